// The `s3` storage: s3://bucket/key on AWS S3 or any S3-compatible store (MinIO, Ceph RGW, R2, GCS
// interoperability), through the libcurl client in s3_client.h. Configured the way the AWS tools
// are (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, credentials from the environment or
// ~/.aws/credentials); see ClientOptions::from_environment.
#include <fulgur/error.h>
#include <fulgur/storage.h>

#include <fmt/format.h>

#include <mutex>

#include "s3_client.h"

namespace fulgur::s3 {
namespace {

struct Location {
  std::string bucket;
  std::string key;
};

Location parse(const std::string& url) {
  constexpr std::string_view kScheme = "s3://";
  if (!url.starts_with(kScheme)) throw Error(ErrorKind::config, fmt::format("'{}' is not an s3:// URL", url));
  const std::string rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  Location l{rest.substr(0, slash), slash == std::string::npos ? std::string() : rest.substr(slash + 1)};
  if (l.bucket.empty())
    throw Error(ErrorKind::config, fmt::format("'{}' names no bucket; write s3://<bucket>/<key>", url));
  return l;
}

class S3Storage final : public Storage {
 public:
  void write(const std::string& url, std::string_view bytes) override {
    const Location l = object(url);
    client().put(l.bucket, l.key, bytes);
  }

  std::string read(const std::string& url) override {
    const Location l = object(url);
    return client().get(l.bucket, l.key, std::nullopt);
  }

  std::string read_range(const std::string& url, uint64_t offset, uint64_t length) override {
    const Location l = object(url);
    return client().get(l.bucket, l.key, std::pair{offset, length});
  }

  std::vector<StorageObject> list(const std::string& prefix) override {
    const Location l = parse(prefix);
    std::vector<StorageObject> out;
    for (const ObjectInfo& info : client().list(l.bucket, l.key))
      out.push_back(StorageObject{fmt::format("s3://{}/{}", l.bucket, info.key), info.size, info.modified_ns});
    return out;
  }

  bool remove(const std::string& url) override {
    const Location l = object(url);
    return client().remove(l.bucket, l.key);
  }

  std::optional<StorageObject> stat(const std::string& url) override {
    const Location l = parse(url);
    if (l.key.empty()) return std::nullopt;  // a bucket is not a file
    const std::optional<ObjectInfo> info = client().head(l.bucket, l.key);
    if (!info) return std::nullopt;
    return StorageObject{url, info->size, info->modified_ns};
  }

 private:
  static Location object(const std::string& url) {
    Location l = parse(url);
    if (l.key.empty() || l.key.back() == '/')
      throw Error(ErrorKind::config, fmt::format("'{}' names no object; write s3://<bucket>/<key>", url));
    return l;
  }

  // Created on first use, not at load: reading the environment and the credentials may fail,
  // and only a run that touches s3:// should see that.
  Client& client() {
    std::call_once(once_, [this] { client_.emplace(ClientOptions::from_environment()); });
    return *client_;
  }

  std::once_flag once_;
  std::optional<Client> client_;
};

}  // namespace
}  // namespace fulgur::s3

using S3Storage = fulgur::s3::S3Storage;
FULGUR_STORAGE_BACKEND(S3Storage, "s3")
