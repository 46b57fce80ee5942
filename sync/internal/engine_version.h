// Making a built version visible: the last steps every publisher shares
// (CommitDirectory in sync/commit.cc and the AdamW-inverting Publisher in
// sync/publisher.cc).
//
// Thread-safety: stateless; the Store and BlobSink passed in follow their own
// rules (one BlobSink per version being built).
#pragma once

#include <optional>
#include <vector>

#include "store/manifest.h"
#include "store/status.h"
#include "store/store.h"
#include "sync/internal/blob_sink.h"

namespace dte::internal {

// Fills m's stats from its files and the blobs `sink` added, stores the block
// table, and creates m's manifest exclusively: the version exists exactly
// when this returns Ok. Fails with AlreadyExists, writing no manifest, when
// the store's latest version is no longer `expected_latest` (another
// publisher committed meanwhile, so m's parent is stale) or when m.version
// was taken. On success the version is also remembered in the store's caches.
Status PublishVersion(Store* store, BlobSink* sink, Manifest* m,
                      const std::vector<BlockRecord>& records,
                      const std::optional<uint64_t>& expected_latest);

}  // namespace dte::internal
