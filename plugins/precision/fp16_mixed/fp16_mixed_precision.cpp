// Built-in precision `16-mixed`: Lightning's MixedPrecision("16-mixed") with torch.amp.GradScaler.
// Parameters and optimizer state stay float32; the forward pass runs under float16 autocast and
// the loss is multiplied by a dynamic scale before backward. Before the optimizer step (and before
// on_before_optimizer_step callbacks and clipping) the gradients are unscaled once; a step whose
// gradients hold inf/NaN is skipped and the scale backs off, and after `growth_interval` good
// steps in a row it grows.
//
// The scaler is ATen's AMP kernels (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_;
// CUDA and the CPU have them, as torch.amp.GradScaler uses them on both).
// Where the Trainer steps an Adam/AdamW itself (device_found_inf), nothing waits for the host: the
// fused optimizer kernels skip a step on the inf flag and the scale is updated on the device;
// otherwise optimizer_step reads the flag once per step, as GradScaler.step does.
// CPU: like Lightning, which switches 16-mixed to bf16 on CPU, the forward pass autocasts to
// bfloat16 (with a warning); the loss scaler stays on (harmless with bf16's range, and it keeps
// the scaler's behaviour testable without a GPU).
#include "../common/mixed_precision.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace {

namespace ps = fulgur::mixed_precision;

class Fp16MixedPrecision final
    : public fulgur::WithExtensions<fulgur::Precision, fulgur::DeviceStepPrecision, fulgur::ClosureStepPrecision> {
 public:
  // Lightning refuses LBFGS under 16-mixed too ("Native AMP and the LBFGS optimizer are not
  // compatible"): one step re-evaluates the loss many times, each evaluation would need the same
  // scale, and a step found non-finite could not be skipped part-way through LBFGS's line search.
  std::string closure_step_refusal() const override {
    return "16-mixed scales the loss and skips steps with inf/NaN gradients, which an optimizer that "
           "re-evaluates the loss inside its step (LBFGS) cannot follow; use precision \"32-true\" or "
           "\"bf16-mixed\"";
  }
  bool optimizer_step_with_closure(torch::optim::Optimizer&, const std::function<at::Tensor()>&) override {
    throw config_error(closure_step_refusal());
  }
  FULGUR_OPTIONS(Options, (floating, init_scale, "Initial loss scale", 65536.0),
                 (floating, growth_factor, "Scale multiplier after growth_interval finite steps", 2.0),
                 (floating, backoff_factor, "Scale multiplier after a step with inf/NaN gradients", 0.5),
                 (integer, growth_interval, "Finite steps in a row before the scale grows", 2000));
  explicit Fp16MixedPrecision(const Options& options)
      : init_scale_(options.init_scale),
        growth_factor_(options.growth_factor),
        backoff_factor_(options.backoff_factor),
        growth_interval_(options.growth_interval) {
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
    const bool cuda = device_type_ == c10::DeviceType::CUDA;
    autocast_dtype_ = cuda ? at::kHalf : at::kBFloat16;
    if (!cuda && !warned_fallback_) {
      warned_fallback_ = true;
      fulgur::log::warn(
          fmt::format("16-mixed on {} runs bf16 autocast (float16 autocast is only used on CUDA, as in Lightning); use "
                      "precision = \"bf16-mixed\" to silence this. Loss scaling stays on",
                      c10::DeviceTypeName(device_type_)));
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
    // A sparse gradient (an Embedding with sparse = true) is checked and unscaled through its
    // values, in place, as GradScaler does; the kernel takes dense tensors only.
    for (at::Tensor& grad : grads)
      if (grad.is_sparse()) grad = grad._values();
    if (!grads.empty() && grads.front().device() != scale_.device()) move_state_to(grads.front().device());
    at::Tensor found = at::zeros({}, scale_.options());
    if (!grads.empty()) {
      at::NoGradGuard no_grad;
      const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
      // One kernel launch per device the gradients are on (a model split over devices); the
      // kernel sets its flag to exactly 1, which the fused optimizer kernels compare against.
      std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> by_device;
      for (const at::Tensor& grad : grads) {
        auto it = std::find_if(by_device.begin(), by_device.end(),
                               [&](const auto& entry) { return entry.first == grad.device(); });
        if (it == by_device.end()) it = by_device.insert(by_device.end(), {grad.device(), {}});
        it->second.push_back(grad);
      }
      for (auto& [device, list] : by_device) {
        if (device == scale_.device()) {
          at::_amp_foreach_non_finite_check_and_unscale_(list, found, inv_scale);
          continue;
        }
        at::Tensor flag = at::zeros({}, scale_.options().device(device));
        at::_amp_foreach_non_finite_check_and_unscale_(list, flag, inv_scale.to(device));
        found = at::maximum(found, flag.to(found.device()));
      }
    }
    found_inf_[&optimizer] = found;
  }

  void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    if (clip_value <= 0.0) return;
    unscale_gradients(optimizer);  // clipping acts on true gradients; a no-op if already unscaled
    fulgur::clip_gradients_of(optimizer, clip_value, algorithm);
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
      fulgur::log::info(
          fmt::format("precision '16-mixed': the checkpoint has no loss-scaler state (saved without loss scaling); "
                      "starting from init_scale {}",
                      init_scale_));
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

  // GradScaler.update through _amp_update_scale_ (on the scale's device): inf/NaN -> scale *=
  // backoff, tracker = 0; else tracker += 1 and on reaching growth_interval scale *= growth (only
  // if that stays finite), tracker = 0.
  void update_scale(const at::Tensor& found_inf) {
    at::NoGradGuard no_grad;
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf.to(scale_.device()), growth_factor_, backoff_factor_,
                           growth_interval_);
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
  bool warned_fallback_ = false;
  ps::AutocastState autocast_;
};

}  // namespace

FULGUR_PLUGIN(Fp16MixedPrecision, "16-mixed", "0.1.0",
              "float32 parameters, float16 autocast and dynamic loss scaling (CUDA; bf16 autocast on CPU)")
