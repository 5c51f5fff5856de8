// Built-in callback `throughput_monitor`: Lightning's ThroughputMonitor. On the Trainer's logging
// steps it logs, over the training time since the previous log (validation time left out):
//
//   train/device/batches_per_sec, samples_per_sec, items_per_sec, flops_per_sec, mfu   this process
//   train/batches_per_sec, samples_per_sec, items_per_sec, flops_per_sec, mfu          x world size
//   train/time, train/samples                                                          totals
//
// FLOPs per sample are declared (`flops_per_sample`) or counted once on one training batch
// (forward + backward + optimizer ops with the profiler's per-op formulas); MFU needs the
// device's peak FLOP/s: `peak_flops`, or else the table in peak_flops.h for the device's name and
// the precision's compute dtype (TF32 for float32 when float32_matmul_precision allows it). The device is synchronized
// only on logging steps, so the monitor adds no per-step host-device sync.
#include <fulgur/plugin.h>

#include <ATen/Context.h>
#include <fmt/format.h>

#include <chrono>
#include <string>

#include "../common/direct_logging.h"
#include "flop_counter.h"
#include "peak_flops.h"

namespace {

namespace monitor = fulgur::direct_logging;
using fulgur::Error;
using fulgur::ErrorKind;
using Clock = std::chrono::steady_clock;

constexpr char kOwner[] = "callback 'throughput_monitor'";

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class ThroughputMonitor final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options,
                 (floating, flops_per_sample,
                  "FLOPs of one training sample (forward + backward + step); 0: count them on one batch "
                  "when count_flops is set",
                  0.0),
                 (boolean, count_flops, "Count FLOPs on one training batch when flops_per_sample is 0", true),
                 (integer, count_flops_at_batch,
                  "Which training batch (0-based) to count on; after the first, caches are warm", 1),
                 (floating, peak_flops,
                  "The device's peak FLOP/s for the training dtype (e.g. 989e12 for H100 bf16 dense); "
                  "0: from the built-in table of datacenter GPUs by device name and compute dtype (no MFU "
                  "for a device it does not list)",
                  0.0),
                 (integer, items_per_sample,
                  "Items (e.g. tokens) per sample; 0: the number of input elements of a sample", 0),
                 (string, prefix, "Prepended to every logged name", "train/"));

  explicit ThroughputMonitor(const Options& options)
      : flops_per_sample_(options.flops_per_sample),
        count_flops_(options.count_flops),
        count_at_batch_(options.count_flops_at_batch),
        peak_flops_given_(options.peak_flops),
        peak_flops_(peak_flops_given_),
        items_per_sample_(options.items_per_sample),
        prefix_(options.prefix) {
    if (flops_per_sample_ < 0 || peak_flops_given_ < 0 || items_per_sample_ < 0 || count_at_batch_ < 0)
      throw Error(ErrorKind::config, fmt::format("{}: flops_per_sample, peak_flops, items_per_sample and "
                                                 "count_flops_at_batch must be >= 0",
                                                 kOwner));
  }

  // on_train_batch_start is declared only when FLOPs are counted (see hooks()).
  static constexpr fulgur::HookSet kConditionalHooks = static_cast<fulgur::HookSet>(fulgur::Hook::train_batch_start);

  fulgur::HookSet hooks() const override {
    using fulgur::Hook;
    HookSet set = Hook::train_start | Hook::train_batch_end | Hook::validation_start | Hook::validation_end;
    if (flops_per_sample_ == 0 && count_flops_) set = set | Hook::train_batch_start;
    return set;
  }

  void on_train_start(fulgur::TrainerContext& trainer) override {
    monitor::require_logger(trainer, kOwner);
    world_size_ = trainer.cluster().world_size;
    if (peak_flops_given_ == 0) {
      const c10::ScalarType dtype = trainer.compute_dtype();
      const bool tf32 = at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST;
      const std::string device = trainer.device_name();
      const auto peak = fulgur::throughput::peak_flops_for(device, dtype, tf32);
      peak_flops_ = peak.value_or(0.0);
      const std::string dtype_name = dtype == c10::ScalarType::Float && tf32 ? "tf32" : c10::toString(dtype);
      if (peak)
        fulgur::log::info(
            fmt::format("{}: MFU against {:.4g} FLOP/s, the peak of '{}' in {} (set peak_flops to use another)", kOwner,
                        *peak, device, dtype_name));
      else
        fulgur::log::debug(fmt::format("{}: no peak FLOP/s known for '{}' in {}: set peak_flops to log MFU", kOwner,
                                       device, dtype_name));
    }
    batches_ = samples_ = items_ = 0;
    train_seconds_ = 0;
    last_ = Clock::now();
    last_batches_ = last_samples_ = last_items_ = 0;
    paused_ = Clock::duration::zero();
    batches_seen_ = 0;
  }

  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t) override {
    if (batches_seen_ == count_at_batch_ && flops_per_sample_ == 0 && !counted_) counter_.start();
  }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput&, const fulgur::Batch& batch,
                          int64_t) override {
    const int64_t size = batch.size();
    ++batches_seen_;
    ++batches_;
    samples_ += size;
    items_ += items_per_sample_ > 0 ? items_per_sample_ * size : (batch.input.defined() ? batch.input.numel() : 0);
    if (counter_.counting()) {
      const uint64_t flops = counter_.stop();
      counted_ = true;
      if (size > 0 && flops > 0) {
        flops_per_sample_ = static_cast<double>(flops) / static_cast<double>(size);
        fulgur::log::info(fmt::format("{}: counted {:.4g} FLOPs per sample (forward, backward and optimizer step)",
                                      kOwner, flops_per_sample_));
      } else {
        fulgur::log::warn(fmt::format(
            "{}: no FLOPs were counted on a training batch; set flops_per_sample to log FLOP/s and MFU", kOwner));
      }
    }
    if (!trainer.step_logging_due()) return;
    // Queued device work belongs to the steps being measured: wait for it, once per log.
    trainer.synchronize_device();
    const Clock::time_point now = Clock::now();
    const double dt = seconds(now - last_ - paused_);
    train_seconds_ += dt;
    fulgur::MetricMap m;
    if (dt > 0 && batches_ > last_batches_) {
      const double per_device_batches = static_cast<double>(batches_ - last_batches_) / dt;
      const double per_device_samples = static_cast<double>(samples_ - last_samples_) / dt;
      const double per_device_items = static_cast<double>(items_ - last_items_) / dt;
      const double w = static_cast<double>(world_size_);
      m[prefix_ + "device/batches_per_sec"] = per_device_batches;
      m[prefix_ + "device/samples_per_sec"] = per_device_samples;
      m[prefix_ + "device/items_per_sec"] = per_device_items;
      m[prefix_ + "batches_per_sec"] = per_device_batches * w;
      m[prefix_ + "samples_per_sec"] = per_device_samples * w;
      m[prefix_ + "items_per_sec"] = per_device_items * w;
      if (flops_per_sample_ > 0) {
        const double flops = per_device_samples * flops_per_sample_;
        m[prefix_ + "device/flops_per_sec"] = flops;
        m[prefix_ + "flops_per_sec"] = flops * w;
        if (peak_flops_ > 0) {
          m[prefix_ + "device/mfu"] = flops / peak_flops_;
          m[prefix_ + "mfu"] = flops / peak_flops_;  // the same ratio when every device does its share
        }
      }
    }
    m[prefix_ + "time"] = train_seconds_;
    m[prefix_ + "samples"] = static_cast<double>(samples_) * static_cast<double>(world_size_);
    trainer.log_metrics(m, kOwner);
    last_ = now;
    paused_ = Clock::duration::zero();
    last_batches_ = batches_;
    last_samples_ = samples_;
    last_items_ = items_;
  }

  // Validation inside fit is not training throughput: its time is left out.
  void on_validation_start(fulgur::TrainerContext& trainer) override {
    if (trainer.stage() == fulgur::Stage::fit) validation_started_ = Clock::now();
  }
  void on_validation_end(fulgur::TrainerContext& trainer) override {
    if (trainer.stage() == fulgur::Stage::fit && validation_started_) {
      paused_ += Clock::now() - *validation_started_;
      validation_started_.reset();
    }
  }

  using HookSet = fulgur::HookSet;

 private:
  // Options.
  double flops_per_sample_;
  bool count_flops_;
  int64_t count_at_batch_;
  double peak_flops_given_;  // the option; 0: from the table at train start
  double peak_flops_;
  int64_t items_per_sample_;
  std::string prefix_;

  // State.
  fulgur::throughput::FlopCounter counter_;
  bool counted_ = false;
  int64_t world_size_ = 1;
  int64_t batches_seen_ = 0;
  int64_t batches_ = 0, samples_ = 0, items_ = 0;
  int64_t last_batches_ = 0, last_samples_ = 0, last_items_ = 0;
  double train_seconds_ = 0;
  Clock::time_point last_;
  Clock::duration paused_ = Clock::duration::zero();
  std::optional<Clock::time_point> validation_started_;
};

}  // namespace

FULGUR_PLUGIN(ThroughputMonitor, "throughput_monitor", "0.1.0",
              "Logs batches, samples and items per second, FLOP/s and MFU (Lightning's ThroughputMonitor)")
