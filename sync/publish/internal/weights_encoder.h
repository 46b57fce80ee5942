// Encoding one BF16 tensor of a new version from the trainer's new weights
// and the parent version's bytes: the publisher's path for any optimizer
// and any precision (Publisher::PublishWeights, sync/publish/publisher.h).
//
// Where the AdamW path (engine_encoder.h) reconstructs the previous weights
// from the optimizer state, this one reads them: each block of the parent's
// tensor comes from this host's snapshot of a recent version plus the deltas
// since (store/snapshot.h), else from the store, and is compared with the
// new weights cast to BF16 (round to nearest even, as torch's .to(bfloat16)).
// Every changed element is found and its old bits are exact, so the
// version, and a push's differences, are exactly what `dtectl commit` of
// the same weights saved as safetensors would give.
//
// The tensor is processed kWeightsBlocksPerChunk blocks at a time, the
// blocks of a chunk in parallel: memory is the new and old bytes of one
// chunk (about 2 x 16 block sizes), whatever the tensor or model size.
//
// Thread-safety: not thread-safe; one per publish. Uses the kernels thread
// pool internally.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "store/base/status.h"
#include "store/delta_codec.h"
#include "store/manifest.h"
#include "store/write/blob_sink.h"
#include "sync/push/changes.h"

namespace dte {

class Materializer;
class SnapshotWriter;
struct Version;

namespace internal {

class FullTableBuilder;  // store/write/version_writer.h

inline constexpr uint32_t kWeightsBlocksPerChunk = 16;

// Where the weights of one tensor are: `data` holds the tensor's elements
// in `dtype` (BF16 or F32, C-contiguous, caller-owned).
struct WeightsInput {
  const void* data = nullptr;
  DType dtype = DType::kBF16;
};

class WeightsEncoder {
 public:
  // reader: reads the parent's blocks (not owned; thread-safe reads).
  WeightsEncoder(Materializer* reader, std::shared_ptr<const Version> parent, uint64_t block_bytes);

  // Also encode every block of the following tensors dense into `full` (a
  // policy anchor's or join table; not owned); null: stop.
  void SetFull(FullTableBuilder* full) { full_ = full; }
  // Also append every changed element (flat index, new and old bits, all
  // known) to `changes` (not owned), as a push sends them; null: stop.
  void SetChanges(TensorChanges* changes) {
    changes_ = changes;
    if (changes_) changes_->old_exact = true;
  }
  // Also write each block's new bytes to `snapshot` (the new version's,
  // not owned); null: stop. The first failed write is returned by
  // snapshot_error() and stops the writes; the publish goes on.
  void SetSnapshot(SnapshotWriter* snapshot) { snapshot_ = snapshot; }
  const Status& snapshot_error() const { return snapshot_error_; }

  // Encodes tensor t of the new version (a copy of the parent's entry
  // `parent_t` of file `parent_file`, same dtype BF16 and shape) from `in`:
  // sets t->hash and t->changed, fills records[0, t->blocks) and appends
  // their payloads to spool (blob `blob_index` of the version).
  Status EncodeTensor(const WeightsInput& in, const FileEntry& parent_file,
                      const TensorEntry& parent_t, TensorEntry* t, BlockRecord* records,
                      Spool* spool, uint32_t blob_index);

  // Bytes of the parent read so far.
  uint64_t parent_bytes() const { return parent_bytes_; }

 private:
  // Casts or copies block `b` of the chunk starting at element e0 into
  // now_, reads the parent's block into old_ and encodes it.
  Status EncodeBlock(const WeightsInput& in, const FileEntry& parent_file,
                     const TensorEntry& parent_t, uint64_t e0, uint32_t block, size_t slot,
                     uint64_t elems, BlockRecord* record);
  // Appends slot's changed elements (chunk-relative base e0) to changes_.
  void CollectChanges(size_t slot, uint64_t first_element, uint64_t elems);

  Materializer* reader_;
  std::shared_ptr<const Version> parent_;
  uint64_t block_bytes_;
  std::vector<uint16_t> now_, old_;  // one chunk, new and parent bits
  std::vector<EncodedBlock> encoded_, full_encoded_;
  FullTableBuilder* full_ = nullptr;
  TensorChanges* changes_ = nullptr;
  SnapshotWriter* snapshot_ = nullptr;
  Status snapshot_error_;
  uint64_t parent_bytes_ = 0;
};

}  // namespace internal
}  // namespace dte
