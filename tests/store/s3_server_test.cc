// S3Store over libcurl: against moto's real S3 server on loopback (what the
// contract test does not cover), and against scripted misbehaving HTTP
// servers (stalls, resets, truncated and overlong bodies).
#include "tests/testutil/s3_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "store/s3_store.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/wait.h"

namespace dte {
namespace {

std::string Binary(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return s;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class S3Moto : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = test::S3TestServer::Get();
    ASSERT_TRUE(server.ok()) << "no S3 test server: " << server.status().ToString();
    server_ = *server;
    auto bucket = server_->NewBucket();
    ASSERT_TRUE(bucket.ok()) << bucket.status().ToString();
    bucket_ = *bucket;
    options_ = server_->Options(spool_.path());
    options_.parallel_parts = 3;
    auto store = OpenS3Store(bucket_, "p", options_, true);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }

  test::ScopedTempDir spool_;
  test::S3TestServer* server_ = nullptr;
  std::string bucket_;
  S3Options options_;
  std::unique_ptr<ObjectStore> store_;
};

TEST_F(S3Moto, MultipartUploadsRoundTrip) {
  const std::string data = Binary((uint64_t{5} << 20) * 2 + 777, 1);  // 3 parts
  const std::string path = store_->NewTempPath().value();
  std::ofstream(path, std::ios::binary) << data;
  Status put = store_->PutFile("blobs/big", path);
  ASSERT_TRUE(put.ok()) << put.ToString();
  EXPECT_FALSE(std::ifstream(path).good());
  EXPECT_EQ(store_->Get("blobs/big").value(), data);
  const uint64_t boundary = uint64_t{5} << 20;
  EXPECT_EQ(store_->GetRange("blobs/big", boundary - 10, 20).value(),
            data.substr(boundary - 10, 20));
  const std::string other = Binary((uint64_t{5} << 20) + 1, 2);
  ASSERT_TRUE(store_->Put("blobs/other", other).ok());
  EXPECT_EQ(store_->Size("blobs/other").value(), std::optional<uint64_t>(other.size()));
  EXPECT_EQ(store_->RemoveStaleTemp(0).value(), 0u) << "an upload was left open";
}

TEST_F(S3Moto, TouchMovesTheModifiedTimeAndKeepsTheBytes) {
  ASSERT_TRUE(store_->Put("blobs/t", "bytes").ok());
  const int64_t before = store_->ModifiedTime("blobs/t").value();
  // S3 times are whole seconds: a Touch moves one once the clock (the
  // server's is this machine's) has left the second of the write.
  ASSERT_TRUE(test::WaitFor([&] { return std::time(nullptr) > before; }))
      << "the clock did not pass " << before;
  ASSERT_TRUE(store_->Touch("blobs/t").ok());
  EXPECT_GT(store_->ModifiedTime("blobs/t").value(), before);
  EXPECT_EQ(store_->Get("blobs/t").value(), "bytes");
}

TEST_F(S3Moto, TouchAboveTheCopyLimitIsAMultipartCopyThatKeepsTheBytes) {
  // A small limit stands for S3's 5 GiB CopyObject limit.
  S3Options o = options_;
  o.max_copy_bytes = uint64_t{6} << 20;
  o.copy_part_size = uint64_t{5} << 20;
  auto opened = OpenS3Store(bucket_, "p", o, false);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  ObjectStore& store = **opened;
  const std::string big = Binary((uint64_t{5} << 20) * 2 + 4321, 7);  // 3 copy parts
  const std::string small = Binary(1000, 8);
  ASSERT_TRUE(store.Put("blobs/big", big).ok());  // a multipart upload: above part_size
  ASSERT_TRUE(store.Put("blobs/small", small).ok());
  const int64_t big_before = store.ModifiedTime("blobs/big").value();
  const int64_t small_before = store.ModifiedTime("blobs/small").value();
  // Whole seconds, as above.
  const int64_t newest = std::max(big_before, small_before);
  ASSERT_TRUE(test::WaitFor([&] { return std::time(nullptr) > newest; }))
      << "the clock did not pass " << newest;
  Status touched = store.Touch("blobs/big");
  ASSERT_TRUE(touched.ok()) << touched.ToString();
  ASSERT_TRUE(store.Touch("blobs/small").ok());
  EXPECT_GT(store.ModifiedTime("blobs/big").value(), big_before);
  EXPECT_GT(store.ModifiedTime("blobs/small").value(), small_before);
  EXPECT_EQ(store.Get("blobs/big").value(), big);
  EXPECT_EQ(store.Get("blobs/small").value(), small);  // its checksum metadata still matches
  EXPECT_EQ(store.RemoveStaleTemp(0).value(), 0u) << "the multipart copy was left open";
  EXPECT_EQ(store.Touch("blobs/missing").code(), Code::kNotFound);
}

TEST_F(S3Moto, RemoveStaleTempAbortsStaleUploadsUnderThePrefixOnly) {
  ASSERT_EQ(server_->RawRequest("POST", "/" + bucket_ + "/p/blobs/x?uploads=").value(), 200);
  ASSERT_EQ(server_->RawRequest("POST", "/" + bucket_ + "/q/blobs/x?uploads=").value(), 200);
  // moto reports every upload as initiated in 2010, so ages are checked
  // against FakeS3 (s3_store_test.cc) instead.
  EXPECT_EQ(store_->RemoveStaleTemp(0).value(), 1u);
  EXPECT_EQ(store_->RemoveStaleTemp(0).value(), 0u);
  auto other = OpenS3Store(bucket_, "q", options_, false);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->RemoveStaleTemp(0).value(), 1u);
}

TEST_F(S3Moto, ListPagesPastAThousandKeys) {
  std::vector<std::string> want;
  for (int i = 0; i < 1005; ++i) {
    want.push_back("blobs/k" + std::to_string(10000 + i));
    ASSERT_TRUE(store_->Put(want.back(), "").ok());
  }
  EXPECT_EQ(store_->List("blobs/").value(), want);
}

TEST_F(S3Moto, MissingBucketIsNotFoundNamingIt) {
  auto store = OpenS3Store("no-such-bucket-" + bucket_, "p", options_, false);
  ASSERT_TRUE(store.ok());
  auto got = (*store)->Get("dte-store.json");
  ASSERT_EQ(got.status().code(), Code::kNotFound);
  EXPECT_TRUE(Contains(got.status().message(),
                       "bucket no-such-bucket-" + bucket_ + " of store s3://no-such-bucket-"))
      << got.status().message();
  EXPECT_TRUE(Contains(got.status().message(), "NoSuchBucket, HTTP 404"));
  Status put = (*store)->CreateExclusive("dte-store.json", "{}");
  EXPECT_EQ(put.code(), Code::kNotFound) << put.ToString();
}

// Every kind of request, signed with the IAM user's keys or a session's
// temporary credentials, on the server that checks each signature.
class S3Signed : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    auto server = test::S3TestServer::GetSigned();
    ASSERT_TRUE(server.ok()) << "no S3 test server: " << server.status().ToString();
    server_ = *server;
    options_ =
        GetParam() ? server_->SessionOptions(spool_.path()) : server_->Options(spool_.path());
    options_.list_page_size = 2;  // continuation tokens ('=', '/', '+') in signed queries
    prefix_ = "signed/" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    auto store = OpenS3Store(test::S3TestServer::kSignedBucket, prefix_, options_, true);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }

  test::ScopedTempDir spool_;
  test::S3TestServer* server_ = nullptr;
  S3Options options_;
  std::string prefix_;
  std::unique_ptr<ObjectStore> store_;
};

TEST_P(S3Signed, EveryOperationPassesTheSignatureCheck) {
  ObjectStore& s = *store_;
  ASSERT_TRUE(s.Put("a/1", "one").ok());
  ASSERT_TRUE(s.CreateExclusive("a/2", "two").ok());
  EXPECT_EQ(s.CreateExclusive("a/2", "again").code(), Code::kAlreadyExists);
  const std::string big = Binary((uint64_t{5} << 20) + 3, 9);
  ASSERT_TRUE(s.Put("a/big", big).ok());  // multipart
  const std::string path = s.NewTempPath().value();
  std::ofstream(path, std::ios::binary) << big;
  ASSERT_TRUE(s.PutFile("a/file", path).ok());
  ASSERT_TRUE(s.Put("b/x", "").ok());
  EXPECT_EQ(s.Get("a/1").value(), "one");
  EXPECT_EQ(s.GetRange("a/big", 5, 4).value(), big.substr(5, 4));
  EXPECT_EQ(s.GetRange("a/file", 0, 0).value(), "");
  EXPECT_EQ(s.Size("a/2").value(), std::optional<uint64_t>(3));
  EXPECT_FALSE(s.Size("a/none").value().has_value());
  EXPECT_GT(s.ModifiedTime("a/1").value(), 0);
  EXPECT_TRUE(s.Touch("a/1").ok());
  EXPECT_EQ(s.List("").value(), (std::vector<std::string>{"a/1", "a/2", "a/big", "a/file", "b/x"}));
  EXPECT_EQ(s.List("a/").value().size(), 4u);
  EXPECT_TRUE(s.Delete("b/x").ok());
  EXPECT_TRUE(s.Delete("b/x").ok());
  EXPECT_EQ(s.Get("b/x").status().code(), Code::kNotFound);
  EXPECT_EQ(s.RemoveStaleTemp(3600).value(), 0u);
}

TEST_P(S3Signed, WrongCredentialsFailAtOnceWithoutLeakingThem) {
  S3Options bad = options_;
  bad.secret_key = "Wrong/Secret+Distinctive0123456789";
  auto store = OpenS3Store(test::S3TestServer::kSignedBucket, prefix_, bad, false);
  ASSERT_TRUE(store.ok());
  auto got = (*store)->Get("a/1");
  ASSERT_EQ(got.status().code(), Code::kPermissionDenied) << got.status().message();
  const std::string& m = got.status().message();
  EXPECT_TRUE(Contains(m, "SignatureDoesNotMatch")) << m;
  EXPECT_TRUE(Contains(m, "HTTP 403")) << m;
  EXPECT_TRUE(Contains(m, "access denied to object a/1 (bucket " +
                              std::string(test::S3TestServer::kSignedBucket) + ")"))
      << m;
  EXPECT_FALSE(Contains(m, "attempts")) << "a 403 was retried: " << m;
  for (const std::string& secret : {bad.secret_key, bad.access_key, options_.secret_key}) {
    EXPECT_FALSE(Contains(m, secret)) << m;
  }
  if (!options_.session_token.empty()) {
    bad = options_;
    bad.session_token = "Wrong-Token-Distinctive-42";
    auto with_token = OpenS3Store(test::S3TestServer::kSignedBucket, prefix_, bad, false);
    ASSERT_TRUE(with_token.ok());
    Status s = (*with_token)->Put("a/3", "x");
    ASSERT_EQ(s.code(), Code::kPermissionDenied) << s.message();
    EXPECT_FALSE(Contains(s.message(), bad.session_token)) << s.message();
  } else {
    bad = options_;
    bad.access_key = "AKIANOSUCHKEY0000042";
    auto unknown = OpenS3Store(test::S3TestServer::kSignedBucket, prefix_, bad, false);
    ASSERT_TRUE(unknown.ok());
    Status s = (*unknown)->Put("a/3", "x");
    ASSERT_EQ(s.code(), Code::kPermissionDenied) << s.message();
    EXPECT_TRUE(Contains(s.message(), "InvalidAccessKeyId")) << s.message();
    EXPECT_TRUE(Contains(s.message(), "object a/3")) << s.message();
  }
}

INSTANTIATE_TEST_SUITE_P(Credentials, S3Signed, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Session" : "UserKeys"; });

// A loopback HTTP server whose i-th connection runs handlers[min(i, last)]
// on the socket after reading the request head.
class ScriptedServer {
 public:
  using Handler = std::function<void(int fd)>;
  explicit ScriptedServer(std::vector<Handler> handlers) : handlers_(std::move(handlers)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(fd_, 16);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~ScriptedServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    for (auto& t : workers_) t.join();
    ::close(fd_);
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int connections() const { return connections_.load(); }

  static void Send(int fd, const std::string& text) {
    (void)::send(fd, text.data(), text.size(), MSG_NOSIGNAL);
  }

 private:
  void Serve() {
    for (;;) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0 || stop_) {
        if (c >= 0) ::close(c);
        return;
      }
      const size_t i = std::min<size_t>(connections_++, handlers_.size() - 1);
      workers_.emplace_back([this, c, i] {
        std::string head;
        char ch;
        while (!head.ends_with("\r\n\r\n") && ::recv(c, &ch, 1, 0) == 1) head += ch;
        handlers_[i](c);
        ::close(c);
      });
    }
  }

  std::vector<Handler> handlers_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> connections_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<std::thread> workers_;  // touched by thread_ only, joined after it
};

std::unique_ptr<ObjectStore> OpenAt(const std::string& endpoint, const std::string& spool,
                                    int attempts) {
  S3Options o;
  o.endpoint = endpoint;
  o.access_key = "AKIDSCRIPTED";
  o.secret_key = "scripted-secret-value";
  o.retry.max_attempts = attempts;
  o.retry.base_delay = std::chrono::milliseconds(1);
  o.retry.max_delay = std::chrono::milliseconds(5);
  o.low_speed_limit = 1;
  o.low_speed_time = std::chrono::seconds(1);
  o.spool_dir = spool;
  auto store = OpenS3Store("bucket", "p", o, false);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(*store) : nullptr;
}

const ScriptedServer::Handler kStall = [](int fd) {
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  (void)fd;
};
const ScriptedServer::Handler kClose = [](int) {};

ScriptedServer::Handler Answer(const std::string& body, size_t send_bytes) {
  return [=](int fd) {
    ScriptedServer::Send(fd, "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) +
                                 "\r\nConnection: close\r\n\r\n" + body.substr(0, send_bytes));
  };
}

TEST(S3Curl, StalledTransfersTimeOutAndAreRetried) {
  test::ScopedTempDir spool;
  ScriptedServer server({kStall});
  auto store = OpenAt(server.endpoint(), spool.path(), 2);
  const auto start = std::chrono::steady_clock::now();
  auto got = store->Get("m");
  const auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(got.status().code(), Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(got.status().message(), "timed out or stalled")) << got.status().message();
  EXPECT_TRUE(Contains(got.status().message(), "after 2 attempts")) << got.status().message();
  EXPECT_EQ(server.connections(), 2);
  EXPECT_LT(secs, 10.0);
}

TEST(S3Curl, ResetsAndTruncatedBodiesAreRetriedUntilWhole) {
  test::ScopedTempDir spool;
  const std::string body = "0123456789";
  ScriptedServer server({kClose, Answer(body, 4), Answer(body, body.size())});
  auto store = OpenAt(server.endpoint(), spool.path(), 3);
  auto got = store->Get("m");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, body);
  EXPECT_EQ(server.connections(), 3);
}

TEST(S3Curl, OverlongRangeBodiesNeverPassTheCallersBuffer) {
  test::ScopedTempDir spool;
  ScriptedServer server({Answer("0123456789", 10)});  // a 200 ignoring the range
  auto store = OpenAt(server.endpoint(), spool.path(), 2);
  std::string buf = "[....]";
  Status s = store->ReadRange("m", 0, 4, buf.data() + 1);
  ASSERT_EQ(s.code(), Code::kIOError) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "longer than the 4 bytes requested")) << s.message();
  EXPECT_EQ(buf.front(), '[');
  EXPECT_EQ(buf.back(), ']');
  EXPECT_FALSE(Contains(s.message(), "scripted-secret-value"));
}

}  // namespace
}  // namespace dte
