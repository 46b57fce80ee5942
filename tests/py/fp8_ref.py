"""The independent FP8 reference quantizer of the tests: numpy FP32
arithmetic and ml_dtypes' float8_e4m3fn cast, written from docs/fp8.md's
rules (not from the C++ code). Every Python test that checks FP8 bytes or
scales (kernels, mount views, stats, receivers) compares against this.

scale = fp32(amax / 448) per block (1.0 for an all-zero block), optionally
rounded up to a power of two ("pow2"), and
byte = e4m3fn(clip(x / scale, -448, 448)).
"""

import numpy as np
import ml_dtypes

F8 = ml_dtypes.float8_e4m3fn
F32 = np.float32


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(F32).astype(ml_dtypes.bfloat16).view(np.uint16)


def ref_scales(x: np.ndarray, br: int, bc: int, rule: str) -> np.ndarray:
    rows, cols = x.shape
    gr, gc = -(-rows // br), -(-cols // bc)
    padded = np.zeros((gr * br, gc * bc), dtype=F32)
    padded[:rows, :cols] = np.abs(x)
    amax = padded.reshape(gr, br, gc, bc).max(axis=(1, 3))
    with np.errstate(under="ignore"):
        s = (amax / F32(448.0)).astype(F32)  # IEEE FP32 division, rounded once
    s[(s == 0) & (amax > 0)] = np.finfo(F32).smallest_subnormal
    s[amax == 0] = F32(1.0)
    if rule == "pow2":
        mant, exp = np.frexp(s)  # s = mant * 2**exp, mant in [0.5, 1)
        p = np.where(mant == 0.5, s, np.ldexp(F32(1.0), exp)).astype(F32)
        s = np.clip(p, F32(2.0 ** -126), F32(2.0 ** 127)).astype(F32)
    return s


def expand(s: np.ndarray, br: int, bc: int, shape) -> np.ndarray:
    return np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: shape[0], : shape[1]]


def ref_quantize(bits: np.ndarray, br: int, bc: int, rule: str):
    x = bf16_values(bits)
    s = ref_scales(x, br, bc, rule)
    with np.errstate(under="ignore"):
        scaled = x / expand(s, br, bc, x.shape)
    q = np.clip(scaled, F32(-448.0), F32(448.0)).astype(F8).view(np.uint8)
    return q, s


def read_safetensors(path) -> dict:
    """Every tensor of a safetensors file, read by the real `safetensors`
    package: {name: (dtype string, shape, numpy array)}.

    Debian's torch 1.13 has no float8 dtypes, so framework="pt" cannot give
    F8_E4M3 tensors; the numpy framework can once numpy answers to the dtype
    names the package's Rust reader asks it for, which ml_dtypes provides.
    """
    from safetensors import safe_open

    np.float8_e4m3fn = ml_dtypes.float8_e4m3fn
    np.bfloat16 = ml_dtypes.bfloat16
    out = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            s = f.get_slice(name)
            out[name] = (s.get_dtype(), list(s.get_shape()), f.get_tensor(name))
    return out
