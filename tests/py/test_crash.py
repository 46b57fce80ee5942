"""SIGKILL dtectl commit and gc at random moments: the store must stay whole.

After every kill the store verifies clean, shows the old state or the
complete new version (never a partial one), and the interrupted command
can simply be run again.
"""

import os
import random
import shutil
import signal
import subprocess

import pytest

import store_util
from crash_util import RunLength, fractions, timed_run
from ckpt_util import CheckpointSequence
from dtectl_util import CONFLICT, OK, Dtectl

KILLS = 24  # commit kills; gc gets KILLS // 2
SEED = int(os.environ.get("DTE_CRASH_SEED", "1234"))


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Two steps of a ~40 MiB model, so a commit takes a few hundred ms."""
    seq = CheckpointSequence(tmp_path_factory.mktemp("big"), hidden=1024, intermediate=2816,
                             layers=1, vocab=4096)
    seq.dir(1)
    return seq


def copy_store(base, root, env):
    """dtectl on a copy of base's store that shares its files (objects are only
    ever replaced by rename or removed by unlink, so hard links are as good as
    copies), with a cache of its own."""
    shutil.copytree(base.store, root / "store", copy_function=os.link)
    return Dtectl(root / "store", root / "cache", env)


def kill_on_manifest_change(argv, env, manifests, n):
    """Starts argv and SIGKILLs it as soon as the n-th change of the manifests
    directory is seen; returns True if it was still running."""
    seen = set(os.listdir(manifests))
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while p.poll() is None and n > 0:
        now = set(os.listdir(manifests))
        if now != seen:
            n -= 1
            seen = now
    if n == 0:
        p.send_signal(signal.SIGKILL)
    return p.wait() == -signal.SIGKILL


def snapshot_temps(dte):
    """Temporary snapshot files in dte's cache (a writer's, or a dead one's)."""
    found = []
    for root, _, files in os.walk(dte.cache):
        found += [os.path.join(root, f) for f in files if f.startswith(".tmp.")]
    return found


def listing(path):
    """Sorted names in a directory; [] if it does not exist."""
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def assert_no_garbage_after_gc(dte):
    """Once gc has run with no grace window, only reachable blobs remain."""
    dte.ok("gc", "--keep-last", 1000, "--grace-seconds", 0)
    assert set(store_util.blobs(dte.store)) == store_util.all_reachable_blobs(dte.store)


@pytest.mark.parametrize("kind", ["delta", "policy-anchor", "join-table"])
def test_commit_killed_at_random_moments(big, tmp_path, kind):
    """A policy anchor also writes a full table (--anchor-every 1), a join
    table commit (v2 onto v1) a join table after its manifest and prunes;
    both try fewer moments. Every commit also writes its snapshot into the
    cache (--snapshot-every 1), so kills land while a snapshot is being
    written too: the next command must clear its temporary file and the
    retry must commit right."""
    policy_anchor, join = kind == "policy-anchor", kind == "join-table"
    rng = random.Random(SEED + policy_anchor + 2 * join)
    base = Dtectl(tmp_path / "base", tmp_path / "base-cache")
    base.ok("import", big.dir(0))
    target = 1
    if join:  # a join table needs a delta before it
        base.ok("commit", big.dir(1), "--join-budget", 0)
        target = 2
    before = list(range(target))
    env = dict(base.env, DTE_THREADS="1")
    extra = (("--anchor-every", 1) if policy_anchor else
             ("--anchor-budget", 0, "--join-budget", "1e-9") if join else ())
    extra += ("--snapshot-every", 1)
    kills = KILLS if kind == "delta" else KILLS // 2
    version = ("--version", target)

    probes = [copy_store(base, tmp_path / f"probe{i}", env) for i in range(3)]
    # The median of three: one probe slowed by a busy machine must not
    # spread the kills past the end of a typical run.
    length = RunLength(
        [timed_run(p.argv("commit", big.dir(target), *version, *extra), env) for p in probes])
    assert all(p.versions() == before + [target] for p in probes)
    if join:
        assert all(os.listdir(os.path.join(p.store, "joins")) == ["v00000002.json"]
                   for p in probes)
    # Random moments; right after the manifest appears (before the index
    # hears of it); and once not at all, so the landed path always runs.
    trials = [("after", f) for f in fractions(kills, rng)]
    trials += [("change", 1), ("change", 1), ("after", None)]
    killed = landed = 0
    retry_problems = []
    for i, (how, when) in enumerate(trials):
        dte = copy_store(base, tmp_path / f"t{i}", env)
        argv = dte.argv("commit", big.dir(target), *version, *extra)
        if how == "after":
            moment = length.at(when)
            killed += length.kill(argv, env, when)
            when = "never killed" if when is None else f"killed after {moment:.3f}s"
        else:
            killed += kill_on_manifest_change(argv, env, os.path.join(dte.store, "manifests"), 1)
            when = "killed when its manifest appeared"
        context = f"trial {i}, {when}, of a {length.seconds:.3f}s commit"
        r = dte.run("verify")
        assert r.returncode == OK, f"{context}: {r.stderr}"
        log = dte.log()
        assert [v["version"] for v in log] in (before, before + [target]), context
        joins = os.path.join(dte.store, "joins")
        if len(log) == target + 1:
            landed += 1
            assert (log[-1]["kind"], log[-1]["parent"]) == ("delta", target - 1), context
            assert ("full" in store_util.manifests(dte.store)[target][1]) == policy_anchor, context
            # The join object comes after the manifest: a kill in between
            # leaves the version without one.
            assert listing(joins) in (([], ["v00000002.json"]) if join else ([],)), context
            store_util.same_tree(dte.export(target, tmp_path / f"t{i}" / "out"), big.dir(target))
            # Retrying a commit that landed is a version conflict. Collected, not
            # asserted here, so that every crash trial still runs.
            r = dte.run("commit", big.dir(target), *version)
            if r.returncode != CONFLICT or f"version {target} " not in r.stderr:
                retry_problems.append(f"{context}: exit {r.returncode}: {r.stderr.strip()}")
        else:
            assert listing(joins) == [], context
            r = dte.run("commit", big.dir(target), *version, *extra)
            assert r.stdout == f"{target}\n", context
            assert dte.ok("verify", "--version", target)
            assert not snapshot_temps(dte), context  # the dead commit's, cleared
            if join:
                assert listing(joins) == ["v00000002.json"], context
        assert dte.versions() == before + [target], context
        if i % 4 == 0:
            assert_no_garbage_after_gc(dte)
        shutil.rmtree(tmp_path / f"t{i}")
    print(f"commit {length.seconds:.3f}s: {killed} of {len(trials)} killed while running, "
          f"{landed} landed")
    # The kills must have landed inside commits, on both sides of the manifest write.
    assert killed >= kills // 2, (killed, length.seconds)
    # At least a quarter of the random kills came before the manifest (for the
    # 24 kills of a plain commit: 6, as always; the 12 of the others: 3).
    assert 3 <= landed <= len(trials) - kills // 4, (landed, length.seconds)
    assert not retry_problems, "\n".join(retry_problems)


# Checkpoint steps committed as v0..v3, gc's options, the (version, parent)
# pairs it keeps, and how many changes of the manifests directory it makes.
GC_CASES = {
    # v2 and v3 revisit earlier weights (still deltas); v2 is rebased to an
    # anchor: its new revision, then v0, v1 and v2's old revision go.
    "keep-last": ((0, 1, 0, 1), ("--keep-last", 2), [(2, None), (3, 2)], 4),
    # v1 goes; v2 is rebased as a delta of v0: its new revision, then v1 and
    # v2's old revision go.
    "keep-every": ((0, 1, 2, 1), ("--keep-last", 1, "--keep-every", 2),
                   [(0, None), (2, 0), (3, 2)], 3),
}


@pytest.mark.parametrize("case", GC_CASES)
def test_gc_killed_at_random_moments(big, tmp_path, case):
    steps, keep_args, kept, changes = GC_CASES[case]
    rng = random.Random(SEED + 1 + list(GC_CASES).index(case))
    base = Dtectl(tmp_path / "base", tmp_path / "base-cache")
    base.ok("import", big.dir(steps[0]))
    for s in steps[1:]:
        base.ok("commit", big.dir(s))
    env = dict(base.env, DTE_THREADS="1")

    gc_args = ("gc", *keep_args, "--grace-seconds", 0)
    kept_versions = [v for v, _ in kept]
    probes = [copy_store(base, tmp_path / f"probe{i}", env) for i in range(3)]
    length = RunLength([timed_run(p.argv(*gc_args), env) for p in probes])
    assert all(p.versions() == kept_versions for p in probes)
    # Random moments, then the moments right after each of gc's manifest
    # changes (rebased revision written, old manifests deleted one by one),
    # where the order of its steps shows.
    trials = [("after", f) for f in fractions(KILLS // 2, rng)]
    trials += [("change", n) for n in range(1, changes + 1) for _ in range(2)]
    killed = 0
    broken = []  # stores left failing verify; collected so that recovery is still checked
    for i, (how, when) in enumerate(trials):
        dte = copy_store(base, tmp_path / f"g{i}", env)
        if how == "after":
            moment = length.at(when)
            killed += length.kill(dte.argv(*gc_args), env, when)
            context = f"trial {i}, killed after {moment:.3f}s of a {length.seconds:.3f}s gc"
        else:
            manifests = os.path.join(dte.store, "manifests")
            killed += kill_on_manifest_change(dte.argv(*gc_args), env, manifests, when)
            context = f"trial {i}, killed at manifest change {when}"
        versions = dte.versions()
        assert set(kept_versions) <= set(versions) <= {0, 1, 2, 3}, (context, versions)
        # What gc keeps is whole at every moment ...
        r = dte.run("verify", "--version", 3)
        assert r.returncode == OK, f"{context}: {r.stderr}"
        # ... and so is everything else the store still lists.
        r = dte.run("verify")
        if r.returncode != OK:
            problems = sorted(set(r.stderr.strip().splitlines()))
            broken.append(f"{context}: versions {versions}: " + " | ".join(problems))
        # Running gc again finishes the job.
        dte.ok(*gc_args)
        assert [(v["version"], v["parent"]) for v in dte.log()] == kept, context
        for v in kept_versions if i % 3 == 0 else ():  # verify below checks every tensor hash
            out = tmp_path / f"g{i}" / f"out{v}"
            store_util.same_tree(dte.export(v, out), big.dir(steps[v]))
            shutil.rmtree(out)
        reachable = store_util.all_reachable_blobs(dte.store)
        assert set(store_util.blobs(dte.store)) == reachable, context
        assert dte.ok("verify")
        shutil.rmtree(tmp_path / f"g{i}")
    print(f"gc {case} {length.seconds:.3f}s: {killed} of {len(trials)} killed while running, "
          f"{len(broken)} left broken")
    assert killed >= len(trials) // 2, (killed, length.seconds)
    assert not broken, "a killed gc left versions that do not verify:\n" + "\n".join(broken)
