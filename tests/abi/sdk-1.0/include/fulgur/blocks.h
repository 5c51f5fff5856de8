/// @file
/// Blocks: the parts of a model's forward that a strategy or the memory plan treats as one unit
/// (a transformer: each layer; a CNN: each stage). LibTorch's C++ modules have no forward hooks,
/// so a Module marks its blocks by running them through run_block, and marks them as built with
/// built_block; a strategy takes part through BlockHooks.
#pragma once

#include <fulgur/export.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <concepts>
#include <functional>

namespace torch::nn {
class Module;
}

namespace fulgur {

/// How run_block runs a block: `fulgur::BlockOptions().checkpoint_activations(true)`.
struct BlockOptions {
  /// Recompute the block's activations in backward instead of keeping them (default false). Set
  /// with `.checkpoint_activations(bool)`, read with `.checkpoint_activations()`.
  TORCH_ARG(bool, checkpoint_activations) = false;
};

/// A block's forward: a callable of the block's input.
using BlockForward = std::function<at::Tensor(const at::Tensor&)>;

/// Runs `forward(input)` as a block of the model. Call it from a Module's forward, for training,
/// validation and prediction alike, on the thread running the forward:
///
/// @code
///   for (auto& layer : layers)  // a module holder whose forward takes one tensor
///     x = fulgur::run_block(layer, x, fulgur::BlockOptions().checkpoint_activations(true));
///   x = fulgur::run_block(*attention, x,  // any forward: a callable of the input
///                         [attention, mask](const at::Tensor& h) mutable { return attention->forward(h, mask); });
/// @endcode
///
/// What a block gets:
///   - activation checkpointing (checkpoint_activations, while gradients are enabled): the block's
///     forward keeps no activations for backward; backward runs it again (with the random state
///     and autocast context of the first run, so dropout draws the same mask) and takes its
///     gradients from the recomputation. Memory for activations drops from one set per block to
///     one block's worth, for one more forward.
///   - under a sharded strategy (fsdp with zero_stage = 3), a unit of sharding: the strategy
///     gathers the block's parameters before its forward, frees them after it, gathers them again
///     for its backward and reduce-scatters their gradients as soon as the block's backward is
///     done. Every rank must then run the same blocks in the same order (the gathers are
///     collectives).
///
/// Without either, run_block is a plain call of `forward`. The forward must compute from `input`
/// and the block's own parameters (block.parameters()); other tensors it captures (masks,
/// positions) are constants to it: under activation checkpointing no gradient flows into captured
/// tensors that require one. With checkpoint_activations, backward calls `forward` again after the
/// Module's forward has returned (on autograd's thread): capture by value (module holders and
/// tensors are cheap to copy), never a reference to a local. Blocks may nest; a parameter belongs
/// to the outermost block that runs it. Exceptions from `forward` propagate.
FULGUR_SDK_API at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward,
                                    const BlockOptions& options = {});

/// The common case: a module holder (torch::nn::Linear, a TORCH_MODULE of yours) whose forward
/// takes the input alone. The holder is copied into the forward (it shares the module).
template <class Holder>
requires requires(Holder holder, const at::Tensor& input) {
  { holder->forward(input) } -> std::convertible_to<at::Tensor>;
}
at::Tensor run_block(Holder block, const at::Tensor& input, const BlockOptions& options = {}) {
  return run_block(
      *block, input, [block](const at::Tensor& x) mutable { return block->forward(x); }, options);
}

/// Building a model larger than one rank's memory: in the Module's configure_model, mark each block
/// as complete as soon as it is constructed and initialised:
///
/// @code
///   void configure_model() override {
///     if (!blocks_.empty()) return;  // configure_model runs for every stage: build once
///     for (int64_t i = 0; i < n_layer; ++i) {
///       Block block(options);
///       init_weights(*block);  // everything that draws random numbers for it, before marking it
///       blocks_.push_back(fulgur::built_block(block));
///     }
///   }
/// @endcode
///
/// A sharded strategy (fsdp, zero_stage = 3) then puts the block on the device, converts it with
/// the precision plugin and keeps only this rank's rows of its parameters, at once: a rank holds
/// its shards plus one whole block at a time, never the whole model. Every rank builds every block
/// from the same random state (rank zero's), so the shards are the rows of the weights one process
/// with the same seed would build. Such a block must then run through run_block, which gathers it
/// for each use (its parameters hold no storage outside it). Other strategies do nothing here, and
/// outside configure_model it does nothing. Every rank must mark the same blocks in the same order.
FULGUR_SDK_API void block_built(torch::nn::Module& block);

/// The same for a module holder (a TORCH_MODULE of yours), returned for registering.
template <class Holder>
Holder built_block(Holder block) {
  block_built(*block);
  return block;
}

/// What a strategy installs to take part in every block's forward (a sharded strategy: gather the
/// block's parameters around it and hook its backward). Implemented by the strategy (usually the
/// strategy object itself), which keeps owning it; installed process-wide with
/// install_block_hooks. Called from the thread running the Module's code.
class FULGUR_SDK_API BlockHooks {
 public:
  virtual ~BlockHooks();
  /// Runs `forward(input)` for `block` with the strategy's work around it; returns its output.
  /// Called by fulgur::run_block for every block forward while installed (every training,
  /// validation and prediction batch); `forward` already includes activation checkpointing where
  /// it was asked for.
  virtual at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward) = 0;
  /// Makes every parameter of `module` whole on every rank (a collective). Called by
  /// FullParameters' constructor; calls nest.
  virtual void gather_full_parameters(torch::nn::Module& module) = 0;
  /// Undoes one gather_full_parameters (a collective where it communicates). Called by
  /// FullParameters' destructor: must not throw.
  virtual void release_full_parameters(torch::nn::Module& module) = 0;
  /// A block the Module finished building (fulgur::built_block), while configure_model runs.
  /// Default: nothing.
  virtual void block_built(torch::nn::Module& /*block*/) {}
};

/// Installs the hooks of the running strategy, one per process (replacing any installed before);
/// nullptr (the default) when the strategy has none. A strategy installs itself when it builds or
/// sets up the model and removes itself at teardown, before it is destroyed. Safe from any thread.
FULGUR_SDK_API void install_block_hooks(BlockHooks* hooks);
/// Uninstalls `hooks`, only if `hooks` is the installed one (another strategy's stay). Safe from
/// any thread.
FULGUR_SDK_API void remove_block_hooks(BlockHooks* hooks);
/// The installed hooks, or nullptr. Not owned by the caller.
FULGUR_SDK_API BlockHooks* installed_block_hooks();

/// While it lives, the model's parameters are whole on every rank, as a single process would have
/// them (FSDP's summon_full_params): to read or save weights after fit under a sharded strategy,
/// e.g. `{ fulgur::FullParameters full(*model); torch::save(model, "model.pt"); }`. A collective:
/// construct and destroy it on every rank together. Without sharding (no BlockHooks installed) it
/// does nothing. Keeps references to `module` and to the hooks installed at construction: both
/// must outlive it.
class FULGUR_SDK_API FullParameters {
 public:
  /// Gathers the parameters of `module` (BlockHooks::gather_full_parameters).
  explicit FullParameters(torch::nn::Module& module);
  /// Releases them again (BlockHooks::release_full_parameters).
  ~FullParameters();
  FullParameters(const FullParameters&) = delete;
  FullParameters& operator=(const FullParameters&) = delete;

 private:
  torch::nn::Module& module_;
  BlockHooks* hooks_;
};

}  // namespace fulgur
