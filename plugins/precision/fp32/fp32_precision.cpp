// Built-in precision `32-true`: float32 parameters and compute, libtorch's default. Everything on
// the forward path is a no-op so that the default costs nothing per step.
#include "../common/precision_support.h"

namespace {

namespace ps = fulgur::precision_support;

class Fp32Precision final : public fulgur::Precision {
 public:
  void convert_module(torch::nn::Module&) override {}
  void convert_input(fulgur::Batch&) override {}
  void forward_enter() override {}
  void forward_exit() override {}
  at::Tensor scale_loss(const at::Tensor& loss) override { return loss; }
  void unscale_gradients(torch::optim::Optimizer&) override {}

  // Lightning's clip_gradients; a clip value of 0 (or less) means "no clipping".
  void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    ps::clip_gradients(optimizer, clip_value, algorithm);
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer) override {
    optimizer.step();
    return true;
  }
  // Nothing on the step's path decides on the host: a captured step needs no change here.
  std::string step_capture_refusal() const override { return {}; }

  void state_dict(c10::IValue& out) const override { out = ps::empty_state(); }
  // A checkpoint from a run with loss scaling (16-mixed) resumed in fp32: the scaler has no
  // meaning here, which is not an error, but the user is told it is dropped.
  void load_state_dict(const c10::IValue& state) override { ps::load_stateless("32-true", state); }
};

}  // namespace

FULGUR_PLUGIN(Fp32Precision, "32-true", "0.1.0", "float32 parameters and compute (libtorch's default)")
