"""tools/fp8_hf_check.py, the FP8 check tools/gpu_check.sh runs with
transformers on a GPU, run here without --gpu so it cannot rot: on a real
mount it finds MOUNT/fp8/vN equal to the reference quantization of MOUNT/vN
(both scale rules), and it fails, naming the tensor, on a copy of the FP8
directory with one weight byte changed, one scale changed, or a
config.json that does not list the modules left in BF16, and on a mount
that quantizes partial blocks (dtefs --fp8-partial-blocks), which
transformers cannot load."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fs_util
from dtectl_util import Dtectl

SOURCE = Path(os.environ.get("DTE_SOURCE_DIR", Path(__file__).resolve().parents[2]))
CHECK = SOURCE / "tools" / "fp8_hf_check.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8check")
    step = fs_util.generate(root / "gen", "2MiB", 1, "--hidden", "256", "--intermediate", "640")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", step(0))
    d.ok("commit", step(1))
    return root / "store"


def check(bf16, fp8, *args):
    return subprocess.run([sys.executable, str(CHECK), "--bf16", str(bf16), "--fp8", str(fp8),
                           *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("rule", ["plain", "pow2"])
def test_mount_equals_the_reference(tmp_path, store, rule):
    with fs_util.mounts(tmp_path) as start:
        m = start(store, "--fp8-scale", rule)
        r = check(Path(m.path) / "v00000001", Path(m.path) / "fp8" / "v00000001")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal the reference quantization" in r.stdout and f"({rule} scales" in r.stdout


def test_partial_blocks_fail_naming_the_tensor(tmp_path, store):
    """k_proj and v_proj (64 x 256) are not whole 128 x 128 blocks: the
    default view keeps them BF16 (and lists them); a partial-blocks mount
    quantizes them, which the check refuses."""
    with fs_util.mounts(tmp_path) as start:
        m = start(store)
        config = json.loads((Path(m.path) / "fp8" / "v00000001" / "config.json").read_text())
        assert "model.layers.0.self_attn.k_proj" in (
            config["quantization_config"]["modules_to_not_convert"])
        m = start(store, "--fp8-partial-blocks")
        r = check(Path(m.path) / "v00000001", Path(m.path) / "fp8" / "v00000001")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "k_proj.weight [64, 256] is F8_E4M3 but not whole 128x128 blocks" in r.stdout, r.stdout


def copy_fp8(tmp_path, store):
    """MOUNT/v00000001 and a writable copy of MOUNT/fp8/v00000001."""
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    with fs_util.mounts(tmp_path / "m") as start:
        m = start(store)
        shutil.copytree(Path(m.path) / "v00000001", bf16)
        shutil.copytree(Path(m.path) / "fp8" / "v00000001", fp8)
    return bf16, fp8


def flip_byte(path, name, offset_in_tensor):
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        pos = 8 + n + header[name]["data_offsets"][0] + offset_in_tensor
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ 0x01]))


def test_a_changed_byte_scale_or_config_fails_naming_it(tmp_path, store):
    bf16, fp8 = copy_fp8(tmp_path, store)
    assert check(bf16, fp8).returncode == 0
    target = fp8 / "model.safetensors"
    name = "model.layers.0.mlp.down_proj.weight"
    flip_byte(target, name, 1000)
    r = check(bf16, fp8)
    assert r.returncode == 1 and name in r.stdout and "1 bytes" in r.stdout, r.stdout
    flip_byte(target, name, 1000)
    flip_byte(target, name + "_scale_inv", 0)
    r = check(bf16, fp8)
    assert r.returncode == 1 and name + "_scale_inv differs" in r.stdout, r.stdout
    flip_byte(target, name + "_scale_inv", 0)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = []
    (fp8 / "config.json").write_text(json.dumps(config))
    r = check(bf16, fp8)
    assert r.returncode == 1 and "modules_to_not_convert lacks" in r.stdout, r.stdout
