#include "tests/testutil/memory_store.h"

#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <thread>
#include <utility>

#include "store/local_store.h"

namespace dte::test {

ScopedTempDir::ScopedTempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/dte-test-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::perror(("mkdtemp " + pattern).c_str());
    std::abort();
  }
  path_ = pattern;
}

ScopedTempDir::~ScopedTempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

const char* StoreOpName(StoreOp op) {
  static constexpr const char* kNames[kStoreOpCount] = {
      "put",  "put_file", "create_exclusive", "get",           "get_range", "read_range",
      "size", "list",     "delete",           "modified_time", "touch",     "new_temp_path",
  };
  return kNames[static_cast<size_t>(op)];
}

MemoryStore::MemoryStore(std::string name) : name_(std::move(name)) {}

Status MemoryStore::Begin(StoreOp op, const std::string& key) {
  std::shared_ptr<const Hook> hook;
  std::chrono::microseconds delay{0};
  Status fault;
  {
    MutexLock lock(&mu_);
    OpState& state = ops_[static_cast<size_t>(op)];
    const uint64_t call = ++state.calls;
    if (auto it = state.fail_at.find(call); it != state.fail_at.end()) {
      fault = it->second;
      state.fail_at.erase(it);
    } else if (state.fail_all) {
      fault = *state.fail_all;
    }
    hook = hook_;
    delay = state.delay;
  }
  if (hook != nullptr) (*hook)(op, key);
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  return fault.WithContext(std::string(StoreOpName(op)) + " " + key);
}

int64_t MemoryStore::Now() const {
  return now_.has_value() ? *now_ : static_cast<int64_t>(std::time(nullptr));
}

Status MemoryStore::Store(StoreOp op, const std::string& key, std::string data, bool exclusive) {
  RETURN_IF_ERROR(Begin(op, key));
  RETURN_IF_ERROR(ValidateObjectKey(key));
  MutexLock lock(&mu_);
  if (exclusive && objects_.count(key) > 0) {
    return AlreadyExists("object " + key + " already exists in store " + Describe());
  }
  if (!drop_writes_) objects_[key] = Object{std::move(data), Now()};
  return Status::Ok();
}

Status MemoryStore::Put(const std::string& key, std::string_view data) {
  return Store(StoreOp::kPut, key, std::string(data), /*exclusive=*/false);
}

Status MemoryStore::CreateExclusive(const std::string& key, std::string_view data) {
  return Store(StoreOp::kCreateExclusive, key, std::string(data), /*exclusive=*/true);
}

Status MemoryStore::PutFile(const std::string& key, const std::string& path) {
  std::string data;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) return NotFound("put_file " + key + ": cannot open " + path);
    data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) return IOError("put_file " + key + ": cannot read " + path);
  }
  RETURN_IF_ERROR(Store(StoreOp::kPutFile, key, std::move(data), /*exclusive=*/false));
  std::remove(path.c_str());  // consumed, as the contract says
  return Status::Ok();
}

// Bytes [offset, offset+len) of `key`, or all of it when len is nullopt.
Result<std::string> MemoryStore::Read(StoreOp op, const std::string& key, uint64_t offset,
                                      std::optional<uint64_t> len) {
  RETURN_IF_ERROR(Begin(op, key));
  RETURN_IF_ERROR(ValidateObjectKey(key));
  if (len.has_value() && *len > UINT64_MAX - offset) {
    return InvalidArgument("range of object " + key + " overflows: offset " +
                           std::to_string(offset) + ", length " + std::to_string(*len));
  }
  MutexLock lock(&mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return NotFound("object " + key + " not found in store " + Describe());
  const std::string& data = it->second.data;
  if (!len.has_value()) return data;
  if (offset + *len > data.size()) {
    return Corruption("object " + key + " in store " + Describe() + " is " +
                      std::to_string(data.size()) + " bytes, shorter than the requested range [" +
                      std::to_string(offset) + ", " + std::to_string(offset + *len) + ")");
  }
  return data.substr(offset, *len);
}

Result<std::string> MemoryStore::Get(const std::string& key) {
  return Read(StoreOp::kGet, key, 0, std::nullopt);
}

Result<std::string> MemoryStore::GetRange(const std::string& key, uint64_t offset, uint64_t len) {
  return Read(StoreOp::kGetRange, key, offset, len);
}

Status MemoryStore::ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) {
  ASSIGN_OR_RETURN(std::string bytes, Read(StoreOp::kReadRange, key, offset, len));
  if (!bytes.empty()) std::memcpy(dst, bytes.data(), bytes.size());
  return Status::Ok();
}

Result<std::optional<uint64_t>> MemoryStore::Size(const std::string& key) {
  RETURN_IF_ERROR(Begin(StoreOp::kSize, key));
  RETURN_IF_ERROR(ValidateObjectKey(key));
  MutexLock lock(&mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return std::optional<uint64_t>();
  return std::optional<uint64_t>(it->second.data.size());
}

Result<std::vector<std::string>> MemoryStore::List(const std::string& prefix) {
  RETURN_IF_ERROR(Begin(StoreOp::kList, prefix));
  RETURN_IF_ERROR(ValidateObjectKeyPrefix(prefix));
  MutexLock lock(&mu_);
  std::vector<std::string> keys;
  for (auto it = objects_.lower_bound(prefix);
       it != objects_.end() && it->first.starts_with(prefix); ++it) {
    keys.push_back(it->first);
  }
  return keys;
}

Status MemoryStore::Delete(const std::string& key) {
  RETURN_IF_ERROR(Begin(StoreOp::kDelete, key));
  RETURN_IF_ERROR(ValidateObjectKey(key));
  MutexLock lock(&mu_);
  objects_.erase(key);
  return Status::Ok();
}

Result<int64_t> MemoryStore::ModifiedTime(const std::string& key) {
  RETURN_IF_ERROR(Begin(StoreOp::kModifiedTime, key));
  RETURN_IF_ERROR(ValidateObjectKey(key));
  MutexLock lock(&mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return NotFound("object " + key + " not found in store " + Describe());
  return it->second.mtime;
}

Status MemoryStore::Touch(const std::string& key) {
  RETURN_IF_ERROR(Begin(StoreOp::kTouch, key));
  RETURN_IF_ERROR(ValidateObjectKey(key));
  MutexLock lock(&mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return NotFound("object " + key + " not found in store " + Describe());
  if (!drop_writes_) it->second.mtime = Now();
  return Status::Ok();
}

Result<std::string> MemoryStore::NewTempPath() {
  RETURN_IF_ERROR(Begin(StoreOp::kNewTempPath, ""));
  MutexLock lock(&mu_);
  return spool_.path() + "/spool-" + std::to_string(temp_counter_++);
}

void MemoryStore::FailNth(StoreOp op, uint64_t n, Status status) {
  MutexLock lock(&mu_);
  OpState& state = ops_[static_cast<size_t>(op)];
  state.fail_at[state.calls + n] = std::move(status);
}

void MemoryStore::FailAll(StoreOp op, Status status) {
  MutexLock lock(&mu_);
  ops_[static_cast<size_t>(op)].fail_all = std::move(status);
}

void MemoryStore::ClearFaults() {
  MutexLock lock(&mu_);
  for (OpState& state : ops_) {
    state.fail_at.clear();
    state.fail_all.reset();
  }
}

void MemoryStore::SetDropWrites(bool drop) {
  MutexLock lock(&mu_);
  drop_writes_ = drop;
}

void MemoryStore::SetDelay(StoreOp op, std::chrono::microseconds delay) {
  MutexLock lock(&mu_);
  ops_[static_cast<size_t>(op)].delay = delay;
}

void MemoryStore::SetHook(Hook hook) {
  auto shared = hook ? std::make_shared<const Hook>(std::move(hook)) : nullptr;
  MutexLock lock(&mu_);
  hook_ = std::move(shared);
}

void MemoryStore::SetNow(std::optional<int64_t> now) {
  MutexLock lock(&mu_);
  now_ = now;
}

uint64_t MemoryStore::Calls(StoreOp op) const {
  MutexLock lock(&mu_);
  return ops_[static_cast<size_t>(op)].calls;
}

std::map<std::string, std::string> MemoryStore::Objects() const {
  MutexLock lock(&mu_);
  std::map<std::string, std::string> out;
  for (const auto& [key, object] : objects_) out.emplace(key, object.data);
  return out;
}

}  // namespace dte::test
