// Built-in precision `bf16-mixed`: Lightning's MixedPrecision("bf16-mixed"). Parameters and
// optimizer state stay float32; the forward pass runs under autocast to bfloat16 on the device
// the module lives on (CPU or CUDA, read at convert_module). No loss scaling: bfloat16 has
// float32's exponent range.
#include "../common/precision_support.h"

namespace {

namespace ps = fulgur::precision_support;

class Bf16MixedPrecision final : public fulgur::Precision {
 public:
  void convert_module(torch::nn::Module& module) override { device_type_ = ps::device_type_of(module); }
  void convert_input(fulgur::Batch&) override {}
  void forward_enter() override { autocast_.enter(device_type_, at::kBFloat16); }
  void forward_exit() override { autocast_.exit(); }
  at::Tensor scale_loss(const at::Tensor& loss) override { return loss; }
  void unscale_gradients(torch::optim::Optimizer&) override {}

  void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    ps::clip_gradients(optimizer, clip_value, algorithm);
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer) override {
    optimizer.step();
    return true;
  }
  c10::ScalarType compute_dtype() const override { return at::kBFloat16; }
  // Autocast and unscaled gradients: nothing decided on the host, so a step can be captured.
  std::string step_capture_refusal() const override { return {}; }

  void state_dict(c10::IValue& out) const override { out = ps::empty_state(); }
  void load_state_dict(const c10::IValue& state) override { ps::load_stateless("bf16-mixed", state); }

 private:
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  ps::AutocastState autocast_;
};

}  // namespace

FULGUR_PLUGIN(Bf16MixedPrecision, "bf16-mixed", "0.1.0",
              "float32 parameters, bfloat16 autocast in the forward pass (CPU or CUDA)")
