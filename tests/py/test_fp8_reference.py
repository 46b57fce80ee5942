"""The CPU FP8 quantizer (kernels/fp8.h, run through build/tests/fp8_tool)
equals an independent reference bit for bit: numpy FP32 arithmetic and
ml_dtypes' float8_e4m3fn cast, written from docs/fp8.md's rules.

The reference quantizes as the public checkpoints' loaders would read it:
scale = fp32(amax / 448) per block (1.0 for an all-zero block), optionally
rounded up to a power of two, and byte = e4m3fn(clip(x / scale, -448, 448)).
"""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

try:
    import ml_dtypes
except ImportError:
    pytest.fail("ml_dtypes is not installed (tools/setup.sh installs it)", pytrace=False)
from fp8_ref import F8, F32, bf16_values, expand, ref_quantize, ref_scales, to_bf16  # noqa: E402,F401

BUILD_DIR = Path(os.environ.get("DTE_BUILD_DIR", "/work/main/build"))
TOOL = BUILD_DIR / "tests" / "fp8_tool"


def run_tool(tmp_path: Path, cmd: str, shape, block, rule: str, *arrays):
    ins = []
    for k, a in enumerate(arrays):
        p = tmp_path / f"in{k}"
        np.ascontiguousarray(a).tofile(p)
        ins.append(str(p))
    outs = [str(tmp_path / f"out{k}") for k in range(3 if cmd != "changes" else 1)]
    if cmd == "quantize":
        outs = outs[:2]
    elif cmd == "dequantize":
        outs = outs[:1]
    args = [str(TOOL), cmd, str(shape[0]), str(shape[1]), str(block[0]), str(block[1]), rule]
    return subprocess.run(args + ins + outs, capture_output=True, text=True), outs


def cpu_quantize(tmp_path, bits, block, rule, expect_rc=0):
    if not os.access(TOOL, os.X_OK):
        pytest.fail(f"{TOOL} is not built (build the fp8_tool target)")
    res, (q_path, s_path) = run_tool(tmp_path, "quantize", bits.shape, block, rule, bits)
    assert res.returncode == expect_rc, res.stderr
    q = np.fromfile(q_path, dtype=np.uint8).reshape(bits.shape)
    return q, np.fromfile(s_path, dtype=F32), res.stderr


def assert_matches_reference(tmp_path, bits, block, rule):
    q, s, _ = cpu_quantize(tmp_path, bits, block, rule)
    want_q, want_s = ref_quantize(bits, block[0], block[1], rule)
    np.testing.assert_array_equal(s.view(np.uint32), want_s.reshape(-1).view(np.uint32))
    mismatch = np.flatnonzero(q != want_q)
    assert mismatch.size == 0, (
        f"{mismatch.size} bytes differ, first at {mismatch[0]}: "
        f"x={bf16_values(bits).reshape(-1)[mismatch[0]]!r} "
        f"got {q.reshape(-1)[mismatch[0]]:#x} want {want_q.reshape(-1)[mismatch[0]]:#x}")


def weights(shape, seed, sigma=0.02):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, sigma, size=shape).astype(F32)
    x.reshape(-1)[::997] *= 40  # outliers push the others towards subnormals
    return to_bf16(x)


@pytest.mark.parametrize("rule", ["plain", "pow2"])
def test_every_bf16_value_with_scale_one(tmp_path, rule):
    # Each row is one block whose maximum is 448, so the scale is 1 and every
    # BF16 value of magnitude <= 448 meets the element rule directly.
    mags = np.arange(0, 0x43E1, dtype=np.uint16)
    vals = np.concatenate([mags, mags | np.uint16(0x8000)])
    cols = 128
    vals = np.concatenate([vals, np.zeros(-len(vals) % (cols - 1), dtype=np.uint16)])
    body = vals.reshape(-1, cols - 1)
    head = np.full((body.shape[0], 1), 0x43E0, dtype=np.uint16)  # 448.0
    assert_matches_reference(tmp_path, np.hstack([head, body]), (1, cols), rule)


@pytest.mark.parametrize("rule", ["plain", "pow2"])
def test_every_finite_bf16_value_in_small_blocks(tmp_path, rule):
    # Every finite BF16 value, shuffled into 1 x 16 blocks: scales from the
    # subnormal range to 2^120, tiny values beside large ones.
    allbits = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    finite = allbits[(allbits & 0x7F80) != 0x7F80]
    rng = np.random.default_rng(1)
    finite = rng.permutation(finite)
    finite = np.concatenate([finite, np.zeros(-len(finite) % 64, dtype=np.uint16)])
    assert_matches_reference(tmp_path, finite.reshape(-1, 64), (1, 16), rule)


@pytest.mark.parametrize("rule", ["plain", "pow2"])
@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((256, 384), (128, 128)),
                                         ((130, 257), (64, 32)), ((77, 300), (7, 300)),
                                         ((5, 9), (1, 1))])
def test_weights_with_partial_blocks(tmp_path, rule, shape, block):
    assert_matches_reference(tmp_path, weights(shape, hash(shape) & 0xFFFF), block, rule)


def test_zero_and_all_equal_blocks(tmp_path):
    bits = np.zeros((256, 384), dtype=np.uint16)
    bits[:128, :128] = 0x8000                      # -0.0 block
    bits[128:, :128] = to_bf16(np.array(3.0))      # all equal
    bits[:128, 128:256] = to_bf16(np.array(-1e-30))  # all equal, tiny
    bits[128:, 256:] = 0x0001                       # the smallest BF16 subnormal
    for rule in ("plain", "pow2"):
        assert_matches_reference(tmp_path, bits, (128, 128), rule)
    q, s, _ = cpu_quantize(tmp_path, bits, (128, 128), "plain")
    assert s[0] == 1.0 and s[2] == 1.0 and (q[:128, :128] == 0x80).all()
    assert (q[128:, :128] == 0x7E).all() and (q[:128, 128:256] == 0xFE).all()


def test_dequantize_is_byte_times_scale(tmp_path):
    bits = weights((200, 300), 5)
    q, s, _ = cpu_quantize(tmp_path, bits, (128, 128), "plain")
    res, (out,) = run_tool(tmp_path, "dequantize", bits.shape, (128, 128), "plain", q, s)
    assert res.returncode == 0, res.stderr
    got = np.fromfile(out, dtype=F32).reshape(bits.shape)
    want = q.view(F8).astype(F32) * expand(s.reshape(2, 3), 128, 128, bits.shape)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("bad", [0x7FC0, 0x7F80, 0xFF80])
def test_nan_and_inf_are_refused(tmp_path, bad):
    bits = weights((300, 200), 6)
    bits[131, 5] = bad
    _, _, err = cpu_quantize(tmp_path, bits, (128, 128), "plain", expect_rc=3)
    assert "FP8 block (1, 0) (rows 128..255, cols 0..127)" in err
    assert "element (131, 5)" in err and "refuses non-finite weights" in err


@pytest.mark.parametrize("rule", ["plain", "pow2"])
def test_change_set_matches_reference(tmp_path, rule):
    parent = weights((300, 260), 7)
    rng = np.random.default_rng(8)
    child = parent.copy()
    moved = rng.random(parent.shape) < 0.05
    child[moved] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=int(moved.sum()))
    child[5, 200] = to_bf16(np.array(100.0))  # a new maximum: block (0, 1)'s scale moves
    res, (prefix,) = run_tool(tmp_path, "changes", parent.shape, (128, 128), rule, parent, child)
    assert res.returncode == 0, res.stderr
    qp, sp = ref_quantize(parent, 128, 128, rule)
    qc, sc = ref_quantize(child, 128, 128, rule)
    want_bytes = np.flatnonzero(qp != qc)
    want_scales = np.flatnonzero(sp.view(np.uint32) != sc.view(np.uint32))
    got_bytes = np.fromfile(prefix + ".byte_index", dtype=np.uint64)
    np.testing.assert_array_equal(got_bytes, want_bytes)
    np.testing.assert_array_equal(np.fromfile(prefix + ".byte_value", dtype=np.uint8),
                                  qc.reshape(-1)[want_bytes])
    np.testing.assert_array_equal(np.fromfile(prefix + ".scale_index", dtype=np.uint64),
                                  want_scales)
    assert 1 in want_scales.tolist()
    np.testing.assert_array_equal(np.fromfile(prefix + ".scale_value", dtype=F32),
                                  sc.reshape(-1)[want_scales])
