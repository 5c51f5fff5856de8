#include "dcp_storage.h"

#include <fulgur/error.h>
#include <fulgur/log.h>
#include <fulgur/storage.h>

#include <fmt/format.h>

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

// Step 1 of a save, on rank 0: the tag of this save's data files. A fresh prefix gets DCP's own
// names (__<rank>_0.distcp, as torch writes them). A prefix that holds a checkpoint (last.ckpt,
// saved again) gets names of their own, __<rank>_0.<tag>.distcp: the old .metadata names the old
// files, so the old checkpoint stays whole until the new .metadata replaces it in one PUT, and a
// process killed in between leaves it readable.
std::string data_file_tag(Storage& storage, const std::string& url) {
  if (!storage.exists(join_storage_path(url, kMetadata))) return {};
  return fmt::format("{:x}", std::chrono::system_clock::now().time_since_epoch().count());
}

// `file` (DCP's "__<rank>_0.distcp") with `tag` before its extension.
std::string tagged(const std::string& file, const std::string& tag) {
  if (tag.empty()) return file;
  const size_t dot = file.rfind('.');
  return file.substr(0, dot) + "." + tag + file.substr(dot);
}

// `fn(name, object_url)` for every object directly below `url` (a checkpoint's files; deeper
// objects belong to other checkpoints).
template <class Fn>
void for_each_file(Storage& storage, const std::string& url, Fn&& fn) {
  for (const StorageObject& object : storage.list(join_storage_path(url, ""))) {
    const std::string name = object.url.substr(url.size() + 1);
    if (name.find('/') == std::string::npos) fn(name, object.url);
  }
}

// Rank 0, once the new .metadata is in place: every file directly below `url` that it does not
// name (the replaced checkpoint's files, or those of a save killed before its .metadata) goes.
// The checkpoint is complete already, so a failure here only warns: the next save retries.
void remove_unnamed(Storage& storage, const std::string& url, const std::vector<dcp::RankWrite>& ranks) {
  const std::string error = outcome([&] {
    for_each_file(storage, url, [&](const std::string& name, const std::string& object) {
      const bool ours = name == kMetadata || std::any_of(ranks.begin(), ranks.end(),
                                                         [&](const dcp::RankWrite& w) { return w.file == name; });
      if (!ours) storage.remove(object);
    });
  });
  if (!error.empty())
    log::warn(
        fmt::format("sharded checkpoint '{}' is complete, but files it replaced could not be removed: {}", url, error));
}

// Writes this rank's data file into `local` and uploads it to `url` under its tagged name, which
// the returned record carries (the name .metadata gives it).
dcp::RankWrite write_and_upload(const std::string& local, const std::string& url, const std::string& tag, int64_t rank,
                                const c10::IValue& state, const std::map<std::string, dcp::Chunk>& placements) {
  dcp::RankWrite mine = dcp::write_rank_file(local, rank, state, placements);
  const std::string written = mine.file;
  mine.file = tagged(written, tag);
  storage_for(url).write(join_storage_path(url, mine.file), local_storage().read(join_storage_path(local, written)));
  return mine;
}

void throw_first_failure(const std::vector<std::string>& messages, const std::string& url) {
  for (size_t r = 0; r < messages.size(); ++r)
    if (!messages[r].empty() && messages[r][0] == 'e')
      throw Error(ErrorKind::checkpoint, fmt::format("saving sharded checkpoint '{}' failed on rank {}: {}", url, r,
                                                     std::string_view(messages[r]).substr(1)));
}

// Rank 0, after a failed save: the data files it uploaded go (best effort, never throws). With a
// tag they are told by it, and a previous checkpoint at `url` keeps its own; without, the prefix
// held no checkpoint and is left empty.
void remove_failed_save(Storage& storage, const std::string& url, const std::string& tag) {
  std::string ignored = outcome([&] {
    for_each_file(storage, url, [&](const std::string& name, const std::string& object) {
      if (tag.empty() ? name != kMetadata : name.find("." + tag + ".") != std::string::npos) storage.remove(object);
    });
  });
}

// Step 1, on every rank: rank 0's tag (or its error, `error`), learned by all; throws
// fulgur::Error(checkpoint) on every rank when rank 0 failed.
std::string agree_on_tag(const std::string& tag, const std::string& error, const std::string& url, int64_t rank,
                         int64_t world_size, const BroadcastString& broadcast) {
  const std::vector<std::string> started =
      gather_strings(error.empty() ? "k" + tag : "e" + error, rank, world_size, broadcast);
  throw_first_failure(started, url);
  return started[0].substr(1);
}

// Step 3, rank 0 once every rank's write succeeded: .metadata for them all (`messages` holds each
// other rank's serialized RankWrite), written in `local`, uploaded last in one PUT (replacing a
// previous checkpoint's), then the files it does not name go. Returns the error, empty on success.
std::string publish_metadata(Storage& storage, const std::string& url, const std::string& local,
                             const dcp::RankWrite& mine, const std::vector<std::string>& messages) {
  return outcome([&] {
    std::vector<dcp::RankWrite> ranks{mine};
    for (size_t r = 1; r < messages.size(); ++r)
      ranks.push_back(dcp::RankWrite::deserialize(std::string_view(messages[r]).substr(1)));
    dcp::write_metadata(local, ranks);
    storage.write(join_storage_path(url, kMetadata), local_storage().read(join_storage_path(local, kMetadata)));
    remove_unnamed(storage, url, ranks);
  });
}

}  // namespace

void save_to_storage(const std::string& target, const c10::IValue& state,
                     const std::map<std::string, dcp::Chunk>& placements, int64_t rank, int64_t world_size,
                     const BroadcastString& broadcast) {
  const std::string url = trimmed(target);
  Storage& storage = storage_for(url);
  // 1. Rank 0 tags this save's data files (data_file_tag); everyone learns the tag.
  std::string tag;
  std::string error = rank == 0 ? outcome([&] { tag = data_file_tag(storage, url); }) : std::string();
  tag = agree_on_tag(tag, error, url, rank, world_size, broadcast);

  // 2. Every rank writes its data file locally and uploads it; rank 0 learns what each wrote.
  const std::string local = local_directory("save");
  dcp::RankWrite mine;
  error = outcome([&] { mine = write_and_upload(local, url, tag, rank, state, placements); });
  const std::vector<std::string> messages = gather_strings(
      error.empty() ? (rank == 0 ? "k" : "k" + mine.serialize()) : "e" + error, rank, world_size, broadcast);
  // 3. Rank 0 writes .metadata locally and uploads it last (replacing a previous checkpoint's in
  // one PUT), then removes the files it does not name; everyone learns the outcome.
  const bool all_written =
      std::none_of(messages.begin(), messages.end(), [](const std::string& m) { return m[0] == 'e'; });
  error.clear();
  if (rank == 0) {
    if (all_written)
      error = publish_metadata(storage, url, local, mine, messages);
    else
      remove_failed_save(storage, url, tag);
  }
  remove_tree(local);
  throw_first_failure(messages, url);
  throw_first_failure(gather_strings(error.empty() ? "k" : "e" + error, rank, world_size, broadcast), url);
}

SplitStorageSave::SplitStorageSave(const std::string& target, int64_t rank, int64_t world_size,
                                   const BroadcastString& broadcast)
    : url_(trimmed(target)), rank_(rank), world_size_(world_size) {
  std::string error = outcome([&] {
    if (rank == 0) tag_ = data_file_tag(storage_for(url_), url_);
    local_ = local_directory("save");
  });
  try {
    tag_ = agree_on_tag(tag_, error, url_, rank, world_size, broadcast);
  } catch (...) {
    if (!local_.empty()) remove_tree(local_);
    throw;
  }
}

SplitStorageSave::~SplitStorageSave() { remove_tree(local_); }

void SplitStorageSave::write(const c10::IValue& state, const std::map<std::string, dcp::Chunk>& placements) {
  mine_ = write_and_upload(local_, url_, tag_, rank_, state, placements);
}

void SplitStorageSave::finish(bool all_written, const BroadcastString& broadcast) {
  Storage& storage = storage_for(url_);
  if (!all_written) {
    // No new .metadata: what this save uploaded goes; a checkpoint that was at `url` stays.
    if (rank_ == 0) remove_failed_save(storage, url_, tag_);
    return;
  }
  const std::vector<std::string> messages =
      gather_strings(rank_ == 0 ? "k" : "k" + mine_.serialize(), rank_, world_size_, broadcast);
  const std::string error = rank_ == 0 ? publish_metadata(storage, url_, local_, mine_, messages) : std::string();
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
    for_each_file(storage, url, [&](const std::string& name, const std::string& object) {
      local_storage().write(join_storage_path(dir_, name), storage.read(object));
    });
  } catch (...) {
    remove_tree(dir_);
    throw;
  }
}

StagedCheckpoint::~StagedCheckpoint() { remove_tree(dir_); }

}  // namespace fulgur::fsdp
