// S3 over libcurl. libcurl (>= 7.75) signs requests with SigV4 itself (CURLOPT_AWS_SIGV4); what it
// leaves to the caller, learnt against a signature-checking server (capability-notes §6):
//   - every request sends x-amz-content-sha256 (UNSIGNED-PAYLOAD here), which curl then signs;
//   - uploads send Content-Type: application/octet-stream (else a body may be read as a form);
//   - curl 7.88 signs the query string as given, so queries are built already sorted and encoded;
//   - curl 7.88 also signs a header blanked with "Name:" (which it does not send): none is used.
#include "s3_client.h"

#include <fulgur/error.h>

#include <curl/curl.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

namespace fulgur::s3 {

struct Client::Request {
  std::string method = "GET";  // GET, PUT, POST, HEAD, DELETE
  std::string bucket;
  std::string key;
  std::string query;  // sorted, encoded "a=1&b=2"
  std::string_view body;
  std::vector<std::string> headers;
};

struct Client::Response {
  CURLcode code = CURLE_OK;
  std::string transport_error;
  long status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
};

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : std::string();
}

std::string trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(" \t\r\n");
  return std::string(s.substr(b, e - b + 1));
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The text of the first <tag>...</tag> in `xml` (S3's answers are simple, unnested where read).
std::string xml_value(std::string_view xml, std::string_view tag, size_t* from = nullptr) {
  const std::string open = fmt::format("<{}>", tag), close = fmt::format("</{}>", tag);
  const size_t start = xml.find(open, from ? *from : 0);
  if (start == std::string_view::npos) return {};
  const size_t end = xml.find(close, start + open.size());
  if (end == std::string_view::npos) return {};
  if (from) *from = end + close.size();
  std::string value(xml.substr(start + open.size(), end - start - open.size()));
  // The five XML entities; keys with other characters come back as they were sent.
  for (auto [entity, c] : {std::pair{"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}})
    for (size_t at = value.find(entity); at != std::string::npos; at = value.find(entity, at + 1))
      value.replace(at, std::strlen(entity), 1, c);
  return value;
}

// "2026-12-05T14:33:02.000Z" (ListObjectsV2) to nanoseconds since the epoch.
int64_t iso8601_ns(const std::string& text) {
  std::tm tm{};
  int ms = 0;
  if (std::sscanf(text.c_str(), "%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min,
                  &tm.tm_sec, &ms) < 6)
    return 0;
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return static_cast<int64_t>(timegm(&tm)) * 1'000'000'000LL + static_cast<int64_t>(ms) * 1'000'000LL;
}

// What to do about an S3 error code: the fix the message ends with.
std::string fix_for(const std::string& code, long status, const ClientOptions& options, const Credentials* creds,
                    const std::string& bucket) {
  const std::string from = creds ? fmt::format(" (they came from {})", creds->source) : std::string();
  if (code == "InvalidAccessKeyId")
    return fmt::format(
        "the access key id is unknown to the server: check AWS_ACCESS_KEY_ID or the profile in the "
        "shared credentials file{}",
        from);
  if (code == "SignatureDoesNotMatch")
    return fmt::format(
        "the secret access key does not belong to the access key id{}: check AWS_SECRET_ACCESS_KEY "
        "(or the profile), and that region '{}' is the bucket's (AWS_REGION)",
        from, options.region);
  if (code == "NoSuchBucket") return fmt::format("create bucket '{}' first, or correct the bucket in the URL", bucket);
  if (code == "ExpiredToken" || code == "InvalidToken" || code == "TokenRefreshRequired")
    return "the session token is expired or invalid: refresh AWS_SESSION_TOKEN (with the key id and secret it came "
           "with)";
  if (code == "AccessDenied" || status == 403)
    return fmt::format(
        "the credentials{} have no permission for this: grant s3:GetObject, s3:PutObject, "
        "s3:DeleteObject and s3:ListBucket on arn:aws:s3:::{} and arn:aws:s3:::{}/*",
        from, bucket, bucket);
  if (code == "PermanentRedirect" || code == "AuthorizationHeaderMalformed")
    return "the bucket lives in another region: set AWS_REGION to the bucket's region";
  if (status >= 500) return "the server kept failing after retries; try again later";
  return "check the bucket, key and credentials";
}

size_t collect_body(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

size_t collect_header(char* data, size_t size, size_t n, void* out) {
  const std::string_view line(data, size * n);
  if (const size_t colon = line.find(':'); colon != std::string_view::npos)
    (*static_cast<std::map<std::string, std::string>*>(out))[lower(std::string(line.substr(0, colon)))] =
        trim(line.substr(colon + 1));
  return size * n;
}

// Test-only fault injection (compiled in with FULGUR_FAULT_INJECTION, as the SDK's
// checkpoint_write seam): FULGUR_FAULT_INJECT = "s3_upload:N" kills this process with SIGKILL
// once half of the body of its N-th object upload (1-based) has gone to the server, so that
// tests/storage_test.cpp can show that an upload cut short leaves no object behind;
// "s3_upload:N:TEXT" counts only the uploads whose key contains TEXT (each rank of a sharded save
// killed while it replaces its own data file, say).
struct UploadToKill {
  long n = 0;
  std::string key_part;
};

const UploadToKill& upload_to_kill() {
  static const UploadToKill kill = [] {
    UploadToKill k;
#if defined(FULGUR_FAULT_INJECTION)
    const char* spec = std::getenv("FULGUR_FAULT_INJECT");
    int consumed = 0;
    if (spec && std::sscanf(spec, "s3_upload:%ld%n", &k.n, &consumed) == 1 && spec[consumed] == ':')
      k.key_part = spec + consumed + 1;
#endif
    return k;
  }();
  return kill;
}

std::atomic<long> uploads_started{0};

struct Upload {
  std::string_view body;
  size_t at = 0;
  bool doomed = false;  // the upload the fault injection kills
};

size_t send_body(char* buffer, size_t size, size_t n, void* in) {
  auto* upload = static_cast<Upload*>(in);
  if (upload->doomed && upload->at >= upload->body.size() / 2) ::raise(SIGKILL);
  const size_t count = std::min(size * n, upload->body.size() - upload->at);
  std::memcpy(buffer, upload->body.data() + upload->at, count);
  upload->at += count;
  return count;
}

bool transient(const CURLcode code) {
  switch (code) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_COULDNT_RESOLVE_HOST:
      return true;
    default:
      return false;
  }
}

void global_init() {
  static const bool done = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
  (void)done;
}

}  // namespace

std::string uri_encode(std::string_view text, bool keep_slash) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/'))
      out += static_cast<char>(c);
    else
      out += fmt::format("%{:02X}", c);
  }
  return out;
}

ClientOptions ClientOptions::from_environment() {
  ClientOptions o;
  o.endpoint = env("AWS_ENDPOINT_URL_S3");
  if (o.endpoint.empty()) o.endpoint = env("AWS_ENDPOINT_URL");
  while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  if (std::string r = env("AWS_REGION"); !r.empty())
    o.region = r;
  else if (std::string d = env("AWS_DEFAULT_REGION"); !d.empty())
    o.region = d;
  if (std::string p = env("AWS_PROFILE"); !p.empty()) o.profile = p;
  o.credentials_file = env("AWS_SHARED_CREDENTIALS_FILE");
  if (std::string s = env("FULGUR_S3_PART_SIZE"); !s.empty()) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
    if (end == s.c_str() || *end != '\0' || v < (5ull << 20))
      throw Error(ErrorKind::config,
                  fmt::format("FULGUR_S3_PART_SIZE = '{}' is not valid: give a number of bytes of at least 5242880 "
                              "(5 MiB, S3's smallest part)",
                              s));
    o.part_size = v;
  }
  if (std::string s = env("FULGUR_S3_MAX_RETRIES"); !s.empty()) o.max_retries = std::max(0, std::atoi(s.c_str()));
  return o;
}

Credentials resolve_credentials(const ClientOptions& options) {
  Credentials c;
  c.access_key_id = env("AWS_ACCESS_KEY_ID");
  c.secret_access_key = env("AWS_SECRET_ACCESS_KEY");
  c.session_token = env("AWS_SESSION_TOKEN");
  if (!c.access_key_id.empty() && !c.secret_access_key.empty()) {
    c.source = "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)";
    return c;
  }
  std::string file = options.credentials_file;
  if (file.empty()) file = env("HOME") + "/.aws/credentials";
  std::ifstream in(file);
  std::string line, section;
  c = Credentials{};
  bool found = false;
  while (std::getline(in, line)) {
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[' && t.back() == ']') {
      section = trim(std::string_view(t).substr(1, t.size() - 2));
      continue;
    }
    if (section != options.profile) continue;
    const size_t eq = t.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = lower(trim(std::string_view(t).substr(0, eq))),
                      value = trim(std::string_view(t).substr(eq + 1));
    found = true;
    if (key == "aws_access_key_id") c.access_key_id = value;
    if (key == "aws_secret_access_key") c.secret_access_key = value;
    if (key == "aws_session_token") c.session_token = value;
  }
  if (found && !c.access_key_id.empty() && !c.secret_access_key.empty()) {
    c.source = fmt::format("{} [{}]", file, options.profile);
    return c;
  }
  throw Error(ErrorKind::io,
              fmt::format("s3: no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set, and {} has no "
                          "profile [{}] with aws_access_key_id and aws_secret_access_key. Set those variables (and "
                          "AWS_SESSION_TOKEN for temporary credentials), or write the profile (AWS_PROFILE picks "
                          "another one)",
                          file, options.profile));
}

// Credentials are resolved once, here, so that requests from several threads only read them.
Client::Client(ClientOptions options) : options_(std::move(options)), credentials_(resolve_credentials(options_)) {
  global_init();
}

const Credentials& Client::credentials() {
  if (!credentials_) credentials_ = resolve_credentials(options_);
  return *credentials_;
}

std::string Client::url_of(const std::string& bucket, const std::string& key, const std::string& query) const {
  std::string url =
      options_.endpoint.empty()
          ? fmt::format("https://{}.s3.{}.amazonaws.com/{}", bucket, options_.region, uri_encode(key, true))
          : fmt::format("{}/{}/{}", options_.endpoint, bucket, uri_encode(key, true));
  if (!query.empty()) url += "?" + query;
  return url;
}

Client::Response Client::send_once(const Request& request) {
  const Credentials& creds = credentials();
  Response response;
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) {
    response.code = CURLE_FAILED_INIT;
    response.transport_error = "curl_easy_init failed";
    return response;
  }
  CURL* h = curl.get();
  const std::string url = url_of(request.bucket, request.key, request.query);
  const std::string sigv4 = fmt::format("aws:amz:{}:s3", options_.region);
  const std::string userpwd = creds.access_key_id + ":" + creds.secret_access_key;
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4.c_str());
  curl_easy_setopt(h, CURLOPT_USERPWD, userpwd.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, options_.connect_timeout_s);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, options_.stall_timeout_s);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, collect_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &response.body);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, collect_header);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, &response.headers);

  curl_slist* headers = nullptr;
  auto add = [&](const std::string& header) { headers = curl_slist_append(headers, header.c_str()); };
  add("x-amz-content-sha256: UNSIGNED-PAYLOAD");
  if (!creds.session_token.empty()) add("x-amz-security-token: " + creds.session_token);
  for (const std::string& header : request.headers) add(header);
  Upload upload{request.body, 0, false};
  if (request.method == "PUT") {
    if (const UploadToKill& kill = upload_to_kill(); kill.n > 0 &&
                                                     request.query.find("partNumber") == std::string::npos &&
                                                     request.key.find(kill.key_part) != std::string::npos)
      upload.doomed = uploads_started.fetch_add(1) + 1 == kill.n;
    // No "Expect:" to skip the 100-continue round trip: curl 7.88 signs that blanked header
    // without sending it, and the server then refuses the signature.
    add("Content-Type: application/octet-stream");
    curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(h, CURLOPT_READFUNCTION, send_body);
    curl_easy_setopt(h, CURLOPT_READDATA, &upload);
    curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method == "POST") {
    add("Content-Type: application/xml");
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, request.body.data());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
  } else if (request.method == "HEAD") {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  } else if (request.method == "DELETE") {
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "DELETE");
  }
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  char error_buffer[CURL_ERROR_SIZE] = {};
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
  response.code = curl_easy_perform(h);
  curl_slist_free_all(headers);
  if (response.code != CURLE_OK) {
    response.transport_error = error_buffer[0] ? error_buffer : curl_easy_strerror(response.code);
    return response;
  }
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

Client::Response Client::perform(const Request& request) {
  std::mt19937 jitter(std::random_device{}());
  for (int attempt = 0;; ++attempt) {
    Response response = send_once(request);
    const bool retry =
        response.code != CURLE_OK ? transient(response.code) : response.status >= 500 || response.status == 429;
    if (!retry || attempt >= options_.max_retries) return response;
    // Exponential backoff with full jitter (AWS's advice), capped at 5 s.
    const int64_t cap_ms = std::min<int64_t>(5000, int64_t{100} << std::min(attempt, 6));
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int64_t>(cap_ms / 2, cap_ms)(jitter)));
  }
}

void Client::fail(std::string_view operation, const std::string& bucket, const std::string& key,
                  const Response& response) {
  const std::string where = fmt::format("s3://{}/{}", bucket, key);
  const std::string server = options_.endpoint.empty() ? std::string("AWS S3") : options_.endpoint;
  if (response.code != CURLE_OK)
    throw Error(ErrorKind::io,
                fmt::format("s3: {} of {} failed: cannot reach {} ({}) after {} retries; check the endpoint "
                            "(AWS_ENDPOINT_URL) and the network",
                            operation, where, server, response.transport_error, options_.max_retries));
  std::string code = xml_value(response.body, "Code");
  const std::string message = xml_value(response.body, "Message");
  if (code.empty() && response.status == 404) code = key.empty() ? "NoSuchBucket" : "NoSuchKey";
  throw Error(
      ErrorKind::io,
      fmt::format("s3: {} of {} (bucket '{}', key '{}') failed at {}: HTTP {}{}{}; {}", operation, where, bucket, key,
                  server, response.status, code.empty() ? "" : " " + code, message.empty() ? "" : ": " + message,
                  fix_for(code, response.status, options_, credentials_ ? &*credentials_ : nullptr, bucket)));
}

void Client::put(const std::string& bucket, const std::string& key, std::string_view bytes) {
  if (bytes.size() > options_.part_size) return put_multipart(bucket, key, bytes);
  Request request{"PUT", bucket, key, "", bytes, {}};
  const Response response = perform(request);
  if (response.code != CURLE_OK || response.status != 200) fail("upload", bucket, key, response);
}

// CreateMultipartUpload, UploadPart per part_size bytes, CompleteMultipartUpload. The object
// appears only when the last call succeeds; on failure the upload is aborted (its parts freed).
void Client::put_multipart(const std::string& bucket, const std::string& key, std::string_view bytes) {
  Response created = perform(Request{"POST", bucket, key, "uploads=", {}, {}});
  if (created.code != CURLE_OK || created.status != 200) fail("multipart upload (create)", bucket, key, created);
  const std::string upload_id = xml_value(created.body, "UploadId");
  if (upload_id.empty()) fail("multipart upload (create: no UploadId in the answer)", bucket, key, created);
  const std::string id_query = "uploadId=" + uri_encode(upload_id, false);
  try {
    std::string complete = "<CompleteMultipartUpload>";
    int part = 1;
    for (size_t at = 0; at < bytes.size(); at += options_.part_size, ++part) {
      const std::string_view chunk = bytes.substr(at, options_.part_size);
      Response sent = perform(Request{"PUT", bucket, key, fmt::format("partNumber={}&{}", part, id_query), chunk, {}});
      if (sent.code != CURLE_OK || sent.status != 200)
        fail(fmt::format("multipart upload (part {})", part), bucket, key, sent);
      complete += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", part, sent.headers["etag"]);
    }
    complete += "</CompleteMultipartUpload>";
    Response done = perform(Request{"POST", bucket, key, id_query, complete, {}});
    // S3 may answer 200 with an <Error> body when completing fails late.
    if (done.code != CURLE_OK || done.status != 200 || done.body.find("<Error>") != std::string::npos)
      fail("multipart upload (complete)", bucket, key, done);
  } catch (...) {
    perform(Request{"DELETE", bucket, key, id_query, {}, {}});  // best effort: free the parts
    throw;
  }
}

std::string Client::get(const std::string& bucket, const std::string& key,
                        std::optional<std::pair<uint64_t, uint64_t>> range) {
  Request request{"GET", bucket, key, "", {}, {}};
  if (range) {
    if (range->second == 0) return {};
    request.headers.push_back(fmt::format("Range: bytes={}-{}", range->first, range->first + range->second - 1));
  }
  const Response response = perform(request);
  if (range && response.status == 416) return {};  // starts past the end
  if (response.code != CURLE_OK || (response.status != 200 && response.status != 206))
    fail(range ? "ranged read" : "read", bucket, key, response);
  return response.body;
}

std::optional<ObjectInfo> Client::head(const std::string& bucket, const std::string& key) {
  Response response = perform(Request{"HEAD", bucket, key, "", {}, {}});
  if (response.code == CURLE_OK && response.status == 404) return std::nullopt;
  if (response.code != CURLE_OK || response.status != 200) {
    // A HEAD answer has no body: ask for the same key's listing to learn the error code.
    if (response.code == CURLE_OK && response.status == 403) {
      Response why =
          perform(Request{"GET", bucket, "", "list-type=2&max-keys=1&prefix=" + uri_encode(key, false), {}, {}});
      if (why.code == CURLE_OK && why.status != 200) fail("lookup", bucket, key, why);
    }
    fail("lookup", bucket, key, response);
  }
  ObjectInfo info{key, std::strtoull(response.headers["content-length"].c_str(), nullptr, 10), 0};
  const time_t t = curl_getdate(response.headers["last-modified"].c_str(), nullptr);
  info.modified_ns = t > 0 ? static_cast<int64_t>(t) * 1'000'000'000LL : 0;
  return info;
}

std::vector<ObjectInfo> Client::list(const std::string& bucket, const std::string& prefix) {
  std::vector<ObjectInfo> out;
  std::string token;
  for (;;) {
    // Sorted by name, as SigV4's canonical query must be.
    std::string query;
    if (!token.empty()) query += "continuation-token=" + uri_encode(token, false) + "&";
    query += "list-type=2&prefix=" + uri_encode(prefix, false);
    const Response response = perform(Request{"GET", bucket, "", query, {}, {}});
    if (response.code != CURLE_OK || response.status != 200) fail("listing", bucket, prefix, response);
    size_t at = 0;
    while (true) {
      const size_t contents = response.body.find("<Contents>", at);
      if (contents == std::string::npos) break;
      const size_t end = response.body.find("</Contents>", contents);
      const std::string_view entry = std::string_view(response.body).substr(contents, end - contents);
      out.push_back(ObjectInfo{xml_value(entry, "Key"), std::strtoull(xml_value(entry, "Size").c_str(), nullptr, 10),
                               iso8601_ns(xml_value(entry, "LastModified"))});
      at = end;
    }
    if (xml_value(response.body, "IsTruncated") != "true") break;
    token = xml_value(response.body, "NextContinuationToken");
    if (token.empty()) break;
  }
  return out;
}

bool Client::remove(const std::string& bucket, const std::string& key) {
  if (!head(bucket, key)) return false;
  const Response response = perform(Request{"DELETE", bucket, key, "", {}, {}});
  if (response.code != CURLE_OK || (response.status != 204 && response.status != 200))
    fail("delete", bucket, key, response);
  return true;
}

}  // namespace fulgur::s3
