#include "gradient_buckets.h"

#include <fulgur/error.h>

#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/utils.h>

#include <utility>

namespace fulgur::fsdp {

void GradientBuckets::set_up(Shards& shards, int64_t bucket_bytes) {
  clear();
  shards_ = &shards;
  bucket_bytes_ = bucket_bytes;
  dtype_ = options_.reduce_dtype_for(shards.dtype);
  sequence_.assign(shards.ordered.rbegin(), shards.ordered.rend());
  learned_ = false;
  lay_out();
}

// Buckets over sequence_, and a hook on every parameter backward can give a gradient.
void GradientBuckets::lay_out() {
  remove_hooks();
  // A bucket's size: its parameters' gradients as this rank packs them (every rank's rows, padded).
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype_)) * group_.world_size;
  for (size_t position = 0; position < sequence_.size(); ++position) {
    ShardedParameter* p = sequence_[position];
    if (buckets_.empty() || (buckets_.back().numel + p->chunk_numel()) * element > bucket_bytes_)
      buckets_.emplace_back();
    Bucket& bucket = buckets_.back();
    bucket.parameters.push_back(p);
    bucket.numel += p->chunk_numel();
    const size_t index = buckets_.size() - 1;
    // A frozen parameter (or one the Module's graph cannot reach) has no gradient accumulator.
    if (!hookable(*p)) continue;
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(p->full);
    if (!accumulator) continue;
    ++bucket.expected;
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, index, position](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_gradient(index, position);
          return outputs;
        }));
    hooks_.push_back({std::move(accumulator), key, p});
  }
  for (Bucket& bucket : buckets_) bucket.slice = bucket.numel + static_cast<int64_t>(bucket.parameters.size());
}

void GradientBuckets::remove_hooks() {
  for (Hook& hook : hooks_) hook.accumulator->del_post_hook(hook.key);
  hooks_.clear();
  buckets_.clear();
  armed_ = false;
  next_ = 0;
}

void GradientBuckets::clear() {
  remove_hooks();
  sequence_.clear();
  ready_order_.clear();
  shards_ = nullptr;
}

// After the first backward: the buckets laid out again in the order its gradients became ready
// (rank 0's, broadcast, so that every rank lays out the same buckets; DDP's rebuilt buckets), the
// parameters that got none last. The Module's or the optimizers' order need not be backward's.
void GradientBuckets::learn_order() {
  learned_ = true;
  std::vector<char> seen(sequence_.size(), 0);
  std::vector<int64_t> order;
  for (const size_t position : ready_order_)
    if (!seen[position]) {
      seen[position] = 1;
      order.push_back(static_cast<int64_t>(position));
    }
  for (size_t position = 0; position < sequence_.size(); ++position)
    if (!seen[position]) order.push_back(static_cast<int64_t>(position));
  ready_order_.clear();
  at::Tensor positions = at::tensor(order, at::TensorOptions().dtype(at::kLong)).to(group_.device);
  if (group_.communicator) group_.communicator->broadcast(positions, 0);
  positions = positions.to(at::kCPU).contiguous();
  const int64_t* chosen = positions.const_data_ptr<int64_t>();
  std::vector<ShardedParameter*> sequence;
  for (size_t i = 0; i < sequence_.size(); ++i) sequence.push_back(sequence_.at(static_cast<size_t>(chosen[i])));
  sequence_ = std::move(sequence);
  lay_out();
}

bool GradientBuckets::hookable(const ShardedParameter& p) { return p.full.requires_grad() && p.full.is_leaf(); }

void GradientBuckets::begin_backward() {
  // A parameter frozen or unfrozen since (a fine-tuning callback): hooks and counts made again, so
  // that no bucket starts before a gradient it must carry.
  size_t hookable_now = 0;
  bool same = true;
  if (shards_ != nullptr) {
    for (const ShardedParameter* p : shards_->ordered) hookable_now += hookable(*p) ? 1 : 0;
    for (const Hook& hook : hooks_) same = same && hookable(*hook.parameter);
    if (!same || hookable_now != hooks_.size()) lay_out();
  }
  for (Bucket& bucket : buckets_) {
    bucket.ready = 0;
    bucket.pending.reset();
    bucket.flat = bucket.mine = at::Tensor();
  }
  next_ = 0;
  started_during_backward_ = 0;
  ready_order_.clear();
  armed_ = true;
  start_ready_buckets();  // buckets of frozen parameters only: nothing to wait for
}

void GradientBuckets::abandon() {
  armed_ = false;
  for (Bucket& bucket : buckets_) {
    bucket.pending.reset();
    bucket.flat = bucket.mine = at::Tensor();
  }
}

void GradientBuckets::finish_backward() {
  if (!armed_) return;
  armed_ = false;
  started_during_backward_ = static_cast<int64_t>(next_);
  while (next_ < buckets_.size()) start(buckets_[next_++]);
  for (Bucket& bucket : buckets_) land(bucket);
  if (!learned_) learn_order();
}

// Runs in backward, after a parameter's gradient was accumulated (once per backward).
void GradientBuckets::on_gradient(size_t index, size_t position) {
  if (!armed_) return;
  if (!learned_) ready_order_.push_back(position);
  Bucket& bucket = buckets_[index];
  if (index < next_)
    throw Error(ErrorKind::runtime,
                "strategy 'fsdp': a parameter's gradient was accumulated again after its bucket was sent (a "
                "parameter reached twice by one backward, or a backward inside backward); set "
                "[strategy] overlap_reduce = false to average the gradients after backward");
  ++bucket.ready;
  start_ready_buckets();
}

void GradientBuckets::start_ready_buckets() {
  while (next_ < buckets_.size() && buckets_[next_].ready >= buckets_[next_].expected) start(buckets_[next_++]);
}

void GradientBuckets::start(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  const int64_t world = group_.world_size, n = static_cast<int64_t>(bucket.parameters.size());
  const at::TensorOptions reduce = at::TensorOptions().dtype(dtype_).device(group_.device);
  bucket.flat = at::zeros({world * bucket.slice}, reduce);
  const at::Tensor flags = at::zeros({n}, reduce);
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    ShardedParameter& p = *bucket.parameters[i];
    if (at::Tensor& grad = p.full.mutable_grad(); grad.defined()) {
      pack_rank_major(p, grad, bucket.flat, bucket.slice, offset, world);
      flags[i].fill_(1);
      grad.reset();  // the bucket holds it now: no second copy of the gradient
    }
    offset += p.chunk_numel();
  }
  bucket.flat.view({world, bucket.slice}).narrow(1, bucket.numel, n).copy_(flags.unsqueeze(0).expand({world, n}));
  if (options_.zero_stage == 1) {
    // All-reduce the whole bucket, then keep this rank's rows.
    if (group_.communicator) bucket.pending = group_.communicator->all_reduce_async(bucket.flat, ReduceOp::mean);
    bucket.mine = bucket.flat.narrow(0, group_.rank * bucket.slice, bucket.slice);
  } else {
    bucket.mine = at::zeros({bucket.slice}, reduce);
    if (group_.communicator)
      bucket.pending = group_.communicator->reduce_scatter_async(bucket.mine, bucket.flat, ReduceOp::mean);
    else
      bucket.mine.copy_(bucket.flat);
  }
}

void GradientBuckets::land(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  if (bucket.pending) bucket.pending->wait();
  bucket.pending.reset();
  // offload_optimizer: one copy to host memory per bucket.
  const at::Tensor mine = options_.offload_optimizer ? bucket.mine.to(at::kCPU) : bucket.mine;
  const at::Tensor flags = mine.narrow(0, bucket.numel, static_cast<int64_t>(bucket.parameters.size())).to(at::kCPU);
  const auto has_gradient = flags.to(at::kFloat).contiguous();
  const float* flag = has_gradient.const_data_ptr<float>();
  int64_t offset = 0;
  for (size_t i = 0; i < bucket.parameters.size(); ++i) {
    ShardedParameter& p = *bucket.parameters[i];
    p.full.mutable_grad().reset();
    if (flag[i] > 0) land_gradient(p, mine.narrow(0, offset, p.local_rows() * p.row_numel));
    offset += p.chunk_numel();
  }
  bucket.flat = bucket.mine = at::Tensor();
}

}  // namespace fulgur::fsdp
