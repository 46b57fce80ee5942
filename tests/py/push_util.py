"""Shared parts of the push tests (tests/py/test_push.py,
tests/py/test_push_ranks.py) and their worker processes
(tests/py/push_worker.py): a small GQA Llama-shaped model whose
named_parameters() spell Hugging Face names, and a tensor-parallel, fused
sharding of its tensors written with plain slicing (not dte's plan math),
so comparing the two can fail; and receiver processes that check every
version they reach."""

import json
import math
import os
import subprocess
import sys

import torch

from wait_util import wait_for

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

VOCAB, DIM, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 250, 64, 128, 2, 4, 2, 16
CONFIG = {"model_type": "llama", "hidden_size": DIM, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "intermediate_size": FFN, "vocab_size": VOCAB}


class TinyGqaLM(torch.nn.Module):
    """Parameters only (the tests train it on a quadratic loss)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "lm_head.weight": (VOCAB, DIM),
                  "model.norm.weight": (DIM,)}
        for l in range(LAYERS):
            p = "model.layers.%d." % l
            shapes.update({p + "input_layernorm.weight": (DIM,),
                           p + "post_attention_layernorm.weight": (DIM,),
                           p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, DIM),
                           p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, DIM),
                           p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, DIM),
                           p + "self_attn.o_proj.weight": (DIM, HEADS * HEAD_DIM),
                           p + "mlp.gate_proj.weight": (FFN, DIM),
                           p + "mlp.up_proj.weight": (FFN, DIM),
                           p + "mlp.down_proj.weight": (DIM, FFN)})
        self.params = torch.nn.ParameterDict()
        self.names = list(shapes)
        for n, s in shapes.items():
            init = torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02
            self.params[n.replace(".", "__")] = torch.nn.Parameter(init)

    def named(self):
        return {n: self.params[n.replace(".", "__")] for n in self.names}


def shard(name, t, tp, rank):
    """Rank `rank`'s part of canonical tensor t under TP degree tp (vLLM's
    splits; vocabulary rows padded with zeros to ceil(V / tp) per rank)."""
    if ".q_proj." in name:
        rows = HEADS // tp * HEAD_DIM
        return t[rank * rows:(rank + 1) * rows]
    if ".k_proj." in name or ".v_proj." in name:
        per, first = (KV_HEADS // tp, rank * KV_HEADS // tp) if KV_HEADS >= tp else \
            (1, rank * KV_HEADS // tp)
        return t[first * HEAD_DIM:(first + per) * HEAD_DIM]
    if ".gate_proj." in name or ".up_proj." in name:
        rows = t.shape[0] // tp
        return t[rank * rows:(rank + 1) * rows]
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        cols = t.shape[1] // tp
        return t[:, rank * cols:(rank + 1) * cols]
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        per = math.ceil(t.shape[0] / tp)
        part = t[rank * per:(rank + 1) * per]
        out = torch.zeros((per,) + tuple(t.shape[1:]), dtype=t.dtype)
        out[:part.shape[0]] = part
        return out
    return t


def local_state(canonical, tp, rank, fused):
    """{local name: tensor} of one receiver rank, from {name: canonical tensor}."""
    out = {n: shard(n, t, tp, rank).contiguous().clone() for n, t in canonical.items()}
    if fused:
        for l in range(LAYERS):
            p = "model.layers.%d." % l
            out[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [out.pop(p + "self_attn.%s_proj.weight" % x) for x in "qkv"])
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [out.pop(p + "mlp.%s_proj.weight" % x) for x in ("gate", "up")])
    return out


def shapes_and_dtypes(model):
    """{name: zero BF16 tensor} of the canonical model, for sizing receivers."""
    return {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in model.named().items()}


def read_version(dte, store, version, names):
    """{name: BF16 tensor} of `version`, through libdte's verified reader."""
    out = {}
    with dte.StoreReader(store) as r:
        for n, shape in names.items():
            t = torch.empty(shape, dtype=torch.bfloat16)
            r.read_into(version, n, t)
            out[n] = t
    return out


def train_step(model, opt, seed):
    """One AdamW step of `opt` on a random linear loss drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in model.parameters())
    loss.backward()
    opt.step()


def adamw_params(model, opt):
    """{name: dict} for Publisher.publish_adamw: each parameter with its
    optimizer state."""
    out = {}
    for name, p in model.named().items():
        st = opt.state[p]
        out[name] = {"param": p, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                     "step": st["step"]}
    return out


def save_checkpoint(directory, model):
    import safetensors.torch
    os.makedirs(directory, exist_ok=True)
    state = {n: p.detach().to(torch.bfloat16) for n, p in model.named().items()}
    safetensors.torch.save_file(state, os.path.join(directory, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)


class ReceiverProcs:
    """Receiver processes (push_worker.py receiver) of a test, tagged
    tpT-rR: each checks every version it reaches against the store and
    leaves a mark file TAG-VERSION in self.marks. Users set self.tmp,
    self.store, self.marks and self.procs (tag -> process)."""

    WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "push_worker.py")

    def start_one(self, address, tp, rank, fused, steps):
        tag = "tp%d-r%d" % (tp, rank)
        argv = [sys.executable, self.WORKER, "receiver", "--address", address,
                "--store", self.store, "--steps", str(steps), "--rank", str(rank),
                "--tp", str(tp), "--tag", tag, "--marks", str(self.marks),
                "--out", str(self.tmp / (tag + ".json"))] + (["--fused"] if fused else [])
        self.procs[tag] = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        return tag

    def await_marks(self, version, tags=None):
        tags = tags or list(self.procs)

        def done():
            for tag in tags:
                if self.procs[tag].poll() is not None:
                    raise AssertionError("%s exited: %s" % (tag, self.procs[tag].stderr.read()))
            return all((self.marks / ("%s-%d" % (t, version))).exists() for t in tags)
        wait_for(done, 60, "receivers %s to check v%d" % (tags, version))

    def results(self):
        out = {}
        for tag, p in self.procs.items():
            assert p.wait(60) == 0, "%s: %s" % (tag, p.stderr.read())
            with open(self.tmp / (tag + ".json")) as f:
                out[tag] = json.load(f)
        return out
