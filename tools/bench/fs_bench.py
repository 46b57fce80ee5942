#!/opt/dte/venv/bin/python
"""dtefs read benchmarks, each against a baseline measured in the same run.

  cold     one reader, every file of a version in 1 MiB reads, nothing cached
           (FUSE fs remounted, page cache dropped): dtefs vs libfuse's example
           passthrough_ll serving the same version exported as plain files
           (`dtectl export`) from the same disk. A version 1 delta past its
           anchor and one 32 deltas past it; for context also the plain files
           read directly from ext4.
  warm     the third read of the version through dtefs (its page cache
           populated by the first two) vs the third read of the plain
           exported files, from the page cache, no FUSE.
  8 readers  cold, one thread per shard (like TP ranks loading) vs one reader
           reading the same shards one after the other; dtefs and, for
           context, passthrough_ll.
  load     every shard loaded with the Python safetensors reader, from the
           dtefs mount vs from the plain exported directory, cold and warm:
           load_file (mmap) plus a copy of every tensor into process memory,
           and, if this safetensors has it, load_file(backend="pread").

Both FUSE mounts get the same kernel readahead window (--readahead-kb, set in
/sys/class/bdi/<dev>/read_ahead_kb after mounting). Ratios are dtefs over
baseline throughput (> 1: dtefs faster). In each repetition the two sides of
a pair run back to back in alternating order; the table gives the medians of
--repeat repetitions and the median and range of the per-repetition ratios.
The machine is shared: before each timed run the script waits (a while) for
it to be quiet, and repeats a run during which other processes used more than
--max-other cores.

Usage: /opt/dte/venv/bin/python tools/bench/fs_bench.py [--build-dir DIR] [--work DIR]
       [--size 512MiB] [--steps 33] [--shard-size 64MiB] [--depths 1,32]
       [--repeat 5] [--readahead-kb 4096] [--keep] [--cold-only] [--json OUT]
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

import harness as h
from fs_bench_report import GB, deltas, report

PT_SOURCE = "/usr/share/doc/libfuse3-dev/examples/passthrough_ll.c"


def build_passthrough(bin_dir):
    if not os.path.exists(PT_SOURCE):
        sys.exit(f"{PT_SOURCE} not found (apt-get install libfuse3-dev)")
    out = os.path.join(bin_dir, "passthrough_ll")
    flags = h.run(["pkg-config", "fuse3", "--cflags"]).stdout.split()
    libs = h.run(["pkg-config", "fuse3", "--libs"]).stdout.split()
    h.run(["cc", "-O2", *flags, PT_SOURCE, "-o", out, *libs])
    return out


def chain_depths(tools, store, cache):
    """{version: deltas past its anchor} from `dtectl log`."""
    by_version = {e["version"]: e for e in tools.log(store, cache)}
    depth = {}
    for v in sorted(by_version):
        p = by_version[v]["parent"]
        depth[v] = 0 if p is None else depth[p] + 1
    return depth


def pick_versions(depths, wanted):
    """For each wanted depth, the first version that far from its anchor (or the
    deepest one if the store re-anchors earlier)."""
    out = []
    for d in wanted:
        exact = [v for v, dv in sorted(depths.items()) if dv == d]
        v = exact[0] if exact else max(depths, key=lambda k: (depths[k], -k))
        if (v, depths[v]) not in out:
            out.append((v, depths[v]))
    return out


def export_versions(tools, store, cache, export_root, versions):
    os.makedirs(export_root, exist_ok=True)
    for v, _ in versions:
        out = os.path.join(export_root, f"v{v:08d}")
        if not os.path.isdir(out):
            h.run(tools.dtectl_cmd("export", store, cache, "--version", v, out))


# --- measurements ----------------------------------------------------------------------


class Bench:
    """Owns the two mounts and runs each measurement in its cold or warm state
    (timed runs through h.Load: a quiet machine, contended runs repeated)."""

    def __init__(self, a, tools, store, cache, export_root):
        self.a, self.tools = a, tools
        self.export_root = export_root
        mnt = os.path.join(a.work, "mnt")
        self.paths = {"dtefs": os.path.join(mnt, "dtefs"), "pt": os.path.join(mnt, "passthrough")}
        dtefs_argv = [tools.dtefs, store, self.paths["dtefs"], "--cache-dir", cache, "-f"]
        if tools.dtefs_option("--readahead-kb"):
            dtefs_argv += ["--readahead-kb", str(a.readahead_kb)]
        dtefs_argv += shlex.split(a.dtefs_args)
        pt_argv = [tools.passthrough, "-f", "-o", f"source={export_root}", self.paths["pt"]]
        self.argv = {"dtefs": dtefs_argv, "pt": pt_argv}
        self.mounts = {}
        self.readahead = {"dtefs": set(), "pt": set()}
        self.dropper = h.CacheDropper([store, export_root, cache])
        self.load = h.Load(a)
        self.status = []  # .dte/status deltas of cold dtefs reads

    def remount(self, fs):
        """A fresh mount of fs: its page cache and the daemon's caches are empty."""
        if fs in self.mounts:
            self.mounts.pop(fs).unmount()
        log_path = os.path.join(self.a.work, f"{fs}.log")
        m = h.FuseMount(fs, self.argv[fs], self.paths[fs], log_path).start()
        self.mounts[fs] = m
        self.readahead[fs].add(h.set_readahead_kb(m.path, self.a.readahead_kb))
        return m

    def unmount_all(self):
        for m in self.mounts.values():
            m.unmount()
        self.mounts = {}

    def dir_of(self, fs, version):
        name = f"v{version:08d}"
        return os.path.join(self.export_root if fs == "plain" else self.paths[fs], name)

    def files(self, fs, version, names):
        return [os.path.join(self.dir_of(fs, version), n) for n in names]

    def dte_status(self):
        return self.mounts["dtefs"].status()

    def timed(self, prepare, body, pids):
        return self.load.timed(prepare, body, pids)

    def cold(self, fs, reader, paths, tag=None):
        """Times reader(paths) on a fresh mount of fs (no mount for "plain") after
        dropping the page cache.
        Returns (GB/s, daemon CPU seconds); dtefs's counters go to self.status."""
        state = {}

        def prepare():
            state["m"] = self.remount(fs) if fs != "plain" else None
            state["before"] = self.dte_status() if fs == "dtefs" else None
            self.dropper.drop()

        def body():
            m = state["m"]
            cpu0 = m.cpu_seconds() if m else 0.0
            n, secs = reader(paths)
            return n, secs, (m.cpu_seconds() - cpu0) if m else 0.0

        n, secs, cpu = self.timed(prepare, body,
                                  lambda: [state["m"].proc.pid] if state["m"] else [])
        if state["before"] is not None:
            after, before = self.dte_status(), state["before"]
            self.status.append({k: after[k] - before[k] for k in
                                ("reads", "bytes_served", "blocks_decoded", "records_decoded",
                                 "payload_bytes")} | {"seconds": secs, "bytes": n, "tag": tag})
        return n / secs / GB, cpu

    def warm(self, fs, reader, paths):
        """GB/s of reader(paths) with the files already in the page cache."""
        pids = (lambda: [self.mounts[fs].proc.pid]) if fs in self.mounts else (lambda: [])
        n, secs = self.timed(lambda: None, lambda: reader(paths), pids)
        return n / secs / GB


LOADERS = {
    "mmap": "safetensors.torch.load_file(f) (mmap), then every tensor copied into process memory",
    "pread": "safetensors.torch.load_file(f, backend=\"pread\")",
}


class LoadChild:
    """A Python process that has imported torch and safetensors and loads every
    shard each time it is told to; only the loads are timed, not the imports.
    Loader "mmap": load_file (zero-copy mmap) and a copy of every tensor, which
    is what loading into a model's parameters costs; "pread": load_file with
    the pread backend, which reads into memory itself."""

    def __init__(self, loader, paths):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--load-child",
                                      loader, *paths], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("safetensors loader did not start")

    def load(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError("safetensors loader failed")
        return float(line[0]), int(line[1])

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def load_child(loader, paths):
    import safetensors.torch  # imports are not timed

    def load(p):
        if loader == "pread":
            return safetensors.torch.load_file(p, backend="pread")
        return {k: t.clone() for k, t in safetensors.torch.load_file(p).items()}

    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        tensors = [load(p) for p in paths]
        secs = time.perf_counter() - t0
        n = sum(t.numel() * t.element_size() for d in tensors for t in d.values())
        del tensors
        print(f"{secs:.6f} {n}", flush=True)


def loaders_available():
    """The loaders this safetensors supports (the pread backend is recent)."""
    p = subprocess.run([sys.executable, "-c", "import inspect, safetensors.torch as s; "
                        "print('backend' in inspect.signature(s.load_file).parameters)"],
                       capture_output=True, text=True)
    return ["mmap", "pread"] if p.stdout.strip() == "True" else ["mmap"]


def measure_load(b, fs, loader, version, shards):
    """(cold s, warm s, tensor bytes) of loading every shard from fs."""
    child = LoadChild(loader, b.files(fs, version, shards))
    try:
        def prepare():
            if fs != "plain":
                b.remount(fs)
            b.dropper.drop()

        def pids():
            return [child.proc.pid] + ([b.mounts[fs].proc.pid] if fs != "plain" else [])

        cold, n = b.timed(prepare, child.load, pids)
        warm, _ = b.timed(lambda: None, child.load, pids)
    finally:
        child.close()
    return cold, warm, n


def one_repetition(b, rep, version, names, shards8, shards_all, loaders, res):
    order = ("dtefs", "pt") if rep % 2 == 0 else ("pt", "dtefs")
    seq = h.read_sequential
    for fs in order:
        gbs, cpu = b.cold(fs, seq, b.files(fs, version, names), (version, "seq"))
        res[f"cold_{fs}"].append(gbs)
        res[f"cold_cpu_{fs}"].append(cpu)
        if b.a.cold_only:
            continue
        if fs == "dtefs":  # its page cache now holds the whole version
            files = b.files("dtefs", version, names)
            seq(files)  # the timed read is the third one, as for the plain files
            res["warm_dtefs"].append(b.warm("dtefs", seq, files))
    if b.a.cold_only:
        return
    plain = b.files("plain", version, names)
    res["cold_plain"].append(b.cold("plain", seq, plain)[0])
    seq(plain)  # a second read: the timed read is the third one, as for dtefs
    res["warm_plain"].append(b.warm("plain", seq, plain))
    for fs in order:
        modes = ("par", "one") if rep % 2 == 0 else ("one", "par")
        for mode in modes:
            reader = h.read_parallel if mode == "par" else seq
            gbs, _ = b.cold(fs, reader, b.files(fs, version, shards8), (version, mode))
            res[f"{mode}8_{fs}"].append(gbs)
    for loader in loaders:
        for fs in (("dtefs", "plain") if rep % 2 == 0 else ("plain", "dtefs")):
            cold, warm, n = measure_load(b, fs, loader, version, shards_all)
            res.setdefault(f"load_{loader}_cold_{fs}", []).append(cold)
            res.setdefault(f"load_{loader}_warm_{fs}", []).append(warm)
            res["load_bytes"] = n


def cold_only_report(versions, results):
    """The cold sequential pair alone (--cold-only): medians and per-repetition ratios."""
    for v, d in versions:
        r = results[v]
        ratios = [x / y for x, y in zip(r["cold_dtefs"], r["cold_pt"])]
        print(f"v{v} ({deltas(d)}): cold sequential read, dtefs "
              f"{statistics.median(r['cold_dtefs']):.2f} GB/s, passthrough_ll "
              f"{statistics.median(r['cold_pt']):.2f} GB/s, ratio "
              f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


def main():
    ap = h.parser(__doc__)
    ap.add_argument("--work", default="/var/tmp/dte-fs-bench",
                    help="work dir: store, exports, mounts (must be a disk, not tmpfs)")
    ap.add_argument("--size", default="512MiB")
    ap.add_argument("--steps", type=int, default=33, help="optimizer steps after the anchor")
    ap.add_argument("--shard-size", default="64MiB")
    ap.add_argument("--depths", default="1,32", help="deltas past the anchor of the versions read")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions; medians are reported")
    ap.add_argument("--readahead-kb", type=int, default=4096)
    ap.add_argument("--dtefs-args", default="", help="extra dtefs arguments")
    h.add_quiet_args(ap, max_busy=0.25, quiet_timeout=30.0, max_other=0.3, retries=3)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (store, exports)")
    ap.add_argument("--cold-only", action="store_true",
                    help="only the cold sequential read against passthrough_ll")
    ap.add_argument("--load-child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.load_child:
        return load_child(a.load_child[0], a.load_child[1:])
    a.cmdline = h.command_line(__file__)
    work = h.Scratch(a.work, keep=a.keep, disk=True,
                     names=("store", "cache", "export", "bin", "mnt", "gen", "model.json",
                            "dtefs.log", "pt.log"))
    a.work = work.path
    with work:
        tools = h.Tools(a.build_dir, work("bin"))
        tools.passthrough = build_passthrough(work("bin"))
        store, cache = work("store"), work("cache")
        h.commit_chain(tools, store, cache, ["--size", a.size, "--shard-size", a.shard_size],
                       a.steps, gen_dir=work("gen"), stamp=work("model.json"))
        versions = pick_versions(chain_depths(tools, store, cache),
                                 [int(x) for x in a.depths.split(",")])
        export_root = work("export")
        export_versions(tools, store, cache, export_root, versions)
        ref = os.path.join(export_root, f"v{versions[0][0]:08d}")
        names = sorted(os.listdir(ref))
        shards_all = [n for n in names if n.endswith(".safetensors")]
        shards8 = sorted(shards_all, key=lambda n: -os.path.getsize(os.path.join(ref, n)))[:8]
        if len(shards8) < 8 and not a.cold_only:
            sys.exit(f"only {len(shards8)} shards; use a smaller --shard-size")
        model = {"files": len(names), "shards": len(shards_all),
                 "bytes": sum(os.path.getsize(os.path.join(ref, n)) for n in names)}
        b = Bench(a, tools, store, cache, export_root)
        b.loaders, b.loader_notes, b.pt_source = loaders_available(), LOADERS, PT_SOURCE
        results = {v: {k: [] for k in ("cold_dtefs", "cold_pt", "cold_plain", "cold_cpu_dtefs",
                                       "cold_cpu_pt", "warm_dtefs", "warm_plain", "par8_dtefs",
                                       "one8_dtefs", "par8_pt", "one8_pt")}
                   for v, _ in versions}
        for rep in range(a.repeat):
            for v, d in versions:
                h.log(f"repetition {rep + 1}/{a.repeat}, v{v} ({deltas(d)})")
                one_repetition(b, rep, v, names, shards8, shards_all, b.loaders, results[v])
        b.unmount_all()
        if a.cold_only:
            cold_only_report(versions, results)
        else:
            report(a, b, tools, versions, model, results)
        h.write_json(a.json, {"versions": versions, "results": results, "status": b.status,
                              "readahead": {k: sorted(v) for k, v in b.readahead.items()},
                              "busy": b.load.quiet.seen, "other_cores": b.load.other})


if __name__ == "__main__":
    main()
