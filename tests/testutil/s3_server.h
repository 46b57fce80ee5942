// S3TestServer: a real S3-compatible server (moto) on a free loopback port,
// started on first use and killed when the test program exits (or dies:
// the child gets SIGKILL with its parent).
//
// It runs tests/testutil/moto_server.py (moto's server with conditional
// writes serialized, see there) with the project's Python
// (tests/testutil/paths.h). Tests that need it must fail, not skip, when it cannot start: Get() returns the reason
// (moto missing, the port taken, no answer within a minute) with the tail of
// the server's log.
//
// Two servers, each started on first use: Get() accepts any signature and
// lets tests create buckets with unsigned requests; GetSigned() checks the
// SigV4 signature of every request (moto recomputes it with botocore) and
// has one bucket, signed_bucket(), and credentials made by the server: an
// IAM user's keys (Options) and an assumed-role session with a token
// (SessionOptions).
//
// Thread-safety: Get() and NewBucket() may be called concurrently.
#pragma once

#include <string>

#include "store/base/status.h"
#include "store/s3_store.h"

namespace dte::test {

class S3TestServer {
 public:
  // The process-wide servers.
  static Result<S3TestServer*> Get();
  static Result<S3TestServer*> GetSigned();

  // "http://127.0.0.1:PORT"
  const std::string& endpoint() const { return endpoint_; }

  // Creates a bucket with a fresh name and returns the name.
  Result<std::string> NewBucket();

  // Options for a store on this server: its endpoint, path style, test
  // credentials (the IAM user's on the signed server), quick retries, 5 MiB
  // parts, and spool files in `spool_dir`.
  S3Options Options(const std::string& spool_dir) const;
  // The same with the signed server's temporary credentials (session token).
  S3Options SessionOptions(const std::string& spool_dir) const;
  // The signed server's bucket.
  static constexpr const char* kSignedBucket = "dte-signed";

  // Sends one unsigned HTTP/1.1 request and returns the status code (moto
  // does not check signatures): for setting up buckets in tests.
  Result<int> RawRequest(const std::string& method, const std::string& path) const;

 private:
  friend class S3TestServerHolder;
  S3TestServer() = default;
  Status Start(bool check_signatures);
  Status ReadCredentials(const std::string& path);
  void Stop();

  int pid_ = -1;
  std::string access_key_ = "AKIDTESTONLY";
  std::string secret_key_ = "test-secret-not-real";
  std::string session_access_key_, session_secret_key_, session_token_;
  int port_ = 0;
  std::string endpoint_;
  std::string dir_;  // the server's log and credentials, removed by Stop
  std::string log_path_;
};

}  // namespace dte::test
