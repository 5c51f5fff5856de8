// The model_parallel strategy's checkpoints: torch.distributed.checkpoint directories with the
// chunk layout PyTorch writes for FSDP2 + tensor parallelism (capability-notes §1). Each rank
// writes its tensor-parallel shard of every split parameter (ColumnParallelLinear: dimension 0,
// RowParallelLinear's weight: dimension 1, VocabParallelEmbedding: dimension 0) and of its
// optimizer state, and inside that shard the rows (dimension 0) its data-parallel coordinate owns,
// as fully_shard's torch.chunk does: TP chunk outer, FSDP chunk inner. Replicated tensors are
// written once (tp rank 0's rows, split over dp like the rest). Loading reads only the region of
// this rank's shard, whatever layout wrote the checkpoint, and cuts whole tensors (a one-process
// file) to the shard: that is the resharding between (dp, tp) layouts.
#pragma once

#include <fulgur/distributed_checkpoint.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace fulgur::model_parallel {

/// Where one parameter as this rank holds it sits in the whole tensor (split parameters), or that
/// it is replicated across the tp group (split == false: global shape = its own, offsets 0).
struct Piece {
  bool split = false;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  std::vector<int64_t> local_shape;  // the parameter as this rank holds it
};

/// Every parameter's Piece, by tensor and by dotted name, found by walking the model's
/// tensor-parallel layers.
struct Pieces {
  std::unordered_map<const void*, Piece> by_tensor;  // TensorImpl*
  std::map<std::string, const Piece*> by_name;
  std::vector<std::string> split_names;  // for messages and tests: which parameters are split
  std::set<std::string> parameters;      // every parameter's name (the rest of a state dict: buffers)
};

/// Finds the split parameters of `model` (its ColumnParallelLinear, RowParallelLinear and
/// VocabParallelEmbedding layers) for tensor-parallel coordinate `tp_rank`.
Pieces find_pieces(torch::nn::Module& model, int64_t tp_rank);

/// This rank's coordinate in the (dp, tp) mesh.
struct Coordinate {
  int64_t dp_rank = 0, dp_size = 1, tp_rank = 0;
};

/// The model state to write, from `state` (the module's state as this rank holds it): each
/// parameter as this rank's chunk (placements, made anew, recorded under "state_dict.<name>"):
/// split ones their dp rows of the tp shard, replicated ones their dp rows on tp rank 0 only;
/// buffers whole (rank 0 writes them).
c10::IValue sharded_module_state(const c10::IValue& state, const Pieces& pieces, const Coordinate& at,
                                 std::map<std::string, dcp::Chunk>& placements);

/// One parameter of an optimizer, in torch.optim's order: the module's parameter (this rank's tp
/// shard of it) and, when the dp dimension shards the optimizer (zero_stage >= 1), the rows
/// [begin, begin + count) of it that this rank steps and keeps the state of (count < 0: all).
struct Stepped {
  at::Tensor parameter;
  int64_t begin = 0;
  int64_t count = -1;

  bool rows() const { return count >= 0; }
  /// The shape of this rank's per-element optimizer state of it.
  std::vector<int64_t> state_shape() const;
};
/// An optimizer's parameters in torch.optim's order.
using StepOrder = std::vector<Stepped>;

/// The optimizer's parameters as they are (no dp sharding).
StepOrder whole_order(torch::optim::Optimizer& optimizer);

/// The same for one optimizer's state (torch.optim layout, `local` from fulgur::optimizer_state_dict):
/// every per-parameter tensor is chunked like the parameter (placements added). Under dp sharding
/// (`order` with rows) the tensors are this rank's rows already and are written as they are.
c10::IValue sharded_optimizer_state(const c10::IValue& local, const StepOrder& order, int64_t optimizer_index,
                                    const Pieces& pieces, const Coordinate& at,
                                    std::map<std::string, dcp::Chunk>& placements);

/// A model state with every whole tensor of a split parameter cut to this rank's shard (tensors of
/// the shard's shape pass as they are).
c10::IValue local_module_state(const c10::IValue& state, const Pieces& pieces);
/// One tensor of `parameter`'s optimizer state: cut to this rank's shard when it is the whole
/// tensor of a split parameter, as it is otherwise.
at::Tensor local_state_tensor(const at::Tensor& tensor, const Pieces& pieces, const at::Tensor& parameter);
/// The same for an optimizer's per-parameter state, then cut to this rank's rows under dp sharding.
c10::IValue local_optimizer_state(const c10::IValue& state, const StepOrder& order, const Pieces& pieces);

/// Reads a DCP checkpoint with only this rank's region of each split parameter and of its
/// optimizer state (`orders`: the optimizers' in checkpoint order, possibly none; under dp
/// sharding only this rank's rows of the state); every other tensor whole.
c10::IValue read_local(const std::string& path, const Pieces& pieces, const std::vector<StepOrder>& orders);

}  // namespace fulgur::model_parallel
