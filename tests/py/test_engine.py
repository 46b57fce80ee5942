"""The AdamW-inverting publisher against real torch.optim.AdamW training.

A small Llama-shaped LM (embedding, attention and MLP projections, RMSNorm
weights, untied head) trains for 200 steps with weight decay on the
matrices with torch's fused CPU kernel (fused=True, transformers' default),
twice: published by publish_adamw with every version a delta, and by
publish_torch_adamw with a full table every third version. (torch 2.x's
foreach and single-tensor CPU kernels round torch.sqrt 1 ulp off about one
result in five, which no engine order models: publish_torch_adamw sends
them to the weights path, tests/py/test_torch_adamw_path.py.) After every
optimizer step the engine publishes a version from the FP32 master weights
and the moments alone; the test then reads every tensor of that version
back through libdte's verified reader and requires it to equal
param.to(torch.bfloat16) bit for bit, and counts the false positives (stored
elements whose BF16 bits did not change) against the trainer's own previous
BF16 weights, which only the test keeps. At the end `dtectl verify` checks
every version and `dtectl export` of the last one must equal a safetensors
file of the trainer's BF16 weights byte for byte.

Needs libdte.so ($DTE_BUILD_DIR/sync/libdte.so or $DTE_LIBRARY) and dtectl.
"""

import filecmp
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import dtectl_util
import store_util

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402
import safetensors.torch  # noqa: E402

STEPS = 200
VOCAB, DIM, FFN, LAYERS, HEADS, SEQ, BATCH = 256, 64, 160, 2, 4, 32, 8


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, n, torch.nn.Linear(DIM, DIM, bias=False))

    def forward(self, x):
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        att = (q @ k.transpose(-1, -2)) / (DIM // HEADS) ** 0.5
        att = att.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, DIM)
        return self.o_proj(y)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(DIM, FFN, bias=False)
        self.up_proj = torch.nn.Linear(DIM, FFN, bias=False)
        self.down_proj = torch.nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(DIM), RMSNorm(DIM)
        self.self_attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)


class TinyLM(torch.nn.Module):
    """named_parameters() spells Hugging Face Llama names."""

    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


@pytest.fixture
def work():
    """A scratch directory; in memory where possible, since 400 publishes'
    fsyncs would otherwise dominate the run time."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=shm, prefix="dte-engine-test-") as d:
        yield pathlib.Path(d)


def bf16_state(model):
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def save_checkpoint(directory, model):
    os.makedirs(directory, exist_ok=True)
    safetensors.torch.save_file(bf16_state(model), os.path.join(directory, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": DIM, "num_hidden_layers": LAYERS}, f)


def dtectl(*args):
    return dtectl_util.run(*args, check=True, timeout=300)


def batches(seed):
    """Token sequences from a fixed random Markov chain, so the loss falls."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.rand(VOCAB, VOCAB, generator=g).pow(8)
    trans /= trans.sum(-1, keepdim=True)
    while True:
        tok = torch.randint(VOCAB, (BATCH,), generator=g)
        seq = [tok]
        for _ in range(SEQ):
            tok = torch.multinomial(trans[tok], 1, generator=g).squeeze(1)
            seq.append(tok)
        yield torch.stack(seq, 1)


def lr_at(step):
    """Warm-up to an RL-sized peak, then a slow decay: 0.3-6% of the BF16
    weights change per step."""
    return 2e-5 * min(1.0, step / 50) * (1.0 - 0.5 * step / STEPS) + 1e-6


def params_for(model, optimizer):
    """{name: dict} for publish_adamw, with each tensor's group values."""
    group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = {}
    for name, p in model.named_parameters():
        st = optimizer.state[p]
        out[name] = {"param": p, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                     "step": st["step"], "weight_decay": group[id(p)]["weight_decay"]}
    return out


@pytest.mark.parametrize("via_torch", [False, True])
def test_every_version_equals_bf16_of_the_trainer(work, via_torch):
    tmp_path = work
    torch.manual_seed(1234)
    model = TinyLM()
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr_at(1), betas=(0.9, 0.95), eps=1e-8, fused=True)
    store = str(tmp_path / "store")
    save_checkpoint(tmp_path / "v0", model)
    # The anchor policy: every 3rd version (the publish_torch_adamw run), or the default
    # byte budget (one dense model's worth of deltas), keeps its delta and
    # adds a full table, and reads stop there.
    every = 3 if via_torch else 0
    pub = dte.Publisher(store=store, converter="hf", anchor_every=every)
    assert pub.import_checkpoint(str(tmp_path / "v0")) == 0
    reader = dte.StoreReader(store)
    names = [n for n, _ in model.named_parameters()]
    elements = sum(p.numel() for p in model.parameters())
    prev = bf16_state(model)
    data = batches(7)
    totals = {"changed": 0, "stored": 0, "false_positives": 0, "uncertain": 0, "flagged": 0,
              "detector_fp": 0}
    for step in range(1, STEPS + 1):
        lr = lr_at(step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        tokens = next(data)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                 tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if via_torch:
            r = pub.publish_torch_adamw(optimizer, dict(model.named_parameters()))
        else:
            r = pub.publish_adamw(step=step, params=params_for(model, optimizer), lr=lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        assert int(r) == step and r.parent == step - 1 and r.elements == elements
        now = bf16_state(model)
        actual = 0
        for n in names:
            got = reader.read_into(r.version, n, torch.empty_like(now[n]))
            if not torch.equal(got.view(torch.int16), now[n].view(torch.int16)):
                bad = (got.view(torch.int16) != now[n].view(torch.int16)).sum().item()
                pytest.fail("step %d: %s differs from the trainer's BF16 in %d elements"
                            % (step, n, bad))
            actual += (now[n].view(torch.int16) != prev[n].view(torch.int16)).sum().item()
        # Never-miss made the stored set a superset of the true changes.
        assert r.changed >= actual
        totals["changed"] += actual
        totals["stored"] += r.changed
        totals["false_positives"] += r.changed - actual
        totals["uncertain"] += r.uncertain
        totals["flagged"] += r.flagged
        totals["detector_fp"] += r.flagged - actual
        assert r.changed - actual <= r.uncertain
        assert r.changed - actual <= 0.02 * elements
        prev = now
    entries = STEPS * elements
    print("via_torch=%s: %d of %d entries changed (%.3f%%); stored %d; false positives %d "
          "(%.5f%% of entries, %.4f%% of stored); detector flagged %d (%d proven unchanged "
          "and dropped); uncertain %d"
          % (via_torch, totals["changed"], entries, 100 * totals["changed"] / entries,
             totals["stored"], totals["false_positives"],
             100 * totals["false_positives"] / entries,
             100 * totals["false_positives"] / max(totals["stored"], 1), totals["flagged"],
             totals["detector_fp"], totals["uncertain"]))
    assert totals["changed"] > 0.001 * entries  # the run really changed weights
    ms = {v: m for v, (_, m) in store_util.manifests(store).items()}
    for version, m in ms.items():
        assert m["kind"] == ("anchor" if version == 0 else "delta")
        if every:
            assert ("full" in m) == (version > 0 and version % every == 0), version
        if version == 0 or "full" in m:
            assert m["since_full"] == {"versions": 0, "bytes": 0}, version
        else:
            before = ms[version - 1]["since_full"]
            assert m["since_full"] == {"versions": before["versions"] + 1,
                                       "bytes": before["bytes"] + m["stats"]["stored_bytes"]}
            # The budget: a version past it would have been a policy anchor.
            assert every or before["bytes"] < m["stats"]["dense_bytes"], version
    assert sum("full" in m for m in ms.values()) >= (STEPS // every if every else 1)
    # Join tables (default join budget), where full tables leave room: the
    # newest two, written by the publisher; the reader above read the
    # versions through them.
    if not every:
        assert len(os.listdir(os.path.join(store, "joins"))) == 2
    assert totals["false_positives"] <= 0.02 * entries
    assert totals["false_positives"] <= 0.02 * totals["stored"]
    reader.close()
    pub.close()
    # The CLI agrees: every version verifies, and the last one exports to
    # exactly the trainer's BF16 weights saved as safetensors.
    dtectl("verify", "--store", store, "--cache-dir", str(tmp_path / "cache"))
    save_checkpoint(tmp_path / "expected", model)
    dtectl("export", "--store", store, "--cache-dir", str(tmp_path / "cache"), "--version",
           "latest", str(tmp_path / "exported"))
    for f in ("model.safetensors", "config.json"):
        assert filecmp.cmp(tmp_path / "exported" / f, tmp_path / "expected" / f, shallow=False)


def test_rejections_name_the_tensor(work):
    tmp_path = work
    torch.manual_seed(1)
    model = TinyLM()
    save_checkpoint(tmp_path / "v0", model)
    pub = dte.Publisher(store=str(tmp_path / "store"))
    pub.import_checkpoint(str(tmp_path / "v0"))
    p = model.lm_head.weight.detach()
    good = (p, torch.zeros_like(p), torch.ones_like(p))
    with pytest.raises(dte.DteError, match="amsgrad"):
        pub.publish_adamw(step=1, params={"lm_head.weight": good}, lr=1e-5, amsgrad=True)
    with pytest.raises(dte.DteError, match="lm_head.weight.*F16"):
        pub.publish_adamw(step=1, params={"lm_head.weight": (p.half(), good[1], good[2])},
                          lr=1e-5)
    with pytest.raises(dte.DteError, match="lm_head.weight.*shape"):
        pub.publish_adamw(step=1, params={"lm_head.weight": (p[:3], good[1], good[2])},
                          lr=1e-5)
    with pytest.raises(dte.DteError, match="lm_head.weight.*step 3"):
        pub.publish_adamw(step=1, params={"lm_head.weight": {
            "param": p, "exp_avg": good[1], "exp_avg_sq": good[2], "step": 3}}, lr=1e-5)
    with pytest.raises(dte.DteError, match="no_such.weight"):
        pub.publish_adamw(step=1, params={"no_such.weight": good}, lr=1e-5)
    with pytest.raises(dte.DteError, match="lm_head.weight.*numpy|int64|I64|U8|needs FP32"):
        pub.publish_adamw(step=1, params={"lm_head.weight": (
            np.zeros(tuple(p.shape), np.int64), good[1].numpy(), good[2].numpy())}, lr=1e-5)
    # Nothing was committed by the rejected calls; a valid numpy publish works.
    r = pub.publish_adamw(step=1, params={"lm_head.weight": tuple(
        t.numpy() for t in good)}, lr=1e-5)
    assert r.version == 1 and r.changed == 0
    with pytest.raises(dte.DteError, match="step 3 does not follow step 1"):
        pub.publish_adamw(step=3, params={"lm_head.weight": good}, lr=1e-5)
    with pytest.raises(dte.DteError, match="--join-budget"):
        dte.Publisher(store=str(tmp_path / "store"), join_budget=-1)


# --- Publishing from sharded Megatron-Core state ---------------------------

MC_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16,
             "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 24,
             "vocab_size": 50, "tie_word_embeddings": False}


def mcore_shards(hf, tp):
    """The Megatron-Core (Transformer Engine naming) TP shards of an HF state:
    {(mcore_name, tp_rank, 0): array}, written from the layout's definition
    (GQA-grouped fused QKV, [gate; up] fc1 per rank, vocab padded to 128 * tp
    rows), independently of the C++ sharder."""
    c = MC_CONFIG
    hd = c["hidden_size"] // c["num_attention_heads"]
    group = c["num_attention_heads"] // c["num_key_value_heads"]
    padded = -(-c["vocab_size"] // (128 * tp)) * 128 * tp
    out = {}

    def rows(name, x):
        for r, part in enumerate(np.split(x, tp, axis=0)):
            out[(name, r, 0)] = np.ascontiguousarray(part)

    def cols(name, x):
        for r, part in enumerate(np.split(x, tp, axis=1)):
            out[(name, r, 0)] = np.ascontiguousarray(part)

    for hf_name, mc_name in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                             ("lm_head.weight", "output_layer.weight")):
        x = np.zeros((padded, c["hidden_size"]), np.float32)
        x[:c["vocab_size"]] = hf[hf_name]
        rows(mc_name, x)
    out[("decoder.final_layernorm.weight", 0, 0)] = hf["model.norm.weight"]
    for layer in range(c["num_hidden_layers"]):
        h, m = "model.layers.%d." % layer, "decoder.layers.%d." % layer
        q = hf[h + "self_attn.q_proj.weight"].reshape(-1, group * hd, c["hidden_size"])
        k = hf[h + "self_attn.k_proj.weight"].reshape(-1, hd, c["hidden_size"])
        v = hf[h + "self_attn.v_proj.weight"].reshape(-1, hd, c["hidden_size"])
        rows(m + "self_attention.linear_qkv.weight",
             np.concatenate([q, k, v], axis=1).reshape(-1, c["hidden_size"]))
        cols(m + "self_attention.linear_proj.weight", hf[h + "self_attn.o_proj.weight"])
        out[(m + "self_attention.linear_qkv.layer_norm_weight", 0, 0)] = \
            hf[h + "input_layernorm.weight"]
        out[(m + "mlp.linear_fc1.layer_norm_weight", 0, 0)] = \
            hf[h + "post_attention_layernorm.weight"]
        gate = np.split(hf[h + "mlp.gate_proj.weight"], tp)
        up = np.split(hf[h + "mlp.up_proj.weight"], tp)
        for r in range(tp):
            out[(m + "mlp.linear_fc1.weight", r, 0)] = np.concatenate([gate[r], up[r]])
        cols(m + "mlp.linear_fc2.weight", hf[h + "mlp.down_proj.weight"])
    return out


def mcore_hf_params():
    c, hd = MC_CONFIG, MC_CONFIG["hidden_size"] // MC_CONFIG["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"]),
              "model.norm.weight": (c["hidden_size"],),
              "lm_head.weight": (c["vocab_size"], c["hidden_size"])}
    for layer in range(c["num_hidden_layers"]):
        h = "model.layers.%d." % layer
        shapes.update({
            h + "input_layernorm.weight": (c["hidden_size"],),
            h + "post_attention_layernorm.weight": (c["hidden_size"],),
            h + "self_attn.q_proj.weight": (c["num_attention_heads"] * hd, c["hidden_size"]),
            h + "self_attn.k_proj.weight": (c["num_key_value_heads"] * hd, c["hidden_size"]),
            h + "self_attn.v_proj.weight": (c["num_key_value_heads"] * hd, c["hidden_size"]),
            h + "self_attn.o_proj.weight": (c["hidden_size"], c["num_attention_heads"] * hd),
            h + "mlp.gate_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            h + "mlp.up_proj.weight": (c["intermediate_size"], c["hidden_size"]),
            h + "mlp.down_proj.weight": (c["hidden_size"], c["intermediate_size"])})
    g = torch.Generator().manual_seed(5)
    return {n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.02 + ("norm" in n))
            for n, s in shapes.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_mcore_converter_publishes_the_same_versions_as_hf(work, tp):
    params = mcore_hf_params()
    norms = [p for n, p in params.items() if "norm" in n]
    others = [p for n, p in params.items() if "norm" not in n]
    opt = torch.optim.AdamW([{"params": others}, {"params": norms, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    os.makedirs(work / "v0")
    safetensors.torch.save_file({n: p.detach().to(torch.bfloat16) for n, p in params.items()},
                                str(work / "v0" / "model.safetensors"), metadata={"format": "pt"})
    with open(work / "v0" / "config.json", "w") as f:
        json.dump(MC_CONFIG, f)
    hf_pub = dte.Publisher(store=str(work / "hf"))
    mc_pub = dte.Publisher(store=str(work / "mc"),
                           converter={"config": str(work / "v0" / "config.json"), "tp": tp})
    hf_pub.import_checkpoint(str(work / "v0"))
    mc_pub.import_checkpoint(str(work / "v0"))
    g = torch.Generator().manual_seed(6)
    for step in range(1, 4):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
        wd = {n: 0.0 if "norm" in n else 0.1 for n in params}
        a = hf_pub.publish_adamw(step=step, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, params={
            n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                "exp_avg_sq": opt.state[p]["exp_avg_sq"], "weight_decay": wd[n]}
            for n, p in params.items()})
        state = [{n: t.detach().numpy() for n, t in d.items()} for d in (
            params, {n: opt.state[p]["exp_avg"] for n, p in params.items()},
            {n: opt.state[p]["exp_avg_sq"] for n, p in params.items()})]
        theta, m, v = (mcore_shards(s, tp) for s in state)
        b = mc_pub.publish_adamw(step=step, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, params={
            key: {"param": theta[key], "exp_avg": m[key], "exp_avg_sq": v[key], "step": step,
                  "weight_decay": 0.0 if "norm" in key[0] else None}
            for key in theta})
        assert (b.version, b.tensors, b.changed, b.stored_bytes) == \
            (a.version, a.tensors, a.changed, a.stored_bytes)
        assert a.changed > 0
    for name, p in params.items():  # both equal the trainer's BF16 weights
        for store in ("hf", "mc"):
            got = torch.empty(p.shape, dtype=torch.bfloat16)
            dte.StoreReader(str(work / store)).read_into(3, name, got)
            assert torch.equal(got.view(torch.int16), p.detach().to(torch.bfloat16).view(
                torch.int16)), (store, name)
    for store in ("hf", "mc"):
        dtectl("export", "--store", str(work / store), "--version", "latest",
               str(work / ("out_" + store)))
    assert filecmp.cmp(work / "out_hf" / "model.safetensors", work / "out_mc" / "model.safetensors",
                       shallow=False)
    # Mismatches name the shard and its ranks, and commit nothing.
    key = ("decoder.layers.1.self_attention.linear_qkv.weight", tp - 1, 0)
    bad = dict(theta)
    bad[key] = theta[key][1:]
    with pytest.raises(dte.DteError, match=r"linear_qkv.weight \(tp rank %d, ep rank 0\).*shape"
                       % (tp - 1)):
        mc_pub.publish_adamw(step=4, lr=1e-3, params={k: (bad[k], m[k], v[k]) for k in bad})
    del bad[key]
    with pytest.raises(dte.DteError, match="missing"):
        mc_pub.publish_adamw(step=4, lr=1e-3, params={k: (bad[k], m[k], v[k]) for k in bad})
    with pytest.raises(dte.DteError, match="not part of"):
        mc_pub.publish_adamw(step=4, lr=1e-3, params={("no.such.weight", 0, 0): (
            theta[key], m[key], v[key])})
    with pytest.raises(dte.DteError, match="tensor parallel size 8"):
        dte.Publisher(store=str(work / "mc"), converter={"config": MC_CONFIG, "tp": 8})
    with pytest.raises(dte.DteError, match="unknown keys"):
        dte.Publisher(store=str(work / "mc"), converter={"config": MC_CONFIG, "pp": 2})
    assert dte.StoreReader(str(work / "mc")).latest() == 3
