#include "store/ops/commit.h"

#include <fcntl.h>

#include <atomic>
#include <vector>

#include "kernels/parallel.h"
#include "store/base/posix_file.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "store/write/blob_sink.h"
#include "store/write/scan.h"
#include "store/write/version_writer.h"

namespace dte {
namespace {

using internal::BlobSink;
using internal::FullTableBuilder;
using internal::InputFile;
using internal::Spool;

constexpr uint32_t kBlocksPerChunk = 64;
// Manifest keys spell versions with at most 12 digits (ParseManifestKey); a
// larger version's manifest would be written but never listed.
constexpr uint64_t kMaxVersion = 999'999'999'999;

// Reads exactly len bytes of an input file at offset.
Status ReadInput(int fd, uint64_t offset, uint64_t len, uint8_t* dst, const std::string& path) {
  ASSIGN_OR_RETURN(uint64_t n, CannotWording(PreadUpTo(fd, dst, len, offset, path)));
  if (n < len) return InvalidArgument(path + " is shorter than its header says (truncated?)");
  return Status::Ok();
}

// Builds one version: shared state of the file and tensor loops.
class Committer {
 public:
  Committer(Store* store, const CommitOptions& options)
      : store_(store), options_(options), sink_(&store->objects()), reader_(store) {}

  Result<CommitResult> Run(const std::string& dir);

 private:
  Status Plan(const std::vector<InputFile>& files);
  Status StoreRawFile(const InputFile& in, FileEntry* entry);
  Status StoreSafetensors(const InputFile& in, FileEntry* entry, const FileEntry* parent);
  Status StoreTensor(int fd, const InputFile& in, FileEntry* entry, TensorEntry* t,
                     const FileEntry* parent, Spool* spool, uint32_t blob_index);
  // Reads, hashes and (for a delta) encodes blocks [first, first+count) of t
  // into chunk_ and encoded_, on the thread pool; each worker also writes
  // the blocks it read to the new version's snapshot.
  Status ProcessChunk(int fd, const InputFile& in, const FileEntry& entry, const TensorEntry& t,
                      const FileEntry* parent, uint32_t first, uint32_t count);
  // Fills the chunk's block records, appending payloads to the spool.
  Status AppendChunk(const TensorEntry& t, bool anchor, uint32_t first, uint32_t count,
                     Spool* spool, uint32_t blob_index);
  Status Publish();
  void Progress(uint64_t bytes);
  // Opens the cache directory's snapshots and starts the new version's
  // snapshot if it is due; without one the commit goes on (result().snapshot
  // says why).
  void StartSnapshot();
  // Why the new version gets no snapshot (CommitOptions::snapshot_every),
  // or "" when it is due.
  std::string SnapshotNotDue();
  // Gives the snapshot up (not the commit) after the first failed write.
  void DropSnapshotOnError(const std::vector<Status>& writes);
  // After the version exists: publishes its snapshot and prunes old ones.
  void FinishSnapshot();
  CommitResult Summary() const;

  Store* store_;
  const CommitOptions& options_;
  BlobSink sink_;
  Materializer reader_;
  Manifest manifest_;
  std::vector<BlockRecord> records_;
  std::shared_ptr<const Version> parent_;
  std::optional<uint64_t> latest_;
  std::unique_ptr<Spool> delta_spool_;  // all sparse payloads of a delta version
  std::string anchor_reason_;
  std::string join_reason_;
  internal::JoinOutcome join_;
  uint64_t total_bytes_ = 0, done_bytes_ = 0;
  std::vector<uint8_t> chunk_, old_chunk_;
  std::vector<EncodedBlock> encoded_;
  AnchorDistance parent_distance_;
  std::unique_ptr<FullTableBuilder> full_;  // a policy anchor's full table
  std::vector<EncodedBlock> full_encoded_;
  std::unique_ptr<SnapshotSet> snapshots_;
  std::unique_ptr<SnapshotWriter> snapshot_;
  std::string snapshot_note_;
};

Status Committer::Plan(const std::vector<InputFile>& files) {
  // PublishVersion checks again, with a new listing, before the manifest.
  ASSIGN_OR_RETURN(latest_, store_->LatestListed());
  uint64_t version = latest_ ? *latest_ + 1 : 0;
  if (options_.version) {
    if (latest_ && *options_.version <= *latest_) {
      ASSIGN_OR_RETURN(auto versions, store_->ListVersions());
      if (versions.count(*options_.version)) {
        return AlreadyExists("version " + std::to_string(*options_.version) +
                             " already exists in store " + store_->uri() + " (latest is " +
                             std::to_string(*latest_) + ")");
      }
      return InvalidArgument("version " + std::to_string(*options_.version) +
                             " must be greater than the latest version " +
                             std::to_string(*latest_));
    }
    version = *options_.version;
  }
  if (version > kMaxVersion) {
    return InvalidArgument("version " + std::to_string(version) + " is beyond the largest " +
                           "version a store can hold, " + std::to_string(kMaxVersion));
  }
  manifest_.version = version;
  manifest_.created = NowRfc3339();
  manifest_.block_bytes = kDefaultBlockBytes;
  manifest_.files = internal::LayoutEntries(files, manifest_.block_bytes);
  for (const auto& f : files) total_bytes_ += f.size;
  if (!latest_) {
    anchor_reason_ = "first version";
  } else if (options_.force_anchor) {
    anchor_reason_ = "anchor requested";
  } else {
    ASSIGN_OR_RETURN(parent_, store_->GetVersion(*latest_));
    if (!SameTensorLayout(parent_->manifest, manifest_.files, manifest_.block_bytes)) {
      anchor_reason_ = "tensor layout differs from " + VersionName(*latest_);
      parent_.reset();
    } else {
      manifest_.parent = *latest_;
    }
  }
  size_t blocks = 0;
  uint64_t dense_bytes = 0;
  for (const auto& f : manifest_.files) {
    for (const auto& t : f.tensors) {
      blocks += t.blocks;
      dense_bytes += t.bytes();
    }
  }
  records_.resize(blocks);
  if (!parent_) return Status::Ok();
  ASSIGN_OR_RETURN(TableDecision tables,
                   DecideTables(*store_, options_.anchor_policy, parent_, dense_bytes));
  parent_distance_ = tables.parent_distance;
  anchor_reason_ = tables.anchor_reason;
  join_reason_ = tables.join_reason;
  if (tables.any_table()) {
    std::optional<uint64_t> join;
    if (tables.join_table()) join = manifest_.version;
    ASSIGN_OR_RETURN(full_, FullTableBuilder::Start(&sink_, blocks, join));
  }
  return Status::Ok();
}

void Committer::StartSnapshot() {
  const std::string dir = SnapshotDir(*store_);
  if (dir.empty()) {
    snapshot_note_ = "none: no cache directory";
    return;
  }
  auto set = SnapshotSet::Open(dir);
  if (!set.ok()) {
    snapshot_note_ = "none: " + set.status().message();
    return;
  }
  snapshots_ = std::move(set).value();
  reader_.SetBase(snapshots_.get());
  if (options_.keep_snapshots == 0) {
    snapshot_note_ = "none: --keep-snapshots 0";
    return;
  }
  if (std::string why = SnapshotNotDue(); !why.empty()) {
    snapshot_note_ = "none: " + why;
    return;
  }
  // Kept in the page cache: the next commit reads it whole as its parent.
  auto writer = snapshots_->Begin(manifest_.version, manifest_.block_bytes,
                                  SnapshotSet::SnapshotSize(manifest_), SnapshotPages::kKeep);
  if (!writer.ok()) {
    snapshot_note_ = "none: " + writer.status().message();
    return;
  }
  snapshot_ = std::move(writer).value();
}

std::string Committer::SnapshotNotDue() {
  if (!parent_ || full_ || options_.snapshot_every <= 1) return "";
  return dte::SnapshotNotDue(*store_, *snapshots_, parent_, options_.snapshot_every);
}

void Committer::DropSnapshotOnError(const std::vector<Status>& writes) {
  for (const Status& s : writes) {
    if (s.ok()) continue;
    snapshot_.reset();
    snapshot_note_ = "none: " + s.message();
    return;
  }
}

void Committer::FinishSnapshot() {
  if (!snapshot_) return;
  Version v;
  v.manifest = manifest_;
  v.records = records_;
  Status s = snapshot_->Publish(v);
  snapshot_.reset();
  if (!s.ok()) {
    snapshot_note_ = "none: " + s.message();
    return;
  }
  snapshot_note_ = snapshots_->dir() + "/" + SnapshotSet::FileName(v);
  snapshots_->KeepNewest(options_.keep_snapshots);
}

void Committer::Progress(uint64_t bytes) {
  done_bytes_ += bytes;
  if (options_.progress) options_.progress(done_bytes_, total_bytes_);
}

Status Committer::StoreRawFile(const InputFile& in, FileEntry* entry) {
  ASSIGN_OR_RETURN(ScopedFd fd, CannotWording(OpenFile(in.path, O_RDONLY)));
  ASSIGN_OR_RETURN(auto spool, sink_.NewSpool());
  std::vector<uint8_t> buf(std::min<uint64_t>(in.size, 8 << 20));
  for (uint64_t off = 0; off < in.size; off += buf.size()) {
    uint64_t n = std::min<uint64_t>(buf.size(), in.size - off);
    RETURN_IF_ERROR(ReadInput(fd.get(), off, n, buf.data(), in.path));
    RETURN_IF_ERROR(spool->Append(buf.data(), n));
    Progress(n);
  }
  ASSIGN_OR_RETURN(BlobRef ref, sink_.Finish(std::move(spool)));
  entry->blob = ref.hash;
  return Status::Ok();
}

Status Committer::ProcessChunk(int fd, const InputFile& in, const FileEntry& entry,
                               const TensorEntry& t, const FileEntry* parent, uint32_t first,
                               uint32_t count) {
  const uint64_t bb = manifest_.block_bytes;
  const int width = DTypeWidth(t.dtype);
  auto blen = [&](uint32_t b) { return std::min<uint64_t>(bb, t.bytes() - uint64_t{b} * bb); };
  std::vector<Status> errors(count), snapshot_writes(snapshot_ ? count : 0);
  encoded_.assign(count, EncodedBlock{});
  if (full_) full_encoded_.assign(count, EncodedBlock{});
  if (parent) old_chunk_.resize(size_t{count} * bb);
  // Each worker reads its own blocks, so reading overlaps hashing and coding.
  kernels::ParallelFor(count, 1, [&](size_t lo, size_t hi) {
    thread_local CodecScratch scratch;
    for (size_t i = lo; i < hi && errors[i].ok(); ++i) {
      uint32_t b = first + static_cast<uint32_t>(i);
      uint8_t* now = chunk_.data() + i * bb;
      errors[i] =
          ReadInput(fd, in.header.data_offset + t.begin + uint64_t{b} * bb, blen(b), now, in.path);
      if (!errors[i].ok()) break;
      records_[t.first_block + b].hash = HashBlock(now, blen(b));
      if (snapshot_) snapshot_writes[i] = snapshot_->Write(t.first_block + b, now, blen(b));
      if (!parent) continue;
      uint8_t* old = old_chunk_.data() + i * bb;
      const TensorEntry& pt = parent->tensors[&t - entry.tensors.data()];
      errors[i] = reader_.ReadBlock(parent_, *parent, pt, b, old);
      if (!errors[i].ok()) break;
      encoded_[i] = EncodeBlock(old, now, blen(b), width, &scratch);
      if (full_) full_encoded_[i] = full_->Encode(now, blen(b), width, &scratch);
    }
  });
  for (const auto& e : errors) RETURN_IF_ERROR(e);
  DropSnapshotOnError(snapshot_writes);
  return Status::Ok();
}

Status Committer::AppendChunk(const TensorEntry& t, bool anchor, uint32_t first, uint32_t count,
                              Spool* spool, uint32_t blob_index) {
  const uint64_t bb = manifest_.block_bytes;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t b = first + i;
    BlockRecord& rec = records_[t.first_block + b];
    if (anchor) {  // the data blob is the file's data section, verbatim
      rec.kind = BlockKind::kDenseRaw;
      rec.blob = blob_index;
      rec.offset = t.begin + uint64_t{b} * bb;
      rec.length = static_cast<uint32_t>(std::min<uint64_t>(bb, t.bytes() - uint64_t{b} * bb));
      continue;
    }
    RETURN_IF_ERROR(AppendEncodedBlock(encoded_[i], blob_index, spool, &rec));
    if (full_) RETURN_IF_ERROR(full_->Append(t.first_block + b, full_encoded_[i]));
  }
  return Status::Ok();
}

Status Committer::StoreTensor(int fd, const InputFile& in, FileEntry* entry, TensorEntry* t,
                              const FileEntry* parent, Spool* spool, uint32_t blob_index) {
  const uint64_t bb = manifest_.block_bytes;
  Hasher128 hasher;
  for (uint32_t first = 0; first < t->blocks; first += kBlocksPerChunk) {
    uint32_t count = std::min(kBlocksPerChunk, t->blocks - first);
    uint64_t off = uint64_t{first} * bb;
    uint64_t len = std::min<uint64_t>(uint64_t{count} * bb, t->bytes() - off);
    chunk_.resize(len);
    RETURN_IF_ERROR(ProcessChunk(fd, in, *entry, *t, parent, first, count));
    hasher.Update(chunk_.data(), len);
    if (!parent) RETURN_IF_ERROR(spool->Append(chunk_.data(), len));
    RETURN_IF_ERROR(AppendChunk(*t, parent == nullptr, first, count, spool, blob_index));
    Progress(len);
  }
  t->hash = hasher.Finish();
  t->changed = t->elements();
  if (parent) {
    t->changed = 0;
    for (uint32_t b = 0; b < t->blocks; ++b) t->changed += records_[t->first_block + b].changed;
  }
  return Status::Ok();
}

Status Committer::StoreSafetensors(const InputFile& in, FileEntry* entry, const FileEntry* parent) {
  ASSIGN_OR_RETURN(BlobRef header, sink_.PutBytes(in.header_bytes));
  entry->header_blob = header.hash;
  Progress(in.header_bytes.size());
  ASSIGN_OR_RETURN(ScopedFd fd, CannotWording(OpenFile(in.path, O_RDONLY)));
  std::unique_ptr<Spool> data_spool;
  Spool* spool = delta_spool_.get();
  uint32_t blob_index = 0;  // the delta blob is blobs[0]
  if (!parent) {
    ASSIGN_OR_RETURN(data_spool, sink_.NewSpool());
    spool = data_spool.get();
    blob_index = static_cast<uint32_t>(manifest_.blobs.size());
  }
  for (auto& t : entry->tensors) {
    RETURN_IF_ERROR(StoreTensor(fd.get(), in, entry, &t, parent, spool, blob_index));
  }
  if (!parent) {
    ASSIGN_OR_RETURN(BlobRef data, sink_.Finish(std::move(data_spool)));
    manifest_.blobs.push_back(data);
  }
  return Status::Ok();
}

Status Committer::Publish() {
  static const std::vector<BlockRecord> kNone;
  if (full_) RETURN_IF_ERROR(full_->Finish(&sink_, records_, &manifest_));
  return internal::PublishVersion(store_, &sink_, &manifest_, records_,
                                  full_ ? full_->records() : kNone, parent_distance_, latest_,
                                  full_ && full_->join(), &join_);
}

Result<CommitResult> Committer::Run(const std::string& dir) {
  ASSIGN_OR_RETURN(auto files, internal::ScanCheckpoint(dir));
  RETURN_IF_ERROR(Plan(files));
  StartSnapshot();
  Status s = [&]() -> Status {
    if (parent_) {
      ASSIGN_OR_RETURN(delta_spool_, sink_.NewSpool());
      manifest_.blobs.push_back(BlobRef{});
    }
    for (size_t i = 0; i < files.size(); ++i) {
      FileEntry* entry = &manifest_.files[i];
      const FileEntry* pf = nullptr;
      if (parent_) {
        for (const auto& f : parent_->manifest.files) {
          if (f.name == entry->name) pf = &f;
        }
      }
      if (files[i].safetensors) {
        RETURN_IF_ERROR(StoreSafetensors(files[i], entry, pf));
      } else {
        RETURN_IF_ERROR(StoreRawFile(files[i], entry));
      }
    }
    if (parent_) {
      if (delta_spool_->size() == 0) {
        manifest_.blobs.clear();  // nothing changed: no delta blob at all
      } else {
        ASSIGN_OR_RETURN(manifest_.blobs[0], sink_.Finish(std::move(delta_spool_)));
      }
    }
    return Publish();
  }();
  // A failed commit leaves the blobs it added: another publisher may have
  // found and reused one meanwhile, so deleting them could break its
  // version. gc removes them once they are older than its grace window.
  if (!s.ok()) return s;
  FinishSnapshot();
  return Summary();
}

CommitResult Committer::Summary() const {
  CommitResult r;
  r.version = manifest_.version;
  r.parent = manifest_.parent;
  r.anchor_reason = anchor_reason_;
  r.full_table = full_ && !full_->join();
  r.full_bytes = r.full_table ? full_->payload_bytes() : 0;
  r.join_reason = join_reason_;
  r.join_table = join_.written;
  r.join_bytes = join_.bytes;
  r.join_error = join_.error;
  r.parent_snapshot_blocks = snapshots_ ? snapshots_->Stats().block_reads : 0;
  r.snapshot = snapshot_note_;
  r.tensors = manifest_.stats.tensors;
  r.elements = manifest_.stats.elements;
  r.changed_elements = manifest_.stats.changed_elements;
  r.stored_bytes = manifest_.stats.stored_bytes;
  r.dense_bytes = manifest_.stats.dense_bytes;
  r.input_bytes = total_bytes_;
  return r;
}

}  // namespace

Result<CommitResult> CommitDirectory(Store& store, const std::string& dir,
                                     const CommitOptions& options) {
  Committer committer(&store, options);
  return committer.Run(dir);
}

}  // namespace dte
