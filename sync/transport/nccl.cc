// The NCCL transport: grouped ncclSend/ncclRecv on a non-blocking
// communicator, cut into bounded groups (sync/transport/internal/chunk.h),
// every wait polled against the deadline and ended with ncclCommAbort.
//
// Host buffers are packed into one device staging buffer per direction, so
// each Exchange costs one host-to-device and one device-to-host copy; a
// device-resident path would hand device pointers straight to NCCL.
//
// Never executed: the development machines have no GPU (docs/transfer.md).
#include "sync/transport/transport.h"

#if defined(DTE_HAVE_NCCL)

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda.h"
#include "sync/transport/internal/chunk.h"
#include "sync/transport/socket.h"

namespace dte {
namespace {

using transport_internal::Deadline;

// The one place ncclResult_t becomes Status.
Status FromNccl(ncclResult_t r, const std::string& what, ncclComm_t comm) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::Ok();
  std::string detail = ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') detail += std::string(" (") + last + ")";
  }
  return IOError(what + ": " + detail);
}

// The one place cudaError_t becomes Status in this module.
Status FromCudaError(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::Ok();
  return IOError(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

Status FromKernels(const kernels::CudaStatus& st) {
  return st.ok() ? Status::Ok() : IOError(st.message);
}

// Waits until the communicator's pending operation (init, group end) is no
// longer in progress, or the deadline.
Status WaitNotInProgress(ncclComm_t comm, const Deadline& deadline, const std::string& what) {
  for (;;) {
    ncclResult_t async = ncclSuccess;
    RETURN_IF_ERROR(FromNccl(ncclCommGetAsyncError(comm, &async), what, comm));
    if (async != ncclInProgress) return FromNccl(async, what, comm);
    if (deadline.Expired()) return DeadlineExceeded("timed out " + what);
    std::this_thread::yield();
  }
}

// Thread-safety: one caller at a time (the Transport contract); owns the
// communicator and its stream.
class NcclTransport final : public Transport {
 public:
  NcclTransport(const NcclTransportOptions& o, ncclComm_t comm, cudaStream_t stream)
      : o_(o), comm_(comm), stream_(stream) {}
  ~NcclTransport() override {
    if (comm_ != nullptr) error_.ok() ? ncclCommDestroy(comm_) : ncclCommAbort(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return o_.base.rank; }
  int size() const override { return o_.base.size; }
  Status Exchange(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) override;

 private:
  std::string Me() const {
    return "NCCL transport rank " + std::to_string(o_.base.rank) + " of " +
           std::to_string(o_.base.size);
  }
  Status Launch(const std::vector<std::vector<transport_internal::GroupedOp>>& groups,
                const std::vector<size_t>& send_off, const std::vector<size_t>& recv_off,
                std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs,
                uint8_t* d_send, uint8_t* d_recv, const Deadline& deadline);
  Status WaitStream(const Deadline& deadline, const std::string& peers);
  Status Fail(Status st) {
    error_ = st.WithContext(Me());
    return error_;
  }

  const NcclTransportOptions o_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  Status error_;
};

Status NcclTransport::Launch(const std::vector<std::vector<transport_internal::GroupedOp>>& groups,
                             const std::vector<size_t>& send_off,
                             const std::vector<size_t>& recv_off, std::span<const SendBuffer> sends,
                             std::span<const RecvBuffer> recvs, uint8_t* d_send, uint8_t* d_recv,
                             const Deadline& deadline) {
  // Groups run in order on one stream; transport_chunk.h says why the cut
  // in global message order cannot deadlock.
  for (const auto& group : groups) {
    RETURN_IF_ERROR(FromNccl(ncclGroupStart(), "ncclGroupStart", comm_));
    for (const transport_internal::GroupedOp& op : group) {
      ncclResult_t r;
      if (op.send) {
        r = ncclSend(d_send + send_off[op.index], sends[op.index].bytes, ncclUint8, op.peer, comm_,
                     stream_);
      } else {
        r = ncclRecv(d_recv + recv_off[op.index], recvs[op.index].bytes, ncclUint8, op.peer, comm_,
                     stream_);
      }
      if (r != ncclSuccess && r != ncclInProgress) {
        (void)ncclGroupEnd();
        return FromNccl(r, op.send ? "ncclSend" : "ncclRecv", comm_);
      }
    }
    RETURN_IF_ERROR(FromNccl(ncclGroupEnd(), "ncclGroupEnd", comm_));
    RETURN_IF_ERROR(WaitNotInProgress(comm_, deadline, "launching an NCCL group"));
  }
  return Status::Ok();
}

Status NcclTransport::WaitStream(const Deadline& deadline, const std::string& peers) {
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaSuccess) return Status::Ok();
    if (q != cudaErrorNotReady) return FromCudaError(q, "NCCL exchange stream");
    ncclResult_t async = ncclSuccess;
    RETURN_IF_ERROR(FromNccl(ncclCommGetAsyncError(comm_, &async), "NCCL exchange", comm_));
    RETURN_IF_ERROR(FromNccl(async, "NCCL exchange", comm_));
    if (deadline.Expired()) {
      return DeadlineExceeded("timed out after " + std::to_string(o_.base.timeout.count()) +
                              " ms waiting for " + peers);
    }
    std::this_thread::yield();
  }
}

Status NcclTransport::Exchange(std::span<const SendBuffer> sends,
                               std::span<const RecvBuffer> recvs) {
  if (!error_.ok()) return error_;
  const Deadline deadline(o_.base.timeout);
  RETURN_IF_ERROR(transport_internal::CopyToSelf(rank(), sends, recvs, Me()));
  const auto groups =
      transport_internal::ChunkInGlobalOrder(rank(), sends, recvs, o_.max_ops_per_group);
  // Pack host buffers into staging order: message i at offset off[i].
  std::vector<size_t> send_off(sends.size()), recv_off(recvs.size());
  std::vector<uint8_t> h_send, h_recv;
  std::string peers;
  for (const auto& group : groups) {
    for (const transport_internal::GroupedOp& op : group) {
      if (op.send) {
        send_off[op.index] = h_send.size();
        const auto* p = static_cast<const uint8_t*>(sends[op.index].data);
        h_send.insert(h_send.end(), p, p + sends[op.index].bytes);
      } else {
        recv_off[op.index] = h_recv.size();
        h_recv.resize(h_recv.size() + recvs[op.index].bytes);
        peers += (peers.empty() ? "rank " : ", rank ") + std::to_string(op.peer);
      }
    }
  }
  if (groups.empty()) return Status::Ok();
  kernels::CudaBuffer d_send, d_recv;
  Status st = FromKernels(d_send.Allocate(h_send.size()));
  if (st.ok()) st = FromKernels(d_recv.Allocate(h_recv.size()));
  if (st.ok() && !h_send.empty()) {
    st = FromKernels(kernels::CudaCopyToDevice(d_send.data(), h_send.data(), h_send.size()));
  }
  if (st.ok()) {
    st = Launch(groups, send_off, recv_off, sends, recvs, static_cast<uint8_t*>(d_send.data()),
                static_cast<uint8_t*>(d_recv.data()), deadline);
  }
  if (st.ok()) st = WaitStream(deadline, peers.empty() ? "peers" : peers);
  if (st.ok() && !h_recv.empty()) {
    st = FromKernels(kernels::CudaCopyToHost(h_recv.data(), d_recv.data(), h_recv.size()));
  }
  if (!st.ok()) {
    // An unfinished group may never finish: abort so no NCCL kernel keeps
    // waiting on a dead peer (the destructor then skips ncclCommDestroy).
    return Fail(st);
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (recvs[i].bytes != 0 && recvs[i].peer != rank()) {
      std::memcpy(recvs[i].data, h_recv.data() + recv_off[i], recvs[i].bytes);
    }
  }
  return Status::Ok();
}

Result<ncclUniqueId> ExchangeUniqueId(const TransportOptions& o, const Deadline& deadline) {
  ncclUniqueId id;
  if (o.rank == 0) {
    RETURN_IF_ERROR(FromNccl(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr));
    RETURN_IF_ERROR(transport_internal::PublishFile(
        o.rendezvous_dir, "nccl-id", std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
    return id;
  }
  ASSIGN_OR_RETURN(std::string bytes, transport_internal::WaitForFile(o.rendezvous_dir, "nccl-id",
                                                                      deadline, "rank 0"));
  if (bytes.size() != sizeof(id)) {
    return Corruption("NCCL unique id in " + o.rendezvous_dir + " has " +
                      std::to_string(bytes.size()) + " bytes");
  }
  std::memcpy(&id, bytes.data(), sizeof(id));
  return id;
}

}  // namespace

Result<std::unique_ptr<Transport>> ConnectNcclTransport(const NcclTransportOptions& options) {
  const TransportOptions& o = options.base;
  const std::string me =
      "NCCL transport rank " + std::to_string(o.rank) + " of " + std::to_string(o.size);
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size || o.rendezvous_dir.empty()) {
    return InvalidArgument(me + ": not a valid setup (rank, size, rendezvous dir)");
  }
  const Deadline deadline(o.timeout);
  RETURN_IF_ERROR(FromCudaError(cudaSetDevice(options.device), "cudaSetDevice").WithContext(me));
  Result<ncclUniqueId> id = ExchangeUniqueId(o, deadline);
  if (!id.ok()) return id.status().WithContext(me);
  cudaStream_t stream = nullptr;
  RETURN_IF_ERROR(
      FromCudaError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate")
          .WithContext(me));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so every wait can be bounded and aborted
  ncclComm_t comm = nullptr;
  Status st = FromNccl(ncclCommInitRankConfig(&comm, o.size, *id, o.rank, &config),
                       "ncclCommInitRankConfig", nullptr);
  if (st.ok()) st = WaitNotInProgress(comm, deadline, "waiting for all ranks to join NCCL");
  if (!st.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    return st.WithContext(me);
  }
  return std::unique_ptr<Transport>(new NcclTransport(options, comm, stream));
}

}  // namespace dte

#else  // !defined(DTE_HAVE_NCCL)

namespace dte {

Result<std::unique_ptr<Transport>> ConnectNcclTransport(const NcclTransportOptions& options) {
  return Unimplemented("NCCL transport rank " + std::to_string(options.base.rank) +
                       ": dte was built without NCCL (configure with CUDA and NCCL present)");
}

}  // namespace dte

#endif  // defined(DTE_HAVE_NCCL)
