// Built-in logger `csv`: Lightning's CSVLogger layout, readable by pandas and by Lightning tools.
//
//   <save_dir>/<name>/version_<N>/metrics.csv   one row per log_metrics call; columns are the
//                                              sorted union of all keys seen, "step" included
//   <save_dir>/<name>/version_<N>/hparams.yaml  "key: value" per hyperparameter
//
// Rows are buffered and written every `flush_logs_every_n_steps` steps and on save()/finalize().
// When a row brings a key not in the header, the file is rewritten (atomically) with the wider
// header; cells of rows that lack a key stay empty. A save_dir URL (s3://bucket/prefix) stages the
// files under default_root_dir and uploads them whole after every flush (common/storage_mirror.h).
#include <fulgur/checkpoint_io.h>
#include <fulgur/csv.h>
#include <fulgur/plugin.h>
#include <fulgur/storage_root.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "../common/run_directory.h"
#include "../common/storage_mirror.h"

namespace fs = std::filesystem;

namespace {

constexpr const char* kMetricsFile = "metrics.csv";
constexpr const char* kHparamsFile = "hparams.yaml";
constexpr const char* kStepKey = "step";

[[noreturn]] void io_error(const std::string& message) { throw fulgur::Error(fulgur::ErrorKind::io, message); }

// Parses one CSV file written by this logger back into records (quoted fields may hold commas,
// quotes and newlines): fulgur::read_csv_record, record by record. Fields are written with
// fulgur::csv_field (RFC 4180 quoting, only when needed, as Python's csv module does it).
std::vector<std::vector<std::string>> parse_csv(const std::string& text) {
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> record;
  size_t pos = 0;
  while (pos < text.size()) {
    fulgur::read_csv_record(text, pos, ',', record);
    records.push_back(record);
  }
  return records;
}

// Shortest text that reads back as the same double ("0.1", "1e-05", "nan", "inf"), as Python's
// repr() writes floats into Lightning's CSV.
std::string format_value(double value) { return fmt::format("{}", value); }

// Hyperparameter values arrive as TOML value text; nearly all of it is valid YAML as is. The
// exceptions are TOML's special floats and inline tables.
std::string yaml_value(const std::string& toml) {
  if (toml == "inf" || toml == "+inf") return ".inf";
  if (toml == "-inf") return "-.inf";
  if (toml == "nan" || toml == "+nan" || toml == "-nan") return ".nan";
  if (!toml.empty() && toml.front() == '{') {
    // { a = 1, b = "x" } -> quoted as a string: YAML would misread the TOML '='.
    std::string quoted = "'";
    for (char c : toml) {
      if (c == '\'') quoted += '\'';
      quoted += c;
    }
    return quoted + "'";
  }
  return toml;
}

std::string yaml_key(const std::string& key) {
  const bool plain = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-' || c == '/';
  });
  if (plain && key.front() != '-') return key;
  std::string quoted = "'";
  for (char c : key) {
    if (c == '\'') quoted += '\'';
    quoted += c;
  }
  return quoted + "'";
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) io_error(fmt::format("logger 'csv': cannot read '{}': {}", path.string(), std::strerror(errno)));
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

class CsvLogger final : public fulgur::WithExtensions<fulgur::Logger, fulgur::LoggerStorageRoot> {
 public:
  // [trainer] default_root_dir = "s3://...": an empty save_dir means that URL (SDK 1.6).
  void set_root_url(const std::string& url) override {
    if (save_dir_.empty()) save_dir_ = url;
  }
  std::string remote_log_dir() const override { return mirror_.remote_dir(); }

  FULGUR_OPTIONS(Options,
                 (string, save_dir,
                  "Root directory; empty means the Trainer's default_root_dir; a URL (s3://bucket/prefix): files "
                  "staged under default_root_dir and uploaded on every flush",
                  ""),
                 (string, name, "Experiment name: the directory under save_dir", "lightning_logs"),
                 (integer, version, "Run version; -1 picks the next free version_N", -1),
                 (string, prefix, "Prepended to every metric name, joined with '-'", ""),
                 (integer, flush_logs_every_n_steps, "Write buffered rows to disk every N steps", 100));
  explicit CsvLogger(const Options& options)
      : save_dir_(options.save_dir),
        name_(options.name),
        version_(options.version),
        prefix_(options.prefix),
        flush_every_(options.flush_logs_every_n_steps) {
    options.check(flush_every_ >= 1, "flush_logs_every_n_steps", "must be at least 1");
    options.check(version_ >= -1, "version", "is not valid; use -1 for the next free version_N or a number >= 0");
  }

  ~CsvLogger() override {
    // A run that dies without finalize() should still leave its buffered rows on disk.
    try {
      flush_rows();
    } catch (const std::exception& e) {
      fulgur::log::error(fmt::format("logger 'csv': {}", e.what()));
    }
  }

  void setup(const fulgur::LoggerSetup& setup) override {
    writes_ = setup.global_rank == 0;
    if (log_dir_.empty()) {
      // A URL: staged locally under default_root_dir, uploaded on every flush (storage_mirror.h).
      const bool remote = fulgur::is_storage_url(save_dir_);
      const fs::path root = fs::path(save_dir_.empty() || remote ? setup.root_dir : save_dir_) / name_;
      const std::string remote_root = remote ? fulgur::join_storage_path(save_dir_, name_) : std::string();
      // Every rank computes the same path; only rank zero creates it.
      int64_t version = version_;
      if (version < 0) {
        version = fulgur::run_directory::next_free_version(root);
        if (remote) version = std::max(version, fulgur::run_directory::next_free_version_at(remote_root));
      }
      log_dir_ = (root / fmt::format("version_{}", version)).string();
      if (remote) mirror_.start(log_dir_, fulgur::join_storage_path(remote_root, fmt::format("version_{}", version)));
    }
    if (!writes_) return;
    prepare_directory();
  }

  void log_metrics(const fulgur::MetricMap& metrics, int64_t step) override {
    if (!writes_) return;
    Row row;
    row.step = step;
    for (const auto& [key, value] : metrics) {
      std::string name = prefix_.empty() ? key : prefix_ + "-" + key;
      if (name == kStepKey) continue;  // the step column comes from `step`, as in Lightning
      row.values.emplace(std::move(name), value);
    }
    pending_.push_back(std::move(row));
    if ((step + 1) % flush_every_ == 0) flush_rows();
  }

  void log_hyperparams(const std::map<std::string, std::string>& params) override {
    if (!writes_) return;
    for (const auto& [key, value] : params) hparams_[key] = value;
    write_hparams();
  }

  void save() override {
    if (writes_) flush_rows();
  }

  void finalize(fulgur::RunStatus) override { save(); }

  std::string log_dir() const override { return log_dir_; }

 private:
  struct Row {
    int64_t step = 0;
    std::map<std::string, double> values;
  };

  void prepare_directory() {
    std::error_code error;
    fs::create_directories(log_dir_, error);
    if (error)
      io_error(fmt::format("logger 'csv': cannot create the log directory '{}': {}; choose another save_dir", log_dir_,
                           error.message()));
    // Fail now rather than at the first flush, minutes into the run.
    const std::string probe = fmt::format("{}/.write-test-{}", log_dir_, ::getpid());
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
      io_error(fmt::format("logger 'csv': the log directory '{}' is not writable: {}; choose another save_dir",
                           log_dir_, std::strerror(errno)));
    ::close(fd);
    ::unlink(probe.c_str());

    if (!header_.empty()) return;  // a later stage of the same run: keep what is written
    const fs::path metrics = fs::path(log_dir_) / kMetricsFile;
    if (fs::exists(metrics, error)) {
      // Lightning does the same with an explicit version that was used before.
      fulgur::log::warn(
          fmt::format("logger 'csv': '{}' already holds logs; its metrics.csv is replaced by this run's", log_dir_));
      ::unlink(metrics.c_str());
    }
  }

  void flush_rows() {
    if (pending_.empty() || log_dir_.empty()) return;
    std::set<std::string> keys(header_.begin(), header_.end());
    keys.insert(kStepKey);
    for (const Row& row : pending_)
      for (const auto& [key, value] : row.values) keys.insert(key);
    std::vector<std::string> header(keys.begin(), keys.end());  // sorted, like Lightning's

    const fs::path path = fs::path(log_dir_) / kMetricsFile;
    if (header != header_ && !header_.empty()) {
      rewrite_with_header(path, header);
    } else if (header_.empty()) {
      atomic_write(path, header_line(header) + rows_text(header));
      header_ = std::move(header);
    } else {
      append(path, rows_text(header_));
    }
    pending_.clear();
    mirror_.upload("logger 'csv'", path.string());
  }

  // A new key widens the header: existing rows are re-laid out under it and the file replaced.
  void rewrite_with_header(const fs::path& path, const std::vector<std::string>& header) {
    std::string content = header_line(header);
    const std::vector<std::vector<std::string>> records = parse_csv(read_file(path));
    std::vector<size_t> new_position(header_.size());
    for (size_t i = 0; i < header_.size(); ++i)
      new_position[i] = static_cast<size_t>(std::find(header.begin(), header.end(), header_[i]) - header.begin());
    for (size_t r = 1; r < records.size(); ++r) {  // records[0] is the old header
      std::vector<std::string> cells(header.size());
      for (size_t i = 0; i < records[r].size() && i < header_.size(); ++i) cells[new_position[i]] = records[r][i];
      content += join_cells(cells);
    }
    content += rows_text(header);
    atomic_write(path, content);
    header_ = header;
  }

  std::string rows_text(const std::vector<std::string>& header) const {
    std::string text;
    std::vector<std::string> cells(header.size());
    for (const Row& row : pending_) {
      for (size_t i = 0; i < header.size(); ++i) {
        if (header[i] == kStepKey) {
          cells[i] = fmt::format("{}", row.step);
        } else {
          auto it = row.values.find(header[i]);
          cells[i] = it == row.values.end() ? std::string() : format_value(it->second);
        }
      }
      text += join_cells(cells);
    }
    return text;
  }

  static std::string join_cells(const std::vector<std::string>& cells) {
    std::string line;
    for (size_t i = 0; i < cells.size(); ++i) {
      if (i) line += ',';
      line += fulgur::csv_field(cells[i]);
    }
    return line + "\n";
  }

  static std::string header_line(const std::vector<std::string>& header) { return join_cells(header); }

  void atomic_write(const fs::path& path, const std::string& content) {
    try {
      fulgur::atomic_write_text(path.string(), content);
    } catch (const fulgur::Error& e) {
      io_error(fmt::format("logger 'csv': {}", e.what()));
    }
  }

  void append(const fs::path& path, const std::string& text) {
    std::FILE* file = std::fopen(path.c_str(), "ae");
    if (!file) io_error(fmt::format("logger 'csv': cannot append to '{}': {}", path.string(), std::strerror(errno)));
    const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
    const int write_errno = errno;
    const bool closed = std::fclose(file) == 0;
    if (!written || !closed)
      io_error(fmt::format("logger 'csv': writing '{}' failed: {}", path.string(),
                           std::strerror(written ? errno : write_errno)));
  }

  void write_hparams() {
    std::string content;
    for (const auto& [key, value] : hparams_)
      if (fulgur::run_directory::is_module_hparam(key))
        content += fmt::format("{}: {}\n", yaml_key(key), yaml_value(value));
    atomic_write(fs::path(log_dir_) / kHparamsFile, content);
    mirror_.upload("logger 'csv'", (fs::path(log_dir_) / kHparamsFile).string());
  }

  std::string save_dir_;
  std::string name_;
  int64_t version_;
  std::string prefix_;
  int64_t flush_every_;

  bool writes_ = false;
  std::string log_dir_;
  std::vector<std::string> header_;  // columns of metrics.csv as written; empty: no file yet
  std::vector<Row> pending_;
  std::map<std::string, std::string> hparams_;
  fulgur::run_directory::StorageMirror mirror_;  // save_dir on object storage
};

}  // namespace

FULGUR_PLUGIN(CsvLogger, "csv", "0.1.0", "Metrics to <save_dir>/<name>/version_N/metrics.csv (Lightning's CSVLogger)")
