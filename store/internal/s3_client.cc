#include "store/internal/s3_client.h"

#include <algorithm>
#include <iterator>
#include <random>
#include <string_view>
#include <thread>
#include <utility>

#include "store/internal/s3_retry.h"
#include "store/internal/s3_xml.h"

namespace dte::internal {
namespace {

constexpr size_t kMaxMessageBytes = 300;  // of server-provided text quoted in a Status

uint64_t RandomWord() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

std::string BaseUrl(const S3Options& o, const std::string& bucket) {
  std::string endpoint =
      o.endpoint.empty() ? "https://s3." + o.region + ".amazonaws.com" : o.endpoint;
  if (endpoint.find("://") == std::string::npos) endpoint = "https://" + endpoint;
  while (endpoint.ends_with('/')) endpoint.pop_back();
  // Virtual-hosted names with dots break TLS wildcard certificates.
  if (o.path_style || bucket.find('.') != std::string::npos) return endpoint + "/" + bucket;
  const size_t host = endpoint.find("://") + 3;
  return endpoint.substr(0, host) + bucket + "." + endpoint.substr(host);
}

std::optional<uint64_t> ParseUint(const std::string* text) {
  if (text == nullptr || text->empty() || text->size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : *text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

// S3 error codes that mean the request was not allowed, whatever their
// HTTP status (InvalidAccessKeyId and ExpiredToken come with 403 or 400).
bool IsPermissionCode(const std::string& code) {
  static constexpr std::string_view kCodes[] = {
      "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
      "InvalidToken", "ExpiredToken",      "AccountProblem",
  };
  return std::find(std::begin(kCodes), std::end(kCodes), code) != std::end(kCodes);
}

// Answers of a store that is overloaded or down for a while (Unavailable):
// retrying later can succeed.
bool IsUnavailableReply(long http_status, const std::string& code) {
  if (code == "SlowDown" || code == "ServiceUnavailable") return true;
  return http_status == 429 || http_status == 502 || http_status == 503 || http_status == 504;
}

}  // namespace

const char* TransportErrorName(TransportError error) {
  switch (error) {
    case TransportError::kNone:
      return "no error";
    case TransportError::kConnect:
      return "cannot connect";
    case TransportError::kTimeout:
      return "timed out or stalled";
    case TransportError::kReset:
      return "connection reset";
    case TransportError::kBadBody:
      return "incomplete response body";
    case TransportError::kChecksum:
      return "response body damaged in transit";
    case TransportError::kFatal:
      return "request failed";
  }
  return "unknown transport error";
}

const std::string* HttpResponse::Header(std::string_view name) const {
  const std::string* found = nullptr;
  for (const auto& [n, v] : headers) {
    if (n == name) found = &v;
  }
  return found;
}

S3Client::S3Client(S3Options options, std::string bucket, std::string prefix,
                   std::unique_ptr<HttpTransport> transport)
    : options_(std::move(options)),
      bucket_(std::move(bucket)),
      prefix_(std::move(prefix)),
      base_url_(BaseUrl(options_, bucket_)),
      transport_(std::move(transport)) {}

std::string S3Client::Describe() const {
  return "s3://" + bucket_ + (prefix_.empty() ? "" : "/" + prefix_);
}

std::string S3Client::ObjectKey(const std::string& key) const {
  return prefix_.empty() ? key : prefix_ + "/" + key;
}

std::optional<std::string> S3Client::StoreKey(std::string_view object_key) const {
  if (prefix_.empty()) return std::string(object_key);
  if (object_key.size() <= prefix_.size() + 1 || !object_key.starts_with(prefix_) ||
      object_key[prefix_.size()] != '/') {
    return std::nullopt;
  }
  return std::string(object_key.substr(prefix_.size() + 1));
}

std::string S3Client::Redact(std::string text) const {
  return RedactSecrets(std::move(text),
                       {options_.secret_key, options_.session_token, options_.access_key});
}

std::string S3Client::Url(const std::string& object_key, const QueryParams& query) const {
  std::string url = base_url_;
  if (!object_key.empty()) {
    url += "/" + UriEncode(object_key, /*keep_slash=*/true);
  } else if (!options_.path_style && bucket_.find('.') == std::string::npos) {
    url += "/";
  }
  if (!query.empty()) url += "?" + CanonicalQuery(query);
  return url;
}

HttpRequest S3Client::BuildRequest(const S3Call& call) const {
  HttpRequest r;
  r.method = call.method;
  r.url = Url(call.key.empty() ? "" : ObjectKey(call.key), call.query);
  r.headers = call.headers;
  const std::string sha256 = Sha256Hex(call.body);
  r.headers.push_back("x-amz-content-sha256: " + sha256);
  if (call.checksum && !call.body.empty()) {
    r.headers.push_back(std::string(kChecksumHeader) + ": " + sha256);
  }
  if (!options_.session_token.empty()) {
    r.headers.push_back("x-amz-security-token: " + options_.session_token);
  }
  if (call.method == "PUT" || call.method == "POST") {
    // Without it curl would send a form content type, which some servers
    // (moto's) then parse as a form instead of storing.
    bool has_type = false;
    for (const std::string& h : call.headers) has_type |= h.starts_with("Content-Type:");
    if (!has_type) r.headers.push_back("Content-Type: application/octet-stream");
    // No "Expect:" header to turn 100-continue off: libcurl 7.88's signer
    // would sign it although it is never sent.
  }
  r.body = call.body;
  r.into = call.into;
  r.into_len = call.into_len;
  return r;
}

// Fills in the S3 error of `reply`, and turns a 2xx body shorter than its
// Content-Length or that call.check_body refuses into a kBadBody transport
// error, and one that fails its stored checksum into kChecksum.
void S3Client::Interpret(const S3Call& call, S3Reply* reply) const {
  HttpResponse& http = reply->http;
  reply->code.clear();
  reply->message.clear();
  if (http.error != TransportError::kNone) return;
  const bool success = http.status >= 200 && http.status < 300;
  if (success && call.method != "HEAD") {
    auto length = ParseUint(http.Header("content-length"));
    if (length && *length != http.body_bytes) {
      http.error = TransportError::kBadBody;
      http.error_detail = "received " + std::to_string(http.body_bytes) + " of " +
                          std::to_string(*length) + " bytes";
      return;
    }
  }
  const std::string* stored = http.Header(kChecksumHeader);
  if (success && call.checksum && call.method == "GET" && call.into == nullptr &&
      stored != nullptr && Sha256Hex(http.body) != *stored) {
    http.error = TransportError::kChecksum;
    http.error_detail = "its SHA-256 differs from the object's " + std::string(kChecksumHeader);
    return;
  }
  if (success && call.check_body) {
    if (std::string wrong = call.check_body(http.body); !wrong.empty()) {
      http.error = TransportError::kBadBody;
      http.error_detail = "the body does not parse: " + wrong;
      return;
    }
  }
  if (!success || call.error_in_200) {
    if (auto error = ParseErrorBody(http.body)) {
      reply->code = error->code.empty() ? "UnknownError" : error->code;
      reply->message = error->message;
    }
  }
}

S3Reply S3Client::Call(const S3Call& call) {
  const HttpRequest request = BuildRequest(call);
  const int max_attempts = std::max(1, options_.retry.max_attempts);
  S3Reply reply;
  for (int attempt = 1;; ++attempt) {
    requests_.fetch_add(1);
    reply.http = transport_->Send(request);
    reply.attempts = attempt;
    Interpret(call, &reply);
    if (reply.ok() || attempt >= max_attempts ||
        !IsRetryable(reply.http.error, reply.http.status, reply.code)) {
      return reply;
    }
    retries_.fetch_add(1);
    std::this_thread::sleep_for(BackoffDelay(attempt, options_.retry, RandomWord()));
  }
}

Status S3Client::NotFoundStatus(const std::string& key) const {
  return NotFound("object " + key + " not found in store " + Describe());
}

Status S3Client::AlreadyExistsStatus(const std::string& key) const {
  return AlreadyExists("object " + key + " already exists in store " + Describe());
}

Status S3Client::ErrorStatus(const S3Reply& reply, const S3Call& call) const {
  const HttpResponse& http = reply.http;
  std::string detail = std::string("S3 ") + call.op + ": ";
  if (http.error != TransportError::kNone) {
    detail += std::string(TransportErrorName(http.error)) + " (" +
              PrintableText(http.error_detail, kMaxMessageBytes) + ")";
  } else {
    if (!reply.code.empty()) detail += PrintableText(reply.code, 64) + ", ";
    detail += "HTTP " + std::to_string(http.status);
    if (!reply.message.empty()) detail += ": " + PrintableText(reply.message, kMaxMessageBytes);
  }
  if (reply.attempts > 1) detail += ", after " + std::to_string(reply.attempts) + " attempts";
  const std::string what = call.key.empty() ? "bucket " + bucket_ : "object " + call.key;
  const std::string where = " in store " + Describe() + " (" + detail + ")";
  Status status;
  if (http.error == TransportError::kChecksum) {
    status = Corruption(what + " does not match its checksum" + where);
  } else if (http.error == TransportError::kTimeout) {
    status = DeadlineExceeded("cannot reach " + what + where);
  } else if (http.error == TransportError::kConnect || http.error == TransportError::kReset) {
    status = Unavailable("cannot reach " + what + where);
  } else if (http.error != TransportError::kNone) {
    status = IOError("cannot reach " + what + where);
  } else if (reply.code == "NoSuchBucket") {
    status = NotFound("bucket " + bucket_ + " of store " + Describe() + " does not exist (" +
                      detail + ")");
  } else if (http.status == 404 && reply.code != "NoSuchUpload") {
    status = NotFound(what + " not found" + where);
  } else if (http.status == 412) {
    status = AlreadyExists(what + " already exists" + where);
  } else if (http.status == 403 || IsPermissionCode(reply.code)) {
    // HEAD answers have no body: a 403 to one names no S3 code.
    const std::string no_code =
        reply.code.empty() && call.method == "HEAD" ? " (HEAD answers carry no S3 error code)" : "";
    const std::string bucket = call.key.empty() ? "" : " (bucket " + bucket_ + ")";
    status = PermissionDenied("access denied to " + what + bucket + where + no_code +
                              "; check the credentials, the region, the clock and the bucket "
                              "policy");
  } else if (IsUnavailableReply(http.status, reply.code)) {
    status = Unavailable(std::string(call.op) + " of " + what + " failed" + where +
                         ": the store is overloaded or down for now");
  } else {
    status = IOError(std::string(call.op) + " of " + what + " failed" + where);
  }
  return Status(status.code(), Redact(status.message()));
}

}  // namespace dte::internal
