// Hot-path rules: a training batch does no host-device sync, allocation or virtual call beyond
// what a hand-written loop does, unless a value is due (logging every log_every_n_steps, a
// callback that declared a batch hook, a configured profiler).
#include "training_epoch_loop.h"

#include <fulgur/closure_step.h>
#include <fulgur/error.h>
#include <fulgur/profiler.h>
#include <fulgur/sample_position.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include <algorithm>

#include "../capture/device_step.h"
#include "../ivalue_dict.h"
#include "../trainer_engine.h"
#include "fit_loop.h"
#include "lightning_progress.h"
#include "loop_scopes.h"

namespace fulgur {

void TrainingEpochLoop::run(BatchLoader& train) {
  TrainerEngine& t = trainer_;
  HookDispatcher& hooks = t.hooks_;
  Module& module = *t.module_;
  MetricStore& store = t.logging_.train_metrics();
  ProfileScope epoch_scope(t.plugins_.profiler.get(), "run_training_epoch");
  {
    // Lightning's defaults there: on_step = false, on_epoch = true.
    LogContext log(t.binding_, &store, /*training=*/false, true);
    hooks.call(Hook::train_epoch_start, [&](Callback& c) { c.on_train_epoch_start(t); });
    hooks.module("on_train_epoch_start", [&] { module.on_train_epoch_start(); });
  }
  const int64_t skip = resume_skip_;
  resume_skip_ = 0;
  start_epoch(train, skip);
  batches_done_ = skip;
  epoch_was_empty_ = skip == 0;
  // Which epochs validate (check_val_every_n_epoch; 0 is Lightning's None: every epoch may, by
  // the batch count across epochs) and whether this one does at its end (by default; a
  // wall-clock or across-epochs cadence validates at the end only when the last batch is due).
  const int64_t every_n_epochs = t.trainer_config_.check_val_every_n_epoch;
  const bool validating_epoch =
      val_loop_.has_batches() && (every_n_epochs == 0 || (position_.epoch + 1) % every_n_epochs == 0);
  bool validate_at_end = validating_epoch && every_n_epochs != 0 && val_check_seconds_ <= 0;
  if (num_batches_ >= 0) batches_before_epoch_ = position_.epoch * num_batches_;
  auto validation_due = [&](int64_t batch_idx) {
    if (!validating_epoch) return false;
    if (val_check_seconds_ > 0)
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - last_validation_).count() >=
             val_check_seconds_;
    if (val_check_batches_ <= 0) return false;
    const int64_t counted = every_n_epochs == 0 ? batches_before_epoch_ + batch_idx : batch_idx;
    return (counted + 1) % val_check_batches_ == 0;
  };
  auto validate = [&] {
    val_loop_.run(/*sanity=*/false);
    last_validation_ = std::chrono::steady_clock::now();
  };
  // A loader of unknown length (num_batches() == -1) trains until it is exhausted: the batch
  // after the current one is fetched ahead so that is_last_batch is known before the step.
  // With several ranks and no known length, the ranks agree after every fetch whether all of
  // them still have a batch: the epoch ends for everyone at the shortest rank's end (otherwise
  // the longer ones would wait forever in the gradient collective). One boolean all-reduce per
  // batch, only for such loaders.
  Strategy& strategy = *t.plugins_.strategy;
  const bool agree_on_end = num_batches_ < 0 && strategy.cluster().world_size > 1;
  std::optional<Batch> next;
  auto fetch = [&] {
    std::optional<Batch> batch;
    {
      ProfileScope scope(t.plugins_.profiler.get(), "train_dataloader_next");
      batch = train.next();
    }
    if (agree_on_end && !strategy.reduce_boolean_decision(batch.has_value(), /*all=*/true)) batch.reset();
    return batch;
  };
  // Staged transfers (an accelerator with a copy stream): once batch n's step is queued (and any
  // validation after it has run), batch n+1 goes through its transfer hooks and copies on the copy
  // stream, overlapping step n on the device; its own step waits for the copy. The hooks run in
  // Lightning's order either way: batch n+1 is transferred after batch n ended, before it starts.
  StagedTransfers* staging = t.plugins_.staged_transfers;
  const c10::Device device = t.device();
  bool next_staged = false;
  auto stage_next = [&] {
    next_staged = next && staging && staging->stage_transfer(device, [&] { *next = t.transfer(std::move(*next)); });
  };
  // Signals: with several processes on Gloo the ranks vote one batch behind (SignalVote).
  std::optional<SignalVote> vote;
  if (strategy.cluster().world_size > 1)
    if (auto communicator = t.world_communicator(); communicator && communicator->backend() == "gloo")
      vote.emplace(std::move(communicator));
  if (!batches_done(skip)) next = fetch();
  for (int64_t batch_idx = skip; next; ++batch_idx) {
    Batch batch = std::move(*next);
    const bool staged = next_staged;
    next.reset();
    next_staged = false;
    if (!batches_done(batch_idx + 1)) next = fetch();
    is_last_batch_ = !next.has_value();
    epoch_was_empty_ = false;
    {
      HookDispatcher::Scope batch_scope(t.hooks_, nullptr, batch_idx);  // errors name the batch
      run_batch(batch, batch_idx, staged);
    }
    if (validation_due(batch_idx)) {
      if (is_last_batch_)
        validate_at_end = true;  // where the epoch's own validation runs: before on_train_epoch_end
      else
        validate();
    }
    if (vote ? vote->after_batch() : interrupt_due(t)) interrupt_at_safe_point(t);  // after the step and its validation
    // Mid-epoch, the fit loop's epoch limit cannot hold yet: this checks max_steps and a requested
    // stop (max_time's among them).
    if (fit_.done()) break;
    stage_next();
  }
  if (vote && vote->finish()) interrupt_at_safe_point(t);  // the last batch's vote
  epoch_end_phase_ = true;
  // End-of-epoch validation runs before on_train_epoch_end (Lightning).
  if (validate_at_end) validate();
  if (num_batches_ < 0) batches_before_epoch_ += batches_done_;
  {
    // Lightning: values logged at epoch end are epoch-level by default and land in this epoch.
    LogContext log(t.binding_, &store, /*training=*/false, true);
    hooks.call_where_monitor(Hook::train_epoch_end, false, [&](Callback& c) { c.on_train_epoch_end(t); });
    hooks.module("on_train_epoch_end", [&] { module.on_train_epoch_end(); });
    hooks.call_where_monitor(Hook::train_epoch_end, true, [&](Callback& c) { c.on_train_epoch_end(t); });
  }
  t.logging_.log_epoch_metrics(store, /*send_to_loggers=*/true);
  t.step_schedulers(SchedulerInterval::epoch);
  t.logging_.save();
  ++position_.epoch;
  batches_done_ = 0;
  epoch_end_phase_ = false;
}

int64_t TrainingEpochLoop::loader_replicas() const {
  return trainer_.trainer_config_.use_distributed_sampler ? trainer_.plugins_.strategy->data_parallel_size() : 1;
}

void TrainingEpochLoop::start_epoch(BatchLoader& train, int64_t skip) {
  TrainerEngine& t = trainer_;
  // overfit_batches: the same batches every epoch (and in validation, which starts its loader at
  // epoch 0 too), as Lightning's overfitting on a fixed subset without shuffling does. The loader's
  // order is epoch 0's: a BatchLoader takes no request to stop shuffling.
  const int64_t epoch = t.trainer_config_.overfit ? 0 : position_.epoch;
  positions_ = sample_position_of(train);
  if (positions_ && positions_->samples_consumed(0) < 0) positions_ = nullptr;  // a stream split its own way
  const int64_t replicas = loader_replicas();
  const int64_t saved_samples = resume_samples_, saved_replicas = resume_replicas_, saved_from = resume_dealt_from_;
  const int64_t saved_per_step = resume_samples_per_step_;
  resume_samples_ = resume_replicas_ = resume_samples_per_step_ = -1;
  resume_dealt_from_ = 0;
  loader_batch_base_ = 0;
  dealt_from_ = 0;
  epoch_end_batch_ = num_batches_;
  // The checkpoint's per-rank batch count means the same samples only when the whole epoch so far
  // was dealt to as many replicas as now; otherwise what is left of the epoch's global order is
  // dealt out again (the checkpoint connector refused checkpoints that do not record it).
  const bool redeal = skip > 0 && saved_samples >= 0 && (saved_replicas != replicas || saved_from > 0);
  if (!redeal) {
    train.start_epoch(epoch, skip);
    samples_per_batch_ = positions_ ? positions_->samples_consumed(1) - positions_->samples_consumed(0) : -1;
  } else {
    if (!positions_)
      throw Error(ErrorKind::checkpoint,
                  fmt::format("the checkpoint stopped {} batches into epoch {} with {} processes and this run has {}, "
                              "but this run's train loader cannot deal out the rest of an epoch by sample (a loader "
                              "of a streaming dataset, or one that does not offer fulgur::SamplePositionLoader): "
                              "resume with {} processes, or from a checkpoint saved at an epoch end",
                              skip, position_.epoch, saved_replicas, replicas, saved_replicas));
    // A loader made for this run starts at the epoch's beginning: one batch of every replica.
    samples_per_batch_ = positions_->samples_consumed(1) - positions_->samples_consumed(0);
    const int64_t left_batches = positions_->start_epoch_at_sample(epoch, saved_samples);
    loader_batch_base_ = skip;
    dealt_from_ = saved_samples;
    epoch_end_batch_ = left_batches < 0 ? -1 : skip + left_batches;  // -1: a stream, until it ends
    if (num_batches_ >= 0 && num_batches_ < train.num_batches())     // limit_train_batches: per rank, as before
      epoch_end_batch_ = std::min(epoch_end_batch_, std::max(skip, num_batches_));
  }
  if (skip > 0 && t.global_rank() == 0) {
    const int64_t consumed = redeal ? saved_samples : positions_ ? positions_->samples_consumed(skip) : -1;
    const std::string remain =
        consumed < 0 ? "this loader does not say how many samples of this epoch remain"
        : positions_->epoch_samples() < 0
            ? fmt::format("the stream goes on from its sample {} (its length is not known)", consumed)
            : fmt::format("{} samples of this epoch remain", positions_->epoch_samples() - consumed);
    spdlog::info("resumed at step {} of epoch {} with {} processes (was {}); {}", position_.global_step,
                 position_.epoch, replicas, saved_replicas > 0 ? saved_replicas : replicas, remain);
    const int64_t per_step = samples_per_batch_ * t.trainer_config_.accumulate_grad_batches;
    if (saved_per_step > 0 && samples_per_batch_ > 0 && per_step != saved_per_step)
      spdlog::info(
          "the global batch is now {} samples per optimizer step (was {}): each process keeps its batch size and "
          "accumulate_grad_batches, so the global batch follows the number of processes",
          per_step, saved_per_step);
  }
}

// Lightning's LightningOptimizer.step -> strategy.optimizer_step -> precision.optimizer_step.
bool TrainingEpochLoop::step_optimizer(torch::optim::Optimizer& optimizer) {
  TrainerEngine& t = trainer_;
  Precision& precision = *t.plugins_.precision;
  // True gradients for callbacks and clipping (16-mixed unscales here).
  precision.unscale_gradients(optimizer);
  t.hooks_.call(Hook::before_optimizer_step, [&](Callback& c) { c.on_before_optimizer_step(t, optimizer); });
  t.hooks_.module("on_before_optimizer_step", [&] { t.module_->on_before_optimizer_step(optimizer); });
  if (t.trainer_config_.gradient_clip_val > 0)
    t.plugins_.strategy->clip_gradients(optimizer, precision, t.trainer_config_.gradient_clip_val,
                                        t.trainer_config_.gradient_clip_algorithm);
  ProfileScope scope(t.plugins_.profiler.get(), "optimizer_step");
  if (!t.fused_adam_ || &optimizer != t.optimizer_ptrs_.front())
    return t.plugins_.strategy->optimizer_step(optimizer, precision);
  // 16-mixed: the inf/NaN verdict stays on the device, and so does the decision to skip (a
  // strategy that only delegates its step may be bypassed; under cuda_graphs = "try" one that
  // does more may have given up on capturing).
  if (delegates_optimizer_step(t.plugins_))
    if (const at::Tensor found_inf = device_found_inf(t.plugins_, optimizer); found_inf.defined()) {
      t.fused_adam_->before_step(/*recorded=*/false);
      t.fused_adam_->step_decided_by(t.plugins_.precision_device_step, found_inf);
      t.fused_adam_->advance_host_steps(/*replayed=*/false);
      return true;  // taken or skipped: only the device knows, and nothing here asks it
    }
  t.sync_optimizer_host_state();  // the optimizer's own step() reads the host counts
  const bool stepped = t.plugins_.strategy->optimizer_step(optimizer, precision);
  t.fused_adam_->host_stepped();
  return stepped;
}

namespace {

// Optimizers whose step() calls a closure that re-evaluates the loss: LibTorch's LBFGS throws
// without one.
bool needs_closure(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const torch::optim::LBFGS*>(&optimizer) != nullptr;
}

// Why the automatic loop cannot step `optimizer` with a closure under this run's plugins, or "".
std::string closure_step_refusal(const PluginSet& p, const ClosureStepPrecision* precision, int64_t accumulate,
                                 const std::string& strategy_name, const std::string& precision_name) {
  if (accumulate > 1)
    return fmt::format(
        "accumulate_grad_batches = {} would mix several batches into one step, but the optimizer "
        "re-evaluates the loss of one batch inside its step; use 1",
        accumulate);
  if (!delegates_optimizer_step(p))
    return fmt::format(
        "strategy '{}' steps the optimizer itself (sharded parameters or optimizer state); LBFGS "
        "keeps its curvature history over the whole parameter vector and re-runs the step's forward "
        "pass: use a strategy that leaves the step to the precision (one device, or replicated data "
        "parallel)",
        strategy_name);
  if (!precision)
    return fmt::format(
        "precision '{}' does not step optimizers with a closure (it offers no {} extension): use "
        "a precision that does (full precision or bfloat16 mixed precision)",
        precision_name, ClosureStepPrecision::kExtensionId);
  if (std::string why = precision->closure_step_refusal(); !why.empty())
    return fmt::format("precision '{}': {}", precision_name, why);
  return {};
}

}  // namespace

void TrainingEpochLoop::prepare_optimizer_steps() {
  TrainerEngine& t = trainer_;
  t.fused_adam_.reset();
  closure_step_ =
      t.module_->automatic_optimization && !t.optimizer_ptrs_.empty() && needs_closure(*t.optimizer_ptrs_.front());
  closure_precision_ = find_extension<ClosureStepPrecision>(*t.plugins_.precision);
  if (closure_step_)
    if (std::string why =
            closure_step_refusal(t.plugins_, closure_precision_, t.trainer_config_.accumulate_grad_batches,
                                 t.config().strategy.name, t.config().precision.name);
        !why.empty())
      throw Error(ErrorKind::config,
                  fmt::format("configure_optimizers returned an optimizer that needs a closure (LBFGS), which this "
                              "run cannot step: {}",
                              why));
  if (t.module_->automatic_optimization && t.optimizer_ptrs_.size() == 1 && delegates_optimizer_step(t.plugins_) &&
      FusedAdamStep::refusal(*t.optimizer_ptrs_.front()).empty())
    t.fused_adam_ = std::make_unique<FusedAdamStep>(*t.optimizer_ptrs_.front());
  capture_.prepare();
}

void TrainingEpochLoop::manual_backward(const at::Tensor& loss) {
  TrainerEngine& t = trainer_;
  t.hooks_.call(Hook::before_backward, [&](Callback& c) { c.on_before_backward(t, loss); });
  t.hooks_.module("on_before_backward", [&] { t.module_->on_before_backward(loss); });
  t.plugins_.strategy->backward(loss, *t.plugins_.precision, /*sync_gradients=*/true);
  t.hooks_.call(Hook::after_backward, [&](Callback& c) { c.on_after_backward(t); });
  t.hooks_.module("on_after_backward", [&] { t.module_->on_after_backward(); });
}

void TrainingEpochLoop::run_batch(Batch& batch, int64_t batch_idx, bool staged) {
  TrainerEngine& t = trainer_;
  HookDispatcher& hooks = t.hooks_;
  Module& module = *t.module_;
  Strategy& strategy = *t.plugins_.strategy;
  Profiler* profiler = t.plugins_.profiler.get();
  const int64_t accumulate = t.trainer_config_.accumulate_grad_batches;
  ProfileScope batch_scope(profiler, "run_training_batch");
  const bool boundary = (batch_idx + 1) % accumulate == 0 || is_last_batch_;
  const bool steps = !module.automatic_optimization || boundary;
  // The row this batch's metrics go to: the optimizer steps before it (Lightning's
  // _batches_that_stepped), due every log_every_n_steps steps and on the last batch.
  row_step_ = batches_that_stepped_;
  step_row_due_ =
      (batches_that_stepped_ + (steps ? 1 : 0)) % t.trainer_config_.log_every_n_steps == 0 || is_last_batch_;
  if (staged)
    t.plugins_.staged_transfers->finish_transfer(t.device(), batch);  // transferred while the last step ran
  else
    batch = t.transfer(std::move(batch));
  t.binding_.batch_size = batch.size();
  LogContext log(t.binding_, &t.logging_.train_metrics(), /*training=*/true, /*allowed=*/true);
  in_batch_ = true;
  hooks.call(Hook::train_batch_start, [&](Callback& c) { c.on_train_batch_start(t, batch, batch_idx); });
  hooks.module("on_train_batch_start", [&] { module.on_train_batch_start(batch, batch_idx); });
  // Gradient accumulation: only the last micro-step of a window synchronizes (DDP's no_sync).
  strategy.before_training_step(steps);

  StepOutput output;
  if (!module.automatic_optimization) {
    PrecisionScope precision_scope(*t.plugins_.precision);
    ProfileScope scope(profiler, "training_step");
    output = hooks.module_step("training_step", [&] { return module.training_step(batch, batch_idx); });
    // global_step counted each optimizer.step() the step called (count_manual_optimizer_step);
    // the loggers' step counts the batch once.
    ++batches_that_stepped_;
  } else if (closure_step_) {
    output = run_closure_step(batch, batch_idx);
    ++position_.global_step;
    ++batches_that_stepped_;
    t.step_schedulers(SchedulerInterval::step);
  } else if (std::optional<StepOutput> captured = run_captured(batch, batch_idx)) {
    // cuda_graphs: forward, backward and the optimizer step as one recorded graph (one optimizer
    // step per batch: accumulation is refused).
    output = std::move(*captured);
    ++position_.global_step;
    ++batches_that_stepped_;
    t.step_schedulers(SchedulerInterval::step);
  } else {
    torch::optim::Optimizer& optimizer = *t.optimizer_ptrs_.front();
    const bool window_start = batch_idx % accumulate == 0;
    {
      PrecisionScope precision_scope(*t.plugins_.precision);
      ProfileScope scope(profiler, "training_step");
      output = hooks.module_step("training_step", [&] { return module.training_step(batch, batch_idx); });
    }
    if (output.loss.defined()) {  // an undefined loss skips backward and the step (Lightning: None)
      at::Tensor loss = accumulate > 1 ? output.loss / static_cast<double>(accumulate) : output.loss;
      if (window_start) {
        hooks.call(Hook::before_zero_grad, [&](Callback& c) { c.on_before_zero_grad(t, optimizer); });
        hooks.module("on_before_zero_grad", [&] { module.on_before_zero_grad(optimizer); });
        ProfileScope scope(profiler, "optimizer_zero_grad");
        optimizer.zero_grad(/*set_to_none=*/true);
      }
      hooks.call(Hook::before_backward, [&](Callback& c) { c.on_before_backward(t, loss); });
      hooks.module("on_before_backward", [&] { module.on_before_backward(loss); });
      {
        ProfileScope scope(profiler, "backward");
        strategy.backward(loss, *t.plugins_.precision, /*sync_gradients=*/boundary);
      }
      hooks.call(Hook::after_backward, [&](Callback& c) { c.on_after_backward(t); });
      hooks.module("on_after_backward", [&] { module.on_after_backward(); });
      if (boundary) {
        step_optimizer(optimizer);
        ++position_.global_step;
        ++batches_that_stepped_;
        t.step_schedulers(SchedulerInterval::step);
      }
    }
  }
  batches_done_ = batch_idx + 1;  // what a checkpoint written from the hooks below records
  hooks.call(Hook::train_batch_end, [&](Callback& c) { c.on_train_batch_end(t, output, batch, batch_idx); });
  hooks.module("on_train_batch_end", [&] { module.on_train_batch_end(output, batch, batch_idx); });
  in_batch_ = false;
  if (step_row_due_ || t.should_stop_) t.logging_.send_step_row(row_step_);
  step_row_due_ = false;
}

StepOutput TrainingEpochLoop::run_closure_step(Batch& batch, int64_t batch_idx) {
  TrainerEngine& t = trainer_;
  HookDispatcher& hooks = t.hooks_;
  Module& module = *t.module_;
  Strategy& strategy = *t.plugins_.strategy;
  Precision& precision = *t.plugins_.precision;
  Profiler* profiler = t.plugins_.profiler.get();
  torch::optim::Optimizer& optimizer = *t.optimizer_ptrs_.front();
  const bool several_ranks = strategy.cluster().world_size > 1;
  StepOutput output;  // the last evaluation's, as Lightning's closure keeps its last result
  // Lightning's Closure (training_step, zero_grad, backward) followed by its _after_closure
  // (on_before_optimizer_step, clipping); the optimizer calls it under no_grad.
  bool first_evaluation = true;
  auto closure = [&]() -> at::Tensor {
    at::AutoGradMode enable_grad(true);
    // Every evaluation is a forward and backward of its own: the strategy prepares each as it
    // prepared the first in run_batch (ddp's Reducer rebuilds its buckets before a forward, as
    // PyTorch's DDP.forward does; without it the second backward trips the Reducer's bookkeeping).
    if (!first_evaluation) strategy.before_training_step(/*sync_gradients=*/true);
    first_evaluation = false;
    {
      PrecisionScope precision_scope(precision);
      ProfileScope scope(profiler, "training_step");
      output = module.training_step(batch, batch_idx);
    }
    if (!output.loss.defined())
      throw Error(ErrorKind::runtime,
                  "training_step returned no loss, but the optimizer (LBFGS) needs one from every evaluation");
    hooks.call(Hook::before_zero_grad, [&](Callback& c) { c.on_before_zero_grad(t, optimizer); });
    hooks.module("on_before_zero_grad", [&] { module.on_before_zero_grad(optimizer); });
    optimizer.zero_grad(/*set_to_none=*/true);
    hooks.call(Hook::before_backward, [&](Callback& c) { c.on_before_backward(t, output.loss); });
    hooks.module("on_before_backward", [&] { module.on_before_backward(output.loss); });
    {
      ProfileScope scope(profiler, "backward");
      strategy.backward(output.loss, precision, /*sync_gradients=*/true);
    }
    hooks.call(Hook::after_backward, [&](Callback& c) { c.on_after_backward(t); });
    hooks.module("on_after_backward", [&] { module.on_after_backward(); });
    precision.unscale_gradients(optimizer);
    hooks.call(Hook::before_optimizer_step, [&](Callback& c) { c.on_before_optimizer_step(t, optimizer); });
    hooks.module("on_before_optimizer_step", [&] { module.on_before_optimizer_step(optimizer); });
    if (t.trainer_config_.gradient_clip_val > 0)
      strategy.clip_gradients(optimizer, precision, t.trainer_config_.gradient_clip_val,
                              t.trainer_config_.gradient_clip_algorithm);
    // With several ranks the gradients are averaged already; the loss must be too, or LBFGS's
    // loss-based stopping tests could end the iteration on one rank and not on another.
    const at::Tensor loss = output.loss.detach();
    return several_ranks ? strategy.reduce(loss, ReduceOp::mean) : loss;
  };
  ProfileScope scope(profiler, "optimizer_step");
  closure_precision_->optimizer_step_with_closure(optimizer, closure);
  return output;
}

std::optional<StepOutput> TrainingEpochLoop::run_captured(Batch& batch, int64_t batch_idx) {
  if (!capture_.active()) return std::nullopt;
  ProfileScope scope(trainer_.plugins_.profiler.get(), "captured_training_step");
  return capture_.run(batch, batch_idx);
}

void TrainingEpochLoop::state_dict(c10::impl::GenericDict& fit_loop_state) const {
  fit_loop_state.insert("global_step", position_.global_step);
  fit_loop_state.insert("batches_that_stepped", batches_that_stepped_);
  fit_loop_state.insert("batches_done_in_epoch", batches_done_);
  fit_loop_state.insert("epoch_end_phase", epoch_end_phase_);
  // Where the epoch stands in global samples, so that a resume with another number of processes
  // deals out exactly the rest (-1: the loader cannot say). Older checkpoints lack these keys.
  const bool in_epoch = batches_done_ > 0 && !epoch_end_phase_;
  fit_loop_state.insert("epoch_samples_consumed", in_epoch && positions_
                                                      ? positions_->samples_consumed(batches_done_ - loader_batch_base_)
                                                      : int64_t{in_epoch ? -1 : 0});
  fit_loop_state.insert("epoch_dealt_from_sample", in_epoch ? dealt_from_ : int64_t{0});
  fit_loop_state.insert("loader_replicas", loader_replicas());
  fit_loop_state.insert("samples_per_step", samples_per_batch_ > 0
                                                ? samples_per_batch_ * trainer_.trainer_config_.accumulate_grad_batches
                                                : int64_t{-1});
  const c10::IValue val_state = val_loop_.state_dict();
  fit_loop_state.insert("val_loop", val_state);

  // The same position in Lightning 2.6's _TrainingEpochLoop layout, as Lightning's own checkpoint
  // written at the equivalent hook holds it (its restart logic reads the differences between the
  // counters): mid-epoch as from on_train_batch_end (batch k processed, not yet completed), in the
  // epoch-end phase as from on_train_epoch_end (every batch completed), else a fresh epoch.
  const TrainerEngine& t = trainer_;
  const bool mid_epoch = batches_done_ > 0 && !epoch_end_phase_;
  lightning::Counts current = lightning::Counts::all(epoch_end_phase_ || mid_epoch ? batches_done_ : 0);
  if (mid_epoch) --current.completed;
  const int64_t earlier = num_batches_ > 0 ? position_.epoch * num_batches_ : 0;  // batches of the epochs before
  const bool last = (mid_epoch && is_last_batch_) || epoch_end_phase_;
  fit_loop_state.insert("epoch_loop.batch_progress", lightning::batch_progress(current.plus(earlier), current, last));
  // Lightning counts batch k's optimizer step into _batches_that_stepped after on_train_batch_end
  // and adds it back on restore when that batch was not accumulating: write its count from before.
  const int64_t accumulate = t.trainer_config_.accumulate_grad_batches;
  const bool lightning_adds_one = mid_epoch && (batches_done_ % accumulate == 0 || is_last_batch_);
  auto epoch_state = string_dict();
  epoch_state.insert("_batches_that_stepped", batches_that_stepped_ - (lightning_adds_one ? 1 : 0));
  fit_loop_state.insert("epoch_loop.state_dict", epoch_state);
  // Lightning restores schedulers from lr_schedulers; its scheduler counter only counts calls.
  fit_loop_state.insert("epoch_loop.scheduler_progress", lightning::ready_completed_progress(0, 0));
  // Lightning's global_step: the automatic loop's optimizer steps, or the manual loop's.
  const bool automatic = !t.module_ || t.module_->automatic_optimization;
  const int64_t steps = position_.global_step;
  const int64_t epoch_batches = epoch_end_phase_ || mid_epoch ? batches_done_ : 0;
  const int64_t epoch_steps =
      std::min(steps, epoch_batches / accumulate + (epoch_batches % accumulate != 0 && last ? 1 : 0));
  fit_loop_state.insert("epoch_loop.automatic_optimization.state_dict", lightning::empty_state());
  fit_loop_state.insert("epoch_loop.automatic_optimization.optim_progress",
                        lightning::optimization_progress(automatic ? steps : 0, automatic ? epoch_steps : 0));
  fit_loop_state.insert("epoch_loop.manual_optimization.state_dict", lightning::empty_state());
  fit_loop_state.insert("epoch_loop.manual_optimization.optim_step_progress",
                        lightning::ready_completed_progress(automatic ? 0 : steps, automatic ? 0 : epoch_steps));
  const auto& val = val_state.toGenericDict();
  fit_loop_state.insert("epoch_loop.val_loop.state_dict", val.at("state_dict"));
  fit_loop_state.insert("epoch_loop.val_loop.batch_progress", val.at("batch_progress"));
}

bool TrainingEpochLoop::load_state_dict(const c10::impl::GenericDict& fit_loop_state, const std::string& path) {
  position_.global_step = require_key(fit_loop_state, "global_step", path, "").toInt();
  // Checkpoints from before manual optimization counted optimizer steps: the two were equal.
  const auto stepped = get(fit_loop_state, "batches_that_stepped");
  batches_that_stepped_ = stepped ? stepped->toInt() : position_.global_step;
  resume_skip_ = require_key(fit_loop_state, "batches_done_in_epoch", path, "").toInt();
  batches_done_ = resume_skip_;
  // Checkpoints from before the loops kept their own state have no validation loop entry.
  if (auto val = get(fit_loop_state, "val_loop")) val_loop_.load_state_dict(*val, path);
  const bool at_epoch_end = require_key(fit_loop_state, "epoch_end_phase", path, "").toBool();
  auto read_int = [&](const char* key, int64_t otherwise) {
    auto v = get(fit_loop_state, key);
    return v && v->isInt() ? v->toInt() : otherwise;
  };
  resume_samples_ = read_int("epoch_samples_consumed", -1);
  resume_dealt_from_ = read_int("epoch_dealt_from_sample", 0);
  resume_replicas_ = read_int("loader_replicas", -1);
  resume_samples_per_step_ = read_int("samples_per_step", -1);
  if (at_epoch_end) {
    resume_skip_ = 0;
    batches_done_ = 0;
  }
  return at_epoch_end;
}

}  // namespace fulgur
