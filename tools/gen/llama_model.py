"""A small Llama-style decoder LM whose state_dict uses Hugging Face's names.

Grouped-query attention with rotary embeddings (rotate-half convention),
SwiGLU MLP, RMSNorm, optional tied embeddings: the tensors and config of
LlamaForCausalLM, so the saved checkpoints load in transformers unchanged.
"""

import dataclasses
import math

import torch
from torch import nn
import torch.nn.functional as F


@dataclasses.dataclass
class LlamaDims:
    vocab: int = 320
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 768
    tied: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self):
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(dims, positions):
    """cos, sin of shape [T, head_dim] for integer positions [T]."""
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dims.head_dim, 2).float()
                                          / dims.head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden, d.heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.heads * d.head_dim, d.hidden, bias=False)

    def forward(self, x, cos, sin, cache=None):
        """x: [B, T, H]. cache: (k, v) of earlier positions or None. Returns
        the output and the (k, v) including these positions."""
        b, t, _ = x.shape
        d = self.d
        q = self.q_proj(x).view(b, t, d.heads, d.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, d.kv_heads, d.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, d.kv_heads, d.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        new_cache = (k, v)
        groups = d.heads // d.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d.head_dim)
        past = k.shape[2] - t
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d.heads * d.head_dim)
        return self.o_proj(out), new_cache


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.down_proj = nn.Linear(d.intermediate, d.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = Attention(d)
        self.mlp = MLP(d)
        self.input_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.rms_eps)

    def forward(self, x, cos, sin, cache=None):
        attn, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), new_cache


class LlamaModel(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(d.layers))
        self.norm = RMSNorm(d.hidden, d.rms_eps)


class LlamaForCausalLM(nn.Module):
    """forward(ids, caches=None, start=0) -> (logits, caches)."""

    def __init__(self, d):
        super().__init__()
        self.dims = d
        self.model = LlamaModel(d)
        self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if d.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids, caches=None, start=0):
        positions = torch.arange(start, start + ids.shape[1])
        cos, sin = rope_tables(self.dims, positions)
        x = self.model.embed_tokens(ids)
        new_caches = []
        for i, layer in enumerate(self.model.layers):
            x, cache = layer(x, cos, sin, None if caches is None else caches[i])
            new_caches.append(cache)
        return self.lm_head(self.model.norm(x)), new_caches

    def hf_state_dict(self):
        """Weights by Hugging Face name, in state-dict order; a tied lm_head
        is left out, as save_pretrained does."""
        state = self.state_dict()
        if self.dims.tied:
            state.pop("lm_head.weight", None)
        return state
