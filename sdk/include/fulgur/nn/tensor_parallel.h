/// @file
/// Tensor and sequence parallelism as Megatron-LM builds it: layers whose weights are split across
/// the ranks of a tensor-parallel group (DeviceMesh::group("tp")), and the four communication
/// mappings, as autograd functions, that make their forward and backward equal one process's.
/// LibTorch has no DTensor, so the model says where its weights are split, as in Megatron
/// (`megatron/core/tensor_parallel/{mappings,layers,cross_entropy,random}.py`).
///
/// Shards are PyTorch's: ColumnParallelLinear holds torch.chunk(weight, tp, 0)[rank] (and of the
/// bias), RowParallelLinear torch.chunk(weight, tp, 1)[rank] and the whole bias,
/// VocabParallelEmbedding torch.chunk(weight, tp, 0)[rank]: what ColwiseParallel, RowwiseParallel
/// and a vocabulary-sharded embedding hold in a DTensor state dict, under the same names (weight,
/// bias). Sizes must divide by the group's size. A nullptr group means one rank: every mapping is
/// the identity and the layers are torch::nn::Linear / Embedding.
///
/// Sequence parallelism splits the activations between blocks along `sequence_dim` (0 in the
/// Megatron layout [sequence, batch, hidden]). A parameter that is replicated across the group but
/// used on sequence-split activations (a LayerNorm's weight and bias, a RowParallelLinear's bias)
/// gets a partial gradient on each rank; pass it through replicated_parameter() where it is used
/// and its gradient is summed over the group in backward (RowParallelLinear does so for its bias).
/// Not yet part of a released SDK (added for SDK 1.3).
#pragma once

#include <fulgur/export.h>

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

namespace fulgur {
class Communicator;
}

namespace fulgur::nn {

/// @name The Megatron mappings (forward / backward). `group` nullptr: one rank, identity.
/// @{
/// Identity / all-reduce (sum): enters a tensor-parallel region with replicated input.
FULGUR_SDK_API at::Tensor copy_to_tensor_parallel(const at::Tensor& input, Communicator* group);
/// All-reduce (sum) / identity: leaves a tensor-parallel region whose ranks hold partial sums.
FULGUR_SDK_API at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, Communicator* group);
/// All-gather along `dim` / this rank's chunk of the gradient: whole output of a split layer.
FULGUR_SDK_API at::Tensor gather_from_tensor_parallel(const at::Tensor& input, Communicator* group, int64_t dim = -1);
/// This rank's chunk along `dim` / all-gather: split a replicated tensor among the ranks.
FULGUR_SDK_API at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, Communicator* group, int64_t dim = -1);
/// All-gather along `dim` / reduce-scatter (sum): sequence-split activations into a
/// tensor-parallel region (SP's "gather-from-SP").
FULGUR_SDK_API at::Tensor gather_from_sequence_parallel(const at::Tensor& input, Communicator* group, int64_t dim = 0);
/// Reduce-scatter (sum) along `dim` / all-gather: partial sums out of a tensor-parallel region,
/// split along the sequence (SP's "scatter-to-SP" after a row-parallel layer).
FULGUR_SDK_API at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, Communicator* group,
                                                              int64_t dim = 0);
/// This rank's chunk along `dim` / all-gather: replicated activations (an embedding's output) into
/// a sequence-parallel region.
FULGUR_SDK_API at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, Communicator* group, int64_t dim = 0);
/// A parameter replicated across `group` but used on sequence-split activations: the identity in
/// forward; in backward its partial gradients are summed over the group (copy_to_tensor_parallel).
inline at::Tensor replicated_parameter(const at::Tensor& parameter, Communicator* group) {
  return copy_to_tensor_parallel(parameter, group);
}
/// @}

/// Options of ColumnParallelLinear and RowParallelLinear.
struct ParallelLinearOptions {
  /// Whole (unsplit) input and output features.
  ParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Whole input features (the weight's dimension 1).
  TORCH_ARG(int64_t, in_features);
  /// Whole output features (the weight's dimension 0).
  TORCH_ARG(int64_t, out_features);
  /// Learnable bias.
  TORCH_ARG(bool, bias) = true;
  /// The tensor-parallel group; nullptr (or one rank): a plain linear layer.
  TORCH_ARG(std::shared_ptr<Communicator>, group) = nullptr;
  /// Column-parallel only: all-gather the output features (else each rank keeps its chunk).
  TORCH_ARG(bool, gather_output) = false;
  /// Row-parallel only: the input is already split along its last dimension (a column-parallel
  /// layer's output); else the layer takes its chunk of a replicated input.
  TORCH_ARG(bool, input_is_parallel) = true;
  /// Sequence parallelism: column-parallel all-gathers its sequence-split input along
  /// sequence_dim; row-parallel reduce-scatters its output along it.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// The sequence dimension of the activations (Megatron's layout [s, b, h]: 0).
  TORCH_ARG(int64_t, sequence_dim) = 0;
};

/// y = x Wᵀ + b with W's output features (dimension 0) split across the group: Megatron's
/// ColumnParallelLinear, PyTorch's ColwiseParallel. weight is [out/tp, in], bias [out/tp]. The
/// initial weights are torch::nn::Linear(in, out)'s drawn whole from the default generator (every
/// rank the same seed), then chunked, so a model built with tp ranks starts as the one-process one.
class FULGUR_SDK_API ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl> {
 public:
  /// A layer with `options` (throws fulgur::Error(invalid_argument) when out_features does not
  /// divide by the group's size).
  explicit ColumnParallelLinearImpl(const ParallelLinearOptions& options);
  /// (Re)creates weight and bias: the whole layer's initialization, then this rank's chunk.
  void reset() override;
  /// Input [..., in] (sequence-split when sequence_parallel); output [..., out/tp], or [..., out]
  /// with gather_output.
  at::Tensor forward(const at::Tensor& input);
  /// `fulgur::nn::ColumnParallelLinear(in_features=…, out_features=…, tp=…, …)`.
  void pretty_print(std::ostream& stream) const override;
  /// The options the layer was made with.
  ParallelLinearOptions options;
  at::Tensor weight;  ///< [out/tp, in]: chunk `rank` of the whole weight along dimension 0
  at::Tensor bias;    ///< [out/tp]

 private:
  struct State;
  std::shared_ptr<State> state_;  // unused in 1.3: room to grow without changing this class's layout
};
/// The module holder of ColumnParallelLinearImpl.
TORCH_MODULE(ColumnParallelLinear);

/// y = x Wᵀ + b with W's input features (dimension 1) split across the group: Megatron's
/// RowParallelLinear, PyTorch's RowwiseParallel. weight is [out, in/tp], bias [out] (replicated,
/// added once after the reduction). Output replicated, or sequence-split with sequence_parallel.
class FULGUR_SDK_API RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl> {
 public:
  /// A layer with `options` (throws fulgur::Error(invalid_argument) when in_features does not
  /// divide by the group's size).
  explicit RowParallelLinearImpl(const ParallelLinearOptions& options);
  /// (Re)creates weight and bias: the whole layer's initialization, then this rank's chunk.
  void reset() override;
  /// Input [..., in/tp] (input_is_parallel) or [..., in]; output [..., out].
  at::Tensor forward(const at::Tensor& input);
  /// `fulgur::nn::RowParallelLinear(in_features=…, out_features=…, tp=…, …)`.
  void pretty_print(std::ostream& stream) const override;
  /// The options the layer was made with.
  ParallelLinearOptions options;
  at::Tensor weight;  ///< [out, in/tp]: chunk `rank` of the whole weight along dimension 1
  at::Tensor bias;    ///< [out], replicated

 private:
  struct State;
  std::shared_ptr<State> state_;  // unused in 1.3: room to grow without changing this class's layout
};
/// The module holder of RowParallelLinearImpl.
TORCH_MODULE(RowParallelLinear);

/// Options of VocabParallelEmbedding.
struct VocabParallelEmbeddingOptions {
  /// The whole vocabulary's size and the embedding width.
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);                         ///< whole vocabulary
  TORCH_ARG(int64_t, embedding_dim);                          ///< width of each embedding
  TORCH_ARG(std::shared_ptr<Communicator>, group) = nullptr;  ///< tensor-parallel group
  /// Reduce-scatter the output along sequence_dim (into a sequence-parallel region) instead of
  /// all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 0;  ///< the sequence dimension of the output
};

/// An embedding whose vocabulary (weight's dimension 0) is split across the group: each rank looks
/// up the ids in its range [rank·V/tp, (rank+1)·V/tp), zeros the others, and the results are
/// summed over the group. weight is [V/tp, D], initialized as torch::nn::Embedding(V, D) (N(0, 1)
/// drawn whole, then chunked).
class FULGUR_SDK_API VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl> {
 public:
  /// A layer with `options` (throws fulgur::Error(invalid_argument) when num_embeddings does not
  /// divide by the group's size).
  explicit VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options);
  /// (Re)creates weight: N(0, 1) drawn for the whole vocabulary, then this rank's rows.
  void reset() override;
  /// Embeddings of `ids` (any shape, whole-vocabulary ids): [..., D], replicated, or split along
  /// sequence_dim with sequence_parallel.
  at::Tensor forward(const at::Tensor& ids);
  /// `fulgur::nn::VocabParallelEmbedding(num_embeddings=…, embedding_dim=…, tp=…)`.
  void pretty_print(std::ostream& stream) const override;
  /// The options the layer was made with.
  VocabParallelEmbeddingOptions options;
  at::Tensor weight;        ///< [V/tp, D]
  int64_t vocab_start = 0;  ///< first id of this rank's range
  int64_t vocab_end = 0;    ///< one past its last

 private:
  struct State;
  std::shared_ptr<State> state_;  // unused in 1.3: room to grow without changing this class's layout
};
/// The module holder of VocabParallelEmbeddingImpl.
TORCH_MODULE(VocabParallelEmbedding);

/// Cross-entropy of logits split along the vocabulary (a ColumnParallelLinear head without
/// gather_output): [N, V/tp] on each rank, `target` [N] whole ids. Per-token losses [N], equal on
/// every rank; the logits are never gathered (three all-reduces of [N] values: max, target logit,
/// sum of exponentials). Its backward is local (softmax minus the one-hot of the target).
FULGUR_SDK_API at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                                       Communicator* group);

/// Clips the gradients of `model`'s parameters to a total 2-norm of `max_norm` (torch's
/// clip_grad_norm_ over the whole, unsplit model) and returns the norm before clipping. Each
/// element counts once: the shards of ColumnParallelLinear, RowParallelLinear (weight) and
/// VocabParallelEmbedding are summed over `group`; every other parameter is replicated and counted
/// as this rank holds it. A collective over `group` (one all-reduce). Parameters without a
/// gradient are skipped.
FULGUR_SDK_API double clip_grad_norm_tensor_parallel(torch::nn::Module& model, double max_norm, Communicator* group);

/// Dropout randomness for tensor parallelism (Megatron's CudaRNGStatesTracker): the default
/// generator, seeded alike on every rank of the tensor-parallel group, drives replicated regions
/// (their masks must match, or the replicas diverge); a second stream, seeded `seed + 2718 +
/// tp_rank`, drives the sharded regions (each rank's shard gets its own mask, as one process's
/// dropout over the whole tensor would). fork() swaps it in for a scope.
class FULGUR_SDK_API TensorParallelRng {
 public:
  /// The sharded stream for `tp_rank` on `device`'s default generator (CPU or one CUDA device).
  TensorParallelRng(uint64_t seed, int64_t tp_rank, c10::Device device = c10::Device(c10::kCPU));
  /// While alive, the device's default generator draws from the sharded stream; its own state is
  /// restored (untouched) when the scope ends.
  class FULGUR_SDK_API Scope {
   public:
    /// Puts the default generator's own state back (the sharded stream's is kept for the next fork).
    ~Scope();
    Scope(const Scope&) = delete;             ///< not copyable
    Scope& operator=(const Scope&) = delete;  ///< not copyable

   private:
    friend class TensorParallelRng;
    explicit Scope(TensorParallelRng& tracker);
    TensorParallelRng& tracker_;
    at::Tensor saved_default_;
  };
  /// Enters the sharded region until the returned scope ends (not reentrant).
  [[nodiscard]] Scope fork();
  /// The sharded stream's seed.
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_;
  c10::Device device_;
  at::Tensor state_;  // the sharded stream's generator state between forks
};

}  // namespace fulgur::nn
