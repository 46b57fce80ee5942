#include "store/write/blob_sink.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>

#include "store/base/posix_file.h"

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
  RETURN_IF_ERROR(CannotWording(WriteAll(fd_, buf_.data(), buf_.size(), "spool file " + path_)));
  buf_.clear();
  return Status::Ok();
}

Result<BlobRef> BlobSink::PutBytes(std::string_view data) {
  std::string copy(data);
  return Adopt(HashBytes(data.data(), data.size()), data.size(), &copy, nullptr);
}

Result<std::unique_ptr<Spool>> BlobSink::NewSpool() {
  ASSIGN_OR_RETURN(std::string path, objects_->NewTempPath());
  int err = 0;
  Result<ScopedFd> fd = OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC, 0644, &err);
  if (!fd.ok()) return ErrnoStatus("cannot create spool file " + path, err);
  return std::unique_ptr<Spool>(new Spool(path, fd->release()));
}

Result<BlobRef> BlobSink::Finish(std::unique_ptr<Spool> spool) {
  RETURN_IF_ERROR(spool->Flush());
  ScopedFd fd(std::exchange(spool->fd_, -1));
  RETURN_IF_ERROR(CannotWording(fd.Close("spool file " + spool->path_)));
  auto ref = Adopt(spool->hasher_.Finish(), spool->size_, nullptr, &spool->path_);
  return ref;
}

Result<BlobRef> BlobSink::Adopt(const Hash128& hash, uint64_t size, const std::string* data,
                                const std::string* path) {
  std::string key = BlobKey(hash);
  for (const auto& b : used_) {
    if (b.hash == hash) return BlobRef{hash, size, false};
  }
  ASSIGN_OR_RETURN(auto existing, objects_->Size(key));
  if (existing && *existing == size) {
    RETURN_IF_ERROR(objects_->Touch(key));
    used_.push_back(BlobRef{hash, size, false});
    return used_.back();
  }
  // Missing, or a damaged copy of the wrong size: (re)write it.
  if (data) {
    RETURN_IF_ERROR(objects_->Put(key, *data));
  } else {
    RETURN_IF_ERROR(objects_->PutFile(key, *path));
  }
  BlobRef ref{hash, size, true};
  added_.push_back(ref);
  used_.push_back(ref);
  return ref;
}

void BlobSink::Include(const BlobRef& ref) {
  for (const auto& b : used_) {
    if (b.hash == ref.hash) return;
  }
  used_.push_back(ref);
  if (ref.added) added_.push_back(ref);
}

Status BlobSink::Refresh() {
  for (const auto& b : used_) {
    std::string key = BlobKey(b.hash);
    ASSIGN_OR_RETURN(auto size, objects_->Size(key));
    if (size != b.size) {
      return NotFound("blob " + key + " written by this commit has gone before its manifest " +
                      "was created (a gc whose grace window is shorter than the commit?); " +
                      "retry the commit");
    }
    RETURN_IF_ERROR(objects_->Touch(key));
  }
  return Status::Ok();
}

uint64_t BlobSink::added_bytes() const {
  uint64_t n = 0;
  for (const auto& b : added_) n += b.size;
  return n;
}

Status AppendEncodedBlock(const EncodedBlock& block, uint32_t blob_index, Spool* spool,
                          BlockRecord* rec) {
  rec->kind = block.kind;
  rec->changed = block.changed;
  if (block.kind == BlockKind::kSame) return Status::Ok();
  rec->blob = blob_index;
  rec->offset = spool->size();
  rec->length = static_cast<uint32_t>(block.payload.size());
  return spool->Append(block.payload.data(), block.payload.size());
}

}  // namespace dte::internal
