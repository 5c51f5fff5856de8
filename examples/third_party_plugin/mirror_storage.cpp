// A storage plugin (SDK 1.5) written as a third party would add `azure` or `hdfs`: it serves
// mirror://bucket/key URLs from a local directory, `root`/bucket/key. Selecting it takes a URL of its
// scheme anywhere a path goes (model_checkpoint dirpath, ckpt_path, ...) and, for its options, a
// [storage] table:
//
//   [storage]
//   name = "mirror"
//   root = "store"
#include <fulgur/plugin.h>

#include <filesystem>
#include <string_view>

class MirrorStorage final : public fulgur::Storage {
 public:
  explicit MirrorStorage(const fulgur::Options& options) : root_(options.get_string("root")) {
    if (root_.empty()) throw fulgur::Error(fulgur::ErrorKind::config, "mirror: set [storage] root to a directory");
  }
  // An object store has no directories: a key's "folders" exist once it is written.
  void write(const std::string& url, std::string_view bytes) override {
    const std::string file = path(url);
    std::filesystem::create_directories(std::filesystem::path(file).parent_path());
    local().write(file, bytes);
  }
  std::string read(const std::string& url) override { return local().read(path(url)); }
  std::string read_range(const std::string& url, uint64_t offset, uint64_t length) override {
    return local().read_range(path(url), offset, length);
  }
  std::vector<fulgur::StorageObject> list(const std::string& prefix) override {
    std::vector<fulgur::StorageObject> out = local().list(path(prefix));
    for (fulgur::StorageObject& o : out) o.url = std::string(kScheme) + o.url.substr(root_.size() + 1);
    return out;
  }
  bool remove(const std::string& url) override { return local().remove(path(url)); }
  std::optional<fulgur::StorageObject> stat(const std::string& url) override {
    std::optional<fulgur::StorageObject> info = local().stat(path(url));
    if (info) info->url = url;
    return info;
  }

 private:
  static constexpr std::string_view kScheme = "mirror://";
  static fulgur::Storage& local() { return fulgur::local_storage(); }
  std::string path(const std::string& url) const {
    if (!url.starts_with(kScheme))
      throw fulgur::Error(fulgur::ErrorKind::config, "mirror: not a mirror:// URL: " + url);
    return root_ + "/" + url.substr(kScheme.size());
  }
  std::string root_;
};

FULGUR_PLUGIN(MirrorStorage, "mirror", "1.0.0", "mirror://bucket/key as files below a local directory",
              FULGUR_REQUIRED_OPTION(path, root, "Directory that holds the buckets"))
