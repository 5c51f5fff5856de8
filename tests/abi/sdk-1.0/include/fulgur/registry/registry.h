// The plugin registry: finds plugin libraries on the search path, reads and checks their
// metadata without running their code, and loads and instantiates only what a config selects.
#pragma once

#include <fulgur/error.h>
#include <fulgur/options.h>
#include <fulgur/registry/metadata.h>
#include <fulgur/suggest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur {

struct SearchDirectory {
  std::filesystem::path path;
  std::string origin;  // "config", "FULGUR_PLUGIN_PATH", "user", "install"
};

struct SearchPathOptions {
  std::vector<std::filesystem::path> config_paths;  // already resolved against the TOML's directory
  bool use_environment = true;                      // FULGUR_PLUGIN_PATH
  bool use_user_directory = true;                   // $XDG_DATA_HOME/fulgur/plugins
  bool use_install_directory = true;                // <dir of libfulgur_registry.so>/fulgur/plugins
};

// The search path in precedence order: config, FULGUR_PLUGIN_PATH, user dir, install dir.
std::vector<SearchDirectory> plugin_search_path(const SearchPathOptions& options);
std::filesystem::path install_plugin_directory();
std::filesystem::path user_plugin_directory();

enum class CandidateStatus { available, rejected, shadowed, ambiguous };
std::string_view to_string(CandidateStatus status);

struct PluginCandidate {
  std::filesystem::path file;
  size_t directory_index = 0;  // position of its directory in the search path
  PluginMetadata metadata;
  CandidateStatus status = CandidateStatus::available;
  ErrorKind error_kind = ErrorKind::plugin_rejected;  // when rejected
  std::string reason;                                 // why rejected / shadowed by what / ambiguous with what
};

// A file on the search path that is not a usable plugin library at all.
struct FileProblem {
  std::filesystem::path file;
  bool is_plugin_error = false;  // false: simply not a plugin (debug only); true: a broken plugin
  ErrorKind error_kind = ErrorKind::plugin_rejected;
  std::string reason;
};

struct RegistryOptions {
  // Accept plugin files and directories that other users can write to (code injection risk).
  bool allow_writable = false;
  // Refuse plugins that `fulgur plugins check` recorded as crashing, aborting or hanging
  // (verdict_cache_path()); the check's own child processes turn this off.
  bool use_verdict_cache = true;
};

// Names of the plugins that ship with Fulgur: a plugin from another directory may not take them.
bool is_reserved_builtin_name(PluginKind kind, std::string_view name);

// A created plugin object. It keeps its library loaded; destroying it runs the plugin's destroy.
using PluginObject = std::shared_ptr<void>;

class PluginRegistry {
 public:
  PluginRegistry(std::vector<SearchDirectory> search_path, RegistryOptions options = {});
  ~PluginRegistry();
  PluginRegistry(const PluginRegistry&) = delete;
  PluginRegistry& operator=(const PluginRegistry&) = delete;

  // Reads metadata of every candidate file (no plugin code runs). Called by the constructor.
  void scan();

  const std::vector<SearchDirectory>& search_path() const { return search_path_; }
  const std::vector<PluginCandidate>& candidates() const { return candidates_; }
  const std::vector<FileProblem>& problems() const { return problems_; }

  // The candidate a selection of (kind, name) resolves to; throws fulgur::Error:
  // plugin_not_found (with "did you mean" and the refused candidates), plugin_rejected,
  // plugin_ambiguous.
  const PluginCandidate& resolve(PluginKind kind, std::string_view name) const;

  // Loads the library (RTLD_NOW | RTLD_LOCAL), cross-checks its descriptor against the note and
  // calls its factory with `options`. Throws fulgur::Error (plugin_load / plugin_create / ...).
  PluginObject create(PluginKind kind, std::string_view name, const Options& options) const;
  // The same for one given candidate (for instance one that is shadowed or ambiguous), skipping
  // resolution: `fulgur plugins check` creates every plugin file this way.
  PluginObject create(const PluginCandidate& candidate, const Options& options) const;

  // Loads `candidate` and checks its descriptor, without creating anything.
  void load(const PluginCandidate& candidate) const;

 private:
  void apply_recorded_verdicts();

  std::vector<SearchDirectory> search_path_;
  RegistryOptions options_;
  std::vector<PluginCandidate> candidates_;
  std::vector<FileProblem> problems_;
};

// Typed view of a created object: `auto cb = plugin_cast<Callback>(registry.create(...))`.
template <class Interface>
std::shared_ptr<Interface> plugin_cast(const PluginObject& object) {
  return std::shared_ptr<Interface>(object, static_cast<Interface*>(object.get()));
}

// The options a plugin gets when nothing is configured for it: every schema default. Throws
// fulgur::Error(config) naming the first required key (which has no default).
Options default_options(const PluginMetadata& metadata);

}  // namespace fulgur
