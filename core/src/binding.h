// Internal: how a fulgur::Module reaches the Trainer that runs it (logging, manual optimization).
#pragma once

#include <fulgur/module.h>

#include <functional>
#include <string>

#include "metric_store.h"

namespace fulgur {

class Precision;
class Strategy;

// A Module::log call made while a step was being captured: replayed against the store after
// every replay of the step, with `value` (a tensor the graph rewrites) cloned.
struct RecordedLog {
  std::string name;
  at::Tensor value;
  LogOptions options;
};

struct Module::Binding {
  MetricStore* metrics = nullptr;  // the store of the running stage
  bool training_context = false;   // defaults for log(): on_step in training, on_epoch otherwise
  bool logging_allowed = false;    // false in hooks where Lightning forbids self.log
  const char* log_hook = nullptr;  // the hook a logging context is for, when one name covers it
  bool barebones = false;          // [trainer] barebones: log() is a no-op with one warning, as in Lightning
  bool warned_barebones = false;
  int64_t batch_size = 0;   // of the current batch (weights epoch means)
  std::string name_suffix;  // appended to logged names ("/dataloader_idx_1" with several loaders)
  std::vector<RecordedLog>* recorded_logs = nullptr;   // set while a training step is captured
  c10::Device recording_device{c10::DeviceType::CPU};  // where values logged while capturing must live
  std::vector<torch::optim::Optimizer*> optimizers;
  Strategy* strategy = nullptr;
  Precision* precision = nullptr;
  std::function<void(const at::Tensor&)> manual_backward;
  // Module::clip_gradients: through the strategy (a sharded one clips by the global norm).
  std::function<void(torch::optim::Optimizer&, double, GradClipAlgorithm)> clip_gradients;
  // OptimizerHandle::step: unscale, on_before_optimizer_step, strategy step (manual optimization).
  std::function<bool(torch::optim::Optimizer&)> optimizer_step;
};

}  // namespace fulgur
