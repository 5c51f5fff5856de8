// The plugin verdict cache: one tab-separated record per line, written atomically.
#include <fulgur/error.h>
#include <fulgur/registry/verdicts.h>

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace fulgur {

namespace fs = std::filesystem;

namespace {

constexpr const char* kHeader = "# fulgur plugin verdicts v1";

template <class T>
bool parse_number(std::string_view text, T& out) {
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && ptr == text.data() + text.size();
}

std::vector<std::string_view> split_tabs(std::string_view line) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= line.size(); ++i)
    if (i == line.size() || line[i] == '\t') {
      out.push_back(line.substr(start, i - start));
      start = i + 1;
    }
  return out;
}

std::string one_line(std::string_view text) {
  std::string out(text);
  std::replace_if(
      out.begin(), out.end(), [](char c) { return c == '\t' || c == '\n' || c == '\r'; }, ' ');
  return out;
}

std::optional<VerdictRecord> parse_record(std::string_view line) {
  auto f = split_tabs(line);
  if (f.size() != 10) return std::nullopt;
  VerdictRecord r;
  r.file = std::string(f[0]);
  uint32_t kind = 0;
  if (r.file.empty() || !parse_number(f[1], r.size) || !parse_number(f[2], r.mtime_ns) ||
      !parse_number(f[3], r.inode) || !parse_number(f[5], kind) || !is_valid_plugin_kind(kind) ||
      !parse_number(f[9], r.checked_at))
    return std::nullopt;
  auto [ptr, ec] = std::from_chars(f[4].data(), f[4].data() + f[4].size(), r.note_hash, 16);
  if (ec != std::errc() || ptr != f[4].data() + f[4].size()) return std::nullopt;
  r.kind = static_cast<PluginKind>(kind);
  r.name = std::string(f[6]);
  std::optional<Verdict> v = parse_verdict(f[7]);
  if (!v || r.name.empty()) return std::nullopt;
  r.verdict = *v;
  r.reason = std::string(f[8]);
  return r;
}

std::string format_record(const VerdictRecord& r) {
  return fmt::format("{}\t{}\t{}\t{}\t{:016x}\t{}\t{}\t{}\t{}\t{}\n", one_line(r.file), r.size, r.mtime_ns, r.inode,
                     r.note_hash, static_cast<uint32_t>(r.kind), one_line(r.name), to_string(r.verdict),
                     one_line(r.reason), r.checked_at);
}

bool same_plugin_in_same_path(const VerdictRecord& a, const VerdictRecord& b) {
  return a.file == b.file && a.kind == b.kind && a.name == b.name;
}

}  // namespace

std::string_view to_string(Verdict verdict) {
  switch (verdict) {
    case Verdict::ok:
      return "ok";
    case Verdict::error:
      return "error";
    case Verdict::crash:
      return "crash";
    case Verdict::abort:
      return "abort";
    case Verdict::hang:
      return "hang";
  }
  return "unknown";
}

std::optional<Verdict> parse_verdict(std::string_view text) {
  for (Verdict v : {Verdict::ok, Verdict::error, Verdict::crash, Verdict::abort, Verdict::hang})
    if (to_string(v) == text) return v;
  return std::nullopt;
}

bool verdict_refuses(Verdict verdict) {
  return verdict == Verdict::crash || verdict == Verdict::abort || verdict == Verdict::hang;
}

bool VerdictRecord::same_subject(const VerdictRecord& other) const {
  return same_plugin_in_same_path(*this, other) && size == other.size && mtime_ns == other.mtime_ns &&
         inode == other.inode && note_hash == other.note_hash;
}

fs::path verdict_cache_path() {
  if (const char* p = std::getenv("FULGUR_PLUGIN_CACHE"); p && *p) return p;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return fs::path(xdg) / "fulgur/plugin-verdicts";
  if (const char* home = std::getenv("HOME"); home && *home) return fs::path(home) / ".cache/fulgur/plugin-verdicts";
  return {};
}

std::optional<VerdictRecord> verdict_subject(const fs::path& file, const PluginMetadata& metadata) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return std::nullopt;
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(file, ec);
  VerdictRecord r;
  r.file = (ec ? file : canonical).string();
  r.size = static_cast<uint64_t>(st.st_size);
  r.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  r.inode = static_cast<uint64_t>(st.st_ino);
  r.note_hash = metadata.note_hash;
  r.kind = metadata.kind;
  r.name = metadata.name;
  return r;
}

std::vector<VerdictRecord> load_verdicts(const fs::path& cache) {
  std::vector<VerdictRecord> out;
  if (cache.empty()) return out;
  std::ifstream in(cache);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (auto r = parse_record(line)) out.push_back(std::move(*r));
  }
  return out;
}

const VerdictRecord* find_verdict(const std::vector<VerdictRecord>& records, const VerdictRecord& subject) {
  for (auto it = records.rbegin(); it != records.rend(); ++it)
    if (it->same_subject(subject)) return &*it;
  return nullptr;
}

void store_verdicts(const fs::path& cache, const std::vector<VerdictRecord>& updates) {
  if (cache.empty())
    throw Error(ErrorKind::io, "no place for the plugin verdict cache: set FULGUR_PLUGIN_CACHE or HOME");
  std::vector<VerdictRecord> records = load_verdicts(cache);
  for (const VerdictRecord& u : updates) {
    std::erase_if(records, [&](const VerdictRecord& r) { return same_plugin_in_same_path(r, u); });
    records.push_back(u);
  }
  std::error_code ec;
  if (cache.has_parent_path()) fs::create_directories(cache.parent_path(), ec);
  const fs::path tmp = cache.string() + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kHeader << "\n";
    for (const VerdictRecord& r : records) out << format_record(r);
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      throw Error(ErrorKind::io, fmt::format("cannot write the plugin verdict cache {}", tmp.string()));
    }
  }
  if (std::rename(tmp.c_str(), cache.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error(ErrorKind::io, fmt::format("cannot replace the plugin verdict cache {}", cache.string()));
  }
}

}  // namespace fulgur
