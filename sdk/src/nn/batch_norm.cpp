// fulgur::nn::BatchNorm: torch::nn::BatchNorm's computation, plus statistics synchronized across
// ranks through the Communicator with gradients that flow back across them.
#include <fulgur/communicator.h>
#include <fulgur/error.h>
#include <fulgur/nn/batch_norm.h>

#include <ATen/ops/_assert_async.h>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <cstdint>
#include <ostream>

namespace fulgur::nn {
namespace {

// y = Σ_ranks x, and its adjoint: each rank's loss depends on every rank's x through y, so the
// gradient of the sum of all ranks' losses with respect to this rank's x is Σ_ranks dL_k/dy.
// (Megatron's "all-reduce in forward, identity in backward" is the other case: a loss computed
// once from replicated values. Here every rank computes its own loss from the shared statistics.)
struct AllReduceSum : torch::autograd::Function<AllReduceSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* context, const at::Tensor& local,
                            Communicator* communicator) {
    context->saved_data["communicator"] = static_cast<int64_t>(reinterpret_cast<std::intptr_t>(communicator));
    at::Tensor total = local.clone(at::MemoryFormat::Contiguous);
    communicator->all_reduce(total, ReduceOp::sum);
    return total;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list gradients) {
    auto* communicator =
        reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(context->saved_data["communicator"].toInt()));
    at::Tensor total = gradients[0].clone(at::MemoryFormat::Contiguous);
    communicator->all_reduce(total, ReduceOp::sum);
    return {total, at::Tensor()};
  }
};

at::Tensor all_reduce_sum(const at::Tensor& local, Communicator& communicator) {
  return AllReduceSum::apply(local, &communicator);
}

}  // namespace

BatchNormImpl::BatchNormImpl(const BatchNormOptions& options_) : options(options_) { reset(); }

void BatchNormImpl::reset() {
  if (options.num_features() < 1)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("fulgur::nn::BatchNorm: num_features must be at least 1, got {}", options.num_features()));
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({options.num_features()}));
    bias = register_parameter("bias", torch::empty({options.num_features()}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({options.num_features()}));
    running_var = register_buffer("running_var", torch::ones({options.num_features()}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void BatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  torch::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void BatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

void BatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "fulgur::nn::BatchNorm(num_features=" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum())
    stream << *options.momentum();
  else
    stream << "None";
  stream << ", affine=" << (options.affine() ? "true" : "false")
         << ", track_running_stats=" << (options.track_running_stats() ? "true" : "false") << ")";
}

void BatchNormImpl::synchronize_with(std::weak_ptr<Communicator> communicator) {
  synchronized_ = !communicator.expired();
  communicator_ = std::move(communicator);
}

at::Tensor BatchNormImpl::forward(const at::Tensor& input) {
  if (input.dim() < 2 || input.dim() > 5 || input.size(1) != options.num_features())
    throw Error(ErrorKind::invalid_argument,
                fmt::format("fulgur::nn::BatchNorm({}): expected an input of 2 to 5 dimensions with {} channels in "
                            "dimension 1, got shape {}",
                            options.num_features(), options.num_features(), fmt::streamed(input.sizes())));
  // torch.nn.modules.batchnorm._BatchNorm.forward's bookkeeping, line for line in effect.
  double average_factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked.add_(1);
    if (!options.momentum()) average_factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  }
  const bool batch_statistics = is_training() || !running_mean.defined();
  if (batch_statistics && synchronized_) {
    const std::shared_ptr<Communicator> communicator = communicator_.lock();
    if (!communicator)
      throw Error(ErrorKind::runtime,
                  "fulgur::nn::BatchNorm: synchronized across ranks, but the run's communicator is gone (was the "
                  "layer used for training after the Trainer finished? call synchronize_with({}) to make it local)");
    if (communicator->world_size() > 1) return synchronized_forward(input, *communicator, average_factor);
  }
  const bool use_running = !is_training() || options.track_running_stats();
  return torch::batch_norm(input, weight, bias, use_running ? running_mean : at::Tensor(),
                           use_running ? running_var : at::Tensor(), batch_statistics, average_factor, options.eps(),
                           at::globalContext().userEnabledCuDNN());
}

at::Tensor BatchNormImpl::synchronized_forward(const at::Tensor& input, Communicator& communicator,
                                               double average_factor) {
  // Statistics in float32 at least (half-precision sums of a large batch lose the mean).
  const at::ScalarType statistics_type =
      at::isReducedFloatingType(input.scalar_type()) ? at::kFloat : input.scalar_type();
  const at::Tensor x = input.to(statistics_type);
  std::vector<int64_t> reduced{0};
  for (int64_t d = 2; d < x.dim(); ++d) reduced.push_back(d);
  std::vector<int64_t> channel_shape(x.dim(), 1);
  channel_shape[1] = options.num_features();
  const int64_t channels = options.num_features();

  // Round 1: per-channel sums and this rank's sample count, in one message.
  const double local_count = static_cast<double>(x.numel() / channels);
  const at::Tensor sums_and_count =
      all_reduce_sum(torch::cat({x.sum(reduced), torch::full({1}, local_count, x.options())}), communicator);
  const at::Tensor count = sums_and_count.narrow(0, channels, 1).detach();
  // The count stays on the device: reading it on the host would synchronize every forward of
  // every layer. The CPU checks it at once (no cost there); a device asserts asynchronously.
  if (count.is_cpu()) {
    if (count.item<double>() <= 1)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("fulgur::nn::BatchNorm: expected more than 1 value per channel across all ranks while "
                              "training, got input shape {} on this rank",
                              fmt::streamed(input.sizes())));
  } else {
    at::_assert_async(count.gt(1).squeeze(),
                      "fulgur::nn::BatchNorm: expected more than 1 value per channel across all ranks while training");
  }
  const at::Tensor mean = sums_and_count.narrow(0, 0, channels) / count;
  // Round 2: squared deviations from the global mean.
  const at::Tensor centered = x - mean.view(channel_shape);
  const at::Tensor variance = all_reduce_sum((centered * centered).sum(reduced), communicator) / count;
  at::Tensor out = centered * torch::rsqrt(variance + options.eps()).view(channel_shape);
  if (options.affine())
    out = out * weight.view(channel_shape).to(statistics_type) + bias.view(channel_shape).to(statistics_type);

  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    const at::Tensor unbiased = variance.detach() * (count / (count - 1));
    running_mean.mul_(1 - average_factor).add_(mean.detach().to(running_mean.scalar_type()), average_factor);
    running_var.mul_(1 - average_factor).add_(unbiased.to(running_var.scalar_type()), average_factor);
  }
  return out.to(input.scalar_type());
}

}  // namespace fulgur::nn
