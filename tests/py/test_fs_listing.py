"""A dtefs mount of an s3:// store (moto on loopback) read through the fault
proxy (s3_proxy.py) while single periodic full listings of manifests/ are
damaged in transit: one key dropped (an old version's, the newest's) or
changed into another key (the newest into a version that does not exist,
an old one into a key outside the grammar).

What must hold (docs/fs.md, "Listings that lack a version"): while a
watcher reads `latest` and lists the root as fast as it can, `latest` never
goes back and no version leaves the mount; every damaged listing that lacks
a version is named, with the version's manifest key, in `.dte/status`
(`listings`) and in the daemon's log. A manifest really deleted (history
rewritten) takes its version out of the mount, and `latest` with it, and
that is said too.
"""

import os
import threading
import time

import pytest

import s3_util
from fs_util import Mount
from wait_util import wait_for
from s3_proxy import Rule

VERSIONS = 4
POLL_MS = 100  # a full listing every 10 polls: one a second
FAST_RETRIES = {"DTE_S3_MAX_ATTEMPTS": "4", "DTE_S3_RETRY_BASE_MS": "20",
                "DTE_S3_RETRY_MAX_MS": "200"}
DEADLINE = 30.0


class FullListing(Rule):
    """A rule for the mount's periodic full listings of manifests/ only (not
    its incremental ones, which start after the newest key seen)."""

    def matches(self, ex):
        return super().matches(ex) and "start-after" not in ex.query


class Watcher:
    """Reads `latest` and lists the root of a mount in a loop on a thread;
    `seen` holds every distinct (latest, versions) state, in order."""

    def __init__(self, path):
        self.path, self.seen, self.reads = path, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                state = (os.readlink(os.path.join(self.path, "latest")),
                         tuple(sorted(n for n in os.listdir(self.path) if n.startswith("v"))))
            except OSError as e:
                state = (f"error: {e}", ())
            self.reads += 1
            if not self.seen or self.seen[-1] != state:
                self.seen.append(state)

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        return self.seen


def names(versions):
    return tuple(f"v{v:08d}" for v in versions)


@pytest.fixture
def mount(moto, proxy, ckpts, tmp_path, request):
    """VERSIONS versions committed straight to the server, and a mount of the
    store through the proxy, showing them all: (mount, bucket)."""
    bucket, uri = s3_util.committed_store(moto, request.node.name, ckpts, VERSIONS,
                                          tmp_path / "pubcache")
    proxy.clear_rules()
    m = Mount(uri, tmp_path / "mnt", tmp_path / "mcache", ["--poll-ms", POLL_MS],
              env={**moto.env(), "AWS_ENDPOINT_URL": proxy.endpoint, **FAST_RETRIES})
    m.start()
    wait_for(lambda: os.readlink(os.path.join(m.path, "latest")) == names([VERSIONS - 1])[0],
             DEADLINE, "the mount to show every version")
    yield m, bucket
    proxy.clear_rules()
    m.unmount()


def damage_one_full_listing(m, proxy, action, at, mask=0x10):
    """Damages the next full listing of manifests/, then waits for two more
    full listings (the damaged one applied, and one after it)."""
    rule = proxy.add_rule(FullListing(action, method="GET", query="manifests%2F", at=at,
                                      mask=mask))
    wait_for(lambda: rule.fired == 1, DEADLINE, f"a full listing to {action} {at}")
    full = m.status()["poll"]["full_listings"]
    wait_for(lambda: m.status()["poll"]["full_listings"] >= full + 2, DEADLINE,
             "two more full listings")
    proxy.clear_rules()


def test_damaged_listings_neither_move_latest_back_nor_hide_a_version(mount, proxy):
    m, _ = mount
    every = (names([VERSIONS - 1])[0], names(range(VERSIONS)))
    watcher = Watcher(m.path)
    start = time.monotonic()
    # An old version's key and the newest's, dropped (the page still reads
    # as whole); the newest's changed into v00000007 (still in order); an
    # old one's changed into a key outside the grammar (the S3 client asks
    # again for such a page before the store sees it).
    cases = [("list_drop_key", 1, 0x10), ("list_drop_key", -1, 0x10),
             ("list_damage_key", -1, 0x04), ("list_damage_key", 1, 0x40)]
    for action, at, mask in cases:
        damage_one_full_listing(m, proxy, action, at, mask)
    seen = watcher.stop()
    print(f"{len(cases)} damaged listings in {time.monotonic() - start:.1f} s, "
          f"{watcher.reads} reads of latest and the root")
    assert seen == [every], f"the mount changed: {seen}"

    # Said by the store (a listing made again) or by the mount (a version
    # kept after a read of its manifest), naming the manifest key.
    listings = m.status()["listings"]
    print(listings)
    assert listings["damaged"] + listings["kept"] >= 3, listings
    assert listings["gone"] == 0, listings
    events = "\n".join(listings["events"])
    log = [line for line in m.log().splitlines() if line.startswith("dtefs: ")]
    for key in ("manifests/v00000001.json", "manifests/v00000003.json"):
        assert f"{key}" in events, events
        assert [line for line in log if "lacks" in line and key in line], log
    assert m.status()["max_version_seen"] == VERSIONS - 1


def test_a_manifest_deleted_for_real_takes_its_version_out(mount, moto):
    m, bucket = mount
    newest = f"manifests/v{VERSIONS - 1:08d}.json"
    s3_util.aws(moto, "s3", "rm", f"s3://{bucket}/p/{newest}")
    latest = names([VERSIONS - 2])[0]
    wait_for(lambda: os.readlink(os.path.join(m.path, "latest")) == latest, DEADLINE,
             f"latest to go back to {latest}")
    assert tuple(n for n in sorted(os.listdir(m.path)) if n.startswith("v")) == names(
        range(VERSIONS - 1))
    s = m.status()
    assert s["latest"] == VERSIONS - 2 and s["max_version_seen"] == VERSIONS - 1, s
    assert s["listings"]["gone"] == 1, s["listings"]
    said = f"{names([VERSIONS - 1])[0]} left the store: its manifest {newest} is gone"
    assert said in "\n".join(s["listings"]["events"]), s["listings"]
    assert said in m.log(), m.log()
