#include "store/base/status.h"

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
    case Code::kBusy:
      return "busy";
    case Code::kPermissionDenied:
      return "permission denied";
    case Code::kUnimplemented:
      return "unimplemented";
    case Code::kInternal:
      return "internal error";
  }
  return "unknown";
}

Status ErrnoStatus(const std::string& what, int err) {
  Code code = Code::kIOError;
  if (err == ENOENT) code = Code::kNotFound;
  if (err == EEXIST) code = Code::kAlreadyExists;
  if (err == EWOULDBLOCK || err == EBUSY) code = Code::kBusy;
  return Status(code, what + ": " + std::strerror(err));
}

}  // namespace dte
