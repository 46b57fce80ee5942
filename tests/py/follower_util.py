"""A tiny transformers Llama and a store of its versions for the Follower
tests: each version moves every weight a little (in BF16) and is saved with
save_pretrained and committed with dtectl."""

import os
import sys

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import torch  # noqa: E402
import transformers  # noqa: E402

from dtectl_util import Dtectl  # noqa: E402


def config(tied=False):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                    max_position_embeddings=128, tie_word_embeddings=tied)


def model(dtype=torch.bfloat16, seed=1, tied=False):
    """A fresh model (random weights: not any version) in `dtype`; tied:
    lm_head shares the embedding's weight (saved once)."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config(tied)).to(dtype).eval()


def state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _bits(t):
    return t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t


def differing(m, expected):
    """The names of m's tensors that do not hold `expected`'s (BF16) values
    bit for bit; a wider model tensor must hold them exactly."""
    got = m.state_dict()
    bad = []
    for k, v in expected.items():
        g = got[k].detach()
        exact = torch.equal(g.to(v.dtype).to(g.dtype), g)
        if not (exact and torch.equal(_bits(g.to(v.dtype)), _bits(v))):
            bad.append(k)
    return bad


class Versions:
    """Versions of one trained model committed to `store` (a directory or
    s3:// URI) by dtectl; states[v] is version v's BF16 state_dict."""

    def __init__(self, root, store, env=None, tied=False):
        self.root = str(root)
        self.dtectl = Dtectl(store, os.path.join(self.root, "dtectl-cache"), env=env)
        self.model = model(seed=0, tied=tied)
        self.states = []

    def commit(self, fraction=1.0):
        """Moves `fraction` of the weights one step and commits them;
        returns the version."""
        if self.states:
            with torch.no_grad():
                for p in self.model.parameters():
                    step = torch.randn_like(p) * 0.02
                    p.add_(step * (torch.rand(p.shape) < fraction).to(p.dtype))
        d = os.path.join(self.root, f"ckpt-{len(self.states)}")
        self.model.save_pretrained(d, safe_serialization=True)
        if self.states:
            v = self.dtectl.commit(d)
        else:
            self.dtectl.ok("import", d)
            v = 0
        assert v == len(self.states)
        self.states.append(state(self.model))
        return v

