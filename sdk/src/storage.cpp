// The storage registry (scheme -> Storage) and the built-in local storage. See storage.h.
#include <fulgur/checkpoint_io.h>
#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

namespace fulgur {

Storage::~Storage() = default;
void* Storage::extension(std::string_view) noexcept { return nullptr; }

namespace {

std::string os_reason(int error_number) { return std::system_category().message(error_number); }

[[noreturn]] void io_error(std::string_view what, const std::string& path, int error_number) {
  throw Error(ErrorKind::io, fmt::format("cannot {} '{}': {}", what, path, os_reason(error_number)));
}

int64_t mtime_ns(const struct stat& info) { return info.st_mtim.tv_sec * 1'000'000'000LL + info.st_mtim.tv_nsec; }

// POSIX files. Disk access goes through POSIX rather than std::filesystem (see
// plugins/callback/model_checkpoint: libtorch.so exports clashing copies of some of its functions).
class LocalStorage final : public Storage {
 public:
  void write(const std::string& url, std::string_view bytes) override { atomic_write_text(url, bytes); }

  std::string read(const std::string& url) override { return read_range(url, 0, UINT64_MAX); }

  std::string read_range(const std::string& url, uint64_t offset, uint64_t length) override {
    const int fd = ::open(url.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) io_error("read", url, errno);
    std::string out;
    char buffer[1 << 16];
    uint64_t at = offset;
    while (out.size() < length) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(sizeof(buffer), length - out.size()));
      const ssize_t got = ::pread(fd, buffer, want, static_cast<off_t>(at));
      if (got < 0) {
        if (errno == EINTR) continue;
        const int error_number = errno;
        ::close(fd);
        io_error("read", url, error_number);
      }
      if (got == 0) break;
      out.append(buffer, static_cast<size_t>(got));
      at += static_cast<uint64_t>(got);
    }
    ::close(fd);
    return out;
  }

  std::vector<StorageObject> list(const std::string& prefix) override {
    // The directory that holds everything starting with `prefix`: its part up to the last '/'.
    const size_t slash = prefix.rfind('/');
    const std::string top = slash == std::string::npos ? std::string(".") : prefix.substr(0, slash + 1);
    static thread_local std::vector<StorageObject>* found = nullptr;
    static thread_local const std::string* wanted = nullptr;
    std::vector<StorageObject> out;
    found = &out;
    wanted = &prefix;
    ::nftw(
        top.c_str(),
        [](const char* file, const struct stat* info, int type, FTW*) {
          const std::string path(file);
          if (type == FTW_F && path.starts_with(*wanted))
            found->push_back(StorageObject{path, static_cast<uint64_t>(info->st_size), mtime_ns(*info)});
          return 0;
        },
        16, FTW_PHYS);
    return out;
  }

  bool remove(const std::string& url) override {
    if (::unlink(url.c_str()) == 0) return true;
    if (errno == ENOENT) return false;
    io_error("remove", url, errno);
  }

  std::optional<StorageObject> stat(const std::string& url) override {
    struct stat info {};
    if (::stat(url.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) return std::nullopt;
    return StorageObject{url, static_cast<uint64_t>(info.st_size), mtime_ns(info)};
  }
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, StorageFactory, std::less<>> factories;
  std::map<std::string, std::shared_ptr<Storage>, std::less<>> created;
  std::function<void(std::string_view)> loader;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: storage may be used from exit handlers
  return *r;
}

bool scheme_char(char c, bool first) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return first ? alpha : alpha || (c >= '0' && c <= '9') || c == '+' || c == '-' || c == '.';
}

}  // namespace

std::string storage_scheme(std::string_view path) {
  const size_t colon = path.find("://");
  if (colon == std::string_view::npos || colon == 0) return {};
  for (size_t i = 0; i < colon; ++i)
    if (!scheme_char(path[i], i == 0)) return {};
  std::string scheme(path.substr(0, colon));
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return scheme == "file" ? std::string() : scheme;
}

bool is_storage_url(std::string_view path) { return !storage_scheme(path).empty(); }

void register_storage(std::string_view scheme, StorageFactory factory) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.factories.insert_or_assign(std::string(scheme), std::move(factory));
}

void set_storage_loader(std::function<void(std::string_view)> loader) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.loader = std::move(loader);
}

Storage& local_storage() {
  static LocalStorage* local = new LocalStorage();
  return *local;
}

Storage& storage_for(std::string_view path) {
  const std::string scheme = storage_scheme(path);
  if (scheme.empty()) return local_storage();
  Registry& r = registry();
  std::function<void(std::string_view)> loader;
  {
    std::lock_guard lock(r.mutex);
    if (auto it = r.created.find(scheme); it != r.created.end()) return *it->second;
    if (!r.factories.contains(scheme)) loader = r.loader;
  }
  // Outside the lock: loading a library runs its FULGUR_STORAGE_BACKEND, which registers.
  if (loader) loader(scheme);
  std::lock_guard lock(r.mutex);
  if (auto it = r.created.find(scheme); it != r.created.end()) return *it->second;
  auto factory = r.factories.find(scheme);
  if (factory == r.factories.end())
    throw Error(ErrorKind::config,
                fmt::format("'{}': no storage handles '{}://' URLs; the storage plugin '{}' is not in the plugin "
                            "search path (or this program installed no storage loader). Use a local path, or add "
                            "the directory holding that plugin with [plugins] paths or FULGUR_PLUGIN_PATH",
                            path, scheme, scheme));
  std::shared_ptr<Storage> storage = factory->second();
  Storage& out = *storage;
  r.created.emplace(scheme, std::move(storage));
  return out;
}

std::string join_storage_path(std::string_view base, std::string_view name) {
  std::string out(base);
  while (out.size() > 1 && out.back() == '/' && !out.ends_with("://")) out.pop_back();
  if (!out.empty() && out.back() != '/') out += '/';
  out += name;
  return out;
}

}  // namespace fulgur
