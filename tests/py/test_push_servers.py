"""Inference servers on the push path (docs/push.md, "Servers"): servers of
2 and 4 tensor-parallel ranks (fused layout), each rank its own process
(tests/py/push_server_worker.py) in a gloo group with its server's other
ranks, holding its weights in /dev/shm; a trainer process publishing with a
push group. Between the server's batches a watcher reads every rank's
weights and finds which committed version each holds, element for element
(the store's version sliced for the rank by plain slicing,
push_util.local_state): a batch that serves must find every rank at one
committed version, the version the ranks report. Each fault is injected
at each point: a rank stalled past the push timeout, a connection cut
after staging, kill -9 of a rank before, during and after staging, a rank
restarted from an older version, the trainer killed mid-push. A fleet of
receivers without servers, under the same stall, shows the mix the
watcher exists to catch."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import push_util
from prom_util import free_port
from s3_util import TcpRelay
from wait_util import wait_for

import dte

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "push_server_worker.py")
SHAPES = {n: tuple(p.shape) for n, p in push_util.TinyGqaLM().named().items()}


class Trainer:
    """The trainer process: publishes step K on `publish(K)`."""

    def __init__(self, store, address):
        self.store, self.address = store, address
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "trainer", "--address", self.address, "--store",
             self.store, "--timeout", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready", self.proc.stderr.read()

    def publish(self, k):
        """Version and push report of step k."""
        self.proc.stdin.write("step %d\n" % k)
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split(" ", 2)
        assert line[0] == "published", self.proc.stderr.read()
        return int(line[1]), json.loads(line[2])

    def status(self):
        """The push group's status (PushGroup.status, as JSON)."""
        self.proc.stdin.write("status 0\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split(" ", 1)
        assert line[0] == "status", self.proc.stderr.read()
        return json.loads(line[1])

    def send(self, k):
        """Starts step k without waiting for it."""
        self.proc.stdin.write("step %d\n" % k)
        self.proc.stdin.flush()

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0, self.proc.stderr.read()


class Server:
    """An inference server's rank processes, its batches and the watcher."""

    def __init__(self, tmp, store, address, size, independent=False, addresses=None):
        self.ctl = tmp / ("ctl-%d" % size)
        self.ctl.mkdir()
        self.store, self.size, self.independent = store, size, independent
        self.addresses = addresses or {}
        self.address = address
        self.procs = {}
        self.batch = 0
        self.generation = 0
        self.observed = []  # (batch, [each rank's version], serving)
        self.expected = {}
        for r in range(size):
            self.start(r, 0)

    def start(self, rank, version, first_batch=0):
        shm = "dte-servers-%d-%d-r%d" % (os.getpid(), self.size, rank)
        argv = [sys.executable, WORKER, "rank", "--address", self.addresses.get(rank, self.address),
                "--store", self.store, "--ctl", str(self.ctl), "--size", str(self.size),
                "--rank", str(rank), "--shm", shm, "--load-version", str(version),
                "--generation", str(self.generation), "--first-batch", str(first_batch),
                "--timeout", "2"] + (["--independent"] if self.independent else [])
        self.procs[rank] = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)

    def kill(self, rank):
        """kill -9 of a rank; the others form the group's next generation."""
        self.procs[rank].kill()
        self.procs[rank].wait()
        self.generation += 1

    def restart(self, rank, version):
        self.start(rank, version, first_batch=self.batch)

    def run_batch(self, timeout=90, command="batch"):
        """Runs one batch; the watcher then reads every rank's weights."""
        n = self.batch
        self.go(n, command)
        done = self.ctl / ("done-%d" % n)

        def finished():
            for r, p in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError("rank %d exited: %s" % (r, p.stderr.read()))
            return done.exists()
        wait_for(finished, timeout, "batch %d" % n)
        result = json.loads(done.read_text())
        self.batch += 1
        held = [self.holds(r) for r in range(self.size)]
        self.observed.append((n, held, result["serving"]))
        if result["serving"]:
            reported = {r["version"] for r in result["ranks"]}
            assert len(set(held)) == 1 and held[0] is not None, (
                "batch %d serves a mix: the ranks hold %s (they report %s)" % (n, held, result))
            assert reported == {held[0]}, (n, held, result)
        return result, held

    def holds(self, rank):
        """The committed version rank `rank`'s weights equal, or None."""
        with open(self.ctl / ("layout-%d.json" % rank)) as f:
            layout = json.load(f)
        with open(layout["shm"], "rb") as f:
            data = f.read()
        with dte.StoreReader(self.store) as r:
            versions = r.versions()
        for v in reversed(versions):
            want = self.want(rank, v)
            if all(data[off:off + len(want[n])] == want[n]
                   for n, (off, _) in layout["tensors"].items()):
                return v
        return None

    def want(self, rank, version):
        key = (rank, version)
        if key not in self.expected:
            state = push_util.local_state(push_util.read_version(dte, self.store, version, SHAPES),
                                          self.size, rank, True)
            self.expected[key] = {n: t.view(torch.int16).numpy().tobytes()
                                  for n, t in state.items()}
        return self.expected[key]

    def until(self, version, batches=40):
        """Runs batches until every rank serves `version`."""
        for _ in range(batches):
            result, held = self.run_batch()
            if result["serving"] and held == [version] * self.size:
                return result
            time.sleep(0.1)
        raise AssertionError("server not at v%d after %d batches: %s" % (
            version, batches, self.observed[-5:]))

    def go(self, n, command):
        """Hands out batch n: written whole, then renamed, so that rank 0
        never reads a half-written command."""
        tmp = self.ctl / ("go-%d.tmp" % n)
        tmp.write_text(command)
        os.rename(tmp, self.ctl / ("go-%d" % n))

    def stop(self):
        self.go(self.batch, "stop")
        for r, p in self.procs.items():
            try:
                rc = p.wait(60)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)  # the worker dumps every thread's stack
                time.sleep(1)
                p.kill()
                p.wait()
                raise AssertionError("rank %d did not stop within 60 s: %s"
                                     % (r, p.stderr.read()))
            assert rc == 0, "rank %d: %s" % (r, p.stderr.read())
        for r in range(self.size):
            path = "/dev/shm/dte-servers-%d-%d-r%d" % (os.getpid(), self.size, r)
            if os.path.exists(path):
                os.unlink(path)

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for r in range(self.size):
            path = "/dev/shm/dte-servers-%d-%d-r%d" % (os.getpid(), self.size, r)
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture
def job(tmp_path):
    """A store holding v0 and a trainer on a free port; closed at teardown."""
    store = str(tmp_path / "store")
    model = push_util.TinyGqaLM(seed=5)
    push_util.save_checkpoint(str(tmp_path / "ckpt"), model)
    with dte.Publisher(store=store) as pub:
        pub.import_checkpoint(str(tmp_path / "ckpt"))
    address = "127.0.0.1:%d" % free_port()
    made = []

    def make(size, **kw):
        s = Server(tmp_path, store, address, size, **kw)
        made.append(s)
        return s
    trainer = Trainer(store, address)
    yield trainer, make
    for s in made:
        s.close()
    if trainer.proc.poll() is None:
        trainer.kill()


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_stalled_past_the_push_timeout_holds_its_server_back_and_catches_up(job, size):
    trainer, make = job
    server = make(size)
    server.until(0)
    assert trainer.publish(1)[1]["pushed"] == size
    server.until(1)
    os.kill(server.procs[1].pid, signal.SIGSTOP)
    version, report = trainer.publish(2)  # rank 1 misses it: dropped after 2 s
    assert report["pushed"] == size - 1 and len(report["dropped"]) == 1, report
    os.kill(server.procs[1].pid, signal.SIGCONT)
    server.until(2)
    # Rank 1 reconnects (its link was closed while it was stopped).
    wait_for(lambda: trainer.status()["servers"][0]["complete"], 20, "rank 1 to reconnect")
    servers = trainer.status()["servers"]
    assert [(g["name"], g["size"], g["ranks"], g["complete"]) for g in servers] == [
        ("rollout-0", size, list(range(size)), True)], servers
    # Rank 1's new link was told what its server agreed on at the welcome.
    wait_for(lambda: trainer.status()["servers"][0]["version"] == 2, 10, "the server at v2")
    assert trainer.status()["servers"][0]["staleness"] == 0
    # The batches before rank 1 was back stayed at v1 on every rank.
    assert [h for _, h, serving in server.observed if serving][-1] == [2] * size
    assert any(h == [1] * size for _, h, _ in server.observed[-6:]), server.observed
    server.stop()
    for r in range(size):
        with open(server.ctl / ("status-%d.json" % r)) as f:
            st = json.load(f)
        assert st["server_version"] == 2 and st["version"] == 2 and not st["server_inconsistent"]


@pytest.mark.parametrize("servers", [True, False])
def test_a_rank_cut_off_during_a_push_holds_its_server_back(job, servers):
    """Rank 1's link is down while v1 is pushed: with servers no batch runs
    on a mix; receivers on their own (the watcher's control) are seen
    mixed, rank 0 at v1 beside rank 1 at v0, until rank 1 caught up."""
    trainer, make = job
    relay = TcpRelay(int(trainer.address.rsplit(":", 1)[1]))
    server = make(2, addresses={1: "127.0.0.1:%d" % relay.port}, independent=not servers)
    server.until(0)
    relay.cut()  # closes rank 1's link and refuses it until restore()
    wait_for(lambda: len(trainer.status()["receivers"]) == 1, 20, "rank 1 to be dropped")
    assert trainer.publish(1)[1]["pushed"] == 1
    batches = [server.run_batch() if servers else unchecked_batch(server) for _ in range(3)]
    relay.restore()
    if servers:
        assert [held for _, held in batches] == [[0, 0]] * 3, server.observed
        server.until(1)
        server.stop()
        return
    assert [held for _, held in batches] == [[1, 0]] * 3, server.observed
    for _ in range(40):
        if unchecked_batch(server)[1] == [1, 1]:
            break
        time.sleep(0.1)
    assert server.observed[-1][1] == [1, 1], server.observed


def unchecked_batch(server):
    """A batch whose observation is recorded, not asserted."""
    n = server.batch
    server.go(n, "batch")
    done = server.ctl / ("done-%d" % n)
    wait_for(done.exists, 60, "batch %d" % n)
    result = json.loads(done.read_text())
    server.batch += 1
    held = [server.holds(r) for r in range(server.size)]
    server.observed.append((n, held, result["serving"]))
    return result, held


def test_a_connection_cut_after_staging_changes_nothing_until_every_rank_applies(job, tmp_path):
    trainer, make = job
    relay = TcpRelay(int(trainer.address.rsplit(":", 1)[1]))
    server = make(2, addresses={1: "127.0.0.1:%d" % relay.port})
    server.until(0)
    version, report = trainer.publish(1)
    assert report["pushed"] == 2, report  # staged on both
    relay.cut()
    relay.restore()
    server.until(1)
    server.stop()


@pytest.mark.parametrize("size,when,restart_at", [
    (2, w, r) for w in ("before", "during", "after") for r in ("latest", "older")] + [
    (4, w, "older") for w in ("before", "during", "after")])
def test_a_rank_killed_around_staging_and_restarted_rejoins_its_server(job, size, when,
                                                                        restart_at):
    trainer, make = job
    server = make(size)
    server.until(0)
    trainer.publish(1)
    server.until(1)
    if when == "before":
        server.kill(1)
        trainer.publish(2)
    elif when == "during":
        os.kill(server.procs[1].pid, signal.SIGSTOP)  # mid-receive of the push
        trainer.send(2)
        time.sleep(0.5)
        server.kill(1)
        trainer.proc.stdout.readline()
    else:
        assert trainer.publish(2)[1]["pushed"] == size  # staged on all, applied by none
        server.kill(1)
    # Rank 0 alone serves nothing newer; rank 1 comes back from the store.
    server.restart(1, 2 if restart_at == "latest" else 0)
    result = server.until(2)
    assert all(r["server_version"] == 2 for r in result["ranks"]), result
    if restart_at == "older":
        # Rank 1 at v0 beside rank 0 at v1 was never served.
        assert all(serving is False or len(set(h)) == 1 for _, h, serving in server.observed)
    server.stop()


def test_the_trainer_killed_mid_push_leaves_one_version_and_a_new_trainer_moves_it_on(job):
    trainer, make = job
    server = make(2)
    server.until(0)
    os.kill(server.procs[1].pid, signal.SIGSTOP)
    trainer.send(1)  # committed, then pushed: rank 0 stages it, rank 1 is stopped
    time.sleep(0.5)
    trainer.kill()
    os.kill(server.procs[1].pid, signal.SIGCONT)
    for _ in range(3):
        server.run_batch()  # every rank at v0 or every rank at v1: never a mix
    trainer.start()
    trainer.publish(2)
    server.until(2)
    server.stop()


def test_a_rank_of_a_server_of_several_is_refused_without_its_group(tmp_path):
    import torch.distributed as dist
    with pytest.raises(dte.InvalidArgument, match="needs group="):
        dte.PushReceiver("127.0.0.1:1", {}, server="rollout-9", server_size=2)
    with pytest.raises(dte.InvalidArgument, match="server_size 2 needs a server name"):
        dte.PushReceiver("127.0.0.1:1", {}, server_size=2, group=object())
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "group"), rank=0,
                            world_size=1)
    try:
        with pytest.raises(dte.InvalidArgument, match="group has 1 ranks, but server "
                                                      "'rollout-9' has server_size 2"):
            dte.PushReceiver("127.0.0.1:1", {}, server="rollout-9", server_size=2,
                             group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_a_server_rolls_back_in_place_and_forward_again_together(job, size):
    """AdamW steps (whose records hold some elements whole), the trainer
    stopped, then every rank moved back two versions and forward one, from
    the store's deltas."""
    trainer, make = job
    server = make(size)
    server.until(0)
    wait_for(lambda: trainer.status()["servers"][0]["complete"], 20, "every rank connected")
    for k in (1, 2, 3):
        report = trainer.publish(k)[1]
        assert report["pushed"] == size, report
    server.until(3)
    trainer.stop()  # else the next push says they are behind, and they catch up again
    for target in (1, 2):
        result, held = server.run_batch(command="move %d" % target)
        assert held == [target] * size and result["serving"], (held, result)
        assert all(r["server_version"] == target for r in result["ranks"]), result
    server.stop()
