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
Needs a build (DTE_BUILD_DIR, default build/) with dtefs, dtectl and dte-gen,
and /dev/fuse.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fs_bench_util as fu  # noqa: E402
from fs_bench_util import wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(ROOT, "build"))
DTECTL = os.path.join(BUILD, "tools", "dtectl")
DTEFS = os.path.join(BUILD, "tools", "dtefs")
DTEGEN = os.path.join(BUILD, "tools", "dte-gen")
TARGETS = (1, 8, 16, 32, 63, 64)
BATCH = 16  # steps generated at a time (bounds the disk the plain checkpoints take)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def build_store(work, size, steps):
    """Commits steps 0..steps as one chain; generates them BATCH at a time."""
    store, cache = os.path.join(work, "store"), os.path.join(work, "dtectl-cache")
    if os.path.isdir(os.path.join(store, "manifests")):
        n = len(json.loads(run([DTECTL, "log", "--store", store, "--cache-dir", cache,
                                "--json"]).stdout))
        if n == steps + 1:
            return store
        sys.exit(f"{store} holds {n} versions, not {steps + 1}: remove it or use another --work")
    gen = os.path.join(work, "gen")
    t0 = time.monotonic()
    for first in range(0, steps + 1, BATCH):
        last = min(steps, first + BATCH - 1)
        shutil.rmtree(gen, ignore_errors=True)
        run([DTEGEN, "--out", gen, "--size", size, "--start", str(first), "--steps", str(last),
             "-q"])
        for step in range(first, last + 1):
            cmd = "import" if step == 0 else "commit"
            run([DTECTL, cmd, "--store", store, "--cache-dir", cache, "-q",
                 os.path.join(gen, f"step-{step:06d}")])
        print(f"  committed v0..v{last} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    shutil.rmtree(gen, ignore_errors=True)
    return store


class Mount(fu.FuseMount):
    """dtefs in the foreground on `path`, stderr in PATH.log; a context manager."""

    def __init__(self, store, path, cache, args):
        super().__init__("dtefs", [DTEFS, store, path, "--cache-dir", cache, "-f", *args], path,
                         path + ".log")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.unmount()

    def status(self):
        with open(os.path.join(self.path, ".dte", "status")) as f:
            return json.load(f)


def drop_from_page_cache(dirs):
    """Writes back and evicts every file under `dirs` (blobs, snapshots)."""
    for d in dirs:
        for dirpath, _, files in os.walk(d):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue  # deleted meanwhile
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def cpu_seconds(pid):
    """User + system CPU time of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_version(root):
    """Reads every file of a version directory sequentially; returns bytes."""
    total = 0
    buf = bytearray(1 << 20)
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                total += n
    return total


def wait_snapshots(m, want, timeout=1800):
    def ready():
        s = m.status()["snapshots"]
        return s is not None and s["versions"] == want and s["building"] is None
    wait_for(ready, timeout, f"snapshots of {want}")


def expected_snapshots(steps, every, keep):
    """Versions dtefs snapshots in a chain v0..v`steps`, keeping `keep`."""
    marked = list(range(every, steps + 1, every)) if every else []
    return marked[-keep:] if keep else []


def build_snapshots(store, work, args, expect):
    """Mounts once to build the snapshots; returns (cache dir, seconds, snapshot status)."""
    cache = os.path.join(work, "cache-on")
    shutil.rmtree(cache, ignore_errors=True)
    with Mount(store, os.path.join(work, "mnt"), cache, args) as m:
        t0 = time.monotonic()
        wait_snapshots(m, expect)
        return cache, time.monotonic() - t0, m.status()["snapshots"]


def measure(store, work, cache, args, expect, v):
    """One cold read of version v; returns (seconds, dtefs CPU seconds, bytes, status after)."""
    mnt = os.path.join(work, "mnt")
    drop_from_page_cache([os.path.join(store, "blobs"), cache])
    with Mount(store, mnt, cache, args) as m:
        if expect:
            wait_snapshots(m, expect, 60)  # taken in from disk, none built
        cpu0, t0 = cpu_seconds(m.proc.pid), time.perf_counter()
        n = read_version(os.path.join(mnt, f"v{v:08d}"))
        secs = time.perf_counter() - t0
        return secs, cpu_seconds(m.proc.pid) - cpu0, n, m.status()


def bench(store, work, steps, every, reps):
    """Both modes; the reads of all versions and modes are interleaved, rep
    by rep, so that load from elsewhere spreads evenly over them."""
    keep = len(expected_snapshots(steps, every, 10**9))
    expect = expected_snapshots(steps, every, keep)
    modes = {"on": ["--snapshot-every", every, "--snapshots", keep],
             "off": ["--snapshot-every", 0]}
    cache_on, build_secs, snap = build_snapshots(store, work, modes["on"], expect)
    caches = {"on": cache_on, "off": os.path.join(work, "cache-off")}
    results = {mode: {"rows": {v: {"all_seconds": [], "all_cpu": []} for v in TARGETS}}
               for mode in modes}
    for rep in range(reps):
        for v in TARGETS:
            for mode, args in modes.items():
                secs, cpu, n, st = measure(store, work, caches[mode], args,
                                           expect if mode == "on" else [], v)
                row = results[mode]["rows"][v]
                row["all_seconds"].append(secs)
                row["all_cpu"].append(cpu)
                blocks = max(1, st["blocks_decoded"])
                row.update(bytes=n, records_per_block=st["records_decoded"] / blocks,
                           snapshot_blocks_per_block=st["snapshot_block_reads"] / blocks,
                           readahead_kb=st["readahead_kb"])
        print(f"  rep {rep + 1}/{reps} done", file=sys.stderr)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--every", type=int, default=8, help="--snapshot-every of the 'on' mode")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "dte-chain-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.steps < max(TARGETS):
        sys.exit(f"--steps must be at least {max(TARGETS)}")
    os.makedirs(a.work, exist_ok=True)
    t0 = time.monotonic()
    store = build_store(a.work, a.size, a.steps)
    results = bench(store, a.work, a.steps, a.every, a.reps)
    results["config"] = {"size": a.size, "steps": a.steps, "reps": a.reps, "every": a.every,
                         "seconds": time.monotonic() - t0}
    print(table(results))
    on = results["on"]
    print(f"\nsnapshots: versions {on['snapshot_versions']}, "
          f"{on['snapshot_bytes'] / 2**20:.0f} MiB on disk, built in "
          f"{on['snapshot_build_seconds']:.1f} s; readahead "
          f"{on['rows'][1]['readahead_kb']} KiB; whole run {results['config']['seconds']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
