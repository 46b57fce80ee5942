#include "sync/verify.h"

#include <map>
#include <set>

#include "store/materialize.h"
#include "store/store.h"

namespace dte {
namespace {

// Every blob a version's own records, files and block table name.
void CollectBlobs(const Version& v, std::map<std::string, uint64_t>* out) {
  const Manifest& m = v.manifest;
  (*out)[m.block_table.hash.Hex()] = m.block_table.size;
  for (const auto& b : m.blobs) (*out)[b.hash.Hex()] = b.size;
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
  std::vector<std::shared_ptr<const Version>> loaded;
  std::set<uint64_t> chain;
  for (const auto& [num, key] : versions) {
    if (only && num != *only) continue;
    // With one version selected, its whole parent chain is checked too.
    for (std::optional<uint64_t> cur = num; cur;) {
      if (!chain.insert(*cur).second) break;
      auto v = store.GetVersion(*cur);
      if (!v.ok()) {
        report.problems.push_back(v.status().message());
        break;
      }
      Status object = CheckManifestObject(store, **v);
      if (!object.ok()) report.problems.push_back(object.message());
      CollectBlobs(**v, &blobs);
      if (*cur == num) loaded.push_back(*v);
      cur = (*v)->manifest.parent;
      if (!only) break;  // every version is visited by the outer loop anyway
    }
  }
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
  Materializer reader(&store);
  for (const auto& v : loaded) {
    report.versions++;
    for (const auto& f : v->manifest.files) {
      Status s =
          reader.StreamFile(v, f, [](uint64_t, const uint8_t*, size_t) { return Status::Ok(); });
      if (!s.ok()) report.problems.push_back(s.message());
      report.files++;
      report.tensors += f.tensors.size();
    }
    if (v->manifest.parent && !versions.count(*v->manifest.parent)) {
      report.problems.push_back(VersionName(v->manifest.version) + ": parent " +
                                VersionName(*v->manifest.parent) + " is missing");
    }
  }
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
