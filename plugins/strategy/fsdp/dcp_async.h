// state_dict_type = "sharded" with [trainer] async_checkpoint (fulgur/async_save.h): the collective
// dcp::save split in three, so that only the part that talks to no other rank runs in the
// background. As in dcp::save, the checkpoint is assembled in a temporary sibling directory and
// swapped into place only when every rank's data file and the metadata are written: a save that
// fails on any rank leaves the previous checkpoint at that path, and nothing that looks complete.
#pragma once

#include <fulgur/distributed_checkpoint.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "dcp_storage.h"

namespace fulgur::fsdp {

class SplitDcpSave {
 public:
  /// Training thread, a collective: rank 0 makes a fresh temporary directory next to `dir`; every
  /// rank learns whether it could (fulgur::Error(checkpoint) on every rank otherwise).
  SplitDcpSave(const std::string& dir, int64_t rank, int64_t world_size, const BroadcastString& broadcast);
  /// Background thread, no collectives: this rank's data file, from `state` and `placements` as
  /// for dcp::write_rank_file. Throws what that throws.
  void write(const c10::IValue& state, const std::map<std::string, dcp::Chunk>& placements);
  /// Training thread, a collective, once every rank's write() returned: with `all_written`, rank
  /// 0 gathers what each rank wrote, writes .metadata and swaps the directory into place; without,
  /// it removes the directory. A failure there throws fulgur::Error(checkpoint) on every rank.
  void finish(bool all_written, const BroadcastString& broadcast);

 private:
  std::string target_, temp_;
  int64_t rank_, world_size_;
  dcp::RankWrite mine_;
};

}  // namespace fulgur::fsdp
