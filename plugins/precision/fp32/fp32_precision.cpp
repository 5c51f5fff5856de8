// Built-in precision `32-true`: float32 parameters and compute, libtorch's default. Every function
// is the Precision default (identity on the forward path, so the default costs nothing per step).
#include "../common/mixed_precision.h"

namespace {

namespace ps = fulgur::mixed_precision;

class Fp32Precision final
    : public fulgur::WithExtensions<fulgur::Precision, fulgur::DeviceStepPrecision, ps::PlainClosureStep> {
 public:
  // A checkpoint from a run with loss scaling (16-mixed) resumed in fp32: the scaler has no
  // meaning here, which is not an error, but the user should know it is dropped.
  void load_state_dict(const c10::IValue& state) override { ps::load_stateless("32-true", state); }

  // Nothing on the step's path decides on the host: a captured step needs no change here.
  std::string step_capture_refusal() const override { return {}; }
  // Never skips a step and decides nothing on the host: steps may be captured (DeviceStepPrecision).
  at::Tensor device_found_inf(torch::optim::Optimizer&) override { return {}; }
  void update_after_device_step(torch::optim::Optimizer&, const at::Tensor&) override {}
};

}  // namespace

FULGUR_PLUGIN(Fp32Precision, "32-true", "0.1.0", "float32 parameters and compute (libtorch's default)")
