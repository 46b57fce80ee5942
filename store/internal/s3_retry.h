// Which failed S3 requests are worth retrying, and how long to wait.
//
// Retried: no answer (connect failure, reset, timeout or stall, truncated
// body, a body that fails its stored checksum), HTTP 500, 502, 503, 504, 429 and 408, and the S3 error codes
// SlowDown, RequestTimeout, InternalError, ServiceUnavailable,
// ConditionalRequestConflict and OperationAborted whatever their status
// (CompleteMultipartUpload and CopyObject can fail inside a 200).
// Everything else (403, 404, 412, other 4xx, misconfiguration) fails at once.
//
// Backoff is exponential with full jitter: before retry n (1-based) wait a
// uniformly random time in [0, min(max_delay, base_delay * 2^(n-1))].
//
// Thread-safety: pure functions.
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "store/internal/s3_http.h"
#include "store/s3_store.h"

namespace dte::internal {

// `s3_code` is the <Code> of an error body ("" if none).
bool IsRetryable(TransportError error, long http_status, std::string_view s3_code);

// The wait before retry `retry` (1-based), from a uniform random `random`.
std::chrono::milliseconds BackoffDelay(int retry, const S3RetryPolicy& policy, uint64_t random);

}  // namespace dte::internal
