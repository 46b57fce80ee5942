"""Running dtectl from tests: one store, one cache directory, parsed results."""

import atexit
import json
import os
import pty
import select
import shutil
import subprocess
import tempfile
import tty
from pathlib import Path

import pytest

BUILD_DIR = Path(os.environ.get("DTE_BUILD_DIR", "/work/main/build"))
BUILT_DTECTL = BUILD_DIR / "tools" / "dtectl"
_binary = None


def binary():
    """A private copy of the built dtectl, made on first use, so that a rebuild
    in the shared build directory cannot swap the program under a running test."""
    global _binary
    if _binary is None:
        if not os.access(BUILT_DTECTL, os.X_OK):
            pytest.fail(f"{BUILT_DTECTL} is not built "
                        "(set DTE_BUILD_DIR or build the dtectl target)")
        bin_dir = tempfile.mkdtemp(prefix="dtectl-bin-")
        atexit.register(shutil.rmtree, bin_dir, True)
        _binary = Path(shutil.copy2(BUILT_DTECTL, os.path.join(bin_dir, "dtectl")))
    return _binary


# Exit statuses of dtectl.
OK, ERROR, USAGE, CONFLICT, CORRUPT = 0, 1, 2, 3, 4


def _clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTE_")}
    env.update(extra or {})
    return env


def run(*args, env=None, check=False, timeout=120):
    """dtectl with exactly `args` (no store or cache of its own: for commands
    given a mount, or a --store each call) in the clean environment plus
    `env`; with `check`, a non-zero exit fails the test naming the command."""
    r = subprocess.run([str(binary()), *map(str, args)], env=_clean_env(env),
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == OK, f"dtectl {args}: exit {r.returncode}\n{r.stderr}"
    return r


def s3(server, uri, cache, endpoint=None, env=None):
    """A Dtectl on the s3:// store `uri` of moto `server`, reached at
    `endpoint` (a proxy's; default the server's), with no AWS_ variable but
    the server's."""
    d = Dtectl(uri, cache, env={**server.env(), "AWS_ENDPOINT_URL": endpoint or server.endpoint,
                                **(env or {})})
    for k in [k for k in d.env if k.startswith("AWS_") and k not in server.env()]:
        del d.env[k]
    return d


class Dtectl:
    """Runs dtectl against one store and cache directory."""

    def __init__(self, store, cache, env=None):
        self.binary = binary()
        self.store, self.cache = str(store), str(cache)
        self.env = _clean_env(env)
        # Anything not told --cache-dir lands in the test's directory, not in ~.
        self.env["XDG_CACHE_HOME"] = os.path.join(os.path.dirname(self.cache), "xdg-cache")

    def argv(self, cmd, *args, store=None, cache=None):
        return [str(self.binary), cmd, "--store", store or self.store,
                "--cache-dir", cache or self.cache, *map(str, args)]

    def run(self, cmd, *args, store=None, cache=None, timeout=120, **kw):
        return subprocess.run(self.argv(cmd, *args, store=store, cache=cache), env=self.env,
                              capture_output=True, text=True, timeout=timeout, **kw)

    def popen(self, cmd, *args, **kw):
        return subprocess.Popen(self.argv(cmd, *args), env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    def ok(self, cmd, *args, **kw):
        r = self.run(cmd, *args, **kw)
        assert r.returncode == OK, f"dtectl {cmd} {args}: exit {r.returncode}\n{r.stderr}"
        return r

    def commit(self, ckpt_dir, *args):
        """Commits a directory; returns the version number dtectl printed."""
        return int(self.ok("commit", ckpt_dir, *args).stdout)

    def import_steps(self, step_dir, steps):
        """Imports step 0 of `step_dir` (step -> checkpoint directory) and
        commits steps 1..steps, which must become versions 1..steps."""
        self.ok("import", step_dir(0))
        for step in range(1, steps + 1):
            assert self.commit(step_dir(step)) == step
        return self

    def log(self, **kw):
        return json.loads(self.ok("log", "--json", **kw).stdout)

    def versions(self):
        return [v["version"] for v in self.log()]

    def export(self, version, out):
        self.ok("export", "--version", version, out)
        return out

    def copy_to(self, dest):
        """A copy of this store (same store id) with a fresh cache directory."""
        dest = Path(dest)
        shutil.copytree(self.store, dest / "store")
        return Dtectl(dest / "store", dest / "cache")


def run_on_pty(argv, env):
    """Runs argv with stderr on a pseudo-terminal in raw mode; returns (rc, stderr bytes)."""
    master, slave = pty.openpty()
    tty.setraw(slave)
    p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=slave)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            if p.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out += data
    os.close(master)
    return p.wait(timeout=60), out.decode(errors="replace")
