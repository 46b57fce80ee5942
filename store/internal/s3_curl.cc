// HttpTransport over libcurl. CURLcode is converted to TransportError here
// and nowhere else.
#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "store/base/thread_annotations.h"
#include "store/internal/s3_http.h"

namespace dte::internal {
namespace {

struct CurlDeleter {
  void operator()(CURL* handle) const { curl_easy_cleanup(handle); }
};
using CurlPtr = std::unique_ptr<CURL, CurlDeleter>;

struct SlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};
using SlistPtr = std::unique_ptr<curl_slist, SlistDeleter>;

TransportError FromCurlCode(CURLcode rc) {
  switch (rc) {
    case CURLE_OK:
      return TransportError::kNone;
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
      return TransportError::kConnect;
    case CURLE_OPERATION_TIMEDOUT:
      return TransportError::kTimeout;
    case CURLE_PARTIAL_FILE:
    case CURLE_WRITE_ERROR:  // our write callback refused an overlong body
      return TransportError::kBadBody;
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_WEIRD_SERVER_REPLY:
      return TransportError::kReset;
    default:
      return TransportError::kFatal;
  }
}

// Idle easy handles; each keeps its connection open for the next request.
class HandlePool {
 public:
  CurlPtr Acquire() EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (!idle_.empty()) {
        CurlPtr handle = std::move(idle_.back());
        idle_.pop_back();
        return handle;
      }
    }
    return CurlPtr(curl_easy_init());
  }

  void Release(CurlPtr handle) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (idle_.size() < kMaxIdle) idle_.push_back(std::move(handle));
  }

 private:
  static constexpr size_t kMaxIdle = 32;
  Mutex mu_;
  std::vector<CurlPtr> idle_ GUARDED_BY(mu_);
};

// State of one transfer, shared with the callbacks.
struct Transfer {
  CURL* handle;
  const HttpRequest* request;
  HttpResponse* response;
  size_t read_pos = 0;
  uint64_t written = 0;  // into request->into
  bool overflow = false;
};

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  t->response->body_bytes += n;
  long status = 0;
  curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &status);
  if (t->request->into != nullptr && status >= 200 && status < 300) {
    if (n > t->request->into_len - t->written) {
      t->overflow = true;
      return 0;  // aborts the transfer with CURLE_WRITE_ERROR
    }
    std::memcpy(t->request->into + t->written, data, n);
    t->written += n;
  } else {
    t->response->body.append(data, n);
  }
  return n;
}

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  std::string_view line(data, n);
  if (line.starts_with("HTTP/")) {  // a new response (after 100 Continue)
    t->response->headers.clear();
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return n;
  std::string name(line.substr(0, colon));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' ')) {
    value.remove_suffix(1);
  }
  t->response->headers.emplace_back(std::move(name), std::string(value));
  return n;
}

size_t OnRead(char* buffer, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string_view body = t->request->body;
  const size_t n = std::min(size * count, body.size() - t->read_pos);
  std::memcpy(buffer, body.data() + t->read_pos, n);
  t->read_pos += n;
  return n;
}

int OnSeek(void* user, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(user);
  if (origin != SEEK_SET || offset < 0 || static_cast<size_t>(offset) > t->request->body.size()) {
    return CURL_SEEKFUNC_FAIL;
  }
  t->read_pos = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

class CurlTransport final : public HttpTransport {
 public:
  explicit CurlTransport(const S3Options& options)
      : sigv4_("aws:amz:" + options.region + ":s3"),
        access_key_(options.access_key),
        secret_key_(options.secret_key),
        low_speed_limit_(options.low_speed_limit),
        low_speed_time_(static_cast<long>(options.low_speed_time.count())),
        connect_timeout_ms_(static_cast<long>(options.connect_timeout.count())) {
    static std::once_flag init;
    std::call_once(init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  }

  HttpResponse Send(const HttpRequest& request) override {
    HttpResponse response;
    CurlPtr handle = pool_.Acquire();
    if (handle == nullptr) {
      response.error = TransportError::kFatal;
      response.error_detail = "curl_easy_init failed";
      return response;
    }
    curl_easy_reset(handle.get());
    Transfer transfer{handle.get(), &request, &response};
    SlistPtr headers;
    for (const std::string& h : request.headers) {
      headers.reset(curl_slist_append(headers.release(), h.c_str()));
    }
    char error[CURL_ERROR_SIZE] = "";
    Configure(handle.get(), request, &transfer, headers.get(), error);
    const CURLcode rc = curl_easy_perform(handle.get());
    curl_easy_getinfo(handle.get(), CURLINFO_RESPONSE_CODE, &response.status);
    response.error = FromCurlCode(rc);
    if (transfer.overflow) {
      response.error_detail =
          "response body longer than the " + std::to_string(request.into_len) + " bytes requested";
    } else if (rc != CURLE_OK) {
      response.error_detail = error[0] != '\0' ? error : curl_easy_strerror(rc);
    }
    // A handle whose transfer failed may hold a broken connection; drop it.
    if (rc == CURLE_OK) pool_.Release(std::move(handle));
    return response;
  }

 private:
  void Configure(CURL* h, const HttpRequest& request, Transfer* transfer, curl_slist* headers,
                 char* error) const {
    curl_easy_setopt(h, CURLOPT_URL, request.url.c_str());
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, connect_timeout_ms_);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, low_speed_limit_);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, low_speed_time_);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, OnBody);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, transfer);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, OnHeader);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, transfer);
    if (!access_key_.empty()) {
      curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4_.c_str());
      curl_easy_setopt(h, CURLOPT_USERNAME, access_key_.c_str());
      curl_easy_setopt(h, CURLOPT_PASSWORD, secret_key_.c_str());
    }
    const std::string& m = request.method;
    if (m == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (m == "PUT") {
      curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(h, CURLOPT_READFUNCTION, OnRead);
      curl_easy_setopt(h, CURLOPT_READDATA, transfer);
      curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, OnSeek);
      curl_easy_setopt(h, CURLOPT_SEEKDATA, transfer);
      curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.body.size()));
    } else if (m == "POST") {
      curl_easy_setopt(h, CURLOPT_POST, 1L);
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, request.body.data());
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE,
                       static_cast<curl_off_t>(request.body.size()));
    } else if (m != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, m.c_str());
    }
  }

  const std::string sigv4_;
  const std::string access_key_;
  const std::string secret_key_;
  const long low_speed_limit_;
  const long low_speed_time_;
  const long connect_timeout_ms_;
  HandlePool pool_;
};

}  // namespace

std::unique_ptr<HttpTransport> NewCurlTransport(const S3Options& options) {
  return std::make_unique<CurlTransport>(options);
}

}  // namespace dte::internal
