#include "http_client.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <cctype>
#include <cstdio>
#include <mutex>

namespace fulgur::mlflow {

namespace {

// curl_global_init is not thread-safe and must run once per process before any handle.
void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

size_t append_body(char* data, size_t size, size_t count, void* target) {
  static_cast<std::string*>(target)->append(data, size * count);
  return size * count;
}

// Seconds: a dead host is noticed quickly; a slow server still gets time to answer.
constexpr long kConnectTimeoutS = 5;
constexpr long kRequestTimeoutS = 60;
// Uploads have no total limit (a large checkpoint over a slow link), only a stall limit.
constexpr long kLowSpeedBytesPerS = 1024;
constexpr long kLowSpeedTimeS = 60;

}  // namespace

struct HttpClient::Handle {
  CURL* curl = nullptr;
  char error[CURL_ERROR_SIZE] = {};
};

HttpClient::HttpClient() : handle_(std::make_unique<Handle>()) {
  init_curl_once();
  handle_->curl = curl_easy_init();
}

HttpClient::~HttpClient() {
  if (handle_->curl) curl_easy_cleanup(handle_->curl);
}

std::string HttpResponse::describe() const {
  if (status == 0) return transport_error;
  std::string text = body.size() > 300 ? body.substr(0, 300) + "..." : body;
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  return fmt::format("HTTP {}: {}", status, text);
}

namespace {

// Options every request shares; the handle is reset first so no setting leaks between requests
// (reset keeps the live connection and the DNS cache).
void prepare(CURL* curl, char* error, const std::string& url, std::string* body) {
  curl_easy_reset(curl);
  error[0] = '\0';
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for DNS timeouts: the Trainer owns signals
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, kConnectTimeoutS);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append_body);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, body);
}

// `body` is where the write callback appended the answer (set by prepare()).
HttpResponse perform(CURL* curl, const char* error, std::string& body) {
  HttpResponse response;
  const CURLcode code = curl_easy_perform(curl);
  if (code != CURLE_OK) {
    response.transport_error = error[0] ? error : curl_easy_strerror(code);
    return response;
  }
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  response.body = std::move(body);
  return response;
}

}  // namespace

HttpResponse HttpClient::get(const std::string& url) {
  if (!handle_->curl) return {0, {}, "curl_easy_init failed"};
  std::string body;
  prepare(handle_->curl, handle_->error, url, &body);
  curl_easy_setopt(handle_->curl, CURLOPT_TIMEOUT, kRequestTimeoutS);
  return perform(handle_->curl, handle_->error, body);
}

HttpResponse HttpClient::post_json(const std::string& url, const std::string& json) {
  if (!handle_->curl) return {0, {}, "curl_easy_init failed"};
  std::string body;
  prepare(handle_->curl, handle_->error, url, &body);
  curl_easy_setopt(handle_->curl, CURLOPT_TIMEOUT, kRequestTimeoutS);
  curl_easy_setopt(handle_->curl, CURLOPT_POST, 1L);
  curl_easy_setopt(handle_->curl, CURLOPT_POSTFIELDS, json.c_str());
  curl_easy_setopt(handle_->curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(json.size()));
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(handle_->curl, CURLOPT_HTTPHEADER, headers);
  HttpResponse response = perform(handle_->curl, handle_->error, body);
  curl_slist_free_all(headers);
  return response;
}

HttpResponse HttpClient::put_file(const std::string& url, const std::string& path) {
  if (!handle_->curl) return {0, {}, "curl_easy_init failed"};
  std::FILE* file = std::fopen(path.c_str(), "rbe");
  if (!file) return {0, {}, fmt::format("cannot open '{}' for upload", path)};
  std::fseek(file, 0, SEEK_END);
  const long size = std::ftell(file);
  std::rewind(file);
  std::string body;
  prepare(handle_->curl, handle_->error, url, &body);
  curl_easy_setopt(handle_->curl, CURLOPT_UPLOAD, 1L);  // PUT, body read with fread from READDATA
  curl_easy_setopt(handle_->curl, CURLOPT_READDATA, file);
  curl_easy_setopt(handle_->curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(size));
  curl_easy_setopt(handle_->curl, CURLOPT_LOW_SPEED_LIMIT, kLowSpeedBytesPerS);
  curl_easy_setopt(handle_->curl, CURLOPT_LOW_SPEED_TIME, kLowSpeedTimeS);
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/octet-stream");
  curl_easy_setopt(handle_->curl, CURLOPT_HTTPHEADER, headers);
  HttpResponse response = perform(handle_->curl, handle_->error, body);
  curl_slist_free_all(headers);
  std::fclose(file);
  return response;
}

std::string url_encode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~')
      out += static_cast<char>(c);
    else
      out += fmt::format("%{:02X}", c);
  }
  return out;
}

}  // namespace fulgur::mlflow
