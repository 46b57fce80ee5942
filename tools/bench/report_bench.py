#!/opt/dte/venv/bin/python
"""dtectl stats and dtectl report on a long run: time and peak memory against
the number of versions, the report against the two stats runs it reads, in
the same run.

Builds a store of --versions versions of a small Llama-shaped model (67
tensors over 8 layers, 238 K elements; ~1.6% of elements flip each
version) with the Python publisher's import_checkpoint (in one process),
then measures wall time and peak RSS (/usr/bin/time) of:
  stats --by version --csv, stats --by layer-kind --csv   (what the report reads)
  report -o run.html
at the sizes given by --at (prefixes of the same store, via --versions).

Usage: /opt/dte/venv/bin/python tools/bench/report_bench.py [--versions 10001] [--at 100,1000,10000]
       [--build-dir build] [--work DIR]
"""

import os
import sys
import time

import harness as h

SOURCE = h.ROOT


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


def main():
    ap = h.parser(__doc__, json_arg=False)
    ap.add_argument("--versions", type=int, default=10001)
    ap.add_argument("--at", default="100,1000,10000")
    ap.add_argument("--work", help="where the temporary work directory goes")
    a = ap.parse_args()
    dtectl = h.Tools(a.build_dir, names=("dtectl",)).dtectl
    with h.Scratch(prefix="dte-report-bench-", parent=a.work) as work:
        store, cache = build_store(work.path, a.versions,
                                   os.path.join(a.build_dir, "sync", "libdte.so"))
        common = ["--store", store, "--cache-dir", cache]
        rows = []
        for n in [int(x) for x in a.at.split(",")]:
            sel = ["--versions", "0..%d" % (n - 1)]
            by_version = h.measure([dtectl, "stats", "--csv", "--by", "version"] + common + sel)
            by_kind = h.measure([dtectl, "stats", "--csv", "--by", "layer-kind"] + common + sel)
            rep = h.measure([dtectl, "report", "-o", work("run.html")] + common + sel)
            both = by_version.seconds + by_kind.seconds
            rows.append([n, "%.2f s" % by_version.seconds, "%.2f s" % by_kind.seconds,
                         "%.2f s" % both, "%.2f s" % rep.seconds, "%.2fx" % (rep.seconds / both),
                         "%.0f MiB" % (rep.peak_rss / h.MIB),
                         "%.0f MiB" % (max(by_version.peak_rss, by_kind.peak_rss) / h.MIB)])
            print(h.md_row(rows[-1]), file=sys.stderr, flush=True)
    print(h.md_table(["versions", "stats --by version", "stats --by layer-kind", "both", "report",
                      "report / both", "report peak RSS", "stats peak RSS"], rows))


if __name__ == "__main__":
    main()
