/// @file
/// Precision: numeric format of parameters and compute, loss scaling and gradient clipping.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

namespace fulgur {

/// The numeric format of a run (fp32, bf16-mixed, 16-mixed, true dtypes). Created when the Trainer
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
  virtual void convert_module(torch::nn::Module& module) = 0;
  /// Converts floating-point inputs of a batch (true modes); identity for mixed modes. Called once
  /// per batch of every stage, after the Module's transfer hooks (the batch is on the device).
  virtual void convert_input(Batch& batch) = 0;
  /// Enters the forward-pass numeric context (autocast). Called right before each
  /// training/validation/test/predict step; use PrecisionScope, not this.
  virtual void forward_enter() = 0;
  /// Leaves what forward_enter entered, right after the step, also when it threw. Must not throw
  /// (PrecisionScope calls it from its destructor).
  virtual void forward_exit() = 0;
  /// Returns the loss to call backward() on (scaled for 16-mixed). Called by Strategy::backward,
  /// once per backward.
  virtual at::Tensor scale_loss(const at::Tensor& loss) = 0;
  /// Brings gradients back to their true values (idempotent per step: a second call before the
  /// step changes nothing). Called once per optimizer step, before the on_before_optimizer_step
  /// hooks and before clipping.
  virtual void unscale_gradients(torch::optim::Optimizer& optimizer) = 0;
  /// Clips the (unscaled) gradients of `optimizer`'s parameters to `clip_value`, by total norm or
  /// by value. Called by Strategy::clip_gradients' default (`[trainer] gradient_clip_val`, or the
  /// Module's clip_gradients).
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value, GradClipAlgorithm algorithm) = 0;
  /// Steps the optimizer unless gradients are not finite; returns whether it stepped. Updates the
  /// loss scale where there is one. Called by Strategy::optimizer_step, once per optimizer step.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer) = 0;
  /// Steps decided on the device, without a host synchronisation (16-mixed): after
  /// unscale_gradients(optimizer), a 0-dim float32 tensor on the gradients' device that holds 1
  /// when this step must be skipped (inf/NaN gradients) and 0 when it is taken; an undefined tensor
  /// (the default) where the precision never skips or decides on the host. When it is defined and
  /// the Trainer can step the optimizer with fused kernels that read it (one Adam/AdamW under
  /// automatic optimization, a strategy that delegates_optimizer_step), the Trainer takes the step
  /// itself instead of calling optimizer_step, then calls update_after_device_step. Asked once per
  /// optimizer step on that path (and inside a captured step, where it must only queue device
  /// work).
  virtual at::Tensor device_found_inf(torch::optim::Optimizer& optimizer);
  /// Ends a step decided by device_found_inf: updates the loss scale on the device and forgets this
  /// step's unscale. With an undefined `found_inf` the step was abandoned (a capture that failed
  /// part-way): forget the unscale, change nothing else. Default: nothing.
  virtual void update_after_device_step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf);
  /// Scaler state for checkpoints, written into `out` (None or an empty dict when stateless: then
  /// nothing is stored). Called on every rank for every full checkpoint.
  virtual void state_dict(c10::IValue& out) const = 0;
  /// Restores what state_dict wrote. Called when fit resumes from a checkpoint that holds a
  /// precision state (after on_fit_start). Throws fulgur::Error(checkpoint) for a state it cannot
  /// read.
  virtual void load_state_dict(const c10::IValue& state) = 0;
  /// The dtype matrix multiplications run in (bf16 under bf16-mixed), which selects the device's
  /// peak FLOP/s for MFU. Reached through TrainerContext::compute_dtype. Default: float32.
  virtual c10::ScalarType compute_dtype() const;
  /// Why a training step under this precision cannot be recorded as a StepGraph (for example, a
  /// step skipped or taken by a decision on the host), or "" when it can: the step is then
  /// forward under forward_enter/exit, backward of scale_loss(loss), unscale_gradients and
  /// clipping through clip_gradients, with the optimizer stepped by the Trainer's capturable step
  /// (which skips where device_found_inf says so, then calls update_after_device_step), not by
  /// optimizer_step. Asked at the start of fit when `[trainer] cuda_graphs` is not "off". Default:
  /// a refusal, so a plugin opts in knowingly.
  virtual std::string step_capture_refusal() const;
};

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
