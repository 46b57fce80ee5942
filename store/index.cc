// RocksDB-backed Index. One column family per kind of entry, keyed by
// big-endian version numbers (so byte order is numeric order):
//   "versions"     ver:be64                  -> manifest key
//   "manifests"    ver:be64                  -> manifest bytes
//   "tables"       ver:be64                  -> block table bytes
//   "full_tables"  ver:be64                  -> full block table bytes (only if it has one)
//   "files"        ver:be64 file             -> file size (decimal) and kind
//   "tensors"      ver:be64 file '\0' tensor -> first_block:be32 blocks:be32
//   default        'c' key                   -> cache entry
// A new version's keys are the greatest of every family, so flushes never
// overlap older table files and compactions move them without rewriting:
// writing a version costs the same after ten thousand versions as after
// ten. (With one family and a tag prefix per kind, every flush overlapped
// every table file, and each compaction rewrote the whole index.) An index
// of the older one-family layout is a cache like any other: it is deleted
// and rebuilt as versions are read.
#include "store/index.h"

#include <rocksdb/db.h>
#include <rocksdb/metadata.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <vector>

namespace dte {
namespace {

std::string Be64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) s[i] = static_cast<char>(v & 0xff);
  return s;
}

std::string Be32(uint32_t v) { return Be64(v).substr(4); }

uint64_t ReadBe(std::string_view s) {
  uint64_t v = 0;
  for (char c : s) v = (v << 8) | static_cast<uint8_t>(c);
  return v;
}

std::string Key(uint64_t version, std::string_view rest = {}) {
  std::string k = Be64(version);
  k.append(rest);
  return k;
}

// The size of the index's table files.
constexpr uint64_t kTargetFileBytes = uint64_t{4} << 20;

// The column families of version entries, in the order of RocksIndex::cf_.
enum Family { kVersions, kManifests, kTables, kFullTables, kFiles, kTensors, kFamilies };
constexpr const char* kFamilyNames[kFamilies] = {"versions",    "manifests", "tables",
                                                 "full_tables", "files",     "tensors"};

// The one place rocksdb::Status becomes a dte Status.
Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  if (s.IsNotFound()) return NotFound(what + ": " + s.ToString());
  if (s.IsCorruption()) return Corruption(what + ": " + s.ToString());
  return IOError(what + ": " + s.ToString());
}

class RocksIndex final : public Index {
 public:
  RocksIndex(std::unique_ptr<rocksdb::DB> db, std::vector<rocksdb::ColumnFamilyHandle*> handles,
             std::string dir)
      : db_(std::move(db)), dir_(std::move(dir)) {
    // handles[0] is the default family; the rest follow kFamilyNames.
    default_ = handles[0];
    for (int f = 0; f < kFamilies; ++f) cf_[f] = handles[f + 1];
  }
  ~RocksIndex() override { Close().IgnoreError(); }

  Status PutVersion(const Manifest& m, const Entry& e) override {
    rocksdb::WriteBatch batch;
    // Only a version indexed before (another revision) has keys to drop: a
    // range tombstone per new version would pile up, and every read and
    // compaction would pay for all of them.
    std::string indexed;
    rocksdb::Status had =
        db_->Get(rocksdb::ReadOptions(), cf_[kVersions], Key(m.version), &indexed);
    if (!had.IsNotFound()) {
      RETURN_IF_ERROR(FromRocks(had, "index " + dir_ + ": " + VersionName(m.version)));
      RETURN_IF_ERROR(DeleteRanges(m.version, &batch));
    }
    batch.Put(cf_[kVersions], Key(m.version), e.manifest_key);
    batch.Put(cf_[kManifests], Key(m.version), e.manifest);
    batch.Put(cf_[kTables], Key(m.version), e.block_table);
    if (!e.full_table.empty()) batch.Put(cf_[kFullTables], Key(m.version), e.full_table);
    for (const auto& f : m.files) {
      batch.Put(cf_[kFiles], Key(m.version, f.name),
                std::to_string(f.size) + (f.safetensors ? " safetensors" : " raw"));
      for (const auto& t : f.tensors) {
        batch.Put(cf_[kTensors], Key(m.version, f.name + '\0' + t.name),
                  Be32(t.first_block) + Be32(t.blocks));
      }
    }
    return Write(&batch, "recording " + VersionName(m.version));
  }

  Status DeleteVersion(uint64_t version) override {
    rocksdb::WriteBatch batch;
    RETURN_IF_ERROR(DeleteRanges(version, &batch));
    return Write(&batch, "dropping " + VersionName(version));
  }

  Result<std::optional<Entry>> GetVersion(uint64_t version) override {
    // One snapshot so the keys come from the same logical update.
    rocksdb::ReadOptions ro;
    ro.snapshot = db_->GetSnapshot();
    Entry e;
    rocksdb::Status s = db_->Get(ro, cf_[kVersions], Key(version), &e.manifest_key);
    if (s.ok()) s = db_->Get(ro, cf_[kManifests], Key(version), &e.manifest);
    if (s.ok()) s = db_->Get(ro, cf_[kTables], Key(version), &e.block_table);
    if (s.ok()) {
      s = db_->Get(ro, cf_[kFullTables], Key(version), &e.full_table);
      if (s.IsNotFound()) s = rocksdb::Status::OK();
    }
    db_->ReleaseSnapshot(ro.snapshot);
    if (s.IsNotFound()) return std::optional<Entry>();
    RETURN_IF_ERROR(FromRocks(s, "index " + dir_ + ": reading " + VersionName(version)));
    return std::optional<Entry>(std::move(e));
  }

  Result<std::map<uint64_t, std::string>> ListVersions() override {
    std::map<uint64_t, std::string> out;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf_[kVersions]));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().size() != 8) continue;
      out[ReadBe(it->key().ToStringView())] = it->value().ToString();
    }
    RETURN_IF_ERROR(FromRocks(it->status(), "index " + dir_ + ": listing versions"));
    return out;
  }

  Result<std::optional<std::pair<uint32_t, uint32_t>>> FindTensor(
      uint64_t version, const std::string& file, const std::string& tensor) override {
    std::string v;
    rocksdb::Status s =
        db_->Get(rocksdb::ReadOptions(), cf_[kTensors], Key(version, file + '\0' + tensor), &v);
    if (s.IsNotFound()) return std::optional<std::pair<uint32_t, uint32_t>>();
    RETURN_IF_ERROR(FromRocks(s, "index " + dir_ + ": tensor " + tensor));
    if (v.size() != 8) return Corruption("index " + dir_ + ": bad tensor entry for " + tensor);
    return std::optional(std::make_pair(static_cast<uint32_t>(ReadBe(v.substr(0, 4))),
                                        static_cast<uint32_t>(ReadBe(v.substr(4)))));
  }

  Status PutCacheEntry(std::string_view key, std::string_view value) override {
    return FromRocks(db_->Put(rocksdb::WriteOptions(), "c" + std::string(key), value),
                     "index " + dir_ + ": cache entry");
  }

  Result<std::optional<std::string>> GetCacheEntry(std::string_view key) override {
    std::string v;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), "c" + std::string(key), &v);
    if (s.IsNotFound()) return std::optional<std::string>();
    RETURN_IF_ERROR(FromRocks(s, "index " + dir_ + ": cache entry"));
    return std::optional<std::string>(std::move(v));
  }

  Result<std::vector<std::pair<std::string, std::string>>> ListCacheEntries(
      std::string_view prefix) override {
    const std::string start = "c" + std::string(prefix);
    std::vector<std::pair<std::string, std::string>> out;
    rocksdb::ReadOptions ro;
    ro.snapshot = db_->GetSnapshot();
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
    for (it->Seek(start); it->Valid() && it->key().starts_with(start); it->Next()) {
      out.emplace_back(it->key().ToString().substr(1), it->value().ToString());
    }
    const rocksdb::Status s = it->status();
    it.reset();  // before its snapshot goes
    db_->ReleaseSnapshot(ro.snapshot);
    RETURN_IF_ERROR(FromRocks(s, "index " + dir_ + ": listing cache entries"));
    return out;
  }

  Status UpdateCacheEntries(const std::vector<std::pair<std::string, std::string>>& puts,
                            const std::vector<std::string>& deletes) override {
    rocksdb::WriteBatch batch;
    for (const std::string& key : deletes) batch.Delete("c" + key);
    for (const auto& [key, value] : puts) batch.Put("c" + key, value);
    return Write(&batch, "cache entries");
  }

  Status Clear() override {
    rocksdb::WriteBatch batch;
    batch.DeleteRange(default_, std::string(1, '\0'), std::string(1, '\xff'));
    for (auto* cf : cf_) batch.DeleteRange(cf, std::string(), std::string(9, '\xff'));
    return Write(&batch, "clearing");
  }

  Status Close() override {
    if (!db_) return Status::Ok();
    CompactNewest();
    for (auto* cf : cf_) db_->DestroyColumnFamilyHandle(cf).PermitUncheckedError();
    db_->DestroyColumnFamilyHandle(default_).PermitUncheckedError();
    Status s = FromRocks(db_->Close(), "closing index " + dir_);
    db_.reset();
    return s;
  }

 private:
  Status DeleteRanges(uint64_t version, rocksdb::WriteBatch* batch) {
    for (auto* cf : cf_) {
      // Past the last version's keys (version + 1 would wrap).
      std::string end = version == UINT64_MAX ? std::string(9, '\xff') : Key(version + 1);
      rocksdb::Status s = batch->DeleteRange(cf, Key(version), end);
      RETURN_IF_ERROR(FromRocks(s, "index " + dir_));
    }
    return Status::Ok();
  }

  // Every process that opens the index flushes what the previous one wrote
  // (RocksDB's recovery) into new level-0 files, and with a version's keys
  // the greatest of every family, RocksDB moves them to level 1 as they are:
  // level 1 would collect one tiny file per process, and every open and
  // read would pay for all of them. Before closing, each family's level-0
  // files and the small files at the end of level 1 (all newer than the
  // rest) are merged into level-1 files of the target size: what is
  // rewritten is bounded by that size, not by the number of versions.
  void CompactNewest() {
    constexpr size_t kMaxSmallFiles = 8;
    for (auto* cf : {default_, cf_[0], cf_[1], cf_[2], cf_[3], cf_[4], cf_[5]}) {
      rocksdb::ColumnFamilyMetaData meta;
      db_->GetColumnFamilyMetaData(cf, &meta);
      if (meta.levels.size() < 2) continue;
      std::vector<std::string> inputs;
      for (const auto& f : meta.levels[0].files) inputs.push_back(f.name);
      const auto& level1 = meta.levels[1].files;  // in key order
      for (auto it = level1.rbegin(); it != level1.rend() && it->size < kTargetFileBytes / 2;
           ++it) {
        inputs.push_back(it->name);
      }
      if (inputs.size() < kMaxSmallFiles) continue;
      rocksdb::CompactionOptions o;
      o.compression = rocksdb::kNoCompression;
      o.output_file_size_limit = kTargetFileBytes;
      // A cache: a failed compaction costs only speed.
      db_->CompactFiles(o, cf, inputs, 1).PermitUncheckedError();
    }
  }

  Status Write(rocksdb::WriteBatch* batch, const std::string& what) {
    rocksdb::WriteOptions wo;
    return FromRocks(db_->Write(wo, batch), "index " + dir_ + ": " + what);
  }

  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* default_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_[kFamilies] = {};
  std::string dir_;
};

}  // namespace

Result<std::unique_ptr<Index>> Index::Open(const std::string& dir) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.create_missing_column_families = true;
  options.max_open_files = 64;
  options.keep_log_file_num = 2;
  options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  // All memtables together: a process that indexes thousands of versions
  // (a mount reading across a long run) holds at most this much of them.
  options.db_write_buffer_size = uint64_t{16} << 20;
  rocksdb::ColumnFamilyOptions family;
  // Small memtables and table files: the daemon's memory and what one
  // compaction rewrites stay small whatever the index holds.
  family.write_buffer_size = uint64_t{8} << 20;
  family.target_file_size_base = kTargetFileBytes;
  // Block tables and manifests are small and read whole: compressing them
  // costs every flush and compaction CPU for little disk.
  family.compression = rocksdb::kNoCompression;
  // An index of the one-family layout (no "versions" family) is dropped.
  std::vector<std::string> existing;
  if (rocksdb::DB::ListColumnFamilies(options, dir, &existing).ok() && !existing.empty() &&
      std::find(existing.begin(), existing.end(), kFamilyNames[kVersions]) == existing.end()) {
    rocksdb::Status gone = rocksdb::DestroyDB(dir, options);
    if (!gone.ok() && !gone.IsIOError()) return FromRocks(gone, "dropping old index " + dir);
  }
  std::vector<rocksdb::ColumnFamilyDescriptor> families{
      {rocksdb::kDefaultColumnFamilyName, family}};
  for (const char* name : kFamilyNames) families.push_back({name, family});
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, families, &handles, &raw);
  if (!s.ok()) {
    // RocksDB says "lock" only in its message; take the path out first, so a
    // directory such as /data/blockstore is not mistaken for a held lock.
    std::string msg = s.ToString();
    for (size_t at; (at = msg.find(dir)) != std::string::npos;) msg.erase(at, dir.size());
    if (s.IsIOError() && (msg.find("lock") != std::string::npos ||
                          msg.find("Resource temporarily") != std::string::npos)) {
      return Unavailable("cache index " + dir +
                         " is in use by another dte process (a running dtefs or dtectl); "
                         "wait for it or use another --cache-dir");
    }
    return FromRocks(s, "opening cache index " + dir);
  }
  return std::unique_ptr<Index>(
      new RocksIndex(std::unique_ptr<rocksdb::DB>(raw), std::move(handles), dir));
}

}  // namespace dte
