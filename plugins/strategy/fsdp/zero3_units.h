// ZeRO stage 3 of the fsdp strategy: parameters whole only around the blocks that use them.
//
// The blocks a Module runs through fulgur::run_block (fulgur/blocks.h) are the units: before a
// block's forward one all-gather makes its parameters whole, after it they are freed again
// (reshard_after_forward); a hook on the block's output gathers them again when backward reaches
// it, and an identity autograd node on its input reduce-scatters their gradients as soon as the
// block's backward is done (the engine runs the parameters' gradient accumulation before that
// node). What no hook saw (the first block, whose input needs no gradient; parameters outside any
// block) is reduce-scattered at the end of backward in one collective. With prefetch, the next
// unit's all-gather (in the order of the previous training forward) starts before the current
// unit computes, so that they overlap.
#pragma once

#include <fulgur/blocks.h>

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "sharded_parameter.h"

namespace fulgur::fsdp {

/// Frees a stage-3 parameter's storage; its shape, autograd identity and gradient stay.
void release(ShardedParameter& p);

/// Gives a stage-3 parameter freed storage of another dtype (its values come from the shards at
/// the next gather). The Module keeps the same parameter: set_data changes what it holds, not its
/// identity. Only between steps or on a block's first use, before autograd saw the parameter.
void set_storage_dtype(ShardedParameter& p, at::ScalarType dtype);

/// What an identity node on a block's input runs when its backward does: once the block's
/// backward is done (the engine accumulates the parameters' gradients before it), which is when
/// the block's gradients can be reduce-scattered and its parameters freed.
struct AfterBlock : torch::CustomClassHolder {
  std::function<void()> run;
};

/// The units of stage 3 and the gathers, prefetches, reductions and releases around them.
class Zero3Units {
 public:
  /// `shards`, `options` and `group` belong to the strategy and outlive this object.
  Zero3Units(Shards& shards, const ShardingOptions& options, const RankGroup& group)
      : shards_(shards), options_(options), group_(group) {}
  Zero3Units(const Zero3Units&) = delete;
  Zero3Units& operator=(const Zero3Units&) = delete;

  /// fulgur::BlockHooks::run_block: `forward(input)` with `block`'s parameters whole around it,
  /// and the hooks that gather them again and reduce their gradients in backward.
  at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input, const BlockForward& forward);

  /// Before a training step: whether its backward reduces gradients, and the forward order the
  /// previous step recorded, which prefetching follows.
  void before_training_step(bool sync_gradients);
  /// Around backward: its gradients reduce-scattered block by block (unless `sync_gradients` is
  /// false: micro-steps keep whole gradients), prefetching in the reverse of the forward just run;
  /// finish_backward reduces what no block hook saw and frees the blocks' parameters.
  void begin_backward(bool sync_gradients);
  void finish_backward();
  /// After an optimizer step: whole copies of blocks' parameters are stale and freed (the next
  /// forward gathers them); the parameters outside blocks are refreshed at once, as in stage 2.
  void after_step();

  /// fulgur::FullParameters: every parameter whole, in the shards' dtype (param_dtype is for
  /// computing, not for saving); guards nest. The last release writes this rank's rows of the whole
  /// parameters back to the shards (FSDP's writeback): what was changed in them meanwhile stays.
  void hold_full_parameters();
  void release_full_parameters();

  /// One all-gather makes the group's parameters whole from every rank's shards (each padded to
  /// its chunk size). A group already whole on this rank is whole on every rank (the same hooks ran
  /// everywhere), so it costs nothing, unless `refresh` (the shards changed).
  void gather_group(const std::vector<ShardedParameter*>& group, bool refresh = false, bool drain = true);
  /// The parameters whole now, gathered again from shards that changed (a loaded checkpoint).
  void refresh_whole();
  /// Completes every prefetch under way.
  void drain_prefetches();
  /// Units that hold at least one parameter.
  int64_t unit_count() const {
    int64_t n = 0;
    for (const auto& [module, unit] : units_) n += unit.parameters.empty() ? 0 : 1;
    return n;
  }
  /// Forgets the units and forward orders (they refer to the shards; run_block makes them again).
  void clear();

  /// Logs (debug) the collectives since the previous call, and counts again from zero.
  void report_traffic();
  void reset_traffic() { all_gathers_ = reduce_scatters_ = reduce_scatters_overlapped_ = prefetches_ = 0; }

 private:
  // An all-gather under way: this rank's padded shards and the buffer every rank's arrive in.
  struct InFlightGather {
    at::Tensor mine, all;
    int64_t unit_numel = 0;
    std::unique_ptr<PendingCollective> pending;  // null: already complete
  };

  // A reduce-scatter of a group's gradients: every rank's packed rows and this rank's sum of them.
  struct InFlightReduce {
    std::vector<ShardedParameter*> group;
    at::Tensor flat, mine;
    int64_t numel = 0;                           // the gradients' part of the slice (flags follow)
    std::unique_ptr<PendingCollective> pending;  // null: complete
  };

  struct Unit {
    std::vector<ShardedParameter*> parameters;  // those no other block claimed first
    c10::intrusive_ptr<AfterBlock> after;
    int64_t order = -1;                          // its place in the previous training forward
    std::unique_ptr<InFlightGather> prefetched;  // an all-gather started ahead of its use
  };

  Unit& unit_of(torch::nn::Module& block);
  void remember_forward_order();
  c10::intrusive_ptr<AfterBlock> unit_capsule(Unit& unit);
  void after_block_backward(Unit& unit);
  InFlightGather start_gather(const std::vector<ShardedParameter*>& group, bool async);
  void finish_gather(const std::vector<ShardedParameter*>& group, InFlightGather& gather);
  void gather_unit(Unit& unit);
  void write_back_rows();
  void prefetch_after(const Unit& unit, int step);
  bool prefetch_in_flight() const;
  void reduce_scatter_group(const std::vector<ShardedParameter*>& candidates, bool async);
  void land_reductions(size_t count);
  void land_reduction(InFlightReduce& reduction);
  at::TensorOptions reduce_options() const;

  Shards& shards_;
  const ShardingOptions& options_;
  const RankGroup& group_;
  bool sync_gradients_ = true;
  int full_parameters_held_ = 0;  // FullParameters guards alive (nested ones count)
  int64_t all_gathers_ = 0, reduce_scatters_ = 0, reduce_scatters_overlapped_ = 0, prefetches_ = 0;
  std::deque<InFlightReduce> reductions_;  // overlap_reduce: started in backward, not landed yet
  std::map<const torch::nn::Module*, Unit> units_;
  std::vector<Unit*> forward_order_, this_forward_;
};

/// `state` (a model state dict) with every tensor copied: stage 3's whole parameters outlive the
/// fulgur::FullParameters guard that gathered them.
c10::IValue with_copied_tensors(const c10::IValue& state);

}  // namespace fulgur::fsdp
