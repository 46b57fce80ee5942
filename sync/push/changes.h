// A version's changed elements as a push sends them (sync/push/push_server.h):
// per canonical tensor, the changed flat indices, their new values and,
// where known, the parent's values (TensorChanges, store/changes.h); read
// from memory or back from the store. Where the sender knows the parent's
// elements a push sends the difference, which the delta codec stores in
// about a byte; otherwise the whole value.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/changes.h"  // TensorChanges

namespace dte {

class Store;
struct Version;

// A version's changes, read one canonical tensor at a time: a push reads
// them in the version's tensor order, twice (the counts of round 1, then the
// data of round 2), so the pusher holds one tensor's changes at a time.
class ChangesSource {
 public:
  virtual ~ChangesSource() = default;
  // False when tensor `name` has no changes (it is then not read).
  virtual bool MayChange(const std::string& name) const = 0;
  // Its changes (empty when none), valid until the next call, or for the
  // source's life when Stable().
  virtual Result<const TensorChanges*> Read(const std::string& name) = 0;
  // True when Read's results stay valid (changes held in memory anyway):
  // they are then used in place, neither copied nor read twice.
  virtual bool Stable() const { return false; }
};

// The changes of version v against its parent, from the store, one tensor
// at a time (what ChangesFromStore reads): what a distributed publisher's
// rank 0 pushes. Memory: one tensor's changed elements.
Result<std::unique_ptr<ChangesSource>> StoreChanges(Store& store,
                                                    const std::shared_ptr<const Version>& v);

// The changes of version v against its parent, read back from the store
// (ReadVersionChanges, store/changes.h): every sparse record decoded (its
// differences and whole values, exactly what a push sends), and blocks
// stored dense compared with the parent's. What a publisher that did not
// see every change itself (a distributed publisher's rank 0) pushes.
// Memory: the version's changed elements.
Result<std::vector<TensorChanges>> ChangesFromStore(Store& store,
                                                    const std::shared_ptr<const Version>& v);

}  // namespace dte
