"""Same-cluster push from every rank of a sharded trainer (docs/push.md):
two trainer rank processes (tests/py/push_worker.py rank: a distributed
publisher over dte's TCP transport, each rank training the same model with
torch.optim.AdamW and publishing its row half of every tensor) each push
the tensors they own in each version, straight to 1, 2 and 4 receiver
processes in tensor-parallel, fused layouts, which join through rank 0's
address, hold every version bit for bit (checked against the store's
version sharded by plain slicing) and catch up from the store after a
missed push. Faults: a trainer rank stopped with SIGSTOP, then one killed
with kill -9, fail the publish on every rank within the timeout and commit
nothing; receivers keep the version they had, whole, and say which; the
restarted rank joins (a new push address, learnt by the receivers) and the
next publishes push again.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import push_util  # noqa: E402
from wait_util import wait_for  # noqa: E402

import dte  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "push_worker.py")
LAYOUTS = {1: [(1, 0, False)], 2: [(2, 0, True), (2, 1, True)],
           4: [(4, r, True) for r in range(4)]}


class Job(push_util.ReceiverProcs):
    """Trainer rank processes and receiver processes."""

    def __init__(self, tmp, world=2, timeout=4.0, push_timeout=3.0, receivers=0):
        self.tmp, self.world = tmp, world
        self.timeout, self.push_timeout = timeout, push_timeout
        self.receivers = receivers
        self.store = str(tmp / "store")
        self.marks = tmp / "marks"
        self.marks.mkdir()
        push_util.save_checkpoint(tmp / "v0", push_util.TinyGqaLM(seed=3))
        with dte.Publisher(store=self.store) as first:
            assert first.import_checkpoint(str(tmp / "v0")) == 0
        probe = dte.PushGroup("127.0.0.1:0")
        self.address = probe.address
        probe.close()
        self.ranks = [self.spawn(r) for r in range(world)]
        self.rendezvous = 0
        self.procs = {}  # receivers

    def spawn(self, r):
        """Rank r's process, once it has imported torch and dte (it says
        "ready"): the ranks' TCP rendezvous then waits for peers, not for
        their imports (seconds with torch 2.15 on a loaded machine, past
        this job's 3 s transport timeout)."""
        err = open(self.tmp / ("rank%d.err" % r), "a")
        p = subprocess.Popen(
            [sys.executable, WORKER, "rank", "--rank", str(r), "--world", str(self.world),
             "--address", self.address, "--store", self.store, "--steps", "0",
             "--timeout", str(self.timeout), "--push-timeout", str(self.push_timeout),
             "--receivers", str(self.receivers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        ready, _, _ = select.select([p.stdout], [], [], 120)
        line = p.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise AssertionError("trainer rank %d did not start: %r %s"
                                 % (r, line, (self.tmp / ("rank%d.err" % r)).read_text()[-3000:]))
        return p

    def send(self, r, line):
        self.ranks[r].stdin.write(line + "\n")
        self.ranks[r].stdin.flush()

    def read(self, r, timeout=60):
        p = self.ranks[r]
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""
        if not line:
            err = (self.tmp / ("rank%d.err" % r)).read_text()
            raise AssertionError("trainer rank %d said nothing: %s" % (r, err[-3000:]))
        return line.rstrip("\n")

    def open(self, ranks=None):
        self.rendezvous += 1
        d = self.tmp / ("rendezvous%d" % self.rendezvous)
        d.mkdir()
        ranks = range(self.world) if ranks is None else ranks
        for r in ranks:
            self.send(r, "open %s" % d)
        for r in ranks:
            assert self.read(r) == "opened"

    def step(self, k, ranks=None):
        """Every rank publishes step k: [(version, push) or ("failed", message)]."""
        ranks = range(self.world) if ranks is None else ranks
        for r in ranks:
            self.send(r, "step %d" % k)
        out = []
        for r in ranks:
            word, rest = self.read(r).split(" ", 1)
            if word == "published":
                version, push = rest.split(" ", 1)
                out.append((int(version), json.loads(push)))
            else:
                out.append(("failed", rest))
        return out

    def start_receiver(self, tp, rank, fused, steps):
        return self.start_one(self.address, tp, rank, fused, steps)

    def close(self):
        for p in list(self.procs.values()) + self.ranks:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def job(tmp_path):
    jobs = []

    def make(**kw):
        j = Job(tmp_path, **kw)
        jobs.append(j)
        return j
    yield make
    for j in jobs:
        j.close()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_rank_pushes_what_it_owns_and_receivers_hold_each_version(job, n):
    steps = 3
    j = job(receivers=n)
    j.open()
    # Receivers join before the first publish: rank 0 names the other rank.
    for tp, rank, fused in LAYOUTS[n]:
        j.start_receiver(tp, rank, fused, steps)
    j.await_marks(0)
    for k in range(1, steps + 1):
        out = j.step(k)
        assert [v for v, _ in out] == [k] * j.world, out
        elements = []
        for r, (_, push) in enumerate(out):
            assert push["pushed"] == n and push["dropped"] == [], (r, push)
            assert push["missing"] == 0, (r, push)
            elements.append(push["elements"])
        # Each rank sent the part it owns: both parts carry changes.
        assert all(e > 0 for e in elements), elements
        j.await_marks(k)
    for tag, res in j.results().items():
        assert res["checked"] == [[0, "catch-up"]] + [[v, "push"] for v in range(1, steps + 1)]
        st = res["status"]
        assert st["pushes"] == steps and st["version"] == steps and st["connected"], st


def test_a_stopped_or_killed_trainer_rank_leaves_receivers_whole_and_the_restart_pushes(job):
    j = job(timeout=3.0, push_timeout=3.0)
    j.open()
    for tp, rank, fused in LAYOUTS[2]:
        j.start_receiver(tp, rank, fused, 5)
    j.await_marks(0)
    out = j.step(1)
    assert all(v == 1 and p["pushed"] == 2 for v, p in out), out
    j.await_marks(1)

    # Rank 1 stopped: rank 0's publish of step 2 fails within the timeout,
    # naming rank 1; nothing is committed or pushed.
    os.kill(j.ranks[1].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        (r0,) = j.step(2, ranks=[0])
        took = time.monotonic() - t0
    finally:
        os.kill(j.ranks[1].pid, signal.SIGCONT)
    assert r0[0] == "failed" and "rank 1" in r0[1], r0
    assert took < 20, took
    (r1,) = j.step(2, ranks=[1])  # rank 1, woken, finds its peer gone
    assert r1[0] == "failed", r1
    with dte.StoreReader(j.store) as reader:
        assert reader.latest() == 1
    for tag in j.procs:
        assert not (j.marks / ("%s-2" % tag)).exists()
    # The job retries the step on a fresh rendezvous: the push goes out.
    j.open()
    out = j.step(2)
    assert all(v == 2 and p["pushed"] == 2 for v, p in out), out
    j.await_marks(2)

    # Rank 1 killed: the publish of step 3 fails on rank 0; receivers keep v2.
    j.ranks[1].kill()
    j.ranks[1].wait()
    (r0,) = j.step(3, ranks=[0])
    assert r0[0] == "failed", r0
    with dte.StoreReader(j.store) as reader:
        assert reader.latest() == 2
    # Restarted (its push server on a new port), it replays the steps it
    # missed and the job goes on: rank 0 names the new sender to receivers.
    j.ranks[1] = j.spawn(1)
    j.open()
    for k in (3, 4, 5):
        out = j.step(k)
        assert [v for v, _ in out] == [k, k], out
        for v, push in out:
            assert push["dropped"] == [] or k == 3, push
        j.await_marks(k)
    for tag, res in j.results().items():
        checked = res["checked"]
        assert checked[:3] == [[0, "catch-up"], [1, "push"], [2, "push"]], (tag, checked)
        # After the restart: v3 by push, or from the store when the receiver
        # was still reconnecting to the new rank; then pushes again.
        assert [v for v, _ in checked[3:]] == [3, 4, 5], (tag, checked)
        assert checked[-1] == [5, "push"], (tag, checked)
        assert res["status"]["version"] == 5 and not res["status"]["inconsistent"]
