// Communicator: the collectives a Strategy may use. The core implements it over LibTorch c10d
// (TCPStore + ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA); strategies never include c10d
// headers themselves, so a third-party strategy builds against the SDK alone.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

// How a strategy asks for its process group (StrategyEnvironment::connect).
struct CommunicatorOptions {
  std::string backend = "gloo";  // "gloo" or "nccl"
  // Every collective and the rendezvous give up after this long; a dead peer then surfaces as an
  // error instead of a hang (torch's default is 30 minutes).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);

  CommunicatorOptions& set_backend(std::string v) {
    backend = std::move(v);
    return *this;
  }
  CommunicatorOptions& set_timeout(std::chrono::milliseconds v) {
    timeout = v;
    return *this;
  }
};

// An in-flight asynchronous collective (for gradient buckets overlapping backward).
class FULGUR_SDK_API PendingCollective {
 public:
  virtual ~PendingCollective();
  virtual void wait() = 0;
};

struct GradientSyncOptions {
  // Gradients are all-reduced in buckets of about this size while backward still runs.
  int64_t bucket_cap_mb = 25;
  // Parameters that get no gradient in a step are marked ready after backward (costs a graph walk).
  bool find_unused_parameters = false;
  // Gradients alias the communication buckets (saves one copy and the memory of the gradients).
  bool gradient_as_bucket_view = false;
  // Names of the parameters, in order, for error messages (a parameter that got no gradient).
  std::vector<std::string> parameter_names;
};

// Data-parallel gradient averaging that overlaps backward: c10d's Reducer (the engine behind
// PyTorch's DistributedDataParallel) registered on a module's parameters.
class FULGUR_SDK_API GradientSync {
 public:
  virtual ~GradientSync();
  // Before each forward whose backward will synchronize (rebuilds buckets after step one).
  virtual void prepare_for_forward() = 0;
  // Right before backward of a synchronizing step; `outputs` seed the unused-parameter search.
  // Not calling it makes the following backward purely local (gradient accumulation, no_sync).
  virtual void prepare_for_backward(const std::vector<at::Tensor>& outputs) = 0;
};

class FULGUR_SDK_API Communicator {
 public:
  virtual ~Communicator();

  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual std::string backend() const = 0;  // "gloo", "nccl"

  virtual void all_reduce(at::Tensor& tensor, ReduceOp op) = 0;  // in place
  virtual std::unique_ptr<PendingCollective> all_reduce_async(at::Tensor& tensor, ReduceOp op) = 0;
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  virtual void broadcast(at::Tensor& tensor, int64_t src) = 0;
  // Broadcasts many tensors in a few large messages (initial parameters and buffers).
  virtual void broadcast_coalesced(std::vector<at::Tensor>& tensors, int64_t src) = 0;
  // `input` (world_size x output's elements, rank-major) reduced across ranks; this rank's slice
  // lands in `output`. One collective: sharded strategies' gradient reduction.
  virtual void reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op) = 0;
  virtual std::unique_ptr<PendingCollective> reduce_scatter_async(at::Tensor& output, const at::Tensor& input,
                                                                  ReduceOp op) = 0;
  // Every rank's `input` (the same number of elements everywhere), concatenated in rank order into
  // `output` (world_size x input's elements, contiguous). One collective: sharded strategies'
  // parameter gather (c10d's all_gather_into_tensor).
  virtual void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input) = 0;
  virtual std::unique_ptr<PendingCollective> all_gather_into_tensor_async(at::Tensor& output,
                                                                          const at::Tensor& input) = 0;
  // The same for several tensors in one go (c10d's coalesced forms: one message per group where the
  // backend batches them). outputs[i] pairs with inputs[i].
  virtual void all_gather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                const std::vector<at::Tensor>& inputs) = 0;
  virtual void reduce_scatter_coalesced(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                        ReduceOp op) = 0;
  virtual void barrier() = 0;

  // Rethrows an error raised while communication was under way (a backward whose gradient
  // buckets are all-reduced, say): an error of the process group becomes fulgur::Error
  // (distributed) naming this rank and, when known, the peer that died; others pass unchanged.
  [[noreturn]] virtual void rethrow(const char* operation, std::exception_ptr error) = 0;

  // Gradient averaging over `parameters` (all must require grad and live on one device).
  virtual std::unique_ptr<GradientSync> make_gradient_sync(std::vector<at::Tensor> parameters,
                                                           const GradientSyncOptions& options) = 0;
};

}  // namespace fulgur
