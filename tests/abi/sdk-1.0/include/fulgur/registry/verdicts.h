// Verdicts of `fulgur plugins check`: what happened when a plugin was loaded and created in a
// child process, cached per file like GStreamer's registry. A file is the same file while its
// path, size, mtime, inode and note hash are; any change invalidates its verdicts.
#pragma once

#include <fulgur/registry/metadata.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

enum class Verdict {
  ok,     // loaded and created (or loaded only, when an option has no default)
  error,  // failed cleanly with a message (load or create error): the run reports the same
  crash,  // killed by a signal other than SIGABRT
  abort,  // SIGABRT: abort(), a failed assert, an uncaught exception, std::terminate
  hang,   // did not finish within the timeout
};
std::string_view to_string(Verdict verdict);
std::optional<Verdict> parse_verdict(std::string_view text);
// crash, abort and hang: a run refuses the plugin instead of going down with it.
bool verdict_refuses(Verdict verdict);

struct VerdictRecord {
  std::string file;  // canonical path
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  uint64_t note_hash = 0;
  PluginKind kind = PluginKind::callback;
  std::string name;
  Verdict verdict = Verdict::ok;
  std::string reason;      // one line
  int64_t checked_at = 0;  // unix seconds

  // Same file, same plugin (identity fields only).
  bool same_subject(const VerdictRecord& other) const;
};

// $FULGUR_PLUGIN_CACHE, else $XDG_CACHE_HOME/fulgur/plugin-verdicts, else ~/.cache/fulgur/plugin-verdicts.
std::filesystem::path verdict_cache_path();

// The identity of `file` today for plugin `metadata` (verdict fields left empty); nullopt if the
// file cannot be stat'ed.
std::optional<VerdictRecord> verdict_subject(const std::filesystem::path& file, const PluginMetadata& metadata);

// Every well-formed record in `cache` (a missing or unreadable cache is empty; bad lines are skipped).
std::vector<VerdictRecord> load_verdicts(const std::filesystem::path& cache);

// The record for `subject` in `records` if one matches its identity exactly.
const VerdictRecord* find_verdict(const std::vector<VerdictRecord>& records, const VerdictRecord& subject);

// Replaces the records for the same (file, kind, name) by `updates` and writes the cache
// atomically (temporary file, rename). Throws fulgur::Error(io) when it cannot be written.
void store_verdicts(const std::filesystem::path& cache, const std::vector<VerdictRecord>& updates);

}  // namespace fulgur
