#include "store/write/version_writer.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "store/write/anchor_policy.h"

namespace dte::internal {

Result<std::unique_ptr<FullTableBuilder>> FullTableBuilder::Start(
    BlobSink* sink, size_t blocks, std::optional<uint64_t> join_version) {
  auto b = std::make_unique<FullTableBuilder>();
  ASSIGN_OR_RETURN(b->spool_, sink->NewSpool());
  b->join_version_ = join_version;
  if (join_version) {
    const std::string header = JoinBlobHeader(*join_version, 0);
    RETURN_IF_ERROR(b->spool_->Append(header.data(), header.size()));
  }
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
  ASSIGN_OR_RETURN(full.block_table,
                   sink->PutBytes(join_version_ ? JoinBlobHeader(*join_version_, kJoinTablePart) +
                                                      EncodeBlockTable(records_)
                                                : EncodeBlockTable(records_)));
  m->full = std::move(full);
  return Status::Ok();
}

Status PublishVersion(Store* store, BlobSink* sink, Manifest* m,
                      const std::vector<BlockRecord>& records,
                      const std::vector<BlockRecord>& full_records,
                      const AnchorDistance& parent_distance,
                      const std::optional<uint64_t>& expected_latest, bool join,
                      JoinOutcome* join_out) {
  std::optional<FullTable> join_table;
  uint64_t join_added = 0;
  if (join && m->full) {
    join_table = std::move(*m->full);
    m->full.reset();
    if (join_table->block_table.added) join_added += join_table->block_table.size;
    for (const auto& b : join_table->blobs) join_added += b.added ? b.size : 0;
  }
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
  s.stored_bytes = sink->added_bytes() - std::min(join_added, sink->added_bytes());
  m->since_full = NextDistance(parent_distance, m->self_contained(), s.stored_bytes);
  std::string text = EncodeManifest(*m);
  RETURN_IF_ERROR(sink->Refresh());
  // The last check before the point of no return: a publisher that committed
  // meanwhile makes this delta's parent stale. A listing that says so is
  // believed once the manifests confirm it (Store::ConfirmedLatest).
  ASSIGN_OR_RETURN(auto latest,
                   expected_latest ? store->ConfirmedLatest(*expected_latest) : store->Latest());
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
  if (!join_table) v->full_records = full_records;
  // The version exists now: an error here must neither fail the commit (a
  // retry would publish it twice) nor roll back the blobs it references. The
  // index is only a cache, re-synced from the manifests on the next open.
  store->Remember(std::move(v)).IgnoreError();
  if (join_table) {
    Status js = WriteJoinTable(store, *m, ManifestKey(m->version, 0), *join_table);
    if (join_out) {
      join_out->written = js.ok();
      join_out->bytes = join_table->block_table.size;
      for (const auto& b : join_table->blobs) join_out->bytes += b.size;
      join_out->error = js.ok() ? "" : js.message();
    }
  }
  return Status::Ok();
}

Status WriteJoinTable(Store* store, const Manifest& m, const std::string& manifest_key,
                      const FullTable& table) {
  JoinTable jt;
  jt.version = m.version;
  jt.manifest_key = manifest_key;
  jt.created = NowRfc3339();
  jt.table = table;
  RETURN_IF_ERROR(store->objects().Put(JoinKey(m.version), EncodeJoin(jt)));
  return PruneJoinTables(store);
}

Status PruneJoinTables(Store* store) {
  ASSIGN_OR_RETURN(auto versions, store->ListVersions());
  ASSIGN_OR_RETURN(auto listed, ReadJoinTables(*store));
  // Kept: the newest kJoinTablesKept that belong to the current revision of
  // their version (or to a version newer than the listing).
  std::set<uint64_t> keep;
  for (auto it = listed.rbegin(); it != listed.rend() && keep.size() < kJoinTablesKept; ++it) {
    if (it->second.table && JoinIsCurrent(it->first, *it->second.table, versions)) {
      keep.insert(it->first);
    }
  }
  std::set<std::string> kept_blobs;
  for (uint64_t v : keep) {
    const FullTable& t = listed[v].table->table;
    kept_blobs.insert(BlobKey(t.block_table.hash));
    for (const auto& b : t.blobs) kept_blobs.insert(BlobKey(b.hash));
  }
  for (const auto& [v, l] : listed) {
    if (keep.count(v)) continue;
    RETURN_IF_ERROR(store->objects().Delete(l.key));
    store->DropJoin(v);
    if (!l.table) continue;  // its blobs, if any, are gc's to sweep
    std::vector<std::string> blobs{BlobKey(l.table->table.block_table.hash)};
    for (const auto& b : l.table->table.blobs) blobs.push_back(BlobKey(b.hash));
    for (const std::string& blob : blobs) {
      if (kept_blobs.count(blob)) continue;
      Status d = store->objects().Delete(blob);
      if (!d.ok() && d.code() != Code::kNotFound) return d;
    }
  }
  return Status::Ok();
}

}  // namespace dte::internal
