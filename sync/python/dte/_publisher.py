"""The Publisher and StoreReader classes over libdte's C ABI."""

import ctypes
import dataclasses
import json
import math
import os

from dte import _lib
from dte._lib import lib


class DteError(RuntimeError):
    """A failed dte call; .code is the C ABI's dte_code."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def _check(rc):
    if rc != 0:
        msg = lib.dte_last_error().decode("utf-8", "replace")
        raise DteError(rc, "%s: %s" % (_lib.CODE_NAMES.get(rc, "error %d" % rc), msg))


def _secret_arg(secret):
    """secret= as the C ABI takes it: None (from the environment) or bytes."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret or b"\0" in secret:
        raise ValueError("secret must be a non-empty str or bytes without NUL bytes")
    return secret


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def _as_array(x, what, name, keep):
    """An _lib.Array viewing x (zero-copy for contiguous arrays); references
    that must outlive the call go to keep."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise DteError(1, "tensor %s: %s is on %s; a single-process Publisher reads host "
                           "memory (a distributed one, world_size= and rank=, finds the "
                           "changes of CUDA tensors on their GPU)" % (name, what, x.device))
        x = x.detach()
        if not x.is_contiguous():
            x = x.contiguous()
        dtype = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16,
                 torch.float16: _lib.DTYPE_F16, torch.float64: _lib.DTYPE_F64}.get(
                     x.dtype, _lib.DTYPE_OTHER)
        ptr, shape = x.data_ptr(), tuple(x.shape)
    else:
        import numpy as np
        x = np.ascontiguousarray(x)
        dtype = {np.dtype(np.float32): _lib.DTYPE_F32, np.dtype(np.float16): _lib.DTYPE_F16,
                 np.dtype(np.float64): _lib.DTYPE_F64}.get(x.dtype, _lib.DTYPE_OTHER)
        ptr, shape = x.ctypes.data, x.shape
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    keep.extend((x, dims))
    return _lib.Array(ptr or None, dtype, len(shape), dims)


def _step_value(step):
    if step is None:
        return -1
    if hasattr(step, "item"):
        step = step.item()
    return int(step)


class _Handle:
    """Owns one C handle, closed exactly once: by close(), at the end of a
    with block, or when the object is collected. Subclasses name the C
    function that closes it."""

    _h = None
    _close_fn = None  # name of the dte_*_close function

    def close(self):
        if self._h:
            h, self._h = self._h, None
            _check(getattr(lib, self._close_fn)(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except DteError:
            pass  # nothing to tell at collection; the handle is gone either way


@dataclasses.dataclass
class PublishResult:
    """What one publish committed. int(result) is the version."""
    version: int
    parent: int
    tensors: int
    elements: int
    changed: int          # elements stored in the delta
    flagged: int          # elements the fused detector reported
    false_positives: int  # reported, then proven unchanged (not stored)
    uncertain: int        # stored whole; at most this many stored elements are unchanged
    stored_bytes: int
    state_bytes: int      # optimizer state read: 12 bytes per element
    # With push=: {"version", "pushed", "behind", "elements", "bytes", "seconds",
    # "dropped": [lines]}, or {"error": ...} when the push could not run.
    push: object = None

    def __int__(self):
        return self.version

    __index__ = __int__


_MCORE_KEYS = {"config", "tp", "ep", "etp", "vocab_divisible_by", "norms", "experts"}


def _mcore_spec(spec):
    """(config.json text, its name for errors, _lib.McoreLayout) of a converter= dict."""
    if not isinstance(spec, dict):
        raise DteError(1, "converter must be \"hf\" or a Megatron-Core spec dict with keys %s, "
                       "not %r" % (", ".join(sorted(_MCORE_KEYS)), spec))
    unknown = set(spec) - _MCORE_KEYS
    if unknown or "config" not in spec:
        raise DteError(1, "Megatron-Core converter spec: %s (keys: %s)" % (
            "unknown keys %s" % sorted(unknown) if unknown else "\"config\" is required",
            ", ".join(sorted(_MCORE_KEYS))))
    config = spec["config"]
    if isinstance(config, dict):
        text, source = json.dumps(config), "converter config"
    else:
        with open(config, "rb") as f:
            text, source = f.read(), os.fsdecode(config)
    norms, experts = spec.get("norms", "te"), spec.get("experts", "sequential")
    if norms not in _lib.MCORE_NORMS or experts not in _lib.MCORE_EXPERTS:
        raise DteError(1, "Megatron-Core converter spec: norms must be one of %s and experts "
                       "one of %s" % (sorted(_lib.MCORE_NORMS), sorted(_lib.MCORE_EXPERTS)))
    layout = _lib.McoreLayout(int(spec.get("tp", 1)), int(spec.get("ep", 1)),
                              int(spec.get("etp", 0)), int(spec.get("vocab_divisible_by", 128)),
                              _lib.MCORE_NORMS[norms], _lib.MCORE_EXPERTS[experts])
    if isinstance(text, str):
        text = text.encode()
    return text, source.encode(), layout


def _fill(e, name, value, keep):
    """Fills the array, step and group fields of a C parameter entry."""
    if isinstance(value, dict):
        d = value
    else:
        if len(value) != 3:
            raise DteError(1, "tensor %s: expected (master, exp_avg, exp_avg_sq)" % name)
        d = dict(zip(("param", "exp_avg", "exp_avg_sq"), value))
    e.param = _as_array(d["param"], "param", name, keep)
    e.exp_avg = _as_array(d["exp_avg"], "exp_avg", name, keep)
    e.exp_avg_sq = _as_array(d["exp_avg_sq"], "exp_avg_sq", name, keep)
    e.state_step = _step_value(d.get("step"))
    e.lr = float(d["lr"]) if d.get("lr") is not None else math.nan
    wd = d.get("weight_decay")
    e.weight_decay = float(wd) if wd is not None else math.nan


def _mcore_key(key):
    """(name, tp_rank, ep_rank) of a params key: a 3-tuple, or a name (ranks 0)."""
    if isinstance(key, str):
        return key, 0, 0
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], str):
        return key[0], int(key[1]), int(key[2])
    raise DteError(1, "Megatron-Core params are keyed by (mcore_name, tp_rank, ep_rank), not %r"
                   % (key,))


class Publisher(_Handle):
    """Commits versions of a dte store (a local directory or s3://bucket/prefix).

    Not thread-safe: call it from one thread. See docs/engine.md."""

    _close_fn = "dte_publisher_close"

    def __init__(self, store, converter="hf", cache_dir=None, anchor_budget=1.0, anchor_every=0,
                 rank=None, world_size=None, group=None, rendezvous=None, job=None,
                 timeout=60.0, push=None, join_budget=0.125, *, secret=None):
        """anchor_budget, anchor_every, join_budget: the anchor policy and
        join tables, as dtectl commit's --anchor-budget, --anchor-every and
        --join-budget (docs/cli.md).

        converter: "hf" (params are keyed by Hugging Face tensor names) or a
        Megatron-Core spec, a dict {"config": path to the model's HF
        config.json or the config as a dict, "tp": 1, "ep": 1, and optionally
        "etp", "vocab_divisible_by" (128), "norms" ("te" or "local"),
        "experts" ("sequential" or "grouped")}; then params are keyed by
        (mcore_name, tp_rank, ep_rank).

        Distributed publishing (every rank of a sharded trainer publishes the
        state it holds; docs/engine.md, "Distributed publish"): give
        world_size (and rank), or a torch.distributed process group. The
        ranks exchange over `group` (a torch.distributed ProcessGroup; the
        default group when torch.distributed is initialized and no
        rendezvous is given), or over dte's TCP transport when `rendezvous`
        names a fresh directory every rank sees (connected here, by every
        rank together), or through the store alone when `job` names the
        job (ranks on hosts that share nothing but the store: messages are
        objects under exchange/JOB/ of the store; a restarted job takes a new
        name). timeout (seconds) bounds the TCP and store transports' waits;
        a process group's own timeout bounds its waits.

        secret: the job secret (str or bytes) the TCP transport's ranks, and
        a PushGroup given none of its own, prove on every connection; None:
        DTE_JOB_SECRET, DTE_JOB_SECRET_FILE, else, for the TCP transport,
        the rendezvous directory's "secret" file, which rank 0 creates (mode
        0600) when there is none (docs/engine.md, "Security"; a push group's
        receivers are other processes: give them and it the secret).

        push: a dte.PushGroup; after each publish, the version's changed
        elements go to its receivers (docs/push.md). A distributed publisher
        takes one on every rank (each pushes the tensors it owns in each
        version, from the changes it kept while encoding them; receivers
        connect to rank 0's address and are told the others) or on rank 0
        only (which pushes every tensor, read back from the store)."""
        self._h = None
        self._transport = None
        self._push = None
        self._dist = world_size is not None or group is not None
        handle = ctypes.c_void_p()
        cache = os.fsencode(cache_dir) if cache_dir else None
        self._mcore = not (isinstance(converter, str) and converter == "hf")
        if self._dist:
            self._exchange = None
            self._job, self._tries = job, {}
            if rendezvous is not None and job is not None:
                raise DteError(1, "give rendezvous (TCP transport) or job (store transport), "
                               "not both")
            if job is not None:
                if rank is None or world_size is None:
                    raise DteError(1, "the store transport needs rank and world_size")
            elif rendezvous is None:
                import torch.distributed as dist
                if group is None and not dist.is_initialized():
                    raise DteError(1, "distributed publishing needs a torch.distributed process "
                                   "group (group=, or an initialized default group) or a "
                                   "rendezvous directory for dte's TCP transport")
                self._exchange = _TorchExchange(group)
                rank = self._exchange.rank if rank is None else rank
                world_size = self._exchange.size if world_size is None else world_size
                if (rank, world_size) != (self._exchange.rank, self._exchange.size):
                    raise DteError(1, "rank %d of %d does not match the process group's rank %d "
                                   "of %d" % (rank, world_size, self._exchange.rank,
                                              self._exchange.size))
            elif rank is None or world_size is None:
                raise DteError(1, "dte's TCP transport needs rank and world_size")
            self.rank, self.world_size = int(rank), int(world_size)
            text = source = layout = None
            if self._mcore:
                text, source, layout = _mcore_spec(converter)
            elif converter != "hf":
                raise DteError(1, "converter must be \"hf\" or a Megatron-Core spec dict")
            _check(lib.dte_dist_publisher_open(os.fsencode(store), cache, text, source,
                                               ctypes.byref(layout) if layout else None,
                                               ctypes.byref(handle)))
            self._h = handle
            self._close_fn = "dte_dist_publisher_close"
            _check(lib.dte_dist_publisher_set_anchor_policy(self._h, float(anchor_budget),
                                                            int(anchor_every)))
            _check(lib.dte_dist_publisher_set_join_budget(self._h, float(join_budget)))
            self._timeout_ms = int(timeout * 1000)
            secret = _secret_arg(secret)
            if push is not None:
                # As part `rank` of every rank's push; the ranks find out
                # whether every rank or rank 0 alone pushes (below, or at
                # each publish), and set it.
                push._start(self.rank, self.world_size, secret=secret)
                _check(lib.dte_dist_publisher_set_push(self._h, push._h))
                self._push = push
            if rendezvous is not None:
                t = ctypes.c_void_p()
                _check(lib.dte_transport_tcp(self.rank, self.world_size, os.fsencode(rendezvous),
                                             int(timeout * 1000), secret, ctypes.byref(t)))
                self._transport = t
                # Connected by every rank together: the push servers'
                # addresses go round now, so receivers can join before the
                # first publish.
                _check(lib.dte_dist_publisher_share_push(self._h, t))
            return
        if self._mcore:
            text, source, layout = _mcore_spec(converter)
            _check(lib.dte_publisher_open_mcore(os.fsencode(store), cache, text, source,
                                                ctypes.byref(layout), ctypes.byref(handle)))
        else:
            _check(lib.dte_publisher_open(os.fsencode(store), cache, converter.encode(),
                                          ctypes.byref(handle)))
        self._h = handle
        _check(lib.dte_publisher_set_anchor_policy(self._h, float(anchor_budget),
                                                   int(anchor_every)))
        _check(lib.dte_publisher_set_join_budget(self._h, float(join_budget)))
        if push is not None:
            if not push._h:
                push._start(secret=_secret_arg(secret))
            _check(lib.dte_publisher_set_push(self._h, push._handle()))
            self._push = push  # the server must outlive this publisher's use of it

    def close(self):
        if self._push is not None and self._h:
            (lib.dte_dist_publisher_set_push if self._dist else lib.dte_publisher_set_push)(
                self._h, None)
            self._push = None
        if self._transport:
            lib.dte_transport_close(self._transport)
            self._transport = None
        super().close()

    def import_checkpoint(self, directory):
        """Commits a Hugging Face checkpoint directory; returns its version.
        Single-process publishers only: the ranks of a distributed one start
        from a version imported before they open it."""
        if self._dist:
            raise DteError(1, "import_checkpoint: a distributed Publisher (rank %d of %d) does "
                           "not import checkpoints; import version 0 once, before the ranks "
                           "open their publishers, from one process with "
                           "dte.Publisher(store).import_checkpoint(%r) or `dtectl import "
                           "--store STORE %s`" % (self.rank, self.world_size,
                                                  os.fsdecode(directory),
                                                  os.fsdecode(directory)))
        version = ctypes.c_uint64()
        _check(lib.dte_publisher_import(self._h, os.fsencode(directory), ctypes.byref(version)))
        return version.value

    def publish_adamw(self, step, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                      amsgrad=False, maximize=False, order="torch_cpu"):
        """Publishes the BF16 weights after AdamW step `step`.

        params maps tensor names to (master_fp32, exp_avg, exp_avg_sq) or to a
        dict with keys param, exp_avg, exp_avg_sq and optionally step (the
        optimizer state's), lr and weight_decay (the tensor's param group's).
        With a Megatron-Core converter, keys are (mcore_name, tp_rank,
        ep_rank) of every shard of the converter units published (a bare name
        means ranks 0, 0), and the values are the shards' state; the version
        is the one publishing the converted HF state would make.
        Arrays are torch CPU tensors or numpy arrays; a distributed
        publisher also takes torch CUDA tensors, whose changes it finds on
        their GPU (docs/engine.md, "State on the GPU").

        A distributed publisher (world_size given) takes what the rank holds:
        a dict may add rows=(begin, end) (a dim-0 shard) or flat=(begin, end)
        (a range of the flattened tensor), a value may be a list of such
        pieces, and torch DTensors (FSDP2, HSDP) with Shard(0) and Replicate
        placements give their rows themselves."""
        if order not in _lib.ORDERS:
            raise DteError(1, "unknown order %r (one of %s)" % (order, ", ".join(_lib.ORDERS)))
        h = _lib.AdamWStep(float(lr), float(betas[0]), float(betas[1]), float(eps),
                           float(weight_decay), int(step), int(bool(amsgrad)),
                           int(bool(maximize)), _lib.ORDERS[order])
        if self._push is not None and not self._push._h:
            raise DteError(1, "the PushGroup given as push= was closed; close the Publisher "
                           "first, or open it without push=")
        if self._dist:
            return self._publish_ranges(h, params)
        keep = []
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
            _fill(e, label, value, keep)
        out = _lib.PublishResult()
        publish = (lib.dte_publisher_publish_adamw_mcore if self._mcore
                   else lib.dte_publisher_publish_adamw)
        _check(publish(self._h, ctypes.byref(h), entries, len(params), ctypes.byref(out)))
        result = PublishResult(*(getattr(out, f) for f, _ in _lib.PublishResult._fields_))
        if self._push is not None:
            result.push = self._last_push()
        return result

    def _last_push(self):
        """The push report of the last publish (docs/push.md)."""
        text = ctypes.c_char_p()
        last = (lib.dte_dist_publisher_last_push_json if self._dist
                else lib.dte_publisher_last_push_json)
        _check(last(self._h, ctypes.byref(text)))
        return json.loads(text.value.decode())

    def metrics_text(self):
        """What this publisher's publishes did, as Prometheus metrics in the
        text exposition format (names and meanings: docs/engine.md,
        "Metrics")."""
        text = ctypes.c_char_p()
        fn = lib.dte_dist_publisher_metrics_text if self._dist else lib.dte_publisher_metrics_text
        _check(fn(self._h, ctypes.byref(text)))
        return text.value.decode()

    def serve_metrics(self, address):
        """Serves the metrics at http://ADDRESS/metrics until close or the
        next call: "HOST:PORT", or a port alone for loopback (0: any free
        port; None or "": stop). Returns the port."""
        port = ctypes.c_int32()
        fn = (lib.dte_dist_publisher_serve_metrics if self._dist
              else lib.dte_publisher_serve_metrics)
        _check(fn(self._h, str(address or "").encode(), ctypes.byref(port)))
        return port.value

    def push_metrics(self, gateway, job, labels=None):
        """Pushes the metrics' current values to the Prometheus Pushgateway at
        `gateway` ("http://HOST:PORT") as `job`, grouped by `labels` (a dict;
        a distributed publisher adds {"rank": rank} unless given), replacing
        what that group held."""
        labels = dict(labels or {})
        if self._dist:
            labels.setdefault("rank", str(self.rank))
        names = (ctypes.c_char_p * max(1, len(labels)))(*[str(k).encode() for k in labels])
        values = (ctypes.c_char_p * max(1, len(labels)))(
            *[str(v).encode() for v in labels.values()])
        fn = lib.dte_dist_publisher_push_metrics if self._dist else lib.dte_publisher_push_metrics
        _check(fn(self._h, str(gateway).encode(), str(job).encode(), names, values, len(labels)))

    def metrics_collector(self):
        """A prometheus_client collector of these metrics, to register in the
        trainer's own registry (prometheus_client.REGISTRY or another) and
        serve or push with prometheus_client next to the trainer's metrics."""
        return MetricsCollector(self)

    def last_stats(self):
        """What the last distributed publish did on this rank: entries_sent,
        bytes_sent, bytes_received, tensors_owned, parent_bytes_read,
        messages_sent, push_tensors_kept, push_tensors_read_back, detect_ns
        (detection: the host screen, or the device kernel and the copy of
        its kept entries), encode_ns, commit_ns (its part sent to rank 0
        until the outcome) and detect_device_bytes (copied device to
        host)."""
        if not self._dist:
            raise DteError(1, "last_stats is for distributed publishers")
        return _dist_stats(self._h)

    def _publish_ranges(self, h, params):
        keep, ranges = [], []
        for key, value in params.items():
            if self._mcore:
                name, tp_rank, ep_rank = _mcore_key(key)
                label = "%s (tp rank %d, ep rank %d)" % (name, tp_rank, ep_rank)
            else:
                if not isinstance(key, str):
                    raise DteError(1, "params are keyed by Hugging Face tensor names, not %r"
                                   % (key,))
                name, tp_rank, ep_rank, label = key, 0, 0, key
            encoded = name.encode()
            keep.append(encoded)
            for piece in (value if isinstance(value, list) else [value]):
                ranges.append(_range_of(encoded, tp_rank, ep_rank, label, piece, keep))
        entries = (_lib.AdamWRange * max(len(ranges), 1))(*ranges)
        # The C side reads device memory on the legacy default stream: wait
        # for the work queued on each device's current stream (the optimizer
        # step, the copies contiguous() made).
        torch = _torch()
        for device in sorted({r.device for r in ranges if r.memory == _lib.MEMORY_CUDA}):
            torch.cuda.current_stream(device).synchronize()
        out = _lib.PublishResult()
        per_call = self._exchange is not None or self._job is not None
        if self._exchange is not None:
            t = ctypes.c_void_p()
            _check(lib.dte_transport_callback(self.rank, self.world_size, self._exchange.fn, None,
                                              ctypes.byref(t)))
        elif self._job is not None:
            # A fresh prefix per attempt of a step: a retry never reads what
            # a failed attempt left behind.
            tries = self._tries.get(h.step, 0)
            t = ctypes.c_void_p()
            _check(lib.dte_transport_store(self._h, self.rank, self.world_size,
                                           ("%s/step-%d/try-%d" % (self._job, h.step, tries))
                                           .encode(), self._timeout_ms, ctypes.byref(t)))
        else:
            if not self._transport:
                raise DteError(5, "the TCP transport failed earlier; open a new Publisher with a "
                               "fresh rendezvous directory on every rank to retry")
            t = self._transport
        try:
            rc = lib.dte_dist_publisher_publish_adamw(self._h, t, ctypes.byref(h), entries,
                                                      len(ranges), ctypes.byref(out))
        finally:
            if per_call:
                lib.dte_transport_close(t)
        if rc != 0 and self._job is not None:
            self._tries[h.step] = self._tries.get(h.step, 0) + 1
        if rc != 0 and not per_call:
            lib.dte_transport_close(self._transport)  # broken now
            self._transport = None
        _check(rc)
        result = PublishResult(*(getattr(out, f) for f, _ in _lib.PublishResult._fields_))
        if self._push is not None:
            result.push = self._last_push()
        return result


class MetricsCollector:
    """A prometheus_client collector of a dte.Publisher's metrics: each
    collection reads the publisher's values of the moment. Needs the
    prometheus_client package (Debian's python3-prometheus-client)."""

    def __init__(self, publisher):
        from prometheus_client.parser import text_string_to_metric_families
        self._parse = text_string_to_metric_families
        self._publisher = publisher

    def collect(self):
        return list(self._parse(self._publisher.metrics_text()))


def _dist_stats(h):
    out = _lib.DistStats()
    _check(lib.dte_dist_publisher_last_stats(h, ctypes.byref(out)))
    return {f: getattr(out, f) for f, _ in _lib.DistStats._fields_}


def chunk_rows(rows, rank, world_size):
    """(begin, end) rows of torch.chunk(world_size) that rank holds (FSDP2's
    Shard(0)): chunks of ceil(rows / world_size), the last short or empty."""
    chunk = -(-rows // world_size)
    begin = min(rows, chunk * rank)
    return begin, min(rows, begin + chunk)


def _fp32_view(x, what, name, keep):
    """(address, elements, shape, device) of x as contiguous FP32; device is
    None for host memory, else the torch CUDA device."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type not in ("cpu", "cuda"):
            raise DteError(1, "tensor %s: %s is on %s; the distributed publisher reads host or "
                           "CUDA memory" % (name, what, x.device))
        x = x.detach()
        if x.dtype != torch.float32:
            raise DteError(1, "tensor %s: %s is %s; the publisher needs FP32 master weights and "
                           "moments" % (name, what, x.dtype))
        x = x.contiguous()
        keep.append(x)
        device = x.device if x.device.type == "cuda" else None
        return x.data_ptr(), x.numel(), tuple(x.shape), device
    import numpy as np
    x = np.ascontiguousarray(x)
    if x.dtype != np.float32:
        raise DteError(1, "tensor %s: %s is %s; the publisher needs FP32 master weights and "
                       "moments" % (name, what, x.dtype))
    keep.append(x)
    return x.ctypes.data, x.size, x.shape, None


def _is_dtensor(x):
    """A torch DTensor (torch >= 2.0), or anything with its interface."""
    return (x is not None and hasattr(x, "placements") and hasattr(x, "device_mesh")
            and hasattr(x, "to_local"))


def _dtensor_rows(x, what, label):
    """(begin, end) rows of the global tensor that this rank's local shard of
    the DTensor x holds: every Shard(0) mesh dimension, in mesh order, cuts
    the rows the earlier ones left as torch.chunk does (DTensor's and FSDP2's
    rule); Replicate mesh dimensions hold every row. Other placements cannot
    be published from one rank's shard."""
    mesh = x.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise DteError(1, "tensor %s: %s is a DTensor on a device mesh this rank is not part of"
                       % (label, what))
    rows = int(x.shape[0]) if len(x.shape) else 1
    begin, end = 0, rows
    for dim, pl in enumerate(x.placements):
        if pl.is_replicate():
            continue
        if pl.is_shard() and getattr(pl, "dim", None) == 0:
            b, e = chunk_rows(end - begin, int(coord[dim]), int(mesh.size(dim)))
            begin, end = begin + b, begin + e
            continue
        raise DteError(1, "tensor %s: %s is a DTensor placed %s on mesh dimension %d; the "
                       "publisher takes Shard(0) and Replicate placements (for other splits "
                       "pass the local tensor with flat=(begin, end) pieces)"
                       % (label, what, pl, dim))
    return begin, end


def _from_dtensors(d, label):
    """d with DTensor param and moments replaced by their local shards and
    the rows they hold."""
    if "rows" in d or "flat" in d:
        raise DteError(1, "tensor %s: a DTensor says which rows it holds; do not also pass rows "
                       "or flat" % label)
    out, held = dict(d), None
    for k in ("param", "exp_avg", "exp_avg_sq"):
        x = d[k]
        if not _is_dtensor(x):
            raise DteError(1, "tensor %s: %s is not a DTensor but the others are; pass param, "
                           "exp_avg and exp_avg_sq all as DTensors or all as local tensors"
                           % (label, k))
        rows = _dtensor_rows(x, k, label)
        if held is not None and (rows != held[0] or tuple(x.shape) != held[1]):
            raise DteError(1, "tensor %s: %s is placed differently from param (rows %s of %s, "
                           "param rows %s of %s)" % (label, k, rows, tuple(x.shape), held[0],
                                                     held[1]))
        held = held or (rows, tuple(x.shape))
        out[k] = x.to_local()
    begin, end = held[0]
    shape = held[1]
    if len(shape) == 0:
        return out  # a scalar: whole
    out["rows"] = (begin, end)
    local = tuple(out["param"].shape)
    if local != (end - begin,) + shape[1:]:
        raise DteError(1, "tensor %s: the local shard of the DTensor is %s, but its placements "
                       "give rows [%d, %d) of %s" % (label, local, begin, end, shape))
    return out


def _range_of(encoded, tp_rank, ep_rank, label, value, keep):
    """The C range of one held piece: (param, exp_avg, exp_avg_sq) for a
    whole tensor, or a dict with those keys and optionally rows=(begin, end)
    (a dim-0 shard), flat=(begin, end) (a range of the flattened tensor),
    step, lr and weight_decay. DTensors (all three) give their rows through
    their placements."""
    if isinstance(value, dict):
        d = value
    else:
        if len(value) != 3:
            raise DteError(1, "tensor %s: expected (master, exp_avg, exp_avg_sq)" % label)
        d = dict(zip(("param", "exp_avg", "exp_avg_sq"), value))
    if any(_is_dtensor(d.get(k)) for k in ("param", "exp_avg", "exp_avg_sq")):
        d = _from_dtensors(d, label)
    views = [_fp32_view(d[k], k, label, keep) for k in ("param", "exp_avg", "exp_avg_sq")]
    n, shape, device = views[0][1], views[0][2], views[0][3]
    if any(v[1] != n for v in views):
        raise DteError(1, "tensor %s: param, exp_avg and exp_avg_sq have different sizes" % label)
    if any(v[3] != device for v in views):
        raise DteError(1, "tensor %s: param, exp_avg and exp_avg_sq are on different devices "
                       "(%s)" % (label, ", ".join(str(v[3] or "cpu") for v in views)))
    if "rows" in d and "flat" in d:
        raise DteError(1, "tensor %s: give rows or flat, not both" % label)
    if "rows" in d:
        r0, r1 = (int(x) for x in d["rows"])
        row = 1
        for dim in shape[1:]:
            row *= int(dim)
        begin, end = r0 * row, r1 * row
    elif "flat" in d:
        begin, end = (int(x) for x in d["flat"])
    else:
        begin, end = 0, n
    if end - begin != n:
        raise DteError(1, "tensor %s: the range [%d, %d) holds %d elements but the arrays %d"
                       % (label, begin, end, end - begin, n))
    lr, wd = d.get("lr"), d.get("weight_decay")
    return _lib.AdamWRange(encoded, tp_rank, ep_rank, begin, end, views[0][0], views[1][0],
                           views[2][0], _step_value(d.get("step")),
                           float(lr) if lr is not None else math.nan,
                           float(wd) if wd is not None else math.nan,
                           _lib.MEMORY_CUDA if device is not None else _lib.MEMORY_HOST,
                           device.index if device is not None else 0)


class _TorchExchange:
    """Runs the distributed publisher's exchanges over a torch.distributed
    process group: isend/irecv of the C buffers (batched, except on gloo),
    self-messages copied. On an NCCL group, which moves only device memory,
    each message is staged through a buffer on the rank's current CUDA
    device."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.device = None
        if self.backend == "nccl":
            torch = _torch()
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fn = _lib.EXCHANGE_FN(self._run)  # kept alive with the publisher

    def _peer(self, r):
        if self.group is None:
            return r
        return self.dist.distributed_c10d._get_global_rank(self.group, r)

    def _run(self, ctx, sends, n_sends, recvs, n_recvs, error, error_size):
        try:
            torch = _torch()
            dist = self.dist
            ops, peers, local_sends, local_recvs, staged = [], [], [], [], []
            for msgs, n, local, op in ((sends, n_sends, local_sends, dist.isend),
                                       (recvs, n_recvs, local_recvs, dist.irecv)):
                for i in range(n):
                    m = msgs[i]
                    if m.bytes == 0:
                        continue
                    if m.peer == self.rank:
                        local.append(m)
                        continue
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
            for s, r in zip(local_sends, local_recvs):
                ctypes.memmove(r.data, s.data, s.bytes)
            failed = []

            def fail(peer, e):
                if peer not in (p for p, _ in failed):
                    failed.append((peer, e))

            if ops:
                # gloo posts each message on its own anyway, so post them one
                # by one there: a post that fails (a peer's connection closed)
                # is then charged to its peer. NCCL needs the batch.
                posted = []
                if self.backend == "gloo":
                    for o, peer in zip(ops, peers):
                        try:
                            posted.append((o.op(o.tensor, o.peer, o.group, o.tag), peer))
                        except Exception as e:  # noqa: BLE001 - reported through the C ABI
                            fail(peer, e)
                else:
                    posted = list(zip(dist.batch_isend_irecv(ops), peers))
                # Wait for every message, so that the error names each peer
                # that failed (the one that died, not only a survivor that
                # gave up on it first).
                for req, peer in posted:
                    try:
                        req.wait()
                    except Exception as e:  # noqa: BLE001 - reported through the C ABI
                        fail(peer, e)
            if failed:
                raise RuntimeError("; ".join("rank %d: %s" % (p, e) for p, e in failed))
            for host, wire in staged:
                host.copy_(wire)  # device to host; synchronizes with the receive
            return 0
        except Exception as e:  # noqa: BLE001 - reported through the C ABI
            msg = ("%s" % e).encode("utf-8", "replace")[:max(error_size - 1, 0)]
            ctypes.memmove(error, msg + b"\0", len(msg) + 1)
            return 1


def publish_torch_adamw(publisher, optimizer, named_params, step=None):
    """Publishes a torch.optim.AdamW's state after optimizer.step().

    named_params maps store tensor names to the optimizer's parameters. Every
    param group's lr and weight decay are passed per tensor; unsupported
    settings (amsgrad, maximize, fused, capturable) are rejected."""
    torch = _torch()
    if not isinstance(optimizer, torch.optim.AdamW):
        raise DteError(1, "publish_torch_adamw needs a torch.optim.AdamW, not %s"
                       % type(optimizer).__name__)
    group_of = {}
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "fused", "capturable"):
            if g.get(flag):
                raise DteError(1, "AdamW %s=True is not supported by the publisher" % flag)
        for p in g["params"]:
            group_of[id(p)] = g
    params, steps, first = {}, set(), None
    for name, p in named_params.items():
        g = group_of.get(id(p))
        if g is None:
            raise DteError(1, "tensor %s is not a parameter of the optimizer" % name)
        st = optimizer.state[p]
        s = _step_value(st["step"])
        steps.add(s)
        first = first or g
        params[name] = {"param": p, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                        "step": s, "lr": g["lr"], "weight_decay": g["weight_decay"]}
    if step is None:
        if len(steps) != 1:
            raise DteError(1, "parameters are at different optimizer steps %s" % sorted(steps))
        step = steps.pop()
    return publisher.publish_adamw(step=step, params=params, lr=first["lr"],
                                   betas=first["betas"], eps=first["eps"],
                                   weight_decay=first["weight_decay"])


class StoreReader(_Handle):
    """Reads tensors of committed versions, verified against their hashes."""

    _close_fn = "dte_store_close"

    def __init__(self, store, cache_dir=None):
        handle = ctypes.c_void_p()
        _check(lib.dte_store_open(os.fsencode(store),
                                  os.fsencode(cache_dir) if cache_dir else None,
                                  ctypes.byref(handle)))
        self._h = handle

    def latest(self):
        """The newest committed version, None when there is none. Its manifest
        was read, not only listed, and within this reader the answer never goes
        back while that manifest exists (a listing that lacks it is made again)."""
        has, version = ctypes.c_int(), ctypes.c_uint64()
        _check(lib.dte_store_latest(self._h, ctypes.byref(has), ctypes.byref(version)))
        return version.value if has.value else None

    def read_into(self, version, name, out):
        """Fills the contiguous numpy array or CPU torch tensor `out` (exactly the
        tensor's size in bytes) with tensor `name` at `version`."""
        torch = _torch()
        if torch is not None and isinstance(out, torch.Tensor):
            ptr, nbytes = out.data_ptr(), out.numel() * out.element_size()
        else:
            ptr, nbytes = out.ctypes.data, out.nbytes
        _check(lib.dte_store_read_tensor(self._h, int(version), name.encode(),
                                         ctypes.c_void_p(ptr), nbytes))
        return out
