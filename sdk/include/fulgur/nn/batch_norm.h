/// @file
/// fulgur::nn::BatchNorm: batch normalization whose statistics `[trainer] sync_batchnorm = true`
/// computes over every data-parallel rank's batch (Lightning's `sync_batchnorm`, PyTorch's
/// SyncBatchNorm). SDK 1.2.
///
/// PyTorch converts the model's BatchNorm layers to SyncBatchNorm when asked. LibTorch's C++ modules
/// cannot be converted: a parent calls its typed member (`torch::nn::BatchNorm2d bn`) directly, so
/// a replaced registration would never run. A model that wants synchronized statistics therefore
/// declares this layer where it would declare torch::nn::BatchNorm{1,2,3}d; with sync_batchnorm off
/// or in one process it computes exactly what they compute, with the same parameter and buffer
/// names (weight, bias, running_mean, running_var, num_batches_tracked), so checkpoints and state
/// dicts are interchangeable with torch.nn.BatchNorm*d and torch.nn.SyncBatchNorm.
#pragma once

#include <fulgur/export.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace fulgur {
class Communicator;
}

namespace fulgur::nn {

/// Options of fulgur::nn::BatchNorm: torch::nn::BatchNormOptions' fields and defaults,
/// `fulgur::nn::BatchNormOptions(64).eps(1e-3).momentum(0.01)`.
struct BatchNormOptions {
  /// `num_features`: the size of the input's dimension 1 (channels).
  /* implicit */ BatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  /// Channels (the input's dimension 1).
  TORCH_ARG(int64_t, num_features);
  /// Added to the variance before its square root.
  TORCH_ARG(double, eps) = 1e-5;
  /// Weight of the current batch in the running statistics; nullopt: their cumulative average.
  TORCH_ARG(std::optional<double>, momentum) = 0.1;
  /// Learnable per-channel scale (`weight`) and shift (`bias`).
  TORCH_ARG(bool, affine) = true;
  /// Keep running statistics for evaluation (else evaluation normalizes with the batch's own).
  TORCH_ARG(bool, track_running_stats) = true;
};

/// Batch normalization over dimension 1 of an input of 2 to 5 dimensions ((N, C), (N, C, L),
/// (N, C, H, W), (N, C, D, H, W)): torch::nn::BatchNorm1d/2d/3d in one layer, whose training
/// statistics can be synchronized across ranks.
///
/// Synchronized (the Trainer calls synchronize_with when `[trainer] sync_batchnorm = true` and the
/// run has more than one data-parallel rank), a training-mode forward normalizes with the mean and
/// biased variance of the whole global batch: two all-reduces per forward (per-channel sums and
/// counts, then the sums of squared deviations from the global mean, which keeps the variance
/// accurate where E[x²] - E[x]² would cancel). Their backward all-reduces the gradients of those
/// sums, so every rank's input gradient includes what the other ranks' losses owe to its samples:
/// gradients equal one process's over the global batch, which is what makes 2 ranks with batch B
/// train as one process with batch 2B. The running statistics are updated from the global
/// statistics (variance with Bessel's correction over the global count), identical on every rank.
/// Evaluation uses the running statistics and no communication. Half-precision inputs are reduced
/// in float32. Every rank must run the layer the same number of times per step (the all-reduces are
/// collectives).
class FULGUR_SDK_API BatchNormImpl : public torch::nn::Cloneable<BatchNormImpl> {
 public:
  /// A layer for `options.num_features()` channels.
  explicit BatchNormImpl(const BatchNormOptions& options);
  /// A layer for `num_features` channels with the default options.
  explicit BatchNormImpl(int64_t num_features) : BatchNormImpl(BatchNormOptions(num_features)) {}

  /// (Re)creates the parameters and buffers (torch::nn::BatchNorm's initialization).
  void reset() override;
  /// Running mean 0, running variance 1, num_batches_tracked 0.
  void reset_running_stats();
  /// reset_running_stats, then weight 1 and bias 0.
  void reset_parameters();
  /// Normalizes `input` (see the class comment for what synchronization changes).
  at::Tensor forward(const at::Tensor& input);
  /// `fulgur::nn::BatchNorm(num_features=…, eps=…, momentum=…, affine=…, track_running_stats=…)`.
  void pretty_print(std::ostream& stream) const override;

  /// Training-mode statistics from every rank of `communicator` (the Trainer passes the
  /// data-parallel group); an empty pointer makes the layer local again. The layer keeps a weak
  /// reference: once the communicator is gone it refuses to train synchronized (a clear error)
  /// rather than silently falling back to local statistics.
  void synchronize_with(std::weak_ptr<Communicator> communicator);
  /// Whether synchronize_with gave this layer a communicator.
  bool synchronized() const { return synchronized_; }

  /// The options the layer was made with.
  BatchNormOptions options;
  /// Per-channel scale (affine only).
  at::Tensor weight;
  /// Per-channel shift (affine only).
  at::Tensor bias;
  /// Running mean, per channel (track_running_stats only).
  at::Tensor running_mean;
  /// Running variance (unbiased), per channel (track_running_stats only).
  at::Tensor running_var;
  /// Training-mode forwards so far (track_running_stats only): the cumulative average's divisor.
  at::Tensor num_batches_tracked;

 private:
  at::Tensor synchronized_forward(const at::Tensor& input, Communicator& communicator, double average_factor);
  std::weak_ptr<Communicator> communicator_;
  bool synchronized_ = false;
};

/// The module holder: `fulgur::nn::BatchNorm bn = register_module("bn", fulgur::nn::BatchNorm(64));`.
TORCH_MODULE(BatchNorm);

}  // namespace fulgur::nn
