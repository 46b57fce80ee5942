// MemoryStore: an in-memory ObjectStore for unit tests, with fault injection.
//
// It keeps the contract every ObjectStore shares (the key grammar of
// store/local_store.h, NotFound / AlreadyExists / Corruption cases, sorted
// List, OK Delete of a missing key), so code tested against it behaves the
// same on a real store; tests/store/object_store_contract_test.cc checks
// that. Differences from a directory: "a" and "a/b" may both exist, and
// NewTempPath hands out paths in a private temporary directory.
//
// Faults. Every call counts as one operation of its kind (StoreOp), and
// before doing anything it: runs the hook (SetHook), sleeps the kind's delay
// (SetDelay), then fails if a fault is armed for this call (FailNth,
// FailAll). With SetDropWrites(true), writes report OK but store nothing
// (a store that loses acknowledged writes). SetNow fixes the clock that
// Put and Touch stamp and ModifiedTime reports.
//
// Thread-safety: all methods may be called concurrently. Hooks and delays
// run without the lock held, so a hook may call back into the store.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"
#include "store/object_store.h"

namespace dte::test {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it
// on destruction. Aborts the test program if it cannot be created.
class ScopedTempDir {
 public:
  ScopedTempDir();
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

enum class StoreOp {
  kPut,
  kPutFile,
  kCreateExclusive,
  kGet,
  kGetRange,
  kReadRange,
  kSize,
  kList,
  kDelete,
  kModifiedTime,
  kTouch,
  kNewTempPath,
};
inline constexpr size_t kStoreOpCount = static_cast<size_t>(StoreOp::kNewTempPath) + 1;
const char* StoreOpName(StoreOp op);  // "put", "get_range", ...

class MemoryStore final : public ObjectStore {
 public:
  // Called before each operation with its kind and key (the prefix for List,
  // "" for NewTempPath).
  using Hook = std::function<void(StoreOp, const std::string& key)>;

  explicit MemoryStore(std::string name = "test");

  std::string Describe() const override { return "memory:" + name_; }
  Status Put(const std::string& key, std::string_view data) override;
  Status PutFile(const std::string& key, const std::string& path) override;
  Status CreateExclusive(const std::string& key, std::string_view data) override;
  Result<std::string> Get(const std::string& key) override;
  Result<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t len) override;
  Status ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) override;
  Result<std::optional<uint64_t>> Size(const std::string& key) override;
  Result<std::vector<std::string>> List(const std::string& prefix) override;
  Status Delete(const std::string& key) override;
  Result<int64_t> ModifiedTime(const std::string& key) override;
  Status Touch(const std::string& key) override;
  Result<std::string> NewTempPath() override;

  // Fault injection. The n-th call of `op` from now (n = 1: the next one)
  // fails with `status`, its message prefixed by the operation and key.
  void FailNth(StoreOp op, uint64_t n, Status status = IOError("injected fault"));
  // Every call of `op` fails until ClearFaults.
  void FailAll(StoreOp op, Status status = IOError("injected fault"));
  // Disarms FailNth and FailAll faults; delays, hook and drop stay.
  void ClearFaults();
  void SetDropWrites(bool drop);
  void SetDelay(StoreOp op, std::chrono::microseconds delay);
  void SetHook(Hook hook);
  // Fixes the clock (seconds since the epoch); nullopt restores real time.
  void SetNow(std::optional<int64_t> now);

  // Inspection.
  uint64_t Calls(StoreOp op) const;                    // calls of `op` so far, failed ones included
  std::map<std::string, std::string> Objects() const;  // a snapshot

 private:
  struct Object {
    std::string data;
    int64_t mtime = 0;
  };
  struct OpState {
    uint64_t calls = 0;
    std::map<uint64_t, Status> fail_at;  // call number -> fault
    std::optional<Status> fail_all;
    std::chrono::microseconds delay{0};
  };

  // Counts the call, runs hook and delay; the armed fault, if any.
  Status Begin(StoreOp op, const std::string& key) EXCLUDES(mu_);
  Status Store(StoreOp op, const std::string& key, std::string data, bool exclusive) EXCLUDES(mu_);
  Result<std::string> Read(StoreOp op, const std::string& key, uint64_t offset,
                           std::optional<uint64_t> len) EXCLUDES(mu_);
  int64_t Now() const REQUIRES(mu_);

  const std::string name_;
  ScopedTempDir spool_;  // NewTempPath files

  mutable Mutex mu_;
  std::map<std::string, Object> objects_ GUARDED_BY(mu_);
  std::array<OpState, kStoreOpCount> ops_ GUARDED_BY(mu_);
  std::shared_ptr<const Hook> hook_ GUARDED_BY(mu_);
  bool drop_writes_ GUARDED_BY(mu_) = false;
  std::optional<int64_t> now_ GUARDED_BY(mu_);
  uint64_t temp_counter_ GUARDED_BY(mu_) = 0;
};

}  // namespace dte::test
