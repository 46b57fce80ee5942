#!/opt/dte/venv/bin/python
"""Same-cluster push against full-weight sync, on the same model, transport
and receivers (docs/push.md, figures in docs/benchmarks.md).

A Llama-shaped model of about --size (BF16; GQA, untied head) is trained
with torch.optim.AdamW (random gradients, --lr 7e-7: 3.1% of BF16 weights
change at step 1, falling to ~1.5% by step 4, as in RL fine-tuning). The trainer (this process)
publishes every step with dte.Publisher(push=dte.PushGroup(...)) to
--receivers processes that hold the model as the ranks of one
tensor-parallel inference server (TP = receivers, vLLM's fused qkv_proj and
gate_up_proj), in CPU memory, applying pushes as they arrive.

Per receiver count and step it reports:
  push      seconds from the start of the push (the commit done) until every
            receiver holds the version (their clocks: same host)
  publish   seconds of publish_adamw (detection, commit to a local store and
            the push, which ends when every receiver confirmed receipt)
  bytes     bytes the push sent, over all receivers
and the baseline RL frameworks use, in the same run: every tensor sent whole
(BF16) over TCP to every receiver, which keeps its shard (copies it into
its fused, split tensors): seconds until every receiver has copied, and
bytes sent. Ratios: baseline / push.

Each step also reports the trainer's extra memory during publish_adamw
(peak resident set minus the resident set before it, VmHWM reset through
/proc/self/clear_refs). With --dist the trainer is a distributed publisher
of --world ranks (threads of this process over dte's TCP transport, rank r
publishing rows [r/world, (r+1)/world) of every tensor): rank 0 pushes each
committed version read back from the store, a tensor at a time; with
--owners every rank has a push group and pushes the tensors it owned, and
the rows add each rank's push time ("rank_push_s") and bytes.

With --cuda the receivers hold their tensors in GPU memory (pushes are
written by the CUDA kernel; the baseline copies each shard host to device).

With --servers each receiver count runs twice more, the receivers calling
apply_pending() between "batches" (every 5 ms): on their own (rows
"batches"), then as the ranks of one inference server (docs/push.md,
"Servers"; rows "server"), in a gloo group, so a version lands when every
rank staged it. The summary adds push (server) / push (on their own) per
step of the same run, and each server rank's most staged bytes and peak
resident set beside its weights' bytes.

Usage: /opt/dte/venv/bin/python tools/bench/push_bench.py [--size 1GiB] [--receivers 1,2,4]
       [--steps 4] [--lr 7e-7] [--dist [--world N] [--owners]] [--cuda] [--servers]
       [--json out]
"""

import dataclasses
import json
import math
import os
import socket
import struct
import subprocess
import sys
import time

import harness as h
from harness import run_threads

SOURCE = h.ROOT


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def config_for(size):
    """A Llama-shaped config of about `size` bytes of BF16."""
    hidden, heads, kv, head_dim, vocab = 2048, 16, 4, 128, 32000
    ffn = 5632
    per_layer = (heads * head_dim * hidden * 2 + kv * head_dim * hidden * 2 + 3 * ffn * hidden +
                 2 * hidden)
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size / 2 - fixed) / per_layer))
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "intermediate_size": ffn, "vocab_size": vocab}


def shapes(c):
    h, q, kv, f, v = (c["hidden_size"], c["num_attention_heads"] * c["head_dim"],
                      c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"],
                      c["vocab_size"])
    out = {"model.embed_tokens.weight": (v, h)}
    for l in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % l
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def shard(c, name, t, tp, rank):
    """Rank `rank`'s part of canonical tensor t (vLLM's splits)."""
    import torch
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    if ".q_proj." in name:
        rows = heads // tp * hd
        return t[rank * rows:(rank + 1) * rows]
    if ".k_proj." in name or ".v_proj." in name:
        per, first = (kv // tp, rank * kv // tp) if kv >= tp else (1, rank * kv // tp)
        return t[first * hd:(first + per) * hd]
    if ".gate_proj." in name or ".up_proj." in name:
        rows = t.shape[0] // tp
        return t[rank * rows:(rank + 1) * rows]
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        cols = t.shape[1] // tp
        return t[:, rank * cols:(rank + 1) * cols]
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        per = math.ceil(t.shape[0] / tp)
        part = t[rank * per:(rank + 1) * per]
        out = torch.zeros((per,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        if t.device.type == "meta":
            return out
        out[:part.shape[0]] = part
        return out
    return t


def local_layout(c, tp, rank):
    """{local name: [(canonical name, row offset)]}: where each canonical
    tensor's shard lands in the rank's fused tensors, and the local shapes."""
    import torch
    names = shapes(c)
    parts, local = {}, {}
    for n, s in names.items():
        z = shard(c, n, torch.empty(s, dtype=torch.bfloat16, device="meta"), tp, rank)
        target = n
        for group, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                             (("gate_proj", "up_proj"), "gate_up_proj")):
            for g in group:
                if "." + g + "." in n:
                    target = n.replace(g, fused)
        parts.setdefault(target, []).append((n, tuple(z.shape)))
    for target, ps in parts.items():
        rows = sum(s[0] for _, s in ps)
        local[target] = (rows,) + ps[0][1][1:]
    return parts, local


class Trainer:
    """The model of config c trained with torch.optim.AdamW (random gradients,
    the same from the same seed), its version 0 imported into `store`."""

    ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}

    def __init__(self, c, lr, root, store):
        import safetensors.torch
        import torch
        sys.path.insert(0, h.PY_PATH)
        import dte
        self.lr = lr
        g = torch.Generator().manual_seed(1)
        self.params = {n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.02 if len(s) > 1
                                             else torch.ones(s)) for n, s in shapes(c).items()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, fused=True, **self.ADAMW)
        ckpt = os.path.join(root, "v0")
        os.makedirs(ckpt)
        safetensors.torch.save_file(
            {n: t.detach().to(torch.bfloat16) for n, t in self.params.items()},
            os.path.join(ckpt, "model.safetensors"))
        json.dump(c, open(os.path.join(ckpt, "config.json"), "w"))
        with dte.Publisher(store=store) as importer:
            importer.import_checkpoint(ckpt)
        h.remove(ckpt)

    def step(self, step):
        """Takes optimizer step `step`; returns the state publish_adamw takes."""
        import torch
        gs = torch.Generator().manual_seed(100 + step)
        for t in self.params.values():
            t.grad = torch.randn(t.shape, generator=gs)
        self.opt.step()
        st = self.opt.state
        return {n: {"param": t, "exp_avg": st[t]["exp_avg"], "exp_avg_sq": st[t]["exp_avg_sq"],
                    "step": st[t]["step"]} for n, t in self.params.items()}

    def publish(self, pub, step, state):
        return pub.publish_adamw(step=step, params=state, lr=self.lr, **self.ADAMW)


# --- receiver process --------------------------------------------------------

def receiver(a):
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    import dte
    import torch
    c = json.load(open(a.config))
    parts, local = local_layout(c, a.tp, a.rank)
    device = "cuda:%d" % (a.rank % torch.cuda.device_count()) if a.cuda else "cpu"
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in local.items()}
    out = open(a.out, "w", buffering=1)
    if a.server or a.batches:
        return batch_rank(a, dte, tensors, out)
    rx = dte.PushReceiver(a.address, tensors, rank=a.rank, layout=dte.FusedReceiverLayout(a.tp),
                          version=None, auto_apply=True, timeout=60.0)
    # Baseline listener: whole tensors in, the shard copied into the fused tensors.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    out.write(json.dumps({"baseline_port": srv.getsockname()[1]}) + "\n")
    held = None
    target = 0
    while target <= a.steps:
        try:
            rx.wait_for(target, timeout=600)
        except dte.MissedPushes:
            rx.catch_up(a.store)
        held = rx.version
        out.write(json.dumps({"version": held, "t": time.time()}) + "\n")
        target = held + 1
    # The baseline, --steps times.
    names = shapes(c)
    offsets = {}
    for target_name, ps in parts.items():
        row = 0
        for n, s in ps:
            offsets[n] = (target_name, row, s[0])
            row += s[0]
    conn, _ = srv.accept()
    f = conn.makefile("rb")
    buf = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in names.items()}
    for _ in range(a.steps + 1):
        for n in names:
            mv = memoryview(buf[n].view(torch.uint8).numpy()).cast("B")
            got = 0
            while got < len(mv):
                k = f.readinto(mv[got:])
                if not k:
                    raise SystemExit("baseline sender closed")
                got += k
            target_name, row, rows = offsets[n]
            tensors[target_name][row:row + rows].copy_(shard(c, n, buf[n], a.tp, a.rank))
        conn.sendall(struct.pack("<d", time.time()))
    conn.close()
    rx.close()


def batch_rank(a, dte, tensors, out):
    """A rank that calls apply_pending() between batches: on its own
    (--batches), or as a rank of one inference server (--server)."""
    import datetime
    import torch.distributed as dist
    server = {}
    if a.server:
        dist.init_process_group("gloo", init_method="file://" + a.group_file, rank=a.rank,
                                world_size=a.tp, timeout=datetime.timedelta(seconds=600))
        server = {"server": "bench", "server_size": a.tp, "group": dist.group.WORLD}
    rx = dte.PushReceiver(a.address, tensors, rank=a.rank, layout=dte.FusedReceiverLayout(a.tp),
                          version=None, timeout=60.0, **server)
    weights = sum(t.numel() * 2 for t in tensors.values())
    out.write(json.dumps({"baseline_port": 0}) + "\n")
    staged = 0
    target = 0
    while target <= a.steps:
        st = rx.status()
        staged = max(staged, st.staged_bytes)
        if st.behind is not None and st.behind not in rx.path():
            rx.catch_up(a.store)
        rx.apply_pending()
        path = rx.path()
        held = path[0] if path else None
        if held is not None and held >= target:
            out.write(json.dumps({"version": held, "t": time.time()}) + "\n")
            target = held + 1
        time.sleep(0.005)  # a batch every 5 ms, about a decode step
    moves = {}
    if a.server:
        # One step back in place (a rollback) and forward again, from the
        # store's deltas, every rank together: staged, then applied.
        for name, v in (("back_s", a.steps - 1), ("forward_s", a.steps)):
            dist.barrier()
            t0 = time.time()
            rx.move_to(a.store, v)
            moves[name] = time.time() - t0
            assert rx.version == v, (rx.version, v)
    out.write(json.dumps({"staged_max": staged, "weights": weights,
                          "hwm": h.proc_status("self", "VmHWM"), **moves}) + "\n")
    rx.close()
    if a.server:
        dist.destroy_process_group()


# --- trainer -----------------------------------------------------------------

def parse_args():
    p = h.parser(__doc__)
    p.add_argument("mode", nargs="?", default="bench")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--receivers", default="1,2,4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=7e-7)
    p.add_argument("--work", default=None, help="where the temporary work directory goes")
    p.add_argument("--dist", action="store_true",
                   help="publish with a distributed publisher of one rank, which pushes each "
                        "version read back from the store a tensor at a time")
    p.add_argument("--world", type=int, default=1, help="ranks of --dist")
    p.add_argument("--owners", action="store_true",
                   help="--dist: every rank pushes the tensors it owns")
    p.add_argument("--cuda", action="store_true",
                   help="receivers hold their tensors in GPU memory (rank r on GPU r mod count)")
    p.add_argument("--servers", action="store_true",
                   help="also run each receiver count as the ranks of one server")
    p.add_argument("--server", action="store_true", help="receiver mode: a rank of one server")
    p.add_argument("--batches", action="store_true",
                   help="receiver mode: apply_pending() between batches, on its own")
    p.add_argument("--group-file")
    # receiver mode
    p.add_argument("--address")
    p.add_argument("--store")
    p.add_argument("--config")
    p.add_argument("--tp", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--out")
    return p.parse_args()


class Bench:
    """One receiver count's run: the model and its optimizer, the store with
    v0, the publisher(s) and push group(s), and the receiver processes."""

    def __init__(self, a, dte, c, names, work, n_rx, mode="receivers"):
        self.a, self.dte, self.c, self.names, self.n_rx = a, dte, c, names, n_rx
        self.mode = mode  # "receivers" (auto_apply), "batches" or "server"
        self.elements = sum(math.prod(s) for s in names.values())
        self.root = os.path.join(work, "rx%d-%s" % (n_rx, mode))
        os.makedirs(self.root)
        json.dump(c, open(os.path.join(self.root, "config.json"), "w"))
        self.store = os.path.join(self.root, "store")
        self.trainer = Trainer(c, a.lr, self.root, self.store)
        self.params = self.trainer.params
        self.group = dte.PushGroup("127.0.0.1:0", timeout=120.0)
        self.open_publishers()
        self.start_receivers()

    def open_publishers(self):
        a, dte = self.a, self.dte
        self.pubs, self.groups = [], [self.group]
        if not a.dist:
            self.pub = dte.Publisher(store=self.store, push=self.group)
            return
        rdv = os.path.join(self.root, "rendezvous")
        os.makedirs(rdv)
        self.pubs = [None] * a.world
        for _ in range(1, a.world):
            self.groups.append(
                dte.PushGroup(self.group.address, timeout=120.0) if a.owners else None)

        def open_rank(r):
            self.pubs[r] = dte.Publisher(store=self.store, push=self.groups[r], rank=r,
                                         world_size=a.world, rendezvous=rdv)
        run_threads(open_rank, range(a.world))
        self.pub = self.pubs[0]

    def start_receivers(self):
        a = self.a
        self.procs, self.outs = [], []
        for r in range(self.n_rx):
            out = os.path.join(self.root, "rx%d.jsonl" % r)
            self.outs.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "receiver", "--address", self.group.address,
                 "--store", self.store, "--config", os.path.join(self.root, "config.json"),
                 "--tp", str(self.n_rx), "--rank", str(r), "--steps", str(a.steps), "--out", out,
                 "--build-dir", a.build_dir] + (["--cuda"] if a.cuda else []) +
                (["--server", "--group-file", os.path.join(self.root, "group")]
                 if self.mode == "server" else []) +
                (["--batches"] if self.mode == "batches" else [])))
        while not all(self.held(i) >= 0 for i in range(self.n_rx)):
            if any(pr.poll() is not None for pr in self.procs):
                raise SystemExit("a receiver exited")
            time.sleep(0.05)
        log("%d receiver(s) at v0" % self.n_rx)

    def records(self, i):
        try:
            return [json.loads(x) for x in open(self.outs[i])]
        except FileNotFoundError:
            return []

    def held(self, i):
        return max([x["version"] for x in self.records(i) if "version" in x], default=-1)

    def publish(self, step, state):
        """(result, push reports, end time, push start time) of one publish."""
        a = self.a
        if not (a.dist and a.world > 1):
            res = self.trainer.publish(self.pub, step, state)
            t1 = time.time()
            return res, [dataclasses.asdict(res.push)], t1, t1 - res.push.seconds
        results, ends = [None] * a.world, [0.0] * a.world

        def publish_rank(r):
            results[r] = self.trainer.publish(self.pubs[r], step, rank_rows(state, r, a.world))
            ends[r] = time.time()
        run_threads(publish_rank, range(a.world))
        pushes = [dataclasses.asdict(x.push) for x in results if x.push is not None]
        push_start = min(e - x.push.seconds for e, x in zip(ends, results) if x.push is not None)
        return results[0], pushes, max(ends), push_start

    def push_row(self, step):
        """Trains and publishes step `step`; its row once every receiver holds it."""
        state = self.trainer.step(step)
        h.trim_heap()
        rss0 = h.proc_status("self", "VmRSS")
        h.reset_peak()
        t0 = time.time()
        res, pushes, t1, push_start = self.publish(step, state)
        extra_mib = (h.proc_status("self", "VmHWM") - rss0) / h.MIB
        for x in pushes:
            assert x["pushed"] == self.n_rx and not x["dropped"], x
        while not all(self.held(i) >= step for i in range(self.n_rx)):
            time.sleep(0.002)
        applied = max(x["t"] for i in range(self.n_rx) for x in self.records(i)
                      if x.get("version") == step)
        row = {"receivers": self.n_rx, "mode": self.mode,
               "step": step, "changed": res.changed,
               "changed_fraction": res.changed / self.elements, "publish_s": t1 - t0,
               "push_s": applied - push_start, "push_bytes": sum(x["bytes"] for x in pushes),
               "push_confirmed_s": max(x["seconds"] for x in pushes),
               "rank_push_s": [x["seconds"] for x in pushes],
               "rank_push_bytes": [x["bytes"] for x in pushes],
               "push_pack_s": max(x["pack_seconds"] for x in pushes),
               "publish_extra_mib": extra_mib}
        log("rx %d step %d: %.2f%% changed, publish %.3f s, push %.3f s (packed %.3f, "
            "received %.3f s; per pushing rank %s s), %d bytes, publish's extra memory "
            "%.0f MiB" % (
                self.n_rx, step, 100 * row["changed_fraction"], row["publish_s"], row["push_s"],
                row["push_pack_s"], row["push_confirmed_s"],
                "/".join("%.3f" % x for x in row["rank_push_s"]), row["push_bytes"], extra_mib))
        return row

    def baseline_rows(self):
        """The baseline: whole BF16 tensors to every receiver over TCP."""
        import torch
        bf16 = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in self.params.items()}
        socks = []
        for i in range(self.n_rx):
            port = next(x["baseline_port"] for x in self.records(i) if "baseline_port" in x)
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
        rows = []
        # Round 0 warms the receivers' buffers and sockets and is not counted.
        for step in range(0, self.a.steps + 1):
            t0 = time.time()
            done = []

            def send(s):
                for n in self.names:
                    s.sendall(memoryview(bf16[n].view(torch.uint8).numpy()))
                done.append(struct.unpack("<d", s.recv(8))[0])
            run_threads(send, socks)
            base = {"receivers": self.n_rx, "step": step, "baseline_s": max(done) - t0,
                    "baseline_bytes": self.n_rx * self.elements * 2}
            if step > 0:
                rows.append(base)
            log("rx %d baseline %d: %.3f s, %d bytes" % (self.n_rx, step, base["baseline_s"],
                                                         base["baseline_bytes"]))
        for s in socks:
            s.close()
        return rows

    def close(self):
        for pr in self.procs:
            if pr.wait(600) != 0:
                raise SystemExit("a receiver failed")
        self.memory = [x for i in range(self.n_rx) for x in self.records(i) if "staged_max" in x]
        for x in self.pubs or [self.pub]:
            x.close()
        for g in self.groups:
            if g is not None:
                g.close()
        h.remove(self.root)


def rank_rows(state, r, world):
    """The rows [r/world, (r+1)/world) of every tensor of state: rank r's."""
    mine = {}
    for n, st in state.items():
        rows_n = st["param"].shape[0]
        chunk = (rows_n + world - 1) // world
        r0, r1 = min(rows_n, r * chunk), min(rows_n, (r + 1) * chunk)
        mine[n] = {"param": st["param"].detach()[r0:r1], "exp_avg": st["exp_avg"][r0:r1],
                   "exp_avg_sq": st["exp_avg_sq"][r0:r1], "rows": (r0, r1), "step": st["step"]}
    return mine


def print_summary(rows):
    """The push of the last step (AdamW's first steps change more elements;
    the last is the steady state) against the baseline's median."""
    out = []
    for n_rx in sorted({r["receivers"] for r in rows}):
        pr = [r for r in rows if r["receivers"] == n_rx and "push_s" in r
              and r["mode"] == "receivers"]
        br = [r for r in rows if r["receivers"] == n_rx and "baseline_s" in r]
        last = max(pr, key=lambda r: r["step"])
        base = sorted(r["baseline_s"] for r in br)
        push_s, base_s = last["push_s"], base[len(base) // 2]
        pb, bb = last["push_bytes"], br[0]["baseline_bytes"]
        out.append([n_rx, "%.2f%%" % (100 * last["changed_fraction"]), "%.3f s" % last["publish_s"],
                    "%.3f s" % push_s, "%.3f s" % base_s, "%.1fx" % (base_s / push_s),
                    "%.1f MB" % (pb / 1e6), "%.1f MB" % (bb / 1e6), "%.0fx" % (bb / pb)])
    print(h.md_table(["receivers", "changed", "publish", "push", "baseline", "time ratio",
                      "push bytes", "baseline bytes", "bytes ratio"], out))
    servers = [r for r in rows if r.get("mode") == "server" and "push_s" in r]
    if not servers:
        return
    out = []
    for r in servers:
        alone = next(x for x in rows if x.get("mode") == "batches" and "push_s" in x
                     and x["receivers"] == r["receivers"] and x["step"] == r["step"])
        mem = next(x for x in rows if x.get("of") == "server" and x["receivers"] == r["receivers"])
        out.append([r["receivers"], r["step"], "%.2f%%" % (100 * r["changed_fraction"]),
                    "%.3f s" % alone["push_s"], "%.3f s" % r["push_s"],
                    "%.2f" % (r["push_s"] / alone["push_s"]),
                    "%.1f MB" % (max(m["staged_max"] for m in mem["memory"]) / 1e6),
                    "%.0f MB" % (max(m["hwm"] for m in mem["memory"]) / 1e6),
                    "%.0f MB" % (max(m["weights"] for m in mem["memory"]) / 1e6)])
    for x in rows:
        if x.get("of") == "server" and "back_s" in x["memory"][0]:
            last = max((r for r in servers if r["receivers"] == x["receivers"]),
                       key=lambda r: r["step"])
            back = max(m["back_s"] for m in x["memory"])
            fwd = max(m["forward_s"] for m in x["memory"])
            out_moves = "%d ranks: one step back in place %.3f s, forward again %.3f s " \
                "(the slowest rank), against the push of that step %.3f s: %.2fx" % (
                    x["receivers"], back, fwd, last["push_s"], back / last["push_s"])
            print(out_moves)
    print()
    print(h.md_table(["ranks", "step", "changed", "push (on their own)", "push (server)",
                      "server / on their own", "staged per rank (max)", "rank peak RSS",
                      "rank weights"], out))


def main():
    a = parse_args()
    os.environ.setdefault("DTE_LIBRARY", os.path.join(a.build_dir, "sync", "libdte.so"))
    if a.mode == "receiver":
        return receiver(a)
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    import dte
    import torch
    torch.set_num_threads(os.cpu_count())
    c = config_for(h.parse_size(a.size))
    names = shapes(c)
    elements = sum(math.prod(s) for s in names.values())
    log("model: %d layers, %.2f GiB of BF16" % (c["num_hidden_layers"], elements * 2 / 2**30))
    rows = []
    with h.Scratch(prefix="dte-push-bench-", parent=a.work) as work:
        for n_rx in [int(x) for x in a.receivers.split(",")]:
            bench = Bench(a, dte, c, names, work.path, n_rx)
            rows += [bench.push_row(step) for step in range(1, a.steps + 1)]
            rows += bench.baseline_rows()
            bench.close()
            if a.servers:
                for mode in ("batches", "server"):
                    bench = Bench(a, dte, c, names, work.path, n_rx, mode)
                    rows += [bench.push_row(step) for step in range(1, a.steps + 1)]
                    bench.close()
                    rows.append({"receivers": n_rx, "memory": bench.memory, "of": mode})
    print_summary(rows)
    h.write_json(a.json, {"config": c, "rows": rows})


if __name__ == "__main__":
    main()
