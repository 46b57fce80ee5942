"""tools/bench/gpu_sync.py at a small scale on the CPU backend: the script
that measures a Qwen3-8B-shaped step from trainer state to a receiver's
weights on a GPU (tools/gpu_check.sh runs it at full scale) must keep
working where there is no GPU."""

import importlib.util
import json
import os
import subprocess
import sys

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
SCRIPT = os.path.join(SOURCE, "tools", "bench", "gpu_sync.py")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_sync", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_qwen3_8b_shapes_and_fused_layout():
    g = load_script()
    c = g.QWEN3_8B
    # Qwen3-8B has 8.19 B parameters (untied head).
    assert abs(g.count(c) - 8_190_735_360) < 1e6
    local, where = g.fused_layout(c)
    assert local["model.layers.0.self_attn.qkv_proj.weight"] == ((32 + 8 + 8) * 128, 4096)
    assert local["model.layers.35.mlp.gate_up_proj.weight"] == (2 * 12288, 4096)
    assert where["model.layers.3.self_attn.v_proj.weight"] == (
        "model.layers.3.self_attn.qkv_proj.weight", (32 + 8) * 128)
    assert where["model.layers.3.mlp.up_proj.weight"] == ("model.layers.3.mlp.gate_up_proj.weight",
                                                          12288)
    # An H100's 80 GB holds about half of the layers at 14 bytes a parameter;
    # an H200's 141 GB all of them.
    assert 15 <= g.layers_that_fit(c, 80 << 30, 12 << 30) <= 22
    assert g.layers_that_fit(c, 141 << 30, 12 << 30) == 36


def test_identical_names_the_tensor_that_differs():
    import torch
    g = load_script()
    params = {"a": torch.ones(4, 3), "b": torch.full((2,), 0.5)}
    views = {n: p.to(torch.bfloat16).clone() for n, p in params.items()}
    assert g.identical(views, params) == []
    views["b"][1] = 0.25
    assert g.identical(views, params) == ["b"]


def test_small_run_on_the_cpu_backend_delivers_bit_identical_weights(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, DTE_LIBRARY=os.path.join(BUILD, "sync", "libdte.so"))
    r = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--model", "tiny", "--steps",
                        "2", "--warmup", "1", "--live", "--build-dir", BUILD,
                        "--work", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read(), "the script left its mount behind"
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["layers"] == 2
    steps = rep["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["warmup"] for s in steps] == [
        True, False, False]
    for s in steps:
        assert s["identical"] and s["version"] == s["step"]
        assert 0 < s["changed"] and 0.001 < s["changed_fraction"] < 0.5
        assert s["detect_s"] > 0 and s["encode_s"] > 0 and s["commit_s"] > 0
        assert s["detect_device_bytes"] == 0  # host state: nothing crosses PCIe
        # A push of changed elements is far smaller than the dense weights.
        assert 0 < s["push_bytes"] < rep["baseline_bytes"] / 4
        assert s["deliver_s"] > 0 and s["e2e_s"] >= s["deliver_s"]
    assert rep["live_skipped"] is None, rep["live_skipped"]
    assert [s["step"] for s in rep["live"]] == [4, 5]
    for s in rep["live"]:
        assert s["identical"] and s["entries"] > 0 and s["apply_s"] > 0
    assert rep["baseline_copy_s"] > 0 and rep["baseline_cast_copy_s"] > 0
    assert rep["baseline_bytes"] == 2 * rep["parameters"]
    assert "bit-identical to the trainer's BF16 weights after every delivery: yes" in r.stdout
    assert "arithmetic, not measured: at 400 Gb/s" in r.stdout


def test_cuda_without_a_device_says_so(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--model", "tiny",
                        "--build-dir", BUILD, "--work", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "torch sees no CUDA device" in r.stderr
