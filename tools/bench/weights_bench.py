#!/opt/dte/venv/bin/python
"""The weights path's cost per step beside the AdamW inversion's, on the
same model and the same torch.optim.AdamW steps, in one run.

A synthetic Llama-shaped set of FP32 parameters (--elements in all, a few
large matrices and small vectors) takes real torch.optim.AdamW(fused=True) steps (lr
1e-6, random gradients: 1-3% of BF16 elements change per step, as in RL). After each step the same state is published twice:
into store A by Publisher.publish_torch_adamw (the step inverted from the
optimizer state) and into store B by Publisher.publish_weights (the new
weights compared with the parent version, read from the cache directory's
snapshots plus the deltas since). Both must find the same changes at every
step, and the last version's exports must be byte-identical. Reports the median seconds per
step of each from step 2 on, their ratio, the bytes each read, and each
path's peak RSS over its steps, measured in a process of its own (--path
adamw|weights; the peak restarted after the first step), beside
the same steps with no publish (--path none).

Usage: /opt/dte/venv/bin/python tools/bench/weights_bench.py [--elements 33554432]
       [--steps 9] [--build-dir build] [--work /var/tmp/dte-weights] [--json OUT]
"""

import filecmp
import json
import os
import statistics
import sys
import time

import harness as h

sys.path.insert(0, h.PY_PATH)


def shapes(elements):
    """Matrices of a Llama-like layer mix, scaled to about `elements`."""
    unit = [(4, 1), (4, 1), (1, 1), (1, 1), (3, 1), (3, 1), (1, 3)]  # q k v o gate up down
    cols = 1024
    per = sum(r * c for r, c in unit) * cols * cols
    layers = max(1, elements // per)
    out = {}
    for i in range(layers):
        for j, (r, c) in enumerate(unit):
            out["model.layers.%d.w%d.weight" % (i, j)] = (r * cols // 4 * 4, c * cols)
        out["model.layers.%d.norm.weight" % i] = (cols,)
    return out


def build(elements, seed=0):
    import torch
    torch.manual_seed(seed)
    params = {k: torch.nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes(elements).items()}
    # fused: the Trainer's default, which the engine models exactly on the CPU
    opt = torch.optim.AdamW(params.values(), lr=1e-6, weight_decay=0.1, fused=True)
    return params, opt


def step(params, opt, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()


def save(params, directory):
    import safetensors.torch
    import torch
    os.makedirs(directory, exist_ok=True)
    safetensors.torch.save_file({k: v.detach().to(torch.bfloat16) for k, v in params.items()},
                                os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}\n')


def run_path(a):
    """One path in a process of its own: its peak RSS."""
    import dte
    params, opt = build(a.elements)
    store = os.path.join(a.work, "rss-" + a.path)
    h.remove(store)
    save(params, os.path.join(a.work, "ckpt0"))
    with dte.Publisher(store, cache_dir=os.path.join(a.work, "cache-rss-" + a.path)) as pub:
        pub.import_checkpoint(os.path.join(a.work, "ckpt0"))
        for s in range(1, a.steps + 1):
            if s == 2:  # the optimizer's state exists from here on
                h.reset_peak()  # the peak (VmHWM) restarts from what the process holds now
            step(params, opt, s)
            if a.path == "adamw":
                pub.publish_torch_adamw(opt, params, step=s)
            elif a.path == "weights":
                pub.publish_weights(params, step=s)
    print(json.dumps({"max_rss_kib": h.proc_status("self", "VmHWM") // h.KIB}))


def compare(a):
    import dte
    params, opt = build(a.elements)
    h.remove(a.work)
    save(params, os.path.join(a.work, "ckpt0"))
    stores = {p: os.path.join(a.work, "store-" + p) for p in ("adamw", "weights")}
    pubs = {p: dte.Publisher(s, cache_dir=os.path.join(a.work, "cache-" + p))
            for p, s in stores.items()}
    for pub in pubs.values():
        pub.import_checkpoint(os.path.join(a.work, "ckpt0"))
    seconds = {p: [] for p in pubs}
    last = {}
    for s in range(1, a.steps + 1):
        step(params, opt, s)
        t0 = time.perf_counter()
        last["adamw"] = pubs["adamw"].publish_torch_adamw(opt, params, step=s)
        t1 = time.perf_counter()
        last["weights"] = pubs["weights"].publish_weights(params, step=s)
        t2 = time.perf_counter()
        seconds["adamw"].append(t1 - t0)
        seconds["weights"].append(t2 - t1)
        # The AdamW path may also store elements whose old bits it could not
        # prove ("uncertain", rewritten with their current value); the
        # weights path stores exactly the changed ones.
        aw, wt = last["adamw"], last["weights"]
        assert (aw.path, wt.path) == ("adamw", "weights"), (aw.path, wt.path)
        assert aw.changed - aw.uncertain <= wt.changed <= aw.changed, (s, aw, wt)
    for pub in pubs.values():
        pub.close()
    dtectl = h.Tools(a.build_dir, names=("dtectl",)).dtectl
    out = {}
    for p, s in stores.items():
        out[p] = os.path.join(a.work, "export-" + p)
        h.run([dtectl, "export", "--store", s, "--version", a.steps, out[p]])
    assert filecmp.cmp(os.path.join(out["adamw"], "model.safetensors"),
                       os.path.join(out["weights"], "model.safetensors"), shallow=False)
    return seconds, last


def rss(a, path):
    r = h.run([sys.executable, __file__, "--path", path, "--elements", a.elements, "--steps", 3,
               "--work", a.work, "--build-dir", a.build_dir])
    return json.loads(r.stdout.strip().splitlines()[-1])["max_rss_kib"]


def main():
    ap = h.parser(__doc__)
    ap.add_argument("--elements", type=int, default=1 << 25)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--work", default="/var/tmp/dte-weights", help="scratch directory (removed)")
    ap.add_argument("--path", choices=["adamw", "weights", "none"])
    a = ap.parse_args()
    a.build_dir = os.path.abspath(a.build_dir)
    os.environ.setdefault("DTE_LIBRARY", os.path.join(a.build_dir, "sync", "libdte.so"))
    if a.path:
        return run_path(a)
    seconds, last = compare(a)
    med = {p: statistics.median(v[1:]) for p, v in seconds.items()}
    out = {"elements": last["weights"].elements, "steps": a.steps,
           "adamw_s": med["adamw"], "weights_s": med["weights"],
           "weights_vs_adamw": med["weights"] / med["adamw"],
           "changed_last": last["weights"].changed,
           "adamw_state_bytes": last["adamw"].state_bytes,
           "weights_state_bytes": last["weights"].state_bytes,
           "weights_parent_bytes": last["weights"].parent_bytes,
           "rss_kib": {p: rss(a, p) for p in ("none", "adamw", "weights")},
           "command": h.command_line(__file__)}
    print(json.dumps(out, indent=1))
    h.write_json(a.json, out)
    h.remove(a.work)


if __name__ == "__main__":
    main()
