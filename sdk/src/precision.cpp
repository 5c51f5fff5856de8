// Precision's identity defaults: full precision, no loss scaling, torch's gradient clipping and a
// plain optimizer step, so a precision plugin overrides only what it changes.
#include <fulgur/error.h>
#include <fulgur/log.h>
#include <fulgur/precision.h>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace fulgur {

void clip_gradients_of(torch::optim::Optimizer& optimizer, double clip_value, GradClipAlgorithm algorithm) {
  if (clip_value <= 0.0) return;
  // Parameters without a gradient (frozen, or unused in this step) are skipped, as
  // torch.nn.utils.clip_grad_* do.
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (const at::Tensor& param : group.params())
      if (param.grad().defined()) grads.push_back(param.grad());
  if (grads.empty()) return;
  at::NoGradGuard no_grad;
  if (algorithm == GradClipAlgorithm::value) {
    for (at::Tensor& grad : grads) grad.clamp_(-clip_value, clip_value);
    return;
  }
  // clip_grad_norm_ (L2, error_if_nonfinite = false) without its final .item(), so no step waits
  // for the host: total = ||(||g_i||)||, g_i *= min(1, max / (total + 1e-6)).
  const c10::Device device = grads.front().device();
  std::vector<at::Tensor> norms;
  norms.reserve(grads.size());
  for (const at::Tensor& grad : grads) norms.push_back(grad.norm(2).to(device));
  const at::Tensor total = norms.size() == 1 ? norms.front() : at::stack(norms).norm(2);
  const at::Tensor coefficient = (clip_value / (total + 1e-6)).clamp_max(1.0);
  for (at::Tensor& grad : grads) grad.mul_(grad.device() == device ? coefficient : coefficient.to(grad.device()));
}

void Precision::convert_module(torch::nn::Module&) {}
void Precision::convert_input(Batch&) {}
void Precision::forward_enter() {}
void Precision::forward_exit() {}
at::Tensor Precision::scale_loss(const at::Tensor& loss) { return loss; }
void Precision::unscale_gradients(torch::optim::Optimizer&) {}

void Precision::clip_gradients(torch::optim::Optimizer& optimizer, double clip_value, GradClipAlgorithm algorithm) {
  clip_gradients_of(optimizer, clip_value, algorithm);
}

bool Precision::optimizer_step(torch::optim::Optimizer& optimizer) {
  optimizer.step();
  return true;
}

void Precision::state_dict(c10::IValue& out) const {
  out = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

void Precision::load_state_dict(const c10::IValue& state) {
  if (state.isNone()) return;
  if (!state.isGenericDict())
    throw Error(ErrorKind::checkpoint,
                fmt::format("the checkpoint's precision state is a {}, expected a dict", state.tagKind()));
  const c10::impl::GenericDict dict = state.toGenericDict();
  if (dict.empty()) return;
  // A scaler state from a run with loss scaling, resumed without it: not an error, but say so.
  std::vector<std::string> keys;
  for (const auto& entry : dict) keys.push_back(entry.key().isString() ? entry.key().toStringRef() : "?");
  log::warn(
      fmt::format("the precision plugin ignores the precision state in the checkpoint (keys: {}); it was "
                  "saved by another precision plugin",
                  fmt::join(keys, ", ")));
}

}  // namespace fulgur
