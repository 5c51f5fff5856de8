// The Metric base: a stateful value updated per batch and reduced across ranks at compute(), as
// torchmetrics' Metric. The engine logs Metric objects (Module::log(name, Metric&)); the concrete
// metrics (accuracy, F1, AUROC, MSE, perplexity, ...) live in the metrics library (fulgur/metrics.h,
// target Fulgur::metrics).
#pragma once

#include <fulgur/types.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

class Module;

namespace metrics {

// How a state combines across ranks.
enum class StateReduction { sum, cat, max, min };

// The collectives a metric needs at compute(). The Trainer's strategy provides them through
// Metric::sync_with(module); tests and other runners may provide their own.
class MetricSync {
 public:
  virtual ~MetricSync();
  virtual int64_t world_size() const = 0;
  virtual at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  // Every rank's tensor, in rank order; tensors may differ in their first dimension.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
};

class Metric {
 public:
  virtual ~Metric();
  virtual void update(const at::Tensor& preds, const at::Tensor& target) = 0;
  // The value over everything since the last reset, over all ranks when synced (every rank must
  // call it then: it is a collective). Local states are left as they were.
  at::Tensor compute();
  void reset();

  // Sync through the Trainer running `module` (looked up at each compute(), so one metric serves
  // every stage; outside a run or with one process, nothing is exchanged).
  Metric& sync_with(const Module& module);
  Metric& sync_with(std::shared_ptr<MetricSync> sync);
  bool synced() const { return sync_ != nullptr; }

  struct State {
    std::string name;
    at::Tensor initial;
    StateReduction reduction;
    at::Tensor value;                // sum / max / min states
    std::vector<at::Tensor> chunks;  // cat states: one per update, joined at compute()
  };
  const std::vector<State>& states() const { return states_; }
  // The state's current local value (cat states joined; empty (0) when nothing was added).
  at::Tensor state_value(size_t index) const;

 protected:
  // Registers a state (in the constructor); returns its index.
  size_t add_state(std::string name, at::Tensor initial, StateReduction reduction);
  at::Tensor& state(size_t index) { return states_[index].value; }
  void append(size_t index, const at::Tensor& chunk);
  // The metric from (already synced) state values, in add_state order.
  virtual at::Tensor compute_from(const std::vector<at::Tensor>& values) const = 0;

 private:
  std::vector<State> states_;
  std::shared_ptr<MetricSync> sync_;
};

}  // namespace metrics
}  // namespace fulgur
