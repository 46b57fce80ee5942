#include "sync/live/live_client.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

namespace dte::live {
namespace {

std::string ControlPath(const std::string& mount) {
  if (!mount.empty() && mount.back() == '/') return mount + DTE_LIVE_CONTROL_FILE;
  return mount + "/" + DTE_LIVE_CONTROL_FILE;
}

// ioctl(2) retried on EINTR; returns 0 or the errno. FUSE waits for the
// daemon's answer through ordinary signals, so EINTR means the daemon gave
// the command up undone.
int Ioctl(int fd, unsigned long cmd, void* arg) {
  while (::ioctl(fd, cmd, arg) < 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

// True if the fixed-size field `s` holds a NUL.
template <size_t N>
bool Terminated(const char (&s)[N]) {
  return std::memchr(s, '\0', N) != nullptr;
}

// The NUL-terminated prefix of an out field the daemon wrote (which a
// misbehaving daemon might leave unterminated).
template <size_t N>
std::string OutString(const char (&s)[N]) {
  return std::string(s, strnlen(s, N));
}

}  // namespace

Code CodeOfErrno(int err) {
  switch (err) {
    case EPERM:
    case EACCES:
      return Code::kPermissionDenied;
    case EBUSY:
    case EAGAIN:
      return Code::kUnavailable;
    case ETIMEDOUT:
      return Code::kDeadlineExceeded;
    case EBADFD:
      return Code::kFailedPrecondition;
    case ECANCELED:
      return Code::kAborted;
    case ENOENT:
      return Code::kNotFound;
    case EINVAL:
    case ENOTTY:
      return Code::kInvalidArgument;
    default:
      return Code::kIOError;
  }
}

Result<Control> Control::Open(const std::string& mount) {
  const std::string path = ControlPath(mount);
  int err = 0;
  auto fd = OpenFile(path, O_RDONLY, 0, &err);
  if (fd.ok()) return Control(mount, std::move(fd).value());
  if (err != ENOENT && err != ENOTDIR) {
    return Status(CodeOfErrno(err), path + ": " + std::strerror(err));
  }
  struct stat st;
  if (::stat(mount.c_str(), &st) != 0) {
    const int stat_err = errno;
    return Status(CodeOfErrno(stat_err), mount + ": " + std::strerror(stat_err));
  }
  return NotFound(mount + " is not a dtefs mount with live apply (no " DTE_LIVE_CONTROL_FILE ")");
}

Status Control::Failed(const char* what, int err, const char* message) const {
  if (err == ENOTTY) return InvalidArgument(mount_ + " is not a dtefs mount (ENOTTY)");
  if (message != nullptr && message[0] != '\0') {
    return Status(CodeOfErrno(err), mount_ + ": " + message);
  }
  // The daemon allows live commands to root and the user who mounted.
  const char* hint = err == EPERM ? " (only root and the user who mounted it may do this)" : "";
  return Status(CodeOfErrno(err), mount_ + ": " + what + ": " + std::strerror(err) + hint);
}

namespace {

// One DTE_IOC_APPLY of the given phase.
Result<dte_live_apply> ApplyIoctl(int fd, uint32_t flags, std::optional<uint64_t> version,
                                  uint32_t prepared, int* err) {
  dte_live_apply a{};
  a.abi_version = DTE_LIVE_ABI_VERSION;
  a.flags = flags;
  a.version = version.value_or(DTE_LIVE_LATEST);
  a.prepared = prepared;
  *err = Ioctl(fd, DTE_IOC_APPLY, &a);
  if (*err == 0 && a.error != 0) *err = a.error;
  return a;
}

}  // namespace

Result<dte_live_apply> Control::Apply(std::optional<uint64_t> version) {
  int err = 0;
  dte_live_apply a = *ApplyIoctl(fd(), 0, version, 0, &err);
  if (err != 0) return Failed("apply", err, OutString(a.message).c_str());
  return a;
}

Result<dte_live_apply> Control::Prepare(std::optional<uint64_t> version) {
  int err = 0;
  dte_live_apply a = *ApplyIoctl(fd(), DTE_LIVE_APPLY_PREPARE, version, 0, &err);
  if (err != 0) return Failed("prepare apply", err, OutString(a.message).c_str());
  return a;
}

Result<dte_live_apply> Control::Commit(uint32_t prepared) {
  int err = 0;
  dte_live_apply a = *ApplyIoctl(fd(), DTE_LIVE_APPLY_COMMIT, std::nullopt, prepared, &err);
  if (err != 0) return Failed("commit apply", err, OutString(a.message).c_str());
  return a;
}

Status Control::Abort(uint32_t prepared) {
  int err = 0;
  dte_live_apply a = *ApplyIoctl(fd(), DTE_LIVE_APPLY_ABORT, std::nullopt, prepared, &err);
  if (err != 0) return Failed("abort apply", err, OutString(a.message).c_str());
  return Status::Ok();
}

Result<dte_live_status> Control::GetStatus() {
  dte_live_status s{};
  s.abi_version = DTE_LIVE_ABI_VERSION;
  if (int err = Ioctl(fd(), DTE_IOC_STATUS, &s); err != 0) return Failed("status", err, nullptr);
  return s;
}

Result<uint64_t> Control::Register(dte_live_register* r) {
  if (r == nullptr) return InvalidArgument(mount_ + ": register: no buffer given");
  if (!Terminated(r->name) || !Terminated(r->dtype) || !Terminated(r->shm_name)) {
    return InvalidArgument(mount_ + ": register: name, dtype and shm_name must be NUL-terminated");
  }
  r->abi_version = DTE_LIVE_ABI_VERSION;
  r->buffer_id = 0;
  r->error = 0;
  std::memset(r->message, 0, sizeof(r->message));
  int err = Ioctl(fd(), DTE_IOC_REGISTER, r);
  if (err == 0 && r->error != 0) err = r->error;
  if (err != 0) {
    const std::string what = std::string("register ") + r->name;
    return Failed(what.c_str(), err, OutString(r->message).c_str());
  }
  return r->buffer_id;
}

Status Control::Unregister(uint64_t id) {
  if (int err = Ioctl(fd(), DTE_IOC_UNREGISTER, &id); err != 0) {
    const std::string what =
        id == 0 ? "unregister all buffers" : "unregister buffer " + std::to_string(id);
    return Failed(what.c_str(), err, nullptr);
  }
  return Status::Ok();
}

Result<dte_live_apply> Apply(const std::string& mount, std::optional<uint64_t> version) {
  ASSIGN_OR_RETURN(Control c, Control::Open(mount));
  return c.Apply(version);
}

Result<dte_live_status> GetStatus(const std::string& mount) {
  ASSIGN_OR_RETURN(Control c, Control::Open(mount));
  return c.GetStatus();
}

}  // namespace dte::live
