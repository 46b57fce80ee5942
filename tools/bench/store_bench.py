#!/opt/dte/venv/bin/python
"""End-to-end store benchmarks for dtectl, each against a baseline in the same run.

  commit    dtectl commit of step 1 (a ~1.5% sparse update) vs `zstd -1 -T0` of the
            same checkpoint (the dense-checkpoint baseline); wall-time ratio.
  memory    peak RSS of commit and export (/usr/bin/time) at each size.
  export    dtectl export throughput vs `cp -r` of the same plain files.
  delta     stored bytes per changed BF16 element over a sequence vs the AReaL-DTE
            wire format (int32 index + BF16 value, zstd) computed on the same data.

Usage: /opt/dte/venv/bin/python tools/bench/store_bench.py [--sizes 512MiB,2GiB] [--work DIR]
       [--steps N] [--torch-steps N] [--reps R] [--commit-only] [--json OUT]
"""
import os
import statistics
import subprocess
import sys

import numpy as np

import harness as h


def generate(tools, out, size, steps):
    """Steps 0..steps of a dte-gen model (kept between runs); their directories."""
    if not os.path.isdir(h.step_dir(out, steps)):
        h.generate(tools, out, ["--size", size], steps)
    return [h.step_dir(out, s) for s in range(steps + 1)]


def bench_size(tools, work, size, reps, commit_only=False):
    ckpts = generate(tools, work(f"gen-{size}"), size, 1)
    files = sorted(os.path.join(ckpts[1], f) for f in os.listdir(ckpts[1]))
    store, cache, zout = work("store"), work("cache"), work("dense.zst")

    def commit(rep):
        h.remove(store, cache)
        h.run(tools.dtectl_cmd("import", store, cache, ckpts[0]))
        # Same warm page cache for both sides: read the inputs once first.
        subprocess.run(["cat"] + files, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(["sync"])
        return h.measure(tools.dtectl_cmd("commit", store, cache, ckpts[1]))

    def zstd(rep):
        subprocess.run(["sync"])
        m = h.measure(["sh", "-c", f"zstd -1 -T0 -q -c {' '.join(files)} > {zout}"])
        return m, os.path.getsize(zout)

    commits, zstds = [], []
    for rep in range(reps):  # the commit first: zstd runs on what it left in the page cache
        commits.append(commit(rep))
        zstds.append(zstd(rep))
        os.remove(zout)
    commit_t, zstd_t = [m.seconds for m in commits], [m.seconds for m, _ in zstds]
    v1 = tools.log(store, cache)[1]
    result = {
        "size": size,
        "dense_bytes": h.dir_bytes(ckpts[1]),
        "changed_fraction": v1["changed_elements"] / v1["elements"],
        "commit_s": statistics.median(commit_t),
        "zstd_s": statistics.median(zstd_t),
        "commit_over_zstd": statistics.median(commit_t) / statistics.median(zstd_t),
        "commit_over_zstd_runs": h.ratios(commit_t, zstd_t),
        "zstd_bytes": zstds[-1][1],
        "stored_bytes": v1["stored_bytes"],
        "commit_rss_mib": max(m.peak_rss for m in commits) / h.MIB,
    }
    if commit_only:
        return result
    # Export vs cp -r, both from a warm page cache, neither syncing. Write
    # speed on this machine swings a lot from run to run, so the two run as
    # pairs in alternating order and the ratio is taken per pair.
    exp = {dest: export_pairs(tools, store, cache, ckpts[1], dest, reps)
           for dest in (work.path, "/dev/shm")}
    return {**result,
            "export_disk": {k: v for k, v in exp[work.path].items() if k != "rss"},
            "export_tmpfs": {k: v for k, v in exp["/dev/shm"].items() if k != "rss"},
            "export_rss_mib": max(exp[work.path]["rss"] + exp["/dev/shm"]["rss"])}


def export_pairs(tools, store, cache, src, dest_root, reps):
    """Paired runs of `cp -r src` and `dtectl export` into dest_root."""
    out, cpo = os.path.join(dest_root, "dte-bench-export"), os.path.join(dest_root, "dte-bench-cp")

    def check(rep):
        h.run(["diff", "-r", out, src])
        h.remove(out, cpo)

    h.remove(out, cpo)
    exports, cps = h.paired(
        lambda rep: h.measure(tools.dtectl_cmd("export", store, cache, "--version", "1", out)),
        lambda rep: h.measure(["cp", "-r", src, cpo]), reps,
        between=lambda rep: subprocess.run(["sync"]),  # dirty pages of one side throttle the other
        after=check, baseline_first=True)
    subprocess.run(["sync"])
    exp_t, cp_t = [m.seconds for m in exports], [m.seconds for m in cps]
    r = h.ratios(cp_t, exp_t)
    return {"export_s": statistics.median(exp_t), "cp_s": statistics.median(cp_t),
            "ratio_median": statistics.median(r), "ratio_min": min(r), "ratio_max": max(r),
            "rss": [m.peak_rss / h.MIB for m in exports]}


def areal_bytes(prev_dir, cur_dir):
    """int32 index + BF16 value per changed BF16 element, zstd -3, as AReaL-DTE sends."""
    parts, changed = [], 0
    for _, _, old, new in h.bf16_pairs(prev_dir, cur_dir):
        idx = np.nonzero(old != new)[0]
        changed += len(idx)
        rec = np.empty(len(idx), dtype=[("i", "<i4"), ("v", "<u2")])
        rec["i"], rec["v"] = idx, new[idx]
        parts.append(rec.tobytes())
    z = h.run(["zstd", "-3", "-q", "-c"], input=b"".join(parts), text=False).stdout
    return len(z), changed


def bench_delta(tools, work, name, ckpts):
    store, cache = work(f"store-{name}"), work("cache")
    h.remove(store)
    h.run(tools.dtectl_cmd("import", store, cache, ckpts[0]))
    for c in ckpts[1:]:
        h.run(tools.dtectl_cmd("commit", store, cache, c))
    log = tools.log(store, cache)
    steps = []
    for i in range(1, len(ckpts)):
        zb, changed = areal_bytes(ckpts[i - 1], ckpts[i])
        v = log[i]
        steps.append({"step": i, "changed_fraction": v["changed_elements"] / v["elements"],
                      "dte_bytes": v["stored_bytes"], "changed": v["changed_elements"],
                      "areal_bytes": zb, "areal_changed": changed})
    dte = sum(s["dte_bytes"] for s in steps) / sum(s["changed"] for s in steps)
    areal = sum(s["areal_bytes"] for s in steps) / sum(s["areal_changed"] for s in steps)
    h.remove(store)
    return {"sequence": name, "steps": len(steps),
            "mean_changed_fraction": statistics.mean(s["changed_fraction"] for s in steps),
            "dte_bytes_per_changed": dte, "areal_bytes_per_changed": areal,
            "areal_over_dte": areal / dte, "per_step": steps}


def size_line(r):
    line = (f"[{r['size']}] changed {100 * r['changed_fraction']:.2f}%  commit {r['commit_s']:.2f} s"
            f"  zstd -1 -T0 {r['zstd_s']:.2f} s  ratio "
            f"{h.fmt_range(r['commit_over_zstd_runs'])}"
            f"  | stored {r['stored_bytes'] / h.MIB:.1f} MiB vs zstd {r['zstd_bytes'] / h.MIB:.1f} MiB")
    for name in ("disk", "tmpfs"):
        e = r.get("export_" + name)
        if e:
            line += (f"  | export->{name} {e['export_s']:.2f} s  cp -r {e['cp_s']:.2f} s"
                     f"  throughput ratio median {e['ratio_median']:.2f}"
                     f" [{e['ratio_min']:.2f}-{e['ratio_max']:.2f}]")
    line += f"  | peak RSS commit {r['commit_rss_mib']:.0f} MiB"
    if "export_rss_mib" in r:
        line += f" export {r['export_rss_mib']:.0f} MiB"
    return line


def main():
    ap = h.parser(__doc__)
    ap.add_argument("--sizes", default="512MiB,2GiB")
    ap.add_argument("--work", default="/tmp/dte-bench",
                    help="scratch directory (generated models are kept for the next run)")
    ap.add_argument("--steps", type=int, default=8, help="dte-gen sequence length for delta sizes")
    ap.add_argument("--torch-steps", type=int, default=8, help="torch_gen sequence length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-size", action="store_true")
    ap.add_argument("--commit-only", action="store_true",
                    help="only commit vs zstd at each size (no export, no delta sizes)")
    a = ap.parse_args()
    tools = h.Tools(a.build_dir, names=("dtectl", "dtegen"))
    work = h.Scratch(a.work, keep=True)
    results = {"sizes": [], "delta": []}
    if not a.skip_size:
        for size in a.sizes.split(","):
            results["sizes"].append(bench_size(tools, work, size, a.reps, a.commit_only))
            print(size_line(results["sizes"][-1]), flush=True)
    seqs = []
    if not a.commit_only:
        seqs.append(("dte-gen 64MiB", generate(tools, work("seq-gen"), "64MiB", a.steps)))
        torch_dir = work("seq-torch")
        if a.torch_steps > 0:
            if not os.path.isdir(h.step_dir(torch_dir, a.torch_steps)):
                h.run([sys.executable, os.path.join(h.ROOT, "tools", "gen", "torch_gen.py"),
                       "--out", torch_dir, "--steps", a.torch_steps])
            seqs.append(("torch_gen", [h.step_dir(torch_dir, s)
                                       for s in range(a.torch_steps + 1)]))
    for name, ckpts in seqs:
        r = bench_delta(tools, work, name, ckpts)
        results["delta"].append(r)
        print(f"[{name}] {r['steps']} steps, mean changed {100 * r['mean_changed_fraction']:.2f}%"
              f"  dte {r['dte_bytes_per_changed']:.3f} B/changed element"
              f"  AReaL-DTE wire {r['areal_bytes_per_changed']:.3f} B"
              f"  ratio {r['areal_over_dte']:.2f}x", flush=True)
    h.write_json(a.json, results)
    h.remove(work("store"), work("cache"))


if __name__ == "__main__":
    main()
