// Precision: numeric format of parameters and compute, loss scaling and gradient clipping.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

namespace fulgur {

class FULGUR_SDK_API Precision {
 public:
  virtual ~Precision();

  // Converts parameters/buffers once at setup (true modes) or leaves them (mixed modes). Runs with
  // the module on the strategy's root device, before Strategy::setup_module (which then shards or
  // wraps the converted parameters).
  virtual void convert_module(torch::nn::Module& module) = 0;
  // Converts floating-point inputs of a batch (true modes); identity for mixed modes.
  virtual void convert_input(Batch& batch) = 0;
  // Enters/leaves the forward-pass numeric context (autocast). Use PrecisionScope, not these.
  virtual void forward_enter() = 0;
  virtual void forward_exit() = 0;
  // Returns the loss to call backward() on (scaled for 16-mixed).
  virtual at::Tensor scale_loss(const at::Tensor& loss) = 0;
  // Brings gradients back to their true values (idempotent per step); called before
  // on_before_optimizer_step callbacks and before clipping.
  virtual void unscale_gradients(torch::optim::Optimizer& optimizer) = 0;
  virtual void clip_gradients(torch::optim::Optimizer& optimizer, double clip_value, GradClipAlgorithm algorithm) = 0;
  // Steps the optimizer unless gradients are not finite; returns whether it stepped.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer) = 0;
  // Steps decided on the device, without a host synchronisation (16-mixed): after
  // unscale_gradients(optimizer), a 0-dim float32 tensor on the gradients' device that holds 1
  // when this step must be skipped (inf/NaN gradients) and 0 when it is taken; an undefined tensor
  // (the default) where the precision never skips or decides on the host. When it is defined and
  // the Trainer can step the optimizer with fused kernels that read it (one Adam/AdamW under
  // automatic optimization, a strategy that delegates_optimizer_step), the Trainer takes the step
  // itself instead of calling optimizer_step, then calls update_after_device_step.
  virtual at::Tensor device_found_inf(torch::optim::Optimizer& optimizer);
  // Ends a step decided by device_found_inf: updates the loss scale on the device and forgets this
  // step's unscale. With an undefined `found_inf` the step was abandoned (a capture that failed
  // part-way): forget the unscale, change nothing else. Default: nothing.
  virtual void update_after_device_step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf);
  // Scaler state for checkpoints (an empty dict when stateless).
  virtual void state_dict(c10::IValue& out) const = 0;
  virtual void load_state_dict(const c10::IValue& state) = 0;
  // The dtype matrix multiplications run in (bf16 under bf16-mixed), which selects the device's
  // peak FLOP/s for MFU. Default: float32.
  virtual c10::ScalarType compute_dtype() const;
  // Why a training step under this precision cannot be recorded as a StepGraph (for example, a
  // step skipped or taken by a decision on the host), or "" when it can: the step is then
  // forward under forward_enter/exit, backward of scale_loss(loss), unscale_gradients and
  // clipping through clip_gradients, with the optimizer stepped by the Trainer's capturable step
  // (which skips where device_found_inf says so, then calls update_after_device_step), not by
  // optimizer_step. Default: a refusal, so a plugin opts in knowingly.
  virtual std::string step_capture_refusal() const;
};

// RAII forward context: `{ PrecisionScope scope(precision); out = model->forward(x); }`.
class PrecisionScope {
 public:
  explicit PrecisionScope(Precision& precision) : precision_(precision) { precision_.forward_enter(); }
  ~PrecisionScope() { precision_.forward_exit(); }
  PrecisionScope(const PrecisionScope&) = delete;
  PrecisionScope& operator=(const PrecisionScope&) = delete;

 private:
  Precision& precision_;
};

}  // namespace fulgur
