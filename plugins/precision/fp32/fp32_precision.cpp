// Built-in precision `32-true`: float32 parameters and compute, libtorch's default. Everything on
// the forward path is a no-op so that the default costs nothing per step.
#include <fulgur/plugin.h>

#include <ATen/TensorOperators.h>
#include <ATen/core/Dict.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <ATen/ops/stack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace {

// Gradients of every parameter the optimizer updates; parameters without a gradient (frozen, or
// unused in this step) are skipped, as torch.nn.utils.clip_grad_* do.
std::vector<at::Tensor> gradients_of(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (const at::Tensor& param : group.params())
      if (param.grad().defined()) grads.push_back(param.grad());
  return grads;
}

class Fp32Precision final : public fulgur::Precision {
 public:
  void convert_module(torch::nn::Module&) override {}
  void convert_input(fulgur::Batch&) override {}
  void forward_enter() override {}
  void forward_exit() override {}
  at::Tensor scale_loss(const at::Tensor& loss) override { return loss; }
  void unscale_gradients(torch::optim::Optimizer&) override {}

  void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    // Lightning: a clip value of 0 (or less) means "no clipping".
    if (clip_value <= 0.0) return;
    std::vector<at::Tensor> grads = gradients_of(optimizer);
    if (grads.empty()) return;
    at::NoGradGuard no_grad;
    if (algorithm == fulgur::GradClipAlgorithm::value) {
      for (at::Tensor& grad : grads) grad.clamp_(-clip_value, clip_value);
      return;
    }
    clip_by_total_norm(grads, clip_value);
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer) override {
    optimizer.step();
    return true;
  }

  void state_dict(c10::IValue& out) const override {
    out = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    if (!state.isGenericDict())
      throw fulgur::Error(fulgur::ErrorKind::checkpoint,
                          fmt::format("precision '32-true': the checkpoint's precision state is a {}, expected a dict",
                                      state.tagKind()));
    const c10::impl::GenericDict dict = state.toGenericDict();
    if (dict.empty()) return;
    // A checkpoint from a run with loss scaling (16-mixed) resumed in fp32: the scaler has no
    // meaning here, which is not an error, but the user should know it is dropped.
    std::vector<std::string> keys;
    for (const auto& entry : dict) keys.push_back(entry.key().isString() ? entry.key().toStringRef() : "?");
    spdlog::warn(
        "precision '32-true' ignores the precision state in the checkpoint (keys: {}); it was saved by "
        "another precision plugin",
        fmt::join(keys, ", "));
  }

 private:
  // torch::nn::utils::clip_grad_norm_ (L2, error_if_nonfinite = false) without its final
  // .item(): that would synchronise host and device on every step only to return a number
  // nobody reads here. Same arithmetic: total = ||(||g_i||)||, g_i *= min(1, max / (total + 1e-6)).
  static void clip_by_total_norm(std::vector<at::Tensor>& grads, double max_norm) {
    const c10::Device device = grads.front().device();
    std::vector<at::Tensor> norms;
    norms.reserve(grads.size());
    for (const at::Tensor& grad : grads) norms.push_back(grad.norm(2).to(device));
    const at::Tensor total = norms.size() == 1 ? norms.front() : at::stack(norms).norm(2);
    const at::Tensor coefficient = (max_norm / (total + 1e-6)).clamp_max(1.0);
    for (at::Tensor& grad : grads) grad.mul_(grad.device() == device ? coefficient : coefficient.to(grad.device()));
  }
};

}  // namespace

FULGUR_PLUGIN(Fp32Precision, "32-true", "0.1.0", "float32 parameters and compute (libtorch's default)")
