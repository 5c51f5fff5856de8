/// @file
/// Precision: numeric format of parameters and compute, loss scaling and gradient clipping.
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <string>
#include <string_view>

namespace fulgur {

/// The numeric format of a run (fp32, bf16-mixed, 16-mixed, true dtypes). Every function has an
/// identity default (full precision, no scaling, torch's clipping), so a precision plugin overrides
/// only what it changes. Created when the Trainer
/// is built and owned by it for its whole life. Every method is called on every rank, from the
/// thread that runs the Trainer's stages (autocast state is per thread); none is a collective. The
/// strategy calls the backward and step methods (scale_loss, clip_gradients, optimizer_step), the
/// Trainer the rest.
class FULGUR_SDK_API Precision {
 public:
  virtual ~Precision();

  /// Converts parameters/buffers once at setup (true modes) or leaves them (mixed modes). Runs with
  /// the module on the strategy's root device, before Strategy::setup_module (which then shards or
  /// wraps the converted parameters), at the start of every stage; under a sharded strategy also
  /// for each block as the Module builds it, then again for the whole model. So it must be
  /// idempotent: converting what is converted already changes nothing.
  /// Default: nothing (parameters keep their dtype).
  virtual void convert_module(torch::nn::Module& module);
  /// Converts floating-point inputs of a batch (true modes); identity for mixed modes. Called once
  /// per batch of every stage, after the Module's transfer hooks (the batch is on the device).
  /// Default: nothing.
  virtual void convert_input(Batch& batch);
  /// Enters the forward-pass numeric context (autocast). Called right before each
  /// training/validation/test/predict step; use PrecisionScope, not this.
  /// Default: nothing.
  virtual void forward_enter();
  /// Leaves what forward_enter entered, right after the step, also when it threw. Must not throw
  /// (PrecisionScope calls it from its destructor).
  /// Default: nothing.
  virtual void forward_exit();
  /// Returns the loss to call backward() on (scaled for 16-mixed). Called by Strategy::backward,
  /// once per backward.
  /// Default: `loss` itself.
  virtual at::Tensor scale_loss(const at::Tensor& loss);
  /// Brings gradients back to their true values (idempotent per step: a second call before the
  /// step changes nothing). Called once per optimizer step, before the on_before_optimizer_step
  /// hooks and before clipping.
  /// Default: nothing (gradients are never scaled).
  virtual void unscale_gradients(torch::optim::Optimizer& optimizer);
  /// Clips the (unscaled) gradients of `optimizer`'s parameters to `clip_value`, by total norm or
  /// by value. Called by Strategy::clip_gradients' default (`[trainer] gradient_clip_val`, or the
  /// Module's clip_gradients).
  /// Default: fulgur::clip_gradients_of (Lightning's clip_gradients).
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value, GradClipAlgorithm algorithm);
  /// Steps the optimizer unless gradients are not finite; returns whether it stepped. Updates the
  /// loss scale where there is one. Called by Strategy::optimizer_step, once per optimizer step.
  /// Default: optimizer.step(), returns true.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer);
  /// Scaler state for checkpoints, written into `out` (None or an empty dict when stateless: then
  /// nothing is stored). Called on every rank for every full checkpoint.
  /// Default: an empty dict (stateless).
  virtual void state_dict(c10::IValue& out) const;
  /// Restores what state_dict wrote. Called when fit resumes from a checkpoint that holds a
  /// precision state (after on_fit_start). Throws fulgur::Error(checkpoint) for a state it cannot
  /// read.
  /// Default: accepts None or an empty dict (what the default state_dict writes); throws
  /// fulgur::Error(checkpoint) for anything else, which another precision wrote.
  virtual void load_state_dict(const c10::IValue& state);
  /// The dtype matrix multiplications run in (bf16 under bf16-mixed), which selects the device's
  /// peak FLOP/s for MFU. Reached through TrainerContext::compute_dtype. Default: float32.
  virtual c10::ScalarType compute_dtype() const;
  /// The extension interface named `id` that this precision implements (DeviceStepPrecision,
  /// ...), or nullptr. Implement it with fulgur::WithExtensions; see fulgur/extension.h. Must not
  /// throw.
  virtual void* extension(std::string_view id) noexcept;
};

/// Extension (SDK 1.0) of a Precision whose optimizer steps can be decided on the device and
/// recorded in a captured step (16-mixed with fused Adam, CUDA graphs). Without it, every step is
/// decided on the host through Precision::optimizer_step and captured steps are refused.
class DeviceStepPrecision {
 public:
  /// The extension's id for Precision::extension().
  static constexpr std::string_view kExtensionId = "fulgur.precision.device_step/1";
  /// Steps decided on the device, without a host synchronisation (16-mixed): after
  /// unscale_gradients(optimizer), a 0-dim float32 tensor on the gradients' device that holds 1
  /// when this step must be skipped (inf/NaN gradients) and 0 when it is taken; an undefined tensor
  /// where the precision never skips a step (fp32, bf16). When it is defined and the Trainer can step the optimizer with fused kernels that read it (one Adam/AdamW under
  /// automatic optimization, a strategy that delegates_optimizer_step), the Trainer takes the step
  /// itself instead of calling optimizer_step, then calls update_after_device_step. Asked once per
  /// optimizer step on that path (and inside a captured step, where it must only queue device
  /// work).
  virtual at::Tensor device_found_inf(torch::optim::Optimizer& optimizer) = 0;
  /// Ends a step decided by device_found_inf: updates the loss scale on the device and forgets this
  /// step's unscale. With an undefined `found_inf` the step was abandoned (a capture that failed
  /// part-way): forget the unscale, change nothing else.
  virtual void update_after_device_step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf) = 0;
  /// Why a training step under this precision cannot be recorded as a StepGraph (for example, a
  /// step skipped or taken by a decision on the host), or "" when it can: the step is then
  /// forward under forward_enter/exit, backward of scale_loss(loss), unscale_gradients and
  /// clipping through clip_gradients, with the optimizer stepped by the Trainer's capturable step
  /// (which skips where device_found_inf says so, then calls update_after_device_step), not by
  /// optimizer_step. Asked at the start of fit when `[trainer] cuda_graphs` is not "off". A
  /// precision without this extension is refused, so a plugin opts in knowingly.
  virtual std::string step_capture_refusal() const = 0;

 protected:
  ~DeviceStepPrecision() = default;
};

/// Lightning's clip_gradients over the gradients of `optimizer`'s parameters, in place: by total
/// 2-norm (torch.nn.utils.clip_grad_norm_, without its host synchronisation) or by value
/// (clip_grad_value_); a `clip_value` of 0 or less does nothing; parameters without a gradient are
/// skipped. Precision::clip_gradients' default; call it from an override after unscaling.
FULGUR_SDK_API void clip_gradients_of(torch::optim::Optimizer& optimizer, double clip_value,
                                      GradClipAlgorithm algorithm);

/// RAII forward context: `{ PrecisionScope scope(precision); out = model->forward(x); }`. Enters on
/// construction, leaves on destruction (also during unwinding). Keeps a reference: `precision` must
/// outlive the scope.
class PrecisionScope {
 public:
  /// Calls precision.forward_enter().
  explicit PrecisionScope(Precision& precision) : precision_(precision) { precision_.forward_enter(); }
  /// Calls forward_exit() on the same precision.
  ~PrecisionScope() { precision_.forward_exit(); }
  PrecisionScope(const PrecisionScope&) = delete;
  PrecisionScope& operator=(const PrecisionScope&) = delete;

 private:
  Precision& precision_;
};

}  // namespace fulgur
