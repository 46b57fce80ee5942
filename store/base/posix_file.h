// POSIX file helpers: an owning file descriptor and read/write loops that
// retry EINTR and partial transfers.
//
// Errors: an errno failure becomes ErrnoStatus("<verb> <path>", errno), e.g.
// "read /ckpt/a.bin: Input/output error", with verb open, read, write or
// close; the Status code follows the errno (NotFound for ENOENT, ...). The
// `path` argument of the functions that take a descriptor only names the file
// in such messages. CannotWording rewords them for callers whose messages say
// "cannot read ..." instead.
//
// Thread-safety: the functions are thread-safe; concurrent preads of one
// descriptor are fine. A ScopedFd has one owner; its const get() may be
// called from any thread, moving and closing may not race with anything.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "store/base/status.h"

namespace dte {

// Owns one file descriptor (or none, -1) and closes it when destroyed.
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept;
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();

  int get() const { return fd_; }
  // Gives up ownership: returns the descriptor, which the caller now closes.
  int release();
  // Closes now and reports close(2)'s error, which can carry a failed write
  // on network filesystems. The descriptor is gone either way.
  Status Close(const std::string& path);

 private:
  int fd_;
};

// open(2) with O_CLOEXEC added, retried on EINTR. On failure the errno also
// goes to `*err`, if given, for callers that branch on it (ENOENT, ...) or
// word their own message.
Result<ScopedFd> OpenFile(const std::string& path, int flags, mode_t mode = 0, int* err = nullptr);

// Writes all `len` bytes of `data`.
Status WriteAll(int fd, const void* data, size_t len, const std::string& path);

// Reads up to `len` bytes at `offset` into `dst`; fewer only at end of file.
// Returns how many were read.
Result<uint64_t> PreadUpTo(int fd, void* dst, uint64_t len, uint64_t offset,
                           const std::string& path);

// Reads exactly `len` bytes at `offset`. When the file ends first, returns
// on_short(bytes_read): what a short file means (a truncated input, a file
// that changed while read, a damaged object) is the caller's to word.
template <typename OnShort>
Status PreadExact(int fd, void* dst, uint64_t len, uint64_t offset, const std::string& path,
                  const OnShort& on_short) {
  ASSIGN_OR_RETURN(uint64_t n, PreadUpTo(fd, dst, len, offset, path));
  if (n < len) return on_short(n);
  return Status::Ok();
}

// The whole content of `path`, read until end of file.
Result<std::string> ReadWholeFile(const std::string& path);

// Deletes the regular files directly in `dir` whose modification time is at
// least `min_age_seconds` old (spool and temp areas left by writers that
// died). Returns how many were removed; 0 if `dir` does not exist.
Result<uint64_t> RemoveFilesOlderThan(const std::string& dir, int64_t min_age_seconds);

// An error of the functions above, "<verb> <path>: <strerror>", reworded as
// "cannot <verb> <path>: <strerror>" with the same code. OK stays OK.
Status CannotWording(const Status& status);

template <typename T>
Result<T> CannotWording(Result<T> result) {
  if (result.ok()) return result;
  return CannotWording(result.status());
}

}  // namespace dte
