"""A process of the push tests (tests/py/test_push.py).

receiver: one inference rank. Its tensors start as zeros of its layout with
no version; it catches up from the store whenever the server says it is
behind, applies pushes, and after each version it reaches checks every
tensor against the store's version sharded by plain slicing
(push_util.local_state), then writes DIR/TAG-VERSION. Exits once it holds
--steps; writes the versions it checked (and how: "push" or "catch-up") as
JSON to --out.

trainer: imports v0, publishes --steps AdamW steps with a push group on
--address, prints "published N" after each, then waits to be killed.

rank: rank --rank of a distributed publisher of --world ranks (dte's TCP
transport), every rank with a push group (rank 0's on --address; the others
told it), each publishing its row half of every tensor of a model every rank
trains alike. Reads commands from stdin: "open DIR" (re)opens the publisher
on rendezvous directory DIR, keeping the push group, and prints "opened";
"step K" trains up to step K (replaying the steps a restarted rank missed)
and publishes it, printing "published V PUSH-JSON" or "failed MESSAGE".
"""

import argparse
import dataclasses
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))
import push_util  # noqa: E402

import dte  # noqa: E402
import torch  # noqa: E402


def canonical_shapes():
    return {n: tuple(p.shape) for n, p in push_util.TinyGqaLM().named().items()}


def receiver(a):
    shapes = canonical_shapes()
    zeros = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    tensors = push_util.local_state(zeros, a.tp, a.rank, a.fused)
    layout = dte.FusedReceiverLayout(a.tp) if a.fused else dte.ReceiverLayout(a.tp)
    rx = dte.PushReceiver(a.address, tensors, rank=a.rank, layout=layout, version=None,
                          timeout=10.0)
    checked = []
    target = 0
    how = "push"
    while True:
        try:
            rx.wait_for(target, timeout=120.0)
        except dte.MissedPushes:
            rx.catch_up(a.store)
            how = "catch-up"
        v = rx.version
        want = push_util.local_state(push_util.read_version(dte, a.store, v, shapes), a.tp,
                                     a.rank, a.fused)
        for n, t in want.items():
            if not torch.equal(tensors[n].view(torch.int16), t.view(torch.int16)):
                raise SystemExit("%s: tensor %s differs from v%d (%s)" % (a.tag, n, v, how))
        checked.append([v, how])
        how = "push"
        with open(os.path.join(a.marks, "%s-%d" % (a.tag, v)), "w"):
            pass
        if v >= a.steps:
            break
        target = v + 1
    with open(a.out, "w") as f:
        json.dump({"checked": checked, "status": dataclasses.asdict(rx.status())}, f)
    rx.close()


def push_json(r):
    """The publish's push report as one line of JSON (null: no push)."""
    return json.dumps(dataclasses.asdict(r.push) if r.push else None)


def trainer(a):
    model = push_util.TinyGqaLM(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, fused=True)
    group = dte.PushGroup(a.address, timeout=5.0)
    pub = dte.Publisher(store=a.store, push=group)
    push_util.save_checkpoint(a.ckpt, model)
    pub.import_checkpoint(a.ckpt)
    print("published 0", flush=True)
    for step in range(1, a.steps + 1):
        push_util.train_step(model, opt, 1000 + step)
        r = pub.publish_adamw(step=step, params=push_util.adamw_params(model, opt), lr=5e-6,
                              betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        print("published %d %s" % (r.version, push_json(r)), flush=True)
    while True:  # serves the receivers until the test kills it
        signal.pause()


def rank(a):
    model = push_util.TinyGqaLM(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, fused=True)
    group = dte.PushGroup(a.address, timeout=a.push_timeout, receivers=a.receivers)
    pub, trained = None, 0
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "open":
            if pub is not None:
                pub.close()
            pub = dte.Publisher(store=a.store, rank=a.rank, world_size=a.world, rendezvous=arg,
                                timeout=a.timeout, push=group)
            print("opened", flush=True)
            continue
        step = int(arg)
        while trained < step:
            trained += 1
            push_util.train_step(model, opt, 1000 + trained)
        params = {}
        for n, p in model.named().items():
            st = opt.state[p]
            rows = p.shape[0]
            chunk = (rows + a.world - 1) // a.world
            r0, r1 = min(rows, a.rank * chunk), min(rows, (a.rank + 1) * chunk)
            params[n] = {"param": p.detach()[r0:r1], "exp_avg": st["exp_avg"][r0:r1],
                         "exp_avg_sq": st["exp_avg_sq"][r0:r1], "rows": (r0, r1),
                         "step": st["step"]}
        try:
            r = pub.publish_adamw(step=step, params=params, lr=5e-6, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.0)
            print("published %d %s" % (r.version, push_json(r)), flush=True)
        except dte.DteError as e:
            print("failed %s" % str(e).replace("\n", " "), flush=True)
    if pub is not None:
        pub.close()
    group.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["receiver", "trainer", "rank"])
    p.add_argument("--address", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--fused", action="store_true")
    p.add_argument("--tag", default="rx")
    p.add_argument("--marks")
    p.add_argument("--out")
    p.add_argument("--ckpt")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--push-timeout", type=float, default=5.0)
    p.add_argument("--receivers", type=int, default=0)
    a = p.parse_args()
    {"receiver": receiver, "trainer": trainer, "rank": rank}[a.mode](a)


if __name__ == "__main__":
    main()
