// Status and Result<T>: the error model of every dte module above kernels.
//
// No exceptions cross a module boundary. A function that can fail returns a
// [[nodiscard]] Status (or Result<T>), whose message names the file, tensor,
// version, blob or key involved so the user knows what to fix.
//
// Thread-safety: values; safe to copy between threads.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace dte {

// The canonical error codes, after Abseil's (absl/status/status.h): each
// says what kind of failure it is, so a caller can decide what to do without
// reading the message. docs/errors.md lists them with their C values, Python
// classes and errno on the mount. A deadline is not an I/O error, a missed
// push is not a missing file. The values are stable: ranks send them to each
// other (sync/publish/internal/dist_wire.h); 6 was kBusy, retired, and stays unused.
enum class Code {
  kOk = 0,
  kInvalidArgument = 1,      // bad user input (a malformed checkpoint, a bad flag)
  kNotFound = 2,             // missing version, file, blob, store
  kAlreadyExists = 3,        // version number taken (a racing publisher won)
  kCorruption = 4,           // data loss: stored bytes do not match their hash or grammar
  kIOError = 5,              // the operating system or a remote store failed, for good
  kPermissionDenied = 7,     // the store refused the credentials or the request (S3 403)
  kUnimplemented = 8,        // the operation or format is not supported
  kInternal = 9,             // a broken invariant of dte itself
  kFailedPrecondition = 10,  // the state is wrong for the operation (a receiver that missed
                             // pushes, a version whose parent is gone); retrying alone cannot help
  kAborted = 11,             // a concurrency conflict (a round abandoned, a racing apply);
                             // retry the whole operation
  kDeadlineExceeded = 12,    // a timeout: the operation did not finish in time
  kUnavailable = 13,         // a peer, store or lock is temporarily unreachable; retry
};

const char* CodeName(Code code);

// True for the codes worth retrying unchanged after a wait: kUnavailable,
// kDeadlineExceeded and kAborted.
bool IsTransient(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == Code::kOk; }
  // IsTransient(code()): worth retrying unchanged.
  bool transient() const { return IsTransient(code_); }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "message" for errors, "OK" otherwise.
  std::string ToString() const { return ok() ? "OK" : message_; }

  // Returns a copy whose message is "context: message".
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }
  void IgnoreError() const {}

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {Code::kAlreadyExists, std::move(m)}; }
inline Status Corruption(std::string m) { return {Code::kCorruption, std::move(m)}; }
inline Status IOError(std::string m) { return {Code::kIOError, std::move(m)}; }
inline Status PermissionDenied(std::string m) { return {Code::kPermissionDenied, std::move(m)}; }
inline Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {Code::kUnimplemented, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {Code::kFailedPrecondition, std::move(m)};
}
inline Status Aborted(std::string m) { return {Code::kAborted, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
inline Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }

// Converts errno into a Status in exactly one place: "what: strerror(err)".
Status ErrnoStatus(const std::string& what, int err);

// Holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: must be non-OK

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dte

#define DTE_CONCAT_INNER(a, b) a##b
#define DTE_CONCAT(a, b) DTE_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::dte::Status dte_status_ = (expr);        \
    if (!dte_status_.ok()) return dte_status_; \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(DTE_CONCAT(dte_result_, __LINE__), lhs, expr)
