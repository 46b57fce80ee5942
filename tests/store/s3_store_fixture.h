// The fixture of the S3Store tests against FakeS3 (s3_store_test.cc,
// s3_copy_test.cc): a store s3://bucket/pre/fix over a fresh FakeS3, with
// fast retries, 5 MiB parts and credentials whose leaks the tests look for.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "store/internal/s3_open.h"
#include "store/s3_store.h"
#include "tests/testutil/fake_s3.h"
#include "tests/testutil/memory_store.h"

namespace dte::s3_store_test {

using test::FakeS3;

inline constexpr const char* kAccessKey = "AKIDFAKEACCESS123";
inline constexpr const char* kSecret = "sEcReT/fake+key0123456789";
inline constexpr const char* kToken = "ToKeN-fake-session-987";

inline std::string Binary(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return s;
}

inline bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

inline int Count(const std::vector<std::string>& log, const std::string& start) {
  int n = 0;
  for (const auto& l : log) n += l.rfind(start, 0) == 0;
  return n;
}

class S3StoreFake : public ::testing::Test {
 protected:
  void SetUp() override { Open(); }

  void Open(int max_attempts = 4, const std::function<void(S3Options*)>& tune = nullptr) {
    S3Options o;
    o.endpoint = FakeS3::kEndpoint;
    o.access_key = kAccessKey;
    o.secret_key = kSecret;
    o.session_token = kToken;
    o.retry.max_attempts = max_attempts;
    o.retry.base_delay = std::chrono::milliseconds(1);
    o.retry.max_delay = std::chrono::milliseconds(2);
    o.part_size = uint64_t{5} << 20;
    o.parallel_parts = 3;
    o.spool_dir = spool_.path() + "/spool";
    if (tune) tune(&o);
    auto fake = std::make_unique<FakeS3>("bucket");
    fake_ = fake.get();
    auto store = internal::OpenS3StoreWithTransport("bucket", "pre/fix", o, std::move(fake));
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }

  std::string Spool(const std::string& data) {
    std::string path = store_->NewTempPath().value();
    std::ofstream(path, std::ios::binary) << data;
    return path;
  }

  void ExpectNoSecrets(const std::string& message) {
    EXPECT_FALSE(Contains(message, kSecret)) << message;
    EXPECT_FALSE(Contains(message, kToken)) << message;
    EXPECT_FALSE(Contains(message, kAccessKey)) << message;
    EXPECT_FALSE(Contains(message, "Authorization")) << message;
  }

  test::ScopedTempDir spool_;
  FakeS3* fake_ = nullptr;
  std::unique_ptr<ObjectStore> store_;
};

}  // namespace dte::s3_store_test
