"""dtefs mounted the way hosts mount filesystems: through the fuse3 mount helper.

`mount -t fuse.dtefs STORE MOUNTPOINT -o ...` and an fstab line
`STORE MOUNTPOINT fuse.dtefs ro,... 0 0` make util-linux mount(8) run
/sbin/mount.fuse (mount.fuse3), which runs `/bin/sh -c 'dtefs STORE MOUNTPOINT
-o ...'`. mount(8) clears PATH (and HOME) before it runs a helper, so that
shell finds dtefs only in its default path (/usr/local/sbin:/usr/local/bin:
/usr/sbin:/usr/bin:/sbin:/bin), where an installed dtefs lives. To test the
built dtefs without installing it, mount(8) runs in a private mount namespace
in which a directory holding dtefs is bound over /usr/local/sbin. The mount
point lies under a shared bind mount of the test's directory, so the new
mount propagates back to the test's namespace, where it is read, inspected
and unmounted like any other mount.
"""

import json
import os
import subprocess

import pytest

import fs_util
from dtectl_util import Dtectl
from fs_util import HelperMount, dtefs_pids
from wait_util import wait_for

NAMESPACE_PATH_DIR = "/usr/local/sbin"  # first in /bin/sh's default path

# Runs "$@" in a new mount namespace whose /usr/local/sbin is the directory $1.
# The mount holding /usr/local/sbin is made private first (not recursively, so
# the shared test directory stays shared): the bind must not reach the host.
IN_NAMESPACE = """set -e
bin=$1; shift
mount --make-private "$(findmnt -n -o TARGET --target {path})"
mount --bind "$bin" {path}
exec "$@"
""".format(path=NAMESPACE_PATH_DIR)


@pytest.fixture(scope="module")
def store(tmp_path_factory, ckpts):
    """A store holding steps 0 (anchor) and 1 (delta); only read by these tests."""
    root = tmp_path_factory.mktemp("mountstore")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", ckpts.dir(0))
    d.ok("commit", ckpts.dir(1))
    return d


@pytest.fixture
def shared_dir(tmp_path):
    """A directory that is a shared mount: mounts made under it in a child mount
    namespace appear in this one. Unmounted, with anything left under it, at
    teardown."""
    root = tmp_path / "shared"
    root.mkdir()
    guard = HelperMount(root).register()
    subprocess.run(["mount", "--bind", root, root], check=True, timeout=30)
    subprocess.run(["mount", "--make-shared", root], check=True, timeout=30)
    yield root
    for sub in sorted(root.iterdir(), reverse=True):
        HelperMount(sub).unmount()
    guard.unmount()
    fs_util.unmount_all()
    assert not os.path.ismount(root)


def run_mount_in_namespace(argv):
    """Runs mount(8) argv where it finds the built dtefs on /bin/sh's default path."""
    bin_dir = fs_util.binary().parent  # holds only the private copy, named dtefs
    return subprocess.run(["unshare", "--mount", "--propagation", "unchanged", "sh", "-c",
                           IN_NAMESPACE, "sh", str(bin_dir), *map(str, argv)],
                          capture_output=True, text=True, timeout=fs_util.MOUNT_TIMEOUT)


def store_id(store):
    with open(os.path.join(store, "dte-store.json")) as f:
        return json.load(f)["store_id"]


def findmnt(path):
    r = subprocess.run(["findmnt", "-J", "-n", "-o", "TARGET,FSTYPE,OPTIONS",
                        "--mountpoint", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"findmnt: {path} is not a mount point"
    (fs,) = json.loads(r.stdout)["filesystems"]
    return fs


def proc_mounts_entry(path):
    with open("/proc/mounts") as f:
        rows = [line.split() for line in f]
    return [r for r in rows if r[1] == str(path)]


def check_serves_the_store(mnt, store, ckpts, cache_dir):
    """The mount is read-only fuse.dtefs, serves the committed bytes, and its
    daemon uses the cache directory given in the mount options."""
    fs = findmnt(mnt)
    assert fs["fstype"] == "fuse.dtefs", fs
    assert "ro" in fs["options"].split(","), fs
    (entry,) = proc_mounts_entry(mnt)
    assert entry[2] == "fuse.dtefs" and "ro" in entry[3].split(","), entry
    assert sorted(os.listdir(mnt)) == [".dte", "fp8", "latest", "live", "v00000000", "v00000001"]
    for version, step in (("latest", 1), ("v00000000", 0)):
        for name in os.listdir(ckpts.dir(step)):
            r = subprocess.run(["cmp", os.path.join(mnt, version, name),
                                os.path.join(ckpts.dir(step), name)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, f"{version}/{name}: {r.stdout}{r.stderr}"
    index = os.path.join(cache_dir, store_id(store.store), "index")
    wait_for(lambda: os.path.isdir(index), 10.0, f"dtefs to open its index in {index}")
    (pid,) = dtefs_pids(mnt)
    return pid


def check_umount_ends_daemon(mnt, pid):
    r = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert not os.path.ismount(mnt) and not proc_mounts_entry(mnt)
    wait_for(lambda: not dtefs_pids(mnt), 15.0, f"dtefs {pid} of {mnt} to exit")


def test_mount_fuse3_helper_runs_dtefs_found_on_path(store, ckpts, tmp_path):
    mnt, cache = tmp_path / "mnt", tmp_path / "fscache"
    mnt.mkdir()
    guard = HelperMount(mnt).register()
    try:
        env = dict(os.environ, PATH=f"{fs_util.binary().parent}:{os.environ['PATH']}")
        r = subprocess.run(["/sbin/mount.fuse3", store.store, mnt, "-t", "fuse.dtefs",
                            "-o", f"cache_dir={cache},cache_size=48MiB"],
                           env=env, capture_output=True, text=True,
                           timeout=fs_util.MOUNT_TIMEOUT)
        assert r.returncode == 0, r.stderr
        pid = check_serves_the_store(mnt, store, ckpts, cache)
        with open(os.path.join(mnt, ".dte", "status")) as f:
            assert json.load(f)["cache"]["capacity_bytes"] == 48 << 20
        check_umount_ends_daemon(mnt, pid)
    finally:
        guard.unmount()
    assert not os.path.ismount(mnt)


def test_mount_t_fuse_dtefs(store, ckpts, shared_dir):
    mnt, cache = shared_dir / "mnt", shared_dir.parent / "fscache"
    mnt.mkdir()
    r = run_mount_in_namespace(["mount", "-t", "fuse.dtefs", store.store, mnt,
                                "-o", f"cache_dir={cache},cache_size=40MiB,poll_ms=200"])
    assert r.returncode == 0, r.stderr
    pid = check_serves_the_store(mnt, store, ckpts, cache)
    with open(os.path.join(mnt, ".dte", "status")) as f:
        assert json.load(f)["cache"]["capacity_bytes"] == 40 << 20
    check_umount_ends_daemon(mnt, pid)


def test_fstab_line_mounted_with_alternative_fstab(store, ckpts, shared_dir):
    mnt, cache = shared_dir / "mnt", shared_dir.parent / "fscache"
    mnt.mkdir()
    fstab = shared_dir.parent / "fstab"
    fstab.write_text("# dte policy store, read-only\n"
                     f"{store.store} {mnt} fuse.dtefs "
                     f"ro,cache_dir={cache},poll_ms=200,nofail 0 0\n")
    r = run_mount_in_namespace(["mount", "-T", fstab, mnt])
    assert r.returncode == 0, r.stderr
    pid = check_serves_the_store(mnt, store, ckpts, cache)
    check_umount_ends_daemon(mnt, pid)
