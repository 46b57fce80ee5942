#!/opt/dte/venv/bin/python
"""An FSDP2 (or HSDP) trainer of a small Llama that publishes every step from every rank.

torch.distributed.fsdp.fully_shard shards each decoder layer and the model
over a device mesh: "--mesh N" (default: the world size) is FSDP2, every
parameter a DTensor placed Shard(0), torch.chunk's uneven split of its
rows; "--mesh RxS" is HSDP, placed (Replicate(), Shard(0)): R replicas of
an S-way sharding. torch.optim.AdamW steps the DTensors, so its moments are
DTensors too (fused: on the CPU, the kernel the engine models; docs/engine.md,
"Fused AdamW"), and every rank hands dte.Publisher the optimizer and the
model's named parameters as they are (publish_torch_adamw): the publisher
reads each shard's rows from its placements. The version appears once
every rank's part is in, and is the BF16 of the whole model; the script
checks that after every step against the parameters gathered whole.

    torchrun --nproc_per_node 3 tools/examples/fsdp2_publish.py --store /tmp/policy --steps 5
    torchrun --nproc_per_node 4 tools/examples/fsdp2_publish.py --store /tmp/hsdp --mesh 2x2

Needs torch 2.6 or later (fully_shard in torch.distributed.fsdp) and
transformers. Set DTE_LIBRARY to build/sync/libdte.so, or PYTHONPATH to
sync/python with the library beside it (tools/examples/README.md). With an
s3:// store the ranks may sit on different hosts; --job NAME makes them
exchange through the store instead of the process group.
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
    from torch.distributed.fsdp import fully_shard
except ImportError as e:
    sys.exit("fsdp2_publish.py needs torch.distributed.fsdp.fully_shard (torch >= 2.6); this "
             "torch is %s (%s)" % (torch.__version__, e))
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

# 1001 rows of embed_tokens and lm_head split unevenly on any mesh of 2-4 shards.
CONFIG = LlamaConfig(vocab_size=1001, hidden_size=128, intermediate_size=344,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     tie_word_embeddings=False, max_position_embeddings=128)
LR, WD = 1e-3, 0.1


def make_mesh(spec, world):
    dims = tuple(int(x) for x in (spec or str(world)).split("x"))
    if len(dims) == 1:
        return init_device_mesh("cpu", dims, mesh_dim_names=("shard",))
    return init_device_mesh("cpu", dims, mesh_dim_names=("replicate", "shard"))


def import_initial(model, store):
    """Commits the initial weights as version 0 (rank 0, before the others
    open their publishers); a real job imports the checkpoint it starts from."""
    import safetensors.torch
    init = store + ".init"
    os.makedirs(init, exist_ok=True)
    CONFIG.save_pretrained(init)
    safetensors.torch.save_file({n: p.detach().to(torch.bfloat16).contiguous()
                                 for n, p in model.named_parameters()},
                                os.path.join(init, "model.safetensors"),
                                metadata={"format": "pt"})
    with dte.Publisher(store) as p:
        print("imported version", p.import_checkpoint(init), flush=True)


def equals_full_bf16(reader, version, params):
    """Whether `version` is the BF16 of the parameters gathered whole: every
    rank gathers, rank 0 (which has the reader) compares; True elsewhere."""
    same = True
    for n, p in params.items():
        full = p.detach().full_tensor().to(torch.bfloat16)
        if reader is not None:
            got = torch.empty(full.shape, dtype=torch.bfloat16)
            reader.read_into(version, n, got)
            same &= bool(torch.equal(got.view(torch.int16), full.view(torch.int16)))
    return same


def sharded_model(mesh, rank, store):
    """The Llama, sharded over mesh, and its optimizer; rank 0 imports its
    initial weights as version 0 first."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(CONFIG)
    if rank == 0:
        import_initial(model, store)
    dist.barrier()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in params.items() if not n.endswith("norm.weight")],
         "weight_decay": WD},
        {"params": [p for n, p in params.items() if n.endswith("norm.weight")],
         "weight_decay": 0.0}], lr=LR, fused=True)
    return model, opt


def train_step(model, opt, step, rank):
    # A stand-in for the data loader: this rank's batch of the step.
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=g)
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mesh", default="", help="N (FSDP2) or RxS (HSDP); default: world size")
    ap.add_argument("--job", help="exchange through the store under this job name")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = sharded_model(make_mesh(a.mesh, world), rank, a.store)
    params = dict(model.named_parameters())
    pub = dte.Publisher(a.store, rank=rank, world_size=world, job=a.job)
    reader = dte.StoreReader(a.store) if rank == 0 else None
    ok = True
    for step in range(1, a.steps + 1):
        train_step(model, opt, step, rank)
        r = pub.publish_torch_adamw(opt, params)
        same = equals_full_bf16(reader, r.version, params)
        ok &= same
        if rank == 0:
            print("step %d: version %d, %d changed elements, %d bytes stored; equals the full "
                  "BF16 weights: %s" % (step, r.version, r.changed, r.stored_bytes, same),
                  flush=True)
    pub.close()
    if rank == 0:
        print("every version equals the trainer's BF16 weights, gathered whole:", ok, flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)  # rank 0 compares; the others gathered with it


if __name__ == "__main__":
    main()
