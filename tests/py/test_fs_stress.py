"""dtefs under concurrency: 16 readers while versions are committed and gc'd.

One mount; 16 reader threads read whole files and random ranges of random
versions (and of `latest`) for DURATION seconds, while a committer thread
commits a new version every few hundred milliseconds and a gc thread runs
`dtectl gc --keep-last KEEP` over and over. Every byte read is compared with
the checkpoint directory that version was committed from. The only error a
reader may see is ENOENT when it opens (or lists) a version, and only if gc
had removed that version; a read from an open file never fails. Every thread
must finish by a deadline: a hung reader fails the test (the fixture then
unmounts, which ends the daemon and frees the reader).
"""

import collections
import errno
import os
import random
import re
import subprocess
import threading
import time
import traceback

import pytest

import fs_util
from dtectl_util import Dtectl
from wait_util import wait_for

DURATION = 20.0       # seconds of concurrent load
DEADLINE = 45.0       # seconds after the start by which every thread must have ended
READERS = 16
KEEP = 3              # gc --keep-last
GRACE = 600           # gc --grace-seconds: longer than the test, so blobs an open
                      # file of a removed version still reads are kept (docs/fs.md)
STEPS = 6             # distinct checkpoints; commits cycle through them
COMMIT_PAUSE = 0.25
GC_PAUSE = 0.6
SEED = int(os.environ.get("DTE_STRESS_SEED", "20261122"))
MANIFEST = re.compile(r"^v(\d{8,12})(\.r\d+)?\.json$")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """STEPS checkpoints of an 8 MiB model in 3 shards: ({step: {file: bytes}}, dirs)."""
    out = tmp_path_factory.mktemp("stressgen") / "seq"
    gen = fs_util.BUILD_DIR / "tools" / "dte-gen"
    subprocess.run([gen, "--out", out, "--size", "8MiB", "--steps", str(STEPS - 1),
                    "--shard-size", "3MiB", "-q"], check=True, capture_output=True, timeout=120)
    dirs = [out / f"step-{s:06d}" for s in range(STEPS)]
    content = {}
    for s, d in enumerate(dirs):
        content[s] = {}
        for name in os.listdir(d):
            with open(d / name, "rb") as f:
                content[s][name] = f.read()
    assert len({c["model-00001-of-00003.safetensors"] for c in content.values()}) == STEPS
    return content, dirs


def store_versions(store):
    """Versions whose manifest exists now (docs/formats/store-layout.md)."""
    names = os.listdir(os.path.join(store, "manifests"))
    return {int(m.group(1)) for m in map(MANIFEST.match, names) if m}


class Run:
    """What the threads did. Lists are appended to from many threads (atomic in
    CPython); each reader counts in its own Counter."""

    def __init__(self):
        self.stop = threading.Event()
        self.failures = []          # messages
        self.enoent = []            # (version, monotonic time, what)
        self.step_of = {}           # version -> step it was committed from
        self.committed_at = {}      # version -> monotonic time its commit returned
        self.gc_runs = []           # (start, end, versions present after)
        self.counts = [collections.Counter() for _ in range(READERS)]

    def total(self, what):
        return sum(c[what] for c in self.counts)

    def fail(self, msg):
        self.failures.append(msg)


def first_difference(a, b):
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; bisect on prefixes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_bytes(run, count, what, got, want):
    if got != want:
        kind = "short read" if want.startswith(got) else "wrong bytes"
        run.fail(f"{what}: {kind} ({len(got)} read, {len(want)} expected, "
                 f"first difference at {first_difference(got, want)})")
    count["bytes"] += len(got)


def read_at(fd, n, off, path):
    """os.pread; an error names the file and range (the file is open: any error fails)."""
    try:
        return os.pread(fd, n, off)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} reading {n} bytes at {off} of the open file",
                      path) from None


def read_whole(fd, rng, path):
    chunk = rng.choice([4096, 131072, 1 << 20, 4 << 20])
    parts, off = [], 0
    while True:
        b = read_at(fd, chunk, off, path)
        if not b:
            return b"".join(parts)
        parts.append(b)
        off += len(b)


def read_version_file(run, count, rng, mnt, version, name, content):
    """Reads one file of one version, whole or in random ranges."""
    want = content[run.step_of[version]][name]
    path = os.path.join(mnt, f"v{version:08d}", name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        run.enoent.append((version, time.monotonic(), path))
        return
    count["opens"] += 1
    try:  # from here on any error is a failure: the open file keeps its version
        if rng.random() < 0.3:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        if rng.random() < 0.4:
            check_bytes(run, count, path, read_whole(fd, rng, path), want)
            count["whole"] += 1
        else:
            for _ in range(rng.randint(1, 8)):
                off = rng.randint(0, len(want))
                n = rng.choice([1, 100, 4096, 65536, 262151, 1 << 20, 3 << 20])
                check_bytes(run, count, f"{path}[{off}:+{n}]", read_at(fd, n, off, path),
                            want[off:off + n])
                count["ranges"] += 1
        if rng.random() < 0.5:  # drop its page cache, so the next read reaches dtefs
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_latest(run, count, rng, mnt, name, content):
    """Reads latest/<name> whole: it must be one of the versions latest named meanwhile."""
    latest = os.path.join(mnt, "latest")
    before = int(os.readlink(latest)[1:])
    path = os.path.join(latest, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        run.enoent.append((before, time.monotonic(), path))
        return
    count["opens"] += 1
    try:
        got = read_whole(fd, rng, path)
    finally:
        os.close(fd)
    after = int(os.readlink(latest)[1:])
    candidates = [v for v in range(before, after + 1) if v in run.step_of]
    if not any(got == content[run.step_of[v]][name] for v in candidates):
        run.fail(f"{path}: {len(got)} bytes equal to no version in {before}..{after}")
    count["bytes"] += len(got)
    count["latest"] += 1


def reader(run, idx, mnt, names, content):
    rng = random.Random(SEED * 100 + idx)
    count = run.counts[idx]
    while not run.stop.is_set():
        try:
            listed = sorted(int(n[1:]) for n in os.listdir(mnt) if n.startswith("v"))
            unknown = [v for v in listed if v not in run.step_of]
            if unknown:
                run.fail(f"listing shows versions never committed: {unknown}")
            name = rng.choice(names)
            if rng.random() < 0.15:
                read_latest(run, count, rng, mnt, name, content)
                continue
            version = rng.choice(listed)
            if rng.random() < 0.1:
                d = os.path.join(mnt, f"v{version:08d}")
                try:
                    if sorted(os.listdir(d)) != sorted(names):
                        run.fail(f"{d} lists {sorted(os.listdir(d))}")
                except FileNotFoundError:
                    run.enoent.append((version, time.monotonic(), d))
                continue
            read_version_file(run, count, rng, mnt, version, name, content)
        except OSError as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            run.fail(f"reader {idx}: {errno.errorcode.get(e.errno, e.errno)}: {e} "
                     f"(in {where.name}: {where.line})")
        except Exception as e:  # a bug in the test itself must not pass silently
            run.fail(f"reader {idx}: {e!r}")
            return


def committer(run, dte, dirs, first):
    version, step = first, first % STEPS
    while not run.stop.is_set():
        run.step_of[version] = step  # before the manifest exists: readers may see it at once
        r = dte.run("commit", "--version", version, dirs[step], "-q")
        if r.returncode != 0:
            run.fail(f"commit v{version}: exit {r.returncode}: {r.stderr}")
            return
        run.committed_at[version] = time.monotonic()
        version, step = version + 1, (step + 1) % STEPS
        run.stop.wait(COMMIT_PAUSE)


def collector(run, dte):
    while not run.stop.is_set():
        start = time.monotonic()
        r = dte.run("gc", "--keep-last", KEEP, "--grace-seconds", GRACE, "-q")
        end = time.monotonic()
        if r.returncode != 0:
            run.fail(f"gc: exit {r.returncode}: {r.stderr}")
            return
        run.gc_runs.append((start, end, store_versions(dte.store)))
        run.stop.wait(GC_PAUSE)


def removed_by_gc_before(run, version, when):
    """Whether a gc run that started before `when` found `version` committed
    and left it without a manifest."""
    done = run.committed_at.get(version)
    return done is not None and any(
        start <= when and done <= end and version not in after
        for start, end, after in run.gc_runs)


def test_readers_see_exact_bytes_while_commits_and_gc_run(steps, mount, tmp_path):
    content, dirs = steps
    dte = Dtectl(tmp_path / "store", tmp_path / "cache")
    dte.ok("import", dirs[0])
    for s in (1, 2):
        assert dte.commit(dirs[s]) == s
    run = Run()
    run.step_of.update({0: 0, 1: 1, 2: 2})
    run.committed_at.update(dict.fromkeys((0, 1, 2), time.monotonic()))
    names = sorted(content[0])
    # A small block cache, so that evictions race with loads; fast polling, so
    # the daemon's version set changes often.
    m = mount(dte.store, "--cache-size", "4MiB", "--poll-ms", "100")
    threads = [threading.Thread(target=reader, args=(run, i, m.path, names, content),
                                name=f"reader-{i}", daemon=True) for i in range(READERS)]
    threads += [threading.Thread(target=committer, args=(run, dte, dirs, 3), daemon=True,
                                 name="committer"),
                threading.Thread(target=collector, args=(run, dte), daemon=True, name="gc")]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    run.stop.wait(DURATION)
    run.stop.set()
    for t in threads:
        t.join(timeout=max(0.0, t0 + DEADLINE - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"still running {DEADLINE} s after the start: {hung}"
    assert run.failures == [], "\n".join(run.failures[:20] + ["dtefs log:", m.log()[-4000:]])

    for version, when, path in run.enoent:
        assert removed_by_gc_before(run, version, when), \
            f"ENOENT for {path}, but no gc had removed v{version:08d} by then"
    removed = set(run.step_of) - store_versions(dte.store)
    print(f"\nstress: {len(run.step_of)} versions, {len(run.gc_runs)} gc runs removed "
          f"{len(removed)}; {run.total('opens')} opens, {run.total('whole')} whole-file, "
          f"{run.total('ranges')} range and {run.total('latest')} latest reads, "
          f"{run.total('bytes') >> 20} MiB checked, {len(run.enoent)} ENOENT after gc")
    # The load really happened: versions came and went under the readers.
    assert len(run.step_of) >= 10 and len(run.gc_runs) >= 5 and len(removed) >= 5
    assert run.total("whole") >= 50 and run.total("ranges") >= 50
    assert run.total("latest") >= 10

    assert m.alive(), m.log()
    dte.ok("gc", "--keep-last", KEEP, "--grace-seconds", GRACE)  # after the last commit
    kept = store_versions(dte.store)
    assert kept == set(sorted(run.step_of)[-KEEP:])
    listing = lambda: {int(n[1:]) for n in os.listdir(m.path) if n.startswith("v")}
    wait_for(lambda: listing() == kept, 10.0, f"the mount to list exactly {sorted(kept)}")
    assert os.readlink(os.path.join(m.path, "latest")) == f"v{max(kept):08d}"
    for version in kept:
        for name in names:
            with open(os.path.join(m.path, f"v{version:08d}", name), "rb") as f:
                assert f.read() == content[run.step_of[version]][name], (version, name)
    status = m.status()
    assert status["read_errors"] == 0 and status["hash_failures"] == 0, status
    assert status["errors"] == [], status["errors"]
    assert sorted(status["versions"]) == sorted(kept)
    assert m.alive(), m.log()
    dte.ok("verify")
