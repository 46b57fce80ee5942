"""dtectl on S3 through a fault-injecting proxy (s3_proxy.py) in front of a
real, signature-checking moto server on loopback.

One test per fault type. Retryable faults (5xx and SlowDown storms shorter
than the retry budget, connection resets before and after the request was
applied, stalls, truncated bodies) are ridden out: commits land once and
exports are byte-identical. A storm longer than the budget fails the command
with the S3 code and key in the message and leaves no version. Flipped bits
in answers are never visible: a read either retries and gets the right
bytes or fails as corruption, and nothing wrong is written or cached. Other
4xx fail at once, without retries (counted at the proxy).

The retry budget is made small through the environment (DTE_S3_MAX_ATTEMPTS
and friends, docs/s3.md) so that the tests run in seconds.
"""

import json
import os
import random
import re
import subprocess

import pytest

import s3_util
import store_util
from ckpt_util import CheckpointSequence
import dtectl_util
from dtectl_util import CORRUPT, ERROR, OK

ATTEMPTS = 4
FAST_RETRIES = {"DTE_S3_MAX_ATTEMPTS": str(ATTEMPTS), "DTE_S3_RETRY_BASE_MS": "20",
                "DTE_S3_RETRY_MAX_MS": "200", "DTE_S3_PART_SIZE": "5MiB",
                "DTE_S3_PARALLEL_PARTS": "2"}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A ~25 MiB model whose two data shards (18 and 6 MiB) are multipart
    uploads at the 5 MiB part size."""
    return CheckpointSequence(tmp_path_factory.mktemp("big"), hidden=768, intermediate=2048,
                              layers=1, vocab=4096)


def dtectl(moto, endpoint, uri, root, env=None):
    """dtectl on `uri` at `endpoint`, fast retries."""
    return dtectl_util.s3(moto, uri, root / "cache", endpoint, env={
        "DTE_SPOOL_DIR": str(root / "spool"), **FAST_RETRIES, **(env or {})})


class Setup:
    """A store through the proxy (`dte`) and the truth straight from the server
    (`check`, with a cache of its own on every call)."""

    def __init__(self, moto, proxy, bucket, root, prefix="p", env=None):
        self.moto, self.bucket, self.prefix, self.root = moto, bucket, prefix, root
        self.uri = f"s3://{bucket}/{prefix}"
        self.dte = dtectl(moto, proxy.endpoint, self.uri, root / "via", env)
        self._checks = 0

    def check(self):
        self._checks += 1
        return dtectl(self.moto, self.moto.endpoint, self.uri, self.root / f"check{self._checks}")

    def key(self, exchange):
        """The store key an exchange was about."""
        return exchange.path.split(f"/{self.bucket}/{self.prefix}/", 1)[1]

    def out(self, name):
        return self.root / "out" / name


def assert_versions_and_clean(s, versions):
    check = s.check()
    assert check.versions() == versions
    r = check.run("verify")
    assert r.returncode == OK, r.stderr


def test_error_storms_within_the_retry_budget_are_ridden_out(moto, faults, bucket, ckpts,
                                                             tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    storm = ATTEMPTS - 1
    s.dte.ok("import", ckpts.dir(0))
    rules = [faults.add_rule(action="status", status=500, code="InternalError", method="PUT",
                             key="/blobs/", times=storm),
             faults.add_rule(action="status", status=503, code="SlowDown", method="PUT",
                             key="/manifests/", times=storm),
             faults.add_rule(action="status", status=503, code="ServiceUnavailable",
                             method="GET", query="list-type=2", skip=1, times=storm)]
    assert s.dte.commit(ckpts.dir(1)) == 1
    puts = faults.exchanges(method="PUT", key="/manifests/v00000001.json")
    assert [e.status for e in puts] == [503] * storm + [200]
    assert [r.fired for r in rules] == [storm] * 3

    # Reads on a host with an empty cache: manifests, block tables and blob ranges.
    faults.clear_rules()
    rules = [faults.add_rule(action="status", status=503, code="SlowDown", method="GET",
                             key="/manifests/", times=storm),
             faults.add_rule(action="status", status=500, code="InternalError", method="GET",
                             key="/blobs/", ranged=True, skip=5, times=storm)]
    fresh = dtectl(moto, faults.endpoint, s.uri, tmp_path / "fresh")
    store_util.same_tree(fresh.export(1, s.out("v1")), ckpts.dir(1))
    assert fresh.ok("verify").returncode == OK
    assert [r.fired for r in rules] == [storm] * 2
    assert_versions_and_clean(s, [0, 1])


@pytest.mark.parametrize("target", ["blob", "manifest", "part"])
def test_error_storm_longer_than_the_budget_fails_and_leaves_no_version(
        moto, faults, bucket, ckpts, big, tmp_path, target):
    s = Setup(moto, faults, bucket, tmp_path)
    seq = big if target == "part" else ckpts
    s.dte.ok("import", seq.dir(0))
    keys_before = s3_util.object_keys(moto, bucket, "p")
    faults.reset_counters()
    if target == "blob":
        rule = faults.add_rule(action="status", status=503, code="SlowDown", method="PUT",
                               key="/blobs/", times=None)
    elif target == "manifest":
        rule = faults.add_rule(action="status", status=503, code="SlowDown", method="PUT",
                               key="/manifests/", times=None)
    else:
        rule = faults.add_rule(action="status", status=500, code="InternalError", method="PUT",
                               query="partNumber=3", times=None)
    args = ("--anchor",) if target == "part" else ()
    r = s.dte.run("commit", seq.dir(1), *args)
    assert r.returncode == ERROR, r.stderr
    failed = faults.exchanges(method="PUT", key=rule.key, query=rule.query)
    assert failed and all(e.status == rule.status for e in failed)
    key = s.key(failed[0])
    # The message says what failed, where, and that it was retried.
    assert key in r.stderr and rule.code in r.stderr, r.stderr
    assert f"HTTP {rule.status}" in r.stderr and f"after {ATTEMPTS} attempts" in r.stderr, r.stderr
    assert len([e for e in failed if s.key(e) == key]) == ATTEMPTS
    faults.clear_rules()
    assert_versions_and_clean(s, [0])
    keys_after = s3_util.object_keys(moto, bucket, "p")
    assert [k for k in keys_after if k.startswith("manifests/")] == ["manifests/v00000000.json"]
    if target == "part":  # the failed upload was aborted, no parts linger
        assert faults.exchanges(method="DELETE", query="uploadId=")
        assert s3_util.multipart_uploads(moto, bucket) == []
    # A retry once the server is well again commits the version.
    assert s.dte.commit(seq.dir(1), *args) == 1
    store_util.same_tree(s.check().export(1, s.out("v1")), seq.dir(1))
    assert set(keys_before) < set(s3_util.object_keys(moto, bucket, "p"))


def test_connection_reset_before_forwarding_is_retried(moto, faults, bucket, big, tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    rules = [faults.add_rule(action="reset_before", method="PUT", query="partNumber=2", times=2),
             faults.add_rule(action="reset_before", method="POST", query="uploadId=", times=1),
             faults.add_rule(action="reset_before", method="PUT", key="/blobs/", query="",
                             times=2),
             faults.add_rule(action="reset_before", method="PUT", key="/manifests/", times=2),
             faults.add_rule(action="reset_before", method="HEAD", skip=3, times=2)]
    s.dte.ok("import", big.dir(0))
    assert [r.fired for r in rules] == [2, 1, 2, 2, 2]
    puts = faults.exchanges(method="PUT", key="/manifests/v00000000.json")
    assert [e.status for e in puts] == [None, None, 200]

    faults.clear_rules()
    rules = [faults.add_rule(action="reset_before", method="GET", key="/blobs/", times=3),
             faults.add_rule(action="reset_before", method="GET", key="/manifests/", times=1),
             faults.add_rule(action="reset_before", method="GET", query="list-type=2", times=1)]
    fresh = dtectl(moto, faults.endpoint, s.uri, tmp_path / "fresh")
    store_util.same_tree(fresh.export(0, s.out("v0")), big.dir(0))
    assert [r.fired for r in rules] == [3, 1, 1]
    assert_versions_and_clean(s, [0])


def test_lost_answer_after_the_manifest_was_created_ends_with_one_version(
        moto, faults, bucket, ckpts, tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    faults.add_rule(action="reset_after", method="PUT", key="/manifests/v00000001.json")
    r = s.dte.run("commit", ckpts.dir(1))
    assert (r.returncode, r.stdout) == (OK, "1\n"), r.stderr
    # The first PUT was applied and its answer lost; the retry saw 412 and the
    # manifest read back equal to ours.
    puts = faults.exchanges(method="PUT", key="/manifests/v00000001.json")
    assert [e.status for e in puts] == [None, 412]
    assert faults.exchanges(method="GET", key="/manifests/v00000001.json")
    assert_versions_and_clean(s, [0, 1])
    assert s.dte.versions() == [0, 1]
    store_util.same_tree(s.check().export(1, s.out("v1")), ckpts.dir(1))


def test_lost_create_answer_then_a_storm_still_reports_the_version(moto, faults, bucket, ckpts,
                                                                   tmp_path):
    """The create applied, its answer was lost, and every retry meets a storm:
    the version exists, so the commit must not report failure (a user who
    retried would publish the same checkpoint twice)."""
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    faults.add_rule(action="reset_after", method="PUT", key="/manifests/")
    faults.add_rule(action="status", status=503, code="SlowDown", method="PUT",
                    key="/manifests/", times=None)
    r = s.dte.run("commit", ckpts.dir(1))
    puts = faults.exchanges(method="PUT", key="/manifests/v00000001.json")
    assert [e.status for e in puts] == [None] + [503] * (ATTEMPTS - 1)
    assert (r.returncode, r.stdout) == (OK, "1\n"), r.stderr
    faults.clear_rules()
    assert_versions_and_clean(s, [0, 1])


def test_lost_answers_inside_multipart_uploads_are_retried(moto, faults, bucket, big, tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    rules = [faults.add_rule(action="reset_after", method="POST", query="uploads=", times=1),
             faults.add_rule(action="reset_after", method="PUT", query="partNumber=1", times=2),
             faults.add_rule(action="reset_after", method="POST", query="uploadId=", times=2),
             faults.add_rule(action="reset_after", method="PUT", key="/blobs/", query="",
                             skip=1)]
    s.dte.ok("import", big.dir(0))
    assert [r.fired for r in rules] == [1, 2, 2, 1]
    completes = faults.exchanges(method="POST", query="uploadId=")
    # Completed by the first attempt: a retry finds the upload done (moto
    # answers 200 again; S3 may answer 404 NoSuchUpload) and the size check decides.
    assert [e.status for e in completes][:2] == [None, None]
    assert completes[2].status in (200, 404)
    store_util.same_tree(s.check().export(0, s.out("v0")), big.dir(0))
    assert_versions_and_clean(s, [0])
    # The upload whose initiation answer was lost is orphaned (only gc can
    # find it); every upload dtectl knew of completed.
    assert len(s3_util.multipart_uploads(moto, bucket)) == 1
    s.dte.ok("gc", "--keep-last", 10)
    assert s3_util.multipart_uploads(moto, bucket) == []


def test_stalled_answers_are_abandoned_and_retried(moto, faults, bucket, ckpts, tmp_path):
    stall = {"DTE_S3_LOW_SPEED_TIME": "2"}
    s = Setup(moto, faults, bucket, tmp_path, env=stall)
    s.dte.ok("import", ckpts.dir(0))
    rules = [faults.add_rule(action="stall", seconds=8, method="PUT", key="/blobs/", skip=1),
             faults.add_rule(action="stall", seconds=8, method="PUT", key="/manifests/")]
    assert s.dte.commit(ckpts.dir(1)) == 1
    assert [r.fired for r in rules] == [1, 1]
    puts = faults.exchanges(method="PUT", key="/manifests/v00000001.json")
    assert [e.status for e in puts] == [None, 412]  # the stalled one was applied

    faults.clear_rules()
    rules = [faults.add_rule(action="stall", seconds=8, at=1000, method="GET", key="/blobs/",
                             ranged=True, skip=2),
             faults.add_rule(action="stall", seconds=8, method="GET", key="/manifests/")]
    fresh = dtectl(moto, faults.endpoint, s.uri, tmp_path / "fresh", env=stall)
    store_util.same_tree(fresh.export(1, s.out("v1")), ckpts.dir(1))
    assert [r.fired for r in rules] == [1, 1]
    assert_versions_and_clean(s, [0, 1])


def test_truncated_bodies_are_retried(moto, faults, bucket, ckpts, tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    s.dte.ok("commit", ckpts.dir(1))
    rules = [faults.add_rule(action="truncate", method="GET", key="/manifests/", times=2),
             faults.add_rule(action="truncate", method="GET", key="/blobs/", times=3),
             faults.add_rule(action="truncate", method="GET", query="list-type=2", times=1),
             faults.add_rule(action="truncate", at=0, method="GET", key="dte-store.json")]
    fresh = dtectl(moto, faults.endpoint, s.uri, tmp_path / "fresh")
    store_util.same_tree(fresh.export(1, s.out("v1")), ckpts.dir(1))
    assert fresh.ok("verify").returncode == OK
    assert [r.fired for r in rules] == [2, 3, 1, 1]
    assert fresh.log() == s.check().log()


def test_flipped_bits_in_blob_reads_never_reach_the_output(moto, faults, bucket, ckpts, tmp_path):
    """Every export runs on a host with an empty blob cache, so its blob
    reads go to the store. With 4 MiB chunks every blob is one chunk, checked
    against its name as it arrives and fetched again; with 64 KiB chunks a
    flipped chunk of a larger blob is caught by the block hashes, its chain's
    chunks are dropped and the export reads again. Either way the output is
    right, and nothing damaged stays in the cache."""
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    s.dte.ok("commit", ckpts.dir(1))
    rng = random.Random(7)
    reread = 0
    for trial in range(6):
        faults.clear_rules()
        faults.reset_counters()
        rule = faults.add_rule(action="flip", method="GET", key="/blobs/", skip=rng.randrange(8),
                               mask=1 << rng.randrange(8))
        host = dtectl(moto, faults.endpoint, s.uri, tmp_path / f"host{trial}")
        chunk = "64KiB" if trial % 2 else "4MiB"
        out = s.out(f"t{trial}")
        r = host.run("export", "--version", 1, out, "--blob-chunk-size", chunk)
        assert rule.fired == 1, trial
        assert r.returncode == OK, (trial, r.stderr)
        store_util.same_tree(out, ckpts.dir(1))
        reread += "reading again" in r.stderr
        # The cache kept only good chunks: a second export reads them.
        faults.clear_rules()
        faults.reset_counters()
        again = s.out(f"again{trial}")
        host.ok("export", "--version", 1, again, "--blob-chunk-size", chunk)
        store_util.same_tree(again, ckpts.dir(1))
        assert faults.exchanges(method="GET", key="/blobs/") == [], trial
        # verify reads every blob from the store: a flip there is reported,
        # never accepted.
        rule = faults.add_rule(action="flip", method="GET", key="/blobs/", skip=rng.randrange(8))
        r = s.dte.run("verify")
        assert rule.fired == 1
        assert r.returncode in (OK, CORRUPT), r.stderr
    faults.clear_rules()
    assert_versions_and_clean(s, [0, 1])
    print("exports that dropped chunks and read again:", reread)


def test_flipped_chunk_of_a_large_blob_is_dropped_and_read_again(moto, faults, bucket, ckpts,
                                                                 tmp_path):
    """A chunk of a blob larger than a chunk cannot be checked as it arrives:
    the block hashes of the export catch it, the reader drops the cached
    chunks of the block's records and reads it once more from the store,
    and the output is right."""
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    s.dte.ok("commit", ckpts.dir(1))
    objects = s3_util.s3_client(moto).list_objects_v2(Bucket=bucket, Prefix="p/blobs/")
    largest = max(objects["Contents"], key=lambda o: o["Size"])
    assert largest["Size"] > 4 * 64 * 1024, largest  # several 64 KiB chunks
    faults.reset_counters()
    rule = faults.add_rule(action="flip", method="GET", key=largest["Key"].split("/", 1)[1],
                           skip=2, mask=0x10)
    host = dtectl(moto, faults.endpoint, s.uri, tmp_path / "host")
    out = s.out("v1")
    r = host.run("export", "--version", 1, out, "--blob-chunk-size", "64KiB", "--json")
    assert rule.fired == 1
    assert r.returncode == OK, r.stderr
    store_util.same_tree(out, ckpts.dir(1))
    assert json.loads(r.stdout)["blob_cache"]["dropped"] > 0
    # The damaged chunk was fetched again.
    fetched = [(e.path, e.headers.get("range")) for e in faults.exchanges(method="GET",
                                                                          key="/blobs/")]
    damaged = fetched[[i for i, f in enumerate(fetched) if f[0].endswith(largest["Key"])][2]]
    assert fetched.count(damaged) == 2, damaged


def manifest_flip_spots(manifest, rng):
    """(offset, mask) pairs in a manifest: flips that keep the JSON valid (a
    digit of the commit time, of the changed-element count, of a tensor's
    changed count; a letter of a file name) and random ones."""
    spots = []
    for field, skip in ((b'"created": "', 3), (b'"changed_elements": ', 0), (b'"changed": ', 0),
                        (b'"name": "config.json"', 10)):
        at = manifest.index(field) + len(field) + skip
        spots.append((at, 0x01))  # '0'<->'1', '2'<->'3', ...; 'c'<->'b'
    spots += [(rng.randrange(len(manifest)), 1 << rng.randrange(7)) for _ in range(4)]
    return spots


def test_flipped_bits_in_manifests_and_block_tables_are_never_visible(moto, faults, bucket,
                                                                      ckpts, tmp_path):
    """Manifests have no hash of their own, so a damaged one would parse:
    whole-object reads are checked against the SHA-256 stored with the
    object and retried. Nothing damaged is shown, cached in the host's index
    or exported."""
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    s.dte.ok("commit", ckpts.dir(1))
    truth = s.check().log()
    client = s3_util.s3_client(moto)
    manifest = client.get_object(Bucket=bucket, Key="p/manifests/v00000001.json")["Body"].read()
    table = json.loads(manifest)["block_table"]["hash"]
    rng = random.Random(11)
    targets = [("/manifests/v00000001.json", at, mask)
               for at, mask in manifest_flip_spots(manifest, rng)]
    targets += [(f"/blobs/{table[:2]}/{table}", rng.randrange(64), 0x04) for _ in range(2)]
    for i, (key, at, mask) in enumerate(targets):
        for command in ("log", "export"):
            faults.clear_rules()
            rule = faults.add_rule(action="flip", method="GET", key=key, at=at, mask=mask)
            host = dtectl(moto, faults.endpoint, s.uri, tmp_path / f"{command}{i}")
            out = s.out(f"{command}{i}")
            r = (host.run("log", "--json") if command == "log" else
                 host.run("export", "--version", 1, out))
            context = (key, at, mask, command, r.stderr)
            assert rule.fired == 1, context
            # The damaged answer was retried: the truth, at once.
            assert r.returncode == OK, context
            if command == "log":
                assert json.loads(r.stdout) == truth, context
            else:
                store_util.same_tree(out, ckpts.dir(1))
            faults.clear_rules()
            assert host.log() == truth, context  # and nothing damaged was cached
    faults.clear_rules()
    assert_versions_and_clean(s, [0, 1])


def test_other_4xx_fail_at_once_without_retries(moto, faults, bucket, ckpts, tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    bad = dtectl(moto, faults.endpoint, s.uri, tmp_path / "bad",
                 env={"AWS_SECRET_ACCESS_KEY": "Wrong/Secret+0123456789abcdefghij"})
    faults.reset_counters()
    r = bad.run("log")
    assert r.returncode == ERROR, r.stderr
    assert "SignatureDoesNotMatch" in r.stderr and "HTTP 403" in r.stderr, r.stderr
    assert "dte-store.json" in r.stderr and "attempts" not in r.stderr, r.stderr
    assert [(e.method, e.status) for e in faults.exchanges()] == [("GET", 403)]

    # A 403 the proxy makes up in the middle of a commit: one request, no retry.
    faults.reset_counters()
    rule = faults.add_rule(action="status", status=403, code="AccessDenied",
                           message="Access Denied", method="PUT", key="/blobs/", skip=1)
    r = s.dte.run("commit", ckpts.dir(1))
    assert r.returncode == ERROR, r.stderr
    denied = faults.exchanges(method="PUT", key="/blobs/")[1]
    key = s.key(denied)
    assert "AccessDenied" in r.stderr and "HTTP 403" in r.stderr and key in r.stderr, r.stderr
    assert "access denied to object" in r.stderr and f"(bucket {bucket})" in r.stderr, r.stderr
    # One PUT (Touch's CopyObject or the upload) after its HEADs: no retry.
    assert rule.fired == 1
    assert [e.method for e in faults.exchanges(key=denied.path) if e.method != "HEAD"] == ["PUT"]
    assert "attempts" not in r.stderr, r.stderr
    faults.clear_rules()
    assert_versions_and_clean(s, [0])


def test_proxy_counts_the_bytes_of_each_direction(moto, faults, bucket, ckpts, tmp_path):
    s = Setup(moto, faults, bucket, tmp_path)
    r = s.dte.ok("import", ckpts.dir(0), "--json")
    stored = json.loads(r.stdout)["stored_bytes"]
    assert stored <= faults.bytes_up <= stored + 200_000, (stored, faults.bytes_up)
    faults.reset_counters()
    faults.set_rate(up=None, down=2 << 20)  # 2 MiB/s: shaping must not change a byte
    try:
        fresh = dtectl(moto, faults.endpoint, s.uri, tmp_path / "fresh")
        store_util.same_tree(fresh.export(0, s.out("v0")), ckpts.dir(0))
    finally:
        faults.set_rate(None, None)
    dense = sum(f.stat().st_size for f in s.out("v0").iterdir())
    assert dense <= faults.bytes_down <= dense + 200_000, (dense, faults.bytes_down)
    assert faults.bytes_up < 100_000


def test_bad_retry_setting_is_refused_naming_the_variable(moto, faults, bucket, tmp_path):
    for name, value in (("DTE_S3_MAX_ATTEMPTS", "0"), ("DTE_S3_PART_SIZE", "1MiB")):
        s = Setup(moto, faults, bucket, tmp_path / name, env={name: value})
        r = s.dte.run("log")
        assert r.returncode == ERROR and name in r.stderr, r.stderr
    assert faults.exchanges() == []  # refused before any request


def bad_start(faults, endless=False):
    """Listings (ListObjectsV2) fail at first: 503s for longer than one
    request's retries, then a reset, then a 200 whose body is not a
    listing; endless: every listing fails."""
    faults.clear_rules()
    lists = dict(method="GET", query="list-type=2")
    if endless:
        return faults.add_rule(action="status", status=503, code="SlowDown", times=None, **lists)
    storm = ATTEMPTS + 2
    faults.add_rule(action="status", status=503, code="SlowDown", times=storm, **lists)
    faults.add_rule(action="reset_before", skip=storm, times=1, **lists)
    faults.add_rule(action="status", status=200, code="NotAListing", skip=storm + 1, times=1,
                    **lists)


def test_a_bad_start_is_ridden_out_by_dtectl_and_by_a_mount(moto, faults, bucket, ckpts,
                                                              tmp_path):
    import fs_util
    s = Setup(moto, faults, bucket, tmp_path)
    s.dte.ok("import", ckpts.dir(0))
    s.dte.ok("commit", ckpts.dir(1))

    # dtectl lists again, with backoff, until the listing comes through.
    bad_start(faults)
    seen = len(faults.exchanges(method="GET", query="list-type=2"))
    fresh = dtectl(moto, faults.endpoint, s.uri, tmp_path / "fresh")
    assert fresh.versions() == [0, 1]
    lists = faults.exchanges(method="GET", query="list-type=2")[seen:]
    assert [e.action for e in lists[:ATTEMPTS + 4]] == (
        ["status"] * (ATTEMPTS + 2) + ["reset_before", "status"]), lists
    # ... and names the listing and the attempts when it never does.
    bad_start(faults, endless=True)
    r = dtectl(moto, faults.endpoint, s.uri, tmp_path / "never").run("log")
    assert r.returncode == ERROR, r.stderr
    assert re.search(r"listing the versions of store %s failed %d times over [0-9.]+ s; "
                     r"the last attempt: .*ListObjectsV2.*SlowDown.*after %d attempts"
                     % (re.escape(s.uri), ATTEMPTS, ATTEMPTS), r.stderr), r.stderr

    # A mount through the same bad start comes up and serves both versions.
    env = {**moto.env(), "AWS_ENDPOINT_URL": faults.endpoint, **FAST_RETRIES}
    bad_start(faults)
    m = fs_util.Mount(s.uri, tmp_path / "mnt", tmp_path / "mcache", env=env)
    m.start()
    try:
        assert sorted(n for n in os.listdir(m.path) if n.startswith("v")) == [
            "v00000000", "v00000001"]
        store_util.same_tree(os.path.join(m.path, "v00000001"), ckpts.dir(1))
    finally:
        m.unmount()
    # A store that never answers fails the mount, naming the listing.
    bad_start(faults, endless=True)
    os.makedirs(tmp_path / "mnt2", exist_ok=True)
    r = subprocess.run([str(fs_util.binary()), s.uri, str(tmp_path / "mnt2"), "--cache-dir",
                        str(tmp_path / "mcache2")], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert re.search(r"failed %d times over .*ListObjectsV2" % ATTEMPTS, r.stderr), r.stderr
    assert not os.path.ismount(tmp_path / "mnt2")
