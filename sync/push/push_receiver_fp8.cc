// An FP8 receiver's part of the push receiver
// (sync/push/internal/push_receiver_impl.h): what each entry of a push may
// write into which tensor, and the catch-up that quantizes a version from
// the store into the receiver's FP8 tensors.
#include <map>

#include "kernels/fp8.h"
#include "store/store.h"
#include "sync/push/internal/push_catchup.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_receiver_impl.h"

namespace dte {

using push_internal::EntryKind;

Status PushReceiver::Impl::CheckEntryKind(const push_internal::CountsMsg& c, size_t k,
                                          const std::string& what) const {
  const EntryKind kind = c.kind.empty() ? EntryKind::kElements : c.kind[k];
  const EntryKind holds = kinds_[c.tensor[k]];
  if (kind == holds) return Status::Ok();
  return Corruption(what + ": op " + std::to_string(c.op[k]) + " writes " +
                    push_internal::EntryKindName(kind) + " into tensor " +
                    options_.tensors[c.tensor[k]].name + " (" +
                    DTypeName(options_.tensors[c.tensor[k]].dtype) + "), which holds " +
                    push_internal::EntryKindName(holds));
}

namespace {

// A tensor's bytes on the host: its own memory, or a copy of its device
// memory written back by Flush.
class HostView {
 public:
  HostView(const PushTensor& t, uint64_t bytes) : t_(t), bytes_(bytes) {}
  Result<uint8_t*> Open(const std::string& what) {
    if (t_.device < 0) return static_cast<uint8_t*>(t_.data);
    mirror_.resize(bytes_);
    RETURN_IF_ERROR(Cuda(kernels::CudaSetDevice(t_.device), what));
    RETURN_IF_ERROR(Cuda(kernels::CudaCopyToHost(mirror_.data(), t_.data, bytes_), what));
    return mirror_.data();
  }
  Status Flush(const std::string& what) {
    if (t_.device < 0) return Status::Ok();
    return Cuda(kernels::CudaCopyToDevice(t_.data, mirror_.data(), bytes_), what);
  }

 private:
  static Status Cuda(const kernels::CudaStatus& s, const std::string& what) {
    return s.ok() ? Status::Ok() : IOError(what + ": " + s.message);
  }
  const PushTensor& t_;
  uint64_t bytes_;
  std::vector<uint8_t> mirror_;
};

}  // namespace

// One receiver tensor (and its scale tensor) at a time, its ops' boxes read
// from the store and quantized a band of rows at a time: memory is one band
// in BF16 and quantized (push_catchup.h), and the receiver tensor where it
// lives on a device.
Status PushReceiver::Impl::FillFp8FromStore(Store& store, const std::shared_ptr<const Version>& v,
                                            const TransferPlan& plan, const Fp8ReceiverPlan& fp8,
                                            const std::vector<uint32_t>& own,
                                            const std::string& what) {
  std::map<uint32_t, const Fp8ReceiverOp*> fp8_op;
  for (const Fp8ReceiverOp& op : fp8.ops) fp8_op[op.op] = &op;
  Materializer reader(&store);
  push_internal::BandCopier copier(reader, v, plan, options_.catch_up_band_bytes, what);
  const uint32_t n = static_cast<uint32_t>(plan.receiver_tensors[options_.rank].size());
  for (uint32_t rt = 0; rt < n; ++rt) {
    const bool is_fp8 = fp8.tensors[rt].fp8;
    const uint32_t t = own[rt];
    HostView dst(options_.tensors[t], numel_[t] * DTypeWidth(options_.tensors[t].dtype));
    ASSIGN_OR_RETURN(uint8_t * d, dst.Open(what));
    const uint32_t st = is_fp8 ? own[n + rt] : push_internal::kNoTensor;
    std::optional<HostView> scales;
    uint8_t* s = nullptr;
    if (is_fp8) {
      scales.emplace(options_.tensors[st], numel_[st] * 4);
      ASSIGN_OR_RETURN(s, scales->Open(what));
    }
    for (size_t k = 0; k < plan.ops.size(); ++k) {
      const TransferOp& op = plan.ops[k];
      if (op.receiver != options_.rank || op.receiver_tensor != rt) continue;
      if (!is_fp8) {
        RETURN_IF_ERROR(copier.CopyOp(op, d));
        continue;
      }
      auto it = fp8_op.find(static_cast<uint32_t>(k));
      if (it == fp8_op.end()) return Internal(what + ": FP8 tensor without its FP8 op");
      RETURN_IF_ERROR(copier.CopyFp8Op(*it->second, fp8.canonical_layout[op.canonical], d, s));
    }
    RETURN_IF_ERROR(dst.Flush(what));
    if (scales) RETURN_IF_ERROR(scales->Flush(what));
  }
  return Status::Ok();
}

}  // namespace dte
