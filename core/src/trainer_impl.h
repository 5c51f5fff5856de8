// Internal: the Trainer's state and the TrainerContext plugins see. Split over trainer.cpp
// (construction, plugins, hooks), loops.cpp (fit/eval/predict loops) and checkpoint.cpp.
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

#include <array>
#include <bit>
#include <chrono>
#include <functional>
#include <optional>

#include "binding.h"
#include "metrics.h"

namespace fulgur {

// Batch limits from limit_*_batches: an integer is a count, a float a fraction of the loader.
int64_t apply_batch_limit(const OptionValue& limit, int64_t available);

class Trainer::Impl final : public TrainerContext {
 public:
  explicit Impl(Config config);

  // ---- TrainerContext -------------------------------------------------------------------------
  Stage stage() const override { return stage_; }
  bool sanity_checking() const override { return sanity_checking_; }
  int64_t current_epoch() const override { return epoch_; }
  int64_t global_step() const override { return global_step_; }
  int64_t max_epochs() const override { return max_epochs_; }
  int64_t max_steps() const override { return max_steps_; }
  int64_t num_batches(Stage stage) const override;
  bool is_last_batch() const override { return is_last_batch_; }
  const MetricMap& callback_metrics() const override;
  const MetricMap& progress_bar_metrics() const override;
  bool should_stop() const override { return should_stop_; }
  void request_stop(std::string_view reason) override;
  const std::string& default_root_dir() const override { return root_dir_; }
  std::string log_dir() const override;
  int64_t global_rank() const { return environment_ready_ ? strategy_->cluster().global_rank : 0; }
  void save_checkpoint(const std::string& path, bool weights_only) override;
  torch::nn::Module& model() override;
  std::vector<torch::optim::Optimizer*> optimizers() override { return optimizer_ptrs_; }
  Strategy& strategy() override { return *strategy_; }
  Accelerator& accelerator() override { return *accelerator_; }
  Precision& precision() override { return *precision_; }
  std::span<Logger* const> loggers() override { return logger_ptrs_; }
  int64_t log_every_n_steps() const override { return log_every_n_steps_; }

  // ---- entry points ---------------------------------------------------------------------------
  void fit(Module& module, DataModule& data, const std::string& ckpt_path);
  std::vector<MetricMap> evaluate(Stage stage, Module& module, DataModule& data, const std::string& ckpt_path);
  std::vector<at::Tensor> predict(Module& module, DataModule& data, const std::string& ckpt_path);
  void add_callback(std::shared_ptr<Callback> callback, std::string name);

  const Config& config() const { return config_; }
  const MetricMap& logged_metrics() const { return logged_metrics_; }

 private:
  friend class Trainer;

  struct CallbackSlot {
    std::shared_ptr<Callback> callback;
    std::string name;
    bool monitoring = false;  // model_checkpoint / early_stopping: run after the module at epoch end
    HookSet hooks = 0;
  };

  // Calls `fn` on every callback that declared `hook` (nothing at all for the others).
  template <class Fn>
  void call(Hook hook, Fn&& fn) {
    for (Callback* cb : by_hook_[std::countr_zero(static_cast<uint64_t>(hook))]) fn(*cb);
  }
  // on_train_epoch_end: non-monitoring callbacks, then `module_fn`, then monitoring callbacks.
  void call_epoch_end_split(const std::function<void()>& module_fn);

  void create_plugins();
  void add_default_callbacks();
  void index_hooks();
  void attach(Module& module, DataModule& data, Stage stage);
  void setup_environment_once();
  StrategyEnvironment make_strategy_environment();
  void setup_loggers_once();
  void finish_stage(Stage stage, RunStatus status);

  // Loops (loops.cpp).
  void run_fit();
  void run_train_epoch();
  void run_train_batch(Batch& batch, int64_t batch_idx);
  bool step_optimizer(torch::optim::Optimizer& optimizer);
  void run_validation(bool sanity);
  MetricMap run_eval_loop(Stage stage, BatchLoader& loader, int64_t limit, bool sanity);
  Batch transfer(Batch batch);
  void log_step_metrics();
  void log_epoch_metrics(MetricStore& store, bool send_to_loggers);
  bool time_exceeded() const;
  bool fit_done() const;
  void step_schedulers(SchedulerInterval interval, bool skip_monitored = false);

  // Checkpoints (checkpoint.cpp).
  c10::IValue dump_checkpoint(bool weights_only);
  std::string resolve_checkpoint_path(const std::string& ckpt_path);
  c10::IValue read_checkpoint(const std::string& path);
  void restore_model(const c10::IValue& checkpoint, const std::string& path);
  void restore_callbacks(const c10::IValue& checkpoint);
  void restore_training_state(const c10::IValue& checkpoint, const std::string& path);

  Config config_;
  std::unique_ptr<PluginRegistry> registry_;
  std::shared_ptr<Accelerator> accelerator_;
  std::shared_ptr<Strategy> strategy_;
  std::shared_ptr<Precision> precision_;
  std::shared_ptr<Profiler> profiler_;
  std::vector<std::shared_ptr<Logger>> logger_objects_;
  std::vector<Logger*> logger_ptrs_;
  std::vector<CallbackSlot> callbacks_;
  std::array<std::vector<Callback*>, 64> by_hook_;

  // Settings resolved from [trainer].
  std::string root_dir_;
  int64_t max_epochs_ = -1, max_steps_ = -1, min_epochs_ = 0, min_steps_ = 0;
  double max_time_seconds_ = 0;
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
  int64_t epoch_ = 0, global_step_ = 0;
  int64_t batches_done_in_epoch_ = 0;  // for mid-epoch resume
  int64_t resume_skip_batches_ = 0;
  bool is_last_batch_ = false;
  bool in_epoch_end_phase_ = false;  // the epoch's batches are done; epoch-end work is running
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
};

}  // namespace fulgur
