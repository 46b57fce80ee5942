#include "sync/capi/internal/c_api_handles.h"

#include <cstdio>
#include <utility>

namespace dte::capi {
namespace {

constexpr uintptr_t kKindMask = (uintptr_t{1} << kKindBits) - 1;

std::string Hex(uintptr_t token) {
  char buf[2 + 2 * sizeof(uintptr_t) + 1];
  std::snprintf(buf, sizeof(buf), "0x%jx", static_cast<uintmax_t>(token));
  return buf;
}

}  // namespace

const char* KindName(HandleKind kind) {
  switch (kind) {
    case HandleKind::kPublisher:
      return "dte_publisher";
    case HandleKind::kStore:
      return "dte_store";
    case HandleKind::kTransport:
      return "dte_transport";
    case HandleKind::kPushServer:
      return "dte_push_server";
    case HandleKind::kPushReceiver:
      return "dte_push_receiver";
    case HandleKind::kLive:
      return "dte_live";
    case HandleKind::kTensorTable:
      return "dte_tensor_table";
  }
  return "?";
}

HandleTable& HandleTable::Global() {
  static HandleTable* table = new HandleTable;  // never destroyed: handles may outlive statics
  return *table;
}

uintptr_t HandleTable::Add(HandleKind kind, std::shared_ptr<void> object) {
  MutexLock lock(&mu_);
  uintptr_t token = (static_cast<uintptr_t>(++issued_) << kKindBits) | static_cast<uintptr_t>(kind);
  open_.emplace(token, Entry{kind, std::move(object)});
  return token;
}

std::shared_ptr<void> HandleTable::Find(uintptr_t token, HandleKind kind, const char* fn,
                                        std::string* error) const {
  MutexLock lock(&mu_);
  auto it = open_.find(token);
  if (it != open_.end() && it->second.kind == kind) return it->second.object;
  *error = Describe(token, kind, fn);
  return nullptr;
}

std::shared_ptr<void> HandleTable::Remove(uintptr_t token, HandleKind kind, const char* fn,
                                          std::string* error) {
  MutexLock lock(&mu_);
  auto it = open_.find(token);
  if (it == open_.end() || it->second.kind != kind) {
    *error = Describe(token, kind, fn);
    return nullptr;
  }
  std::shared_ptr<void> object = std::move(it->second.object);
  open_.erase(it);
  return object;
}

size_t HandleTable::Count(HandleKind kind) const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [token, entry] : open_) n += entry.kind == kind;
  return n;
}

std::string HandleTable::Describe(uintptr_t token, HandleKind kind, const char* fn) const {
  std::string what = std::string(fn) + ": expected a " + KindName(kind) + " handle, got ";
  if (token == 0) return what + "NULL";
  auto it = open_.find(token);
  if (it != open_.end()) return what + "a " + KindName(it->second.kind) + " (" + Hex(token) + ")";
  auto was = static_cast<HandleKind>(token & kKindMask);
  uint64_t serial = static_cast<uint64_t>(token >> kKindBits);
  bool given = serial > 0 && serial <= issued_ && std::string(KindName(was)) != "?";
  if (!given) return what + Hex(token) + ", which is no handle this library gave";
  return what + "a " + KindName(was) + " that is closed already (" + Hex(token) + ")";
}

}  // namespace dte::capi
