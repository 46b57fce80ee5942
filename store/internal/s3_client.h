// S3Client: S3 requests for one bucket prefix, over an HttpTransport, with
// retries and the one conversion of S3 answers into Status.
//
// A call names an S3 operation, the store key it is about, its method,
// query, extra headers and body. The client builds the URL (path-style
// ENDPOINT/BUCKET/PREFIX/KEY or virtual-hosted BUCKET.HOST/PREFIX/KEY) with
// the canonical query string, adds x-amz-content-sha256 (the payload's
// SHA-256) and x-amz-security-token, sends it, checks that a 2xx body has
// its Content-Length, and retries what s3_retry.h says is transient.
//
// Thread-safety: all methods may be called concurrently; the client is
// immutable after construction apart from atomic counters.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/internal/s3_http.h"
#include "store/internal/s3_protocol.h"
#include "store/s3_store.h"

namespace dte::internal {

struct S3Call {
  const char* op = "";   // the S3 operation, for messages: "GetObject", "UploadPart", ...
  std::string method{};  // GET, HEAD, PUT, POST, DELETE
  std::string key{};     // store key ("" for a bucket-level request)
  QueryParams query{};
  std::vector<std::string> headers{};  // extra "Name: value"
  std::string_view body{};
  char* into = nullptr;  // see HttpRequest::into
  uint64_t into_len = 0;
  // The operation may report failure inside a 200 answer
  // (CompleteMultipartUpload, CopyObject).
  bool error_in_200 = false;
  // PUT: store the body's SHA-256 as the object's metadata (kChecksumHeader).
  // GET of a whole object: an answer whose metadata holds a SHA-256 must
  // match it, else it is retried like a truncated body (kChecksum). S3
  // checks what it receives (x-amz-content-sha256) but nothing checks what
  // it sends; manifests, which have no hash of their own, rely on this.
  bool checksum = false;
  // A 2xx answer whose body this finds malformed (it returns what is wrong,
  // "" for a good body) is retried like a truncated one: a listing cut
  // short, or replaced by a proxy's error page.
  std::function<std::string(std::string_view body)> check_body{};
};

// The user metadata header holding a whole object's SHA-256 (hex).
inline constexpr const char* kChecksumHeader = "x-amz-meta-dte-sha256";

struct S3Reply {
  HttpResponse http;
  std::string code;     // S3 <Code> of an error body, or ""
  std::string message;  // S3 <Message>, or ""
  int attempts = 0;

  bool ok() const {
    return http.error == TransportError::kNone && http.status >= 200 && http.status < 300 &&
           code.empty();
  }
  bool status_is(long status) const {
    return http.error == TransportError::kNone && http.status == status;
  }
};

class S3Client {
 public:
  S3Client(S3Options options, std::string bucket, std::string prefix,
           std::unique_ptr<HttpTransport> transport);

  // Sends `call`, retrying transient failures; the final reply.
  S3Reply Call(const S3Call& call);

  // The status for a failed reply: NotFound naming the key (404) or bucket
  // (NoSuchBucket), AlreadyExists (412), PermissionDenied naming the key and
  // bucket (403, or a credentials code such as AccessDenied,
  // SignatureDoesNotMatch or InvalidAccessKeyId), Corruption (a body that
  // never matched its checksum), DeadlineExceeded (timed out or stalled),
  // Unavailable (cannot connect, reset, 429/502/503/504, SlowDown), IOError
  // otherwise; the message
  // names the operation, key, S3 code, HTTP status and attempts, with
  // every secret redacted.
  Status ErrorStatus(const S3Reply& reply, const S3Call& call) const;

  Status NotFoundStatus(const std::string& key) const;
  Status AlreadyExistsStatus(const std::string& key) const;

  // The S3 object key of a store key, and back (nullopt if outside the prefix).
  std::string ObjectKey(const std::string& key) const;
  std::optional<std::string> StoreKey(std::string_view object_key) const;

  const S3Options& options() const { return options_; }
  const std::string& bucket() const { return bucket_; }
  const std::string& prefix() const { return prefix_; }
  std::string Describe() const;  // "s3://bucket/prefix"
  // Redacts every credential in `text`.
  std::string Redact(std::string text) const;

  uint64_t requests() const { return requests_.load(); }
  uint64_t retries() const { return retries_.load(); }

 private:
  HttpRequest BuildRequest(const S3Call& call) const;
  std::string Url(const std::string& object_key, const QueryParams& query) const;
  void Interpret(const S3Call& call, S3Reply* reply) const;

  const S3Options options_;
  const std::string bucket_;
  const std::string prefix_;
  std::string base_url_;  // scheme://host[:port][/path] with the bucket placed
  const std::unique_ptr<HttpTransport> transport_;
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> retries_{0};
};

}  // namespace dte::internal
