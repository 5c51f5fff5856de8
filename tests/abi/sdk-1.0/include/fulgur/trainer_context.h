/// @file
/// What plugins see of the running Trainer: counters, metrics, the model and its optimizers, and
/// capabilities (where this process sits, agreement and broadcast across ranks, device services,
/// logging, stopping, saving). Plugins get capabilities, not the other plugins: a callback cannot
/// reach the strategy's backward or a logger's finalize.
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <c10/core/Device.h>

#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

/// What TrainerContext::run_batch_size_trial did.
struct BatchSizeTrial {
  int64_t batches_run = 0;         ///< fewer than asked when one epoch holds fewer
  int64_t batches_per_epoch = -1;  ///< of the train loader at the tried size (-1: unknown)
};

/// The running Trainer as plugins see it, passed by reference to every callback hook and
/// checkpoint-provider call. The object is the Trainer's own and lives as long as the Trainer; use
/// it from the thread that runs the stage, during a hook (between stages its answers describe the
/// last stage). Nothing here is a collective unless it says so; a collective must be called by
/// every rank, in the same order, or the ranks wait for each other until the strategy's timeout
/// (with one process, collectives return at once). Before the first stage has set up the process
/// group, cluster() describes a single process and collectives are identities.
class FULGUR_SDK_API TrainerContext {
 public:
  virtual ~TrainerContext();

  // ---- counters and state ----------------------------------------------------------------------

  /// The stage being run (the entry point called: fit, validate, test or predict). Validation
  /// inside fit, the sanity check included, reports Stage::fit.
  virtual Stage stage() const = 0;
  /// Whether fit's sanity check (a few validation batches before training) is running.
  virtual bool sanity_checking() const = 0;
  /// The training epoch, counted from 0; it advances after the epoch's end work
  /// (on_train_epoch_end, epoch schedulers), so after fit it is the number of epochs trained.
  virtual int64_t current_epoch() const = 0;
  /// Optimizer steps taken in fit (under manual optimization: training batches run). In
  /// on_train_batch_end it already counts that batch's step, if it took one.
  virtual int64_t global_step() const = 0;
  virtual int64_t max_epochs() const = 0;  ///< `[trainer] max_epochs`; -1: unlimited
  virtual int64_t max_steps() const = 0;   ///< `[trainer] max_steps`; -1: unlimited
  /// Batches per epoch of `stage`'s loader after limits (limit_*_batches, fast_dev_run), -1 when
  /// unknown; for validation and test, of the loader running now (dataloader_idx()).
  virtual int64_t num_batches(Stage stage) const = 0;
  /// Whether the current training batch is the epoch's last (known before its step, also for a
  /// loader of unknown length: the next batch is fetched ahead).
  virtual bool is_last_batch() const = 0;
  /// Which of the stage's loaders the current validation/test batch comes from (0 with one loader;
  /// Lightning's dataloader_idx).
  virtual int64_t dataloader_idx() const { return 0; }

  // ---- metrics -----------------------------------------------------------------------------------

  /// Latest epoch- or step-level values of everything logged (what monitors read), including the
  /// current step's. The reference is to the Trainer's map and stays valid; its values change as
  /// the run logs more: copy what you keep. Each call merges the current step's values: not free,
  /// call it when you read it.
  virtual const MetricMap& callback_metrics() const = 0;
  /// The latest values logged with prog_bar (what a progress bar shows), as callback_metrics.
  virtual const MetricMap& progress_bar_metrics() const = 0;
  /// Whether the Trainer sends the current training step's metrics to the loggers
  /// (log_every_n_steps, the last batch, a requested stop). Lets a monitor skip computing values
  /// nobody will write.
  virtual bool step_logging_due() const = 0;
  /// Sends `metrics` to every logger from rank zero only (other ranks return without sending), at
  /// the step the Trainer's own row for the current batch carries (the epoch's last step outside a
  /// batch). Logger failures are the Trainer's to report. Throws fulgur::Error(config) naming
  /// `owner` when there is no logger (on every rank).
  virtual void log_metrics(const MetricMap& metrics, std::string_view owner) = 0;
  /// True when at least one logger is configured.
  virtual bool has_logger() const = 0;

  // ---- where this process sits; agreement across ranks ------------------------------------------

  /// Where this process sits in the job (the strategy's answer). The reference stays valid.
  virtual const ClusterInfo& cluster() const = 0;
  /// Whether this is global rank zero (the process that writes files and logs).
  bool is_global_zero() const { return cluster().global_rank == 0; }
  /// The device this process trains on.
  virtual c10::Device device() const = 0;
  /// `value` from rank `src`, on every rank. A collective: every rank must call it.
  virtual std::string broadcast(const std::string& value, int64_t src = 0) = 0;
  /// A decision every rank takes together: true when all ranks (all = true) or any rank
  /// (all = false) said true; the same answer on every rank. A collective: every rank must call it.
  virtual bool agree(bool decision, bool all) = 0;
  /// `tensor` reduced over all ranks (a new tensor; the input is left alone). A collective.
  virtual at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  /// Every rank's `tensor` (same shape on all ranks), in rank order. A collective.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  /// Waits until every rank has arrived; `name` says where, for messages. A collective.
  virtual void barrier(std::string_view name) = 0;

  // ---- device services ---------------------------------------------------------------------------

  /// Blocks until queued work on this process's device has finished (timing; a no-op on cpu).
  virtual void synchronize_device() = 0;
  /// Point-in-time statistics of this process's device (memory, utilisation), by metric name.
  virtual MetricMap device_stats() const = 0;
  /// The device's product name ("NVIDIA H200"; "cpu" on the cpu accelerator): with
  /// compute_dtype(), the key of a peak FLOP/s table.
  virtual std::string device_name() const = 0;
  /// The dtype the precision plugin computes matrix products in (bf16 under bf16-mixed).
  virtual c10::ScalarType compute_dtype() const = 0;

  // ---- actions -----------------------------------------------------------------------------------

  /// Whether a stop was requested on this rank (request_stop); it stays requested for the
  /// Trainer's life.
  virtual bool should_stop() const = 0;
  /// Asks the fit loop to stop at the next check, after the current batch or at the epoch's end
  /// (respecting min_epochs/min_steps); `reason` is logged when not empty. Not a collective, but
  /// call it on every rank with the same decision (use agree()), as early stopping does, or the
  /// ranks leave the loop at different batches.
  virtual void request_stop(std::string_view reason) = 0;
  /// Gradient accumulation: batches per optimizer step ([trainer] accumulate_grad_batches).
  virtual int64_t accumulate_grad_batches() const = 0;
  /// Changes accumulate_grad_batches. A callback may change it between epochs
  /// (on_train_epoch_start, on every rank alike), as Lightning's GradientAccumulationScheduler
  /// does; it applies from the next batch. Throws fulgur::Error (config) under manual optimization,
  /// for n < 1, or inside a training batch.
  virtual void set_accumulate_grad_batches(int64_t n) = 0;
  /// `[trainer] default_root_dir`: where runs write by default. The reference stays valid.
  virtual const std::string& default_root_dir() const = 0;
  /// The first logger's run directory (rank zero's, the same on every rank), or default_root_dir
  /// when there is no logger. The loggers are set up after the first stage's setup hooks: until
  /// then this is default_root_dir.
  virtual std::string log_dir() const = 0;
  /// Writes a complete checkpoint to `path` through the strategy (atomically): the Strategy's
  /// model and optimizer parts, the loops', schedulers', precision's and callbacks' state (not
  /// with `weights_only`), and every callback's on_save_checkpoint, this one's included. A
  /// collective. Throws fulgur::Error(runtime) before the first stage, (io, checkpoint) when the
  /// checkpoint cannot be written.
  virtual void save_checkpoint(const std::string& path, bool weights_only) = 0;

  // ---- the training batch size (the batch-size finder) ------------------------------------------

  /// The DataModule's training batch size (fulgur::DataModule::batch_size(), Lightning's
  /// `batch_size` attribute), or -1 when the DataModule does not offer one.
  virtual int64_t train_batch_size() const = 0;
  /// Changes it for this fit (DataModule::set_batch_size). Only before fit builds its loaders: from
  /// setup() or on_fit_start. Throws fulgur::Error(config) after that, for n < 1, or when the
  /// DataModule cannot change its batch size.
  virtual void set_train_batch_size(int64_t n) = 0;
  /// Trains `steps` batches of `batch_size` samples from a fresh train loader (training_step,
  /// backward, optimizer step; no callback hook runs, nothing is logged or counted), then puts the
  /// weights, the optimizer states, the CPU random state and the batch size back as they were: what
  /// a batch-size search measures. An error in the steps (c10::OutOfMemoryError on CUDA) reaches
  /// the caller after that restore. One process only (an out-of-memory rank would leave the others
  /// inside the gradient all-reduce), from setup() or on_fit_start; throws fulgur::Error(config)
  /// otherwise.
  virtual BatchSizeTrial run_batch_size_trial(int64_t batch_size, int64_t steps) = 0;

  // ---- the model being trained -----------------------------------------------------------------

  /// The user's module as written (not a strategy's wrapper), valid for the Trainer's life once a
  /// stage has started. Under a strategy that shards parameters (fsdp with zero_stage = 3) they are
  /// not whole outside a block's forward: fulgur::FullParameters makes them whole. Throws
  /// fulgur::Error(runtime) before the first stage.
  virtual torch::nn::Module& model() = 0;
  /// The optimizers of fit (the strategy's, where it wrapped or replaced them), in the order
  /// configure_optimizers returned them: empty until the first fit has created them. The pointers
  /// stay valid until the next fit creates new ones.
  virtual std::vector<torch::optim::Optimizer*> optimizers() = 0;
  /// The extension interface named `id` that this host implements, or nullptr (the default).
  /// Capabilities added after SDK 1.0 arrive this way; see fulgur/extension.h. Must not throw.
  virtual void* extension(std::string_view id) noexcept;
};

}  // namespace fulgur
