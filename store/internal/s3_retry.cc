#include "store/internal/s3_retry.h"

#include <algorithm>

namespace dte::internal {

bool IsRetryable(TransportError error, long http_status, std::string_view s3_code) {
  switch (error) {
    case TransportError::kNone:
      break;
    case TransportError::kFatal:
      return false;
    case TransportError::kConnect:
    case TransportError::kTimeout:
    case TransportError::kReset:
    case TransportError::kBadBody:
    case TransportError::kChecksum:
      return true;
  }
  for (std::string_view code : {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable",
                                "ConditionalRequestConflict", "OperationAborted"}) {
    if (s3_code == code) return true;
  }
  switch (http_status) {
    case 408:
    case 429:
    case 500:
    case 502:
    case 503:
    case 504:
      return true;
    default:
      return false;
  }
}

std::chrono::milliseconds BackoffDelay(int retry, const S3RetryPolicy& policy, uint64_t random) {
  const int64_t base = std::max<int64_t>(0, policy.base_delay.count());
  const int64_t cap = std::max<int64_t>(0, policy.max_delay.count());
  int64_t ceiling = base;
  for (int i = 1; i < retry && ceiling > 0 && ceiling < cap; ++i) ceiling *= 2;
  ceiling = std::min(ceiling, cap);
  return std::chrono::milliseconds(static_cast<int64_t>(random % (uint64_t(ceiling) + 1)));
}

}  // namespace dte::internal
