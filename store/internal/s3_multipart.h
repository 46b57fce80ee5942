// Multipart uploads: large objects in parts, several in flight; and
// multipart copies of objects larger than one CopyObject allows.
//
// UploadMultipart starts an upload (CreateMultipartUpload), sends parts
// 1..n from `parallel_parts` worker threads, each with its own part-sized
// buffer that `read` fills (so at most parallel_parts * part_size bytes are
// in memory), completes it (CompleteMultipartUpload, whose 200 answer may
// still carry an error), and checks the object's size with a HEAD. Any
// failure aborts the upload (AbortMultipartUpload) so no parts linger.
// Each part is signed with its SHA-256, so the server rejects a part that
// was damaged in flight.
//
// Thread-safety: the functions may be called concurrently; `read` is called
// from several threads at once.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/internal/s3_client.h"

namespace dte::internal {

// S3's limits: at most 10000 parts, each at least 5 MiB but the last.
inline constexpr uint64_t kMaxParts = 10000;
inline constexpr uint64_t kMinPartSize = uint64_t{5} << 20;

// The part size for an object of `size` bytes: `configured`, grown (in whole
// MiB) when the object would need more than kMaxParts parts.
uint64_t PartSizeFor(uint64_t size, uint64_t configured);

// Fills bytes [offset, offset+len) of the object, returning a view of them:
// into *scratch (which has room for a whole part), or of memory it already
// has.
using PartReader =
    std::function<Result<std::string_view>(uint64_t offset, uint64_t len, std::string* scratch)>;

Status UploadMultipart(S3Client& client, const std::string& key, uint64_t size,
                       const PartReader& read);

// Copies the object `key` of `size` bytes onto itself with a multipart
// upload whose parts are UploadPartCopy requests (x-amz-copy-source with
// x-amz-copy-source-range), so no byte passes through dte: how objects
// larger than one CopyObject allows (S3: 5 GiB) are copied. Parts of
// options().copy_part_size (grown past kMaxParts parts), parallel_parts at
// a time; `headers` (the metadata to keep) go with CreateMultipartUpload.
// Completed and size-checked like an upload; aborted on any failure.
Status CopyMultipart(S3Client& client, const std::string& key, uint64_t size,
                     const std::vector<std::string>& headers);

// The x-amz-copy-source value naming the object `key`: /BUCKET/OBJECT_KEY.
std::string CopySource(const S3Client& client, const std::string& key);

// Aborts multipart uploads under the client's prefix initiated at least
// `min_age_seconds` before `now`. Returns how many were aborted.
Result<uint64_t> AbortStaleUploads(S3Client& client, int64_t min_age_seconds, int64_t now);

}  // namespace dte::internal
