// FakeS3: an in-memory S3 behind the HttpTransport interface, for unit
// tests of S3Store's protocol handling without a server: retries, lost
// answers, multipart aborts, truncated bodies.
//
// It serves one bucket at http://fake.test/BUCKET (path style): PutObject
// (with If-None-Match: *), GetObject (with Range), HeadObject, DeleteObject,
// CopyObject, ListObjectsV2 (kListPageSize keys a page, continuation tokens
// with '+', '/' and '=', start-after), and the multipart calls. Every request must carry
// x-amz-content-sha256 equal to its body's SHA-256, else it answers 400
// XAmzContentSHA256Mismatch.
//
// Faults: `before` may answer a request instead of the fake (the request
// is then not applied); `after` may change the answer of an applied request
// (e.g. lose it). Both run without the lock held.
//
// Thread-safety: Send may be called concurrently; set the hooks before.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/base/thread_annotations.h"
#include "store/internal/s3_http.h"

namespace dte::test {

class FakeS3 final : public internal::HttpTransport {
 public:
  static constexpr size_t kListPageSize = 2;
  static constexpr const char* kEndpoint = "http://fake.test";

  explicit FakeS3(std::string bucket) : bucket_(std::move(bucket)) {}

  internal::HttpResponse Send(const internal::HttpRequest& request) override;

  std::function<std::optional<internal::HttpResponse>(const internal::HttpRequest&)> before;
  std::function<void(const internal::HttpRequest&, internal::HttpResponse*)> after;
  // Time each UploadPart takes, to see how many run at once.
  std::chrono::milliseconds part_delay{0};

  // Inspection.
  std::map<std::string, std::string> Objects() const EXCLUDES(mu_);
  void SetObject(const std::string& key, const std::string& data) EXCLUDES(mu_);
  size_t OpenUploads() const EXCLUDES(mu_);
  // "METHOD /bucket/key?query" of every request, in order.
  std::vector<std::string> Log() const EXCLUDES(mu_);
  int max_parts_in_flight() const { return max_in_flight_.load(); }

  // An S3 error answer.
  static internal::HttpResponse Error(long status, const std::string& code,
                                      const std::string& message = "");

 private:
  struct Parsed;
  internal::HttpResponse Handle(const internal::HttpRequest& r, const Parsed& p) EXCLUDES(mu_);
  internal::HttpResponse GetObject(const internal::HttpRequest& r, const std::string& data);
  internal::HttpResponse List(const Parsed& p) EXCLUDES(mu_);
  internal::HttpResponse UploadPart(const internal::HttpRequest& r, const Parsed& p) EXCLUDES(mu_);

  const std::string bucket_;
  mutable Mutex mu_;
  std::map<std::string, std::string> objects_ GUARDED_BY(mu_);
  std::map<std::string, std::map<int, std::string>> uploads_ GUARDED_BY(mu_);
  std::vector<std::string> log_ GUARDED_BY(mu_);
  int next_upload_ GUARDED_BY(mu_) = 0;
  std::atomic<int> in_flight_{0};
  std::atomic<int> max_in_flight_{0};
};

}  // namespace dte::test
