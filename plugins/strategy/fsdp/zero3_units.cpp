#include "zero3_units.h"

#include <fulgur/log.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <deque>
#include <utility>

namespace fulgur::fsdp {
namespace {

// The identity on a block's input whose backward runs its AfterBlock.
struct AfterBlockBackward : torch::autograd::Function<AfterBlockBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<AfterBlock> after) {
    ctx->saved_data["after"] = c10::IValue::make_capsule(std::move(after));
    return input;  // autograd makes it a view of the input with this node as its history
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    c10::static_intrusive_pointer_cast<AfterBlock>(ctx->saved_data["after"].toCapsule())->run();
    return {grad_outputs[0], at::Tensor()};
  }
};

void allocate(ShardedParameter& p) {
  if (p.materialised) return;
  c10::StorageImpl* storage = p.full.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = storage->allocator();
  if (!allocator) allocator = c10::GetAllocator(p.full.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(p.full_nbytes));
  storage->set_nbytes(p.full_nbytes);
  p.materialised = true;
}

}  // namespace

void release(ShardedParameter& p) {
  if (!p.materialised || p.full_nbytes == 0) return;
  c10::StorageImpl* storage = p.full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, p.full.device()));
  storage->set_nbytes(0);
  p.materialised = false;
}

void set_storage_dtype(ShardedParameter& p, at::ScalarType dtype) {
  if (p.full.scalar_type() == dtype) return;
  torch::NoGradGuard no_grad;
  const at::Tensor grad = p.full.grad();
  p.full.set_data(at::empty(p.full.sizes(), p.full.options().dtype(dtype)));
  if (grad.defined()) p.full.mutable_grad() = grad.to(dtype);
  const c10::Storage& storage = p.full.storage();
  p.full_alias = at::empty({0}, p.full.options()).set_(storage, 0, p.full.sizes(), p.full.strides());
  p.full_nbytes = storage.nbytes();
  p.materialised = true;
  release(p);
}

at::Tensor Zero3Units::run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward) {
  Unit& unit = unit_of(block);
  if (unit.parameters.empty()) return forward(input);
  const bool with_gradients = torch::GradMode::is_enabled();
  if (with_gradients) this_forward_.push_back(&unit);
  gather_unit(unit);
  prefetch_after(unit, +1);
  at::Tensor x = input;
  if (with_gradients && input.requires_grad()) x = AfterBlockBackward::apply(input, unit_capsule(unit));
  // param_dtype: the block computes in the gathered parameters' dtype (FSDP2's cast_forward_inputs)
  // and hands its output back in the input's dtype, so the code around blocks needs no change.
  const at::ScalarType compute = unit.parameters.front()->full.scalar_type();
  const bool cast = options_.param_dtype && compute == *options_.param_dtype && input.is_floating_point() &&
                    input.scalar_type() != compute;
  if (cast) x = x.to(compute);
  at::Tensor output = forward(x);
  if (with_gradients && output.requires_grad())
    output.register_hook([this, &unit](const at::Tensor&) {
      gather_unit(unit);
      prefetch_after(unit, -1);
    });
  if ((options_.reshard_after_forward || !with_gradients) && full_parameters_held_ == 0)
    for (ShardedParameter* p : unit.parameters) release(*p);
  return cast && output.is_floating_point() ? output.to(input.scalar_type()) : output;
}

void Zero3Units::before_training_step(bool sync_gradients) {
  sync_gradients_ = sync_gradients;
  remember_forward_order();
}

void Zero3Units::begin_backward(bool sync_gradients) {
  sync_gradients_ = sync_gradients;
  reductions_.clear();  // left by a backward that threw
  for (ShardedParameter* p : shards_.ordered) p->reduced = false;
  remember_forward_order();  // backward prefetches in the reverse of the forward just run
}

void Zero3Units::finish_backward() {
  drain_prefetches();
  if (sync_gradients_) {
    std::vector<ShardedParameter*> rest;
    for (ShardedParameter* p : shards_.ordered)
      if (!p->reduced) rest.push_back(p);
    reduce_scatter_group(rest, /*async=*/false);
    land_reductions(reductions_.size());
  }
  if (full_parameters_held_ == 0)
    for (ShardedParameter* p : shards_.ordered)
      if (p->in_block) release(*p);
}

void Zero3Units::after_step() {
  std::vector<ShardedParameter*> outside;
  for (ShardedParameter* p : shards_.ordered) {
    if (p->in_block)
      release(*p);
    else
      outside.push_back(p);
  }
  gather_group(outside, /*refresh=*/true);
}

void Zero3Units::hold_full_parameters() {
  if (full_parameters_held_++ == 0 && options_.param_dtype) {
    drain_prefetches();
    for (ShardedParameter* p : shards_.ordered)
      if (p->in_block) set_storage_dtype(*p, shards_.dtype);
  }
  gather_group(shards_.ordered);
}

void Zero3Units::release_full_parameters() {
  if (full_parameters_held_ > 0 && --full_parameters_held_ == 0) {
    write_back_rows();
    for (ShardedParameter* p : shards_.ordered)
      if (p->in_block) {
        release(*p);
        if (options_.param_dtype) set_storage_dtype(*p, *options_.param_dtype);
      }
  }
}

// Whole parameters a callback may have changed (ema swapping in its average, pruning zeroing
// weights): this rank's rows go back to the shards, from which every later gather and the
// optimizer start. Every rank changed the same values, so the shards stay one model. A local copy.
void Zero3Units::write_back_rows() {
  torch::NoGradGuard no_grad;
  for (ShardedParameter* p : shards_.ordered) {
    if (!p->materialised || p->local_rows() == 0) continue;
    p->shard.copy_(p->rows_of(p->full_alias, p->begin, p->local_rows()).reshape(p->shard_shape()));
    if (p->host.defined()) p->host.copy_(p->shard);
  }
}

void Zero3Units::gather_group(const std::vector<ShardedParameter*>& group, bool refresh, bool drain) {
  if (drain) drain_prefetches();  // a prefetched unit may overlap the group
  bool needed = refresh;
  for (ShardedParameter* p : group) needed = needed || !p->materialised;
  if (group.empty() || !needed) return;
  // One collective per dtype (under param_dtype, blocks' parameters and the others differ).
  std::vector<ShardedParameter*> same, other;
  for (ShardedParameter* p : group)
    (p->full.scalar_type() == group.front()->full.scalar_type() ? same : other).push_back(p);
  if (!other.empty()) {
    gather_group(same, /*refresh=*/true, /*drain=*/false);
    gather_group(other, /*refresh=*/true, /*drain=*/false);
    return;
  }
  InFlightGather gather = start_gather(group, /*async=*/false);
  finish_gather(group, gather);
}

void Zero3Units::refresh_whole() {
  std::vector<ShardedParameter*> whole;
  for (ShardedParameter* p : shards_.ordered)
    if (p->materialised) whole.push_back(p);
  gather_group(whole, /*refresh=*/true);
}

void Zero3Units::drain_prefetches() {
  for (auto& [module, unit] : units_) {
    (void)module;
    if (!unit.prefetched) continue;
    auto gather = std::move(unit.prefetched);
    finish_gather(unit.parameters, *gather);
  }
}

void Zero3Units::clear() {
  units_.clear();
  forward_order_.clear();
  this_forward_.clear();
}

void Zero3Units::report_traffic() {
  if (log::enabled(log::Level::debug))
    log::debug(fmt::format(
        "strategy 'fsdp': since the previous optimizer step: {} all-gathers ({} started ahead), {} reduce-scatters "
        "({} units), {} of the reduce-scatters overlapping backward",
        all_gathers_, prefetches_, reduce_scatters_, units_.size(), reduce_scatters_overlapped_));
  reset_traffic();
}

Zero3Units::Unit& Zero3Units::unit_of(torch::nn::Module& block) {
  auto found = units_.find(&block);
  if (found != units_.end()) return found->second;
  Unit unit;
  for (const at::Tensor& parameter : block.parameters()) {
    auto sharded = shards_.by_tensor.find(parameter.unsafeGetTensorImpl());
    if (sharded == shards_.by_tensor.end() || sharded->second.in_block) continue;
    sharded->second.in_block = true;
    if (options_.param_dtype && full_parameters_held_ == 0) set_storage_dtype(sharded->second, *options_.param_dtype);
    unit.parameters.push_back(&sharded->second);
  }
  if (options_.param_dtype && !unit.parameters.empty() && log::enabled(log::Level::debug))
    log::debug(fmt::format("strategy 'fsdp': a block of {} parameters computes in {}", unit.parameters.size(),
                           c10::toString(unit.parameters.front()->full.scalar_type())));
  return units_.emplace(&block, std::move(unit)).first->second;
}

// The order blocks ran in during the last training forward: what prefetching follows, in this
// step's backward and the next step's forward (the same on every rank, so the prefetches pair up).
void Zero3Units::remember_forward_order() {
  if (this_forward_.empty()) return;
  forward_order_ = std::move(this_forward_);
  this_forward_.clear();
  for (auto& [module, unit] : units_) unit.order = -1;
  for (size_t i = 0; i < forward_order_.size(); ++i)
    if (forward_order_[i]->order < 0) forward_order_[i]->order = static_cast<int64_t>(i);
}

c10::intrusive_ptr<AfterBlock> Zero3Units::unit_capsule(Unit& unit) {
  if (!unit.after) {
    unit.after = c10::make_intrusive<AfterBlock>();
    unit.after->run = [this, &unit] { after_block_backward(unit); };
  }
  return unit.after;
}

void Zero3Units::after_block_backward(Unit& unit) {
  if (sync_gradients_) reduce_scatter_group(unit.parameters, /*async=*/true);
  if (full_parameters_held_ == 0)
    for (ShardedParameter* p : unit.parameters) release(*p);
}

Zero3Units::InFlightGather Zero3Units::start_gather(const std::vector<ShardedParameter*>& group, bool async) {
  torch::NoGradGuard no_grad;
  InFlightGather gather;
  for (ShardedParameter* p : group) gather.unit_numel += p->chunk_numel();
  // In the dtype the parameters compute in: the shards are cast on the way in (param_dtype).
  const at::TensorOptions options = at::TensorOptions().dtype(group.front()->full.scalar_type()).device(group_.device);
  gather.mine = at::zeros({gather.unit_numel}, options);
  int64_t offset = 0;
  for (ShardedParameter* p : group) {
    gather.mine.narrow(0, offset, p->local_rows() * p->row_numel).copy_(p->shard.reshape({-1}));
    offset += p->chunk_numel();
  }
  gather.all = gather.mine;
  if (group_.communicator) {
    gather.all = at::empty({group_.world_size * gather.unit_numel}, options);
    if (async)
      gather.pending = group_.communicator->all_gather_into_tensor_async(gather.all, gather.mine);
    else
      group_.communicator->all_gather_into_tensor(gather.all, gather.mine);
  }
  ++all_gathers_;
  return gather;
}

void Zero3Units::finish_gather(const std::vector<ShardedParameter*>& group, InFlightGather& gather) {
  torch::NoGradGuard no_grad;
  if (gather.pending) gather.pending->wait();
  gather.pending.reset();
  int64_t offset = 0;
  for (ShardedParameter* p : group) {
    allocate(*p);
    unpack_rank_major(*p, gather.all, p->full_alias, gather.unit_numel, offset, group_.world_size);
    offset += p->chunk_numel();
  }
}

// A unit whole for its forward or backward: from its prefetch when one is under way.
void Zero3Units::gather_unit(Unit& unit) {
  if (unit.prefetched) {
    finish_gather(unit.parameters, *unit.prefetched);
    unit.prefetched.reset();
    return;
  }
  gather_group(unit.parameters, /*refresh=*/false, /*drain=*/false);  // units never overlap
}

// Starts the all-gather of the unit that ran `step` places away from `unit` in the previous
// training forward (+1 in forward, -1 in backward), so that it overlaps this unit's compute.
void Zero3Units::prefetch_after(const Unit& unit, int step) {
  if (!options_.prefetch || unit.order < 0) return;
  const int64_t next = unit.order + step;
  if (next < 0 || next >= static_cast<int64_t>(forward_order_.size())) return;
  Unit& target = *forward_order_[next];
  if (target.prefetched || prefetch_in_flight()) return;  // one ahead at most: two units whole, not more
  bool needed = false;
  for (ShardedParameter* p : target.parameters) needed = needed || !p->materialised;
  if (!needed) return;
  target.prefetched = std::make_unique<InFlightGather>(start_gather(target.parameters, /*async=*/true));
  ++prefetches_;
}

bool Zero3Units::prefetch_in_flight() const {
  for (const auto& [module, unit] : units_)
    if (unit.prefetched) return true;
  return false;
}

at::TensorOptions Zero3Units::reduce_options() const {
  return at::TensorOptions().dtype(options_.reduce_dtype_for(shards_.dtype)).device(group_.device);
}

// Averages the group's gradients across ranks and leaves each rank its rows, on the shards, in
// one reduce-scatter. Each rank's slice ends with one flag per parameter (1: it has a gradient
// here), summed with the gradients: a parameter no rank gave a gradient keeps none, as in one
// process, without a second collective. With overlap_reduce (and `async`, in backward) the
// reduce-scatter runs while backward goes on: the gradients are packed and dropped at once, the
// rows land when it completes (at most two under way: a third waits for the oldest, so that the
// packed buffers stay a unit or two, FSDP2's bound), and the end of backward lands the rest.
void Zero3Units::reduce_scatter_group(const std::vector<ShardedParameter*>& candidates, bool async) {
  InFlightReduce reduction;
  for (ShardedParameter* p : candidates)
    if (p->trainable && !p->reduced) reduction.group.push_back(p);
  if (reduction.group.empty()) return;
  torch::NoGradGuard no_grad;
  const std::vector<ShardedParameter*>& group = reduction.group;
  const int64_t world = group_.world_size, n = static_cast<int64_t>(group.size());
  int64_t slice = n;
  for (ShardedParameter* p : group) slice += p->chunk_numel();
  at::Tensor flat = at::zeros({world * slice}, reduce_options());
  int64_t offset = 0;
  for (ShardedParameter* p : group) {
    if (const at::Tensor grad = p->full.grad(); grad.defined()) pack_rank_major(*p, grad, flat, slice, offset, world);
    offset += p->chunk_numel();
  }
  for (int64_t j = 0; j < world; ++j)
    for (int64_t i = 0; i < n; ++i)
      if (group[i]->full.grad().defined()) flat[j * slice + offset + i] = 1;
  for (ShardedParameter* p : group) {
    p->reduced = true;
    p->full.mutable_grad().reset();  // packed: the flat buffer holds it now
  }
  reduction.numel = offset;
  reduction.flat = flat;
  reduction.mine = at::zeros({slice}, reduce_options());
  if (!group_.communicator)
    reduction.mine.copy_(flat);
  else if (async && options_.overlap_reduce)
    reduction.pending = group_.communicator->reduce_scatter_async(reduction.mine, reduction.flat, ReduceOp::sum);
  else
    group_.communicator->reduce_scatter(reduction.mine, reduction.flat, ReduceOp::sum);
  ++reduce_scatters_;
  if (!reduction.pending) {
    land_reduction(reduction);
    return;
  }
  ++reduce_scatters_overlapped_;
  reductions_.push_back(std::move(reduction));
  if (reductions_.size() > 2) land_reductions(1);
}

// Completes the `count` oldest reduce-scatters under way, in the order they started.
void Zero3Units::land_reductions(size_t count) {
  while (count-- > 0 && !reductions_.empty()) {
    InFlightReduce reduction = std::move(reductions_.front());
    reductions_.pop_front();
    land_reduction(reduction);
  }
}

void Zero3Units::land_reduction(InFlightReduce& reduction) {
  torch::NoGradGuard no_grad;
  if (reduction.pending) reduction.pending->wait();
  reduction.pending.reset();
  const int64_t n = static_cast<int64_t>(reduction.group.size());
  at::Tensor mine = reduction.mine;
  mine.narrow(0, 0, reduction.numel).div_(static_cast<double>(group_.world_size));
  const at::Tensor landed = options_.offload_optimizer ? mine.to(at::kCPU) : mine;  // one copy to host memory
  const auto flags = landed.narrow(0, reduction.numel, n).to(at::kCPU);
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    ShardedParameter& p = *reduction.group[i];
    if (flags[i].item<double>() > 0) land_gradient(p, landed.narrow(0, offset, p.local_rows() * p.row_numel));
    offset += p.chunk_numel();
  }
}

c10::IValue with_copied_tensors(const c10::IValue& state) {
  const auto entries = state.toGenericDict();
  auto copies = c10::impl::GenericDict(entries.keyType(), entries.valueType());
  for (const auto& entry : entries)
    copies.insert(entry.key(),
                  entry.value().isTensor() ? c10::IValue(entry.value().toTensor().clone()) : entry.value());
  return copies;
}

}  // namespace fulgur::fsdp
