"""Mounting a store with the built dtefs from tests, and never leaving a mount behind.

Every Mount (and HelperMount, a mount made by mount(8)) is registered until
it is unmounted; `unmount_all` (called by the test fixture's teardown and at
interpreter exit) unmounts with `fusermount3 -u` (`umount`) and falls back to
a lazy `umount -l`, then reaps a foreground daemon (ends a helper's). Every
wait has a deadline.
"""

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from wait_util import wait_for

BUILD_DIR = Path(os.environ.get("DTE_BUILD_DIR", "/work/main/build"))
BUILT_DTEFS = BUILD_DIR / "tools" / "dtefs"
MOUNT_TIMEOUT = 20.0
_binary = None
_live = []


def binary():
    """A private copy of the built dtefs (a rebuild must not swap it under a test)."""
    global _binary
    if _binary is None:
        if not os.access(BUILT_DTEFS, os.X_OK):
            import pytest  # only tests get here; the benchmarks import this module too

            pytest.fail(f"{BUILT_DTEFS} is not built (set DTE_BUILD_DIR or build dtefs)")
        bin_dir = tempfile.mkdtemp(prefix="dtefs-bin-")
        atexit.register(shutil.rmtree, bin_dir, True)
        _binary = Path(shutil.copy2(BUILT_DTEFS, os.path.join(bin_dir, "dtefs")))
    return _binary


def generate(out, size, steps, *args):
    """dte-gen steps 0..steps of a `size` model (None: the shape args give)
    into out (more dte-gen arguments in args); returns step -> that step's
    checkpoint directory."""
    gen = BUILD_DIR / "tools" / "dte-gen"
    assert os.access(gen, os.X_OK), f"{gen} is not built"
    size_args = [] if size is None else ["--size", size]
    subprocess.run([str(gen), "--out", str(out), *size_args, "--steps", str(steps),
                    *map(str, args), "-q"], check=True, timeout=300)
    return lambda step: Path(out) / f"step-{step:06d}"


def unmount_and_reap(path, proc):
    """Unmounts the FUSE mount at `path` with `fusermount3 -u`, lazily if it must,
    then reaps its foreground daemon `proc` (None: none), killing it after 15 s."""
    if mounted(path):  # also a dead daemon's mount, which os.path.ismount misses
        r = subprocess.run(["fusermount3", "-u", path], capture_output=True, timeout=30)
        if r.returncode != 0 and mounted(path):
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    if proc is not None and proc.poll() is None:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=15)


def register(mount):
    """Adds a mount (anything with .path and .unmount()) to those `unmount_all`
    removes; its unmount() takes it out again."""
    _live.append(mount)


def unregister(mount):
    if mount in _live:
        _live.remove(mount)


class Mount:
    """One dtefs mount of `store` at `path`."""

    def __init__(self, store, path, cache, args=(), foreground=True, env=None):
        self.store, self.path, self.cache = str(store), str(path), str(cache)
        self.args, self.foreground = list(map(str, args)), foreground
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DTE_")}
        self.env.update(env or {})
        self.proc = None
        self.stderr_path = os.path.join(os.path.dirname(self.path),
                                        os.path.basename(self.path) + ".stderr")

    def argv(self):
        return [str(binary()), self.store, self.path, "--cache-dir", self.cache, *self.args]

    def start(self):
        os.makedirs(self.path, exist_ok=True)
        register(self)
        if self.foreground:
            with open(self.stderr_path, "wb") as err:
                self.proc = subprocess.Popen(self.argv() + ["-f"], env=self.env,
                                             stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=err)
            wait_for(lambda: os.path.ismount(self.path) or self.proc.poll() is not None,
                     MOUNT_TIMEOUT, f"dtefs to mount {self.path}")
            assert self.proc.poll() is None, f"dtefs exited {self.proc.returncode}: {self.log()}"
        else:
            r = subprocess.run(self.argv(), env=self.env, capture_output=True, text=True,
                               timeout=MOUNT_TIMEOUT)
            assert r.returncode == 0, f"dtefs exited {r.returncode}: {r.stderr}"
        wait_for(lambda: os.path.ismount(self.path), MOUNT_TIMEOUT, f"{self.path} mounted")
        return self

    def log(self):
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def alive(self):
        return self.proc is None or self.proc.poll() is None

    def status(self):
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


class HelperMount:
    """A dtefs mount made by someone else (mount(8) through the fuse3 helper):
    registered like a Mount, so that `unmount_all` removes it and ends its
    daemon (found by its mount point, which is unique to the test)."""

    def __init__(self, path):
        self.path = str(path)

    def register(self):
        register(self)
        return self

    def unmount(self):
        if mounted(self.path):
            r = subprocess.run(["umount", self.path], capture_output=True, timeout=30)
            if r.returncode != 0 and mounted(self.path):
                subprocess.run(["umount", "-l", self.path], capture_output=True, timeout=30)
        try:
            wait_for(lambda: not dtefs_pids(self.path), 15.0, f"dtefs of {self.path} to exit")
        except AssertionError:
            for pid in dtefs_pids(self.path):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        unregister(self)


def mounted(path):
    """Whether `path` is a mount point, also when it is a FUSE mount whose
    daemon died (stat fails there, so os.path.ismount says no)."""
    path = os.path.abspath(str(path))
    with open("/proc/self/mounts") as f:
        targets = [line.split()[1].replace("\\040", " ") for line in f]
    # The literal path first: asking the filesystem (stat) would hang on a
    # daemon that stopped answering.
    return path in targets or os.path.realpath(path) in targets


def dtefs_pids(mountpoint):
    """Live (not zombie) dtefs processes with `mountpoint` among their arguments."""
    mountpoint = os.path.abspath(str(mountpoint))
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # exited meanwhile
            continue
        if argv and os.path.basename(argv[0]) == "dtefs" and mountpoint in argv[1:]:
            pids.append(int(entry))
    return pids


@contextlib.contextmanager
def mounts(root):
    """Yields start(store, *args, foreground=True, cache=None) -> a started Mount
    under `root` (cache: its --cache-dir, default a fresh one under `root`); on
    exit every mount started is unmounted, and none may be left."""
    made = []

    def start(store, *args, foreground=True, cache=None):
        m = Mount(store, os.path.join(root, f"mnt{len(made)}"),
                  cache or os.path.join(root, f"fscache{len(made)}"), args, foreground)
        made.append(m)
        return m.start()

    try:
        yield start
    finally:
        try:
            for m in made:
                try:
                    m.unmount()
                except Exception:  # keep going: the others must be unmounted too
                    pass
            unmount_all()
        finally:
            left = [m.path for m in made if mounted(m.path)]
            for path in left:  # the last resort
                subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    assert not left, f"still mounted after unmounting: {left}"


def unmount_all():
    for m in list(_live):
        try:
            m.unmount()
        except Exception:  # keep going: the others must be unmounted too
            subprocess.run(["umount", "-l", m.path], capture_output=True, timeout=30)
            if m in _live:
                _live.remove(m)


atexit.register(unmount_all)
