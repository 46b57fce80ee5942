// A version's changed elements, read from the store: the one reader of
// what a version changed that the push (sync/push), the stats' diff
// (store/ops/stats.h) and the live apply (sync/live/live.h) share. The push reads
// a version against its parent a tensor at a time (VersionChangesReader);
// the diff and the live apply, which span any two versions (the live apply
// composing the records along the chain between them), use its parts a
// block at a time (DecodeRecordEntries, DifferingElements).
//
// Per block, a version's record says what changed against its parent: a
// kSame record nothing, a kSparse record lists its entries (a wrapping
// difference from the parent's element, or a whole value where it sets
// one), and a block stored dense is compared with the parent's block.
//
// Thread-safety: the functions are stateless; a VersionChangesReader is
// used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/delta_codec.h"
#include "store/manifest.h"
#include "store/materialize.h"

namespace dte {

class Store;
struct Version;

// The changed elements of one tensor at a version: increasing flat indices
// and their new values (DTypeWidth bytes each). Where the parent's elements
// are known (old_values, same layout as values; known[k] != 0 for entry k,
// or `known` empty: all of them), values - old_values is the change, which
// a push sends as a difference; otherwise values is the whole value.
// old_exact says more: the known old values are the parent's elements
// themselves (a publisher that saw them), not only a base the difference
// is taken over (VersionChangesReader's 0), so a push may use them in
// place of reading the parent (docs/push.md "FP8 receivers").
struct TensorChanges {
  std::string name;
  std::vector<uint64_t> indices;
  std::vector<uint8_t> values;
  std::vector<uint8_t> old_values;
  std::vector<uint8_t> known;
  bool old_exact = false;
};

// One block's entries as its sparse record holds them (DecodeSparseEntries):
// block-relative increasing indices; per entry `width` bytes in vals, the
// wrapping difference from the parent's element, or its whole value where
// whole[k] != 0 (whole is empty when no entry is one).
struct BlockEntries {
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals;
  std::vector<uint8_t> whole;
};

// Decodes the kSparse record `rec` of a block of `len` bytes from the bytes
// of the blob it points into, after checking the record lies inside them.
// `what` names the version, file, tensor and block in errors.
Status DecodeRecordEntries(std::string_view blob, const BlockRecord& rec, size_t len, int width,
                           BlockEntries* out, CodecScratch* scratch, const std::string& what);

// Appends to *idx the indices of the elements (`width` bytes each) that
// differ between blocks a and b of `len` bytes, in increasing order.
void DifferingElements(const uint8_t* a, const uint8_t* b, size_t len, int width,
                       std::vector<uint32_t>* idx);

// Reads the changes of version v against its parent, one tensor at a time:
// every sparse record decoded (its differences as values over old values
// of 0, its whole values as values not known), and blocks stored dense
// compared with the parent's (new and old values). Memory: one tensor's
// changed elements, and two blocks.
class VersionChangesReader {
 public:
  // v must have a parent (InvalidArgument otherwise).
  static Result<std::unique_ptr<VersionChangesReader>> Open(Store& store,
                                                            std::shared_ptr<const Version> v);

  const Version& version() const { return *v_; }
  // False when tensor `name` has no changed block (or is not in v).
  bool MayChange(const std::string& name) const;
  // Its changes (none when it is not in v), valid until the next Read.
  Result<const TensorChanges*> Read(const std::string& name);

 private:
  VersionChangesReader(Store& store, std::shared_ptr<const Version> v,
                       std::shared_ptr<const Version> parent);
  Status ReadSparse(const BlockRecord& rec, uint64_t first, size_t len, int width,
                    const std::string& what);
  Status CompareDense(const FileEntry& f, const TensorEntry& t, uint32_t b, uint64_t first,
                      size_t len, int width);

  std::shared_ptr<const Version> v_, parent_;
  Materializer reader_;
  TensorChanges c_;
  std::string payload_;
  BlockEntries entries_;
  std::vector<uint32_t> differ_;
  std::vector<uint8_t> old_block_, new_block_;
};

// The changes of version v against its parent, every changed tensor in
// manifest order (those without changes left out). Memory: the version's
// changed elements.
Result<std::vector<TensorChanges>> ReadVersionChanges(Store& store,
                                                      const std::shared_ptr<const Version>& v);

}  // namespace dte
