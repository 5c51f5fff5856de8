#include "evaluation_loop.h"

#include <fulgur/profiler.h>

#include <fmt/format.h>

#include <algorithm>

#include "../ivalue_dict.h"
#include "../trainer_engine.h"
#include "lightning_progress.h"
#include "loop_scopes.h"

namespace fulgur {

void EvaluationLoop::set_loaders(std::vector<BatchLoader*> loaders, std::vector<int64_t> limits) {
  loaders_ = std::move(loaders);
  limits_ = std::move(limits);
  dataloader_idx_ = 0;
}

bool EvaluationLoop::has_batches() const {
  for (int64_t limit : limits_)
    if (limit != 0) return true;
  return false;
}

int64_t EvaluationLoop::num_batches() const {
  if (limits_.empty()) return 0;
  return limits_[static_cast<size_t>(std::min<int64_t>(dataloader_idx_, static_cast<int64_t>(limits_.size()) - 1))];
}

MetricMap EvaluationLoop::run(bool sanity, int64_t max_batches) {
  TrainerEngine& t = trainer_;
  Profiler* profiler = t.plugins_.profiler.get();
  HookDispatcher& hooks = t.hooks_;
  Module& module = *t.module_;
  MetricStore& store = t.logging_.eval_metrics();
  const bool test = stage_ == Stage::test;
  ProfileScope loop_scope(profiler, test ? "run_test_evaluation" : "run_validation_evaluation");
  EvalMode eval_mode(module, t.trainer_config_.inference_mode);
  // Errors name the pass: fit's sanity check and validation, or the stage itself.
  HookDispatcher::Scope stage_scope(hooks,
                                    t.stage_ != Stage::fit ? nullptr
                                    : sanity               ? "fit (sanity check)"
                                                           : "fit (validation)",
                                    -1);
  batches_done_ = 0;
  dataloader_idx_ = 0;
  hooks.call(test ? Hook::test_start : Hook::validation_start,
             [&](Callback& c) { test ? c.on_test_start(t) : c.on_validation_start(t); });
  {
    LogContext log(t.binding_, &store, false, true);
    hooks.call(test ? Hook::test_epoch_start : Hook::validation_epoch_start,
               [&](Callback& c) { test ? c.on_test_epoch_start(t) : c.on_validation_epoch_start(t); });
    hooks.module(test ? "on_test_epoch_start" : "on_validation_epoch_start",
                 [&] { test ? module.on_test_epoch_start() : module.on_validation_epoch_start(); });
  }
  const bool several = loaders_.size() > 1;
  for (size_t i = 0; i < loaders_.size(); ++i) {
    dataloader_idx_ = static_cast<int64_t>(i);
    BatchLoader& loader = *loaders_[i];
    int64_t limit = limits_[i];
    if (max_batches >= 0) limit = limit < 0 ? max_batches : std::min(limit, max_batches);
    if (limit == 0) continue;
    // Lightning names values logged for one of several loaders "<name>/dataloader_idx_<i>".
    t.binding_.name_suffix = several ? fmt::format("/dataloader_idx_{}", i) : std::string();
    batches_done_ = 0;
    loader.start_epoch(0);
    for (int64_t batch_idx = 0; limit < 0 || batch_idx < limit; ++batch_idx) {
      std::optional<Batch> next;
      {
        ProfileScope scope(profiler, test ? "test_dataloader_next" : "val_dataloader_next");
        next = loader.next();
      }
      if (!next) break;
      HookDispatcher::Scope batch_scope(hooks, nullptr, batch_idx);
      Batch batch = t.transfer(std::move(*next));
      t.binding_.batch_size = batch.size();
      LogContext log(t.binding_, &store, false, true);
      hooks.call(test ? Hook::test_batch_start : Hook::validation_batch_start, [&](Callback& c) {
        test ? c.on_test_batch_start(t, batch, batch_idx) : c.on_validation_batch_start(t, batch, batch_idx);
      });
      StepOutput out;
      {
        PrecisionScope precision_scope(*t.plugins_.precision);
        ProfileScope scope(profiler, test ? "test_step" : "validation_step");
        out = hooks.module_step(test ? "test_step" : "validation_step", [&] {
          return test ? module.test_step(batch, batch_idx, dataloader_idx_)
                      : module.validation_step(batch, batch_idx, dataloader_idx_);
        });
      }
      hooks.call(test ? Hook::test_batch_end : Hook::validation_batch_end, [&](Callback& c) {
        test ? c.on_test_batch_end(t, out, batch, batch_idx) : c.on_validation_batch_end(t, out, batch, batch_idx);
      });
      batches_done_ = batch_idx + 1;
    }
    t.binding_.name_suffix.clear();
  }
  {
    LogContext log(t.binding_, &store, false, true);
    hooks.call(test ? Hook::test_epoch_end : Hook::validation_epoch_end,
               [&](Callback& c) { test ? c.on_test_epoch_end(t) : c.on_validation_epoch_end(t); });
    hooks.module(test ? "on_test_epoch_end" : "on_validation_epoch_end",
                 [&] { test ? module.on_test_epoch_end() : module.on_validation_epoch_end(); });
  }
  MetricMap all = t.logging_.log_evaluation_epoch(sanity);
  hooks.call(test ? Hook::test_end : Hook::validation_end,
             [&](Callback& c) { test ? c.on_test_end(t) : c.on_validation_end(t); });
  if (!sanity) ++completed_passes_;
  return all;
}

c10::IValue EvaluationLoop::state_dict() const {
  auto state = string_dict();
  state.insert("dataloader_idx", dataloader_idx_);
  state.insert("batches_done", batches_done_);
  state.insert("completed_passes", completed_passes_);
  // Lightning's _EvaluationLoop reads these two: the last pass ended after batches_done_ batches
  // (Fulgur writes no checkpoint inside a pass), as Lightning's own checkpoint after it says.
  state.insert("state_dict", lightning::empty_state());
  const auto batches = lightning::Counts::all(batches_done_);
  state.insert("batch_progress", lightning::batch_progress(batches, batches, batches_done_ > 0));
  return state;
}

void EvaluationLoop::load_state_dict(const c10::IValue& state, const std::string& path) {
  const auto dict = as_dict(state, stage_ == Stage::test ? "test loop state" : "validation loop state", path);
  dataloader_idx_ = require_key(dict, "dataloader_idx", path, "").toInt();
  batches_done_ = require_key(dict, "batches_done", path, "").toInt();
  completed_passes_ = require_key(dict, "completed_passes", path, "").toInt();
}

}  // namespace fulgur
