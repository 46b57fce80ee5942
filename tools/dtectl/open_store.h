// Opening the store for a dtectl command, with the blob cache for s3://
// stores, and the one retry that cache needs.
//
// Thread-safety: functions of the command's main thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "store/base/status.h"
#include "store/store.h"
#include "tools/dtectl/commands.h"

namespace dte::cli {

// How a command reads blob data of an s3:// store.
enum class BlobReads {
  kCached,     // through the blob cache, which also keeps what is uploaded
  kFromStore,  // always from the store (verify: it checks the store's bytes)
};

// Opens c.store. With kCached, an s3:// store reads blobs through a
// CachedStore in CACHE_DIR/<store_id>/blobs, bounded by
// c.blob_cache_bytes, and keeps the blobs it uploads there (write-through),
// so the next commit reads its parent from local disk. The cache lives in
// the store's index, which one process holds at a time: if another process
// (dtefs, dtectl) holds it, the command runs without the cache and says so
// on stderr, prefixed "dtectl CMD: note:".
Result<std::unique_ptr<Store>> OpenStore(const Common& c, const char* cmd, bool create,
                                         BlobReads reads);

// Drops the cached chunks of the data blobs of `version` and every version
// of its chain. A chunk of a blob larger than a chunk is checked only by
// its readers' block hashes, so one that came in damaged is found as a
// Corruption of the read that used it; the command then drops and retries.
void DropCachedChain(Store& store, uint64_t version);

// True if a command that failed with `s` should run once more: it failed as
// corruption and read through a blob cache (whose suspect chunks the
// caller has dropped).
bool RetryAfterCorruption(Store& store, const Status& s);

}  // namespace dte::cli
