// Internal: TrainerEngine, the engine behind the public Trainer facade: it implements the
// TrainerContext plugins see, owns the plugins, loops and connectors, and runs the stage funnel.
// It is split the way Lightning splits its trainer:
//   trainer.cpp                 construction, the TrainerContext capabilities, the stage funnel,
//                               and fit / validate / test / predict as short scripts over these:
//   resolved_trainer_config.*   the Config's [trainer] table, checked and resolved
//   connectors/plugin_*         which plugins run (config -> registry -> objects, the default set)
//   connectors/logger_*         metric stores, rows to loggers, logger lifecycle
//   connectors/checkpoint_*     checkpoint assembly and restore, through the strategy's parts
//   hook_dispatcher.*           the one path of every hook call (profiling, error attribution)
//   loops/                      fit, training epoch, evaluation and prediction loops, each with
//                               its own state and state dict
#pragma once

#include <fulgur/checkpoint_queue.h>
#include <fulgur/data_module.h>
#include <fulgur/module.h>
#include <fulgur/scheduler_names.h>
#include <fulgur/storage_root.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "binding.h"
#include "capture/fused_adam_step.h"
#include "connectors/checkpoint_connector.h"
#include "connectors/logger_connector.h"
#include "connectors/plugin_connector.h"
#include "connectors/signal_connector.h"
#include "hook_dispatcher.h"
#include "loops/evaluation_loop.h"
#include "loops/fit_loop.h"
#include "loops/prediction_loop.h"
#include "resolved_trainer_config.h"

namespace fulgur {

class TrainerEngine final : public WithExtensions<TrainerContext, SchedulerNames, CheckpointSaveQueue, StorageRoot> {
 public:
  explicit TrainerEngine(Config config);
  ~TrainerEngine() override;

  // ---- TrainerContext -------------------------------------------------------------------------
  Stage stage() const override { return stage_; }
  bool sanity_checking() const override { return sanity_checking_; }
  int64_t current_epoch() const override { return fit_loop_.position().epoch; }
  int64_t global_step() const override { return fit_loop_.position().global_step; }
  int64_t max_epochs() const override { return trainer_config_.max_epochs; }
  int64_t max_steps() const override { return trainer_config_.max_steps; }
  int64_t num_batches(Stage stage) const override;
  bool is_last_batch() const override { return fit_loop_.epoch_loop().is_last_batch(); }
  int64_t dataloader_idx() const override;
  const MetricMap& callback_metrics() const override { return logging_.callback_metrics(); }
  const MetricMap& progress_bar_metrics() const override { return logging_.progress_bar_metrics(); }
  bool step_logging_due() const override { return fit_loop_.epoch_loop().step_row_due() || should_stop_; }
  void log_metrics(const MetricMap& metrics, std::string_view owner) override { logging_.log_metrics(metrics, owner); }
  bool has_logger() const override { return logging_.has_logger(); }
  const ClusterInfo& cluster() const override;
  c10::Device device() const override;
  std::string broadcast(const std::string& value, int64_t src) override;
  bool agree(bool decision, bool all) override;
  at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) override;
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override;
  void barrier(std::string_view name) override;
  void synchronize_device() override;
  MetricMap device_stats() const override;
  std::string device_name() const override;
  c10::ScalarType compute_dtype() const override;
  bool should_stop() const override { return should_stop_; }
  void request_stop(std::string_view reason) override;
  int64_t accumulate_grad_batches() const override { return trainer_config_.accumulate_grad_batches; }
  void set_accumulate_grad_batches(int64_t n) override;
  const std::string& default_root_dir() const override { return trainer_config_.default_root_dir; }
  std::string log_dir() const override { return logging_.log_dir(); }
  void save_checkpoint(const std::string& path, bool weights_only) override { checkpoints_.save(path, weights_only); }
  int64_t train_batch_size() const override;
  void set_train_batch_size(int64_t n) override;
  BatchSizeTrial run_batch_size_trial(int64_t batch_size, int64_t steps) override;
  torch::nn::Module& model() override;
  std::vector<torch::optim::Optimizer*> optimizers() override { return optimizer_ptrs_; }
  // ---- SchedulerNames -------------------------------------------------------------------------
  std::vector<std::string> scheduler_names() const override;
  // ---- CheckpointSaveQueue ([trainer] async_checkpoint) ---------------------------------------
  std::string pending_save() const override { return checkpoints_.pending_save(); }
  void after_pending_save(std::function<void()> action) override { checkpoints_.after_pending_save(std::move(action)); }
  // ---- StorageRoot ([trainer] default_root_dir = "s3://...") ----------------------------------
  std::string default_root_url() const override { return trainer_config_.default_root_url; }
  std::string log_url() const override { return logging_.log_url(); }

  int64_t global_rank() const { return environment_ready_ ? plugins_.strategy->cluster().global_rank : 0; }
  // The process group every rank joined (null with one process): the loops' own votes use it.
  std::shared_ptr<Communicator> world_communicator() const { return world_communicator_.lock(); }

  // ---- entry points ---------------------------------------------------------------------------
  void fit(Module& module, DataModule& data, const std::string& ckpt_path);
  std::vector<MetricMap> evaluate(Stage stage, Module& module, DataModule& data, const std::string& ckpt_path);
  std::vector<at::Tensor> predict(Module& module, DataModule& data, const std::string& ckpt_path);
  void add_callback(std::shared_ptr<Callback> callback, std::string name);

  const Config& config() const { return config_; }
  const MetricMap& logged_metrics() const { return logging_.logged_metrics(); }
  // The test seam for plugin state (precision scaler state in tests).
  Precision& precision() { return *plugins_.precision; }
  Strategy& strategy() { return *plugins_.strategy; }

 private:
  // The loops and connectors are the Trainer's parts: they read its resolved [trainer] values and plugins and
  // drive its hooks, as Lightning's loops hold their trainer.
  friend class FitLoop;
  friend class TrainingEpochLoop;
  friend class EvaluationLoop;
  friend class PredictionLoop;
  friend class LoggerConnector;
  friend class CheckpointConnector;
  friend class StepCapture;

  // The stage funnel: attach, prepare_data + barrier, setup hooks, the model built and placed
  // under the strategy (and optimizers for fit), loggers and profiler, then `body`; a failure
  // runs on_exception, finalizes the loggers as failed and is rethrown; teardown always runs.
  void run_stage(Stage stage, Module& module, DataModule& data, const std::function<void()>& body);
  void attach(Module& module, DataModule& data, Stage stage);
  void build_model(Module& module);
  void setup_optimizers(Module& module);
  void setup_environment_once();
  StrategyEnvironment make_strategy_environment();
  void finish_stage(Stage stage, RunStatus status);
  // Lightning refuses Trainer-level clipping and accumulation under manual optimization.
  void check_manual_optimization(const Module& module) const;
  // The loaders of `stage` (validate and test: every one of the DataModule's; predict: one), set
  // up for this rank, and each one's batch limit.
  std::vector<std::unique_ptr<BatchLoader>> stage_loaders(Stage stage, std::vector<int64_t>& limits);

  // Shared by the loops: a batch through the module's transfer hooks and the precision's input
  // conversion; the LR schedulers of `interval` that are due.
  Batch transfer(Batch batch);
  // run_batch_size_trial's preconditions (a fit not yet training, one process, a DataModule that
  // offers its batch size); `what` names the caller in the error.
  void check_batch_size_change(std::string_view what) const;
  // One trial batch (batch_size_trial.cpp): the step, backward and optimizer step, no hooks.
  void run_trial_batch(Batch batch, int64_t batch_idx);
  void step_schedulers(SchedulerInterval interval, bool skip_monitored = false);
  // The optimizer's host state as the fused steps left it (their step counts are on the device
  // when the precision decides steps there): before a checkpoint or anything else reads it.
  void sync_optimizer_host_state();

  Config config_;
  ResolvedTrainerConfig trainer_config_;
  PluginSet plugins_;
  const Profiler* profiler_ptr_ = nullptr;

  // Loops first: the hook dispatcher reports the fit loop's position in its errors.
  FitLoop fit_loop_{*this};
  EvaluationLoop validate_loop_{*this, Stage::validate};
  EvaluationLoop test_loop_{*this, Stage::test};
  PredictionLoop predict_loop_{*this};
  HookDispatcher hooks_{profiler_ptr_, fit_loop_.position()};
  LoggerConnector logging_{*this};
  CheckpointConnector checkpoints_{*this};

  // What the current stage runs on.
  Module* module_ = nullptr;
  DataModule* data_ = nullptr;
  Module::Binding binding_;
  std::vector<OptimizerConfig> optimizer_configs_;
  std::vector<torch::optim::Optimizer*> optimizer_ptrs_;
  // During fit, the single Adam/AdamW of automatic optimization stepped by fused kernels: by
  // captured steps (cuda_graphs) and where the precision decides steps on the device (16-mixed).
  std::unique_ptr<FusedAdamStep> fused_adam_;
  Stage stage_ = Stage::fit;
  bool sanity_checking_ = false;
  bool should_stop_ = false;
  std::string stop_reason_;
  bool environment_ready_ = false;
  std::weak_ptr<Communicator> world_communicator_;  // the strategy owns it
};

}  // namespace fulgur
