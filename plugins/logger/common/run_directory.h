// Helpers shared by the built-in loggers: Lightning's version_N directory rules, the early
// "can this directory be written" check, and hparams.yaml rendering. Header-only on purpose: each
// logger is its own plugin library built against the SDK only, so there is no library to share.
#pragma once

#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>

#include "../../common/writable_directory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace fulgur::run_directory {

namespace fs = std::filesystem;

// The N of a "version_N" directory name, or -1.
inline int64_t version_number(const std::string& name) {
  if (name.rfind("version_", 0) != 0) return -1;
  const std::string digits = name.substr(8);
  if (digits.empty() || digits.size() > 15 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}

// The next free version under `root`: one more than the largest version_N there that holds
// anything. An empty version_N is free: another logger of the same run (csv next to tensorboard)
// may have just created it, and both should write into the same run directory, as in Lightning.
inline int64_t next_free_version(const fs::path& root) {
  std::error_code error;
  if (!fs::is_directory(root, error)) return 0;
  int64_t next = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, error)) {
    const int64_t n = version_number(entry.path().filename().string());
    if (n < 0 || !entry.is_directory(error)) continue;
    if (fs::is_empty(entry.path(), error) && !error) {
      next = std::max<int64_t>(next, n);  // reusable, but nothing above it is
      continue;
    }
    next = std::max<int64_t>(next, n + 1);
  }
  return next;
}

// A log directory that cannot be written fails when the run starts, not at the first flush.
inline void ensure_writable_directory(std::string_view owner, const std::string& dir) {
  filesystem_checks::ensure_writable_directory(owner, dir, "the log directory", "save_dir");
}

// Hyperparameter values arrive as TOML value text; nearly all of it is valid YAML as is. The
// exceptions are TOML's special floats and inline tables.
inline std::string yaml_quoted(std::string_view text) {
  std::string quoted = "'";
  for (char c : text) {
    if (c == '\'') quoted += '\'';
    quoted += c;
  }
  return quoted + "'";
}

inline std::string yaml_value(const std::string& toml) {
  if (toml == "inf" || toml == "+inf") return ".inf";
  if (toml == "-inf") return "-.inf";
  if (toml == "nan" || toml == "+nan" || toml == "-nan") return ".nan";
  // { a = 1 } would be misread by YAML (the '='): keep it as a string.
  if (!toml.empty() && toml.front() == '{') return yaml_quoted(toml);
  return toml;
}

inline std::string yaml_key(const std::string& key) {
  const bool plain = !key.empty() && key.front() != '-' && std::all_of(key.begin(), key.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-' || c == '/';
  });
  return plain ? key : yaml_quoted(key);
}

// Whether hparams.yaml holds `key`. Lightning's hparams.yaml holds the LightningModule's (and the
// LightningDataModule's) hyperparameters only; the Trainer sends every table, prefixed with its
// name, so the model's and the data's are "model." and "data." keys, and a key without a table
// (logged in code) is the user's own. The trainer's and the plugins' keys reach the loggers that
// keep parameters (TensorBoard's hparams view, MLflow's params); a run's whole configuration is
// its config.toml.
inline bool is_module_hparam(const std::string& key) {
  const size_t dot = key.find('.');
  return dot == std::string::npos || key.starts_with("model.") || key.starts_with("data.");
}

// "key: value" per line for the hyperparameters hparams.yaml holds (is_module_hparam).
inline std::string hparams_yaml(const std::map<std::string, std::string>& hparams) {
  std::string content;
  for (const auto& [key, value] : hparams)
    if (is_module_hparam(key)) content += fmt::format("{}: {}\n", yaml_key(key), yaml_value(value));
  return content;
}

// <dir>/hparams.yaml (hparams_yaml), written atomically.
inline void write_hparams_yaml(const std::string& dir, const std::map<std::string, std::string>& hparams) {
  atomic_write_text((fs::path(dir) / "hparams.yaml").string(), hparams_yaml(hparams));
}

}  // namespace fulgur::run_directory
