#include "fs/internal/live_worker.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fs/log.h"

namespace dte::fs {
namespace {

// cachestat(2) (Linux 6.5), which this system's headers may predate: how many
// pages of a file's range are in the page cache, without mapping it.
constexpr long kSysCachestat = 451;
struct CachestatRange {
  uint64_t off, len;  // len 0: to the end of the file
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

// True when the file certainly has no page cached (cachestat says so); false
// when it has some, or cachestat is not available.
bool NothingCached(int fd) {
  CachestatRange range = {0, 0};
  Cachestat st = {};
  return ::syscall(kSysCachestat, fd, &range, &st, 0) == 0 && st.nr_cache == 0;
}

// The kernel's page cache of the mount's live/ files.
class FusePageCache : public live::PageCache {
 public:
  FusePageCache(Filesystem* fs, fuse_session* se, const std::string& mountpoint)
      : fs_(fs), se_(se), mountpoint_(mountpoint) {}

  Status Resident(const std::string& file, uint64_t size, std::vector<uint8_t>* out) override {
    const std::string path = mountpoint_ + "/live/" + file;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open " + path, errno);
    if (NothingCached(fd)) {  // the common case without a reader: no mapping, no page walk
      ::close(fd);
      out->assign((size + live::kPageBytes - 1) / live::kPageBytes, 0);
      return Status::Ok();
    }
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (m == MAP_FAILED) return ErrnoStatus("mmap " + path, map_errno);
    out->assign((size + live::kPageBytes - 1) / live::kPageBytes, 0);
    const int rc = ::mincore(m, size, out->data());
    const int mincore_errno = errno;
    ::munmap(m, size);
    if (rc != 0) return ErrnoStatus("mincore " + path, mincore_errno);
    return Status::Ok();
  }

  Status Store(uint32_t file_index, uint64_t offset, const char* data, size_t len) override {
    fuse_bufvec bufv = FUSE_BUFVEC_INIT(len);
    bufv.buf[0].mem = const_cast<char*>(data);
    const int rc =
        fuse_lowlevel_notify_store(se_, fs_->LiveIno(file_index), static_cast<off_t>(offset), &bufv,
                                   static_cast<fuse_buf_copy_flags>(0));
    // ENOENT: the kernel does not know the inode, so nothing of it is cached.
    if (rc != 0 && rc != -ENOENT) {
      return ErrnoStatus("page-cache store of live file " + std::to_string(file_index), -rc);
    }
    return Status::Ok();
  }

  // Reads through the mount: the kernel copies resident pages straight
  // from the page cache, with no request to the daemon; a page evicted
  // since the residency check is read through the daemon (from the new
  // view, and noted by it: sync/live/live_pages.cc).
  Status Fetch(uint32_t file_index, uint64_t offset, size_t len, char* dst, size_t* got) override {
    *got = 0;
    ASSIGN_OR_RETURN(const int fd, FdOf(file_index));
    while (*got < len) {
      const ssize_t r = ::pread(fd, dst + *got, len - *got, static_cast<off_t>(offset + *got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return ErrnoStatus("read of live file " + std::to_string(file_index), errno);
      if (r == 0) break;
      *got += static_cast<size_t>(r);
    }
    return Status::Ok();
  }

  void Done() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [file, fd] : fds_) ::close(fd);
    fds_.clear();
  }

 private:
  // MOUNT/live/<file>, opened once per apply, readahead off (a fetch reads
  // only pages that were resident).
  Result<int> FdOf(uint32_t file_index) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = fds_.find(file_index); it != fds_.end()) return it->second;
    std::shared_ptr<const live::LiveView> view = fs_->live().View();
    if (!view || file_index >= view->version->manifest.files.size()) {
      return NotFound("live file " + std::to_string(file_index) + " is not in the live version");
    }
    const std::string path =
        mountpoint_ + "/live/" + view->version->manifest.files[file_index].name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open " + path, errno);
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    fds_[file_index] = fd;
    return fd;
  }

  Filesystem* const fs_;
  fuse_session* const se_;
  const std::string mountpoint_;
  std::mutex mu_;
  std::map<uint32_t, int> fds_;
};

}  // namespace

void ReplyApply(fuse_req_t req, const Result<dte_live_counts>& r, uint32_t prepared) {
  dte_live_apply out = {};
  out.abi_version = DTE_LIVE_ABI_VERSION;
  if (r.ok()) {
    out.counts = *r;
    out.prepared = prepared;
    fuse_reply_ioctl(req, 0, &out, sizeof out);
    return;
  }
  ReplyLiveError(req, LiveErrno(r.status()), &out, r.status().message());
}

LiveWorker::LiveWorker(Filesystem* fs, fuse_session* se, std::string mountpoint)
    : fs_(fs), se_(se), mountpoint_(std::move(mountpoint)), thread_([this] { Run(); }) {}

LiveWorker::~LiveWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool LiveWorker::Submit(const Request& r) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || stop_) return false;
    busy_ = true;
    req_ = r;
  }
  cv_.notify_all();
  return true;
}

void LiveWorker::Run() {
  FusePageCache pages(fs_, se_, mountpoint_);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || req_.req != nullptr; });
    if (req_.req == nullptr) return;  // stopping with nothing queued
    const Request q = req_;
    lock.unlock();
    uint32_t id = 0;
    Result<dte_live_counts> r =
        q.flags == DTE_LIVE_APPLY_PREPARE  ? fs_->PrepareLive(q.owner, q.version, &id)
        : q.flags == DTE_LIVE_APPLY_COMMIT ? fs_->CommitLive(q.owner, q.prepared, &pages)
                                           : fs_->ApplyLive(q.version, &pages);
    if (r.ok() && q.flags == DTE_LIVE_APPLY_PREPARE) {
      LogLine("dtefs: live apply " + std::to_string(id) + " " + VersionName(r->from_version) +
              " -> " + VersionName(r->to_version) + " prepared: " + std::to_string(r->entries) +
              " entries in " + std::to_string(r->decode_ns / 1000000) + " ms");
    } else if (r.ok()) {
      LogLine("dtefs: live apply " + VersionName(r->from_version) + " -> " +
              VersionName(r->to_version) + ": " + std::to_string(r->entries) + " entries, " +
              std::to_string(r->receivers) + " receivers, " + std::to_string(r->pages) +
              " pages in " + std::to_string(r->elapsed_ns / 1000000) + " ms");
    } else {
      LogLine("dtefs: live apply failed: " + r.status().message());
    }
    // Free before the reply: the caller may send the next request as soon
    // as it has it (a coordinator's next phase), and must not find the
    // worker still busy with this one.
    lock.lock();
    req_ = Request{};
    busy_ = false;
    lock.unlock();
    ReplyApply(q.req, r, id);
    lock.lock();
  }
}

}  // namespace dte::fs
