#include "sync/capi/internal/c_api_glue.h"

namespace dte::capi {

std::string& LastError() {
  thread_local std::string last_error;
  return last_error;
}

// The one place dte::Code becomes dte_code.
int ToCode(dte::Code code) {
  switch (code) {
    case dte::Code::kOk:
      return DTE_OK;
    case dte::Code::kInvalidArgument:
      return DTE_INVALID_ARGUMENT;
    case dte::Code::kNotFound:
      return DTE_NOT_FOUND;
    case dte::Code::kAlreadyExists:
      return DTE_ALREADY_EXISTS;
    case dte::Code::kCorruption:
      return DTE_CORRUPTION;
    case dte::Code::kIOError:
      return DTE_IO_ERROR;
    case dte::Code::kFailedPrecondition:
      return DTE_FAILED_PRECONDITION;
    case dte::Code::kAborted:
      return DTE_ABORTED;
    case dte::Code::kDeadlineExceeded:
      return DTE_DEADLINE_EXCEEDED;
    case dte::Code::kUnavailable:
      return DTE_UNAVAILABLE;
    case dte::Code::kPermissionDenied:
      return DTE_PERMISSION_DENIED;
    case dte::Code::kUnimplemented:
      return DTE_UNIMPLEMENTED;
    case dte::Code::kInternal:
      return DTE_INTERNAL;
  }
  return DTE_INTERNAL;
}

int Fail(const dte::Status& s) {
  LastError() = s.message();
  return ToCode(s.code());
}

int FailWith(int code, std::string message) {
  LastError() = std::move(message);
  return code;
}

const char* OrEmpty(const char* s) { return s != nullptr ? s : ""; }

}  // namespace dte::capi
