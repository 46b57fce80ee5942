#include "store/local_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <random>
#include <utility>

#include "store/base/posix_file.h"
#include "store/hash.h"
#include "store/internal/fd_cache.h"
#include "store/listing_check.h"

namespace dte {
namespace {

struct DirCloser {
  void operator()(DIR* dir) const { ::closedir(dir); }
};
using ScopedDir = std::unique_ptr<DIR, DirCloser>;

// Unlinks a temp file when it goes out of scope, unless released.
class TempFileGuard {
 public:
  explicit TempFileGuard(std::string path) : path_(std::move(path)) {}
  ~TempFileGuard() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;
  void Release() { path_.clear(); }

 private:
  std::string path_;
};

// Creates the new file `path` in `tmp_dir`, and `tmp_dir` itself if it went
// missing.
Result<ScopedFd> CreateTempFile(const std::string& path, const std::string& tmp_dir) {
  int err = 0;
  auto fd = OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644, &err);
  if (err != ENOENT) return fd;
  if (::mkdir(tmp_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus("mkdir " + tmp_dir, errno);
  }
  return OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
}

Status FsyncFd(int fd, const std::string& path) {
  if (::fsync(fd) != 0) return ErrnoStatus("fsync " + path, errno);
  return Status::Ok();
}

Status FsyncDir(const std::string& dir) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(dir, O_RDONLY | O_DIRECTORY));
  RETURN_IF_ERROR(FsyncFd(fd.get(), dir));
  return fd.Close(dir);
}

std::string ParentDir(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// mkdir -p for the components of `dir` after its first `keep` characters.
// Appends to `to_sync` the parent of every directory it created and, with
// `sync_found`, of every one it found: a racing creator may not have synced
// its mkdir yet.
Status MakeDirs(const std::string& dir, size_t keep, bool sync_found,
                std::vector<std::string>* to_sync) {
  for (size_t pos = keep; pos < dir.size();) {
    size_t next = std::min(dir.find('/', pos + 1), dir.size());
    std::string part = dir.substr(0, next);
    pos = next;
    if (::mkdir(part.c_str(), 0755) == 0) {
      to_sync->push_back(ParentDir(part));
    } else if (errno != EEXIST) {
      return ErrnoStatus("mkdir " + part, errno);
    } else if (sync_found) {
      to_sync->push_back(ParentDir(part));
    }
  }
  return Status::Ok();
}

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa {};
  struct stat sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

// readdir, with errno 0 at the end of the directory and set on failure.
const dirent* NextEntry(DIR* dir) {
  errno = 0;
  return ::readdir(dir);
}

// DT_REG, DT_DIR or something else; follows symbolic links.
unsigned char EntryType(DIR* dir, const dirent& entry) {
  if (entry.d_type != DT_UNKNOWN && entry.d_type != DT_LNK) return entry.d_type;
  struct stat st {};
  if (::fstatat(::dirfd(dir), entry.d_name, &st, 0) != 0) return DT_UNKNOWN;
  return S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
}

bool IsTempArea(std::string_view rel) { return rel == "tmp" || rel.starts_with("tmp/"); }

}  // namespace

LocalStore::LocalStore(std::string root, size_t max_open_fds)
    : root_(std::move(root)),
      tmp_dir_(root_ + "/tmp"),
      temp_nonce_((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()),
      fd_cache_(std::make_unique<FdCache>(max_open_fds)) {}

LocalStore::~LocalStore() = default;

Result<std::unique_ptr<LocalStore>> LocalStore::Open(const std::string& root,
                                                     const LocalStoreOptions& options) {
  if (root.empty()) return InvalidArgument("store path is empty");
  std::string dir = root;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (options.create && !IsDirectory(dir)) {
    std::vector<std::string> to_sync;
    RETURN_IF_ERROR(MakeDirs(dir, 0, /*sync_found=*/false, &to_sync));
    for (const std::string& d : to_sync) RETURN_IF_ERROR(FsyncDir(d));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFound("store " + dir + " does not exist");
    return ErrnoStatus("store " + dir, errno);
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("store " + dir + " is not a directory");
  // ROOT/tmp is made by the first write, so opening a directory to read it
  // (or to find out it is not a store) changes nothing.
  size_t max_fds = options.max_open_fds;
  struct rlimit nofile {};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
    max_fds = std::min<size_t>(max_fds, nofile.rlim_cur / 4);
  }
  return std::unique_ptr<LocalStore>(new LocalStore(std::move(dir), max_fds));
}

Status LocalStore::CheckKey(const std::string& key) const {
  RETURN_IF_ERROR(ValidateObjectKey(key));
  if (IsTempArea(key)) {
    return InvalidArgument("object key " + key + " is reserved for temporary files in store " +
                           root_);
  }
  return Status::Ok();
}

std::string LocalStore::TempName() {
  return tmp_dir_ + "/" + std::to_string(::getpid()) + "-" + Hex64(temp_nonce_) + "-" +
         std::to_string(temp_counter_.fetch_add(1));
}

Result<std::string> LocalStore::NewTempPath() {
  if (::mkdir(tmp_dir_.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus("mkdir " + tmp_dir_, errno);
  }
  return TempName();
}

// Creates a fresh temp file holding `data`, synced and closed.
Result<std::string> LocalStore::WriteTempFile(std::string_view data) {
  const std::string tmp = TempName();
  ASSIGN_OR_RETURN(ScopedFd fd, CreateTempFile(tmp, tmp_dir_));
  TempFileGuard guard(tmp);
  RETURN_IF_ERROR(WriteAll(fd.get(), data.data(), data.size(), tmp));
  RETURN_IF_ERROR(FsyncFd(fd.get(), tmp));
  RETURN_IF_ERROR(fd.Close(tmp));
  guard.Release();
  return tmp;
}

Result<std::string> LocalStore::CopyToTempFile(const std::string& src) {
  ASSIGN_OR_RETURN(ScopedFd in, dte::OpenFile(src, O_RDONLY));
  const std::string tmp = TempName();
  ASSIGN_OR_RETURN(ScopedFd out, CreateTempFile(tmp, tmp_dir_));
  TempFileGuard guard(tmp);
  std::vector<char> buf(1 << 20);
  for (uint64_t offset = 0;;) {
    ASSIGN_OR_RETURN(uint64_t n, PreadUpTo(in.get(), buf.data(), buf.size(), offset, src));
    if (n == 0) break;
    RETURN_IF_ERROR(WriteAll(out.get(), buf.data(), n, tmp));
    offset += n;
  }
  RETURN_IF_ERROR(FsyncFd(out.get(), tmp));
  RETURN_IF_ERROR(out.Close(tmp));
  guard.Release();
  return tmp;
}

// Syncs `src` and renames it to `dst`; false if they are on different
// filesystems.
Result<bool> LocalStore::MoveSyncedFile(const std::string& src, const std::string& dst) {
  {
    ASSIGN_OR_RETURN(ScopedFd fd, dte::OpenFile(src, O_RDONLY));
    RETURN_IF_ERROR(FsyncFd(fd.get(), src));
  }
  if (::rename(src.c_str(), dst.c_str()) == 0) return true;
  if (errno == EXDEV) return false;
  return ErrnoStatus("rename " + src + " to " + dst, errno);
}

Status LocalStore::MakeParents(const std::string& key, std::vector<std::string>* to_sync) {
  size_t slash = key.rfind('/');
  if (slash == std::string::npos) return Status::Ok();
  std::string dir = PathOf(key.substr(0, slash));
  if (IsDirectory(dir)) return Status::Ok();
  return MakeDirs(dir, root_.size(), /*sync_found=*/true, to_sync);
}

// After `path` got its new entry: drops any cached descriptor for the old
// object and makes the entry and the directories leading to it durable.
Status LocalStore::FinishInstall(const std::string& path, std::vector<std::string> to_sync) {
  fd_cache_->Evict(path);
  to_sync.push_back(ParentDir(path));
  std::sort(to_sync.begin(), to_sync.end());
  to_sync.erase(std::unique(to_sync.begin(), to_sync.end()), to_sync.end());
  for (const std::string& dir : to_sync) RETURN_IF_ERROR(FsyncDir(dir));
  return Status::Ok();
}

Status LocalStore::Put(const std::string& key, std::string_view data) {
  RETURN_IF_ERROR(CheckKey(key));
  auto tmp = WriteTempFile(data);
  if (!tmp.ok()) return tmp.status().WithContext("put " + key);
  TempFileGuard guard(*tmp);
  std::vector<std::string> to_sync;
  RETURN_IF_ERROR(MakeParents(key, &to_sync));
  const std::string path = PathOf(key);
  if (::rename(tmp->c_str(), path.c_str()) != 0) {
    return ErrnoStatus("rename " + *tmp + " to " + path, errno);
  }
  guard.Release();
  return FinishInstall(path, std::move(to_sync));
}

Status LocalStore::PutFile(const std::string& key, const std::string& path) {
  RETURN_IF_ERROR(CheckKey(key));
  std::vector<std::string> to_sync;
  RETURN_IF_ERROR(MakeParents(key, &to_sync));
  const std::string dst = PathOf(key);
  ASSIGN_OR_RETURN(bool moved, MoveSyncedFile(path, dst));
  if (!moved) {  // another filesystem: copy into ROOT/tmp, where rename is atomic
    ASSIGN_OR_RETURN(std::string tmp, CopyToTempFile(path));
    TempFileGuard guard(tmp);
    if (::rename(tmp.c_str(), dst.c_str()) != 0) {
      return ErrnoStatus("rename " + tmp + " to " + dst, errno);
    }
    guard.Release();
    RETURN_IF_ERROR(FinishInstall(dst, std::move(to_sync)));
    if (::unlink(path.c_str()) != 0) return ErrnoStatus("unlink " + path, errno);
    return Status::Ok();
  }
  return FinishInstall(dst, std::move(to_sync));
}

Status LocalStore::CreateExclusive(const std::string& key, std::string_view data) {
  RETURN_IF_ERROR(CheckKey(key));
  auto tmp = WriteTempFile(data);
  if (!tmp.ok()) return tmp.status().WithContext("create " + key);
  TempFileGuard guard(*tmp);  // the temp name goes either way
  return LinkExclusive(*tmp, key);
}

Status LocalStore::LinkExclusive(const std::string& tmp, const std::string& key) {
  std::vector<std::string> to_sync;
  RETURN_IF_ERROR(MakeParents(key, &to_sync));
  const std::string path = PathOf(key);
  if (::link(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    // Over NFS a retransmitted link whose first reply was lost reports
    // EEXIST although it succeeded; the inode tells.
    const bool ours = err == EEXIST && SameFile(tmp, path);
    if (err == EEXIST && !ours) {
      return AlreadyExists("object " + key + " already exists in store " + root_);
    }
    if (!ours) return ErrnoStatus("link " + tmp + " to " + path, err);
  }
  return FinishInstall(path, std::move(to_sync));
}

Result<LocalStore::OpenFilePtr> LocalStore::OpenObject(const std::string& key) const {
  const std::string path = PathOf(key);
  int err = 0;
  // dte::OpenFile is the function; plain OpenFile here names the struct.
  auto fd = dte::OpenFile(path, O_RDONLY, 0, &err);
  if (err == ENOENT || err == ENOTDIR) {
    return NotFound("object " + key + " not found in store " + root_);
  }
  if (!fd.ok()) return fd.status();
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0) return ErrnoStatus("stat " + path, errno);
  if (!S_ISREG(st.st_mode)) return NotFound("object " + key + " is not a file in store " + root_);
  return std::make_shared<const OpenFile>(
      OpenFile{std::move(*fd), static_cast<uint64_t>(st.st_size)});
}

Status LocalStore::TooShort(const std::string& key, uint64_t offset, uint64_t len,
                            uint64_t size) const {
  return Corruption("object " + key + " in store " + root_ + " is " + std::to_string(size) +
                    " bytes, shorter than the requested range [" + std::to_string(offset) + ", " +
                    std::to_string(offset + len) + ")");
}

Status LocalStore::ReadOpenFile(const OpenFile& file, const std::string& key, uint64_t offset,
                                uint64_t len, void* dst) const {
  // Objects are never rewritten in place; a shorter file was truncated behind our back.
  return PreadExact(file.fd.get(), dst, len, offset, PathOf(key),
                    [&](uint64_t n) { return TooShort(key, offset, len, offset + n); });
}

Result<std::string> LocalStore::Get(const std::string& key) {
  RETURN_IF_ERROR(CheckKey(key));
  ASSIGN_OR_RETURN(OpenFilePtr file, OpenObject(key));
  std::string out(file->size, '\0');
  RETURN_IF_ERROR(ReadOpenFile(*file, key, 0, file->size, out.data()));
  return out;
}

// The cached (or freshly opened) object, checked to hold [offset, offset+len).
Result<LocalStore::OpenFilePtr> LocalStore::OpenForRange(const std::string& key, uint64_t offset,
                                                         uint64_t len) {
  RETURN_IF_ERROR(CheckKey(key));
  if (len > UINT64_MAX - offset) {
    return InvalidArgument("range of object " + key + " overflows: offset " +
                           std::to_string(offset) + ", length " + std::to_string(len));
  }
  const std::string path = PathOf(key);
  OpenFilePtr file = fd_cache_->Lookup(path);
  if (file == nullptr) {
    const uint64_t epoch = fd_cache_->Epoch();
    ASSIGN_OR_RETURN(file, OpenObject(key));
    fd_cache_->Insert(path, file, epoch);
  }
  if (offset + len > file->size) return TooShort(key, offset, len, file->size);
  return file;
}

Result<std::string> LocalStore::GetRange(const std::string& key, uint64_t offset, uint64_t len) {
  ASSIGN_OR_RETURN(OpenFilePtr file, OpenForRange(key, offset, len));
  std::string out(len, '\0');
  RETURN_IF_ERROR(ReadOpenFile(*file, key, offset, len, out.data()));
  return out;
}

Status LocalStore::ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) {
  ASSIGN_OR_RETURN(OpenFilePtr file, OpenForRange(key, offset, len));
  return ReadOpenFile(*file, key, offset, len, dst);
}

// stat of the object's file; nullopt if there is none.
Result<std::optional<struct stat>> LocalStore::StatObject(const std::string& key) const {
  RETURN_IF_ERROR(CheckKey(key));
  const std::string path = PathOf(key);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::optional<struct stat>();
    return ErrnoStatus("stat " + path, errno);
  }
  if (!S_ISREG(st.st_mode)) return std::optional<struct stat>();
  return std::optional<struct stat>(st);
}

Result<std::optional<uint64_t>> LocalStore::Size(const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<struct stat> st, StatObject(key));
  if (!st) return std::optional<uint64_t>();
  return std::optional<uint64_t>(st->st_size);
}

Result<int64_t> LocalStore::ModifiedTime(const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<struct stat> st, StatObject(key));
  if (!st) return NotFound("object " + key + " not found in store " + root_);
  return int64_t{st->st_mtim.tv_sec};
}

Status LocalStore::Touch(const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<struct stat> st, StatObject(key));
  if (!st) return NotFound("object " + key + " not found in store " + root_);
  const std::string path = PathOf(key);
  if (::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) != 0) {
    return ErrnoStatus("touch " + path, errno);
  }
  return Status::Ok();
}

Status LocalStore::Delete(const std::string& key) {
  RETURN_IF_ERROR(CheckKey(key));
  const std::string path = PathOf(key);
  const int rc = ::unlink(path.c_str());
  const int err = errno;
  fd_cache_->Evict(path);  // after unlink, so no reader re-caches the old file
  if (rc != 0) {
    // Missing, or a directory (which is not an object): nothing to delete.
    if (err == ENOENT || err == ENOTDIR || err == EISDIR) return Status::Ok();
    return ErrnoStatus("delete " + path, err);
  }
  return FsyncDir(ParentDir(path));
}

Result<std::vector<std::string>> LocalStore::List(const std::string& prefix) {
  RETURN_IF_ERROR(ValidateObjectKeyPrefix(prefix));
  size_t slash = prefix.rfind('/');
  std::vector<std::string> keys;
  RETURN_IF_ERROR(Walk(slash == std::string::npos ? "" : prefix.substr(0, slash), prefix, &keys));
  std::sort(keys.begin(), keys.end());
  return keys;
}

Result<std::vector<std::string>> LocalStore::ListStoreKeys(const std::string& prefix) {
  ASSIGN_OR_RETURN(auto keys, List(prefix));
  std::erase_if(keys, [&](const std::string& key) { return !CheckListedKey(prefix, key).empty(); });
  return keys;
}

// Appends the keys under directory `start` (relative to the root) that begin
// with `prefix`, skipping ROOT/tmp and names that are not valid keys.
Status LocalStore::Walk(const std::string& start, const std::string& prefix,
                        std::vector<std::string>* keys) const {
  std::vector<std::string> pending = {start};
  while (!pending.empty()) {
    const std::string rel = std::move(pending.back());
    pending.pop_back();
    if (IsTempArea(rel)) continue;
    const std::string dir = rel.empty() ? root_ : PathOf(rel);
    ScopedDir d(::opendir(dir.c_str()));
    if (d == nullptr && (errno == ENOENT || errno == ENOTDIR)) continue;  // nothing there
    if (d == nullptr) return ErrnoStatus("list " + dir, errno);
    const dirent* entry;
    while ((entry = NextEntry(d.get())) != nullptr) {
      const std::string name = entry->d_name;
      const std::string key = rel.empty() ? name : rel + "/" + name;
      if (!ValidateObjectKey(key).ok()) continue;  // also skips "." and ".."
      const unsigned char type = EntryType(d.get(), *entry);
      if (type == DT_REG && key.starts_with(prefix)) keys->push_back(key);
      const std::string as_dir = key + "/";
      if (type == DT_DIR && (as_dir.starts_with(prefix) || prefix.starts_with(as_dir))) {
        pending.push_back(key);
      }
    }
    if (errno != 0) return ErrnoStatus("list " + dir, errno);
  }
  return Status::Ok();
}

Result<uint64_t> LocalStore::RemoveStaleTempFiles(int64_t min_age_seconds) {
  return RemoveFilesOlderThan(tmp_dir_, min_age_seconds);
}

size_t LocalStore::CachedFdCount() const { return fd_cache_->Count(); }

bool LocalStore::IsFdCached(const std::string& key) const {
  return fd_cache_->Contains(PathOf(key));
}

}  // namespace dte
