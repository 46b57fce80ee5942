#!/usr/bin/python3
"""FSDP2-style training that publishes every step from every rank.

Each rank holds torch.chunk(world) of dim 0 of every parameter (FSDP2's
Shard(0) placement, uneven), its FP32 master and AdamW moments, and runs the
optimizer on its shard only, as FSDP2's sharded optimizer does. After every
step each rank publishes what it holds; the version appears in the store
once every rank's part is in, and is the BF16 of the whole model.

    python3 -m torch.distributed.run --nproc_per_node 3 tools/examples/fsdp2_publish.py \
        --store /tmp/policy --steps 5

(Set DTE_LIBRARY to build/sync/libdte.so, or PYTHONPATH to sync/python with
the library beside it; tools/examples/README.md.) With an s3:// store, the
ranks may sit on different hosts; --job NAME makes them exchange through
the store instead of the process group.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(
    os.environ.get("DTE_BUILD_DIR", os.path.join(HERE, "..", "..", "build")), "sync", "libdte.so"))

import dte  # noqa: E402

SHAPES = {"model.embed_tokens.weight": (1000, 128),
          "model.layers.0.self_attn.q_proj.weight": (128, 128),
          "model.layers.0.mlp.down_proj.weight": (128, 344),
          "model.layers.0.input_layernorm.weight": (128,),
          "model.norm.weight": (128,),
          "lm_head.weight": (1000, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--job", help="exchange through the store under this job name")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # The full initial weights exist only to cut the shards and, on rank 0,
    # to write the initial checkpoint; a real job loads its shards instead.
    torch.manual_seed(0)
    full = {n: (1.0 + 0.02 * torch.randn(s)) if n.endswith("norm.weight") else 0.02 * torch.randn(s)
            for n, s in SHAPES.items()}
    if rank == 0:
        import safetensors.torch
        init = os.path.join(a.store + ".init")
        os.makedirs(init, exist_ok=True)
        safetensors.torch.save_file({n: t.to(torch.bfloat16) for n, t in full.items()},
                                    os.path.join(init, "model.safetensors"),
                                    metadata={"format": "pt"})
        with open(os.path.join(init, "config.json"), "w") as f:
            f.write('{"model_type": "llama"}\n')
        with dte.Publisher(a.store) as p:
            print("imported version", p.import_checkpoint(init))
    dist.barrier()

    shards = {}
    for n, t in full.items():
        r0, r1 = dte.chunk_rows(t.shape[0], rank, world)
        shards[n] = (torch.nn.Parameter(t[r0:r1].clone()), r0, r1)
    del full
    norms = [p for n, (p, _, _) in shards.items() if n.endswith("norm.weight")]
    mats = [p for n, (p, _, _) in shards.items() if not n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.1},
                             {"params": norms, "weight_decay": 0.0}], lr=1e-3, foreach=False)
    pub = dte.Publisher(a.store, rank=rank, world_size=world, job=a.job)
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(step)
        for n, (p, r0, r1) in shards.items():
            # Stand-in for backward + reduce-scatter: this rank's rows of the
            # gradient (the same rows whatever the world size).
            p.grad = (torch.randn(SHAPES[n], generator=g) * 1e-2)[r0:r1]
        opt.step()
        params = {}
        for n, (p, r0, r1) in shards.items():
            st, group = opt.state[p], next(gr for gr in opt.param_groups
                                           if any(q is p for q in gr["params"]))
            params[n] = {"param": p.detach(), "exp_avg": st["exp_avg"],
                         "exp_avg_sq": st["exp_avg_sq"], "step": int(st["step"]),
                         "weight_decay": group["weight_decay"], "rows": (r0, r1)}
        r = pub.publish_adamw(step=step, params=params, lr=1e-3, weight_decay=0.1)
        if rank == 0:
            print("step %d: version %d, %d changed elements, %d bytes stored"
                  % (step, r.version, r.changed, r.stored_bytes))

    # Check: the latest version is the BF16 of every rank's shards.
    reader = dte.StoreReader(a.store)
    ok = True
    for n, (p, r0, r1) in shards.items():
        got = torch.empty(SHAPES[n], dtype=torch.bfloat16)
        reader.read_into(reader.latest(), n, got)
        ok &= bool(torch.equal(got[r0:r1].view(torch.int16),
                               p.detach().to(torch.bfloat16).view(torch.int16)))
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    if rank == 0:
        print("latest version equals the trainer's BF16 weights on every rank:", all(flags))
    dist.destroy_process_group()
    sys.exit(0 if all(flags) else 1)


if __name__ == "__main__":
    main()
