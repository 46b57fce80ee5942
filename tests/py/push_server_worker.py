"""A process of the inference-server tests (tests/py/test_push_servers.py).

rank: one rank of an inference server of --size ranks (tensor-parallel
--size, fused layout), in a gloo group with the server's other ranks. It
loads --load-version from the store into a /dev/shm object (--shm; its
layout written to DIR/layout-RANK.json, so the test's watcher can read the
rank's weights), opens a dte.PushReceiver on them as a rank of server
--server, and serves "batches" the test hands out: rank 0 waits for
DIR/go-N and broadcasts its text ("batch", "move V" or "stop"; a move
stages the move to V from the store and applies it, every rank
together); in a batch every
rank catches up (staged) when told it is behind, then calls
apply_pending() (the server's ranks agree on the version), and rank 0
writes DIR/done-N (JSON: each rank's version, the server's version and
whether it is inconsistent, and "serving": whether the batch's forward pass
would run) once every rank is done. Between done-N and the next go the
ranks wait, as an engine between two forward passes. A collective that
fails (a rank died) makes the rank join the group's next generation
(DIR/group-G) and go on; a restarted rank is started with that generation.

With --independent the ranks are receivers on their own (no server):
each applies what it received and catches up by writing at once, as a
fleet without servers does; the test uses it to show its watcher sees the
mix that servers prevent.

trainer: resumes from the store's latest version and publishes an AdamW
step (publish_adamw) per stdin command "step K", with a push group on
--address; prints "published V PUSH-JSON"; "status 0"
prints "status GROUP-STATUS-JSON".
"""

import argparse
import dataclasses
import datetime
import faulthandler
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import push_util  # noqa: E402

import dte  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def canonical_shapes():
    return {n: tuple(p.shape) for n, p in push_util.TinyGqaLM().named().items()}


def join_group(ctl, generation, rank, size):
    dist.init_process_group("gloo", init_method="file://%s/group-%d" % (ctl, generation),
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=10))


def leave_group():
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a broken group may fail to tear down)
        pass


def wait_for_file(path, timeout=120.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit("no %s after %.0f s" % (path, timeout))
        time.sleep(0.005)
    with open(path) as f:
        return f.read().strip()


def load(a, shapes):
    """The rank's tensors at --load-version in a SharedWeights object."""
    state = push_util.local_state(push_util.read_version(dte, a.store, a.load_version, shapes),
                                  a.size, a.rank, True)
    path = "/dev/shm/" + a.shm
    if os.path.exists(path):
        os.unlink(path)  # a restarted rank's old object
    w = dte.SharedWeights(a.shm, {n: ("BF16", tuple(t.shape)) for n, t in state.items()})
    for n, t in state.items():
        w.array(n)[...] = t.view(torch.int16).numpy().view("uint16")
    layout = {n: [w.offset(n), list(t.shape)] for n, t in state.items()}
    with open(os.path.join(a.ctl, "layout-%d.json" % a.rank), "w") as f:
        json.dump({"shm": path, "tensors": layout}, f)
    return w


def batch(a, rx):
    """One batch's update: caught up (staged) when behind, then applied."""
    st = rx.status()
    if st.behind is not None and st.behind not in rx.path():
        try:
            rx.catch_up(a.store)
        except dte.DteError as e:  # the trainer moved on meanwhile: next batch
            print("rank %d: catch-up: %s" % (a.rank, e), file=sys.stderr, flush=True)
    rx.apply_pending()
    st = rx.status()
    return {"version": st.version, "server_version": st.server_version,
            "inconsistent": st.server_inconsistent, "error": st.server_error,
            "path": rx.path()}


def rank(a):
    shapes = canonical_shapes()
    w = load(a, shapes)
    tensors = {n: ("BF16", w.array(n)) for n in w.tensors}
    generation = a.generation
    join_group(a.ctl, generation, a.rank, a.size)
    server = {} if a.independent else {"server": a.server, "server_size": a.size,
                                       "group": dist.group.WORLD}
    rx = dte.PushReceiver(a.address, tensors, rank=a.rank, layout=dte.FusedReceiverLayout(a.size),
                          version=a.load_version, timeout=a.timeout, **server)
    n = a.first_batch
    while True:
        try:
            cmd = [wait_for_file(os.path.join(a.ctl, "go-%d" % n)) if a.rank == 0 else None]
            dist.broadcast_object_list(cmd, src=0)
            if cmd[0] == "stop":
                break
            if cmd[0].startswith("move "):  # every rank moves to that version together
                rx.move_to(a.store, int(cmd[0].split()[1]))
            elif cmd[0] != "batch":
                raise SystemExit("rank %d: batch %d: unknown command %r" % (a.rank, n, cmd[0]))
            mine = batch(a, rx)
            everyone = [None] * a.size
            dist.all_gather_object(everyone, mine)
        except RuntimeError as e:  # a rank died: the next generation of the group
            print("rank %d: group %d failed (%s); joining %d" % (a.rank, generation, e,
                                                                generation + 1),
                  file=sys.stderr, flush=True)
            leave_group()
            generation += 1
            join_group(a.ctl, generation, a.rank, a.size)
            if not a.independent:
                rx.group = dist.group.WORLD
            continue
        if a.rank == 0:
            serving = all(not r["inconsistent"] for r in everyone)
            tmp = os.path.join(a.ctl, "done-%d.tmp" % n)
            with open(tmp, "w") as f:
                json.dump({"ranks": everyone, "serving": serving, "generation": generation}, f)
            os.rename(tmp, os.path.join(a.ctl, "done-%d" % n))
        n += 1
    with open(os.path.join(a.ctl, "status-%d.json" % a.rank), "w") as f:
        json.dump(dataclasses.asdict(rx.status()), f)
    rx.close()
    leave_group()


def trainer(a):
    """Resumes from the store's latest version: an AdamW (fused, as TRL's
    default) step per "step K" command, published with publish_adamw."""
    shapes = canonical_shapes()
    model = push_util.TinyGqaLM()
    with dte.StoreReader(a.store) as r:
        latest = r.latest()
    weights = push_util.read_version(dte, a.store, latest, shapes)
    with torch.no_grad():
        for n, p in model.named().items():
            p.copy_(weights[n].float())
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, fused=True)
    group = dte.PushGroup(a.address, timeout=a.timeout)
    pub = dte.Publisher(store=a.store, push=group)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, k = line.split()
        if cmd == "status":
            print("status " + json.dumps(dataclasses.asdict(group.status(events=False))),
                  flush=True)
            continue
        push_util.train_step(model, opt, 1000 + int(k))
        params = push_util.adamw_params(model, opt)
        step = int(next(iter(params.values()))["step"])  # this optimizer's (1 after a restart)
        r = pub.publish_adamw(step=step, params=params, lr=5e-6,
                              betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        print("published %d %s" % (r.version, json.dumps(dataclasses.asdict(r.push)
                                                         if r.push else None)), flush=True)
    pub.close()
    group.close()


def main():
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stop() asks on a hang
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["rank", "trainer"])
    p.add_argument("--address", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--ctl", default="")
    p.add_argument("--server", default="rollout-0")
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--shm", default="")
    p.add_argument("--load-version", type=int, default=0)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--first-batch", type=int, default=0)
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--independent", action="store_true")
    a = p.parse_args()
    {"rank": rank, "trainer": trainer}[a.mode](a)


if __name__ == "__main__":
    main()
