// The C ABI's table of open handles (sync/capi/c_api.h).
//
// A handle the C ABI gives out is a token naming an entry of this table,
// never the address of the object: every entry point looks its handles up
// here before using them, so a NULL, closed, forged or wrong-kind handle is
// answered with an error message and is never dereferenced. A token is
//   (serial << kKindBits) | kind
// with a serial counted from 1 and never reused in a process, so a closed
// handle stays closed after later opens, and the error can say which kind
// of handle a closed or wrong token was.
//
// Thread-safety: every method may be called concurrently. Find returns a
// shared_ptr: a close (Remove) that races with a call on the same handle
// takes the token out of the table at once (later calls fail), and the
// object is destroyed when the last call holding it returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "store/base/thread_annotations.h"

namespace dte::capi {

// The kinds of handles, one per opaque type of sync/capi/c_api.h. Values fit in
// kKindBits; 0 is no kind, and 4 (dte_dist_publisher before C API 11) is
// retired: a token of it is no handle at all.
enum class HandleKind : uint8_t {
  kPublisher = 1,
  kStore = 2,
  kTransport = 3,
  kPushServer = 5,
  kPushReceiver = 6,
  kLive = 7,
  kTensorTable = 8,
};
constexpr int kKindBits = 4;

// The C type name of a kind ("dte_publisher"); "?" for a value no kind has.
const char* KindName(HandleKind kind);

class HandleTable {
 public:
  // The process's table, which every C entry point uses.
  static HandleTable& Global();

  // Adds `object` (not null) and returns its new token.
  uintptr_t Add(HandleKind kind, std::shared_ptr<void> object) EXCLUDES(mu_);

  // The object of open handle `token` of kind `kind`; else null, and
  // *error is "FN: expected a KIND handle, got ..." saying what it got
  // (NULL, a closed handle, one of another kind, or no handle at all).
  std::shared_ptr<void> Find(uintptr_t token, HandleKind kind, const char* fn,
                             std::string* error) const EXCLUDES(mu_);

  // Takes open handle `token` of kind `kind` out of the table and returns
  // its object, which the caller drops; null with *error as for Find (a
  // second close finds the handle closed).
  std::shared_ptr<void> Remove(uintptr_t token, HandleKind kind, const char* fn, std::string* error)
      EXCLUDES(mu_);

  // Open handles of `kind`.
  size_t Count(HandleKind kind) const EXCLUDES(mu_);

 private:
  struct Entry {
    HandleKind kind;
    std::shared_ptr<void> object;
  };

  // What a token that is not an open handle of `kind` is, for errors.
  std::string Describe(uintptr_t token, HandleKind kind, const char* fn) const REQUIRES(mu_);

  mutable Mutex mu_;
  // Serials given so far: a token of a serial up to it and a valid kind is
  // called closed, any other forged (kept flat in the handles ever opened).
  uint64_t issued_ GUARDED_BY(mu_) = 0;
  std::unordered_map<uintptr_t, Entry> open_ GUARDED_BY(mu_);
};

}  // namespace dte::capi
