#!/opt/dte/venv/bin/python
"""Megatron-style training (tensor parallel x pipeline parallel x data
parallel with the distributed optimizer) that publishes every step from
every rank.

The model lives in Megatron-Core's layout (Transformer Engine names: fused
QKV per GQA group, [gate; up] fc1, vocab padded to 128 x TP): TP rank t of
the TP group holds its shard of every parameter. Within each of the TP
ranks' DP groups, the distributed optimizer cuts the flattened FP32 master
weights of that TP rank's shards into DP equal ranges, across parameter
boundaries; DP rank d keeps only its range of the master weights and AdamW
moments and steps it. After every step, each rank publishes its range of
each MCore shard it touches; dte maps them to Hugging Face tensors element
by element and commits one version.

    python3 tools/examples/launch.py --nproc 4 tools/examples/megatron_publish.py \
        --store /tmp/policy --tp 2 --steps 3
    python3 tools/examples/launch.py --nproc 8 tools/examples/megatron_publish.py \
        --store /tmp/policy --tp 2 --pp 2 --steps 3

With --pp, pipeline stage p holds its share of the layers (the embedding on
the first stage, the output layer and final norm on the last), and its DP
ranks cut only that stage's parameters. With --moe the model is a small
Qwen3-MoE (layer 0 dense, layer 1 with 4 experts) and --ep E splits the
experts over E expert-parallel ranks inside each DP group: EP rank e holds
its experts' shards (keyed with its EP rank) and cuts them over its expert
data-parallel group, while the dense parameters are cut over the whole DP
group as before:

    python3 tools/examples/launch.py --nproc 2 tools/examples/megatron_publish.py \
        --store /tmp/policy --tp 1 --moe --ep 2 --steps 3

At the end the data-parallel ranks gather their master weights, the BF16
shards are converted to Hugging Face with `mcore2hf`, and the latest version
is compared with them tensor by tensor.
"""

import argparse
import json
import os
import subprocess
import sys
import zlib

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "sync", "python"))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(ROOT, "build"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402
import safetensors.torch  # noqa: E402

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
          "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 160,
          "vocab_size": 500, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
MOE_CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
              "intermediate_size": 160, "moe_intermediate_size": 48, "num_experts": 4,
              "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
              "vocab_size": 500, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
LR, WD = 1e-3, 0.1


def mcore_shapes(cfg, tp, ep):
    """{mcore_name: shape of a TP (and, for experts, EP) rank's shard}."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim", h // heads)
    padded = -(-cfg["vocab_size"] // (128 * tp)) * 128 * tp
    qkv = (heads + 2 * cfg["num_key_value_heads"]) * hd
    moe = cfg["model_type"] == "qwen3_moe"
    shapes = {"embedding.word_embeddings.weight": (padded // tp, h),
              "output_layer.weight": (padded // tp, h),
              "decoder.final_layernorm.weight": (h,)}
    for layer in range(cfg["num_hidden_layers"]):
        m = "decoder.layers.%d." % layer
        shapes.update({
            m + "self_attention.linear_qkv.layer_norm_weight": (h,),
            m + "self_attention.linear_qkv.weight": (qkv // tp, h),
            m + "self_attention.linear_proj.weight": (h, heads * hd // tp)})
        if moe:
            shapes.update({m + "self_attention.q_layernorm.weight": (hd,),
                           m + "self_attention.k_layernorm.weight": (hd,)})
        if not moe or layer in cfg["mlp_only_layers"]:
            shapes.update({
                m + "mlp.linear_fc1.layer_norm_weight": (h,),
                m + "mlp.linear_fc1.weight": (2 * cfg["intermediate_size"] // tp, h),
                m + "mlp.linear_fc2.weight": (h, cfg["intermediate_size"] // tp)})
            continue
        f = cfg["moe_intermediate_size"]
        shapes.update({m + "pre_mlp_layernorm.weight": (h,),
                       m + "mlp.router.weight": (cfg["num_experts"], h)})
        for j in range(cfg["num_experts"] // ep):
            x = m + "mlp.experts.local_experts.%d." % j
            shapes.update({x + "linear_fc1.weight": (2 * f // tp, h),
                           x + "linear_fc2.weight": (h, f // tp)})
    return shapes


def is_expert(name):
    return ".local_experts." in name


def stage_of(name, pp, cfg):
    """The pipeline stage holding an MCore parameter: layers split evenly,
    the embedding on the first stage, the output layer and final norm on the
    last."""
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        return layer * pp // cfg["num_hidden_layers"]
    return 0 if name.startswith("embedding.") else pp - 1


def is_norm(name):
    return name.endswith("layernorm.weight") or name.endswith("layer_norm_weight")


def init_value(name, shape, tp_rank, ep_rank):
    """Seeded by name and the ranks that split it: every DP replica and, for
    norms and the router, every TP rank agree."""
    split = 0 if is_norm(name) or name.endswith("router.weight") else tp_rank
    seed = zlib.crc32(name.encode()) + split + (1000 * ep_rank if is_expert(name) else 0)
    g = torch.Generator().manual_seed(seed)
    return 1.0 + 0.02 * torch.randn(shape, generator=g) if is_norm(name) else \
        0.02 * torch.randn(shape, generator=g)


def save_mcore(directory, cfg, tp_rank, ep_rank, shards):
    """A Megatron-Core checkpoint file of one TP and EP rank, as mcore2hf
    reads it."""
    os.makedirs(directory, exist_ok=True)
    safetensors.torch.save_file({n: t.to(torch.bfloat16).contiguous() for n, t in shards.items()},
                                os.path.join(directory, "mp_rank_%02d_%03d.safetensors"
                                             % (tp_rank, ep_rank)), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)


def mcore2hf(src, dst, tp, ep):
    subprocess.run([os.path.join(BUILD, "tools", "mcore2hf"), "--tp", str(tp), "--ep", str(ep),
                    src, dst], check=True, stdout=subprocess.DEVNULL)


class FlatBuffer:
    """The distributed optimizer's view of some shards: their flattened FP32
    master weights, cut into equal ranges over a data-parallel group; this
    rank keeps its range only (`master`)."""

    def __init__(self, names, weights, group, group_rank, group_size):
        self.names, self.group, self.size = names, group, group_size
        self.numel = {n: weights[n].numel() for n in names}
        self.offsets, at = {}, 0
        for n in names:
            self.offsets[n] = at
            at += self.numel[n]
        self.total, self.per = at, -(-at // group_size)
        self.lo = min(at, self.per * group_rank)
        self.hi = min(at, self.lo + self.per)
        flat = torch.cat([weights[n].reshape(-1) for n in names]) if names else torch.empty(0)
        self.master = torch.nn.Parameter(flat[self.lo:self.hi].clone())

    def pieces(self, opt, tp_rank, ep_rank):
        """{(name, tp_rank, ep_rank): this rank's range of the shard}."""
        st, out = opt.state[self.master], {}
        for n in self.names:
            b = max(self.lo, self.offsets[n])
            e = min(self.hi, self.offsets[n] + self.numel[n])
            if b < e:
                out[(n, tp_rank, ep_rank)] = {
                    "param": self.master.detach()[b - self.lo:e - self.lo],
                    "exp_avg": st["exp_avg"][b - self.lo:e - self.lo],
                    "exp_avg_sq": st["exp_avg_sq"][b - self.lo:e - self.lo],
                    "step": int(st["step"]), "flat": (b - self.offsets[n], e - self.offsets[n])}
        return out

    def gather(self, shapes):
        """Every shard whole (a collective of the group)."""
        if self.total == 0:
            return {}
        pieces = [torch.empty(self.per) for _ in range(self.size)]
        mine = torch.zeros(self.per)
        mine[:self.hi - self.lo] = self.master.detach()
        dist.all_gather(pieces, mine, group=self.group)
        full = torch.cat(pieces)[:self.total]
        return {n: full[self.offsets[n]:self.offsets[n] + self.numel[n]].reshape(shapes[n])
                for n in self.names}


class Topology:
    """This rank's place in Megatron's rank order: TP fastest, then PP, then
    DP; EP ranks are consecutive DP ranks."""

    def __init__(self, a, rank, world):
        self.tp, self.pp, self.ep = a.tp, a.pp, a.ep
        tp, pp, ep = self.tp, self.pp, self.ep
        if world % (tp * pp) or (world // (tp * pp)) % ep or (ep > 1 and not a.moe):
            sys.exit("world size %d: needs a multiple of tp x pp = %d whose DP size the EP size "
                     "%d divides (EP only with --moe)" % (world, tp * pp, ep))
        self.rank, self.world, self.dp = rank, world, world // (tp * pp)
        self.tp_rank, self.pp_rank, self.dp_rank = rank % tp, (rank // tp) % pp, rank // (tp * pp)
        self.ep_rank, self.edp_rank = self.dp_rank % ep, self.dp_rank // ep

    def ranks_of(self, t, p, ds):
        return [t + self.tp * p + self.tp * self.pp * d for d in ds]

    def groups(self):
        """The DP group of every (TP rank, stage) and the expert-DP group of
        every (TP rank, stage, EP rank); every rank creates them all."""
        groups = {}
        for p in range(self.pp):
            for t in range(self.tp):
                groups[("dp", t, p)] = dist.new_group(self.ranks_of(t, p, range(self.dp)))
                for e in range(self.ep):
                    groups[("edp", t, p, e)] = dist.new_group(
                        self.ranks_of(t, p, range(e, self.dp, self.ep)))
        return groups


def import_initial(store, cfg, topo, shapes, work):
    """Version 0: the initial checkpoint of every TP and EP rank, every
    stage's parameters (only to import it; a real job starts from its own
    checkpoint), converted to Hugging Face and imported by rank 0."""
    if topo.pp_rank == 0 and topo.dp_rank == topo.ep_rank:
        save_mcore(os.path.join(work, "init-mcore"), cfg, topo.tp_rank, topo.ep_rank,
                   {n: init_value(n, shapes[n], topo.tp_rank, topo.ep_rank) for n in shapes})
    dist.barrier()
    if topo.rank == 0:
        mcore2hf(os.path.join(work, "init-mcore"), os.path.join(work, "init-hf"), topo.tp,
                 topo.ep)
        with dte.Publisher(store) as p:
            print("imported version", p.import_checkpoint(os.path.join(work, "init-hf")))
    dist.barrier()


def train_and_publish(a, cfg, topo, shapes):
    """Trains --steps steps, publishing each; returns the stage's dense and
    expert FlatBuffers."""
    groups = topo.groups()
    tp_rank, pp_rank, ep_rank = topo.tp_rank, topo.pp_rank, topo.ep_rank
    # This stage's parameters: dense ones cut over the DP group, this EP
    # rank's experts over its expert-DP group.
    mine = sorted(n for n in shapes if stage_of(n, topo.pp, cfg) == pp_rank)
    weights = {n: init_value(n, shapes[n], tp_rank, ep_rank) for n in mine}
    dense = FlatBuffer([n for n in mine if not is_expert(n)], weights,
                       groups[("dp", tp_rank, pp_rank)], topo.dp_rank, topo.dp)
    experts = FlatBuffer([n for n in mine if is_expert(n)], weights,
                         groups[("edp", tp_rank, pp_rank, ep_rank)], topo.edp_rank,
                         topo.dp // topo.ep)
    opt = torch.optim.AdamW([dense.master, experts.master], lr=LR, weight_decay=WD,
                            fused=True)
    pub = dte.Publisher(a.store, converter={"config": cfg, "tp": topo.tp, "ep": topo.ep},
                        rank=topo.rank, world_size=topo.world)
    for step in range(1, a.steps + 1):
        # Stand-ins for the reduced gradients, the same on every replica.
        for buf, seed in ((dense, 1000 * step + 10 * tp_rank + pp_rank),
                          (experts, 2000 * step + 100 * ep_rank + 10 * tp_rank + pp_rank)):
            g = torch.Generator().manual_seed(seed)
            buf.master.grad = (torch.randn(buf.total, generator=g) * 1e-2)[buf.lo:buf.hi]
        opt.step()
        params = dense.pieces(opt, tp_rank, 0)
        params.update(experts.pieces(opt, tp_rank, ep_rank))
        r = pub.publish_adamw(step=step, params=params, lr=LR, weight_decay=WD)
        if topo.rank == 0:
            print("step %d: version %d, %d changed elements" % (step, r.version, r.changed))
    return dense, experts


def save_final(cfg, topo, shapes, dense, experts, work):
    """The master weights gathered over the DP groups, saved per stage."""
    stage_dir = os.path.join(work, "final-stage%d" % topo.pp_rank)
    whole = dense.gather(shapes)
    if topo.dp_rank == 0:
        save_mcore(os.path.join(stage_dir, "dense"), cfg, topo.tp_rank, 0, whole)
    whole = experts.gather(shapes)
    if topo.edp_rank == 0:
        save_mcore(os.path.join(stage_dir, "experts"), cfg, topo.tp_rank, topo.ep_rank, whole)
    dist.barrier()


def latest_matches(store, cfg, topo, work):
    """Rank 0: whether the latest version equals the stages' final weights
    merged and converted to Hugging Face, tensor by tensor."""
    for t in range(topo.tp):
        for e in range(topo.ep):
            merged = {}
            for p in range(topo.pp):
                for part, pe in (("dense", 0), ("experts", e)):
                    merged.update(safetensors.torch.load_file(os.path.join(
                        work, "final-stage%d" % p, part,
                        "mp_rank_%02d_%03d.safetensors" % (t, pe))))
            save_mcore(os.path.join(work, "final-mcore"), cfg, t, e, merged)
    mcore2hf(os.path.join(work, "final-mcore"), os.path.join(work, "final-hf"), topo.tp, topo.ep)
    reader = dte.StoreReader(store)
    ok = True
    for f in sorted(os.listdir(os.path.join(work, "final-hf"))):
        if not f.endswith(".safetensors"):
            continue
        expected = safetensors.torch.load_file(os.path.join(work, "final-hf", f))
        for n, t in expected.items():
            got = torch.empty(t.shape, dtype=torch.bfloat16)
            reader.read_into(reader.latest(), n, got)
            ok &= bool(torch.equal(got.view(torch.int16), t.view(torch.int16)))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE model")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (with --moe)")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    topo = Topology(a, dist.get_rank(), dist.get_world_size())
    cfg = MOE_CONFIG if a.moe else CONFIG
    shapes = mcore_shapes(cfg, topo.tp, topo.ep)
    work = a.store + ".work"
    import_initial(a.store, cfg, topo, shapes, work)
    dense, experts = train_and_publish(a, cfg, topo, shapes)
    # Check: gather the master weights, convert to Hugging Face and compare
    # with the latest version.
    save_final(cfg, topo, shapes, dense, experts, work)
    ok = True
    if topo.rank == 0:
        ok = latest_matches(a.store, cfg, topo, work)
        print("latest version equals the trainer's weights converted to Hugging Face:", ok)
    flags = [None] * topo.world
    dist.all_gather_object(flags, ok)
    dist.destroy_process_group()
    sys.exit(0 if all(flags) else 1)


if __name__ == "__main__":
    main()
