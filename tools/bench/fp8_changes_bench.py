#!/opt/dte/venv/bin/python
"""FP8 change sets on real AdamW steps: how many FP8 bytes and scales change
per step of an RL run, against the BF16 elements that change.

The steps are those of the torch generator (tools/gen/torch_gen.py): a
Llama-style byte-level LM pretrained on text found on this machine, then
fine-tuned with a group-relative policy gradient and torch.optim.AdamW
(FP32 master weights, BF16 autocast) at an RL learning rate. For each
learning rate of --lrs the run starts from the same pretrained model, takes
--warm-steps RL steps (warm Adam moments), then commits the BF16 weights
after each of --steps more steps to a fresh store (dtectl import, then
dtectl commit per step), and reads `dtectl stats --fp8 --by version --json`.

Reported per learning rate, over the steps (median, p10, p90):
  bf16      changed BF16 elements / elements of the quantized tensors
  ratio     changed FP8 bytes / changed BF16 elements, plain and pow2 rules
  scales    changed scales / scales (blocks), plain and pow2
  step      bytes an FP8 receiver's step writes (changed bytes + 4 per
            changed scale) / a BF16 receiver's (2 per changed element)
and the time of the steps, the commits and `dtectl stats --fp8`, and its
peak RSS (/usr/bin/time).

Usage: /opt/dte/venv/bin/python tools/bench/fp8_changes_bench.py [--build-dir build]
       [--lrs 1e-6,1e-5] [--steps 150] [--threads 2] [--prompts 4 --group 4]
       [--json out.json]
"""

import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch

import harness as h

sys.path.insert(0, os.path.join(h.ROOT, "tools", "gen"))
import torch_gen  # noqa: E402
from llama_model import LlamaDims, LlamaForCausalLM  # noqa: E402


def log(msg):
    h.log(f"[fp8_changes] {msg}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_build_dir_arg(p)
    p.add_argument("--work", help="work directory (default: a temporary one, removed)")
    p.add_argument("--lrs", default="1e-6,1e-5", help="RL learning rates, comma-separated")
    p.add_argument("--steps", type=int, default=150, help="committed RL steps per learning rate")
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--pretrain-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--fp8-block", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def generator_args(a, out):
    """torch_gen's arguments for this run (its defaults otherwise)."""
    return torch_gen.parse_args([
        "--out", out, "--seed", str(a.seed), "--threads", str(a.threads),
        "--hidden", str(a.hidden), "--intermediate", str(a.intermediate),
        "--layers", str(a.layers), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
        "--pretrain-steps", str(a.pretrain_steps), "--warm-steps", str(a.warm_steps),
        "--prompts", str(a.prompts), "--group", str(a.group)])


def commit_steps(model0, corpus, gargs, lr, steps, dtectl, root):
    """The RL run at `lr`, each step committed; returns (store args, seconds
    of the RL steps, seconds of the commits)."""
    model = copy.deepcopy(model0)
    args = copy.copy(gargs)
    args.lr, args.out = lr, os.path.join(root, "ckpt")
    gen = torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(args.beta1, args.beta2),
                            eps=args.eps, weight_decay=args.weight_decay, foreach=False)
    for _ in range(args.warm_steps):
        torch_gen.rl_step(model, opt, corpus, args, gen)
    store = ["--store", os.path.join(root, "store"), "--cache-dir", os.path.join(root, "cache")]
    dims = model.dims
    train_s = commit_s = 0.0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        if step:
            torch_gen.rl_step(model, opt, corpus, args, gen)
        torch_gen.save_step(step, model, opt, args, dims)
        t1 = time.perf_counter()
        h.run([dtectl, "import" if step == 0 else "commit", *store, "-q",
               os.path.join(args.out, "step-%06d" % step)])
        h.remove(os.path.join(args.out, "step-%06d" % step))
        train_s += t1 - t0
        commit_s += time.perf_counter() - t1
        if step % 25 == 0:
            log(f"lr {lr:g}: step {step}/{steps}, RL steps {train_s:.0f} s, commits "
                f"{commit_s:.0f} s")
    return store, train_s, commit_s


def fp8_stats(dtectl, store, block):
    """`dtectl stats --fp8 --by version --json`: (document, seconds, peak RSS bytes)."""
    m = h.measure([dtectl, "stats", "--fp8", "--by", "version", "--json", "--fp8-block", block,
                   *store])
    return json.loads(m.stdout), m.seconds, m.peak_rss


def distribution(xs):
    xs = np.asarray(xs, dtype=np.float64)
    return {"median": float(np.median(xs)), "p10": float(np.percentile(xs, 10)),
            "p90": float(np.percentile(xs, 90)), "min": float(xs.min()), "max": float(xs.max())}


def summarize(doc):
    rows = [r for r in doc["rows"] if r["kind"] != "anchor"]
    out = {"steps": len(rows),
           "bf16_changed_fraction": distribution([r["bf16_changed"] / r["elements"]
                                                  for r in rows])}
    for rule in ("plain", "pow2"):
        out[rule] = {
            "ratio": distribution([r[rule]["ratio"] for r in rows]),
            "scales_changed_pct": distribution([100 * r[rule]["scales_changed_fraction"]
                                                for r in rows]),
            "step_ratio": distribution([r[rule]["step_ratio"] for r in rows]),
            "steps_with_scale_changes": sum(1 for r in rows if r[rule]["scales_changed"]),
            "total_ratio": doc["total"][rule]["ratio"],
            "total_step_ratio": doc["total"][rule]["step_ratio"],
        }
    t = doc["total"]
    out["quantized"] = {"elements": rows[0]["elements"], "tensors": rows[0]["tensors"],
                        "blocks": rows[0]["blocks"]} if rows else {}
    out["total"] = {"bf16_changed": t["bf16_changed"], "bf16_step_bytes": t["bf16_step_bytes"],
                    "plain_step_bytes": t["plain"]["step_bytes"],
                    "pow2_step_bytes": t["pow2"]["step_bytes"]}
    return out


def fmt(d, pct=False):
    f = "{:.2f}%" if pct else "{:.4f}"
    return " / ".join(f.format(d[k]) for k in ("median", "p10", "p90"))


def print_table(results):
    print("| lr | steps | BF16 changed | FP8/BF16 plain | FP8/BF16 pow2 | scales plain | "
          "scales pow2 | step bytes FP8/BF16 plain | pow2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lr, s in results.items():
        print(f"| {lr} | {s['steps']} | {fmt(s['bf16_changed_fraction'])} | "
              f"{fmt(s['plain']['ratio'])} | {fmt(s['pow2']['ratio'])} | "
              f"{fmt(s['plain']['scales_changed_pct'], True)} | "
              f"{fmt(s['pow2']['scales_changed_pct'], True)} | "
              f"{fmt(s['plain']['step_ratio'])} | {fmt(s['pow2']['step_ratio'])} |")


def main(argv):
    a = parse_args(argv)
    scratch = h.Scratch(a.work, prefix="fp8-changes-", keep=a.work is not None)
    work = scratch.path
    # A private copy: a rebuild in the build directory cannot swap it mid-run.
    dtectl = h.Tools(a.build_dir, work, names=("dtectl",)).dtectl
    torch.set_num_threads(a.threads)
    gargs = generator_args(a, work)
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    dims = LlamaDims(vocab=gargs.vocab, hidden=gargs.hidden, layers=gargs.layers,
                     heads=gargs.heads, kv_heads=gargs.kv_heads,
                     intermediate=gargs.intermediate, tied=gargs.tie_embeddings)
    model = LlamaForCausalLM(dims)
    corpus = torch_gen.load_corpus(gargs.corpus, gargs.corpus_bytes)
    t0 = time.perf_counter()
    torch_gen.pretrain(model, corpus, gargs, gen)
    log(f"pretrained in {time.perf_counter() - t0:.1f} s")
    results, runs = {}, {}
    try:
        for lr in [float(x) for x in a.lrs.split(",")]:
            root = os.path.join(work, f"lr{lr:g}")
            store, train_s, commit_s = commit_steps(model, corpus, gargs, lr, a.steps, dtectl,
                                                    root)
            doc, stats_s, rss = fp8_stats(dtectl, store, a.fp8_block)
            s = summarize(doc)
            s.update({"train_s": train_s, "commit_s": commit_s, "stats_s": stats_s,
                      "stats_peak_rss": rss})
            results[f"{lr:g}"] = s
            runs[f"{lr:g}"] = doc["rows"]
            log(f"lr {lr:g}: {a.steps} steps in {train_s:.0f} s, commits {commit_s:.0f} s, "
                f"stats --fp8 {stats_s:.1f} s, peak RSS {rss / 2**20:.0f} MiB")
    finally:
        scratch.clean()
    print_table(results)
    print(json.dumps(results, indent=1))
    h.write_json(a.json, {"args": vars(a), "results": results, "rows": runs})


if __name__ == "__main__":
    main(sys.argv[1:])
