// S3Store: each ObjectStore method as S3 requests (docs/s3.md has the table).
#include "store/s3_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <thread>
#include <utility>

#include "store/base/posix_file.h"
#include "store/base/units.h"
#include "store/internal/s3_client.h"
#include "store/internal/s3_multipart.h"
#include "store/internal/s3_open.h"
#include "store/internal/s3_retry.h"
#include "store/internal/s3_spool.h"
#include "store/internal/s3_xml.h"
#include "store/listing_check.h"
#include "store/local_store.h"

namespace dte {
namespace {

using internal::HttpResponse;
using internal::S3Call;
using internal::S3Client;
using internal::S3Reply;

constexpr int kMaxListPages = 1000000;  // a server that never stops paging is broken

std::optional<uint64_t> ParseDecimal(std::string_view text) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

// "bytes FIRST-LAST/TOTAL" or "bytes */TOTAL".
struct ContentRange {
  std::optional<uint64_t> first;
  std::optional<uint64_t> total;
};
ContentRange ParseContentRange(const std::string* header) {
  ContentRange r;
  if (header == nullptr || !header->starts_with("bytes ")) return r;
  std::string_view v = std::string_view(*header).substr(6);
  const size_t slash = v.find('/');
  if (slash == std::string_view::npos) return r;
  r.total = ParseDecimal(v.substr(slash + 1));
  const size_t dash = v.find('-');
  if (dash < slash) r.first = ParseDecimal(v.substr(0, dash));
  return r;
}

Status CheckBucket(const std::string& bucket) {
  bool ok = bucket.size() >= 3 && bucket.size() <= 63;
  for (char c : bucket)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-');
  ok = ok && bucket.front() != '.' && bucket.front() != '-' && bucket.back() != '.' &&
       bucket.back() != '-';
  if (!ok) {
    return InvalidArgument("S3 bucket name \"" + bucket +
                           "\" is invalid (3-63 characters of a-z, 0-9, '.' and '-')");
  }
  return Status::Ok();
}

class S3Store final : public ObjectStore, public PagedLister {
 public:
  S3Store(const S3Options& options, const std::string& bucket, const std::string& prefix,
          std::unique_ptr<internal::HttpTransport> transport)
      : client_(options, bucket, prefix, std::move(transport)), spool_(options.spool_dir) {}

  std::string Describe() const override { return client_.Describe(); }
  Status Put(const std::string& key, std::string_view data) override;
  Status PutFile(const std::string& key, const std::string& path) override;
  Status CreateExclusive(const std::string& key, std::string_view data) override;
  Result<std::string> Get(const std::string& key) override;
  Result<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t len) override;
  Status ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) override;
  Result<std::optional<uint64_t>> Size(const std::string& key) override;
  Result<std::vector<std::string>> List(const std::string& prefix) override;
  Result<std::vector<std::string>> ListStoreKeys(const std::string& prefix) override;
  Status Delete(const std::string& key) override;
  Result<int64_t> ModifiedTime(const std::string& key) override;
  Status Touch(const std::string& key) override;
  Result<std::string> NewTempPath() override { return spool_.NewPath(); }
  Result<uint64_t> RemoveStaleTemp(int64_t min_age_seconds) override;
  Result<KeyPage> ListAfter(const std::string& prefix, const std::string& start_after,
                            int max_keys) override;

 private:
  // One ListObjectsV2 page: keys of the store (relative, in the key
  // grammar; with `grammar`, in the store's, store/listing_check.h).
  Result<internal::ListObjectsPage> ListPage(const std::string& prefix, int max_keys,
                                             const std::string& token,
                                             const std::string& start_after, bool grammar,
                                             std::vector<std::string>* keys);
  // Why a parsed page of a listing under `prefix` is damaged ("" if it is
  // not): store/listing_check.h, and a truncated page without a token.
  std::string CheckPage(const std::string& prefix, const internal::ListObjectsPage& page,
                        const std::string& start_after, bool grammar) const;
  // One whole listing, its pages chained by their continuation tokens;
  // Corruption when the chain breaks (a token missing or repeated, keys
  // not increasing from one page to the next).
  Result<std::vector<std::string>> ListOnce(const std::string& prefix, bool grammar);
  // ListOnce again from the start while the chain breaks, up to the
  // retry policy's attempts; IOError naming the listing after the last.
  Result<std::vector<std::string>> ListChain(const std::string& prefix, bool grammar);
  Status PutObject(const std::string& key, std::string_view data);
  Status ReadInto(const std::string& key, uint64_t offset, uint64_t len, char* dst);
  Status CheckRangeReply(const std::string& key, uint64_t offset, uint64_t len,
                         const S3Reply& reply);
  // The HEAD answer, or nullopt for a missing object.
  Result<std::optional<HttpResponse>> Head(const std::string& key);
  Status TooShort(const std::string& key, uint64_t offset, uint64_t len, uint64_t size) const;

  S3Client client_;
  internal::SpoolDir spool_;
};

Status S3Store::PutObject(const std::string& key, std::string_view data) {
  S3Call call{.op = "PutObject", .method = "PUT", .key = key};
  call.body = data;
  call.checksum = true;
  S3Reply reply = client_.Call(call);
  if (!reply.ok()) return client_.ErrorStatus(reply, call);
  return Status::Ok();
}

Status S3Store::Put(const std::string& key, std::string_view data) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  if (data.size() <= client_.options().part_size) return PutObject(key, data);
  return internal::UploadMultipart(
      client_, key, data.size(),
      [data](uint64_t offset, uint64_t len, std::string*) -> Result<std::string_view> {
        return data.substr(offset, len);
      });
}

Status S3Store::PutFile(const std::string& key, const std::string& path) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_RDONLY));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat " + path, errno);
  const auto size = static_cast<uint64_t>(st.st_size);
  const int raw_fd = fd.get();
  auto read = [&](uint64_t offset, uint64_t len, std::string* scratch) -> Result<std::string_view> {
    scratch->resize(len);
    RETURN_IF_ERROR(PreadExact(raw_fd, scratch->data(), len, offset, path, [&](uint64_t n) {
      return IOError("spool file " + path + " shrank while uploaded to object " + key + " (" +
                     std::to_string(offset + n) + " of " + std::to_string(size) + " bytes)");
    }));
    return std::string_view(*scratch);
  };
  if (size > client_.options().part_size) {
    RETURN_IF_ERROR(internal::UploadMultipart(client_, key, size, read));
  } else {
    std::string scratch;
    ASSIGN_OR_RETURN(std::string_view data, read(0, size, &scratch));
    RETURN_IF_ERROR(PutObject(key, data));
  }
  RETURN_IF_ERROR(fd.Close(path));
  if (::unlink(path.c_str()) != 0) return ErrnoStatus("unlink " + path, errno);
  return Status::Ok();
}

Status S3Store::CreateExclusive(const std::string& key, std::string_view data) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  S3Call call{.op = "PutObject If-None-Match", .method = "PUT", .key = key};
  call.headers = {"If-None-Match: *"};
  call.body = data;
  call.checksum = true;
  S3Reply reply = client_.Call(call);
  if (reply.ok()) return Status::Ok();
  const bool conflict = reply.status_is(412);
  Status failed = conflict ? client_.AlreadyExistsStatus(key) : client_.ErrorStatus(reply, call);
  if (reply.attempts == 1) return failed;
  // An earlier attempt may have created the object and lost its answer, and
  // the retries then met 412 or kept failing: the bytes tell whether the
  // object is ours. Reporting a failure for a create that happened would
  // make the caller publish the same thing twice.
  auto existing = Get(key);
  if (existing.ok()) return *existing == data ? Status::Ok() : client_.AlreadyExistsStatus(key);
  if (conflict) {
    return existing.status().WithContext("create " + key + ": reading back after a retry");
  }
  if (existing.status().code() == Code::kNotFound) return failed;
  return Status(failed.code(), failed.message() + "; whether it was created is unknown: " +
                                   existing.status().message());
}

Result<std::string> S3Store::Get(const std::string& key) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  S3Call call{.op = "GetObject", .method = "GET", .key = key};
  call.checksum = true;
  S3Reply reply = client_.Call(call);
  if (!reply.ok()) return client_.ErrorStatus(reply, call);
  return std::move(reply.http.body);
}

Status S3Store::TooShort(const std::string& key, uint64_t offset, uint64_t len,
                         uint64_t size) const {
  return Corruption("object " + key + " in store " + Describe() + " is " + std::to_string(size) +
                    " bytes, shorter than the requested range [" + std::to_string(offset) + ", " +
                    std::to_string(offset + len) + ")");
}

Status S3Store::ReadInto(const std::string& key, uint64_t offset, uint64_t len, char* dst) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  if (len > UINT64_MAX - offset) {
    return InvalidArgument("range of object " + key + " overflows: offset " +
                           std::to_string(offset) + ", length " + std::to_string(len));
  }
  if (len == 0) {  // S3 has no empty ranges: check the size instead
    ASSIGN_OR_RETURN(std::optional<uint64_t> size, Size(key));
    if (!size) return client_.NotFoundStatus(key);
    if (*size < offset) return TooShort(key, offset, len, *size);
    return Status::Ok();
  }
  S3Call call{.op = "GetObject Range", .method = "GET", .key = key};
  call.headers = {"Range: bytes=" + std::to_string(offset) + "-" +
                  std::to_string(offset + len - 1)};
  call.into = dst;
  call.into_len = len;
  S3Reply reply = client_.Call(call);
  return CheckRangeReply(key, offset, len, reply);
}

Status S3Store::CheckRangeReply(const std::string& key, uint64_t offset, uint64_t len,
                                const S3Reply& reply) {
  S3Call call{.op = "GetObject Range", .method = "GET", .key = key};
  const ContentRange range = ParseContentRange(reply.http.Header("content-range"));
  if (reply.status_is(416)) {  // the range starts at or past the end
    std::optional<uint64_t> size = range.total;
    if (!size) {
      ASSIGN_OR_RETURN(size, Size(key));
    }
    if (!size) return client_.NotFoundStatus(key);
    return TooShort(key, offset, len, *size);
  }
  if (!reply.ok()) return client_.ErrorStatus(reply, call);
  const uint64_t got = reply.http.body_bytes;
  if (reply.http.status == 200 && offset != 0) {
    return IOError("S3 GetObject of object " + key + " in store " + Describe() +
                   " ignored the Range header (HTTP 200)");
  }
  if (reply.http.status == 206 && range.first != offset) {
    return IOError("S3 GetObject of object " + key + " in store " + Describe() +
                   " answered a different range (Content-Range " +
                   internal::PrintableText(*reply.http.Header("content-range"), 80) + ")");
  }
  if (got == len) return Status::Ok();
  const uint64_t total = reply.http.status == 200 ? got : range.total.value_or(UINT64_MAX);
  if (total < offset + len) return TooShort(key, offset, len, total);
  return IOError("S3 GetObject of object " + key + " in store " + Describe() + " returned " +
                 std::to_string(got) + " of the " + std::to_string(len) + " bytes requested");
}

Result<std::string> S3Store::GetRange(const std::string& key, uint64_t offset, uint64_t len) {
  if (len > UINT64_MAX - offset) return ReadInto(key, offset, len, nullptr);  // the overflow error
  std::string out(len, '\0');
  RETURN_IF_ERROR(ReadInto(key, offset, len, out.data()));
  return out;
}

Status S3Store::ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) {
  return ReadInto(key, offset, len, static_cast<char*>(dst));
}

Result<std::optional<HttpResponse>> S3Store::Head(const std::string& key) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  S3Call call{.op = "HeadObject", .method = "HEAD", .key = key};
  S3Reply reply = client_.Call(call);
  if (reply.status_is(404)) return std::optional<HttpResponse>();
  if (!reply.ok()) return client_.ErrorStatus(reply, call);
  return std::optional<HttpResponse>(std::move(reply.http));
}

Result<std::optional<uint64_t>> S3Store::Size(const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<HttpResponse> head, Head(key));
  if (!head) return std::optional<uint64_t>();
  const std::string* length = head->Header("content-length");
  auto size = length ? ParseDecimal(*length) : std::nullopt;
  if (!size) {
    return IOError("S3 HeadObject of object " + key + " in store " + Describe() +
                   ": no valid Content-Length");
  }
  return std::optional<uint64_t>(*size);
}

Result<int64_t> S3Store::ModifiedTime(const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<HttpResponse> head, Head(key));
  if (!head) return client_.NotFoundStatus(key);
  const std::string* date = head->Header("last-modified");
  auto seconds = date ? internal::ParseHttpDate(*date) : std::nullopt;
  if (!seconds) {
    return IOError("S3 HeadObject of object " + key + " in store " + Describe() +
                   ": no valid Last-Modified");
  }
  return *seconds;
}

// The metadata a copy of the object must carry over: its checksum (a copy
// with REPLACE keeps only what the request sends).
std::vector<std::string> KeptMetadata(const HttpResponse& head) {
  const std::string* sha = head.Header(internal::kChecksumHeader);
  if (sha == nullptr || sha->size() != 64 ||
      sha->find_first_not_of("0123456789abcdef") != std::string::npos) {
    return {};
  }
  return {std::string(internal::kChecksumHeader) + ": " + *sha};
}

Status S3Store::Touch(const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<HttpResponse> head, Head(key));
  if (!head) return client_.NotFoundStatus(key);
  const std::string* length = head->Header("content-length");
  const std::optional<uint64_t> size = length ? ParseDecimal(*length) : std::nullopt;
  if (!size) {
    return IOError("S3 HeadObject of object " + key + " in store " + Describe() +
                   ": no valid Content-Length");
  }
  std::vector<std::string> metadata = KeptMetadata(*head);
  if (*size > client_.options().max_copy_bytes) {
    return internal::CopyMultipart(client_, key, *size, metadata);
  }
  S3Call call{.op = "CopyObject", .method = "PUT", .key = key};
  call.headers = {"x-amz-copy-source: " + internal::CopySource(client_, key),
                  "x-amz-metadata-directive: REPLACE"};
  call.headers.insert(call.headers.end(), metadata.begin(), metadata.end());
  call.error_in_200 = true;
  S3Reply reply = client_.Call(call);
  if (!reply.ok()) return client_.ErrorStatus(reply, call);
  return internal::CheckResultRoot(reply.http.body, "CopyObjectResult")
      .WithContext("S3 CopyObject of object " + key + " in store " + Describe());
}

Status S3Store::Delete(const std::string& key) {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  S3Call call{.op = "DeleteObject", .method = "DELETE", .key = key};
  S3Reply reply = client_.Call(call);
  if (reply.ok() || (reply.status_is(404) && reply.code != "NoSuchBucket")) return Status::Ok();
  return client_.ErrorStatus(reply, call);
}

Result<internal::ListObjectsPage> S3Store::ListPage(const std::string& prefix, int max_keys,
                                                    const std::string& token,
                                                    const std::string& start_after, bool grammar,
                                                    std::vector<std::string>* keys) {
  S3Call call{.op = "ListObjectsV2", .method = "GET"};
  call.query = {{"list-type", "2"},
                {"max-keys", std::to_string(max_keys)},
                {"prefix", client_.ObjectKey(prefix)}};
  if (!token.empty()) call.query.emplace_back("continuation-token", token);
  if (!start_after.empty()) call.query.emplace_back("start-after", client_.ObjectKey(start_after));
  // A listing that does not parse (cut short, or a proxy's page in a 200),
  // or that is damaged (store/listing_check.h), is asked for again, like a
  // truncated body.
  call.check_body = [this, &prefix, &start_after, grammar](std::string_view body) {
    auto page = internal::ParseListObjectsV2(body);
    if (!page.ok()) return page.status().message();
    return CheckPage(prefix, *page, start_after, grammar);
  };
  S3Reply reply = client_.Call(call);
  if (!reply.ok()) return client_.ErrorStatus(reply, call);
  auto list = internal::ParseListObjectsV2(reply.http.body);
  if (!list.ok()) return list.status().WithContext("list " + Describe());
  for (const std::string& object : list->keys) {
    auto key = client_.StoreKey(object);
    // Keys outside the grammar (console "folder/" markers, foreign
    // objects) are not part of the store, as on a local directory; with
    // `grammar`, CheckPage has refused them.
    if (key && key->starts_with(prefix) && ValidateObjectKey(*key).ok()) {
      keys->push_back(std::move(*key));
    }
  }
  return list;
}

std::string S3Store::CheckPage(const std::string& prefix, const internal::ListObjectsPage& page,
                               const std::string& start_after, bool grammar) const {
  if (page.truncated && page.next_token.empty()) {
    return "the page is truncated but gives no continuation token";
  }
  std::vector<std::string> keys;
  for (const std::string& object : page.keys) {
    auto key = client_.StoreKey(object);
    if (!key) return "key \"" + object + "\" is outside the store's prefix";
    if (grammar && *key == prefix && prefix.ends_with('/')) continue;  // a "folder/" marker
    keys.push_back(std::move(*key));
  }
  if (std::string why = CheckListedPage(prefix, keys, start_after, grammar); !why.empty()) {
    return "the listing of " + prefix + " is damaged: " + why;
  }
  return "";
}

Result<std::vector<std::string>> S3Store::ListOnce(const std::string& prefix, bool grammar) {
  std::vector<std::string> keys;
  std::string token;
  for (int page = 0; page < kMaxListPages; ++page) {
    const size_t before = keys.size();
    ASSIGN_OR_RETURN(auto list,
                     ListPage(prefix, client_.options().list_page_size, token, "", grammar, &keys));
    // Each page starts after the last key of the one before (S3 lists in
    // byte order): a page that does not belongs to another listing.
    if (before > 0 && keys.size() > before && keys[before] <= keys[before - 1]) {
      return Corruption("the listing of " + prefix + " in store " + Describe() +
                        " is damaged: page " + std::to_string(page + 1) + " starts at \"" +
                        keys[before] + "\", not after \"" + keys[before - 1] + "\"");
    }
    if (!list.truncated) {
      std::sort(keys.begin(), keys.end());
      return keys;
    }
    if (list.next_token.empty() || list.next_token == token) {
      return Corruption("the listing of " + prefix + " in store " + Describe() +
                        " is damaged: page " + std::to_string(page + 1) +
                        " is truncated but gives no new continuation token");
    }
    token = std::move(list.next_token);
  }
  return Corruption("S3 ListObjectsV2 of store " + Describe() + " returned too many pages");
}

Result<std::vector<std::string>> S3Store::List(const std::string& prefix) {
  return ListChain(prefix, /*grammar=*/false);
}

Result<std::vector<std::string>> S3Store::ListStoreKeys(const std::string& prefix) {
  return ListChain(prefix, /*grammar=*/true);
}

Result<std::vector<std::string>> S3Store::ListChain(const std::string& prefix, bool grammar) {
  RETURN_IF_ERROR(ValidateObjectKeyPrefix(prefix));
  // A broken chain of pages is listed again from the start, with the
  // backoff of a request (pages that do not parse were retried already).
  const S3RetryPolicy& policy = client_.options().retry;
  const int attempts = std::max(1, policy.max_attempts);
  uint64_t random = static_cast<uint64_t>(::time(nullptr)) ^ reinterpret_cast<uintptr_t>(this);
  for (int attempt = 1;; ++attempt) {
    auto keys = ListOnce(prefix, grammar);
    if (keys.ok() || keys.status().code() != Code::kCorruption) return keys;
    if (attempt >= attempts) {
      return IOError("listing " + prefix + " of store " + Describe() + " failed " +
                     std::to_string(attempts) +
                     " times; the last attempt: " + keys.status().message());
    }
    random = random * 6364136223846793005ULL + 1442695040888963407ULL;
    std::this_thread::sleep_for(internal::BackoffDelay(attempt, policy, random >> 11));
  }
}

Result<KeyPage> S3Store::ListAfter(const std::string& prefix, const std::string& start_after,
                                   int max_keys) {
  RETURN_IF_ERROR(ValidateObjectKeyPrefix(prefix));
  if (!start_after.empty()) RETURN_IF_ERROR(ValidateObjectKeyPrefix(start_after));
  if (max_keys < 1 || max_keys > 1000) {
    return InvalidArgument("list of store " + Describe() + ": max_keys must be 1 to 1000");
  }
  KeyPage page;
  ASSIGN_OR_RETURN(auto list,
                   ListPage(prefix, max_keys, "", start_after, /*grammar=*/true, &page.keys));
  std::sort(page.keys.begin(), page.keys.end());
  page.truncated = list.truncated;
  return page;
}

Result<uint64_t> S3Store::RemoveStaleTemp(int64_t min_age_seconds) {
  ASSIGN_OR_RETURN(uint64_t removed, spool_.RemoveStale(min_age_seconds));
  if (!client_.options().abort_stale_uploads) return removed;
  ASSIGN_OR_RETURN(uint64_t aborted,
                   internal::AbortStaleUploads(client_, min_age_seconds, ::time(nullptr)));
  return removed + aborted;
}

}  // namespace

Result<S3Location> ParseS3Uri(const std::string& uri) {
  if (!uri.starts_with("s3://")) return InvalidArgument("\"" + uri + "\" is not an s3:// URI");
  std::string rest = uri.substr(5);
  const size_t slash = rest.find('/');
  S3Location loc{rest.substr(0, slash), slash == std::string::npos ? "" : rest.substr(slash + 1)};
  while (loc.prefix.ends_with('/')) loc.prefix.pop_back();
  RETURN_IF_ERROR(CheckBucket(loc.bucket).WithContext("store " + uri));
  if (!loc.prefix.empty()) {
    RETURN_IF_ERROR(ValidateObjectKey(loc.prefix).WithContext("store " + uri + ": prefix"));
  }
  return loc;
}

namespace internal {

Result<std::unique_ptr<ObjectStore>> OpenS3StoreWithTransport(
    const std::string& bucket, const std::string& prefix, const S3Options& options,
    std::unique_ptr<HttpTransport> transport) {
  const std::string uri = "s3://" + bucket + (prefix.empty() ? "" : "/" + prefix);
  RETURN_IF_ERROR(CheckBucket(bucket).WithContext("store " + uri));
  if (!prefix.empty()) {
    RETURN_IF_ERROR(ValidateObjectKey(prefix).WithContext("store " + uri + ": prefix"));
  }
  if (options.part_size < kMinPartSize || options.part_size > (uint64_t{5} << 30)) {
    return InvalidArgument("store " + uri + ": S3 part size " + std::to_string(options.part_size) +
                           " is outside [5 MiB, 5 GiB]");
  }
  for (uint64_t size : {options.max_copy_bytes, options.copy_part_size}) {
    if (size < kMinPartSize || size > (uint64_t{5} << 30)) {
      return InvalidArgument("store " + uri + ": S3 copy size " + std::to_string(size) +
                             " is outside [5 MiB, 5 GiB]");
    }
  }
  if (options.parallel_parts < 1 || options.parallel_parts > 64) {
    return InvalidArgument("store " + uri + ": parallel parts must be 1 to 64");
  }
  if (options.list_page_size < 1 || options.list_page_size > 1000) {
    return InvalidArgument("store " + uri + ": the list page size must be 1 to 1000");
  }
  S3Options o = options;
  if (o.spool_dir.empty()) o.spool_dir = DefaultCacheDir() + "/spool";
  return std::unique_ptr<ObjectStore>(new S3Store(o, bucket, prefix, std::move(transport)));
}

}  // namespace internal

Result<std::unique_ptr<ObjectStore>> OpenS3Store(const std::string& bucket,
                                                 const std::string& prefix,
                                                 const S3Options& options, bool create) {
  (void)create;  // prefixes need no creating, and buckets are not dte's to create
  return internal::OpenS3StoreWithTransport(bucket, prefix, options,
                                            internal::NewCurlTransport(options));
}

}  // namespace dte
