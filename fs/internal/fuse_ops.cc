#include "fs/internal/fuse_ops.h"

#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fs/internal/live_worker.h"
#include "sync/live/live_abi.h"

namespace dte::fs {
namespace {

// Version directories and files never change while mounted: the kernel may
// keep their attributes and names for long. The root, `latest` and
// .dte/status change as versions come and go, so they are never cached.
constexpr double kImmutableTimeout = 3600.0;
// A version directory can still disappear (gc): its name is re-checked soon.
constexpr double kVersionDirEntryTimeout = 1.0;

// Largest read request; EffectiveMountOptions() passes the same as -o max_read.
constexpr unsigned kMaxRead = 1 << 20;
// Pieces one read reply may have (the kernel takes up to 1024 iovecs).
constexpr size_t kMaxReplyPieces = 64;

Filesystem* Fs(fuse_req_t req) {
  auto* state = static_cast<MountState*>(fuse_req_userdata(req));
  if (!state->tuned.load(std::memory_order_acquire)) {  // the first requests only
    state->serving = true;
    state->serving.notify_all();
    state->tuned.wait(false);  // a sysfs write away, on the tuning thread
  }
  return state->fs.get();
}

struct stat ToStat(const NodeAttr& a) {
  struct stat st = {};
  st.st_ino = a.ino;
  switch (a.type) {
    case NodeType::kDirectory:
      st.st_mode = S_IFDIR | 0555;
      st.st_nlink = 2;
      break;
    case NodeType::kRegular:
      st.st_mode = S_IFREG | 0444;
      st.st_nlink = 1;
      break;
    case NodeType::kSymlink:
      st.st_mode = S_IFLNK | 0777;
      st.st_nlink = 1;
      break;
  }
  st.st_uid = getuid();
  st.st_gid = getgid();
  st.st_size = static_cast<off_t>(a.size);
  st.st_blksize = 256 * 1024;
  st.st_blocks = static_cast<blkcnt_t>((a.size + 511) / 512);
  st.st_mtim.tv_sec = st.st_ctim.tv_sec = st.st_atim.tv_sec = a.mtime;
  return st;
}

double AttrTimeout(const NodeAttr& a) { return a.immutable ? kImmutableTimeout : 0.0; }

void ReplyError(fuse_req_t req, const Status& s) { fuse_reply_err(req, ErrnoOf(s)); }

void ReplyEntry(fuse_req_t req, const Result<NodeAttr>& a) {
  if (!a.ok()) return ReplyError(req, a.status());
  fuse_entry_param e = {};
  e.ino = a->ino;
  e.attr = ToStat(*a);
  e.attr_timeout = AttrTimeout(*a);
  e.entry_timeout = !a->immutable                     ? 0.0
                    : a->type == NodeType::kDirectory ? kVersionDirEntryTimeout
                                                      : kImmutableTimeout;
  fuse_reply_entry(req, &e);
}

// --- read-only namespace ------------------------------------------------------

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  ReplyEntry(req, Fs(req)->Lookup(parent, name));
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Result<NodeAttr> a = Fs(req)->GetAttr(ino);
  if (!a.ok()) return ReplyError(req, a.status());
  struct stat st = ToStat(*a);
  fuse_reply_attr(req, &st, AttrTimeout(*a));
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  Result<std::string> target = Fs(req)->ReadLink(ino);
  if (!target.ok()) return ReplyError(req, target.status());
  fuse_reply_readlink(req, target->c_str());
}

// A directory listing is taken once at opendir, so a reader paging through
// it sees one consistent set of versions.
void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Result<std::vector<DirEntry>> entries = Fs(req)->ReadDir(ino);
  if (!entries.ok()) return ReplyError(req, entries.status());
  auto listing = std::make_unique<std::vector<DirEntry>>(std::move(entries).value());
  fi->fh = reinterpret_cast<uint64_t>(listing.get());
  if (fuse_reply_open(req, fi) == 0) listing.release();
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  const auto& listing = *reinterpret_cast<const std::vector<DirEntry>*>(fi->fh);
  std::string buf(size, '\0');
  size_t used = 0;
  for (size_t i = static_cast<size_t>(off); i < listing.size(); ++i) {
    struct stat st = ToStat(listing[i].attr);
    size_t n = fuse_add_direntry(req, buf.data() + used, size - used, listing[i].name.c_str(), &st,
                                 static_cast<off_t>(i + 1));
    if (n > size - used) break;
    used += n;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete reinterpret_cast<std::vector<DirEntry>*>(fi->fh);
  fuse_reply_err(req, 0);
}

// --- files ------------------------------------------------------------------------

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Result<std::unique_ptr<OpenFile>> f = Fs(req)->Open(ino, fi->flags);
  if (!f.ok()) return ReplyError(req, f.status());
  // Version files are immutable: keep their page cache across opens, and no
  // direct I/O so mmap works. live/ files too: an apply replaces their cached
  // pages in place. The .dte files change on every read.
  const bool dte_file = (*f)->version == nullptr && !(*f)->live;
  fi->keep_cache = !dte_file;
  fi->direct_io = dte_file;
  fi->fh = reinterpret_cast<uint64_t>(f->get());
  if (fuse_reply_open(req, fi) == 0) f->release();
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  const auto& f = *reinterpret_cast<const OpenFile*>(fi->fh);
  size = std::min<size_t>(size, kMaxRead);
  Filesystem* fs = Fs(req);
  // A live/ read holds off an apply's switch until its reply is written.
  std::optional<live::Live::ReadGuard> guard;
  if (f.live) guard.emplace(&fs->live());
  // The reply points at the cached blocks themselves (held until the reply
  // is written), so the bytes are copied once, by the kernel. A read cut
  // into more pieces than is worth a vector (many tiny tensors) is copied
  // into one buffer per FUSE worker thread instead.
  thread_local std::vector<ReadPath::Piece> pieces;
  thread_local std::vector<iovec> iov;
  pieces.clear();
  Status s =
      fs->ReadPieces(f, static_cast<uint64_t>(off), size, &pieces, guard ? guard->view() : nullptr);
  if (!s.ok()) {
    pieces.clear();
    return (void)fuse_reply_err(req, ReadErrnoOf(s));
  }
  if (guard && guard->view()) {
    fs->live().NoteRead(guard->view().get(), f.file_index, static_cast<uint64_t>(off), size);
  }
  if (pieces.empty()) {
    fuse_reply_buf(req, nullptr, 0);  // at or past the end of the file
  } else if (pieces.size() <= kMaxReplyPieces) {
    iov.clear();
    for (const ReadPath::Piece& p : pieces) iov.push_back({const_cast<char*>(p.data), p.size});
    fuse_reply_iov(req, iov.data(), static_cast<int>(iov.size()));
  } else {
    thread_local std::unique_ptr<char[]> buffer(new char[kMaxRead]);
    size_t n = 0;
    for (const ReadPath::Piece& p : pieces) {
      std::memcpy(buffer.get() + n, p.data, p.size);
      n += p.size;
    }
    fuse_reply_buf(req, buffer.get(), n);
  }
  pieces.clear();  // releases the blocks
}

void OpRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  auto* f = reinterpret_cast<OpenFile*>(fi->fh);
  // A closed control file (its process exited) takes its receivers along.
  if (f->control) Fs(req)->live().Drop(fi->fh);
  delete f;
  fuse_reply_err(req, 0);
}

// --- live apply: ioctls on .dte/control (sync/live/live_abi.h) ----------------------

// Only the mounting user and root may apply.
bool MayApply(fuse_req_t req) {
  const fuse_ctx* ctx = fuse_req_ctx(req);
  return ctx->uid == 0 || ctx->uid == ::getuid();
}

void OpIoctl(fuse_req_t req, fuse_ino_t ino, int cmd, void*, fuse_file_info* fi, unsigned flags,
             const void* in_buf, size_t in_bufsz, size_t out_bufsz) {
  if (ino != kControlIno || (flags & FUSE_IOCTL_DIR) || (flags & FUSE_IOCTL_COMPAT)) {
    return (void)fuse_reply_err(req, ENOTTY);
  }
  Filesystem* fs = Fs(req);
  const unsigned command = static_cast<unsigned>(cmd);
  switch (command) {
    case DTE_IOC_APPLY: {
      dte_live_apply a = {};
      if (in_bufsz < sizeof a || out_bufsz < sizeof a) return (void)fuse_reply_err(req, EINVAL);
      std::memcpy(&a, in_buf, sizeof a);
      if (!MayApply(req)) {
        return ReplyLiveError(req, EPERM, &a,
                              "live apply: only root and the user who mounted it may apply");
      }
      if (a.abi_version != DTE_LIVE_ABI_VERSION) {
        return ReplyLiveError(req, EINVAL, &a,
                              "live apply: ABI version " + std::to_string(a.abi_version) +
                                  ", this daemon speaks " + std::to_string(DTE_LIVE_ABI_VERSION));
      }
      if (a.flags != 0 && a.flags != DTE_LIVE_APPLY_PREPARE && a.flags != DTE_LIVE_APPLY_COMMIT &&
          a.flags != DTE_LIVE_APPLY_ABORT) {
        return ReplyLiveError(req, EINVAL, &a,
                              "live apply: unknown flags " + std::to_string(a.flags) +
                                  " (0, or one of PREPARE, COMMIT, ABORT)");
      }
      if (a.flags == DTE_LIVE_APPLY_ABORT) {  // cheap: answered here
        Status s = fs->live().Abort(fi->fh, a.prepared);
        if (!s.ok()) return ReplyLiveError(req, LiveErrno(s), &a, s.message());
        a.error = 0;
        a.message[0] = '\0';
        fuse_reply_ioctl(req, 0, &a, sizeof a);
        return;
      }
      auto* state = static_cast<MountState*>(fuse_req_userdata(req));
      LiveWorker::Request q;
      q.req = req;
      q.flags = a.flags;
      q.version = a.version == DTE_LIVE_LATEST ? std::nullopt : std::optional<uint64_t>(a.version);
      q.owner = fi->fh;
      q.prepared = a.prepared;
      if (!state->live_worker || !state->live_worker->Submit(q)) {
        return ReplyLiveError(req, EBUSY, &a, "live apply: another apply is running");
      }
      return;  // the worker replies when the apply is done
    }
    case DTE_IOC_STATUS: {
      if (out_bufsz < sizeof(dte_live_status)) return (void)fuse_reply_err(req, EINVAL);
      dte_live_status st = fs->LiveStatus();
      fuse_reply_ioctl(req, 0, &st, sizeof st);
      return;
    }
    case DTE_IOC_REGISTER: {
      dte_live_register r = {};
      if (in_bufsz < sizeof r || out_bufsz < sizeof r) return (void)fuse_reply_err(req, EINVAL);
      std::memcpy(&r, in_buf, sizeof r);
      Result<uint64_t> id = fs->live().Register(fi->fh, fuse_req_ctx(req)->uid, r);
      if (!id.ok()) return ReplyLiveError(req, LiveErrno(id.status()), &r, id.status().message());
      r.buffer_id = *id;
      r.error = 0;
      r.message[0] = '\0';
      fuse_reply_ioctl(req, 0, &r, sizeof r);
      return;
    }
    case DTE_IOC_UNREGISTER: {
      uint64_t id = 0;
      if (in_bufsz < sizeof id) return (void)fuse_reply_err(req, EINVAL);
      std::memcpy(&id, in_buf, sizeof id);
      Status s = fs->live().Unregister(fi->fh, id);
      fuse_reply_ioctl(req, -LiveErrno(s), nullptr, 0);
      return;
    }
  }
  fuse_reply_err(req, ENOTTY);
}

// --- modifications: all refused -------------------------------------------------

void ReplyReadOnly(fuse_req_t req, const char* op) { ReplyError(req, ReadOnlyError(op)); }

void OpSetattr(fuse_req_t req, fuse_ino_t, struct stat*, int, fuse_file_info*) {
  ReplyReadOnly(req, "setattr");
}
void OpMknod(fuse_req_t req, fuse_ino_t, const char*, mode_t, dev_t) {
  ReplyReadOnly(req, "mknod");
}
void OpMkdir(fuse_req_t req, fuse_ino_t, const char*, mode_t) { ReplyReadOnly(req, "mkdir"); }
void OpUnlink(fuse_req_t req, fuse_ino_t, const char*) { ReplyReadOnly(req, "unlink"); }
void OpRmdir(fuse_req_t req, fuse_ino_t, const char*) { ReplyReadOnly(req, "rmdir"); }
void OpSymlink(fuse_req_t req, const char*, fuse_ino_t, const char*) {
  ReplyReadOnly(req, "symlink");
}
void OpRename(fuse_req_t req, fuse_ino_t, const char*, fuse_ino_t, const char*, unsigned int) {
  ReplyReadOnly(req, "rename");
}
void OpLink(fuse_req_t req, fuse_ino_t, fuse_ino_t, const char*) { ReplyReadOnly(req, "link"); }
void OpWrite(fuse_req_t req, fuse_ino_t, const char*, size_t, off_t, fuse_file_info*) {
  ReplyReadOnly(req, "write");
}
void OpCreate(fuse_req_t req, fuse_ino_t, const char*, mode_t, fuse_file_info*) {
  ReplyReadOnly(req, "create");
}

// --- session ------------------------------------------------------------------------

void OpInit(void* userdata, fuse_conn_info* conn) {
  // Large requests: the kernel may send reads of up to 1 MiB (with -o
  // max_read) and read ahead as far as asked. The kernel caps max_readahead
  // at its current window (128 KiB by default); the window itself is raised
  // through sysfs once INIT is done (fs/readahead.h).
  // libfuse requires init to repeat the session's max_read.
  const uint32_t readahead_kb = static_cast<MountState*>(userdata)->readahead_kb;
  conn->max_read = kMaxRead;
  conn->max_readahead = readahead_kb > 0 ? readahead_kb * 1024 : kMaxRead;
  if (conn->capable & FUSE_CAP_ASYNC_READ) conn->want |= FUSE_CAP_ASYNC_READ;
}

fuse_lowlevel_ops MakeOps() {
  fuse_lowlevel_ops ops = {};
  ops.init = OpInit;
  ops.lookup = OpLookup;
  ops.getattr = OpGetattr;
  ops.readlink = OpReadlink;
  ops.opendir = OpOpendir;
  ops.readdir = OpReaddir;
  ops.releasedir = OpReleasedir;
  ops.open = OpOpen;
  ops.read = OpRead;
  ops.release = OpRelease;
  ops.ioctl = OpIoctl;
  ops.setattr = OpSetattr;
  ops.mknod = OpMknod;
  ops.mkdir = OpMkdir;
  ops.unlink = OpUnlink;
  ops.rmdir = OpRmdir;
  ops.symlink = OpSymlink;
  ops.rename = OpRename;
  ops.link = OpLink;
  ops.write = OpWrite;
  ops.create = OpCreate;
  return ops;
}

}  // namespace

int ReadErrnoOf(const Status& s) {
  // A file's bytes that cannot be had now (a blob gone, the store down or
  // slow) are an I/O error to the reader, as with a disk.
  switch (s.code()) {
    case Code::kNotFound:
    case Code::kUnavailable:
    case Code::kDeadlineExceeded:
      return EIO;
    default:
      return ErrnoOf(s);
  }
}

const fuse_lowlevel_ops& FilesystemOps() {
  static const fuse_lowlevel_ops ops = MakeOps();
  return ops;
}

}  // namespace dte::fs
