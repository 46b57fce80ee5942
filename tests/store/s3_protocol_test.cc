#include "store/internal/s3_protocol.h"

#include <gtest/gtest.h>

#include <string>

#include "store/internal/s3_retry.h"

namespace dte::internal {
namespace {

TEST(S3Protocol, UriEncodeKeepsOnlyUnreservedBytes) {
  EXPECT_EQ(UriEncode("AZaz09-_.~", false), "AZaz09-_.~");
  EXPECT_EQ(UriEncode("a b+c/d=e&f", false), "a%20b%2Bc%2Fd%3De%26f");
  EXPECT_EQ(UriEncode("blobs/3f/3f2a", true), "blobs/3f/3f2a");
  EXPECT_EQ(UriEncode(std::string("\x00\xff*", 3), false), "%00%FF%2A");
}

TEST(S3Protocol, CanonicalQueryIsSortedEncodedAndKeepsEmptyValues) {
  EXPECT_EQ(CanonicalQuery({}), "");
  EXPECT_EQ(CanonicalQuery({{"uploads", ""}}), "uploads=");
  EXPECT_EQ(CanonicalQuery({{"uploadId", "x/y+z="}, {"partNumber", "10"}}),
            "partNumber=10&uploadId=x%2Fy%2Bz%3D");
  // Sorted by the encoded name, then value: "list-type" < "prefix".
  EXPECT_EQ(
      CanonicalQuery({{"prefix", "p/a b"}, {"list-type", "2"}, {"continuation-token", "1Ab+/=="}}),
      "continuation-token=1Ab%2B%2F%3D%3D&list-type=2&prefix=p%2Fa%20b");
  // Upper case sorts before lower case (byte order), as SigV4 wants.
  EXPECT_EQ(CanonicalQuery({{"b", "1"}, {"B", "2"}, {"a", "2"}, {"a", "1"}}), "B=2&a=1&a=2&b=1");
}

TEST(S3Protocol, Sha256HexMatchesKnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(S3Protocol, ParsesHttpDates) {
  EXPECT_EQ(ParseHttpDate("Sun, 06 Nov 1994 08:49:37 GMT"), 784111777);
  EXPECT_EQ(ParseHttpDate("Thu, 01 Jan 1970 00:00:00 GMT"), 0);
  EXPECT_EQ(ParseHttpDate("Tue, 29 Feb 2028 23:59:59 GMT"), 1835481599);
  for (const char* bad : {"", "Sun, 06 Nov 1994 08:49:37", "Sun, 06 Foo 1994 08:49:37 GMT",
                          "06 Nov 1994 08:49:37 GMT", "Sun, 6 Nov 1994 08:49:37 GMT",
                          "Sun, 06 Nov 1994 24:00:00 GMT", "Sun, -1 Nov 1994 08:49:37 GMT"}) {
    EXPECT_FALSE(ParseHttpDate(bad).has_value()) << bad;
  }
}

TEST(S3Protocol, ParsesIso8601Timestamps) {
  EXPECT_EQ(ParseIso8601("1994-11-06T08:49:37Z"), 784111777);
  EXPECT_EQ(ParseIso8601("1994-11-06T08:49:37.123Z"), 784111777);
  for (const char* bad : {"", "1994-11-06 08:49:37Z", "1994-11-06T08:49:37", "1994-13-06T08:49:37Z",
                          "1994-11-06T08:49:37.Z", "1994-11-06T08:49:37.1x2Z"}) {
    EXPECT_FALSE(ParseIso8601(bad).has_value()) << bad;
  }
}

TEST(S3Protocol, RedactSecretsReplacesEveryOccurrence) {
  EXPECT_EQ(RedactSecrets("key SECRET and SECRETSECRET, token T0K", {"SECRET", "", "T0K"}),
            "key [redacted] and [redacted][redacted], token [redacted]");
  EXPECT_EQ(PrintableText("a\nb\x01", 10), "a\\x0ab\\x01");
  EXPECT_EQ(PrintableText("abcdef", 3), "abc...");
}

TEST(S3Retry, RetriesTransientFailuresOnly) {
  using E = TransportError;
  for (E e : {E::kConnect, E::kTimeout, E::kReset, E::kBadBody}) {
    EXPECT_TRUE(IsRetryable(e, 0, "")) << TransportErrorName(e);
  }
  EXPECT_FALSE(IsRetryable(E::kFatal, 0, ""));
  for (long status : {500, 502, 503, 504, 429, 408}) {
    EXPECT_TRUE(IsRetryable(E::kNone, status, "")) << status;
  }
  for (long status : {400, 401, 403, 404, 405, 409, 412, 416, 501}) {
    EXPECT_FALSE(IsRetryable(E::kNone, status, "")) << status;
  }
  for (const char* code : {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable",
                           "ConditionalRequestConflict", "OperationAborted"}) {
    EXPECT_TRUE(IsRetryable(E::kNone, 400, code)) << code;
    EXPECT_TRUE(IsRetryable(E::kNone, 200, code)) << code << " inside a 200";
  }
  for (const char* code : {"AccessDenied", "NoSuchKey", "NoSuchBucket", "PreconditionFailed",
                           "SignatureDoesNotMatch", "InvalidAccessKeyId", "EntityTooSmall"}) {
    EXPECT_FALSE(IsRetryable(E::kNone, 400, code)) << code;
  }
}

TEST(S3Retry, BackoffIsFullJitterUnderAnExponentialCeiling) {
  S3RetryPolicy p;
  p.base_delay = std::chrono::milliseconds(100);
  p.max_delay = std::chrono::milliseconds(1000);
  const uint64_t kMax = UINT64_MAX;
  EXPECT_EQ(BackoffDelay(1, p, 0).count(), 0);
  EXPECT_EQ(BackoffDelay(1, p, kMax).count(), static_cast<int64_t>(kMax % 101));
  for (int retry = 1; retry <= 64; ++retry) {
    const int64_t ceiling = std::min<int64_t>(1000, int64_t{100} << std::min(retry - 1, 20));
    for (uint64_t r : {uint64_t{0}, uint64_t{1}, uint64_t{12345}, kMax, kMax - 1}) {
      const int64_t d = BackoffDelay(retry, p, r).count();
      EXPECT_GE(d, 0);
      EXPECT_LE(d, ceiling) << "retry " << retry;
    }
    EXPECT_EQ(BackoffDelay(retry, p, static_cast<uint64_t>(ceiling)).count(), ceiling);
  }
  EXPECT_LE(BackoffDelay(1 << 30, p, kMax).count(), 1000);  // no overflow for huge counts
  p.base_delay = std::chrono::milliseconds(0);
  EXPECT_EQ(BackoffDelay(1 << 30, p, kMax).count(), 0);
}

}  // namespace
}  // namespace dte::internal
