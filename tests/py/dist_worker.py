"""One rank of a sharded trainer for tests/py/test_dist_publish.py.

Two trainers, joined in a torch.distributed gloo group, run real
torch.optim.AdamW steps and publish the state each rank holds through
dte.Publisher (over the group, dte's TCP transport or the store):

- layouts "fsdp2" and "hsdp": a real FSDP2 trainer of a small transformers
  Llama (tests/py/fsdp2_trainer.py), whose DTensor parameters and moments
  go to Publisher.publish_torch_adamw as they are; it saves and loads
  torch.distributed.checkpoint (DCP) checkpoints;
- ParamsTrainer's layouts: a dict of parameters every rank holds whole
  (gradients from a seeded generator), of which each rank hands over one
  cut: row shards ("rows", uneven, with empty ones), a flat buffer cut
  across tensor boundaries ("flat": ZeRO, Megatron's distributed
  optimizer), replicas ("replicated"), row shards with replicas ("hybrid").

A restarted job loads the newest complete DCP checkpoint (if any), replays
the steps up to the store's latest version without publishing, checks that
the latest version is the trainer's weights bit for bit, and publishes the
next; a job whose checkpoint is behind the store and that may not replay
("replay": false) refuses, naming both numbers. With "ref", rank 0 also
publishes every step with the single-process publisher into a second store,
from the whole state; every step rank 0 reads the version back and
compares it with the full parameters' BF16.

Usage: python dist_worker.py CONFIG_JSON; starts CONFIG["world"] ranks, each
writing CONFIG["out"]-RANK.json.
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
BETAS, EPS = (0.9, 0.95), 1e-8


class ParamsTrainer:
    """SHAPES as parameters every rank holds whole, trained alike on every
    rank; publish() hands over the cut of `layout` for this rank. On the
    CPU the fused AdamW steps it (the CPU kernel the engine models); on a
    CUDA device, torch's default CUDA AdamW (foreach) steps it there and
    the state is published from device memory. Not thread-safe."""

    def __init__(self, layout, rank, world, device="cpu"):
        self.layout, self.rank, self.world, self.device = layout, rank, world, device
        self.order = "torch_cuda_foreach" if device != "cpu" else "torch_cpu"
        torch.manual_seed(0)
        params = {}
        for name, shape in SHAPES.items():
            if name.endswith("norm.weight"):
                params[name] = torch.nn.Parameter(1.0 + 0.02 * torch.randn(shape))
            else:
                params[name] = torch.nn.Parameter(0.02 * torch.randn(shape))
        if device != "cpu":
            params = {n: torch.nn.Parameter(p.detach().to(device)) for n, p in params.items()}
        self.params = params
        norms = [p for n, p in params.items() if n.endswith("norm.weight")]
        mats = [p for n, p in params.items() if not n.endswith("norm.weight")]
        self.opt = torch.optim.AdamW([{"params": mats, "lr": LR, "weight_decay": WD},
                                      {"params": norms, "lr": NORM_LR, "weight_decay": 0.0}],
                                     betas=BETAS, eps=EPS, foreach=device != "cpu",
                                     fused=device == "cpu")

    def save_initial(self, directory):
        os.makedirs(directory, exist_ok=True)
        safetensors.torch.save_file(
            {n: p.detach().cpu().to(torch.bfloat16).contiguous() for n, p in self.params.items()},
            os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write('{"model_type": "llama"}\n')

    def train_step(self, step):
        g = torch.Generator().manual_seed(1000 + step)
        for p in self.params.values():
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.device)
        self.opt.step()

    def publish(self, pub):
        lr = LR * 2 if self.layout == "disagree" and self.rank == 1 else LR
        return pub.publish_adamw(step=self.step(), params=self.held(), lr=lr, betas=BETAS,
                                 eps=EPS, weight_decay=WD, order=self.order)

    def step(self):
        return int(self.opt.state[self.params["lm_head.weight"]]["step"].item())

    def full_params(self):
        """{name: parameter}, whole and in host memory."""
        return {n: p.detach().cpu() for n, p in self.params.items()}

    def full_state(self):
        """{name: state}, whole and in host memory."""
        return {n: {k: v.cpu() if torch.is_tensor(v) else v for k, v in self.state(p).items()}
                for n, p in self.params.items()}

    def state(self, p, sl=None):
        st = self.opt.state[p]
        grp = next(g for g in self.opt.param_groups if any(q is p for q in g["params"]))
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

    def held(self):
        """What this rank holds: {name: state}."""
        if self.layout == "replicated":
            return {n: self.state(p) for n, p in self.params.items()}
        if self.layout in ("rows", "hybrid", "disagree"):
            r, w = (self.rank % 2, 2) if self.layout == "hybrid" else (self.rank, self.world)
            return {n: self.state(p, ("rows",) + dte.chunk_rows(p.shape[0], r, w))
                    for n, p in self.params.items()}
        assert self.layout == "flat"
        total = sum(p.numel() for p in self.params.values())
        per = -(-total // self.world)
        lo, hi = min(total, per * self.rank), min(total, per * (self.rank + 1))
        out, at = {}, 0
        for n, p in self.params.items():
            b, e = max(lo, at), min(hi, at + p.numel())
            if b < e:
                out[n] = self.state(p, ("flat", b - at, e - at))
            at += p.numel()
        return out


def make_trainer(cfg, rank, world):
    if cfg["layout"] in ("fsdp2", "hsdp"):
        from fsdp2_trainer import Fsdp2Trainer
        return Fsdp2Trainer(cfg["layout"], world, cfg["model"])
    return ParamsTrainer(cfg["layout"], rank, world, "cuda" if cfg.get("cuda") else "cpu")


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


def newest_checkpoint(directory):
    """(step, path) of the newest complete DCP checkpoint under directory
    (step-N/ with its .metadata, which DCP writes last), or (0, None)."""
    best = (0, None)
    for name in os.listdir(directory) if directory and os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if name.startswith("step-") and os.path.exists(os.path.join(path, ".metadata")):
            best = max(best, (int(name[5:]), path))
    return best


def mismatches(reader, version, params):
    """BF16 elements of `version` that differ from the whole params'."""
    bad = 0
    for n, p in params.items():
        want = p.to(torch.bfloat16)
        got = torch.empty(want.shape, dtype=torch.bfloat16)
        reader.read_into(version, n, got)
        bad += int((got.view(torch.int16) != want.view(torch.int16)).sum())
    return bad


def resume(cfg, trainer, store):
    """(checkpoint step, store's latest version) of a (re)started job;
    refuses a checkpoint the store is behind, or ahead of when the job may
    not replay."""
    start, path = newest_checkpoint(cfg.get("checkpoints"))
    if path is not None:
        loaded = trainer.load(path)
        assert loaded == start, (loaded, path)
    latest = dte.StoreReader(store).latest()
    if latest < start:
        raise RuntimeError("store %s is at version %d, behind the checkpoint of step %d"
                           % (store, latest, start))
    if latest > start and not cfg.get("replay", True):
        raise RuntimeError("store %s is at version %d, ahead of the checkpoint of step %d: "
                           "publishing step %d would commit it on top of version %d"
                           % (store, latest, start, start + 1, latest))
    return start, latest


def check_latest(trainer, store, latest):
    """The store's latest version must be this trainer's weights."""
    bad = mismatches(dte.StoreReader(store), latest, trainer.full_params())
    if bad:
        raise RuntimeError("version %d of store %s differs from the trainer's weights after "
                           "step %d in %d elements" % (latest, store, latest, bad))


def import_initial(cfg, trainer, rank):
    store = cfg["store"]
    fresh = (cfg.get("import", False) if store.startswith("s3://")
             else not os.path.exists(os.path.join(store, "dte-store.json")))
    if rank == 0 and fresh:
        ckpt = os.path.join(cfg["work"], "init")
        trainer.save_initial(ckpt)
        for s in [store] + ([cfg["ref"]] if cfg.get("ref") else []):
            with dte.Publisher(s) as p:
                p.import_checkpoint(ckpt)
    dist.barrier()


def open_publisher(cfg, rank, world):
    kwargs = {"rank": rank, "world_size": world}
    if cfg.get("transport") == "tcp":
        kwargs["rendezvous"] = cfg["rendezvous"]
        kwargs["timeout"] = cfg.get("timeout", 30)
    elif cfg.get("transport") == "store":
        kwargs["job"] = cfg["job"]
        kwargs["timeout"] = cfg.get("timeout", 30)
    if cfg.get("cache"):
        kwargs["cache_dir"] = os.path.join(cfg["work"], "cache-rank%d" % rank)
    pub = dte.Publisher(cfg["store"], **kwargs)
    if cfg.get("transport") == "staged":
        # What an NCCL group does (every message through a separate
        # buffer, received ones copied back), on gloo and the CPU.
        pub._exchange.device = torch.device("cpu")
    return pub


def reference(ref, trainer, full, step):
    """Publishes the whole state with the single-process publisher (which
    reads host memory), with the trainer's hyper-parameters."""
    g = trainer.opt.param_groups[0]
    return ref.publish_adamw(step=step, params=full, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                             weight_decay=g["weight_decay"], order=trainer.order)


def run(cfg, rank, world, result):
    timeout = datetime.timedelta(seconds=cfg.get("timeout", 30))
    dist.init_process_group("gloo", init_method="file://" + cfg["init"], rank=rank,
                            world_size=world, timeout=timeout)
    trainer = make_trainer(cfg, rank, world)
    store = cfg["store"]
    import_initial(cfg, trainer, rank)
    start, latest = resume(cfg, trainer, store)
    result["resumed"] = [start, latest]
    if hasattr(trainer, "local_shapes"):
        result["local_shapes"] = trainer.local_shapes()
    step_now = [0]
    kill = cfg.get("kill")
    if kill and kill[0] == rank:
        arm_kill(kill[1:], step_now)
    pub = open_publisher(cfg, rank, world)
    ref = dte.Publisher(cfg["ref"]) if cfg.get("ref") and rank == 0 else None
    reader = dte.StoreReader(store) if rank == 0 else None
    if latest == start:
        check_latest(trainer, store, latest)
    for step in range(start + 1, cfg["steps"] + 1):
        trainer.train_step(step)
        if step == latest:  # replayed up to the store's latest version
            check_latest(trainer, store, latest)
        if step <= latest:
            continue
        if cfg.get("stall") == [rank, step]:
            time.sleep(3600)  # a hung rank: launch() kills it once the others exit
        step_now[0] = step
        if kill and kill[0] == rank and kill[1] == step and kill[2] == -1:
            os.kill(os.getpid(), signal.SIGKILL)
        publish_step(trainer, pub, ref, reader, step, result["steps"])
        if step in cfg.get("save_at", []):
            trainer.save(os.path.join(cfg["checkpoints"], "step-%d" % step))
    result["metrics"] = pub.metrics_text()
    pub.close()


def publish_step(trainer, pub, ref, reader, step, records):
    """Publishes the step just taken and appends its record to records;
    with ref and reader (rank 0), also publishes the whole state into the
    reference store and reads the version back into the record."""
    t0 = time.time()
    r = trainer.publish(pub)
    rec = {"step": step, "version": r.version, "changed": r.changed, "seconds": time.time() - t0}
    records.append(rec)  # kept if a peer dies in the gather below
    full = trainer.full_state()  # a collective for the FSDP2 trainer
    if ref is not None:
        rr = reference(ref, trainer, full, step)
        rec["ref_version"], rec["ref_changed"] = rr.version, rr.changed
    if reader is not None:
        rec["mismatches"] = mismatches(reader, r.version,
                                       {n: d["param"] for n, d in full.items()})


def rank_main(cfg, rank):
    """One rank, in a child process of launch(): writes its result, exits."""
    result = {"rank": rank, "steps": [], "error": None}
    out_path = "%s-%d.json" % (cfg["out"], rank)
    try:
        run(cfg, rank, cfg["world"], result)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = "%s: %s" % (type(e).__name__, e)
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    os._exit(0)  # do not wait on a process group whose peers died


def launch(cfg):
    """Forks every rank once the modules are imported (each process
    imports torch and transformers once per job, not once per rank; no
    thread, process group or CUDA context exists yet) and waits for them. A
    rank the config stalls is killed once every other rank has exited:
    they must fail on their own timeout, and no fixed delay guesses how
    long that takes."""
    if cfg["layout"] in ("fsdp2", "hsdp"):
        import fsdp2_trainer  # noqa: F401
    ranks = {}
    for rank in range(cfg["world"]):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            rank_main(cfg, rank)
        ranks[pid] = rank
    stalled = (cfg.get("stall") or [None])[0]
    while ranks:
        if set(ranks.values()) == {stalled}:
            os.kill(next(iter(ranks)), signal.SIGKILL)
        pid, _ = os.wait()
        ranks.pop(pid, None)


if __name__ == "__main__":
    launch(json.load(open(sys.argv[1])))
