// Manifest JSON and block table encoding. Grammars: docs/formats/manifest.md,
// docs/formats/block-table.md.
//
// Block table (little-endian):
//   table  := magic:"DTEBLKT1" format_version:u32 count:u32 record{count}
//   record := kind:u8 pad:u8[3] blob:u32 offset:u64 length:u32 changed:u32 hash:u64
#include "store/manifest.h"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>

namespace dte {
namespace {

using nlohmann::json;

constexpr char kTableMagic[8] = {'D', 'T', 'E', 'B', 'L', 'K', 'T', '1'};
constexpr size_t kRecordSize = 32;

template <typename T>
void PutLE(std::string* out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));  // the project targets little-endian hosts
  out->append(buf, sizeof(T));
}

template <typename T>
T GetLE(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

json BlobJson(const BlobRef& b) {
  return json{{"hash", b.hash.Hex()}, {"size", b.size}, {"added", b.added}};
}

json TensorJson(const TensorEntry& t) {
  return json{{"name", t.name},
              {"dtype", DTypeName(t.dtype)},
              {"shape", t.shape},
              {"offsets", {t.begin, t.end}},
              {"hash", t.hash.Hex()},
              {"changed", t.changed},
              {"first_block", t.first_block},
              {"blocks", t.blocks}};
}

json FileJson(const FileEntry& f) {
  json j{{"name", f.name}, {"size", f.size}};
  if (!f.safetensors) {
    j["blob"] = f.blob.Hex();
    return j;
  }
  j["header_blob"] = f.header_blob.Hex();
  j["header_size"] = f.header_size;
  json tensors = json::array();
  for (const auto& t : f.tensors) tensors.push_back(TensorJson(t));
  j["tensors"] = std::move(tensors);
  return j;
}

template <typename T>
struct IsVector : std::false_type {};
template <typename U>
struct IsVector<std::vector<U>> : std::true_type {};

// True if v is a JSON value of T's kind whose value T holds exactly. get<>()
// alone would turn -1 into 2^64-1, 2^32+1 into 1 for a uint32_t, 1.5 into 1.
template <typename T>
bool Representable(const json& v) {
  if constexpr (IsVector<T>::value) {
    if (!v.is_array()) return false;
    for (const auto& e : v) {
      if (!Representable<typename T::value_type>(e)) return false;
    }
    return true;
  } else if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return false;
    if (!v.is_number_unsigned()) return std::is_signed_v<T>;  // a negative number
    return v.template get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  } else {
    return true;  // strings: get<>() checks the type
  }
}

// Reads j[key] as T, or fails naming the key.
template <typename T>
Status Field(const json& j, const char* key, T* out, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end()) return Corruption(what + ": missing field \"" + key + "\"");
  if (!Representable<T>(*it)) {
    return Corruption(what + ": field \"" + key + "\" has the wrong type or is out of range");
  }
  try {
    *out = it->get<T>();
  } catch (const json::exception&) {
    return Corruption(what + ": field \"" + key + "\" has the wrong type");
  }
  return Status::Ok();
}

Status HashField(const json& j, const char* key, Hash128* out, const std::string& what) {
  std::string hex;
  RETURN_IF_ERROR(Field(j, key, &hex, what));
  auto h = Hash128::FromHex(hex);
  if (!h) return Corruption(what + ": field \"" + key + "\" is not a 32-digit hex hash");
  *out = *h;
  return Status::Ok();
}

Status ParseBlob(const json& j, BlobRef* b, const std::string& what) {
  if (!j.is_object()) return Corruption(what + ": blob entry is not an object");
  RETURN_IF_ERROR(HashField(j, "hash", &b->hash, what));
  RETURN_IF_ERROR(Field(j, "size", &b->size, what));
  return Field(j, "added", &b->added, what);
}

Status CheckTensorShape(const TensorEntry& t, const std::string& what) {
  uint64_t n = 1;
  for (int64_t d : t.shape) {
    if (d < 0) return Corruption(what + ": negative dimension");
    if (d != 0 && n > UINT64_MAX / static_cast<uint64_t>(d)) {
      return Corruption(what + ": shape overflows");
    }
    n *= static_cast<uint64_t>(d);
  }
  uint64_t width = static_cast<uint64_t>(DTypeWidth(t.dtype));
  if (n > UINT64_MAX / width || t.end < t.begin || n * width != t.end - t.begin) {
    return Corruption(what + ": byte range does not match dtype x shape");
  }
  return Status::Ok();
}

Status ParseTensor(const json& j, uint64_t block_bytes, TensorEntry* t, const std::string& file) {
  std::string name, dtype;
  RETURN_IF_ERROR(Field(j, "name", &name, file));
  t->name = name;
  std::string what = file + " tensor \"" + name + "\"";
  RETURN_IF_ERROR(Field(j, "dtype", &dtype, what));
  auto dt = ParseDType(dtype);
  if (!dt) return Corruption(what + ": unknown dtype \"" + dtype + "\"");
  t->dtype = *dt;
  RETURN_IF_ERROR(Field(j, "shape", &t->shape, what));
  std::vector<uint64_t> offsets;
  RETURN_IF_ERROR(Field(j, "offsets", &offsets, what));
  if (offsets.size() != 2) return Corruption(what + ": offsets must have two entries");
  t->begin = offsets[0];
  t->end = offsets[1];
  RETURN_IF_ERROR(CheckTensorShape(*t, what));
  RETURN_IF_ERROR(HashField(j, "hash", &t->hash, what));
  RETURN_IF_ERROR(Field(j, "changed", &t->changed, what));
  RETURN_IF_ERROR(Field(j, "first_block", &t->first_block, what));
  RETURN_IF_ERROR(Field(j, "blocks", &t->blocks, what));
  uint64_t want = (t->bytes() + block_bytes - 1) / block_bytes;
  if (t->blocks != want) return Corruption(what + ": block count does not match its size");
  return Status::Ok();
}

Status ParseFile(const json& j, uint64_t block_bytes, FileEntry* f, const std::string& what) {
  if (!j.is_object()) return Corruption(what + ": file entry is not an object");
  RETURN_IF_ERROR(Field(j, "name", &f->name, what));
  if (!IsPlainFileName(f->name)) {
    return Corruption(what + ": unsafe file name \"" + f->name + "\" (must be a plain name)");
  }
  std::string fw = what + " file " + f->name;
  RETURN_IF_ERROR(Field(j, "size", &f->size, fw));
  f->safetensors = j.contains("tensors");
  if (!f->safetensors) return HashField(j, "blob", &f->blob, fw);
  RETURN_IF_ERROR(HashField(j, "header_blob", &f->header_blob, fw));
  RETURN_IF_ERROR(Field(j, "header_size", &f->header_size, fw));
  if (!j["tensors"].is_array()) return Corruption(fw + ": tensors is not an array");
  uint64_t pos = 0;
  for (const auto& tj : j["tensors"]) {
    TensorEntry t;
    RETURN_IF_ERROR(ParseTensor(tj, block_bytes, &t, fw));
    if (t.begin != pos) return Corruption(fw + ": tensor \"" + t.name + "\" is not contiguous");
    pos = t.end;
    f->tensors.push_back(std::move(t));
  }
  if (f->header_size < 8 || f->header_size > f->size || f->size - f->header_size != pos) {
    return Corruption(fw + ": size does not match header and tensors");
  }
  return Status::Ok();
}

Status CheckBlockRanges(const Manifest& m, const std::string& what) {
  uint64_t next = 0;
  std::set<std::string> names;
  for (const auto& f : m.files) {
    if (!names.insert(f.name).second) return Corruption(what + ": duplicate file " + f.name);
    for (const auto& t : f.tensors) {
      if (t.first_block != next) return Corruption(what + ": block ranges out of order");
      next += t.blocks;
    }
  }
  return Status::Ok();
}

Status ParseStats(const json& j, VersionStats* s, const std::string& what) {
  if (!j.is_object()) return Corruption(what + ": stats is not an object");
  RETURN_IF_ERROR(Field(j, "tensors", &s->tensors, what));
  RETURN_IF_ERROR(Field(j, "elements", &s->elements, what));
  RETURN_IF_ERROR(Field(j, "changed_elements", &s->changed_elements, what));
  RETURN_IF_ERROR(Field(j, "stored_bytes", &s->stored_bytes, what));
  return Field(j, "dense_bytes", &s->dense_bytes, what);
}

Status ParseBlobArray(const json& j, std::vector<BlobRef>* out, const std::string& what) {
  if (!j.is_array()) return Corruption(what + ": blobs is not an array");
  for (const auto& bj : j) {
    BlobRef b;
    RETURN_IF_ERROR(ParseBlob(bj, &b, what));
    out->push_back(b);
  }
  return Status::Ok();
}

// Format 2 fields: "full" (a delta's second, dense-only block table) and
// "since_full" (the anchor policy's distance).
Status ParseFormat2(const json& j, Manifest* m, const std::string& what) {
  if (j.contains("full") && !j["full"].is_null()) {
    const json& fj = j["full"];
    if (!fj.is_object() || !fj.contains("block_table") || !fj.contains("blobs")) {
      return Corruption(what + ": full is not an object with block_table and blobs");
    }
    if (m->anchor()) return Corruption(what + ": an anchor has no full table");
    FullTable full;
    RETURN_IF_ERROR(ParseBlob(fj["block_table"], &full.block_table, what + " full"));
    RETURN_IF_ERROR(ParseBlobArray(fj["blobs"], &full.blobs, what + " full"));
    m->full = std::move(full);
  }
  if (j.contains("since_full") && !j["since_full"].is_null()) {
    const json& sj = j["since_full"];
    if (!sj.is_object()) return Corruption(what + ": since_full is not an object");
    AnchorDistance d;
    RETURN_IF_ERROR(Field(sj, "versions", &d.versions, what + " since_full"));
    RETURN_IF_ERROR(Field(sj, "bytes", &d.bytes, what + " since_full"));
    m->since_full = d;
  }
  return Status::Ok();
}

Status ParseManifestJson(const json& j, Manifest* m, const std::string& what) {
  std::string format;
  uint32_t fv = 0;
  RETURN_IF_ERROR(Field(j, "format", &format, what));
  RETURN_IF_ERROR(Field(j, "format_version", &fv, what));
  if (format != "dte-manifest") return Corruption(what + ": not a dte manifest");
  if (fv < 1 || fv > kManifestFormatVersion) {
    return Corruption(what + ": unsupported manifest format_version " + std::to_string(fv));
  }
  RETURN_IF_ERROR(Field(j, "version", &m->version, what));
  RETURN_IF_ERROR(Field(j, "revision", &m->revision, what));
  if (j.contains("parent") && !j["parent"].is_null()) {
    uint64_t p = 0;
    RETURN_IF_ERROR(Field(j, "parent", &p, what));
    if (p >= m->version) return Corruption(what + ": parent is not older than the version");
    m->parent = p;
  }
  RETURN_IF_ERROR(Field(j, "created", &m->created, what));
  RETURN_IF_ERROR(Field(j, "block_bytes", &m->block_bytes, what));
  if (m->block_bytes < 4096 || m->block_bytes > (64u << 20) || m->block_bytes % 8 != 0) {
    return Corruption(what + ": block_bytes out of range");
  }
  if (!j.contains("block_table")) return Corruption(what + ": missing block_table");
  RETURN_IF_ERROR(ParseBlob(j["block_table"], &m->block_table, what));
  if (!j.contains("blobs")) return Corruption(what + ": missing blobs");
  RETURN_IF_ERROR(ParseBlobArray(j["blobs"], &m->blobs, what));
  if (fv >= 2) RETURN_IF_ERROR(ParseFormat2(j, m, what));
  if (!j.contains("files") || !j["files"].is_array()) return Corruption(what + ": missing files");
  for (const auto& fj : j["files"]) {
    FileEntry f;
    RETURN_IF_ERROR(ParseFile(fj, m->block_bytes, &f, what));
    m->files.push_back(std::move(f));
  }
  RETURN_IF_ERROR(CheckBlockRanges(*m, what));
  if (!j.contains("stats")) return Corruption(what + ": missing stats");
  return ParseStats(j["stats"], &m->stats, what);
}

}  // namespace

TensorNameIndex& TensorNameIndex::operator=(const TensorNameIndex&) {
  std::lock_guard lock(mu_);
  built_ = false;
  sorted_.clear();
  return *this;
}

TensorNameIndex& TensorNameIndex::operator=(TensorNameIndex&& other) noexcept {
  return *this = static_cast<const TensorNameIndex&>(other);
}

void TensorNameIndex::Build(const std::vector<FileEntry>& files) const {
  std::lock_guard lock(mu_);
  if (built_.load(std::memory_order_relaxed)) return;
  for (uint32_t f = 0; f < files.size(); ++f) {
    for (uint32_t t = 0; t < files[f].tensors.size(); ++t) {
      sorted_.push_back({files[f].tensors[t].name, {f, t}});
    }
  }
  std::sort(sorted_.begin(), sorted_.end());
  built_.store(true, std::memory_order_release);
}

std::optional<TensorLocation> TensorNameIndex::Find(const std::vector<FileEntry>& files,
                                                    std::string_view name) const {
  if (!built_.load(std::memory_order_acquire)) Build(files);
  auto it = std::lower_bound(sorted_.begin(), sorted_.end(), name,
                             [](const Entry& e, std::string_view n) { return e.first < n; });
  if (it != sorted_.end() && it->first == name) {
    const auto [f, t] = it->second;
    if (f < files.size() && t < files[f].tensors.size() && files[f].tensors[t].name == name) {
      return TensorLocation{&files[f], &files[f].tensors[t], f, t};
    }
  }
  for (uint32_t f = 0; f < files.size(); ++f) {  // not indexed: added or moved since
    for (uint32_t t = 0; t < files[f].tensors.size(); ++t) {
      if (files[f].tensors[t].name == name) {
        return TensorLocation{&files[f], &files[f].tensors[t], f, t};
      }
    }
  }
  return std::nullopt;
}

uint64_t TensorEntry::elements() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string EncodeManifest(const Manifest& m) {
  json j{{"format", "dte-manifest"},
         {"format_version", kManifestFormatVersion},
         {"version", m.version},
         {"revision", m.revision},
         {"parent", m.parent ? json(*m.parent) : json(nullptr)},
         {"kind", m.anchor() ? "anchor" : "delta"},
         {"created", m.created},
         {"block_bytes", m.block_bytes},
         {"delta_format", kDeltaFormatVersion},
         {"block_table", BlobJson(m.block_table)}};
  json blobs = json::array();
  for (const auto& b : m.blobs) blobs.push_back(BlobJson(b));
  j["blobs"] = std::move(blobs);
  json files = json::array();
  for (const auto& f : m.files) files.push_back(FileJson(f));
  j["files"] = std::move(files);
  j["stats"] = json{{"tensors", m.stats.tensors},
                    {"elements", m.stats.elements},
                    {"changed_elements", m.stats.changed_elements},
                    {"stored_bytes", m.stats.stored_bytes},
                    {"dense_bytes", m.stats.dense_bytes}};
  if (m.full) {
    json full_blobs = json::array();
    for (const auto& b : m.full->blobs) full_blobs.push_back(BlobJson(b));
    j["full"] = json{{"block_table", BlobJson(m.full->block_table)}, {"blobs", full_blobs}};
  }
  if (m.since_full) {
    j["since_full"] = json{{"versions", m.since_full->versions}, {"bytes", m.since_full->bytes}};
  }
  return j.dump(1) + "\n";
}

Result<Manifest> DecodeManifest(std::string_view text, const std::string& what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corruption(what + ": not valid JSON");
  Manifest m;
  RETURN_IF_ERROR(ParseManifestJson(j, &m, what));
  return m;
}

std::string EncodeBlockTable(const std::vector<BlockRecord>& records) {
  std::string out(kTableMagic, sizeof(kTableMagic));
  PutLE<uint32_t>(&out, kBlockTableFormatVersion);
  PutLE<uint32_t>(&out, static_cast<uint32_t>(records.size()));
  out.reserve(out.size() + records.size() * kRecordSize);
  for (const auto& r : records) {
    PutLE<uint8_t>(&out, static_cast<uint8_t>(r.kind));
    out.append(3, '\0');
    PutLE<uint32_t>(&out, r.blob);
    PutLE<uint64_t>(&out, r.offset);
    PutLE<uint32_t>(&out, r.length);
    PutLE<uint32_t>(&out, r.changed);
    PutLE<uint64_t>(&out, r.hash);
  }
  return out;
}

Result<std::vector<BlockRecord>> DecodeBlockTable(std::string_view b, const std::string& what) {
  if (b.size() < 16 || std::memcmp(b.data(), kTableMagic, 8) != 0) {
    return Corruption(what + ": not a block table");
  }
  uint32_t fv = GetLE<uint32_t>(b.data() + 8);
  uint32_t count = GetLE<uint32_t>(b.data() + 12);
  if (fv != kBlockTableFormatVersion) return Corruption(what + ": unsupported block table format");
  if ((b.size() - 16) / kRecordSize != count || (b.size() - 16) % kRecordSize != 0) {
    return Corruption(what + ": block table size does not match its count");
  }
  std::vector<BlockRecord> out(count);
  const char* p = b.data() + 16;
  for (uint32_t i = 0; i < count; ++i, p += kRecordSize) {
    uint8_t kind = GetLE<uint8_t>(p);
    if (kind > static_cast<uint8_t>(BlockKind::kSparse)) {
      return Corruption(what + ": record " + std::to_string(i) + " has an unknown kind");
    }
    out[i] =
        BlockRecord{static_cast<BlockKind>(kind), GetLE<uint32_t>(p + 4),  GetLE<uint64_t>(p + 8),
                    GetLE<uint32_t>(p + 16),      GetLE<uint32_t>(p + 20), GetLE<uint64_t>(p + 24)};
  }
  return out;
}

std::string BlobKey(const Hash128& hash) {
  std::string hex = hash.Hex();
  return "blobs/" + hex.substr(0, 2) + "/" + hex;
}

std::string VersionName(uint64_t version) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "v%08llu", static_cast<unsigned long long>(version));
  return buf;
}

std::string ManifestKey(uint64_t version, uint32_t revision) {
  std::string key = "manifests/" + VersionName(version);
  if (revision > 0) key += ".r" + std::to_string(revision);
  return key + ".json";
}

std::optional<std::pair<uint64_t, uint32_t>> ParseManifestKey(std::string_view key) {
  constexpr std::string_view kPrefix = "manifests/v";
  if (key.substr(0, kPrefix.size()) != kPrefix || key.size() < kPrefix.size() + 8 + 5) {
    return std::nullopt;
  }
  key.remove_prefix(kPrefix.size());
  if (key.substr(key.size() - 5) != ".json") return std::nullopt;
  key.remove_suffix(5);
  auto digits = [](std::string_view s, uint64_t* v) {
    if (s.empty() || s.size() > 12) return false;
    *v = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      *v = *v * 10 + static_cast<uint64_t>(c - '0');
    }
    return true;
  };
  // Only the canonical spelling (ManifestKey's): the version in 8 digits, or
  // more without a leading zero; a revision from 1 to 2^32-1 without one.
  // Checked without building the key: listings parse every manifest's.
  uint64_t version = 0, revision = 0;
  const size_t dot = key.find(".r");
  const std::string_view v = key.substr(0, dot);
  if (!digits(v, &version) || v.size() < 8 || (v.size() > 8 && v[0] == '0')) return std::nullopt;
  if (dot != std::string_view::npos) {
    const std::string_view r = key.substr(dot + 2);
    if (!digits(r, &revision) || r[0] == '0' || revision > UINT32_MAX) return std::nullopt;
  }
  return std::make_pair(version, static_cast<uint32_t>(revision));
}

std::string JoinKey(uint64_t version) {
  return std::string(kJoinPrefix) + VersionName(version) + ".json";
}

std::optional<uint64_t> ParseJoinKey(std::string_view key) {
  const std::string prefix = std::string(kJoinPrefix) + "v";
  if (key.size() < prefix.size() + 8 + 5 || key.size() > prefix.size() + 12 + 5 ||
      key.substr(0, prefix.size()) != prefix || key.substr(key.size() - 5) != ".json") {
    return std::nullopt;
  }
  uint64_t v = 0;
  for (char c : key.substr(prefix.size(), key.size() - prefix.size() - 5)) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (JoinKey(v) != key) return std::nullopt;  // non-canonical spelling
  return v;
}

namespace {
constexpr char kJoinMagic[8] = {'D', 'T', 'E', 'J', 'O', 'I', 'N', '1'};
}  // namespace

std::string JoinBlobHeader(uint64_t version, uint32_t part) {
  std::string out(kJoinMagic, sizeof(kJoinMagic));
  PutLE<uint64_t>(&out, version);
  PutLE<uint32_t>(&out, part);
  out.resize(kJoinBlobHeaderBytes, '\0');
  return out;
}

Result<std::string_view> JoinTableBody(std::string_view blob, uint64_t version,
                                       const std::string& what) {
  if (blob.size() < kJoinBlobHeaderBytes ||
      blob.substr(0, kJoinBlobHeaderBytes) != JoinBlobHeader(version, kJoinTablePart)) {
    return Corruption(what + ": block table blob has no join header for " + VersionName(version));
  }
  return blob.substr(kJoinBlobHeaderBytes);
}

std::string EncodeJoin(const JoinTable& jt) {
  json blobs = json::array();
  for (const auto& b : jt.table.blobs) blobs.push_back(BlobJson(b));
  json j{{"format", "dte-join"},     {"format_version", 1},
         {"version", jt.version},    {"manifest", jt.manifest_key},
         {"created", jt.created},    {"block_table", BlobJson(jt.table.block_table)},
         {"blobs", std::move(blobs)}};
  return j.dump(1) + "\n";
}

Result<JoinTable> DecodeJoin(std::string_view text, const std::string& what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corruption(what + ": not valid JSON");
  std::string format;
  uint64_t format_version = 0;
  RETURN_IF_ERROR(Field(j, "format", &format, what));
  RETURN_IF_ERROR(Field(j, "format_version", &format_version, what));
  if (format != "dte-join" || format_version != 1) {
    return Corruption(what + ": not a dte-join format 1 object");
  }
  JoinTable jt;
  RETURN_IF_ERROR(Field(j, "version", &jt.version, what));
  RETURN_IF_ERROR(Field(j, "manifest", &jt.manifest_key, what));
  RETURN_IF_ERROR(Field(j, "created", &jt.created, what));
  if (!j.contains("block_table") || !j.contains("blobs")) {
    return Corruption(what + ": missing block_table or blobs");
  }
  RETURN_IF_ERROR(ParseBlob(j["block_table"], &jt.table.block_table, what));
  RETURN_IF_ERROR(ParseBlobArray(j["blobs"], &jt.table.blobs, what));
  auto parsed = ParseManifestKey(jt.manifest_key);
  if (!parsed || parsed->first != jt.version) {
    return Corruption(what + ": manifest \"" + jt.manifest_key + "\" is not a manifest of " +
                      VersionName(jt.version));
  }
  return jt;
}

bool IsPlainFileName(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.size() > 255) return false;
  for (char c : name) {
    if (c == '/' || c == '\\' || c == '\0') return false;
  }
  return true;
}

std::string NowRfc3339() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

bool SameTensorLayout(const Manifest& a, const std::vector<FileEntry>& b, uint64_t block_bytes) {
  if (a.block_bytes != block_bytes) return false;
  auto safetensors = [](const std::vector<FileEntry>& files) {
    std::vector<const FileEntry*> out;
    for (const auto& f : files) {
      if (f.safetensors) out.push_back(&f);
    }
    return out;
  };
  auto fa = safetensors(a.files);
  auto fb = safetensors(b);
  if (fa.size() != fb.size()) return false;
  for (size_t i = 0; i < fb.size(); ++i) {
    if (fa[i]->name != fb[i]->name || fa[i]->tensors.size() != fb[i]->tensors.size()) return false;
    for (size_t k = 0; k < fb[i]->tensors.size(); ++k) {
      const TensorEntry& ta = fa[i]->tensors[k];
      const TensorEntry& tb = fb[i]->tensors[k];
      if (ta.name != tb.name || ta.dtype != tb.dtype || ta.shape != tb.shape ||
          ta.begin != tb.begin || ta.end != tb.end) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace dte
