"""Times dte.Follower.load_into against transformers' from_pretrained for
one step's change of a Llama of about --gib GiB (BF16) on a dtefs mount:
version 0, then version 1 with --density of the elements moved by one ulp
(about what one RL step changes). Prints one line per case.

    python3 tests/py/follower_bench.py --work /tmp/fbench --gib 1
"""

import argparse
import os
import shutil
import time

import follower_util  # noqa: F401 (puts dte on the path)
from dtectl_util import Dtectl
from fs_util import mounts

import dte
import torch
import transformers


def config(gib):
    layers = max(1, round((gib * 2 ** 30 / 2 - 2 * 32000 * 2048) / (2048 * (2 * 2048 + 2 * 512)
                                                                     + 3 * 2048 * 5504)))
    return transformers.LlamaConfig(hidden_size=2048, intermediate_size=5504, vocab_size=32000,
                                    num_hidden_layers=layers, num_attention_heads=16,
                                    num_key_value_heads=4, tie_word_embeddings=False)


def versions(work, cfg, density):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    d = Dtectl(os.path.join(work, "store"), os.path.join(work, "cache"))
    model.save_pretrained(os.path.join(work, "v0"), safe_serialization=True)
    d.ok("import", os.path.join(work, "v0"))
    with torch.no_grad():
        for p in model.parameters():
            bits = p.view(torch.int16).view(-1)
            idx = torch.randperm(bits.numel())[:int(bits.numel() * density)]
            bits[idx] ^= 1
    model.save_pretrained(os.path.join(work, "v1"), safe_serialization=True)
    assert d.commit(os.path.join(work, "v1")) == 1
    return sum(p.numel() for p in model.parameters()) * 2


def drop_page_cache(directory):
    """Drops the kernel's cached pages of the version's files (the daemon's
    block cache stays)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(what, fn):
    t = time.monotonic()
    out = fn()
    print(f"{what}: {time.monotonic() - t:.3f} s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--density", type=float, default=0.015)
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    cfg = config(a.gib)
    nbytes = versions(a.work, cfg, a.density)
    print(f"model: {cfg.num_hidden_layers} layers, {nbytes / 2 ** 30:.2f} GiB BF16", flush=True)
    with mounts(a.work) as start:
        m = start(os.path.join(a.work, "store"))
        v1 = os.path.join(m.path, "v00000001")
        drop_page_cache(v1)
        timed("from_pretrained(MOUNT/v1), page cache dropped", lambda: transformers.LlamaForCausalLM
              .from_pretrained(v1, dtype=torch.bfloat16))
        timed("from_pretrained(MOUNT/v1), page cache warm", lambda: transformers.LlamaForCausalLM
              .from_pretrained(v1, dtype=torch.bfloat16))
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        with dte.Follower(m.path, live=False, verify=False) as f:
            f.load_into(model, 0)
            drop_page_cache(v1)
            timed("load_into v0 -> v1, reads through the mount, page cache dropped",
                  lambda: f.load_into(model, 1))
            timed("check (XXH3-128 of every tensor)", lambda: f.check(model))
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        with dte.Follower(m.path, live=True, verify=False) as f:
            timed("load_into v0, live attach", lambda: f.load_into(model, 0))
            timed("load_into v0 -> v1, live apply", lambda: f.load_into(model, 1))
            f.check(model, 1)


if __name__ == "__main__":
    main()
