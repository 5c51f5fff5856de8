// Internal: the optimizer step of a captured training step (`[trainer] cuda_graphs`). libtorch's
// C++ Adam keeps its step count on the host and folds lr and the bias corrections into scalars,
// which a recorded graph would freeze at their capture-time values. This steps the same
// torch::optim::Adam / AdamW (its param groups and its state tensors, in place) with ATen's fused
// kernels, whose step counts and learning rate are device tensors, as Python's
// Adam(fused=True, capturable=True) does. The host step counts are kept equal after every step,
// so checkpoints, and the optimizer's own step() where a batch runs uncaptured, see what they
// would have seen.
//
// It is also the step of a precision that decides on the device whether a step is taken (16-mixed:
// DeviceStepPrecision::device_found_inf), captured or not: the kernels skip on the flag, and the host step
// counts, which only the device knows then, are brought up to date by sync_host_steps() where
// something reads them (a checkpoint, the end of fit, a step by the optimizer's own step()).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class DeviceStepPrecision;

class FusedAdamStep {
 public:
  // Why `optimizer` cannot be stepped here ("" when it can): only Adam and AdamW have fused
  // kernels with device-side step counts.
  static std::string refusal(torch::optim::Optimizer& optimizer);
  // `optimizer` must pass refusal(); it must outlive this object.
  explicit FusedAdamStep(torch::optim::Optimizer& optimizer);
  ~FusedAdamStep();

  // Creates missing state (zeros, step 0, as the optimizer's first step would) and the device
  // step counts from the host ones. Call before the first step() and after anything else stepped
  // the optimizer (its own step(), a checkpoint load). `every_parameter` false: parameters with
  // neither state nor a gradient are left out until they have a gradient (uncaptured steps).
  void sync_from_host(bool every_parameter = true);
  // What precedes every step: sync_from_host() the first time, adopt_replaced_state(), the
  // hyperparameters (`recorded`: a change is refused by check_hyperparameters(); otherwise the
  // groups are read anew) and refresh_lr().
  void before_step(bool recorded);
  // Writes each group's current lr into its device tensor (schedulers change the host value).
  // Queued on the current stream: the next replay reads it.
  void refresh_lr();
  // One step of every parameter that has a gradient: device work only, no host synchronisation.
  // `found_inf` (optional, a 0-dim float32 tensor on the parameters' device): where it holds 1 the
  // kernels leave parameters and state as they are and the step counts do not advance.
  void step(const at::Tensor& found_inf = {});
  // step(found_inf) with the precision's decision (DeviceStepPrecision::device_found_inf, undefined
  // where it has none), then its scale update on the device; a step that throws still ends the
  // precision's step (the unscale is forgotten, so the next step unscales its own gradients).
  // `precision` is null for a precision without the extension (found_inf is then undefined).
  void step_decided_by(DeviceStepPrecision* precision, const at::Tensor& found_inf);
  // Where steps read found_inf, the host step counts are left behind: copies the device counts to
  // the host state objects (one synchronisation). Does nothing when they are current.
  void sync_host_steps();
  // The parameters the last step() stepped are the ones a recorded step steps: call after the
  // step() inside a capture.
  void remember_captured_step() {
    captured_ = last_;
    captured_reads_found_inf_ = last_read_found_inf_;
  }
  // The optimizer's own step() ran: the device state is recorded again before the next step().
  void host_stepped() { synced_ = false; }
  // The host step counts after a step ran: the last step() (eager), or the recorded one (replay).
  // After a step that read found_inf they are provisional (skips counted as steps) until
  // sync_host_steps().
  void advance_host_steps(bool replayed);
  // The tensors a recorded step updates must stay the optimizer's state: where something replaced
  // the state (a checkpoint or a callback loaded it), its values are copied into the recorded
  // tensors and the new state objects are pointed at them. Cheap: one lookup per parameter.
  void adopt_replaced_state();
  // Throws fulgur::Error(config) when a group's betas, eps, weight decay or amsgrad changed since
  // sync_from_host(): a captured step keeps them as recorded (only lr is read at each replay).
  void check_hyperparameters() const;

  struct Group;  // defined in the .cpp: one param group's recorded tensors

 private:
  torch::optim::Optimizer& optimizer_;
  bool decoupled_weight_decay_ = false;  // AdamW
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<void*> last_, captured_;     // Group::Parameter entries stepped
  bool synced_ = false;                    // sync_from_host() ran
  bool host_steps_stale_ = false;          // a step read found_inf since the last sync_host_steps()
  bool announced_found_inf_ = false;       // the debug line that says so was written
  bool last_read_found_inf_ = false;       // the last step() was given a found_inf
  bool captured_reads_found_inf_ = false;  // ... and so was the recorded one
};

}  // namespace fulgur
