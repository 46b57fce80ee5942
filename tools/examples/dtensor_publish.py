#!/usr/bin/python3
"""Publishing torch DTensors (FSDP2 and HSDP placements) from every rank.

Needs a torch with torch.distributed.tensor (2.4 or later; Debian 12's
torch 1.13 has none: fsdp2_publish.py shows the same with row ranges). The
parameters are DTensors on a device mesh: "--mesh 4" is FSDP2's Shard(0) over
4 ranks, "--mesh 2x2" HSDP, (Replicate, Shard(0)) over a 2 x 2 mesh. AdamW
runs on the DTensors, so its moments are DTensors too, and each rank hands
dte.Publisher what it holds as they are: the publisher reads each shard's
rows from its placements. Rank 0 also publishes the gathered state with the
single-process publisher into STORE.ref, and the script checks, every step,
that both stores hold the same bytes and that they equal the BF16 of the
full parameters.

    python3 -m torch.distributed.run --nproc_per_node 4 tools/examples/dtensor_publish.py \
        --store /tmp/policy --mesh 2x2 --steps 3
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

try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
except ImportError as e:
    sys.exit("dtensor_publish.py needs torch.distributed.tensor (torch >= 2.4); this torch is "
             "%s (%s)" % (torch.__version__, e))

SHAPES = {"model.embed_tokens.weight": (1001, 128),
          "model.layers.0.self_attn.q_proj.weight": (128, 128),
          "model.layers.0.mlp.down_proj.weight": (130, 344),
          "model.layers.0.input_layernorm.weight": (128,),
          "model.norm.weight": (128,),
          "lm_head.weight": (1001, 128)}
LR, WD = 1e-3, 0.1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--mesh", default="", help="N (FSDP2) or RxS (HSDP); default: world size")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = [int(x) for x in (a.mesh or str(world)).split("x")]
    mesh = init_device_mesh("cpu", tuple(dims))
    placements = [Shard(0)] if len(dims) == 1 else [Replicate(), Shard(0)]

    torch.manual_seed(0)
    full = {n: (1.0 + 0.02 * torch.randn(s)) if n.endswith("norm.weight") else 0.02 * torch.randn(s)
            for n, s in SHAPES.items()}
    ref_store = a.store + ".ref"
    if rank == 0:
        import safetensors.torch
        init = a.store + ".init"
        os.makedirs(init, exist_ok=True)
        safetensors.torch.save_file({n: t.to(torch.bfloat16) for n, t in full.items()},
                                    os.path.join(init, "model.safetensors"),
                                    metadata={"format": "pt"})
        with open(os.path.join(init, "config.json"), "w") as f:
            f.write('{"model_type": "llama"}\n')
        for s in (a.store, ref_store):
            with dte.Publisher(s) as p:
                p.import_checkpoint(init)
    dist.barrier()

    params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, placements))
              for n, t in full.items()}
    del full
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=WD, foreach=False)
    pub = dte.Publisher(a.store, rank=rank, world_size=world)
    ref = dte.Publisher(ref_store) if rank == 0 else None
    ok = True
    for step in range(1, a.steps + 1):
        g = torch.Generator().manual_seed(step)
        for n, p in params.items():
            p.grad = distribute_tensor(torch.randn(SHAPES[n], generator=g) * 1e-2, mesh,
                                       placements)
        opt.step()
        held = {n: {"param": p.detach(), "exp_avg": opt.state[p]["exp_avg"],
                    "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
                for n, p in params.items()}
        r = pub.publish_adamw(step=step, params=held, lr=LR, weight_decay=WD)
        # The reference: the gathered state, published by one process.
        gathered = {n: tuple(x.full_tensor() for x in (d["param"], d["exp_avg"], d["exp_avg_sq"]))
                    for n, d in held.items()}
        if rank == 0:
            rr = ref.publish_adamw(step=step, params=gathered, lr=LR, weight_decay=WD)
            same = rr.version == r.version and rr.changed == r.changed
            a_reader, b_reader = dte.StoreReader(a.store), dte.StoreReader(ref_store)
            for n, (theta, _, _) in gathered.items():
                x = torch.empty(SHAPES[n], dtype=torch.bfloat16)
                y = torch.empty(SHAPES[n], dtype=torch.bfloat16)
                a_reader.read_into(r.version, n, x)
                b_reader.read_into(rr.version, n, y)
                want = theta.to(torch.bfloat16)
                same &= bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
                same &= bool(torch.equal(x.view(torch.int16), want.view(torch.int16)))
            print("step %d: version %d, %d changed; equals the single-process version and the "
                  "full BF16 params: %s" % (step, r.version, r.changed, same), flush=True)
            ok &= same
    flags = [None] * world
    dist.all_gather_object(flags, ok)
    dist.destroy_process_group()
    sys.exit(0 if all(flags) else 1)


if __name__ == "__main__":
    main()
