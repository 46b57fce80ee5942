"""dtefs following an s3:// store on a real S3-compatible server (moto, on
loopback, checking every request's SigV4 signature), published by dtectl.

What a rollout host must get: every version's files byte-identical to the
committed checkpoints; new versions shown, and `latest` moved, within a
deadline, with one listing request per poll; --prefetch latest filling the
local blob cache so that reads succeed with the server stopped, also after a
restart of dtefs; a damaged cache file never served (fetched again, or EIO
when the server is gone); a SIGKILL during prefetch recovered by a restart;
an outage reported once, cached data readable through it, uncached reads
failing with EIO, and new versions after recovery.

Each test starts its own server (tests stop them). Timings are printed,
never asserted; every wait has a deadline.
"""

import filecmp
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import dtectl_util
import s3_util
import store_util
from fs_util import BUILD_DIR, Mount, binary, mounted, unmount_all
from wait_util import wait_for

STEPS = 6  # dte-gen steps 0..STEPS of an 8 MiB model
POLL_MS = 500
APPEAR_DEADLINE = 60.0  # a new version shown, with slack for a loaded machine
PREFETCH_DEADLINE = 120.0
EIO_DEADLINE = 300.0  # bounded retries of every block read, see docs/s3.md


def generate(out, size, steps):
    gen = BUILD_DIR / "tools" / "dte-gen"
    assert os.access(gen, os.X_OK), f"{gen} is not built"
    subprocess.run([str(gen), "--out", str(out), "--size", size, "--steps", str(steps), "-q"],
                   check=True, timeout=300)
    return lambda step: out / f"step-{step:06d}"


@pytest.fixture(scope="session")
def gen(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("gen"), "8MiB", STEPS)


@pytest.fixture(scope="session")
def big_gen(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("biggen"), "32MiB", 1)


@pytest.fixture
def moto():
    server = s3_util.MotoServer()
    print(f"moto started in {server.start_seconds:.2f} s on {server.endpoint}")
    yield server
    server.stop()


@pytest.fixture
def follower(tmp_path):
    """follower(moto, bucket, *args, endpoint=None, cache=None, flags=True) ->
    a started Mount of s3://bucket/policy, with --endpoint and --poll-ms
    unless not `flags`; unmounted at teardown."""
    made = []

    def start(moto, bucket, *args, endpoint=None, cache=None, flags=True):
        n = len(made)
        given = ["--endpoint", endpoint or moto.endpoint, "--poll-ms", POLL_MS] if flags else []
        m = Mount(f"s3://{bucket}/policy", tmp_path / f"mnt{n}", cache or tmp_path / f"fscache{n}",
                  [*given, *args], env=moto.env())
        for k in [k for k in m.env if k.startswith("AWS_ENDPOINT_URL")]:
            del m.env[k]  # --endpoint is the only way to the server
        made.append(m)
        return m.start()

    yield start
    for m in made:
        m.unmount()
    unmount_all()
    for m in made:  # a killed daemon's mount, which os.path.ismount misses
        if mounted(m.path):
            subprocess.run(["fusermount3", "-uz", m.path], capture_output=True, timeout=30)
    assert not [m.path for m in made if mounted(m.path)]


def publisher(moto, bucket, root):
    """dtectl on s3://bucket/policy, talking to the server directly."""
    moto.create_bucket(bucket)
    return dtectl_util.s3(moto, f"s3://{bucket}/policy", root / "pubcache")


def publish(d, gen, steps):
    for step in steps:
        if step == 0:
            d.ok("import", gen(0))
        else:
            assert d.commit(gen(step)) == step


def check_version(m, version, src):
    filecmp.clear_cache()  # it would answer a second comparison without reading
    store_util.same_tree(os.path.join(m.path, f"v{version:08d}"), src)


def wait_latest(m, version, timeout=APPEAR_DEADLINE):
    target = f"v{version:08d}"
    wait_for(lambda: os.path.lexists(os.path.join(m.path, "latest")) and
             os.readlink(os.path.join(m.path, "latest")) == target, timeout,
             f"latest -> {target}", interval=0.02)


def wait_prefetched(m, version, timeout=PREFETCH_DEADLINE):
    def done():
        p = m.status()["prefetch"]
        return p["version"] == version and p["done"]
    wait_for(done, timeout, f"prefetch of v{version} to finish")
    return m.status()


def chunk_files(status):
    root = status["blob_cache"]["dir"]
    out = []
    for d, _, files in os.walk(root):
        if os.path.basename(d) != "tmp":
            out += [os.path.join(d, f) for f in files]
    return sorted(out)


READER = r"""
import errno, json, sys
path, src = sys.argv[1], sys.argv[2]
out = {"bytes": 0, "errno": None, "wrong": False}
with open(src, "rb") as s, open(path, "rb") as f:
    while True:
        try:
            data = f.read(1 << 20)
        except OSError as e:
            out["errno"] = e.errno
            break
        if not data:
            break
        if data != s.read(len(data)):
            out["wrong"] = True
            break
        out["bytes"] += len(data)
print(json.dumps(out))
"""


def read_checked(path, src, timeout=EIO_DEADLINE):
    """Reads `path` in a child process (so a hang cannot hang the test),
    comparing every byte read with `src`: {"bytes", "errno", "wrong"}."""
    r = subprocess.run([sys.executable, "-c", READER, str(path), str(src)], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def moto_requests(moto):
    with open(os.path.join(moto.dir, "moto.log"), errors="replace") as f:
        return re.findall(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP', f.read())


def test_follows_new_versions_with_one_listing_per_poll(moto, gen, follower, tmp_path):
    pub = publisher(moto, "follow", tmp_path)
    publish(pub, gen, range(0, 3))
    m = follower(moto, "follow")
    for v in range(0, 3):
        check_version(m, v, gen(v))
    wait_latest(m, 2, timeout=5)

    # Commits while mounted appear, and latest moves with them.
    for step in range(3, STEPS + 1):
        pub.commit(gen(step))
        started = time.monotonic()
        wait_latest(m, step)
        print(f"v{step} shown {time.monotonic() - started:.2f} s after its commit returned")
        check_version(m, step, gen(step))
    assert m.status()["versions"] == list(range(0, STEPS + 1))

    # Idle polling: one ListObjectsV2 of manifests/ per poll, starting after
    # the newest manifest except on the periodic full listings, which also
    # list joins/ (the join tables); no other request.
    before, s1 = len(moto_requests(moto)), m.status()["poll"]
    wait_for(lambda: m.status()["poll"]["polls"] >= s1["polls"] + 12, 60, "12 more polls")
    s2 = m.status()["poll"]
    requests = moto_requests(moto)[before:]
    polls, full = s2["polls"] - s1["polls"], s2["full_listings"] - s1["full_listings"]
    assert all(method == "GET" and "list-type=2" in url and
               re.search(r"[?&]prefix=policy/(manifests|joins)/(&|$)", url)
               for method, url in requests), requests
    joins = [url for _, url in requests if "prefix=policy/joins/" in url]
    requests = [r for r in requests if "prefix=policy/joins/" not in r[1]]
    assert abs(len(requests) - polls) <= 1, (len(requests), polls)
    incremental = [url for _, url in requests if "start-after=policy/manifests/v00000006.json"
                   in url]
    assert full >= 1 and len(incremental) >= polls - full - 1, (requests, polls, full)
    assert abs(len(joins) - full) <= 1, (joins, full)
    assert s2["failed"] == 0 and m.status()["errors"] == []


def test_prefetch_fills_the_cache_and_reads_need_no_server(moto, gen, follower, tmp_path):
    pub = publisher(moto, "prefetch", tmp_path)
    publish(pub, gen, range(0, 3))
    m = follower(moto, "prefetch", "--prefetch", "latest", "--blob-chunk-size", "256KiB")
    started = time.monotonic()
    st = wait_prefetched(m, 2)
    print(f"prefetch of v2: {st['prefetch']['bytes']} bytes in {st['prefetch']['chunks']} "
          f"chunks, {time.monotonic() - started:.2f} s")
    assert st["prefetch"]["bytes_done"] == st["prefetch"]["bytes"] > 0
    assert st["blob_cache"]["chunks"] == len(chunk_files(st)) > 0

    # A commit while mounted moves latest; the prefetcher follows it.
    pub.commit(gen(3))
    wait_latest(m, 3)
    st = wait_prefetched(m, 3)
    fetched = st["blob_cache"]["fetches"]

    moto.stop()
    # Nothing of v3 was read yet: every byte comes from the blob cache.
    check_version(m, 3, gen(3))
    st = m.status()
    assert st["blob_cache"]["fetches"] == fetched
    assert st["blob_cache"]["hits"] > 0 and st["read_errors"] == 0
    assert m.alive() and mounted(m.path)


def test_restart_reuses_the_cache(moto, gen, follower, tmp_path):
    pub = publisher(moto, "restart", tmp_path)
    publish(pub, gen, range(0, 3))
    # The mount(8) spelling of the options.
    first = follower(moto, "restart", "-o", f"endpoint={moto.endpoint},prefetch=latest,"
                     "blob_cache_size=64MiB,blob_chunk_size=1MiB,poll_ms=500", flags=False)
    st = wait_prefetched(first, 2)
    assert st["blob_cache"]["capacity_bytes"] == 64 << 20
    assert st["blob_cache"]["chunk_bytes"] == 1 << 20
    kept = st["blob_cache"]["chunks"]
    first.unmount()

    second = follower(moto, "restart", "--blob-chunk-size", "1MiB", cache=first.cache)
    st = second.status()
    assert st["blob_cache"]["chunks"] == kept and st["prefetch"] is None
    moto.stop()
    check_version(second, 2, gen(2))
    st = second.status()
    assert st["blob_cache"]["fetches"] == 0 and st["blob_cache"]["hits"] > 0
    assert st["read_errors"] == 0


def damage_middle(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x20]))


def test_damaged_cache_files_are_never_served(moto, gen, follower, tmp_path):
    pub = publisher(moto, "damage", tmp_path)
    publish(pub, gen, range(0, 2))
    first = follower(moto, "damage", "--prefetch", "latest")
    files = chunk_files(wait_prefetched(first, 1))
    first.unmount()
    # Flip a byte in the biggest chunk (the anchor's data) and cut another short.
    files.sort(key=os.path.getsize)
    damage_middle(files[-1])
    os.truncate(files[-2], os.path.getsize(files[-2]) // 2)

    # With the server up: the damage is found and the chunks fetched again.
    second = follower(moto, "damage", cache=first.cache)
    check_version(second, 1, gen(1))
    st = second.status()
    assert st["blob_cache"]["dropped"] >= 1 and st["blob_cache"]["fetches"] >= 2
    assert st["read_errors"] == 0
    second.unmount()

    # With the server gone: EIO for the damaged range, never wrong bytes.
    files = sorted(chunk_files(st), key=os.path.getsize)
    third = follower(moto, "damage", cache=first.cache)
    moto.stop()
    damage_middle(files[-1])
    src = gen(1) / "model.safetensors"
    started = time.monotonic()
    got = read_checked(os.path.join(third.path, "v00000001", "model.safetensors"), src)
    print(f"damaged read with the server stopped: {got} after {time.monotonic() - started:.1f} s")
    assert not got["wrong"]
    assert got["errno"] == 5 and got["bytes"] < os.path.getsize(src)  # EIO
    check_version_file = os.path.join(third.path, "v00000001", "config.json")
    assert open(check_version_file, "rb").read() == (gen(1) / "config.json").read_bytes()
    assert third.alive()


def test_sigkill_during_prefetch_then_restart_reads_correctly(moto, big_gen, follower, tmp_path):
    pub = publisher(moto, "kill", tmp_path)
    publish(pub, big_gen, range(0, 2))
    args = ("--prefetch", "latest", "--blob-chunk-size", "64KiB")
    first = follower(moto, "kill", *args)

    def partway():
        p = first.status()["prefetch"]
        return p["version"] == 1 and p["chunks_done"] >= 10 and not p["done"] and p
    p = wait_for(partway, PREFETCH_DEADLINE, "prefetch under way", interval=0.005)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    print(f"killed with {p['chunks_done']} of {p['chunks']} chunks prefetched")
    subprocess.run(["fusermount3", "-uz", first.path], check=True, timeout=30)
    first.unmount()

    second = follower(moto, "kill", *args, cache=first.cache)
    st = wait_prefetched(second, 1)
    # What the killed daemon kept is trusted, and only the rest is fetched.
    assert 0 < st["prefetch"]["chunks"] < p["chunks"]
    assert st["blob_cache"]["chunks"] == len(chunk_files(st))
    assert not os.listdir(os.path.join(st["blob_cache"]["dir"], "tmp"))
    moto.stop()
    check_version(second, 1, big_gen(1))
    assert second.status()["read_errors"] == 0


def test_outage_is_reported_once_and_new_versions_appear_after_it(moto, gen, follower, tmp_path):
    pub = publisher(moto, "outage", tmp_path)
    publish(pub, gen, range(0, 2))
    relay = s3_util.TcpRelay(moto.port)
    # No block cache: every read reaches the blob cache or the store.
    m = follower(moto, "outage", "--cache-size", "0", endpoint=relay.endpoint)
    check_version(m, 0, gen(0))
    st = m.status()
    fetched, hits = st["blob_cache"]["fetches"], st["blob_cache"]["hits"]

    relay.cut()
    started = time.monotonic()
    wait_for(lambda: m.status()["poll"]["failing"], APPEAR_DEADLINE, "the outage to be noticed")
    print(f"outage noticed after {time.monotonic() - started:.2f} s")
    failed = m.status()["poll"]["failed"]
    wait_for(lambda: m.status()["poll"]["failed"] >= failed + 2, 120, "two more failed polls")
    pub.commit(gen(2))  # published meanwhile, straight to the server

    # Cached data stays readable (from the blob cache: the page cache is dropped).
    path = os.path.join(m.path, "v00000000", "model.safetensors")
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    check_version(m, 0, gen(0))
    st = m.status()
    assert st["blob_cache"]["hits"] > hits and st["blob_cache"]["fetches"] == fetched
    # Uncached data fails with EIO after the bounded retries; nothing wrong.
    started = time.monotonic()
    got = read_checked(os.path.join(m.path, "v00000001", "model.safetensors"),
                       gen(1) / "model.safetensors")
    print(f"uncached read during the outage: {got} after {time.monotonic() - started:.1f} s")
    assert got["errno"] == 5 and not got["wrong"]
    st = m.status()
    outage_errors = [e for e in st["errors"] if "cannot list the store" in e]
    assert len(outage_errors) == 1, st["errors"]
    assert m.alive() and mounted(m.path) and st["versions"] == [0, 1]

    relay.restore()
    started = time.monotonic()
    wait_latest(m, 2)
    print(f"v2 shown {time.monotonic() - started:.2f} s after the outage ended")
    for v in range(0, 3):
        check_version(m, v, gen(v))
    assert not m.status()["poll"]["failing"]
    log = m.log()
    assert log.count("cannot list the store") == 1 and log.count("answers again") == 1, log
    relay.cut()


@pytest.mark.parametrize("args", [["--prefetch", "everything"], ["--blob-chunk-size", "100KiB"],
                                  ["-o", "blob_cache_size=lots"]])
def test_bad_options_are_refused_before_mounting(args, tmp_path):
    os.makedirs(tmp_path / "mnt")
    r = subprocess.run([str(binary()), "s3://bucket/policy",
                        str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / "cache"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "dtefs: bad" in r.stderr, r.stderr
    assert not mounted(tmp_path / "mnt")
