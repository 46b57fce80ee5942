#include "store/base/status.h"

#include <cerrno>
#include <cstring>

namespace dte {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "invalid argument";
    case Code::kNotFound:
      return "not found";
    case Code::kAlreadyExists:
      return "already exists";
    case Code::kCorruption:
      return "corruption";
    case Code::kIOError:
      return "I/O error";
    case Code::kPermissionDenied:
      return "permission denied";
    case Code::kUnimplemented:
      return "unimplemented";
    case Code::kInternal:
      return "internal error";
    case Code::kFailedPrecondition:
      return "failed precondition";
    case Code::kAborted:
      return "aborted";
    case Code::kDeadlineExceeded:
      return "deadline exceeded";
    case Code::kUnavailable:
      return "unavailable";
  }
  return "unknown";
}

bool IsTransient(Code code) {
  return code == Code::kUnavailable || code == Code::kDeadlineExceeded || code == Code::kAborted;
}

Status ErrnoStatus(const std::string& what, int err) {
  Code code = Code::kIOError;
  if (err == ENOENT) code = Code::kNotFound;
  if (err == EEXIST) code = Code::kAlreadyExists;
  if (err == EWOULDBLOCK || err == EBUSY) code = Code::kUnavailable;
  if (err == ETIMEDOUT) code = Code::kDeadlineExceeded;
  if (err == ECONNREFUSED || err == ECONNRESET || err == EHOSTUNREACH || err == ENETUNREACH) {
    code = Code::kUnavailable;
  }
  return Status(code, what + ": " + std::strerror(err));
}

}  // namespace dte
