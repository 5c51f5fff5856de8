// Built-in precision `fp8`: FP8 training of the model's linear layers (torchao's Float8Linear
// recipes, fulgur/nn/float8.h) inside bf16 autocast for everything else. Parameters, gradients and
// optimizer state stay float32; each chosen fulgur::nn::Linear quantizes its operands to FP8 (e4m3
// forward, e5m2 gradients) with dynamic scales right before each of its three products. Layers
// declared as torch::nn::Linear, and layers whose sizes are not multiples of 16, stay in bf16.
// Scaling is dynamic, so there is no state to checkpoint; the loss is not scaled (e5m2's range
// and per-tensor scales cover the gradients).
#include "../common/mixed_precision.h"

#include <fulgur/nn/float8.h>
#include <fulgur/nn/linear.h>

#include <string>
#include <vector>

namespace {

namespace ps = fulgur::mixed_precision;
using fulgur::nn::Float8Options;
using fulgur::nn::Float8Scaling;

class Fp8Precision final : public fulgur::WithExtensions<fulgur::Precision, ps::PlainClosureStep> {
 public:
  FULGUR_OPTIONS(
      Options, (string, scaling, "\"tensorwise\" (one scale per tensor) or \"rowwise\" (per row)", "tensorwise"),
      (string, filter,
       "ECMAScript regex on layer names: only matching fulgur::nn::Linear layers train in FP8 (e.g. "
       "\"^(?!head)\" keeps the output layer in bf16); empty: all",
       ""),
      (string, backend,
       "\"auto\" (at::_scaled_mm on CUDA, emulated on the CPU), \"scaled_mm\" (the kernel everywhere) or \"emulated\"",
       "auto"),
      (boolean, autocast, "bf16 autocast for the rest of the model (false: float32 outside FP8 layers)", true));

  explicit Fp8Precision(const Options& options)
      : float8_(Float8Options(fulgur::nn::float8_scaling_from_string(options.scaling))
                    .backend(fulgur::nn::float8_backend_from_string(options.backend))),
        filter_(options.filter),
        autocast_enabled_(options.autocast) {
    if (float8_.scaling() == Float8Scaling::none)
      throw config_error("scaling \"none\" turns FP8 off: choose precision \"bf16-mixed\" instead");
    // Compile the filter now, so a bad regex fails at start-up rather than at the first stage.
    torch::nn::Module probe;
    fulgur::nn::convert_to_float8_training(probe, float8_, filter_);
  }

  // Called for every block a sharded strategy builds and then for the whole model (turning FP8 on
  // is idempotent): the last call's names are the whole model's, reported at the first step.
  void convert_module(torch::nn::Module& module) override {
    device_type_ = ps::device_type_of(module);
    converted_ = fulgur::nn::convert_to_float8_training(module, float8_, filter_);
    left_out_.clear();
    for (const auto& item : module.named_modules("", /*include_self=*/false)) {
      auto* linear = item.value()->as<fulgur::nn::Linear>();
      if (linear && linear->float8_options().scaling() == Float8Scaling::none) left_out_.push_back(item.key());
    }
  }

  void forward_enter() override {
    if (!reported_) report();
    if (autocast_enabled_) autocast_.enter(device_type_, at::kBFloat16);
  }
  void forward_exit() override {
    if (autocast_enabled_) autocast_.exit();
  }
  c10::ScalarType compute_dtype() const override { return at::kFloat8_e4m3fn; }
  void load_state_dict(const c10::IValue& state) override { ps::load_stateless("fp8", state); }

 private:
  // At the first step, once every block has been converted: which layers train in FP8, and a
  // clear error when none does (the model declares torch::nn::Linear, or the filter matches none).
  void report() {
    reported_ = true;
    if (converted_.empty())
      throw config_error(fmt::format(
          "no layer trains in FP8: the model has no fulgur::nn::Linear layer{} with both sizes multiples of 16. "
          "Declare linear layers as fulgur::nn::Linear (fulgur/nn/linear.h; same parameters as torch::nn::Linear), "
          "or choose precision \"bf16-mixed\"",
          filter_.empty() ? "" : fmt::format(" matching filter '{}'", filter_)));
    fulgur::log::info(fmt::format(
        "fp8: {} linear layers train in FP8 ({} scaling{}): {}{}", converted_.size(),
        fulgur::nn::to_string(float8_.scaling()),
        float8_.backend() == fulgur::nn::Float8Backend::automatic
            ? std::string()
            : ", backend " + fulgur::nn::to_string(float8_.backend()),
        fmt::join(converted_, ", "),
        left_out_.empty()
            ? std::string()
            : fmt::format("; left in {}: {}", autocast_enabled_ ? "bf16" : "float32", fmt::join(left_out_, ", "))));
  }

  fulgur::Error config_error(const std::string& message) const {
    return fulgur::Error(fulgur::ErrorKind::config, fmt::format("precision 'fp8': {}", message));
  }

  Float8Options float8_;
  std::string filter_;
  bool autocast_enabled_;
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  ps::AutocastState autocast_;
  std::vector<std::string> converted_;
  std::vector<std::string> left_out_;
  bool reported_ = false;
};

}  // namespace

FULGUR_PLUGIN(Fp8Precision, "fp8", "0.1.0",
              "FP8 training of fulgur::nn::Linear layers (e4m3 forward, e5m2 gradients, dynamic tensorwise or rowwise "
              "scales), bf16 autocast elsewhere, float32 master weights")
