// Internal: Lightning 2.6's loop progress trackers (lightning/pytorch/loops/progress.py) as the
// dicts its loops' state_dict() writes, so that the checkpoint's "loops" entry is one a Lightning
// Trainer resumes from (trainer.fit(ckpt_path=...)). Lightning reads only the keys its loops own
// ("state_dict", "epoch_progress", "epoch_loop.batch_progress", ...) and skips the rest: Fulgur's
// own exact-resume keys (sampler position, batches_that_stepped, ...) sit beside them.
#pragma once

#include <ATen/core/Dict.h>

#include <cstdint>

namespace fulgur::lightning {

/// A _ProcessedTracker: events ready, started, processed and completed.
struct Counts {
  int64_t ready = 0, started = 0, processed = 0, completed = 0;
  /// All four equal: `n` events went through every stage.
  static Counts all(int64_t n) { return {n, n, n, n}; }
  Counts plus(int64_t n) const { return {ready + n, started + n, processed + n, completed + n}; }
};

/// _Progress of _ProcessedTrackers: {"total": ..., "current": ...}.
c10::impl::GenericDict progress(const Counts& total, const Counts& current);
/// _BatchProgress: a _Progress with "is_last_batch".
c10::impl::GenericDict batch_progress(const Counts& total, const Counts& current, bool is_last_batch);
/// _SchedulerProgress, or the manual loop's optim_step_progress: _ReadyCompletedTrackers.
c10::impl::GenericDict ready_completed_progress(int64_t total, int64_t current);
/// _OptimizationProgress: {"optimizer": {"step": ..., "zero_grad": ...}}; Lightning's global step
/// under automatic optimization is its step.total.completed.
c10::impl::GenericDict optimization_progress(int64_t total_steps, int64_t current_steps);
/// A loop's own "state_dict" entry (_Loop.on_save_checkpoint) where it keeps nothing there.
c10::impl::GenericDict empty_state();

}  // namespace fulgur::lightning
