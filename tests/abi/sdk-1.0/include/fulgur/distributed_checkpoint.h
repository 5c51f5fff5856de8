/// @file
/// Distributed checkpoints in PyTorch's torch.distributed.checkpoint (DCP) format, written and read
/// from C++ without Python: a directory with one `__<rank>_0.distcp` data file per rank (each entry
/// a complete torch.save archive) and one `.metadata` file (a pickled Metadata object) that says
/// which byte range of which file holds which chunk of which tensor. Python opens what this writes
/// with torch.distributed.checkpoint.load (any number of ranks, any sharding) or
/// format_utils.dcp_to_torch_save; the Reader opens what Python's dcp.save wrote.
#pragma once

#include <fulgur/export.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace c10 {
struct IValue;
}

namespace fulgur {

class Communicator;

/// Distributed checkpoints (torch.distributed.checkpoint's format): a sharded strategy saves each
/// rank's chunks with save() and re-shards on load by reading any region through a Reader.
namespace dcp {

/// One step of a leaf's place in the nested state: a dict key (string) or a list index (integer).
using PathElement = std::variant<std::string, int64_t>;
/// A leaf's place in the nested state, outermost first.
using Path = std::vector<PathElement>;
/// The flattened key, DCP's: the elements joined by '.' ("state_dict.layer.weight",
/// "optimizer_states.0.state.3.exp_avg").
FULGUR_SDK_API std::string flatten_key(const Path& path);

/// A tensor leaf this rank holds only part of: the whole tensor's shape and where this rank's
/// part (the leaf itself, whose sizes are the chunk's) starts in it.
struct Chunk {
  std::vector<int64_t> global_shape;  ///< shape of the whole tensor
  std::vector<int64_t> offsets;       ///< where this rank's part starts, one offset per dimension

  /// Sets global_shape; returns *this for chaining.
  Chunk& set_global_shape(std::vector<int64_t> v) {
    global_shape = std::move(v);
    return *this;
  }
  /// Sets offsets; returns *this for chaining.
  Chunk& set_offsets(std::vector<int64_t> v) {
    offsets = std::move(v);
    return *this;
  }
};

/// What one rank's data file holds, as the metadata needs it. Ranks send it to rank 0 as a string.
struct RankWrite {
  /// One leaf written to the file.
  struct Entry {
    std::string key;         ///< the flattened key
    Path path;               ///< how to rebuild the nesting (DCP's planner_data)
    bool is_tensor = false;  ///< a tensor (the fields marked "tensors only" apply) or a torch.save'd value
    at::ScalarType dtype = at::ScalarType::Float;  ///< tensors only
    std::vector<int64_t> global_shape;             ///< tensors only: the whole tensor's shape
    std::vector<int64_t> offsets;                  ///< tensors only: where this chunk starts
    std::vector<int64_t> sizes;                    ///< tensors only: this chunk's sizes
    int64_t offset = 0;                            ///< start of the entry's byte range in `file`
    int64_t length = 0;                            ///< length of that byte range
  };
  int64_t rank = 0;            ///< the rank that wrote the file
  std::string file;            ///< relative to the checkpoint directory
  std::vector<Entry> entries;  ///< every leaf of the file, in the order written

  /// This record as bytes, to send to rank 0 (deserialize reads it back).
  FULGUR_SDK_API std::string serialize() const;
  /// Throws fulgur::Error(distributed) when `bytes` is not what serialize() produced.
  FULGUR_SDK_API static RankWrite deserialize(std::string_view bytes);
};

/// Writes this rank's data file `__<rank>_0.distcp` into `dir` (which must exist), fsynced, and
/// returns what the metadata needs. `state` is a nested dict/list (GenericDict with string or int
/// keys, GenericList) whose leaves are flattened as DCP flattens them: dicts and lists holding a
/// tensor or a container are walked, any other list or tuple is one leaf. Tensor leaves named in
/// `placements` (by flattened key) are this rank's chunk of a sharded tensor; other tensors are
/// replicated and, like non-tensor leaves (numbers, strings, None, lists of them: torch.save
/// bytes), written by rank 0 only. Empty dicts have no leaves and vanish, as in DCP. Not a
/// collective (save() is). Throws fulgur::Error (checkpoint, io).
FULGUR_SDK_API RankWrite write_rank_file(const std::string& dir, int64_t rank, const c10::IValue& state,
                                         const std::map<std::string, Chunk>& placements);

/// Writes `dir`/.metadata from every rank's RankWrite (via .metadata.tmp, fsync, rename): rank 0's
/// part of a save. Checks that the ranks agree on each tensor's shape and dtype and that its chunks
/// cover it exactly once; throws fulgur::Error(checkpoint) naming the key otherwise, (io) when the
/// file cannot be written.
FULGUR_SDK_API void write_metadata(const std::string& dir, const std::vector<RankWrite>& ranks);

/// The collective save: every rank calls it with its own part (`state` and `placements` as for
/// write_rank_file). The checkpoint is assembled in a temporary sibling directory
/// (`.<name>.dcp-tmp`) and only then swapped into `dir`, so an existing checkpoint at `dir` is
/// replaced only by a complete one and a rank killed mid-save leaves the previous checkpoint
/// loadable. A failure on any rank throws fulgur::Error on every rank. `communicator` == nullptr:
/// a single process (rank 0 of 1); otherwise it is used only during the call.
FULGUR_SDK_API void save(const std::string& dir, const c10::IValue& state,
                         const std::map<std::string, Chunk>& placements, Communicator* communicator);

/// A checkpoint directory opened for reading: Fulgur's or Python's, any number of writer ranks.
/// Re-sharding is reading whatever region this rank needs. Not a collective: each rank opens and
/// reads on its own. Errors are fulgur::Error(checkpoint) naming the directory and file (a key
/// that does not exist, or a tensor read as a value and the reverse: invalid_argument). Tensors
/// are read onto the CPU.
class FULGUR_SDK_API Reader {
 public:
  /// Opens `dir` and reads its `.metadata`; throws fulgur::Error(checkpoint) when it is missing or
  /// unreadable.
  explicit Reader(const std::string& dir);
  ~Reader();
  /// Moves the opened checkpoint; the source is left empty.
  Reader(Reader&&) noexcept;
  /// Moves the opened checkpoint; the source is left empty.
  Reader& operator=(Reader&&) noexcept;

  /// The directory this reader opened.
  const std::string& directory() const;
  std::vector<std::string> keys() const;  ///< flattened keys, in the checkpoint's order
  /// Whether `key` is a flattened key of the checkpoint.
  bool contains(const std::string& key) const;
  /// Whether the leaf at `key` is a tensor (else a value read with read_value).
  bool is_tensor(const std::string& key) const;
  /// The whole tensor's shape at `key`.
  std::vector<int64_t> shape(const std::string& key) const;
  /// The tensor's dtype at `key`.
  at::ScalarType dtype(const std::string& key) const;
  Path path(const std::string& key) const;  ///< where the leaf sits in the nested state

  /// The region [offsets, offsets + sizes) of a tensor, assembled from every chunk that overlaps
  /// it.
  at::Tensor read(const std::string& key, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) const;
  at::Tensor read(const std::string& key) const;         ///< the whole tensor
  c10::IValue read_value(const std::string& key) const;  ///< a non-tensor leaf
  /// The nested state, every tensor whole (string-keyed dicts, lists), as dcp_to_torch_save builds
  /// it.
  c10::IValue read_all() const;
  /// The same, with each tensor leaf from `read_tensor(key)` (e.g. a sharded strategy reading only
  /// its rows with read(key, offsets, sizes)); an undefined tensor from it means "read it whole".
  c10::IValue read_all(const std::function<at::Tensor(const std::string& key)>& read_tensor) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// DCP stores dict keys as strings, so torch.optim's per-parameter state comes back keyed "0", "1",
/// ...: this returns an optimizer state dict with those keys as integers again (other keys as they
/// are).
FULGUR_SDK_API c10::IValue with_index_keys(const c10::IValue& optimizer_state);

/// Whether `dir` is a directory holding a `.metadata` file. Does not throw.
FULGUR_SDK_API bool is_distributed_checkpoint(const std::string& dir);

/// Writes the whole checkpoint at `dir` into one torch.save file (atomically):
/// torch.load(out_file, weights_only=True) opens it; Fulgur reads it with read_checkpoint_file.
/// Throws fulgur::Error (checkpoint, io).
FULGUR_SDK_API void consolidate(const std::string& dir, const std::string& out_file);

}  // namespace dcp
}  // namespace fulgur
