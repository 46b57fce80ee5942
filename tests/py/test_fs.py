"""End-to-end tests of dtefs: real mounts of real stores through /dev/fuse.

Each test mounts a store, checks what readers see against the committed
checkpoint directories, and unmounts in its fixture's teardown (fusermount3,
falling back to a lazy umount), so a failing test never leaves a mount.
"""

import datetime
import errno
import filecmp
import json
import mmap
import os
import random
import signal
import struct
import subprocess
import time

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch

import ckpt_util
from dtectl_util import Dtectl
import fs_util
from wait_util import wait_for

STEPS = 3  # versions in the shared store


@pytest.fixture(scope="session")
def fs_store(tmp_path_factory, ckpts):
    """A store holding steps 0 (anchor), 1 and 2 (deltas). Copy it before writing."""
    root = tmp_path_factory.mktemp("fsbase")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", ckpts.dir(0))
    for step in range(1, STEPS):
        d.ok("commit", ckpts.dir(step))
    return d


def tensor_ranges(path):
    """[(name, file offset, end)] of a safetensors file, and its header size."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = [(name, base + e["data_offsets"][0], base + e["data_offsets"][1])
           for name, e in header.items() if name != "__metadata__"]
    return sorted(out, key=lambda t: t[1]), base


def shard_names(ckpt):
    return [s.name for s in ckpt.shards]


# --- namespace -------------------------------------------------------------------

def test_ls_shows_versions_and_latest_symlink(fs_store, ckpts, mount):
    m = mount(fs_store.store, foreground=False)  # the daemonizing form
    names = [f"v{i:08d}" for i in range(STEPS)]
    assert sorted(os.listdir(m.path)) == sorted(names + ["latest", "live", "fp8", ".dte"])
    assert os.path.islink(os.path.join(m.path, "latest"))
    assert os.readlink(os.path.join(m.path, "latest")) == names[-1]
    log = {v["version"]: v for v in fs_store.log()}
    for i, name in enumerate(names):
        d = os.path.join(m.path, name)
        assert sorted(os.listdir(d)) == sorted(os.listdir(ckpts.dir(i)))
        for f in os.listdir(d):
            st = os.stat(os.path.join(d, f))
            assert st.st_size == os.path.getsize(os.path.join(ckpts.dir(i), f))
            assert st.st_mode & 0o222 == 0
        created = log[i]["created"].replace("Z", "+00:00")
        want = datetime.datetime.fromisoformat(created).timestamp()
        assert abs(os.stat(d).st_mtime - want) < 1.0
    status = m.status()
    assert status["versions"] == list(range(STEPS)) and status["latest"] == STEPS - 1


def test_every_file_of_every_version_is_identical(fs_store, ckpts, mount):
    m = mount(fs_store.store)
    for i in range(STEPS):
        src = ckpts.dir(i)
        for f in os.listdir(src):
            got = os.path.join(m.path, f"v{i:08d}", f)
            assert filecmp.cmp(got, os.path.join(src, f), shallow=False), got
    for f in os.listdir(ckpts.dir(STEPS - 1)):
        r = subprocess.run(["cmp", os.path.join(m.path, "latest", f),
                            os.path.join(ckpts.dir(STEPS - 1), f)], timeout=60)
        assert r.returncode == 0, f


def test_random_ranges_including_boundaries(fs_store, ckpts, mount):
    m = mount(fs_store.store)
    rng = random.Random(7)
    for i in (0, STEPS - 1):
        for f in os.listdir(ckpts.dir(i)):
            src = os.path.join(ckpts.dir(i), f)
            with open(src, "rb") as fh:
                want = fh.read()
            cuts = [0, len(want)]
            if f.endswith(".safetensors"):
                ranges, header = tensor_ranges(src)
                cuts += [header] + [b for _, b, _ in ranges]
            fd = os.open(os.path.join(m.path, f"v{i:08d}", f), os.O_RDONLY)
            try:
                for _ in range(60):
                    c = rng.choice(cuts)  # straddle a header or tensor boundary
                    off = max(0, min(len(want), c + rng.randint(-5000, 100)))
                    n = rng.choice([1, 7, 4096, 65536, 300000, 2 << 20])
                    assert os.pread(fd, n, off) == want[off:off + n], (f, off, n)
                assert os.pread(fd, 100, len(want) + 10) == b""
            finally:
                os.close(fd)


# --- real readers ------------------------------------------------------------------

def test_safetensors_readers_numpy_and_torch(fs_store, ckpts, mount):
    m = mount(fs_store.store)
    for i in range(STEPS):
        ckpt = ckpts.state(i)
        d = os.path.join(m.path, "latest" if i == STEPS - 1 else f"v{i:08d}")
        for shard in ckpt.shards:
            path = os.path.join(d, shard.name)
            raw = ckpt_util.read_safetensors(path)[1]  # raw bytes through the mount
            for name in shard.tensors:
                assert np.array_equal(raw[name][1], ckpt.tensors[name][1]), name
            if shard.writer != "torch":  # float8: neither numpy nor torch 1.13 knows it
                continue
            with safe_open(path, framework="pt") as f:
                assert sorted(f.keys()) == sorted(shard.tensors)
                for name in shard.tensors:
                    got = ckpt_util.from_torch(f.get_tensor(name))
                    assert np.array_equal(got, ckpt.tensors[name][1]), name
            for name, t in load_torch(path).items():
                assert np.array_equal(ckpt_util.from_torch(t), ckpt.tensors[name][1]), name
            if all(ckpt.tensors[n][0] != "BF16" for n in shard.tensors):
                for name, a in load_numpy(path).items():
                    assert a.tobytes() == ckpt.tensors[name][1].tobytes(), name
            with safe_open(path, framework="np") as f:
                for name in shard.tensors:
                    if ckpt.tensors[name][0] != "BF16":  # numpy has no bfloat16
                        assert f.get_tensor(name).tobytes() == ckpt.tensors[name][1].tobytes()


def test_plain_mmap_reads_equal(fs_store, ckpts, mount):
    m = mount(fs_store.store)
    for f in shard_names(ckpts.state(1)):
        with open(os.path.join(m.path, "v00000001", f), "rb") as fh:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                with open(os.path.join(ckpts.dir(1), f), "rb") as src:
                    assert mm[:] == src.read()


def test_writes_fail_with_erofs(fs_store, mount):
    m = mount(fs_store.store)
    f = os.path.join(m.path, "latest", "config.json")
    attempts = [
        lambda: open(f, "r+b"),
        lambda: open(os.path.join(m.path, "latest", "new.txt"), "wb"),
        lambda: os.truncate(f, 0),
        lambda: os.unlink(f),
        lambda: os.mkdir(os.path.join(m.path, "vnew")),
        lambda: os.rename(f, f + ".bak"),
        lambda: os.symlink("x", os.path.join(m.path, "link")),
        lambda: os.chmod(f, 0o644),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    assert m.alive()


# --- live store --------------------------------------------------------------------

def test_new_version_appears_and_latest_moves(fs_store, ckpts, mount, tmp_path):
    dte = fs_store.copy_to(tmp_path / "live")
    m = mount(dte.store)
    latest = os.path.join(m.path, "latest")
    assert os.readlink(latest) == f"v{STEPS - 1:08d}"
    assert dte.commit(ckpts.dir(STEPS)) == STEPS
    t0 = time.monotonic()
    new = f"v{STEPS:08d}"
    wait_for(lambda: new in os.listdir(m.path), 5.0, f"{new} in the listing")
    assert time.monotonic() - t0 < 3.0  # polled every 500 ms; slack for a loaded CI host
    wait_for(lambda: os.readlink(latest) == new, 2.0, "latest to move")
    for f in os.listdir(ckpts.dir(STEPS)):
        assert filecmp.cmp(os.path.join(latest, f), os.path.join(ckpts.dir(STEPS), f),
                           shallow=False)


def test_gc_removes_versions_while_an_open_file_keeps_reading(fs_store, ckpts, mount, tmp_path):
    dte = fs_store.copy_to(tmp_path / "gc")
    m = mount(dte.store)
    shard = ckpts.state(0).shards[1].name
    with open(os.path.join(ckpts.dir(0), shard), "rb") as f:
        want = f.read()
    with open(os.path.join(m.path, "v00000000", shard), "rb") as f:
        head = f.read(4096)
        dte.ok("gc", "--keep-last", 1)  # default grace: unreferenced blobs stay a while
        wait_for(lambda: "v00000000" not in os.listdir(m.path), 5.0, "v00000000 to go")
        wait_for(lambda: not os.path.exists(os.path.join(m.path, "v00000000")), 5.0,
                 "v00000000 lookups to fail")
        assert head + f.read() == want
    assert sorted(os.listdir(m.path)) == [".dte", "fp8", "latest", "live", f"v{STEPS - 1:08d}"]
    for f in os.listdir(ckpts.dir(STEPS - 1)):  # the kept version was rebased: same bytes
        assert filecmp.cmp(os.path.join(m.path, "latest", f),
                           os.path.join(ckpts.dir(STEPS - 1), f), shallow=False)


def test_listing_and_opening_are_lazy_reading_one_tensor_decodes_its_blocks(fs_store, ckpts,
                                                                          mount):
    m = mount(fs_store.store)  # the block cache makes "decoded" count distinct blocks
    d = os.path.join(m.path, "v00000002")
    for f in os.listdir(d):
        os.stat(os.path.join(d, f))
        os.close(os.open(os.path.join(d, f), os.O_RDONLY))
    s0 = m.status()
    assert s0["blocks_decoded"] == 0 and s0["bytes_served"] == 0
    shard = ckpts.state(2).shards[0].name
    path = os.path.join(d, shard)
    ranges, _ = tensor_ranges(os.path.join(ckpts.dir(2), shard))
    name, begin, end = max(ranges[1:-1], key=lambda t: t[2] - t[1])  # a big one, not at an end
    block = 256 * 1024
    tensor_blocks = -(-(end - begin) // block)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead beyond the request
        got = os.pread(fd, end - begin, begin)
    finally:
        os.close(fd)
    with open(os.path.join(ckpts.dir(2), shard), "rb") as src:
        src.seek(begin)
        assert got == src.read(end - begin)
    s1 = m.status()
    decoded = s1["blocks_decoded"] - s0["blocks_decoded"]
    file_blocks = sum(-(-(e - b) // block) for _, b, e in ranges)
    # The kernel reads whole pages, which can reach into the neighbours' edge blocks.
    lo, hi = begin // 4096 * 4096, -(-end // 4096) * 4096
    touched = sum(len(range((max(lo, b) - b) // block, (min(hi, e) - b - 1) // block + 1))
                  for _, b, e in ranges if b < hi and e > lo and e > b)
    assert tensor_blocks <= decoded <= touched, (name, decoded, tensor_blocks, touched)
    assert decoded < file_blocks // 2
    assert s1["reads"] > s0["reads"] and s1["bytes_served"] >= end - begin


# --- faults ------------------------------------------------------------------------

def corrupt_largest_blob(store):
    """Flips a byte three quarters into the largest blob; returns its file name."""
    blobs = []
    for dirpath, _, files in os.walk(os.path.join(store, "blobs")):
        blobs += [os.path.join(dirpath, f) for f in files]
    victim = max(blobs, key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) * 3 // 4)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    return os.path.basename(victim)


def read_tensors(path, ranges):
    """{tensor name: bytes, or the errno of a failed read}, without readahead."""
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for name, b, e in ranges:
            try:
                out[name] = os.pread(fd, e - b, b)
                if len(out[name]) < e - b:  # a short read stops at the failing request
                    os.pread(fd, e - b - len(out[name]), b + len(out[name]))
                    raise AssertionError(f"{name}: short read, then a good one")
            except OSError as err:
                out[name] = err.errno
    finally:
        os.close(fd)
    return out


def test_daemon_logs_read_failures_to_its_log_file(fs_store, ckpts, mount, tmp_path):
    """A daemonized dtefs has no terminal: its messages go to CACHE_DIR/dtefs.log
    (or --log-file), each read failure once, naming blob, version and file."""
    dte = fs_store.copy_to(tmp_path / "bad")
    blob = corrupt_largest_blob(dte.store)
    m = mount(dte.store, foreground=False)
    failures = 0
    for _ in range(2):
        for shard in shard_names(ckpts.state(0)):
            try:
                with open(os.path.join(m.path, "v00000000", shard), "rb") as f:
                    f.read()
            except OSError as e:
                assert e.errno == errno.EIO
                failures += 1
    assert failures == 2  # one shard holds the corrupt blob, read twice
    with open(os.path.join(m.cache, "dtefs.log")) as f:
        log = f.read()
    assert f"serving {dte.store} on {m.path}" in log, log
    lines = [l for l in log.splitlines() if "failed" in l]
    assert len(lines) == 1 and blob in lines[0] and "v00000000/" in lines[0], log

    explicit = tmp_path / "explicit.log"
    m2 = mount(dte.store, "--log-file", explicit, foreground=False)
    assert os.path.ismount(m2.path)
    assert f"serving {dte.store} on {m2.path}" in explicit.read_text()
    assert not os.path.exists(os.path.join(m2.cache, "dtefs.log"))
    assert oct(explicit.stat().st_mode & 0o777) == oct(0o640)


def test_log_file_that_cannot_be_opened(fs_store, tmp_path):
    """An explicit --log-file that cannot be opened fails the mount, before
    mounting; a default log that is a symlink is not followed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    dtefs = str(fs_util.binary())
    r = subprocess.run([dtefs, fs_store.store, mnt, "--cache-dir", tmp_path / "c",
                        "--log-file", tmp_path / "no" / "such" / "dir.log"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "cannot open log file" in r.stderr and "dir.log" in r.stderr
    assert not fs_util.mounted(mnt)

    cache = tmp_path / "c2"
    cache.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    os.symlink(victim, cache / "dtefs.log")
    with fs_util.mounts(tmp_path / "m") as start:
        m = start(fs_store.store, foreground=False, cache=str(cache))
        assert os.path.ismount(m.path)
    assert victim.read_text() == "untouched\n"


def test_corrupt_blob_is_eio_on_affected_reads_only(fs_store, ckpts, mount, tmp_path):
    dte = fs_store.copy_to(tmp_path / "bad")
    blob = corrupt_largest_blob(dte.store)
    m = mount(dte.store)
    failed = {}
    for shard in shard_names(ckpts.state(0)):
        src = os.path.join(ckpts.dir(0), shard)
        ranges, _ = tensor_ranges(src)
        got = read_tensors(os.path.join(m.path, "v00000000", shard), ranges)
        with open(src, "rb") as f:
            want = f.read()
        for name, b, e in ranges:
            if isinstance(got[name], int):
                assert got[name] == errno.EIO
                failed.setdefault(shard, []).append(name)
            else:
                assert got[name] == want[b:e], name  # never wrong bytes
    assert len(failed) == 1 and 1 <= len(next(iter(failed.values()))) <= 3, failed
    bad_shard = next(iter(failed))
    for _ in range(3):  # the failure stays an EIO, and is logged once
        with pytest.raises(OSError) as e:
            with open(os.path.join(m.path, "v00000000", bad_shard), "rb") as f:
                f.read()
        assert e.value.errno == errno.EIO
    for f in os.listdir(ckpts.dir(0)):  # everything else still reads
        if f != bad_shard:
            assert filecmp.cmp(os.path.join(m.path, "v00000000", f),
                               os.path.join(ckpts.dir(0), f), shallow=False)
    assert m.alive()
    status = m.status()
    assert status["read_errors"] >= 4 and status["hash_failures"] >= 1
    lines = [l for l in m.log().splitlines() if "v00000000/" + bad_shard in l]
    assert len(lines) == 1, m.log()
    assert blob in lines[0] and "v00000000" in lines[0]
    assert any(bad_shard in err for err in status["errors"])


def test_missing_blob_is_eio_not_enoent(fs_store, ckpts, mount, tmp_path):
    dte = fs_store.copy_to(tmp_path / "gone")
    blobs = []
    for dirpath, _, files in os.walk(os.path.join(dte.store, "blobs")):
        blobs += [os.path.join(dirpath, f) for f in files]
    victim = max(blobs, key=os.path.getsize)
    os.unlink(victim)
    m = mount(dte.store)
    results = {}
    for shard in shard_names(ckpts.state(0)):
        path = os.path.join(m.path, "v00000000", shard)
        try:
            with open(path, "rb") as f:  # the file itself is there
                data = f.read()
            with open(os.path.join(ckpts.dir(0), shard), "rb") as f:
                assert data == f.read(), shard  # never wrong bytes
            results[shard] = "ok"
        except OSError as e:
            results[shard] = e.errno
    assert sorted(v for v in results.values() if v != "ok") == [errno.EIO], results
    assert m.alive()
    status = m.status()
    assert status["read_errors"] >= 1
    assert any(os.path.basename(victim) in err for err in status["errors"]), status["errors"]


# --- session -----------------------------------------------------------------------

def test_sigterm_unmounts_cleanly(fs_store, mount):
    m = mount(fs_store.store)
    with open(os.path.join(m.path, "latest", "config.json"), "rb") as f:
        assert f.read(1)
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=20) == 0, m.log()
    assert not os.path.ismount(m.path)


def test_mount_source_is_the_store(fs_store, mount, tmp_path):
    """findmnt / /proc/mounts name the store as the mount's source, also when its
    path holds a comma (which libfuse's option parser would split at)."""
    dte = fs_store.copy_to(tmp_path / "a,b")
    m = mount(dte.store)
    r = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", m.path], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(dte.store), "fuse.dtefs"], r.stdout


def test_mount_helper_option_form(fs_store, ckpts, mount):
    m = mount(fs_store.store, "-o", "rw,allow_other,dev,suid,default_permissions,poll_ms=200",
              "-o", "cache_size=64MiB", foreground=False)
    f = "config.json"
    assert filecmp.cmp(os.path.join(m.path, "latest", f), os.path.join(ckpts.dir(STEPS - 1), f),
                       shallow=False)
    assert m.status()["cache"]["capacity_bytes"] == 64 << 20
    with pytest.raises(OSError) as e:
        open(os.path.join(m.path, "latest", f), "ab")
    assert e.value.errno == errno.EROFS


def test_reads_of_many_tiny_tensors(mount, tmp_path):
    """A 1 MiB read that spans thousands of tensors (more pieces than one reply
    carries without copying) returns exactly the committed bytes."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    tensors = {f"t{i:05d}": rng.integers(0, 1 << 16, size=int(rng.integers(1, 64)),
                                         dtype=np.uint16).view(np.float16)
               for i in range(6000)}
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    save_file(tensors, str(ckpt / "model.safetensors"))
    dte = Dtectl(tmp_path / "store", tmp_path / "cache")
    dte.ok("import", ckpt)
    m = mount(dte.store)
    with open(ckpt / "model.safetensors", "rb") as f:
        want = f.read()
    path = os.path.join(m.path, "v00000000", "model.safetensors")
    with open(path, "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(1 << 20), b""))
    assert got == want
    with open(path, "rb", buffering=0) as f:  # unaligned starts
        for off in (0, 4095, 123457, len(want) - 5000):
            assert os.pread(f.fileno(), 300000, off) == want[off:off + 300000]
