/// @file
/// Logger: where metrics and hyperparameters go (csv, tensorboard, ...).
#pragma once

#include <fulgur/export.h>
#include <fulgur/extension.h>
#include <fulgur/types.h>

#include <string>
#include <string_view>

namespace fulgur {

/// What Logger::setup gets. Valid during that call; copy what you keep.
struct LoggerSetup {
  std::string root_dir;     ///< Trainer's default_root_dir: the run directory goes below it
  int64_t global_rank = 0;  ///< this process's rank: only rank zero writes anything
};

/// A destination for metrics and hyperparameters. Created when the Trainer is built and owned by it
/// for its whole life (every stage). Every method is called on every rank, from the thread that
/// runs the Trainer's stages, in this order: setup, log_hyperparams, then log_metrics / save any
/// number of times, finalize at the end of fit (or of a stage that failed); more rows may follow
/// when the same Trainer runs another stage. None is a collective. Rank zero's logger writes; the
/// others are called too (except for rows callbacks send) and write nothing: decide it in setup
/// from LoggerSetup::global_rank. What a method throws ends the stage with a fulgur::Error naming
/// the logger and the method.
class FULGUR_SDK_API Logger {
 public:
  virtual ~Logger();

  /// Chooses, and on rank zero creates, the run directory; a directory that cannot be written fails
  /// here, not mid-run (throw fulgur::Error(io)). Called once per Trainer, at the start of its
  /// first stage, after the model is set up.
  virtual void setup(const LoggerSetup& setup) = 0;
  /// One row of scalar values at `step` (Lightning's step: the optimizer steps taken before the
  /// row's batch; never negative; the key "epoch" holds the current epoch). Called every
  /// `log_every_n_steps` training steps, at each epoch end and after each validation or test pass,
  /// and when a callback sends a row (TrainerContext::log_metrics, rank zero only). Buffer and
  /// flush as suits the format: it is on the training loop's path.
  virtual void log_metrics(const MetricMap& metrics, int64_t step) = 0;
  /// Flattened hyperparameters, "model.lr" -> "0.001" (values in TOML syntax): the model, data,
  /// trainer, accelerator, strategy, precision and profiler tables. Called once, right after setup.
  virtual void log_hyperparams(const std::map<std::string, std::string>& params) = 0;
  /// Makes everything logged so far durable (flushes buffers). Called at the end of every training
  /// epoch and of every stage (also a failed one).
  virtual void save() = 0;
  /// The run ended with `status`: flush and close. Called after save() at the end of fit, and of
  /// any stage that failed or was interrupted.
  virtual void finalize(RunStatus status) = 0;
  /// The run directory (below LoggerSetup::root_dir), valid after setup. Rank zero's first logger
  /// names the run for every rank: TrainerContext::log_dir, the profiler's directory, checkpoint
  /// callbacks' default directory.
  virtual std::string log_dir() const = 0;
  /// The extension interface named `id` that this logger implements, or nullptr (the default).
  /// Capabilities added after SDK 1.0 arrive this way; see fulgur/extension.h. Must not throw.
  virtual void* extension(std::string_view id) noexcept;
};

/// What CheckpointObserver::after_save_checkpoint hears about a checkpoint the run just wrote.
/// Valid during that call; copy what you keep.
struct SavedCheckpoint {
  std::string path;           ///< the checkpoint as the saver named it: a file, or a directory (sharded)
  int64_t global_step = 0;    ///< the optimizer steps the checkpoint holds (its "global_step")
  int64_t epoch = 0;          ///< the epoch it was saved in (its "epoch")
  bool weights_only = false;  ///< true: model weights only, no optimizer or loop state
};

/// Extension (SDK 1.1) of a Logger that hears about every checkpoint the run writes, as Lightning's
/// Logger.after_save_checkpoint: a model registry uploads it (mlflow's upload_when = "saved"), an
/// experiment tracker links it to the run. Without it a logger never learns of checkpoints.
/// Called on every rank, after the strategy's save has finished on every rank (the file or
/// directory is complete and will not be rewritten by this save), from the thread that runs the
/// fit; never for a save that failed. Every save through TrainerContext::save_checkpoint counts:
/// model_checkpoint's top-k and last files, the checkpoint written on a signal, a callback's own.
/// A checkpoint callback may delete an older file later (top-k); the observer is not told. What it
/// throws ends the fit as a logger error naming the logger and this method.
class CheckpointObserver {
 public:
  /// The extension's id for Logger::extension().
  static constexpr std::string_view kExtensionId = "fulgur.logger.checkpoint_observer/1";
  /// `checkpoint` has just been written and is complete on disk.
  virtual void after_save_checkpoint(const SavedCheckpoint& checkpoint) = 0;

 protected:
  ~CheckpointObserver() = default;
};

}  // namespace fulgur
