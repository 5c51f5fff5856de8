// Where plugins are looked for, in precedence order.
#include <fulgur/registry/registry.h>

#include <boost/dll/runtime_symbol_info.hpp>

#include <cstdlib>
#include <sstream>

namespace fulgur {

std::filesystem::path install_plugin_directory() {
  // The directory of this library (libfulgur_registry.so), so an installed tree and the build
  // tree both find their own built-in plugins in <libdir>/fulgur/plugins. Normalized because the
  // loader reports the path it found through RUNPATH ($ORIGIN/../lib gives ".../bin/../lib").
  return (std::filesystem::path(boost::dll::this_line_location().parent_path()) / "fulgur" / "plugins")
      .lexically_normal();
}

std::filesystem::path user_plugin_directory() {
  if (const char* data = std::getenv("XDG_DATA_HOME"); data && *data)
    return std::filesystem::path(data) / "fulgur/plugins";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::filesystem::path(home) / ".local/share/fulgur/plugins";
  return {};
}

std::vector<SearchDirectory> plugin_search_path(const SearchPathOptions& options) {
  std::vector<SearchDirectory> path;
  for (const auto& dir : options.config_paths) path.push_back({dir, "config"});
  if (options.use_environment) {
    if (const char* env = std::getenv("FULGUR_PLUGIN_PATH"); env && *env) {
      std::stringstream entries(env);
      std::string entry;
      while (std::getline(entries, entry, ':'))
        if (!entry.empty()) path.push_back({entry, "FULGUR_PLUGIN_PATH"});
    }
  }
  if (options.use_user_directory) {
    auto user = user_plugin_directory();
    if (!user.empty()) path.push_back({user, "user"});
  }
  if (options.use_install_directory) path.push_back({install_plugin_directory(), "install"});
  return path;
}

}  // namespace fulgur
