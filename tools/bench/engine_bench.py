"""CPU engine throughput vs memory bandwidth and vs PyTorch, in one run.

Runs `engine_bench kernel ELEMENTS DIR` (memory-read bandwidth, the fused
detector and the whole per-tensor engine on one synthetic AdamW step), then
times a PyTorch implementation of the same steps -- AdamW inverse, BF16 cast
of both, bit compare, nonzero, gather of the new values -- on the very same
arrays, with as many threads. All throughputs are bytes of optimizer state
(theta, m, v: 12 B per element) per second of wall time.

Usage: /opt/dte/venv/bin/python tools/bench/engine_bench.py [ELEMENTS] [BUILD_DIR]
(default 67108864 elements = 768 MiB of state; BUILD_DIR default
$DTE_BUILD_DIR or build).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch


def torch_detect(theta, m, v, p):
    """The engine's steps in PyTorch: inverse, cast, compare, nonzero, gather."""
    bc1 = 1 - p["beta1"] ** p["step"]
    bc2_sqrt = (1 - p["beta2"] ** p["step"]) ** 0.5
    step_size = p["lr"] / bc1
    denom = (v.sqrt() / bc2_sqrt).add_(p["eps"])
    prev = (theta - (m * -step_size) / denom) / (1 - p["lr"] * p["weight_decay"])
    old = prev.to(torch.bfloat16).view(torch.int16)
    new = theta.to(torch.bfloat16).view(torch.int16)
    idx = torch.nonzero(old != new).squeeze(1)
    return idx, new[idx]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 26
    build = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("DTE_BUILD_DIR", "build")
    exe = os.path.join(build, "tools", "bench", "engine_bench")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        engine = json.loads(subprocess.run([exe, "kernel", str(n), d], check=True,
                                           capture_output=True, text=True).stdout)
        p = json.load(open(os.path.join(d, "params.json")))
        arrays = [torch.from_numpy(np.fromfile(os.path.join(d, f), dtype=np.float32))
                  for f in ("theta.f32", "m.f32", "v.f32")]
    torch.set_num_threads(engine["threads"])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        idx, _vals = torch_detect(*arrays, p)
        best = min(best, time.perf_counter() - t0)
    state = 12 * n
    out = dict(engine)
    out["torch_gbs"] = state / best / 1e9
    out["torch_changed"] = int(idx.numel())
    out["torch_version"] = torch.__version__
    out["engine_fraction_of_bandwidth"] = engine["engine_gbs"] / engine["read_bandwidth_gbs"]
    out["detect_fraction_of_bandwidth"] = engine["detect_gbs"] / engine["read_bandwidth_gbs"]
    out["engine_vs_torch"] = engine["engine_gbs"] / out["torch_gbs"]
    out["detect_vs_torch"] = engine["detect_gbs"] / out["torch_gbs"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
