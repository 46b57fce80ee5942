#!/usr/bin/python3
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
ranks cut only that stage's parameters.

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


def mcore_shapes(tp):
    """{mcore_name: shape of TP rank's shard} and the replicated names."""
    c = CONFIG
    h, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    padded = -(-c["vocab_size"] // (128 * tp)) * 128 * tp
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    shapes = {"embedding.word_embeddings.weight": (padded // tp, h),
              "output_layer.weight": (padded // tp, h),
              "decoder.final_layernorm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        m = "decoder.layers.%d." % layer
        shapes.update({
            m + "self_attention.linear_qkv.layer_norm_weight": (h,),
            m + "self_attention.linear_qkv.weight": (qkv // tp, h),
            m + "self_attention.linear_proj.weight": (h, c["num_attention_heads"] * hd // tp),
            m + "mlp.linear_fc1.layer_norm_weight": (h,),
            m + "mlp.linear_fc1.weight": (2 * c["intermediate_size"] // tp, h),
            m + "mlp.linear_fc2.weight": (h, c["intermediate_size"] // tp)})
    return shapes


def stage_of(name, pp):
    """The pipeline stage holding an MCore parameter: layers split evenly,
    the embedding on the first stage, the output layer and final norm on the
    last."""
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        return layer * pp // CONFIG["num_hidden_layers"]
    return 0 if name.startswith("embedding.") else pp - 1


def init_value(name, shape, tp_rank):
    """Seeded by name (and TP rank, for split tensors): every DP replica and,
    for norms, every TP rank agree."""
    norm = name.endswith("layernorm.weight") or name.endswith("layer_norm_weight")
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (0 if norm else tp_rank))
    return 1.0 + 0.02 * torch.randn(shape, generator=g) if norm else \
        0.02 * torch.randn(shape, generator=g)


def save_mcore(directory, tp_rank, shards):
    """A Megatron-Core checkpoint file of one TP rank, as mcore2hf reads it."""
    os.makedirs(directory, exist_ok=True)
    safetensors.torch.save_file({n: t.to(torch.bfloat16).contiguous() for n, t in shards.items()},
                                os.path.join(directory, "mp_rank_%02d_000.safetensors" % tp_rank),
                                metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)


def mcore2hf(src, dst, tp):
    subprocess.run([os.path.join(BUILD, "tools", "mcore2hf"), "--tp", str(tp), src, dst],
                   check=True, stdout=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, pp = a.tp, a.pp
    if world % (tp * pp):
        sys.exit("the world size %d is not a multiple of tp x pp = %d" % (world, tp * pp))
    dp_size = world // (tp * pp)
    tp_rank, pp_rank, dp_rank = rank % tp, (rank // tp) % pp, rank // (tp * pp)
    # Megatron's rank order: TP fastest, then PP, then DP.
    dp_groups = {(t, p): dist.new_group([t + tp * p + tp * pp * d for d in range(dp_size)])
                 for p in range(pp) for t in range(tp)}
    dp_group = dp_groups[(tp_rank, pp_rank)]

    shapes = mcore_shapes(tp)
    work = a.store + ".work"
    if dp_rank == 0 and pp_rank == 0:
        # The initial checkpoint of this TP rank, every stage's layers (only
        # to import version 0; a real job starts from its own checkpoint).
        save_mcore(os.path.join(work, "init-mcore"), tp_rank,
                   {n: init_value(n, shapes[n], tp_rank) for n in shapes})
    # This stage's parameters.
    names = sorted(n for n in shapes if stage_of(n, pp) == pp_rank)
    weights = {n: init_value(n, shapes[n], tp_rank) for n in names}
    dist.barrier()
    if rank == 0:
        mcore2hf(os.path.join(work, "init-mcore"), os.path.join(work, "init-hf"), tp)
        with dte.Publisher(a.store) as p:
            print("imported version", p.import_checkpoint(os.path.join(work, "init-hf")))
    dist.barrier()

    # The distributed optimizer: this DP rank's range of the flat FP32 master.
    offsets, at = {}, 0
    for n in names:
        offsets[n] = at
        at += weights[n].numel()
    per = -(-at // dp_size)
    lo, hi = min(at, per * dp_rank), min(at, per * (dp_rank + 1))
    flat = torch.cat([weights[n].reshape(-1) for n in names])
    master = torch.nn.Parameter(flat[lo:hi].clone())
    opt = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.1, foreach=False)

    converter = {"config": CONFIG, "tp": tp}
    pub = dte.Publisher(a.store, converter=converter, rank=rank, world_size=world)
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + tp_rank)
        grad = torch.randn(at, generator=g) * 1e-2  # stand-in for the reduced gradient
        master.grad = grad[lo:hi]
        opt.step()
        st = opt.state[master]
        params = {}
        for n in names:
            b, e = max(lo, offsets[n]), min(hi, offsets[n] + weights[n].numel())
            if b >= e:
                continue
            params[(n, tp_rank, 0)] = {
                "param": master.detach()[b - lo:e - lo], "exp_avg": st["exp_avg"][b - lo:e - lo],
                "exp_avg_sq": st["exp_avg_sq"][b - lo:e - lo], "step": int(st["step"]),
                "flat": (b - offsets[n], e - offsets[n])}
        r = pub.publish_adamw(step=step, params=params, lr=1e-3, weight_decay=0.1)
        if rank == 0:
            print("step %d: version %d, %d changed elements" % (step, r.version, r.changed))

    # Check: gather the master weights of each TP rank, convert to Hugging
    # Face and compare with the latest version.
    pieces = [torch.empty(per) for _ in range(dp_size)]
    mine = torch.zeros(per)
    mine[:hi - lo] = master.detach()
    dist.all_gather(pieces, mine, group=dp_group)
    full = torch.cat(pieces)[:at]
    if dp_rank == 0:
        save_mcore(os.path.join(work, "final-stage%d" % pp_rank), tp_rank,
                   {n: full[offsets[n]:offsets[n] + weights[n].numel()].reshape(shapes[n])
                    for n in names})
    dist.barrier()
    ok = True
    if rank == 0:
        # Each TP rank's checkpoint file holds every stage's parameters.
        for t in range(tp):
            merged = {}
            for p in range(pp):
                merged.update(safetensors.torch.load_file(os.path.join(
                    work, "final-stage%d" % p, "mp_rank_%02d_000.safetensors" % t)))
            save_mcore(os.path.join(work, "final-mcore"), t, merged)
        mcore2hf(os.path.join(work, "final-mcore"), os.path.join(work, "final-hf"), tp)
        expected = safetensors.torch.load_file(os.path.join(work, "final-hf",
                                                            "model.safetensors"))
        reader = dte.StoreReader(a.store)
        for n, t in expected.items():
            got = torch.empty(t.shape, dtype=torch.bfloat16)
            reader.read_into(reader.latest(), n, got)
            ok &= bool(torch.equal(got.view(torch.int16), t.view(torch.int16)))
        print("latest version equals the trainer's weights converted to Hugging Face:", ok)
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    dist.destroy_process_group()
    sys.exit(0 if all(flags) else 1)


if __name__ == "__main__":
    main()
