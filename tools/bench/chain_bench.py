#!/opt/dte/venv/bin/python
"""Cold sequential read time of versions far from their anchor through dtefs.

Generates a dte-gen sequence (an anchor and STEPS sparse deltas of about 1.5%
changed BF16 elements each), commits it as one chain, mounts it with dtefs,
and for versions anchor+1, +8, +16, +32, +63, +64 times a cold sequential
read of the whole version (every file, 1 MiB reads), with materialized
snapshots on (the default, a snapshot every 8 versions) and off
(--snapshot-every 0). Ratios are against anchor+1 in the same mode and run.

Cold: before each timed read the mount is unmounted and mounted again (an
empty FUSE page cache and block cache), and every blob of the store and
every snapshot file is written back and dropped from the page cache with
posix_fadvise(DONTNEED). Each figure is the median of --reps reads.

Usage: /opt/dte/venv/bin/python tools/bench/chain_bench.py [--size 256MiB] [--steps 64]
       [--reps 3] [--every 8] [--work DIR] [--keep] [--json OUT]
Needs a build (--build-dir: DTE_BUILD_DIR, default build/) with dtefs, dtectl and dte-gen,
and /dev/fuse.
"""
import os
import statistics
import sys
import tempfile
import time

import harness as h

TARGETS = (1, 8, 16, 32, 63, 64)
BATCH = 16  # steps generated at a time (bounds the disk the plain checkpoints take)


def build_store(tools, work, size, steps):
    """Commits steps 0..steps as one chain (reused when built with the same options)."""
    store = os.path.join(work, "store")
    t0 = time.monotonic()
    h.commit_chain(tools, store, os.path.join(work, "dtectl-cache"), ["--size", size], steps,
                   gen_dir=os.path.join(work, "gen"), batch=BATCH,
                   stamp=os.path.join(work, "model.json"))
    h.log(f"store of v0..v{steps} ready ({time.monotonic() - t0:.0f} s)")
    return store


def wait_snapshots(m, want, timeout=1800):
    def ready():
        s = m.status()["snapshots"]
        return s is not None and s["versions"] == want and s["building"] is None
    h.wait_for(ready, timeout, f"snapshots of {want}")


def expected_snapshots(steps, every, keep):
    """Versions dtefs snapshots in a chain v0..v`steps`, keeping `keep`."""
    marked = list(range(every, steps + 1, every)) if every else []
    return marked[-keep:] if keep else []


def build_snapshots(tools, store, work, args, expect):
    """Mounts once to build the snapshots; returns (cache dir, seconds, snapshot status)."""
    cache = os.path.join(work, "cache-on")
    h.remove(cache)
    with h.dtefs_mount(tools, store, os.path.join(work, "mnt"), cache, *args) as m:
        t0 = time.monotonic()
        wait_snapshots(m, expect)
        return cache, time.monotonic() - t0, m.status()["snapshots"]


def measure(tools, store, work, cache, args, expect, v):
    """One cold read of version v; returns (seconds, dtefs CPU seconds, bytes, status after)."""
    mnt = os.path.join(work, "mnt")
    h.drop_from_page_cache([os.path.join(store, "blobs"), cache])
    with h.dtefs_mount(tools, store, mnt, cache, *args) as m:
        if expect:
            wait_snapshots(m, expect, 60)  # taken in from disk, none built
        cpu0 = m.cpu_seconds()
        n, secs = h.read_dir(os.path.join(mnt, f"v{v:08d}"))
        return secs, m.cpu_seconds() - cpu0, n, m.status()


def bench(tools, store, work, steps, every, reps):
    """Both modes; the reads of all versions and modes are interleaved, rep
    by rep, so that load from elsewhere spreads evenly over them."""
    keep = len(expected_snapshots(steps, every, 10**9))
    expect = expected_snapshots(steps, every, keep)
    modes = {"on": ["--snapshot-every", every, "--snapshots", keep],
             "off": ["--snapshot-every", 0]}
    cache_on, build_secs, snap = build_snapshots(tools, store, work, modes["on"], expect)
    caches = {"on": cache_on, "off": os.path.join(work, "cache-off")}
    results = {mode: {"rows": {v: {"all_seconds": [], "all_cpu": []} for v in TARGETS}}
               for mode in modes}
    for rep in range(reps):
        for v in TARGETS:
            for mode, args in modes.items():
                secs, cpu, n, st = measure(tools, store, work, caches[mode], args,
                                           expect if mode == "on" else [], v)
                row = results[mode]["rows"][v]
                row["all_seconds"].append(secs)
                row["all_cpu"].append(cpu)
                blocks = max(1, st["blocks_decoded"])
                row.update(bytes=n, records_per_block=st["records_decoded"] / blocks,
                           snapshot_blocks_per_block=st["snapshot_block_reads"] / blocks,
                           readahead_kb=st["readahead_kb"])
        h.log(f"rep {rep + 1}/{reps} done")
    for mode in modes:
        for row in results[mode]["rows"].values():
            row["seconds"] = statistics.median(row["all_seconds"])
            row["cpu"] = statistics.median(row["all_cpu"])
    results["on"].update(snapshot_build_seconds=build_secs, snapshot_bytes=snap["bytes"],
                         snapshot_versions=snap["versions"])
    return results


def table(results):
    on, off = results["on"]["rows"], results["off"]["rows"]
    lines = ["| version | snapshots on: read | ratio vs +1 | dtefs CPU | records + snapshot "
             "blocks / block | snapshots off: read | ratio vs +1 | dtefs CPU | records / block |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in TARGETS:
        a, b = on[v], off[v]
        lines.append(
            f"| anchor+{v} | {a['seconds']:.2f} s ({a['bytes'] / a['seconds'] / 2**20:.0f} MiB/s) "
            f"| **{a['seconds'] / on[1]['seconds']:.2f}** | {a['cpu']:.2f} s "
            f"| {a['records_per_block'] + a['snapshot_blocks_per_block']:.2f} "
            f"| {b['seconds']:.2f} s ({b['bytes'] / b['seconds'] / 2**20:.0f} MiB/s) "
            f"| {b['seconds'] / off[1]['seconds']:.2f} | {b['cpu']:.2f} s "
            f"| {b['records_per_block']:.2f} |")
    return "\n".join(lines)


def main():
    ap = h.parser(__doc__, work=os.path.join(tempfile.gettempdir(), "dte-chain-bench"))
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--every", type=int, default=8, help="--snapshot-every of the 'on' mode")
    a = ap.parse_args()
    if a.steps < max(TARGETS):
        sys.exit(f"--steps must be at least {max(TARGETS)}")
    t0 = time.monotonic()
    work = h.Scratch(a.work, keep=a.keep)
    work.names = None if work.created else ("store", "dtectl-cache", "gen", "model.json",
                                            "cache-on", "cache-off", "mnt", "mnt.log")
    with work:
        tools = h.Tools(a.build_dir)
        store = build_store(tools, work.path, a.size, a.steps)
        results = bench(tools, store, work.path, a.steps, a.every, a.reps)
    results["config"] = {"size": a.size, "steps": a.steps, "reps": a.reps, "every": a.every,
                         "seconds": time.monotonic() - t0}
    print(table(results))
    on = results["on"]
    print(f"\nsnapshots: versions {on['snapshot_versions']}, "
          f"{on['snapshot_bytes'] / 2**20:.0f} MiB on disk, built in "
          f"{on['snapshot_build_seconds']:.1f} s; readahead "
          f"{on['rows'][1]['readahead_kb']} KiB; whole run {results['config']['seconds']:.0f} s")
    h.write_json(a.json, results)


if __name__ == "__main__":
    main()
