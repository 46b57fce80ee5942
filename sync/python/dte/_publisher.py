"""The Publisher and StoreReader classes over libdte's C ABI."""

import ctypes
import dataclasses
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


class Publisher:
    """Commits versions of a dte store (a local directory or s3://bucket/prefix).

    Not thread-safe: call it from one thread. See docs/engine.md."""

    def __init__(self, store, converter="hf", cache_dir=None):
        handle = ctypes.c_void_p()
        _check(lib.dte_publisher_open(os.fsencode(store),
                                      os.fsencode(cache_dir) if cache_dir else None,
                                      converter.encode(), ctypes.byref(handle)))
        self._h = handle

    def close(self):
        if self._h:
            lib.dte_publisher_close(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

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
        Arrays are torch CPU tensors or numpy arrays."""
        if order not in _lib.ORDERS:
            raise DteError(1, "unknown order %r (one of %s)" % (order, ", ".join(_lib.ORDERS)))
        keep = []
        entries = (_lib.AdamWParam * max(len(params), 1))()
        for i, (name, value) in enumerate(params.items()):
            if isinstance(value, dict):
                d = value
            else:
                d = dict(zip(("param", "exp_avg", "exp_avg_sq"), value))
                if len(value) != 3:
                    raise DteError(1, "tensor %s: expected (master, exp_avg, exp_avg_sq)" % name)
            e = entries[i]
            encoded = name.encode()
            keep.append(encoded)
            e.name = encoded
            e.param = _as_array(d["param"], "param", name, keep)
            e.exp_avg = _as_array(d["exp_avg"], "exp_avg", name, keep)
            e.exp_avg_sq = _as_array(d["exp_avg_sq"], "exp_avg_sq", name, keep)
            e.state_step = _step_value(d.get("step"))
            e.lr = float(d["lr"]) if d.get("lr") is not None else math.nan
            wd = d.get("weight_decay")
            e.weight_decay = float(wd) if wd is not None else math.nan
        h = _lib.AdamWStep(float(lr), float(betas[0]), float(betas[1]), float(eps),
                           float(weight_decay), int(step), int(bool(amsgrad)),
                           int(bool(maximize)), _lib.ORDERS[order])
        out = _lib.PublishResult()
        _check(lib.dte_publisher_publish_adamw(self._h, ctypes.byref(h), entries, len(params),
                                               ctypes.byref(out)))
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


class StoreReader:
    """Reads tensors of committed versions, verified against their hashes."""

    def __init__(self, store, cache_dir=None):
        handle = ctypes.c_void_p()
        _check(lib.dte_store_open(os.fsencode(store),
                                  os.fsencode(cache_dir) if cache_dir else None,
                                  ctypes.byref(handle)))
        self._h = handle

    def close(self):
        if self._h:
            lib.dte_store_close(self._h)
            self._h = None

    def __del__(self):
        self.close()

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
