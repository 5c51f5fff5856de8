// Internal: values logged with Module::log, aggregated per step and per epoch the way Lightning's
// ResultCollection does. Values stay on device as tensors until somebody needs a number.
#pragma once

#include <fulgur/module.h>
#include <fulgur/types.h>

#include <functional>
#include <string>
#include <vector>

namespace fulgur {

class Strategy;
namespace metrics {
class Metric;
}

class MetricStore {
 public:
  struct Entry {
    std::string name;
    bool on_step = false;
    bool on_epoch = false;
    bool prog_bar = false;
    bool logger = true;
    bool sync_dist = false;
    Reduction reduce = Reduction::mean;
    at::Tensor step_value;              // latest value (detached)
    at::Tensor epoch_accum;             // weighted sum (mean), sum, or running max/min
    double epoch_weight = 0;            // total batch size behind epoch_accum
    bool step_fresh = false;            // logged since the last collect_step()
    metrics::Metric* metric = nullptr;  // Module::log(name, metric): computed and reset at epoch end
    bool metric_due = false;            // logged since the last reduce_epoch()
  };

  // One value. With sync_dist and `sync_strategy` (several ranks), its step-level value is reduced
  // across the ranks right here, as Lightning syncs step values when they are logged (a collective:
  // every rank logs it at the same point); its epoch accumulation stays local until reduce_epoch.
  void log(const std::string& name, const at::Tensor& value, const LogOptions& options, bool training_context,
           int64_t batch_size, Strategy* sync_strategy = nullptr);

  void log_metric(const std::string& name, metrics::Metric& metric, const LogOptions& options);
  // Step-level values logged since the last call ("name" or "name_step"); host copies happen here.
  MetricMap collect_step(bool logger_only, bool prog_bar_only, bool consume);
  // Epoch-level values ("name" or "name_epoch"), reduced across ranks where sync_dist asked for it;
  // clears the epoch accumulators.
  MetricMap reduce_epoch(Strategy* strategy, bool logger_only, MetricMap* prog_bar_out, MetricMap* all_out);
  // Latest step values of prog_bar entries (for the progress bar), without consuming them.
  MetricMap prog_bar_step_values() const;
  void clear();
  bool empty() const { return entries_.empty(); }

 private:
  Entry& entry(const std::string& name);
  std::vector<Entry> entries_;
};

}  // namespace fulgur
