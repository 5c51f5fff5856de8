#include "dcp_storage.h"

#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <fmt/format.h>

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <vector>

namespace fulgur::fsdp {

namespace {

namespace fs = std::filesystem;

constexpr const char* kMetadata = ".metadata";

std::string trimmed(std::string url) {
  while (url.ends_with('/') && !url.ends_with("://")) url.pop_back();
  return url;
}

// A fresh local directory under $TMPDIR (the DCP writer and reader work on directories).
std::string local_directory(std::string_view what) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = fmt::format("{}/fulgur-dcp-{}-XXXXXX", tmp && *tmp ? tmp : "/tmp", what);
  if (::mkdtemp(pattern.data()) == nullptr)
    throw Error(ErrorKind::io, fmt::format("cannot make a local directory {} for a sharded checkpoint: {}", pattern,
                                           std::strerror(errno)));
  return pattern;
}

void throw_first_failure(const std::vector<std::string>& messages, const std::string& url) {
  for (size_t r = 0; r < messages.size(); ++r)
    if (!messages[r].empty() && messages[r][0] == 'e')
      throw Error(ErrorKind::checkpoint, fmt::format("saving sharded checkpoint '{}' failed on rank {}: {}", url, r,
                                                     std::string_view(messages[r]).substr(1)));
}

}  // namespace

void save_to_storage(const std::string& target, const c10::IValue& state,
                     const std::map<std::string, dcp::Chunk>& placements, int64_t rank, int64_t world_size,
                     const BroadcastString& broadcast) {
  const std::string url = trimmed(target);
  Storage& storage = storage_for(url);
  // 1. Rank 0 takes the old checkpoint's .metadata away: from here until step 3 there is none.
  std::string error = rank == 0 ? outcome([&] { storage.remove(join_storage_path(url, kMetadata)); }) : std::string();
  throw_first_failure(gather_strings(error.empty() ? "k" : "e" + error, rank, world_size, broadcast), url);

  // 2. Every rank writes its data file locally and uploads it; rank 0 learns what each wrote.
  const std::string local = local_directory("save");
  dcp::RankWrite mine;
  error = outcome([&] {
    mine = dcp::write_rank_file(local, rank, state, placements);
    storage.write(join_storage_path(url, mine.file), local_storage().read(join_storage_path(local, mine.file)));
  });
  const std::vector<std::string> messages = gather_strings(
      error.empty() ? (rank == 0 ? "k" : "k" + mine.serialize()) : "e" + error, rank, world_size, broadcast);
  // 3. Rank 0 writes .metadata locally and uploads it last; everyone learns the outcome.
  error.clear();
  if (rank == 0 && std::none_of(messages.begin(), messages.end(), [](const std::string& m) { return m[0] == 'e'; })) {
    error = outcome([&] {
      std::vector<dcp::RankWrite> ranks{mine};
      for (int64_t r = 1; r < world_size; ++r)
        ranks.push_back(dcp::RankWrite::deserialize(std::string_view(messages[r]).substr(1)));
      // Data files of ranks a previous, larger run had would be read with the new metadata's
      // names only; they are removed so that the prefix holds one checkpoint.
      for (const StorageObject& object : storage.list(join_storage_path(url, ""))) {
        const std::string name = object.url.substr(url.size() + 1);
        const bool ours = name == kMetadata || std::any_of(ranks.begin(), ranks.end(),
                                                           [&](const dcp::RankWrite& w) { return w.file == name; });
        if (!ours) storage.remove(object.url);
      }
      dcp::write_metadata(local, ranks);
      storage.write(join_storage_path(url, kMetadata), local_storage().read(join_storage_path(local, kMetadata)));
    });
  }
  remove_tree(local);
  throw_first_failure(messages, url);
  throw_first_failure(gather_strings(error.empty() ? "k" : "e" + error, rank, world_size, broadcast), url);
}

SplitStorageSave::SplitStorageSave(const std::string& target, int64_t rank, int64_t world_size,
                                   const BroadcastString& broadcast)
    : url_(trimmed(target)), rank_(rank), world_size_(world_size) {
  std::string error = outcome([&] {
    if (rank == 0) storage_for(url_).remove(join_storage_path(url_, kMetadata));
    local_ = local_directory("save");
  });
  try {
    throw_first_failure(gather_strings(error.empty() ? "k" : "e" + error, rank, world_size, broadcast), url_);
  } catch (...) {
    if (!local_.empty()) remove_tree(local_);
    throw;
  }
}

SplitStorageSave::~SplitStorageSave() { remove_tree(local_); }

void SplitStorageSave::write(const c10::IValue& state, const std::map<std::string, dcp::Chunk>& placements) {
  mine_ = dcp::write_rank_file(local_, rank_, state, placements);
  storage_for(url_).write(join_storage_path(url_, mine_.file),
                          local_storage().read(join_storage_path(local_, mine_.file)));
}

void SplitStorageSave::finish(bool all_written, const BroadcastString& broadcast) {
  Storage& storage = storage_for(url_);
  if (!all_written) {
    // No .metadata: not a checkpoint. What some ranks uploaded goes too (best effort).
    if (rank_ == 0) {
      std::string ignored = outcome([&] {
        for (const StorageObject& object : storage.list(join_storage_path(url_, "")))
          if (object.url.find('/', url_.size() + 1) == std::string::npos) storage.remove(object.url);
      });
    }
    return;
  }
  const std::vector<std::string> messages =
      gather_strings(rank_ == 0 ? "k" : "k" + mine_.serialize(), rank_, world_size_, broadcast);
  std::string error;
  if (rank_ == 0) {
    error = outcome([&] {
      std::vector<dcp::RankWrite> ranks{mine_};
      for (int64_t r = 1; r < world_size_; ++r)
        ranks.push_back(dcp::RankWrite::deserialize(std::string_view(messages[r]).substr(1)));
      // As save_to_storage: data files of ranks a previous, larger run had are removed.
      for (const StorageObject& object : storage.list(join_storage_path(url_, ""))) {
        const std::string name = object.url.substr(url_.size() + 1);
        const bool ours = name == kMetadata || std::any_of(ranks.begin(), ranks.end(),
                                                           [&](const dcp::RankWrite& w) { return w.file == name; });
        if (!ours && name.find('/') == std::string::npos) storage.remove(object.url);
      }
      dcp::write_metadata(local_, ranks);
      storage.write(join_storage_path(url_, kMetadata), local_storage().read(join_storage_path(local_, kMetadata)));
    });
  }
  throw_first_failure(gather_strings(error.empty() ? "k" : "e" + error, rank_, world_size_, broadcast), url_);
}

bool is_stored_checkpoint(const std::string& url) {
  return storage_for(url).exists(join_storage_path(trimmed(url), kMetadata));
}

StagedCheckpoint::StagedCheckpoint(const std::string& target) : dir_(local_directory("load")) {
  const std::string url = trimmed(target);
  try {
    Storage& storage = storage_for(url);
    if (!storage.exists(join_storage_path(url, kMetadata)))
      throw Error(ErrorKind::checkpoint,
                  fmt::format("'{}' is not a complete sharded checkpoint: it has no {} (its save did not finish)", url,
                              kMetadata));
    for (const StorageObject& object : storage.list(join_storage_path(url, ""))) {
      const std::string name = object.url.substr(url.size() + 1);
      if (name.find('/') != std::string::npos) continue;  // not part of this checkpoint
      local_storage().write(join_storage_path(dir_, name), storage.read(object.url));
    }
  } catch (...) {
    remove_tree(dir_);
    throw;
  }
}

StagedCheckpoint::~StagedCheckpoint() { remove_tree(dir_); }

}  // namespace fulgur::fsdp
