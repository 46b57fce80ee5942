#include "sync/publish/internal/weights_encoder.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "kernels/bf16.h"
#include "kernels/parallel.h"
#include "store/hash.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/write/version_writer.h"

namespace dte::internal {
namespace {

constexpr int kWidth = 2;  // BF16

}  // namespace

WeightsEncoder::WeightsEncoder(Materializer* reader, std::shared_ptr<const Version> parent,
                               uint64_t block_bytes)
    : reader_(reader), parent_(std::move(parent)), block_bytes_(block_bytes) {}

Status WeightsEncoder::EncodeBlock(const WeightsInput& in, const FileEntry& parent_file,
                                   const TensorEntry& parent_t, uint64_t e0, uint32_t block,
                                   size_t slot, uint64_t elems, BlockRecord* record) {
  const uint64_t block_elems = block_bytes_ / kWidth;
  uint16_t* now = now_.data() + slot * block_elems;
  uint16_t* old = old_.data() + slot * block_elems;
  const uint64_t first = e0 + slot * block_elems;  // the block's first element
  if (in.dtype == DType::kF32) {
    kernels::CastFp32ToBf16(static_cast<const float*>(in.data) + first, now, elems);
  } else {
    std::memcpy(now, static_cast<const uint16_t*>(in.data) + first, elems * kWidth);
  }
  const auto* now_bytes = reinterpret_cast<const uint8_t*>(now);
  record->hash = HashBlock(now_bytes, elems * kWidth);
  RETURN_IF_ERROR(
      reader_->ReadBlock(parent_, parent_file, parent_t, block, reinterpret_cast<uint8_t*>(old)));
  thread_local CodecScratch scratch;
  encoded_[slot] = dte::EncodeBlock(reinterpret_cast<const uint8_t*>(old), now_bytes,
                                    elems * kWidth, kWidth, &scratch);
  if (full_) full_encoded_[slot] = full_->Encode(now_bytes, elems * kWidth, kWidth, &scratch);
  return Status::Ok();
}

void WeightsEncoder::CollectChanges(size_t slot, uint64_t first_element, uint64_t elems) {
  const uint64_t block_elems = block_bytes_ / kWidth;
  const uint16_t* now = now_.data() + slot * block_elems;
  const uint16_t* old = old_.data() + slot * block_elems;
  for (uint64_t i = 0; i < elems; ++i) {
    if (now[i] == old[i]) continue;
    changes_->indices.push_back(first_element + i);
    const auto* n = reinterpret_cast<const uint8_t*>(now + i);
    const auto* o = reinterpret_cast<const uint8_t*>(old + i);
    changes_->values.insert(changes_->values.end(), n, n + kWidth);
    changes_->old_values.insert(changes_->old_values.end(), o, o + kWidth);
    changes_->known.push_back(1);
  }
}

Status WeightsEncoder::EncodeTensor(const WeightsInput& in, const FileEntry& parent_file,
                                    const TensorEntry& parent_t, TensorEntry* t,
                                    BlockRecord* records, Spool* spool, uint32_t blob_index) {
  const uint64_t block_elems = block_bytes_ / kWidth;
  const uint64_t n = t->elements();
  Hasher128 hasher;
  t->changed = 0;
  for (uint32_t first = 0; first < t->blocks; first += kWeightsBlocksPerChunk) {
    const uint32_t nblocks = std::min(kWeightsBlocksPerChunk, t->blocks - first);
    const uint64_t e0 = uint64_t{first} * block_elems;
    const uint64_t len = std::min<uint64_t>(uint64_t{nblocks} * block_elems, n - e0);
    now_.resize(size_t{nblocks} * block_elems);
    old_.resize(size_t{nblocks} * block_elems);
    encoded_.assign(nblocks, EncodedBlock{});
    if (full_) full_encoded_.assign(nblocks, EncodedBlock{});
    std::vector<Status> errors(nblocks);
    auto elems_of = [&](size_t b) { return std::min(block_elems, len - b * block_elems); };
    kernels::ParallelFor(nblocks, 1, [&](size_t lo, size_t hi) {
      for (size_t b = lo; b < hi; ++b) {
        errors[b] = EncodeBlock(in, parent_file, parent_t, e0, first + static_cast<uint32_t>(b), b,
                                elems_of(b), &records[first + b]);
      }
    });
    for (size_t b = 0; b < nblocks; ++b) {
      RETURN_IF_ERROR(errors[b].WithContext("tensor " + t->name));
    }
    parent_bytes_ += len * kWidth;
    hasher.Update(now_.data(), len * kWidth);
    if (snapshot_ && snapshot_error_.ok()) {
      snapshot_error_ =
          snapshot_->Write(size_t{t->first_block} + first,
                           reinterpret_cast<const uint8_t*>(now_.data()), len * kWidth);
    }
    for (size_t b = 0; b < nblocks; ++b) {
      if (changes_ && encoded_[b].changed > 0) CollectChanges(b, e0 + b * block_elems, elems_of(b));
      t->changed += encoded_[b].changed;
      RETURN_IF_ERROR(AppendEncodedBlock(encoded_[b], blob_index, spool, &records[first + b]));
      if (full_)
        RETURN_IF_ERROR(full_->Append(size_t{t->first_block} + first + b, full_encoded_[b]));
    }
  }
  t->hash = hasher.Finish();
  return Status::Ok();
}

}  // namespace dte::internal
