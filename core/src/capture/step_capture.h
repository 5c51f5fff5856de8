// Internal: `[trainer] cuda_graphs` — the automatic-optimization training step recorded once as a
// graph (StepGraphFactory::make_step_graph) and replayed for every later batch, which replaces one
// launch per kernel with one per step. The order of a run:
//
//   prepare()        at fit start: what can be known before training is checked (the accelerator
//                    can capture, one Adam/AdamW optimizer, no accumulation, a strategy and a
//                    precision that opt in, no callback hook inside the step, ...)
//   3 warm-up steps  eager, on the capture stream, with the capturable optimizer step (more when
//                    the next batch is the epoch's last or shaped unlike the one before it)
//   capture          the next step is recorded on static copies of its batch, then replayed
//   replays          each batch is copied into the static buffers and the graph replayed; values
//                    the step logged are logged again from the graph's output tensors
//
// A step that cannot be captured (the capture fails, a batch of another shape, a refusal found
// at prepare()) ends the run under "on" with one line that says why; under "try" it is trained
// uncaptured with one warning. The optimizer's host state (step counts, its state tensors) stays
// what its own step() would have left, so checkpoints and uncaptured steps need nothing special;
// under 16-mixed, whose skips are decided on the device, the step counts are copied back from the
// device where something reads them (TrainerEngine::sync_optimizer_host_state).
#pragma once

#include <fulgur/accelerator.h>
#include <fulgur/trainer.h>
#include <fulgur/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../binding.h"
#include "../resolved_trainer_config.h"

namespace fulgur {

class FusedAdamStep;

class StepCapture {
 public:
  explicit StepCapture(TrainerEngine& trainer);
  ~StepCapture();

  // At fit start, with the model and optimizers set up. Throws the refusal under "on".
  void prepare();
  // Captured steps run this fit (a refusal under "try" turns them off).
  bool active() const { return active_; }
  // The step of `batch` (on the device): warm-up, capture, replay, or eager. nullopt: capturing
  // was given up ("try") and this batch takes the Trainer's ordinary path.
  std::optional<StepOutput> run(Batch& batch, int64_t batch_idx);

  static constexpr int64_t kWarmupSteps = 3;

 private:
  StepOutput eager_step(Batch& batch, int64_t batch_idx, bool grads_to_none);
  FusedAdamStep& adam();  // the Trainer's, set by prepare()
  // Under "on": throws `reason` as the run's error. Under "try": warns once and returns.
  void refuse(const std::string& reason, bool give_up);
  // Why `batch` cannot replay a step recorded for `reference` ("" when it can).
  static std::string shape_mismatch(const Batch& batch, const Batch& reference);
  StepOutput output_copy() const;
  void copy_into_static(const Batch& batch);
  void log_recorded();

  TrainerEngine& t_;
  StepCaptureMode mode_;
  bool active_ = false;
  bool warned_ = false;
  std::unique_ptr<StepGraph> graph_;
  int64_t warmups_done_ = 0;
  bool captured_ = false;
  Batch previous_batch_;  // the last warm-up batch: a capture needs two alike in a row
  Batch static_batch_;
  StepOutput static_output_;
  std::vector<RecordedLog> recorded_logs_;
};

}  // namespace fulgur
