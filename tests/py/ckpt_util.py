"""Hugging Face style checkpoint directories for the dtectl end-to-end tests.

A checkpoint is held as raw element bits: every tensor is a numpy array of
the unsigned integer type of its dtype's width, so tests compare and count
changes exactly as the store must (NaN payloads and signed zeros included).

Shards holding only dtypes torch 1.13 knows are written with the real
`safetensors.torch.save_file`; the others (float8) with `write_safetensors`,
a small writer of the same format.
"""

import copy
import json
import os
import pathlib
import struct
from dataclasses import dataclass, field

import numpy as np

WIDTH = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
INDEX_NAME = "model.safetensors.index.json"


def raw_type(dtype):
    return RAW[WIDTH[dtype]]


@dataclass
class Shard:
    name: str
    tensors: list          # tensor names, in the order they are written
    writer: str = "torch"  # "torch": safetensors.torch.save_file; "raw": write_safetensors
    metadata: dict = field(default_factory=lambda: {"format": "pt"})


@dataclass
class Checkpoint:
    """Tensors (name -> (dtype, raw array)), their shards and the other files."""
    tensors: dict
    shards: list
    files: dict            # non-tensor file name -> bytes
    with_index: bool = True

    def clone(self):
        return Checkpoint({k: (d, a.copy()) for k, (d, a) in self.tensors.items()},
                          copy.deepcopy(self.shards), dict(self.files), self.with_index)

    def elements(self):
        return sum(a.size for _, a in self.tensors.values())

    def dense_bytes(self):
        return sum(a.nbytes for _, a in self.tensors.values())


def changed_elements(old, new):
    """Elements whose raw bits differ, per tensor name (same layout assumed)."""
    return {name: int(np.count_nonzero(old.tensors[name][1] != arr))
            for name, (_, arr) in new.tensors.items()}


# --- safetensors bytes -------------------------------------------------------

def header_bytes(entries, metadata=None):
    """Prefix + JSON header for (name, dtype, shape, begin, end) entries, in order.

    Built as text so that duplicate names can be written too.
    """
    parts = []
    if metadata is not None:
        parts.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    for name, dtype, shape, begin, end in entries:
        parts.append(json.dumps(name) + ":" + json.dumps(
            {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]},
            separators=(",", ":")))
    text = ("{" + ",".join(parts) + "}").encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path, tensors, metadata=None):
    """Writes [(name, dtype, raw array)] in the given order."""
    entries, pos = [], 0
    for name, dtype, arr in tensors:
        entries.append((name, dtype, arr.shape, pos, pos + arr.nbytes))
        pos += arr.nbytes
    with open(path, "wb") as f:
        f.write(header_bytes(entries, metadata))
        for _, _, arr in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())


def read_safetensors(path):
    """(header dict, {name: (dtype, raw array)}) read straight from the bytes."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        arr = np.frombuffer(data[b:end], dtype=raw_type(e["dtype"])).reshape(e["shape"])
        out[name] = (e["dtype"], arr)
    return header, out


def split_file(path):
    """(header JSON text, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[8:8 + n], blob[8 + n:]


# --- torch bridging ----------------------------------------------------------

def to_torch(dtype, arr):
    import torch
    if dtype == "BF16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    if dtype == "BOOL":
        return torch.from_numpy(arr.astype(np.bool_))
    npt = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}[dtype]
    return torch.from_numpy(arr.view(npt).copy())


def from_torch(t):
    """Raw bits of a torch tensor, as the unsigned type of its width."""
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8)
    a = t.numpy()
    return a.view(RAW[a.itemsize])


# --- writing a directory -----------------------------------------------------

def write_checkpoint(ckpt, out_dir):
    os.makedirs(out_dir, exist_ok=False)
    weight_map = {}
    for shard in ckpt.shards:
        path = os.path.join(out_dir, shard.name)
        items = [(n, *ckpt.tensors[n]) for n in shard.tensors]
        if shard.writer == "torch":
            from safetensors.torch import save_file
            save_file({n: to_torch(d, a) for n, d, a in items}, path, metadata=shard.metadata)
        else:
            write_safetensors(path, items, shard.metadata)
        for n in shard.tensors:
            weight_map[n] = shard.name
    if ckpt.with_index:
        index = {"metadata": {"total_size": ckpt.dense_bytes()}, "weight_map": weight_map}
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name, content in ckpt.files.items():
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(content)
    return out_dir


def reshard(ckpt, n):
    """The same tensors spread over n torch-written shards named as transformers does."""
    names = [t for s in ckpt.shards for t in s.tensors]
    per = -(-len(names) // n)
    ckpt.shards = [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", names[i * per:(i + 1) * per])
                   for i in range(n)]
    for s in ckpt.shards:
        if any(ckpt.tensors[t][0].startswith("F8") for t in s.tensors):
            s.writer = "raw"


# --- a small Llama-like model --------------------------------------------------

def _bf16_bits(f32):
    """Round-to-nearest-even float32 -> bfloat16 bits (no NaNs expected)."""
    u = f32.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _text_files(rng, cfg):
    vocab = {f"tok{i}_{rng.integers(1 << 30):x}": i for i in range(cfg["vocab_size"])}
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": []},
                 "added_tokens": [{"id": 0, "content": "<s>", "special": True}]}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **cfg}
    dump = lambda o: (json.dumps(o, indent=2, sort_keys=True) + "\n").encode()
    return {
        "config.json": dump(config),
        "generation_config.json": dump({"bos_token_id": 0, "eos_token_id": 1, "do_sample": True}),
        "tokenizer.json": json.dumps(tokenizer).encode(),
        "tokenizer_config.json": dump({"model_max_length": 2048,
                                       "tokenizer_class": "LlamaTokenizer"}),
        "special_tokens_map.json": dump({"bos_token": "<s>", "eos_token": "</s>"}),
    }


class Trainer:
    """A checkpoint and the AdamW state that moves it one optimizer step at a time.

    BF16 weights are the rounding of FP32 master weights; with the default
    learning rate about 1-2% of BF16 elements change per step, as in RL
    fine-tuning. A few other tensors change by raw bits each step.
    """

    def __init__(self, seed=0, hidden=256, intermediate=688, layers=2, vocab=1024, lr=2e-6):
        self.rng = np.random.default_rng(seed)
        # Optimizer state as after a long run, so every step moves about as
        # many elements as the next (no bias-correction warm-up).
        self.lr, self.t, self.grad_scale = lr, 0, 1e-3
        cfg = {"hidden_size": hidden, "intermediate_size": intermediate,
               "num_hidden_layers": layers, "vocab_size": vocab,
               "num_attention_heads": 4, "num_key_value_heads": 2}
        kv = hidden // 2
        shapes = [("model.embed_tokens.weight", (vocab, hidden))]
        for i in range(layers):
            p = f"model.layers.{i}."
            shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)),
                       (p + "self_attn.k_proj.weight", (kv, hidden)),
                       (p + "self_attn.v_proj.weight", (kv, hidden)),
                       (p + "self_attn.o_proj.weight", (hidden, hidden)),
                       (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                       (p + "mlp.up_proj.weight", (intermediate, hidden)),
                       (p + "mlp.down_proj.weight", (hidden, intermediate)),
                       (p + "input_layernorm.weight", (hidden,)),
                       (p + "post_attention_layernorm.weight", (hidden,))]
        shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
        self.master, self.m, self.v = {}, {}, {}
        tensors = {}
        for name, shape in shapes:
            w = self.rng.standard_normal(shape, np.float32) * 0.02
            if name.endswith("norm.weight"):
                w = np.ones(shape, np.float32) + w
            self.master[name] = w
            self.m[name] = self.rng.standard_normal(shape, np.float32) * (0.23 * self.grad_scale)
            self.v[name] = np.full(shape, self.grad_scale ** 2, np.float32)
            tensors[name] = ("BF16", _bf16_bits(w))
        extras = {
            "model.rotary_emb.inv_freq": ("F32", (1.0 / 10000 ** (np.arange(0, 64, 2) / 64))
                                          .astype(np.float32).view(np.uint32)),
            "model.extra.router_bias": ("F16", self.rng.standard_normal(1000)
                                        .astype(np.float16).view(np.uint16)),
            "model.extra.position_ids": ("I64", np.arange(2048, dtype=np.uint64).reshape(1, 2048)),
            "model.extra.causal_mask": ("BOOL", np.tril(np.ones((64, 64), np.uint8))),
            "model.layers.1.mlp.down_proj.weight_scale": (
                "F8_E4M3", self.rng.integers(0, 0x7F, hidden, dtype=np.uint8)),
            "model.layers.1.mlp.up_proj.weight_fp8": (
                "F8_E5M2", self.rng.integers(0, 0x7C, (64, 64), dtype=np.uint8)),
        }
        tensors.update(extras)
        half = 1 + 9 * (layers // 2)
        bf16 = [n for n, _ in shapes]
        shards = [Shard("model-00001-of-00003.safetensors", bf16[:half]),
                  Shard("model-00002-of-00003.safetensors", bf16[half:]),
                  Shard("model-00003-of-00003.safetensors", list(extras), "raw",
                        {"format": "pt", "note": "mixed dtypes"})]
        self.ckpt = Checkpoint(tensors, shards, _text_files(self.rng, cfg))
        self.ckpt.files["trainer_state.json"] = b'{"global_step": 0}\n'

    def step(self):
        """Advances one AdamW step; returns a copy of the new checkpoint."""
        self.t += 1
        b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
        for name, w in self.master.items():
            g = self.rng.standard_normal(w.shape, np.float32) * self.grad_scale
            m, v = self.m[name], self.v[name]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            w -= self.lr * (m / (np.sqrt(v) + eps) + wd * w)
            self.ckpt.tensors[name] = ("BF16", _bf16_bits(w))
        for name in ("model.extra.router_bias", "model.layers.1.mlp.up_proj.weight_fp8"):
            dtype, arr = self.ckpt.tensors[name]
            arr = arr.copy()
            idx = self.rng.choice(arr.size, max(1, arr.size // 50), replace=False)
            arr.reshape(-1)[idx] ^= 1  # flip the lowest mantissa bit
            self.ckpt.tensors[name] = (dtype, arr)
        state = json.dumps({"global_step": self.t}) + "\n"
        self.ckpt.files["trainer_state.json"] = state.encode()
        return self.ckpt.clone()


class CheckpointSequence:
    """Checkpoints of one simulated training run, written on first use."""

    def __init__(self, root, **trainer_args):
        self.root = pathlib.Path(root)
        self.trainer = Trainer(**trainer_args)
        self.states = [self.trainer.ckpt.clone()]
        self.dirs = []

    def _extend(self, step):
        while len(self.states) <= step:
            self.states.append(self.trainer.step())
        while len(self.dirs) <= step:
            i = len(self.dirs)
            self.dirs.append(write_checkpoint(self.states[i], str(self.root / f"s{i:02d}")))

    def dir(self, step):
        self._extend(step)
        return self.dirs[step]

    def state(self, step):
        self._extend(step)
        return self.states[step]
