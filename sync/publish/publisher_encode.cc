// The Publisher's ranged publish: phase 5 (encoding): the owner of each tensor reads its
// parent blocks, applies the entries routed to it, hashes blocks and tensor
// and encodes each block as dtectl commit does, into its own blobs
// (sync/publish/publisher.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "kernels/parallel.h"
#include "store/delta_codec.h"
#include "store/hash.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "store/write/blob_sink.h"
#include "store/write/version_writer.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/publisher.h"

namespace dte {

using dist_internal::Detected;
using dist_internal::Encoded;
using dist_internal::Group;
using dist_internal::kEntryBytes;
using dist_internal::kOwnerBlocksPerChunk;
using dist_internal::Plan;
using dist_internal::Reader;

namespace {

// Indexes the groups of entries each rank routed to this rank's tensors.
Status IndexRouted(const Plan& p, const std::vector<std::string>& in, Encoded& e) {
  for (int r = 0; r < p.world; ++r) {
    Reader rd(in[r]);
    while (!rd.done()) {
      uint32_t ti = 0, count = 0;
      uint64_t base = 0;
      if (!rd.Get(&ti) || !rd.Get(&base) || !rd.Get(&count) || !e.owned.count(ti)) {
        return Corruption("rank " + std::to_string(r) +
                          " routed changed elements this rank does not own");
      }
      const char* at = rd.data();
      const size_t bytes = size_t{count} * kEntryBytes;
      if (!rd.Skip(bytes)) {
        return Corruption("rank " + std::to_string(r) +
                          " routed a truncated group of entries of tensor " +
                          p.tensors[ti].entry->name);
      }
      e.owned[ti].push_back({r, base, std::string_view(at, bytes)});
    }
  }
  return Status::Ok();
}

// Encodes the tensors this rank owns, a chunk of blocks at a time, as
// dtectl commit does: records against the parent and, for a full or join
// table, every block again, into this rank's blobs.
class OwnerEncoder {
 public:
  OwnerEncoder(const Plan& p, Encoded& e, Store* store, DistPublishStats* stats)
      : p_(p), e_(e), reader_(store), snapshots_(OpenStoreSnapshots(*store)), stats_(stats) {
    reader_.SetBase(snapshots_.get());
  }

  Status Start();
  // Tensor ti's entries, from the groups routed to it.
  Status Unpack(size_t ti, const std::vector<Group>& groups);
  // Encodes tensor ti with the entries Unpack found; for this rank's push,
  // keeps its elements that differ from the parent in `keep` (or null).
  Status Tensor(size_t ti, TensorChanges* keep);
  Status Finish();

 private:
  uint64_t BlockLen(const TensorEntry& te, uint32_t b) const {
    return std::min<uint64_t>(p_.pm().block_bytes, te.bytes() - uint64_t{b} * p_.pm().block_bytes);
  }
  Status EncodeChunk(size_t ti, uint32_t first, uint32_t count, bool keep);
  Status EncodeBlockAt(size_t ti, uint32_t b, size_t i, bool keep, CodecScratch* scratch);
  void ApplyEntries(const TensorEntry& te, uint32_t b, size_t i, bool keep);
  void KeepChanges(uint32_t count, TensorChanges* keep);
  Status AppendChunk(size_t ti, uint32_t first, uint32_t count, Hasher128* hasher);

  const Plan& p_;
  Encoded& e_;
  Materializer reader_;
  std::unique_ptr<SnapshotSet> snapshots_;
  DistPublishStats* stats_;
  std::unique_ptr<internal::Spool> spool_, full_spool_;
  // The tensor being encoded: its entries as (element << 16 | bits), sorted
  // by element; a chunk of its blocks, before and after them.
  std::vector<uint64_t> entries_;
  std::vector<uint8_t> old_chunk_, new_chunk_;
  std::vector<EncodedBlock> enc_, full_enc_;
  std::vector<std::vector<uint64_t>> keep_idx_;
  std::vector<std::vector<uint16_t>> keep_new_, keep_old_;
};

Status OwnerEncoder::Start() {
  ASSIGN_OR_RETURN(spool_, e_.sink.NewSpool());
  if (!p_.full) return Status::Ok();
  ASSIGN_OR_RETURN(full_spool_, e_.sink.NewSpool());
  if (p_.join) {
    const std::string header = JoinBlobHeader(p_.latest + 1, static_cast<uint32_t>(p_.rank));
    RETURN_IF_ERROR(full_spool_->Append(header.data(), header.size()));
  }
  return Status::Ok();
}

Status OwnerEncoder::Unpack(size_t ti, const std::vector<Group>& groups) {
  const TensorEntry& te = *p_.tensors[ti].entry;
  const uint64_t elements = te.elements();
  if (elements >= uint64_t{1} << 48) {
    return InvalidArgument("tensor " + te.name + " has more than 2^48 elements");
  }
  size_t total = 0;
  for (const Group& g : groups) total += g.entries.size() / kEntryBytes;
  entries_.clear();
  entries_.reserve(total);
  for (const Group& g : groups) {
    Reader rd(g.entries);
    uint32_t offset = 0;
    uint16_t bits = 0;
    while (rd.Get(&offset) && rd.Get(&bits)) {
      if (g.base + offset >= elements) {
        return Corruption("rank " + std::to_string(g.from) +
                          " routed an out-of-range entry of tensor " + te.name);
      }
      entries_.push_back((g.base + offset) << 16 | bits);
    }
  }
  std::sort(entries_.begin(), entries_.end());
  for (size_t k = 1; k < entries_.size(); ++k) {
    if (entries_[k] >> 16 == entries_[k - 1] >> 16) {
      return Corruption("element " + std::to_string(entries_[k] >> 16) + " of tensor " + te.name +
                        " was routed twice");
    }
  }
  return Status::Ok();
}

Status OwnerEncoder::Tensor(size_t ti, TensorChanges* keep) {
  const Plan::Tensor& pt = p_.tensors[ti];
  const TensorEntry& te = *pt.entry;
  const uint64_t bb = p_.pm().block_bytes;
  e_.recs[ti].resize(te.blocks);
  if (p_.full) e_.full_recs[ti].resize(te.blocks);
  Hasher128 hasher;
  for (uint32_t first = 0; first < te.blocks; first += kOwnerBlocksPerChunk) {
    const uint32_t count = std::min(kOwnerBlocksPerChunk, te.blocks - first);
    RETURN_IF_ERROR(EncodeChunk(ti, first, count, keep != nullptr));
    if (keep) KeepChanges(count, keep);
    stats_->parent_bytes_read +=
        std::min<uint64_t>(uint64_t{count} * bb, te.bytes() - uint64_t{first} * bb);
    RETURN_IF_ERROR(AppendChunk(ti, first, count, &hasher));
  }
  e_.hashes[ti] = pt.named ? hasher.Finish() : te.hash;
  if (pt.named) {
    // Routed entries whose bits equal the parent's: the screen could not
    // prove them unchanged, the parent's bytes do.
    e_.dropped += entries_.size() - std::min<uint64_t>(entries_.size(), e_.changed[ti]);
  }
  entries_.clear();
  return Status::Ok();
}

// Reads and encodes blocks [first, first + count) of tensor ti in parallel.
Status OwnerEncoder::EncodeChunk(size_t ti, uint32_t first, uint32_t count, bool keep) {
  const uint64_t bb = p_.pm().block_bytes;
  old_chunk_.resize(size_t{count} * bb);
  new_chunk_.resize(size_t{count} * bb);
  enc_.assign(count, EncodedBlock{});
  full_enc_.assign(count, EncodedBlock{});
  std::vector<Status> errors(count);
  if (keep) {
    keep_idx_.assign(count, {});
    keep_new_.assign(count, {});
    keep_old_.assign(count, {});
  }
  kernels::ParallelFor(count, 1, [&](size_t lo, size_t hi) {
    thread_local CodecScratch scratch;
    for (size_t i = lo; i < hi; ++i) {
      errors[i] = EncodeBlockAt(ti, first + static_cast<uint32_t>(i), i, keep, &scratch);
    }
  });
  for (const auto& e : errors) RETURN_IF_ERROR(e);
  return Status::Ok();
}

// Block b of tensor ti, chunk slot i: the parent's bytes, the new bytes,
// and their encodings (on a worker thread).
Status OwnerEncoder::EncodeBlockAt(size_t ti, uint32_t b, size_t i, bool keep,
                                   CodecScratch* scratch) {
  const Plan::Tensor& pt = p_.tensors[ti];
  const TensorEntry& te = *pt.entry;
  const uint64_t bb = p_.pm().block_bytes, len = BlockLen(te, b);
  const int width = DTypeWidth(te.dtype);
  uint8_t* o = old_chunk_.data() + i * bb;
  uint8_t* nw = new_chunk_.data() + i * bb;
  RETURN_IF_ERROR(reader_.ReadBlock(p_.parent, p_.pm().files[pt.file], te, b, o));
  std::memcpy(nw, o, len);
  if (pt.named) {
    ApplyEntries(te, b, i, keep);
    enc_[i] = EncodeBlock(o, nw, len, width, scratch);
  }
  if (p_.full) full_enc_[i] = internal::EncodeFullTableBlock(p_.join, nw, len, width, scratch);
  return Status::Ok();
}

// The entries of block b written over its new bytes (chunk slot i); with
// `keep`, the ones that differ from the parent recorded with both values.
void OwnerEncoder::ApplyEntries(const TensorEntry& te, uint32_t b, size_t i, bool keep) {
  const uint64_t bb = p_.pm().block_bytes;
  const int width = DTypeWidth(te.dtype);
  const uint8_t* o = old_chunk_.data() + i * bb;
  uint8_t* nw = new_chunk_.data() + i * bb;
  const uint64_t lo_e = uint64_t{b} * (bb / width), hi_e = lo_e + BlockLen(te, b) / width;
  auto it = std::lower_bound(entries_.begin(), entries_.end(), lo_e << 16);
  for (; it != entries_.end() && (*it >> 16) < hi_e; ++it) {
    const uint16_t bits = static_cast<uint16_t>(*it & 0xFFFF);
    const uint64_t at = ((*it >> 16) - lo_e) * 2;
    if (keep) {
      uint16_t was;
      std::memcpy(&was, o + at, 2);
      if (was != bits) {
        keep_idx_[i].push_back(*it >> 16);
        keep_new_[i].push_back(bits);
        keep_old_[i].push_back(was);
      }
    }
    std::memcpy(nw + at, &bits, 2);
  }
}

void OwnerEncoder::KeepChanges(uint32_t count, TensorChanges* keep) {
  keep->old_exact = true;  // read from the parent's blocks (ApplyEntries)
  for (size_t i = 0; i < count; ++i) {
    keep->indices.insert(keep->indices.end(), keep_idx_[i].begin(), keep_idx_[i].end());
    const auto* nb = reinterpret_cast<const uint8_t*>(keep_new_[i].data());
    const auto* ob = reinterpret_cast<const uint8_t*>(keep_old_[i].data());
    keep->values.insert(keep->values.end(), nb, nb + keep_new_[i].size() * 2);
    keep->old_values.insert(keep->old_values.end(), ob, ob + keep_old_[i].size() * 2);
  }
}

// The records of the chunk's blocks, their payloads appended to the spools.
Status OwnerEncoder::AppendChunk(size_t ti, uint32_t first, uint32_t count, Hasher128* hasher) {
  const Plan::Tensor& pt = p_.tensors[ti];
  const TensorEntry& te = *pt.entry;
  const uint64_t bb = p_.pm().block_bytes;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t b = first + i;
    const size_t r = te.first_block + b;
    const uint8_t* nw = new_chunk_.data() + size_t{i} * bb;
    if (pt.named) {
      hasher->Update(nw, BlockLen(te, b));
      BlockRecord& rec = e_.recs[ti][b];
      RETURN_IF_ERROR(internal::AppendEncodedBlock(enc_[i], 0, spool_.get(), &rec));
      rec.hash = rec.kind == BlockKind::kSame ? p_.parent->records[r].hash
                                              : HashBlock(nw, BlockLen(te, b));
      e_.changed[ti] += rec.changed;
    } else {
      e_.recs[ti][b] = BlockRecord{BlockKind::kSame, 0, 0, 0, 0, p_.parent->records[r].hash};
    }
    if (p_.full) {
      RETURN_IF_ERROR(
          internal::AppendEncodedBlock(full_enc_[i], 0, full_spool_.get(), &e_.full_recs[ti][b]));
    }
  }
  return Status::Ok();
}

Status OwnerEncoder::Finish() {
  if (spool_->size() > 0) {
    ASSIGN_OR_RETURN(e_.delta_blob, e_.sink.Finish(std::move(spool_)));
  }
  if (full_spool_ && full_spool_->size() > 0) {
    ASSIGN_OR_RETURN(e_.full_blob, e_.sink.Finish(std::move(full_spool_)));
  }
  return Status::Ok();
}

}  // namespace

// 5. Encoding this rank's tensors; any error goes to rank 0 in the part.
void Publisher::Encode(const Plan& p, const Detected& d, std::vector<std::string>& routed,
                       Encoded& e) {
  const auto start = std::chrono::steady_clock::now();
  for (size_t ti = 0; ti < p.tensors.size(); ++ti) {
    if (p.tensors[ti].owner != p.rank) continue;
    e.owned.emplace(ti, std::vector<Group>{});
    owned_.insert(p.tensors[ti].entry->name);
  }
  stats_.tensors_owned = e.owned.size();
  e.status = d.status;
  if (e.status.ok()) e.status = IndexRouted(p, routed, e);
  e.recs.resize(p.tensors.size());
  e.full_recs.resize(p.tensors.size());
  e.hashes.resize(p.tensors.size());
  e.changed.assign(p.tensors.size(), 0);
  if (e.status.ok()) e.status = EncodeOwned(p, e);
  routed.clear();
  stats_.encode_ns = dist_internal::NanosSince(start);
}

Status Publisher::EncodeOwned(const Plan& p, Encoded& e) {
  OwnerEncoder encoder(p, e, store_.get(), &stats_);
  RETURN_IF_ERROR(encoder.Start());
  uint64_t kept_bytes = 0;
  for (const auto& [ti, groups] : e.owned) {
    const Plan::Tensor& pt = p.tensors[ti];
    const TensorEntry& te = *pt.entry;
    RETURN_IF_ERROR(encoder.Unpack(ti, groups));
    // For this rank's push: the elements that differ from the parent, with
    // both values, block by block, up to the push server's cache_bytes (12
    // bytes per element); the other tensors' changes are read back from
    // the store.
    TensorChanges* keep = nullptr;
    if (push_owned_ && pt.named && DTypeWidth(te.dtype) == 2 && kept_bytes < push_->cache_bytes()) {
      keep = &push_changes_[te.name];
      keep->name = te.name;
    }
    RETURN_IF_ERROR(encoder.Tensor(ti, keep));
    if (keep) kept_bytes += keep->indices.size() * 12;
  }
  return encoder.Finish();
}

}  // namespace dte
