// Tensor and sequence parallelism: the Megatron mappings as autograd functions over the
// Communicator, and the layers built on them.
#include <fulgur/communicator.h>
#include <fulgur/error.h>
#include <fulgur/nn/tensor_parallel.h>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <set>

namespace fulgur::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t group_size(Communicator* group) { return group == nullptr ? 1 : group->world_size(); }
int64_t group_rank(Communicator* group) { return group == nullptr ? 0 : group->rank(); }

// The communicator travels through the autograd context as an integer, as BatchNorm's does: the
// caller keeps it alive across backward (the layers hold it).
void save_group(AutogradContext* context, Communicator* group, int64_t dim) {
  context->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<std::intptr_t>(group));
  context->saved_data["dim"] = dim;
}
Communicator* saved_group(AutogradContext* context) {
  return reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(context->saved_data["group"].toInt()));
}

at::Tensor all_reduce_sum(const at::Tensor& input, Communicator& group) {
  at::Tensor total = input.clone(at::MemoryFormat::Contiguous);
  group.all_reduce(total, ReduceOp::sum);
  return total;
}

// Every rank's `input` concatenated along `dim`.
at::Tensor all_gather(const at::Tensor& input, Communicator& group, int64_t dim) {
  const at::Tensor moved = input.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = moved.sizes().vec();
  sizes[0] *= group.world_size();
  at::Tensor output = at::empty(sizes, moved.options());
  group.all_gather_into_tensor(output, moved);
  return output.movedim(0, dim);
}

// The sum over ranks of `input`, this rank's chunk of it along `dim`.
at::Tensor reduce_scatter(const at::Tensor& input, Communicator& group, int64_t dim) {
  const at::Tensor moved = input.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = moved.sizes().vec();
  if (sizes[0] % group.world_size() != 0)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("sequence parallelism: dimension {} of size {} does not split into {} equal chunks", dim,
                            sizes[0], group.world_size()));
  sizes[0] /= group.world_size();
  at::Tensor output = at::empty(sizes, moved.options());
  group.reduce_scatter(output, moved, ReduceOp::sum);
  return output.movedim(0, dim);
}

// This rank's chunk of `input` along `dim`.
at::Tensor split(const at::Tensor& input, Communicator& group, int64_t dim) {
  const int64_t size = input.size(dim);
  if (size % group.world_size() != 0)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("tensor parallelism: dimension {} of size {} does not split into {} equal chunks", dim,
                            size, group.world_size()));
  const int64_t chunk = size / group.world_size();
  return input.narrow(dim, group.rank() * chunk, chunk).contiguous();
}

struct CopyToParallel : torch::autograd::Function<CopyToParallel> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, Communicator* group) {
    save_group(context, group, 0);
    return input.view_as(input);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    return {all_reduce_sum(gradients[0], *saved_group(context)), at::Tensor()};
  }
};

struct ReduceFromParallel : torch::autograd::Function<ReduceFromParallel> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& input, Communicator* group) {
    return all_reduce_sum(input, *group);
  }
  static variable_list backward(AutogradContext*, variable_list gradients) { return {gradients[0], at::Tensor()}; }
};

struct GatherFromParallel : torch::autograd::Function<GatherFromParallel> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, Communicator* group, int64_t dim) {
    save_group(context, group, dim);
    return all_gather(input, *group, dim);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    return {split(gradients[0], *saved_group(context), context->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct ScatterToParallel : torch::autograd::Function<ScatterToParallel> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, Communicator* group, int64_t dim) {
    save_group(context, group, dim);
    return split(input, *group, dim);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    return {all_gather(gradients[0], *saved_group(context), context->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct GatherFromSequenceParallel : torch::autograd::Function<GatherFromSequenceParallel> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, Communicator* group, int64_t dim) {
    save_group(context, group, dim);
    return all_gather(input, *group, dim);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    return {reduce_scatter(gradients[0], *saved_group(context), context->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct ReduceScatterToSequenceParallel : torch::autograd::Function<ReduceScatterToSequenceParallel> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& input, Communicator* group, int64_t dim) {
    save_group(context, group, dim);
    return reduce_scatter(input, *group, dim);
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    return {all_gather(gradients[0], *saved_group(context), context->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

int64_t wrap_dim(const at::Tensor& input, int64_t dim) { return c10::maybe_wrap_dim(dim, input.dim()); }

bool single(Communicator* group) { return group_size(group) == 1; }

int64_t shard_of(int64_t whole, Communicator* group, const char* layer, const char* what) {
  const int64_t parts = group_size(group);
  if (whole < 1 || whole % parts != 0)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("fulgur::nn::{}: {} = {} does not split into {} equal shards (the tensor-parallel "
                            "group's size); choose a multiple of it",
                            layer, what, whole, parts));
  return whole / parts;
}

}  // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& input, Communicator* group) {
  return single(group) ? input : CopyToParallel::apply(input, group);
}
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, Communicator* group) {
  return single(group) ? input : ReduceFromParallel::apply(input, group);
}
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, Communicator* group, int64_t dim) {
  return single(group) ? input : GatherFromParallel::apply(input, group, wrap_dim(input, dim));
}
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, Communicator* group, int64_t dim) {
  return single(group) ? input : ScatterToParallel::apply(input, group, wrap_dim(input, dim));
}
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, Communicator* group, int64_t dim) {
  return single(group) ? input : GatherFromSequenceParallel::apply(input, group, wrap_dim(input, dim));
}
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, Communicator* group, int64_t dim) {
  return single(group) ? input : ReduceScatterToSequenceParallel::apply(input, group, wrap_dim(input, dim));
}
at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, Communicator* group, int64_t dim) {
  // Split / all-gather: the same pair as scatter_to_tensor_parallel, on the sequence dimension.
  return single(group) ? input : ScatterToParallel::apply(input, group, wrap_dim(input, dim));
}

// ---- ColumnParallelLinear ----

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ParallelLinearOptions& options_) : options(options_) {
  reset();
}

void ColumnParallelLinearImpl::reset() {
  Communicator* group = options.group().get();
  const int64_t local_out = shard_of(options.out_features(), group, "ColumnParallelLinear", "out_features");
  // torch::nn::Linear's initialization of the whole weight (same draws on every rank), then the
  // chunk: the model starts as the one-process model with the same seed.
  torch::nn::Linear whole(torch::nn::LinearOptions(options.in_features(), options.out_features()).bias(options.bias()));
  const int64_t start = group_rank(group) * local_out;
  weight = register_parameter("weight", whole->weight.detach().narrow(0, start, local_out).clone());
  if (options.bias())
    bias = register_parameter("bias", whole->bias.detach().narrow(0, start, local_out).clone());
  else
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  Communicator* group = options.group().get();
  const at::Tensor x = options.sequence_parallel() ? gather_from_sequence_parallel(input, group, options.sequence_dim())
                                                   : copy_to_tensor_parallel(input, group);
  const at::Tensor y = torch::nn::functional::linear(x, weight, bias);
  return options.gather_output() ? gather_from_tensor_parallel(y, group, -1) : y;
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::ColumnParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", tp=" << group_size(options.group().get())
         << ", bias=" << (options.bias() ? "true" : "false") << ", gather_output=" << options.gather_output()
         << ", sequence_parallel=" << options.sequence_parallel() << ")";
}

// ---- RowParallelLinear ----

RowParallelLinearImpl::RowParallelLinearImpl(const ParallelLinearOptions& options_) : options(options_) { reset(); }

void RowParallelLinearImpl::reset() {
  Communicator* group = options.group().get();
  const int64_t local_in = shard_of(options.in_features(), group, "RowParallelLinear", "in_features");
  torch::nn::Linear whole(torch::nn::LinearOptions(options.in_features(), options.out_features()).bias(options.bias()));
  weight =
      register_parameter("weight", whole->weight.detach().narrow(1, group_rank(group) * local_in, local_in).clone());
  if (options.bias())
    bias = register_parameter("bias", whole->bias.detach().clone());
  else
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  Communicator* group = options.group().get();
  const at::Tensor x = options.input_is_parallel() ? input : scatter_to_tensor_parallel(input, group, -1);
  const at::Tensor partial = torch::nn::functional::linear(x, weight);
  at::Tensor y = options.sequence_parallel()
                     ? reduce_scatter_to_sequence_parallel(partial, group, options.sequence_dim())
                     : reduce_from_tensor_parallel(partial, group);
  if (!bias.defined()) return y;
  // Under sequence parallelism each rank adds the bias to its part of the sequence only: its
  // gradient is partial and is summed over the group in backward.
  return y + (options.sequence_parallel() ? replicated_parameter(bias, group) : bias);
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::RowParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", tp=" << group_size(options.group().get())
         << ", bias=" << (options.bias() ? "true" : "false") << ", input_is_parallel=" << options.input_is_parallel()
         << ", sequence_parallel=" << options.sequence_parallel() << ")";
}

// ---- VocabParallelEmbedding ----

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options_)
    : options(options_) {
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  Communicator* group = options.group().get();
  const int64_t local = shard_of(options.num_embeddings(), group, "VocabParallelEmbedding", "num_embeddings");
  vocab_start = group_rank(group) * local;
  vocab_end = vocab_start + local;
  const at::Tensor whole = torch::randn({options.num_embeddings(), options.embedding_dim()});
  weight = register_parameter("weight", whole.narrow(0, vocab_start, local).clone());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  Communicator* group = options.group().get();
  if (single(group)) return torch::embedding(weight, ids);
  const at::Tensor outside = (ids < vocab_start).logical_or(ids >= vocab_end);
  const at::Tensor local_ids = (ids - vocab_start).masked_fill(outside, 0);
  const at::Tensor partial = torch::embedding(weight, local_ids).masked_fill(outside.unsqueeze(-1), 0.0);
  return options.sequence_parallel() ? reduce_scatter_to_sequence_parallel(partial, group, options.sequence_dim())
                                     : reduce_from_tensor_parallel(partial, group);
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", tp=" << group_size(options.group().get()) << ")";
}

// ---- vocab-parallel cross-entropy ----

namespace {

// Megatron's _VocabParallelCrossEntropy: the softmax's normalizer and the target's logit from
// all-reduces of [N] values; backward is local.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* context, const at::Tensor& logits_in, const at::Tensor& target,
                            Communicator* group) {
    const at::Tensor logits = logits_in.to(at::kFloat);
    const int64_t local_vocab = logits.size(-1);
    const int64_t start = group_rank(group) * local_vocab;
    at::Tensor maximum = std::get<0>(logits.max(-1)).contiguous();
    if (group) group->all_reduce(maximum, ReduceOp::max);
    const at::Tensor shifted = logits - maximum.unsqueeze(-1);

    const at::Tensor outside = (target < start).logical_or(target >= start + local_vocab);
    const at::Tensor local_target = (target - start).masked_fill(outside, 0);
    at::Tensor target_logit =
        shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0).contiguous();
    at::Tensor exp_logits = shifted.exp();
    at::Tensor sum_exp = exp_logits.sum(-1).contiguous();
    if (group) {
      // One message for both sums.
      at::Tensor both = torch::stack({target_logit, sum_exp});
      group->all_reduce(both, ReduceOp::sum);
      target_logit = both[0];
      sum_exp = both[1];
    }
    const at::Tensor loss = sum_exp.log() - target_logit;
    exp_logits.div_(sum_exp.unsqueeze(-1));  // softmax, this rank's columns
    context->save_for_backward({exp_logits, local_target, outside});
    context->saved_data["dtype"] = static_cast<int64_t>(logits_in.scalar_type());
    return loss.to(logits_in.scalar_type());
  }
  static variable_list backward(AutogradContext* context, variable_list gradients) {
    const auto saved = context->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    const at::Tensor inside = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(-1, saved[1].unsqueeze(-1), -inside.unsqueeze(-1));
    grad.mul_(gradients[0].to(grad.scalar_type()).unsqueeze(-1));
    return {grad.to(static_cast<at::ScalarType>(context->saved_data["dtype"].toInt())), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, Communicator* group) {
  if (logits.dim() < 1 || target.sizes() != logits.sizes().slice(0, logits.dim() - 1))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("vocab_parallel_cross_entropy: logits {} and target {} do not fit: the target must have "
                            "the logits' shape without the last (vocabulary) dimension",
                            fmt::streamed(logits.sizes()), fmt::streamed(target.sizes())));
  return VocabParallelCrossEntropy::apply(logits, target, single(group) ? nullptr : group);
}

// ---- gradient clipping ----

double clip_grad_norm_tensor_parallel(torch::nn::Module& model, double max_norm, Communicator* group) {
  std::vector<at::Tensor> sharded, replicated;
  std::set<const void*> seen;
  auto add = [&](const at::Tensor& p, bool is_shard) {
    if (!p.defined() || !p.grad().defined() || !seen.insert(p.unsafeGetTensorImpl()).second) return;
    (is_shard ? sharded : replicated).push_back(p.grad());
  };
  const auto visit = [&](torch::nn::Module& m) {
    if (auto* column = m.as<ColumnParallelLinearImpl>()) {
      add(column->weight, true);
      add(column->bias, true);
    } else if (auto* row = m.as<RowParallelLinearImpl>()) {
      add(row->weight, true);
      add(row->bias, false);
    } else if (auto* embedding = m.as<VocabParallelEmbeddingImpl>()) {
      add(embedding->weight, true);
    }
  };
  visit(model);
  for (const auto& child : model.modules(/*include_self=*/false)) visit(*child);
  for (const auto& p : model.parameters()) add(p, false);  // the rest: replicated
  if (sharded.empty() && replicated.empty()) return 0.0;
  // Sums of squares on the gradients' device in double; one host read for the norm.
  const at::TensorOptions options =
      at::TensorOptions(at::kDouble).device((sharded.empty() ? replicated : sharded).front().device());
  auto squares = [&](const std::vector<at::Tensor>& grads) {
    at::Tensor total = torch::zeros({1}, options);
    for (const auto& g : grads) total += g.detach().to(options).pow(2).sum();
    return total;
  };
  at::Tensor sharded_total = squares(sharded);
  if (group != nullptr && group->world_size() > 1) group->all_reduce(sharded_total, ReduceOp::sum);
  const double norm = std::sqrt((sharded_total + squares(replicated)).item<double>());
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (auto* grads : {&sharded, &replicated})
      for (auto& g : *grads) g.mul_(coefficient);
  }
  return norm;
}

// ---- TensorParallelRng ----

namespace {

at::Generator default_generator(c10::Device device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
}

}  // namespace

TensorParallelRng::TensorParallelRng(uint64_t seed, int64_t tp_rank, c10::Device device)
    : seed_(seed + 2718 + static_cast<uint64_t>(tp_rank)), device_(device) {
  // Megatron's offset: the sharded stream differs per tp rank and from the default stream.
  at::Generator generator = default_generator(device_);
  std::lock_guard<std::mutex> lock(generator.mutex());
  const at::Tensor saved = generator.get_state();
  generator.set_current_seed(seed_);
  state_ = generator.get_state();
  generator.set_state(saved);
}

TensorParallelRng::Scope::Scope(TensorParallelRng& tracker) : tracker_(tracker) {
  at::Generator generator = default_generator(tracker_.device_);
  std::lock_guard<std::mutex> lock(generator.mutex());
  saved_default_ = generator.get_state();
  generator.set_state(tracker_.state_);
}

TensorParallelRng::Scope::~Scope() {
  at::Generator generator = default_generator(tracker_.device_);
  std::lock_guard<std::mutex> lock(generator.mutex());
  tracker_.state_ = generator.get_state();
  generator.set_state(saved_default_);
}

TensorParallelRng::Scope TensorParallelRng::fork() { return Scope(*this); }

}  // namespace fulgur::nn
