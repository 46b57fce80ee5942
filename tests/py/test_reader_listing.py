"""Readers of an s3:// store (moto on loopback) through the fault proxy
(s3_proxy.py) while single listings of manifests/ are damaged in transit:
dte.StoreReader (latest, versions), dte.Follower and dtectl log.

What must hold: a reader's latest never goes back within its process
(the store lists again a full listing that lacks a version it has seen),
and never names a version that is not there (a key changed into another
version's: the store reads the newest listed manifest and lists once more
when it is missing); versions() lists exactly the committed ones through
the same damage, and through gc on another host; dtectl log shows every
version. The Python readers hold no S3 client: everything goes through
libdte. Needs libdte.so ($DTE_BUILD_DIR/sync/libdte.so or $DTE_LIBRARY)
and dtectl.
"""

import itertools
import json
import os
import sys

import pytest

import s3_util
import store_util
from dtectl_util import Dtectl

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402

VERSIONS = 4
FAST_RETRIES = {"DTE_S3_MAX_ATTEMPTS": "4", "DTE_S3_RETRY_BASE_MS": "20",
                "DTE_S3_RETRY_MAX_MS": "200"}
# Damage to the newest key: dropped; changed into v00000007 (still in order).
NEWEST_DROPPED = ("list_drop_key", -1, 0x10)
NEWEST_CHANGED = ("list_damage_key", -1, 0x04)


@pytest.fixture
def store(moto, proxy, ckpts, tmp_path, monkeypatch, request):
    """VERSIONS versions committed straight to the server; this process's
    S3 settings pointed at the proxy. Returns the store's URI."""
    _, uri = s3_util.committed_store(moto, request.node.name, ckpts, VERSIONS,
                                     tmp_path / "pubcache")
    for k in [k for k in os.environ if k.startswith(("AWS_", "DTE_S3_"))]:
        monkeypatch.delenv(k)
    for k, v in {**moto.env(), "AWS_ENDPOINT_URL": proxy.endpoint, **FAST_RETRIES}.items():
        monkeypatch.setenv(k, v)
    proxy.clear_rules()
    yield uri
    proxy.clear_rules()


def damage_next_listing(proxy, damage):
    action, at, mask = damage
    return proxy.add_rule(action=action, method="GET", query="manifests%2F", at=at, mask=mask)


def test_store_reader_latest_never_goes_back_nor_names_a_missing_version(store, proxy):
    with dte.StoreReader(store) as r:
        assert r.latest() == VERSIONS - 1
        for damage in (NEWEST_DROPPED, NEWEST_CHANGED, ("list_drop_key", 1, 0x10)):
            rule = damage_next_listing(proxy, damage)
            assert r.latest() == VERSIONS - 1, damage
            assert rule.fired == 1, damage
    # A reader whose first listing is damaged: v00000007 is not there, so
    # the store lists again before it answers.
    rule = damage_next_listing(proxy, NEWEST_CHANGED)
    with dte.StoreReader(store) as r:
        assert r.latest() == VERSIONS - 1
    assert rule.fired == 1


def test_store_reader_versions_are_exactly_the_committed_ones(store, proxy):
    everything = list(range(VERSIONS))
    with dte.StoreReader(store) as r:
        assert r.versions() == everything
        for damage in (NEWEST_DROPPED, NEWEST_CHANGED, ("list_drop_key", 1, 0x10)):
            rule = damage_next_listing(proxy, damage)
            assert r.versions() == everything, damage
            assert rule.fired == 1, damage
            assert r.versions(after=1) == everything[2:], damage
            assert r.latest() == VERSIONS - 1, damage
        assert r.versions(after=VERSIONS - 1) == []
        assert r.versions(after=-1) == everything
    # A first listing whose newest key names v00000007, which is not there.
    rule = damage_next_listing(proxy, NEWEST_CHANGED)
    with dte.StoreReader(store) as r:
        assert r.versions() == everything
        assert r.tensors(VERSIONS - 1).keys() == r.tensors(0).keys()
    assert rule.fired == 1


def test_a_follower_sees_each_committed_version_once_through_damaged_listings(store, proxy):
    with dte.Follower(store) as f:
        assert f.latest() == VERSIONS - 1
        for damage in (NEWEST_CHANGED, NEWEST_DROPPED, ("list_drop_key", 1, 0x10)):
            rule = damage_next_listing(proxy, damage)
            got = list(itertools.islice(f.versions(after=-1, timeout=10), VERSIONS))
            assert got == list(range(VERSIONS)), damage
            assert rule.fired == 1, damage
            rule = damage_next_listing(proxy, damage)
            assert f.latest() == VERSIONS - 1, damage
            assert rule.fired == 1, damage
        with pytest.raises(dte.DeadlineExceeded):
            next(f.versions(timeout=0.3))  # nothing after the newest


def test_versions_gc_removed_leave_and_latest_stays(store, proxy, tmp_path):
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "DTE_S3_"))}
    with dte.Follower(store) as f, dte.StoreReader(store) as r:
        assert r.versions() == list(range(VERSIONS)) and f.latest() == VERSIONS - 1
        Dtectl(store, tmp_path / "gc-cache", env=env).ok("gc", "--keep-last", 2,
                                                        "--grace-seconds", 0)
        assert r.versions() == [VERSIONS - 2, VERSIONS - 1]
        assert r.latest() == f.latest() == VERSIONS - 1
        with pytest.raises(dte.NotFound, match="v00000000"):
            r.tensors(0)
        assert list(itertools.islice(f.versions(after=-1, timeout=10), 2)) == \
            [VERSIONS - 2, VERSIONS - 1]


def test_dtectl_log_and_latest_through_a_changed_newest_key(store, proxy, ckpts, tmp_path):
    # Fresh caches know nothing to cross-check with: the changed key is
    # caught by reading the newest listed manifest, which is not there.
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "DTE_S3_"))}
    rule = damage_next_listing(proxy, NEWEST_CHANGED)
    d = Dtectl(store, tmp_path / "cache1", env=env)
    got = [v["version"] for v in json.loads(d.ok("log", "--json").stdout)]
    assert got == list(range(VERSIONS)) and rule.fired == 1, got
    rule = damage_next_listing(proxy, NEWEST_CHANGED)
    d = Dtectl(store, tmp_path / "cache2", env=env)
    d.ok("export", "--version", "latest", tmp_path / "out")
    assert rule.fired == 1
    store_util.same_tree(tmp_path / "out", ckpts.dir(VERSIONS - 1))
