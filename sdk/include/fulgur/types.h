// Small value types exchanged between the Trainer and plugins. Narrow torch headers only.
#pragma once

#include <fulgur/export.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace c10 {
struct IValue;
}
namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fulgur {

enum class Stage { fit, validate, test, predict, sanity_check };
FULGUR_SDK_API const char* to_string(Stage stage);

// Scalar metrics by name, as loggers and monitoring callbacks see them.
using MetricMap = std::map<std::string, double>;

// One batch as produced by a DataModule's loader: inputs, targets and anything else a model needs.
struct Batch {
  at::Tensor input;
  at::Tensor target;
  std::vector<at::Tensor> extra;

  int64_t size() const { return input.defined() && input.dim() > 0 ? input.size(0) : 0; }
};

// What a training/validation/test step returns.
struct StepOutput {
  at::Tensor loss;                          // required for automatic optimization
  std::map<std::string, at::Tensor> extra;  // anything a callback may want to read
};

enum class RunStatus { success, failed, interrupted };
FULGUR_SDK_API const char* to_string(RunStatus status);

enum class ReduceOp { sum, mean, max, min };

enum class GradClipAlgorithm { norm, value };

// Where this process sits in a (possibly single-process) job.
struct ClusterInfo {
  int64_t global_rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  int64_t node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;
};

}  // namespace fulgur
