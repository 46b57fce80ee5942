"""End-to-end tests of live apply into FP8 receivers on a real dtefs mount:
receivers in /dev/shm registered through dte.LiveReceiver(fp8=...) with
their E4M3 bytes, their block scales and their BF16 tensors, in vLLM's fused
TP layout, under both scale rules. After every `dtectl apply`, forward and
back, every buffer equals the target version sharded directly and, for the
quantized tensors, quantized by the independent numpy + ml_dtypes reference
(tests/py/fp8_ref.py), bit for bit, and the TP-1 receiver equals the
mount's own FP8 view of the target (MOUNT/fp8/vN read with the safetensors
package); the apply writes only the bytes and scales that changed.

The model is test_fs_live's dte-gen Llama, with AdamW steps large enough
(lr 2e-5) that some block scales move. 32 x 32 blocks: the small model's
K/V heads (32 rows) are the receivers' split.
"""

import os
import sys

import numpy as np
import pytest

from dtectl_util import Dtectl
import fs_util
from fp8_ref import read_safetensors, ref_quantize
from test_fs_live import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MODEL_ARGS, PY_PATH, VOCAB, apply,
                          load_raw, shard)

STEPS = 3
BLOCK = 32


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return fs_util.generate(tmp_path_factory.mktemp("fp8gen"), None, STEPS, *MODEL_ARGS, "--lr",
                            "2e-5")


@pytest.fixture(scope="module")
def store(tmp_path_factory, gen):
    root = tmp_path_factory.mktemp("fp8store")
    return Dtectl(root / "store", root / "cache").import_steps(gen, STEPS).store


@pytest.fixture
def mount(tmp_path, store):
    with fs_util.mounts(tmp_path) as start:
        yield lambda *args, **kw: start(store, *args, **kw)


def quantized(name):
    """The policy's rule for this model: the projections' weights."""
    return name.endswith("_proj.weight")


def expected(state, tp, rank, rule):
    """{buffer name: (dtype, array)} of one rank: BF16 slices, and E4M3 bytes
    and F32 scales of the quantized slices."""
    out = {}
    for name, a in shard(state, tp, rank).items():
        if not quantized(name):
            out[name] = ("BF16", a)
            continue
        q, s = ref_quantize(a, BLOCK, BLOCK, rule)
        out[name] = ("F8_E4M3", q)
        out[name[:-len(".weight")] + ".weight_scale_inv"] = ("F32", s)
    return out


class Fp8Receiver:
    """One rank's receiver: its buffers in /dev/shm, registered."""

    def __init__(self, dte, mount_path, state, version, tp, rank, rule):
        self.tp, self.rank, self.rule = tp, rank, rule
        want = expected(state, tp, rank, rule)
        self.w = dte.SharedWeights(f"dte-test-fp8-{os.getpid()}-{tp}-{rank}-{rule}",
                                   {k: (dt, a.shape) for k, (dt, a) in want.items()})
        for k, (_, a) in want.items():
            self.w.array(k)[...] = a.view(self.w.array(k).dtype)
        self.rx = dte.LiveReceiver(mount_path, tp=tp, rank=rank,
                                   fp8=dte.Fp8Options(block=BLOCK, scale_rule=rule))
        self.rx.register_shared(self.w, version)

    def check(self, state, what):
        """Every buffer equals the reference of `state`, bit for bit."""
        for k, (_, a) in expected(state, self.tp, self.rank, self.rule).items():
            got = self.w.array(k)
            assert np.array_equal(got.view(np.uint8), a.view(np.uint8)), (what, self.rank, k)

    def close(self):
        self.rx.close()
        self.w.close()
        self.w.unlink()


def fused_view(fp8_dir):
    """{name: uint8 array} of the mount's FP8 view (MOUNT/fp8/vN) laid out
    as a TP-1 fused receiver: q/k/v and gate/up bytes and scales stacked."""
    view = {k: a.view(np.uint8) for k, (_, _, a) in
            read_safetensors(os.path.join(fp8_dir, "model.safetensors")).items()}
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                         (("gate_proj", "up_proj"), "gate_up_proj")):
        for k in [k for k in view if f".{parts[0]}." in k]:
            view[k.replace(parts[0], fused)] = np.concatenate(
                [view.pop(k.replace(parts[0], p)) for p in parts])
    return view


def differing_bytes(a, b):
    """Bytes that differ between two expected() results, element-wise."""
    n = 0
    for k, (_, x) in a.items():
        y = b[k][1]
        n += int(np.count_nonzero(x != y)) * x.dtype.itemsize
    return n


def test_fp8_receivers_equal_the_reference_after_every_apply(mount, gen):
    sys.path.insert(0, PY_PATH)
    import dte
    m = mount("--live-version", 1, "--fp8-block", BLOCK)
    states = {v: load_raw(gen(v) / "model.safetensors") for v in range(STEPS + 1)}
    rxs = []
    try:
        for rule in ("plain", "pow2"):
            for tp in (1, 2):
                for rank in range(tp):
                    rxs.append(Fp8Receiver(dte, m.path, states[1], 1, tp, rank, rule))
        assert m.status()["live"]["receivers"] == len(rxs)
        at, scales_moved, fp8_bytes, bf16_bytes = 1, 0, 0, 0
        for target in (3, 0, 2, 1):
            r = apply(m.path, target)
            assert r["to_version"] == target and r["receivers"] == len(rxs), r
            want = 0
            for x in rxs:
                x.check(states[target], f"{at} -> {target}")
                before = expected(states[at], x.tp, x.rank, x.rule)
                after = expected(states[target], x.tp, x.rank, x.rule)
                want += differing_bytes(before, after)
                scales_moved += sum(int(np.count_nonzero(before[k][1] != after[k][1]))
                                    for k in after if after[k][0] == "F32")
                if x.tp == 1 and x.rule == "plain":
                    # The quantized tensors' FP8 payload against their BF16 one.
                    fp8_bytes += sum(differing_bytes({k: before[k]}, {k: after[k]})
                                     for k in after if after[k][0] in ("F8_E4M3", "F32"))
                    old, new = shard(states[at], 1, 0), shard(states[target], 1, 0)
                    bf16_bytes += sum(2 * int(np.count_nonzero(old[k] != new[k]))
                                      for k in after if after[k][0] == "F8_E4M3")
            # The plain TP-1 receiver equals the mount's FP8 view of the target.
            view = fused_view(os.path.join(m.path, "fp8", "v%08d" % target))
            x = rxs[0]
            for k, (dt, _) in expected(states[target], 1, 0, "plain").items():
                if dt != "BF16":
                    assert np.array_equal(x.w.array(k).view(np.uint8).reshape(-1),
                                          view[k].reshape(-1)), (target, k)
            # Only what changed is written: E4M3 bytes, 4 per scale, 2 per BF16 element.
            assert r["bytes"] == want, (r, want)
            at = target
        assert scales_moved > 0  # the steps exercised moved block scales
        assert 0 < fp8_bytes < bf16_bytes / 4, (fp8_bytes, bf16_bytes)
    finally:
        for x in rxs:
            x.close()


def test_fp8_registrations_are_refused_naming_what_to_fix(mount):
    sys.path.insert(0, PY_PATH)
    import dte
    m = mount()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    rows = (HEADS // 2 + 2 * (KV_HEADS // 2)) * HEAD_DIM
    w = dte.SharedWeights(f"dte-test-fp8-bad-{os.getpid()}",
                          {qkv: ("F8_E4M3", [rows, HIDDEN]),
                           "lm_head.weight": ("F8_E4M3", [VOCAB, HIDDEN])})
    try:
        # 128-row blocks would mix K heads of both ranks: refused, naming the
        # tensor, the split and the block.
        with dte.LiveReceiver(m.path, tp=2, rank=0, fp8=dte.Fp8Options()) as r:
            with pytest.raises(dte.InvalidArgument,
                               match=r"k_proj.weight': receiver rank 0 \(tp=2\) takes its rows "
                                     r"\[0, 32\) of 64 .*FP8 block 128"):
                r.register(qkv, w.name, w.offset(qkv), "F8_E4M3", [rows, HIDDEN])
        with dte.LiveReceiver(m.path, tp=1, rank=0, fp8=dte.Fp8Options(block=BLOCK)) as r:
            with pytest.raises(dte.InvalidArgument, match="not held in FP8 \\(skipped module\\)"):
                r.register("lm_head.weight", w.name, w.offset("lm_head.weight"), "F8_E4M3",
                           [VOCAB, HIDDEN])
        # register_cuda(dtype=) must name a dtype of the tensor's element
        # width (checked before any CUDA call): F32 over uint8 memory would
        # write 4 bytes per element into a tensor of 1-byte ones.
        class Uint8Tensor:
            dtype, shape = "torch.uint8", (rows, HIDDEN)

            def element_size(self):
                return 1

        with dte.LiveReceiver(m.path, tp=1, rank=0, fp8=dte.Fp8Options(block=BLOCK)) as r:
            with pytest.raises(dte.InvalidArgument, match="dtype F32 \\(4-byte elements\\) does "
                                                          "not match the tensor's 1-byte"):
                r.register_cuda(qkv, Uint8Tensor(), dtype="F32")
        with pytest.raises(dte.InvalidArgument, match="live apply takes square FP8 blocks"):
            dte.LiveReceiver(m.path, fp8=dte.Fp8Options(block=(32, 64)))
        with pytest.raises(dte.InvalidArgument, match="scale rule 'e8m0' is not one of"):
            dte.Fp8Options(scale_rule="e8m0")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            dte.Fp8Options(block=0)
    finally:
        w.close()
        w.unlink()


def test_fp8_options_of_one_block_shape_are_equal():
    """block=(N, N) is block=N (the group status lists square blocks so);
    (rows, cols) keeps both sides; a list, a bool or one side is refused."""
    sys.path.insert(0, PY_PATH)
    import dte
    assert dte.Fp8Options(block=(16, 16)) == dte.Fp8Options(block=16)
    assert dte.Fp8Options(block=(16, 16)).block == 16
    wide = dte.Fp8Options(block=(8, 32))
    assert (wide.block, wide.block_rows, wide.block_cols) == ((8, 32), 8, 32)
    assert wide.scale_shape((17, 64)) == (3, 2)
    for bad in ([8, 32], True, (8,), (8, 0), (8, 2**32)):
        with pytest.raises(ValueError, match="FP8 block must be"):
            dte.Fp8Options(block=bad)  # type: ignore[arg-type]


def test_a_mounts_kept_modules_are_not_fp8_for_live_receivers(mount):
    """dtefs --fp8-keep reaches live apply: on such a mount o_proj is held in
    BF16 (as MOUNT/fp8 shows it), so an F8_E4M3 registration of it is
    refused while one of q/k/v is taken."""
    sys.path.insert(0, PY_PATH)
    import dte
    m = mount("--fp8-keep", "o_proj")
    o = "model.layers.0.self_attn.o_proj.weight"
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    qkv_shape = [(HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN]
    w = dte.SharedWeights(f"dte-test-fp8-keep-{os.getpid()}",
                          {o: ("F8_E4M3", [HIDDEN, HEADS * HEAD_DIM]),
                           qkv: ("F8_E4M3", qkv_shape)})
    try:
        with dte.LiveReceiver(m.path, tp=1, rank=0, fp8=dte.Fp8Options(block=BLOCK)) as r:
            r.register(qkv, w.name, w.offset(qkv), "F8_E4M3", qkv_shape)
            with pytest.raises(dte.InvalidArgument, match="o_proj.weight\" is not held in FP8 "
                                                          "\\(skipped module\\)"):
                r.register(o, w.name, w.offset(o), "F8_E4M3", [HIDDEN, HEADS * HEAD_DIM])
    finally:
        w.close()
        w.unlink()
