// Built-in precision `bf16-mixed`: Lightning's MixedPrecision("bf16-mixed"). Parameters and
// optimizer state stay float32; the forward pass runs under autocast to bfloat16 on the device
// the module lives on (CPU or CUDA, read at convert_module). No loss scaling: bfloat16 has
// float32's exponent range. Loss, gradients, clipping and the step are the Precision defaults.
#include "../common/mixed_precision.h"

namespace {

namespace ps = fulgur::mixed_precision;

class Bf16MixedPrecision final
    : public fulgur::WithExtensions<fulgur::Precision, fulgur::DeviceStepPrecision, ps::PlainClosureStep> {
 public:
  void convert_module(torch::nn::Module& module) override { device_type_ = ps::device_type_of(module); }
  void forward_enter() override { autocast_.enter(device_type_, at::kBFloat16); }
  void forward_exit() override { autocast_.exit(); }
  c10::ScalarType compute_dtype() const override { return at::kBFloat16; }
  // Autocast and unscaled gradients: nothing decided on the host, so a step can be captured.
  std::string step_capture_refusal() const override { return {}; }
  // Never skips a step and decides nothing on the host: steps may be captured (DeviceStepPrecision).
  at::Tensor device_found_inf(torch::optim::Optimizer&) override { return {}; }
  void update_after_device_step(torch::optim::Optimizer&, const at::Tensor&) override {}

  void load_state_dict(const c10::IValue& state) override { ps::load_stateless("bf16-mixed", state); }

 private:
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  ps::AutocastState autocast_;
};

}  // namespace

FULGUR_PLUGIN(Bf16MixedPrecision, "bf16-mixed", "0.1.0",
              "float32 parameters, bfloat16 autocast in the forward pass (CPU or CUDA)")
