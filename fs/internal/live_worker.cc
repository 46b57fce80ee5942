#include "fs/internal/live_worker.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

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

// Fetches waiting for the kernel's retrieve replies, by id (the cookie).
// An id whose fetch gave up waiting is gone: its late reply is dropped.
class Retrievals {
 public:
  struct Pending {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    uint64_t offset = 0;
    std::string data;
    Status error;  // the request could not be sent
  };

  static Retrievals& Get() {
    static Retrievals* r = new Retrievals();  // outlives every request thread
    return *r;
  }

  std::shared_ptr<Pending> Find(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    return it == pending_.end() ? nullptr : it->second;
  }

  std::pair<uint64_t, std::shared_ptr<Pending>> Begin() {
    auto p = std::make_shared<Pending>();
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = ++next_;
    pending_[id] = p;
    return {id, p};
  }
  void End(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(id);
  }
  void Complete(uint64_t id, uint64_t offset, fuse_bufvec* bufv) {
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) return;
      p = it->second;
    }
    std::string data(fuse_buf_size(bufv), '\0');
    fuse_bufvec dst = FUSE_BUFVEC_INIT(data.size());
    dst.buf[0].mem = data.data();
    const ssize_t n = fuse_buf_copy(&dst, bufv, static_cast<fuse_buf_copy_flags>(0));
    data.resize(n > 0 ? static_cast<size_t>(n) : 0);
    std::lock_guard<std::mutex> lock(p->mu);
    p->offset = offset;
    p->data = std::move(data);
    p->done = true;
    p->cv.notify_all();
  }

 private:
  std::mutex mu_;
  uint64_t next_ = 0;
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;
};

// How long a fetch waits for the kernel's reply before the apply fills
// those pages from the read path instead.
constexpr auto kRetrieveTimeout = std::chrono::seconds(10);

// The kernel's page cache of the mount's live/ files.
class FusePageCache : public PageCache {
 public:
  FusePageCache(Filesystem* fs, fuse_session* se, const std::string& mountpoint)
      : fs_(fs), se_(se), mountpoint_(mountpoint) {}

  Status Resident(const std::string& file, uint64_t size, std::vector<uint8_t>* out) override {
    const std::string path = mountpoint_ + "/live/" + file;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open " + path, errno);
    if (NothingCached(fd)) {  // the common case without a reader: no mapping, no page walk
      ::close(fd);
      out->assign((size + kPageBytes - 1) / kPageBytes, 0);
      return Status::Ok();
    }
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (m == MAP_FAILED) return ErrnoStatus("mmap " + path, map_errno);
    out->assign((size + kPageBytes - 1) / kPageBytes, 0);
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

  Status Fetch(uint32_t file_index, uint64_t offset, size_t len, std::string* out) override {
    return FinishFetch(StartFetch(file_index, offset, len), out);
  }

  Ticket StartFetch(uint32_t file_index, uint64_t offset, size_t len) override {
    const auto [id, pending] = Retrievals::Get().Begin();
    const int rc =
        fuse_lowlevel_notify_retrieve(se_, fs_->LiveIno(file_index), len,
                                      static_cast<off_t>(offset), reinterpret_cast<void*>(id));
    // ENOENT: the kernel does not know the inode, so nothing of it is cached.
    if (rc != 0) {
      std::lock_guard<std::mutex> lock(pending->mu);
      pending->done = true;
      pending->offset = offset;
      if (rc != -ENOENT) {
        pending->error =
            ErrnoStatus("page-cache retrieve of live file " + std::to_string(file_index), -rc);
      }
    }
    return {file_index, offset, len, id};
  }

  Status FinishFetch(const Ticket& t, std::string* out) override {
    out->clear();
    std::shared_ptr<Retrievals::Pending> pending = Retrievals::Get().Find(t.id);
    struct End {
      uint64_t id;
      ~End() { Retrievals::Get().End(id); }
    } end{t.id};
    if (!pending) return Internal("page-cache retrieve " + std::to_string(t.id) + " is unknown");
    std::unique_lock<std::mutex> lock(pending->mu);
    if (!pending->cv.wait_for(lock, kRetrieveTimeout, [&] { return pending->done; })) {
      return IOError("page-cache retrieve of live file " + std::to_string(t.file) + " at " +
                     std::to_string(t.offset) + ": no reply from the kernel");
    }
    if (!pending->error.ok()) return pending->error;
    if (pending->offset != t.offset) {
      return Internal("page-cache retrieve of live file " + std::to_string(t.file) +
                      ": the reply is for offset " + std::to_string(pending->offset) + ", not " +
                      std::to_string(t.offset));
    }
    *out = std::move(pending->data);
    return Status::Ok();
  }

 private:
  Filesystem* const fs_;
  fuse_session* const se_;
  const std::string mountpoint_;
};

}  // namespace

void OnRetrieveReply(fuse_req_t req, void* cookie, fuse_ino_t, off_t offset, fuse_bufvec* bufv) {
  Retrievals::Get().Complete(reinterpret_cast<uint64_t>(cookie), static_cast<uint64_t>(offset),
                             bufv);
  fuse_reply_none(req);
}

void ReplyApply(fuse_req_t req, const Result<dte_live_counts>& r) {
  dte_live_apply out = {};
  out.abi_version = DTE_LIVE_ABI_VERSION;
  if (r.ok()) {
    out.counts = *r;
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

bool LiveWorker::Submit(fuse_req_t req, std::optional<uint64_t> version) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || stop_) return false;
    busy_ = true;
    req_ = req;
    version_ = version;
  }
  cv_.notify_all();
  return true;
}

void LiveWorker::Run() {
  FusePageCache pages(fs_, se_, mountpoint_);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || req_ != nullptr; });
    if (req_ == nullptr) return;  // stopping with nothing queued
    fuse_req_t req = req_;
    const std::optional<uint64_t> version = version_;
    lock.unlock();
    Result<dte_live_counts> r = fs_->ApplyLive(version, &pages);
    if (r.ok()) {
      LogLine("dtefs: live apply " + VersionName(r->from_version) + " -> " +
              VersionName(r->to_version) + ": " + std::to_string(r->entries) + " entries, " +
              std::to_string(r->receivers) + " receivers, " + std::to_string(r->pages) +
              " pages in " + std::to_string(r->elapsed_ns / 1000000) + " ms");
    } else {
      LogLine("dtefs: live apply failed: " + r.status().message());
    }
    ReplyApply(req, r);
    lock.lock();
    req_ = nullptr;
    busy_ = false;
  }
}

}  // namespace dte::fs
