// S3Store::Touch against FakeS3: a CopyObject onto itself that keeps the
// checksum metadata, and above the copy limit a multipart copy of
// UploadPartCopy parts, aborted when a part fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "store/internal/s3_open.h"
#include "store/internal/s3_protocol.h"
#include "store/s3_store.h"
#include "tests/store/s3_store_fixture.h"
#include "tests/testutil/fake_s3.h"

namespace dte {
namespace {

using internal::HttpRequest;
using internal::HttpResponse;
using s3_store_test::Binary;
using s3_store_test::Contains;
using s3_store_test::Count;
using s3_store_test::S3StoreFake;
using test::FakeS3;

TEST_F(S3StoreFake, TouchCopiesTheObjectOntoItself) {
  fake_->SetObject("pre/fix/blobs/t", "x");
  std::vector<std::string> headers;
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    headers = r.headers;
    return std::nullopt;
  };
  ASSERT_TRUE(store_->Touch("blobs/t").ok());
  EXPECT_NE(std::find(headers.begin(), headers.end(), "x-amz-copy-source: /bucket/pre/fix/blobs/t"),
            headers.end());
  EXPECT_NE(std::find(headers.begin(), headers.end(), "x-amz-metadata-directive: REPLACE"),
            headers.end());
  EXPECT_EQ(store_->Touch("blobs/missing").code(), Code::kNotFound);
  EXPECT_EQ(store_->ModifiedTime("blobs/t").value(), 784111777);
}

// The checksum metadata moto and S3 return with an object written by PutObject.
constexpr const char* kStoredSha =
    "x-amz-meta-dte-sha256: 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

bool HasHeader(const std::vector<std::string>& headers, const std::string& header) {
  return std::find(headers.begin(), headers.end(), header) != headers.end();
}

TEST_F(S3StoreFake, TouchKeepsTheChecksumMetadata) {
  fake_->SetObject("pre/fix/blobs/t", "x");
  fake_->after = [](const HttpRequest& r, HttpResponse* answer) {
    if (r.method == "HEAD") answer->headers.emplace_back("x-amz-meta-dte-sha256", kStoredSha + 23);
  };
  std::vector<std::string> copy_headers;
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method == "PUT") copy_headers = r.headers;
    return std::nullopt;
  };
  ASSERT_TRUE(store_->Touch("blobs/t").ok());
  EXPECT_TRUE(HasHeader(copy_headers, kStoredSha));
  EXPECT_TRUE(HasHeader(copy_headers, "x-amz-metadata-directive: REPLACE"));
  const auto log = fake_->Log();
  EXPECT_EQ(std::count(log.begin(), log.end(), "PUT /bucket/pre/fix/blobs/t"), 1);
}

// Answers UploadPartCopy as S3 does, through the fake: the range of the
// source is uploaded as the part, and the ETag comes back in the body.
std::optional<HttpResponse> CopyPart(FakeS3* fake, const HttpRequest& r) {
  auto header = [&](const std::string& name) -> std::string {
    for (const std::string& h : r.headers) {
      if (h.rfind(name + ": ", 0) == 0) return h.substr(name.size() + 2);
    }
    return "";
  };
  const std::string range = header("x-amz-copy-source-range");
  if (header("x-amz-copy-source") != "/bucket/pre/fix/blobs/big" || range.empty()) {
    return FakeS3::Error(400, "InvalidRequest", "bad copy source or range");
  }
  const size_t dash = range.find('-');
  const uint64_t first = std::stoull(range.substr(6, dash - 6));
  const uint64_t last = std::stoull(range.substr(dash + 1));
  const std::string part = fake->Objects().at("pre/fix/blobs/big").substr(first, last - first + 1);
  HttpRequest upload = r;
  upload.headers = {"x-amz-content-sha256: " + internal::Sha256Hex(part)};
  upload.body = part;
  HttpResponse sent = fake->Send(upload);
  if (sent.status != 200) return sent;
  std::string etag;
  for (const auto& [name, value] : sent.headers) {
    if (name == "etag") etag = value;
  }
  HttpResponse answer;
  answer.status = 200;
  answer.body = "<CopyPartResult><ETag>" + etag + "</ETag></CopyPartResult>";
  answer.body_bytes = answer.body.size();
  answer.headers.emplace_back("content-length", std::to_string(answer.body.size()));
  return answer;
}

TEST_F(S3StoreFake, TouchAboveTheCopyLimitCopiesInPartsOnTheServer) {
  Open(4, [](S3Options* o) {
    o->max_copy_bytes = uint64_t{6} << 20;
    o->copy_part_size = uint64_t{5} << 20;
  });
  const std::string data = Binary((uint64_t{5} << 20) * 2 + 777, 9);  // 3 parts of at most 5 MiB
  fake_->SetObject("pre/fix/blobs/big", data);
  fake_->after = [](const HttpRequest& r, HttpResponse* answer) {
    if (r.method == "HEAD") answer->headers.emplace_back("x-amz-meta-dte-sha256", kStoredSha + 23);
  };
  std::vector<std::string> ranges, initiate_headers;
  std::mutex mu;
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method == "POST" && Contains(r.url, "?uploads")) initiate_headers = r.headers;
    for (const std::string& h : r.headers) {
      if (r.method == "PUT" && h.rfind("x-amz-copy-source-range: ", 0) == 0) {
        {
          std::lock_guard<std::mutex> lock(mu);
          ranges.push_back(h.substr(25));
        }
        return CopyPart(fake_, r);
      }
    }
    return std::nullopt;  // CopyPart's own upload of the part, and the rest
  };
  Status touched = store_->Touch("blobs/big");
  ASSERT_TRUE(touched.ok()) << touched.ToString();
  EXPECT_EQ(fake_->Objects().at("pre/fix/blobs/big"), data);
  std::sort(ranges.begin(), ranges.end());
  EXPECT_EQ(ranges, (std::vector<std::string>{"bytes=0-5242879", "bytes=10485760-10486536",
                                              "bytes=5242880-10485759"}));
  EXPECT_TRUE(HasHeader(initiate_headers, kStoredSha)) << "the checksum metadata was dropped";
  const auto log = fake_->Log();
  EXPECT_EQ(std::count(log.begin(), log.end(), "PUT /bucket/pre/fix/blobs/big"), 0)
      << "a single CopyObject was sent";
  EXPECT_EQ(Count(fake_->Log(), "POST /bucket/pre/fix/blobs/big?uploadId="), 1);  // complete
  EXPECT_EQ(fake_->OpenUploads(), 0u);
}

TEST_F(S3StoreFake, FailedMultipartCopyIsAbortedAndLeavesTheObject) {
  Open(4, [](S3Options* o) {
    o->max_copy_bytes = uint64_t{5} << 20;
    o->copy_part_size = uint64_t{5} << 20;
    o->parallel_parts = 1;
  });
  const std::string data = Binary((uint64_t{5} << 20) + 1, 10);
  fake_->SetObject("pre/fix/blobs/big", data);
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method == "PUT" && Contains(r.url, "partNumber=2")) {
      return FakeS3::Error(403, "AccessDenied", "no s3:GetObject on the source");
    }
    if (r.method == "PUT" && HasHeader(r.headers, "x-amz-copy-source: /bucket/pre/fix/blobs/big")) {
      return CopyPart(fake_, r);
    }
    return std::nullopt;
  };
  Status s = store_->Touch("blobs/big");
  ASSERT_EQ(s.code(), Code::kPermissionDenied) << s.message();
  EXPECT_TRUE(Contains(s.message(), "UploadPartCopy: AccessDenied, HTTP 403")) << s.message();
  EXPECT_EQ(fake_->OpenUploads(), 0u) << "the upload was not aborted";
  EXPECT_EQ(Count(fake_->Log(), "DELETE /bucket/pre/fix/blobs/big?uploadId="), 1);
  EXPECT_EQ(fake_->Objects().at("pre/fix/blobs/big"), data);
}

TEST_F(S3StoreFake, CopySizesOutsideFiveMiBToFiveGiBAreRefused) {
  for (uint64_t bad : {uint64_t{1} << 20, (uint64_t{5} << 30) + 1}) {
    S3Options o;
    o.endpoint = FakeS3::kEndpoint;
    o.max_copy_bytes = bad;
    auto store =
        internal::OpenS3StoreWithTransport("bucket", "p", o, std::make_unique<FakeS3>("bucket"));
    EXPECT_EQ(store.status().code(), Code::kInvalidArgument) << bad;
    o.max_copy_bytes = uint64_t{5} << 30;
    o.copy_part_size = bad;
    store =
        internal::OpenS3StoreWithTransport("bucket", "p", o, std::make_unique<FakeS3>("bucket"));
    EXPECT_EQ(store.status().code(), Code::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace dte
