// The fsdp strategy's unit of sharding: one parameter split on dim 0 into world_size chunks of
// ceil(rows / world_size) rows (FSDP2's layout; the last ranks' chunks may be short or empty, a
// 0-dim parameter is one row owned by rank 0), the set of them in the orders every rank visits
// them, and the collectives that move rows: the stage-1/2 gradient reduction and parameter
// gather over one flat buffer, and the gather of one tensor's rows (optimizer state).
#pragma once

#include <fulgur/communicator.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/TensorImpl.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fulgur::fsdp {

/// Rows [first, first + count) of a parameter.
struct RowRange {
  int64_t first = 0;
  int64_t count = 0;
};

/// One parameter as the strategy shards it.
struct ShardedParameter {
  at::Tensor full;   // the module's parameter (whole on every rank in stages 1 and 2)
  at::Tensor shard;  // a view of this rank's rows of it: the tensor the optimizer steps, in place
  at::Tensor host;   // offload_optimizer: a copy of the shard in host memory, stepped instead
  int64_t rows = 1, chunk_rows = 1, row_numel = 1;
  int64_t begin = 0, end = 0;  // this rank's rows [begin, end)
  int64_t flat_offset = 0;     // its padded chunk's place in one rank's slice of the flat buffers
  bool trainable = true;       // frozen parameters (requires_grad false) never get gradients
  // Stage 3 only.
  at::Tensor full_alias;     // full's storage through a tensor with its own version counter: a
                             // gather writes through it without invalidating what autograd saved
  size_t full_nbytes = 0;    // the storage's size when whole
  bool materialised = true;  // full's storage holds the current values (false: freed)
  bool in_block = false;     // a block claimed it (else it stays whole, like stage 2)
  bool reduced = false;      // its gradient was reduce-scattered during the current backward

  int64_t local_rows() const { return end - begin; }
  int64_t chunk_numel() const { return chunk_rows * row_numel; }
  /// The rows rank `rank` owns (count 0 for a rank past the last row).
  RowRange rows_of_rank(int64_t rank) const {
    const int64_t first = std::min(rows, rank * chunk_rows);
    return {first, std::min(rows, (rank + 1) * chunk_rows) - first};
  }
  /// Rows [first, first + count) of a tensor shaped like the parameter, as [count, row_numel].
  at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t count) const {
    return t.reshape({rows, row_numel}).narrow(0, first, count);
  }
  /// The tensor the optimizer steps and whose gradient the collectives fill.
  at::Tensor& stepped() { return host.defined() ? host : shard; }
  const at::Tensor& stepped() const { return host.defined() ? host : shard; }
  /// Whether `t` is this rank's rows of the parameter rather than the whole of it (as a stage-3
  /// rank reads them from a sharded checkpoint).
  bool is_local_rows(const at::Tensor& t) const {
    return full.dim() > 0 && local_rows() < rows && t.sizes().vec() == shard_shape();
  }
  /// The shape of this rank's rows (a 0-dim parameter: 0-dim on its owner, {0} elsewhere).
  std::vector<int64_t> shard_shape() const {
    if (full.dim() == 0) return local_rows() == 1 ? std::vector<int64_t>{} : std::vector<int64_t>{0};
    std::vector<int64_t> shape(full.sizes().begin(), full.sizes().end());
    shape[0] = local_rows();
    return shape;
  }
};

/// Where the collectives on rows run: the process group (null: a job of one process), this rank's
/// place in it and its device. The strategy refreshes it in setup_environment.
struct RankGroup {
  Communicator* communicator = nullptr;
  int64_t world_size = 1;
  int64_t rank = 0;
  c10::Device device{c10::DeviceType::CPU};
};

/// The strategy's options that decide how rows travel and where the stepped rows live.
struct ShardingOptions {
  int64_t zero_stage = 2;
  bool reshard_after_forward = true;           // stage 3: free a block's parameters after its forward
  bool prefetch = true;                        // stage 3: gather the next block while one computes
  bool offload_optimizer = false;              // the optimizer steps host copies of the rows
  bool overlap_reduce = true;                  // gradients averaged while backward runs (gradient_buckets.h)
  int64_t reduce_bucket_bytes = 25 << 20;      // stages 1 and 2 with overlap_reduce: a bucket's gradients
  std::optional<at::ScalarType> reduce_dtype;  // nullopt: param_dtype, else the parameters' dtype
  std::optional<at::ScalarType> param_dtype;   // stage 3: blocks compute in it (nullopt: the model's)

  /// The dtype gradients travel in for parameters of `dtype` (bfloat16 halves the bytes); they
  /// land on the shards in the parameters' dtype.
  at::ScalarType reduce_dtype_for(at::ScalarType dtype) const {
    return reduce_dtype.value_or(param_dtype.value_or(dtype));
  }
};

/// Every parameter the strategy shards, and the orders the ranks visit them in: the same on every
/// rank, so that the collectives pair up.
struct Shards {
  std::map<const c10::TensorImpl*, ShardedParameter> by_tensor;  // keyed by the module's parameter
  std::vector<ShardedParameter*> ordered;                        // the collectives' layout (each parameter once)
  std::map<std::string, ShardedParameter*> named;                // stage 3: every parameter by its dotted name
  std::vector<const torch::optim::Optimizer*> optimizers;        // in setup_optimizers' order
  std::map<const torch::optim::Optimizer*, std::vector<ShardedParameter*>> by_optimizer;  // param groups' order
  at::ScalarType dtype = at::kFloat;  // every parameter's: one dtype only
  int64_t flat_numel = 0;             // stages 1 and 2: one rank's slice of the flat buffers

  /// `parameter`'s shard, made on first sight: this rank's rows as a view of the parameter
  /// (stages 1 and 2), or as a tensor of their own (`own_storage`, stage 3: the parameter's storage
  /// is freed between uses). Throws fulgur::Error(config) for a parameter it cannot split.
  ShardedParameter& of(const at::Tensor& parameter, const RankGroup& group, bool own_storage);
  /// The rows the optimizer steps, in its param groups' order; throws for one never set up.
  const std::vector<ShardedParameter*>& of_optimizer(const torch::optim::Optimizer& optimizer) const;

  /// Stages 1 and 2: each parameter's padded chunk gets its place in one rank's slice of the flat
  /// buffers.
  void lay_out_flat_buffers();
  /// Stages 1 and 2: averages a step's gradients across ranks and leaves each rank its rows of them
  /// on the shards (all-reduced in stage 1, reduce-scattered in stage 2); the full gradients are
  /// dropped (stage 2 never holds the averaged full gradient).
  void reduce_gradients(const ShardingOptions& options, const RankGroup& group);
  /// Stages 1 and 2, after the step: every rank's updated rows, gathered into the full parameters
  /// (one collective).
  void gather_parameters(const RankGroup& group);
};

/// Copies rank j's rows of `whole` (shaped like p's parameter) to `flat` at j * slice + offset, for
/// every rank j: the layout a reduce-scatter hands each rank its slice of.
void pack_rank_major(const ShardedParameter& p, const at::Tensor& whole, const at::Tensor& flat, int64_t slice,
                     int64_t offset, int64_t world_size);
/// The reverse: rank j's rows from `all` at j * slice + offset into `whole`, for every rank j (after
/// an all-gather).
void unpack_rank_major(const ShardedParameter& p, const at::Tensor& all, const at::Tensor& whole, int64_t slice,
                       int64_t offset, int64_t world_size);

/// This rank's averaged rows of a gradient (flat) onto what the optimizer steps. A gradient not
/// zeroed since the last step (manual optimization) accumulates, as in one process.
void land_gradient(ShardedParameter& p, const at::Tensor& flat_rows);

/// A tensor shaped like this rank's rows of `p`, gathered into the parameter's full shape (a
/// collective, on the group's device).
at::Tensor gather_rows(const ShardedParameter& p, const at::Tensor& local, const RankGroup& group);

}  // namespace fulgur::fsdp
