// An owned /dev/shm object mapped into a test: what live receivers register
// as host buffers (tests/fs/live_*_test.cc). Created exclusively, mode 0600;
// unmapped and unlinked when destroyed.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace dte::test {

class ShmObject {
 public:
  ShmObject(const std::string& name, size_t size) : name_(name), size_(size) {
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << name;
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    data_ = static_cast<uint8_t*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~ShmObject() {
    munmap(data_, size_);
    shm_unlink(("/" + name_).c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  const std::string& name() const { return name_; }
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // The object's memory goes away under every mapping of it: the next
  // access through one raises SIGBUS.
  void Truncate() const {
    const int fd = shm_open(("/" + name_).c_str(), O_RDWR, 0600);
    EXPECT_EQ(ftruncate(fd, 0), 0);
    close(fd);
  }

 private:
  std::string name_;
  size_t size_;
  uint8_t* data_ = nullptr;
};

}  // namespace dte::test
