#include <fulgur/error.h>
#include <fulgur/registry/storage_loader.h>
#include <fulgur/storage.h>

#include <dlfcn.h>
#include <sys/stat.h>

#include <fmt/format.h>

#include <filesystem>
#include <string_view>

namespace fulgur {

void install_storage_loader(const std::vector<SearchDirectory>& search_path, bool allow_writable) {
  std::vector<std::filesystem::path> directories;
  for (const SearchDirectory& d : search_path) directories.push_back(d.path);
  set_storage_loader([directories, allow_writable](std::string_view scheme) {
    for (const std::filesystem::path& directory : directories) {
      const std::filesystem::path file = directory / fmt::format("libfulgur-storage-{}.so", scheme);
      struct stat info {};
      if (::stat(file.c_str(), &info) != 0) continue;
      if ((info.st_mode & S_IWOTH) && !allow_writable)
        throw Error(ErrorKind::plugin_rejected,
                    fmt::format("storage library {} is writable by everyone, so it is not loaded; chmod o-w it",
                                file.string()));
      if (::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr)
        throw Error(ErrorKind::plugin_rejected, fmt::format("cannot load storage library {} for {}:// URLs: {}",
                                                            file.string(), scheme, ::dlerror()));
      return;
    }
  });
}

}  // namespace fulgur
