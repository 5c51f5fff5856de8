// The `s3` storage plugin: s3://bucket/key on AWS S3 or any S3-compatible store (MinIO, Ceph RGW,
// R2, GCS interoperability), through the libcurl client in s3_client.h. Configured the way the AWS
// tools are (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, credentials from the environment or
// ~/.aws/credentials; see ClientOptions::from_environment), and by the [storage] table's keys,
// which win over the environment.
#include <fulgur/error.h>
#include <fulgur/plugin.h>
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

// The [storage] keys over the environment's values: an empty string or a negative number keeps
// what the environment (or the AWS default) says.
ClientOptions client_options(const Options& o) {
  ClientOptions out = ClientOptions::from_environment();
  if (std::string endpoint = o.get_string("endpoint"); !endpoint.empty()) {
    if (!endpoint.starts_with("http://") && !endpoint.starts_with("https://"))
      throw Error(ErrorKind::config, fmt::format("[storage] endpoint = \"{}\" is not a URL: write http://host:port or "
                                                 "https://host (an S3-compatible server), or leave it empty for AWS",
                                                 endpoint));
    while (endpoint.back() == '/') endpoint.pop_back();
    out.endpoint = endpoint;
  }
  if (std::string region = o.get_string("region"); !region.empty()) out.region = region;
  if (std::string profile = o.get_string("profile"); !profile.empty()) out.profile = profile;
  if (std::string file = o.get_string("credentials_file"); !file.empty()) out.credentials_file = file;
  if (const int64_t mib = o.get_int("part_size_mb"); mib != 0) {
    if (mib < 5 || mib > 5120)
      throw Error(ErrorKind::config,
                  fmt::format("[storage] part_size_mb = {}: S3 parts are 5 to 5120 MiB; 0 keeps the default (64, or "
                              "FULGUR_S3_PART_SIZE)",
                              mib));
    out.part_size = static_cast<uint64_t>(mib) << 20;
  }
  if (const int64_t retries = o.get_int("max_retries"); retries >= 0) {
    if (retries > 100)
      throw Error(ErrorKind::config, fmt::format("[storage] max_retries = {}: at most 100 (the backoff caps at 5 s "
                                                 "per retry); -1 keeps the default (5, or FULGUR_S3_MAX_RETRIES)",
                                                 retries));
    out.max_retries = static_cast<int>(retries);
  }
  const int64_t connect = o.get_int("connect_timeout_s");
  const int64_t stall = o.get_int("stall_timeout_s");
  if (connect < 1 || stall < 1)
    throw Error(ErrorKind::config, fmt::format("[storage] connect_timeout_s = {} and stall_timeout_s = {}: both must "
                                               "be at least 1 second",
                                               connect, stall));
  out.connect_timeout_s = static_cast<long>(connect);
  out.stall_timeout_s = static_cast<long>(stall);
  return out;
}

class S3Storage final : public Storage {
 public:
  /// Reads the options now (bad values fail the run before it trains); the client, which reads the
  /// credentials, is made on first use.
  explicit S3Storage(const Options& options) : options_(client_options(options)) {}

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

  // Created on first use, not at load: reading the credentials may fail, and only a run that
  // touches s3:// should see that.
  Client& client() {
    std::call_once(once_, [this] { client_.emplace(options_); });
    return *client_;
  }

  ClientOptions options_;
  std::once_flag once_;
  std::optional<Client> client_;
};

}  // namespace
}  // namespace fulgur::s3

using S3Storage = fulgur::s3::S3Storage;
FULGUR_PLUGIN(S3Storage, "s3", "1.0.0",
              "s3://bucket/key on AWS S3 or an S3-compatible store (MinIO, Ceph, R2, GCS interoperability)",
              FULGUR_OPTION(string, endpoint,
                            "Server URL of an S3-compatible store (http://host:port); empty: AWS_ENDPOINT_URL_S3 / "
                            "AWS_ENDPOINT_URL, else AWS itself",
                            ""),
              FULGUR_OPTION(string, region, "Signing region; empty: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1",
                            ""),
              FULGUR_OPTION(string, profile,
                            "Section of the shared credentials file; empty: AWS_PROFILE, else default (used when "
                            "AWS_ACCESS_KEY_ID is not set)",
                            ""),
              FULGUR_OPTION(path, credentials_file,
                            "Shared credentials file; empty: AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials", ""),
              FULGUR_OPTION(integer, part_size_mb,
                            "Objects larger than this go up as a multipart upload of parts this size (5-5120 MiB); "
                            "0: FULGUR_S3_PART_SIZE, else 64",
                            0),
              FULGUR_OPTION(integer, max_retries,
                            "Retries after the first attempt on 5xx, 429 and transport errors, with backoff; -1: "
                            "FULGUR_S3_MAX_RETRIES, else 5",
                            -1),
              FULGUR_OPTION(integer, connect_timeout_s, "Seconds to wait for a connection before a retry", 10),
              FULGUR_OPTION(integer, stall_timeout_s,
                            "A transfer below 1 byte/s for this many seconds fails (and is retried)", 60))
