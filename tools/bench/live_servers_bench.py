#!/opt/dte/venv/bin/python
"""The two-phase live apply of a server over two mounts (docs/live.md,
"Servers on several hosts") against the one-phase applies it replaces.

Builds live_bench's store (a dte-gen Llama, steps 0..BASE+1 of ~1.5% BF16
changes each), copies it (two hosts, each with its own store), mounts both
with dtefs, and registers a TP 2 server's ranks (vLLM's fused layout, in
/dev/shm, from this process) in three ways, each measured forward one step
(BASE -> BASE+1) and back (a rollback of one step), warm (no cache drop):

  independent  rank 0 on mount A and rank 1 on mount B, no server: one
               dte.apply on A, then one on B (the baseline: what a
               controller did before servers spanned mounts);
  two-phase    the same ranks as server "s": dte.apply_servers([A, B])
               (prepare both, check the union, commit both);
  one mount    both ranks on A as server "s": one dte.apply (for scale).

Every measured apply is checked: each rank's buffers against the target
sharded here. Reports the medians and the ratio two-phase / independent of
the same repetitions.

Usage: /opt/dte/venv/bin/python tools/bench/live_servers_bench.py [--build-dir build]
       [--size 1GiB] [--reps 5] [--work DIR] [--json OUT]
"""
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

import harness as h
import live_bench as lb

sys.path.insert(0, h.PY_PATH)


def rank_weights(dte, mount, base, rank, tag):
    """Rank `rank` of TP 2 at vBASE in a SharedWeights object."""
    d = os.path.join(mount, f"v{base:08d}")

    def fill(state):
        parts = dict(lb.shard(state, lb.geometry(d), 2, rank))
        w = dte.SharedWeights(f"dte-servers-bench-{os.getpid()}-{tag}-{rank}",
                              {k: ("BF16", a.shape) for k, a in parts.items()})
        for k, a in parts.items():
            w.array(k)[...] = a
        return w
    return lb.with_version(d, fill)


def check(w, mount, v, rank):
    d = os.path.join(mount, f"v{v:08d}")

    def cmp(state):
        for name, want in lb.shard(state, lb.geometry(d), 2, rank):
            if not np.array_equal(w.array(name), want):
                raise RuntimeError(f"BUG: rank {rank} {name} differs from v{v}")
    lb.with_version(d, cmp)


def layout(dte, mounts, base, server, tag):
    """(receivers, weights): rank r on mounts[r]."""
    rxs, ws = [], []
    for rank, m in enumerate(mounts):
        w = rank_weights(dte, m, base, rank, tag)
        rx = dte.LiveReceiver(m, tp=2, rank=rank, server=server, server_size=2 if server else 1)
        rx.register_shared(w, version=base)
        rxs.append(rx)
        ws.append(w)
    return rxs, ws


def close(rxs, ws):
    for rx in rxs:
        rx.close()
    for w in ws:
        w.close()
        w.unlink()


def main():
    ap = h.parser(__doc__)
    ap.add_argument("--work", default="/var/tmp/dte-live-servers-bench")
    ap.add_argument("--size", default="1GiB", help="BF16 bytes of the model")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--base", type=int, default=8)
    a = ap.parse_args()
    a.model_args = ["--size", a.size, *lb.GEOMETRY]
    a.shard_size = "5GB"
    os.makedirs(a.work, exist_ok=True)
    tools = h.Tools(a.build_dir, os.path.join(a.work, "bin"),
                    names=("dtectl", "dtefs", "dtegen", "libdte"))
    os.environ["DTE_LIBRARY"] = tools.libdte
    import dte
    lb.check_model(tools, a.model_args, 2)
    stores = [os.path.join(a.work, "store-a"), os.path.join(a.work, "store-b")]
    caches = [os.path.join(a.work, "cache-a"), os.path.join(a.work, "cache-b")]
    lb.build_store(tools, a, stores[0], caches[0], a.base + 1)
    shutil.rmtree(stores[1], ignore_errors=True)
    shutil.copytree(stores[0], stores[1], symlinks=True)
    mounts, paths = [], []
    try:
        for i in range(2):
            m = h.dtefs_mount(tools, stores[i], os.path.join(a.work, f"mnt{i}"),
                              os.path.join(a.work, f"fscache{i}"), "--live-version", a.base,
                              log_path=os.path.join(a.work, f"dtefs{i}.log")).start()
            mounts.append(m)
            paths.append(m.path)
        res = {}
        fwd, back = a.base + 1, a.base

        def measure(name, mnts, server, move):
            rxs, ws = layout(dte, mnts, a.base, server, name)
            try:
                move(fwd)  # the first apply after registering maps the buffers in
                move(back)
                for _ in range(a.reps):
                    for v in (fwd, back):
                        t0 = time.perf_counter()
                        move(v)
                        res.setdefault(f"{name}_{'fwd' if v == fwd else 'back'}", []).append(
                            time.perf_counter() - t0)
                        for r, w in enumerate(ws):
                            check(w, mnts[r], v, r)
            finally:
                close(rxs, ws)

        measure("independent", paths, None, lambda v: [dte.apply(p, v) for p in paths])
        measure("two_phase", paths, "s", lambda v: dte.apply_servers(paths, v))
        measure("one_mount", [paths[0], paths[0]], "s", lambda v: dte.apply(paths[0], v))
    finally:
        for m in mounts:
            m.unmount()
    out = {k: statistics.median(v) for k, v in res.items()}
    ratios = {d: [t / i for t, i in zip(res[f"two_phase_{d}"], res[f"independent_{d}"])]
              for d in ("fwd", "back")}
    print(f"model {a.size}, TP 2 over two mounts, {a.reps} reps, warm; medians:")
    for k, v in sorted(out.items()):
        print(f"  {k:20s} {v * 1000:8.1f} ms")
    for d, r in ratios.items():
        print(f"  two-phase / independent ({d}): median {statistics.median(r):.2f} "
              f"(range {min(r):.2f}-{max(r):.2f})")
    print(f"  rollback / forward (two-phase): {out['two_phase_back'] / out['two_phase_fwd']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"medians_s": out, "ratios": ratios, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
