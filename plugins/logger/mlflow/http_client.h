// A small blocking HTTP client for the mlflow logger, over libcurl (Debian libcurl4-openssl-dev).
// libcurl rather than a hand-written socket client or a header-only library: it is the most
// widely used and security-maintained HTTP stack in Debian, brings timeouts, keep-alive, HTTPS
// and proxy support (a tracking server is often remote), and its C header costs nothing to
// compile next to the torch headers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace fulgur::mlflow {

struct HttpResponse {
  // 0 when no HTTP answer came (connection refused, timeout, DNS): `transport_error` says why.
  long status = 0;
  std::string body;
  std::string transport_error;

  bool ok() const { return status >= 200 && status < 300; }
  // Worth another try: no answer at all, a server error (5xx) or rate limiting (429). A 4xx is
  // the request's fault and would fail again.
  bool transient() const { return status == 0 || status == 429 || status >= 500; }
  // One line for error messages: "HTTP 400: {...}" or "Couldn't connect to server".
  std::string describe() const;
};

class HttpClient {
 public:
  HttpClient();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  HttpResponse get(const std::string& url);
  HttpResponse post_json(const std::string& url, const std::string& body);
  // PUT with the file's bytes as the body, streamed from disk (checkpoints can be large).
  HttpResponse put_file(const std::string& url, const std::string& path);

 private:
  struct Handle;
  std::unique_ptr<Handle> handle_;  // one curl handle: its connection is kept alive between calls
};

// Percent-encodes `text` for a URL path segment or query value (RFC 3986 unreserved kept).
std::string url_encode(const std::string& text);

}  // namespace fulgur::mlflow
