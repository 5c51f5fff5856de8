// What plugins see of the running Trainer: counters, metrics, the model and its optimizers, and
// capabilities (where this process sits, agreement and broadcast across ranks, device services,
// logging, stopping, saving). Plugins get capabilities, not the other plugins: a callback cannot
// reach the strategy's backward or a logger's finalize.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <c10/core/Device.h>

#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

// What TrainerContext::run_batch_size_trial did.
struct BatchSizeTrial {
  int64_t batches_run = 0;         // fewer than asked when one epoch holds fewer
  int64_t batches_per_epoch = -1;  // of the train loader at the tried size (-1: unknown)
};

class FULGUR_SDK_API TrainerContext {
 public:
  virtual ~TrainerContext();

  // ---- counters and state ----------------------------------------------------------------------
  virtual Stage stage() const = 0;
  virtual bool sanity_checking() const = 0;
  virtual int64_t current_epoch() const = 0;
  virtual int64_t global_step() const = 0;  // optimizer steps taken
  virtual int64_t max_epochs() const = 0;   // -1: unlimited
  virtual int64_t max_steps() const = 0;    // -1: unlimited
  // Batches per epoch of the running stage's loader after limits (-1 when unknown).
  virtual int64_t num_batches(Stage stage) const = 0;
  virtual bool is_last_batch() const = 0;
  // Which of the stage's loaders the current validation/test batch comes from (0 with one loader;
  // Lightning's dataloader_idx).
  virtual int64_t dataloader_idx() const { return 0; }

  // ---- metrics -----------------------------------------------------------------------------------
  // Latest epoch- or step-level values of everything logged (what monitors read).
  virtual const MetricMap& callback_metrics() const = 0;
  virtual const MetricMap& progress_bar_metrics() const = 0;
  // Whether the Trainer sends the current training step's metrics to the loggers
  // (log_every_n_steps, the last batch, a requested stop). Lets a monitor skip computing values
  // nobody will write.
  virtual bool step_logging_due() const = 0;
  // Sends `metrics` to every logger from rank zero only, at the step the Trainer's own row for
  // the current batch carries (the epoch's last step outside a batch). Logger failures are the
  // Trainer's to report. Throws fulgur::Error(config) naming `owner` when there is no logger.
  virtual void log_metrics(const MetricMap& metrics, std::string_view owner) = 0;
  // True when at least one logger is configured.
  virtual bool has_logger() const = 0;

  // ---- where this process sits; agreement across ranks ------------------------------------------
  virtual const ClusterInfo& cluster() const = 0;
  bool is_global_zero() const { return cluster().global_rank == 0; }
  // The device this process trains on.
  virtual c10::Device device() const = 0;
  // `value` from rank `src`, on every rank (a collective: every rank must call it).
  virtual std::string broadcast(const std::string& value, int64_t src = 0) = 0;
  // A decision every rank takes together: true when all ranks (all = true) or any rank
  // (all = false) said true. A collective: every rank must call it.
  virtual bool agree(bool decision, bool all) = 0;
  // `tensor` reduced over all ranks (a new tensor; the input is left alone). A collective.
  virtual at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  // Every rank's `tensor` (same shape on all ranks), in rank order. A collective.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  // Waits until every rank has arrived. A collective.
  virtual void barrier(std::string_view name) = 0;

  // ---- device services ---------------------------------------------------------------------------
  // Waits for queued work on this process's device (timing; a no-op on cpu).
  virtual void synchronize_device() = 0;
  // Point-in-time statistics of this process's device (memory, utilisation), by metric name.
  virtual MetricMap device_stats() const = 0;
  // The device's product name ("NVIDIA H200"; "cpu" on the cpu accelerator) and the dtype the
  // precision plugin computes in: the keys of a peak FLOP/s table.
  virtual std::string device_name() const = 0;
  virtual c10::ScalarType compute_dtype() const = 0;

  // ---- actions -----------------------------------------------------------------------------------
  virtual bool should_stop() const = 0;
  // Asks the fit loop to stop at the next check (respecting min_epochs/min_steps). Call it on
  // every rank with the same decision (use agree()), as early stopping does.
  virtual void request_stop(std::string_view reason) = 0;
  // Gradient accumulation: batches per optimizer step ([trainer] accumulate_grad_batches). A
  // callback may change it between epochs (on_train_epoch_start, on every rank alike), as
  // Lightning's GradientAccumulationScheduler does; it applies from the next batch. Throws
  // fulgur::Error (config) under manual optimization, for n < 1, or inside a training batch.
  virtual int64_t accumulate_grad_batches() const = 0;
  virtual void set_accumulate_grad_batches(int64_t n) = 0;
  virtual const std::string& default_root_dir() const = 0;
  // The first logger's run directory (rank zero's), or default_root_dir when there is no logger.
  virtual std::string log_dir() const = 0;
  // Writes a complete checkpoint to `path` through the strategy (atomically). A collective.
  virtual void save_checkpoint(const std::string& path, bool weights_only) = 0;

  // ---- the training batch size (the batch-size finder) ------------------------------------------
  // The DataModule's training batch size (fulgur::DataModule::batch_size(), Lightning's
  // `batch_size` attribute), or -1 when the DataModule does not offer one.
  virtual int64_t train_batch_size() const = 0;
  // Changes it for this fit (DataModule::set_batch_size). Only before fit builds its loaders: from
  // setup() or on_fit_start. Throws fulgur::Error(config) after that, for n < 1, or when the
  // DataModule cannot change its batch size.
  virtual void set_train_batch_size(int64_t n) = 0;
  // Trains `steps` batches of `batch_size` samples from a fresh train loader (training_step,
  // backward, optimizer step; no callback hook runs, nothing is logged or counted), then puts the
  // weights, the optimizer states, the CPU random state and the batch size back as they were: what
  // a batch-size search measures. An error in the steps (c10::OutOfMemoryError on CUDA) reaches
  // the caller after that restore. One process only (an out-of-memory rank would leave the others
  // inside the gradient all-reduce), from setup() or on_fit_start; throws fulgur::Error(config)
  // otherwise.
  virtual BatchSizeTrial run_batch_size_trial(int64_t batch_size, int64_t steps) = 0;
  // ---- the model being trained -----------------------------------------------------------------
  // The user's module as written (not a strategy's wrapper).
  virtual torch::nn::Module& model() = 0;
  virtual std::vector<torch::optim::Optimizer*> optimizers() = 0;
};

}  // namespace fulgur
