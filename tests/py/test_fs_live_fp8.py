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

import json
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
def mount(mount, store):
    """conftest's mount, bound to the module's store."""
    return lambda *args, **kw: mount(store, *args, **kw)


# A fused receiver tensor and the canonical tensors it holds.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def quantized(state, name, block):
    """The policy's rule for these models under N x N blocks: a projection's
    weight whose canonical tensors (all parts of a fused one) are whole
    blocks."""
    if not name.endswith("_proj.weight"):
        return False
    module = name.split(".")[-2]
    parts = [name.replace(module, p) for p in FUSED.get(module, (module,))]
    return all(state[p].shape[0] % block == 0 and state[p].shape[1] % block == 0 for p in parts)


def expected(state, tp, rank, rule, block=BLOCK):
    """{buffer name: (dtype, array)} of one rank: BF16 slices, and E4M3 bytes
    and F32 scales of the quantized slices."""
    out = {}
    for name, a in shard(state, tp, rank).items():
        if not quantized(state, name, block):
            out[name] = ("BF16", a)
            continue
        q, s = ref_quantize(a, block, block, rule)
        out[name] = ("F8_E4M3", q)
        out[name[:-len(".weight")] + ".weight_scale_inv"] = ("F32", s)
    return out


class Fp8Receiver:
    """One rank's receiver: its buffers in /dev/shm, registered."""

    def __init__(self, dte, mount_path, state, version, tp, rank, rule, block=BLOCK):
        self.tp, self.rank, self.rule, self.block = tp, rank, rule, block
        want = expected(state, tp, rank, rule, block)
        self.w = dte.SharedWeights(f"dte-test-fp8-{os.getpid()}-{tp}-{rank}-{rule}-{block}",
                                   {k: (dt, a.shape) for k, (dt, a) in want.items()})
        for k, (_, a) in want.items():
            self.w.array(k)[...] = a.view(self.w.array(k).dtype)
        self.rx = dte.LiveReceiver(mount_path, tp=tp, rank=rank,
                                   fp8=dte.Fp8Options(block=block, scale_rule=rule))
        self.rx.register_shared(self.w, version)

    def check(self, state, what):
        """Every buffer equals the reference of `state`, bit for bit."""
        for k, (_, a) in expected(state, self.tp, self.rank, self.rule, self.block).items():
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


OFF_INTER = 344  # 43 x 8: the MLP is not whole 32 x 32 blocks


@pytest.fixture(scope="module")
def off_block(tmp_path_factory):
    """(step -> checkpoint dir, store) of the same Llama with an MLP 344
    wide, one layer, versions 0..2."""
    root = tmp_path_factory.mktemp("fp8off")
    args = list(MODEL_ARGS)
    args[args.index("--intermediate") + 1] = OFF_INTER
    args[args.index("--layers") + 1] = 1
    gen = fs_util.generate(root / "gen", None, 2, *args, "--lr", "2e-5")
    return gen, Dtectl(root / "store", root / "cache").import_steps(gen, 2).store


def test_weights_off_a_receivers_block_are_written_as_bf16(tmp_path, off_block):
    """gate_proj and up_proj (344 x 256) and down_proj (256 x 344) are not
    whole 32 x 32 blocks: MOUNT/fp8 (--fp8-block 32) keeps them BF16 and
    lists them in modules_to_not_convert; receivers of 32 x 32 blocks (TP 1,
    and TP 2, whose 172-wide halves are then no FP8 split to refuse) hold
    gate_up_proj and down_proj in BF16, refuse them as F8_E4M3, and every
    apply writes them the target's BF16 slices, while attention stays FP8;
    a receiver of 8 x 8 blocks (344 = 43 x 8) decides with its own block and
    holds the MLP in FP8."""
    sys.path.insert(0, PY_PATH)
    import dte
    gen, store = off_block
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    mlp = (gate_up, "model.layers.0.mlp.down_proj.weight")
    states = {v: load_raw(gen(v) / "model.safetensors") for v in range(3)}
    with fs_util.mounts(tmp_path) as start:
        m = start(store, "--live-version", 0, "--fp8-block", BLOCK)
        fp8_dir = os.path.join(m.path, "fp8", "v00000000")
        with open(os.path.join(fp8_dir, "config.json")) as f:
            listed = json.load(f)["quantization_config"]["modules_to_not_convert"]
        assert listed == ["lm_head", "model.embed_tokens"] + [
            f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
        view = read_safetensors(os.path.join(fp8_dir, "model.safetensors"))
        assert view["model.layers.0.mlp.up_proj.weight"][0] == "BF16"
        assert view["model.layers.0.self_attn.k_proj.weight"][0] == "F8_E4M3"
        rxs = [Fp8Receiver(dte, m.path, states[0], 0, tp, rank, "plain", block)
               for tp, rank, block in ((1, 0, BLOCK), (2, 0, BLOCK), (2, 1, BLOCK), (1, 0, 8))]
        try:
            for x in rxs:
                fp8 = x.block == 8  # the MLP's buffers: 1-byte E4M3 or 2-byte BF16
                assert [x.w.array(k).dtype.itemsize for k in mlp] == [1 if fp8 else 2] * 2
                assert (dte.Fp8Options.scale_name(gate_up) in x.w.tensors) == fp8
            for target in (2, 1, 0):
                r = apply(m.path, target)
                assert r["to_version"] == target and r["receivers"] == len(rxs), r
                for x in rxs:
                    x.check(states[target], f"-> {target}")
                for x in rxs[:3]:  # the BF16 slices, computed directly
                    want = shard(states[target], x.tp, x.rank)
                    for k in mlp:
                        assert np.array_equal(x.w.array(k).view(np.uint16), want[k]), (target, k)
            w = dte.SharedWeights(f"dte-test-fp8-off-{os.getpid()}",
                                  {gate_up: ("F8_E4M3", [2 * OFF_INTER, HIDDEN])})
            try:
                with dte.LiveReceiver(m.path, fp8=dte.Fp8Options(block=BLOCK)) as r:
                    with pytest.raises(dte.InvalidArgument,
                                       match="gate_up_proj.weight\" is not held in FP8 "
                                             "\\(shape not a multiple of the block\\)"):
                        r.register(gate_up, w.name, w.offset(gate_up), "F8_E4M3",
                                   [2 * OFF_INTER, HIDDEN])
            finally:
                w.close()
                w.unlink()
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
        # 64-row blocks would mix K heads of both ranks: refused, naming the
        # tensor, the split and the block.
        with dte.LiveReceiver(m.path, tp=2, rank=0, fp8=dte.Fp8Options(block=64)) as r:
            with pytest.raises(dte.InvalidArgument,
                               match=r"k_proj.weight': receiver rank 0 \(tp=2\) takes its rows "
                                     r"\[0, 32\) of 64 .*FP8 block 64"):
                r.register(qkv, w.name, w.offset(qkv), "F8_E4M3", [rows, HIDDEN])
        # Under 128-row blocks k_proj and v_proj (64 rows) are not whole
        # blocks: the fused qkv_proj is held in BF16, as MOUNT/fp8 keeps them.
        with dte.LiveReceiver(m.path, tp=2, rank=0, fp8=dte.Fp8Options()) as r:
            with pytest.raises(dte.InvalidArgument,
                               match="qkv_proj.weight\" is not held in FP8 "
                                     "\\(shape not a multiple of the block\\)"):
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
