// The C ABI's result codes (sync/capi/c_api.h, docs/errors.md): stable
// numeric values, DTE_BUSY's number left unused, every dte::Code mapped,
// and dte_code_transient.
#include <gtest/gtest.h>

#include "store/base/status.h"
#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_glue.h"

namespace dte {
namespace {

TEST(CApiCodes, ValuesAreTheDocumentedOnes) {
  EXPECT_EQ(DTE_C_API_VERSION, 14);
  EXPECT_EQ(dte_c_api_version(), 14);
  EXPECT_EQ(DTE_OK, 0);
  EXPECT_EQ(DTE_INVALID_ARGUMENT, 1);
  EXPECT_EQ(DTE_NOT_FOUND, 2);
  EXPECT_EQ(DTE_ALREADY_EXISTS, 3);
  EXPECT_EQ(DTE_CORRUPTION, 4);
  EXPECT_EQ(DTE_IO_ERROR, 5);
  // 6 was DTE_BUSY, retired in C API 10.
  EXPECT_EQ(DTE_UNIMPLEMENTED, 7);
  EXPECT_EQ(DTE_INTERNAL, 8);
  EXPECT_EQ(DTE_PERMISSION_DENIED, 9);
  EXPECT_EQ(DTE_FAILED_PRECONDITION, 10);
  EXPECT_EQ(DTE_ABORTED, 11);
  EXPECT_EQ(DTE_DEADLINE_EXCEEDED, 12);
  EXPECT_EQ(DTE_UNAVAILABLE, 13);
}

TEST(CApiCodes, EveryCodeMapsToItsConstant) {
  EXPECT_EQ(capi::ToCode(Code::kOk), DTE_OK);
  EXPECT_EQ(capi::ToCode(Code::kInvalidArgument), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(capi::ToCode(Code::kNotFound), DTE_NOT_FOUND);
  EXPECT_EQ(capi::ToCode(Code::kAlreadyExists), DTE_ALREADY_EXISTS);
  EXPECT_EQ(capi::ToCode(Code::kCorruption), DTE_CORRUPTION);
  EXPECT_EQ(capi::ToCode(Code::kIOError), DTE_IO_ERROR);
  EXPECT_EQ(capi::ToCode(Code::kPermissionDenied), DTE_PERMISSION_DENIED);
  EXPECT_EQ(capi::ToCode(Code::kUnimplemented), DTE_UNIMPLEMENTED);
  EXPECT_EQ(capi::ToCode(Code::kInternal), DTE_INTERNAL);
  EXPECT_EQ(capi::ToCode(Code::kFailedPrecondition), DTE_FAILED_PRECONDITION);
  EXPECT_EQ(capi::ToCode(Code::kAborted), DTE_ABORTED);
  EXPECT_EQ(capi::ToCode(Code::kDeadlineExceeded), DTE_DEADLINE_EXCEEDED);
  EXPECT_EQ(capi::ToCode(Code::kUnavailable), DTE_UNAVAILABLE);
}

TEST(CApiCodes, TransientAreUnavailableDeadlineExceededAndAborted) {
  for (int code = -1; code <= 20; ++code) {
    const bool want =
        code == DTE_UNAVAILABLE || code == DTE_DEADLINE_EXCEEDED || code == DTE_ABORTED;
    EXPECT_EQ(dte_code_transient(code), want ? 1 : 0) << code;
  }
  // The same answer as the store's IsTransient for every code it has.
  for (int v : {0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13}) {
    const Code c = static_cast<Code>(v);
    EXPECT_EQ(dte_code_transient(capi::ToCode(c)) == 1, IsTransient(c)) << CodeName(c);
  }
}

}  // namespace
}  // namespace dte
