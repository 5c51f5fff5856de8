// Internal: one training epoch (Lightning's _TrainingEpochLoop with its automatic optimization):
// batches, optimizer steps, gradient accumulation, validation inside and at the end of the epoch.
#pragma once

#include <fulgur/data_module.h>
#include <fulgur/trainer.h>
#include <fulgur/types.h>

#include <ATen/core/Dict.h>

#include <chrono>

#include "../capture/step_capture.h"
#include "../hook_dispatcher.h"
#include "evaluation_loop.h"

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class ClosureStepPrecision;
class FitLoop;
class SamplePositionLoader;

class TrainingEpochLoop {
 public:
  // `position` is the fit loop's: this loop counts global steps, the fit loop epochs.
  TrainingEpochLoop(TrainerEngine& trainer, FitLoop& fit, RunPosition& position)
      : trainer_(trainer), fit_(fit), position_(position), val_loop_(trainer, Stage::validate), capture_(trainer) {}

  // At fit start, with model and optimizers set up: whether the optimizer is stepped by fused
  // kernels (one Adam/AdamW under automatic optimization and a strategy that delegates its step,
  // used where the precision decides steps on the device) and whether steps are captured
  // (cuda_graphs).
  void prepare_optimizer_steps();

  // Batch counts for the coming epochs (-1: a loader of unknown length) and the validation
  // cadence: every `val_check_batches` batches (0: at the epoch's end only; with
  // check_val_every_n_epoch = 0 counted across epochs), or, when `val_check_seconds` > 0, after
  // the batch that ends that much wall-clock time since the last validation (Lightning's
  // time-based val_check_interval).
  void configure(int64_t num_batches, int64_t val_check_batches, double val_check_seconds = 0) {
    num_batches_ = num_batches;
    val_check_batches_ = val_check_batches;
    val_check_seconds_ = val_check_seconds;
  }
  // Training starts: the wall-clock validation interval counts from here.
  void start_validation_clock() { last_validation_ = std::chrono::steady_clock::now(); }
  // Runs the epoch `position.epoch` over `train`, validating with val_loop() when due.
  // Ends with the epoch counted: position.epoch is one higher afterwards.
  void run(BatchLoader& train);

  // One optimizer step through precision and strategy, with its hooks and clipping; also what
  // OptimizerHandle::step runs under manual optimization. False: the step was skipped (inf grads).
  bool step_optimizer(torch::optim::Optimizer& optimizer);

  // Module::manual_backward: backward through strategy and precision with its hooks.
  void manual_backward(const at::Tensor& loss);

  EvaluationLoop& val_loop() { return val_loop_; }
  const EvaluationLoop& val_loop() const { return val_loop_; }
  int64_t num_batches() const { return num_batches_; }
  // Lightning's _batches_that_stepped: batches after which an optimizer stepped, once per batch
  // whatever the number of optimizers. The loggers' step; equal to global_step in automatic
  // optimization.
  int64_t batches_that_stepped() const { return batches_that_stepped_; }
  // Manual optimization: one optimizer.step() call (the global step counts them).
  void count_manual_optimizer_step() { ++position_.global_step; }
  bool is_last_batch() const { return is_last_batch_; }
  // Between a training batch's start and the end of its hooks: values callbacks log join its row.
  bool in_batch() const { return in_batch_; }
  bool step_row_due() const { return step_row_due_; }
  // The epoch's batches are done and its end-of-epoch work runs.
  bool in_epoch_end_phase() const { return epoch_end_phase_; }
  // Batches of the current epoch done so far (what a checkpoint written now records).
  int64_t batches_done_in_epoch() const { return batches_done_; }
  // The last epoch's loader yielded no batch at all.
  bool last_epoch_was_empty() const { return epoch_was_empty_; }
  // Batches the next epoch skips because a mid-epoch checkpoint was loaded.
  int64_t batches_to_skip() const { return resume_skip_; }
  // The loaded mid-epoch checkpoint records where the epoch stands in global samples, so that it
  // can resume with another number of processes (fulgur/sample_position.h).
  bool resume_has_sample_position() const { return resume_samples_ >= 0; }
  // The train loader is about to be destroyed: its position is not asked any more.
  void forget_loader() { positions_ = nullptr; }

  // Progress inside the epoch (batches done, the end-of-epoch phase) and the global step, in the
  // fit loop's checkpoint entry (flat, as Fulgur 0.1 wrote it) plus the validation loop's own,
  // and the same position in Lightning 2.6's "epoch_loop.*" keys (lightning_progress.h).
  void state_dict(c10::impl::GenericDict& fit_loop_state) const;
  // Restores what state_dict wrote; returns whether the checkpoint was written at an epoch's end.
  bool load_state_dict(const c10::impl::GenericDict& fit_loop_state, const std::string& path);

 private:
  // `staged`: the accelerator already transferred the batch (stage_transfer); else it is here.
  void run_batch(Batch& batch, int64_t batch_idx, bool staged);
  // The batch's step for an optimizer that re-evaluates the loss (LBFGS): training_step, backward
  // and the hooks run inside the closure the optimizer calls (Lightning's closure).
  StepOutput run_closure_step(Batch& batch, int64_t batch_idx);
  // The batch's step through capture_ when it is active; nullopt: the ordinary path runs it.
  std::optional<StepOutput> run_captured(Batch& batch, int64_t batch_idx);
  bool batches_done(int64_t batch_idx) const { return epoch_end_batch_ >= 0 && batch_idx >= epoch_end_batch_; }
  // Starts the epoch over `train`, skipping `skip` batches of a loaded checkpoint; with another
  // number of replicas (or after an epoch that was resumed so) it deals out the samples left.
  void start_epoch(BatchLoader& train, int64_t skip);
  // Replicas the train loader is dealt to: the data-parallel size, or 1 when every rank reads all.
  int64_t loader_replicas() const;

  TrainerEngine& trainer_;
  FitLoop& fit_;
  RunPosition& position_;
  EvaluationLoop val_loop_;
  StepCapture capture_;

  int64_t num_batches_ = -1;
  int64_t val_check_batches_ = 0;
  double val_check_seconds_ = 0;
  std::chrono::steady_clock::time_point last_validation_ = std::chrono::steady_clock::now();
  int64_t batches_before_epoch_ = 0;  // batches of earlier epochs (check_val_every_n_epoch = 0)
  int64_t batches_done_ = 0;          // in the current epoch: what a checkpoint written now records
  int64_t resume_skip_ = 0;           // batches the next epoch skips (a mid-epoch checkpoint was loaded)
  int64_t epoch_end_batch_ = -1;      // this epoch's batches end here (-1: when the loader ends)
  // Position in global samples. positions_: the current train loader's (nullptr: it has none);
  // the epoch's batches [loader_batch_base_, ...) are the loader's batches [0, ...); the epoch's
  // first dealt_from_ samples were dealt before this run (another number of replicas).
  SamplePositionLoader* positions_ = nullptr;
  int64_t loader_batch_base_ = 0;
  int64_t dealt_from_ = 0;
  int64_t samples_per_batch_ = -1;  // all replicas together
  // From a loaded mid-epoch checkpoint, for the next epoch's start (-1: not recorded).
  int64_t resume_samples_ = -1, resume_replicas_ = -1, resume_dealt_from_ = 0, resume_samples_per_step_ = -1;
  bool epoch_end_phase_ = false;
  bool epoch_was_empty_ = false;
  bool is_last_batch_ = false;
  bool in_batch_ = false;
  bool step_row_due_ = false;                          // the current batch's metrics go to the loggers
  bool closure_step_ = false;                          // the optimizer needs a closure (prepare_optimizer_steps)
  ClosureStepPrecision* closure_precision_ = nullptr;  // the precision's extension, if it offers it
  int64_t batches_that_stepped_ = 0;
  int64_t row_step_ = 0;  // the step that row carries
};

}  // namespace fulgur
