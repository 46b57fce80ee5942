// Materializer: any byte range of any file of any version.
//
// Bytes of a safetensors file come from its header blob and, for the data
// section, from blocks: a block at version v is its nearest dense record
// back along the parent chain with every later sparse record applied in
// order; the walk also stops at a version with a full table (a policy
// anchor that kept its delta) or with a join table (store/manifest.h,
// JoinTable), whose dense record ends it unless the base holds the parent's
// block; a join table whose blobs are gone (pruned by a newer one) is
// skipped and the walk goes on. With a BlockBase (SetBase), the walk stops earlier: at the first
// version, starting with v itself, whose block the base holds, so the cost
// of a block is bounded by the distance to the nearest version the base
// holds instead of the distance to the anchor. Only the blocks overlapping
// the requested range are decoded, and every block is checked against its
// XXH3-64 from the version's block table before a byte of it is returned: a
// mismatch is Corruption, never wrong bytes.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"

namespace dte {

struct ReadCounters {
  std::atomic<uint64_t> blocks{0};         // blocks materialized
  std::atomic<uint64_t> records{0};        // dense or sparse records decoded
  std::atomic<uint64_t> payload_bytes{0};  // record bytes read from blobs
  std::atomic<uint64_t> hash_failures{0};  // blocks whose content hash did not match
  std::atomic<uint64_t> base_blocks{0};    // blocks whose walk started from the BlockBase
  std::atomic<uint64_t> join_blocks{0};    // blocks read from a join table
};

// Fully materialized blocks of some versions, kept outside the store (see
// store/snapshot.h), that a Materializer may start a chain walk from.
//
// Thread-safety: implementations must allow concurrent calls.
class BlockBase {
 public:
  virtual ~BlockBase() = default;

  // Fills dst with the `len` bytes of block record `record` of v and returns
  // true if the base holds that block and its content hashes to
  // v.records[record].hash; false (dst unspecified) otherwise.
  virtual bool ReadBlock(const Version& v, size_t record, uint64_t len, uint8_t* dst) = 0;
};

// A version and its ancestors, newest first: chain[i + 1] is the parent of
// chain[i]. A reader that holds one reads the parents from it rather than
// from the store, so it keeps reading after they left the store (while gc's
// grace period keeps their blobs).
using VersionChain = std::vector<std::shared_ptr<const Version>>;

class Materializer {
 public:
  explicit Materializer(Store* store) : store_(store) {}

  // Blocks are looked up in `base` (not owned; null: none) at every version
  // of a chain walk. The base must outlive every read that may use it.
  void SetBase(BlockBase* base) { base_.store(base); }

  // Reads [offset, offset + len) of `file` (a file of version v) into dst.
  // The range must lie within the file.
  Status ReadFile(const std::shared_ptr<const Version>& v, const FileEntry& file, uint64_t offset,
                  uint64_t len, uint8_t* dst);

  // The full content of block `block` of tensor `tensor` of `file` into dst
  // (the block's length: block_bytes, or less for a tensor's last block).
  // With `chain` (whose first element is v), parents come from it. A block
  // whose bytes do not match its hash is read once more from the store
  // (past the blob cache) before Corruption says a blob is corrupt.
  Status ReadBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                   const TensorEntry& tensor, uint32_t block, uint8_t* dst,
                   const VersionChain* chain = nullptr);

  // Block `block` of `tensor` from v's full table alone (v must have one),
  // checked against v's block hash: a reader that verifies the full table
  // itself, not the chain.
  Status ReadFullBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                       const TensorEntry& tensor, uint32_t block, uint8_t* dst);
  // The same from `join`, a join table of v (Store::JoinOf).
  Status ReadJoinBlock(const std::shared_ptr<const Version>& v, const LoadedJoin& join,
                       const FileEntry& file, const TensorEntry& tensor, uint32_t block,
                       uint8_t* dst);

  // v and its ancestors back to the first self-contained one (an anchor or
  // a version with a full table) or, with `stop_at_joins`, to the first
  // with a join table (what a read of v's blocks walks; live apply, which
  // composes the deltas between two versions, needs them all), as far as
  // they load from the store now (a parent that does not load ends the
  // chain early).
  VersionChain ChainOf(std::shared_ptr<const Version> v, bool stop_at_joins = false);

  // The content of a raw file or a safetensors header, verified against its
  // hash.
  Result<std::string> ReadWholeBlob(const Hash128& blob, uint64_t size, const std::string& what);

  // Streams the whole file in order to `sink(file_offset, data, len)`: a
  // safetensors file's header as one piece, then its data section in chunks
  // of up to 16 MiB (across tensor boundaries) whose blocks are materialized
  // in parallel; `sink` runs on a helper thread, one call at a time, while
  // the next chunk is materialized. Every block is checked against its hash before it is passed
  // on, and a raw file against its blob hash. With `check_tensor_hashes`
  // each tensor's XXH3-128 is checked too; a mismatch fails on the chunk
  // that ends the tensor, so callers that must not expose a partial result
  // write to a temp place.
  using Sink = std::function<Status(uint64_t, const uint8_t*, size_t)>;
  Status StreamFile(const std::shared_ptr<const Version>& v, const FileEntry& file,
                    const Sink& sink, bool check_tensor_hashes = true);

  ReadCounters& counters() { return counters_; }

  // The payload of one of v's block records, from its blob (checked as
  // every read is); `what` names the block in errors.
  Status ReadRecordPayload(const Version& v, const BlockRecord& rec, std::string* out,
                           const std::string& what) {
    return ReadRecord(v, rec, out, what);
  }

 private:
  Status ReadData(const std::shared_ptr<const Version>& v, const FileEntry& file, uint64_t offset,
                  uint64_t len, uint8_t* dst);
  Status StreamData(const std::shared_ptr<const Version>& v, const FileEntry& file,
                    const Sink& sink, bool check_tensor_hashes);
  Status ReadRecord(const Version& v, const BlockRecord& rec, std::string* out,
                    const std::string& what);
  // A dense record's block (len bytes) into dst; `blobs` are the ones its
  // table points into (the manifest's, or its full table's).
  Status ReadDense(const std::vector<BlobRef>& blobs, const BlockRecord& rec, int width,
                   uint8_t* dst, uint64_t len, const std::string& what);
  // The parent of `cur`, found `depth` hops from the start of a walk: from
  // `chain` when it holds it, else from the store.
  // A dense record of a table that stands alone (full or join), checked
  // against v's block hash; `table` names it in errors.
  Status ReadStandalone(const Version& v, const std::vector<BlobRef>& blobs,
                        const std::vector<BlockRecord>& records, const FileEntry& file,
                        const TensorEntry& tensor, uint32_t block, uint8_t* dst, const char* table);
  // ReadBlock's chain walk; with `use_joins`, it may end at a join table
  // (*from_join: whose, when it did).
  Status WalkBlock(const std::shared_ptr<const Version>& v, const FileEntry& file,
                   const TensorEntry& tensor, uint32_t block, uint8_t* dst,
                   const VersionChain* chain, bool use_joins, std::optional<uint64_t>* from_join);
  Result<std::shared_ptr<const Version>> ParentOf(const Version& cur, size_t depth,
                                                  const VersionChain* chain);
  // Drops the blob cache's chunks holding the records block `record` of v
  // is built from, so that the next read fetches them from the store (a
  // chunk of a large blob is checked only by its readers' block hashes).
  void DropCachedRecords(const std::shared_ptr<const Version>& v, size_t record,
                         const VersionChain* chain);

  Store* store_;
  std::atomic<BlockBase*> base_{nullptr};
  ReadCounters counters_;
};

}  // namespace dte
