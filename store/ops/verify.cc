#include "store/ops/verify.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <set>

#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"

namespace dte {
namespace {

// Every blob a version's own records, full table, files and block tables
// name.
void CollectBlobs(const Version& v, std::map<std::string, uint64_t>* out) {
  const Manifest& m = v.manifest;
  (*out)[m.block_table.hash.Hex()] = m.block_table.size;
  for (const auto& b : m.blobs) (*out)[b.hash.Hex()] = b.size;
  if (m.full) {
    (*out)[m.full->block_table.hash.Hex()] = m.full->block_table.size;
    for (const auto& b : m.full->blobs) (*out)[b.hash.Hex()] = b.size;
  }
  for (const auto& f : m.files) {
    if (f.safetensors) {
      (*out)[f.header_blob.Hex()] = f.header_size;
    } else {
      (*out)[f.blob.Hex()] = f.size;
    }
  }
}

Status CheckBlob(ObjectStore& objects, const Hash128& hash, uint64_t size) {
  std::string key = BlobKey(hash);
  ASSIGN_OR_RETURN(auto actual, objects.Size(key));
  if (!actual) return NotFound("blob " + key + " is missing");
  if (*actual != size) {
    return Corruption("blob " + key + " has " + std::to_string(*actual) + " bytes, expected " +
                      std::to_string(size) + " (truncated?)");
  }
  constexpr uint64_t kChunk = 8 << 20;
  Hasher128 hasher;
  std::string buf;
  for (uint64_t off = 0; off < size; off += kChunk) {
    uint64_t n = std::min(kChunk, size - off);
    buf.resize(n);
    RETURN_IF_ERROR(objects.ReadRange(key, off, n, buf.data()));
    hasher.Update(buf.data(), n);
  }
  if (hasher.Finish() != hash) return Corruption("blob " + key + " does not match its hash");
  return Status::Ok();
}

// The index and the in-memory cache keep copies of manifests, so a version
// loaded through them can look fine while the store's own manifest object is
// damaged: compare it with the loaded bytes.
Status CheckManifestObject(Store& store, const Version& v) {
  const std::string what = store.uri() + "/" + v.key;
  auto bytes = store.objects().Get(v.key);
  if (!bytes.ok()) return bytes.status();
  if (*bytes == v.manifest_bytes) return Status::Ok();
  auto parsed = DecodeManifest(*bytes, what);
  if (!parsed.ok()) return parsed.status();
  return Corruption(what +
                    ": differs from the copy this host has cached (manifests are immutable)");
}

// Every block of a table that stands alone (v's full table, or `join`, a
// join table of v) decodes alone to v's bytes.
Status CheckStandaloneTable(Materializer& reader, const std::shared_ptr<const Version>& v,
                            const LoadedJoin* join = nullptr) {
  std::vector<uint8_t> buf(v->manifest.block_bytes);
  for (const auto& f : v->manifest.files) {
    for (const auto& t : f.tensors) {
      for (uint32_t b = 0; b < t.blocks; ++b) {
        RETURN_IF_ERROR(join ? reader.ReadJoinBlock(v, *join, f, t, b, buf.data())
                             : reader.ReadFullBlock(v, f, t, b, buf.data()));
      }
    }
  }
  return Status::Ok();
}

// The join tables of the versions checked (every one, or `only`'s) that
// belong to the version's current revision: the object parses, its blobs
// match their hashes, and every block decodes from it alone to the version's
// bytes. A join table of a rewritten or removed version is stale, not
// damage (readers ignore it, gc deletes it), and is not checked.
void CheckJoinTables(Store& store, const std::map<uint64_t, std::string>& versions,
                     std::optional<uint64_t> only, Materializer& reader, VerifyReport* report) {
  auto joins = store.ListJoins();
  if (!joins.ok()) {
    report->problems.push_back(joins.status().message());
    return;
  }
  for (const auto& [num, key] : *joins) {
    if (only && num != *only) continue;
    auto listed = versions.find(num);
    if (listed == versions.end()) continue;
    const std::string what = store.uri() + "/" + key;
    auto text = store.objects().Get(key);
    if (!text.ok()) {
      if (text.status().code() != Code::kNotFound)
        report->problems.push_back(text.status().message());
      continue;  // pruned meanwhile
    }
    auto jt = DecodeJoin(*text, what);
    if (!jt.ok()) {
      report->problems.push_back(jt.status().message());
      continue;
    }
    if (jt->manifest_key != listed->second) continue;
    bool blobs_ok = true;
    std::vector<BlobRef> blobs{jt->table.block_table};
    blobs.insert(blobs.end(), jt->table.blobs.begin(), jt->table.blobs.end());
    for (const auto& b : blobs) {
      Status s = CheckBlob(store.objects(), b.hash, b.size);
      if (!s.ok()) {
        report->problems.push_back(what + ": " + s.message());
        blobs_ok = false;
      }
      report->blobs++;
      report->blob_bytes += b.size;
    }
    if (!blobs_ok) continue;
    auto v = store.GetVersion(num);
    if (!v.ok()) continue;  // reported with the versions
    auto join = store.JoinOf(**v);
    if (!join) {
      report->problems.push_back(what + ": its block table does not match " + VersionName(num));
      continue;
    }
    Status s = CheckStandaloneTable(reader, *v, join.get());
    if (!s.ok()) report->problems.push_back(s.message());
  }
}

// A private directory for the rolling snapshots of one verify run, removed
// with it.
class ScratchSnapshots {
 public:
  explicit ScratchSnapshots(const Store& store) {
    std::error_code ec;
    const std::string parent = store.CachePath().empty()
                                   ? std::filesystem::temp_directory_path(ec).string()
                                   : store.CachePath();
    dir_ = parent + "/verify." + std::to_string(::getpid());
    auto set = SnapshotSet::Open(dir_);
    if (set.ok()) set_ = std::move(set).value();
  }
  ~ScratchSnapshots() {
    set_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  SnapshotSet* get() { return set_.get(); }

 private:
  std::string dir_;
  std::unique_ptr<SnapshotSet> set_;
};

// The versions to verify, ascending: all of them, or `only` and its chain
// down to the nearest self-contained version. Collects their blobs and the
// problems found loading them.
std::vector<uint64_t> SelectVersions(Store& store, const std::map<uint64_t, std::string>& versions,
                                     std::optional<uint64_t> only,
                                     std::map<std::string, uint64_t>* blobs, VerifyReport* report) {
  std::set<uint64_t> chosen;
  for (const auto& [num, key] : versions) {
    if (only && num != *only) continue;
    for (std::optional<uint64_t> cur = num; cur && chosen.insert(*cur).second;) {
      auto v = store.GetVersion(*cur);
      if (!v.ok()) {
        report->problems.push_back(v.status().message());
        break;
      }
      Status object = CheckManifestObject(store, **v);
      if (!object.ok()) report->problems.push_back(object.message());
      CollectBlobs(**v, blobs);
      if (!only || (*v)->manifest.self_contained()) break;  // the outer loop visits the rest
      cur = (*v)->manifest.parent;
    }
  }
  return std::vector<uint64_t>(chosen.begin(), chosen.end());
}

}  // namespace

Result<VerifyReport> VerifyStore(Store& store, std::optional<uint64_t> only,
                                 const std::function<void(uint64_t, uint64_t)>& progress) {
  VerifyReport report;
  ASSIGN_OR_RETURN(auto versions, store.ListVersions());
  if (only && !versions.count(*only)) {
    return NotFound("version " + std::to_string(*only) + " is not committed in store " +
                    store.uri());
  }
  std::map<std::string, uint64_t> blobs;
  const std::vector<uint64_t> chosen = SelectVersions(store, versions, only, &blobs, &report);
  uint64_t total = 0, done = 0;
  for (const auto& [hex, size] : blobs) total += size;
  for (const auto& [hex, size] : blobs) {
    Status s = CheckBlob(store.objects(), *Hash128::FromHex(hex), size);
    if (!s.ok()) report.problems.push_back(s.message());
    report.blobs++;
    report.blob_bytes += size;
    done += size;
    if (progress) progress(done, total);
  }
  // Versions in order, each built as a snapshot from its parent's (one
  // record per block), so the whole store costs one pass over its records
  // instead of a walk from the anchor per version. The snapshots are this
  // run's own: a cached one proves nothing about the store's bytes.
  ScratchSnapshots scratch(store);
  Materializer reader(&store);
  reader.SetBase(scratch.get());
  const std::atomic<bool> never{false};
  for (uint64_t num : chosen) {
    auto v = store.GetVersion(num);
    if (!v.ok()) continue;  // reported by SelectVersions
    if (scratch.get()) {
      // Only a speed-up: a failure (a corrupt block, no disk space) shows
      // again, as a problem, in the check below, or not at all.
      scratch.get()->Build(*v, &reader, never).IgnoreError();
    }
    if (only && num != *only) continue;
    report.versions++;
    for (const auto& f : (*v)->manifest.files) {
      Status s =
          reader.StreamFile(*v, f, [](uint64_t, const uint8_t*, size_t) { return Status::Ok(); });
      if (!s.ok()) report.problems.push_back(s.message());
      report.files++;
      report.tensors += f.tensors.size();
    }
    if ((*v)->manifest.full) {
      Status s = CheckStandaloneTable(reader, *v);
      if (!s.ok()) report.problems.push_back(s.message());
    }
    if ((*v)->manifest.parent && !versions.count(*(*v)->manifest.parent)) {
      report.problems.push_back(VersionName(num) + ": parent " +
                                VersionName(*(*v)->manifest.parent) + " is missing");
    }
    if (scratch.get()) scratch.get()->KeepNewest(2);
  }
  CheckJoinTables(store, versions, only, reader, &report);
  // The same damage can surface through several versions; report it once.
  std::set<std::string> seen;
  std::vector<std::string> unique;
  for (auto& p : report.problems) {
    if (seen.insert(p).second) unique.push_back(std::move(p));
  }
  report.problems = std::move(unique);
  return report;
}

}  // namespace dte
