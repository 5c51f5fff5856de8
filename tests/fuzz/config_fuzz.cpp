// Fuzz target: a TOML config through parse_config and, when it parses, validate_plugins against
// the plugins on the search path (metadata only: FULGUR_PLUGIN_PATH and the install directory).
#include <fulgur/config.h>
#include <fulgur/error.h>
#include <fulgur/registry/registry.h>

#include <string_view>

#include "fuzz_targets.h"

namespace fulgur::fuzz {

int config(const uint8_t* data, size_t size) {
  static const PluginRegistry* registry = [] {
    RegistryOptions options;
    options.use_verdict_cache = false;
    return new PluginRegistry(plugin_search_path({}), options);
  }();
  try {
    Config parsed = parse_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.toml");
    validate_plugins(parsed, *registry);
  } catch (const Error&) {
  }
  return 0;
}

}  // namespace fulgur::fuzz

FULGUR_FUZZ_ENTRY(fulgur::fuzz::config)
