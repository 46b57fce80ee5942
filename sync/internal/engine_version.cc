#include "sync/internal/engine_version.h"

#include <memory>
#include <string>

#include "sync/anchor_policy.h"

namespace dte::internal {

Result<std::unique_ptr<FullTableBuilder>> FullTableBuilder::Start(BlobSink* sink, size_t blocks) {
  auto b = std::make_unique<FullTableBuilder>();
  ASSIGN_OR_RETURN(b->spool_, sink->NewSpool());
  b->records_.resize(blocks);
  return b;
}

Status FullTableBuilder::Append(size_t record, const EncodedBlock& dense) {
  if (dense.kind != BlockKind::kDenseRaw && dense.kind != BlockKind::kDenseZstd) {
    return Internal("full table record " + std::to_string(record) + " is not dense");
  }
  return AppendEncodedBlock(dense, 0, spool_.get(), &records_[record]);
}

Status FullTableBuilder::Finish(BlobSink* sink, const std::vector<BlockRecord>& records,
                                Manifest* m) {
  for (size_t r = 0; r < records_.size(); ++r) records_[r].hash = records[r].hash;
  payload_bytes_ = spool_->size();
  FullTable full;
  ASSIGN_OR_RETURN(BlobRef data, sink->Finish(std::move(spool_)));
  full.blobs.push_back(data);
  ASSIGN_OR_RETURN(full.block_table, sink->PutBytes(EncodeBlockTable(records_)));
  m->full = std::move(full);
  return Status::Ok();
}

Status PublishVersion(Store* store, BlobSink* sink, Manifest* m,
                      const std::vector<BlockRecord>& records,
                      const std::vector<BlockRecord>& full_records,
                      const AnchorDistance& parent_distance,
                      const std::optional<uint64_t>& expected_latest) {
  ASSIGN_OR_RETURN(BlobRef table, sink->PutBytes(EncodeBlockTable(records)));
  m->block_table = table;
  VersionStats& s = m->stats;
  s = VersionStats{};
  for (const auto& f : m->files) {
    for (const auto& t : f.tensors) {
      s.tensors++;
      s.elements += t.elements();
      s.changed_elements += t.changed;
      s.dense_bytes += t.bytes();
    }
  }
  s.stored_bytes = sink->added_bytes();
  m->since_full = NextDistance(parent_distance, m->self_contained(), s.stored_bytes);
  std::string text = EncodeManifest(*m);
  RETURN_IF_ERROR(sink->Refresh());
  // The last check before the point of no return: a publisher that committed
  // meanwhile makes this delta's parent stale.
  ASSIGN_OR_RETURN(auto latest, store->Latest());
  if (latest != expected_latest) {
    return AlreadyExists("the store's latest version changed (now " +
                         (latest ? VersionName(*latest) : std::string("none")) + ") while " +
                         VersionName(m->version) +
                         " was being built by this publisher; retry the commit");
  }
  Status created = store->objects().CreateExclusive(ManifestKey(m->version, 0), text);
  if (created.code() == Code::kAlreadyExists) {
    return AlreadyExists("version " + std::to_string(m->version) + " already exists in store " +
                         store->uri() + " (another publisher committed it first)");
  }
  RETURN_IF_ERROR(created);
  auto v = std::make_shared<Version>();
  v->key = ManifestKey(m->version, 0);
  v->manifest_bytes = std::move(text);
  v->manifest = *m;
  v->records = records;
  v->full_records = full_records;
  // The version exists now: an error here must neither fail the commit (a
  // retry would publish it twice) nor roll back the blobs it references. The
  // index is only a cache, re-synced from the manifests on the next open.
  store->Remember(std::move(v)).IgnoreError();
  return Status::Ok();
}

}  // namespace dte::internal
