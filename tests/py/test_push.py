"""Same-cluster push end to end (docs/push.md): a trainer trains a small GQA
Llama-shaped model with torch.optim.AdamW and publishes every step with a
dte.PushGroup; 1, 2 and 4 receiver processes (tests/py/push_worker.py) in
tensor-parallel, fused layouts hold every version bit for bit, checked
against the store's version sharded by plain slicing. Faults: a receiver
stopped with SIGSTOP misses a push, is dropped within the timeout, and
catches up from the store; a receiver killed with kill -9 does not stop the
publishes; a trainer killed with kill -9 leaves receivers holding their
last version, whole, and saying so.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import push_util  # noqa: E402
from wait_util import wait_for  # noqa: E402

import dte  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "push_worker.py")
LAYOUTS = {1: [(1, 0, False)], 2: [(2, 0, True), (2, 1, True)],
           4: [(4, r, True) for r in range(4)]}  # tp 4 > 2 kv heads: replicated heads


class Run(push_util.ReceiverProcs):
    """A trainer in this process and receiver processes."""

    def __init__(self, tmp, receivers, timeout=10.0):
        self.tmp = tmp
        self.store = str(tmp / "store")
        self.marks = tmp / "marks"
        self.marks.mkdir()
        self.model = push_util.TinyGqaLM(seed=3)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=5e-6, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=0.0, fused=True)
        self.group = dte.PushGroup("127.0.0.1:0", timeout=timeout)
        self.pub = dte.Publisher(store=self.store, push=self.group)
        push_util.save_checkpoint(tmp / "v0", self.model)
        assert self.pub.import_checkpoint(str(tmp / "v0")) == 0
        self.procs = {}
        self.layouts = receivers

    def start(self, steps):
        for tp, rank, fused in self.layouts:
            self.start_one(tp, rank, fused, steps)
        # Every receiver connected, caught up to v0 and checked it.
        self.await_marks(0)

    def start_one(self, tp, rank, fused, steps):
        return super().start_one(self.group.address, tp, rank, fused, steps)

    def publish(self, step):
        push_util.train_step(self.model, self.opt, 1000 + step)
        params = push_util.adamw_params(self.model, self.opt)
        t0 = time.monotonic()
        r = self.pub.publish_adamw(step=step, params=params, lr=5e-6, betas=(0.9, 0.95),
                                   eps=1e-8, weight_decay=0.0)
        return r, time.monotonic() - t0

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        self.pub.close()
        self.group.close()


@pytest.fixture
def run(tmp_path):
    runs = []

    def make(receivers, timeout=10.0):
        r = Run(tmp_path, receivers, timeout)
        runs.append(r)
        return r
    yield make
    for r in runs:
        r.close()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_receivers_hold_every_version_bit_for_bit(run, n):
    steps = 4
    r = run(LAYOUTS[n])
    r.start(steps)
    for step in range(1, steps + 1):
        res, _ = r.publish(step)
        assert res.version == step
        assert res.changed > 0
        assert res.push.pushed == n and res.push.dropped == [], (res.push, r.group.status())
        assert res.push.elements >= res.changed  # every change reaches each TP group
        r.await_marks(step)
    for tag, out in r.results().items():
        assert out["checked"] == [[0, "catch-up"]] + [[v, "push"] for v in range(1, steps + 1)]
        assert out["status"]["pushes"] == steps and out["status"]["version"] == steps


def test_stopped_receiver_is_dropped_and_catches_up_from_the_store(run):
    r = run(LAYOUTS[2], timeout=1.0)
    r.start(3)
    res, _ = r.publish(1)
    assert res.push.pushed == 2
    r.await_marks(1)
    stopped = r.procs["tp2-r1"]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        res, secs = r.publish(2)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert res.version == 2
    assert res.push.pushed == 1
    assert len(res.push.dropped) == 1 and "did not confirm v00000002" in res.push.dropped[0]
    assert secs < 5.0, "a stalled receiver held the publish for %.1f s" % secs
    r.await_marks(2)
    # The stopped receiver reconnects and holds v2: from the push that sat in
    # its socket (whole, so it applies) or from the store.
    wait_for(lambda: [x.version for x in r.group.status().receivers] == [2, 2], 30,
             "both receivers to be back at v2")
    res, _ = r.publish(3)
    assert res.push.pushed == 2, res.push
    out = r.results()
    assert out["tp2-r0"]["checked"] == [[0, "catch-up"], [1, "push"], [2, "push"], [3, "push"]]
    checked = out["tp2-r1"]["checked"]
    assert checked[:2] == [[0, "catch-up"], [1, "push"]] and checked[-1] == [3, "push"], checked
    assert checked[2][0] == 2, checked


def test_killed_receiver_does_not_stop_publishing_and_its_restart_catches_up(run):
    r = run(LAYOUTS[2], timeout=2.0)
    r.start(4)
    res, _ = r.publish(1)
    r.await_marks(1)
    victim = r.procs.pop("tp2-r0")
    victim.kill()
    victim.wait()
    for step in (2, 3):
        res, secs = r.publish(step)
        assert res.version == step
        assert res.push.pushed == 1, res.push
        assert secs < 5.0
    r.await_marks(3)
    events = r.group.status().events
    assert any("rank 0" in e and "closed the connection" in e for e in events), events
    # Restarted, it joins late with empty tensors: the store brings it to v3,
    # then it is pushed to again.
    tag = r.start_one(2, 0, True, 4)
    r.await_marks(3, [tag])
    wait_for(lambda: [x.version for x in r.group.status().receivers] == [3, 3], 30,
             "the restarted receiver to be registered at v3")
    res, _ = r.publish(4)
    assert res.push.pushed == 2, res.push
    out = r.results()
    assert out["tp2-r0"]["checked"] == [[3, "catch-up"], [4, "push"]]
    assert out["tp2-r1"]["status"]["version"] == 4


def test_receiver_keeps_its_version_when_the_trainer_dies(tmp_path):
    store = str(tmp_path / "store")
    port_probe = dte.PushGroup("127.0.0.1:0")
    address = port_probe.address
    port_probe.close()
    trainer = subprocess.Popen([sys.executable, WORKER, "trainer", "--address", address,
                                "--store", store, "--steps", "2", "--ckpt",
                                str(tmp_path / "v0")], stdout=subprocess.PIPE, text=True)
    try:
        shapes = {n: tuple(p.shape) for n, p in push_util.TinyGqaLM().named().items()}
        zeros = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        tensors = push_util.local_state(zeros, 1, 0, False)
        assert trainer.stdout.readline().startswith("published 0")
        with dte.PushReceiver(address, tensors, version=None, auto_apply=True,
                              timeout=5.0) as rx:
            wait_for(lambda: rx.status().behind is not None or rx.version is not None, 30,
                     "the server's welcome")
            if rx.version is None:
                rx.catch_up(store)
            for line in iter(trainer.stdout.readline, ""):
                if line.startswith("published 2"):
                    break
            # The trainer does not wait for this receiver: a push it missed
            # while catching up is made good from the store, as a server would.
            try:
                rx.wait_for(2, timeout=30)
            except dte.MissedPushes:
                rx.catch_up(store)
            assert rx.version == 2
            trainer.kill()
            trainer.wait()
            wait_for(lambda: not rx.status().connected, 10, "the receiver to notice")
            st = rx.status()
            assert st.version == 2 and not st.inconsistent, st
            with pytest.raises(dte.DeadlineExceeded) as e:
                rx.wait_for(3, timeout=0.5)
            assert e.value.code == 12 and e.value.transient
            assert "holding v00000002, not connected" in str(e.value)
            assert isinstance(e.value, TimeoutError)
            want = push_util.local_state(push_util.read_version(dte, store, 2, shapes), 1, 0,
                                         False)
            for n, t in want.items():
                assert torch.equal(tensors[n].view(torch.int16), t.view(torch.int16)), n
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_publish_refuses_a_closed_push_group(run):
    r = run(LAYOUTS[1])
    r.group.close()
    with pytest.raises(dte.DteError) as e:
        r.publish(1)
    assert "PushGroup given as push= was closed" in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: pushes into GPU memory need one "
                           "(tools/gpu_check.sh runs this test on a GPU host)")
def test_cuda_receivers_hold_every_version_bit_for_bit(run):
    r = run([])
    shapes = {n: tuple(p.shape) for n, p in r.model.named().items()}
    zeros = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    rxs = []
    for rank in range(2):
        tensors = {n: t.cuda() for n, t in push_util.local_state(zeros, 2, rank, True).items()}
        rx = dte.PushReceiver(r.group.address, tensors, rank=rank,
                              layout=dte.FusedReceiverLayout(2), version=None, timeout=10.0)
        rxs.append((rank, tensors, rx))
    for rank, tensors, rx in rxs:
        wait_for(lambda: rx.status().behind is not None, 30, "the server's welcome")
        rx.catch_up(r.store)
    wait_for(lambda: [x.version for x in r.group.status().receivers] == [0, 0], 30,
             "both receivers at v0")
    for step in range(1, 4):
        res, _ = r.publish(step)
        assert res.push.pushed == 2, res.push
        want = push_util.read_version(dte, r.store, step, shapes)
        for rank, tensors, rx in rxs:
            rx.wait_for(step, timeout=30)
            for n, t in push_util.local_state(want, 2, rank, True).items():
                assert torch.equal(tensors[n].cpu().view(torch.int16), t.view(torch.int16)), \
                    (rank, n, step)
    for _, _, rx in rxs:
        rx.close()


@pytest.mark.parametrize("mode", ["rank0", "owners", "owners-read-back"])
def test_distributed_publisher_pushes_each_version(tmp_path, mode):
    """Two ranks (threads, dte's TCP transport) publish row halves of every
    tensor and push each committed version to a TP-2 fused server whose
    ranks hold it bit for bit: rank 0 alone (read back from the store), or
    every rank the tensors it owns (the changes it kept while encoding, or
    with no cache for them read back from the store)."""
    import threading
    store = str(tmp_path / "store")
    model = push_util.TinyGqaLM(seed=5)
    push_util.save_checkpoint(tmp_path / "v0", model)
    with dte.Publisher(store=store) as first:
        first.import_checkpoint(str(tmp_path / "v0"))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, fused=True)
    cache = 0 if mode == "owners-read-back" else None
    group = dte.PushGroup("127.0.0.1:0", timeout=10.0, cache_mib=cache)
    groups = [group, None if mode == "rank0" else dte.PushGroup(group.address, timeout=10.0,
                                                                   cache_mib=cache)]
    shapes = {n: tuple(p.shape) for n, p in model.named().items()}
    v0 = push_util.read_version(dte, store, 0, shapes)
    rxs = []
    for rank in range(2):
        tensors = push_util.local_state(v0, 2, rank, True)
        rxs.append((rank, tensors, dte.PushReceiver(group.address, tensors, rank=rank,
                                                    layout=dte.FusedReceiverLayout(2), version=0,
                                                    auto_apply=True, timeout=10.0)))
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    pubs = [None, None]

    def open_rank(r):
        pubs[r] = dte.Publisher(store=store, rank=r, world_size=2, rendezvous=str(rendezvous),
                                timeout=30.0, push=groups[r])
    threads = [threading.Thread(target=open_rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wait_for(lambda: len(group.status().receivers) == 2, 30, "both receivers")
    try:
        for step in range(1, 4):
            g = torch.Generator().manual_seed(2000 + step)
            opt.zero_grad()
            sum((p * torch.randn(p.shape, generator=g)).sum() for p in model.parameters()).backward()
            opt.step()
            results = [None, None]

            def publish(r):
                params = {}
                for n, p in model.named().items():
                    st = opt.state[p]
                    half = (p.shape[0] + 1) // 2
                    r0, r1 = (0, half) if r == 0 else (half, p.shape[0])
                    params[n] = {"param": p.detach()[r0:r1], "exp_avg": st["exp_avg"][r0:r1],
                                 "exp_avg_sq": st["exp_avg_sq"][r0:r1], "rows": (r0, r1),
                                 "step": st["step"]}
                results[r] = pubs[r].publish_adamw(step=step, params=params, lr=5e-6,
                                                   betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
            threads = [threading.Thread(target=publish, args=(r,)) for r in range(2)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert results[0].version == results[1].version == step
            push = results[0].push
            assert push.pushed == 2 and push.dropped == [], push
            if mode == "rank0":
                assert results[1].push is None
            else:
                other = results[1].push
                assert other.pushed == 2 and other.dropped == [], other
                assert push.elements > 0 and other.elements > 0, (push, other)
                # Each rank's push took its tensors from what it kept, or
                # (no cache for them) read them back from the store.
                for p in pubs:
                    st = p.last_stats()
                    kept, back = st.push_tensors_kept, st.push_tensors_read_back
                    assert (kept, back) == ((0, kept + back) if cache == 0 else (kept + back, 0))
                    assert kept + back > 0, st
            want = push_util.read_version(dte, store, step, shapes)
            for rank, tensors, rx in rxs:
                rx.wait_for(step, timeout=30)
                for n, t in push_util.local_state(want, 2, rank, True).items():
                    assert torch.equal(tensors[n].view(torch.int16), t.view(torch.int16)), \
                        (rank, n, step)
    finally:
        for _, _, rx in rxs:
            rx.close()
        for p in pubs:
            if p is not None:
                p.close()
        for g in groups:
            if g is not None:
                g.close()


def test_push_that_cannot_run_is_reported_and_the_version_still_committed(tmp_path):
    """A checkpoint without config.json has no attention geometry to plan
    receivers with: the import and the publish commit, and the publish
    result says why nothing was pushed."""
    model = push_util.TinyGqaLM(seed=1)
    push_util.save_checkpoint(tmp_path / "v0", model)
    os.remove(tmp_path / "v0" / "config.json")
    store = str(tmp_path / "store")
    with dte.PushGroup() as group, dte.Publisher(store=store, push=group) as pub:
        assert pub.import_checkpoint(str(tmp_path / "v0")) == 0
        opt = torch.optim.AdamW(model.parameters(), lr=5e-6, fused=True)
        for p in model.parameters():
            p.grad = torch.ones(p.shape)
        opt.step()
        params = {n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                      "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
                  for n, p in model.named().items()}
        r = pub.publish_adamw(step=1, params=params, lr=5e-6, weight_decay=0.01)
        assert r.version == 1
        assert r.push == dte.PushReport(error="receivers need the attention geometry from "
                                              "config.json, and v00000001 has none"), r.push
    with dte.StoreReader(store) as reader:
        assert reader.latest() == 1


def test_push_group_waits_for_the_receivers_it_expects_and_reports_those_missing(tmp_path):
    model = push_util.TinyGqaLM(seed=4)
    push_util.save_checkpoint(tmp_path / "v0", model)
    store = str(tmp_path / "store")
    shapes = {n: tuple(p.shape) for n, p in model.named().items()}
    with dte.PushGroup(timeout=5.0, receivers=2) as group, \
            dte.Publisher(store=store, push=group) as pub:
        assert pub.import_checkpoint(str(tmp_path / "v0")) == 0
        v0 = push_util.read_version(dte, store, 0, shapes)
        rxs = [dte.PushReceiver(group.address, push_util.local_state(v0, 2, r, True), rank=r,
                                layout=dte.FusedReceiverLayout(2), version=0, auto_apply=True)
               for r in range(2)]
        try:
            st = group.wait_for_receivers(timeout=30, version=0)
            assert st.expected == 2 and len(st.receivers) == 2, st
            assert [x.layout for x in st.receivers] == [dte.FusedReceiverLayout(2)] * 2, st
            rxs.pop().close()
            wait_for(lambda: len(group.status(events=False).receivers) == 1, 30,
                     "the close")
            with pytest.raises(dte.DeadlineExceeded) as e:
                group.wait_for_receivers(timeout=0.3)
            assert e.value.code == 12 and "1 of 2 receivers after" in str(e.value)
            # Waiting left the event of the close for status() to take.
            events = group.status().events
            assert any("closed the connection" in x for x in events), events
            assert group.status().events == []
            opt = torch.optim.AdamW(model.parameters(), lr=5e-6, fused=True)
            for p in model.parameters():
                p.grad = torch.ones(p.shape)
            opt.step()
            params = {n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                          "exp_avg_sq": opt.state[p]["exp_avg_sq"],
                          "step": opt.state[p]["step"]} for n, p in model.named().items()}
            r = pub.publish_adamw(step=1, params=params, lr=5e-6)
            assert r.push.pushed == 1 and r.push.missing == 1, r.push
        finally:
            for rx in rxs:
                rx.close()


def _publish_one_step(pub, model):
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, fused=True)
    for p in model.parameters():
        p.grad = torch.ones(p.shape)
    opt.step()
    params = {n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                  "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
              for n, p in model.named().items()}
    return pub.publish_adamw(step=1, params=params, lr=5e-6, weight_decay=0.01)


def test_push_reads_model_facts_from_architectures_and_transformers_defaults(tmp_path):
    """A config.json that names its model by "architectures" alone, with no
    intermediate_size (a push does not need it) and no head_dim (hidden /
    heads, as transformers derives it): the version is pushed."""
    model = push_util.TinyGqaLM(seed=2)
    push_util.save_checkpoint(tmp_path / "v0", model)
    assert push_util.DIM // push_util.HEADS == push_util.HEAD_DIM
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": push_util.DIM,
              "num_attention_heads": push_util.HEADS, "num_key_value_heads": push_util.KV_HEADS}
    (tmp_path / "v0" / "config.json").write_text(json.dumps(config))
    store = str(tmp_path / "store")
    shapes = {n: tuple(p.shape) for n, p in model.named().items()}
    with dte.PushGroup(receivers=1) as group, dte.Publisher(store=store, push=group) as pub:
        assert pub.import_checkpoint(str(tmp_path / "v0")) == 0
        v0 = push_util.read_version(dte, store, 0, shapes)
        tensors = push_util.local_state(v0, 2, 1, True)
        with dte.PushReceiver(group.address, tensors, rank=1, layout=dte.FusedReceiverLayout(2),
                              version=0) as rx:
            group.wait_for_receivers(timeout=30, version=0)
            r = _publish_one_step(pub, model)
            assert r.push.error == "" and r.push.pushed == 1, r.push
            rx.wait_for(1, timeout=30)
            want = push_util.local_state(push_util.read_version(dte, store, 1, shapes), 2, 1, True)
            for n, t in want.items():
                assert torch.equal(tensors[n].view(torch.int16), t.view(torch.int16)), n


def test_push_without_model_facts_names_every_missing_key_at_once(tmp_path):
    model = push_util.TinyGqaLM(seed=2)
    push_util.save_checkpoint(tmp_path / "v0", model)
    (tmp_path / "v0" / "config.json").write_text(json.dumps({"num_key_value_heads": 2}))
    with dte.PushGroup() as group, dte.Publisher(store=str(tmp_path / "store"),
                                                 push=group) as pub:
        assert pub.import_checkpoint(str(tmp_path / "v0")) == 0
        r = _publish_one_step(pub, model)
    assert r.version == 1 and r.push.pushed == 0
    assert r.push.error == ('v00000001/config.json: missing "hidden_size", '
                            '"num_attention_heads"'), r.push


def test_a_receiver_that_cannot_connect_names_the_server_address_once():
    import socket
    with socket.socket() as s:  # a loopback port nobody listens on once it is closed
        s.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % s.getsockname()[1]
    w = np.zeros(4, np.float32)
    with dte.PushReceiver(address, {"w": ("F32", w)}, timeout=1.0) as rx:
        error = wait_for(lambda: rx.status().error, 30, "a failed connection")
        assert "the push server at %s" % address in error, error
        assert error.count(address) == 1, error
        with pytest.raises(dte.DeadlineExceeded) as e:
            rx.wait_for(1, timeout=0.2)
        assert str(e.value).count(address) == 1, str(e.value)
