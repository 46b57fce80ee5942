#!/opt/dte/venv/bin/python
"""Writes BF16 checkpoints of a real RL fine-tuning run of a small Llama LM.

Pretrains a Llama-style byte-level LM on text found on this machine (license
and copyright files) at a pretraining learning rate, then fine-tunes it with
a group-relative policy gradient (sampled completions, a reward, advantages
normalized within each prompt's group) using AdamW at an RL learning rate.
Saves OUT/step-000000 (the policy after --warm-steps RL steps) and
OUT/step-K after each of the next --steps RL optimizer steps, each a complete Hugging Face model directory
in BF16, and prints the fraction of BF16 elements that changed per step.

Run in the project's environment (it has torch): /opt/dte/venv/bin/python torch_gen.py.
The output is a function of the arguments, the corpus and --threads (torch's
CPU kernels are deterministic for a fixed thread count on one machine).
See docs/generators.md.
"""

import argparse
import glob
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import hf_writer
from llama_model import LlamaDims, LlamaForCausalLM

DEFAULT_CORPUS = ["/usr/share/common-licenses/*", "/usr/share/doc/*/copyright"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output dir (gets step-NNNNNN/)")
    p.add_argument("--steps", type=int, default=5, help="RL optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    m = p.add_argument_group("model")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--intermediate", type=int, default=768)
    m.add_argument("--vocab", type=int, default=320, help=">= 259 (byte tokenizer)")
    m.add_argument("--tie-embeddings", action="store_true")
    t = p.add_argument_group("pretraining")
    t.add_argument("--corpus", nargs="*", default=DEFAULT_CORPUS, help="text files or globs")
    t.add_argument("--corpus-bytes", type=int, default=4 << 20)
    t.add_argument("--pretrain-steps", type=int, default=30)
    t.add_argument("--pretrain-lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=128)
    r = p.add_argument_group("RL fine-tuning")
    r.add_argument("--warm-steps", type=int, default=8,
                   help="RL steps run before step-000000 is saved, so the saved window "
                        "starts mid-run with warm Adam moments (a fresh Adam's first "
                        "steps move every weight by a full lr)")
    r.add_argument("--lr", type=float, default=1e-6)
    r.add_argument("--weight-decay", type=float, default=0.01)
    r.add_argument("--beta1", type=float, default=0.9)
    r.add_argument("--beta2", type=float, default=0.999)
    r.add_argument("--eps", type=float, default=1e-8)
    r.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    r.add_argument("--group", type=int, default=4, help="completions per prompt")
    r.add_argument("--prompt-len", type=int, default=32)
    r.add_argument("--gen-len", type=int, default=32)
    o = p.add_argument_group("output")
    o.add_argument("--shard-size", default="5GB", help="max bytes per shard, e.g. 3MiB")
    o.add_argument("--save-optimizer", metavar="DIR",
                   help="also write FP32 master weights and AdamW state per step")
    args = p.parse_args(argv)
    if args.vocab < hf_writer.TOKENIZER_VOCAB:
        p.error("--vocab must be at least %d" % hf_writer.TOKENIZER_VOCAB)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        p.error("--hidden must split into --heads, and --heads into --kv-heads")
    return args


def load_corpus(patterns, max_bytes):
    """Token ids of the concatenated files (sorted within each pattern)."""
    data = bytearray()
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if len(data) >= max_bytes or not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    data += f.read(max_bytes - len(data)) + b"\n"
            except OSError:
                continue
    if len(data) < 4096:
        sys.exit("torch_gen: corpus too small (%d bytes) from %s" % (len(data), patterns))
    return torch.tensor(hf_writer.encode_bytes(data), dtype=torch.long)


def windows(corpus, count, length, gen):
    starts = torch.randint(0, len(corpus) - length, (count,), generator=gen)
    return torch.stack([corpus[s:s + length] for s in starts.tolist()])


def pretrain(model, corpus, args, gen):
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95),
                            weight_decay=0.1, foreach=False)
    for step in range(args.pretrain_steps):
        lr = args.pretrain_lr * min(1.0, (step + 1) / max(1, args.warmup))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = windows(corpus, args.batch, args.seq_len + 1, gen)
        with autocast():
            logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == args.pretrain_steps:
            print("pretrain step %d/%d loss %.3f lr %.1e" %
                  (step + 1, args.pretrain_steps, loss.item(), lr), flush=True)


def autocast():
    """BF16 mixed precision (FP32 master weights), as RL trainers run; on
    CPU it also routes matmuls to oneDNN, far faster than generic BLAS."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


@torch.no_grad()
def sample(model, prompts, length, gen):
    """Samples `length` byte tokens after each prompt (KV-cached)."""
    with autocast():
        logits, caches = model(prompts)
    allowed = torch.full((model.dims.vocab,), float("-inf"))
    allowed[hf_writer.FIRST_BYTE_ID:hf_writer.TOKENIZER_VOCAB] = 0
    tokens, pos = [], prompts.shape[1]
    for i in range(length):
        probs = (logits[:, -1].float() + allowed).softmax(-1)
        tok = torch.multinomial(probs, 1, generator=gen)
        tokens.append(tok)
        if i + 1 < length:
            with autocast():
                logits, caches = model(tok, caches, start=pos)
            pos += 1
    return torch.cat(tokens, dim=1)


def reward(completions):
    """Share of completion bytes that are lowercase letters or spaces."""
    b = completions - hf_writer.FIRST_BYTE_ID
    good = ((b >= ord("a")) & (b <= ord("z"))) | (b == ord(" "))
    return good.float().mean(dim=1)


def rl_step(model, opt, corpus, args, gen):
    """One on-policy group-relative policy-gradient step; returns the mean reward."""
    prompts = windows(corpus, args.prompts, args.prompt_len, gen)
    prompts = prompts.repeat_interleave(args.group, dim=0)
    completions = sample(model, prompts, args.gen_len, gen)
    rewards = reward(completions).view(args.prompts, args.group)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    seq = torch.cat((prompts, completions), dim=1)
    with autocast():
        logits, _ = model(seq[:, :-1])
    logp = F.log_softmax(logits[:, args.prompt_len - 1:].float(), dim=-1)
    logp = logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    loss = -(adv.reshape(-1, 1) * logp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return rewards.mean().item()


def bf16_state(model):
    return {k: v.detach().to(torch.bfloat16).contiguous()
            for k, v in model.hf_state_dict().items()}


def count_changed(prev, cur):
    changed = sum(int((prev[k].view(torch.int16) != cur[k].view(torch.int16)).sum())
                  for k in cur)
    return changed, sum(t.numel() for t in cur.values())


def save_optimizer(out_dir, step, model, opt, args):
    """FP32 master weights, exp_avg and exp_avg_sq by HF name, one safetensors
    file each, and adamw.json with the step count and hyperparameters."""
    os.makedirs(out_dir, exist_ok=True)
    files = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    adam_step = 0
    for name, param in model.named_parameters():
        state = opt.state.get(param, {})
        adam_step = int(state["step"]) if "step" in state else adam_step
        files["master"][name] = param.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            files[key][name] = state[key].clone() if key in state \
                else torch.zeros_like(param.detach())
    # One metadata key: the writer orders several keys differently per run.
    for key, tensors in files.items():
        save_file(tensors, os.path.join(out_dir, key + ".safetensors"),
                  metadata={"format": "pt"})
    hparams = {"step": adam_step, "lr": args.lr, "beta1": args.beta1, "beta2": args.beta2,
               "eps": args.eps, "weight_decay": args.weight_decay,
               "checkpoint": "step-%06d" % step}
    with open(os.path.join(out_dir, "adamw.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(hparams, indent=2, sort_keys=True) + "\n")


def save_step(step, model, opt, args, dims):
    state = bf16_state(model)
    name = "step-%06d" % step
    hf_writer.write_model_dir(os.path.join(args.out, name), state, dims,
                              hf_writer.parse_byte_size(args.shard_size))
    if args.save_optimizer:
        save_optimizer(os.path.join(args.save_optimizer, name), step, model, opt, args)
    return state


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dims = LlamaDims(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                     kv_heads=args.kv_heads, intermediate=args.intermediate,
                     tied=args.tie_embeddings)
    model = LlamaForCausalLM(dims)
    n_params = sum(p.numel() for p in model.parameters())
    corpus = load_corpus(args.corpus, args.corpus_bytes)
    print("model: %.2fM params, corpus %d bytes" % (n_params / 1e6, len(corpus)), flush=True)
    start = time.time()
    pretrain(model, corpus, args, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                            eps=args.eps, weight_decay=args.weight_decay, foreach=False)
    for _ in range(args.warm_steps):
        rl_step(model, opt, corpus, args, gen)
    prev = save_step(0, model, opt, args, dims)
    for step in range(1, args.steps + 1):
        mean_reward = rl_step(model, opt, corpus, args, gen)
        cur = save_step(step, model, opt, args, dims)
        changed, total = count_changed(prev, cur)
        print("step %d changed_bf16 %.3f%% (%d/%d)  [reward %.3f]" %
              (step, 100.0 * changed / total, changed, total, mean_reward), flush=True)
        prev = cur
    print("wrote %d checkpoint(s) to %s in %.2f s" %
          (args.steps + 1, args.out, time.time() - start))


if __name__ == "__main__":
    main(sys.argv[1:])
