"""Readers of an s3:// store (moto on loopback) through the fault proxy
(s3_proxy.py) while single listings of manifests/ are damaged in transit:
dte.StoreReader.latest() and dtectl log.

What must hold: a reader's latest never goes back within its process
(the store lists again a full listing that lacks a version it has seen),
and never names a version that is not there (a key changed into another
version's: the store reads the newest listed manifest and lists once more
when it is missing); dtectl log shows every version through the same
damage. Needs libdte.so ($DTE_BUILD_DIR/sync/libdte.so or $DTE_LIBRARY)
and dtectl.
"""

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
