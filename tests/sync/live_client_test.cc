// The live-apply client without a daemon: the ioctl ABI's encoding, and the
// errors on paths that are not dtefs mounts, in C++ and through the C ABI.
// Applies against a real mount are tested with dtefs (tests/fs, tests/py).
#include "sync/live/live_client.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include "sync/capi/c_api.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte::live {
namespace {

// FUSE forwards only restricted ioctls, whose number encodes the size the
// kernel copies: it must be the struct's, and fit in 14 bits.
TEST(LiveAbi, CommandsEncodeTheirStructs) {
  EXPECT_EQ(_IOC_SIZE(DTE_IOC_APPLY), sizeof(dte_live_apply));
  EXPECT_EQ(_IOC_SIZE(DTE_IOC_STATUS), sizeof(dte_live_status));
  EXPECT_EQ(_IOC_SIZE(DTE_IOC_REGISTER), sizeof(dte_live_register));
  EXPECT_EQ(_IOC_SIZE(DTE_IOC_UNREGISTER), sizeof(uint64_t));
  for (unsigned long cmd : {DTE_IOC_APPLY, DTE_IOC_STATUS, DTE_IOC_REGISTER}) {
    EXPECT_EQ(_IOC_DIR(cmd), _IOC_READ | _IOC_WRITE) << std::hex << cmd;
    EXPECT_LE(_IOC_SIZE(cmd), 16383u) << std::hex << cmd;
    EXPECT_EQ(_IOC_TYPE(cmd), DTE_IOC_MAGIC) << std::hex << cmd;
  }
  EXPECT_EQ(_IOC_DIR(DTE_IOC_UNREGISTER), static_cast<unsigned>(_IOC_WRITE));
  EXPECT_EQ(_IOC_NR(DTE_IOC_APPLY), 1u);
  EXPECT_EQ(_IOC_NR(DTE_IOC_STATUS), 2u);
  EXPECT_EQ(_IOC_NR(DTE_IOC_REGISTER), 3u);
  EXPECT_EQ(_IOC_NR(DTE_IOC_UNREGISTER), 4u);
}

// The sizes and offsets the Python mirror (sync/python/dte/_lib.py) and
// tests/py/test_live_client.py check too.
TEST(LiveAbi, StructLayoutIsFixed) {
  EXPECT_EQ(sizeof(dte_live_counts), 104u);
  EXPECT_EQ(sizeof(dte_live_apply), 1152u);
  EXPECT_EQ(offsetof(dte_live_apply, counts), 24u);
  EXPECT_EQ(sizeof(dte_live_status), 1200u);
  EXPECT_EQ(offsetof(dte_live_status, last), 72u);
  EXPECT_EQ(sizeof(dte_live_register), 1816u);
  EXPECT_EQ(offsetof(dte_live_register, name), 24u);
  EXPECT_EQ(offsetof(dte_live_register, shape), 296u);
  EXPECT_EQ(offsetof(dte_live_register, shm_name), 360u);
  EXPECT_EQ(offsetof(dte_live_register, buffer_id), 696u);
  EXPECT_EQ(offsetof(dte_live_register, message), 712u);
  EXPECT_EQ(offsetof(dte_live_register, version), 1736u);
  EXPECT_EQ(offsetof(dte_live_register, server), 1744u);
  EXPECT_EQ(offsetof(dte_live_register, server_size), 1808u);
}

TEST(LiveClient, CodeFollowsErrno) {
  EXPECT_EQ(CodeOfErrno(EPERM), Code::kPermissionDenied);
  EXPECT_EQ(CodeOfErrno(EACCES), Code::kPermissionDenied);
  EXPECT_EQ(CodeOfErrno(EBUSY), Code::kUnavailable);
  EXPECT_EQ(CodeOfErrno(ETIMEDOUT), Code::kDeadlineExceeded);
  EXPECT_EQ(CodeOfErrno(EBADFD), Code::kFailedPrecondition);
  EXPECT_EQ(CodeOfErrno(ECANCELED), Code::kAborted);
  EXPECT_EQ(CodeOfErrno(ENOENT), Code::kNotFound);
  EXPECT_EQ(CodeOfErrno(EINVAL), Code::kInvalidArgument);
  EXPECT_EQ(CodeOfErrno(ENOTTY), Code::kInvalidArgument);
  EXPECT_EQ(CodeOfErrno(EIO), Code::kIOError);
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(LiveClient, PlainDirectoryIsNotADtefsMount) {
  test::ScopedTempDir tmp;
  auto applied = Apply(tmp.path(), std::nullopt);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.status().code(), Code::kNotFound);
  EXPECT_EQ(applied.status().message(),
            tmp.path() + " is not a dtefs mount with live apply (no .dte/control)");
  auto status = GetStatus(tmp.path() + "/");
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(Contains(status.status().message(), tmp.path())) << status.status().message();
  EXPECT_FALSE(Control::Open(tmp.path()).ok());
}

TEST(LiveClient, MissingPathIsNamed) {
  test::ScopedTempDir tmp;
  const std::string missing = tmp.path() + "/nothing";
  auto applied = Apply(missing, 3);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.status().code(), Code::kNotFound);
  EXPECT_EQ(applied.status().message(), missing + ": " + std::strerror(ENOENT));
}

// A directory with a regular file at .dte/control: the file opens, but
// takes no dte ioctls.
class LiveFakeControl : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::mkdir((tmp_.path() + "/.dte").c_str(), 0755), 0);
    ASSERT_TRUE(test::WriteFileBytes(tmp_.path() + "/.dte/control", "").ok());
  }
  std::string NotDtefs() const { return tmp_.path() + " is not a dtefs mount (ENOTTY)"; }

  test::ScopedTempDir tmp_;
};

TEST_F(LiveFakeControl, EveryCommandFailsWithEnotty) {
  auto applied = Apply(tmp_.path(), 7);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(applied.status().message(), NotDtefs());
  auto status = GetStatus(tmp_.path());
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.status().message(), NotDtefs());

  auto c = Control::Open(tmp_.path());
  ASSERT_TRUE(c.ok()) << c.status().message();
  dte_live_register r{};
  std::strcpy(r.name, "model.embed_tokens.weight");
  std::strcpy(r.dtype, "BF16");
  std::strcpy(r.shm_name, "rank0");
  auto id = c->Register(&r);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().message(), NotDtefs());
  EXPECT_EQ(r.abi_version, static_cast<uint32_t>(DTE_LIVE_ABI_VERSION));
  Status s = c->Unregister(0);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.message(), NotDtefs());
}

TEST_F(LiveFakeControl, RegisterRefusesUnterminatedNamesBeforeTheIoctl) {
  auto c = Control::Open(tmp_.path());
  ASSERT_TRUE(c.ok()) << c.status().message();
  dte_live_register r{};
  std::memset(r.name, 'x', sizeof(r.name));
  std::strcpy(r.dtype, "BF16");
  auto id = c->Register(&r);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(id.status().message(), "NUL-terminated")) << id.status().message();
  EXPECT_EQ(r.abi_version, 0u);  // refused before it was filled in
}

TEST_F(LiveFakeControl, ControlOwnsItsDescriptor) {
  auto c = Control::Open(tmp_.path());
  ASSERT_TRUE(c.ok()) << c.status().message();
  const int fd = c->fd();
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC);
  {
    Control moved = std::move(c).value();
    EXPECT_EQ(moved.fd(), fd);
    EXPECT_EQ(moved.mount(), tmp_.path());
  }
  errno = 0;
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
}

TEST(LiveCApi, ErrorsNameTheMount) {
  test::ScopedTempDir tmp;
  dte_live_counts counts{};
  EXPECT_EQ(dte_live_apply_version(tmp.path().c_str(), DTE_LIVE_LATEST, &counts), DTE_NOT_FOUND);
  EXPECT_EQ(std::string(dte_last_error()),
            tmp.path() + " is not a dtefs mount with live apply (no .dte/control)");
  dte_live_status status{};
  EXPECT_EQ(dte_live_get_status(tmp.path().c_str(), &status), DTE_NOT_FOUND);
  dte_live* l = nullptr;
  EXPECT_EQ(dte_live_open(tmp.path().c_str(), &l), DTE_NOT_FOUND);
  EXPECT_EQ(l, nullptr);
  EXPECT_EQ(dte_live_apply_version(nullptr, 0, nullptr), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(dte_live_register_buffer(nullptr, nullptr), DTE_INVALID_ARGUMENT);
}

TEST(LiveCApi, ReceiverOnAFileWithoutIoctls) {
  test::ScopedTempDir tmp;
  ASSERT_EQ(::mkdir((tmp.path() + "/.dte").c_str(), 0755), 0);
  ASSERT_TRUE(test::WriteFileBytes(tmp.path() + "/.dte/control", "").ok());
  dte_live* l = nullptr;
  ASSERT_EQ(dte_live_open(tmp.path().c_str(), &l), DTE_OK) << dte_last_error();
  dte_live_register r{};
  std::strcpy(r.name, "lm_head.weight");
  EXPECT_EQ(dte_live_register_buffer(l, &r), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(dte_last_error()), tmp.path() + " is not a dtefs mount (ENOTTY)");
  EXPECT_EQ(dte_live_unregister(l, 5), DTE_INVALID_ARGUMENT);
  dte_live_close(l);
}

// A control file the caller may not open: EACCES becomes
// DTE_PERMISSION_DENIED. Root opens anything, so as root the check runs in a
// child that became nobody.
TEST(LiveCApi, UnreadableControlFileIsPermissionDenied) {
  test::ScopedTempDir tmp;
  ASSERT_EQ(::chmod(tmp.path().c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((tmp.path() + "/.dte").c_str(), 0755), 0);
  const std::string control = tmp.path() + "/.dte/control";
  ASSERT_TRUE(test::WriteFileBytes(control, "").ok());
  ASSERT_EQ(::chmod(control.c_str(), 0), 0);
  auto check = [&] {
    return dte_live_apply_version(tmp.path().c_str(), DTE_LIVE_LATEST, nullptr) ==
               DTE_PERMISSION_DENIED &&
           std::string(dte_last_error()) == control + ": " + std::strerror(EACCES);
  };
  if (::geteuid() != 0) {
    EXPECT_TRUE(check()) << dte_last_error();
    return;
  }
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const bool ok = ::setgid(65534) == 0 && ::setuid(65534) == 0 && check();
    if (!ok) std::fprintf(stderr, "as nobody: %s\n", dte_last_error());
    ::_exit(ok ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
}

}  // namespace
}  // namespace dte::live
