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
Needs a build (--build-dir: DTE_BUILD_DIR, default build/) with dtefs, dtectl and dte-gen,
and /dev/fuse.
"""
import os
import statistics
import sys

import harness as h

GB = h.GB


def measure(tools, store, work, args, subdir, reader, load):
    """One cold read of every file of MOUNT/subdir (h.Load: a quiet machine
    first, read again while other processes used too much CPU); returns a
    dict of figures."""
    state = {}

    def prepare():
        if state.get("m"):
            state.pop("m").unmount()
        cache = os.path.join(work, "dtefs-cache")
        h.remove(cache)
        h.drop_from_page_cache([os.path.join(store, "blobs")])
        state["m"] = m = h.dtefs_mount(tools, store, os.path.join(work, "mnt"), cache,
                                       "--snapshot-every", 0, *args).start()
        d = os.path.join(m.path, subdir)
        state["paths"] = [os.path.join(d, n) for n in sorted(os.listdir(d))]
        for p in state["paths"]:
            os.stat(p)  # builds the FP8 view (reads headers and JSON) before timing
        state["cpu0"] = m.cpu_seconds()

    def body():
        return reader(state["paths"])

    attempts0 = load.runs + load.retried
    try:
        n, secs = load.timed(prepare, body, lambda: [state["m"].proc.pid])
        m = state["m"]
        st = m.status()
        return {"seconds": secs, "bytes": n, "cpu": m.cpu_seconds() - state["cpu0"],
                "peak_rss": h.proc_status(m.proc.pid, "VmHWM"),
                "blocks_decoded": st["blocks_decoded"], "fp8": st["fp8"],
                "read_errors": st["read_errors"], "other_cores": load.other[-1],
                "attempts": load.runs + load.retried - attempts0}
    finally:
        if state.get("m"):
            state.pop("m").unmount()


def bench(tools, store, work, version, scale, reps, load):
    readers = {"sequential": h.read_sequential, "parallel": h.read_parallel}
    sides = {"bf16": f"v{version:08d}", "fp8": f"fp8/v{version:08d}"}
    args = ["--fp8-scale", scale]
    runs = {(r, s): [] for r in readers for s in sides}
    for rep in range(reps):
        for rname, reader in readers.items():
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for side in order:
                res = measure(tools, store, work, args, sides[side], reader, load)
                if res["read_errors"]:
                    sys.exit(f"{side}: {res['read_errors']} read errors")
                runs[(rname, side)].append(res)
        h.log(f"rep {rep + 1}/{reps} done")
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
    p = h.parser(__doc__.split("\n\n")[0], work=None)
    p.add_argument("--size", default="1GiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scale", default="plain", choices=["plain", "pow2"])
    h.add_quiet_args(p, max_busy=0.15, quiet_timeout=60.0, max_other=0.3, retries=2)
    a = p.parse_args()
    # A temporary work directory is removed afterwards; a given one is kept (its store reused).
    work = h.Scratch(a.work, prefix="fp8-read-", keep=a.keep or a.work is not None)
    with work:
        tools = h.Tools(a.build_dir, work("bin"))
        store = work("store")
        h.commit_chain(tools, store, work("dtectl-cache"),
                       ["--size", a.size, "--shard-size", "512MB"], a.steps, gen_dir=work("gen"),
                       batch=a.steps + 1, stamp=work("model.json"))
        load = h.Load(a)
        results = bench(tools, store, work.path, a.steps, a.scale, a.reps, load)
    print(f"size {a.size}, version v{a.steps:08d} (anchor + {a.steps}), scale {a.scale}, "
          f"{a.reps} reps, {os.cpu_count()} CPUs; {load.report()}")
    print(table(results))
    h.write_json(a.json, results)


if __name__ == "__main__":
    main()
