#include "tools/dtectl/open_store.h"

#include <iostream>
#include <set>

#include "store/cached_store.h"
#include "store/manifest.h"

namespace dte::cli {

Result<std::unique_ptr<Store>> OpenStore(const Common& c, const char* cmd, bool create,
                                         BlobReads reads) {
  StoreOptions o;
  o.uri = c.store;
  o.cache_dir = c.cache_dir;
  o.create = create;
  // Commands work from the store itself when another process holds the
  // index; only reindex insists on it.
  o.index_optional = true;
  o.blob_cache_bytes = reads == BlobReads::kCached ? c.blob_cache_bytes : 0;
  o.blob_chunk_bytes = c.blob_chunk_bytes;
  // A command cannot go on without a listing: a store that cannot be
  // reached now is listed again, with backoff, before it fails.
  o.patient_listing = true;
  ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Open(o));
  if (o.blob_cache_bytes > 0 && o.uri.starts_with("s3://") && store->blob_cache() == nullptr) {
    std::cerr << "dtectl " << cmd << ": note: the cache index in " << store->CachePath()
              << " is in use by another process; running without the blob cache (blob reads "
                 "go to the store, uploads are not kept locally)\n";
  }
  return store;
}

void DropCachedChain(Store& store, uint64_t version) {
  CachedStore* cache = store.blob_cache();
  if (cache == nullptr) return;
  std::set<uint64_t> seen;
  for (std::optional<uint64_t> v = version; v && seen.insert(*v).second;) {
    auto got = store.GetVersion(*v);
    if (!got.ok()) return;
    const Manifest& m = (*got)->manifest;
    for (const BlobRef& b : m.blobs) cache->Drop(BlobKey(b.hash), 0, UINT64_MAX);
    v = m.parent;
  }
}

bool RetryAfterCorruption(Store& store, const Status& s) {
  return s.code() == Code::kCorruption && store.blob_cache() != nullptr;
}

}  // namespace dte::cli
