/// @file
/// Communicator: the collectives a Strategy may use. The core implements it over LibTorch c10d
/// (TCPStore + ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA); strategies never include c10d
/// headers themselves, so a third-party strategy builds against the SDK alone.
#pragma once

#include <fulgur/export.h>
#include <fulgur/types.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace fulgur {

/// How a strategy asks for its process group (StrategyEnvironment::connect).
struct CommunicatorOptions {
  std::string backend = "gloo";  ///< "gloo" or "nccl" (CUDA tensors only)
  /// Every collective and the rendezvous give up after this long; a dead peer then surfaces as an
  /// error instead of a hang (torch's default is 30 minutes).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);

  /// Sets backend; returns *this for chaining.
  CommunicatorOptions& set_backend(std::string v) {
    backend = std::move(v);
    return *this;
  }
  /// Sets timeout; returns *this for chaining.
  CommunicatorOptions& set_timeout(std::chrono::milliseconds v) {
    timeout = v;
    return *this;
  }
};

/// An in-flight asynchronous collective (for gradient buckets overlapping backward). The tensors
/// it was started on must stay alive and untouched until wait() returns.
class FULGUR_SDK_API PendingCollective {
 public:
  virtual ~PendingCollective();
  /// Blocks until the collective has finished and its result is in the tensor (divided by the
  /// world size for ReduceOp::mean). Call it exactly once. Throws fulgur::Error(distributed) when
  /// the collective failed.
  virtual void wait() = 0;
};

/// How Communicator::make_gradient_sync buckets and reduces gradients (DistributedDataParallel's
/// options of the same names).
struct GradientSyncOptions {
  /// Gradients are all-reduced in buckets of about this size while backward still runs.
  int64_t bucket_cap_mb = 25;
  /// Parameters that get no gradient in a step are marked ready after backward (costs a graph
  /// walk).
  bool find_unused_parameters = false;
  /// Gradients alias the communication buckets (saves one copy and the memory of the gradients).
  bool gradient_as_bucket_view = false;
  /// Names of the parameters, in order, for error messages (a parameter that got no gradient).
  std::vector<std::string> parameter_names;
};

/// Data-parallel gradient averaging that overlaps backward: c10d's Reducer (the engine behind
/// PyTorch's DistributedDataParallel) registered on a module's parameters. Owned by the strategy
/// that made it; the all-reduces start from autograd hooks (on autograd's threads) as buckets
/// fill, and the gradients are averaged when backward returns. Every rank makes the same calls, in
/// the same order: prepare_for_forward and the synchronizing backward are collectives.
class FULGUR_SDK_API GradientSync {
 public:
  virtual ~GradientSync();
  /// Before each forward whose backward will synchronize (rebuilds buckets after step one).
  virtual void prepare_for_forward() = 0;
  /// Right before backward of a synchronizing step; `outputs` seed the unused-parameter search.
  /// Not calling it makes the following backward purely local (gradient accumulation, no_sync).
  /// Throws fulgur::Error(config) naming the parameters when the previous step left some without
  /// a gradient and find_unused_parameters is off.
  virtual void prepare_for_backward(const std::vector<at::Tensor>& outputs) = 0;
};

/// The job's process group, as StrategyEnvironment::connect returns it. Owned by the strategy
/// (shared); destroying it leaves the group (after a barrier, unless this rank failed). Used from
/// the thread that runs the Trainer's stages. Every operation but rank(), world_size(), backend()
/// and rethrow() is a collective: every rank calls it with matching tensors (same dtype, same
/// element counts where said), in the same order. Blocking forms return when the result is in
/// place; a failed or timed-out collective throws fulgur::Error(distributed) naming this rank
/// and, when known, the peer that died.
class FULGUR_SDK_API Communicator {
 public:
  virtual ~Communicator();

  virtual int64_t rank() const = 0;         ///< this process's global rank
  virtual int64_t world_size() const = 0;   ///< processes in the group
  virtual std::string backend() const = 0;  ///< "gloo", "nccl"

  /// `tensor` reduced elementwise over all ranks, in place, on every rank.
  virtual void all_reduce(at::Tensor& tensor, ReduceOp op) = 0;
  /// all_reduce, started; the result is in `tensor` once the returned collective's wait() returns.
  virtual std::unique_ptr<PendingCollective> all_reduce_async(at::Tensor& tensor, ReduceOp op) = 0;
  /// Every rank's `tensor` (the same shape everywhere), new tensors in rank order.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  /// Overwrites `tensor` on every rank with rank `src`'s.
  virtual void broadcast(at::Tensor& tensor, int64_t src) = 0;
  /// Broadcasts many tensors in a few large messages (initial parameters and buffers).
  virtual void broadcast_coalesced(std::vector<at::Tensor>& tensors, int64_t src) = 0;
  /// `input` (world_size x output's elements, rank-major) reduced across ranks; this rank's slice
  /// lands in `output`. One collective: sharded strategies' gradient reduction.
  virtual void reduce_scatter(at::Tensor& output, const at::Tensor& input, ReduceOp op) = 0;
  /// reduce_scatter, started; the result is in `output` once wait() returns.
  virtual std::unique_ptr<PendingCollective> reduce_scatter_async(at::Tensor& output, const at::Tensor& input,
                                                                  ReduceOp op) = 0;
  /// Every rank's `input` (the same number of elements everywhere), concatenated in rank order into
  /// `output` (world_size x input's elements, contiguous). One collective: sharded strategies'
  /// parameter gather (c10d's all_gather_into_tensor). Throws fulgur::Error(invalid_argument) when
  /// the sizes do not match.
  virtual void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input) = 0;
  /// all_gather_into_tensor, started; the result is in `output` once wait() returns.
  virtual std::unique_ptr<PendingCollective> all_gather_into_tensor_async(at::Tensor& output,
                                                                          const at::Tensor& input) = 0;
  /// The same for several tensors in one go (c10d's coalesced forms: one message per group where
  /// the backend batches them). outputs[i] pairs with inputs[i].
  virtual void all_gather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                const std::vector<at::Tensor>& inputs) = 0;
  /// reduce_scatter for several tensors in one go; outputs[i] pairs with inputs[i].
  virtual void reduce_scatter_coalesced(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                        ReduceOp op) = 0;
  /// Returns when every rank has arrived.
  virtual void barrier() = 0;

  /// Rethrows an error raised while communication was under way (a backward whose gradient
  /// buckets are all-reduced, say): an error of the process group becomes fulgur::Error
  /// (distributed) naming `operation`, this rank and, when known, the peer that died; others pass
  /// unchanged. Not a collective; always throws.
  [[noreturn]] virtual void rethrow(const char* operation, std::exception_ptr error) = 0;

  /// Gradient averaging over `parameters` (all must require grad and live on one device), owned
  /// by the caller. A collective (every rank passes its copy of the same parameters, in the same
  /// order). Throws fulgur::Error(invalid_argument) for an empty list.
  virtual std::unique_ptr<GradientSync> make_gradient_sync(std::vector<at::Tensor> parameters,
                                                           const GradientSyncOptions& options) = 0;
};

}  // namespace fulgur
