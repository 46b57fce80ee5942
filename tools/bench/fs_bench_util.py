"""Helpers for tools/bench/fs_bench.py: FUSE mounts that are never left behind,
kernel readahead of a mount, cold page caches, quiet-machine waits, readers.

Every FuseMount is registered while mounted with the tests' mount helpers
(tests/py/fs_util.py); their `unmount_all` (run at exit and on
SIGTERM/SIGINT/SIGHUP through the caller's try/finally) unmounts with
`fusermount3 -u`, falls back to a lazy `umount -l`, then reaps the daemon.
Every wait has a deadline.
"""

import atexit
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "py"))
from fs_util import register, unmount_all, unmount_and_reap, unregister  # noqa: E402
from wait_util import wait_for  # noqa: E402

MOUNT_TIMEOUT = 20.0
READ_CHUNK = 1 << 20  # every reader issues 1 MiB read(2) calls


class FuseMount:
    """A foreground FUSE daemon `argv` serving `path`; stderr goes to `log_path`.
    Registered with the tests' mount helpers (tests/py/fs_util.py), so their
    `unmount_all` removes it."""

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

    def unmount(self):
        """Unmounts (lazily if it must) and reaps the daemon; safe to repeat."""
        unmount_and_reap(self.path, self.proc)
        unregister(self)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_cleanup():
    """Unmounts everything at exit, also after SIGTERM or SIGHUP (as after ^C)."""
    atexit.register(unmount_all)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)


# --- readahead ---------------------------------------------------------------------


def bdi_of(path):
    """The sysfs directory of the backing device info of the filesystem at path."""
    st = os.stat(path)
    return f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def set_readahead_kb(path, kb):
    """Sets the mount's kernel readahead window; returns the value read back."""
    ra = os.path.join(bdi_of(path), "read_ahead_kb")
    with open(ra, "w") as f:
        f.write(f"{kb}\n")
    return readahead_kb(path)


def readahead_kb(path):
    with open(os.path.join(bdi_of(path), "read_ahead_kb")) as f:
        return int(f.read())


def block_device_readahead_kb(path):
    """(device name, read_ahead_kb) of the block device under path, if one is found."""
    st = os.stat(path)
    sys_dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        name = os.path.basename(os.path.realpath(sys_dev))
        with open(os.path.join(sys_dev, "queue", "read_ahead_kb")) as f:
            return name, int(f.read())
    except OSError:
        try:
            with open(os.path.join(sys_dev, "..", "queue", "read_ahead_kb")) as f:
                return name, int(f.read())
        except OSError:
            return None, None


# --- cold caches ------------------------------------------------------------------


class CacheDropper:
    """Evicts the page cache: drop_caches if permitted, else fadvise(DONTNEED) on
    every file under the given directories. `method` names what was used."""

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


def fadvise_dontneed(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- a quiet machine ------------------------------------------------------------


def _cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v[:8]), idle


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


# --- processes ---------------------------------------------------------------------


def proc_status(pid, field):
    """A size field of /proc/PID/status (VmHWM, VmRSS, ...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


# --- readers -------------------------------------------------------------------------


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


# --- other load during a timed run ------------------------------------------------


def _busy_seconds():
    """CPU seconds all cores spent neither idle nor waiting for I/O, since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


# --- command lines the benchmarks share ------------------------------------------------

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_build_dir_arg(ap):
    """--build-dir: $DTE_BUILD_DIR, else the repository's build/."""
    ap.add_argument("--build-dir", default=os.environ.get("DTE_BUILD_DIR",
                                                          os.path.join(REPO_ROOT, "build")))


def add_quiet_args(ap, *, max_busy, quiet_timeout, max_other, retries):
    """The quiet-machine options of a timed benchmark (QuietWaiter, OtherLoad)."""
    ap.add_argument("--max-busy", type=float, default=max_busy,
                    help="wait before each timed run until at most this CPU fraction is busy")
    ap.add_argument("--quiet-timeout", type=float, default=quiet_timeout,
                    help="longest wait (seconds) for a quiet machine before each timed run")
    ap.add_argument("--max-other", type=float, default=max_other,
                    help="repeat a timed run if other processes used more cores than this")
    ap.add_argument("--retries", type=int, default=retries, help="repeats of a contended run")


def command_line(script):
    """How this run of `script` (a path) was started, to print beside its results."""
    return shlex.join([sys.executable, os.path.relpath(os.path.abspath(script), REPO_ROOT)]
                      + sys.argv[1:])
