// Making a built version visible: the last steps every publisher shares
// (CommitDirectory in store/ops/commit.cc and the AdamW-inverting Publisher in
// sync/publish/publisher.cc).
//
// Thread-safety: stateless; the Store and BlobSink passed in follow their own
// rules (one BlobSink per version being built).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/delta_codec.h"
#include "store/manifest.h"
#include "store/store.h"
#include "store/write/blob_sink.h"

namespace dte::internal {

// The dense record of block `data` in a full table. A join table's is raw:
// a host that joins late reads it at the speed of a copy (decoding zstd
// costs far more than a copy and saves about a fifth of BF16 weights'
// bytes), and only the newest two join tables are kept. An anchor's is
// compressed where that saves an eighth (EncodeBlock without a parent):
// anchors stay in the store.
inline EncodedBlock EncodeFullTableBlock(bool join, const uint8_t* data, size_t len, int width,
                                         CodecScratch* scratch) {
  return join ? EncodeRawBlock(data, len, width) : EncodeBlock(nullptr, data, len, width, scratch);
}

// The full table of a policy anchor being built (store/write/anchor_policy.h): a
// dense record for every block, their payloads in one blob.
//
// Thread-safety: not thread-safe; one per version being built.
class FullTableBuilder {
 public:
  // With `join_version`, the table is a join table of that version
  // (store/manifest.h, JoinTable): its blobs start with the join header.
  static Result<std::unique_ptr<FullTableBuilder>> Start(
      BlobSink* sink, size_t blocks, std::optional<uint64_t> join_version = std::nullopt);
  // The dense record of a block for this table (EncodeFullTableBlock).
  EncodedBlock Encode(const uint8_t* data, size_t len, int width, CodecScratch* scratch) const {
    return EncodeFullTableBlock(join(), data, len, width, scratch);
  }
  // Block `record` as `dense` (from Encode). Records may come in any order,
  // one call at a time.
  Status Append(size_t record, const EncodedBlock& dense);
  // Stores the payload blob and the table, with each record's hash taken
  // from `records` (the version's own table), and sets m->full (a join
  // table too: PublishVersion moves it out of the manifest).
  Status Finish(BlobSink* sink, const std::vector<BlockRecord>& records, Manifest* m);
  bool join() const { return join_version_.has_value(); }
  const std::vector<BlockRecord>& records() const { return records_; }
  uint64_t payload_bytes() const { return spool_ ? spool_->size() : payload_bytes_; }

 private:
  std::unique_ptr<Spool> spool_;
  std::optional<uint64_t> join_version_;
  std::vector<BlockRecord> records_;
  uint64_t payload_bytes_ = 0;
};

// Fills m's stats from its files and the blobs `sink` added, records its
// distance from the nearest self-contained version (`parent_distance`: its
// parent's; ignored for a self-contained m), stores the block
// table, and creates m's manifest exclusively: the version exists exactly
// when this returns Ok. Fails with AlreadyExists, writing no manifest, when
// the store's latest version is no longer `expected_latest` (another
// publisher committed meanwhile, so m's parent is stale) or when m.version
// was taken. On success the version is also remembered in the store's caches.
// `full_records` are the records of m.full (empty without one).
//
// With `join`, m.full is a join table of m (built with a join header): it
// is taken out of the manifest (its bytes do not count in stored_bytes),
// and once the version exists it is stored as m's join object and older
// join tables are pruned (WriteJoinTable). That part cannot fail the
// commit: its outcome goes to *join_out.
struct JoinOutcome {
  bool written = false;
  uint64_t bytes = 0;  // the join table's blobs
  std::string error;   // why it was not written or pruning failed; "" if it was
};
Status PublishVersion(Store* store, BlobSink* sink, Manifest* m,
                      const std::vector<BlockRecord>& records,
                      const std::vector<BlockRecord>& full_records,
                      const AnchorDistance& parent_distance,
                      const std::optional<uint64_t>& expected_latest, bool join = false,
                      JoinOutcome* join_out = nullptr);

// Stores `table` (built with join headers, its blobs in the store) as the
// join table of committed version m at manifest `manifest_key`, then
// deletes join tables beyond the newest kJoinTablesKept and those of
// versions no longer at the revision they were built for, each object
// before its blobs (a crash leaves only blobs, which gc sweeps). A join
// table's blobs are its own (their header names its version), so deleting
// them never touches a version.
Status WriteJoinTable(Store* store, const Manifest& m, const std::string& manifest_key,
                      const FullTable& table);
Status PruneJoinTables(Store* store);

}  // namespace dte::internal
