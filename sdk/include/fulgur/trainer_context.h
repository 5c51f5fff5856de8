// What plugins see of the running Trainer: counters, metrics, the model and optimizers, the other
// plugins, and the few actions a callback may take (stop, save a checkpoint).
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

class Accelerator;
class Logger;
class Precision;
class Strategy;

class FULGUR_SDK_API TrainerContext {
 public:
  virtual ~TrainerContext();

  virtual Stage stage() const = 0;
  virtual bool sanity_checking() const = 0;
  virtual int64_t current_epoch() const = 0;
  virtual int64_t global_step() const = 0;  // optimizer steps taken
  virtual int64_t max_epochs() const = 0;   // -1: unlimited
  virtual int64_t max_steps() const = 0;    // -1: unlimited
  // Batches per epoch of the running stage's loader after limits (-1 when unknown).
  virtual int64_t num_batches(Stage stage) const = 0;
  virtual bool is_last_batch() const = 0;

  // Latest epoch- or step-level values of everything logged (what monitors read).
  virtual const MetricMap& callback_metrics() const = 0;
  virtual const MetricMap& progress_bar_metrics() const = 0;

  virtual bool should_stop() const = 0;
  // Asks the fit loop to stop at the next check (respecting min_epochs/min_steps).
  virtual void request_stop(std::string_view reason) = 0;

  virtual const std::string& default_root_dir() const = 0;
  // The first logger's run directory, or default_root_dir when there is no logger.
  virtual std::string log_dir() const = 0;
  // Writes a complete checkpoint (atomically) to `path`.
  virtual void save_checkpoint(const std::string& path, bool weights_only) = 0;

  virtual torch::nn::Module& model() = 0;
  virtual std::vector<torch::optim::Optimizer*> optimizers() = 0;
  virtual Strategy& strategy() = 0;
  virtual Accelerator& accelerator() = 0;
  virtual Precision& precision() = 0;
  virtual std::span<Logger* const> loggers() = 0;
  bool is_global_zero() const;

  // [trainer] log_every_n_steps: monitoring callbacks that write to the loggers themselves
  // (lr_monitor, device_stats, throughput_monitor) log on the same steps as the Trainer does.
  // Appended last (interface version 2) so the earlier vtable slots keep their places.
  virtual int64_t log_every_n_steps() const = 0;
};

}  // namespace fulgur
