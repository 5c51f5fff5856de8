#include "sharded_parameter.h"

#include <fulgur/error.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <fmt/format.h>
#include <torch/utils.h>

#include <utility>

namespace fulgur::fsdp {

ShardedParameter& Shards::of(const at::Tensor& parameter, const RankGroup& group, bool own_storage) {
  auto found = by_tensor.find(parameter.unsafeGetTensorImpl());
  if (found != by_tensor.end()) return found->second;
  if (!parameter.defined() || (!by_tensor.empty() && parameter.scalar_type() != dtype))
    throw Error(ErrorKind::config,
                fmt::format("strategy 'fsdp': parameters of several dtypes ({} and {}) are not supported yet; "
                            "convert the model to one dtype (the precision plugin does)",
                            c10::toString(dtype), c10::toString(parameter.scalar_type())));
  dtype = parameter.scalar_type();
  const int64_t world = group.world_size, rank = group.rank;
  ShardedParameter p;
  p.full = parameter;
  p.trainable = parameter.requires_grad();
  p.rows = parameter.dim() == 0 ? 1 : parameter.size(0);
  p.row_numel = p.rows == 0 ? 0 : parameter.numel() / p.rows;
  p.chunk_rows = (p.rows + world - 1) / world;
  p.begin = std::min(p.rows, rank * p.chunk_rows);
  p.end = std::min(p.rows, (rank + 1) * p.chunk_rows);
  if (own_storage) {
    // A tensor of its own: the parameter's storage is freed between uses.
    const c10::Storage& storage = parameter.storage();
    if (!parameter.is_contiguous() || parameter.storage_offset() != 0 ||
        storage.nbytes() != static_cast<size_t>(parameter.numel()) * parameter.element_size())
      throw Error(ErrorKind::config,
                  "strategy 'fsdp': zero_stage = 3 frees each parameter's storage between uses, and a parameter "
                  "shares its storage with other tensors (a view, tied weights, a slice of a larger tensor); "
                  "give each parameter its own contiguous tensor or use zero_stage = 2");
    torch::NoGradGuard no_grad;
    p.full_alias = at::empty({0}, parameter.options()).set_(storage, 0, parameter.sizes(), parameter.strides());
    p.full_nbytes = storage.nbytes();
    p.shard = p.rows_of(p.full_alias, p.begin, p.local_rows()).clone().reshape(p.shard_shape());
    return by_tensor.emplace(parameter.unsafeGetTensorImpl(), std::move(p)).first->second;
  }
  // A view, not a copy: the optimizer updates this rank's rows of the parameter in place, and the
  // model holds no second copy of them (DeepSpeed's accounting: no extra 4 bytes per parameter).
  p.shard = p.rows_of(parameter.detach(), p.begin, p.local_rows()).reshape(p.shard_shape());
  if (p.local_rows() > 0 && !p.shard.is_alias_of(parameter))
    throw Error(ErrorKind::config,
                "strategy 'fsdp': a parameter that is not contiguous cannot be sharded in place; "
                "make it contiguous in the Module's constructor");
  return by_tensor.emplace(parameter.unsafeGetTensorImpl(), std::move(p)).first->second;
}

const std::vector<ShardedParameter*>& Shards::of_optimizer(const torch::optim::Optimizer& optimizer) const {
  auto found = by_optimizer.find(&optimizer);
  if (found == by_optimizer.end())
    throw Error(ErrorKind::runtime, "strategy 'fsdp': an optimizer that setup_optimizers never saw");
  return found->second;
}

void Shards::lay_out_flat_buffers() {
  flat_numel = 0;
  for (ShardedParameter* p : ordered) {
    p->flat_offset = flat_numel;
    flat_numel += p->chunk_numel();
  }
}

void Shards::reduce_gradients(const ShardingOptions& options, const RankGroup& group) {
  torch::NoGradGuard no_grad;
  const int64_t world = group.world_size, n = static_cast<int64_t>(ordered.size());
  // A parameter that got no gradient on any rank keeps none, as in one process.
  at::Tensor has_gradient = at::zeros({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kInt));
  auto flags = has_gradient.accessor<int, 1>();
  for (int64_t i = 0; i < n; ++i) flags[i] = ordered[i]->full.grad().defined() ? 1 : 0;
  if (group.communicator && n > 0) group.communicator->all_reduce(has_gradient, ReduceOp::max);
  const auto used = has_gradient.accessor<int, 1>();

  // Every rank's gradient cut into per-rank chunks (zeros where it has none) in one flat buffer.
  const at::TensorOptions reduce = at::TensorOptions().dtype(options.reduce_dtype_for(dtype)).device(group.device);
  at::Tensor flat = at::zeros({world * flat_numel}, reduce);
  for (int64_t i = 0; i < n; ++i)
    if (used[i] && ordered[i]->full.grad().defined())
      pack_rank_major(*ordered[i], ordered[i]->full.grad(), flat, flat_numel, ordered[i]->flat_offset, world);
  at::Tensor mine;  // this rank's averaged rows, in flat layout
  if (options.zero_stage == 1) {
    // All-reduce the whole gradient, then keep this rank's rows.
    if (group.communicator) group.communicator->all_reduce(flat, ReduceOp::mean);
    mine = flat.narrow(0, group.rank * flat_numel, flat_numel);
  } else {
    // Reduce-scatter: every rank receives its own chunk only.
    mine = at::zeros({flat_numel}, reduce);
    if (group.communicator)
      group.communicator->reduce_scatter(mine, flat, ReduceOp::mean);
    else
      mine.copy_(flat);
  }
  if (options.offload_optimizer) mine = mine.to(at::kCPU);  // one copy to host memory for every parameter
  for (int64_t i = 0; i < n; ++i) {
    ShardedParameter& p = *ordered[i];
    p.full.mutable_grad().reset();
    if (used[i]) land_gradient(p, mine.narrow(0, p.flat_offset, p.local_rows() * p.row_numel));
  }
}

void Shards::gather_parameters(const RankGroup& group) {
  torch::NoGradGuard no_grad;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(group.device);
  at::Tensor mine = at::zeros({flat_numel}, options);
  for (ShardedParameter* p : ordered)
    mine.narrow(0, p->flat_offset, p->local_rows() * p->row_numel).copy_(p->shard.reshape({-1}));
  at::Tensor all = mine;
  if (group.communicator) {
    all = at::empty({group.world_size * flat_numel}, options);
    group.communicator->all_gather_into_tensor(all, mine);
  }
  for (ShardedParameter* p : ordered) unpack_rank_major(*p, all, p->full, flat_numel, p->flat_offset, group.world_size);
}

void pack_rank_major(const ShardedParameter& p, const at::Tensor& whole, const at::Tensor& flat, int64_t slice,
                     int64_t offset, int64_t world_size) {
  for (int64_t j = 0; j < world_size; ++j) {
    const auto [first, count] = p.rows_of_rank(j);
    if (count <= 0) continue;
    flat.narrow(0, j * slice + offset, count * p.row_numel)
        .view({count, p.row_numel})
        .copy_(p.rows_of(whole, first, count));
  }
}

void unpack_rank_major(const ShardedParameter& p, const at::Tensor& all, const at::Tensor& whole, int64_t slice,
                       int64_t offset, int64_t world_size) {
  for (int64_t j = 0; j < world_size; ++j) {
    const auto [first, count] = p.rows_of_rank(j);
    if (count <= 0) continue;
    p.rows_of(whole, first, count)
        .copy_(all.narrow(0, j * slice + offset, count * p.row_numel).view({count, p.row_numel}));
  }
}

void land_gradient(ShardedParameter& p, const at::Tensor& flat_rows) {
  const at::Tensor rows = flat_rows.reshape(p.shard_shape());
  at::Tensor& target = p.stepped();
  at::Tensor& grad = target.mutable_grad();
  if (grad.defined())
    grad.add_(rows);
  else
    grad = rows.to(target.options(), /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor gather_rows(const ShardedParameter& p, const at::Tensor& local, const RankGroup& group) {
  // On the device: with offload_optimizer the optimizer state is in host memory, which NCCL cannot send.
  at::Tensor padded = at::zeros({p.chunk_numel()}, local.options().device(group.device));
  padded.narrow(0, 0, local.numel()).copy_(local.reshape({-1}));
  at::Tensor all = padded;
  if (group.communicator) {
    all = at::empty({group.world_size * p.chunk_numel()}, padded.options());
    group.communicator->all_gather_into_tensor(all, padded);
  }
  std::vector<at::Tensor> pieces;
  for (int64_t j = 0; j < group.world_size; ++j)
    if (const int64_t count = p.rows_of_rank(j).count; count > 0)
      pieces.push_back(all.narrow(0, j * p.chunk_numel(), count * p.row_numel));
  return at::cat(pieces).reshape(p.full.sizes());
}

}  // namespace fulgur::fsdp
