#include "sync/internal/blob_sink.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

namespace dte::internal {
namespace {
constexpr size_t kSpoolBuffer = 8 << 20;
}  // namespace

Spool::~Spool() {
  if (fd_ >= 0) ::close(fd_);
  if (!path_.empty()) ::unlink(path_.c_str());
}

Status Spool::Append(const void* data, size_t len) {
  hasher_.Update(data, len);
  size_ += len;
  buf_.append(static_cast<const char*>(data), len);
  if (buf_.size() >= kSpoolBuffer) return Flush();
  return Status::Ok();
}

Status Spool::Flush() {
  size_t done = 0;
  while (done < buf_.size()) {
    // At most 1 MiB per write(2): larger single writes into the page cache
    // are much slower here (see sync/export.cc).
    ssize_t n = ::write(fd_, buf_.data() + done, std::min<size_t>(buf_.size() - done, 1 << 20));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("cannot write spool file " + path_, errno);
    done += static_cast<size_t>(n);
  }
  buf_.clear();
  return Status::Ok();
}

Result<BlobRef> BlobSink::PutBytes(std::string_view data) {
  std::string copy(data);
  return Adopt(HashBytes(data.data(), data.size()), data.size(), &copy, nullptr);
}

Result<std::unique_ptr<Spool>> BlobSink::NewSpool() {
  ASSIGN_OR_RETURN(std::string path, objects_->NewTempPath());
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("cannot create spool file " + path, errno);
  return std::unique_ptr<Spool>(new Spool(path, fd));
}

Result<BlobRef> BlobSink::Finish(std::unique_ptr<Spool> spool) {
  RETURN_IF_ERROR(spool->Flush());
  if (::close(spool->fd_) != 0) {
    spool->fd_ = -1;
    return ErrnoStatus("cannot close spool file " + spool->path_, errno);
  }
  spool->fd_ = -1;
  auto ref = Adopt(spool->hasher_.Finish(), spool->size_, nullptr, &spool->path_);
  return ref;
}

Result<BlobRef> BlobSink::Adopt(const Hash128& hash, uint64_t size, const std::string* data,
                                const std::string* path) {
  std::string key = BlobKey(hash);
  for (const auto& b : added_) {
    if (b.hash == hash) return BlobRef{hash, size, false};
  }
  ASSIGN_OR_RETURN(auto existing, objects_->Size(key));
  if (existing && *existing == size) {
    RETURN_IF_ERROR(objects_->Touch(key));
    return BlobRef{hash, size, false};
  }
  // Missing, or a damaged copy of the wrong size: (re)write it.
  if (data) {
    RETURN_IF_ERROR(objects_->Put(key, *data));
  } else {
    RETURN_IF_ERROR(objects_->PutFile(key, *path));
  }
  BlobRef ref{hash, size, true};
  added_.push_back(ref);
  return ref;
}

uint64_t BlobSink::added_bytes() const {
  uint64_t n = 0;
  for (const auto& b : added_) n += b.size;
  return n;
}

}  // namespace dte::internal
