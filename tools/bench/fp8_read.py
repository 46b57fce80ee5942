#!/opt/dte/venv/bin/python
"""Cold read of a version in FP8 (MOUNT/fp8/vN) against the same version in
BF16 (MOUNT/vN), through dtefs, in the same run.

Generates a dte-gen Llama (--size, default 1GiB) and commits --steps + 1
versions as one chain (an anchor and sparse deltas), then for the newest
version times, --reps times and alternating which goes first, a cold read of
every file of the version:
  bf16   MOUNT/vNNNNNNNN/*: what dtefs serves from the delta chain;
  fp8    MOUNT/fp8/vNNNNNNNN/*: the same BF16 blocks read, hash-checked and
         quantized by block rows (E4M3 weights + FP32 scales), about half the
         bytes served.
Cold: before each read the mount is made afresh (empty block cache and FUSE
page cache) and every blob of the store is written back and dropped from the
page cache (posix_fadvise DONTNEED). Readers: one thread reading the files in
order in 1 MiB read(2) calls ("sequential"), and one thread per file
("parallel", like tensor-parallel ranks loading). Reports the medians
(seconds, GB/s of bytes served and of BF16 bytes read), the ratio FP8 time /
BF16 time, the daemon's CPU seconds and its peak RSS (VmHWM).

Usage: /opt/dte/venv/bin/python tools/bench/fp8_read.py [--size 1GiB] [--steps 3] [--max-busy 0.15]
       [--reps 3] [--scale plain|pow2] [--work DIR] [--keep] [--json OUT]
Needs a build (DTE_BUILD_DIR, default build/) with dtefs, dtectl and dte-gen,
and /dev/fuse.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chain_bench  # noqa: E402
import fs_bench_util as fu  # noqa: E402
from chain_bench import Mount, cpu_seconds, drop_from_page_cache, run  # noqa: E402

GB = 1e9


def copy_tools(work):
    """Copies dtefs, dtectl and dte-gen into work/bin, so that a rebuild in the
    build directory cannot swap them in the middle of a run."""
    bin_dir = os.path.join(work, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    for name in ("DTEFS", "DTECTL", "DTEGEN"):
        built = getattr(chain_bench, name)
        if not os.access(built, os.X_OK):
            sys.exit(f"{built} is not built")
        setattr(chain_bench, name, shutil.copy2(built, bin_dir))


def build_store(work, size, steps):
    """Commits steps 0..steps of a dte-gen model as one chain (reused if there)."""
    store, cache = os.path.join(work, "store"), os.path.join(work, "dtectl-cache")
    if os.path.isdir(os.path.join(store, "manifests")):
        n = len(json.loads(run([chain_bench.DTECTL, "log", "--store", store, "--cache-dir", cache,
                                "--json"]).stdout))
        if n == steps + 1:
            return store
        sys.exit(f"{store} holds {n} versions, not {steps + 1}: remove it or use another --work")
    gen = os.path.join(work, "gen")
    t0 = time.monotonic()
    run([chain_bench.DTEGEN, "--out", gen, "--size", size, "--steps", str(steps),
         "--shard-size", "512MB", "-q"])
    for step in range(steps + 1):
        run([chain_bench.DTECTL, "import" if step == 0 else "commit", "--store", store,
             "--cache-dir", cache, "-q", os.path.join(gen, f"step-{step:06d}")])
    print(f"  committed v0..v{steps} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    shutil.rmtree(gen, ignore_errors=True)
    return store


def measure(store, work, args, subdir, reader, load):
    """One cold read of every file of MOUNT/subdir; returns a dict of figures.
    Waits for a quiet machine first and reads again (at most load.retries
    more times) when other processes used more than load.max_other cores."""
    for attempt in range(load.retries + 1):
        res = measure_once(store, work, args, subdir, reader, load)
        if res["other_cores"] <= load.max_other:
            break
    res["attempts"] = attempt + 1
    return res


def measure_once(store, work, args, subdir, reader, load):
    mnt = os.path.join(work, "mnt")
    cache = os.path.join(work, "dtefs-cache")
    shutil.rmtree(cache, ignore_errors=True)
    drop_from_page_cache([os.path.join(store, "blobs")])
    with Mount(store, mnt, cache, ["--snapshot-every", 0, *args]) as m:
        d = os.path.join(mnt, subdir)
        paths = [os.path.join(d, n) for n in sorted(os.listdir(d))]
        for p in paths:
            os.stat(p)  # builds the FP8 view (reads headers and JSON) before timing
        load.quiet.wait()
        cpu0 = cpu_seconds(m.proc.pid)
        with fu.OtherLoad([m.proc.pid]) as other:
            n, secs = reader(paths)
        st = m.status()
        return {"seconds": secs, "bytes": n, "cpu": cpu_seconds(m.proc.pid) - cpu0,
                "peak_rss": fu.proc_status(m.proc.pid, "VmHWM"),
                "blocks_decoded": st["blocks_decoded"], "fp8": st["fp8"],
                "read_errors": st["read_errors"], "other_cores": other.cores}


class Load:
    """How timed runs deal with the rest of a shared machine."""

    def __init__(self, a):
        self.quiet = fu.QuietWaiter(a.max_busy, a.quiet_timeout)
        self.max_other, self.retries = a.max_other, a.retries


def bench(store, work, version, scale, reps, load):
    readers = {"sequential": fu.read_sequential, "parallel": fu.read_parallel}
    sides = {"bf16": f"v{version:08d}", "fp8": f"fp8/v{version:08d}"}
    args = ["--fp8-scale", scale]
    runs = {(r, s): [] for r in readers for s in sides}
    for rep in range(reps):
        for rname, reader in readers.items():
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for side in order:
                res = measure(store, work, args, sides[side], reader, load)
                if res["read_errors"]:
                    sys.exit(f"{side}: {res['read_errors']} read errors")
                runs[(rname, side)].append(res)
        print(f"  rep {rep + 1}/{reps} done", file=sys.stderr)
    out = {}
    for (rname, side), rs in runs.items():
        secs = statistics.median(r["seconds"] for r in rs)
        bf16_bytes = runs[(rname, "bf16")][0]["bytes"]  # both sides read all of them
        out.setdefault(rname, {})[side] = {
            "seconds": secs, "all_seconds": [r["seconds"] for r in rs],
            "bytes": rs[0]["bytes"], "gbps": rs[0]["bytes"] / secs / GB,
            "bf16_gbps": bf16_bytes / secs / GB,
            "cpu": statistics.median(r["cpu"] for r in rs),
            "peak_rss": max(r["peak_rss"] for r in rs),
            "quantize_seconds": statistics.median(r["fp8"]["quantize_ns"] for r in rs) / 1e9,
            "rows_quantized": rs[0]["fp8"]["rows_quantized"],
            "other_cores": statistics.median(r["other_cores"] for r in rs),
            "attempts": sum(r["attempts"] for r in rs)}
    for rname in readers:
        out[rname]["ratio"] = out[rname]["fp8"]["seconds"] / out[rname]["bf16"]["seconds"]
        out[rname]["ratios"] = [f["seconds"] / b["seconds"] for f, b in
                                zip(runs[(rname, "fp8")], runs[(rname, "bf16")])]
    return out


def table(results):
    lines = ["| reader | side | seconds | GB/s served | GB/s of the BF16 version | dtefs CPU s | "
             "quantize s | peak RSS MiB | other load (cores) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rname, r in results.items():
        for side in ("bf16", "fp8"):
            s = r[side]
            lines.append(f"| {rname} | {side} | {s['seconds']:.2f} | {s['gbps']:.2f} | "
                         f"{s['bf16_gbps']:.2f} | {s['cpu']:.1f} | {s['quantize_seconds']:.2f} | "
                         f"{s['peak_rss'] / 2**20:.0f} | {s['other_cores']:.2f} |")
        ratios = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(f"| {rname} | FP8 / BF16 time | {r['ratio']:.2f} ({ratios}) | | | | | | |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scale", default="plain", choices=["plain", "pow2"])
    p.add_argument("--work")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json")
    fu.add_quiet_args(p, max_busy=0.15, quiet_timeout=60.0, max_other=0.3, retries=2)
    a = p.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="fp8-read-")
    copy_tools(work)
    fu.install_cleanup()
    try:
        store = build_store(work, a.size, a.steps)
        load = Load(a)
        results = bench(store, work, a.steps, a.scale, a.reps, load)
    finally:
        fu.unmount_all()
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"size {a.size}, version v{a.steps:08d} (anchor + {a.steps}), scale {a.scale}, "
          f"{a.reps} reps, {os.cpu_count()} CPUs; waited {load.quiet.waited:.0f} s for a quiet "
          f"machine, gave up {load.quiet.gave_up} times")
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
