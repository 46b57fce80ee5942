"""dtefs daemon memory: bounded by the block cache, flat in the model size.

For a 64 MiB and a 256 MiB model (three versions each: an anchor and two
deltas), a mount with a 32 MiB block cache reads every file of every version
completely, once sequentially and once with 8 parallel readers, each read
compared with the committed bytes and each file's page cache dropped after
it, so that every byte comes from the daemon. The small model is read as
many times over as it takes to read as many bytes as the large one: the
allocator's footprint grows with the traffic until it levels off, and the
comparison is about the model size. The daemon's peak resident set (VmHWM)
must stay under the cache size plus 128 MiB for both models, and the larger
model must not need more than 32 MiB more than the smaller one.

`pytest -s` prints the measured figures.
"""

import os
import queue
import shutil
import subprocess
import threading

import pytest

import fs_util
from dtectl_util import Dtectl

MiB = 1 << 20
CACHE = 32 * MiB
HEADROOM = 128 * MiB  # allowed above the cache: manifests, block tables, buffers, threads
FLAT = 32 * MiB       # allowed growth from the small model to the large one
SIZES = ("64MiB", "256MiB")
STEPS = 2             # versions 0..STEPS
PARALLEL = 8
CHUNK = 16 * MiB      # a parallel reader's unit of work
JOIN_TIMEOUT = 120.0


def make_store(root, size):
    """STEPS + 1 checkpoints of a `size` model (48 MiB shards) committed to a store."""
    gen = fs_util.BUILD_DIR / "tools" / "dte-gen"
    subprocess.run([gen, "--out", root / "ckpt", "--size", size, "--steps", str(STEPS),
                    "--shard-size", "48MiB", "-q"], check=True, capture_output=True, timeout=300)
    dirs = [root / "ckpt" / f"step-{s:06d}" for s in range(STEPS + 1)]
    dte = Dtectl(root / "store", root / "cache")
    dte.ok("import", dirs[0])
    for s in range(1, STEPS + 1):
        assert dte.commit(dirs[s]) == s
    return dte, dirs


def memory(pid):
    """(VmHWM, VmRSS) of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    kib = lambda key: int(fields[key].split()[0]) * 1024
    return kib("VmHWM"), kib("VmRSS")


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def compare_range(mounted, source, offset, length):
    """Reads [offset, offset+length) of both files in 1 MiB pieces; returns the bytes
    compared, or raises on the first difference."""
    fd, src = os.open(mounted, os.O_RDONLY), os.open(source, os.O_RDONLY)
    try:
        end, off = offset + length, offset
        while off < end:
            want = os.pread(src, min(MiB, end - off), off)
            got = os.pread(fd, len(want), off)
            if got != want:
                raise AssertionError(f"{mounted}: bytes at {off} (+{len(want)}) differ")
            off += len(want)
        return off - offset
    finally:
        os.close(fd)
        os.close(src)


def all_files(mnt, dirs):
    """(file in the mount, its source, size) for every file of every version."""
    out = []
    for v, d in enumerate(dirs):
        for name in sorted(os.listdir(d)):
            out.append((os.path.join(mnt, f"v{v:08d}", name), os.path.join(d, name),
                        os.path.getsize(os.path.join(d, name))))
    return out


def read_sequentially(files):
    total = 0
    for mounted, source, size in files:
        total += compare_range(mounted, source, 0, size)
        drop_page_cache(mounted)
    return total


def read_in_parallel(files):
    work = queue.Queue()
    for mounted, source, size in files:
        for off in range(0, max(size, 1), CHUNK):
            work.put((mounted, source, off, min(CHUNK, size - off)))
    done, errors = [], []

    def reader():
        while True:
            try:
                mounted, source, off, length = work.get_nowait()
            except queue.Empty:
                return
            try:
                done.append(compare_range(mounted, source, off, length))
            except Exception as e:  # reported below; the other readers go on
                errors.append(repr(e))

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(PARALLEL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a parallel reader hung"
    assert errors == [], errors[:5]
    for mounted, _, _ in files:
        drop_page_cache(mounted)
    return sum(done)


def measure(root, size, mount, rounds):
    dte, dirs = make_store(root, size)
    m = mount(dte.store, "--cache-size", "32MiB")
    files = all_files(m.path, dirs)
    total = sum(f[2] for f in files)
    for mounted, _, _ in files:
        drop_page_cache(mounted)
    for _ in range(rounds):
        served0 = m.status()["bytes_served"]
        assert read_sequentially(files) == total
        served1 = m.status()["bytes_served"]
        assert read_in_parallel(files) == total
        served2 = m.status()["bytes_served"]
        # Every byte came from the daemon, in both passes (not from the page cache).
        assert served1 - served0 >= total and served2 - served1 >= total
    status = m.status()
    assert status["read_errors"] == 0 and status["versions"] == list(range(STEPS + 1))
    assert status["cache"]["capacity_bytes"] == CACHE
    assert status["cache"]["bytes"] <= CACHE and status["cache"]["evictions"] > 0
    hwm, rss = memory(m.proc.pid)
    assert m.alive()
    m.unmount()
    shutil.rmtree(root)  # ~1 GiB for the large model; pytest would keep it for a while
    return {"size": size, "read": 2 * rounds * total, "hwm": hwm, "rss": rss}


def test_daemon_rss_is_bounded_by_the_cache_and_flat_in_model_size(tmp_path, mount):
    results = []
    for size, rounds in zip(SIZES, (4, 1)):  # the same traffic for both sizes
        root = tmp_path / size
        root.mkdir()
        results.append(measure(root, size, mount, rounds))
    print()
    for r in results:
        print(f"dtefs --cache-size 32MiB, {r['size']} model x {STEPS + 1} versions, "
              f"{r['read'] / MiB:.0f} MiB read: peak RSS (VmHWM) {r['hwm'] / MiB:.1f} MiB, "
              f"RSS at the end {r['rss'] / MiB:.1f} MiB")
    for r in results:
        assert r["hwm"] <= CACHE + HEADROOM, r
    small, large = results
    assert large["hwm"] <= small["hwm"] + FLAT, (small, large)
