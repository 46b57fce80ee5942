// Opening an S3Store over any HttpTransport: tests put a scripted fake
// where libcurl would be.
//
// Thread-safety: see store/s3_store.h.
#pragma once

#include <memory>
#include <string>

#include "store/base/status.h"
#include "store/internal/s3_http.h"
#include "store/object_store.h"
#include "store/s3_store.h"

namespace dte::internal {

// OpenS3Store with `transport` instead of libcurl.
Result<std::unique_ptr<ObjectStore>> OpenS3StoreWithTransport(
    const std::string& bucket, const std::string& prefix, const S3Options& options,
    std::unique_ptr<HttpTransport> transport);

}  // namespace dte::internal
