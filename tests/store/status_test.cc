// The canonical error codes (store/base/status.h, docs/errors.md): their
// names, which are transient, the factory helpers and the errno mapping.
#include "store/base/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>
#include <vector>

namespace dte {
namespace {

struct CodeRow {
  Code code;
  int value;  // stable: ranks send it (sync/publish/internal/dist_wire.h)
  const char* name;
  bool transient;
};

// docs/errors.md, in the same order.
const std::vector<CodeRow> kCodes = {
    {Code::kOk, 0, "OK", false},
    {Code::kInvalidArgument, 1, "invalid argument", false},
    {Code::kNotFound, 2, "not found", false},
    {Code::kAlreadyExists, 3, "already exists", false},
    {Code::kCorruption, 4, "corruption", false},
    {Code::kIOError, 5, "I/O error", false},
    {Code::kPermissionDenied, 7, "permission denied", false},
    {Code::kUnimplemented, 8, "unimplemented", false},
    {Code::kInternal, 9, "internal error", false},
    {Code::kFailedPrecondition, 10, "failed precondition", false},
    {Code::kAborted, 11, "aborted", true},
    {Code::kDeadlineExceeded, 12, "deadline exceeded", true},
    {Code::kUnavailable, 13, "unavailable", true},
};

TEST(Status, EveryCodeHasItsNameValueAndTransience) {
  for (const CodeRow& row : kCodes) {
    EXPECT_STREQ(CodeName(row.code), row.name) << row.value;
    EXPECT_EQ(static_cast<int>(row.code), row.value) << row.name;
    EXPECT_EQ(IsTransient(row.code), row.transient) << row.name;
  }
  EXPECT_STREQ(CodeName(static_cast<Code>(6)), "unknown") << "6 was kBusy, retired";
  EXPECT_FALSE(IsTransient(static_cast<Code>(6)));
}

TEST(Status, FactoryHelpersMakeTheirCodeAndKeepTheMessage) {
  const std::vector<std::pair<Status, Code>> made = {
      {InvalidArgument("m"), Code::kInvalidArgument},
      {NotFound("m"), Code::kNotFound},
      {AlreadyExists("m"), Code::kAlreadyExists},
      {Corruption("m"), Code::kCorruption},
      {IOError("m"), Code::kIOError},
      {PermissionDenied("m"), Code::kPermissionDenied},
      {Unimplemented("m"), Code::kUnimplemented},
      {Internal("m"), Code::kInternal},
      {FailedPrecondition("m"), Code::kFailedPrecondition},
      {Aborted("m"), Code::kAborted},
      {DeadlineExceeded("m"), Code::kDeadlineExceeded},
      {Unavailable("m"), Code::kUnavailable},
  };
  for (const auto& [s, code] : made) {
    EXPECT_EQ(s.code(), code) << CodeName(code);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.message(), "m");
    EXPECT_EQ(s.transient(), IsTransient(code)) << CodeName(code);
  }
  const Status late = DeadlineExceeded("timed out after 5 ms").WithContext("receiver");
  EXPECT_EQ(late.code(), Code::kDeadlineExceeded);
  EXPECT_EQ(late.message(), "receiver: timed out after 5 ms");
  EXPECT_FALSE(Status::Ok().transient());
}

TEST(Status, ErrnoStatusNamesTheCanonicalCode) {
  EXPECT_EQ(ErrnoStatus("open x", ENOENT).code(), Code::kNotFound);
  EXPECT_EQ(ErrnoStatus("open x", EEXIST).code(), Code::kAlreadyExists);
  EXPECT_EQ(ErrnoStatus("lock x", EWOULDBLOCK).code(), Code::kUnavailable);
  EXPECT_EQ(ErrnoStatus("lock x", EBUSY).code(), Code::kUnavailable);
  EXPECT_EQ(ErrnoStatus("recv", ETIMEDOUT).code(), Code::kDeadlineExceeded);
  EXPECT_EQ(ErrnoStatus("connect", ECONNREFUSED).code(), Code::kUnavailable);
  EXPECT_EQ(ErrnoStatus("write x", EIO).code(), Code::kIOError);
  EXPECT_EQ(ErrnoStatus("open x", ENOENT).message().rfind("open x: ", 0), 0u);
}

}  // namespace
}  // namespace dte
