// Fixtures shared by the dtefs unit tests: a store in a temp dir whose
// version v is step v of a test::ModelSeries, committed through the real
// commit path, and helpers that read through a Filesystem.
//
// Stores are opened without a host-local index, so no RocksDB threads run
// (the suite also runs under ThreadSanitizer, and RocksDB is not built with
// it).
//
// Thread-safety: SeriesStore is immutable after construction; Commit may run
// concurrently with readers of the store. The helpers are thread-safe.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "fs/filesystem.h"
#include "store/ops/commit.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/model_series.h"

namespace dte::test {

class SeriesStore {
 public:
  // Writes the checkpoint directories of `steps` steps; commits nothing.
  explicit SeriesStore(uint64_t steps) : series_(steps), uri_(dir_.path() + "/store") {
    for (uint64_t s = 0; s < steps; ++s) {
      Status w = series_.Write(s, InputDir(s));
      EXPECT_TRUE(w.ok()) << w.message();
    }
  }

  const ModelSeries& series() const { return series_; }
  const std::string& uri() const { return uri_; }
  // The local path of an object of the store.
  std::string PathOf(const std::string& key) const { return uri_ + "/" + key; }

  // A new handle on the store, without an index; null (and a test failure)
  // if it does not open.
  std::unique_ptr<Store> Open() const { return OpenTestStore(uri_); }

  // Commits step `step` as version `step`.
  Status Commit(Store& store, uint64_t step) const {
    CommitOptions o;
    o.version = step;
    auto r = CommitDirectory(store, InputDir(step), o);
    return r.ok() ? Status::Ok() : r.status();
  }

 private:
  std::string InputDir(uint64_t step) const { return dir_.path() + "/in" + std::to_string(step); }

  ScopedTempDir dir_;
  ModelSeries series_;
  std::string uri_;
};

// The inode of `name` in directory `parent`, or 0 (and a test failure).
inline uint64_t LookupIno(fs::Filesystem& f, uint64_t parent, const std::string& name) {
  auto a = f.Lookup(parent, name);
  EXPECT_TRUE(a.ok()) << name << ": " << a.status().message();
  return a.ok() ? a->ino : 0;
}

// The inode of file `name` of `version`, or 0 (and a test failure).
inline uint64_t FileIno(fs::Filesystem& f, uint64_t version, const std::string& name) {
  uint64_t dir = LookupIno(f, fs::kRootIno, VersionName(version));
  return dir == 0 ? 0 : LookupIno(f, dir, name);
}

// [offset, offset + len) of an open file, or the read's error.
inline Result<std::string> ReadRange(fs::Filesystem& f, const fs::OpenFile& file, uint64_t offset,
                                     uint64_t len) {
  std::string out;
  RETURN_IF_ERROR(f.Read(file, offset, len, &out));
  return out;
}

}  // namespace dte::test
