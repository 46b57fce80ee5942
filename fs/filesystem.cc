#include "fs/filesystem.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

#include "fs/log.h"

namespace dte::fs {
namespace {

constexpr size_t kMaxErrors = 32;  // recent errors kept for .dte/status

// "v00000012" -> 12; nullopt for anything else.
std::optional<uint64_t> ParseVersionName(std::string_view name) {
  if (name.size() < 9 || name.size() > 13 || name[0] != 'v') return std::nullopt;
  uint64_t n = 0;
  for (char c : name.substr(1)) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + static_cast<uint64_t>(c - '0');
  }
  if (VersionName(n) != name) return std::nullopt;
  return n;
}

}  // namespace

Status ReadOnlyError(const std::string& what) {
  return Status(Code::kUnimplemented, what + ": the dtefs mount is read-only");
}

int ErrnoOf(const Status& s) {
  switch (s.code()) {
    case Code::kOk:
      return 0;
    case Code::kNotFound:
      return ENOENT;
    case Code::kInvalidArgument:
      return EINVAL;
    case Code::kAlreadyExists:
      return EEXIST;
    case Code::kUnavailable:
      return EBUSY;
    case Code::kDeadlineExceeded:
      return ETIMEDOUT;
    case Code::kFailedPrecondition:
      return EBADFD;  // "in bad state": the state is wrong for the request
    case Code::kAborted:
      return ECANCELED;
    case Code::kPermissionDenied:
      return EACCES;
    case Code::kUnimplemented:
      return EROFS;  // see ReadOnlyError()
    case Code::kCorruption:
    case Code::kIOError:
    case Code::kInternal:
      return EIO;
  }
  return EIO;
}

int LiveErrno(const Status& s) {
  // As any request, except that a refused caller is not permitted (not a
  // file mode matter) and a missing capability is not a read-only mount.
  switch (s.code()) {
    case Code::kPermissionDenied:
      return EPERM;
    case Code::kUnimplemented:
      return EOPNOTSUPP;
    default:
      return ErrnoOf(s);
  }
}

int64_t ParseRfc3339(const std::string& text) {
  std::tm tm{};
  if (std::sscanf(text.c_str(), "%d-%d-%dT%d:%d:%d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                  &tm.tm_hour, &tm.tm_min, &tm.tm_sec) != 6) {
    return 0;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return static_cast<int64_t>(timegm(&tm));
}

Filesystem::Filesystem(Store* store, uint64_t cache_bytes)
    : store_(store), reader_(store, cache_bytes) {
  root_mtime_ = mount_time_;
}

Result<std::shared_ptr<const Version>> Filesystem::VersionOf(uint64_t version) {
  std::string key;
  {
    MutexLock lock(&mu_);
    auto it = versions_.find(version);
    if (it == versions_.end()) return NotFound(VersionName(version) + " is not in the store");
    if (latest_ && latest_->manifest.version == version && latest_->key == it->second) {
      return latest_;
    }
    key = it->second;
  }
  auto v = Load(version, key);
  if (v.ok() || v.status().code() != Code::kNotFound) return v;
  // gc on another host rewrites kept versions under new manifest keys and
  // deletes the old ones; until the next refresh the listing here is
  // behind. The store looks the version up in fresher listings.
  auto fresh = store_->GetVersion(version);
  if (!fresh.ok()) return fresh;
  MutexLock lock(&mu_);
  auto it = versions_.find(version);
  if (it != versions_.end() && it->second == key) it->second = (*fresh)->key;
  return fresh;
}

Result<std::shared_ptr<const Version>> Filesystem::Load(uint64_t version, const std::string& key) {
  auto v = store_->GetVersionAt(version, key);
  if (v.ok() || v.status().code() == Code::kNotFound) return v;
  MutexLock lock(&mu_);
  if (failed_keys_.insert(key).second) {
    LogLine("dtefs: cannot load " + VersionName(version) + ": " + v.status().message());
    PushErrorLocked(v.status().message());
  }
  return v;
}

NodeAttr Filesystem::VersionDirAttr(const Version& v) {
  NodeAttr a;
  a.ino = inodes_.Intern(v.manifest.version, kDirFile);
  a.type = NodeType::kDirectory;
  a.mtime = ParseRfc3339(v.manifest.created);
  a.immutable = true;
  return a;
}

NodeAttr Filesystem::FileAttr(const Version& v, uint32_t file) {
  NodeAttr a;
  a.ino = inodes_.Intern(v.manifest.version, file);
  a.type = NodeType::kRegular;
  a.size = v.manifest.files[file].size;
  a.mtime = ParseRfc3339(v.manifest.created);
  a.immutable = true;
  return a;
}

// Constant attributes: the kernel compares size and mtime on every
// attribute refresh and drops the page cache when they change, which would
// undo the in-place apply. Layouts never change under live/.
NodeAttr Filesystem::LiveFileAttr(const Version& v, uint32_t file) {
  NodeAttr a;
  a.ino = LiveIno(file);
  a.type = NodeType::kRegular;
  a.size = v.manifest.files[file].size;
  a.mtime = mount_time_;
  a.immutable = true;
  return a;
}

// The version a live apply targets (nullopt: the newest); failures are
// counted as failed applies.
Result<std::shared_ptr<const Version>> Filesystem::LiveTarget(std::optional<uint64_t> version) {
  if (version) {
    auto v = VersionOf(*version);
    if (!v.ok()) live_.RecordFailure(v.status());
    return v;
  }
  std::shared_ptr<const Version> target = Latest();
  if (!target) {
    Status s = NotFound("live apply: the store has no versions");
    live_.RecordFailure(s);
    return s;
  }
  return target;
}

Result<dte_live_counts> Filesystem::ApplyLive(std::optional<uint64_t> version,
                                              live::PageCache* pages) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Version> target, LiveTarget(version));
  Result<dte_live_counts> r = live_.Apply(target, pages);
  if (r.ok()) live_apply_latency_.Observe(std::chrono::nanoseconds(r->elapsed_ns));
  return r;
}

Result<dte_live_counts> Filesystem::PrepareLive(uint64_t owner, std::optional<uint64_t> version,
                                                uint32_t* id) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Version> target, LiveTarget(version));
  return live_.Prepare(owner, target, id);
}

Result<dte_live_counts> Filesystem::CommitLive(uint64_t owner, uint32_t id,
                                               live::PageCache* pages) {
  Result<dte_live_counts> r = live_.Commit(owner, id, pages);
  if (r.ok()) live_apply_latency_.Observe(std::chrono::nanoseconds(r->elapsed_ns));
  return r;
}

dte_live_status Filesystem::LiveStatus() {
  dte_live_status st = live_.GetStatus();
  if (std::shared_ptr<const Version> latest = Latest()) {
    st.latest_version = latest->manifest.version;
  }
  return st;
}

NodeAttr Filesystem::RootAttr() {
  MutexLock lock(&mu_);
  NodeAttr a;
  a.ino = kRootIno;
  a.type = NodeType::kDirectory;
  a.mtime = root_mtime_;
  return a;
}

Result<NodeAttr> Filesystem::GetAttr(uint64_t ino) {
  switch (ino) {
    case kRootIno:
      return RootAttr();
    case kLatestIno: {
      ASSIGN_OR_RETURN(std::string target, ReadLink(ino));
      NodeAttr a = RootAttr();
      a.ino = kLatestIno;
      a.type = NodeType::kSymlink;
      a.size = target.size();
      return a;
    }
    case kDteDirIno:
    case kLiveDirIno: {
      NodeAttr a = RootAttr();
      a.ino = ino;
      return a;
    }
    case kStatusIno: {
      NodeAttr a;
      a.ino = kStatusIno;
      a.size = StatusJson().size();
      a.mtime = static_cast<int64_t>(std::time(nullptr));
      return a;
    }
    case kControlIno: {
      NodeAttr a;
      a.ino = kControlIno;
      a.mtime = mount_time_;
      return a;
    }
  }
  if (IsFp8(ino)) return Fp8GetAttr(ino);
  std::optional<InodeKey> key = inodes_.Find(ino);
  if (!key) return NotFound("inode " + std::to_string(ino));
  if (key->version == kLiveKey) {
    std::shared_ptr<const live::LiveView> view = live_.View();
    if (!view || key->file >= view->version->manifest.files.size()) {
      return NotFound("live file inode " + std::to_string(ino));
    }
    return LiveFileAttr(*view->version, key->file);
  }
  ASSIGN_OR_RETURN(auto v, VersionOf(key->version));
  return key->file == kDirFile ? VersionDirAttr(*v) : FileAttr(*v, key->file);
}

Result<NodeAttr> Filesystem::Lookup(uint64_t parent, std::string_view name) {
  if (parent == kRootIno) {
    if (name == "latest") return GetAttr(kLatestIno);
    if (name == ".dte") return GetAttr(kDteDirIno);
    if (name == "live") {
      if (!live_.View()) return NotFound("live: no version is live yet");
      return GetAttr(kLiveDirIno);
    }
    if (name == "fp8" && fp8_) return Fp8DirAttr();
    std::optional<uint64_t> version = ParseVersionName(name);
    if (!version) return NotFound(std::string(name));
    ASSIGN_OR_RETURN(auto v, VersionOf(*version));
    return VersionDirAttr(*v);
  }
  if (parent == kDteDirIno) {
    if (name == "status") return GetAttr(kStatusIno);
    if (name == "control") return GetAttr(kControlIno);
    return NotFound(".dte/" + std::string(name));
  }
  if (parent == kLiveDirIno) {
    std::shared_ptr<const live::LiveView> view = live_.View();
    if (view) {
      const auto& files = view->version->manifest.files;
      for (uint32_t i = 0; i < files.size(); ++i) {
        if (files[i].name == name) return LiveFileAttr(*view->version, i);
      }
    }
    return NotFound("live/" + std::string(name));
  }
  if (IsFp8(parent)) return Fp8Lookup(parent, name);
  std::optional<InodeKey> key = inodes_.Find(parent);
  if (!key || key->file != kDirFile) return NotFound("inode " + std::to_string(parent));
  ASSIGN_OR_RETURN(auto v, VersionOf(key->version));
  const auto& files = v->manifest.files;
  for (uint32_t i = 0; i < files.size(); ++i) {
    if (files[i].name == name) return FileAttr(*v, i);
  }
  return NotFound(VersionName(key->version) + "/" + std::string(name));
}

// Version directories are listed from the listing alone: a directory
// entry carries only the inode and the type, so listing the root loads no
// version (a lookup or stat of one does).
Result<std::vector<DirEntry>> Filesystem::RootEntries() {
  std::vector<DirEntry> out;
  std::vector<uint64_t> versions;
  {
    MutexLock lock(&mu_);
    versions.reserve(versions_.size());
    for (const auto& [version, key] : versions_) versions.push_back(version);
  }
  out.reserve(versions.size() + 3);
  for (uint64_t version : versions) {
    NodeAttr a;
    a.ino = inodes_.Intern(version, kDirFile);
    a.type = NodeType::kDirectory;
    a.immutable = true;
    out.push_back({VersionName(version), a});
  }
  if (!versions.empty()) {
    ASSIGN_OR_RETURN(NodeAttr latest, GetAttr(kLatestIno));
    out.push_back({"latest", latest});
  }
  if (live_.View()) {  // once a version is live, like latest
    ASSIGN_OR_RETURN(NodeAttr live, GetAttr(kLiveDirIno));
    out.push_back({"live", live});
  }
  if (fp8_) out.push_back({"fp8", Fp8DirAttr()});
  ASSIGN_OR_RETURN(NodeAttr dte, GetAttr(kDteDirIno));
  out.push_back({".dte", dte});
  return out;
}

Result<std::vector<DirEntry>> Filesystem::ReadDir(uint64_t ino) {
  if (ino == kRootIno) return RootEntries();
  if (ino == kDteDirIno) {
    ASSIGN_OR_RETURN(NodeAttr status, GetAttr(kStatusIno));
    ASSIGN_OR_RETURN(NodeAttr control, GetAttr(kControlIno));
    return std::vector<DirEntry>{{"control", control}, {"status", status}};
  }
  if (ino == kLiveDirIno) {
    std::vector<DirEntry> out;
    if (std::shared_ptr<const live::LiveView> view = live_.View()) {
      for (uint32_t i = 0; i < view->version->manifest.files.size(); ++i) {
        out.push_back({view->version->manifest.files[i].name, LiveFileAttr(*view->version, i)});
      }
    }
    return out;
  }
  if (IsFp8(ino)) return Fp8ReadDir(ino);
  std::optional<InodeKey> key = inodes_.Find(ino);
  if (!key) return NotFound("inode " + std::to_string(ino));
  if (key->file != kDirFile) return InvalidArgument("inode " + std::to_string(ino) + " is a file");
  ASSIGN_OR_RETURN(auto v, VersionOf(key->version));
  std::vector<DirEntry> out;
  for (uint32_t i = 0; i < v->manifest.files.size(); ++i) {
    out.push_back({v->manifest.files[i].name, FileAttr(*v, i)});
  }
  return out;
}

Result<std::string> Filesystem::ReadLink(uint64_t ino) {
  if (ino != kLatestIno && ino != kFp8LatestIno)
    return InvalidArgument("inode " + std::to_string(ino) + " is no symlink");
  MutexLock lock(&mu_);
  if (versions_.empty()) return NotFound("latest: the store has no versions");
  return VersionName(versions_.rbegin()->first);
}

Result<std::unique_ptr<OpenFile>> Filesystem::Open(uint64_t ino, int flags) {
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC)) {
    return ReadOnlyError("open for writing of inode " + std::to_string(ino));
  }
  auto f = std::make_unique<OpenFile>();
  if (ino == kStatusIno) {
    f->snapshot = StatusJson();
    return f;
  }
  if (ino == kControlIno) {
    f->control = true;
    return f;
  }
  if (IsFp8(ino)) return Fp8Open(ino);
  std::optional<InodeKey> key = inodes_.Find(ino);
  if (!key) return NotFound("inode " + std::to_string(ino));
  if (key->version == kLiveKey) {
    std::shared_ptr<const live::LiveView> view = live_.View();
    if (!view || key->file >= view->version->manifest.files.size()) {
      return NotFound("live file inode " + std::to_string(ino));
    }
    f->live = true;
    f->file_index = key->file;
    return f;
  }
  if (key->file == kDirFile) return InvalidArgument(VersionName(key->version) + " is a directory");
  ASSIGN_OR_RETURN(f->version, VersionOf(key->version));
  f->chain = reader_.ChainOf(f->version, /*stop_at_joins=*/true);
  f->file_index = key->file;
  return f;
}

Status Filesystem::Read(const OpenFile& f, uint64_t offset, uint64_t len, std::string* out) {
  std::shared_ptr<const live::LiveView> view = f.live ? live_.View() : nullptr;
  out->resize(ReadableBytes(f, offset, len, view ? view->version.get() : nullptr));
  Result<size_t> n = Read(f, offset, out->size(), out->data());
  if (!n.ok()) return n.status();
  out->resize(*n);
  return Status::Ok();
}

uint64_t Filesystem::ReadableBytes(const OpenFile& f, uint64_t offset, uint64_t len,
                                   const Version* live) {
  const uint64_t size = f.fp8       ? f.fp8->view.files()[f.file_index].size
                        : f.version ? f.version->manifest.files[f.file_index].size
                        : live      ? live->manifest.files[f.file_index].size
                                    : f.snapshot.size();
  return offset >= size ? 0 : std::min(len, size - offset);
}

Result<size_t> Filesystem::Read(const OpenFile& f, uint64_t offset, uint64_t len, char* dst) {
  std::vector<ReadPath::Piece> pieces;
  RETURN_IF_ERROR(ReadPieces(f, offset, len, &pieces));
  size_t n = 0;
  for (const ReadPath::Piece& p : pieces) {
    std::memcpy(dst + n, p.data, p.size);
    n += p.size;
  }
  return n;
}

Status Filesystem::ReadPieces(const OpenFile& f, uint64_t offset, uint64_t len,
                              std::vector<ReadPath::Piece>* out,
                              std::shared_ptr<const live::LiveView> live_view) {
  reads_++;
  const auto start = std::chrono::steady_clock::now();
  struct Timed {
    LatencyHistogram& h;
    std::chrono::steady_clock::time_point start;
    ~Timed() { h.Observe(std::chrono::steady_clock::now() - start); }
  } timed{read_latency_, start};
  // A live/ file reads the guard's view, else the version live now.
  std::shared_ptr<const live::LiveView> view;
  if (f.live) view = live_view ? std::move(live_view) : live_.View();
  if (f.live && !view) return NotFound("live: no live version");
  len = ReadableBytes(f, offset, len, view ? view->version.get() : nullptr);
  if (len == 0) return Status::Ok();
  if (f.fp8) return Fp8ReadPieces(f, offset, len, out);
  if (!f.version && !view) {
    out->push_back({nullptr, f.snapshot.data() + offset, static_cast<size_t>(len)});
    return Status::Ok();
  }
  const std::shared_ptr<const Version>& v = view ? view->version : f.version;
  Status s = reader_.ReadPieces(v, f.file_index, offset, len, out, view ? &view->chain : &f.chain);
  if (!s.ok()) {
    read_errors_++;
    RecordError(*v, f.file_index, s);
    return s;
  }
  bytes_served_ += len;
  return Status::Ok();
}

void Filesystem::RecordError(const Version& v, uint32_t file, const Status& s) {
  MutexLock lock(&mu_);
  if (!logged_.insert({v.manifest.version, file}).second) return;
  // The message names the blob, version, file and tensor (Materializer's contract).
  LogLine("dtefs: read of " + VersionName(v.manifest.version) + "/" + v.manifest.files[file].name +
          " failed: " + s.message());
  PushErrorLocked(s.message());
}

void Filesystem::PushErrorLocked(const std::string& message) {
  errors_.push_back(message);
  if (errors_.size() > kMaxErrors) errors_.pop_front();
}

void Filesystem::ReportError(const std::string& message) {
  MutexLock lock(&mu_);
  LogLine("dtefs: " + message);
  PushErrorLocked(message);
}

size_t Filesystem::VersionCount() {
  MutexLock lock(&mu_);
  return versions_.size();
}

std::map<uint64_t, std::string> Filesystem::Versions() {
  MutexLock lock(&mu_);
  return versions_;
}

void Filesystem::SetSnapshots(SnapshotSet* snapshots) {
  snapshots_ = snapshots;
  reader_.SetBase(snapshots);
}

void Filesystem::SetReadaheadBdi(const std::string& bdi) {
  MutexLock lock(&mu_);
  readahead_bdi_ = bdi;
}

}  // namespace dte::fs
