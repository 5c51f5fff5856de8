// Built-in precision `16-mixed`: Lightning's MixedPrecision("16-mixed") with torch.amp.GradScaler.
// Parameters and optimizer state stay float32; the forward pass runs under float16 autocast and
// the loss is multiplied by a dynamic scale before backward. Before the optimizer step (and before
// on_before_optimizer_step callbacks and clipping) the gradients are unscaled once; a step whose
// gradients hold inf/NaN is skipped and the scale backs off, and after `growth_interval` good
// steps in a row it grows.
//
// On CUDA the scaler uses ATen's AMP kernels (_amp_foreach_non_finite_check_and_unscale_,
// _amp_update_scale_). Elsewhere it uses the same arithmetic written with ordinary tensor ops.
// Where the Trainer steps an Adam/AdamW itself (device_found_inf), nothing waits for the host: the
// fused optimizer kernels skip a step on the inf flag and the scale is updated on the device;
// otherwise optimizer_step reads the flag once per step, as GradScaler.step does.
// CPU: like Lightning, which switches 16-mixed to bf16 on CPU, the forward pass autocasts to
// bfloat16 (with a warning); the loss scaler stays on (harmless with bf16's range, and it keeps
// the scaler's behaviour testable without a GPU).
#include "../common/precision_support.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>
#include <map>

namespace {

namespace ps = fulgur::precision_support;

class Fp16MixedPrecision final : public fulgur::Precision {
 public:
  explicit Fp16MixedPrecision(const fulgur::Options& options)
      : init_scale_(options.get_float("init_scale")),
        growth_factor_(options.get_float("growth_factor")),
        backoff_factor_(options.get_float("backoff_factor")),
        growth_interval_(options.get_int("growth_interval")) {
    if (!(init_scale_ > 0.0) || !std::isfinite(init_scale_))
      throw config_error(fmt::format("init_scale must be a finite number > 0, got {}", init_scale_));
    if (!(growth_factor_ > 1.0) || !std::isfinite(growth_factor_))
      throw config_error(fmt::format("growth_factor must be > 1, got {}", growth_factor_));
    if (!(backoff_factor_ > 0.0 && backoff_factor_ < 1.0))
      throw config_error(fmt::format("backoff_factor must be in (0, 1), got {}", backoff_factor_));
    if (growth_interval_ < 1) throw config_error(fmt::format("growth_interval must be >= 1, got {}", growth_interval_));
    scale_ = at::scalar_tensor(init_scale_, at::TensorOptions().dtype(at::kFloat));
    growth_tracker_ = at::scalar_tensor(0, at::TensorOptions().dtype(at::kInt));
  }

  void convert_module(torch::nn::Module& module) override {
    found_inf_.clear();  // a fit that failed mid-step must not leave its unscale to the next one
    const c10::Device device = ps::device_of(module);
    device_type_ = device.type();
    use_amp_kernels_ = device_type_ == c10::DeviceType::CUDA;
    autocast_dtype_ = use_amp_kernels_ ? at::kHalf : at::kBFloat16;
    if (!use_amp_kernels_ && !warned_fallback_) {
      warned_fallback_ = true;
      spdlog::warn(
          "16-mixed on {} runs bf16 autocast (float16 autocast is only used on CUDA, as in Lightning); use "
          "precision = \"bf16-mixed\" to silence this. Loss scaling stays on with the generic scaler",
          c10::DeviceTypeName(device_type_));
    }
    move_state_to(device);
  }

  void convert_input(fulgur::Batch&) override {}
  void forward_enter() override { autocast_.enter(device_type_, autocast_dtype_); }
  void forward_exit() override { autocast_.exit(); }

  at::Tensor scale_loss(const at::Tensor& loss) override {
    if (!loss.defined()) return loss;
    if (scale_.device() != loss.device()) move_state_to(loss.device());
    return loss * scale_;
  }

  // GradScaler.unscale_: once per optimizer per step; later calls in the same step do nothing.
  void unscale_gradients(torch::optim::Optimizer& optimizer) override {
    if (found_inf_.count(&optimizer)) return;
    std::vector<at::Tensor> grads = ps::gradients_of(optimizer);
    if (!grads.empty() && grads.front().device() != scale_.device()) move_state_to(grads.front().device());
    at::Tensor found = at::zeros({}, scale_.options());
    if (!grads.empty()) {
      at::NoGradGuard no_grad;
      const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
      if (use_amp_kernels_ && kernel_ready(grads)) {
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale);
      } else {
        std::vector<at::Tensor> flags;
        flags.reserve(grads.size());
        for (at::Tensor& grad : grads) {
          flags.push_back(at::logical_not(at::isfinite(grad)).any().to(scale_.device()));
          grad.mul_(grad.device() == inv_scale.device() ? inv_scale : inv_scale.to(grad.device()));
        }
        found = at::stack(flags).any().to(at::kFloat);
      }
    }
    found_inf_[&optimizer] = found;
  }

  void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    if (clip_value <= 0.0) return;
    unscale_gradients(optimizer);  // clipping acts on true gradients; a no-op if already unscaled
    ps::clip_gradients(optimizer, clip_value, algorithm);
  }

  // GradScaler.step + update: skip the step when the gradients are not finite, then adjust the scale.
  bool optimizer_step(torch::optim::Optimizer& optimizer) override {
    unscale_gradients(optimizer);
    const at::Tensor found = found_inf_.at(&optimizer);
    found_inf_.erase(&optimizer);
    const bool skip = found.item<double>() != 0.0;  // one host sync per step, as GradScaler.step
    if (!skip) optimizer.step();
    update_scale(found);
    return !skip;
  }

  // The same decision without the host: the Trainer's fused Adam/AdamW step reads the flag on the
  // device (Python's GradScaler hands found_inf to a fused optimizer in the same way).
  at::Tensor device_found_inf(torch::optim::Optimizer& optimizer) override {
    unscale_gradients(optimizer);
    return found_inf_.at(&optimizer);
  }
  void update_after_device_step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf) override {
    found_inf_.erase(&optimizer);
    if (found_inf.defined()) update_scale(found_inf);  // undefined: an abandoned step
  }

  c10::ScalarType compute_dtype() const override { return autocast_dtype_; }
  // Capturable: unscale, the inf/NaN check and the scale update are device work, and the step is
  // skipped on the device through device_found_inf.
  std::string step_capture_refusal() const override { return {}; }

  void state_dict(c10::IValue& out) const override {
    c10::impl::GenericDict dict = ps::empty_state();
    dict.insert("scale", scale_.item<double>());
    dict.insert("growth_tracker", static_cast<int64_t>(growth_tracker_.item<int>()));
    out = dict;
  }

  void load_state_dict(const c10::IValue& state) override {
    if (state.isNone()) return;
    if (!state.isGenericDict())
      throw checkpoint_error(fmt::format("the checkpoint's precision state is a {}, expected a dict", state.tagKind()));
    const c10::impl::GenericDict dict = state.toGenericDict();
    if (dict.empty()) {
      spdlog::info(
          "precision '16-mixed': the checkpoint has no loss-scaler state (saved without loss scaling); "
          "starting from init_scale {}",
          init_scale_);
      return;
    }
    if (!dict.contains("scale") || !dict.contains("growth_tracker"))
      throw checkpoint_error("the precision state needs the keys 'scale' and 'growth_tracker'");
    const c10::IValue scale = dict.at("scale");
    const c10::IValue tracker = dict.at("growth_tracker");
    if (!(scale.isDouble() || scale.isInt()))
      throw checkpoint_error(fmt::format("'scale' is a {}, expected a number", scale.tagKind()));
    if (!tracker.isInt())
      throw checkpoint_error(fmt::format("'growth_tracker' is a {}, expected an int", tracker.tagKind()));
    const double scale_value = scale.isDouble() ? scale.toDouble() : static_cast<double>(scale.toInt());
    if (!(scale_value > 0.0) || !std::isfinite(scale_value))
      throw checkpoint_error(fmt::format("'scale' must be a finite number > 0, got {}", scale_value));
    if (tracker.toInt() < 0)
      throw checkpoint_error(fmt::format("'growth_tracker' must be >= 0, got {}", tracker.toInt()));
    scale_.fill_(scale_value);
    growth_tracker_.fill_(tracker.toInt());
  }

 private:
  static fulgur::Error config_error(const std::string& message) {
    return fulgur::Error(fulgur::ErrorKind::config, "precision '16-mixed': " + message);
  }
  static fulgur::Error checkpoint_error(const std::string& message) {
    return fulgur::Error(fulgur::ErrorKind::checkpoint, "precision '16-mixed': " + message);
  }

  void move_state_to(c10::Device device) {
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
  }

  // The fused kernel wants every gradient dense and on the scaler's device.
  bool kernel_ready(const std::vector<at::Tensor>& grads) const {
    for (const at::Tensor& grad : grads)
      if (grad.device() != scale_.device() || grad.is_sparse()) return false;
    return true;
  }

  // _amp_update_scale_'s rule: inf/NaN -> scale *= backoff, tracker = 0; else tracker += 1 and on
  // reaching growth_interval scale *= growth (only if that stays finite), tracker = 0.
  void update_scale(const at::Tensor& found_inf) {
    at::NoGradGuard no_grad;
    const at::Tensor found = found_inf.to(scale_.device());
    if (use_amp_kernels_ && scale_.is_cuda()) {
      at::_amp_update_scale_(scale_, growth_tracker_, found, growth_factor_, backoff_factor_, growth_interval_);
      return;
    }
    const at::Tensor bad = found.ne(0);
    const at::Tensor successful = growth_tracker_ + 1;
    const at::Tensor grow = successful.ge(growth_interval_);
    const at::Tensor grown = scale_ * growth_factor_;
    const at::Tensor kept_or_grown = at::where(grow.logical_and(at::isfinite(grown)), grown, scale_);
    const at::Tensor new_scale = at::where(bad, scale_ * backoff_factor_, kept_or_grown);
    const at::Tensor new_tracker = at::where(bad.logical_or(grow), at::zeros_like(successful), successful);
    scale_.copy_(new_scale);
    growth_tracker_.copy_(new_tracker);
  }

  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  at::Tensor scale_;           // 0-dim float32, on the gradients' device
  at::Tensor growth_tracker_;  // 0-dim int32: good steps in a row since the last change
  std::map<const torch::optim::Optimizer*, at::Tensor> found_inf_;  // set by unscale, used by the step
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  at::ScalarType autocast_dtype_ = at::kBFloat16;
  bool use_amp_kernels_ = false;
  bool warned_fallback_ = false;
  ps::AutocastState autocast_;
};

}  // namespace

FULGUR_PLUGIN(Fp16MixedPrecision, "16-mixed", "0.1.0",
              "float32 parameters, float16 autocast and dynamic loss scaling (CUDA; bf16 autocast on CPU)",
              FULGUR_OPTION(floating, init_scale, "Initial loss scale", 65536.0),
              FULGUR_OPTION(floating, growth_factor, "Scale multiplier after growth_interval finite steps", 2.0),
              FULGUR_OPTION(floating, backoff_factor, "Scale multiplier after a step with inf/NaN gradients", 0.5),
              FULGUR_OPTION(integer, growth_interval, "Finite steps in a row before the scale grows", 2000))
