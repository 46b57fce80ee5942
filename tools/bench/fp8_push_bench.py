#!/opt/dte/venv/bin/python
"""A push step into an FP8 receiver against one into a BF16 receiver
(docs/push.md "FP8 receivers", figures in docs/benchmarks.md "FP8
receivers").

The model and training are tools/bench/push_bench.py's: a Llama-shaped
model of about --size (BF16; GQA, untied head) trained with
torch.optim.AdamW (random gradients, --lr 7e-7: about 3% of BF16 weights
change at step 1, falling to 1.5-2% by step 3). For each receiver kind of
--kinds (bf16; FP8 with blocks of 128 x 128 and plain or pow2 scales) the
run starts again from the same seed: the trainer (this process) publishes
every step with dte.Publisher(push=dte.PushGroup(...)) to one receiver in
this process, rank 0 of vLLM's fused layout of TP --tp, in CPU memory. The
receiver starts empty and catches up from the store (for FP8: the version
quantized); pushes wait until apply_pending() writes them.

Per kind and step it reports:
  changed     BF16 elements the step changed (of the whole model)
  push_s      seconds of the push (the server's remap and encode, for FP8
              the FP8 change sets, the sending, the receiver's checks)
  pack_s      of which the server's remap and encode
  apply_s     seconds of apply_pending() (the receiver's writes)
  sent        bytes the push sent to the receiver
  written     bytes the receiver wrote (elements times their width;
              FP8: E4M3 bytes plus 4 per scale)
  written_quantized  of which into the tensors FP8 receivers quantize (the
              rest, embeddings, lm_head and norms, every kind holds in BF16)
  parent_reads, parent_bytes  for FP8: parent tensors the server read from
              the store whole, and the parent's bytes it read in all
and per kind the catch-up's seconds. Ratios FP8 / BF16 per step. The
alternative to an FP8 push, re-quantizing the whole model from BF16 after
each step, is timed with tools/bench/fp8_requant.cc (when built) on the
last version's BF16 weights saved to a directory.

Usage: /opt/dte/venv/bin/python tools/bench/fp8_push_bench.py [--size 1GiB] [--steps 3]
       [--lr 7e-7] [--tp 1] [--kinds bf16,plain,pow2] [--json out]
"""

import json
import math
import os
import sys
import time

import harness as h
import push_bench  # the model, its shapes and vLLM's sharding

SOURCE = h.ROOT
BLOCK = 128


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def receiver_tensors(c, tp, fp8):
    """Zeroed buffers of rank 0 of vLLM's fused layout of TP tp: BF16 torch
    tensors, and for an FP8 receiver ("F8_E4M3", uint8 array) weights with
    their ("F32", array) scales."""
    import numpy as np
    import torch
    _, local = push_bench.local_layout(c, tp, 0)
    out = {}
    for n, s in local.items():
        if not n.endswith("proj.weight"):
            out[n] = torch.zeros(s, dtype=torch.bfloat16)
            continue
        if fp8 is None:  # what FP8 receivers quantize: arrays here too (not in `plain`)
            out[n] = ("BF16", np.zeros(s, dtype=np.uint16))
            continue
        out[n] = ("F8_E4M3", np.zeros(s, dtype=np.uint8))
        out[fp8.scale_name(n)] = ("F32", np.zeros(fp8.scale_shape(s), dtype=np.float32))
    return out


class Run:
    """One receiver kind: the trainer from the seed, its store and push
    group, and the receiver."""

    def __init__(self, a, dte, c, names, root, kind):
        self.a, self.dte, self.names, self.root = a, dte, names, root
        self.store = os.path.join(root, "store")
        self.trainer = push_bench.Trainer(c, a.lr, root, self.store)
        self.params = self.trainer.params
        self.group = dte.PushGroup("127.0.0.1:0", timeout=300.0)
        self.pub = dte.Publisher(store=self.store, push=self.group)
        self.fp8 = None if kind == "bf16" else dte.Fp8Options(block=BLOCK, scale_rule=kind)
        self.tensors = receiver_tensors(c, a.tp, self.fp8)
        self.rx = dte.PushReceiver(self.group.address, self.tensors, rank=0,
                                   layout=dte.FusedReceiverLayout(a.tp), version=None,
                                   timeout=300.0, fp8=self.fp8)
        try:
            self.rx.wait_for(0, timeout=60)
        except dte.MissedPushes:
            pass
        t0 = time.perf_counter()
        self.rx.catch_up(self.store)
        self.catch_up_s = time.perf_counter() - t0
        self.wait_listed()

    def wait_listed(self):
        """Until the server knows the receiver holds v0."""
        end = time.monotonic() + 60
        while not any(r.version == 0 and not r.behind for r in self.group.status().receivers):
            if time.monotonic() > end:
                raise SystemExit("the receiver did not reach the server at v0")
            time.sleep(0.01)

    def step(self, step):
        import torch
        state = self.trainer.step(step)
        written0 = self.rx.status().bytes
        res = self.trainer.publish(self.pub, step, state)
        assert res.push.pushed == 1 and not res.push.dropped, res.push
        # The tensors every kind holds in BF16 (embeddings, lm_head, norms),
        # to split the bytes written between them and the quantized ones.
        plain = {n: t.clone() for n, t in self.tensors.items() if not isinstance(t, tuple)}
        t0 = time.perf_counter()
        assert self.rx.apply_pending() == 1
        apply_s = time.perf_counter() - t0
        written = self.rx.status().bytes - written0
        plain_written = 2 * sum(int((t.view(torch.int16) != self.tensors[n].view(torch.int16))
                                    .sum()) for n, t in plain.items())
        return {"step": step, "changed": res.changed, "push_s": res.push.seconds,
                "pack_s": res.push.pack_seconds, "apply_s": apply_s, "sent": res.push.bytes,
                "written": written, "written_quantized": written - plain_written,
                "parent_reads": res.push.fp8_parent_reads,
                "parent_bytes": res.push.fp8_parent_bytes}

    def requantize(self, build_dir, rule):
        """fp8_requant over the BF16 weights now: {"read_s", "quantize_s", ...}."""
        import safetensors.torch
        import torch
        tool = os.path.join(build_dir, h.Tools.PATHS["requant"])
        if not os.access(tool, os.X_OK):
            return None
        d = os.path.join(self.root, "requant")
        os.makedirs(d)
        safetensors.torch.save_file(
            {n: t.detach().to(torch.bfloat16) for n, t in self.params.items()},
            os.path.join(d, "model.safetensors"))
        out = h.run([tool, d, BLOCK, rule]).stdout
        h.remove(d)
        return json.loads(out.strip().splitlines()[-1])

    def close(self):
        self.rx.close()
        self.pub.close()
        self.group.close()


def parse_args():
    p = h.parser(__doc__)
    p.add_argument("--size", default="1GiB")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=7e-7)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kinds", default="bf16,plain,pow2")
    p.add_argument("--work", default=None, help="where the temporary work directory goes")
    return p.parse_args()


def print_summary(results):
    """Per step: each FP8 kind against the BF16 receiver."""
    bf16 = {r["step"]: r for r in results.get("bf16", {}).get("rows", [])}
    rows = []
    for kind, res in results.items():
        for r in res["rows"]:
            b = bf16.get(r["step"])
            t = r["push_s"] + r["apply_s"]
            ratios = (["%.3f" % (r["sent"] / b["sent"]), "%.3f" % (r["written"] / b["written"]),
                       "%.3f" % (r["written_quantized"] / b["written_quantized"]),
                       "%.2f" % (t / (b["push_s"] + b["apply_s"]))] if b else ["-"] * 4)
            rows.append([kind, r["step"], "%.2f%%" % (100 * r["changed_fraction"]), "%.3f s" % t,
                         "%.1f MB" % (r["sent"] / 1e6), "%.1f MB" % (r["written"] / 1e6),
                         *ratios])
    print(h.md_table(["kind", "step", "changed", "push + apply", "sent", "written",
                      "sent / BF16", "written / BF16", "quantized tensors: written / BF16",
                      "time / BF16"], rows))
    for kind, res in results.items():
        q = res.get("requant")
        print("%s: catch-up %.2f s%s" % (kind, res["catch_up_s"], "" if not q else
                                          "; re-quantizing the model: %.2f s (+ %.2f s reading)"
                                          % (q["quantize_s"], q["read_s"])))


def main():
    a = parse_args()
    os.environ.setdefault("DTE_LIBRARY", os.path.join(a.build_dir, "sync", "libdte.so"))
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    import dte
    import torch
    torch.set_num_threads(os.cpu_count())
    c = push_bench.config_for(h.parse_size(a.size))
    names = push_bench.shapes(c)
    elements = sum(math.prod(s) for s in names.values())
    log("model: %d layers, %.2f GiB of BF16; receiver: tp=%d rank 0, fused" % (
        c["num_hidden_layers"], elements * 2 / 2**30, a.tp))
    results = {}
    with h.Scratch(prefix="dte-fp8-push-bench-", parent=a.work) as work:
        for kind in a.kinds.split(","):
            root = work(kind)
            os.makedirs(root)
            run = Run(a, dte, c, names, root, kind)
            log("%s: catch-up %.2f s" % (kind, run.catch_up_s))
            rows = []
            for step in range(1, a.steps + 1):
                r = run.step(step)
                r["changed_fraction"] = r["changed"] / elements
                log("%s step %d: %s" % (kind, step, json.dumps(r)))
                rows.append(r)
            results[kind] = {"catch_up_s": run.catch_up_s, "rows": rows,
                             "requant": None if kind == "bf16" else
                             run.requantize(a.build_dir, kind)}
            run.close()
            h.remove(root)
    print_summary(results)
    h.write_json(a.json, {"config": c, "tp": a.tp, "results": results})


if __name__ == "__main__":
    main()
