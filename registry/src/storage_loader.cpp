#include <fulgur/error.h>
#include <fulgur/registry/storage_loader.h>
#include <fulgur/storage.h>

#include <dlfcn.h>
#include <sys/stat.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string_view>

namespace fulgur {

namespace {

// The state the loader closure owns: the search path, scanned once on the first URL whose scheme
// nobody registered (a run that never names a URL pays nothing), and the configured plugin.
struct StorageLoader {
  std::vector<SearchDirectory> search_path;
  bool allow_writable = false;
  std::optional<ConfiguredStorage> configured;
  std::once_flag scanned;
  std::unique_ptr<PluginRegistry> registry;

  const PluginRegistry& plugins() {
    std::call_once(scanned, [this] {
      RegistryOptions options;
      options.allow_writable = allow_writable;
      registry = std::make_unique<PluginRegistry>(search_path, options);
    });
    return *registry;
  }

  bool has_plugin(std::string_view scheme) {
    for (const PluginCandidate& c : plugins().candidates())
      if (c.metadata.kind == PluginKind::storage && c.metadata.name == scheme) return true;
    return false;
  }

  // Creates the storage plugin `scheme` and registers it for its URLs.
  void register_plugin(std::string_view scheme) {
    const PluginRegistry& registry = plugins();
    const PluginCandidate& candidate = registry.resolve(PluginKind::storage, scheme);  // throws if refused
    const Options options =
        configured && configured->name == scheme ? configured->options : default_options(candidate.metadata);
    std::shared_ptr<Storage> storage = plugin_cast<Storage>(registry.create(PluginKind::storage, scheme, options));
    spdlog::debug("storage: {}:// URLs go to plugin '{}' ({})", scheme, scheme, candidate.file.string());
    register_storage(scheme, [storage] { return storage; });
  }

  // A library built with FULGUR_STORAGE_BACKEND before SDK 1.5: loading it registers the scheme.
  bool load_legacy_library(std::string_view scheme) {
    for (const SearchDirectory& directory : search_path) {
      const std::filesystem::path file = directory.path / fmt::format("libfulgur-storage-{}.so", scheme);
      struct stat info {};
      if (::stat(file.c_str(), &info) != 0) continue;
      if ((info.st_mode & S_IWOTH) && !allow_writable)
        throw Error(ErrorKind::plugin_rejected,
                    fmt::format("storage library {} is writable by everyone, so it is not loaded; chmod o-w it",
                                file.string()));
      if (::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr)
        throw Error(ErrorKind::plugin_rejected, fmt::format("cannot load storage library {} for {}:// URLs: {}",
                                                            file.string(), scheme, ::dlerror()));
      spdlog::warn(
          "storage: {}:// URLs go to {}, a library without plugin metadata (FULGUR_STORAGE_BACKEND); "
          "its ABI is not checked before it runs. Rebuild it with FULGUR_PLUGIN against SDK 1.5",
          scheme, file.string());
      return true;
    }
    return false;
  }

  void load(std::string_view scheme) {
    if (has_plugin(scheme)) return register_plugin(scheme);
    if (load_legacy_library(scheme)) return;
    std::vector<std::string> known;
    for (const PluginCandidate& c : plugins().candidates())
      if (c.metadata.kind == PluginKind::storage && c.status == CandidateStatus::available)
        known.push_back(c.metadata.name + "://");
    throw Error(
        ErrorKind::config,
        fmt::format("no storage plugin serves {}:// URLs: the plugin search path holds no storage plugin named "
                    "'{}' (storage plugins found: {}). Use a local path, or add the directory holding that "
                    "plugin with [plugins] paths or FULGUR_PLUGIN_PATH",
                    scheme, scheme, known.empty() ? std::string("none") : fmt::format("{}", fmt::join(known, ", "))));
  }
};

}  // namespace

void install_storage_loader(const std::vector<SearchDirectory>& search_path, bool allow_writable,
                            const std::optional<ConfiguredStorage>& configured) {
  auto loader = std::make_shared<StorageLoader>();
  loader->search_path = search_path;
  loader->allow_writable = allow_writable;
  loader->configured = configured;
  if (configured) loader->register_plugin(configured->name);
  set_storage_loader([loader](std::string_view scheme) { loader->load(scheme); });
}

}  // namespace fulgur
