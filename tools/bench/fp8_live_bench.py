#!/opt/dte/venv/bin/python
"""Live apply into an FP8 receiver against a BF16 receiver and against
re-quantizing the whole model from BF16 after every step.

Generates a dte-gen Llama (32 heads, 8 KV heads; hidden and intermediate
multiples of 128, so vLLM's fused TP-1 layout splits on 128 x 128 blocks) of
--size BF16 bytes, commits steps 0, 1 and 2 (an anchor and two sparse AdamW
deltas of about 1.5% of BF16 elements each), and measures, per repetition,
each on a fresh dtefs mount with v1 live after dropping the page cache,
"cold" (default block cache, empty) and "warm" (a --warm-cache block cache
holding v1's blocks, read once through the mount: what a mount that applied
v1 holds, so v2's blocks are v1's plus one delta):

  bf16       `dtectl apply --version 2` then `--version 1` with one TP-1
             receiver holding every tensor in BF16 in /dev/shm;
  fp8-plain  the same with an FP8 receiver (dte.LiveReceiver(fp8=...)):
  fp8-pow2   E4M3 bytes + F32 scales for the quantized tensors, BF16 for
             the others, 128 x 128 blocks, plain or power-of-two scales;
  requant    the alternative: build/tools/bench/fp8_requant reads every file
             of MNT/v00000002 with 1 MiB reads, quantizes every quantized
             tensor with the same CPU quantizer (kernels/fp8.h) and copies
             the others into one /dev/shm object, per scale rule.

Reported: bytes written into the receiver (the apply's counts: FP8 bytes +
4 per scale + 2 per BF16 element), the apply's wall time (the dtectl
command) and the daemon's own split (decode: changed set + FP8 change sets;
scatter), against requant's read and quantize+write times. The FP8
receivers' buffers are checked after the first forward apply against the
numpy + ml_dtypes reference (tests/py/fp8_ref.py) of v2 on a sample of
tensors (layer 0 and lm_head), the BF16 receiver's against v2 itself.

Usage: /opt/dte/venv/bin/python tools/bench/fp8_live_bench.py [--build-dir build]
       [--size 1536MiB] [--reps 3] [--quick] [--work DIR] [--keep] [--json OUT]
"""
import json
import os
import statistics
import sys
import time

import numpy as np

import harness as h
import live_bench as lb

sys.path.insert(0, h.PY_PATH)
BLOCK = 128
KINDS = ("bf16", "fp8-plain", "fp8-pow2")
CHECKED = ("model.layers.0.", "lm_head.")


def model_args(size, quick):
    """dte-gen options: hidden 2048 (1024 --quick), intermediate 5632 (2816)."""
    hidden, inter = (1024, 2816) if quick else (2048, 5632)
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * inter)
    layers = max(1, (h.parse_size(size) - 4 * 32000 * hidden) // per_layer)
    return ["--hidden", str(hidden), "--intermediate", str(inter), "--layers", str(layers),
            "--vocab", "32000", *lb.GEOMETRY]


def receiver_tensors(state, g, kind):
    """{name: (dtype, array)} a TP-1 fused receiver of `kind` holds of `state`;
    FP8 tensors are left zero (filled by fill())."""
    from dte import Fp8Options
    out = {}
    for name, a in lb.shard(state, g, 1, 0):
        if kind == "bf16" or not name.endswith("_proj.weight"):
            out[name] = ("BF16", a)
            continue
        out[name] = ("F8_E4M3", a)
        opts = Fp8Options(block=BLOCK)
        out[Fp8Options.scale_name(name)] = ("F32", opts.scale_shape(a.shape))
    return out


def reference(a, kind):
    from fp8_ref import ref_quantize
    return ref_quantize(np.asarray(a), BLOCK, BLOCK, kind.split("-")[1])


class Receiver:
    """One TP-1 receiver of `kind` in /dev/shm holding vBASE (FP8 tensors
    quantized by the numpy reference), registered on each fresh mount."""

    def __init__(self, d, kind, shm):
        import dte
        self.kind, self.dte = kind, dte
        g = lb.geometry(d)

        def fill(state):
            parts = receiver_tensors(state, g, kind)
            spec = {k: (dt, a if dt == "F32" else a.shape) for k, (dt, a) in parts.items()}
            w = dte.SharedWeights(shm, spec)
            for k, (dt, a) in parts.items():
                if dt == "BF16":
                    w.array(k)[...] = a
                elif dt == "F8_E4M3":
                    q, s = reference(a, kind)
                    w.array(k)[...] = q
                    w.array(dte.Fp8Options.scale_name(k))[...] = s
            return w
        h.log(f"filling the {kind} receiver from {d}")
        self.w = lb.with_version(d, fill)
        self.rx = None

    def register(self, mount, version):
        fp8 = None
        if self.kind != "bf16":
            fp8 = self.dte.Fp8Options(block=BLOCK, scale_rule=self.kind.split("-")[1])
        self.rx = self.dte.LiveReceiver(mount, tp=1, rank=0, fp8=fp8)
        self.rx.register_shared(self.w, version)

    def unregister(self):
        self.rx.close()
        self.rx = None

    def check(self, d):
        """The sampled tensors equal version directory d (quantized by the reference)."""
        def cmp(state):
            for k, (dt, a) in receiver_tensors(state, lb.geometry(d), self.kind).items():
                if not k.startswith(CHECKED) or dt == "F32":
                    continue
                if dt == "F8_E4M3":
                    q, s = reference(a, self.kind)
                    scale = self.dte.Fp8Options.scale_name(k)
                    ok = (np.array_equal(self.w.array(k), q)
                          and np.array_equal(self.w.array(scale).view(np.uint32),
                                             s.view(np.uint32)))
                else:
                    ok = np.array_equal(self.w.array(k), a)
                if not ok:
                    raise RuntimeError(f"BUG: the {self.kind} receiver's {k} is not {d}")
        lb.with_version(d, cmp)

    def close(self):
        if self.rx:
            self.unregister()
        self.w.close()
        self.w.unlink()


class Bench:
    def __init__(self, a, tools, store, cache):
        self.a, self.tools, self.store, self.cache = a, tools, store, cache
        self.mnt = os.path.join(a.work, "mnt")
        self.m = None
        self.dropper = h.CacheDropper([store, cache])

    def mount(self, warm=False):
        """A fresh mount with v1 live after dropping the page cache; warm: with
        a block cache larger than the model, filled with v1's blocks (a FUSE
        read of MNT/v00000001, as the previous step's apply leaves it)."""
        self.unmount()
        self.dropper.drop()
        self.m = h.dtefs_mount(self.tools, self.store, self.mnt, self.cache, "--live-version", 1,
                               *(["--cache-size", self.a.warm_cache] if warm else []),
                               log_path=os.path.join(self.a.work, "dtefs.log")).start()
        if warm:
            h.read_sequential(self.files(os.path.join(self.mnt, "v00000001")))

    def files(self, d):
        return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".safetensors")]

    def unmount(self):
        if self.m:
            self.m.unmount()
            self.m = None

    def apply(self, version):
        cpu, t0 = self.m.cpu_seconds(), time.perf_counter()
        r = h.run([self.tools.dtectl, "apply", self.mnt, "--version", version, "--json"])
        out = json.loads(r.stdout)
        return out | {"wall": time.perf_counter() - t0, "cpu": self.m.cpu_seconds() - cpu,
                      "load": os.getloadavg()[0]}

    def requant(self, rule, warm=False):
        self.mount(warm)
        t0 = time.perf_counter()
        r = h.run([self.tools.requant, os.path.join(self.mnt, "v00000002"), BLOCK, rule])
        out = json.loads(r.stdout) | {"wall": time.perf_counter() - t0,
                                      "load": os.getloadavg()[0]}
        self.unmount()
        return out


def run_all(b, a, receivers, res, save):
    for rep in range(a.reps):
        for warm in (False, True):
            run_rep(b, a, receivers, res, save, rep, warm)


def run_rep(b, a, receivers, res, save, rep, warm):
    """One repetition of every receiver kind and both requants, cold or warm."""
    pre = "warm-" if warm else ""
    for kind in KINDS:
        b.mount(warm)
        rx = receivers[kind]
        rx.register(b.mnt, 1)
        fwd = b.apply(2)
        if rep == 0 and not warm:
            rx.check(os.path.join(b.mnt, "v00000002"))
        back = b.apply(1)
        rx.unregister()
        b.unmount()
        res[pre + kind].append({"fwd": fwd, "back": back})
        h.log(f"rep {rep} {pre}{kind}: {fwd['bytes'] / 2**20:.1f} MiB in {fwd['wall']:.3f} s, "
               f"back {back['wall']:.3f} s")
        save()
    for rule in ("plain", "pow2"):
        res[pre + "requant-" + rule].append(b.requant(rule, warm))
        h.log(f"rep {rep} {pre}requant {rule}: {res[pre + 'requant-' + rule][-1]}")
        save()


def unquantized_bytes(mnt):
    """Bytes a step v1 -> v2 writes into the tensors every receiver keeps in
    BF16 (embeddings, lm_head, norms): 2 per changed element."""
    def outer(old):
        def inner(new):
            return sum(2 * int(np.count_nonzero(old[k] != new[k])) for k in new
                       if not k.endswith("_proj.weight"))
        return lb.with_version(os.path.join(mnt, "v00000002"), inner)
    return lb.with_version(os.path.join(mnt, "v00000001"), outer)


def med(values):
    return statistics.median(values) if values else float("nan")


def report(a, res, model_line, changed):
    keep = res["unquantized_bytes"]
    print(f"\n## FP8 receivers ({model_line}; {len(res['bf16'])} repetitions, medians)\n")
    print(f"command: {a.cmdline}")
    print(f"BF16 elements changed per step (%): {changed}; page cache before each mount: "
          f"{a.drop_method}; kept in BF16 (embeddings, lm_head, norms): "
          f"{keep / 2**20:.1f} MiB of each step")
    for pre, what in (("", "cold: a fresh mount, default block cache (256MiB)"),
                      ("warm-", f"warm: block cache {a.warm_cache} holding v1's blocks")):
        print(f"\n{what}\n")
        table(res, pre, keep)
    loads = [r["fwd"]["load"] for p in ("", "warm-") for k in KINDS for r in res[p + k]]
    print(f"\n1-minute load average during the applies: {min(loads):.1f} to {max(loads):.1f} "
          f"on {os.cpu_count()} cores")


def table(res, pre, keep):
    bf16 = med([r["fwd"]["bytes"] for r in res[pre + "bf16"]])
    print("| receiver | bytes written | vs BF16 | quantized tensors' bytes | vs BF16 "
          "| apply fwd s | back s | daemon decode s "
          "| scatter s | requant s (read + quantize) | requant / apply [each repetition] |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        rows = res[pre + kind]
        nbytes = med([r["fwd"]["bytes"] for r in rows])
        fwd = med([r["fwd"]["wall"] for r in rows])
        back = med([r["back"]["wall"] for r in rows])
        dec = med([r["fwd"]["decode_ns"] / 1e9 for r in rows])
        sc = med([r["fwd"]["scatter_ns"] / 1e9 for r in rows])
        rq, ratio = "", ""
        if kind != "bf16":
            q = res[pre + "requant-" + kind.split("-")[1]]
            total = med([r["total_s"] for r in q])
            rq = (f"{total:.2f} ({med([r['read_s'] for r in q]):.2f} + "
                  f"{med([r['quantize_s'] for r in q]):.2f})")
            each = [x["total_s"] / r["fwd"]["wall"] for x, r in zip(q, rows)]
            ratio = f"{total / fwd:.1f}x [{', '.join(f'{x:.1f}' for x in each)}]"
        print(f"| {kind} | {nbytes / 2**20:.1f} MiB | {nbytes / bf16:.3f} | "
              f"{(nbytes - keep) / 2**20:.1f} MiB | {(nbytes - keep) / (bf16 - keep):.3f} | "
              f"{fwd:.2f} | "
              f"{back:.2f} | {dec:.2f} | {sc:.3f} | {rq} | {ratio} |")


def parse_args():
    ap = h.parser(__doc__)
    ap.add_argument("--work", default="/var/tmp/dte-fp8-live-bench")
    ap.add_argument("--size", help="BF16 bytes of the model (default 1536MiB; --quick 128MiB)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, help="repetitions (default 3; --quick 1)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--warm-cache", default="4GiB",
                    help="dtefs --cache-size of the warm runs (more than the model)")
    a = ap.parse_args()
    a.size = a.size or ("128MiB" if a.quick else "1536MiB")
    a.reps = a.reps or (1 if a.quick else 3)
    a.model_args = model_args(a.size, a.quick)
    a.cmdline = h.command_line(__file__)
    a.work = os.path.abspath(a.work)
    return a


def main():
    a = parse_args()
    work = h.Scratch(a.work, keep=a.keep, names=("store", "cache", "bin", "gen", "mnt",
                                                  "model.json", "dtefs.log"))
    b, receivers = None, {}
    with work:
        try:
            tools = h.Tools(a.build_dir, work("bin"),
                            names=("dtectl", "dtefs", "dtegen", "libdte", "requant"))
            os.environ["DTE_LIBRARY"] = tools.libdte  # the dte package loads this copy
            model_line = lb.check_model(tools, a.model_args, 1)
            store, cache = work("store"), work("cache")
            changed = lb.build_store(tools, a, store, cache, 2)
            b = Bench(a, tools, store, cache)
            b.mount()
            res = {p + k: [] for p in ("", "warm-")
                   for k in (*KINDS, "requant-plain", "requant-pow2")}
            res["unquantized_bytes"] = unquantized_bytes(b.mnt)
            for kind in KINDS:
                receivers[kind] = Receiver(os.path.join(b.mnt, "v00000001"), kind,
                                           f"dte-fp8-bench-{os.getpid()}-{kind}")
            b.unmount()

            def save():
                h.write_json(a.json, {"results": res, "changed": changed, "model": model_line})
            run_all(b, a, receivers, res, save)
            a.drop_method = b.dropper.method
            report(a, res, model_line, changed)
        finally:
            for rx in receivers.values():
                rx.close()
            if b is not None:
                b.unmount()


if __name__ == "__main__":
    main()
