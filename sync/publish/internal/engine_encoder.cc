#include "sync/publish/internal/engine_encoder.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/adamw_resolve_math.h"
#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "store/delta_codec.h"
#include "store/hash.h"
#include "store/write/version_writer.h"

namespace dte::internal {
namespace {

constexpr int kWidth = 2;  // BF16

}  // namespace

// One block's entries, built per thread: the first `count` of each array.
struct BlockEntries {
  std::vector<uint32_t> idx;
  std::vector<uint16_t> new_bits, old_bits;
  std::vector<uint8_t> known;
  size_t count = 0;
  void Add(uint32_t i, uint16_t now, uint16_t was, bool is_known) {
    if (count == idx.size()) Grow();
    idx[count] = i;
    new_bits[count] = now;
    old_bits[count] = was;
    known[count++] = is_known;
  }
  void Grow() {
    const size_t size = std::max<size_t>(1024, 2 * idx.size());
    idx.resize(size);
    new_bits.resize(size);
    old_bits.resize(size);
    known.resize(size);
  }
};

namespace {

// Resolves candidate i (chunk-relative; block_first is its block's first
// element) and, unless it is proven unchanged, adds it to e.
void AddCandidate(const float* theta, const float* m, const float* v, uint64_t i,
                  uint64_t block_first, const kernels::AdamWScalars& s, BlockEntries* e,
                  EngineCounts* counts) {
  const kernels::ResolvedOld r = kernels::ResolveOldBf16(theta[i], m[i], v[i], s);
  counts->resolved++;
  if (r.state == kernels::OldBits::kUnchanged) {
    counts->false_positives++;
    return;
  }
  e->Add(static_cast<uint32_t>(i - block_first), kernels::Fp32ToBf16Bits(theta[i]), r.bits,
         r.state == kernels::OldBits::kKnown);
  counts->uncertain += r.state == kernels::OldBits::kUnknown;
}

BlockEntries& ThreadEntries() {
  thread_local BlockEntries e;
  e.count = 0;
  return e;
}

}  // namespace

EngineEncoder::EngineEncoder(uint64_t block_bytes, uint32_t margin_ulps, bool screen)
    : block_bytes_(block_bytes), screen_(screen) {
  detect_.report_near_boundary = true;
  detect_.margin_ulps = margin_ulps;
  SetParams(kernels::AdamWParams{});
}

void EngineEncoder::SetParams(const kernels::AdamWParams& params) {
  params_ = params;
  scalars_ = kernels::MakeAdamWScalars(params);
  screen_scalars_ = MakeScreenScalars(scalars_);
}

void EngineEncoder::EncodeBlock(const float* theta, const float* m, const float* v,
                                uint64_t block_elems, size_t entry_begin, size_t entry_end,
                                size_t slot, EngineCounts* counts) {
  BlockEntries& e = ThreadEntries();
  const uint64_t block_first = slot * (block_bytes_ / kWidth);  // chunk-relative
  for (size_t k = entry_begin; k < entry_end; ++k) {
    AddCandidate(theta, m, v, idx_[k], block_first, scalars_, &e, counts);
  }
  FinishBlock(e, block_elems, slot, counts);
}

void EngineEncoder::ScreenBlock(const float* theta, const float* m, const float* v,
                                uint64_t block_elems, size_t slot, EngineCounts* counts) {
  thread_local std::vector<uint32_t> cand(kScreenStride + kScreenSlack);
  thread_local std::vector<uint32_t> old(kScreenStride + kScreenSlack);
  BlockEntries& e = ThreadEntries();
  const uint64_t block_first = slot * (block_bytes_ / kWidth);  // chunk-relative
  const uint64_t block_end = block_first + block_elems;
  for (uint64_t s = block_first; s < block_end; s += kScreenStride) {
    const size_t len = std::min<uint64_t>(kScreenStride, block_end - s);
    const ScreenCounts found = ScreenAndCast(theta + s, m + s, v + s, len, screen_scalars_,
                                             cand.data(), old.data(), cast_.data() + s);
    counts->flagged += found.flagged;
    counts->false_positives += found.flagged - found.kept;
    for (size_t k = 0; k < found.kept; ++k) {
      const uint64_t i = s + cand[k];
      if (old[k] == kScreenUndecided) {
        AddCandidate(theta, m, v, i, block_first, scalars_, &e, counts);
      } else {  // a change the screen proved, with its old bits
        e.Add(static_cast<uint32_t>(i - block_first), cast_[i], static_cast<uint16_t>(old[k]),
              true);
      }
    }
  }
  FinishBlock(e, block_elems, slot, counts);
}

void EngineEncoder::FinishBlock(const BlockEntries& e, uint64_t block_elems, size_t slot,
                                EngineCounts* counts) {
  thread_local CodecScratch scratch;
  const uint64_t block_first = slot * (block_bytes_ / kWidth);  // chunk-relative
  const auto count = static_cast<uint32_t>(e.count);
  counts->changed += count;
  if (changes_) {
    BlockChanges& c = block_changes_[slot];
    c.idx.assign(e.idx.begin(), e.idx.begin() + count);
    c.now.assign(e.new_bits.begin(), e.new_bits.begin() + count);
    c.was.assign(e.old_bits.begin(), e.old_bits.begin() + count);
    c.known.assign(e.known.begin(), e.known.begin() + count);
  }
  EncodedBlock& out = encoded_[slot];
  out = EncodedBlock{};
  if (count == 0) return;  // kSame
  const uint64_t len = block_elems * kWidth;
  out.kind = BlockKind::kSparse;
  out.changed = count;
  out.payload = EncodeSparseEntries(
      e.idx.data(), reinterpret_cast<const uint8_t*>(e.new_bits.data()),
      reinterpret_cast<const uint8_t*>(e.old_bits.data()), e.known.data(), count, kWidth, &scratch);
  if (out.payload.size() <= len / 8) return;
  // Dense can be smaller for a block that changed a lot; encode the new
  // bytes without a parent (dense_zstd or dense_raw by the codec's rules).
  const auto* bytes = reinterpret_cast<const uint8_t*>(cast_.data() + block_first);
  EncodedBlock dense = dte::EncodeBlock(nullptr, bytes, len, kWidth, &scratch);
  if (dense.payload.size() < out.payload.size()) {
    dense.changed = count;
    out = std::move(dense);
  }
}

Status EngineEncoder::EncodeTensor(const float* theta, const float* m, const float* v,
                                   TensorEntry* t, BlockRecord* records, Spool* spool,
                                   uint32_t blob_index, EngineCounts* counts) {
  const uint64_t block_elems = block_bytes_ / kWidth;
  const uint64_t n = t->elements();
  Hasher128 hasher;
  uint64_t prev_len = 0;  // elements of the previous chunk, whose cast is in prev_cast_
  t->changed = 0;
  for (uint32_t first = 0; first < t->blocks; first += kEngineBlocksPerChunk) {
    const uint32_t nblocks = std::min(kEngineBlocksPerChunk, t->blocks - first);
    const uint64_t e0 = uint64_t{first} * block_elems;
    const uint64_t len = std::min<uint64_t>(uint64_t{nblocks} * block_elems, n - e0);
    cast_.swap(prev_cast_);
    cast_.resize(len);
    kernels::AdamWDetectResult found;
    if (!screen_) {
      idx_.resize(len);
      new_bits_.resize(len);
      kernels::CastFp32ToBf16(theta + e0, cast_.data(), len);
      found = kernels::AdamWInvertDetect(theta + e0, m + e0, v + e0, len, params_, detect_,
                                         idx_.data(), new_bits_.data());
      counts->flagged += found.count;
    }
    encoded_.assign(nblocks, EncodedBlock{});
    if (full_) full_encoded_.assign(nblocks, EncodedBlock{});
    if (changes_) block_changes_.assign(nblocks, {});
    std::vector<EngineCounts> per_block(nblocks);
    // Task 0 feeds the previous chunk to the tensor hash (which must see the
    // chunks in order) while the other threads start on this chunk's blocks.
    const size_t hash_task = prev_len > 0 ? 1 : 0;
    kernels::ParallelFor(nblocks + hash_task, 1, [&](size_t lo, size_t hi) {
      for (size_t task = lo; task < hi; ++task) {
        if (task < hash_task) {
          hasher.Update(prev_cast_.data(), prev_len * kWidth);
          continue;
        }
        const size_t b = task - hash_task;
        const uint64_t bb = b * block_elems, be = std::min(len, bb + block_elems);
        if (screen_) {
          // One pass while the block's state is in cache: screen, cast,
          // resolve the candidates.
          ScreenBlock(theta + e0, m + e0, v + e0, be - bb, b, &per_block[b]);
        } else {
          const auto* begin = idx_.data();
          const size_t kb = std::lower_bound(begin, begin + found.count, bb) - begin;
          const size_t ke = std::lower_bound(begin, begin + found.count, be) - begin;
          EncodeBlock(theta + e0, m + e0, v + e0, be - bb, kb, ke, b, &per_block[b]);
        }
        records[first + b].hash = HashBlock(cast_.data() + bb, (be - bb) * kWidth);
        if (full_) {
          full_encoded_[b] = full_->Encode(reinterpret_cast<const uint8_t*>(cast_.data() + bb),
                                           (be - bb) * kWidth, kWidth, nullptr);
        }
      }
    });
    prev_len = len;
    RETURN_IF_ERROR(AppendChunk(per_block, records + first, size_t{t->first_block} + first, e0,
                                spool, blob_index, &t->changed, counts));
  }
  if (prev_len > 0) hasher.Update(cast_.data(), prev_len * kWidth);
  t->hash = hasher.Finish();
  return Status::Ok();
}

Status EngineEncoder::AppendChunk(const std::vector<EngineCounts>& per_block, BlockRecord* records,
                                  size_t first_record, uint64_t first_element, Spool* spool,
                                  uint32_t blob_index, uint64_t* tensor_changed,
                                  EngineCounts* counts) {
  const uint64_t block_elems = block_bytes_ / kWidth;
  for (size_t b = 0; b < per_block.size(); ++b) {
    if (changes_) {
      const BlockChanges& c = block_changes_[b];
      const uint64_t base = first_element + b * block_elems;
      for (uint32_t i : c.idx) changes_->indices.push_back(base + i);
      const auto* now = reinterpret_cast<const uint8_t*>(c.now.data());
      const auto* was = reinterpret_cast<const uint8_t*>(c.was.data());
      changes_->values.insert(changes_->values.end(), now, now + c.now.size() * kWidth);
      changes_->old_values.insert(changes_->old_values.end(), was, was + c.was.size() * kWidth);
      changes_->known.insert(changes_->known.end(), c.known.begin(), c.known.end());
    }
    const EngineCounts& c = per_block[b];
    counts->flagged += c.flagged;
    counts->false_positives += c.false_positives;
    counts->uncertain += c.uncertain;
    counts->changed += c.changed;
    counts->resolved += c.resolved;
    *tensor_changed += c.changed;
    RETURN_IF_ERROR(AppendEncodedBlock(encoded_[b], blob_index, spool, &records[b]));
    if (full_) RETURN_IF_ERROR(full_->Append(first_record + b, full_encoded_[b]));
  }
  return Status::Ok();
}

}  // namespace dte::internal
