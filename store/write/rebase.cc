#include "store/write/rebase.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "kernels/parallel.h"
#include "store/materialize.h"
#include "store/write/anchor_policy.h"
#include "store/write/blob_sink.h"
#include "store/write/version_writer.h"

// A rebase that fails leaves the blobs it added; gc's sweep removes them
// like any unreferenced blob once they are older than its grace window.

namespace dte::internal {
namespace {

using Progress = std::function<void(uint64_t, uint64_t)>;

constexpr uint32_t kBlocksPerChunk = 64;

uint64_t DataBytes(const Manifest& m) {
  uint64_t n = 0;
  for (const auto& f : m.files) {
    for (const auto& t : f.tensors) n += t.bytes();
  }
  return n;
}

// An anchor's every element is new, as for a first import.
void CountAllChanged(Manifest* m) {
  for (auto& f : m->files) {
    for (auto& t : f.tensors) t.changed = t.elements();
  }
}

// Fills the statistics and since_full of m, a new revision whose block table
// and blobs are stored, and creates its manifest exclusively.
Result<AnchorDistance> CreateRevision(Store& store, Manifest* m,
                                      const AnchorDistance& parent_distance) {
  VersionStats& s = m->stats;
  s.changed_elements = 0;
  for (const auto& f : m->files) {
    for (const auto& t : f.tensors) s.changed_elements += t.changed;
  }
  // The blobs this version first stored; a reused full table keeps its flags.
  s.stored_bytes = m->block_table.added ? m->block_table.size : 0;
  for (const auto& b : m->blobs) s.stored_bytes += b.added ? b.size : 0;
  if (m->full && m->parent) {  // a delta's full table (an anchor made of one is counted above)
    s.stored_bytes += m->full->block_table.added ? m->full->block_table.size : 0;
    for (const auto& b : m->full->blobs) s.stored_bytes += b.added ? b.size : 0;
  }
  m->since_full = NextDistance(parent_distance, m->self_contained(), s.stored_bytes);
  RETURN_IF_ERROR(
      store.objects().CreateExclusive(ManifestKey(m->version, m->revision), EncodeManifest(*m)));
  return *m->since_full;
}

// The full table of a policy anchor holds only dense records: as the block
// table of an anchor it needs no new byte.
Result<AnchorDistance> AnchorFromFullTable(Store& store, Manifest m, const Progress& progress) {
  m.parent.reset();
  m.block_table = m.full->block_table;
  m.blobs = m.full->blobs;
  m.full.reset();
  CountAllChanged(&m);
  const uint64_t total = DataBytes(m);
  if (progress) progress(total, total);
  return CreateRevision(store, &m, AnchorDistance{});
}

// Materializes v file by file into one dense blob per safetensors file.
Result<AnchorDistance> StreamedAnchor(Store& store, const std::shared_ptr<const Version>& v,
                                      Manifest m, const Progress& progress) {
  std::vector<BlockRecord> records = v->records;
  BlobSink sink(&store.objects());
  Materializer reader(&store);
  m.parent.reset();
  m.blobs.clear();
  uint64_t total = 0, done = 0;
  for (const auto& f : m.files) total += f.size;
  for (const auto& f : m.files) {
    if (!f.safetensors) continue;
    ASSIGN_OR_RETURN(auto spool, sink.NewSpool());
    RETURN_IF_ERROR(reader.StreamFile(v, f, [&](uint64_t off, const uint8_t* d, size_t n) {
      done += n;
      if (progress) progress(done, total);
      return off < f.header_size ? Status::Ok() : spool->Append(d, n);
    }));
    const uint32_t blob = static_cast<uint32_t>(m.blobs.size());
    ASSIGN_OR_RETURN(BlobRef ref, sink.Finish(std::move(spool)));
    m.blobs.push_back(ref);
    for (const auto& t : f.tensors) {
      for (uint32_t b = 0; b < t.blocks; ++b) {
        BlockRecord& r = records[t.first_block + b];
        r.kind = BlockKind::kDenseRaw;
        r.blob = blob;
        r.offset = t.begin + uint64_t{b} * m.block_bytes;
        r.length = static_cast<uint32_t>(
            std::min<uint64_t>(m.block_bytes, t.bytes() - r.offset + t.begin));
        r.changed = 0;
      }
    }
  }
  CountAllChanged(&m);
  ASSIGN_OR_RETURN(m.block_table, sink.PutBytes(EncodeBlockTable(records)));
  return CreateRevision(store, &m, AnchorDistance{});
}

// Encodes v's blocks against those of `onto`, a chunk of a tensor at a
// time, the way a commit of v's bytes onto `onto` would: every record's
// payload goes into one delta blob, blobs[0].
class DeltaRebase {
 public:
  DeltaRebase(Store& store, std::shared_ptr<const Version> v, std::shared_ptr<const Version> onto,
              bool full, const Progress& progress)
      : full_table_(full),
        store_(store),
        v_(std::move(v)),
        onto_(std::move(onto)),
        progress_(progress),
        sink_(&store.objects()),
        reader_(&store) {}

  Result<AnchorDistance> Run(Manifest m, const AnchorDistance& onto_distance);

 private:
  Status EncodeTensor(const FileEntry& f, const FileEntry& of, size_t tensor, TensorEntry* out);
  Status EncodeChunk(const FileEntry& f, const TensorEntry& t, const FileEntry& of,
                     const TensorEntry& ot, uint32_t first, uint32_t count);

  const bool full_table_;  // also write a full table (a policy anchor)
  std::unique_ptr<FullTableBuilder> full_;
  std::vector<EncodedBlock> dense_;
  Store& store_;
  std::shared_ptr<const Version> v_, onto_;
  const Progress& progress_;
  BlobSink sink_;
  Materializer reader_;
  std::unique_ptr<Spool> spool_;
  std::vector<BlockRecord> records_;
  std::vector<uint8_t> old_, now_;
  std::vector<EncodedBlock> encoded_;
  uint64_t done_ = 0, total_ = 0;
};

Result<AnchorDistance> DeltaRebase::Run(Manifest m, const AnchorDistance& onto_distance) {
  const Manifest& om = onto_->manifest;
  if (!SameTensorLayout(om, m.files, m.block_bytes)) {
    return Internal(VersionName(m.version) + " cannot be a delta of " + VersionName(om.version) +
                    ": their tensor layouts differ");
  }
  m.parent = om.version;
  m.full.reset();
  m.blobs.clear();
  records_.assign(v_->records.size(), BlockRecord{});
  for (size_t r = 0; r < records_.size(); ++r) records_[r].hash = v_->records[r].hash;
  total_ = DataBytes(m);
  ASSIGN_OR_RETURN(spool_, sink_.NewSpool());
  if (full_table_) {
    ASSIGN_OR_RETURN(full_, FullTableBuilder::Start(&sink_, records_.size()));
  }
  for (size_t i = 0; i < m.files.size(); ++i) {
    const FileEntry& f = v_->manifest.files[i];
    if (!f.safetensors) continue;
    auto of = std::find_if(om.files.begin(), om.files.end(),
                           [&](const FileEntry& e) { return e.name == f.name; });
    for (size_t k = 0; k < f.tensors.size(); ++k) {
      RETURN_IF_ERROR(EncodeTensor(f, *of, k, &m.files[i].tensors[k]));
    }
  }
  if (spool_->size() > 0) {  // else nothing changed: no delta blob at all
    ASSIGN_OR_RETURN(BlobRef blob, sink_.Finish(std::move(spool_)));
    m.blobs.push_back(blob);
  }
  if (full_) RETURN_IF_ERROR(full_->Finish(&sink_, records_, &m));
  ASSIGN_OR_RETURN(m.block_table, sink_.PutBytes(EncodeBlockTable(records_)));
  return CreateRevision(store_, &m, onto_distance);
}

Status DeltaRebase::EncodeTensor(const FileEntry& f, const FileEntry& of, size_t tensor,
                                 TensorEntry* out) {
  const TensorEntry& t = f.tensors[tensor];
  for (uint32_t first = 0; first < t.blocks; first += kBlocksPerChunk) {
    const uint32_t count = std::min(kBlocksPerChunk, t.blocks - first);
    RETURN_IF_ERROR(EncodeChunk(f, t, of, of.tensors[tensor], first, count));
  }
  out->changed = 0;
  for (uint32_t b = 0; b < t.blocks; ++b) out->changed += records_[t.first_block + b].changed;
  return Status::Ok();
}

Status DeltaRebase::EncodeChunk(const FileEntry& f, const TensorEntry& t, const FileEntry& of,
                                const TensorEntry& ot, uint32_t first, uint32_t count) {
  const uint64_t bb = v_->manifest.block_bytes;
  const int width = DTypeWidth(t.dtype);
  std::vector<Status> errors(count);
  encoded_.assign(count, EncodedBlock{});
  if (full_) dense_.assign(count, EncodedBlock{});
  old_.resize(size_t{count} * bb);
  now_.resize(size_t{count} * bb);
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < count; ++i) {
    bytes += std::min<uint64_t>(bb, t.bytes() - uint64_t{first + i} * bb);
  }
  kernels::ParallelFor(count, 1, [&](size_t lo, size_t hi) {
    thread_local CodecScratch scratch;
    for (size_t i = lo; i < hi; ++i) {
      const uint32_t b = first + static_cast<uint32_t>(i);
      const size_t r = size_t{t.first_block} + b;
      // Equal block hashes are equal bytes (live apply relies on it too):
      // the encoder would find kSame, so neither block is read (but for a
      // full table, which needs v's every block).
      const bool same = v_->records[r].hash == onto_->records[r].hash;
      if (same && !full_) continue;
      const uint64_t len = std::min<uint64_t>(bb, t.bytes() - uint64_t{b} * bb);
      uint8_t* old = old_.data() + i * bb;
      uint8_t* now = now_.data() + i * bb;
      errors[i] = reader_.ReadBlock(v_, f, t, b, now);
      if (errors[i].ok() && !same) errors[i] = reader_.ReadBlock(onto_, of, ot, b, old);
      if (!errors[i].ok()) break;
      if (!same) encoded_[i] = EncodeBlock(old, now, len, width, &scratch);
      if (full_) dense_[i] = EncodeBlock(nullptr, now, len, width, &scratch);
    }
  });
  for (const auto& e : errors) RETURN_IF_ERROR(e);
  for (uint32_t i = 0; i < count; ++i) {
    const size_t r = size_t{t.first_block} + first + i;
    RETURN_IF_ERROR(AppendEncodedBlock(encoded_[i], 0, spool_.get(), &records_[r]));
    if (full_) RETURN_IF_ERROR(full_->Append(r, dense_[i]));
  }
  done_ += bytes;
  if (progress_) progress_(done_, total_);
  return Status::Ok();
}

}  // namespace

Result<AnchorDistance> RebaseVersion(Store& store, const std::shared_ptr<const Version>& v,
                                     const std::shared_ptr<const Version>& onto,
                                     const AnchorDistance& onto_distance,
                                     const AnchorPolicy& policy, const Progress& progress) {
  Manifest m = v->manifest;
  m.revision++;
  if (onto) {
    const bool full =
        !PolicyAnchorReason(policy, onto_distance, v->manifest.stats.dense_bytes).empty();
    DeltaRebase delta(store, v, onto, full, progress);
    return delta.Run(std::move(m), onto_distance);
  }
  if (m.full) return AnchorFromFullTable(store, std::move(m), progress);
  return StreamedAnchor(store, v, std::move(m), progress);
}

}  // namespace dte::internal
