#include "tests/testutil/fake_s3.h"

#include <algorithm>
#include <cctype>
#include <thread>

#include "store/internal/s3_protocol.h"

namespace dte::test {

using internal::HttpRequest;
using internal::HttpResponse;

namespace {

std::string PercentDecode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      out += static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// The value of header `name` (case-insensitive), or nullopt.
std::optional<std::string> Header(const HttpRequest& r, std::string_view name) {
  for (const std::string& h : r.headers) {
    if (h.size() <= name.size() || h[name.size()] != ':') continue;
    bool same = true;
    for (size_t i = 0; i < name.size(); ++i) {
      same &= std::tolower(static_cast<unsigned char>(h[i])) ==
              std::tolower(static_cast<unsigned char>(name[i]));
    }
    if (!same) continue;
    std::string v = h.substr(name.size() + 1);
    while (!v.empty() && v.front() == ' ') v.erase(0, 1);
    return v;
  }
  return std::nullopt;
}

HttpResponse Ok(long status, std::string body = "") {
  HttpResponse r;
  r.status = status;
  r.headers.emplace_back("content-length", std::to_string(body.size()));
  r.body_bytes = body.size();
  r.body = std::move(body);
  return r;
}

}  // namespace

struct FakeS3::Parsed {
  std::string key;  // object key, "" for the bucket
  std::map<std::string, std::string> query;
};

HttpResponse FakeS3::Error(long status, const std::string& code, const std::string& message) {
  return Ok(status, "<?xml version=\"1.0\"?><Error><Code>" + code + "</Code><Message>" + message +
                        "</Message><RequestId>r</RequestId></Error>");
}

HttpResponse FakeS3::Send(const HttpRequest& request) {
  Parsed p;
  const std::string base = std::string(kEndpoint) + "/" + bucket_;
  std::string rest = request.url.substr(std::min(request.url.size(), base.size()));
  const size_t q = rest.find('?');
  const std::string path = rest.substr(0, q);
  p.key = path.empty() ? "" : PercentDecode(path.substr(1));
  for (size_t pos = q == std::string::npos ? rest.size() : q + 1; pos < rest.size();) {
    const size_t amp = std::min(rest.find('&', pos), rest.size());
    const std::string pair = rest.substr(pos, amp - pos);
    const size_t eq = pair.find('=');
    p.query[PercentDecode(pair.substr(0, eq))] =
        eq == std::string::npos ? "" : PercentDecode(pair.substr(eq + 1));
    pos = amp + 1;
  }
  {
    MutexLock lock(&mu_);
    log_.push_back(request.method + " " + request.url.substr(std::string(kEndpoint).size()));
  }
  if (before) {
    if (auto answer = before(request)) return *answer;
  }
  HttpResponse response;
  if (request.url.rfind(base, 0) != 0) {
    response = Error(404, "NoSuchBucket", "The specified bucket does not exist");
  } else if (Header(request, "x-amz-content-sha256") != internal::Sha256Hex(request.body)) {
    response = Error(400, "XAmzContentSHA256Mismatch", "payload hash mismatch");
  } else {
    response = Handle(request, p);
  }
  if (after) after(request, &response);
  if (request.into != nullptr && response.error == internal::TransportError::kNone &&
      response.status / 100 == 2) {
    if (response.body.size() > request.into_len) {
      response.error = internal::TransportError::kBadBody;
      response.error_detail = "overlong body";
    } else {
      std::copy(response.body.begin(), response.body.end(), request.into);
      response.body.clear();
    }
  }
  return response;
}

HttpResponse FakeS3::Handle(const HttpRequest& r, const Parsed& p) {
  if (p.key.empty() && r.method == "GET") return List(p);
  if (r.method == "PUT" && p.query.count("partNumber")) return UploadPart(r, p);
  MutexLock lock(&mu_);
  auto it = objects_.find(p.key);
  const bool exists = it != objects_.end();
  if (r.method == "HEAD" || r.method == "GET") {
    if (!exists) return r.method == "HEAD" ? Ok(404) : Error(404, "NoSuchKey", "no such key");
    if (r.method == "GET") return GetObject(r, it->second);
    HttpResponse head = Ok(200);
    head.headers = {{"content-length", std::to_string(it->second.size())},
                    {"last-modified", "Sun, 06 Nov 1994 08:49:37 GMT"}};
    return head;
  }
  if (r.method == "DELETE") {
    if (p.query.count("uploadId")) {
      return uploads_.erase(p.query.at("uploadId")) ? Ok(204) : Error(404, "NoSuchUpload");
    }
    objects_.erase(p.key);
    return Ok(204);
  }
  if (r.method == "POST" && p.query.count("uploads")) {
    const std::string id = "upload+/=" + std::to_string(next_upload_++);
    uploads_[id];
    return Ok(200, "<InitiateMultipartUploadResult><UploadId>" + id +
                       "</UploadId></InitiateMultipartUploadResult>");
  }
  if (r.method == "POST" && p.query.count("uploadId")) {
    auto up = uploads_.find(p.query.at("uploadId"));
    if (up == uploads_.end()) return Error(404, "NoSuchUpload");
    std::string data;
    for (const auto& [n, part] : up->second) data += part;
    objects_[p.key] = std::move(data);
    uploads_.erase(up);
    return Ok(200, "<CompleteMultipartUploadResult><Key>k</Key></CompleteMultipartUploadResult>");
  }
  if (r.method == "PUT" && Header(r, "x-amz-copy-source")) {
    if (!exists) return Error(404, "NoSuchKey");
    return Ok(200, "<CopyObjectResult><ETag>e</ETag></CopyObjectResult>");
  }
  if (r.method == "PUT") {
    if (exists && Header(r, "If-None-Match") == "*") return Error(412, "PreconditionFailed");
    objects_[p.key] = std::string(r.body);
    return Ok(200);
  }
  return Error(405, "MethodNotAllowed");
}

HttpResponse FakeS3::GetObject(const HttpRequest& r, const std::string& data) {
  auto range = Header(r, "Range");
  if (!range) return Ok(200, data);
  const size_t dash = range->find('-');
  const uint64_t first = std::stoull(range->substr(6, dash - 6));
  const uint64_t last = std::stoull(range->substr(dash + 1));
  if (first >= data.size()) {
    HttpResponse e = Error(416, "InvalidRange");
    e.headers.emplace_back("content-range", "bytes */" + std::to_string(data.size()));
    return e;
  }
  const uint64_t end = std::min<uint64_t>(last + 1, data.size());
  HttpResponse out = Ok(206, data.substr(first, end - first));
  out.headers.emplace_back("content-range", "bytes " + std::to_string(first) + "-" +
                                                std::to_string(end - 1) + "/" +
                                                std::to_string(data.size()));
  return out;
}

HttpResponse FakeS3::List(const Parsed& p) {
  MutexLock lock(&mu_);
  const std::string prefix = p.query.count("prefix") ? p.query.at("prefix") : "";
  if (p.query.count("uploads")) {
    std::string body = "<ListMultipartUploadsResult><IsTruncated>false</IsTruncated>";
    for (const auto& [id, parts] : uploads_) {
      body += "<Upload><Key>" + prefix + "k</Key><UploadId>" + id +
              "</UploadId><Initiated>2000-01-01T00:00:00.000Z</Initiated></Upload>";
    }
    return Ok(200, body + "</ListMultipartUploadsResult>");
  }
  size_t start = 0;
  if (p.query.count("continuation-token")) {
    start = std::stoul(p.query.at("continuation-token").substr(6));  // "tok+/=N"
  }
  std::vector<std::string> keys;
  const std::string after = p.query.count("start-after") ? p.query.at("start-after") : "";
  for (const auto& [k, v] : objects_) {
    if (k.rfind(prefix, 0) == 0 && k > after) keys.push_back(k);
  }
  std::string body = "<ListBucketResult>";
  const size_t end = std::min(keys.size(), start + kListPageSize);
  for (size_t i = start; i < end; ++i) body += "<Contents><Key>" + keys[i] + "</Key></Contents>";
  if (end < keys.size()) {
    body += "<IsTruncated>true</IsTruncated><NextContinuationToken>tok+/=" + std::to_string(end) +
            "</NextContinuationToken>";
  } else {
    body += "<IsTruncated>false</IsTruncated>";
  }
  return Ok(200, body + "</ListBucketResult>");
}

HttpResponse FakeS3::UploadPart(const HttpRequest& r, const Parsed& p) {
  const int now = in_flight_.fetch_add(1) + 1;
  int seen = max_in_flight_.load();
  while (now > seen && !max_in_flight_.compare_exchange_weak(seen, now)) {
  }
  std::this_thread::sleep_for(part_delay);
  in_flight_.fetch_sub(1);
  MutexLock lock(&mu_);
  auto up = uploads_.find(p.query.at("uploadId"));
  if (up == uploads_.end()) return Error(404, "NoSuchUpload");
  const int n = std::stoi(p.query.at("partNumber"));
  up->second[n] = std::string(r.body);
  HttpResponse out = Ok(200);
  out.headers.emplace_back("etag", "\"etag-" + std::to_string(n) + "\"");
  return out;
}

std::map<std::string, std::string> FakeS3::Objects() const {
  MutexLock lock(&mu_);
  return objects_;
}

void FakeS3::SetObject(const std::string& key, const std::string& data) {
  MutexLock lock(&mu_);
  objects_[key] = data;
}

size_t FakeS3::OpenUploads() const {
  MutexLock lock(&mu_);
  return uploads_.size();
}

std::vector<std::string> FakeS3::Log() const {
  MutexLock lock(&mu_);
  return log_;
}

}  // namespace dte::test
