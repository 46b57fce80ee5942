"""Servers whose ranks register on several dtefs mounts (docs/live.md,
"Servers on several hosts"): two real mounts, each of its own copy of the
store (two hosts), a server of 2 TP ranks with rank 0 registered on one and
rank 1 on the other, each rank its own process (test_fs_live's Receivers).
dte.apply_servers moves them by the two phases. After every step a watcher
reads both ranks' buffers and finds which committed version each holds,
element for element: the ranks hold one version, the one both mounts
report, except after a coordinator killed between its commits, which
dte.live_servers reports as inconsistent until an apply makes it whole.
Each fault at its point: a server lacking a rank on the mounts given, a
rank whose memory goes away (its commit fails and is written back), a rank
that leaves between prepare and commit, the coordinator killed after
preparing and between commits."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from test_fs_live import (PY_PATH, STEPS, Receivers, apply, dtectl, gen, live_store,  # noqa: F401
                          load_raw, shard)
from wait_util import wait_for

sys.path.insert(0, PY_PATH)
import dte  # noqa: E402

SERVER = "rollout-7"
TP = 2

COORDINATOR = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import dte
a, b, version, when = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
pa, pb = dte.prepare_apply(a, version), dte.prepare_apply(b, version)
print("prepared", flush=True)
if when == "after-first-commit":
    pa.commit()
os.kill(os.getpid(), signal.SIGKILL)
"""


class Fleet:
    """Two mounts of copies of one store, rank 0 of the server on the first
    and rank 1 on the second, and the watcher."""

    def __init__(self, mount, tmp_path, store, version):
        self.mounts, self.paths = [], []
        for h in "ab":
            copy = tmp_path / ("store-" + h)
            subprocess.run(["cp", "-a", str(store), str(copy)], check=True)
            m = mount(copy, "--live-version", version)
            self.mounts.append(m)
            self.paths.append(m.path)
        self.states = {v: load_raw(os.path.join(self.paths[0], "v%08d" % v, "model.safetensors"))
                       for v in range(STEPS + 1)}
        self.ranks = []
        try:
            for rank, path in enumerate(self.paths):
                self.ranks.append(Receivers(path, self.states[version], TP, version,
                                            ranks=[rank], server=SERVER))
        except BaseException:
            self.close()
            raise

    def holds(self, rank):
        """The committed version rank `rank`'s buffers equal, or None."""
        w = self.ranks[rank].weights[0]
        for v in sorted(self.states, reverse=True):
            if all(np.array_equal(w.array(k), a)
                   for k, a in shard(self.states[v], TP, rank).items()):
                return v
        return None

    def watch(self, want=None):
        """Both ranks hold one committed version (`want`, when given), the
        one both mounts report; returns it."""
        held = [self.holds(r) for r in range(TP)]
        spans = dte.live_servers(self.paths)
        assert len(spans) == 1 and spans[0].complete, spans
        assert held[0] is not None and held == [held[0]] * TP, held
        assert not spans[0].inconsistent and spans[0].version == held[0], (held, spans)
        assert want is None or held[0] == want, (held, want)
        return held[0]

    def close(self):
        for r in self.ranks:
            r.close()


@pytest.fixture
def fleet(mount, tmp_path, live_store):
    f = Fleet(mount, tmp_path, live_store.store, 1)
    yield f
    f.close()


def test_a_server_over_two_mounts_moves_forward_and_back_together(fleet):
    # A mount alone sees half the server and refuses a one-phase apply.
    r = dtectl("apply", fleet.paths[0], "--version", 3, check=False)
    assert r.returncode != 0 and 'server "rollout-7" is incomplete on this mount' in r.stderr
    fleet.watch(1)
    spans = dte.live_servers(fleet.paths)
    assert [(s.name, s.size, s.ranks, s.mounts) for s in spans] == [
        (SERVER, TP, (0, 1), {fleet.paths[0]: (0,), fleet.paths[1]: (1,)})], spans
    for target in (3, 2, 4, 0):  # forward, a rollback, forward, back to the anchor
        counts = dte.apply_servers(fleet.paths, target)
        assert sorted(counts) == sorted(fleet.paths)
        assert all(c.to_version == target and c.receivers == 1 for c in counts.values()), counts
        fleet.watch(target)
        for p in fleet.paths:
            st = dte.live_status(p)
            assert st.live_version == target and st.servers[0].version == target
    # None: the newest, the same version on both.
    counts = dte.apply_servers(fleet.paths)
    assert {c.to_version for c in counts.values()} == {STEPS}
    fleet.watch(STEPS)


def test_a_server_lacking_a_rank_on_the_mounts_given_is_refused_and_nothing_written(fleet):
    with pytest.raises(dte.FailedPrecondition,
                       match=r"apply of v00000003 refused, nothing written: server 'rollout-7' "
                             r"lacks ranks \[1\] on these mounts"):
        dte.apply_servers(fleet.paths[:1], 3)
    fleet.watch(1)
    # The prepared apply was aborted: the mount takes the next.
    for p in fleet.paths:
        assert dte.live_status(p).applying is False
    dte.apply_servers(fleet.paths, 3)
    fleet.watch(3)


def test_a_rank_whose_memory_goes_away_fails_the_commit_and_the_server_stays(fleet):
    fleet.watch(1)
    os.truncate(os.path.join("/dev/shm", fleet.ranks[1].weights[0].name), 0)
    with pytest.raises(dte.Aborted, match="apply of v00000003 failed on %s: .* moved back: %s, %s"
                       % (fleet.paths[1], fleet.paths[0], fleet.paths[1])):
        dte.apply_servers(fleet.paths, 3)
    # Rank 0 (committed first) was moved back; rank 1 was written back by
    # its mount and dropped there.
    assert fleet.holds(0) == 1
    assert [dte.live_status(p).live_version for p in fleet.paths] == [1, 1]
    spans = dte.live_servers(fleet.paths)
    assert spans[0].ranks == (0,) and not spans[0].complete, spans
    with pytest.raises(dte.FailedPrecondition, match=r"lacks ranks \[1\]"):
        dte.apply_servers(fleet.paths, 3)
    assert fleet.holds(0) == 1
    # Rank 1 loads again and registers: the server moves on together.
    fleet.ranks[1].close()
    fleet.ranks[1] = Receivers(fleet.paths[1], fleet.states[1], TP, 1, ranks=[1], server=SERVER)
    dte.apply_servers(fleet.paths, 3)
    fleet.watch(3)


def test_a_rank_that_leaves_between_prepare_and_commit_aborts_that_commit(fleet):
    prepared = [dte.prepare_apply(p, 2) for p in fleet.paths]
    assert [[s.ranks for s in p.servers] for p in prepared] == [[(0,)], [(1,)]]
    for p in prepared:
        st = dte.live_status(p.mount)
        assert st.prepared == p.id and st.applying and st.live_version == 1, st
    with pytest.raises(dte.Unavailable, match="apply %d of v00000002 is prepared" % prepared[0].id):
        dte.apply(fleet.paths[0], 3)
    fleet.watch(1)
    fleet.ranks[1].procs[0].stdin.close()  # rank 1 exits: its registration goes
    fleet.ranks[1].procs[0].wait(timeout=30)
    wait_for(lambda: dte.live_servers(fleet.paths)[0].ranks == (0,), 10, "rank 1 to go")
    # The first mount's ranks are unchanged: it commits...
    assert prepared[0].commit().to_version == 2
    with pytest.raises(dte.Aborted, match='server "rollout-7" changed on this mount since the '
                                          r'apply was prepared \(ranks \[1\] of 2 then, none now\)'):
        prepared[1].commit()
    for p in prepared:
        p.close()
    # (apply_servers would have moved it back): the mounts disagree, which
    # live_servers reports once rank 1 is back.
    spans = dte.live_servers(fleet.paths[:1])
    assert spans[0].version == 2
    assert fleet.holds(0) == 2
    fleet.ranks[1].close()
    fleet.ranks[1] = Receivers(fleet.paths[1], fleet.states[1], TP, 1, ranks=[1], server=SERVER)
    assert dte.live_servers(fleet.paths)[0].inconsistent
    dte.apply_servers(fleet.paths, 2)  # made whole: v2 on both
    fleet.watch(2)


@pytest.mark.parametrize("when", ["prepared", "after-first-commit"])
def test_a_coordinator_killed_leaves_the_server_whole_or_reported_and_made_whole(fleet, when):
    p = subprocess.Popen([sys.executable, "-c", COORDINATOR, PY_PATH, fleet.paths[0],
                          fleet.paths[1], "3", when], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "prepared"
    assert p.wait(timeout=60) == -signal.SIGKILL
    # Its control files closed with it: no mount holds a prepared apply.
    for m in fleet.mounts:
        wait_for(lambda: not dte.live_status(m.path).applying, 10, "the prepared apply to go")
        assert m.status()["live"]["prepared"] is None
    if when == "prepared":
        fleet.watch(1)  # nothing was written anywhere
    else:
        assert [fleet.holds(r) for r in range(TP)] == [3, 1]
        spans = dte.live_servers(fleet.paths)
        assert spans[0].inconsistent and spans[0].version is None, spans
        assert spans[0].versions == {fleet.paths[0]: 3, fleet.paths[1]: 1}
    dte.apply_servers(fleet.paths, 3)
    fleet.watch(3)
