#include "prediction_loop.h"

#include <fulgur/profiler.h>

#include "../ivalue_dict.h"
#include "../trainer_engine.h"
#include "lightning_progress.h"
#include "loop_scopes.h"

namespace fulgur {

std::vector<at::Tensor> PredictionLoop::run(BatchLoader& loader) {
  TrainerEngine& t = trainer_;
  HookDispatcher& hooks = t.hooks_;
  Module& module = *t.module_;
  std::vector<at::Tensor> predictions;
  EvalMode eval_mode(module, t.trainer_config_.inference_mode);
  LogContext log(t.binding_, nullptr, false, false, "predict_step");  // Lightning forbids logging in predict
  batches_done_ = 0;
  hooks.call(Hook::predict_start, [&](Callback& c) { c.on_predict_start(t); });
  hooks.call(Hook::predict_epoch_start, [&](Callback& c) { c.on_predict_epoch_start(t); });
  loader.start_epoch(0);
  for (int64_t batch_idx = 0; num_batches_ < 0 || batch_idx < num_batches_; ++batch_idx) {
    std::optional<Batch> next = loader.next();
    if (!next) break;
    HookDispatcher::Scope batch_scope(hooks, nullptr, batch_idx);
    Batch batch = t.transfer(std::move(*next));
    hooks.call(Hook::predict_batch_start, [&](Callback& c) { c.on_predict_batch_start(t, batch, batch_idx); });
    at::Tensor prediction;
    {
      PrecisionScope precision_scope(*t.plugins_.precision);
      ProfileScope scope(t.plugins_.profiler.get(), "predict_step");
      prediction = hooks.module_step("predict_step", [&] { return module.predict_step(batch, batch_idx); });
    }
    hooks.call(Hook::predict_batch_end, [&](Callback& c) { c.on_predict_batch_end(t, prediction, batch, batch_idx); });
    // On the CPU as they are collected: a device holds one batch's output at a time, not the
    // whole pass (as Lightning moves predictions to the CPU). Nothing at all for writer-only runs.
    if (t.trainer_config_.return_predictions)
      predictions.push_back(prediction.defined() && !prediction.device().is_cpu() ? prediction.detach().to(c10::kCPU)
                                                                                  : prediction);
    batches_done_ = batch_idx + 1;
  }
  hooks.call(Hook::predict_epoch_end, [&](Callback& c) { c.on_predict_epoch_end(t); });
  hooks.call(Hook::predict_end, [&](Callback& c) { c.on_predict_end(t); });
  ++completed_passes_;
  return predictions;
}

c10::IValue PredictionLoop::state_dict() const {
  auto state = string_dict();
  state.insert("batches_done", batches_done_);
  state.insert("completed_passes", completed_passes_);
  // Lightning's _PredictionLoop reads these two (its batch_progress is a plain _Progress).
  state.insert("state_dict", lightning::empty_state());
  const auto batches = lightning::Counts::all(batches_done_);
  state.insert("batch_progress", lightning::progress(batches, batches));
  return state;
}

void PredictionLoop::load_state_dict(const c10::IValue& state, const std::string& path) {
  const auto dict = as_dict(state, "prediction loop state", path);
  batches_done_ = require_key(dict, "batches_done", path, "").toInt();
  completed_passes_ = require_key(dict, "completed_passes", path, "").toInt();
}

}  // namespace fulgur
