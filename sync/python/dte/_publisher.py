"""The Publisher: commits versions of a dte store from a training loop,
over libdte's C ABI (sync/capi/c_api.h)."""

from __future__ import annotations

import ctypes
import os
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple,
                    Union, cast)

from dte import _lib, _torch_adamw
from dte._arrays import (ConverterSpec, ParamState, _as_array, _fill, _is_dtensor, _mcore_key,
                         _mcore_spec, _range_of, _step_value)
from dte._errors import IOFailure, InvalidArgument
from dte._exchange import _Exchange, _TorchExchange
from dte._handle import _check, _Handle, _secret_arg, _text, _torch
from dte._lib import lib
from dte._results import DistStats, PublishResult, PushReport

if TYPE_CHECKING:
    from dte._push import PushGroup

# params of publish_adamw: keyed by HF tensor name, or (mcore_name, tp_rank,
# ep_rank) with a Megatron-Core converter; a list of pieces per key where
# the rank holds parts of a tensor.
Params = Mapping[Any, Union[ParamState, Sequence[ParamState]]]


class Publisher(_Handle):
    """Commits versions of a dte store (a local directory or s3://bucket/prefix).

    Not thread-safe: call it from one thread. See docs/engine.md."""

    _close_fn = "dte_publisher_close"

    def __init__(self, store: str | os.PathLike[str], *, converter: ConverterSpec = "hf",
                 cache_dir: Optional[str] = None, anchor_budget: float = 1.0,
                 anchor_every: int = 0, rank: Optional[int] = None,
                 world_size: Optional[int] = None, group: Any = None,
                 rendezvous: Optional[str] = None, job: Optional[str] = None,
                 timeout: float = 60.0, push: Optional[PushGroup] = None,
                 join_budget: float = 0.125, secret: str | bytes | None = None) -> None:
        """anchor_budget, anchor_every, join_budget: the anchor policy and
        join tables, as dtectl commit's --anchor-budget, --anchor-every and
        --join-budget (docs/cli.md).

        converter: "hf" (params are keyed by Hugging Face tensor names) or a
        Megatron-Core spec, a dict {"config": path to the model's HF
        config.json or the config as a dict, "tp": 1, "ep": 1, and optionally
        "etp", "vocab_divisible_by" (128), "norms" ("te" or "local"),
        "experts" ("sequential" or "grouped")}; then params are keyed by
        (mcore_name, tp_rank, ep_rank).

        Ranks: by default the publisher is a world of one, this process.
        Several ranks (every rank of a sharded trainer publishes the state
        it holds; docs/engine.md, "Distributed publish"): give world_size
        (and rank), or a torch.distributed process group. The
        ranks exchange over `group` (a torch.distributed ProcessGroup; the
        default group when torch.distributed is initialized and no
        rendezvous is given), or over dte's TCP transport when `rendezvous`
        names a fresh directory every rank sees (connected here, by every
        rank together), or through the store alone when `job` names the
        job (ranks on hosts that share nothing but the store: messages are
        objects under exchange/JOB/ of the store; a restarted job takes a new
        name). timeout (seconds) bounds the TCP and store transports' waits;
        a process group's own timeout bounds its waits. world_size=1 (rank 0)
        needs none of them: with no process group initialized it is the
        default world of one, whose one rank exchanges nothing.

        secret: the job secret (str or bytes) the TCP transport's ranks, and
        a PushGroup given none of its own, prove on every connection; None:
        DTE_JOB_SECRET, DTE_JOB_SECRET_FILE, else, for the TCP transport,
        the rendezvous directory's "secret" file, which rank 0 creates (mode
        0600) when there is none (docs/engine.md, "Security"; a push group's
        receivers are other processes: give them and it the secret).

        push: a dte.PushGroup; after each publish, the version's changed
        elements go to its receivers (docs/push.md). With several ranks, give
        one on every rank (each pushes the tensors it owns in each
        version, from the changes it kept while encoding them; receivers
        connect to rank 0's address and are told the others) or on rank 0
        only (which pushes every tensor, read back from the store)."""
        self._h = None
        self._transport: Optional[ctypes.c_void_p] = None  # dte's TCP transport (rendezvous=)
        self._broken = False  # the TCP transport failed: this publisher cannot publish again
        self._push: Optional[PushGroup] = None
        self._exchange: Optional[_Exchange] = None
        self._job: Optional[str] = job
        self._tries: Dict[int, int] = {}  # failed attempts per step (store transport)
        self._timeout_ms = int(timeout * 1000)
        self._mcore = not (isinstance(converter, str) and converter == "hf")
        self.rank, self.world_size = self._choose_exchange(rank, world_size, group, rendezvous)
        self._open(store, os.fsencode(cache_dir) if cache_dir else None, converter)
        _check(lib.dte_publisher_set_group(self._h, self.rank, self.world_size, None))
        _check(lib.dte_publisher_set_anchor_policy(self._h, float(anchor_budget),
                                                   int(anchor_every)))
        _check(lib.dte_publisher_set_join_budget(self._h, float(join_budget)))
        self._join(push, rendezvous, timeout, _secret_arg(secret))

    def _open(self, store: str | os.PathLike[str], cache: Optional[bytes],
              converter: ConverterSpec) -> None:
        handle = ctypes.c_void_p()
        if self._mcore:
            text, source, layout = _mcore_spec(converter)
            _check(lib.dte_publisher_open_mcore(os.fsencode(store), cache, text, source,
                                                ctypes.byref(layout), ctypes.byref(handle)))
        else:
            _check(lib.dte_publisher_open(os.fsencode(store), cache, b"hf", ctypes.byref(handle)))
        self._h = handle

    def _choose_exchange(self, rank: Optional[int], world_size: Optional[int], group: Any,
                         rendezvous: Optional[str]) -> Tuple[int, int]:
        """(rank, world_size), once it is known how the ranks exchange: the
        store (job=), dte's TCP transport (rendezvous=), a torch.distributed
        group, or nothing at all for a world of one."""
        if rendezvous is not None and self._job is not None:
            raise InvalidArgument("give rendezvous (TCP transport) or job (store transport), "
                                  "not both")
        if self._job is not None or rendezvous is not None:
            if rank is None or world_size is None:
                raise InvalidArgument("%s needs rank and world_size"
                                      % ("the store transport" if self._job is not None
                                         else "dte's TCP transport"))
            return int(rank), int(world_size)
        if group is None and (world_size is None or (world_size == 1 and rank in (None, 0)
                                                     and not _dist_initialized())):
            return 0, 1  # a world of one: no exchange
        import torch.distributed as dist
        if group is None and not dist.is_initialized():
            raise InvalidArgument("publishing from %s ranks needs a torch.distributed process "
                                  "group (group=, or an initialized default group), a "
                                  "rendezvous directory for dte's TCP transport, or job= for "
                                  "the store transport" % world_size)
        ex = _TorchExchange(group)
        rank = ex.rank if rank is None else rank
        world_size = ex.size if world_size is None else world_size
        if (rank, world_size) != (ex.rank, ex.size):
            raise InvalidArgument("rank %d of %d does not match the process group's rank %d of %d"
                                  % (rank, world_size, ex.rank, ex.size))
        if ex.size > 1:
            self._exchange = ex  # a group of one needs no exchange
        return int(rank), int(world_size)

    def _join(self, push: Optional[PushGroup], rendezvous: Optional[str], timeout: float,
              secret: Optional[bytes]) -> None:
        """Starts this rank's part of the push, and connects the TCP transport."""
        if push is not None:
            # As part `rank` of every rank's push; the ranks find out whether
            # every rank or rank 0 alone pushes (below, or at each publish),
            # and set it.
            push._start(self.rank, self.world_size, secret=secret)
            _check(lib.dte_publisher_set_push(self._h, push._h))
            self._push = push  # the server must outlive this publisher's use of it
        if rendezvous is not None:
            t = ctypes.c_void_p()
            _check(lib.dte_transport_tcp(self.rank, self.world_size, os.fsencode(rendezvous),
                                         int(timeout * 1000), secret, ctypes.byref(t)))
            self._transport = t
            _check(lib.dte_publisher_set_group(self._h, self.rank, self.world_size, t))
            # Connected by every rank together: the push servers' addresses
            # go round now, so receivers can join before the first publish.
            _check(lib.dte_publisher_share_push(self._h))

    def close(self) -> None:
        if self._push is not None and self._h:
            lib.dte_publisher_set_push(self._h, None)
            self._push = None
        if self._transport:
            if self._h:
                lib.dte_publisher_set_group(self._h, self.rank, self.world_size, None)
            lib.dte_transport_close(self._transport)
            self._transport = None
        super().close()

    def import_checkpoint(self, directory: str | os.PathLike[str]) -> int:
        """Commits a Hugging Face checkpoint directory; returns its version.
        A world of one only: the ranks of a larger one start from a version
        imported before they publish (dte.Publisher(store).import_checkpoint
        or `dtectl import`, from one process)."""
        version = ctypes.c_uint64()
        _check(lib.dte_publisher_import(self._h, os.fsencode(directory), ctypes.byref(version)))
        return version.value

    def publish_adamw(self, step: int, params: Params, lr: float,
                      betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                      weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                      order: str = "torch_cpu") -> PublishResult:
        """Publishes the BF16 weights after AdamW step `step`.

        params maps tensor names to (master_fp32, exp_avg, exp_avg_sq) or to a
        dict with keys param, exp_avg, exp_avg_sq and optionally step (the
        optimizer state's), lr and weight_decay (the tensor's param group's).
        With a Megatron-Core converter, keys are (mcore_name, tp_rank,
        ep_rank) of every shard of the converter units published (a bare name
        means ranks 0, 0), and the values are the shards' state; the version
        is the one publishing the converted HF state would make.
        Arrays are torch CPU or CUDA tensors or numpy arrays; the changes of
        CUDA tensors are found on their GPU (docs/engine.md, "State on the
        GPU").

        A value may also be what the rank holds of the tensor, in a world of
        any size: a dict may add rows=(begin, end) (a dim-0 shard) or
        flat=(begin, end) (a range of the flattened tensor), a value may be
        a list of such pieces, and torch DTensors (FSDP2, HSDP) with Shard(0)
        and Replicate placements give their rows themselves. With several
        ranks, a whole tensor is this rank's copy (a replica: published by
        the lowest rank holding it)."""
        if order not in _lib.ORDERS:
            raise InvalidArgument("unknown order %r (one of %s)" % (order, ", ".join(_lib.ORDERS)))
        h = _lib.AdamWStep(float(lr), float(betas[0]), float(betas[1]), float(eps),
                           float(weight_decay), int(step), int(bool(amsgrad)),
                           int(bool(maximize)), _lib.ORDERS[order])
        if self._push is not None and not self._push._h:
            raise InvalidArgument("the PushGroup given as push= was closed; close the Publisher "
                                  "first, or open it without push=")
        if all(_whole(v) for v in params.values()):
            return self._publish(h.step, lambda out: self._publish_whole(h, params, out))
        return self._publish(h.step, lambda out: self._publish_ranges(h, params, out))

    def publish_weights(self, weights: Mapping[str, Any], *,
                        step: Optional[int] = None) -> PublishResult:
        """Publishes new BF16 weights from any optimizer (SGD, Adafactor,
        Lion, Muon, 8-bit AdamW, ...) or none, and from BF16-only models.

        weights maps store tensor names to torch tensors or numpy arrays of
        float32, float16, float64 or bfloat16 (cast to BF16 as torch's
        .to(torch.bfloat16) casts), e.g. dict(model.named_parameters()).
        Each tensor is compared, block by block, with the latest version's,
        read from this host's snapshots (cache_dir=) plus the deltas since,
        else from the store; only changed elements are stored, so the
        version is the one `dtectl commit` of the same weights would make.
        Tensors not named are unchanged. step: the trainer's step, checked
        to follow the last one published (None: not checked). CUDA tensors
        are copied to host memory one tensor at a time; the publish adds
        about two chunks of 16 blocks to that. The result's path is
        "weights"; parent_bytes says how much of the parent was read
        (docs/engine.md, "Any optimizer: the weights path"). A world of
        one only: one rank holds or gathers the full weights."""
        if self._mcore:
            raise InvalidArgument("publish_weights takes Hugging Face tensors; this Publisher "
                                  "has a Megatron-Core converter")
        _check(lib.dte_publisher_weights_begin(self._h, -1 if step is None else int(step)))
        for name, value in weights.items():
            if not isinstance(name, str):
                raise InvalidArgument("weights are keyed by Hugging Face tensor names, not %r"
                                      % (name,))
            keep: List[Any] = []  # this tensor's host copy, freed after the call
            entry = _lib.WeightsTensor(name.encode(), _as_array(_host_weights(value, name),
                                                                "weights", name, keep))
            _check(lib.dte_publisher_weights_add(self._h, ctypes.byref(entry)))
        out = _lib.PublishResult()
        _check(lib.dte_publisher_weights_commit(self._h, ctypes.byref(out)))
        result = PublishResult.from_c(out)
        if self._push is not None:
            result.push = self._last_push()
        return result

    def _publish_whole(self, h: _lib.AdamWStep, params: Params, out: _lib.PublishResult) -> int:
        """A publish of whole tensors in host memory (in a world of several
        ranks, each this rank's copy); returns the C call's code."""
        keep: List[Any] = []
        entries: Any
        if self._mcore:
            entries = (_lib.McoreAdamWShard * max(len(params), 1))()
        else:
            entries = (_lib.AdamWParam * max(len(params), 1))()
        for i, (key, value) in enumerate(params.items()):
            e = entries[i]
            if self._mcore:
                name, e.tp_rank, e.ep_rank = _mcore_key(key)
                label = "%s (tp rank %d, ep rank %d)" % (name, e.tp_rank, e.ep_rank)
            else:
                name = label = key
            encoded = name.encode()
            keep.append(encoded)
            e.name = encoded
            _fill(e, label, cast(ParamState, value), keep)
        publish = (lib.dte_publisher_publish_adamw_mcore if self._mcore
                   else lib.dte_publisher_publish_adamw)
        return int(publish(self._h, ctypes.byref(h), entries, len(params), ctypes.byref(out)))

    def _last_push(self) -> Optional[PushReport]:
        """The push report of the last publish (docs/push.md)."""
        text = ctypes.c_char_p()
        _check(lib.dte_publisher_last_push_json(self._h, ctypes.byref(text)))
        return PushReport.from_json(_text(text))

    def metrics_text(self) -> str:
        """What this publisher's publishes did, as Prometheus metrics in the
        text exposition format (names and meanings: docs/engine.md,
        "Metrics")."""
        text = ctypes.c_char_p()
        _check(lib.dte_publisher_metrics_text(self._h, ctypes.byref(text)))
        return _text(text)

    def serve_metrics(self, address: Union[str, int, None]) -> int:
        """Serves the metrics at http://ADDRESS/metrics until close or the
        next call: "HOST:PORT", or a port alone for loopback (0: any free
        port; None or "": stop). Returns the port."""
        port = ctypes.c_int32()
        _check(lib.dte_publisher_serve_metrics(self._h, str(address or "").encode(),
                                               ctypes.byref(port)))
        return port.value

    def push_metrics(self, gateway: str, job: str,
                     labels: Optional[Mapping[str, Any]] = None) -> None:
        """Pushes the metrics' current values to the Prometheus Pushgateway at
        `gateway` ("http://HOST:PORT") as `job`, grouped by `labels` (a dict;
        a publisher of several ranks adds {"rank": rank} unless given),
        replacing what that group held."""
        labels = dict(labels or {})
        if self.world_size > 1:
            labels.setdefault("rank", str(self.rank))
        names = (ctypes.c_char_p * max(1, len(labels)))(*[str(k).encode() for k in labels])
        values = (ctypes.c_char_p * max(1, len(labels)))(
            *[str(v).encode() for v in labels.values()])
        _check(lib.dte_publisher_push_metrics(self._h, str(gateway).encode(), str(job).encode(),
                                              names, values, len(labels)))

    def metrics_collector(self) -> MetricsCollector:
        """A prometheus_client collector of these metrics, to register in the
        trainer's own registry (prometheus_client.REGISTRY or another) and
        serve or push with prometheus_client next to the trainer's metrics."""
        return MetricsCollector(self)

    def last_stats(self) -> DistStats:
        """What the last publish of ranges (pieces, DTensors, CUDA tensors,
        or any publish_adamw of several ranks) did on this rank (DistStats:
        detect_ns is the host screen, or the device kernel and the copy of
        its kept entries; commit_ns its part sent to rank 0 until the
        outcome); zeros after a publish of whole host tensors in a world of
        one."""
        out = _lib.DistStats()
        _check(lib.dte_publisher_last_stats(self._h, ctypes.byref(out)))
        return DistStats.from_c(out)

    def _publish_ranges(self, h: _lib.AdamWStep, params: Params, out: _lib.PublishResult) -> int:
        """A publish of the pieces this rank holds; returns the C call's code."""
        keep: List[Any] = []
        ranges: List[_lib.AdamWRange] = []
        for key, value in params.items():
            if self._mcore:
                name, tp_rank, ep_rank = _mcore_key(key)
                label = "%s (tp rank %d, ep rank %d)" % (name, tp_rank, ep_rank)
            else:
                if not isinstance(key, str):
                    raise InvalidArgument("params are keyed by Hugging Face tensor names, not %r"
                                          % (key,))
                name, tp_rank, ep_rank, label = key, 0, 0, key
            encoded = name.encode()
            keep.append(encoded)
            pieces = value if isinstance(value, list) else [value]
            for piece in cast(List[ParamState], pieces):
                ranges.append(_range_of(encoded, tp_rank, ep_rank, label, piece, keep))
        entries = (_lib.AdamWRange * max(len(ranges), 1))(*ranges)
        # The C side reads device memory on the legacy default stream: wait
        # for the work queued on each device's current stream (the optimizer
        # step, the copies contiguous() made).
        torch = _torch()
        for device in sorted({r.device for r in ranges if r.memory == _lib.MEMORY_CUDA}):
            assert torch is not None
            torch.cuda.current_stream(device).synchronize()
        return int(lib.dte_publisher_publish_ranges(self._h, ctypes.byref(h), entries,
                                                    len(ranges), ctypes.byref(out)))

    def _publish(self, step: int, call: Callable[[_lib.PublishResult], int]) -> PublishResult:
        """Runs one publish call with this step's exchange set on the
        publisher (none in a world of one without a transport), and the
        result with its push report."""
        out = _lib.PublishResult()
        t, per_call = self._transport_for(step)
        if per_call:
            _check(lib.dte_publisher_set_group(self._h, self.rank, self.world_size, t))
        try:
            rc = call(out)
        finally:
            if per_call:
                lib.dte_publisher_set_group(self._h, self.rank, self.world_size, None)
                lib.dte_transport_close(t)
        if rc != 0 and self._job is not None:
            self._tries[step] = self._tries.get(step, 0) + 1
        if rc != 0 and self._transport:
            # A failed TCP transport stays broken.
            lib.dte_publisher_set_group(self._h, self.rank, self.world_size, None)
            lib.dte_transport_close(self._transport)
            self._transport = None
            self._broken = True
        _check(rc)
        result = PublishResult.from_c(out)
        if self._push is not None:
            result.push = self._last_push()
        return result

    def _transport_for(self, step: int) -> Tuple[Optional[ctypes.c_void_p], bool]:
        """The exchange of one publish, and whether it is made for this call
        (set, then closed after it) rather than kept (TCP) or not needed (a
        world of one)."""
        t = ctypes.c_void_p()
        if self._exchange is not None:
            _check(lib.dte_transport_callback(self.rank, self.world_size, self._exchange.fn, None,
                                              ctypes.byref(t)))
            return t, True
        if self._job is not None:
            # A fresh prefix per attempt of a step: a retry never reads what
            # a failed attempt left behind.
            prefix = "%s/step-%d/try-%d" % (self._job, step, self._tries.get(step, 0))
            _check(lib.dte_transport_store(self._h, self.rank, self.world_size, prefix.encode(),
                                           self._timeout_ms, ctypes.byref(t)))
            return t, True
        if self._broken:
            raise IOFailure("the TCP transport failed earlier; open a new Publisher with a "
                            "fresh rendezvous directory on every rank to retry")
        return self._transport, False

    def publish_torch_adamw(self, optimizer: Any, named_params: Mapping[str, Any],
                            step: Optional[int] = None) -> PublishResult:
        """Publishes a torch.optim.AdamW's state after optimizer.step().

        named_params maps store tensor names to the optimizer's parameters
        (e.g. dict(model.named_parameters())). Every param group's lr and
        weight decay are passed per tensor; the engine order follows the
        optimizer's kernel and the parameters' device (_torch_adamw.order:
        fused on the CPU; fused, foreach or single-tensor on CUDA). A step
        the engine has no model of (torch 2's non-fused CPU kernels,
        amsgrad, maximize, capturable without fused on CUDA,
        differentiable, a tensor lr or betas, param groups whose betas, eps
        or kernel differ, parameters that are not FP32) is published by
        publish_weights instead, comparing the weights with the parent
        version: the result's path is "weights", and logger "dte" says why
        (once per reason and publisher). step: the step to publish (None:
        the optimizer state's, which every tensor must share)."""
        torch = _torch()
        if torch is None or not isinstance(optimizer, torch.optim.AdamW):
            raise InvalidArgument("publish_torch_adamw needs a torch.optim.AdamW, not %s"
                                  % type(optimizer).__name__)
        params, first, steps = _torch_adamw.state(optimizer, named_params)
        if step is None:
            if len(steps) != 1:
                raise InvalidArgument("parameters are at different optimizer steps %s"
                                      % sorted(steps))
            step = steps.pop()
        order, how = _torch_adamw.order(optimizer, named_params)
        if order is None:
            return self._publish_adamw_weights(named_params, step, how)
        _torch_adamw.require_order(order, how)
        return self.publish_adamw(step=step, params=params, lr=first["lr"],
                                  betas=first["betas"], eps=first["eps"],
                                  weight_decay=first["weight_decay"], order=order)

    def _publish_adamw_weights(self, named_params: Mapping[str, Any], step: int,
                               why: str) -> PublishResult:
        """publish_torch_adamw of a step the engine has no model of: the
        weights compared with the parent version (a world of one only)."""
        logged = self.__dict__.setdefault("_weights_reasons", set())
        if why not in logged:
            logged.add(why)
            import logging
            logging.getLogger("dte").warning(
                "publish_torch_adamw: AdamW with %s: the engine cannot invert this step; "
                "publishing by comparing the weights with the parent version (path \"weights\")",
                why)
        return self.publish_weights(named_params, step=step)


def _host_weights(x: Any, name: str) -> Any:
    """Weights as a host array the C ABI takes: BF16 or FP32 (other float
    dtypes cast to FP32 exactly, as torch casts them on the way to BF16);
    a DTensor is refused (gather it first: full_tensor())."""
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor):
        import numpy as np
        a = np.asarray(x)
        if a.dtype.name == "bfloat16" or a.dtype == np.float32:
            return a
        if a.dtype.kind == "f":
            return a.astype(np.float32)
        raise InvalidArgument("tensor %s: weights are %s; publish_weights takes floating-point "
                              "arrays" % (name, a.dtype))
    if _is_dtensor(x):
        raise InvalidArgument("tensor %s is a DTensor; publish_weights takes full tensors (call "
                              ".full_tensor() on every rank, one tensor at a time, and publish "
                              "from one)" % name)
    x = x.detach()
    if not x.is_floating_point():
        raise InvalidArgument("tensor %s: weights are %s; publish_weights takes floating-point "
                              "tensors" % (name, x.dtype))
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.to(torch.float32)
    return x.cpu()


def _whole(value: Any) -> bool:
    """Whether a params value is a whole tensor in host memory (published
    through dte_publisher_publish_adamw), not pieces, rows= or flat= ranges,
    DTensors or CUDA tensors (dte_publisher_publish_ranges)."""
    if isinstance(value, list):
        return False
    if isinstance(value, Mapping):
        if "rows" in value or "flat" in value:
            return False
        arrays: List[Any] = [value.get(k) for k in ("param", "exp_avg", "exp_avg_sq")]
    else:
        arrays = list(value)
    torch = _torch()
    for x in arrays:
        if _is_dtensor(x):
            return False
        if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return False
    return True


def _dist_initialized() -> bool:
    """Whether torch.distributed has a default process group (False without torch)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available() and dist.is_initialized())


class MetricsCollector:
    """A prometheus_client collector of a dte.Publisher's metrics: each
    collection reads the publisher's values of the moment. Needs the
    prometheus_client package (pinned in tools/python.lock)."""

    def __init__(self, publisher: Publisher) -> None:
        from prometheus_client.parser import text_string_to_metric_families
        self._parse = text_string_to_metric_families
        self._publisher = publisher

    def collect(self) -> List[Any]:
        return list(self._parse(self._publisher.metrics_text()))
