// Encoding one BF16 tensor of a new version from FP32 AdamW state, without
// the previous version's bytes: the core of the AdamW-inverting publisher
// (sync/publish/publisher.h).
//
// The tensor is processed in chunks of kEngineBlocksPerChunk blocks, the
// blocks of a chunk in parallel: cast theta to BF16 (block and tensor hashes
// come from these bytes, exactly as CommitDirectory hashes a saved
// checkpoint), find the candidates, establish each candidate's old bits (the
// screen's signed estimate, sync/publish/internal/engine_screen.h, or the exact
// resolution, kernels/adamw_resolve_math.h), and encode each block as a
// kSparse payload (differences where the old bits are known, whole values
// where not), or dense when that is smaller. With the screen, cast, screen
// and resolution are one pass over kScreenStride elements at a time, so the
// state is read from memory once; the tensor hash of each chunk runs in
// parallel with the next chunk's blocks. Memory: about 4 bytes per element
// of one chunk with the screen (the casts of two chunks; 14 with the fused
// detector), whatever the tensor or model size.
//
// Thread-safety: not thread-safe; one per publish. Uses the kernels thread
// pool internally.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/adamw.h"
#include "store/base/status.h"
#include "store/manifest.h"
#include "store/write/blob_sink.h"
#include "sync/publish/internal/engine_screen.h"
#include "sync/push/changes.h"

namespace dte::internal {

inline constexpr uint32_t kEngineBlocksPerChunk = 16;
// Elements the screen's path screens, casts and resolves in one go: 48 KiB
// of state, small enough to stay in a core's L1/L2 between the passes.
inline constexpr size_t kScreenStride = 4096;

struct BlockEntries;     // one block's resolved entries (engine_encoder.cc)
class FullTableBuilder;  // store/write/version_writer.h

struct EngineCounts {
  uint64_t flagged = 0;          // candidates the screen or fused detector reported
  uint64_t false_positives = 0;  // of those, proven unchanged and dropped
  uint64_t uncertain = 0;        // stored whole: old bits not provable
  uint64_t changed = 0;          // entries stored (proven changes + uncertain)
  uint64_t resolved = 0;         // candidates that needed the exact resolution
};

class EngineEncoder {
 public:
  // screen: find candidates with the rigorous screen
  // (sync/publish/internal/engine_screen.h); otherwise with the fused detector
  // kernels::AdamWInvertDetect and its near-boundary margin of margin_ulps.
  EngineEncoder(uint64_t block_bytes, uint32_t margin_ulps, bool screen);

  // The step's parameters for the following EncodeTensor calls (valid:
  // kernels::AdamWParamsError empty).
  void SetParams(const kernels::AdamWParams& params);
  // Also encode every block of the following EncodeTensor calls dense into
  // `full` (a policy anchor's full table; not owned); null: stop.
  void SetFull(FullTableBuilder* full) { full_ = full; }
  // Also append every stored entry of the following EncodeTensor calls to
  // `changes` (flat element index, new BF16 bits, and the old bits where
  // proven, in index order; not owned), as a push sends them
  // (sync/push/push_server.h); null: stop. The proven old bits are the
  // parent's elements (old_exact): the version's sparse records and the
  // push's differences are taken over them.
  void SetChanges(TensorChanges* changes) {
    changes_ = changes;
    if (changes_) changes_->old_exact = true;
  }

  // Encodes the BF16 tensor t from theta, m, v (t->elements() FP32 values
  // each): sets t->hash and t->changed, fills records[0, t->blocks) (t's
  // records) and appends their payloads to spool, which is blob `blob_index`
  // of the version.
  Status EncodeTensor(const float* theta, const float* m, const float* v, TensorEntry* t,
                      BlockRecord* records, Spool* spool, uint32_t blob_index,
                      EngineCounts* counts);

 private:
  // Encodes block `slot` of the current chunk (theta, m, v start at the
  // chunk; the block holds block_elems elements and detector entries
  // [entry_begin, entry_end)) into encoded_[slot].
  void EncodeBlock(const float* theta, const float* m, const float* v, uint64_t block_elems,
                   size_t entry_begin, size_t entry_end, size_t slot, EngineCounts* counts);

  // The screen's path: screens block `slot` and casts it into cast_
  // kScreenStride elements at a time (ScreenAndCast), resolving each
  // stride's candidates while its state is still in cache.
  void ScreenBlock(const float* theta, const float* m, const float* v, uint64_t block_elems,
                   size_t slot, EngineCounts* counts);

  // Encodes block `slot`'s resolved entries e into encoded_[slot].
  void FinishBlock(const BlockEntries& e, uint64_t block_elems, size_t slot, EngineCounts* counts);

  // Moves chunk's encoded_ blocks (per_block: their counts) into records
  // and spool, adding to *tensor_changed and counts.
  // `first_record` is records[0]'s index in the version's block table.
  Status AppendChunk(const std::vector<EngineCounts>& per_block, BlockRecord* records,
                     size_t first_record, uint64_t first_element, Spool* spool, uint32_t blob_index,
                     uint64_t* tensor_changed, EngineCounts* counts);

  uint64_t block_bytes_;
  kernels::AdamWParams params_;
  kernels::AdamWScalars scalars_;
  kernels::AdamWDetectOptions detect_;
  bool screen_;
  ScreenScalars screen_scalars_;
  std::vector<uint16_t> cast_;       // BF16 of the chunk
  std::vector<uint16_t> prev_cast_;  // BF16 of the previous chunk, for the tensor hash
  std::vector<uint64_t> idx_;        // detector output: chunk-relative indices
  std::vector<uint16_t> new_bits_;   // detector output: new BF16 bits
  std::vector<EncodedBlock> encoded_;
  FullTableBuilder* full_ = nullptr;
  TensorChanges* changes_ = nullptr;
  // The chunk's entries per block when changes_ is set: block-relative
  // indices and new bits.
  struct BlockChanges {
    std::vector<uint32_t> idx;
    std::vector<uint16_t> now, was;
    std::vector<uint8_t> known;
  };
  std::vector<BlockChanges> block_changes_;
  std::vector<EncodedBlock> full_encoded_;  // the chunk's blocks, dense, for full_
};

}  // namespace dte::internal
