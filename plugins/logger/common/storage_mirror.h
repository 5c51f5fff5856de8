// A logger's save_dir on object storage (save_dir = "s3://bucket/prefix", fulgur/storage.h).
// Object stores have no append and no directories, and the loggers append (metrics.csv, event
// files), so a logger whose save_dir is a URL writes its files as usual into a local staging
// directory, <default_root_dir>/<name>/version_N (which log_dir() names, so that profilers and
// finders that write into log_dir() keep working), and uploads each file whole, replacing the
// object, whenever it flushes it and at finalize: <save_dir>/<name>/version_N/<file>. Each upload
// is atomic (readers see the previous flush or this one); a file grows with the run, so an upload
// costs its whole size: flush_logs_every_n_steps / flush_secs bound how often. Rank zero only,
// like the writes. Header-only: each logger is its own plugin library (run_directory.h).
#pragma once

#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "run_directory.h"

namespace fulgur::run_directory {

// The next free version_N under the URL `root` (run_directory::next_free_version's rule, for
// object storage: a version holding any object is taken).
inline int64_t next_free_version_at(const std::string& root) {
  const std::string prefix = join_storage_path(root, "");
  int64_t next = 0;
  for (const StorageObject& object : storage_for(root).list(prefix)) {
    const std::string rest = object.url.substr(std::min(prefix.size(), object.url.size()));
    const int64_t n = version_number(rest.substr(0, rest.find('/')));
    if (n >= 0 && rest.find('/') != std::string::npos) next = std::max<int64_t>(next, n + 1);
  }
  return next;
}

class StorageMirror {
 public:
  // Files under `local_dir` go to the same relative place under the URL `remote_dir`.
  void start(std::string local_dir, std::string remote_dir) {
    local_dir_ = std::move(local_dir);
    remote_dir_ = std::move(remote_dir);
  }
  bool active() const { return !remote_dir_.empty(); }
  const std::string& remote_dir() const { return remote_dir_; }

  // Uploads `local_file` (below the staging directory) whole; throws fulgur::Error(io) naming
  // `owner` ("logger 'csv'"), the file, the URL and why (the storage's message says bucket, key,
  // status and the fix).
  void upload(std::string_view owner, const std::string& local_file) const {
    if (!active()) return;
    const std::filesystem::path relative = std::filesystem::path(local_file).lexically_relative(local_dir_);
    const std::string url = join_storage_path(remote_dir_, relative.generic_string());
    std::ifstream in(local_file, std::ios::binary);
    if (!in)
      throw Error(ErrorKind::io, fmt::format("{}: cannot read '{}' to upload it to {}: {}", owner, local_file, url,
                                             std::strerror(errno)));
    std::ostringstream bytes;
    bytes << in.rdbuf();
    try {
      storage_for(url).write(url, bytes.str());
    } catch (const Error& e) {
      throw Error(ErrorKind::io, fmt::format("{}: uploading '{}' to {} failed: {}", owner, local_file, url, e.what()));
    }
  }

 private:
  std::string local_dir_, remote_dir_;
};

}  // namespace fulgur::run_directory
