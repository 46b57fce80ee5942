"""The exchanges of a Publisher of several ranks run from Python, through
the C ABI's callback transport (dte_transport_callback), over a
torch.distributed process group. (A world of one needs no exchange.)"""

from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Tuple

from dte import _lib
from dte._handle import _torch

_Messages = Any  # a ctypes POINTER(_lib.Message)


class _Exchange:
    """One exchange function for the C side: run() moves the messages; a
    failure is written to the C error buffer. Self-messages are copied
    (sends and receives to this rank pair up in order)."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.fn = _lib.EXCHANGE_FN(self._call)  # kept alive with the publisher

    def run(self, sends: List[Any], recvs: List[Any]) -> None:
        """Moves the non-empty messages of other ranks (raises on failure)."""
        if sends or recvs:
            raise RuntimeError("rank %d of %d has no peers to exchange with"
                               % (self.rank, self.size))

    def _call(self, ctx: Any, sends: _Messages, n_sends: int, recvs: _Messages, n_recvs: int,
              error: Any, error_size: int) -> int:
        try:
            mine: Tuple[List[Any], List[Any]] = ([], [])
            theirs: Tuple[List[Any], List[Any]] = ([], [])
            for i, (msgs, n) in enumerate(((sends, n_sends), (recvs, n_recvs))):
                for k in range(n):
                    m = msgs[k]
                    if m.bytes:
                        (mine if m.peer == self.rank else theirs)[i].append(m)
            for s, r in zip(*mine):
                ctypes.memmove(r.data, s.data, s.bytes)
            self.run(*theirs)
            return 0
        except Exception as e:  # noqa: BLE001 - reported through the C ABI
            msg = ("%s" % e).encode("utf-8", "replace")[:max(error_size - 1, 0)]
            ctypes.memmove(error, msg + b"\0", len(msg) + 1)
            return 1


class _TorchExchange(_Exchange):
    """Runs the exchanges over a torch.distributed process group: isend/irecv
    of the C buffers (batched, except on gloo). On an NCCL group, which
    moves only device memory, each message is staged through a buffer on the
    rank's current CUDA device."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist
        super().__init__()
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.device: Optional[Any] = None
        if self.backend == "nccl":
            torch = _torch()
            assert torch is not None
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _peer(self, r: int) -> int:
        if self.group is None:
            return r
        return int(self.dist.distributed_c10d._get_global_rank(self.group, r))

    def run(self, sends: List[Any], recvs: List[Any]) -> None:
        torch = _torch()
        assert torch is not None
        dist = self.dist
        ops, peers, staged = [], [], []
        for msgs, op in ((sends, dist.isend), (recvs, dist.irecv)):
            for m in msgs:
                buf = (ctypes.c_uint8 * m.bytes).from_address(m.data)
                host = torch.frombuffer(buf, dtype=torch.uint8)
                if self.device is None:
                    wire = host
                elif op is dist.isend:
                    wire = host.to(self.device)
                else:
                    wire = torch.empty(m.bytes, dtype=torch.uint8, device=self.device)
                    staged.append((host, wire))
                ops.append(dist.P2POp(op, wire, self._peer(m.peer), self.group))
                peers.append(m.peer)
        failed = self._post_and_wait(ops, peers)
        if failed:
            raise RuntimeError("; ".join("rank %d: %s" % (p, e) for p, e in failed))
        for host, wire in staged:
            host.copy_(wire)  # device to host; synchronizes with the receive

    def _post_and_wait(self, ops: List[Any], peers: List[int]) -> List[Tuple[int, Exception]]:
        """Posts the operations and waits for every one; returns the failed
        peers (once each) with their errors."""
        failed: List[Tuple[int, Exception]] = []

        def fail(peer: int, e: Exception) -> None:
            if peer not in (p for p, _ in failed):
                failed.append((peer, e))

        if not ops:
            return failed
        # gloo posts each message on its own anyway, so post them one by one
        # there: a post that fails (a peer's connection closed) is then
        # charged to its peer. NCCL needs the batch.
        posted = []
        if self.backend == "gloo":
            for o, peer in zip(ops, peers):
                try:
                    posted.append((o.op(o.tensor, o.peer, o.group, o.tag), peer))
                except Exception as e:  # noqa: BLE001 - reported through the C ABI
                    fail(peer, e)
        else:
            posted = list(zip(self.dist.batch_isend_irecv(ops), peers))
        # Wait for every message, so that the error names each peer that
        # failed (the one that died, not only a survivor that gave up on it
        # first).
        for req, peer in posted:
            try:
                req.wait()
            except Exception as e:  # noqa: BLE001 - reported through the C ABI
                fail(peer, e)
        return failed
