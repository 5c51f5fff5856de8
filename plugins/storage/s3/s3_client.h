// A small S3 client over libcurl: requests signed with AWS Signature Version 4 by libcurl itself
// (CURLOPT_AWS_SIGV4), retried with exponential backoff on 5xx, 429 and transport failures.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulgur::s3 {

/// Access key, secret and (for temporary credentials) the session token.
struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  std::string source;  // where they came from, for messages ("environment", "~/.aws/credentials [default]")
};

/// Where and how to talk to the store. from_environment() reads the variables the AWS tools use.
struct ClientOptions {
  /// Empty: AWS (https://<bucket>.s3.<region>.amazonaws.com). Set: any S3-compatible server
  /// (MinIO, Ceph, R2, GCS interoperability, moto), addressed path-style: <endpoint>/<bucket>/<key>.
  std::string endpoint;
  std::string region = "us-east-1";
  std::string profile = "default";   ///< section of the shared credentials file
  std::string credentials_file;      ///< empty: ~/.aws/credentials
  uint64_t part_size = 64ull << 20;  ///< objects larger than this are sent as a multipart upload
  int max_retries = 5;               ///< attempts after the first, on 5xx/429/timeouts
  long connect_timeout_s = 10;
  long stall_timeout_s = 60;  ///< a transfer below 1 byte/s for this long fails (and is retried)

  /// AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, AWS_PROFILE,
  /// AWS_SHARED_CREDENTIALS_FILE, and Fulgur's FULGUR_S3_PART_SIZE (bytes, at least 5 MiB) and
  /// FULGUR_S3_MAX_RETRIES.
  static ClientOptions from_environment();
};

/// One object as ListObjectsV2 or HEAD describes it.
struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  int64_t modified_ns = 0;
};

class Client {
 public:
  explicit Client(ClientOptions options);

  void put(const std::string& bucket, const std::string& key, std::string_view bytes);
  std::string get(const std::string& bucket, const std::string& key,
                  std::optional<std::pair<uint64_t, uint64_t>> range);
  std::optional<ObjectInfo> head(const std::string& bucket, const std::string& key);
  std::vector<ObjectInfo> list(const std::string& bucket, const std::string& prefix);
  /// False when there was no such key (S3 itself answers 204 either way; a HEAD tells them apart).
  bool remove(const std::string& bucket, const std::string& key);

  const ClientOptions& options() const { return options_; }

 private:
  struct Request;
  struct Response;
  Response perform(const Request& request);
  Response send_once(const Request& request);
  [[noreturn]] void fail(std::string_view operation, const std::string& bucket, const std::string& key,
                         const Response& response);
  void put_multipart(const std::string& bucket, const std::string& key, std::string_view bytes);
  const Credentials& credentials();
  std::string url_of(const std::string& bucket, const std::string& key, const std::string& query) const;

  ClientOptions options_;
  std::optional<Credentials> credentials_;
};

/// Credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else from the
/// shared credentials file's profile. Throws fulgur::Error(io) saying where it looked.
Credentials resolve_credentials(const ClientOptions& options);

/// Percent-encodes `text` as SigV4 wants it (RFC 3986 unreserved kept; '/' kept when `keep_slash`).
std::string uri_encode(std::string_view text, bool keep_slash);

}  // namespace fulgur::s3
