"""dtectl's blob cache for s3:// stores, against a real S3-compatible server
(moto, on loopback, checking every request's SigV4 signature) behind the
counting proxy of s3_proxy.py.

A publisher keeps the blobs it uploads (write-through), so a commit reads
its parent from local disk: the second of two consecutive commits sends no
blob GET and downloads a tiny fraction of the model, while the same commit
on a host with an empty cache downloads the parent. Results are bit-exact
(exported by another host, verified). Two dtectl processes on one cache
directory: the one without the cache index runs uncached and says so.
Read-only commands on a bucket that does not exist say so.
"""

import fcntl
import json
import os
import shutil
import subprocess
import threading

import s3_util
import store_util
from dtectl_util import ERROR, OK, Dtectl
from fs_util import binary as dtefs_binary



def host(moto, endpoint, uri, root):
    """dtectl on `uri` through `endpoint`, with its own cache directory root/cache."""
    d = Dtectl(uri, root / "cache", env={**moto.env(), "AWS_ENDPOINT_URL": endpoint,
                                         "DTE_SPOOL_DIR": str(root / "spool")})
    for k in [k for k in d.env if k.startswith("AWS_") and k not in moto.env()]:
        del d.env[k]
    return d


class Counted:
    """What one dtectl run moved through the proxy."""

    def __init__(self, proxy, run):
        proxy.reset_counters()
        self.result = run()
        self.blob_gets = proxy.exchanges(method="GET", key="/blobs/")
        self.bytes_down = proxy.bytes_down
        self.bytes_up = proxy.bytes_up
        self.requests = len(proxy.exchanges())


def commit(d, ckpt):
    r = d.ok("commit", ckpt, "--json")
    return json.loads(r.stdout)


def drop_snapshots(d):
    """Deletes the host's snapshots of versions (which a commit reads its
    parent from first), so that the parent must come from blobs."""
    for store_id in os.listdir(d.cache):
        shutil.rmtree(os.path.join(d.cache, store_id, "snapshots"), ignore_errors=True)


def test_second_commit_reads_its_parent_from_the_cache(moto, proxy, bucket, ckpts, tmp_path):
    uri = f"s3://{bucket}/run"
    pub = host(moto, proxy.endpoint, uri, tmp_path / "publisher")
    imported = Counted(proxy, lambda: json.loads(pub.ok("import", ckpts.dir(0), "--json").stdout))
    assert imported.result["blob_cache"]["written_bytes"] >= imported.result["stored_bytes"]
    first = Counted(proxy, lambda: commit(pub, ckpts.dir(1)))
    drop_snapshots(pub)  # the second commit's parent must come from blobs
    second = Counted(proxy, lambda: commit(pub, ckpts.dir(2)))
    dense = second.result["dense_bytes"]
    for c in (first, second):
        print(f"commit v{c.result['version']}: {c.requests} requests, "
              f"{c.bytes_down} bytes down, {c.bytes_up} bytes up, "
              f"{len(c.blob_gets)} blob GETs; dense {dense}")
        assert c.result["kind"] == "delta"
        assert c.blob_gets == [], [e.path for e in c.blob_gets]
        assert c.result["blob_cache"]["fetched_bytes"] == 0
    # The parent came from local disk: its snapshot, left by the last command,
    # or, once that is gone, its blobs in the blob cache.
    assert first.result["parent_snapshot_blocks"] > 0
    assert second.result["parent_snapshot_blocks"] == 0 and second.result["blob_cache"]["hits"] > 0
    for c in (first, second):
        # Listings, HEADs, the marker and the answers to uploads: response
        # heads and small XML bodies, well under 1 KB a request.
        assert c.bytes_down < 1000 * c.requests, (c.bytes_down, c.requests)
        assert c.bytes_down < dense / 20, (c.bytes_down, dense)

    # The same commit on a host with an empty cache downloads the parent.
    cold = host(moto, proxy.endpoint, uri, tmp_path / "cold")
    third = Counted(proxy, lambda: commit(cold, ckpts.dir(3)))
    print(f"commit v3 on an empty cache: {third.bytes_down} bytes down, "
          f"{len(third.blob_gets)} blob GETs")
    assert third.bytes_down > dense / 2, (third.bytes_down, dense)
    assert third.result["blob_cache"]["fetched_bytes"] > dense / 2

    # Bit-exact, read by a host that shares no cache with the publishers.
    reader = host(moto, moto.endpoint, uri, tmp_path / "reader")
    for step in range(4):
        store_util.same_tree(reader.export(step, tmp_path / f"out{step}"), ckpts.dir(step))
    assert json.loads(reader.ok("verify", "--json").stdout)["ok"]
    assert [v["kind"] for v in reader.log()] == ["anchor", "delta", "delta", "delta"]


def test_blob_cache_size_zero_reads_the_parent_from_the_store(moto, proxy, bucket, ckpts,
                                                             tmp_path):
    pub = host(moto, proxy.endpoint, f"s3://{bucket}/p", tmp_path / "publisher")
    pub.ok("import", ckpts.dir(0), "--blob-cache-size", "0")
    drop_snapshots(pub)
    r = Counted(proxy, lambda: pub.ok("commit", ckpts.dir(1), "--json", "--blob-cache-size", "0"))
    assert json.loads(r.result.stdout)["blob_cache"] is None
    assert len(r.blob_gets) > 0
    assert r.bytes_down > json.loads(r.result.stdout)["dense_bytes"] / 2


def test_verify_reads_the_store_not_the_cache(moto, proxy, bucket, ckpts, tmp_path):
    """A blob damaged in the store after the publisher cached it: export
    still reads the good cached copy, verify reports the damage."""
    pub = host(moto, proxy.endpoint, f"s3://{bucket}/p", tmp_path / "publisher")
    pub.ok("import", ckpts.dir(0))
    client = s3_util.s3_client(moto)
    blobs = client.list_objects_v2(Bucket=bucket, Prefix="p/blobs/")["Contents"]
    victim = max(blobs, key=lambda o: o["Size"])["Key"]
    data = bytearray(client.get_object(Bucket=bucket, Key=victim)["Body"].read())
    data[len(data) // 2] ^= 0x40
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(data))
    store_util.same_tree(pub.export(0, tmp_path / "out"), ckpts.dir(0))
    r = pub.run("verify")
    assert r.returncode == 4, r.stderr  # CORRUPT
    assert victim.rsplit("/", 1)[1] in r.stderr, r.stderr


def index_lock(cache_dir):
    """Holds the RocksDB lock of the one store index under cache_dir, as a
    running dtefs or dtectl would; returns the open file (close to release)."""
    (store_id,) = os.listdir(cache_dir)
    f = open(os.path.join(cache_dir, store_id, "index", "LOCK"), "r+")
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def test_busy_cache_index_runs_uncached_with_a_note(moto, proxy, bucket, ckpts, tmp_path):
    pub = host(moto, proxy.endpoint, f"s3://{bucket}/p", tmp_path / "publisher")
    pub.ok("import", ckpts.dir(0))
    drop_snapshots(pub)  # the parent must come from blobs
    lock = index_lock(pub.cache)
    try:
        busy = Counted(proxy, lambda: pub.ok("commit", ckpts.dir(1), "--json"))
    finally:
        lock.close()
    stderr = busy.result.stderr
    assert "note: the cache index" in stderr and "running without the blob cache" in stderr, stderr
    assert json.loads(busy.result.stdout)["blob_cache"] is None
    assert len(busy.blob_gets) > 0  # the parent came from the store
    # The cache is intact: the next commit reads v0 from it and only v1's
    # delta (not kept by the uncached commit) from the store.
    drop_snapshots(pub)  # any the busy commit left
    after = Counted(proxy, lambda: commit(pub, ckpts.dir(2)))
    assert after.result["blob_cache"]["hits"] > 0
    assert after.bytes_down < busy.bytes_down / 2, (after.bytes_down, busy.bytes_down)
    reader = host(moto, moto.endpoint, pub.store, tmp_path / "reader")
    store_util.same_tree(reader.export(2, tmp_path / "out"), ckpts.dir(2))


def test_concurrent_commands_on_one_cache_dir(moto, proxy, bucket, ckpts, tmp_path):
    pub = host(moto, proxy.endpoint, f"s3://{bucket}/p", tmp_path / "publisher")
    pub.ok("import", ckpts.dir(0))
    pub.ok("commit", ckpts.dir(1))
    results = [None] * 4

    def export(i):
        results[i] = pub.run("export", "--version", i % 2, tmp_path / f"out{i}")

    threads = [threading.Thread(target=export, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        assert r.returncode == OK, r.stderr
        store_util.same_tree(tmp_path / f"out{i}", ckpts.dir(i % 2))
    # The cache is still sound for the next command.
    assert pub.ok("commit", ckpts.dir(2)).returncode == OK
    store_util.same_tree(pub.export(2, tmp_path / "out2-again"), ckpts.dir(2))


def test_missing_bucket_is_named_by_read_only_commands_and_dtefs(moto, bucket, tmp_path):
    # A bucket that exists but holds no store is "not a dte store".
    empty = host(moto, moto.endpoint, f"s3://{bucket}/p", tmp_path / "empty")
    r = empty.run("log")
    assert r.returncode == ERROR and "not a dte store" in r.stderr, r.stderr
    uri = "s3://no-such-bucket-cache/p"
    d = host(moto, moto.endpoint, uri, tmp_path)
    for args in (["log"], ["verify"], ["export", "--version", 0, tmp_path / "out"]):
        r = d.run(*args)
        assert r.returncode == ERROR, (args, r.stderr)
        assert "bucket no-such-bucket-cache" in r.stderr and "does not exist" in r.stderr, \
            (args, r.stderr)
        assert "NoSuchBucket" in r.stderr and "not a dte store" not in r.stderr, (args, r.stderr)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([str(dtefs_binary()), uri, str(mnt), "-f", "--cache-dir",
                        str(tmp_path / "fs-cache")], env=d.env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0, r.stderr
    assert "bucket no-such-bucket-cache" in r.stderr and "does not exist" in r.stderr, r.stderr
    assert "not a dte store" not in r.stderr, r.stderr
    assert not os.path.ismount(mnt)


def test_bad_blob_cache_options_are_usage_errors(moto, bucket, tmp_path):
    d = host(moto, moto.endpoint, f"s3://{bucket}/p", tmp_path)
    for args in (["--blob-cache-size", "lots"], ["--blob-chunk-size", "1000"],
                 ["--blob-chunk-size", "2GiB"]):
        r = d.run("log", *args)
        assert r.returncode == 2 and args[0] in r.stderr, (args, r.stderr)


def test_commands_on_a_warm_cache_list_only_new_manifests(moto, proxy, bucket, ckpts, tmp_path):
    """A host's index keeps the store's listing: its next commands list only
    the manifests after the newest one it knows (one request, however many
    versions there are), and a version another host's gc rewrote is found
    again from a full listing."""
    uri = f"s3://{bucket}/listing"
    pub = host(moto, proxy.endpoint, uri, tmp_path / "publisher")
    pub.ok("import", ckpts.dir(0))
    for step in (1, 2):
        commit(pub, ckpts.dir(step))

    def manifest_lists():
        return [e for e in proxy.exchanges(method="GET", query="list-type=2")
                if "manifests" in e.query]

    proxy.reset_counters()
    r = commit(pub, ckpts.dir(3))
    assert r["version"] == 3
    lists = manifest_lists()
    assert lists and all("start-after=" in e.query for e in lists), [e.query for e in lists]
    proxy.reset_counters()
    assert [v["version"] for v in pub.log()] == [0, 1, 2, 3]
    assert all("start-after=" in e.query for e in manifest_lists())
    # Another host's gc removes v0 and v1 and rewrites v2 as an anchor
    # revision. Within the kept listing's lifetime this host still reads v2
    # through its old manifest (same content; gc's grace period keeps the
    # blobs); a gc here lists everything and brings the kept listing up to date.
    other = host(moto, moto.endpoint, uri, tmp_path / "other")
    other.ok("gc", "--keep-last", 2)
    store_util.same_tree(pub.export(2, tmp_path / "out2"), ckpts.dir(2))
    proxy.reset_counters()
    pub.ok("gc", "--keep-last", 2, "--dry-run")
    assert any("start-after=" not in e.query for e in manifest_lists()), "no full listing"
    assert [v["version"] for v in pub.log()] == [2, 3]
    assert [v["kind"] for v in pub.log()] == ["anchor", "delta"]
    store_util.same_tree(pub.export(2, tmp_path / "again"), ckpts.dir(2))
