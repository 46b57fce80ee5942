"""The harness every benchmark of tools/bench uses, so that each script holds
its measurement only.

  set-up     Scratch (a work directory made and cleaned up, never a mount
             point), Tools (the built binaries copied so a rebuild cannot
             swap them mid-run), generate / commit_chain (dte-gen models and
             their stores, reused when the same options built them before)
  timing     measure (a child's wall time and peak RSS, from GNU time),
             repeat / paired (repetitions, a baseline in the same run, in
             alternating order), summary (min / median / max), ratios,
             Load (waits for a quiet machine, repeats a contended run)
  FUSE       FuseMount (registered with the tests' mount helpers, so none is
             left behind), readahead, CacheDropper, the readers
  output     md_table / md_row (the Markdown rows docs/benchmarks.md
             quotes), write_json, command_line

Every wait has a deadline. The tests' helpers are imported from one place
(TESTS_PY) only.
"""

import argparse
import atexit
import json
import os
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import namedtuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TESTS_PY = os.path.join(ROOT, "tests", "py")
PY_PATH = os.path.join(ROOT, "sync", "python")  # the dte package
sys.path.insert(0, TESTS_PY)
from fs_util import register, unmount_all, unmount_and_reap, unregister  # noqa: E402
from wait_util import wait_for  # noqa: E402

GB, MB = 1e9, 1e6
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
MOUNT_TIMEOUT = 20.0
READ_CHUNK = MIB  # every reader issues 1 MiB read(2) calls


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd, env=None, timeout=None, text=True, input=None):
    """Runs cmd (any items, made str); raises RuntimeError with its stderr if it fails."""
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, capture_output=True, text=text, env=env, timeout=timeout,
                       input=input)
    if p.returncode != 0:
        err = p.stderr if text else p.stderr.decode(errors="replace")
        raise RuntimeError(f"failed ({p.returncode}): {shlex.join(cmd)}\n{err}")
    return p


def parse_size(text):
    """'512MiB', '2GiB', '1.5GiB', '5GB', '4096' -> bytes."""
    m = re.fullmatch(r"([\d.]+)\s*([KMG]i?B)?", text.strip())
    if not m:
        raise ValueError(f"bad size {text!r}")
    units = {None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": KIB, "MiB": MIB, "GiB": GIB}
    return int(float(m.group(1)) * units[m.group(2)])


def run_threads(fn, args):
    """fn(x) for every x of args, each on its own thread; returns when all did."""
    threads = [threading.Thread(target=fn, args=(x,)) for x in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --- command lines -------------------------------------------------------------------


def add_build_dir_arg(ap):
    """--build-dir: $DTE_BUILD_DIR, else the repository's build/."""
    ap.add_argument("--build-dir", default=os.environ.get("DTE_BUILD_DIR",
                                                          os.path.join(ROOT, "build")))


def add_work_args(ap, default=None, keep=True):
    """--work (default: `default`, None for a temporary directory) and --keep."""
    ap.add_argument("--work", default=default,
                    help="scratch directory" + (" (default: a temporary one)" if not default
                                                else ""))
    if keep:
        ap.add_argument("--keep", action="store_true", help="keep the work directory")


def add_quiet_args(ap, *, max_busy, quiet_timeout, max_other, retries):
    """The quiet-machine options of a timed benchmark (see Load)."""
    ap.add_argument("--max-busy", type=float, default=max_busy,
                    help="wait before each timed run until at most this CPU fraction is busy")
    ap.add_argument("--quiet-timeout", type=float, default=quiet_timeout,
                    help="longest wait (seconds) for a quiet machine before each timed run")
    ap.add_argument("--max-other", type=float, default=max_other,
                    help="repeat a timed run if other processes used more cores than this")
    ap.add_argument("--retries", type=int, default=retries, help="repeats of a contended run")


def parser(doc, *, build=True, work=False, json_arg=True):
    """An ArgumentParser with the options every benchmark shares."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    if build:
        add_build_dir_arg(ap)
    if work is not False:
        add_work_args(ap, work)
    if json_arg:
        ap.add_argument("--json", help="write the results here")
    return ap


def command_line(script):
    """How this run of `script` (a path) was started, to print beside its results."""
    return shlex.join([sys.executable, os.path.relpath(os.path.abspath(script), ROOT)]
                      + sys.argv[1:])


# --- set-up: scratch directory, binaries, models ----------------------------------------


def holds_mount(path):
    """Whether path is a mount point or one lies (up to two levels) below it."""
    if os.path.ismount(path):
        return True
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.ismount(p) or (os.path.isdir(p) and not os.path.islink(p) and any(
                os.path.ismount(os.path.join(p, n)) for n in os.listdir(p))):
            return True
    return False


def remove(*paths):
    """Removes files and directories, never a mount point or a directory holding one."""
    for p in paths:
        if holds_mount(p):
            log(f"not removing {p}: something is mounted there")
        elif os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.remove(p)


class Scratch:
    """A benchmark's work directory. `path` None: a temporary one (under
    `parent`, default the system's). clean()
    (unless keep) removes `names` under it, or everything the script put
    there when it made the directory itself, then the directory if it made
    it; mounts are left alone (and said so). A context manager that also
    unmounts every FuseMount on the way out, and on SIGTERM or SIGHUP."""

    def __init__(self, path=None, *, prefix="dte-bench-", parent=None, keep=False, names=None,
                 fresh=False, disk=False):
        if path is None:
            self.path, self.created = tempfile.mkdtemp(prefix=prefix, dir=parent), True
        else:
            self.path = os.path.abspath(path)
            if fresh:
                remove(self.path)
            self.created = not os.path.exists(self.path)
            os.makedirs(self.path, exist_ok=True)
        self.keep, self.names = keep, names
        if disk and run(["stat", "-f", "-c", "%T", self.path]).stdout.strip() == "tmpfs":
            raise SystemExit(f"{self.path} is on tmpfs; give --work a directory on a disk")

    def __call__(self, *parts):
        return os.path.join(self.path, *parts)

    def clean(self):
        if self.keep:
            return
        if self.names is not None:
            remove(*(self(n) for n in self.names))
        elif self.created:
            remove(*(self(n) for n in os.listdir(self.path)))
        if self.created:
            try:
                os.rmdir(self.path)
            except OSError:
                pass

    def __enter__(self):
        install_cleanup()
        return self

    def __exit__(self, *exc):
        unmount_all()
        self.clean()
        return False


class Tools:
    """The binaries under test (and libdte.so, fp8_requant when asked for),
    copied into bin_dir (when given) so that a rebuild cannot swap them in
    the middle of a run. Attributes: dtectl, dtefs, dtegen, libdte, requant."""

    PATHS = {"dtectl": "tools/dtectl", "dtefs": "tools/dtefs", "dtegen": "tools/dte-gen",
             "libdte": "sync/libdte.so", "requant": "tools/bench/fp8_requant"}

    def __init__(self, build_dir, bin_dir=None, names=("dtectl", "dtefs", "dtegen")):
        self.build_dir = os.path.abspath(build_dir)
        if bin_dir:
            os.makedirs(bin_dir, exist_ok=True)
        for name in names:
            built = os.path.join(self.build_dir, self.PATHS[name])
            if not os.path.exists(built):
                raise SystemExit(f"{built} is not built (ninja -C {build_dir} dtectl dtefs "
                                 "dte-gen dte_shared fp8_requant)")
            setattr(self, name, shutil.copy2(built, bin_dir) if bin_dir else built)
        self._help = None

    def dtectl_cmd(self, cmd, store, cache, *args):
        return [self.dtectl, cmd, "--store", store, "--cache-dir", cache, "-q", *args]

    def log(self, store, cache=None, env=None):
        """`dtectl log --json` of a store: one entry per version."""
        cache = ["--cache-dir", cache] if cache else []
        return json.loads(run([self.dtectl, "log", "--store", store, *cache, "--json"],
                              env=env).stdout)

    def dtefs_option(self, name):
        """The --help line of a dtefs option, or None if this dtefs lacks it."""
        if self._help is None:
            self._help = run([self.dtefs, "--help"]).stdout
        for line in self._help.splitlines():
            if re.search(rf"(^|[\s,]){re.escape(name)}\b", line):
                return " ".join(line.split())
        return None


def step_dir(gen, step):
    return os.path.join(gen, f"step-{step:06d}")


def generate(tools, out, gen_args, last, first=0):
    """dte-gen steps first..last of the model `gen_args` (dte-gen options:
    --size ..., --hidden ...) into out; returns {step: percent of BF16
    elements it changed} (dte-gen's report)."""
    text = run([tools.dtegen, "--out", out, *gen_args, "--start", first, "--steps", last, "-q"],
               timeout=7200).stdout
    return {int(s): float(p) for s, p in re.findall(r"^step (\d+) changed_bf16 ([\d.]+)%",
                                                     text, re.M)}


def commit_chain(tools, store, cache, gen_args, steps, *, gen_dir, batch=8, stamp=None,
                 commit_args=(), env=None, after=None):
    """Generates steps 0..steps of a dte-gen model `batch` at a time (so that
    at most a batch of checkpoints is on disk), imports step 0 and commits
    the rest with `dtectl ... --json`. after(step, record) runs after each.
    Returns {"changed": {step: percent}, "commits": [record per version:
    seconds and dtectl's JSON]}. With `stamp` (a path) a store built before
    with the same options is reused (its record read back)."""
    key = {"gen": [str(x) for x in gen_args], "steps": steps}
    if stamp and os.path.exists(stamp) and os.path.isdir(store):
        with open(stamp) as f:
            old = json.load(f)
        if old.get("key") == key:
            log("reusing the store of an earlier run with the same model options")
            return {"changed": {int(k): v for k, v in old["changed"].items()},
                    "commits": old["commits"]}
    remove(store, cache, *([stamp] if stamp else []))
    changed, commits = {}, []
    for first in range(0, steps + 1, batch):
        last = min(steps, first + batch - 1)
        remove(gen_dir)
        log(f"dte-gen steps {first}..{last}")
        changed.update(generate(tools, gen_dir, gen_args, last, first))
        for s in range(first, last + 1):
            d = step_dir(gen_dir, s)
            cmd = "import" if s == 0 else "commit"
            extra = list(commit_args) if s else []
            t0 = time.monotonic()
            r = run(tools.dtectl_cmd(cmd, store, cache, d, "--json", *extra), env=env,
                    timeout=3600)
            rec = {"seconds": time.monotonic() - t0, **json.loads(r.stdout)}
            commits.append(rec)
            remove(d)
            if after:
                after(s, rec)
    remove(gen_dir)
    out = {"changed": changed, "commits": commits}
    if stamp:
        with open(stamp, "w") as f:
            json.dump({"key": key, **out}, f)
    return out


# --- checkpoints -------------------------------------------------------------------------


def safetensors_tensors(path):
    """{name: (dtype, uint8 array of its bytes)} of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    return {name: (info["dtype"], data[info["data_offsets"][0]:info["data_offsets"][1]])
            for name, info in header.items() if name != "__metadata__"}


def bf16_pairs(prev_dir, cur_dir):
    """Yields (file, tensor, old, new): the BF16 tensors of two checkpoint
    directories, as uint16 arrays of their bits, file and tensor in order."""
    for f in sorted(os.listdir(cur_dir)):
        if not f.endswith(".safetensors"):
            continue
        old = safetensors_tensors(os.path.join(prev_dir, f))
        for name, (dtype, new) in sorted(safetensors_tensors(os.path.join(cur_dir, f)).items()):
            if dtype == "BF16":
                yield f, name, old[name][1].view(np.uint16), new.view(np.uint16)


def bf16_changed(prev_dir, cur_dir):
    """(changed, total) BF16 elements between two checkpoint directories."""
    changed = total = 0
    for _, _, old, new in bf16_pairs(prev_dir, cur_dir):
        changed += int(np.count_nonzero(old != new))
        total += new.size
    return changed, total


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def same_files(got, want):
    """Raises unless directory `got` holds exactly `want`'s files, byte for byte."""
    if sorted(os.listdir(got)) != sorted(os.listdir(want)):
        raise RuntimeError(f"{got} and {want} hold different files")
    for f in sorted(os.listdir(want)):
        run(["cmp", os.path.join(got, f), os.path.join(want, f)])


# --- timing: a child's time and peak memory, repetitions, ratios -------------------------

Measured = namedtuple("Measured", "seconds peak_rss stdout stderr")


def measure(cmd, env=None, input=None, check=True):
    """Runs cmd under GNU time and returns its wall seconds, its peak RSS in
    bytes (GNU time's maximum resident set size), stdout and stderr (text).
    Not wait4's ru_maxrss of a child of this process: Linux carries the
    high-water mark of the (v)forking process's memory across exec, so a child
    of a large Python process reports that process's size."""
    with tempfile.NamedTemporaryFile(mode="r") as rss:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss.name, *map(str, cmd)],
                           capture_output=True, env=env, input=input)
        secs = time.perf_counter() - t0
        text = rss.read().split()
    stdout, stderr = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    if check and p.returncode != 0:
        raise RuntimeError(f"failed ({p.returncode}): {shlex.join(map(str, cmd))}\n{stderr}")
    return Measured(secs, int(text[-1]) * KIB if text else 0, stdout, stderr)


def timed(fn, *args):
    """(seconds, fn(*args))."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def repeat(fn, reps):
    """[fn(rep) for each repetition]."""
    return [fn(rep) for rep in range(reps)]


def paired(dte, baseline, reps, between=None, after=None, baseline_first=False):
    """Runs dte(rep) and baseline(rep) `reps` times, as pairs in alternating
    order (load that comes and goes falls on both sides alike: dte first in
    even repetitions, or the baseline with baseline_first); between(rep)
    runs before each side, after(rep) after each pair. Returns (dte
    results, baseline results)."""
    a, b = [], []
    for rep in range(reps):
        order = ("dte", "base") if (rep % 2 == 0) != baseline_first else ("base", "dte")
        for side in order:
            if between:
                between(rep)
            (a if side == "dte" else b).append((dte if side == "dte" else baseline)(rep))
        if after:
            after(rep)
    return a, b


def summary(values):
    """{"median", "min", "max", "n"} of a list of numbers."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def ratios(num, den):
    """Per-pair ratios num[i] / den[i]."""
    return [n / d for n, d in zip(num, den)]


def fmt_range(values, spec=".2f", unit=""):
    """'median [min-max]' of values (the median alone for one value)."""
    s = summary(values)
    text = f"{s['median']:{spec}}{unit}"
    return text if s["n"] == 1 or s["min"] == s["max"] else (
        text + f" [{s['min']:{spec}}-{s['max']:{spec}}]")


def median(values, default=float("nan")):
    values = list(values)
    return statistics.median(values) if values else default


# --- processes ------------------------------------------------------------------------------


def proc_status(pid, field):
    """A size field of /proc/PID/status (VmHWM, VmRSS, ...; pid "self"), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid="self"):
    """Restarts VmHWM from the current resident set (/proc/PID/clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5\n")


def trim_heap():
    """Returns freed heap to the system, so that what a step allocates shows
    up in the resident set instead of reusing pages freed before."""
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def process_cpu_seconds(pid):
    """User + system CPU time of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --- a quiet machine --------------------------------------------------------------------------


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[:8]), v[3] + v[4]  # all, idle + iowait


def busy_fraction(interval=0.5):
    """Fraction of all CPUs busy over `interval` seconds (everyone's work)."""
    t0, i0 = _cpu_times()
    time.sleep(interval)
    t1, i1 = _cpu_times()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


class QuietWaiter:
    """Waits before each timed run until the machine is nearly idle, for at most
    `timeout` seconds; keeps the busy fractions seen when each run started."""

    def __init__(self, threshold, timeout):
        self.threshold, self.timeout = threshold, timeout
        self.seen, self.waited, self.gave_up = [], 0.0, 0

    def wait(self):
        if self.timeout <= 0:
            return
        start = time.monotonic()
        while True:
            b = busy_fraction()
            if b <= self.threshold:
                break
            if time.monotonic() - start > self.timeout:
                self.gave_up += 1
                break
            time.sleep(2.0)
        self.waited += time.monotonic() - start
        self.seen.append(b)


def _busy_seconds():
    """CPU seconds all cores spent neither idle nor waiting for I/O, since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds(pids):
    t = os.times()
    return t.user + t.system + sum(process_cpu_seconds(p) for p in pids)


class OtherLoad:
    """Context manager around a timed run: `cores` is the CPU the rest of the
    machine used meanwhile (all busy CPU minus this process and `pids`), in cores.
    Kernel threads working for the run (I/O completion) count as other load too,
    so a small threshold is not zero."""

    def __init__(self, pids=()):
        self.pids = list(pids)
        self.cores = 0.0

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_seconds(), _own_seconds(self.pids)
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        other = (_busy_seconds() - self.busy0) - (_own_seconds(self.pids) - self.own0)
        self.cores = max(0.0, other) / max(wall, 1e-6)
        return False


class Load:
    """How timed runs deal with the rest of a shared machine (the options of
    add_quiet_args): before each, a wait for a quiet machine; a run during
    which other processes used more than max_other cores is repeated (at
    most `retries` more times; the last attempt counts either way)."""

    def __init__(self, a):
        self.quiet = QuietWaiter(a.max_busy, a.quiet_timeout)
        self.max_other, self.retries = a.max_other, a.retries
        self.runs = self.retried = self.contended = 0
        self.other = []  # other load (cores) during each counted run

    def timed(self, prepare, body, pids=lambda: [], undo=None):
        """prepare(); waits for a quiet machine; returns body(), repeating
        (after undo()) while processes other than this one and pids() used
        more than max_other cores."""
        for attempt in range(self.retries + 1):
            if attempt and undo:
                undo()
            prepare()
            self.quiet.wait()
            with OtherLoad(pids()) as other:
                out = body()
            if other.cores <= self.max_other:
                break
            self.retried += attempt < self.retries
        else:
            self.contended += 1
        self.runs += 1
        self.other.append(other.cores)
        return out

    def report(self):
        other = (f"median {median(self.other):.2f} cores, max {max(self.other):.2f}"
                 if self.other else "none measured")
        return (f"timed runs {self.runs}, repeated {self.retried}, contended after retries "
                f"{self.contended}; other load during runs: {other}; waited "
                f"{self.quiet.waited:.0f} s for quiet (gave up {self.quiet.gave_up} times)")


# --- FUSE mounts ---------------------------------------------------------------------------------


class FuseMount:
    """A foreground FUSE daemon `argv` serving `path`; stderr goes to `log_path`.
    Registered with the tests' mount helpers (tests/py/fs_util.py), so their
    `unmount_all` removes it. A context manager."""

    def __init__(self, name, argv, path, log_path):
        self.name, self.argv, self.path, self.log_path = name, list(map(str, argv)), path, log_path
        self.proc = None

    def start(self):
        os.makedirs(self.path, exist_ok=True)
        if os.path.ismount(self.path):
            raise RuntimeError(f"{self.path} is already a mount point; unmount it first")
        register(self)
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)
        wait_for(lambda: os.path.ismount(self.path) or self.proc.poll() is not None,
                 MOUNT_TIMEOUT, f"{self.name} to mount {self.path}")
        if self.proc.poll() is not None:
            self.unmount()
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}; see {self.log_path}")
        return self

    def cpu_seconds(self):
        """User + system CPU time of the daemon (all its threads) so far."""
        return process_cpu_seconds(self.proc.pid)

    def status(self):
        """dtefs's .dte/status."""
        with open(os.path.join(self.path, ".dte", "status")) as f:
            return json.load(f)

    def unmount(self):
        """Unmounts (lazily if it must) and reaps the daemon; safe to repeat."""
        unmount_and_reap(self.path, self.proc)
        unregister(self)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.unmount()


def dtefs_mount(tools, store, path, cache, *args, log_path=None):
    """A FuseMount of dtefs (not started)."""
    argv = [tools.dtefs, store, path, "--cache-dir", cache, "-f", *args]
    return FuseMount("dtefs", argv, path, log_path or path + ".log")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_cleanup():
    """Unmounts everything at exit, also after SIGTERM or SIGHUP (as after ^C)."""
    atexit.register(unmount_all)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)


def bdi_of(path):
    """The sysfs directory of the backing device info of the filesystem at path."""
    st = os.stat(path)
    return f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def set_readahead_kb(path, kb):
    """Sets the mount's kernel readahead window; returns the value read back."""
    with open(os.path.join(bdi_of(path), "read_ahead_kb"), "w") as f:
        f.write(f"{kb}\n")
    return readahead_kb(path)


def readahead_kb(path):
    with open(os.path.join(bdi_of(path), "read_ahead_kb")) as f:
        return int(f.read())


def block_device_readahead_kb(path):
    """(device name, read_ahead_kb) of the block device under path, if one is found."""
    st = os.stat(path)
    sys_dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    name = os.path.basename(os.path.realpath(sys_dev))
    for q in (os.path.join(sys_dev, "queue"), os.path.join(sys_dev, "..", "queue")):
        try:
            with open(os.path.join(q, "read_ahead_kb")) as f:
                return name, int(f.read())
        except OSError:
            pass
    return None, None


# --- cold caches -------------------------------------------------------------------------------


def fadvise_dontneed(path, sync=False):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # deleted meanwhile
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_from_page_cache(dirs):
    """Writes back and evicts every file under `dirs` (blobs, snapshots)."""
    for d in dirs:
        for root, _, files in os.walk(d):
            for name in files:
                fadvise_dontneed(os.path.join(root, name), sync=True)


class CacheDropper:
    """Evicts the page cache: drop_caches if permitted, else fadvise(DONTNEED) on
    every file under the given directories. `method` names what was used.
    As before the harness: drop_caches is written on the first drop only;
    later drops fadvise the directories (the test below never matches the
    name `method` takes), which the figures of docs/benchmarks.md were
    measured with."""

    def __init__(self, dirs):
        self.dirs = list(dirs)
        self.method = None

    def drop(self):
        subprocess.run(["sync"], check=True)
        if self.method in (None, "drop_caches"):
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
                self.method = "sync; echo 3 > /proc/sys/vm/drop_caches"
                return
            except OSError:
                self.method = "posix_fadvise(POSIX_FADV_DONTNEED) on every store and export file"
        for d in self.dirs:
            for root, _, files in os.walk(d):
                for name in files:
                    fadvise_dontneed(os.path.join(root, name))


# --- readers -------------------------------------------------------------------------------------


def read_file(path, buf):
    """Reads path to its end in len(buf)-byte read(2) calls; returns the bytes read."""
    total = 0
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return total
            total += n


def read_sequential(paths):
    """One reader, the files one after the other; returns (bytes, seconds)."""
    buf = bytearray(READ_CHUNK)
    t0 = time.perf_counter()
    total = sum(read_file(p, buf) for p in paths)
    return total, time.perf_counter() - t0


def read_dir(d):
    """Reads every file of directory d in order; returns (bytes, seconds)."""
    return read_sequential([os.path.join(d, n) for n in sorted(os.listdir(d))])


def read_parallel(paths):
    """One thread per file, all started together; returns (bytes, seconds) until
    the last one finishes. read(2) releases the GIL, so the threads read in
    parallel like one process per rank would."""
    totals, errors = [0] * len(paths), []
    barrier = threading.Barrier(len(paths) + 1)

    def worker(i):
        buf = bytearray(READ_CHUNK)
        barrier.wait()
        try:
            totals[i] = read_file(paths[i], buf)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(totals), secs


# --- output ----------------------------------------------------------------------------------------


def md_row(cells):
    """One Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(headers, rows):
    """A Markdown table (a string): the header, its rule and the rows."""
    return "\n".join([md_row(headers), "|" + "---|" * len(headers)] + [md_row(r) for r in rows])


def write_json(path, obj):
    """Writes obj as JSON to path (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


