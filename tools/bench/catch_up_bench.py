#!/opt/dte/venv/bin/python
"""Memory and time of a push receiver's catch-up from the store
(docs/push.md "Catch-up", figures in docs/benchmarks.md "Catch-up").

The model is a dte-gen checkpoint (--size, --vocab, --hidden,
--intermediate: by default about 1 GiB of BF16 with Qwen's 151936-token
vocabulary, so embed_tokens and lm_head are the largest tensors), imported once into a store under
--work (kept between runs). Each receiver runs in its own process: rank
--ranks of vLLM's fused layout of TP --tp, in CPU memory, BF16 or FP8
(blocks of 128 x 128, --kinds). It allocates and touches its tensors,
then catches up to v0 with no server running (a catch-up reads only the
store) and reports:
  tensors_mib  peak RSS before the catch-up (Python, torch, its tensors)
  peak_mib     peak RSS after it
  extra_mib    peak_mib - tensors_mib: what the catch-up itself held
  catch_up_s   seconds of the catch-up
DTE_LIBRARY picks the library (default: BUILD/sync/libdte.so).

Usage: /opt/dte/venv/bin/python tools/bench/catch_up_bench.py --work DIR
       [--tp 2] [--ranks 0,1] [--kinds bf16,plain] [--json out]
"""

import argparse
import json
import os
import resource
import sys
import time

import harness as h
import push_bench  # the model's shapes and vLLM's sharding

SOURCE = h.ROOT

BLOCK = 128


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_args():
    p = h.parser(__doc__)
    p.add_argument("--work", required=True, help="model and store directory (kept)")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, help="MLP size (FP8 TP splits: multiples of 256)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ranks", default="0")
    p.add_argument("--kinds", default="bf16,plain")
    p.add_argument("--child", help=argparse.SUPPRESS)  # "kind,rank": one receiver
    return p.parse_args()


def prepare(a):
    """The dte-gen checkpoint and its store, made once."""
    model, store = os.path.join(a.work, "model"), os.path.join(a.work, "store")
    if os.path.isdir(store):
        return store
    tools = h.Tools(a.build_dir, names=("dtectl", "dtegen"))
    h.generate(tools, model, ["--size", a.size, "--vocab", a.vocab, "--hidden", a.hidden,
                              "--heads", 8, "--kv-heads", 2, "--head-dim", 128,
                              "--shard-size", "64GiB"] +
               (["--intermediate", a.intermediate] if a.intermediate else []), 0)
    h.run(tools.dtectl_cmd("import", store, os.path.join(a.work, "cache"), "--keep-snapshots", 0,
                           h.step_dir(model, 0)))
    return store


def receiver_tensors(c, tp, rank, fp8):
    """Buffers of rank `rank` of vLLM's fused layout of TP tp, touched:
    BF16 torch tensors, for FP8 ("F8_E4M3", uint8 array) weights with
    their ("F32", array) scales."""
    import numpy as np
    import torch
    _, local = push_bench.local_layout(c, tp, rank)
    out = {}
    for n, s in local.items():
        if fp8 is None or not n.endswith("proj.weight"):
            out[n] = torch.ones(s, dtype=torch.bfloat16)
            continue
        out[n] = ("F8_E4M3", np.ones(s, dtype=np.uint8))
        out[fp8.scale_name(n)] = ("F32", np.ones(fp8.scale_shape(s), dtype=np.float32))
    return out


def child(a, store):
    """One receiver's catch-up; prints its figures as JSON."""
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    import dte
    kind, rank = a.child.split(",")
    step = os.path.join(a.work, "model", sorted(os.listdir(os.path.join(a.work, "model")))[0])
    c = json.load(open(os.path.join(step, "config.json")))
    fp8 = None if kind == "bf16" else dte.Fp8Options(block=BLOCK, scale_rule=kind)
    tensors = receiver_tensors(c, a.tp, int(rank), fp8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # Nothing listens on port 1: the receiver's link retries in the
    # background; the catch-up needs only the store.
    rx = dte.PushReceiver("127.0.0.1:1", tensors, rank=int(rank),
                          layout=dte.FusedReceiverLayout(a.tp), version=None, fp8=fp8)
    t0 = time.perf_counter()
    rx.catch_up(store, version=0, cache_dir=os.path.join(a.work, "cache"))
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rx.close()
    print(json.dumps({"kind": kind, "tp": a.tp, "rank": int(rank), "tensors_mib": round(before),
                      "peak_mib": round(peak), "extra_mib": round(peak - before),
                      "catch_up_s": round(took, 2)}))


def main():
    a = parse_args()
    os.environ.setdefault("DTE_LIBRARY", os.path.join(a.build_dir, "sync", "libdte.so"))
    store = prepare(a)
    if a.child:
        child(a, store)
        return
    rows = []
    for kind in a.kinds.split(","):
        for rank in a.ranks.split(","):
            out = h.run([sys.executable, os.path.abspath(__file__), "--work", a.work,
                         "--build-dir", a.build_dir, "--tp", a.tp,
                         "--child", "%s,%s" % (kind, rank)]).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            log(json.dumps(rows[-1]))
    print("kind   tp rank  tensors MiB  peak MiB  extra MiB  catch-up s")
    for r in rows:
        print("%-6s %2d %4d %12d %9d %10d %11.2f" % (r["kind"], r["tp"], r["rank"],
                                                   r["tensors_mib"], r["peak_mib"],
                                                   r["extra_mib"], r["catch_up_s"]))
    h.write_json(a.json, rows)


if __name__ == "__main__":
    main()
