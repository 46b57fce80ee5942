// Snapshot files.
//
//   snapshot-dir  := { snapshot | temp }
//   snapshot      := "v" digits{8,12} "." content-id ".snap"
//   temp          := ".tmp." version-name "." pid "." seq  (being written; flock held)
//   content-id    := 32 lowercase hex digits, XXH3-128 of
//                    "dte-snapshot" u32(format_version = 1) u64(block_bytes)
//                    u64(record_count) { u64(record.hash) }      (little-endian)
//   content       := for every block record r of the version, its block's
//                    bytes at offset r * block_bytes; a tensor's last block
//                    is shorter and the rest of its slot is a hole.
//
// The format version is part of the content id, so a file of another format
// never matches a version and is deleted like any stale snapshot. There is
// no header and no fsync: each block is verified against the version's
// block hash when read, so a torn or damaged file costs a fallback to the
// store, never wrong bytes.
#include "store/snapshot.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace dte {
namespace {

constexpr uint32_t kSnapshotFormatVersion = 1;
constexpr char kSuffix[] = ".snap";
constexpr char kTempPrefix[] = ".tmp.";
// A kDropBehind writer's data is flushed and dropped from the page cache
// in windows of this size, so a snapshot of many gigabytes neither piles up
// dirty pages nor evicts what readers use.
constexpr uint64_t kWriteBehindWindow = uint64_t{32} << 20;

void PutFixed(std::string* out, uint64_t x, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(x >> (8 * i)));
}

// "v00000012.<32 hex>.snap" -> 12; nullopt for any other name.
std::optional<uint64_t> ParseSnapshotName(const std::string& name) {
  const size_t dot = name.find('.');
  const size_t suffix = name.size() - (sizeof(kSuffix) - 1);
  if (dot == std::string::npos || name.size() < sizeof(kSuffix) ||
      name.compare(suffix, std::string::npos, kSuffix) != 0 || suffix != dot + 1 + 32 ||
      !Hash128::FromHex(name.substr(dot + 1, 32))) {
    return std::nullopt;
  }
  const std::string digits = name.substr(1, dot - 1);
  if (name[0] != 'v' || digits.empty() || digits.size() > 12 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  const uint64_t version = std::stoull(digits);
  if (VersionName(version) != name.substr(0, dot)) return std::nullopt;
  return version;
}

Status PwriteAll(int fd, const uint8_t* data, uint64_t len, uint64_t offset,
                 const std::string& path) {
  while (len > 0) {
    ssize_t n = ::pwrite(fd, data, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("write " + path, errno);
    data += n;
    offset += static_cast<uint64_t>(n);
    len -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// Refuses a snapshot that would leave less than 5% of the filesystem free.
Status CheckSpace(const std::string& dir, uint64_t size) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return ErrnoStatus("statvfs " + dir, errno);
  const uint64_t avail = uint64_t{st.f_bavail} * st.f_frsize;
  const uint64_t reserve = uint64_t{st.f_blocks} * st.f_frsize / 20;
  if (avail < size + reserve) {
    return IOError("not enough free space in " + dir + " (" + std::to_string(size) +
                   " bytes needed, " + std::to_string(avail) + " available, 5% kept free)");
  }
  return Status::Ok();
}

// Starts writeback of each full window and drops the window before it from
// the page cache once it is written. Offsets must be written in order.
class WriteBehind {
 public:
  explicit WriteBehind(int fd) : fd_(fd) {}
  void Wrote(uint64_t end) {
    if (end < started_ + kWriteBehindWindow) return;
    ::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(end - started_),
                      SYNC_FILE_RANGE_WRITE);
    if (started_ > dropped_) {
      const auto from = static_cast<off_t>(dropped_), n = static_cast<off_t>(started_ - dropped_);
      ::sync_file_range(
          fd_, from, n,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      ::posix_fadvise(fd_, from, n, POSIX_FADV_DONTNEED);
      dropped_ = started_;
    }
    started_ = end;
  }

 private:
  const int fd_;
  uint64_t started_ = 0;  // writeback started for [dropped_, started_)
  uint64_t dropped_ = 0;  // [0, dropped_) is out of the page cache
};

std::atomic<uint64_t> temp_seq{0};

}  // namespace

struct SnapshotWriter::State {
  SnapshotSet* set = nullptr;
  uint64_t version = 0, block_bytes = 0;
  std::string tmp;
  ScopedFd fd;
  std::unique_ptr<WriteBehind> behind;  // null for SnapshotPages::kKeep
  bool published = false;
};

SnapshotWriter::SnapshotWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}

SnapshotWriter::~SnapshotWriter() {
  if (!state_->published) ::unlink(state_->tmp.c_str());
}

Status SnapshotWriter::Write(size_t record, const uint8_t* data, uint64_t len) {
  const uint64_t offset = record * state_->block_bytes;
  RETURN_IF_ERROR(PwriteAll(state_->fd.get(), data, len, offset, state_->tmp));
  if (state_->behind) state_->behind->Wrote(offset + len);
  return Status::Ok();
}

Status SnapshotWriter::Publish(const Version& v) {
  State& st = *state_;
  if (st.published || v.manifest.version != st.version) {
    return Internal("snapshot of " + VersionName(st.version) + " published twice or as " +
                    VersionName(v.manifest.version));
  }
  auto e = std::make_shared<SnapshotSet::Entry>();
  e->version = st.version;
  e->id = SnapshotSet::ContentId(v);
  e->path = st.set->dir() + "/" + SnapshotSet::FileName(v);
  struct stat sb {};
  if (::fstat(st.fd.get(), &sb) != 0) return ErrnoStatus("stat " + st.tmp, errno);
  e->bytes = uint64_t(sb.st_blocks) * 512;
  e->fd = std::move(st.fd);
  RETURN_IF_ERROR(st.set->Publish(std::move(e), st.tmp));
  st.published = true;
  return Status::Ok();
}

std::string SnapshotDir(const Store& store) {
  return store.CachePath().empty() ? "" : store.CachePath() + "/snapshots";
}

std::unique_ptr<SnapshotSet> OpenStoreSnapshots(const Store& store) {
  const std::string dir = SnapshotDir(store);
  if (dir.empty()) return nullptr;
  auto set = SnapshotSet::Open(dir);
  return set.ok() ? std::move(set).value() : nullptr;
}

std::string SnapshotNotDue(Store& store, SnapshotSet& set, std::shared_ptr<const Version> parent,
                           uint32_t every) {
  std::shared_ptr<const Version> v = std::move(parent);
  for (uint32_t d = 1; d < every; ++d) {
    if (set.Has(*v)) {
      return "the snapshot of " + VersionName(v->manifest.version) + " is " + std::to_string(d) +
             " version(s) back (--snapshot-every " + std::to_string(every) + ")";
    }
    if (v->manifest.self_contained() || !v->manifest.parent) return "";
    auto up = store.GetVersion(*v->manifest.parent);
    if (!up.ok()) return "";
    v = *std::move(up);
  }
  return "";
}

uint64_t SnapshotSet::SnapshotSize(const Manifest& m) {
  uint64_t size = 0;
  for (const FileEntry& f : m.files) {
    for (const TensorEntry& t : f.tensors) {
      if (t.blocks == 0) continue;
      const uint64_t last = uint64_t{t.blocks} - 1;
      const uint64_t end =
          (t.first_block + last) * m.block_bytes + (t.bytes() - last * m.block_bytes);
      size = std::max(size, end);
    }
  }
  return size;
}

Result<std::unique_ptr<SnapshotWriter>> SnapshotSet::Begin(uint64_t version, uint64_t block_bytes,
                                                           uint64_t bytes, SnapshotPages pages) {
  RETURN_IF_ERROR(CheckSpace(dir_, bytes));
  auto st = std::make_unique<SnapshotWriter::State>();
  st->set = this;
  st->version = version;
  st->block_bytes = block_bytes;
  st->tmp = dir_ + "/" + kTempPrefix + VersionName(version) + "." + std::to_string(getpid()) + "." +
            std::to_string(temp_seq++);
  ASSIGN_OR_RETURN(st->fd, OpenFile(st->tmp, O_RDWR | O_CREAT | O_TRUNC, 0644));
  if (::flock(st->fd.get(), LOCK_EX | LOCK_NB) != 0) {
    Status s = ErrnoStatus("lock " + st->tmp, errno);
    ::unlink(st->tmp.c_str());
    return s;
  }
  if (pages == SnapshotPages::kDropBehind) st->behind = std::make_unique<WriteBehind>(st->fd.get());
  return std::unique_ptr<SnapshotWriter>(new SnapshotWriter(std::move(st)));
}

std::vector<uint64_t> SnapshotSet::KeepNewest(size_t keep) {
  std::vector<uint64_t> dropped;
  MutexLock lock(&mu_);
  while (entries_.size() > keep) {
    auto it = entries_.begin();
    ::unlink(it->second->path.c_str());
    dropped.push_back(it->first);
    entries_.erase(it);
  }
  return dropped;
}

Result<std::unique_ptr<SnapshotSet>> SnapshotSet::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IOError("cannot create snapshot directory " + dir + ": " + ec.message());
  std::unique_ptr<SnapshotSet> set(new SnapshotSet(dir));
  RETURN_IF_ERROR(set->Scan());
  return set;
}

SnapshotSet::~SnapshotSet() = default;

Status SnapshotSet::Scan() {
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir_.c_str()), ::closedir);
  if (!d) return ErrnoStatus("open directory " + dir_, errno);
  std::map<uint64_t, std::shared_ptr<Entry>> found;
  while (const dirent* de = ::readdir(d.get())) {
    const std::string name = de->d_name, path = dir_ + "/" + name;
    if (name.rfind(kTempPrefix, 0) == 0) {
      // A writer holds its temp file locked; an unlocked one is a crash's.
      auto fd = OpenFile(path, O_RDWR);
      if (fd.ok() && ::flock(fd->get(), LOCK_EX | LOCK_NB) == 0) ::unlink(path.c_str());
      continue;
    }
    const std::optional<uint64_t> version = ParseSnapshotName(name);
    if (!version) continue;
    auto fd = OpenFile(path, O_RDONLY);
    struct stat st {};
    if (!fd.ok() || ::fstat(fd->get(), &st) != 0) continue;
    auto e = std::make_shared<Entry>();
    e->version = *version;
    e->id = *Hash128::FromHex(name.substr(name.find('.') + 1, 32));
    e->path = path;
    e->fd = std::move(fd).value();
    e->bytes = uint64_t(st.st_blocks) * 512;
    auto [it, inserted] = found.emplace(*version, e);
    if (!inserted) ::unlink(path.c_str());  // two of one version: Retain checks the one kept
  }
  MutexLock lock(&mu_);
  entries_ = std::move(found);
  return Status::Ok();
}

Hash128 SnapshotSet::ContentId(const Version& v) {
  return ContentId(v.manifest.block_bytes, v.records);
}

Hash128 SnapshotSet::ContentId(uint64_t block_bytes, const std::vector<BlockRecord>& records) {
  std::string buf = "dte-snapshot";
  PutFixed(&buf, kSnapshotFormatVersion, 4);
  PutFixed(&buf, block_bytes, 8);
  PutFixed(&buf, records.size(), 8);
  Hasher128 h;
  for (const BlockRecord& r : records) {
    PutFixed(&buf, r.hash, 8);
    if (buf.size() >= 4096) {
      h.Update(buf.data(), buf.size());
      buf.clear();
    }
  }
  h.Update(buf.data(), buf.size());
  return h.Finish();
}

std::string SnapshotSet::FileName(const Version& v) {
  return VersionName(v.manifest.version) + "." + ContentId(v).Hex() + kSuffix;
}

bool SnapshotSet::Matches(Entry* e, const Version& v) {
  {
    MutexLock lock(&e->mu);
    if (e->verified_key && *e->verified_key == v.key) return true;
  }
  if (e->version != v.manifest.version || ContentId(v) != e->id) return false;
  MutexLock lock(&e->mu);
  e->verified_key = v.key;
  return true;
}

bool SnapshotSet::ReadBlock(const Version& v, size_t record, uint64_t len, uint8_t* dst) {
  std::shared_ptr<Entry> e;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(v.manifest.version);
    if (it == entries_.end()) return false;
    e = it->second;
  }
  if (record >= v.records.size() || len > v.manifest.block_bytes || !Matches(e.get(), v)) {
    return false;
  }
  auto n = PreadUpTo(e->fd.get(), dst, len, record * v.manifest.block_bytes, e->path);
  if (!n.ok() || *n != len) {
    Drop(e, n.ok() ? e->path + ": file is short" : n.status().message());
    return false;
  }
  if (HashBlock(dst, len) != v.records[record].hash) {
    hash_failures_++;
    Drop(e, e->path + ": block record " + std::to_string(record) +
                " does not match its hash; snapshot dropped");
    return false;
  }
  block_reads_++;
  return true;
}

void SnapshotSet::Drop(const std::shared_ptr<Entry>& e, const std::string& why) {
  MutexLock lock(&mu_);
  if (!why.empty()) last_error_ = why;
  auto it = entries_.find(e->version);
  if (it == entries_.end() || it->second != e) return;  // already dropped or replaced
  entries_.erase(it);
  ::unlink(e->path.c_str());  // under mu_: a rebuild of the same name cannot be in between
}

bool SnapshotSet::Has(const Version& v) {
  std::shared_ptr<Entry> e;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(v.manifest.version);
    if (it == entries_.end()) return false;
    e = it->second;
  }
  return Matches(e.get(), v);
}

void SnapshotSet::Remove(uint64_t version) {
  MutexLock lock(&mu_);
  auto it = entries_.find(version);
  if (it == entries_.end()) return;
  ::unlink(it->second->path.c_str());
  entries_.erase(it);
}

std::set<uint64_t> SnapshotSet::Retain(
    const std::map<uint64_t, std::shared_ptr<const Version>>& versions) {
  std::vector<std::shared_ptr<Entry>> all;
  {
    MutexLock lock(&mu_);
    for (const auto& [version, e] : entries_) all.push_back(e);
  }
  std::set<uint64_t> kept;
  for (const auto& e : all) {
    auto it = versions.find(e->version);
    if (it != versions.end() && Matches(e.get(), *it->second)) {
      kept.insert(e->version);
    } else {
      Drop(e, "");  // its version left the store (or changed): not an error
    }
  }
  return kept;
}

SnapshotStats SnapshotSet::Stats() const {
  SnapshotStats s;
  MutexLock lock(&mu_);
  for (const auto& [version, e] : entries_) {
    s.versions.push_back(version);
    s.bytes += e->bytes;
  }
  s.count = entries_.size();
  s.building = building_;
  s.building_blocks_done = building_done_;
  s.building_blocks = building_total_;
  s.block_reads = block_reads_.load();
  s.hash_failures = hash_failures_.load();
  s.built = built_;
  s.last_error = last_error_;
  return s;
}

Status SnapshotSet::Build(const std::shared_ptr<const Version>& v, Materializer* reader,
                          const std::atomic<bool>& cancel) {
  if (Has(*v)) return Status::Ok();
  {
    MutexLock lock(&mu_);
    building_ = v->manifest.version;
    building_done_ = 0;
    building_total_ = v->records.size();
  }
  Status s = [&]() -> Status {
    ASSIGN_OR_RETURN(auto writer, Begin(v->manifest.version, v->manifest.block_bytes,
                                        SnapshotSize(v->manifest)));
    RETURN_IF_ERROR(WriteBlocks(v, reader, writer.get(), cancel));
    return writer->Publish(*v);
  }();
  MutexLock lock(&mu_);
  building_.reset();
  return s.WithContext("snapshot of " + VersionName(v->manifest.version));
}

Status SnapshotSet::Publish(std::shared_ptr<Entry> e, const std::string& tmp) {
  MutexLock lock(&mu_);  // held across the rename: see Drop()
  if (::rename(tmp.c_str(), e->path.c_str()) != 0) return ErrnoStatus("rename " + tmp, errno);
  auto it = entries_.find(e->version);
  if (it != entries_.end() && it->second->path != e->path) ::unlink(it->second->path.c_str());
  entries_[e->version] = std::move(e);
  built_++;
  return Status::Ok();
}

Status SnapshotSet::WriteBlocks(const std::shared_ptr<const Version>& v, Materializer* reader,
                                SnapshotWriter* writer, const std::atomic<bool>& cancel) {
  const uint64_t bb = v->manifest.block_bytes;
  std::vector<uint8_t> buf(bb);
  for (const FileEntry& f : v->manifest.files) {
    for (const TensorEntry& t : f.tensors) {
      for (uint32_t b = 0; b < t.blocks; ++b) {
        if (cancel.load()) return Aborted("cancelled");
        RETURN_IF_ERROR(reader->ReadBlock(v, f, t, b, buf.data()));
        const uint64_t len = std::min(bb, t.bytes() - uint64_t{b} * bb);
        RETURN_IF_ERROR(writer->Write(uint64_t{t.first_block} + b, buf.data(), len));
        MutexLock lock(&mu_);
        building_done_++;
      }
    }
  }
  return Status::Ok();
}

}  // namespace dte
