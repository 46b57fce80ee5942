// What every entry point of the C ABI (sync/capi/c_api.h) shares: the
// thread's last error, the one mapping of dte::Code to dte_code, the guard
// that keeps C++ exceptions (allocation failures) from crossing the ABI
// (each entry point reports them as DTE_INTERNAL), and the checked use of
// handles through the table of c_api_handles.h.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "store/base/status.h"
#include "sync/capi/c_api.h"
#include "sync/capi/internal/c_api_handles.h"

namespace dte::capi {

// The message dte_last_error returns: this thread's.
std::string& LastError();

// The dte_code of `code`.
int ToCode(dte::Code code);

// Sets the last error to s's message; returns s's dte_code.
int Fail(const dte::Status& s);

// Sets the last error to `message`; returns `code`.
int FailWith(int code, std::string message);

// s, or "" for NULL.
const char* OrEmpty(const char* s);

// Runs fn() -> int, turning exceptions into DTE_INTERNAL.
template <typename Fn>
int Guard(const Fn& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return FailWith(DTE_INTERNAL, std::string("dte: ") + e.what());
  } catch (...) {
    return FailWith(DTE_INTERNAL, "dte: unknown C++ exception");
  }
}

// The kind of each handle type (c_api_handles.h).
template <typename T>
constexpr HandleKind kKindOf = HandleKind{};
template <>
constexpr HandleKind kKindOf<dte_publisher> = HandleKind::kPublisher;
template <>
constexpr HandleKind kKindOf<dte_store> = HandleKind::kStore;
template <>
constexpr HandleKind kKindOf<dte_transport> = HandleKind::kTransport;
template <>
constexpr HandleKind kKindOf<dte_push_server> = HandleKind::kPushServer;
template <>
constexpr HandleKind kKindOf<dte_push_receiver> = HandleKind::kPushReceiver;
template <>
constexpr HandleKind kKindOf<dte_live> = HandleKind::kLive;
template <>
constexpr HandleKind kKindOf<dte_tensor_table> = HandleKind::kTensorTable;

// Enters a fresh object in the table; returns its handle.
template <typename T>
T* Issue(T* fresh) {
  std::shared_ptr<T> object(fresh);
  return reinterpret_cast<T*>(HandleTable::Global().Add(kKindOf<T>, std::move(object)));
}

// The object of open handle h, or null after setting last_error.
template <typename T>
std::shared_ptr<T> Find(T* h, const char* fn) {
  std::string error;
  std::shared_ptr<void> object =
      HandleTable::Global().Find(reinterpret_cast<uintptr_t>(h), kKindOf<T>, fn, &error);
  if (object == nullptr) LastError() = std::move(error);
  return std::static_pointer_cast<T>(object);
}

// Runs body(T&) -> int on the object of open handle h, under Guard;
// DTE_INVALID_ARGUMENT when h is not one. `fn` names the C function.
template <typename T, typename Body>
int WithHandle(T* h, const char* fn, const Body& body) {
  return Guard([&] {
    std::shared_ptr<T> object = Find(h, fn);
    if (object == nullptr) return static_cast<int>(DTE_INVALID_ARGUMENT);
    return static_cast<int>(body(*object));
  });
}

// The dte_*_close functions: the handle leaves the table first; its object
// is destroyed now, or when a call that holds it returns.
template <typename T>
int Close(T* h, const char* fn) {
  return Guard([&] {
    std::string error;
    std::shared_ptr<void> object =
        HandleTable::Global().Remove(reinterpret_cast<uintptr_t>(h), kKindOf<T>, fn, &error);
    if (object == nullptr) return FailWith(DTE_INVALID_ARGUMENT, std::move(error));
    object.reset();
    return static_cast<int>(DTE_OK);
  });
}

}  // namespace dte::capi
