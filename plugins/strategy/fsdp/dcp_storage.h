// state_dict_type = "sharded" checkpoints on object storage (an s3:// URL, fulgur/storage.h): a
// prefix laid out as DCP's directory, `<url>/__<rank>_0.distcp` per rank and `<url>/.metadata`.
// Every rank writes its data file locally with the SDK's DCP writer and uploads it (one atomic
// object each); rank 0 uploads .metadata last, once every rank's upload succeeded, so a checkpoint
// exists (is listed as one, is resumed from) only when it is complete, and a checkpoint saved
// again at the same prefix is replaced whole (save_to_storage). Reading downloads the
// prefix into a local directory and opens it with the SDK's reader.
#pragma once

#include <fulgur/distributed_checkpoint.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "rank_outcome.h"

namespace fulgur::fsdp {

/// The collective save of `state` (this rank's part, `placements` as for dcp::save) to `url`.
/// A previous checkpoint at `url` stays whole and readable until the new one is complete: the new
/// data files get names of their own (`__<rank>_0.<tag>.distcp`), the new .metadata replaces the
/// old one in one PUT, and then the old files go. A failure on any rank throws
/// fulgur::Error(checkpoint) on every rank, leaving the previous checkpoint.
void save_to_storage(const std::string& url, const c10::IValue& state,
                     const std::map<std::string, dcp::Chunk>& placements, int64_t rank, int64_t world_size,
                     const BroadcastString& broadcast);

/// save_to_storage split in three for [trainer] async_checkpoint (fulgur/async_save.h), so that
/// only the part that talks to no other rank runs in the background.
class SplitStorageSave {
 public:
  /// Training thread, a collective: rank 0 tags the data files of this save when `url` holds a
  /// checkpoint (which stays readable until finish() replaces it), every rank makes its local
  /// staging directory. A failure on any rank throws fulgur::Error(checkpoint) on every rank.
  SplitStorageSave(const std::string& url, int64_t rank, int64_t world_size, const BroadcastString& broadcast);
  ~SplitStorageSave();
  SplitStorageSave(const SplitStorageSave&) = delete;
  SplitStorageSave& operator=(const SplitStorageSave&) = delete;
  /// Background thread, no collectives: this rank's data file, written locally and uploaded.
  void write(const c10::IValue& state, const std::map<std::string, dcp::Chunk>& placements);
  /// Training thread, a collective, once every rank's write() returned: with `all_written`, rank 0
  /// gathers what each rank wrote, removes data files that are not this checkpoint's and uploads
  /// .metadata last; without, it removes the data files this save uploaded (a previous checkpoint
  /// at `url` stays). A failure throws fulgur::Error(checkpoint) on every rank.
  void finish(bool all_written, const BroadcastString& broadcast);

 private:
  std::string url_, local_, tag_;
  int64_t rank_, world_size_;
  dcp::RankWrite mine_;
};

/// True when `url` is a complete sharded checkpoint on object storage (its .metadata exists).
bool is_stored_checkpoint(const std::string& url);

/// A local copy of the sharded checkpoint at `url` (downloaded whole), removed with this object.
class StagedCheckpoint {
 public:
  explicit StagedCheckpoint(const std::string& url);
  ~StagedCheckpoint();
  StagedCheckpoint(const StagedCheckpoint&) = delete;
  StagedCheckpoint& operator=(const StagedCheckpoint&) = delete;
  /// The local directory, for dcp::Reader and the strategy's loaders.
  const std::string& path() const { return dir_; }

 private:
  std::string dir_;
};

}  // namespace fulgur::fsdp
