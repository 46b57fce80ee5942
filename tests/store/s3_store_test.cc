// S3Store's protocol handling against FakeS3 (tests/testutil/fake_s3.h):
// retries, lost answers, multipart, ranges, listing, and what error
// messages say and never say.
#include "store/s3_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <fstream>
#include <memory>
#include <string>

#include "store/internal/s3_open.h"
#include "store/internal/s3_protocol.h"
#include "tests/store/s3_store_fixture.h"
#include "tests/testutil/fake_s3.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using internal::HttpRequest;
using internal::HttpResponse;
using internal::TransportError;
using test::FakeS3;

using s3_store_test::Binary;
using s3_store_test::Contains;
using s3_store_test::Count;
using s3_store_test::kAccessKey;
using s3_store_test::kSecret;
using s3_store_test::kToken;
using s3_store_test::S3StoreFake;

TEST_F(S3StoreFake, DescribesItselfAsItsUriOnly) {
  EXPECT_EQ(store_->Describe(), "s3://bucket/pre/fix");
}

TEST_F(S3StoreFake, RequestsCarryPayloadHashTokenAndPrefixedKeys) {
  std::vector<HttpRequest> seen;
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    seen.push_back(r);
    return std::nullopt;
  };
  ASSERT_TRUE(store_->Put("blobs/ab/x", "payload").ok());
  ASSERT_EQ(seen.size(), 1u);
  const HttpRequest& r = seen[0];
  EXPECT_EQ(r.method, "PUT");
  EXPECT_EQ(r.url, "http://fake.test/bucket/pre/fix/blobs/ab/x");
  auto has = [&](const std::string& h) {
    return std::find(r.headers.begin(), r.headers.end(), h) != r.headers.end();
  };
  EXPECT_TRUE(
      has("x-amz-content-sha256: "
          "239f59ed55e737c77147cf55ad0c1b030b6d7ee748a7426952f9b852d5a935e5"));
  EXPECT_TRUE(has(std::string("x-amz-security-token: ") + kToken));
  EXPECT_TRUE(has("Content-Type: application/octet-stream"));
  for (const auto& h : r.headers) EXPECT_FALSE(Contains(h, kSecret)) << h;
}

TEST_F(S3StoreFake, RetriesTransientFailuresThenSucceeds) {
  fake_->SetObject("pre/fix/m", "manifest");
  std::atomic<int> calls{0};
  fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
    switch (calls++) {
      case 0:
        return FakeS3::Error(503, "SlowDown", "Please reduce your request rate.");
      case 1: {
        HttpResponse reset;
        reset.error = TransportError::kReset;
        reset.error_detail = "Connection reset by peer";
        return reset;
      }
      case 2:
        return FakeS3::Error(500, "InternalError");
      default:
        return std::nullopt;
    }
  };
  auto got = store_->Get("m");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "manifest");
  EXPECT_EQ(calls.load(), 4);
}

TEST_F(S3StoreFake, GivesUpAfterMaxAttemptsNamingCodeStatusKeyAndOperation) {
  fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
    return FakeS3::Error(503, "SlowDown", "Please reduce your request rate.");
  };
  Status s = store_->Put("blobs/ab/y", "data");
  ASSERT_EQ(s.code(), Code::kUnavailable);
  for (const char* part : {"SlowDown", "HTTP 503", "blobs/ab/y", "PutObject", "after 4 attempts",
                           "s3://bucket/pre/fix"}) {
    EXPECT_TRUE(Contains(s.message(), part)) << part << " not in: " << s.message();
  }
  EXPECT_EQ(fake_->Log().size(), 4u);
}

TEST_F(S3StoreFake, ClientErrorsFailAtOnce) {
  fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
    return FakeS3::Error(400, "InvalidArgument", "Bad argument");
  };
  Status s = store_->Put("k", "v");
  ASSERT_EQ(s.code(), Code::kIOError);
  EXPECT_TRUE(Contains(s.message(), "PutObject of object k failed")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "InvalidArgument, HTTP 400")) << s.message();
  EXPECT_EQ(fake_->Log().size(), 1u);
}

TEST_F(S3StoreFake, RefusedCredentialsArePermissionDeniedNamingKeyBucketAndCode) {
  struct Case {
    long status;
    const char* code;
  };
  for (const Case& c : {Case{403, "AccessDenied"}, Case{403, "SignatureDoesNotMatch"},
                        Case{403, "InvalidAccessKeyId"}, Case{400, "ExpiredToken"},
                        Case{403, "RequestTimeTooSkewed"}}) {
    fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
      return FakeS3::Error(c.status, c.code, "refused");
    };
    const size_t requests = fake_->Log().size();
    Status s = store_->Put("blobs/k", "v");
    ASSERT_EQ(s.code(), Code::kPermissionDenied) << c.code << ": " << s.message();
    EXPECT_TRUE(Contains(s.message(), "access denied to object blobs/k (bucket bucket)"))
        << s.message();
    EXPECT_TRUE(Contains(s.message(), std::string(c.code) + ", HTTP " + std::to_string(c.status)))
        << s.message();
    EXPECT_TRUE(Contains(s.message(), "s3://bucket/pre/fix")) << s.message();
    EXPECT_EQ(fake_->Log().size(), requests + 1) << c.code << " was retried";
  }
  // A HEAD answer has no body, so no S3 code: the message says so.
  fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
    HttpResponse r;
    r.status = 403;
    return r;
  };
  auto size = store_->Size("blobs/k");
  ASSERT_EQ(size.status().code(), Code::kPermissionDenied) << size.status().message();
  EXPECT_TRUE(Contains(size.status().message(), "HEAD answers carry no S3 error code"))
      << size.status().message();
  // A bucket-level request names the bucket once.
  fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
    return FakeS3::Error(403, "AccessDenied", "refused");
  };
  auto list = store_->List("manifests/");
  ASSERT_EQ(list.status().code(), Code::kPermissionDenied);
  EXPECT_TRUE(Contains(list.status().message(), "access denied to bucket bucket in store"))
      << list.status().message();
}

TEST_F(S3StoreFake, MissingKeyAndBucketAreNotFoundNamingThem) {
  auto got = store_->Get("manifests/v00000001.json");
  ASSERT_EQ(got.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(got.status().message(), "object manifests/v00000001.json not found"));
  EXPECT_TRUE(Contains(got.status().message(), "NoSuchKey")) << got.status().message();
  fake_->before = [&](const HttpRequest&) -> std::optional<HttpResponse> {
    return FakeS3::Error(404, "NoSuchBucket", "The specified bucket does not exist");
  };
  auto list = store_->List("");
  ASSERT_EQ(list.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(list.status().message(),
                       "bucket bucket of store s3://bucket/pre/fix does "
                       "not exist"))
      << list.status().message();
  EXPECT_EQ(store_->Delete("x").code(), Code::kNotFound);
  EXPECT_EQ(fake_->Log().size(), 3u) << "NotFound is not retried";
}

TEST_F(S3StoreFake, TruncatedBodiesAreRetried) {
  const std::string data = Binary(1000, 1);
  fake_->SetObject("pre/fix/blob", data);
  std::atomic<int> cuts{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (r.method == "GET" && cuts++ < 2) {  // Content-Length stays, the body is cut
      resp->body.resize(resp->body.size() / 2);
      resp->body_bytes = resp->body.size();
    }
  };
  auto whole = store_->Get("blob");
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(*whole, data);
  EXPECT_EQ(cuts.load(), 3);
  cuts = 0;
  std::string buf(100, '\0');
  ASSERT_TRUE(store_->ReadRange("blob", 500, 100, buf.data()).ok());
  EXPECT_EQ(buf, data.substr(500, 100));
  cuts = -100;  // always cut
  auto failed = store_->Get("blob");
  ASSERT_EQ(failed.status().code(), Code::kIOError);
  EXPECT_TRUE(Contains(failed.status().message(), "received 500 of 1000 bytes"))
      << failed.status().message();
}

TEST_F(S3StoreFake, RangesAreExactAndShortObjectsAreCorruption) {
  fake_->SetObject("pre/fix/r", "0123456789");
  EXPECT_EQ(store_->GetRange("r", 2, 3).value(), "234");
  EXPECT_EQ(store_->GetRange("r", 10, 0).value(), "");
  auto past = store_->GetRange("r", 8, 5);
  ASSERT_EQ(past.status().code(), Code::kCorruption);
  EXPECT_TRUE(Contains(past.status().message(),
                       "is 10 bytes, shorter than the requested range "
                       "[8, 13)"))
      << past.status().message();
  EXPECT_EQ(store_->GetRange("r", 10, 1).status().code(), Code::kCorruption);  // 416
  EXPECT_EQ(store_->GetRange("r", 11, 0).status().code(), Code::kCorruption);
  // A server answering another range than asked is an error, not data.
  fake_->after = [&](const HttpRequest&, HttpResponse* resp) {
    for (auto& [name, value] : resp->headers) {
      if (name == "content-range") value = "bytes 0-2/10";
    }
  };
  EXPECT_EQ(store_->GetRange("r", 2, 3).status().code(), Code::kIOError);
}

TEST_F(S3StoreFake, FirstTryConflictIsAlreadyExistsWithoutReadingBack) {
  fake_->SetObject("pre/fix/manifests/v1", "theirs");
  Status s = store_->CreateExclusive("manifests/v1", "ours");
  ASSERT_EQ(s.code(), Code::kAlreadyExists);
  EXPECT_TRUE(Contains(s.message(), "manifests/v1 already exists")) << s.message();
  EXPECT_EQ(Count(fake_->Log(), "GET"), 0);
}

TEST_F(S3StoreFake, LostAnswerToOurCreateIsSuccess) {
  std::atomic<int> puts{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (r.method == "PUT" && puts++ == 0) {  // applied, then the answer is lost
      *resp = HttpResponse{};
      resp->error = TransportError::kReset;
    }
  };
  ASSERT_TRUE(store_->CreateExclusive("manifests/v2", "ours").ok());
  EXPECT_EQ(fake_->Objects().at("pre/fix/manifests/v2"), "ours");
  EXPECT_EQ(puts.load(), 2);
  EXPECT_EQ(Count(fake_->Log(), "GET"), 1) << "read back once";
}

TEST_F(S3StoreFake, LostCreateAnswerThenFailingRetriesIsStillSuccess) {
  std::atomic<int> puts{0};
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method == "PUT" && puts++ > 0) return FakeS3::Error(503, "SlowDown");
    return std::nullopt;
  };
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (r.method == "PUT") {  // the first create applied, its answer lost
      *resp = HttpResponse{};
      resp->error = TransportError::kReset;
    }
  };
  ASSERT_TRUE(store_->CreateExclusive("manifests/v4", "ours").ok());
  EXPECT_EQ(puts.load(), 4);
  EXPECT_EQ(Count(fake_->Log(), "GET"), 1) << "read back once";
  // Nothing applied: the failure stands, after one read-back finds nothing.
  fake_->after = nullptr;
  Status s = store_->CreateExclusive("manifests/v5", "ours");
  ASSERT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "SlowDown")) << s.message();
  EXPECT_EQ(fake_->Objects().count("pre/fix/manifests/v5"), 0u);
  EXPECT_EQ(Count(fake_->Log(), "GET"), 2);
}

TEST_F(S3StoreFake, BodiesDamagedInTransitAreRetriedAgainstTheStoredChecksum) {
  std::string stored;  // FakeS3 keeps no metadata: the test plays the server's part
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    for (const auto& h : r.headers) {
      if (r.method == "PUT" && h.rfind("x-amz-meta-dte-sha256: ", 0) == 0) stored = h.substr(23);
    }
    return std::nullopt;
  };
  std::atomic<int> flips{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (r.method != "GET") return;
    resp->headers.emplace_back("x-amz-meta-dte-sha256", stored);
    if (flips++ < 2) resp->body[3] ^= 0x10;
  };
  ASSERT_TRUE(store_->CreateExclusive("manifests/v6", "{\"version\": 6}").ok());
  ASSERT_EQ(stored, internal::Sha256Hex("{\"version\": 6}"));
  auto got = store_->Get("manifests/v6");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "{\"version\": 6}");
  EXPECT_EQ(flips.load(), 3);
  flips = -100;  // damaged every time: corruption naming the key, never the bytes
  auto bad = store_->Get("manifests/v6");
  ASSERT_EQ(bad.status().code(), Code::kCorruption) << bad.status().ToString();
  EXPECT_TRUE(Contains(bad.status().message(), "manifests/v6 does not match its checksum"))
      << bad.status().message();
  EXPECT_TRUE(Contains(bad.status().message(), "after 4 attempts")) << bad.status().message();
  // Objects without the metadata (written by other tools) are returned as they are.
  fake_->SetObject("pre/fix/foreign", "abc");
  fake_->after = nullptr;
  EXPECT_EQ(store_->Get("foreign").value(), "abc");
}

TEST_F(S3StoreFake, RetryThatFindsAnotherWritersObjectIsAlreadyExists) {
  std::atomic<int> puts{0};
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method != "PUT" || puts++ != 0) return std::nullopt;
    fake_->SetObject("pre/fix/manifests/v3", "theirs");  // a racing publisher wins meanwhile
    HttpResponse timeout;
    timeout.error = TransportError::kTimeout;
    return timeout;
  };
  Status s = store_->CreateExclusive("manifests/v3", "ours");
  ASSERT_EQ(s.code(), Code::kAlreadyExists) << s.ToString();
  EXPECT_EQ(fake_->Objects().at("pre/fix/manifests/v3"), "theirs");
}

TEST_F(S3StoreFake, LargePutFileGoesMultipartWithBoundedParallelParts) {
  const std::string data = Binary((uint64_t{5} << 20) * 7 + 12345, 3);  // 8 parts
  const std::string path = Spool(data);
  fake_->part_delay = std::chrono::milliseconds(30);
  ASSERT_TRUE(store_->PutFile("blobs/big", path).ok());
  EXPECT_EQ(fake_->Objects().at("pre/fix/blobs/big"), data);
  EXPECT_LE(fake_->max_parts_in_flight(), 3);
  EXPECT_GE(fake_->max_parts_in_flight(), 2) << "parts were not uploaded in parallel";
  EXPECT_EQ(Count(fake_->Log(), "PUT /bucket/pre/fix/blobs/big?partNumber="), 8);
  EXPECT_FALSE(std::ifstream(path).good()) << "spool file not consumed";
  EXPECT_EQ(fake_->OpenUploads(), 0u);
}

TEST_F(S3StoreFake, FailedMultipartUploadIsAbortedAndKeepsTheSpoolFile) {
  const std::string data = Binary((uint64_t{5} << 20) * 3, 4);
  const std::string path = Spool(data);
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (Contains(r.url, "partNumber=2")) return FakeS3::Error(400, "EntityTooSmall", "too small");
    return std::nullopt;
  };
  Status s = store_->PutFile("blobs/big", path);
  ASSERT_EQ(s.code(), Code::kIOError);
  EXPECT_TRUE(Contains(s.message(), "EntityTooSmall")) << s.message();
  EXPECT_TRUE(Contains(s.message(), "UploadPart")) << s.message();
  EXPECT_EQ(fake_->OpenUploads(), 0u) << "the upload was not aborted";
  EXPECT_EQ(Count(fake_->Log(), "DELETE /bucket/pre/fix/blobs/big?uploadId="), 1);
  EXPECT_EQ(fake_->Objects().count("pre/fix/blobs/big"), 0u);
  EXPECT_TRUE(std::ifstream(path).good());
}

TEST_F(S3StoreFake, CompleteFailingInsideA200IsRetried) {
  std::atomic<int> completes{0};
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method == "POST" && Contains(r.url, "uploadId=") && completes++ == 0) {
      HttpResponse e = FakeS3::Error(200, "InternalError", "We encountered an internal error.");
      return e;
    }
    return std::nullopt;
  };
  const std::string data = Binary((uint64_t{5} << 20) + 1, 5);
  ASSERT_TRUE(store_->Put("blobs/two-parts", data).ok());
  EXPECT_EQ(completes.load(), 2);
  EXPECT_EQ(fake_->Objects().at("pre/fix/blobs/two-parts"), data);
}

TEST_F(S3StoreFake, ListFollowsContinuationTokensAndStripsThePrefix) {
  for (const char* k : {"pre/fix/b/1", "pre/fix/a", "pre/fix/b/2", "pre/fix/c", "pre/fixx/no",
                        "pre/fix/folder/", "other/x"}) {
    fake_->SetObject(k, "x");
  }
  auto all = store_->List("");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(*all, (std::vector<std::string>{"a", "b/1", "b/2", "c"}));
  auto log = fake_->Log();
  EXPECT_EQ(
      Count(
          log,
          "GET "
          "/bucket?continuation-token=tok%2B%2F%3D2&list-type=2&max-keys=1000&prefix=pre%2Ffix%2F"),
      1)
      << log[1];
  EXPECT_EQ(store_->List("b/").value(), (std::vector<std::string>{"b/1", "b/2"}));
}

TEST_F(S3StoreFake, ErrorMessagesNeverCarrySecrets) {
  const std::string echo =
      std::string("key ") + kAccessKey + " secret " + kSecret + " token " + kToken;
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (r.method == "GET") return FakeS3::Error(400, "SignatureDoesNotMatch", echo);
    HttpResponse e;
    e.error = TransportError::kFatal;
    e.error_detail = echo;
    return e;
  };
  Status get = store_->Get("k").status();
  ASSERT_FALSE(get.ok());
  EXPECT_TRUE(Contains(get.message(), "SignatureDoesNotMatch")) << get.message();
  EXPECT_TRUE(Contains(get.message(), "[redacted]")) << get.message();
  ExpectNoSecrets(get.message());
  Status put = store_->Put("k", "v");
  ASSERT_FALSE(put.ok());
  ExpectNoSecrets(put.message());
  ExpectNoSecrets(store_->Describe());
}

TEST_F(S3StoreFake, RemoveStaleTempTakesOldSpoolFilesAndUploads) {
  const std::string old_file = Spool("old");
  const std::string new_file = Spool("new");
  struct timespec times[2] = {{0, UTIME_OMIT}, {::time(nullptr) - 7200, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, old_file.c_str(), times, 0), 0);
  // A failed upload whose abort failed too: left for RemoveStaleTemp
  // (FakeS3 says every upload was initiated in 2000).
  fake_->before = [&](const HttpRequest& r) -> std::optional<HttpResponse> {
    if (Contains(r.url, "partNumber=2")) return FakeS3::Error(400, "Bad");
    if (r.method == "DELETE") return FakeS3::Error(403, "AccessDenied");
    return std::nullopt;
  };
  ASSERT_FALSE(store_->Put("blobs/x", Binary((uint64_t{5} << 20) * 2, 1)).ok());
  fake_->before = nullptr;
  ASSERT_EQ(fake_->OpenUploads(), 1u);
  EXPECT_EQ(store_->RemoveStaleTemp(int64_t{1} << 40).value(), 0u) << "young ones are kept";
  EXPECT_EQ(fake_->OpenUploads(), 1u);
  EXPECT_EQ(store_->RemoveStaleTemp(3600).value(), 2u);
  EXPECT_EQ(fake_->OpenUploads(), 0u);
  EXPECT_FALSE(std::ifstream(old_file).good());
  EXPECT_TRUE(std::ifstream(new_file).good());
}

TEST(S3Uri, ParsesBucketAndPrefix) {
  auto a = ParseS3Uri("s3://bucket/a/b/");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bucket, "bucket");
  EXPECT_EQ(a->prefix, "a/b");
  EXPECT_EQ(ParseS3Uri("s3://my.bucket-1").value().prefix, "");
  EXPECT_EQ(ParseS3Uri("s3://bucket/").value().prefix, "");
  for (const char* bad : {"s3://", "s3://ab", "s3://Bucket/x", "s3://-bucket", "s3://bucket/../x",
                          "s3://bucket/a//b", "s3://bucket/a b", "gs://bucket"}) {
    EXPECT_EQ(ParseS3Uri(bad).status().code(), Code::kInvalidArgument) << bad;
  }
}

TEST(S3Uri, OpenObjectStoreDispatchesS3UrisWithoutARequest) {
  auto s3 = OpenObjectStore("s3://bucket/prefix", /*create=*/false);
  ASSERT_TRUE(s3.ok()) << s3.status().ToString();
  EXPECT_EQ((*s3)->Describe(), "s3://bucket/prefix");
  EXPECT_EQ(OpenObjectStore("s3://B/prefix", false).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dte
