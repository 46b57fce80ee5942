// S3Store: an ObjectStore in a bucket prefix of any S3-compatible object
// store (AWS S3, MinIO, Ceph RGW, OSS, moto), spoken to over HTTP(S) with
// SigV4 through libcurl. docs/s3.md describes configuration and protocol.
//
// Layout: the object `key` of the store s3://BUCKET/PREFIX is the S3 object
// PREFIX/key (or key when PREFIX is empty), so a local store directory
// copied with `aws s3 sync` is a valid S3 store and the reverse.
//
// Atomicity and durability: S3 PUTs replace objects atomically and are
// durable when acknowledged. CreateExclusive is a PUT with
// `If-None-Match: *`; the server makes exactly one of racing creators win.
// When a retried create sees 412 (a lost response to our own successful
// PUT, or another writer), the object is read back: equal bytes are ours
// (OK), different bytes are AlreadyExists. Objects larger than
// part_size are uploaded with multipart uploads (parts in parallel, each
// part read from the spool file with pread, so memory stays at most
// parallel_parts * part_size); a failed multipart upload is aborted.
//
// Touch is a HEAD and a CopyObject of the object onto itself (keeping its
// checksum metadata); objects above max_copy_bytes, which S3 refuses to
// copy in one request (5 GiB), are copied with a multipart upload of
// UploadPartCopy parts, server side.
//
// Spool files (NewTempPath) live in a local directory, spool_dir (default
// CACHE_DIR/spool, see store/base/units.h), shared by every S3 store of the user;
// PutFile uploads and then deletes them. RemoveStaleTemp deletes old spool
// files and aborts multipart uploads under the prefix older than the age.
//
// Errors: NotFound naming the key (404, NoSuchKey) or the bucket
// (NoSuchBucket); AlreadyExists naming the key (412 on create);
// PermissionDenied naming the key and bucket (403, AccessDenied,
// SignatureDoesNotMatch, InvalidAccessKeyId and the other credential codes);
// Corruption for ranges past the end of an object; DeadlineExceeded for a
// request that stalled or timed out, Unavailable for an endpoint that cannot
// be reached or answers 429/502/503/504 or SlowDown, after the retries (both
// transient, docs/errors.md); IOError for everything else, the
// message naming the operation, the key, the S3 error code and the HTTP
// status. Secrets (secret key, session token, access key id) never appear in
// a message, and neither do signatures, Authorization headers or URLs with
// credentials (none are built: requests are signed in headers).
//
// Listings are checked like bodies (docs/s3.md, "Listings"): a page that
// does not parse, is truncated without a continuation token, holds keys not
// strictly increasing or after the start key, or (ListStoreKeys, ListAfter)
// a key outside the store's grammar is asked for again as a request is;
// a chain of pages that breaks (a token repeated, a page not after the one
// before) is listed again from the start, up to the retry policy's attempts.
//
// Retries: every request is retried with bounded exponential backoff and
// full jitter on 5xx, SlowDown, RequestTimeout, InternalError, 409
// ConditionalRequestConflict, connection failures and resets, timeouts,
// stalls (below low_speed_limit bytes/s for low_speed_time) and bodies
// shorter than their Content-Length; other 4xx fail at once.
//
// Thread-safety: all methods may be called concurrently. Options are copied
// at open and never change.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/object_store.h"

namespace dte {

// One page of keys after a given key: what a follower polls for new
// manifests with a single request. S3 stores implement it as one
// ListObjectsV2 request with `start-after`; decorators of an S3 store
// (store/cached_store.h) forward it. Callers find it with dynamic_cast on
// the ObjectStore and fall back to List when it is missing.
//
// Thread-safety: as the ObjectStore that implements it.
struct KeyPage {
  std::vector<std::string> keys;  // sorted
  bool truncated = false;         // more keys follow the last one
};
class PagedLister {
 public:
  // Up to `max_keys` (1-1000) keys starting with `prefix` that sort after
  // `start_after` (byte order; "" for the first page), in the store's
  // grammar as ObjectStore::ListStoreKeys returns them (a page with a key
  // outside it is asked for again).
  virtual Result<KeyPage> ListAfter(const std::string& prefix, const std::string& start_after,
                                    int max_keys) = 0;

 protected:
  ~PagedLister() = default;
};

struct S3RetryPolicy {
  int max_attempts = 6;  // including the first; at least 1
  std::chrono::milliseconds base_delay{200};
  std::chrono::milliseconds max_delay{10000};
};

// Holds credentials: never print one (there is no operator<< on purpose).
struct S3Options {
  // "http://127.0.0.1:9000", "https://s3.example.com"; empty: AWS, that is
  // https://s3.REGION.amazonaws.com. A URL without scheme gets https://.
  std::string endpoint;
  std::string region = "us-east-1";
  // Empty access_key: anonymous, unsigned requests (public buckets).
  std::string access_key;
  std::string secret_key;
  std::string session_token;  // temporary credentials: sent as x-amz-security-token
  // Path style (ENDPOINT/BUCKET/KEY) or virtual-hosted (BUCKET.HOST/KEY).
  bool path_style = true;

  S3RetryPolicy retry;
  uint64_t part_size = uint64_t{16} << 20;  // multipart above this; >= 5 MiB on AWS
  int parallel_parts = 4;                   // parts in flight per upload
  // Touch copies an object onto itself: one CopyObject up to max_copy_bytes
  // (S3 refuses larger copy sources), a multipart copy (UploadPartCopy) in
  // parts of copy_part_size above. Both 5 MiB to 5 GiB.
  uint64_t max_copy_bytes = uint64_t{5} << 30;
  uint64_t copy_part_size = uint64_t{512} << 20;
  int list_page_size = 1000;  // max-keys of ListObjectsV2 (1-1000)
  // A transfer slower than low_speed_limit bytes/s for low_speed_time is
  // aborted and retried (a stalled connection).
  long low_speed_limit = 1024;
  std::chrono::seconds low_speed_time{30};
  std::chrono::milliseconds connect_timeout{10000};
  // Where NewTempPath puts spool files; empty: DefaultCacheDir() + "/spool".
  std::string spool_dir;
  // RemoveStaleTemp also aborts stale multipart uploads under the prefix.
  bool abort_stale_uploads = true;
};

// Options from the environment, as the AWS CLI reads it:
//  endpoint  endpoint_override, else $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL
//  region    $AWS_REGION, else $AWS_DEFAULT_REGION, else the profile's
//            `region` in $AWS_CONFIG_FILE (~/.aws/config), else us-east-1
//  keys      $AWS_ACCESS_KEY_ID + $AWS_SECRET_ACCESS_KEY (+ $AWS_SESSION_TOKEN),
//            else the profile in $AWS_SHARED_CREDENTIALS_FILE
//            (~/.aws/credentials), else none (anonymous)
//  profile   $AWS_PROFILE, else $AWS_DEFAULT_PROFILE, else "default"
//  style     path style when an endpoint is given, virtual-hosted for AWS;
//            $DTE_S3_ADDRESSING_STYLE=path|virtual overrides
//  spool     $DTE_SPOOL_DIR, else DefaultCacheDir() + "/spool"
//  tuning    $DTE_S3_MAX_ATTEMPTS, $DTE_S3_RETRY_BASE_MS, $DTE_S3_RETRY_MAX_MS,
//            $DTE_S3_LOW_SPEED_TIME (s), $DTE_S3_LOW_SPEED_LIMIT (bytes/s),
//            $DTE_S3_CONNECT_TIMEOUT_MS, $DTE_S3_PART_SIZE (a size such as
//            "8MiB"), $DTE_S3_PARALLEL_PARTS, $DTE_S3_MAX_COPY_SIZE,
//            $DTE_S3_COPY_PART_SIZE override the defaults above
// InvalidArgument naming the variable or file for a bad value (a tuning
// value out of range included), a profile
// named by AWS_PROFILE that does not exist, or half a key pair.
Result<S3Options> S3OptionsFromEnvironment(const std::string& endpoint_override = "");

// "s3://bucket/a/b" -> bucket "bucket", prefix "a/b" ("s3://bucket" and
// "s3://bucket/" have an empty prefix). InvalidArgument for a bad bucket
// name (3-63 of [a-z0-9.-]) or a prefix outside the key grammar.
struct S3Location {
  std::string bucket;
  std::string prefix;
};
Result<S3Location> ParseS3Uri(const std::string& uri);

// Opens the store at s3://bucket/prefix. Sends no request: a missing bucket
// or bad credentials show in the first operation's error. `create` is
// accepted for symmetry with local stores; buckets are never created.
Result<std::unique_ptr<ObjectStore>> OpenS3Store(const std::string& bucket,
                                                 const std::string& prefix,
                                                 const S3Options& options, bool create);

}  // namespace dte
