// The Publisher's ranged publish: phase 6 (commit): the owners send their records and
// blobs to rank 0, which writes the block table and, last, the manifest,
// and tells every rank the outcome (sync/publish/publisher.h).
//
// A part, rank r to rank 0 (little-endian, sync/publish/internal/dist_wire.h):
//   status, flagged u64, kept u64, dropped u64,
//   2 x (present u8 [hash, size u64, added u8]): the delta and full blobs,
//   then, when the status is ok: tensors u64, and per tensor
//   index u32, hash, changed u64, its records, and its full records when
//   the version gets a full table.
// The outcome, rank 0 to every rank: status and the PublishResult's fields
// (EncodeOutcome).
#include <chrono>
#include <utility>

#include "store/store.h"
#include "store/write/blob_sink.h"
#include "store/write/version_writer.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/publisher.h"

namespace dte {

using dist_internal::AllToAllMove;
using dist_internal::Detected;
using dist_internal::Encoded;
using dist_internal::Plan;
using dist_internal::Reader;
using dist_internal::Writer;

namespace {

std::string EncodePart(const Detected& d, const Encoded& e) {
  Writer part;
  part.PutStatus(e.status);
  part.Put<uint64_t>(d.flagged);
  part.Put<uint64_t>(d.kept);
  part.Put<uint64_t>(e.dropped);
  for (const auto* b : {&e.delta_blob, &e.full_blob}) {
    part.Put<uint8_t>(b->has_value());
    if (b->has_value()) {
      part.PutHash((*b)->hash);
      part.Put<uint64_t>((*b)->size);
      part.Put<uint8_t>((*b)->added);
    }
  }
  if (e.status.ok()) {
    part.Put<uint64_t>(e.owned.size());
    for (const auto& [ti, groups] : e.owned) {
      part.Put<uint32_t>(static_cast<uint32_t>(ti));
      part.PutHash(e.hashes[ti]);
      part.Put<uint64_t>(e.changed[ti]);
      for (const BlockRecord& rec : e.recs[ti]) part.PutRecord(rec);
      for (const BlockRecord& rec : e.full_recs[ti]) part.PutRecord(rec);
    }
  }
  return std::move(part.out());
}

// The new version as rank 0 assembles it from the parts.
struct Assembly {
  explicit Assembly(const Plan& p) {
    const Manifest& pm = p.pm();
    m.version = p.latest + 1;
    m.parent = p.latest;
    m.created = NowRfc3339();
    m.block_bytes = pm.block_bytes;
    m.files = pm.files;
    for (auto& f : m.files) {
      for (auto& te : f.tensors) te.changed = 0;
    }
    records = p.parent->records;
    for (auto& rec : records) rec = BlockRecord{BlockKind::kSame, 0, 0, 0, 0, rec.hash};
    full_records.resize(p.full ? records.size() : 0);
    full_done.assign(full_records.size(), 0);
  }
  Manifest m;
  std::vector<BlockRecord> records, full_records;
  std::vector<char> full_done;
  FullTable ft;
  uint64_t uncertain_dropped = 0;
};

// A part's counts and blobs; blob_at: each blob's index in the manifest's
// (delta) or the full table's blobs.
Status ReadPartHead(Reader& rd, const Plan& p, int r, internal::BlobSink& sink, Assembly& a,
                    PublishResult* res, std::optional<uint32_t> blob_at[2]) {
  const std::string bad = p.at_step + ": the part of rank " + std::to_string(r) + " is malformed";
  Status failed;
  uint64_t fl = 0, kp = 0, dr = 0;
  if (!rd.GetStatus(&failed) || !rd.Get(&fl) || !rd.Get(&kp) || !rd.Get(&dr)) {
    return Corruption(bad);
  }
  if (!failed.ok()) return failed.WithContext(p.at_step + ": rank " + std::to_string(r));
  res->flagged += fl;
  res->false_positives += fl - kp;
  a.uncertain_dropped += dr;
  for (int k = 0; k < 2; ++k) {
    uint8_t present = 0;
    if (!rd.Get(&present)) return Corruption(bad);
    if (!present) continue;
    BlobRef ref;
    uint8_t added = 0;
    if (!rd.GetHash(&ref.hash) || !rd.Get(&ref.size) || !rd.Get(&added)) {
      return Corruption(bad);
    }
    ref.added = added != 0;
    sink.Include(ref);
    auto& blobs = k == 0 ? a.m.blobs : a.ft.blobs;
    blob_at[k] = static_cast<uint32_t>(blobs.size());
    blobs.push_back(ref);
  }
  return Status::Ok();
}

// One tensor of rank r's part: its hash, changed count and records.
Status ReadPartTensor(Reader& rd, const Plan& p, int r, const std::optional<uint32_t> blob_at[2],
                      Assembly& a, PublishResult* res) {
  const std::string bad = p.at_step + ": the part of rank " + std::to_string(r) + " is malformed";
  uint32_t ti = 0;
  Hash128 hash;
  uint64_t ch = 0;
  if (!rd.Get(&ti) || ti >= p.tensors.size() || p.tensors[ti].owner != r || !rd.GetHash(&hash) ||
      !rd.Get(&ch)) {
    return Corruption(bad);
  }
  const Plan::Tensor& pt = p.tensors[ti];
  TensorEntry& te = a.m.files[pt.file].tensors[pt.index];
  te.hash = hash;
  te.changed = ch;
  for (int pass = 0; pass < (p.full ? 2 : 1); ++pass) {
    for (uint32_t b = 0; b < te.blocks; ++b) {
      BlockRecord rec;
      if (!rd.GetRecord(&rec)) return Corruption(bad);
      const bool payload = rec.kind != BlockKind::kSame;
      if (payload && !blob_at[pass]) return Corruption(bad);
      if (payload) rec.blob = *blob_at[pass];
      if (pass == 0) {
        a.records[te.first_block + b] = rec;
      } else {
        a.full_records[te.first_block + b] = rec;
        a.full_done[te.first_block + b] = 1;
      }
    }
  }
  if (pt.named) res->tensors++, res->elements += te.elements();
  return Status::Ok();
}

Status ReadPart(const std::string& part, const Plan& p, int r, internal::BlobSink& sink,
                Assembly& a, PublishResult* res) {
  Reader rd(part);
  std::optional<uint32_t> blob_at[2];
  RETURN_IF_ERROR(ReadPartHead(rd, p, r, sink, a, res, blob_at));
  const std::string bad = p.at_step + ": the part of rank " + std::to_string(r) + " is malformed";
  uint64_t n = 0;
  if (!rd.Get(&n)) return Corruption(bad);
  for (uint64_t k = 0; k < n; ++k) RETURN_IF_ERROR(ReadPartTensor(rd, p, r, blob_at, a, res));
  if (!rd.done()) return Corruption(bad);
  return Status::Ok();
}

// The full (or join) table's block table, from every rank's full records.
Status FinishFullTable(const Plan& p, internal::BlobSink& sink, Assembly& a) {
  for (size_t r = 0; r < a.full_records.size(); ++r) {
    if (!a.full_done[r]) {
      return Internal(p.at_step + ": no rank wrote full record " + std::to_string(r));
    }
    a.full_records[r].hash = a.records[r].hash;
  }
  ASSIGN_OR_RETURN(a.ft.block_table,
                   sink.PutBytes(p.join ? JoinBlobHeader(a.m.version, kJoinTablePart) +
                                              EncodeBlockTable(a.full_records)
                                        : EncodeBlockTable(a.full_records)));
  a.m.full = std::move(a.ft);
  return Status::Ok();
}

void EncodeOutcome(const Status& s, const PublishResult& res, Writer* outcome) {
  outcome->PutStatus(s);
  outcome->Put(res.version);
  outcome->Put(res.parent);
  outcome->Put(res.tensors);
  outcome->Put(res.elements);
  outcome->Put(res.changed);
  outcome->Put(res.flagged);
  outcome->Put(res.false_positives);
  outcome->Put(res.stored_bytes);
  outcome->Put(res.state_bytes);
  outcome->Put(res.full_bytes);
  outcome->Put<uint8_t>(res.full_table);
  outcome->PutString(res.anchor_reason);
  outcome->PutString(res.join_reason);
  outcome->Put<uint8_t>(res.join_table);
  outcome->Put(res.join_bytes);
  outcome->PutString(res.join_error);
}

Result<PublishResult> DecodeOutcome(const std::string& text, const std::string& at_step) {
  Reader rd(text);
  Status failed;
  PublishResult res;
  uint8_t full_table = 0, join_table = 0;
  if (!rd.GetStatus(&failed) || !rd.Get(&res.version) || !rd.Get(&res.parent) ||
      !rd.Get(&res.tensors) || !rd.Get(&res.elements) || !rd.Get(&res.changed) ||
      !rd.Get(&res.flagged) || !rd.Get(&res.false_positives) || !rd.Get(&res.stored_bytes) ||
      !rd.Get(&res.state_bytes) || !rd.Get(&res.full_bytes) || !rd.Get(&full_table) ||
      !rd.GetString(&res.anchor_reason) || !rd.GetString(&res.join_reason) ||
      !rd.Get(&join_table) || !rd.Get(&res.join_bytes) || !rd.GetString(&res.join_error)) {
    return Corruption(at_step + ": rank 0's outcome is malformed");
  }
  RETURN_IF_ERROR(failed);
  res.full_table = full_table != 0;
  res.join_table = join_table != 0;
  return res;
}

}  // namespace

// 6. Commit: the parts to rank 0, which commits; every rank learns the
// outcome.
Result<PublishResult> Publisher::Commit(Transport& t, const Plan& p, const Detected& d,
                                        Encoded& e) {
  parts_sent_ = std::chrono::steady_clock::now();
  std::vector<std::string> to(p.world);
  to[0] = EncodePart(d, e);
  ASSIGN_OR_RETURN(auto in,
                   AllToAllMove(t, std::move(to), p.at_step + ": collecting the parts", &stats_));
  Writer outcome;
  if (p.rank == 0) {
    PublishResult res;
    Status s = CommitParts(p, in, e.sink, &res);
    EncodeOutcome(s, res, &outcome);
  }
  to.assign(p.world, p.rank == 0 ? outcome.out() : std::string());
  ASSIGN_OR_RETURN(in,
                   AllToAllMove(t, std::move(to), p.at_step + ": learning the outcome", &stats_));
  ASSIGN_OR_RETURN(PublishResult res, DecodeOutcome(in[0], p.at_step));
  if (p.rank != 0) {
    // Learn the new version now: a listing cached by this rank's store must
    // not make its next publish see a stale latest.
    store_->GetVersion(res.version).status().IgnoreError();
  }
  return res;
}

// Rank 0: the version from every rank's part, written block table first and
// manifest last.
Status Publisher::CommitParts(const Plan& p, const std::vector<std::string>& parts,
                              internal::BlobSink& sink, PublishResult* res) {
  Assembly a(p);
  for (int r = 0; r < p.world; ++r) RETURN_IF_ERROR(ReadPart(parts[r], p, r, sink, a, res));
  if (p.full) RETURN_IF_ERROR(FinishFullTable(p, sink, a));
  static const std::vector<BlockRecord> kNone;
  internal::JoinOutcome join_out;
  RETURN_IF_ERROR(internal::PublishVersion(store_.get(), &sink, &a.m, a.records,
                                           p.full ? a.full_records : kNone, p.parent_distance,
                                           p.latest, p.join, &join_out));
  // Committed: a retry of this step, after a rank missed the outcome,
  // returns this version (Agree).
  last_step_ = p.h.step;
  last_version_ = a.m.version;
  res->version = a.m.version;
  res->parent = p.latest;
  res->changed = a.m.stats.changed_elements;
  res->false_positives += a.uncertain_dropped;
  res->stored_bytes = a.m.stats.stored_bytes;
  res->state_bytes = res->elements * 3 * sizeof(float);
  res->full_table = p.full && !p.join;
  res->anchor_reason = p.tables.anchor_reason;
  if (res->full_table) {
    for (const auto& b : a.m.full->blobs) res->full_bytes += b.size;
  }
  res->join_reason = p.tables.join_reason;
  res->join_table = join_out.written;
  res->join_bytes = join_out.bytes;
  res->join_error = join_out.error;
  return Status::Ok();
}

}  // namespace dte
