// Test checkpoints: Hugging Face style model directories built from tensors
// held in memory, with deterministic pseudo-random weights and updates.
//
// A TestCheckpoint is plain data; tests copy it, change a few tensors (as an
// optimizer step would) and write each version to its own directory.
// VersionWriter instead stores such tensors as versions directly, for tests
// of readers that must not depend on the commit pipeline.
//
// Thread-safety: plain values and pure functions, except the file helpers
// and VersionWriter (one per test), which write.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"
#include "store/manifest.h"
#include "store/object_store.h"
#include "store/store.h"

namespace dte::test {

// splitmix64: a small deterministic generator, identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  uint64_t Below(uint64_t n) { return Next() % n; }  // n > 0; bias is irrelevant here

 private:
  uint64_t state_;
};

struct TestTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::string data;  // little-endian element bytes, width(dtype) x prod(shape)

  uint64_t elements() const;
};

struct TestSafetensors {
  std::string name;                 // e.g. "model-00001-of-00002.safetensors"
  std::vector<TestTensor> tensors;  // laid out in this order
  std::map<std::string, std::string> metadata;
};

struct TestCheckpoint {
  std::vector<TestSafetensors> safetensors;
  std::map<std::string, std::string> raw_files;  // e.g. "config.json" -> its bytes

  TestTensor& tensor(const std::string& name);  // aborts if missing
};

// `elements` BF16 values spread like initialized weights (|x| mostly < 0.1).
std::string RandomBf16(uint64_t elements, uint64_t seed);
// `bytes` pseudo-random bytes.
std::string RandomBytes(uint64_t bytes, uint64_t seed);

// A BF16 tensor of `shape` with RandomBf16 content.
TestTensor Bf16Tensor(const std::string& name, std::vector<int64_t> shape, uint64_t seed);

// Changes exactly `count` distinct elements of `data` (elements of `width`
// bytes, picked from `seed`) by a small nonzero integer step of their bit
// pattern, like one optimizer step on BF16. Returns the changed indices,
// sorted. `count` must not exceed the element count.
std::vector<uint64_t> PerturbElements(std::string* data, int width, uint64_t count, uint64_t seed);

// One optimizer-like step of 2-byte tensors: PerturbElements on each tensor,
// `per_block` elements for every `block_bytes` of it (at most all of them),
// tensor i with seed `seed` + i. With enough per block, every block changes.
std::vector<TestTensor> PerturbEveryBlock(std::vector<TestTensor> tensors, uint64_t block_bytes,
                                          uint64_t per_block, uint64_t seed);

// The number of `width`-byte elements whose bits differ between a and b
// (same length). The reference for changed-element statistics.
uint64_t CountDifferingElements(std::string_view a, std::string_view b, int width);

// The bytes of one safetensors file (header from BuildSafetensorsHeader, then
// the tensors' data in order).
std::string SafetensorsBytes(const TestSafetensors& file);

// Writes every file of `ckpt` into `dir`, which is created if missing.
Status WriteCheckpoint(const TestCheckpoint& ckpt, const std::string& dir);

// Opens the store at `uri`, creating it, with its index in `cache_dir` if
// that is not empty. A failure fails the current test and returns null.
std::unique_ptr<Store> OpenTestStore(const std::string& uri, const std::string& cache_dir = "");

// A file's whole content (NotFound / IOError naming the path).
Result<std::string> ReadFileBytes(const std::string& path);
// Replaces the file at `path` with `bytes`.
Status WriteFileBytes(const std::string& path, std::string_view bytes);
// XORs the byte at `offset` of an existing file with `mask`, in place (the
// same inode, as a failing disk would).
Status FlipBits(const std::string& path, uint64_t offset, uint8_t mask = 0x10);

// Writes versions of a model made of "config.json" and one safetensors file
// (kModelFile) into `objects`, laid out as a publisher does: an anchor's
// records are kDenseRaw into its data section; a delta's records are
// EncodeBlock's choice against the previously written version, their
// payloads in one blob. The test picks every record kind through the data.
class VersionWriter {
 public:
  static constexpr char kModelFile[] = "model.safetensors";

  explicit VersionWriter(ObjectStore* objects) : objects_(objects) {}

  // A delta's parent is the version written last.
  Status Write(uint64_t version, const std::vector<TestTensor>& tensors, bool anchor);

  // The expected bytes of kModelFile, and the block table, of a version.
  const std::string& file(uint64_t version) const { return files_.at(version); }
  const std::vector<BlockRecord>& records(uint64_t version) const { return records_.at(version); }

 private:
  Result<Hash128> Put(const std::string& bytes);

  ObjectStore* objects_;
  std::vector<TestTensor> prev_;
  uint64_t last_ = 0;
  std::map<uint64_t, std::string> files_;
  std::map<uint64_t, std::vector<BlockRecord>> records_;
};

}  // namespace dte::test
