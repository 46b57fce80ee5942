#include "sync/transport/job_secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "store/base/posix_file.h"
#include "store/crypto.h"
#include "sync/transport/socket.h"

namespace dte {
namespace {

std::string Octal(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

Result<JobSecret> Checked(std::string key, std::string source) {
  while (!key.empty() &&
         (key.back() == '\n' || key.back() == '\r' || key.back() == ' ' || key.back() == '\t')) {
    key.pop_back();
  }
  if (key.size() < kMinSecretBytes) {
    return InvalidArgument("the job secret from " + source + " has " + std::to_string(key.size()) +
                           " bytes; it needs at least " + std::to_string(kMinSecretBytes) +
                           " (for example: openssl rand -hex 32)");
  }
  return JobSecret{std::move(key), std::move(source)};
}

}  // namespace

std::string HowToGiveASecret() {
  return std::string("give a job secret (the secret argument, ") + kSecretEnv + ", or " +
         kSecretFileEnv + " naming a file of mode 0600)";
}

Status CheckListenWithoutSecret(const std::string& address, const std::string& what) {
  ASSIGN_OR_RETURN(bool loopback, transport_internal::IsLoopbackAddress(address));
  if (loopback) return Status::Ok();
  return InvalidArgument(what + " would listen on " + address +
                         ", which is not a loopback address, without a job secret: anyone who "
                         "can reach it could connect; " +
                         HowToGiveASecret() + ", or listen on 127.0.0.1");
}

Result<JobSecret> ReadSecretFile(const std::string& path) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_RDONLY));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus("stat " + path, errno);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument("job secret file " + path + " is not a regular file");
  }
  if ((st.st_mode & 077) != 0) {
    return PermissionDenied("job secret file " + path + " has mode " + Octal(st.st_mode) +
                            ": group or others may read it; make it private (chmod 600 " + path +
                            ")");
  }
  if (st.st_uid != geteuid()) {
    return PermissionDenied("job secret file " + path + " belongs to uid " +
                            std::to_string(st.st_uid) + ", not to this user (uid " +
                            std::to_string(geteuid()) + ")");
  }
  ASSIGN_OR_RETURN(std::string key, ReadWholeFile(path));
  return Checked(std::move(key), "file " + path);
}

Result<std::optional<JobSecret>> FindJobSecret(const std::string& given,
                                               const std::string& rendezvous_dir) {
  auto found = [](Result<JobSecret> r) -> Result<std::optional<JobSecret>> {
    if (!r.ok()) return r.status();
    return std::optional<JobSecret>(std::move(r).value());
  };
  if (!given.empty()) return found(Checked(given, "the secret argument"));
  if (const char* env = std::getenv(kSecretEnv); env != nullptr && *env != '\0') {
    return found(Checked(env, kSecretEnv));
  }
  if (const char* file = std::getenv(kSecretFileEnv); file != nullptr && *file != '\0') {
    Result<JobSecret> r = ReadSecretFile(file);
    return found(r.ok() ? std::move(r) : Result<JobSecret>(r.status().WithContext(kSecretFileEnv)));
  }
  if (!rendezvous_dir.empty()) {
    const std::string path = rendezvous_dir + "/" + kSecretFileName;
    if (access(path.c_str(), F_OK) == 0) return found(ReadSecretFile(path));
  }
  return std::optional<JobSecret>();
}

Result<JobSecret> CreateRendezvousSecret(const std::string& rendezvous_dir) {
  const std::string path = rendezvous_dir + "/" + kSecretFileName;
  const std::string tmp = rendezvous_dir + "/." + kSecretFileName + "." + std::to_string(getpid());
  uint8_t raw[32];
  RETURN_IF_ERROR(crypto::RandomBytes(raw, sizeof raw));
  std::string hex;
  for (uint8_t b : raw) {
    hex += "0123456789abcdef"[b >> 4];
    hex += "0123456789abcdef"[b & 15];
  }
  {
    ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600));
    RETURN_IF_ERROR(WriteAll(fd.get(), hex.data(), hex.size(), tmp));
    RETURN_IF_ERROR(fd.Close(tmp));
  }
  // link(2) puts the whole file in place, or fails when one is there: a
  // reader never sees a part of it, and a secret already there is kept.
  const int linked = link(tmp.c_str(), path.c_str());
  const int err = errno;
  unlink(tmp.c_str());
  if (linked != 0 && err != EEXIST) return ErrnoStatus("link " + tmp + " to " + path, err);
  return ReadSecretFile(path);
}

}  // namespace dte
