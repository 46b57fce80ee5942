// One HTTP exchange with an S3 server, behind an interface so tests can put
// a scripted fake where libcurl would be.
//
// The transport signs requests (SigV4, with the credentials it was made
// with) and performs them once; S3Client (s3_client.h) builds them, retries
// and interprets the answers. Nothing here prints a request: the signed
// Authorization header exists only inside libcurl.
//
// Thread-safety: HttpTransport::Send may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "store/s3_store.h"

namespace dte::internal {

struct HttpRequest {
  std::string method;                // GET, HEAD, PUT, POST or DELETE
  std::string url;                   // with the canonical query string
  std::vector<std::string> headers;  // "Name: value", x-amz-content-sha256 included
  std::string_view body;             // PUT and POST payload
  // A 2xx body goes here when set (at most into_len bytes; more is a
  // kBadBody error) instead of into HttpResponse::body.
  char* into = nullptr;
  uint64_t into_len = 0;
};

// Why no HTTP status arrived, or the body did not.
enum class TransportError {
  kNone,
  kConnect,   // could not resolve or connect
  kTimeout,   // connect timeout or stalled transfer (low-speed limit)
  kReset,     // connection reset, closed early, or a send/receive failure
  kBadBody,   // body shorter than Content-Length, or longer than expected
  kChecksum,  // body differs from the SHA-256 the object was stored with
  kFatal,     // misconfiguration (bad URL, TLS verification): retrying cannot help
};
const char* TransportErrorName(TransportError error);

struct HttpResponse {
  TransportError error = TransportError::kNone;
  std::string error_detail;  // libcurl's message, for kNone == false
  long status = 0;           // 0 when no status line arrived
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-case
  std::string body;         // error bodies; 2xx bodies without HttpRequest::into
  uint64_t body_bytes = 0;  // bytes received in all

  // The last header named `name` (lower-case), or null.
  const std::string* Header(std::string_view name) const;
};

class HttpTransport {
 public:
  virtual ~HttpTransport() = default;
  virtual HttpResponse Send(const HttpRequest& request) = 0;
};

// libcurl with a pool of easy handles (reused connections), SigV4 signing
// with `options`' credentials and region, the low-speed and connect limits.
std::unique_ptr<HttpTransport> NewCurlTransport(const S3Options& options);

}  // namespace dte::internal
