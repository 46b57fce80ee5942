"""FP8 receivers of the push through the Python API (docs/push.md, "FP8
receivers"): a trainer trains a small GQA Llama-shaped model with
torch.optim.AdamW and publishes every step with a dte.PushGroup; a BF16
receiver and FP8 receivers (dte.PushReceiver(fp8=dte.Fp8Options(...)),
TP 2 fused with the plain rule, TP 1 unfused with power-of-two scales, TP 1
of 64 x 64 blocks that k_proj and v_proj (32 rows) are not whole blocks
of) hold every version. Each FP8 receiver must equal the version read back
from the store, quantized per canonical tensor by the independent numpy +
ml_dtypes reference (tests/py/fp8_ref.py) and split by plain slicing
(tests/py/push_util.py), bit for bit; a weight that is not whole blocks of
the receiver's block is held and pushed in BF16, as MOUNT/fp8 of that block
keeps it. A receiver that joins late catches up from the store; one whose
split does not fall on block boundaries is refused naming the tensor and
the block.
"""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import push_util  # noqa: E402
from fp8_ref import expand, ref_quantize  # noqa: E402
from wait_util import wait_for  # noqa: E402

import dte  # noqa: E402


def quantized(name):
    """A projection's weight: what the policy quantizes at some block."""
    return name.endswith("proj.weight")


# The canonical tensors of a fused receiver tensor.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fp8_tensors(canonical, fused, fp8):
    """The canonical tensors an FP8 receiver holds in FP8: projections whose
    rows and columns are whole blocks, and in a fused layout only when
    every part of the fused tensor is."""
    out = {n for n, t in canonical.items() if quantized(n)
           and t.shape[0] % fp8.block_rows == 0 and t.shape[1] % fp8.block_cols == 0}
    if fused:
        for group in FUSED:
            for n in [n for n in canonical if "." + group[0] + "." in n]:
                names = [n.replace(group[0], p) for p in group]
                if not all(x in out for x in names):
                    out -= set(names)
    return out


def expected(canonical, tp, rank, fused, fp8):
    """{local name: numpy array} an FP8 receiver holds at this version:
    each quantized canonical tensor through the reference, its bytes and
    its scales (spread over the elements of their blocks) split like the
    BF16 tensors, then one scale per block taken back."""
    br, bc = fp8.block_rows, fp8.block_cols
    parts, scales = {}, {}
    held = fp8_tensors(canonical, fused, fp8)
    for n, t in canonical.items():
        if n not in held:
            parts[n] = t
            continue
        q, s = ref_quantize(t.view(torch.int16).numpy().view(np.uint16), br, bc, fp8.scale_rule)
        parts[n] = torch.from_numpy(q)
        scales[n] = torch.from_numpy(np.ascontiguousarray(expand(s, br, bc, t.shape)))
    out = {n: (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16
               else t.numpy()) for n, t in push_util.local_state(parts, tp, rank, fused).items()}
    for n, t in push_util.local_state(scales, tp, rank, fused).items():
        out[fp8.scale_name(n)] = np.ascontiguousarray(t.numpy()[::br, ::bc])
    return out


def holds(canonical, tp, rank, fused, fp8):
    """{local name: numpy array} a receiver (fp8 None: BF16) holds."""
    if fp8:
        return expected(canonical, tp, rank, fused, fp8)
    return {n: t.view(torch.int16).numpy().view(np.uint16)
            for n, t in push_util.local_state(canonical, tp, rank, fused).items()}


def changed_bytes(a, b):
    """{name: bytes of the elements that differ from a to b}."""
    out = {}
    for n, x in a.items():
        w = x.itemsize
        out[n] = w * int((x.view(np.uint8).reshape(-1, w) != b[n].view(np.uint8).reshape(-1, w))
                         .any(axis=1).sum())
    return out


def receiver_tensors(canonical, tp, rank, fused, fp8):
    """Zeroed buffers of a receiver's tensors: {local name: ("DTYPE", array)}."""
    want = holds(canonical, tp, rank, fused, fp8)
    names = {np.dtype(np.uint16): "BF16", np.dtype(np.uint8): "F8_E4M3",
             np.dtype(np.float32): "F32"}
    return {n: (names[a.dtype], np.zeros_like(a)) for n, a in want.items()}


class Trainer:
    def __init__(self, tmp):
        self.store = str(tmp / "store")
        self.model = push_util.TinyGqaLM(seed=5)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-5, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=0.0, fused=True)
        self.group = dte.PushGroup("127.0.0.1:0", timeout=10.0)
        self.pub = dte.Publisher(store=self.store, push=self.group)
        push_util.save_checkpoint(tmp / "v0", self.model)
        assert self.pub.import_checkpoint(str(tmp / "v0")) == 0
        self.names = {n: tuple(p.shape) for n, p in self.model.named().items()}

    def step(self, step):
        push_util.train_step(self.model, self.opt, 2000 + step)
        params = push_util.adamw_params(self.model, self.opt)
        return self.pub.publish_adamw(step=step, params=params, lr=2e-5, betas=(0.9, 0.95),
                                      eps=1e-8, weight_decay=0.0)

    def version(self, v):
        return push_util.read_version(dte, self.store, v, self.names)

    def close(self):
        self.pub.close()
        self.group.close()


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(tmp_path)
    yield t
    t.close()


def open_receiver(trainer, canonical, tp, rank, fused, fp8, version):
    """A receiver whose buffers hold `canonical` as `version` (None: zeros)."""
    tensors = receiver_tensors(canonical, tp, rank, fused, fp8)
    if version is not None:
        held = holds(canonical, tp, rank, fused, fp8)
        for n, (_, a) in tensors.items():
            a[...] = held[n]
    layout = dte.FusedReceiverLayout(tp) if fused else dte.ReceiverLayout(tp)
    rx = dte.PushReceiver(trainer.group.address, tensors, rank=rank, layout=layout,
                          version=version, timeout=10.0, fp8=fp8)
    return rx, tensors


def check(rx, tensors, canonical, tp, rank, fused, fp8):
    want = holds(canonical, tp, rank, fused, fp8)
    assert set(want) == set(tensors)
    for n, a in want.items():
        got = tensors[n][1]
        bad = np.flatnonzero(got.view(np.uint8).reshape(-1) != a.view(np.uint8).reshape(-1))
        assert bad.size == 0, "%s tp=%d rank %d: %s differs in %d bytes" % (
            "FP8 %s" % fp8.scale_rule if fp8 else "BF16", tp, rank, n, bad.size)


def test_fp8_receivers_equal_the_reference_quantization_of_every_version(trainer):
    v0 = trainer.version(0)
    plain, pow2 = dte.Fp8Options(block=16), dte.Fp8Options(block=32, scale_rule="pow2")
    wide = dte.Fp8Options(block=(8, 32))  # non-square blocks: rows x cols
    big = dte.Fp8Options(block=64)  # not whole blocks of k_proj and v_proj (32 x 64)
    specs = [(2, 0, True, None), (2, 0, True, plain), (2, 1, True, plain), (1, 0, False, pow2),
             (1, 0, True, wide), (1, 0, False, big)]
    rxs = [open_receiver(trainer, v0, *spec, 0) for spec in specs]
    wait_for(lambda: len(trainer.group.status().receivers) == len(specs), 10,
             "the receivers to say hello")
    listed = trainer.group.status().receivers
    assert sorted(r.fp8.scale_rule if r.fp8 else "bf16" for r in listed) == [
        "bf16", "plain", "plain", "plain", "plain", "pow2"]
    assert sorted((r.fp8.block_rows, r.fp8.block_cols) for r in listed if r.fp8) == [
        (8, 32), (16, 16), (16, 16), (32, 32), (64, 64)]
    # The 64 x 64 receiver holds k_proj and v_proj in BF16 (no scales), the
    # other projections in FP8.
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    big_tensors = rxs[-1][1]
    assert big_tensors[k_proj][0] == "BF16" and big.scale_name(k_proj) not in big_tensors
    assert big_tensors["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"
    scales_changed = fp8_quantized = bf16_quantized = 0
    written = [0] * len(specs)
    prev = v0
    quantized_bytes = sum(2 * t.numel() for n, t in v0.items() if quantized(n))
    try:
        for step in range(1, 4):
            r = trainer.step(step)
            assert r.push.pushed == len(specs) and not r.push.dropped, r.push
            # The first push reads the changed tensors' parents whole; the
            # next ones step the block summaries the server kept, reading
            # only the blocks whose scale changed (docs/push.md "Costs").
            if step == 1:
                assert r.push.fp8_parent_reads > 0, r.push
            else:
                assert r.push.fp8_parent_reads == 0, r.push
                assert r.push.fp8_parent_bytes < quantized_bytes / 2, (r.push, quantized_bytes)
            now = trainer.version(r.version)
            for (tp, rank, fused, fp8), (rx, tensors) in zip(specs, rxs):
                rx.wait_for(r.version, timeout=10)
                check(rx, tensors, now, tp, rank, fused, fp8)
            # k_proj of the 64 x 64 receiver: the version's BF16 bits.
            assert np.array_equal(big_tensors[k_proj][1], now[k_proj].view(torch.int16).numpy()
                                  .view(np.uint16)), step
            for k, (tp, rank, fused, fp8) in enumerate(specs):
                step_bytes = changed_bytes(*(holds(x, tp, rank, fused, fp8)
                                             for x in (prev, now)))
                written[k] += sum(step_bytes.values())
                if k == 1:  # FP8 plain, TP 2 rank 0
                    scales_changed += sum(v for n, v in step_bytes.items() if "scale_inv" in n)
                    fp8_quantized += sum(v for n, v in step_bytes.items() if quantized(n) or
                                         "scale_inv" in n)
                    bf16_quantized += sum(v for n, v in changed_bytes(
                        *(holds(x, tp, rank, fused, None) for x in (prev, now))).items()
                        if quantized(n))
            prev = now
        # A receiver that joins now holds nothing: it is told to catch up.
        late = dte.Fp8Options(block=16, scale_rule="pow2")
        rx, tensors = open_receiver(trainer, v0, 2, 1, True, late, None)
        with pytest.raises(dte.MissedPushes):
            rx.wait_for(3, timeout=10)
        rx.catch_up(trainer.store)
        check(rx, tensors, prev, 2, 1, True, late)
        rxs.append((rx, tensors))
        # Each receiver wrote exactly the bytes that changed, scales
        # included; the FP8 receiver's quantized tensors a fraction of a
        # BF16 receiver's.
        assert [rx.status().bytes for rx, _ in rxs[:len(specs)]] == written
        assert 0 < fp8_quantized < bf16_quantized / 4, (fp8_quantized, bf16_quantized)
    finally:
        for rx, _ in rxs:
            rx.close()
    assert scales_changed > 0, "no plain scale changed in three steps: raise the learning rate"


def test_a_pair_whose_dtype_is_wider_than_its_array_is_refused(trainer):
    """("F32", uint8 array): pushes would write 4 bytes per element into
    1-byte ones; refused before the receiver connects."""
    tensors = {"model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", np.zeros(4, np.uint8))}
    with pytest.raises(dte.InvalidArgument, match="dtype F32 \\(4-byte elements\\) does not "
                                                  "match the array's 1-byte uint8"):
        dte.PushReceiver(trainer.group.address, tensors, rank=0, layout=dte.ReceiverLayout(1),
                         timeout=10.0, fp8=dte.Fp8Options(block=32))


def test_a_split_off_the_fp8_blocks_is_refused_naming_tensor_and_block(trainer):
    v0 = trainer.version(0)
    fp8 = dte.Fp8Options(block=32)  # TP 2 ranks hold 16 rows of each k_proj
    rx, _ = open_receiver(trainer, v0, 2, 1, True, fp8, 0)
    try:
        with pytest.raises(dte.InvalidArgument) as e:
            rx.wait_for(1, timeout=10)
        assert "model.layers.0.self_attn.k_proj.weight" in str(e.value)
        assert "FP8 block 32" in str(e.value)
        assert trainer.group.status().receivers == []
    finally:
        rx.close()
