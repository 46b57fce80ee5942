#!/opt/dte/venv/bin/python
"""dtectl stats and dtectl report on a long run: time and peak memory against
the number of versions, the report against the two stats runs it reads, in
the same run.

Builds a store of --versions versions of a small Llama-shaped model (67
tensors over 8 layers, 238 K elements; ~1.6% of elements flip each
version) with the Python publisher's import_checkpoint (in one process),
then measures with /usr/bin/time -v:
  stats --by version --csv, stats --by layer-kind --csv   (what the report reads)
  report -o run.html
at the sizes given by --at (prefixes of the same store, via --versions).

Usage: /opt/dte/venv/bin/python tools/bench/report_bench.py [--versions 10001] [--at 100,1000,10000]
       [--build-dir build] [--work DIR]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.normpath(os.path.join(HERE, "..", ".."))


def build_store(root, versions, lib):
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    os.environ.setdefault("DTE_LIBRARY", lib)
    import numpy as np
    import dte
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    names = []
    for layer in range(8):
        for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names.append("model.layers.%d.%s.weight" % (layer, k))
        names.append("model.layers.%d.input_layernorm.weight" % layer)
    names += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    state = {n: rng.integers(0, 65535, size=(64,) if "norm" in n else (64, 64), dtype=np.uint16)
             for n in names}
    ckpt = os.path.join(root, "ckpt")
    os.makedirs(ckpt)
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}\n')
    store, cache = os.path.join(root, "store"), os.path.join(root, "cache")
    pub = dte.Publisher(store, cache_dir=cache)
    t0 = time.time()
    for _ in range(versions):
        for a in state.values():
            flat = a.reshape(-1)
            flat[rng.integers(0, flat.size, size=max(1, flat.size // 60))] ^= 1
        # F16 as the element type (numpy has no BF16): the same 2-byte raw bits.
        save_file({n: a.view(np.float16) for n, a in state.items()},
                  os.path.join(ckpt, "model.safetensors"))
        pub.import_checkpoint(ckpt)
    pub.close()
    print("store: %d versions in %.1f s" % (versions, time.time() - t0), file=sys.stderr)
    return store, cache


def timed(argv):
    r = subprocess.run(["/usr/bin/time", "-v"] + argv, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit("%s failed:\n%s" % (" ".join(argv), r.stderr))
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", r.stderr)
    seconds = (int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3)))
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return seconds, kib / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=10001)
    ap.add_argument("--at", default="100,1000,10000")
    ap.add_argument("--build-dir", default=os.path.join(SOURCE, "build"))
    ap.add_argument("--work")
    a = ap.parse_args()
    dtectl = os.path.join(a.build_dir, "tools", "dtectl")
    root = tempfile.mkdtemp(prefix="dte-report-bench-", dir=a.work)
    try:
        store, cache = build_store(root, a.versions, os.path.join(a.build_dir, "sync", "libdte.so"))
        common = ["--store", store, "--cache-dir", cache]
        out = os.path.join(root, "run.html")
        print("| versions | stats --by version | stats --by layer-kind | both | report | "
              "report / both | report peak RSS | stats peak RSS |")
        print("|---|---|---|---|---|---|---|---|")
        for n in [int(x) for x in a.at.split(",")]:
            sel = ["--versions", "0..%d" % (n - 1)]
            t1, m1 = timed([dtectl, "stats", "--csv", "--by", "version"] + common + sel)
            t2, m2 = timed([dtectl, "stats", "--csv", "--by", "layer-kind"] + common + sel)
            t3, m3 = timed([dtectl, "report", "-o", out] + common + sel)
            print("| %d | %.2f s | %.2f s | %.2f s | %.2f s | %.2fx | %.0f MiB | %.0f MiB |" % (
                n, t1, t2, t1 + t2, t3, t3 / (t1 + t2), m3, max(m1, m2)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
