// Manifests and block tables: what a committed version is.
//
// A version is one immutable manifest object, "manifests/vNNNNNNNN.json"
// (or "vNNNNNNNN.rK.json", a later revision of the same version written by
// gc when it rebases a version whose parent it removes, as an anchor or
// onto an older kept version; same content hashes).
// The manifest lists the version's files; each safetensors file's tensors
// point at a range of records in the version's block table, a binary blob
// with one 32-byte record per block of tensor data. Formats are specified in
// docs/formats/manifest.md and docs/formats/block-table.md.
//
// Thread-safety: plain values; a const Manifest may be read, FindTensor
// included, from several threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/delta_codec.h"
#include "store/dtype.h"
#include "store/hash.h"

namespace dte {

// Written by this build; readers accept 1 (no "full", no "since_full") to
// this number.
inline constexpr uint32_t kManifestFormatVersion = 2;
inline constexpr uint32_t kBlockTableFormatVersion = 1;
inline constexpr uint64_t kDefaultBlockBytes = 256 * 1024;

struct BlockRecord {
  BlockKind kind = BlockKind::kSame;
  uint32_t blob = 0;    // index into Manifest::blobs (unused for kSame)
  uint64_t offset = 0;  // payload bytes [offset, offset + length) of that blob
  uint32_t length = 0;
  uint32_t changed = 0;  // elements that differ from the parent's block
  uint64_t hash = 0;     // XXH3-64 of the block's full content at this version
};

struct TensorEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // data_offsets within the file's data section
  Hash128 hash;                 // XXH3-128 of the tensor's bytes at this version
  uint64_t changed = 0;         // elements changed vs the parent (all, for an anchor)
  uint32_t first_block = 0;     // first record in the block table
  uint32_t blocks = 0;          // number of records
  uint64_t elements() const;
  uint64_t bytes() const { return end - begin; }
};

struct FileEntry {
  std::string name;  // a plain file name: no '/', "..", NUL
  uint64_t size = 0;
  bool safetensors = false;
  Hash128 blob;         // raw files: the blob holding the content (its hash)
  Hash128 header_blob;  // safetensors: the prefix + JSON header bytes
  uint64_t header_size = 0;
  std::vector<TensorEntry> tensors;  // sorted by begin; contiguous
};

struct BlobRef {
  Hash128 hash;
  uint64_t size = 0;
  bool added = false;  // first stored by this version (counts in stored_bytes)
};

// A second, self-contained block table of a delta version (manifest format
// 2): only dense records, so the version can be read without its parent.
// Written on policy anchors that keep their delta for followers (see
// docs/formats/manifest.md, "full").
struct FullTable {
  BlobRef block_table;
  std::vector<BlobRef> blobs;  // payload blobs its dense records point into
};

// How far a version is from the nearest version whose content stands alone
// (an anchor, or a delta with a full table): versions since it and the
// bytes their deltas added to the store, this version's included. Zero for
// a self-contained version. Drives the anchor policy (store/write/anchor_policy.h).
struct AnchorDistance {
  uint64_t versions = 0;
  uint64_t bytes = 0;
};

struct VersionStats {
  uint64_t tensors = 0, elements = 0, changed_elements = 0;
  uint64_t stored_bytes = 0, dense_bytes = 0;
};

// Where a tensor lies in a manifest (Manifest::FindTensor).
struct TensorLocation {
  const FileEntry* file = nullptr;
  const TensorEntry* tensor = nullptr;
  uint32_t file_index = 0;    // into Manifest::files
  uint32_t tensor_index = 0;  // into file->tensors
};

// Manifest::FindTensor's index, tensor name -> (file, tensor), built on the
// first lookup. A copied or moved-to manifest starts without one.
// Thread-safety: lookups may run concurrently on a const manifest.
class TensorNameIndex {
 public:
  TensorNameIndex() = default;
  TensorNameIndex(const TensorNameIndex&) {}
  TensorNameIndex(TensorNameIndex&&) noexcept {}
  TensorNameIndex& operator=(const TensorNameIndex&);
  TensorNameIndex& operator=(TensorNameIndex&&) noexcept;

  std::optional<TensorLocation> Find(const std::vector<FileEntry>& files,
                                     std::string_view name) const;

 private:
  using Entry = std::pair<std::string, std::pair<uint32_t, uint32_t>>;
  void Build(const std::vector<FileEntry>& files) const;

  mutable std::mutex mu_;  // serializes Build
  mutable std::atomic<bool> built_{false};
  mutable std::vector<Entry> sorted_;  // by name; written once, under mu_
};

struct Manifest {
  uint64_t version = 0;
  uint32_t revision = 0;
  std::optional<uint64_t> parent;  // nullopt: an anchor
  std::string created;             // RFC 3339, UTC
  uint64_t block_bytes = kDefaultBlockBytes;
  BlobRef block_table;
  std::vector<BlobRef> blobs;    // payload blobs that block records point into
  std::vector<FileEntry> files;  // sorted by name
  VersionStats stats;
  std::optional<FullTable> full;             // format 2; delta versions only
  std::optional<AnchorDistance> since_full;  // format 2; absent in older manifests
  bool anchor() const { return !parent.has_value(); }
  // True if the version can be materialized without any other version.
  bool self_contained() const { return anchor() || full.has_value(); }
  // The tensor named `name` (tensor names are unique in a version), or
  // nullopt. Logarithmic after a first call that indexes every tensor. Still
  // right when files change after that: a hit is checked against the entry
  // it names, and a name not found (or a stale hit) is searched linearly.
  std::optional<TensorLocation> FindTensor(std::string_view name) const {
    return tensor_index_.Find(files, name);
  }

 private:
  TensorNameIndex tensor_index_;
};

// A join table (docs/formats/join.md): a full table of a delta version
// kept outside its manifest, in object joins/vNNNNNNNN.json, so a host that
// joins late reads the newest versions from it instead of decoding every
// delta since the last policy anchor. Writers keep only the newest few
// (store/write/anchor_policy.h, join_budget) and delete older ones with their
// blobs; readers that lose one walk the delta chain instead. Manifests never
// point at join tables, so gc, verify and rebase ignore them (gc only keeps
// their blobs while they are listed).
struct JoinTable {
  uint64_t version = 0;
  std::string manifest_key;  // the manifest revision whose block hashes it holds
  std::string created;       // RFC 3339, UTC
  FullTable table;           // records in table.block_table, payloads in table.blobs
};

std::string EncodeJoin(const JoinTable& j);
Result<JoinTable> DecodeJoin(std::string_view json, const std::string& what);
std::string JoinKey(uint64_t version);  // "joins/v00000012.json"
std::optional<uint64_t> ParseJoinKey(std::string_view key);
inline constexpr char kJoinPrefix[] = "joins/";

// Every blob of a join table starts with this header (magic "DTEJOIN1",
// version:u64, part:u32, zero padding), so no manifest ever shares one of
// its blobs and a writer may delete them without a store-wide search. The
// block table blob is the header (part kJoinTablePart) and then an encoded
// block table; payload blobs are the header and then dense records, whose
// offsets count from the blob's first byte.
inline constexpr size_t kJoinBlobHeaderBytes = 32;
inline constexpr uint32_t kJoinTablePart = 0xffffffffu;
std::string JoinBlobHeader(uint64_t version, uint32_t part);
// The block table bytes of a join table blob, after checking its header.
Result<std::string_view> JoinTableBody(std::string_view blob, uint64_t version,
                                       const std::string& what);

// Serializes to the JSON stored in the manifest object.
std::string EncodeManifest(const Manifest& m);
// Parses and validates (format version, names, tensor layout, block ranges).
// `what` names the object in errors.
Result<Manifest> DecodeManifest(std::string_view json, const std::string& what);

// Block tables: one record per block, in manifest order.
std::string EncodeBlockTable(const std::vector<BlockRecord>& records);
Result<std::vector<BlockRecord>> DecodeBlockTable(std::string_view bytes, const std::string& what);

// Object keys.
std::string BlobKey(const Hash128& hash);  // "blobs/ab/ab12..."
std::string ManifestKey(uint64_t version, uint32_t revision);
// Parses "manifests/v00000012.json" / "manifests/v00000012.r3.json".
std::optional<std::pair<uint64_t, uint32_t>> ParseManifestKey(std::string_view key);
std::string VersionName(uint64_t version);  // "v00000012"

// True for a plain file name safe to create inside a directory.
bool IsPlainFileName(std::string_view name);

// Current time as RFC 3339 UTC ("2026-11-22T01:02:03Z").
std::string NowRfc3339();

// True if the safetensors files of the two have the same layout (file names,
// tensor names, dtypes, shapes, offsets), so one can be a delta of the other:
// their block tables then have the same records in the same order. Other
// files are stored whole and do not matter. `block_bytes` is b's block size,
// which must equal a's.
bool SameTensorLayout(const Manifest& a, const std::vector<FileEntry>& b, uint64_t block_bytes);

}  // namespace dte
