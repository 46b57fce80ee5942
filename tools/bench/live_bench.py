#!/opt/dte/venv/bin/python
"""Live apply on a dtefs mount (`dtectl apply`) against reloading the model.

Generates a dte-gen Llama (32 heads, 8 KV heads, so tp 1, 2 and 8 divide it)
and commits steps 0..BASE+max(--distances) (an anchor and sparse deltas of
about 1.5% of BF16 elements each), mounts the store with dtefs (defaults:
snapshots every 8 versions, built once and kept in the cache dir), and
measures, in one run:

  one step   `dtectl apply --version BASE+1` over live BASE, wall time of the
             command, on a fresh mount after `drop_caches`, with live/ not in
             the page cache ("cold") and with live/ fully cached by an mmapped
             reader process ("cached"), each with the default block cache
             (256MiB) and with --big-cache; against the reload alternative:
             every file of MNT/vBASE+1 read with 1 MiB reads after
             `drop_caches` on a fresh mount (cold), and the third such read
             (warm, from the page cache). CPU: the daemon's CPU seconds during
             the apply (reload: the daemon's and the reader's).
  receivers  the same step forward and back with 0, 1, 2 and 8 receiver
             processes registered (tp 1, 2, 8: one rank each, buffers in
             /dev/shm laid out like vLLM's fused TP shards), on one mount;
             the first apply after registering is reported apart.
  distance   applies BASE -> BASE+d and back for each d, one tp=1 receiver.
  memory     the daemon's VmRSS before each apply and its VmHWM during it
             (reset through /proc/PID/clear_refs), against the model size.
  mapped     live/ mapped by a reader that touched all of it or a tenth of
             its pages (every tenth), block caches of 256MiB, 1GiB and
             --big-cache, applies BASE -> BASE+d for d in --mapped-distances:
             the page step's split (fetch from the kernel, patch, store back,
             read path) from .dte/status, against the limit of two passes
             over the resident bytes at the memory bandwidth measured in the
             same run (numpy copies) plus the apply's own decode.

Before each timed run the script waits (a while) for a quiet machine and
repeats a run during which other processes used more than --max-other cores.
Caches are dropped before every timed apply. Every first-repetition apply is
checked: live/ (or the reader's mapping) against MNT/vT, each receiver's
buffers against the target sharded in Python.

Usage: /opt/dte/venv/bin/python tools/bench/live_bench.py [--build-dir build] [--size 2GiB]
       [--quick] [--reps 3] [--big-cache 3GiB] [--distances 1,2,4,8]
       [--receivers 0,1,2,8] [--mapped-distances 1,2,8] [--sections one,recv,mapped]
       [--work DIR] [--keep] [--json OUT]
"""
import argparse
import hashlib
import json
import mmap
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

import harness as h

PY_PATH = h.PY_PATH
GEOMETRY = ["--heads", "32", "--kv-heads", "8"]
# --quick: a smoke test; no waiting for a quiet machine, no repeated runs.
QUICK = {"size": "64MiB", "model": ["--hidden", "512"], "reps": 2}
MIB = h.MIB


# --- model: tensors, vLLM TP shards ---------------------------------------------------


def with_version(d, fn):
    """fn({name: uint16 array (BF16 bits) viewing the mapped file}) for every
    tensor of the safetensors files in directory d; the files are closed after."""
    state, maps = {}, []
    try:
        for name in sorted(os.listdir(d)):
            if not name.endswith(".safetensors"):
                continue
            with open(os.path.join(d, name), "rb") as f:
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            maps.append(m)
            n = int.from_bytes(m[:8], "little")
            for key, t in json.loads(m[8:8 + n]).items():
                if key != "__metadata__":
                    assert t["dtype"] == "BF16", key
                    b, e = t["data_offsets"]
                    state[key] = np.frombuffer(m, np.uint16, (e - b) // 2,
                                               8 + n + b).reshape(t["shape"])
        return fn(state)
    finally:
        state.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:  # views left in a traceback: unmapped with them
                pass


def geometry(d):
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    return {"heads": c["num_attention_heads"], "kv": c["num_key_value_heads"],
            "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            "inter": c["intermediate_size"]}


def shard(state, g, tp, rank):
    """Yields (name, array) of rank `rank` in vLLM's fused TP layout (fused
    qkv_proj and gate_up_proj), as tests/py/test_fs_live.py computes it."""
    hd = g["head_dim"]
    for name, a in state.items():
        if any(s in name for s in (".self_attn.k_proj.", ".self_attn.v_proj.", ".mlp.up_proj.")):
            continue
        if ".self_attn.q_proj." in name:
            p = name.split("q_proj")[0]
            q, kv = g["heads"] // tp * hd, g["kv"] // tp * hd
            k, v = state[p + "k_proj.weight"], state[p + "v_proj.weight"]
            yield p + "qkv_proj.weight", np.concatenate(
                [a[rank * q:(rank + 1) * q], k[rank * kv:(rank + 1) * kv],
                 v[rank * kv:(rank + 1) * kv]])
        elif ".mlp.gate_proj." in name:
            p, rows = name.split("gate_proj")[0], g["inter"] // tp
            up = state[p + "up_proj.weight"]
            yield p + "gate_up_proj.weight", np.concatenate(
                [a[rank * rows:(rank + 1) * rows], up[rank * rows:(rank + 1) * rows]])
        elif ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            cols = a.shape[1] // tp
            yield name, a[:, rank * cols:(rank + 1) * cols]
        elif "embed_tokens" in name or "lm_head" in name:
            rows = a.shape[0] // tp  # the vocabulary divides by tp here (checked)
            yield name, a[rank * rows:(rank + 1) * rows]
        else:
            yield name, a


# --- child processes: a receiver, an mmapped reader of live/ --------------------------


def receiver_child(mount, base, tp, rank, shm):
    """Creates /dev/shm/SHM with rank `rank` of vBASE, registers it, prints its
    layout and waits for stdin to close."""
    sys.path.insert(0, PY_PATH)
    import dte

    d = os.path.join(mount, f"v{base:08d}")

    def fill(state):
        parts = dict(shard(state, geometry(d), tp, rank))
        w = dte.SharedWeights(shm, {k: ("BF16", a.shape) for k, a in parts.items()})
        for k, a in parts.items():
            w.array(k)[...] = a
        return w

    w = with_version(d, fill)  # no file of the mount stays open
    try:
        with dte.LiveReceiver(mount, tp=tp, rank=rank) as r:
            r.register_shared(w, version=base)
            layout = {k: [off, list(shape)] for k, (_, shape, off, _) in w.tensors.items()}
            print(json.dumps({"shm": w.name, "layout": layout}), flush=True)
            sys.stdin.read()
    finally:
        w.close()
        w.unlink()


def reader_child(paths, stride=1):
    """Maps every file, faults every `stride`-th page in (with the kernel's
    readahead off for the mapping: MADV_RANDOM), prints "ready"; then prints
    the sha256 of each mapping for every line read."""
    maps = []
    for p in paths:
        with open(p, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    for m in maps:
        if stride > 1:
            m.madvise(mmap.MADV_RANDOM)
        sum(m[i] for i in range(0, len(m), mmap.PAGESIZE * stride))
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps([hashlib.sha256(m).hexdigest() for m in maps]), flush=True)


class Child:
    """This script run as a child (--child KIND ARGS); the first line it prints is kept."""

    def __init__(self, kind, *args, env=None):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", kind,
                                      *map(str, args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.first = self.proc.stdout.readline()
        if not self.first:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"{kind} child exited {self.proc.returncode}")

    def ask(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=60)


# --- setup ------------------------------------------------------------------------------


def check_model(tools, model_args, max_tp):
    """dte-gen's --dry-run line for the model; exits unless max_tp divides it."""
    out = h.run([tools.dtegen, "--out", "/nonexistent", *model_args, "--dry-run"]).stdout
    m = re.search(r"hidden (\d+), (\d+) layers, intermediate (\d+), (\d+) heads x (\d+) "
                  r"\(kv (\d+)\), vocab (\d+)", out)
    if not m:
        sys.exit(f"cannot parse dte-gen --dry-run: {out}")
    hidden, _, inter, heads, _, kv, vocab = map(int, m.groups())
    if any(x % max_tp for x in (hidden, inter, heads, kv, vocab)):
        sys.exit(f"tp {max_tp} does not divide this model ({out.splitlines()[0]}); "
                 "give another --size")
    return out.splitlines()[0]


def build_store(tools, a, store, cache, steps):
    """Commits steps 0..steps (reused if built before with the same options);
    returns the percent of BF16 elements each step changed."""
    return h.commit_chain(tools, store, cache, a.model_args, steps, gen_dir=os.path.join(
        a.work, "gen"), batch=max(1, min(4, (8 << 30) // h.parse_size(a.size))),
        stamp=os.path.join(a.work, "model.json"))["changed"]


# --- the mount and one apply ------------------------------------------------------------


class Bench:
    """One dtefs mount at a time (fresh for each cold state) and timed applies."""

    def __init__(self, a, tools, store, cache, base):
        self.a, self.tools, self.store, self.cache, self.base = a, tools, store, cache, base
        self.mnt = os.path.join(a.work, "mnt")
        self.m = None
        self.dropper = h.CacheDropper([store, cache])
        self.load = h.Load(a)
        last = base + max(a.distances)  # dtefs defaults: every 8 versions, keep 8
        self.snapshots = list(range(8, last + 1, 8))[-8:]
        self.expected = {}  # version -> sha256 of each file

    def mount(self, cache_size=None):
        """A fresh mount (empty block cache) with vBASE live; waits for the snapshots."""
        self.unmount()
        self.m = h.dtefs_mount(self.tools, self.store, self.mnt, self.cache, "--live-version",
                               self.base, *(["--cache-size", cache_size] if cache_size else []),
                               log_path=os.path.join(self.a.work, "dtefs.log")).start()

        def ready():
            s = self.status()["snapshots"]
            return (s is not None and s["building"] is None
                    and set(self.snapshots) <= set(s["versions"]))
        h.wait_for(ready, 3600, f"dtefs snapshots of {self.snapshots}", 0.2)
        return self.m

    def unmount(self):
        if self.m:
            self.m.unmount()
            self.m = None

    def status(self):
        return self.m.status()

    def vdir(self, v):
        return os.path.join(self.mnt, f"v{v:08d}")

    def files(self, d):
        return [os.path.join(d, n) for n in sorted(os.listdir(d))
                if os.path.getsize(os.path.join(d, n)) > 0]

    def apply(self, version):
        """`dtectl apply --version`; returns its JSON with the command's wall time,
        the daemon's CPU and memory around it."""
        pid = self.m.proc.pid
        rss, hwm = h.proc_status(pid, "VmRSS"), h.proc_status(pid, "VmHWM")
        h.reset_peak(pid)
        cpu, t0 = self.m.cpu_seconds(), time.perf_counter()
        r = h.run([self.tools.dtectl, "apply", self.mnt, "--version", version, "--json"])
        wall = time.perf_counter() - t0
        out = json.loads(r.stdout)
        if out["to_version"] != version:
            raise RuntimeError(f"apply of v{version} reports {out}")
        return out | {"wall": wall, "cpu": self.m.cpu_seconds() - cpu, "rss_before": rss,
                      "hwm_before": hwm, "peak": h.proc_status(pid, "VmHWM"),
                      "shmem": h.proc_status(pid, "RssShmem"),
                      "cache_bytes": self.status()["cache"]["bytes"]}

    def timed(self, prepare, body, pids=lambda: [], undo=None):
        """h.Load.timed, counting the daemon's CPU as this run's own."""
        return self.load.timed(prepare, body, lambda: [self.m.proc.pid, *pids()], undo)

    def expect(self, v):
        """sha256 of every file of vV, read through the mount (after timing)."""
        if v not in self.expected:
            self.expected[v] = [sha256_file(p) for p in self.files(self.vdir(v))]
        return self.expected[v]

    def check_live(self, v, got=None):
        got = got or [sha256_file(p) for p in self.files(os.path.join(self.mnt, "live"))]
        if got != self.expect(v):
            raise RuntimeError(f"BUG: live/ does not hold v{v} after the apply")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- measurements -----------------------------------------------------------------------


def reload_row(b, res):
    """Cold and warm reads of every file of vBASE+1 on a fresh mount."""
    files = lambda: b.files(b.vdir(b.base + 1))  # noqa: E731

    def prepare():
        b.mount()
        b.dropper.drop()

    def read():  # (bytes, seconds, CPU seconds of the daemon and of this reader)
        cpu0, t0 = b.m.cpu_seconds(), os.times()
        n, secs = h.read_sequential(files())
        t1 = os.times()
        return n, secs, b.m.cpu_seconds() - cpu0 + t1.user + t1.system - t0.user - t0.system

    n, cold, cpu = b.timed(prepare, read)
    read()
    _, warm, _ = b.timed(lambda: None, read)
    res["reload_cold"].append(cold)
    res["reload_cpu"].append(cpu)
    res["reload_warm"].append(warm)
    res["model_bytes"] = n


def fresh_mount_with_reader(b, state, cache_size, stride):
    """A fresh mount with --cache-size cache_size, caches dropped, and (stride
    > 0) a reader that maps live/ and touches every stride-th page: in
    state["reader"] (the previous one closed)."""
    if state.get("reader"):
        state.pop("reader").close()
    b.mount(cache_size)
    b.dropper.drop()
    if stride:
        state["reader"] = Child("reader", stride, *b.files(os.path.join(b.mnt, "live")))


def one_step_row(b, cached, cache_size, rep, res):
    """Apply of vBASE+1 over vBASE on a fresh mount, live/ cached or not."""
    state = {}

    def prepare():
        fresh_mount_with_reader(b, state, cache_size, 1 if cached else 0)

    try:
        pids = lambda: [state["reader"].proc.pid] if cached else []  # noqa: E731
        out = b.timed(prepare, lambda: b.apply(b.base + 1), pids)
        if rep == 0:
            got = json.loads(state["reader"].ask("hash")) if cached else None
            b.check_live(b.base + 1, got)
    finally:
        if state.get("reader"):
            state.pop("reader").close()
    res.setdefault(f"apply_{'cached' if cached else 'cold'}_{cache_size or 'default'}",
                   []).append(out)


def start_receivers(b, tp):
    env = dict(os.environ, DTE_LIBRARY=b.tools.libdte)
    out = []
    try:
        for rank in range(tp):
            shm = f"dte-live-bench-{os.getpid()}-{tp}-{rank}"
            out.append(Child("receiver", b.mnt, b.base, tp, rank, shm, env=env))
            out[-1].info = json.loads(out[-1].first)
    except BaseException:
        stop_receivers(out)
        raise
    return out


def stop_receivers(receivers):
    for r in receivers:
        r.close()


def check_receivers(b, receivers, tp, v):
    """Every registered buffer against vV sharded here."""
    d = b.vdir(v)

    def check(state):
        for rank, r in enumerate(receivers):
            with open(f"/dev/shm/{r.info['shm']}", "rb") as f:
                shm = f.read()
            for name, want in shard(state, geometry(d), tp, rank):
                off, shape = r.info["layout"][name]
                got = np.frombuffer(shm, np.uint16, want.size, off).reshape(shape)
                if not np.array_equal(got, want):
                    raise RuntimeError(f"BUG: tp {tp} rank {rank} {name} differs from v{v}")

    with_version(d, check)


def apply_pair(b, receivers, tp, d, rep, res):
    """vBASE -> vBASE+d and back, caches dropped before each; checked in rep 0."""
    pids = [r.proc.pid for r in receivers]
    for src, dst in ((b.base, b.base + d), (b.base + d, b.base)):
        out = b.timed(b.dropper.drop, lambda: b.apply(dst), lambda: pids,
                      undo=lambda: b.apply(src))
        res.setdefault(f"recv{tp}_d{d}_{'fwd' if dst > src else 'back'}", []).append(out)
        if rep == 0 and receivers:
            check_receivers(b, receivers, tp, dst)


def receivers_rows(b, tp, rep, res):
    """Applies with tp receivers (0: none) registered on a fresh mount."""
    b.mount()
    receivers = start_receivers(b, tp) if tp else []
    try:
        st = b.status()["live"]
        if st["receivers"] != tp:
            raise RuntimeError(f"{st['receivers']} receivers registered, not {tp}")
        res.setdefault(f"recv{tp}_buffers", st["buffers"])
        # The first apply after registering also faults the daemon's mappings
        # of the buffers in (the steady state is timed after it).
        b.dropper.drop()
        res.setdefault(f"recv{tp}_first", []).append(b.apply(b.base + 1))
        b.apply(b.base)
        for d in (b.a.distances if tp == 1 else [1]):
            apply_pair(b, receivers, tp, d, rep, res)
    finally:
        stop_receivers(receivers)


def memory_bandwidth():
    """Bytes per second one core copies between two 256 MiB buffers (median of 5)."""
    import numpy as np
    src = np.ones(256 * MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times[1:])


def resident_pages(b):
    """Pages of live/ files in the page cache (mincore through a mapping)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total = 0
    for path in b.files(os.path.join(b.mnt, "live")):
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            libc.mincore(addr, size, vec)
            libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += sum(v & 1 for v in vec)
    return total


def mapped_row(b, cache_size, stride, d, rep, res):
    """Apply of vBASE+d over vBASE on a fresh mount with --cache-size
    cache_size, live/ mapped by a reader that touched every stride-th page."""
    state = {}

    def prepare():
        fresh_mount_with_reader(b, state, cache_size, stride)
        state["resident"] = resident_pages(b)

    def body():
        out = b.apply(b.base + d)
        return out | {"page_split": b.status()["live"]["last_pages"],
                      "resident": state["resident"]}

    try:
        out = b.timed(prepare, body, lambda: [state["reader"].proc.pid])
        if rep == 0:
            b.check_live(b.base + d, json.loads(state["reader"].ask("hash")))
    finally:
        if state.get("reader"):
            state.pop("reader").close()
    res.setdefault(f"mapped_{cache_size}_{stride}_{d}", []).append(out)


def run_all(b, a, res, save):
    configs = [("reload",)]
    if "one" in a.sections:
        configs += [("one", c, s) for c in (False, True) for s in (None, a.big_cache)]
    if "recv" in a.sections:
        configs += [("recv", tp) for tp in a.receivers]
    if "mapped" in a.sections:
        configs += [("mapped", size, stride, d) for size in a.mapped_caches
                    for stride in (1, 10) for d in a.mapped_distances]
    for rep in range(a.reps):
        for cfg in (configs if rep % 2 == 0 else configs[::-1]):
            h.log(f"repetition {rep + 1}/{a.reps}: {cfg}")
            if cfg[0] == "reload":
                reload_row(b, res)
            elif cfg[0] == "one":
                one_step_row(b, cfg[1], cfg[2], rep, res)
            elif cfg[0] == "mapped":
                mapped_row(b, cfg[1], cfg[2], cfg[3], rep, res)
            else:
                receivers_rows(b, cfg[1], rep, res)
            save()
    b.unmount()


# --- report -----------------------------------------------------------------------------


def med(rows, key, scale=1.0):
    return statistics.median(r[key] for r in rows) * scale


def one_step_table(a, res):
    cold, warm = statistics.median(res["reload_cold"]), statistics.median(res["reload_warm"])
    lines = ["| live/ | block cache | `dtectl apply` | in the daemon | decode | scatter "
             "| page cache | pages replaced | CPU | vs cold reload | vs warm reload |",
             "|---" * 11 + "|"]
    for cached in ("cold", "cached"):
        for size in ("default", a.big_cache):
            rows = res[f"apply_{cached}_{size}"]
            t = med(rows, "wall")
            lines.append(
                f"| {'not cached' if cached == 'cold' else 'cached (mmapped)'} "
                f"| {'256MiB (default)' if size == 'default' else size} | {t:.3f} s "
                f"| {med(rows, 'elapsed_ns', 1e-9):.3f} s "
                f"| {med(rows, 'decode_ns', 1e-9):.3f} s | {med(rows, 'scatter_ns', 1e-9):.4f} s "
                f"| {med(rows, 'pagecache_ns', 1e-9):.3f} s | {med(rows, 'pages'):.0f} "
                f"| {med(rows, 'cpu'):.2f} s "
                f"| **{cold / t:.2f}x** | {warm / t:.2f}x |")
    gb = res["model_bytes"] / 1e9
    cpu = statistics.median(res["reload_cpu"])
    lines.append(f"| reload: read MNT/vN | cold | {cold:.3f} s ({gb / cold:.2f} GB/s) "
                 f"| | | | | | {cpu:.2f} s | 1.00x | |")
    lines.append(f"| reload: read MNT/vN | warm | {warm:.3f} s ({gb / warm:.2f} GB/s) "
                 "| | | | | | | | 1.00x |")
    return lines


def memory_table(a, res):
    model = res["model_bytes"] / MIB
    lines = ["| live/ | block cache | daemon RSS before apply | VmHWM since mount | "
             "peak during apply | peak / model size | block cache after |", "|---" * 7 + "|"]
    for cached in ("cold", "cached"):
        for size in ("default", a.big_cache):
            rows = res[f"apply_{cached}_{size}"]
            lines.append(f"| {'not cached' if cached == 'cold' else 'cached'} | {size} "
                         f"| {med(rows, 'rss_before') / MIB:.0f} MiB "
                         f"| {med(rows, 'hwm_before') / MIB:.0f} MiB "
                         f"| {med(rows, 'peak') / MIB:.0f} MiB "
                         f"| {med(rows, 'peak') / MIB / model:.2f} "
                         f"| {med(rows, 'cache_bytes') / MIB:.0f} MiB |")
    return lines


def receivers_table(a, res):
    cold = statistics.median(res["reload_cold"])
    lines = ["| receivers | buffers | first apply (scatter) | forward | in the daemon | decode "
             "| scatter | bytes scattered | forward vs cold reload | back | in the daemon "
             "| decode | scatter |",
             "|---" * 13 + "|"]
    for tp in a.receivers:
        f, bk = res[f"recv{tp}_d1_fwd"], res[f"recv{tp}_d1_back"]
        first = res[f"recv{tp}_first"]
        lines.append(f"| {tp}{' (tp=%d)' % tp if tp else ''} | {res[f'recv{tp}_buffers']} "
                     f"| {med(first, 'wall'):.3f} s ({med(first, 'scatter_ns', 1e-9):.3f} s) | "
                     + row_cells(f) + f" | {med(f, 'bytes') / MIB:.1f} MiB "
                     f"| **{cold / med(f, 'wall'):.2f}x** | " + row_cells(bk) + " |")
    return lines


def row_cells(rows):
    return (f"{med(rows, 'wall'):.3f} s | {med(rows, 'elapsed_ns', 1e-9):.3f} s "
            f"| {med(rows, 'decode_ns', 1e-9):.3f} s | {med(rows, 'scatter_ns', 1e-9):.4f} s")


def distance_table(a, res):
    lines = ["| distance | changed entries | forward | in the daemon | decode | scatter "
             "| back | in the daemon | decode | scatter | daemon peak (fwd, back) |",
             "|---" * 11 + "|"]
    for d in a.distances:
        f, bk = res[f"recv1_d{d}_fwd"], res[f"recv1_d{d}_back"]
        # VmHWM less the receiver's shared memory the daemon has mapped
        peak = [statistics.median(r["peak"] - r["shmem"] for r in x) / MIB for x in (f, bk)]
        lines.append(f"| {d} | {med(f, 'entries'):.0f} | " + row_cells(f) + " | "
                     + row_cells(bk) + f" | {peak[0]:.0f}, {peak[1]:.0f} MiB |")
    return lines


def mapped_table(a, res):
    cold, warm = statistics.median(res["reload_cold"]), statistics.median(res["reload_warm"])
    bw = res["copy_bandwidth"]
    lines = ["| block cache | resident | distance | `dtectl apply` | decode | page step "
             "| fetch | patch | store | read path (pages) | limit | apply / limit "
             "| vs cold reload | vs warm reload | daemon peak |", "|---" * 15 + "|"]
    for size in a.mapped_caches:
        for stride in (1, 10):
            for d in a.mapped_distances:
                rows = res[f"mapped_{size}_{stride}_{d}"]
                t = med(rows, "wall")
                split = lambda k: statistics.median(r["page_split"][k] for r in rows) * 1e-9  # noqa
                read_pages = statistics.median(r["page_split"]["read_path_pages"] for r in rows)
                resident = med(rows, "resident") * mmap.PAGESIZE
                limit = 2 * resident / bw + med(rows, "decode_ns", 1e-9)
                lines.append(
                    f"| {size} | {'all' if stride == 1 else '1/10'} "
                    f"({resident / MIB:.0f} MiB) | {d} | {t:.3f} s "
                    f"| {med(rows, 'decode_ns', 1e-9):.3f} s "
                    f"| {med(rows, 'pagecache_ns', 1e-9):.3f} s | {split('fetch_ns'):.3f} s "
                    f"| {split('patch_ns'):.3f} s | {split('store_ns'):.3f} s "
                    f"| {split('read_ns'):.3f} s ({read_pages:.0f}) | {limit:.3f} s "
                    f"| {t / limit:.2f} | **{cold / t:.2f}x** | {warm / t:.2f}x "
                    f"| {statistics.median(r['peak'] for r in rows) / MIB:.0f} MiB |")
    lines.append(f"\nmemory copy bandwidth (numpy, one core): {bw / 1e9:.2f} GB/s; fetch, "
                 "patch and store are summed over the daemon's threads")
    return lines


def report(a, b, res, model_line, changed):
    n = res["model_bytes"]
    step = changed.get(b.base + 1)
    print(f"\n{a.cmdline}\n{model_line}; {n / MIB:.0f} MiB in the files of a version; "
          f"live v{b.base} -> v{b.base + 1} changes {step}% of BF16 elements (dte-gen); "
          f"snapshots {b.snapshots}; medians of {a.reps}\n")
    if "one" in a.sections:
        print("\n".join(one_step_table(a, res)) + "\n")
        print("\n".join(memory_table(a, res)) + "\n")
    if "recv" in a.sections:
        print("\n".join(receivers_table(a, res)) + "\n")
        print("\n".join(distance_table(a, res)) + "\n")
    if "mapped" in a.sections:
        print("\n".join(mapped_table(a, res)) + "\n")
    print(f"{b.load.report()}; caches dropped with: {b.dropper.method}")


# --- main -------------------------------------------------------------------------------


def parse_args():
    ap = h.parser(__doc__)
    ap.add_argument("--work", default="/var/tmp/dte-live-bench",
                    help="work dir: store, cache, mount (a disk, not tmpfs)")
    ap.add_argument("--size", help="BF16 bytes of the model (default 2GiB; --quick 64MiB)")
    ap.add_argument("--shard-size", default="5GB", help="dte-gen --shard-size")
    ap.add_argument("--quick", action="store_true", help="small model, 2 repetitions")
    ap.add_argument("--reps", type=int, help="repetitions (default 3; --quick 2)")
    ap.add_argument("--base", type=int, default=8, help="the live version applies start from")
    ap.add_argument("--distances", default="1,2,4,8")
    ap.add_argument("--receivers", default="0,1,2,8", help="tp of the receiver sets (0: none)")
    ap.add_argument("--big-cache", default="3GiB", help="the larger dtefs --cache-size")
    ap.add_argument("--mapped-distances", default="1,2,8")
    ap.add_argument("--sections", default="one,recv,mapped",
                    help="what to measure besides the reload baseline")
    h.add_quiet_args(ap, max_busy=0.3, quiet_timeout=10.0, max_other=0.5, retries=1)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (store, snapshots)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return a
    a.size = a.size or (QUICK["size"] if a.quick else "2GiB")
    a.reps = a.reps or (QUICK["reps"] if a.quick else 3)
    if a.quick:
        a.quiet_timeout, a.retries = 0.0, 0
    a.distances = [int(x) for x in a.distances.split(",")]
    a.mapped_distances = [int(x) for x in a.mapped_distances.split(",")]
    a.mapped_caches = ["256MiB", "1GiB", a.big_cache]
    a.sections = set(a.sections.split(","))
    if not a.sections <= {"one", "recv", "mapped"}:
        sys.exit("--sections takes one, recv and mapped")
    a.receivers = [int(x) for x in a.receivers.split(",")]
    if 1 not in a.distances or 1 not in a.receivers:
        sys.exit("--distances and --receivers must include 1")
    a.model_args = ["--size", a.size, *GEOMETRY, *(QUICK["model"] if a.quick else []),
                    "--shard-size", a.shard_size]
    a.cmdline = h.command_line(__file__)
    a.work = os.path.abspath(a.work)
    return a


def main():
    a = parse_args()
    if a.child:
        kind, args = a.child[0], a.child[1:]
        if kind == "receiver":
            return receiver_child(args[0], int(args[1]), int(args[2]), int(args[3]), args[4])
        return reader_child(args[1:], int(args[0]))
    work = h.Scratch(a.work, keep=a.keep, names=("store", "cache", "bin", "gen", "mnt",
                                                  "model.json", "dtefs.log"))
    b = None
    with work:
        try:
            tools = h.Tools(a.build_dir, work("bin"), names=("dtectl", "dtefs", "dtegen", "libdte"))
            model_line = check_model(tools, a.model_args, max(a.receivers))
            store, cache = work("store"), work("cache")
            changed = build_store(tools, a, store, cache,
                                  a.base + max(a.distances + a.mapped_distances))
            b = Bench(a, tools, store, cache, a.base)
            h.log("first mount: building snapshots")
            b.mount()
            res = {"reload_cold": [], "reload_cpu": [], "reload_warm": [],
                   "copy_bandwidth": memory_bandwidth()}

            def save():  # after every configuration, so an interrupted run keeps its figures
                h.write_json(a.json, {"results": res, "other_cores": b.load.other,
                                      "changed": changed})
            run_all(b, a, res, save)
            report(a, b, res, model_line, changed)
        finally:
            if b is not None:
                b.unmount()


if __name__ == "__main__":
    main()
