/// @file
/// Small value types exchanged between the Trainer and plugins. Narrow torch headers only.
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

/// Fulgur: the Trainer and the plugin contract (this SDK). Plugins use the SDK's part of this
/// namespace only: the interfaces they implement, what the Trainer hands them, and helpers.
namespace fulgur {

/// What the Trainer is running: the entry point that was called (Trainer::fit, validate, test,
/// predict). The sanity check inside fit reports Stage::fit with TrainerContext::sanity_checking()
/// true; Stage::sanity_check is accepted where a stage's batches are asked for and counts as
/// validate there.
enum class Stage { fit, validate, test, predict, sanity_check };
/// The stage's name as in the enum ("fit"); "unknown" for other values.
FULGUR_SDK_API const char* to_string(Stage stage);

/// Scalar metrics by name, as loggers and monitoring callbacks see them.
using MetricMap = std::map<std::string, double>;

/// One batch as produced by a DataModule's loader: inputs, targets and anything else a model
/// needs. Plugins see it after the Module's transfer hooks and the precision's convert_input: on
/// the training device, read-only in callback hooks.
struct Batch {
  at::Tensor input;               ///< the model's input; its first dimension is the batch size
  at::Tensor target;              ///< what the loss compares against (undefined when there is none)
  std::vector<at::Tensor> extra;  ///< further tensors, in the order the loader produced them

  /// Number of samples: input's first dimension, 0 when input is undefined or a scalar.
  int64_t size() const { return input.defined() && input.dim() > 0 ? input.size(0) : 0; }
};

/// What a training/validation/test step returns.
struct StepOutput {
  /// Required for automatic optimization: the Trainer runs backward on it (divided by
  /// accumulate_grad_batches) and steps the optimizer; undefined skips both for this batch.
  at::Tensor loss;
  std::map<std::string, at::Tensor> extra;  ///< anything a callback may want to read
};

/// How a stage ended, as loggers are told in Logger::finalize.
enum class RunStatus {
  success,     ///< the stage ran to its end
  failed,      ///< an exception ended it (it is rethrown to the caller)
  interrupted  ///< a signal (SIGTERM and the like) stopped it at a safe point, after a checkpoint
};
/// The status's name as in the enum ("success"); "unknown" for other values.
FULGUR_SDK_API const char* to_string(RunStatus status);

/// How a collective combines the ranks' tensors: elementwise sum, mean, max or min.
enum class ReduceOp { sum, mean, max, min };

/// Gradient clipping: by the total norm of the gradients (norm) or each element to
/// [-value, value] (value), as torch's clip_grad_norm_ / clip_grad_value_.
enum class GradClipAlgorithm { norm, value };

/// Where this process sits in a (possibly single-process) job, as the cluster environment
/// (torchrun, SLURM, MPI, the Trainer's own launcher) describes it. The same on every call.
struct ClusterInfo {
  int64_t global_rank = 0;                ///< this process among all, 0 .. world_size - 1
  int64_t world_size = 1;                 ///< processes in the job
  int64_t local_rank = 0;                 ///< this process among those on its node (picks its device)
  int64_t local_world_size = 1;           ///< processes on this node
  int64_t node_rank = 0;                  ///< this node among the job's nodes
  std::string master_addr = "127.0.0.1";  ///< host of rank zero's rendezvous store
  int64_t master_port = 0;                ///< its TCP port (0 when no launcher was detected)
};

}  // namespace fulgur
