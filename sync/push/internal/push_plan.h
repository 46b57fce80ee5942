// What both ends of a push (sync/push/push_server.h) derive from a version and a
// receiver's layout: the transfer plan, and how the receiver's own tensor
// list lines up with the plan's receiver tensors.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/materialize.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::push_internal {

// For each of the plan's receiver tensors of `rank`, the index of the tensor
// of the same name in `have`, which must hold exactly those tensors with
// the same dtypes and shapes; InvalidArgument naming the first tensor that
// is missing, extra or different.
Result<std::vector<uint32_t>> MatchReceiverTensors(const TransferPlan& plan, int rank,
                                                   const std::vector<PlanTensor>& have,
                                                   const std::string& what);

// The same against any list of tensors: for each of `want`, the index of
// the tensor of the same name in `have`.
Result<std::vector<uint32_t>> MatchTensors(const std::vector<PlanTensor>& want,
                                           const std::vector<PlanTensor>& have,
                                           const std::string& what);

// Where tensor `name` of version v lies: its file and the offset of its
// first byte there, after checking it is in v and holds `size` bytes
// (Internal naming it otherwise); `what` prefixes errors.
struct TensorBytes {
  const FileEntry* file = nullptr;
  uint64_t offset = 0;
};
Result<TensorBytes> LocateTensor(const Version& v, const std::string& name, uint64_t size,
                                 const std::string& what);

// Tensor `name` of version v, whole, into dst, which has room for `size`
// bytes: the tensor's size (Internal otherwise); `what` prefixes errors.
Status ReadTensorInto(Materializer& reader, const std::shared_ptr<const Version>& v,
                      const std::string& name, void* dst, uint64_t size, const std::string& what);

// Copies the part of canonical tensor `op.canonical` (all of it at `src`,
// row-major) that op covers into the receiver tensor at `dst`.
void CopyOpBox(const TransferPlan& plan, const TransferOp& op, const void* src, void* dst);

}  // namespace dte::push_internal
