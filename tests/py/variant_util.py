"""Checkpoint variants: tensors of every dtype with raw-bit edge cases, and
layout changes that must turn a version into an anchor."""

import numpy as np

import ckpt_util

FLOAT_BITS = {  # dtype: (+0, -0, quiet NaN, another NaN payload, negative NaN, one)
    "BF16": (0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC0, 0x3F80),
    "F16": (0x0000, 0x8000, 0x7E00, 0x7E01, 0xFE00, 0x3C00),
    "F32": (0, 0x80000000, 0x7FC00000, 0x7FC00001, 0xFFC00000, 0x3F800000),
    "F64": (0, 1 << 63, 0x7FF8 << 48, (0x7FF8 << 48) | 1, 0xFFF8 << 48, 0x3FF << 52),
    "F8_E4M3": (0x00, 0x80, 0x7F, 0xFF, 0xFF, 0x38),  # E4M3 has one NaN per sign
    "F8_E5M2": (0x00, 0x80, 0x7E, 0x7D, 0xFE, 0x3C),
}
ALL_DTYPES = ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I8", "U8", "I16", "U16",
              "I32", "U32", "I64", "U64", "BOOL"]


def dtype_tensors(rng):
    """One tensor per dtype; floats seeded with signed zeros and NaNs at known places."""
    out = {}
    for i, dtype in enumerate(ALL_DTYPES):
        raw = ckpt_util.raw_type(dtype)
        n = 3000 + 17 * i
        if dtype == "BOOL":
            arr = rng.integers(0, 2, n, dtype=np.uint8)
        else:
            arr = rng.integers(0, np.iinfo(raw).max, n, dtype=raw, endpoint=True)
        if dtype in FLOAT_BITS:
            pz, nz, qnan, nan2, negnan, one = FLOAT_BITS[dtype]
            arr[:] = one
            arr[0:100] = pz
            arr[100:200] = nz
            arr[200:300] = qnan
            arr[300:400] = negnan
        out[f"t.{dtype.lower()}"] = (dtype, arr)
    return out


def nan_and_zero_step(tensors, rng):
    """Changes only signed zeros and NaN payloads in float tensors, a few raw values elsewhere."""
    out = {}
    for name, (dtype, arr) in tensors.items():
        arr = arr.copy()
        if dtype in FLOAT_BITS:
            pz, nz, qnan, nan2, negnan, _ = FLOAT_BITS[dtype]
            arr[0:100:3] = np.where(arr[0:100:3] == pz, nz, pz)      # +0 <-> -0
            arr[100:200:5] = np.where(arr[100:200:5] == nz, pz, nz)
            arr[200:300:4] = np.where(arr[200:300:4] == qnan, nan2, qnan)  # payload
            arr[300:400:7] = np.where(arr[300:400:7] == negnan, qnan, negnan)  # sign of NaN
        else:
            idx = rng.choice(arr.size, 25, replace=False)
            arr[idx] = (1 - arr[idx]) if dtype == "BOOL" else ~arr[idx]
        out[name] = (dtype, arr)
    return out


# Layout changes, applied to a Checkpoint in place.

def shape_change(c):  # same byte count, other shape
    d, a = c.tensors["model.layers.0.mlp.gate_proj.weight"]
    c.tensors["model.layers.0.mlp.gate_proj.weight"] = (d, a.reshape(a.shape[1], a.shape[0]))


def dtype_change(c):  # same byte count, other dtype
    _, a = c.tensors["model.layers.0.self_attn.q_proj.weight"]
    c.tensors["model.layers.0.self_attn.q_proj.weight"] = ("F16", a)


def tensor_added(c):
    c.tensors["model.layers.0.self_attn.q_norm.weight"] = ("BF16", np.full(256, 0x3F80, np.uint16))
    c.shards[0].tensors.append("model.layers.0.self_attn.q_norm.weight")


def tensor_removed(c):
    del c.tensors["lm_head.weight"]
    c.shards[1].tensors.remove("lm_head.weight")


def shard_added(c):
    ckpt_util.reshard(c, 4)


LAYOUT_CHANGES = [shape_change, dtype_change, tensor_added, tensor_removed, shard_added]
