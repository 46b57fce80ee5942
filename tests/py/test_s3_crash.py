"""SIGKILL `dtectl commit` to an s3:// store at random moments and at
moments keyed to the requests it sends: the store must stay whole.

The commit publishes a multi-blob anchor (two data shards of ~14 and ~5 MiB,
multipart uploads at a 5 MiB part size, plus headers, raw files and a block
table) through the fault proxy (s3_proxy.py) to a signature-checking moto
server. After every kill, `verify` is clean, `log` shows the old state or
the complete new version, and running the same commit again either commits
it or reports it committed (exit 3) with content identical to the input. At
the end the multipart uploads and spool files the kills left behind are
cleaned by `dtectl gc` (docs/s3.md: uploads and spool files older than an
hour; moto reports every upload as initiated in 2010, and the spool files
are aged by hand).
"""

import os
import random
import re
import signal
import subprocess
import time

import pytest

import s3_util
import store_util
from crash_util import RunLength, fractions, timed_run
from ckpt_util import CheckpointSequence
from dtectl_util import CONFLICT, OK, Dtectl
from s3_proxy import Rule

RANDOM_KILLS = 20
SEED = int(os.environ.get("DTE_CRASH_SEED", "4321"))
ENV = {"DTE_S3_MAX_ATTEMPTS": "4", "DTE_S3_RETRY_BASE_MS": "20", "DTE_S3_RETRY_MAX_MS": "200",
       "DTE_S3_PART_SIZE": "5MiB", "DTE_S3_PARALLEL_PARTS": "2"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """v0: a small model; v1: a ~19 MiB one of another layout (so an anchor)."""
    root = tmp_path_factory.mktemp("models")
    small = CheckpointSequence(root / "small")
    big = CheckpointSequence(root / "big", hidden=640, intermediate=1728, layers=1, vocab=4096)
    return small.dir(0), big.dir(0)


class Host:
    """A publisher host: dtectl through the proxy with one cache and spool directory."""

    def __init__(self, moto, proxy, uri, root):
        self.dte = Dtectl(uri, root / "cache", env={
            **moto.env(), "AWS_ENDPOINT_URL": proxy.endpoint,
            "DTE_SPOOL_DIR": str(root.parent / "spool"), **ENV})
        for k in [k for k in self.dte.env if k.startswith("AWS_") and k not in moto.env()]:
            del self.dte.env[k]


def start(host, ckpt):
    return subprocess.Popen(host.dte.argv("commit", ckpt, "--version", 1), env=host.dte.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_on(proxy, host, ckpt, **rule):
    """SIGKILLs the commit from a proxy hook when `rule` fires; True if it did."""
    holder = []
    rule = proxy.add_rule(Rule(hook=lambda ex: holder[0].send_signal(signal.SIGKILL), **rule))
    try:
        p = start(host, ckpt)
        holder.append(p)
        p.communicate(timeout=120)
    finally:
        proxy.clear_rules()
    return p.returncode == -signal.SIGKILL and rule.fired == 1


# Kill moments keyed to requests, as the proxy sees them.
KEYED = [
    ("on the 2nd PUT", dict(action="pass", method="PUT", skip=1)),
    ("on the 5th PUT", dict(action="pass", method="PUT", skip=4)),
    ("on the 9th PUT", dict(action="pass", method="PUT", skip=8)),
    ("when part 2 is sent", dict(action="pass", method="PUT", query="partNumber=2")),
    ("when part 3 is sent", dict(action="pass", method="PUT", query="partNumber=3")),
    ("when an upload completes", dict(action="pass", method="POST", query="uploadId=",
                                      when="response")),
    ("before the manifest PUT reaches S3", dict(action="reset_before", method="PUT",
                                                key="/manifests/")),
    ("right after the manifest PUT was sent", dict(action="pass", method="PUT",
                                                   key="/manifests/")),
    ("when the manifest PUT is answered", dict(action="pass", method="PUT", key="/manifests/",
                                               when="response")),
]


def test_commit_to_s3_killed_at_random_moments(moto, proxy, models, tmp_path):
    v0, v1 = models
    bucket = moto.create_bucket("crash")
    base = Host(moto, proxy, f"s3://{bucket}/base", tmp_path / "h" / "base")
    base.dte.ok("import", v0)

    def fresh(name):
        s3_util.copy_prefix(moto, bucket, "base", name)
        return Host(moto, proxy, f"s3://{bucket}/{name}", tmp_path / "h" / name)

    probes = [fresh(f"probe{i}") for i in range(3)]
    length = RunLength([timed_run(h.dte.argv("commit", v1, "--version", 1), h.dte.env)
                        for h in probes])
    rng = random.Random(SEED)
    trials = [("after", f) for f in fractions(RANDOM_KILLS, rng, reach=1.1)]
    trials += [("keyed", k) for k in KEYED]
    killed, landed, problems = 0, 0, []
    started = time.monotonic()
    for i, (how, what) in enumerate(trials):
        name = f"t{i}"
        host = fresh(name)
        if how == "after":
            moment = length.at(what)
            was_killed = length.kill(host.dte.argv("commit", v1, "--version", 1), host.dte.env,
                                     what)
            context = f"trial {i}: killed after {moment:.3f}s of a {length.seconds:.3f}s commit"
        else:
            was_killed = kill_on(proxy, host, v1, **what[1])
            context = f"trial {i}: killed {what[0]}"
            assert was_killed, f"{context}: the moment never came"
        killed += was_killed
        r = host.dte.run("verify")
        assert r.returncode == OK, f"{context}: {r.stderr}"
        versions = host.dte.versions()
        assert versions in ([0], [0, 1]), (context, versions)
        retry = host.dte.run("commit", v1, "--version", 1)
        if versions == [0, 1]:
            landed += 1
            if retry.returncode != CONFLICT or "version 1 already exists" not in retry.stderr:
                problems.append(f"{context}: retry exit {retry.returncode}: {retry.stderr}")
        elif (retry.returncode, retry.stdout) != (OK, "1\n"):
            problems.append(f"{context}: retry exit {retry.returncode}: {retry.stderr}")
        assert host.dte.versions() == [0, 1], context
        assert host.dte.run("verify", "--version", 1).returncode == OK, context
        if versions == [0, 1] or i % 3 == 0:  # what landed is what was committed
            out = tmp_path / "out" / name
            store_util.same_tree(host.dte.export(1, out), v1)
    print(f"commit {length.seconds:.2f}s: {killed} of {len(trials)} trials killed while running, "
          f"{landed} landed; trials took {time.monotonic() - started:.1f}s")
    assert not problems, "\n".join(problems)
    assert killed >= 20, killed
    assert 2 <= landed < len(trials) - 5, landed
    clean_up_leftovers(moto, bucket, tmp_path / "h", [f"t{i}" for i in range(len(trials))],
                       lambda name: Host(moto, proxy, f"s3://{bucket}/{name}",
                                         tmp_path / "h" / name))


def clean_up_leftovers(moto, bucket, hosts_root, names, host_for):
    """Kills left multipart uploads and spool files; gc removes them once old."""
    uploads = s3_util.multipart_uploads(moto, bucket)
    assert uploads, "no kill landed inside a multipart upload"
    spool = hosts_root / "spool"
    leftovers = list(spool.iterdir())
    assert leftovers, "no kill left a spool file"
    # A young spool file may belong to a commit in flight: gc keeps it.
    first = host_for(names[0])
    first.dte.ok("gc", "--keep-last", 10)
    assert sorted(spool.iterdir()) == sorted(leftovers)
    hour_ago = time.time() - 7200
    for f in leftovers:
        os.utime(f, (hour_ago, hour_ago))
    prefixes = sorted({re.match(r"(t\d+)/", key).group(1) for key, _ in uploads})
    for name in prefixes:
        host_for(name).dte.ok("gc", "--keep-last", 10)
    assert s3_util.multipart_uploads(moto, bucket) == []
    assert list(spool.iterdir()) == []
    print(f"gc aborted {len(uploads)} uploads under {len(prefixes)} stores and removed "
          f"{len(leftovers)} spool files")
