// Step 4 of a live apply (sync/live/live.h): every registered receiver's
// buffers written (internal/live_writes.h), the ranks of servers first; a
// receiver of no server whose shared memory goes away under the mapping
// (SIGBUS) is dropped, not the daemon, and a rank of a server that fails
// fails the apply after the ranks written before it are written back
// (docs/live.md, "Servers").
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sync/live/internal/live_changes.h"
#include "sync/live/internal/live_fp8.h"
#include "sync/live/internal/live_writes.h"

namespace dte::live {
namespace {

using internal::BufferRef;
using internal::Target;
using internal::UndoLog;

// A rank of a server written in this apply, kept until the apply is done.
struct Written {
  uint64_t owner;
  std::string what;  // its layout and server, for the log
  std::vector<Target> targets;
  UndoLog log;
  std::unique_ptr<Live::Fp8Undo> fp8;  // its FP8 buffers' old bytes and scales
  std::function<bool()> fp8_back;      // writes them back; false if it cannot
};

// Writing rank `what` of a server failed: the ranks in `written` are
// written back to the live version. Returns the apply's error; *drop gets
// the owners to forget: the failed one, and those that could not be
// written back (a CUDA IPC buffer, or memory gone meanwhile).
Status ServerFailure(uint64_t owner, const std::string& what, std::vector<Written>* written,
                     std::vector<uint64_t>* drop) {
  drop->push_back(owner);
  std::string lost;
  size_t back = 0;
  for (auto w = written->rbegin(); w != written->rend(); ++w) {
    if (!w->log.exact || !w->fp8->exact || !internal::WriteBack(w->targets, &w->log) ||
        !w->fp8_back()) {
      drop->push_back(w->owner);
      lost += (lost.empty() ? "" : ", ") + w->what;
      continue;
    }
    back++;
  }
  std::string message = "writing the buffers of " + what +
                        " failed (its memory went away under the mapping, or a device call "
                        "failed): it was dropped, and the " +
                        std::to_string(back) + " server ranks written before it were written back";
  if (!lost.empty()) {
    message +=
        "; the ranks written before it that could not be written back (CUDA IPC "
        "buffers, or memory gone) were dropped: " +
        lost;
  }
  return Status(Code::kAborted, message);
}

// "rank R of server S (layout)", or the layout alone for a receiver of no
// server (R: a Live::Receiver).
template <typename R>
std::string ReceiverText(const R& rc) {
  const std::string layout = LayoutText(rc.layout, rc.rank);
  if (rc.server.empty()) return layout;
  return "rank " + std::to_string(rc.rank) + " of server \"" + rc.server + "\" (" + layout + ")";
}

// The owners of `receivers` in the order the scatter writes them: the
// ranks of servers first, by server and rank (a failure among them writes
// back those before it), then the receivers of no server (a failure there
// drops only that receiver).
template <typename M>
std::vector<uint64_t> ScatterOrder(const M& receivers) {
  std::vector<std::tuple<bool, std::string, int, uint64_t>> keyed;
  for (const auto& [owner, rc] : receivers) {
    keyed.emplace_back(rc.server.empty(), rc.server, rc.rank, owner);
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<uint64_t> order;
  for (const auto& k : keyed) order.push_back(std::get<3>(k));
  return order;
}

// The targets of receiver rc (a Live::Receiver) over its layout's plan (a
// Live::Plan); *touched: which of its receiver tensors they write.
template <typename R, typename P>
std::vector<Target> ReceiverTargets(const R& rc, const P& plan,
                                    const std::vector<Live::Changes>& changes,
                                    const std::vector<uint32_t>& first_canonical,
                                    std::vector<uint8_t>* touched) {
  std::vector<BufferRef> by_tensor(plan.plan.receiver_tensors[static_cast<size_t>(rc.rank)].size());
  for (const auto& b : rc.buffers) {
    if (b->role != decltype(b->role)::kElements) continue;  // FP8 buffers: WriteFp8
    by_tensor[b->receiver_tensor] = {true, b->data, b->elements, b->kind == DTE_LIVE_CUDA_IPC};
  }
  std::vector<Target> targets =
      TargetsOf(changes, first_canonical, plan.ops_by_canonical, plan.plan, rc.rank, by_tensor);
  touched->assign(by_tensor.size(), 0);
  for (const Target& tg : targets) (*touched)[tg.op->receiver_tensor] = 1;
  return targets;
}

}  // namespace

Status Live::Scatter(const Version& v, const std::vector<Changes>& changes,
                     const std::vector<Fp8Sets>& fp8, dte_live_counts* counts,
                     const std::vector<Server>* expect) {
  internal::InstallSigbusHandler();
  MutexLock lock(&receivers_mu_);
  if (Status s = expect ? ServersAre(*expect) : ServersComplete(); !s.ok()) {
    return s.WithContext("apply of " + VersionName(v.manifest.version) +
                         " refused, live state unchanged");
  }
  // Canonical index of each (file, tensor): the order PlanFor lists them in.
  std::vector<uint32_t> first_canonical;
  uint32_t n = 0;
  for (const FileEntry& f : v.manifest.files) {
    first_canonical.push_back(n);
    n += static_cast<uint32_t>(f.tensors.size());
  }
  std::vector<Written> written;  // ranks of servers, kept to write back
  std::vector<uint64_t> failed;
  for (uint64_t owner : ScatterOrder(receivers_)) {
    Receiver& rc = receivers_.at(owner);
    const bool server = !rc.server.empty();
    const std::string what = ReceiverText(rc);
    auto plan = PlanFor(v, rc.layout);
    std::vector<Target> targets;
    std::vector<uint8_t> touched;
    if (plan.ok()) targets = ReceiverTargets(rc, **plan, changes, first_canonical, &touched);
    UndoLog log;
    auto fp8_log = std::make_unique<Fp8Undo>();
    uint64_t bytes = 0, fp8_buffers = 0;
    const bool ok = plan.ok() && internal::WriteTargets(targets, server ? &log : nullptr, &bytes) &&
                    WriteFp8(rc, fp8, &bytes, &fp8_buffers, server ? fp8_log.get() : nullptr);
    if (!ok && server) {
      Status s = ServerFailure(owner, what, &written, &failed);
      mount_->Log("dtefs: live apply: " + s.message());
      for (uint64_t o : failed) receivers_.erase(o);
      return s.WithContext("live apply of " + VersionName(v.manifest.version) +
                           " failed, live state unchanged");
    }
    if (!ok) {
      // Its memory went away under the mapping (or a device call failed):
      // the receiver is dropped and the apply goes on for the others.
      mount_->Log("dtefs: live apply: dropped receiver (" + what + "): writing its buffers failed");
      failed.push_back(owner);
      continue;
    }
    counts->bytes += bytes;
    if (!targets.empty() || fp8_buffers > 0) counts->receivers++;
    if (server) {
      Fp8Undo* undo = fp8_log.get();
      auto back = [&rc, &fp8, undo] {
        uint64_t ignored = 0, buffers = 0;
        return WriteFp8(rc, fp8, &ignored, &buffers, undo, true);
      };
      written.push_back(
          {owner, what, std::move(targets), std::move(log), std::move(fp8_log), back});
    }
    counts->buffers +=
        static_cast<uint64_t>(std::count(touched.begin(), touched.end(), 1)) + fp8_buffers;
  }
  for (uint64_t owner : failed) receivers_.erase(owner);
  return Status::Ok();
}

}  // namespace dte::live
