// The fsdp strategy's model and optimizer state, in the layouts any strategy and world size read.
//
// state_dict_type = "full": rank zero writes one file holding whole tensors (gathered), the
// optimizer state in torch.optim's layout. state_dict_type = "sharded": every rank writes its own
// rows into a DCP directory (fulgur/distributed_checkpoint.h), nothing is gathered;
// Strategy::load_checkpoint reads it whole, and a stage-3 rank reads only its rows of it. Either
// way the loaders take whole tensors (and cut this rank's rows from them) or rows as they come.
#pragma once

#include <fulgur/distributed_checkpoint.h>
#include <fulgur/strategy.h>

#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sharded_parameter.h"

namespace fulgur::fsdp {

/// Where each split tensor of the next sharded save sits in its whole tensor, by flattened key.
using Placements = std::map<std::string, dcp::Chunk>;

/// state_dict_type = "sharded": the parameters as this rank holds them (its rows: no copy, no
/// collective), buffers whole; `placements` is made anew for them.
c10::IValue sharded_module_state(torch::nn::Module& module, const Shards& shards, Placements& placements);

/// `local` (an optimizer's state in torch.optim's layout, its tensors this rank's rows, `order` its
/// parameters) with every per-parameter tensor gathered whole: a collective.
c10::IValue gathered_optimizer_state(const c10::IValue& local, const std::vector<ShardedParameter*>& order,
                                     const RankGroup& group);
/// The same with this rank's rows kept as they are (a rank holding no rows of a parameter leaves
/// its tensors out) and their placements recorded; "step" and the param groups are the same on
/// every rank (written once). `optimizer_index` is the optimizer's place in the checkpoint.
c10::IValue sharded_optimizer_state(const c10::IValue& local, const std::vector<ShardedParameter*>& order,
                                    int64_t optimizer_index, Placements& placements);
/// The reverse of both: this rank's rows of every per-parameter tensor of `state`, cut from whole
/// tensors or taken as they are; throws fulgur::Error(checkpoint) naming `origin` for a tensor of
/// another parameter's size.
c10::IValue local_optimizer_state(const c10::IValue& state, const std::vector<ShardedParameter*>& order,
                                  const std::string& origin);

/// Stage 3, a sharded checkpoint: reads this rank's rows of the parameters and of their optimizer
/// state (every other tensor whole) from the DCP directory `path` into `out`.
void read_local_rows(const std::string& path, const CheckpointParts& out, const Shards& shards, int64_t rank);

/// Stage 3: whether a model state holds this rank's rows of the split parameters rather than whole
/// tensors.
bool holds_rows(const c10::IValue& state, const Shards& shards);
/// Stage 3: rows (or whole tensors, cut) into the shards, buffers into the module, with the same
/// checks of missing, unexpected and mis-shaped keys as fulgur::load_module_state_dict. Whole
/// copies of the parameters held now are stale afterwards.
void load_module_rows(torch::nn::Module& module, const c10::IValue& state, bool strict, const std::string& origin,
                      const Shards& shards, int64_t rank);

}  // namespace fulgur::fsdp
