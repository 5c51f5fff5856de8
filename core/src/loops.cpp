// The fit, evaluation and prediction loops, in PyTorch Lightning's hook order
// (reference/lightning-anchor.md §2.2; the hook-order test asserts the whole sequence).
//
// Hot-path rules: a training batch does no host-device sync, allocation or virtual call beyond
// what a hand-written loop does, unless a value is due (logging every log_every_n_steps, a
// callback that declared a batch hook, a configured profiler).
#include <fulgur/error.h>

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "distributed/local_launcher.h"
#include "trainer_impl.h"

namespace fulgur {

namespace {

// Sets what Module::log may do for the duration of a hook or step.
class LogContext {
 public:
  LogContext(Module::Binding& b, MetricStore* store, bool training, bool allowed)
      : b_(b), saved_store_(b.metrics), saved_training_(b.training_context), saved_allowed_(b.logging_allowed) {
    b_.metrics = store;
    b_.training_context = training;
    b_.logging_allowed = allowed;
  }
  ~LogContext() {
    b_.metrics = saved_store_;
    b_.training_context = saved_training_;
    b_.logging_allowed = saved_allowed_;
  }

 private:
  Module::Binding& b_;
  MetricStore* saved_store_;
  bool saved_training_, saved_allowed_;
};

// Lightning evaluates under inference mode (or no_grad) with the model in eval mode, then puts
// the model back in the mode it was in.
class EvalMode {
 public:
  EvalMode(torch::nn::Module& m, bool inference) : m_(m), was_training_(m.is_training()) {
    m_.eval();
    if (inference)
      inference_.emplace(true);
    else
      no_grad_.emplace(false);
  }
  ~EvalMode() {
    inference_.reset();
    no_grad_.reset();
    m_.train(was_training_);
  }

 private:
  torch::nn::Module& m_;
  bool was_training_;
  std::optional<c10::InferenceMode> inference_;
  std::optional<c10::AutoGradMode> no_grad_;
};

}  // namespace

Batch Trainer::Impl::transfer(Batch batch) {
  ProfileScope scope(plugins_.profiler.get(), "transfer_batch_to_device");
  batch =
      hooks_.module("on_before_batch_transfer", [&] { return module_->on_before_batch_transfer(std::move(batch)); });
  batch = hooks_.module("transfer_batch_to_device", [&] {
    return module_->transfer_batch_to_device(std::move(batch), plugins_.strategy->root_device());
  });
  batch = hooks_.module("on_after_batch_transfer", [&] { return module_->on_after_batch_transfer(std::move(batch)); });
  plugins_.precision->convert_input(batch);
  return batch;
}

bool Trainer::Impl::time_exceeded() const {
  if (max_time_seconds_ < 0) return false;  // no max_time
  const double elapsed = elapsed_before_resume_ +
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - fit_start_time_).count();
  // Each rank has its own clock: ranks must leave the loop at the same batch, or they would wait
  // in different collectives. Any rank over the limit stops them all.
  if (plugins_.strategy->cluster().world_size > 1)
    return plugins_.strategy->reduce_boolean_decision(elapsed >= max_time_seconds_, /*all=*/false);
  return elapsed >= max_time_seconds_;
}

bool Trainer::Impl::fit_done() const {
  if (max_steps_ >= 0 && pos_.global_step >= max_steps_) return true;
  if (max_epochs_ >= 0 && pos_.epoch >= max_epochs_) return true;
  // A requested stop, and max_time (Lightning's Timer requests one), are honoured once min_epochs
  // and min_steps are met.
  if (pos_.epoch < min_epochs_ || pos_.global_step < min_steps_) return false;
  const bool out_of_time = time_exceeded();  // a collective with several ranks: always asked
  return should_stop_ || out_of_time;
}

void Trainer::Impl::send_row(MetricMap row, int64_t step) {
  if (row.empty() || loggers_.empty()) return;
  row["epoch"] = static_cast<double>(pos_.epoch);
  for_each_logger("log_metrics", [&](Logger& l) { l.log_metrics(row, step); });
  for (const auto& [k, v] : row)
    if (k != "epoch") logged_metrics_[k] = v;
}

void Trainer::Impl::send_step_row() {
  MetricMap metrics = train_metrics_.collect_step(/*logger_only=*/true, false, /*consume=*/true);
  for (const auto& [k, v] : pending_row_) metrics[k] = v;
  pending_row_.clear();
  // Lightning's step for loggers is the number of batches that stepped before this one, which is
  // never negative (a micro-step of an accumulation window belongs to the step it builds).
  send_row(std::move(metrics), row_step_);
}

void Trainer::Impl::log_epoch_metrics(MetricStore& store, bool send_to_loggers) {
  MetricMap all;
  MetricMap for_loggers =
      store.reduce_epoch(plugins_.strategy.get(), /*logger_only=*/true, &progress_bar_metrics_, &all);
  for (const auto& [k, v] : all) callback_metrics_[k] = v;
  if (!send_to_loggers) return;
  for (const auto& [k, v] : pending_row_) for_loggers[k] = v;
  pending_row_.clear();
  send_row(std::move(for_loggers), std::max<int64_t>(0, pos_.global_step - 1));
}

void Trainer::Impl::step_schedulers(SchedulerInterval interval, bool skip_monitored) {
  const int64_t count = interval == SchedulerInterval::step ? pos_.global_step : pos_.epoch + 1;
  for (auto& cfg : optimizer_configs_) {
    if (!cfg.scheduler || cfg.interval != interval || count % cfg.frequency != 0) continue;
    if (cfg.monitor.empty()) {
      cfg.scheduler->step();
      continue;
    }
    if (skip_monitored) continue;
    const MetricMap& metrics = callback_metrics();
    auto it = metrics.find(cfg.monitor);
    if (it == metrics.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : metrics) keys.push_back(k);
      throw Error(ErrorKind::config,
                  fmt::format("the lr scheduler monitors '{}', which was never logged; logged metrics: {}", cfg.monitor,
                              keys.empty() ? "none" : fmt::format("{}", fmt::join(keys, ", "))));
    }
    cfg.scheduler->step(it->second);
  }
}

// ---- fit ----------------------------------------------------------------------------------------

void Trainer::Impl::fit(Module& module, DataModule& data, const std::string& ckpt_path) {
  // The argument wins; otherwise [trainer] ckpt_path (TOML or TrainerOptions) applies to fit.
  const std::string requested =
      restart_ckpt_path(ckpt_path.empty() ? config_.trainer.get_string("ckpt_path") : ckpt_path);
  run_stage(Stage::fit, module, data, [&] {
    binding_.optimizer_step = [this](torch::optim::Optimizer& optimizer) { return step_optimizer(optimizer); };
    binding_.manual_backward = [this](const at::Tensor& loss) {
      hooks_.call(Hook::before_backward, [&](Callback& c) { c.on_before_backward(*this, loss); });
      hooks_.module("on_before_backward", [&] { module_->on_before_backward(loss); });
      plugins_.strategy->backward(loss, *plugins_.precision, true);
      hooks_.call(Hook::after_backward, [&](Callback& c) { c.on_after_backward(*this); });
      hooks_.module("on_after_backward", [&] { module_->on_after_backward(); });
    };
    // Lightning refuses Trainer-level clipping and accumulation under manual optimization: the
    // Trainer does not know when the gradients are final; training_step does.
    if (!module.automatic_optimization && clip_val_ > 0)
      throw Error(ErrorKind::config,
                  fmt::format("[trainer] gradient_clip_val = {} is not supported with manual optimization "
                              "(automatic_optimization = false); call clip_gradients(optimizer, value) in "
                              "training_step before optimizer.step()",
                              clip_val_));
    if (!module.automatic_optimization && accumulate_ != 1)
      throw Error(ErrorKind::config,
                  fmt::format("[trainer] accumulate_grad_batches = {} is not supported with manual optimization "
                              "(automatic_optimization = false); step the optimizer every N batches in "
                              "training_step instead",
                              accumulate_));
    const std::string resolved = requested.empty() ? std::string() : resolve_checkpoint_path(requested, Stage::fit);
    std::optional<ReadCheckpoint> checkpoint;
    if (!resolved.empty()) {
      checkpoint = read_checkpoint(resolved, /*with_optimizer_states=*/true);
      restore_model(*checkpoint);
      restore_callbacks(*checkpoint);
    }
    hooks_.call(Hook::fit_start, [&](Callback& c) { c.on_fit_start(*this); });
    hooks_.module("on_fit_start", [&] { module.on_fit_start(); });
    if (checkpoint) restore_training_state(*checkpoint);
    run_fit();
  });
}

void Trainer::Impl::run_fit() {
  fit_start_time_ = std::chrono::steady_clock::now();
  const SignalScope signals(config_, root_dir_);  // SIGTERM & co. stop at a safe point below
  train_loader_ = data_->train_loader();
  if (!train_loader_) throw Error(ErrorKind::invalid_argument, "the DataModule returned no train_loader()");
  train_loader_->set_replica(plugins_.strategy->data_parallel_rank(), plugins_.strategy->data_parallel_size());
  const Options& t = config_.trainer;
  const bool overfit = [&] {
    const OptionValue& v = t.values().at("overfit_batches");
    return std::holds_alternative<int64_t>(v) ? std::get<int64_t>(v) > 0 : std::get<double>(v) > 0;
  }();
  const int64_t available = train_loader_->num_batches();
  num_train_batches_ = overfit ? apply_batch_limit(t.values().at("overfit_batches"), available)
                               : apply_batch_limit(t.values().at("limit_train_batches"), available);
  if (fast_dev_run_ > 0)
    num_train_batches_ = num_train_batches_ < 0 ? fast_dev_run_ : std::min(num_train_batches_, fast_dev_run_);

  val_loader_ = overfit ? data_->train_loader() : data_->val_loader();
  if (val_loader_) {
    val_loader_->set_replica(plugins_.strategy->data_parallel_rank(), plugins_.strategy->data_parallel_size());
    num_val_batches_ = overfit ? num_train_batches_
                               : apply_batch_limit(t.values().at("limit_val_batches"), val_loader_->num_batches());
    if (fast_dev_run_ > 0)
      num_val_batches_ = num_val_batches_ < 0 ? fast_dev_run_ : std::min(num_val_batches_, fast_dev_run_);
  } else {
    num_val_batches_ = 0;
  }
  const OptionValue& interval = t.values().at("val_check_interval");
  if (const auto* n = std::get_if<int64_t>(&interval)) {
    val_check_batches_ = *n;
  } else {
    const double f = std::get<double>(interval);
    if (f < 1.0 && num_train_batches_ < 0)
      throw Error(ErrorKind::config,
                  fmt::format("[trainer] val_check_interval = {}: a fraction of an epoch needs a train loader of known "
                              "length; this one does not know its length, so give a number of batches (an integer)",
                              f));
    val_check_batches_ =
        f >= 1.0 ? 0 : std::max<int64_t>(1, static_cast<int64_t>(f * static_cast<double>(num_train_batches_)));
  }

  // Sanity check: a few validation batches before training so a broken validation_step fails
  // in seconds, not after an epoch. Its metrics are thrown away.
  if (val_loader_ && num_sanity_val_steps_ != 0 && num_val_batches_ != 0) {
    sanity_checking_ = true;
    hooks_.call(Hook::sanity_check_start, [&](Callback& c) { c.on_sanity_check_start(*this); });
    const int64_t limit = num_sanity_val_steps_ < 0 ? num_val_batches_
                          : num_val_batches_ < 0    ? num_sanity_val_steps_
                                                    : std::min(num_sanity_val_steps_, num_val_batches_);
    run_eval_loop(Stage::validate, *val_loader_, limit, /*sanity=*/true);
    hooks_.call(Hook::sanity_check_end, [&](Callback& c) { c.on_sanity_check_end(*this); });
    sanity_checking_ = false;
    eval_metrics_.clear();
    callback_metrics_.clear();
    progress_bar_metrics_.clear();
  }

  module_->train();
  hooks_.call(Hook::train_start, [&](Callback& c) { c.on_train_start(*this); });
  {
    LogContext log(binding_, &train_metrics_, true, true);
    hooks_.module("on_train_start", [&] { module_->on_train_start(); });
  }
  while (!fit_done()) {
    const int64_t steps_before = pos_.global_step;
    run_train_epoch();
    if (interrupt_due(*this)) interrupt_at_safe_point(*this);
    // A loader that yields nothing would spin forever under max_steps alone.
    if (max_epochs_ < 0 && pos_.global_step == steps_before && epoch_was_empty_ && num_train_batches_ != 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("the train loader yielded no batch in epoch {}; with max_epochs = {} and max_steps = {} "
                              "training cannot progress (check the dataset, batch_size and drop_last)",
                              pos_.epoch - 1, max_epochs_, max_steps_));
  }
  hooks_.call(Hook::train_end, [&](Callback& c) { c.on_train_end(*this); });
  hooks_.module("on_train_end", [&] { module_->on_train_end(); });
  hooks_.call(Hook::fit_end, [&](Callback& c) { c.on_fit_end(*this); });
  hooks_.module("on_fit_end", [&] { module_->on_fit_end(); });
}

bool Trainer::Impl::epoch_batches_done(int64_t batch_idx) const {
  return num_train_batches_ >= 0 && batch_idx >= num_train_batches_;
}

void Trainer::Impl::run_train_epoch() {
  ProfileScope epoch_scope(plugins_.profiler.get(), "run_training_epoch");
  {
    LogContext log(binding_, &train_metrics_, true, true);
    hooks_.call(Hook::train_epoch_start, [&](Callback& c) { c.on_train_epoch_start(*this); });
    hooks_.module("on_train_epoch_start", [&] { module_->on_train_epoch_start(); });
  }
  const int64_t skip = resume_skip_batches_;
  resume_skip_batches_ = 0;
  train_loader_->start_epoch(pos_.epoch, skip);
  batches_done_in_epoch_ = skip;
  epoch_was_empty_ = skip == 0;
  const bool validate_this_epoch =
      val_loader_ && num_val_batches_ != 0 && (pos_.epoch + 1) % check_val_every_n_epoch_ == 0;
  // A loader of unknown length (num_batches() == -1) trains until it is exhausted: the batch
  // after the current one is fetched ahead so that is_last_batch is known before the step.
  std::optional<Batch> next;
  auto fetch = [&] {
    ProfileScope scope(plugins_.profiler.get(), "train_dataloader_next");
    return train_loader_->next();
  };
  if (!epoch_batches_done(skip)) next = fetch();
  for (int64_t batch_idx = skip; next; ++batch_idx) {
    Batch batch = std::move(*next);
    next.reset();
    if (!epoch_batches_done(batch_idx + 1)) next = fetch();
    is_last_batch_ = !next.has_value();
    epoch_was_empty_ = false;
    run_train_batch(batch, batch_idx);
    if (validate_this_epoch && val_check_batches_ > 0 && (batch_idx + 1) % val_check_batches_ == 0 && !is_last_batch_)
      run_validation(false);
    if (interrupt_due(*this)) interrupt_at_safe_point(*this);  // after the step and its validation
    // Mid-epoch, fit_done()'s epoch limit cannot hold yet: this checks max_steps, max_time and a
    // requested stop.
    if (fit_done()) break;
  }
  in_epoch_end_phase_ = true;
  // End-of-epoch validation runs before on_train_epoch_end (Lightning).
  if (validate_this_epoch) run_validation(false);
  {
    // Lightning: values logged at epoch end are epoch-level by default and land in this epoch.
    LogContext log(binding_, &train_metrics_, /*training=*/false, true);
    hooks_.call_where_monitor(Hook::train_epoch_end, false, [&](Callback& c) { c.on_train_epoch_end(*this); });
    hooks_.module("on_train_epoch_end", [&] { module_->on_train_epoch_end(); });
    hooks_.call_where_monitor(Hook::train_epoch_end, true, [&](Callback& c) { c.on_train_epoch_end(*this); });
  }
  log_epoch_metrics(train_metrics_, true);
  step_schedulers(SchedulerInterval::epoch);
  for_each_logger("save", [&](Logger& l) { l.save(); });
  ++pos_.epoch;
  batches_done_in_epoch_ = 0;
  in_epoch_end_phase_ = false;
}

// One optimizer step, for automatic optimization and for OptimizerHandle::step alike (Lightning's
// LightningOptimizer.step -> strategy.optimizer_step -> precision.optimizer_step).
bool Trainer::Impl::step_optimizer(torch::optim::Optimizer& optimizer) {
  // True gradients for callbacks and clipping (16-mixed unscales here).
  plugins_.precision->unscale_gradients(optimizer);
  hooks_.call(Hook::before_optimizer_step, [&](Callback& c) { c.on_before_optimizer_step(*this, optimizer); });
  hooks_.module("on_before_optimizer_step", [&] { module_->on_before_optimizer_step(optimizer); });
  if (clip_val_ > 0) plugins_.strategy->clip_gradients(optimizer, *plugins_.precision, clip_val_, clip_algorithm_);
  ProfileScope scope(plugins_.profiler.get(), "optimizer_step");
  return plugins_.strategy->optimizer_step(optimizer, *plugins_.precision);
}

void Trainer::Impl::run_train_batch(Batch& batch, int64_t batch_idx) {
  ProfileScope batch_scope(plugins_.profiler.get(), "run_training_batch");
  const bool boundary = (batch_idx + 1) % accumulate_ == 0 || is_last_batch_;
  const bool steps = !module_->automatic_optimization || boundary;
  // The row this batch's metrics go to: the optimizer steps before it (Lightning's
  // _batches_that_stepped), due every log_every_n_steps steps and on the last batch.
  row_step_ = pos_.global_step;
  step_row_due_ = (pos_.global_step + (steps ? 1 : 0)) % log_every_n_steps_ == 0 || is_last_batch_;
  batch = transfer(std::move(batch));
  binding_.batch_size = batch.size();
  LogContext log(binding_, &train_metrics_, /*training=*/true, /*allowed=*/true);
  in_train_batch_ = true;
  hooks_.call(Hook::train_batch_start, [&](Callback& c) { c.on_train_batch_start(*this, batch, batch_idx); });
  hooks_.module("on_train_batch_start", [&] { module_->on_train_batch_start(batch, batch_idx); });
  // Gradient accumulation: only the last micro-step of a window synchronizes (DDP's no_sync).
  plugins_.strategy->before_training_step(steps);

  StepOutput output;
  if (!module_->automatic_optimization) {
    PrecisionScope precision_scope(*plugins_.precision);
    ProfileScope scope(plugins_.profiler.get(), "training_step");
    output = module_->training_step(batch, batch_idx);
  } else {
    torch::optim::Optimizer& optimizer = *optimizer_ptrs_.front();
    const bool window_start = batch_idx % accumulate_ == 0;
    {
      PrecisionScope precision_scope(*plugins_.precision);
      ProfileScope scope(plugins_.profiler.get(), "training_step");
      output = module_->training_step(batch, batch_idx);
    }
    if (output.loss.defined()) {  // an undefined loss skips backward and the step (Lightning: None)
      at::Tensor loss = accumulate_ > 1 ? output.loss / static_cast<double>(accumulate_) : output.loss;
      if (window_start) {
        hooks_.call(Hook::before_zero_grad, [&](Callback& c) { c.on_before_zero_grad(*this, optimizer); });
        hooks_.module("on_before_zero_grad", [&] { module_->on_before_zero_grad(optimizer); });
        ProfileScope scope(plugins_.profiler.get(), "optimizer_zero_grad");
        optimizer.zero_grad(/*set_to_none=*/true);
      }
      hooks_.call(Hook::before_backward, [&](Callback& c) { c.on_before_backward(*this, loss); });
      hooks_.module("on_before_backward", [&] { module_->on_before_backward(loss); });
      {
        ProfileScope scope(plugins_.profiler.get(), "backward");
        plugins_.strategy->backward(loss, *plugins_.precision, /*sync_gradients=*/boundary);
      }
      hooks_.call(Hook::after_backward, [&](Callback& c) { c.on_after_backward(*this); });
      hooks_.module("on_after_backward", [&] { module_->on_after_backward(); });
      if (boundary) {
        step_optimizer(optimizer);
        ++pos_.global_step;
        step_schedulers(SchedulerInterval::step);
      }
    }
  }
  if (!module_->automatic_optimization) {
    // Manual optimization: a batch counts as a step when any optimizer stepped; Lightning counts
    // optimizer.step() calls. We count batches, which is what users of a single optimizer expect.
    ++pos_.global_step;
  }
  batches_done_in_epoch_ = batch_idx + 1;  // what a checkpoint written from the hooks below records
  hooks_.call(Hook::train_batch_end, [&](Callback& c) { c.on_train_batch_end(*this, output, batch, batch_idx); });
  hooks_.module("on_train_batch_end", [&] { module_->on_train_batch_end(output, batch, batch_idx); });
  in_train_batch_ = false;
  if (step_row_due_ || should_stop_) send_step_row();
  step_row_due_ = false;
}

void Trainer::Impl::run_validation(bool sanity) {
  run_eval_loop(Stage::validate, *val_loader_, num_val_batches_, sanity);
}

MetricMap Trainer::Impl::run_eval_loop(Stage stage, BatchLoader& loader, int64_t limit, bool sanity) {
  ProfileScope loop_scope(plugins_.profiler.get(),
                          stage == Stage::test ? "run_test_evaluation" : "run_validation_evaluation");
  EvalMode eval_mode(*module_, inference_mode_);
  const bool test = stage == Stage::test;
  hooks_.call(test ? Hook::test_start : Hook::validation_start,
              [&](Callback& c) { test ? c.on_test_start(*this) : c.on_validation_start(*this); });
  {
    LogContext log(binding_, &eval_metrics_, false, true);
    hooks_.call(test ? Hook::test_epoch_start : Hook::validation_epoch_start,
                [&](Callback& c) { test ? c.on_test_epoch_start(*this) : c.on_validation_epoch_start(*this); });
    hooks_.module(test ? "on_test_epoch_start" : "on_validation_epoch_start",
                  [&] { test ? module_->on_test_epoch_start() : module_->on_validation_epoch_start(); });
  }
  loader.start_epoch(0);
  // limit < 0: a loader of unknown length, evaluated until exhausted.
  for (int64_t batch_idx = 0; limit < 0 || batch_idx < limit; ++batch_idx) {
    std::optional<Batch> next;
    {
      ProfileScope scope(plugins_.profiler.get(), test ? "test_dataloader_next" : "val_dataloader_next");
      next = loader.next();
    }
    if (!next) break;
    Batch batch = transfer(std::move(*next));
    binding_.batch_size = batch.size();
    LogContext log(binding_, &eval_metrics_, false, true);
    hooks_.call(test ? Hook::test_batch_start : Hook::validation_batch_start, [&](Callback& c) {
      test ? c.on_test_batch_start(*this, batch, batch_idx) : c.on_validation_batch_start(*this, batch, batch_idx);
    });
    StepOutput out;
    {
      PrecisionScope precision_scope(*plugins_.precision);
      ProfileScope scope(plugins_.profiler.get(), test ? "test_step" : "validation_step");
      out = test ? module_->test_step(batch, batch_idx) : module_->validation_step(batch, batch_idx);
    }
    hooks_.call(test ? Hook::test_batch_end : Hook::validation_batch_end, [&](Callback& c) {
      test ? c.on_test_batch_end(*this, out, batch, batch_idx)
           : c.on_validation_batch_end(*this, out, batch, batch_idx);
    });
  }
  {
    LogContext log(binding_, &eval_metrics_, false, true);
    hooks_.call(test ? Hook::test_epoch_end : Hook::validation_epoch_end,
                [&](Callback& c) { test ? c.on_test_epoch_end(*this) : c.on_validation_epoch_end(*this); });
    hooks_.module(test ? "on_test_epoch_end" : "on_validation_epoch_end",
                  [&] { test ? module_->on_test_epoch_end() : module_->on_validation_epoch_end(); });
  }
  MetricMap all;
  MetricMap for_loggers = eval_metrics_.reduce_epoch(plugins_.strategy.get(), true, &progress_bar_metrics_, &all);
  if (!sanity) {
    for (const auto& [k, v] : all) callback_metrics_[k] = v;
    send_row(std::move(for_loggers), std::max<int64_t>(0, pos_.global_step - 1));
  }
  hooks_.call(test ? Hook::test_end : Hook::validation_end,
              [&](Callback& c) { test ? c.on_test_end(*this) : c.on_validation_end(*this); });
  return all;
}

// ---- validate / test / predict ------------------------------------------------------------------

std::vector<MetricMap> Trainer::Impl::evaluate(Stage stage, Module& module, DataModule& data,
                                               const std::string& ckpt_path) {
  MetricMap results;
  run_stage(stage, module, data, [&] {
    if (!ckpt_path.empty()) {
      restore_model(read_checkpoint(resolve_checkpoint_path(ckpt_path, stage), /*with_optimizer_states=*/false));
    }
    std::unique_ptr<BatchLoader> loader = stage == Stage::test ? data.test_loader() : data.val_loader();
    if (!loader)
      throw Error(ErrorKind::invalid_argument, fmt::format("the DataModule returned no {}_loader() for Trainer::{}",
                                                           stage == Stage::test ? "test" : "val", to_string(stage)));
    loader->set_replica(plugins_.strategy->data_parallel_rank(), plugins_.strategy->data_parallel_size());
    const char* limit_key = stage == Stage::test ? "limit_test_batches" : "limit_val_batches";
    num_eval_batches_ = apply_batch_limit(config_.trainer.values().at(limit_key), loader->num_batches());
    if (fast_dev_run_ > 0)
      num_eval_batches_ = num_eval_batches_ < 0 ? fast_dev_run_ : std::min(num_eval_batches_, fast_dev_run_);
    eval_metrics_.clear();
    results = run_eval_loop(stage, *loader, num_eval_batches_, false);
  });
  // Only the epoch-level keys, without the "_epoch" duplicates (Lightning's returned dict).
  MetricMap clean;
  for (const auto& [k, v] : results)
    if (!k.ends_with("_epoch")) clean[k] = v;
  return {clean};
}

std::vector<at::Tensor> Trainer::Impl::predict(Module& module, DataModule& data, const std::string& ckpt_path) {
  std::vector<at::Tensor> predictions;
  run_stage(Stage::predict, module, data, [&] {
    if (!ckpt_path.empty()) {
      restore_model(
          read_checkpoint(resolve_checkpoint_path(ckpt_path, Stage::predict), /*with_optimizer_states=*/false));
    }
    std::unique_ptr<BatchLoader> loader = data.predict_loader();
    if (!loader) throw Error(ErrorKind::invalid_argument, "the DataModule returned no predict_loader()");
    loader->set_replica(plugins_.strategy->data_parallel_rank(), plugins_.strategy->data_parallel_size());
    num_eval_batches_ = apply_batch_limit(config_.trainer.values().at("limit_predict_batches"), loader->num_batches());
    if (fast_dev_run_ > 0)
      num_eval_batches_ = num_eval_batches_ < 0 ? fast_dev_run_ : std::min(num_eval_batches_, fast_dev_run_);
    predictions = run_predict_loop(module, *loader);
  });
  return predictions;
}

std::vector<at::Tensor> Trainer::Impl::run_predict_loop(Module& module, BatchLoader& loader) {
  std::vector<at::Tensor> predictions;
  EvalMode eval_mode(module, inference_mode_);
  LogContext log(binding_, nullptr, false, false);
  hooks_.call(Hook::predict_start, [&](Callback& c) { c.on_predict_start(*this); });
  hooks_.call(Hook::predict_epoch_start, [&](Callback& c) { c.on_predict_epoch_start(*this); });
  loader.start_epoch(0);
  for (int64_t batch_idx = 0; num_eval_batches_ < 0 || batch_idx < num_eval_batches_; ++batch_idx) {
    std::optional<Batch> next = loader.next();
    if (!next) break;
    Batch batch = transfer(std::move(*next));
    hooks_.call(Hook::predict_batch_start, [&](Callback& c) { c.on_predict_batch_start(*this, batch, batch_idx); });
    at::Tensor prediction;
    {
      PrecisionScope precision_scope(*plugins_.precision);
      ProfileScope scope(plugins_.profiler.get(), "predict_step");
      prediction = module.predict_step(batch, batch_idx);
    }
    hooks_.call(Hook::predict_batch_end,
                [&](Callback& c) { c.on_predict_batch_end(*this, prediction, batch, batch_idx); });
    predictions.push_back(prediction);
  }
  hooks_.call(Hook::predict_epoch_end, [&](Callback& c) { c.on_predict_epoch_end(*this); });
  hooks_.call(Hook::predict_end, [&](Callback& c) { c.on_predict_end(*this); });
  return predictions;
}

}  // namespace fulgur
