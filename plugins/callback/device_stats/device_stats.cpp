// Built-in callback `device_stats`: Lightning's DeviceStatsMonitor. On the Trainer's logging steps
// it logs, at the start and at the end of the training batch, the accelerator's statistics
// (Accelerator::device_stats: the cuda accelerator reports its caching allocator's memory) and
// CPU utilisation and memory read from /proc, under Lightning's names:
// "DeviceStatsMonitor.on_train_batch_start/<stat>" and ".../on_train_batch_end/<stat>".
// Nothing here synchronizes the device: allocator statistics are host-side counters.
#include <fulgur/plugin.h>

#include <fmt/format.h>

#include <string>

#include "../common/direct_logging.h"
#include "proc_stats.h"

namespace {

namespace monitor = fulgur::direct_logging;

constexpr char kOwner[] = "callback 'device_stats'";

class DeviceStatsMonitor final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options, (boolean, cpu_stats, "Also log CPU utilisation and memory from /proc", true));
  explicit DeviceStatsMonitor(const Options& options) : cpu_stats_(options.cpu_stats) {}

  fulgur::HookSet hooks() const override {
    return fulgur::Hook::train_start | fulgur::Hook::train_batch_start | fulgur::Hook::train_batch_end;
  }

  void on_train_start(fulgur::TrainerContext& trainer) override {
    monitor::require_logger(trainer, kOwner);
    fulgur::MetricMap ignored;
    if (cpu_stats_) sampler_.sample(ignored);  // the first utilisation reading needs a previous one
  }

  void on_train_batch_start(fulgur::TrainerContext& trainer, const fulgur::Batch&, int64_t) override {
    if (trainer.step_logging_due()) log(trainer, "on_train_batch_start");
  }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch&,
                          int64_t) override {
    if (trainer.step_logging_due()) log(trainer, "on_train_batch_end");
  }

 private:
  // Both readings of a batch go to the Trainer's row for that batch's step.
  void log(fulgur::TrainerContext& trainer, const char* hook) {
    fulgur::MetricMap stats = trainer.device_stats();
    if (cpu_stats_) sampler_.sample(stats);
    fulgur::MetricMap named;
    for (const auto& [key, value] : stats) named[fmt::format("DeviceStatsMonitor.{}/{}", hook, key)] = value;
    trainer.log_metrics(named, kOwner);
  }

  bool cpu_stats_;
  fulgur::device_stats::ProcSampler sampler_;
};

}  // namespace

FULGUR_PLUGIN(DeviceStatsMonitor, "device_stats", "0.1.0",
              "Logs accelerator, CUDA memory and CPU statistics on logging steps (Lightning's DeviceStatsMonitor)")
