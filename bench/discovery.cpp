// bench_discovery: what plugin discovery costs at startup. Copies one built plugin N times into a
// temporary directory and times PluginRegistry construction over it (directory listing, ELF
// header and note reading, checks; no plugin code runs), side by side with what reading the same
// facts by loading would cost: dlopen(RTLD_NOW) + dlsym of the entry point + dlclose per file.
//
//   bench_discovery [--plugin FILE] [--files N] [--runs R]
#include <fulgur/registry/registry.h>

#include <dlfcn.h>
#include <ftw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// A private 0755 directory holding `count` copies of `plugin`.
fs::path make_copies(const fs::path& root, const std::string& name, const fs::path& plugin, int count) {
  fs::path dir = root / name;
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms(0755));
  for (int i = 0; i < count; ++i) {
    char file[64];
    std::snprintf(file, sizeof(file), "libfulgur-bench-%03d.so", i);
    fs::copy_file(plugin, dir / file);
    fs::permissions(dir / file, fs::perms(0755));
  }
  return dir;
}

// Not std::filesystem::remove_all: libtorch.so (loaded with the registry) exports a copy built
// against libstdc++ 13 that jumps to a null weak symbol with Debian 12's libstdc++.
void remove_tree(const fs::path& dir) {
  ::nftw(
      dir.c_str(), [](const char* file, const struct stat*, int, FTW*) { return std::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

}  // namespace

int main(int argc, char** argv) {
  fs::path plugin = FULGUR_BENCH_PLUGIN;
  int files = 100, runs = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--plugin")
      plugin = argv[i + 1];
    else if (flag == "--files")
      files = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--runs")
      runs = std::max(1, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "usage: bench_discovery [--plugin FILE] [--files N] [--runs R]\n");
      return 2;
    }
  }

  std::string pattern = (fs::temp_directory_path() / "fulgur-bench-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::perror("bench_discovery: mkdtemp");
    return 1;
  }
  const fs::path root = pattern;
  fs::permissions(root, fs::perms(0755));

  // Discovery: the same directory every run (the files are in the page cache after the copy, as
  // installed plugins are after the first start).
  const fs::path scanned = make_copies(root, "scan", plugin, files);
  std::vector<double> scan_ms;
  size_t candidates = 0;
  for (int r = 0; r <= runs; ++r) {  // run 0 warms up and is not counted
    const auto start = Clock::now();
    fulgur::PluginRegistry registry({{scanned, "config"}});
    const double ms = ms_since(start);
    candidates = registry.candidates().size();
    if (r > 0) scan_ms.push_back(ms);
  }
  if (candidates != static_cast<size_t>(files)) {
    std::fprintf(stderr, "bench_discovery: expected %d candidates, the registry found %zu\n", files, candidates);
    return 1;
  }

  // Loading instead: fresh copies each run, since a second dlopen of a loaded file costs nothing.
  std::vector<double> load_ms;
  for (int r = 0; r < runs; ++r) {
    const fs::path dir = make_copies(root, "load" + std::to_string(r), plugin, files);
    const auto start = Clock::now();
    for (const auto& entry : fs::directory_iterator(dir)) {
      void* handle = ::dlopen(entry.path().c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!handle || !::dlsym(handle, FULGUR_PLUGIN_QUERY_SYMBOL)) {
        std::fprintf(stderr, "bench_discovery: cannot load %s: %s\n", entry.path().c_str(), ::dlerror());
        return 1;
      }
      ::dlclose(handle);
    }
    load_ms.push_back(ms_since(start));
  }
  remove_tree(root);

  const double scan = median(scan_ms), load = median(load_ms);
  std::printf("plugin discovery over %d copies of %s (%.0f KiB), median of %d runs\n", files, plugin.filename().c_str(),
              static_cast<double>(fs::file_size(plugin)) / 1024.0, runs);
  std::printf("  registry scan (ELF notes, no dlopen): %8.3f ms per scan, %8.1f us per file\n", scan,
              scan * 1000.0 / files);
  std::printf("  dlopen + dlsym + dlclose instead:    %8.3f ms per scan, %8.1f us per file\n", load,
              load * 1000.0 / files);
  std::printf("  ratio load / scan: %.1fx\n", load / scan);
  return 0;
}
