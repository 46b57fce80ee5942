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
            raise DteError(1, "tensor %s: %s is on %s; this build of dte publishes from CPU "
                           "memory only" % (name, what, x.device))
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
            getattr(lib, self._close_fn)(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


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

    def __init__(self, store, converter="hf", cache_dir=None, anchor_budget=1.0, anchor_every=0):
        """anchor_budget, anchor_every: the anchor policy, as dtectl commit's
        --anchor-budget and --anchor-every (docs/cli.md).

        converter: "hf" (params are keyed by Hugging Face tensor names) or a
        Megatron-Core spec, a dict {"config": path to the model's HF
        config.json or the config as a dict, "tp": 1, "ep": 1, and optionally
        "etp", "vocab_divisible_by" (128), "norms" ("te" or "local"),
        "experts" ("sequential" or "grouped")}; then params are keyed by
        (mcore_name, tp_rank, ep_rank)."""
        self._h = None
        handle = ctypes.c_void_p()
        cache = os.fsencode(cache_dir) if cache_dir else None
        self._mcore = not (isinstance(converter, str) and converter == "hf")
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

    def import_checkpoint(self, directory):
        """Commits a Hugging Face checkpoint directory; returns its version."""
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
        Arrays are torch CPU tensors or numpy arrays."""
        if order not in _lib.ORDERS:
            raise DteError(1, "unknown order %r (one of %s)" % (order, ", ".join(_lib.ORDERS)))
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
        h = _lib.AdamWStep(float(lr), float(betas[0]), float(betas[1]), float(eps),
                           float(weight_decay), int(step), int(bool(amsgrad)),
                           int(bool(maximize)), _lib.ORDERS[order])
        out = _lib.PublishResult()
        publish = (lib.dte_publisher_publish_adamw_mcore if self._mcore
                   else lib.dte_publisher_publish_adamw)
        _check(publish(self._h, ctypes.byref(h), entries, len(params), ctypes.byref(out)))
        return PublishResult(*(getattr(out, f) for f, _ in _lib.PublishResult._fields_))


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
