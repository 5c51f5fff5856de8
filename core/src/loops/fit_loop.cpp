#include "fit_loop.h"

#include <fulgur/error.h>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "../device_rng.h"
#include "../ivalue_dict.h"
#include "../trainer_engine.h"
#include "lightning_progress.h"
#include "loop_scopes.h"

namespace fulgur {

namespace {

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

void FitLoop::run() {
  TrainerEngine& t = trainer_;
  running_ = true;
  struct Finished {
    bool& running;
    ~Finished() { running = false; }
  } finished{running_};
  const SignalScope signals(t.config_, t.trainer_config_.checkpoint_root());  // SIGTERM & co.: safe points below
  setup_data();
  run_sanity_check();
  if (epoch_loop_.num_batches() == 0) {
    // Lightning's fit loop skips training (and its validation) when there is no training batch:
    // limit_train_batches = 0, or an empty train loader of known length.
    spdlog::info("fit stopped: no training batches (limit_train_batches = 0 or an empty train loader)");
    return;
  }

  t.module_->train();
  t.hooks_.call(Hook::train_start, [&](Callback& c) { c.on_train_start(t); });
  {
    // Lightning's defaults there: on_step = false, on_epoch = true (the training epoch's values).
    LogContext log(t.binding_, &t.logging_.train_metrics(), /*training=*/false, true);
    t.hooks_.module("on_train_start", [&] { t.module_->on_train_start(); });
  }
  const int64_t reload = t.trainer_config_.reload_dataloaders_every_n_epochs;
  epoch_loop_.start_validation_clock();
  while (!done()) {
    const int64_t steps_before = position_.global_step;
    if (reload > 0 && position_.epoch - loaders_epoch_ >= reload) setup_data();
    epoch_loop_.run(*train_loader_);
    if (interrupt_due(t)) interrupt_at_safe_point(t);
    // A loader that yields nothing would spin forever under max_steps alone.
    if (t.trainer_config_.max_epochs < 0 && position_.global_step == steps_before &&
        epoch_loop_.last_epoch_was_empty() && epoch_loop_.num_batches() != 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("the train loader yielded no batch in epoch {}; with max_epochs = {} and max_steps = {} "
                              "training cannot progress (check the dataset, batch_size and drop_last)",
                              position_.epoch - 1, t.trainer_config_.max_epochs, t.trainer_config_.max_steps));
  }
  t.sync_optimizer_host_state();  // on_train_end and on_fit_end may read the optimizer's state
  t.hooks_.call(Hook::train_end, [&](Callback& c) { c.on_train_end(t); });
  t.hooks_.module("on_train_end", [&] { t.module_->on_train_end(); });
}

void FitLoop::setup_data() {
  TrainerEngine& t = trainer_;
  const ResolvedTrainerConfig& s = t.trainer_config_;
  Strategy& strategy = *t.plugins_.strategy;
  train_loader_ = t.data_->train_loader();
  if (!train_loader_) throw Error(ErrorKind::invalid_argument, "the DataModule returned no train_loader()");
  if (s.use_distributed_sampler)
    train_loader_->set_replica(strategy.data_parallel_rank(), strategy.data_parallel_size());
  const int64_t available = train_loader_->num_batches();
  int64_t num_train =
      s.overfit ? apply_batch_limit(s.overfit_batches, available) : apply_batch_limit(s.limit_train_batches, available);
  if (s.fast_dev_run > 0) num_train = num_train < 0 ? s.fast_dev_run : std::min(num_train, s.fast_dev_run);

  // overfit_batches validates on the training batches, as Lightning does.
  val_loaders_.clear();
  if (s.overfit)
    val_loaders_.push_back(t.data_->train_loader());
  else
    val_loaders_ = t.data_->val_loaders();
  std::vector<BatchLoader*> loaders;
  std::vector<int64_t> limits;
  for (auto& loader : val_loaders_) {
    if (!loader) throw Error(ErrorKind::invalid_argument, "the DataModule returned a null loader in val_loaders()");
    if (s.use_distributed_sampler) loader->set_replica(strategy.data_parallel_rank(), strategy.data_parallel_size());
    int64_t num_val = s.overfit ? num_train : apply_batch_limit(s.limit_val_batches, loader->num_batches());
    if (s.fast_dev_run > 0) num_val = num_val < 0 ? s.fast_dev_run : std::min(num_val, s.fast_dev_run);
    loaders.push_back(loader.get());
    limits.push_back(num_val);
  }
  epoch_loop_.val_loop().set_loaders(std::move(loaders), std::move(limits));
  loaders_epoch_ = position_.epoch;

  int64_t val_check_batches = 0;
  double val_check_seconds = 0;
  if (const auto* n = std::get_if<int64_t>(&s.val_check_interval)) {
    val_check_batches = *n;
  } else if (const auto* text = std::get_if<std::string>(&s.val_check_interval)) {
    // Wall-clock cadence; fast_dev_run validates at the epoch's end, as Lightning's does.
    if (s.fast_dev_run == 0) val_check_seconds = parse_duration(*text).value_or(0);
  } else {
    const double f = std::get<double>(s.val_check_interval);
    if (f < 1.0 && num_train < 0)
      throw Error(ErrorKind::config,
                  fmt::format("[trainer] val_check_interval = {}: a fraction of an epoch needs a train loader of known "
                              "length; this one does not know its length, so give a number of batches (an integer)",
                              f));
    val_check_batches = f >= 1.0 ? 0 : std::max<int64_t>(1, static_cast<int64_t>(f * static_cast<double>(num_train)));
  }
  epoch_loop_.configure(num_train, val_check_batches, val_check_seconds);
}

// A few validation batches before training so that a broken validation_step fails in seconds,
// not after an epoch. Its metrics are thrown away.
void FitLoop::run_sanity_check() {
  TrainerEngine& t = trainer_;
  const int64_t steps = t.trainer_config_.num_sanity_val_steps;
  EvaluationLoop& val_loop = epoch_loop_.val_loop();
  if (steps == 0 || !val_loop.has_batches()) return;
  t.sanity_checking_ = true;
  t.hooks_.call(Hook::sanity_check_start, [&](Callback& c) { c.on_sanity_check_start(t); });
  // num_sanity_val_steps batches of each loader (-1: all of them). The sanity pass leaves the
  // validation loop's progress as it was.
  const c10::IValue progress = val_loop.state_dict();
  val_loop.run(/*sanity=*/true, steps < 0 ? -1 : steps);
  val_loop.load_state_dict(progress, "<sanity check>");
  t.hooks_.call(Hook::sanity_check_end, [&](Callback& c) { c.on_sanity_check_end(t); });
  t.sanity_checking_ = false;
  t.logging_.clear_after_sanity_check();
}

bool FitLoop::done() {
  const ResolvedTrainerConfig& s = trainer_.trainer_config_;
  if (s.max_steps >= 0 && position_.global_step >= s.max_steps) return true;
  if (s.max_epochs >= 0 && position_.epoch >= s.max_epochs) return true;
  // A requested stop (max_time's Timer requests one) is honoured once min_epochs and min_steps
  // are met.
  if (position_.epoch < s.min_epochs || position_.global_step < s.min_steps) return false;
  return trainer_.should_stop_;
}

c10::IValue FitLoop::state_dict() const {
  auto state = string_dict();
  state.insert("epoch", position_.epoch);
  state.insert("cpu_rng_state", cpu_rng_state());
  save_device_rng_state(state, trainer_.device());
  epoch_loop_.state_dict(state);
  // Lightning 2.6's _FitLoop reads "state_dict" and "epoch_progress" (the epoch loop adds its
  // "epoch_loop.*" keys). The epoch counters as Lightning's checkpoint at the same hook has them:
  // in the epoch-end phase epoch e is processed but not completed (Lightning then resumes at
  // epoch e + 1), mid-epoch it is started but not processed, between epochs all equal e.
  const int64_t e = position_.epoch;
  lightning::Counts epochs = lightning::Counts::all(e);
  if (epoch_loop_.in_epoch_end_phase())
    epochs = {e + 1, e + 1, e + 1, e};
  else if (epoch_loop_.batches_done_in_epoch() > 0)
    epochs = {e + 1, e + 1, e, e};
  state.insert("state_dict", lightning::empty_state());
  state.insert("epoch_progress", lightning::progress(epochs, epochs));
  return state;
}

void FitLoop::load_state_dict(const c10::IValue& state, const std::string& path) {
  const auto dict = as_dict(state, "loops.fit_loop", path);
  position_.epoch = require_key(dict, "epoch", path, "").toInt();
  // Checkpoints from before max_time became the Timer also hold "elapsed_seconds": the Timer keeps
  // that time in its own state now (callbacks["Timer"]), so it is not read.
  set_cpu_rng_state(require_key(dict, "cpu_rng_state", path, "").toTensor());
  load_device_rng_state(dict, trainer_.device(), path);
  if (epoch_loop_.load_state_dict(dict, path)) {
    // Saved during the epoch-end work: that epoch is complete. Finish what comes after the
    // callbacks (epoch schedulers; plateau ones need metrics that are not saved, as in Lightning).
    trainer_.step_schedulers(SchedulerInterval::epoch, /*skip_monitored=*/true);
    ++position_.epoch;
  }
}

}  // namespace fulgur
