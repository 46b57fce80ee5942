"""One rank of a sharded trainer for tests/py/test_dist_publish.py.

Every rank builds the same small model, runs real torch.optim.AdamW steps
(gradients from a seeded generator, two param groups) and publishes the
state it holds under a layout (FSDP2 row shards, a flat buffer cut across
tensor boundaries, replicas, hybrid row shards with replicas, or the same
as DTensors on a 1- or 2-dimensional device mesh) through
dte.Publisher over a torch.distributed gloo group (or dte's TCP transport).
Steps already in the store are replayed without publishing, so a restarted
job resumes where the store is. With "ref", rank 0 also publishes every step
with the single-process publisher into a second store, and reads every
version it published back, comparing it with param.to(torch.bfloat16).

Usage: python3 dist_worker.py CONFIG_JSON RANK; writes CONFIG["out"]-RANK.json.
"""

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402
import safetensors.torch  # noqa: E402

SHAPES = {
    "model.embed_tokens.weight": (300, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 170),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (300, 64),
}
LR, NORM_LR, WD = 2e-3, 5e-3, 0.1


def build(device="cpu"):
    """The model and its optimizer; on a CUDA device, torch's default CUDA
    AdamW (foreach) steps it there."""
    torch.manual_seed(0)
    params = {}
    for name, shape in SHAPES.items():
        if name.endswith("norm.weight"):
            params[name] = torch.nn.Parameter(1.0 + 0.02 * torch.randn(shape))
        else:
            params[name] = torch.nn.Parameter(0.02 * torch.randn(shape))
    if device != "cpu":
        params = {n: torch.nn.Parameter(p.detach().to(device)) for n, p in params.items()}
    norms = [p for n, p in params.items() if n.endswith("norm.weight")]
    mats = [p for n, p in params.items() if not n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": mats, "lr": LR, "weight_decay": WD},
                             {"params": norms, "lr": NORM_LR, "weight_decay": 0.0}],
                            betas=(0.9, 0.95), eps=1e-8, foreach=device != "cpu")
    return params, opt


def train_step(params, opt, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params.values():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.device)
    opt.step()


def group_of(opt, p):
    for grp in opt.param_groups:
        if any(q is p for q in grp["params"]):
            return grp
    raise KeyError("not a parameter")


def state(opt, name, p, sl=None):
    st = opt.state[p]
    grp = group_of(opt, p)
    flat = sl is not None and sl[0] == "flat"

    def cut(t):
        t = t.detach()
        if sl is None:
            return t
        return t.reshape(-1)[sl[1]:sl[2]] if flat else t[sl[1]:sl[2]]

    d = {"param": cut(p), "exp_avg": cut(st["exp_avg"]), "exp_avg_sq": cut(st["exp_avg_sq"]),
         "step": int(st["step"].item()), "lr": grp["lr"], "weight_decay": grp["weight_decay"]}
    if sl is not None:
        d["flat" if flat else "rows"] = (sl[1], sl[2])
    return d


class Shard:
    """torch.distributed.tensor.Shard's interface (Debian's torch 1.13 has no
    DTensor)."""

    def __init__(self, dim):
        self.dim = dim

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def is_replicate(self):
        return False

    def __repr__(self):
        return "Shard(dim=%d)" % self.dim


class Replicate:
    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return True


class Mesh:
    def __init__(self, coordinate, sizes):
        self.coordinate, self.sizes = coordinate, sizes

    def get_coordinate(self):
        return list(self.coordinate)

    def size(self, dim):
        return self.sizes[dim]


class DTensor:
    """A DTensor's interface over a local shard: global shape, mesh,
    placements, to_local()."""

    def __init__(self, local, shape, mesh, placements):
        self._local, self.shape = local, tuple(shape)
        self.device_mesh, self.placements = mesh, tuple(placements)

    def to_local(self):
        return self._local


def dtensor_state(opt, name, p, mesh, placements):
    """The param and moments as DTensors holding this rank's rows: each
    Shard(0) mesh dimension takes its torch.chunk of the rows left."""
    rows = torch.arange(p.shape[0])
    for dim, pl in enumerate(placements):
        if pl.is_shard():
            chunks = rows.chunk(mesh.sizes[dim])
            c = mesh.coordinate[dim]
            rows = chunks[c] if c < len(chunks) else rows[:0]
    r0 = int(rows[0]) if len(rows) else 0
    d = state(opt, name, p, ("rows", r0, r0 + len(rows)))
    del d["rows"]
    for k in ("param", "exp_avg", "exp_avg_sq"):
        d[k] = DTensor(d[k], p.shape, mesh, placements)
    return d


def held(layout, rank, world, params, opt):
    """What this rank holds: {name: state or [states]}."""
    out = {}
    if layout == "replicated":
        return {n: state(opt, n, p) for n, p in params.items()}
    if layout == "dtensor":
        # FSDP2 (one mesh dimension) or, on 4 ranks, a 2 x 2 mesh: HSDP
        # (Replicate, Shard(0)) and doubly sharded (Shard(0), Shard(0))
        # tensors in turn; norms replicated everywhere.
        mesh = Mesh((rank // 2, rank % 2), (2, 2)) if world == 4 else Mesh((rank,), (world,))
        for i, (n, p) in enumerate(params.items()):
            if n.endswith("norm.weight"):
                pls = [Replicate()] * len(mesh.sizes)
            elif len(mesh.sizes) == 2:
                pls = [Replicate(), Shard(0)] if i % 2 == 0 else [Shard(0), Shard(0)]
            else:
                pls = [Shard(0)]
            out[n] = dtensor_state(opt, n, p, mesh, pls)
        return out
    if layout in ("rows", "hybrid", "disagree"):
        r, w = (rank % 2, 2) if layout == "hybrid" else (rank, world)
        for n, p in params.items():
            r0, r1 = dte.chunk_rows(p.shape[0], r, w)
            out[n] = state(opt, n, p, ("rows", r0, r1))
        return out
    assert layout == "flat"
    total = sum(p.numel() for p in params.values())
    per = -(-total // world)
    lo, hi = min(total, per * rank), min(total, per * (rank + 1))
    at = 0
    for n, p in params.items():
        b, e = max(lo, at), min(hi, at + p.numel())
        if b < e:
            out[n] = state(opt, n, p, ("flat", b - at, e - at))
        at += p.numel()
    return out


def arm_kill(point, step_now):
    """Makes this process SIGKILL itself at `point` = [step, call, after]:
    right before (after=0) or after (after=1) its call-th exchange of the
    publish of `step`; call -1: right before that publish."""
    kstep, kcall, kafter = point
    run = dte._exchange._TorchExchange._call
    calls = {"n": 0}

    def dying_run(self, *args):
        if step_now[0] != kstep:
            return run(self, *args)
        n = calls["n"]
        calls["n"] += 1
        if n == kcall and not kafter:
            os.kill(os.getpid(), signal.SIGKILL)
        rc = run(self, *args)
        if n == kcall and kafter:
            os.kill(os.getpid(), signal.SIGKILL)
        return rc

    dte._exchange._TorchExchange._call = dying_run


def main():
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    world = cfg["world"]
    result = {"rank": rank, "steps": [], "error": None}
    out_path = "%s-%d.json" % (cfg["out"], rank)
    try:
        timeout = datetime.timedelta(seconds=cfg.get("timeout", 30))
        dist.init_process_group("gloo", init_method="file://" + cfg["init"], rank=rank,
                                world_size=world, timeout=timeout)
        # "cuda": train on the GPU with torch's CUDA AdamW; every rank's
        # state stays there and is published from device memory.
        device = "cuda" if cfg.get("cuda") else "cpu"
        order = "torch_cuda_foreach" if cfg.get("cuda") else "torch_cpu"
        params, opt = build(device)
        store = cfg["store"]
        fresh = (cfg.get("import", False) if store.startswith("s3://")
                 else not os.path.exists(os.path.join(store, "dte-store.json")))
        if rank == 0 and fresh:
            ckpt = os.path.join(cfg["work"], "init")
            os.makedirs(ckpt, exist_ok=True)
            safetensors.torch.save_file(
                {n: p.detach().cpu().to(torch.bfloat16).contiguous() for n, p in params.items()},
                os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(ckpt, "config.json"), "w") as f:
                f.write('{"model_type": "llama"}\n')
            for s in [store] + ([cfg["ref"]] if cfg.get("ref") else []):
                with dte.Publisher(s) as p:
                    p.import_checkpoint(ckpt)
        dist.barrier()
        step_now = [0]
        kill = cfg.get("kill")
        if kill and kill[0] == rank:
            arm_kill(kill[1:], step_now)
        kwargs = {"rank": rank, "world_size": world}
        if cfg.get("transport") == "tcp":
            kwargs["rendezvous"] = cfg["rendezvous"]
            kwargs["timeout"] = cfg.get("timeout", 30)
        elif cfg.get("transport") == "store":
            kwargs["job"] = cfg["job"]
            kwargs["timeout"] = cfg.get("timeout", 30)
        if cfg.get("cache"):
            kwargs["cache_dir"] = os.path.join(cfg["work"], "cache-rank%d" % rank)
        pub = dte.Publisher(store, **kwargs)
        if cfg.get("transport") == "staged":
            # What an NCCL group does (every message through a separate
            # buffer, received ones copied back), on gloo and the CPU.
            pub._exchange.device = torch.device("cpu")
        latest = dte.StoreReader(store).latest()
        ref = dte.Publisher(cfg["ref"]) if cfg.get("ref") and rank == 0 else None
        reader = dte.StoreReader(store) if rank == 0 else None
        for step in range(1, cfg["steps"] + 1):
            train_step(params, opt, step)
            if step <= latest:
                continue  # already published: replay only
            if cfg.get("stall") == [rank, step]:
                time.sleep(3600)  # a hung rank: the test kills it once the others exit
            step_now[0] = step
            if kill and kill[0] == rank and kill[1] == step and kill[2] == -1:
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.time()
            lr = LR * 2 if cfg["layout"] == "disagree" and rank == 1 else LR
            r = pub.publish_adamw(step=step, params=held(cfg["layout"], rank, world, params, opt),
                                  lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD,
                                  order=order)
            rec = {"step": step, "version": r.version, "changed": r.changed,
                   "seconds": time.time() - t0}
            if ref is not None:
                if device == "cpu":
                    rr = ref.publish_torch_adamw(opt, params)
                else:  # the single-process publisher reads host copies
                    rr = ref.publish_adamw(
                        step=step, params={n: {k: v.cpu() if torch.is_tensor(v) else v
                                               for k, v in state(opt, n, p).items()}
                                           for n, p in params.items()},
                        lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD, order=order)
                rec["ref_version"], rec["ref_changed"] = rr.version, rr.changed
            if reader is not None:
                bad = 0
                for n, p in params.items():
                    got = torch.empty(p.shape, dtype=torch.bfloat16)
                    reader.read_into(r.version, n, got)
                    bad += int((got.view(torch.int16) !=
                                p.detach().cpu().to(torch.bfloat16).view(torch.int16)).sum())
                rec["mismatches"] = bad
            result["steps"].append(rec)
        result["metrics"] = pub.metrics_text()
        pub.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = "%s: %s" % (type(e).__name__, e)
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    os._exit(0)  # do not wait on a process group whose peers died


if __name__ == "__main__":
    main()
