#include "store/internal/s3_multipart.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "store/base/thread_annotations.h"
#include "store/internal/s3_xml.h"

namespace dte::internal {
namespace {

constexpr int kMaxListPages = 100000;  // a server that never stops paging is broken

Result<std::string> Initiate(S3Client& client, const std::string& key,
                             const std::vector<std::string>& headers) {
  S3Call call{.op = "CreateMultipartUpload", .method = "POST", .key = key};
  call.query = {{"uploads", ""}};
  call.headers = headers;
  S3Reply reply = client.Call(call);
  if (!reply.ok()) return client.ErrorStatus(reply, call);
  auto id = ParseInitiateMultipartUpload(reply.http.body);
  if (!id.ok()) return id.status().WithContext("upload of object " + key);
  return id;
}

Result<std::string> UploadPart(S3Client& client, const std::string& key,
                               const std::string& upload_id, uint64_t part_number,
                               std::string_view data) {
  S3Call call{.op = "UploadPart", .method = "PUT", .key = key};
  call.query = {{"partNumber", std::to_string(part_number)}, {"uploadId", upload_id}};
  call.body = data;
  S3Reply reply = client.Call(call);
  if (!reply.ok()) return client.ErrorStatus(reply, call);
  const std::string* etag = reply.http.Header("etag");
  if (etag == nullptr || etag->empty()) {
    return IOError("S3 UploadPart of object " + key + " part " + std::to_string(part_number) +
                   " in store " + client.Describe() + ": the answer has no ETag");
  }
  return *etag;
}

// Copies bytes [offset, offset + len) of the object `key` into part
// `part_number` of the upload (server side).
Result<std::string> UploadPartCopy(S3Client& client, const std::string& key,
                                   const std::string& upload_id, uint64_t part_number,
                                   uint64_t offset, uint64_t len) {
  S3Call call{.op = "UploadPartCopy", .method = "PUT", .key = key};
  call.query = {{"partNumber", std::to_string(part_number)}, {"uploadId", upload_id}};
  call.headers = {"x-amz-copy-source: " + CopySource(client, key),
                  "x-amz-copy-source-range: bytes=" + std::to_string(offset) + "-" +
                      std::to_string(offset + len - 1)};
  call.error_in_200 = true;
  S3Reply reply = client.Call(call);
  if (!reply.ok()) return client.ErrorStatus(reply, call);
  auto etag = ParseCopyPartResult(reply.http.body);
  if (!etag.ok()) {
    return etag.status().WithContext("object " + key + " part " + std::to_string(part_number) +
                                     " in store " + client.Describe());
  }
  return etag;
}

// Sends part `part_number` (from 1), bytes [offset, offset + len) of the
// object, and returns its ETag. `scratch` is the calling worker's buffer.
using PartSender = std::function<Result<std::string>(uint64_t part_number, uint64_t offset,
                                                     uint64_t len, std::string* scratch)>;

// Sends the parts of one object from several threads; the first error
// stops the others at their next part.
class PartUploads {
 public:
  PartUploads(uint64_t size, uint64_t part_size, const PartSender& send)
      : size_(size),
        part_size_(part_size),
        parts_((size + part_size - 1) / part_size),
        send_(send),
        etags_(parts_) {}

  Result<std::vector<std::string>> Run(int parallel) EXCLUDES(mu_) {
    const uint64_t workers = std::clamp<uint64_t>(uint64_t(std::max(parallel, 1)), 1, parts_);
    std::vector<std::thread> threads;
    for (uint64_t i = 1; i < workers; ++i) threads.emplace_back([this] { Work(); });
    Work();
    for (auto& t : threads) t.join();
    MutexLock lock(&mu_);
    if (!error_.ok()) return error_;
    return std::move(etags_);
  }

 private:
  void Work() EXCLUDES(mu_) {
    std::string scratch;
    for (;;) {
      const uint64_t part = next_.fetch_add(1);
      if (part >= parts_ || failed_.load()) return;
      const uint64_t offset = part * part_size_;
      const uint64_t len = std::min(part_size_, size_ - offset);
      Status s = UploadOne(part, offset, len, &scratch);
      if (!s.ok()) {
        MutexLock lock(&mu_);
        if (error_.ok()) error_ = std::move(s);
        failed_ = true;
        return;
      }
    }
  }

  Status UploadOne(uint64_t part, uint64_t offset, uint64_t len, std::string* scratch) {
    ASSIGN_OR_RETURN(std::string etag, send_(part + 1, offset, len, scratch));
    etags_[part] = std::move(etag);  // each worker writes only its own parts
    return Status::Ok();
  }

  const uint64_t size_;
  const uint64_t part_size_;
  const uint64_t parts_;
  const PartSender& send_;
  std::atomic<uint64_t> next_{0};
  std::atomic<bool> failed_{false};
  // Written by the workers at distinct indices, read after they are joined.
  std::vector<std::string> etags_;
  Mutex mu_;
  Status error_ GUARDED_BY(mu_);
};

Status Complete(S3Client& client, const std::string& key, const std::string& upload_id,
                const std::vector<std::string>& etags) {
  const std::string body = BuildCompleteMultipartUpload(etags);
  S3Call call{.op = "CompleteMultipartUpload", .method = "POST", .key = key};
  call.query = {{"uploadId", upload_id}};
  call.headers = {"Content-Type: application/xml"};
  call.body = body;
  call.error_in_200 = true;
  S3Reply reply = client.Call(call);
  // A retry after a lost answer finds the upload gone: the size check that
  // follows tells whether it completed.
  if (!reply.ok() && reply.attempts > 1 && reply.code == "NoSuchUpload") return Status::Ok();
  if (!reply.ok()) return client.ErrorStatus(reply, call);
  return CheckResultRoot(reply.http.body, "CompleteMultipartUploadResult")
      .WithContext("S3 CompleteMultipartUpload of object " + key + " in store " +
                   client.Describe());
}

Status CheckSize(S3Client& client, const std::string& key, uint64_t size) {
  S3Call call{.op = "HeadObject", .method = "HEAD", .key = key};
  S3Reply reply = client.Call(call);
  if (!reply.ok()) return client.ErrorStatus(reply, call);
  const std::string* length = reply.http.Header("content-length");
  if (length == nullptr || *length != std::to_string(size)) {
    return IOError("object " + key + " in store " + client.Describe() +
                   " has the wrong size after its multipart upload: " +
                   (length ? *length : std::string("unknown")) + " bytes, expected " +
                   std::to_string(size));
  }
  return Status::Ok();
}

Status Abort(S3Client& client, const std::string& key, const std::string& upload_id) {
  S3Call call{.op = "AbortMultipartUpload", .method = "DELETE", .key = key};
  call.query = {{"uploadId", upload_id}};
  S3Reply reply = client.Call(call);
  if (reply.ok() || reply.status_is(404)) return Status::Ok();
  return client.ErrorStatus(reply, call);
}

// One multipart upload of `size` bytes in parts of `part_size`: initiate
// (with `headers`), the parts through `send`, complete, check the size;
// aborted on any failure.
Status RunMultipart(S3Client& client, const std::string& key, uint64_t size, uint64_t part_size,
                    const std::vector<std::string>& headers,
                    const std::function<PartSender(const std::string& upload_id)>& sender) {
  ASSIGN_OR_RETURN(std::string upload_id, Initiate(client, key, headers));
  const PartSender send = sender(upload_id);
  PartUploads uploads(size, part_size, send);
  auto etags = uploads.Run(client.options().parallel_parts);
  Status s = etags.ok() ? Complete(client, key, upload_id, *etags) : etags.status();
  if (!s.ok()) {
    Abort(client, key, upload_id).IgnoreError();  // the upload's own error is the one to report
    return s;
  }
  return CheckSize(client, key, size);
}

}  // namespace

uint64_t PartSizeFor(uint64_t size, uint64_t configured) {
  uint64_t part = std::max<uint64_t>(configured, 1);
  if ((size + part - 1) / part <= kMaxParts) return part;
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  part = (size + kMaxParts - 1) / kMaxParts;
  return (part + kMiB - 1) / kMiB * kMiB;
}

std::string CopySource(const S3Client& client, const std::string& key) {
  return "/" + client.bucket() + "/" + UriEncode(client.ObjectKey(key), /*keep_slash=*/true);
}

Status UploadMultipart(S3Client& client, const std::string& key, uint64_t size,
                       const PartReader& read) {
  const uint64_t part_size = PartSizeFor(size, client.options().part_size);
  return RunMultipart(client, key, size, part_size, {}, [&](const std::string& upload_id) {
    return PartSender(
        [&client, &key, &read, upload_id](uint64_t part_number, uint64_t offset, uint64_t len,
                                          std::string* scratch) -> Result<std::string> {
          ASSIGN_OR_RETURN(std::string_view data, read(offset, len, scratch));
          if (data.size() != len) {
            return Internal("multipart upload of object " + key + ": part reader returned " +
                            std::to_string(data.size()) + " of " + std::to_string(len) + " bytes");
          }
          return UploadPart(client, key, upload_id, part_number, data);
        });
  });
}

Status CopyMultipart(S3Client& client, const std::string& key, uint64_t size,
                     const std::vector<std::string>& headers) {
  const uint64_t part_size = PartSizeFor(size, client.options().copy_part_size);
  return RunMultipart(client, key, size, part_size, headers, [&](const std::string& upload_id) {
    return PartSender([&client, &key, upload_id](uint64_t part_number, uint64_t offset,
                                                 uint64_t len, std::string*) {
      return UploadPartCopy(client, key, upload_id, part_number, offset, len);
    });
  });
}

Result<uint64_t> AbortStaleUploads(S3Client& client, int64_t min_age_seconds, int64_t now) {
  const std::string prefix = client.prefix().empty() ? "" : client.prefix() + "/";
  std::string key_marker, id_marker;
  uint64_t aborted = 0;
  for (int page = 0; page < kMaxListPages; ++page) {
    S3Call call{.op = "ListMultipartUploads", .method = "GET"};
    call.query = {{"uploads", ""}, {"prefix", prefix}};
    if (!key_marker.empty()) call.query.emplace_back("key-marker", key_marker);
    if (!id_marker.empty()) call.query.emplace_back("upload-id-marker", id_marker);
    S3Reply reply = client.Call(call);
    if (!reply.ok()) return client.ErrorStatus(reply, call);
    ASSIGN_OR_RETURN(ListUploadsPage list, ParseListMultipartUploads(reply.http.body));
    for (const MultipartUploadInfo& u : list.uploads) {
      auto key = client.StoreKey(u.key);
      if (!key || !u.initiated || now - *u.initiated < min_age_seconds) continue;
      RETURN_IF_ERROR(Abort(client, *key, u.upload_id));
      ++aborted;
    }
    if (!list.truncated) return aborted;
    if (list.next_key_marker.empty() ||
        (list.next_key_marker == key_marker && list.next_upload_id_marker == id_marker)) {
      return Corruption("S3 ListMultipartUploads of store " + client.Describe() +
                        " is truncated but gives no new marker");
    }
    key_marker = list.next_key_marker;
    id_marker = list.next_upload_id_marker;
  }
  return Corruption("S3 ListMultipartUploads of store " + client.Describe() +
                    " returned too many pages");
}

}  // namespace dte::internal
