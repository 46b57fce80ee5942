#include "tests/testutil/s3_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "tests/testutil/paths.h"
#include "tests/testutil/wait.h"

namespace dte::test {
namespace {

constexpr auto kStartTimeout = std::chrono::seconds(60);

std::string ScriptPath() { return std::string(SourceDir()) + "/tests/testutil/moto_server.py"; }

// A port that was free a moment ago.
Result<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus("bind 127.0.0.1:0", err);
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

std::string Tail(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  return text.size() > 2000 ? "..." + text.substr(text.size() - 2000) : text;
}

}  // namespace

// Owns a process-wide server; its destructor stops it at exit.
class S3TestServerHolder {
 public:
  ~S3TestServerHolder() { server.Stop(); }
  Result<S3TestServer*> Get(bool check_signatures) {
    std::call_once(once, [&] { status = server.Start(check_signatures); });
    if (!status.ok()) return status;
    return &server;
  }

 private:
  S3TestServer server;
  std::once_flag once;
  Status status;
};

Result<S3TestServer*> S3TestServer::Get() {
  static S3TestServerHolder holder;
  return holder.Get(false);
}

Result<S3TestServer*> S3TestServer::GetSigned() {
  static S3TestServerHolder holder;
  return holder.Get(true);
}

namespace {

// The string value of "key" after position `from` in JSON text written by
// moto_server.py (no escapes in the values it writes).
std::string JsonString(const std::string& text, const std::string& key, size_t from = 0) {
  const size_t at = text.find("\"" + key + "\": \"", from);
  if (at == std::string::npos) return "";
  const size_t start = at + key.size() + 5;
  const size_t end = text.find('"', start);
  return end == std::string::npos ? "" : text.substr(start, end - start);
}

}  // namespace

Status S3TestServer::ReadCredentials(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const size_t session = text.find("\"session\"");
  access_key_ = JsonString(text.substr(0, session), "access_key");
  secret_key_ = JsonString(text.substr(0, session), "secret_key");
  session_access_key_ = JsonString(text, "access_key", session);
  session_secret_key_ = JsonString(text, "secret_key", session);
  session_token_ = JsonString(text, "token", session);
  if (session == std::string::npos || access_key_.empty() || secret_key_.empty() ||
      session_access_key_.empty() || session_secret_key_.empty() || session_token_.empty()) {
    return IOError("S3 test server credentials in " + path + " are incomplete");
  }
  return Status::Ok();
}

Status S3TestServer::Start(bool check_signatures) {
  char dir[] = "/tmp/dte-moto-XXXXXX";
  if (::mkdtemp(dir) == nullptr) return ErrnoStatus("mkdtemp", errno);
  dir_ = dir;
  log_path_ = dir_ + "/moto.log";
  const std::string creds_path = std::string(dir) + "/credentials.json";
  ASSIGN_OR_RETURN(port_, FreePort());
  endpoint_ = "http://127.0.0.1:" + std::to_string(port_);
  const std::string script = ScriptPath();
  const std::string port = std::to_string(port_);
  pid_ = ::fork();
  if (pid_ < 0) return ErrnoStatus("fork", errno);
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) {
      ::dup2(log, 1);
      ::dup2(log, 2);
    }
    if (check_signatures) {
      ::execl(test::ProjectPython(), test::ProjectPython(), script.c_str(), "-H", "127.0.0.1", "-p",
              port.c_str(), "--check-signatures", creds_path.c_str(), "--bucket", kSignedBucket,
              static_cast<char*>(nullptr));
    } else {
      ::execl(test::ProjectPython(), test::ProjectPython(), script.c_str(), "-H", "127.0.0.1", "-p",
              port.c_str(), static_cast<char*>(nullptr));
    }
    ::_exit(127);
  }
  bool exited = false;
  // The signed server writes its credentials once it checks signatures.
  const bool up = WaitFor(
      [&] {
        exited = ::waitpid(pid_, nullptr, WNOHANG) == pid_;
        return exited || (check_signatures ? ::access(creds_path.c_str(), F_OK) == 0
                                           : RawRequest("GET", "/").ok());
      },
      kStartTimeout, std::chrono::milliseconds(10));
  if (exited) {
    pid_ = -1;
    return IOError("the S3 test server (" + script + ", moto) exited at start; " +
                   "install it with tools/setup.sh; its log:\n" + Tail(log_path_));
  }
  if (up) return check_signatures ? ReadCredentials(creds_path) : Status::Ok();
  Status timeout =
      IOError("the S3 test server (moto) did not answer on " + endpoint_ + " within " +
              std::to_string(kStartTimeout.count()) + " s; its log:\n" + Tail(log_path_));
  Stop();
  return timeout;
}

void S3TestServer::Stop() {
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
    dir_.clear();
  }
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  if (!WaitFor([&] { return ::waitpid(pid_, nullptr, WNOHANG) == pid_; },
               std::chrono::seconds(5))) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  pid_ = -1;
}

Result<int> S3TestServer::RawRequest(const std::string& method, const std::string& path) const {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus("connect " + endpoint_, err);
  }
  const std::string request = method + " " + path +
                              " HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(port_) +
                              "\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
  std::string response;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
  }
  ::close(fd);
  // "HTTP/1.1 200 OK"
  if (response.size() < 12 || !response.starts_with("HTTP/1.")) {
    return IOError(method + " " + path + " on " + endpoint_ + ": no HTTP answer");
  }
  return std::atoi(response.substr(9, 3).c_str());
}

Result<std::string> S3TestServer::NewBucket() {
  static std::atomic<int> counter{0};
  const std::string bucket =
      "dte-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
  ASSIGN_OR_RETURN(int status, RawRequest("PUT", "/" + bucket));
  if (status != 200) {
    return IOError("creating bucket " + bucket + " on " + endpoint_ + ": HTTP " +
                   std::to_string(status));
  }
  return bucket;
}

S3Options S3TestServer::Options(const std::string& spool_dir) const {
  S3Options o;
  o.endpoint = endpoint_;
  o.region = "us-east-1";
  o.access_key = access_key_;
  o.secret_key = secret_key_;
  o.path_style = true;
  o.retry.base_delay = std::chrono::milliseconds(10);
  o.retry.max_delay = std::chrono::milliseconds(200);
  o.part_size = uint64_t{5} << 20;
  o.spool_dir = spool_dir;
  return o;
}

S3Options S3TestServer::SessionOptions(const std::string& spool_dir) const {
  S3Options o = Options(spool_dir);
  o.access_key = session_access_key_;
  o.secret_key = session_secret_key_;
  o.session_token = session_token_;
  return o;
}

}  // namespace dte::test
