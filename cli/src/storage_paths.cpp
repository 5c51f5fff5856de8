#include "storage_paths.h"

#include <fulgur/config.h>
#include <fulgur/error.h>
#include <fulgur/registry/registry.h>
#include <fulgur/registry/storage_loader.h>
#include <fulgur/storage.h>

#include <stdlib.h>

#include <fmt/format.h>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

namespace fulgur::cli {

namespace {

namespace fs = std::filesystem;

std::string temporary_directory() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = fmt::format("{}/fulgur-cli-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (::mkdtemp(pattern.data()) == nullptr)
    throw Error(ErrorKind::io, fmt::format("cannot make a temporary directory {}: {}", pattern, std::strerror(errno)));
  return pattern;
}

std::string trimmed(std::string url) {
  while (url.ends_with('/') && !url.ends_with("://")) url.pop_back();
  return url;
}

// The last component of a URL ("model.safetensors"), which keeps the extension formats go by.
std::string base_name(const std::string& url) { return url.substr(url.rfind('/') + 1); }

void remove_tree(const std::string& path) {
  std::error_code ignored;
  if (!path.empty()) fs::remove_all(path, ignored);
}

}  // namespace

void configure_storage() {
  // As for fulgur fit without a config: the plugin search path, world-writable libraries refused.
  fulgur::install_storage_loader(plugin_search_path(SearchPathOptions{}), /*allow_writable=*/false);
}

void configure_storage(const Config& config, const PluginRegistry& registry) {
  std::optional<ConfiguredStorage> storage;
  if (config.storage) {
    // Only [storage] matters here: the file's model, loggers and callbacks need not be reachable.
    Config storage_only;
    storage_only.file = config.file;
    storage_only.plugin_paths = config.plugin_paths;
    storage_only.accelerator = config.accelerator;
    storage_only.strategy = config.strategy;
    storage_only.precision = config.precision;
    storage_only.storage = config.storage;
    validate_plugins(storage_only, registry);
    storage = ConfiguredStorage{storage_only.storage->name, storage_only.storage->options};
  }
  try {
    fulgur::install_storage_loader(registry.search_path(), config.allow_writable_plugins, storage);
  } catch (const Error& e) {
    if (!config.storage) throw;
    throw Error(e.kind(),
                fmt::format("{}: storage '{}': {}", config.storage->where.str(), config.storage->name, e.what()));
  }
}

LocalInput::LocalInput(const std::string& path_or_url) : local_(path_or_url) {
  if (!is_storage_url(path_or_url)) return;
  const std::string url = trimmed(path_or_url);
  Storage& storage = storage_for(url);
  temporary_ = temporary_directory();
  try {
    local_ = join_storage_path(temporary_, base_name(url));
    if (storage.exists(url)) {
      local_storage().write(local_, storage.read(url));
    } else if (storage.exists(join_storage_path(url, ".metadata"))) {
      // A sharded checkpoint: its top-level objects, as a DCP directory.
      fs::create_directories(local_);
      for (const StorageObject& object : storage.list(join_storage_path(url, ""))) {
        const std::string name = object.url.substr(url.size() + 1);
        if (name.find('/') == std::string::npos)
          local_storage().write(join_storage_path(local_, name), storage.read(object.url));
      }
    } else {
      throw Error(ErrorKind::io,
                  fmt::format("{}: no such object, nor a sharded checkpoint (no {}/.metadata)", url, url));
    }
  } catch (...) {
    remove_tree(temporary_);
    throw;
  }
}

LocalInput::~LocalInput() { remove_tree(temporary_); }

LocalOutput::LocalOutput(const std::string& path_or_url) : target_(path_or_url), local_(path_or_url) {
  if (!is_storage_url(path_or_url)) return;
  storage_for(path_or_url);  // an unknown scheme is refused before any work
  temporary_ = temporary_directory();
  local_ = join_storage_path(temporary_, base_name(trimmed(path_or_url)));
}

LocalOutput::~LocalOutput() { remove_tree(temporary_); }

void LocalOutput::publish() {
  if (temporary_.empty()) return;
  storage_for(target_).write(target_, local_storage().read(local_));
}

}  // namespace fulgur::cli
