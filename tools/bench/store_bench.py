#!/opt/dte/venv/bin/python
"""End-to-end store benchmarks for dtectl, each against a baseline in the same run.

  commit    dtectl commit of step 1 (a ~1.5% sparse update) vs `zstd -1 -T0` of the
            same checkpoint (the dense-checkpoint baseline); wall-time ratio.
  memory    peak RSS of commit and export (/usr/bin/time -v) at each size.
  export    dtectl export throughput vs `cp -r` of the same plain files.
  delta     stored bytes per changed BF16 element over a sequence vs the AReaL-DTE
            wire format (int32 index + BF16 value, zstd) computed on the same data.

Usage: /opt/dte/venv/bin/python tools/bench/store_bench.py [--sizes 512MiB,2GiB] [--work DIR]
       [--steps N] [--torch-steps N] [--reps R] [--commit-only] [--json OUT]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(ROOT, "build"))
DTECTL = os.path.join(BUILD, "tools", "dtectl")
DTEGEN = os.path.join(BUILD, "tools", "dte-gen")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def timed(cmd, env=None):
    """Runs cmd under /usr/bin/time -v; returns (seconds, peak RSS in MiB, stdout)."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, env=env)
    secs = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    return secs, rss / 1024.0, p.stdout


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def drop_caches():
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def generate(out, size, steps):
    if not os.path.isdir(os.path.join(out, f"step-{steps:06d}")):
        run([DTEGEN, "--out", out, "--size", size, "--steps", str(steps), "-q"])
    return [os.path.join(out, f"step-{s:06d}") for s in range(steps + 1)]


def dtectl(store, cache, *args):
    return [DTECTL, args[0], "--store", store, "--cache-dir", cache, "-q"] + list(args[1:])


def bench_size(work, size, reps, commit_only=False):
    ckpts = generate(os.path.join(work, f"gen-{size}"), size, 1)
    dense = dir_bytes(ckpts[1])
    files = sorted(os.path.join(ckpts[1], f) for f in os.listdir(ckpts[1]))
    commit_t, zstd_t, commit_rss = [], [], []
    for r in range(reps):
        store, cache = os.path.join(work, "store"), os.path.join(work, "cache")
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        run(dtectl(store, cache, "import", ckpts[0]))
        # Same warm page cache for both sides: read the inputs once first.
        subprocess.run(["cat"] + files, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(["sync"])
        secs, rss, _ = timed(dtectl(store, cache, "commit", ckpts[1]))
        commit_t.append(secs)
        commit_rss.append(rss)
        zout = os.path.join(work, "dense.zst")
        subprocess.run(["sync"])
        secs, _, _ = timed(["sh", "-c", f"zstd -1 -T0 -q -c {' '.join(files)} > {zout}"])
        zstd_t.append(secs)
        zstd_bytes = os.path.getsize(zout)
        os.remove(zout)
    log = json.loads(run([DTECTL, "log", "--store", store, "--cache-dir", cache, "--json"]).stdout)
    v1 = log[1]
    result = {
        "size": size,
        "dense_bytes": dense,
        "changed_fraction": v1["changed_elements"] / v1["elements"],
        "commit_s": statistics.median(commit_t),
        "zstd_s": statistics.median(zstd_t),
        "commit_over_zstd": statistics.median(commit_t) / statistics.median(zstd_t),
        "commit_over_zstd_runs": [c / z for c, z in zip(commit_t, zstd_t)],
        "zstd_bytes": zstd_bytes,
        "stored_bytes": v1["stored_bytes"],
        "commit_rss_mib": max(commit_rss),
    }
    if commit_only:
        return result
    # Export vs cp -r, both from a warm page cache, neither syncing. Write
    # speed on this machine swings a lot from run to run, so the two run as
    # pairs in alternating order and the ratio is taken per pair.
    exp = {}
    for dest in (work, "/dev/shm"):
        exp[dest] = export_pairs(store, cache, ckpts[1], dest, reps)
    exp_rss = exp[work]["rss"] + exp["/dev/shm"]["rss"]
    return {
        **result,
        "export_disk": {k: v for k, v in exp[work].items() if k != "rss"},
        "export_tmpfs": {k: v for k, v in exp["/dev/shm"].items() if k != "rss"},
        "export_rss_mib": max(exp_rss),
    }


def export_pairs(store, cache, src, dest_root, reps):
    """Paired runs of `cp -r src` and `dtectl export` into dest_root."""
    ratios, exp_t, cp_t, rss_all = [], [], [], []
    for r in range(reps):
        out = os.path.join(dest_root, "dte-bench-export")
        cpo = os.path.join(dest_root, "dte-bench-cp")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cpo, ignore_errors=True)
        secs = {}
        for side in (("cp", "export") if r % 2 == 0 else ("export", "cp")):
            subprocess.run(["sync"])  # dirty pages of one side would throttle the other
            if side == "cp":
                secs["cp"], _, _ = timed(["cp", "-r", src, cpo])
            else:
                secs["export"], rss, _ = timed(dtectl(store, cache, "export", "--version", "1", out))
                rss_all.append(rss)
        run(["diff", "-r", out, src])
        shutil.rmtree(out)
        shutil.rmtree(cpo)
        exp_t.append(secs["export"])
        cp_t.append(secs["cp"])
        ratios.append(secs["cp"] / secs["export"])
    subprocess.run(["sync"])
    return {"export_s": statistics.median(exp_t), "cp_s": statistics.median(cp_t),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rss": rss_all}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], data[b:e])
    return out


def areal_bytes(prev_dir, cur_dir):
    """int32 index + BF16 value per changed BF16 element, zstd -3, as AReaL-DTE sends."""
    idx_val, changed = [], 0
    for f in sorted(os.listdir(cur_dir)):
        if not f.endswith(".safetensors"):
            continue
        a, b = read_safetensors(os.path.join(prev_dir, f)), read_safetensors(os.path.join(cur_dir, f))
        for name, (dt, cur) in b.items():
            if dt != "BF16":
                continue
            old = a[name][1].view(np.uint16)
            new = cur.view(np.uint16)
            idx = np.nonzero(old != new)[0]
            changed += len(idx)
            rec = np.empty(len(idx), dtype=[("i", "<i4"), ("v", "<u2")])
            rec["i"], rec["v"] = idx, new[idx]
            idx_val.append(rec.tobytes())
    raw = b"".join(idx_val)
    z = subprocess.run(["zstd", "-3", "-q", "-c"], input=raw, capture_output=True, check=True).stdout
    return len(z), changed


def bench_delta(work, name, ckpts):
    store, cache = os.path.join(work, f"store-{name}"), os.path.join(work, "cache")
    shutil.rmtree(store, ignore_errors=True)
    run(dtectl(store, cache, "import", ckpts[0]))
    for c in ckpts[1:]:
        run(dtectl(store, cache, "commit", c))
    log = json.loads(run([DTECTL, "log", "--store", store, "--cache-dir", cache, "--json"]).stdout)
    steps = []
    for i in range(1, len(ckpts)):
        zb, changed = areal_bytes(ckpts[i - 1], ckpts[i])
        v = log[i]
        steps.append({"step": i, "changed_fraction": v["changed_elements"] / v["elements"],
                      "dte_bytes": v["stored_bytes"], "changed": v["changed_elements"],
                      "areal_bytes": zb, "areal_changed": changed})
    dte = sum(s["dte_bytes"] for s in steps) / sum(s["changed"] for s in steps)
    areal = sum(s["areal_bytes"] for s in steps) / sum(s["areal_changed"] for s in steps)
    shutil.rmtree(store, ignore_errors=True)
    return {"sequence": name, "steps": len(steps),
            "mean_changed_fraction": statistics.mean(s["changed_fraction"] for s in steps),
            "dte_bytes_per_changed": dte, "areal_bytes_per_changed": areal,
            "areal_over_dte": areal / dte, "per_step": steps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512MiB,2GiB")
    ap.add_argument("--work", default="/tmp/dte-bench")
    ap.add_argument("--steps", type=int, default=8, help="dte-gen sequence length for delta sizes")
    ap.add_argument("--torch-steps", type=int, default=8, help="torch_gen sequence length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--skip-size", action="store_true")
    ap.add_argument("--commit-only", action="store_true",
                    help="only commit vs zstd at each size (no export, no delta sizes)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    results = {"sizes": [], "delta": []}
    if not a.skip_size:
        for size in a.sizes.split(","):
            r = bench_size(a.work, size, a.reps, a.commit_only)
            results["sizes"].append(r)
            print(f"[{size}] changed {100 * r['changed_fraction']:.2f}%  commit {r['commit_s']:.2f} s"
                  f"  zstd -1 -T0 {r['zstd_s']:.2f} s  ratio {r['commit_over_zstd']:.2f}"
                  f" [{min(r['commit_over_zstd_runs']):.2f}-{max(r['commit_over_zstd_runs']):.2f}]"
                  f"  | stored {r['stored_bytes'] / 2**20:.1f} MiB vs zstd {r['zstd_bytes'] / 2**20:.1f} MiB"
                  + "".join(
                      f"  | export->{name} {e['export_s']:.2f} s  cp -r {e['cp_s']:.2f} s"
                      f"  throughput ratio median {e['ratio_median']:.2f}"
                      f" [{e['ratio_min']:.2f}-{e['ratio_max']:.2f}]"
                      for name, e in (("disk", r.get("export_disk")), ("tmpfs", r.get("export_tmpfs")))
                      if e)
                  + f"  | peak RSS commit {r['commit_rss_mib']:.0f} MiB"
                  + (f" export {r['export_rss_mib']:.0f} MiB" if "export_rss_mib" in r else ""),
                  flush=True)
    seqs = []
    if not a.commit_only:
        seqs.append(("dte-gen 64MiB", generate(os.path.join(a.work, "seq-gen"), "64MiB", a.steps)))
    torch_dir = os.path.join(a.work, "seq-torch")
    if a.torch_steps > 0 and not a.commit_only:
        if not os.path.isdir(os.path.join(torch_dir, f"step-{a.torch_steps:06d}")):
            run([sys.executable, os.path.join(ROOT, "tools", "gen", "torch_gen.py"),
                 "--out", torch_dir, "--steps", str(a.torch_steps)])
        seqs.append(("torch_gen", [os.path.join(torch_dir, f"step-{s:06d}")
                                   for s in range(a.torch_steps + 1)]))
    for name, ckpts in seqs:
        r = bench_delta(a.work, name, ckpts)
        results["delta"].append(r)
        print(f"[{name}] {r['steps']} steps, mean changed {100 * r['mean_changed_fraction']:.2f}%"
              f"  dte {r['dte_bytes_per_changed']:.3f} B/changed element"
              f"  AReaL-DTE wire {r['areal_bytes_per_changed']:.3f} B"
              f"  ratio {r['areal_over_dte']:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
