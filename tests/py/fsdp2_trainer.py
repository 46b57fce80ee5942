"""Fsdp2Trainer: one rank of a real FSDP2 trainer of a small transformers
Llama, for tests/py/dist_worker.py.

torch.distributed.fsdp.fully_shard over a 1-dimensional device mesh (FSDP2,
parameters placed Shard(0)) or a 2 x 2 one (HSDP: ("replicate", "shard"),
placed (Replicate(), Shard(0))), each decoder layer and the root; real
forward and backward passes on seeded token batches, torch.optim.AdamW
(fused, two param groups) on the sharded DTensor parameters; model and
optimizer state saved and loaded with torch.distributed.checkpoint. On the
CPU the fused kernel is the one the engine models from torch 2 on (its
foreach and single-tensor kernels' sqrt is not correctly rounded, so
publish_torch_adamw would compare weights instead, which a distributed
publisher does not do; docs/engine.md, "Fused AdamW").

Not thread-safe; every method except initial_bf16 is a collective (every
rank calls it, in the same order).
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

LR, NORM_LR, WD = 2e-3, 5e-3, 0.1
BETAS, EPS = (0.9, 0.95), 1e-8
BATCH, SEQ = 2, 12


def _no_decay(name):
    return name.endswith("norm.weight") or name.endswith(".bias")


class Fsdp2Trainer:
    """layout "fsdp2" (every rank one shard of a 1-dimensional mesh) or
    "hsdp" (4 ranks, a 2 x 2 mesh); model: LlamaConfig keyword arguments."""

    order = "torch_cpu"  # the fused CPU AdamW's (the reference publisher's)

    def __init__(self, layout, world, model):
        if layout == "hsdp":
            if world != 4:
                raise ValueError("the hsdp layout runs on 4 ranks, not %d" % world)
            self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            self.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        self.rank = dist.get_rank()
        self.config = LlamaConfig(**model)
        torch.manual_seed(0)  # the same initial weights on every rank
        self.model = LlamaForCausalLM(self.config)
        self._initial = {n: p.detach().to(torch.bfloat16).clone()
                         for n, p in self.model.named_parameters()}
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.params = dict(self.model.named_parameters())
        decay = [p for n, p in self.params.items() if not _no_decay(n)]
        other = [p for n, p in self.params.items() if _no_decay(n)]
        self.opt = torch.optim.AdamW([{"params": decay, "lr": LR, "weight_decay": WD},
                                      {"params": other, "lr": NORM_LR, "weight_decay": 0.0}],
                                     betas=BETAS, eps=EPS, fused=True)

    def initial_bf16(self):
        """The initial weights as BF16, whole (version 0 of the store)."""
        return self._initial

    def save_initial(self, directory):
        """Writes the initial weights as a Hugging Face checkpoint directory."""
        import safetensors.torch
        os.makedirs(directory, exist_ok=True)
        self.config.save_pretrained(directory)
        safetensors.torch.save_file({n: t.contiguous() for n, t in self._initial.items()},
                                    os.path.join(directory, "model.safetensors"),
                                    metadata={"format": "pt"})

    def train_step(self, step):
        """One optimizer step on this rank's batch (the same for a step and
        rank whatever happened before, so a replayed step is the same step)."""
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        ids = torch.randint(0, self.config.vocab_size, (BATCH, SEQ), generator=g)
        self.opt.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()

    def publish(self, pub):
        """Publishes the step just taken: every rank its DTensor shards."""
        return pub.publish_torch_adamw(self.opt, self.params)

    def local_shapes(self):
        """{name: shape of this rank's local shard of the parameter}."""
        return {n: list(p.to_local().shape) for n, p in self.params.items()}

    def full_params(self):
        """{name: parameter}, gathered whole (full_tensor()) on every rank."""
        return {n: p.detach().full_tensor() for n, p in self.params.items()}

    def full_state(self):
        """{name: {param, exp_avg, exp_avg_sq, step, lr, weight_decay}}, every
        tensor gathered whole (full_tensor()) on every rank."""
        out = {}
        for grp in self.opt.param_groups:
            for p in grp["params"]:
                name = next(n for n, q in self.params.items() if q is p)
                st = self.opt.state[p]
                out[name] = {"param": p.detach().full_tensor(),
                             "exp_avg": st["exp_avg"].full_tensor(),
                             "exp_avg_sq": st["exp_avg_sq"].full_tensor(),
                             "step": int(st["step"].item()), "lr": grp["lr"],
                             "weight_decay": grp["weight_decay"]}
        return out

    def save(self, directory):
        """Saves model and optimizer state with torch.distributed.checkpoint."""
        msd, osd = get_state_dict(self.model, self.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)

    def load(self, directory):
        """Loads what save() wrote; returns the optimizer step it holds."""
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        steps = {int(self.opt.state[p]["step"].item()) for p in self.params.values()}
        if len(steps) != 1:
            raise RuntimeError("checkpoint %s holds parameters at steps %s" % (directory,
                                                                             sorted(steps)))
        return steps.pop()
