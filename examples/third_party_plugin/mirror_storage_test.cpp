// The storage plugin's test, with the testing kit installed with Fulgur: the plugin is created
// from the library just built, through the door the Trainer uses, and put through the conformance
// check every storage plugin should pass.
#include <fulgur/testing/plugin_kit.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace kit = fulgur::testing;

int main() {
  const std::filesystem::path root = std::filesystem::temp_directory_path() / "fulgur-mirror-test";
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  try {
    auto storage = kit::create_plugin<fulgur::Storage>(fulgur::PluginKind::storage, "mirror", {{"root", root.string()}},
                                                       {MIRROR_STORAGE_DIR});
    kit::check_storage_conformance(storage, "mirror://bucket/");
    std::printf("ok: storage conformance\n");
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::filesystem::remove_all(root);
  return 0;
}
