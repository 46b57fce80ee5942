"""End-to-end tests of dtefs on a long delta chain: materialized snapshots
bound the records decoded per block, survive a remount and gc, never serve
wrong bytes when damaged; and the mount's kernel readahead is set.

The chain is a dte-gen sequence (an 8 MiB model, AdamW steps changing about
1.5% of the elements each) committed as one anchor and CHAIN deltas.
"""

import filecmp
import json
import os

import pytest

from dtectl_util import Dtectl
import fs_util
from wait_util import wait_for

CHAIN = 40  # deltas after the anchor v0
EXTRA = 4  # further steps generated for commits while mounted
SNAPSHOT_WAIT = 60.0


@pytest.fixture(scope="session")
def chain_ckpts(tmp_path_factory):
    """dte-gen steps 0..CHAIN+EXTRA."""
    return fs_util.generate(tmp_path_factory.mktemp("chaingen"), "8MiB", CHAIN + EXTRA)


@pytest.fixture(scope="session")
def chain_store(tmp_path_factory, chain_ckpts):
    """A store of v0 (anchor) .. vCHAIN (deltas), without join tables (the
    chain is what these tests bound). Copy it before writing."""
    root = tmp_path_factory.mktemp("chain")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", chain_ckpts(0))
    for step in range(1, CHAIN + 1):
        assert d.commit(chain_ckpts(step), "--join-budget", 0) == step
    assert all(v["parent"] == v["version"] - 1 for v in d.log()[1:])
    return d


def snapshot_dir(store, cache):
    with open(os.path.join(store, "dte-store.json")) as f:
        return os.path.join(cache, json.load(f)["store_id"], "snapshots")


def snapshot_files(m):
    d = snapshot_dir(m.store, m.cache)
    return sorted(f for f in os.listdir(d) if f.endswith(".snap")) if os.path.isdir(d) else []


def wait_snapshots(m, versions):
    """Waits until exactly `versions` have snapshots and none is being built."""
    def done():
        s = m.status()["snapshots"]
        return s["versions"] == versions and s["building"] is None
    wait_for(done, SNAPSHOT_WAIT, f"snapshots of {versions}: {m.status()['snapshots']}", 0.1)
    assert [f.split(".")[0] for f in snapshot_files(m)] == [f"v{v:08d}" for v in versions]


def read_version(m, ckpt_dir, version):
    """cmp every file of a version; returns the status counter deltas of it."""
    before = m.status()
    d = os.path.join(m.path, f"v{version:08d}")
    assert sorted(os.listdir(d)) == sorted(os.listdir(ckpt_dir))
    for f in os.listdir(ckpt_dir):
        assert filecmp.cmp(os.path.join(d, f), os.path.join(ckpt_dir, f), shallow=False), (d, f)
    after = m.status()
    keys = ("blocks_decoded", "records_decoded", "snapshot_block_reads", "hash_failures")
    return {k: after[k] - before[k] for k in keys}


def full_block_offset(ckpt_dir, block=256 * 1024):
    """Offset in a snapshot of the first full block (the first block of the
    first tensor of at least one block); the checkpoint has one shard."""
    shards = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
    assert len(shards) == 1, shards
    with open(os.path.join(ckpt_dir, shards[0]), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensors = sorted((e["data_offsets"] for n, e in header.items() if n != "__metadata__"))
    record = 0
    for begin, end in tensors:
        if end - begin >= block:
            return record * block
        record += -(-(end - begin) // block)
    raise AssertionError("no tensor of a full block")


def steps_per_block(delta):
    """Records decoded plus snapshot blocks used, per block."""
    assert delta["blocks_decoded"] > 0
    return (delta["records_decoded"] + delta["snapshot_block_reads"]) / delta["blocks_decoded"]


# --- snapshots -----------------------------------------------------------------------

def test_snapshots_bound_the_records_decoded_per_block(chain_store, chain_ckpts, mount):
    m = mount(chain_store.store, "--snapshot-every", 8)
    wait_snapshots(m, [8, 16, 24, 32, 40])
    for v in (CHAIN, 32, 8):  # a snapshot's own version reads only the snapshot
        delta = read_version(m, chain_ckpts(v), v)
        assert delta["records_decoded"] == 0, (v, delta)
        assert delta["snapshot_block_reads"] == delta["blocks_decoded"], (v, delta)
    for v in (CHAIN - 1, 33, 7, 1):  # at most 7 sparse records plus the snapshot or anchor
        delta = read_version(m, chain_ckpts(v), v)
        assert steps_per_block(delta) <= 8, (v, delta)
        assert delta["hash_failures"] == 0
    status = m.status()
    assert status["records_decoded"] <= 8 * status["blocks_decoded"]
    assert status["snapshots"]["hash_failures"] == 0 and status["errors"] == []


def test_without_snapshots_the_chain_is_walked_to_the_anchor(chain_store, chain_ckpts, mount):
    m = mount(chain_store.store, "--snapshot-every", 0)
    delta = read_version(m, chain_ckpts(CHAIN), CHAIN)
    assert delta["snapshot_block_reads"] == 0
    assert steps_per_block(delta) > 20, delta  # mostly sparse records all the way to v0
    assert m.status()["snapshots"] is None


def test_snapshots_are_reused_after_a_remount(chain_store, chain_ckpts, mount, tmp_path):
    cache = tmp_path / "shared-cache"
    m = mount(chain_store.store, "-o", "snapshot_every=10,snapshots=8", cache=cache)
    wait_snapshots(m, [10, 20, 30, 40])
    files = snapshot_files(m)
    m.unmount()
    m = mount(chain_store.store, "-o", "snapshot_every=10", cache=cache)
    wait_snapshots(m, [10, 20, 30, 40])
    assert m.status()["snapshots"]["built"] == 0
    assert snapshot_files(m) == files
    delta = read_version(m, chain_ckpts(CHAIN - 5), CHAIN - 5)
    assert steps_per_block(delta) <= 10, delta


def test_keep_limit_drops_the_oldest_and_new_versions_get_snapshots(chain_store, chain_ckpts,
                                                                    mount, tmp_path):
    dte = chain_store.copy_to(tmp_path / "live")
    m = mount(dte.store, "--snapshot-every", 4, "--snapshots", 3, "--poll-ms", 200)
    wait_snapshots(m, [32, 36, 40])
    for step in range(CHAIN + 1, CHAIN + EXTRA + 1):
        assert dte.commit(chain_ckpts(step)) == step
    wait_snapshots(m, [36, 40, 44])
    delta = read_version(m, chain_ckpts(CHAIN + 3), CHAIN + 3)
    assert steps_per_block(delta) <= 4, delta
    assert read_version(m, chain_ckpts(CHAIN + 4), CHAIN + 4)["records_decoded"] == 0


def test_gc_deletes_snapshots_of_removed_versions_and_keeps_rebased_content(
        chain_store, chain_ckpts, mount, tmp_path):
    dte = chain_store.copy_to(tmp_path / "gc")
    m = mount(dte.store, "--snapshot-every", 8, "--poll-ms", 200)
    wait_snapshots(m, [8, 16, 24, 32, 40])
    kept = snapshot_files(m)[-1]
    dte.ok("gc", "--keep-last", 5)  # v36 is rebased into an anchor revision
    wait_snapshots(m, [40])
    assert snapshot_files(m) == [kept]
    assert m.status()["snapshots"]["built"] == 5
    delta = read_version(m, chain_ckpts(CHAIN), CHAIN)
    assert delta["records_decoded"] == 0, delta
    delta = read_version(m, chain_ckpts(CHAIN - 1), CHAIN - 1)
    assert steps_per_block(delta) <= 4, delta  # from the rebased v36


def test_corrupt_snapshot_falls_back_to_the_store_and_is_rebuilt(chain_store, chain_ckpts, mount,
                                                                 tmp_path):
    cache = tmp_path / "cache"
    m = mount(chain_store.store, "--snapshot-every", 20, cache=cache)
    wait_snapshots(m, [20, 40])
    m.unmount()
    path = os.path.join(snapshot_dir(m.store, m.cache), snapshot_files(m)[-1])
    offset = full_block_offset(chain_ckpts(CHAIN)) + 1000
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
    m = mount(chain_store.store, "--snapshot-every", 20, cache=cache)
    delta = read_version(m, chain_ckpts(CHAIN), CHAIN)  # right bytes all the same
    assert delta["hash_failures"] == 0
    status = m.status()
    assert status["snapshots"]["hash_failures"] == 1
    assert "does not match" in status["snapshots"]["last_error"]
    wait_snapshots(m, [20, 40])  # built again
    assert m.status()["snapshots"]["built"] == 1


# --- readahead -----------------------------------------------------------------------

def bdi_readahead(m):
    st = os.stat(m.path)
    with open(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb") as f:
        return int(f.read())


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may set a bdi's read_ahead_kb")
@pytest.mark.parametrize("args,kb", [((), 4096), (("--readahead-kb", 2048), 2048),
                                     (("-o", "readahead_kb=1024"), 1024)])
def test_readahead_is_set_on_the_mount(chain_store, chain_ckpts, mount, args, kb):
    m = mount(chain_store.store, "--snapshot-every", 0, *args)
    # Read at once: a file opened right after the mount must already get
    # the large window (the kernel sends reads of up to 1 MiB, not 128 KiB).
    shard = next(f for f in os.listdir(chain_ckpts(CHAIN)) if f.endswith(".safetensors"))
    path = os.path.join(m.path, f"v{CHAIN:08d}", shard)
    with open(path, "rb") as f:
        size = len(f.read())
    assert bdi_readahead(m) == kb
    status = m.status()
    assert status["readahead_kb"] == kb
    assert status["reads"] <= size // (256 << 10), status["reads"]


def test_readahead_zero_leaves_the_kernel_default(chain_store, mount):
    m = mount(chain_store.store, "--snapshot-every", 0, "--readahead-kb", 0)
    os.listdir(m.path)
    wait_for(lambda: m.status()["readahead_kb"] is not None, 5.0, "readahead_kb in .dte/status")
    assert m.status()["readahead_kb"] == bdi_readahead(m) <= 1024
