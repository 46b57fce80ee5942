"""End-to-end tests of long runs: the anchor policy on `dtectl commit` and
`import`, snapshots left by commits and shown by `dtectl cache`, and a fresh
dtefs mount that reads `latest` from the nearest full table and lists many
versions without loading them.

The run is a dte-gen sequence (a 4 MiB model, AdamW steps changing about
1.5% of the elements each) committed with `--anchor-every 4`.
"""

import json
import os
import shutil

import pytest

import fs_util
import store_util
from dtectl_util import Dtectl

STEPS = 13  # versions 0..STEPS
EVERY = 4


@pytest.fixture(scope="session")
def run_ckpts(tmp_path_factory):
    return fs_util.generate(tmp_path_factory.mktemp("longgen"), "4MiB", STEPS)


@pytest.fixture(scope="session")
def run_store(tmp_path_factory, run_ckpts):
    """v0 imported, v1..vSTEPS committed with --anchor-every EVERY, each leaving
    its snapshot (--snapshot-every 1). Copy before writing."""
    root = tmp_path_factory.mktemp("longrun")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", run_ckpts(0))
    d.results = {}
    for step in range(1, STEPS + 1):
        r = json.loads(d.ok("commit", run_ckpts(step), "--anchor-every", EVERY,
                            "--snapshot-every", 1, "--json").stdout)
        assert r["version"] == step
        d.results[step] = r
    return d


def manifests(store):
    return {v: m for v, (_, m) in store_util.manifests(store).items()}


def test_every_nth_version_is_a_policy_anchor_that_keeps_its_delta(run_store, run_ckpts,
                                                                   tmp_path):
    ms = manifests(run_store.store)
    for step in range(1, STEPS + 1):
        m, r = ms[step], run_store.results[step]
        policy = step % EVERY == 0
        assert ("full" in m) == policy, step
        assert r["full_table"] == policy and (r["full_bytes"] > 0) == policy, r
        # A policy anchor is still a delta of its parent (followers read one record).
        assert (m["kind"], m["parent"]) == ("delta", step - 1)
        assert m["since_full"]["versions"] == step % EVERY, (step, m["since_full"])
        if policy:
            assert r["anchor_reason"], r
            # zstd on BF16 weights: the full table is smaller than the data.
            full = sum(b["size"] for b in m["full"]["blobs"])
            assert full < m["stats"]["dense_bytes"], (full, m["stats"]["dense_bytes"])
            assert m["stats"]["stored_bytes"] >= full
        else:
            assert r["anchor_reason"] == ""
    # Every version exports byte-identical from a host with an empty cache,
    # and verify checks the full tables on their own.
    fresh = Dtectl(run_store.store, tmp_path / "fresh-cache")
    for step in (STEPS, STEPS - 1, EVERY * 2, 1):
        store_util.same_tree(fresh.export(step, tmp_path / f"out{step}"), run_ckpts(step))
    assert json.loads(fresh.ok("verify", "--json").stdout)["ok"]


def test_commits_read_the_parent_from_its_snapshot_and_cache_shows_them(run_store, tmp_path):
    for step in range(2, STEPS + 1):
        r = run_store.results[step]
        assert r["parent_snapshot_blocks"] > 0, r  # the previous commit left it
        assert r["snapshot"].endswith(".snap"), r
    d = run_store.copy_to(tmp_path / "copy")
    shutil.copytree(run_store.cache, d.cache)  # same store id: the snapshots apply
    shown = json.loads(d.ok("cache", "--json").stdout)
    # The newest three (the default --keep-snapshots) survive the commits.
    assert shown["snapshots"]["versions"] == [STEPS - 2, STEPS - 1, STEPS], shown
    assert shown["snapshots"]["count"] == 3 and shown["snapshots"]["bytes"] > 0
    assert shown["free_bytes"] > shown["reserve_bytes"] > 0
    dropped = json.loads(d.ok("cache", "--keep-snapshots", 1, "--json").stdout)
    assert dropped["dropped"] == [STEPS - 2, STEPS - 1], dropped
    assert dropped["snapshots"]["versions"] == [STEPS]


def test_import_and_commit_refuse_bad_policy_options(run_store, run_ckpts, tmp_path):
    d = run_store.copy_to(tmp_path / "copy")
    before = store_util.snapshot(d.store)
    for args in (("--anchor-budget", "-1"), ("--anchor-budget", "nan"), ("--anchor-every", "-2"),
                 ("--anchor-every", "x"), ("--keep-snapshots", "-1")):
        r = d.run("commit", run_ckpts(1), *args)
        assert r.returncode != 0, args
        assert args[0] in r.stderr, (args, r.stderr)
    r = d.run("cache", "--keep-snapshots", "-3")
    assert r.returncode != 0 and "--keep-snapshots" in r.stderr, r.stderr
    assert store_util.snapshot(d.store) == before


def test_fresh_mount_reads_latest_from_the_nearest_full_table(run_store, run_ckpts, tmp_path):
    with fs_util.mounts(tmp_path) as start:
        # No snapshots, empty cache: what a host that joins late does first.
        m = start(run_store.store, "--snapshot-every", 0, cache=str(tmp_path / "empty"))
        latest = os.path.join(m.path, "latest")
        for name in os.listdir(run_ckpts(STEPS)):
            with open(os.path.join(latest, name), "rb") as f:
                got = f.read()
            with open(os.path.join(run_ckpts(STEPS), name), "rb") as f:
                assert got == f.read(), name
        s = m.status()
        # vSTEPS is STEPS % EVERY versions past the full table of its
        # nearest policy anchor: at most that many sparse records plus the
        # full record per block, never the walk back to v0.
        per_block = s["records_decoded"] / s["blocks_decoded"]
        assert 1 <= per_block <= STEPS % EVERY + 1, s
        assert s["versions"] == list(range(STEPS + 1))


def test_a_mount_lists_many_versions_without_loading_them(run_ckpts, tmp_path):
    """200 versions of one checkpoint (empty deltas): listing the root and
    reading latest load only what they need, and .dte/status stays whole."""
    d = Dtectl(tmp_path / "store", tmp_path / "cache")
    d.ok("import", run_ckpts(0))
    for v in range(1, 200):
        d.ok("commit", run_ckpts(0), "--keep-snapshots", 0)
    with fs_util.mounts(tmp_path) as start:
        m = start(d.store, "--snapshot-every", 0, cache=str(tmp_path / "mcache"))
        names = sorted(n for n in os.listdir(m.path) if n.startswith("v"))
        assert names == [f"v{v:08d}" for v in range(200)]
        assert os.readlink(os.path.join(m.path, "latest")) == "v00000199"
        assert sorted(os.listdir(os.path.join(m.path, "v00000007"))) == \
            sorted(os.listdir(run_ckpts(0)))
        assert m.status()["latest"] == 199


@pytest.mark.parametrize("budget", ["1.0", "0.01"])
def test_thinned_history_rebases_onto_kept_versions_with_full_tables_past_the_budget(
        run_store, run_ckpts, tmp_path, budget):
    """gc --keep-every: kept versions whose parent goes become deltas of the
    previous kept one, and such a delta also gets a full table where a
    commit onto the same parent would (the byte budget), so reading a long
    thinned history stays bounded."""
    d = run_store.copy_to(tmp_path / "copy")
    r = json.loads(d.ok("gc", "--keep-last", 2, "--keep-every", 3, "--anchor-budget", budget,
                        "--grace-seconds", 0, "--json").stdout)
    kept = [0, 3, 6, 9, 12, 13]
    assert d.versions() == kept, r
    ms = manifests(d.store)
    assert (ms[3]["parent"], ms[6]["parent"], ms[9]["parent"]) == (0, 3, 6)
    assert ms[12]["kind"] == "anchor"  # a policy anchor whose parent went: its full table
    # v3 follows v0 (an anchor): nothing to bound. v6 follows v3, whose delta
    # passes 1% of the dense size but not 100% of it.
    assert "full" not in ms[3] and "full" not in ms[9]
    assert ("full" in ms[6]) == (budget == "0.01"), ms[6].get("since_full")
    assert ms[9]["since_full"]["versions"] == (1 if budget == "0.01" else 3)
    for v in kept:
        store_util.same_tree(d.export(v, tmp_path / f"out{v}"), run_ckpts(v))
    assert json.loads(d.ok("verify", "--json").stdout)["ok"]
    assert set(store_util.blobs(d.store)) == store_util.all_reachable_blobs(d.store)


def test_fresh_mount_reads_latest_from_the_newest_join_table(run_ckpts, tmp_path):
    """Join tables (--join-budget): a full copy of a recent version kept
    outside its manifest, the newest two only. A mount with an empty cache
    reads latest from the newest one plus the deltas since, and the same
    store without them walks back to the anchor."""
    d = Dtectl(tmp_path / "store", tmp_path / "cache")
    d.ok("import", run_ckpts(0))
    joins = []
    for step in range(1, STEPS + 1):
        r = json.loads(d.ok("commit", run_ckpts(step), "--anchor-budget", 0, "--join-budget",
                            "0.015", "--json").stdout)
        assert not r["full_table"] and r["join_error"] == "", r
        if r["join_table"]:
            assert "join budget" in r["join_reason"] and r["join_bytes"] > 0, r
            joins.append(step)
    assert len(joins) >= 3, joins
    listed = sorted(os.listdir(tmp_path / "store" / "joins"))
    assert listed == ["v%08d.json" % v for v in joins[-2:]]
    for step, m in manifests(d.store).items():
        assert "full" not in m, step  # the manifests do not know about them

    def read_latest(cache):
        with fs_util.mounts(tmp_path) as start:
            m = start(d.store, "--snapshot-every", 0, cache=str(tmp_path / cache))
            for name in os.listdir(run_ckpts(STEPS)):
                with open(os.path.join(m.path, "latest", name), "rb") as f:
                    got = f.read()
                with open(os.path.join(run_ckpts(STEPS), name), "rb") as f:
                    assert got == f.read(), name
            return m.status()

    s = read_latest("empty")
    assert s["join_block_reads"] == s["blocks_decoded"], s
    assert s["records_decoded"] / s["blocks_decoded"] <= STEPS - joins[-1] + 1, s
    shutil.rmtree(tmp_path / "store" / "joins")
    s = read_latest("empty2")
    assert s["join_block_reads"] == 0, s
    assert s["records_decoded"] / s["blocks_decoded"] > STEPS - joins[-1] + 1, s
