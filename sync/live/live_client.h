// The client side of live apply: the ioctls of sync/live/live_abi.h on
// MOUNT/.dte/control of a dtefs mount (docs/live.md), as Status/Result.
//
// Errors: every message starts with the mount point. A failed command's
// message is the one the daemon wrote into the struct, else strerror(errno);
// the Code follows the errno (EPERM/EACCES: kPermissionDenied, EBUSY/EAGAIN:
// kUnavailable, ETIMEDOUT: kDeadlineExceeded, EBADFD: kFailedPrecondition,
// ECANCELED: kAborted, ENOENT: kNotFound, EINVAL: kInvalidArgument, else
// kIOError; docs/errors.md). A path
// that is not a dtefs mount with live apply fails with kNotFound (no
// .dte/control) or kInvalidArgument (the file takes no dte ioctls, ENOTTY).
//
// FUSE-free: plain open(2) and ioctl(2).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "store/base/posix_file.h"
#include "store/base/status.h"
#include "sync/live/live_abi.h"

namespace dte::live {

// One open control file of a mount. The daemon treats each open control
// file as one receiver: the buffers registered through it are unregistered
// when it is closed (destroyed, or the process exits).
//
// Thread-safety: Apply, GetStatus, Register and Unregister may be called
// concurrently (each is one ioctl); moving and destroying must not race
// with anything.
class Control {
 public:
  // Opens MOUNT/.dte/control read-only.
  static Result<Control> Open(const std::string& mount);

  Control(Control&&) noexcept = default;
  Control& operator=(Control&&) noexcept = default;
  Control(const Control&) = delete;
  Control& operator=(const Control&) = delete;

  // DTE_IOC_APPLY: makes `version` (nullopt: the newest) the live version;
  // returns when every registered buffer and cached page holds it.
  Result<dte_live_apply> Apply(std::optional<uint64_t> version);
  // The two phases of an apply (DTE_LIVE_APPLY_*; docs/live.md, "Servers on
  // several hosts"): Prepare returns the counts so far with `prepared` set
  // to the id Commit and Abort take. The prepared apply belongs to this
  // control file: destroying it aborts the apply.
  Result<dte_live_apply> Prepare(std::optional<uint64_t> version);
  Result<dte_live_apply> Commit(uint32_t prepared);
  Status Abort(uint32_t prepared);
  // DTE_IOC_STATUS.
  Result<dte_live_status> GetStatus();
  // DTE_IOC_REGISTER: fills r->abi_version, clears the out fields, and
  // returns the new buffer_id (also left in r->buffer_id; r->error and
  // r->message hold the daemon's answer either way). name, dtype and
  // shm_name must be NUL-terminated.
  Result<uint64_t> Register(dte_live_register* r);
  // DTE_IOC_UNREGISTER: drops buffer `id`; 0 drops every buffer registered
  // through this control file.
  Status Unregister(uint64_t id);

  int fd() const { return fd_.get(); }
  const std::string& mount() const { return mount_; }

 private:
  Control(std::string mount, ScopedFd fd) : mount_(std::move(mount)), fd_(std::move(fd)) {}

  // The Status of a failed command: `message` from the daemon if not
  // empty, else strerror(err) after "what: ".
  Status Failed(const char* what, int err, const char* message) const;

  std::string mount_;
  ScopedFd fd_;
};

// One-shot Control::Open(mount) then Apply / GetStatus.
Result<dte_live_apply> Apply(const std::string& mount, std::optional<uint64_t> version);
Result<dte_live_status> GetStatus(const std::string& mount);

// The Code of a failed live ioctl's errno (see the header comment).
Code CodeOfErrno(int err);

}  // namespace dte::live
