// Internal: the Trainer's state and the TrainerContext plugins see. Split by concern:
//   trainer.cpp          construction, the TrainerContext capabilities, the stage funnel
//   plugin_connector.cpp which plugins run (config -> registry -> objects, the default set)
//   hook_dispatcher.*    the one path of every hook call (profiling, error attribution)
//   loops.cpp            fit / training epoch / evaluation / prediction loops
//   checkpoint.cpp       checkpoint assembly and restore, through the strategy's parts
#pragma once

#include <fulgur/accelerator.h>
#include <fulgur/callback.h>
#include <fulgur/data.h>
#include <fulgur/logger.h>
#include <fulgur/module.h>
#include <fulgur/precision.h>
#include <fulgur/profiler.h>
#include <fulgur/registry/registry.h>
#include <fulgur/strategy.h>
#include <fulgur/trainer.h>
#include <fulgur/trainer_context.h>

#include <chrono>
#include <functional>
#include <optional>

#include "binding.h"
#include "hook_dispatcher.h"
#include "metrics.h"
#include "signal_connector.h"

namespace fulgur {

// Batch limits from limit_*_batches: an integer is a count, a float a fraction of the loader.
// Unknown lengths (-1) stay unknown unless the limit is a count.
int64_t apply_batch_limit(const OptionValue& limit, int64_t available);
// "DD:HH:MM:SS" (fewer fields count from the right) in seconds; throws fulgur::Error(config).
double parse_max_time(const std::string& text);
// Every [trainer] value check the Trainer makes, without building anything (config check uses it).
void validate_trainer_values(const Config& config);

// The plugin objects of a run, created from the config (plugin_connector.cpp).
struct PluginSet {
  std::unique_ptr<PluginRegistry> registry;
  std::shared_ptr<Accelerator> accelerator;
  std::shared_ptr<Strategy> strategy;
  std::shared_ptr<Precision> precision;
  std::shared_ptr<Profiler> profiler;
  std::vector<std::shared_ptr<Logger>> loggers;
  std::vector<PluginIdentity> logger_identities;
  struct CallbackEntry {
    std::shared_ptr<Callback> callback;
    PluginIdentity identity;
  };
  std::vector<CallbackEntry> callbacks;
};
PluginSet connect_plugins(Config& config, bool fast_dev_run);

class Trainer::Impl final : public TrainerContext {
 public:
  explicit Impl(Config config);
  ~Impl() override;

  // ---- TrainerContext -------------------------------------------------------------------------
  Stage stage() const override { return stage_; }
  bool sanity_checking() const override { return sanity_checking_; }
  int64_t current_epoch() const override { return pos_.epoch; }
  int64_t global_step() const override { return pos_.global_step; }
  int64_t max_epochs() const override { return max_epochs_; }
  int64_t max_steps() const override { return max_steps_; }
  int64_t num_batches(Stage stage) const override;
  bool is_last_batch() const override { return is_last_batch_; }
  const MetricMap& callback_metrics() const override;
  const MetricMap& progress_bar_metrics() const override;
  bool step_logging_due() const override { return step_row_due_ || should_stop_; }
  void log_metrics(const MetricMap& metrics, std::string_view owner) override;
  bool has_logger() const override { return !loggers_.empty(); }
  const ClusterInfo& cluster() const override;
  c10::Device device() const override;
  std::string broadcast(const std::string& value, int64_t src) override;
  bool agree(bool decision, bool all) override;
  at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) override;
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override;
  void barrier(std::string_view name) override;
  void synchronize_device() override;
  MetricMap device_stats() const override;
  bool should_stop() const override { return should_stop_; }
  void request_stop(std::string_view reason) override;
  const std::string& default_root_dir() const override { return root_dir_; }
  std::string log_dir() const override;
  void save_checkpoint(const std::string& path, bool weights_only) override;
  torch::nn::Module& model() override;
  std::vector<torch::optim::Optimizer*> optimizers() override { return optimizer_ptrs_; }

  int64_t global_rank() const { return environment_ready_ ? plugins_.strategy->cluster().global_rank : 0; }

  // ---- entry points ---------------------------------------------------------------------------
  void fit(Module& module, DataModule& data, const std::string& ckpt_path);
  std::vector<MetricMap> evaluate(Stage stage, Module& module, DataModule& data, const std::string& ckpt_path);
  std::vector<at::Tensor> predict(Module& module, DataModule& data, const std::string& ckpt_path);
  void add_callback(std::shared_ptr<Callback> callback, std::string name);

  const Config& config() const { return config_; }
  const MetricMap& logged_metrics() const { return logged_metrics_; }
  // The test seam for plugin state (precision scaler state in tests).
  Precision& precision() { return *plugins_.precision; }
  Strategy& strategy() { return *plugins_.strategy; }

 private:
  friend class Trainer;

  // The stage funnel: attach, prepare_data + barrier, setup hooks, the model built and placed
  // under the strategy (and optimizers for fit), loggers and profiler, then `body`; a failure
  // runs on_exception, finalizes the loggers as failed and is rethrown; teardown always runs.
  void run_stage(Stage stage, Module& module, DataModule& data, const std::function<void()>& body);
  void attach(Module& module, DataModule& data, Stage stage);
  void build_model(Module& module, Stage stage);
  void setup_optimizers(Module& module);
  void setup_environment_once();
  StrategyEnvironment make_strategy_environment();
  void setup_loggers_once();
  void finish_stage(Stage stage, RunStatus status);
  template <class Fn>
  void for_each_logger(const char* method, Fn&& fn) {
    for (size_t i = 0; i < loggers_.size(); ++i)
      hooks_.logger(plugins_.logger_identities[i], method, [&] { fn(*loggers_[i]); });
  }

  // Loops (loops.cpp).
  void run_fit();
  void run_train_epoch();
  void run_train_batch(Batch& batch, int64_t batch_idx);
  bool step_optimizer(torch::optim::Optimizer& optimizer);
  void run_validation(bool sanity);
  MetricMap run_eval_loop(Stage stage, BatchLoader& loader, int64_t limit, bool sanity);
  std::vector<at::Tensor> run_predict_loop(Module& module, BatchLoader& loader);
  Batch transfer(Batch batch);
  void send_step_row();
  void log_epoch_metrics(MetricStore& store, bool send_to_loggers);
  void send_row(MetricMap row, int64_t step);
  bool time_exceeded() const;
  bool fit_done() const;
  bool epoch_batches_done(int64_t batch_idx) const;
  void step_schedulers(SchedulerInterval interval, bool skip_monitored = false);

  // Checkpoints (checkpoint.cpp).
  // A checkpoint as the strategy read it, in parts.
  struct ReadCheckpoint {
    std::string path;
    std::shared_ptr<c10::IValue> model_state, metadata;  // metadata: a dict of the other keys
    std::vector<c10::IValue> optimizer_states;           // empty: a weights-only checkpoint
  };
  c10::IValue dump_metadata(bool weights_only);
  // "" when ckpt_path is "last" in fit and no last checkpoint exists yet (a first run starts
  // fresh, with a warning, as Lightning does).
  std::string resolve_checkpoint_path(const std::string& ckpt_path, Stage stage);
  ReadCheckpoint read_checkpoint(const std::string& path, bool with_optimizer_states);
  void restore_model(const ReadCheckpoint& checkpoint);
  void restore_callbacks(const ReadCheckpoint& checkpoint);
  void restore_training_state(const ReadCheckpoint& checkpoint);

  Config config_;
  PluginSet plugins_;
  std::vector<Logger*> loggers_;
  RunPosition pos_;
  const Profiler* profiler_ptr_ = nullptr;
  HookDispatcher hooks_{profiler_ptr_, pos_};

  // Settings resolved from [trainer].
  std::string root_dir_;
  int64_t max_epochs_ = -1, max_steps_ = -1, min_epochs_ = 0, min_steps_ = 0;
  double max_time_seconds_ = -1;  // -1: no limit (""); "00:00:00:00" stops at the first check
  int64_t check_val_every_n_epoch_ = 1, num_sanity_val_steps_ = 2, log_every_n_steps_ = 50;
  int64_t accumulate_ = 1, fast_dev_run_ = 0;
  double clip_val_ = 0;
  GradClipAlgorithm clip_algorithm_ = GradClipAlgorithm::norm;
  bool inference_mode_ = true, detect_anomaly_ = false;

  // Run state.
  Module* module_ = nullptr;
  DataModule* data_ = nullptr;
  Module::Binding binding_;
  std::vector<OptimizerConfig> optimizer_configs_;
  std::vector<torch::optim::Optimizer*> optimizer_ptrs_;
  std::unique_ptr<BatchLoader> train_loader_, val_loader_;
  Stage stage_ = Stage::fit;
  bool sanity_checking_ = false;
  int64_t batches_done_in_epoch_ = 0;  // for mid-epoch resume
  int64_t resume_skip_batches_ = 0;
  bool is_last_batch_ = false;
  bool in_train_batch_ = false;      // between a training batch's start and its row
  bool in_epoch_end_phase_ = false;  // the epoch's batches are done; epoch-end work is running
  bool step_row_due_ = false;        // the current training batch's metrics go to the loggers
  int64_t row_step_ = 0;             // the step that row carries
  bool epoch_was_empty_ = false;     // the last epoch's loader yielded no batch
  bool should_stop_ = false;
  std::string stop_reason_;
  int64_t num_train_batches_ = -1, num_val_batches_ = -1, num_eval_batches_ = -1;
  int64_t val_check_batches_ = 0;  // validate every N training batches (0: at epoch end)
  bool environment_ready_ = false, loggers_ready_ = false;
  std::string log_dir_;  // rank 0's, once the loggers are set up
  std::chrono::steady_clock::time_point fit_start_time_;
  double elapsed_before_resume_ = 0;

  MetricStore train_metrics_, eval_metrics_;
  mutable MetricMap callback_metrics_, progress_bar_metrics_;
  MetricMap logged_metrics_;
  MetricMap pending_row_;  // values callbacks logged for the current step's row
};

}  // namespace fulgur
