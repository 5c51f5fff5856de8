// Blocks: the parts of a model's forward that a strategy or the memory plan treats as one unit.
//
// LibTorch's C++ modules have no forward hooks, so a Module marks its blocks by running them
// through run_block (a transformer: each layer; a CNN: each stage):
//
//   for (auto& layer : layers)  // a module holder whose forward takes one tensor
//     x = fulgur::run_block(layer, x, fulgur::BlockOptions().checkpoint_activations(true));
//   x = fulgur::run_block(*attention, x,  // any forward: a callable of the input
//                         [attention, mask](const at::Tensor& h) mutable { return attention->forward(h, mask); });
//
// What a block gets:
//   - activation checkpointing (checkpoint_activations): the block's forward keeps no
//     activations for backward; backward runs it again (with the random state of the first run, so
//     dropout draws the same mask) and takes its gradients from the recomputation. Memory for
//     activations drops from one set per block to one block's worth, for one more forward.
//   - under a sharded strategy (fsdp with zero_stage = 3), a unit of sharding: the strategy gathers
//     the block's parameters before its forward, frees them after it, gathers them again for its
//     backward and reduce-scatters their gradients as soon as the block's backward is done.
// Without either, run_block is a plain call of `forward`.
//
// The forward must compute from `input` and the block's own parameters (block.parameters());
// other tensors it captures (masks, positions) are constants to it: under activation checkpointing
// no gradient flows into captured tensors that require one. With checkpoint_activations, backward
// calls `forward` again after the Module's forward has returned: capture by value (module holders
// and tensors are cheap to copy), never a reference to a local. Blocks may nest; a parameter belongs to
// the outermost block that runs it.
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

struct BlockOptions {
  // Recompute the block's activations in backward instead of keeping them.
  TORCH_ARG(bool, checkpoint_activations) = false;
};

using BlockForward = std::function<at::Tensor(const at::Tensor&)>;

// Runs `forward(input)` as a block of the model (see above). Call it from a Module's forward, for
// training, validation and prediction alike.
FULGUR_SDK_API at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward,
                                    const BlockOptions& options = {});

// The common case: a module holder (torch::nn::Linear, a TORCH_MODULE of yours) whose forward takes
// the input alone.
template <class Holder>
requires requires(Holder holder, const at::Tensor& input) {
  { holder->forward(input) } -> std::convertible_to<at::Tensor>;
}
at::Tensor run_block(Holder block, const at::Tensor& input, const BlockOptions& options = {}) {
  return run_block(
      *block, input, [block](const at::Tensor& x) mutable { return block->forward(x); }, options);
}

// Building a model larger than one rank's memory: in the Module's configure_model, mark each block
// as complete as soon as it is constructed and initialised:
//
//   void configure_model() override {
//     if (!blocks_.empty()) return;  // configure_model runs for every stage: build once
//     for (int64_t i = 0; i < n_layer; ++i) {
//       Block block(options);
//       init_weights(*block);  // everything that draws random numbers for it, before marking it
//       blocks_.push_back(fulgur::built_block(block));
//     }
//   }
//
// A sharded strategy (fsdp, zero_stage = 3) then puts the block on the device, converts it with the
// precision plugin and keeps only this rank's rows of its parameters, at once: a rank holds its
// shards plus one whole block at a time, never the whole model. Every rank builds every block from
// the same random state (rank zero's), so the shards are the rows of the weights one process with
// the same seed would build. Such a block must then run through run_block, which gathers it for
// each use (its parameters hold no storage outside it). Other strategies do nothing here.
FULGUR_SDK_API void block_built(torch::nn::Module& block);

// The same for a module holder (a TORCH_MODULE of yours), returned for registering.
template <class Holder>
Holder built_block(Holder block) {
  block_built(*block);
  return block;
}

// What a strategy installs to take part in every block's forward (a sharded strategy: gather the
// block's parameters around it and hook its backward).
class FULGUR_SDK_API BlockHooks {
 public:
  virtual ~BlockHooks();
  // Runs `forward(input)` for `block` with the strategy's work around it; returns its output.
  virtual at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward) = 0;
  // Makes every parameter of `module` whole on every rank (a collective), and the reverse.
  virtual void gather_full_parameters(torch::nn::Module& module) = 0;
  virtual void release_full_parameters(torch::nn::Module& module) = 0;
  // A block the Module finished building (fulgur::built_block), while configure_model runs.
  virtual void block_built(torch::nn::Module& /*block*/) {}
};

// The hooks of the running strategy, one per process; nullptr (the default) when the strategy has
// none. A strategy installs itself when it sets up the model and removes itself at teardown.
FULGUR_SDK_API void install_block_hooks(BlockHooks* hooks);
FULGUR_SDK_API void remove_block_hooks(BlockHooks* hooks);  // only if `hooks` is the installed one
FULGUR_SDK_API BlockHooks* installed_block_hooks();

// While it lives, the model's parameters are whole on every rank, as a single process would have
// them (FSDP's summon_full_params): to read or save weights after fit under a sharded strategy,
// e.g. `{ fulgur::FullParameters full(*model); torch::save(model, "model.pt"); }`. A collective:
// construct and destroy it on every rank together. Without sharding it does nothing.
class FULGUR_SDK_API FullParameters {
 public:
  explicit FullParameters(torch::nn::Module& module);
  ~FullParameters();
  FullParameters(const FullParameters&) = delete;
  FullParameters& operator=(const FullParameters&) = delete;

 private:
  torch::nn::Module& module_;
  BlockHooks* hooks_;
};

}  // namespace fulgur
