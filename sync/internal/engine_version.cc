#include "sync/internal/engine_version.h"

#include <memory>
#include <string>

namespace dte::internal {

Status PublishVersion(Store* store, BlobSink* sink, Manifest* m,
                      const std::vector<BlockRecord>& records,
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
  // The version exists now: an error here must neither fail the commit (a
  // retry would publish it twice) nor roll back the blobs it references. The
  // index is only a cache, re-synced from the manifests on the next open.
  store->Remember(std::move(v)).IgnoreError();
  return Status::Ok();
}

}  // namespace dte::internal
