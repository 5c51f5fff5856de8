#include "dcp_async.h"

#include <fulgur/error.h>

#include <fmt/format.h>

#include <fcntl.h>
#include <stdio.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <vector>

namespace fulgur::fsdp {

namespace {

namespace fs = std::filesystem;

// Every rank throws the first rank's error ("" where a rank had none).
void agree_on_errors(const std::string& mine, int64_t rank, int64_t world_size, const BroadcastString& broadcast,
                     const std::string& dir) {
  const std::vector<std::string> errors = gather_strings(mine, rank, world_size, broadcast);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      throw Error(ErrorKind::checkpoint,
                  fmt::format("saving sharded checkpoint '{}' failed on rank {}: {}", dir, r, errors[r]));
}

[[noreturn]] void fail(const fs::path& target, const std::string& what) {
  throw Error(ErrorKind::io, fmt::format("cannot save distributed checkpoint '{}': {}", target.string(), what));
}

// Rank 0, before anyone writes (dcp::save's checks): the temporary directory, fresh.
void prepare(const fs::path& target, const fs::path& temp) {
  std::error_code ec;
  if (fs::exists(target, ec)) {
    if (!fs::is_directory(target, ec))
      fail(target, "a file of that name exists (a distributed checkpoint is a directory); choose another path");
    if (!fs::is_empty(target, ec) && !dcp::is_distributed_checkpoint(target.string()))
      fail(target,
           "the directory exists and is not a distributed checkpoint (it has no .metadata); refusing to "
           "replace it, choose another path");
  }
  fs::create_directories(target.parent_path(), ec);
  remove_tree(temp);  // what an interrupted save left
  ec.clear();
  if (!fs::create_directory(temp, ec) || ec)
    fail(target, fmt::format("cannot create '{}': {}", temp.string(), ec.message()));
}

// Rank 0, once the metadata is written: the new directory takes the place of the old one (an
// atomic exchange where the filesystem has one), then the old one goes.
void publish(const fs::path& target, const fs::path& temp) {
  std::error_code ec;
  if (!fs::exists(target, ec)) {
    if (::rename(temp.c_str(), target.c_str()) != 0)
      fail(target, fmt::format("renaming the new checkpoint into place failed: {}", std::strerror(errno)));
  } else if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    remove_tree(temp);  // the previous checkpoint, swapped out
  } else {
    const fs::path old = target.parent_path() / ("." + target.filename().string() + ".dcp-old");
    remove_tree(old);
    if (::rename(target.c_str(), old.c_str()) != 0)
      fail(target, fmt::format("moving the previous checkpoint aside failed: {}", std::strerror(errno)));
    if (::rename(temp.c_str(), target.c_str()) != 0) {
      const int error_number = errno;
      ::rename(old.c_str(), target.c_str());
      fail(target, fmt::format("renaming the new checkpoint into place failed: {}", std::strerror(error_number)));
    }
    remove_tree(old);
  }
}

}  // namespace

SplitDcpSave::SplitDcpSave(const std::string& dir, int64_t rank, int64_t world_size, const BroadcastString& broadcast)
    : rank_(rank), world_size_(world_size) {
  fs::path target = fs::absolute(fs::path(dir)).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();  // a trailing '/'
  target_ = target.string();
  // Not dcp::save's ".dcp-tmp": a synchronous save of the same path never meets this one's.
  temp_ = (target.parent_path() / ("." + target.filename().string() + ".dcp-async")).string();
  const std::string error = rank == 0 ? outcome([&] { prepare(target_, temp_); }) : std::string();
  agree_on_errors(error, rank_, world_size_, broadcast, target_);
}

void SplitDcpSave::write(const c10::IValue& state, const std::map<std::string, dcp::Chunk>& placements) {
  mine_ = dcp::write_rank_file(temp_, rank_, state, placements);
}

void SplitDcpSave::finish(bool all_written, const BroadcastString& broadcast) {
  if (!all_written) {
    if (rank_ == 0) remove_tree(temp_);
    return;
  }
  const std::vector<std::string> records =
      gather_strings(rank_ == 0 ? std::string() : mine_.serialize(), rank_, world_size_, broadcast);
  std::string error;
  if (rank_ == 0) {
    error = outcome([&] {
      std::vector<dcp::RankWrite> ranks{mine_};
      for (int64_t r = 1; r < world_size_; ++r) ranks.push_back(dcp::RankWrite::deserialize(records[r]));
      dcp::write_metadata(temp_, ranks);
      publish(target_, temp_);
    });
    if (!error.empty()) remove_tree(temp_);
  }
  agree_on_errors(error, rank_, world_size_, broadcast, target_);
}

}  // namespace fulgur::fsdp
