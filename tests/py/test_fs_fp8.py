"""FP8 views on a real mount: MOUNT/fp8/vNNNNNNNN and MOUNT/fp8/latest of a
small generated Llama (dte-gen, three versions) read through /dev/fuse.

Every file is read with the real `safetensors` package (fp8_ref.read_safetensors:
its numpy framework, with ml_dtypes' float8_e4m3fn and bfloat16, because
Debian's torch 1.13 has no float8 dtype for framework="pt"). Quantized weights
must be F8_E4M3 / float8_e4m3fn of the BF16 shape and equal, byte for byte,
the independent numpy + ml_dtypes reference (fp8_ref.ref_quantize) of the
committed BF16 tensor; their weight_scale_inv F32 scales bit for bit; every
other tensor and file unchanged except config.json (quantization_config) and
the index (the scales in weight_map, total_size).
"""

import json
import os
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest

from dtectl_util import Dtectl
import fs_util
from fp8_ref import F8, read_safetensors, ref_quantize

STEPS = 2  # versions 0..2
SKIPPED = ("embed", "norm")  # name parts the default policy leaves in BF16
NUMPY_DTYPE = {"F8_E4M3": F8, "F32": np.float32, "BF16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(store, step -> checkpoint dir) of a 4 MiB generated Llama, 3 versions."""
    root = tmp_path_factory.mktemp("fp8")
    step_dir = fs_util.generate(root / "gen", "4MiB", STEPS, "--shard-size", "2MB")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", step_dir(0))
    for step in range(1, STEPS + 1):
        d.ok("commit", step_dir(step))
    return root / "store", step_dir


def quantized(name, dtype, shape, block, keep=(), partial=False):
    """The default policy of store/fp8_policy.h for a dense Llama, with the
    modules of `keep` (dtefs --fp8-keep) also left in BF16, and a weight
    whose rows or columns are not a multiple of `block` too (unless
    partial: dtefs --fp8-partial-blocks)."""
    module = name[: -len(".weight")]
    return (dtype == "BF16" and len(shape) == 2 and name.endswith(".weight")
            and name != "lm_head.weight" and not any(s in module for s in SKIPPED)
            and not set(module.split(".")) & set(keep)
            and (partial or (shape[0] % block == 0 and shape[1] % block == 0)))


def header_order(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert n % 8 == 0
    entries = [(e["data_offsets"][0], k) for k, e in header.items() if k != "__metadata__"]
    return [k for _, k in sorted(entries)], header.get("__metadata__")


def check_safetensors(src, got, block, rule, keep, partial):
    want = read_safetensors(src)
    have = read_safetensors(got)
    names = []
    for name, (dtype, shape, arr) in want.items():
        if not quantized(name, dtype, shape, block, keep, partial):
            assert have[name][:2] == (dtype, shape), name
            assert have[name][2].dtype == NUMPY_DTYPE[dtype], name
            assert have[name][2].tobytes() == arr.tobytes(), name
            continue
        names += [name, name + "_scale_inv"]
        q, s = ref_quantize(arr.view(np.uint16), block, block, rule)
        f8_dtype, f8_shape, f8 = have[name]
        assert (f8_dtype, f8_shape, f8.dtype) == ("F8_E4M3", shape, F8), name
        mismatch = np.flatnonzero(f8.view(np.uint8) != q)
        assert mismatch.size == 0, f"{name}: {mismatch.size} bytes differ, first at {mismatch[0]}"
        s_dtype, s_shape, scales = have[name + "_scale_inv"]
        assert (s_dtype, s_shape, scales.dtype) == ("F32", list(s.shape), np.float32), name
        np.testing.assert_array_equal(scales.view(np.uint32), s.view(np.uint32), err_msg=name)
    assert sorted(have) == sorted(list(want) + [n for n in names if n.endswith("_scale_inv")])
    order, metadata = header_order(got)
    assert metadata == header_order(src)[1]
    for name in names[::2]:  # each weight is followed by its scales
        assert order[order.index(name) + 1] == name + "_scale_inv"
    return len(names) // 2


def check_version(src, fp8_dir, per_layer, block=128, rule="plain", keep=(), partial=False):
    """MOUNT/fp8/vN against the reference; per_layer: how many of each
    layer's 7 projections are quantized."""
    assert sorted(os.listdir(fp8_dir)) == sorted(os.listdir(src))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    quantized_tensors = 0
    tensor_bytes = 0
    for name in sorted(os.listdir(src)):
        got = os.path.join(fp8_dir, name)
        if name.endswith(".safetensors"):
            quantized_tensors += check_safetensors(os.path.join(src, name), got, block, rule,
                                                   keep, partial)
            tensor_bytes += sum(a.nbytes for _, _, a in read_safetensors(got).values())
        elif name not in ("config.json", "model.safetensors.index.json"):
            with open(os.path.join(src, name), "rb") as a, open(got, "rb") as b:
                assert a.read() == b.read(), name
    assert quantized_tensors == 3 * per_layer  # of q, k, v, o, gate, up, down
    shapes = {n: (d, s) for f in os.listdir(src) if f.endswith(".safetensors")
              for n, (d, s, _) in read_safetensors(os.path.join(src, f)).items()}
    kept = [n[: -len(".weight")] for n, (d, s) in shapes.items()
            if d == "BF16" and len(s) == 2 and "layers" in n
            and not quantized(n, d, s, block, keep, partial)]
    with open(os.path.join(fp8_dir, "config.json")) as f:
        got_config = json.load(f)
    q = got_config.pop("quantization_config")
    assert got_config == config
    want_q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [block, block],
              "modules_to_not_convert": sorted(["lm_head", "model.embed_tokens"] + kept)}
    if rule == "pow2":
        want_q["scale_fmt"] = "ue8m0"
    assert q == want_q
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(fp8_dir, "model.safetensors.index.json")) as f:
        got_index = json.load(f)
    weight_map = dict(index["weight_map"])
    for name, shard in index["weight_map"].items():
        if quantized(name, *shapes[name], block, keep, partial):
            weight_map[name + "_scale_inv"] = shard
    assert got_index["weight_map"] == weight_map
    assert got_index["metadata"]["total_size"] == tensor_bytes


def test_every_version_and_latest_read_as_fp8(llama, mount):
    store, step_dir = llama
    m = mount(store)
    fp8 = os.path.join(m.path, "fp8")
    assert "fp8" in os.listdir(m.path)
    assert sorted(os.listdir(fp8)) == ["latest"] + [f"v{v:08d}" for v in range(STEPS + 1)]
    assert os.readlink(os.path.join(fp8, "latest")) == f"v{STEPS:08d}"
    # 128 x 128 blocks divide q_proj and o_proj (256 x 256) only: k_proj
    # and v_proj (64 rows) and the MLP (576 wide) stay BF16.
    for v in range(STEPS + 1):
        check_version(step_dir(v), os.path.join(fp8, f"v{v:08d}"), 2)
    check_version(step_dir(STEPS), os.path.join(fp8, "latest"), 2)
    bf16 = os.stat(os.path.join(m.path, "v00000001", "model-00001-of-00003.safetensors"))
    st = os.stat(os.path.join(fp8, "v00000001", "model-00001-of-00003.safetensors"))
    assert st.st_ino != bf16.st_ino and st.st_size < bf16.st_size
    status = m.status()
    assert status["fp8"]["scale"] == "plain" and status["fp8"]["rows_quantized"] > 0
    assert status["read_errors"] == 0 and status["errors"] == []
    with pytest.raises(OSError):
        open(os.path.join(fp8, "v00000001", "config.json"), "w")


def test_power_of_two_scales_and_other_blocks(llama, mount):
    store, step_dir = llama
    m = mount(store, "--fp8-scale", "pow2", "--fp8-block", "64")
    # 64 x 64 blocks divide every projection (64, 256 and 576 = 9 x 64).
    check_version(step_dir(1), os.path.join(m.path, "fp8", "v00000001"), 7, 64, "pow2")
    assert m.status()["fp8"]["block"] == [64, 64]
    assert m.status()["fp8"]["partial_blocks"] is False


def test_partial_blocks_are_quantized_when_asked_for(llama, mount):
    """dtefs --fp8-partial-blocks (-o fp8_partial_blocks): every projection
    is quantized under 128 x 128 blocks, k_proj, v_proj and the MLP with
    partial last block rows or columns, scales of ceil(rows / 128) x
    ceil(cols / 128)."""
    store, step_dir = llama
    for args in (["--fp8-partial-blocks"], ["-o", "fp8_partial_blocks"]):
        m = mount(store, *args)
        check_version(step_dir(2), os.path.join(m.path, "fp8", "v00000002"), 7, partial=True)
        assert m.status()["fp8"]["partial_blocks"] is True
        m.unmount()


def test_no_fp8_hides_the_tree(llama, mount):
    store, _ = llama
    m = mount(store, "--no-fp8")
    assert "fp8" not in os.listdir(m.path)
    assert not os.path.exists(os.path.join(m.path, "fp8"))
    assert m.status()["fp8"] is None


def test_kept_modules_stay_bf16_in_the_views(llama, mount):
    """--fp8-keep o_proj and -o fp8_keep=down_proj: those weights stay BF16,
    are listed in modules_to_not_convert, and have no scales."""
    store, step_dir = llama
    m = mount(store, "--fp8-keep", "o_proj", "-o", "fp8_keep=down_proj", "--fp8-block", "64")
    check_version(step_dir(2), os.path.join(m.path, "fp8", "v00000002"), 5, 64,
                  keep=("o_proj", "down_proj"))
    assert m.status()["fp8"]["keep_modules"][-2:] == ["o_proj", "down_proj"]


@pytest.mark.parametrize("args,bad", [
    (["--fp8-keep", "self_attn.o_proj"], "self_attn.o_proj"),
    (["--fp8-keep", ""], ""),
    (["-o", "fp8_keep="], ""),
    (["-o", "fp8_keep=o_proj:"], ""),
    (["-o", "fp8_keep=o_proj::down_proj"], ""),
])
def test_a_kept_module_must_be_one_path_component(llama, tmp_path, args, bad):
    store, _ = llama
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([str(fs_util.binary()), str(store), str(tmp_path / "mnt"), "-f",
                        "--cache-dir", str(tmp_path / "cache")] + args,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert f'bad --fp8-keep (fp8_keep=) "{bad}"' in r.stderr
