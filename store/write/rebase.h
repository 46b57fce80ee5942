// Rebasing a version that gc keeps while removing its parent: the version
// is written again under its next manifest revision, with the same content
// hashes per block and tensor, so that its chain stays inside the kept set.
//
// Thread-safety: stateless; the new revision is created exclusively, so two
// rebases of one version cannot both succeed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "store/base/status.h"
#include "store/manifest.h"
#include "store/store.h"
#include "store/write/anchor_policy.h"

namespace dte::internal {

// Writes v again under its next manifest revision:
//  - with `onto` (an older version of v's tensor layout, `onto_distance`
//    from its nearest self-contained version), as a delta against it: each
//    block's record chosen by the commit's encoder (EncodeBlock) from the
//    two versions' bytes, the payloads in one new blob; and, when `policy`
//    says a commit after `onto` would be a policy anchor, with a full table
//    too, so that chains of rebased deltas (a thinned history) stay as
//    short to read as a commit's;
//  - without, as an anchor: from v's full table when v has one (no data is
//    written: the table's records are dense already), else from v's bytes,
//    streamed into one new blob.
// The old revision stays until gc deletes it. Returns the new revision's
// distance from its nearest self-contained version (its since_full).
// `progress` gets (bytes done, bytes total) of v's data.
Result<AnchorDistance> RebaseVersion(Store& store, const std::shared_ptr<const Version>& v,
                                     const std::shared_ptr<const Version>& onto,
                                     const AnchorDistance& onto_distance,
                                     const AnchorPolicy& policy,
                                     const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace dte::internal
