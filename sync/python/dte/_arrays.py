"""Turning what a trainer hands the Publisher (torch tensors, numpy arrays,
DTensors, Megatron-Core keys and specs) into the C ABI's structs."""

from __future__ import annotations

import ctypes
import json
import math
import os
from typing import Any, Dict, List, Mapping, Tuple, Union

from dte import _lib
from dte._errors import InvalidArgument
from dte._handle import _torch

# A torch.Tensor or a numpy array (anything numpy.ascontiguousarray takes).
Array = Any
# One tensor's optimizer state: (param, exp_avg, exp_avg_sq), or a dict with
# those keys and optionally step, lr, weight_decay, rows=(begin, end) or
# flat=(begin, end).
ParamState = Union[Tuple[Array, Array, Array], Mapping[str, Any]]
# A converter= spec: "hf" or a Megatron-Core dict (see Publisher).
ConverterSpec = Union[str, Mapping[str, Any]]
_Keep = List[Any]  # references that must outlive a C call


def _as_array(x: Array, what: str, name: str, keep: _Keep) -> _lib.Array:
    """An _lib.Array viewing x (zero-copy for contiguous arrays); references
    that must outlive the call go to keep."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise InvalidArgument("tensor %s: %s is on %s; the publisher reads host memory, and "
                                  "finds the changes of CUDA optimizer state on its GPU"
                                  % (name, what, x.device))
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
        if x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
            dtype = _lib.DTYPE_BF16
        ptr, shape = x.ctypes.data, x.shape
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    keep.extend((x, dims))
    return _lib.Array(ptr or None, dtype, len(shape), dims)


def _step_value(step: Any) -> int:
    """An optimizer state's step (an int or a 0-d tensor) as an int; -1: none."""
    if step is None:
        return -1
    if hasattr(step, "item"):
        step = step.item()
    return int(step)


_MCORE_KEYS = {"config", "tp", "ep", "etp", "vocab_divisible_by", "norms", "experts"}


def _mcore_spec(spec: Any) -> Tuple[bytes, bytes, _lib.McoreLayout]:
    """(config.json text, its name for errors, _lib.McoreLayout) of a converter= dict."""
    if not isinstance(spec, dict):
        raise InvalidArgument("converter must be \"hf\" or a Megatron-Core spec dict with keys %s, "
                              "not %r" % (", ".join(sorted(_MCORE_KEYS)), spec))
    unknown = set(spec) - _MCORE_KEYS
    if unknown or "config" not in spec:
        raise InvalidArgument("Megatron-Core converter spec: %s (keys: %s)" % (
            "unknown keys %s" % sorted(unknown) if unknown else "\"config\" is required",
            ", ".join(sorted(_MCORE_KEYS))))
    config = spec["config"]
    if isinstance(config, dict):
        text, source = json.dumps(config).encode(), "converter config"
    else:
        with open(config, "rb") as f:
            text, source = f.read(), os.fsdecode(config)
    norms, experts = spec.get("norms", "te"), spec.get("experts", "sequential")
    if norms not in _lib.MCORE_NORMS or experts not in _lib.MCORE_EXPERTS:
        raise InvalidArgument("Megatron-Core converter spec: norms must be one of %s and experts "
                              "one of %s" % (sorted(_lib.MCORE_NORMS), sorted(_lib.MCORE_EXPERTS)))
    layout = _lib.McoreLayout(int(spec.get("tp", 1)), int(spec.get("ep", 1)),
                              int(spec.get("etp", 0)), int(spec.get("vocab_divisible_by", 128)),
                              _lib.MCORE_NORMS[norms], _lib.MCORE_EXPERTS[experts])
    return text, source.encode(), layout


def _fill(e: Any, name: str, value: ParamState, keep: _Keep) -> None:
    """Fills the array, step and group fields of a C parameter entry."""
    if isinstance(value, dict):
        d = value
    else:
        if len(value) != 3:
            raise InvalidArgument("tensor %s: expected (master, exp_avg, exp_avg_sq)" % name)
        d = dict(zip(("param", "exp_avg", "exp_avg_sq"), value))
    e.param = _as_array(d["param"], "param", name, keep)
    e.exp_avg = _as_array(d["exp_avg"], "exp_avg", name, keep)
    e.exp_avg_sq = _as_array(d["exp_avg_sq"], "exp_avg_sq", name, keep)
    e.state_step = _step_value(d.get("step"))
    e.lr = float(d["lr"]) if d.get("lr") is not None else math.nan
    wd = d.get("weight_decay")
    e.weight_decay = float(wd) if wd is not None else math.nan


def _mcore_key(key: Any) -> Tuple[str, int, int]:
    """(name, tp_rank, ep_rank) of a params key: a 3-tuple, or a name (ranks 0)."""
    if isinstance(key, str):
        return key, 0, 0
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[0], str):
        return key[0], int(key[1]), int(key[2])
    raise InvalidArgument("Megatron-Core params are keyed by (mcore_name, tp_rank, ep_rank), not %r"
                          % (key,))


def chunk_rows(rows: int, rank: int, world_size: int) -> Tuple[int, int]:
    """(begin, end) rows of torch.chunk(world_size) that rank holds (FSDP2's
    Shard(0)): chunks of ceil(rows / world_size), the last short or empty."""
    chunk = -(-rows // world_size)
    begin = min(rows, chunk * rank)
    return begin, min(rows, begin + chunk)


def _fp32_view(x: Array, what: str, name: str,
               keep: _Keep) -> Tuple[int, int, Tuple[int, ...], Any]:
    """(address, elements, shape, device) of x as contiguous FP32; device is
    None for host memory, else the torch CUDA device."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type not in ("cpu", "cuda"):
            raise InvalidArgument("tensor %s: %s is on %s; the publisher reads host or CUDA "
                                  "memory" % (name, what, x.device))
        x = x.detach()
        if x.dtype != torch.float32:
            raise InvalidArgument("tensor %s: %s is %s; the publisher needs FP32 master weights "
                                  "and moments" % (name, what, x.dtype))
        x = x.contiguous()
        keep.append(x)
        device = x.device if x.device.type == "cuda" else None
        return x.data_ptr(), x.numel(), tuple(x.shape), device
    import numpy as np
    x = np.ascontiguousarray(x)
    if x.dtype != np.float32:
        raise InvalidArgument("tensor %s: %s is %s; the publisher needs FP32 master weights and "
                              "moments" % (name, what, x.dtype))
    keep.append(x)
    return x.ctypes.data, x.size, x.shape, None


def _is_dtensor(x: Any) -> bool:
    """A torch DTensor (torch >= 2.0), or anything with its interface."""
    return (x is not None and hasattr(x, "placements") and hasattr(x, "device_mesh")
            and hasattr(x, "to_local"))


def _dtensor_rows(x: Any, what: str, label: str) -> Tuple[int, int]:
    """(begin, end) rows of the global tensor that this rank's local shard of
    the DTensor x holds: every Shard(0) mesh dimension, in mesh order, cuts
    the rows the earlier ones left as torch.chunk does (DTensor's and FSDP2's
    rule); Replicate mesh dimensions hold every row. Other placements cannot
    be published from one rank's shard."""
    mesh = x.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise InvalidArgument("tensor %s: %s is a DTensor on a device mesh this rank is not part of"
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
        # repr: torch prints Shard(1) as "S(1)" and _StridedShard as "_S(0, 2)".
        raise InvalidArgument("tensor %s: %s is a DTensor placed %r on mesh dimension %d; the "
                              "publisher takes Shard(0) and Replicate placements (for other splits "
                              "pass the local tensor with flat=(begin, end) pieces)"
                              % (label, what, pl, dim))
    return begin, end


def _from_dtensors(d: Mapping[str, Any], label: str) -> Dict[str, Any]:
    """d with DTensor param and moments replaced by their local shards and
    the rows they hold."""
    if "rows" in d or "flat" in d:
        raise InvalidArgument("tensor %s: a DTensor says which rows it holds; do not also pass "
                              "rows or flat" % label)
    out, held = dict(d), None
    for k in ("param", "exp_avg", "exp_avg_sq"):
        x = d[k]
        if not _is_dtensor(x):
            raise InvalidArgument("tensor %s: %s is not a DTensor but the others are; pass param, "
                                  "exp_avg and exp_avg_sq all as DTensors or all as local tensors"
                                  % (label, k))
        rows = _dtensor_rows(x, k, label)
        if held is not None and (rows != held[0] or tuple(x.shape) != held[1]):
            raise InvalidArgument("tensor %s: %s is placed differently from param (rows %s of %s, "
                                  "param rows %s of %s)" % (label, k, rows, tuple(x.shape),
                                                            held[0], held[1]))
        held = held or (rows, tuple(x.shape))
        out[k] = x.to_local()
    assert held is not None
    begin, end = held[0]
    shape = held[1]
    if len(shape) == 0:
        return out  # a scalar: whole
    out["rows"] = (begin, end)
    local = tuple(out["param"].shape)
    if local != (end - begin,) + shape[1:]:
        raise InvalidArgument("tensor %s: the local shard of the DTensor is %s, but its placements "
                              "give rows [%d, %d) of %s" % (label, local, begin, end, shape))
    return out


def _range_of(encoded: bytes, tp_rank: int, ep_rank: int, label: str, value: ParamState,
              keep: _Keep) -> _lib.AdamWRange:
    """The C range of one held piece: (param, exp_avg, exp_avg_sq) for a
    whole tensor, or a dict with those keys and optionally rows=(begin, end)
    (a dim-0 shard), flat=(begin, end) (a range of the flattened tensor),
    step, lr and weight_decay. DTensors (all three) give their rows through
    their placements."""
    if isinstance(value, dict):
        d = value
    else:
        if len(value) != 3:
            raise InvalidArgument("tensor %s: expected (master, exp_avg, exp_avg_sq)" % label)
        d = dict(zip(("param", "exp_avg", "exp_avg_sq"), value))
    if any(_is_dtensor(d.get(k)) for k in ("param", "exp_avg", "exp_avg_sq")):
        d = _from_dtensors(d, label)
    views = [_fp32_view(d[k], k, label, keep) for k in ("param", "exp_avg", "exp_avg_sq")]
    n, shape, device = views[0][1], views[0][2], views[0][3]
    if any(v[1] != n for v in views):
        raise InvalidArgument("tensor %s: param, exp_avg and exp_avg_sq have different sizes"
                              % label)
    if any(v[3] != device for v in views):
        raise InvalidArgument("tensor %s: param, exp_avg and exp_avg_sq are on different devices "
                              "(%s)" % (label, ", ".join(str(v[3] or "cpu") for v in views)))
    if "rows" in d and "flat" in d:
        raise InvalidArgument("tensor %s: give rows or flat, not both" % label)
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
        raise InvalidArgument("tensor %s: the range [%d, %d) holds %d elements but the arrays %d"
                              % (label, begin, end, end - begin, n))
    lr, wd = d.get("lr"), d.get("weight_decay")
    return _lib.AdamWRange(encoded, tp_rank, ep_rank, begin, end, views[0][0], views[1][0],
                           views[2][0], _step_value(d.get("step")),
                           float(lr) if lr is not None else math.nan,
                           float(wd) if wd is not None else math.nan,
                           _lib.MEMORY_CUDA if device is not None else _lib.MEMORY_HOST,
                           device.index if device is not None else 0)
