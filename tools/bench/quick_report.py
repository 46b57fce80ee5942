#!/opt/dte/venv/bin/python
"""Compares the ratios of one tools/bench/quick.sh run with their reference figures.

Reads the JSON each benchmark of the quick set wrote into --results, takes
each headline ratio (dte against its baseline in the same run), and prints
it beside its reference figure from --reference (quick_reference.json, the
one source of the figures docs/benchmarks.md quotes for the quick set).
A ratio more than --tolerance worse than its reference is flagged, and so
is one that could not be computed (its benchmark failed); the exit status
is 1 if anything was flagged.

Usage: /opt/dte/venv/bin/python tools/bench/quick_report.py --results DIR
       [--reference tools/bench/quick_reference.json] [--tolerance 0.2]
       [--benches "commit fs chain live dist push fp8_read fp8_live fp8_push"]
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load(results, name):
    with open(os.path.join(results, name + ".json")) as f:
        return json.load(f)


def summary(values):
    """(median, min, max) of per-repetition ratios."""
    return statistics.median(values), min(values), max(values)


def commit_vs_zstd(results):
    size = load(results, "commit")["sizes"][0]
    return summary(size["commit_over_zstd_runs"])


def cold_read_vs_passthrough(results):
    res = next(iter(load(results, "fs")["results"].values()))
    return summary([d / p for d, p in zip(res["cold_dtefs"], res["cold_pt"])])


def chain_row(results):
    return load(results, "chain")[0]


def chain_commit_last_vs_first(results):
    r = chain_row(results)["commit_ratio"]
    return r, r, r


def chain_latest_vs_anchor(results):
    r = chain_row(results)["join_ratio"]
    return r, r, r


def chain_recent_vs_anchor(results):
    r = chain_row(results)["join_worst_ratio"]
    return r, r, r


def live_apply_vs_cold_reload(results):
    res = load(results, "live")["results"]
    applies = [row["wall"] for row in res["apply_cold_default"]]
    return summary([reload / apply for reload, apply in zip(res["reload_cold"], applies)])


def dist_cpu_vs_single(results):
    d = load(results, "dist")
    worlds = [k for k in d if k.isdigit()]
    ranks = d[max(worlds, key=int)]
    r = sum(x["cpu"] for x in ranks) / d["single"]["cpu"]
    return r, r, r


def dist_exchanged_per_changed(results):
    d = load(results, "dist")
    worlds = [k for k in d if k.isdigit()]
    ranks = d[max(worlds, key=int)]
    r = sum(x["bytes_sent"] for x in ranks) / ranks[0]["changed"]
    return r, r, r


def push_rows(results):
    rows = load(results, "push")["rows"]
    pushes = [r for r in rows if "push_s" in r and r.get("mode", "receivers") == "receivers"]
    last = max(pushes, key=lambda r: r["step"])
    baselines = [r for r in rows if "baseline_s" in r]
    return last, baselines


def push_vs_full_sync(results):
    last, baselines = push_rows(results)
    med = statistics.median(r["baseline_s"] for r in baselines) / last["push_s"]
    each = [r["baseline_s"] / last["push_s"] for r in baselines]
    return med, min(each), max(each)


def push_bytes_vs_full_sync(results):
    last, baselines = push_rows(results)
    r = baselines[0]["baseline_bytes"] / last["push_bytes"]
    return r, r, r


def fp8_read_vs_bf16(results):
    """BF16 read time / FP8 read time, per repetition and reader."""
    r = load(results, "fp8_read")
    return summary([1 / x for reader in ("sequential", "parallel") for x in r[reader]["ratios"]])


FP8_LIVE_KINDS = ("fp8-plain", "fp8-pow2")


def fp8_live_bytes_vs_bf16(results):
    """Bytes an FP8 step writes into the quantized tensors / a BF16 step's
    (the bytes written into the tensors kept in BF16 taken off both)."""
    res = load(results, "fp8_live")["results"]
    keep = res["unquantized_bytes"]
    bf16 = statistics.median(r["fwd"]["bytes"] for r in res["bf16"])
    return summary([(r["fwd"]["bytes"] - keep) / (bf16 - keep)
                    for kind in FP8_LIVE_KINDS for r in res[kind]])


def fp8_live_vs_requant(results):
    """Re-quantizing the version / the FP8 apply (cold), per rule and repetition."""
    res = load(results, "fp8_live")["results"]
    return summary([q["total_s"] / r["fwd"]["wall"] for kind in FP8_LIVE_KINDS
                    for q, r in zip(res["requant-" + kind.split("-")[1]], res[kind])])


def fp8_push_bytes_vs_bf16(results):
    """Bytes the FP8 receivers' last step wrote into the quantized tensors / the BF16's."""
    res = load(results, "fp8_push")["results"]
    bf16 = max(res["bf16"]["rows"], key=lambda r: r["step"])
    return summary([r["written_quantized"] / bf16["written_quantized"]
                    for kind, k in res.items() if kind != "bf16"
                    for r in k["rows"] if r["step"] == bf16["step"]])


def fp8_push_time_vs_bf16(results):
    """The server's push time of an FP8 receiver's step / a BF16 receiver's,
    past step 1 (the first push reads the parents whole and builds the
    block summaries; later ones step them)."""
    res = load(results, "fp8_push")["results"]
    bf16 = {r["step"]: r["push_s"] for r in res["bf16"]["rows"]}
    return summary([r["push_s"] / bf16[r["step"]] for kind, k in res.items() if kind != "bf16"
                    for r in k["rows"] if r["step"] > 1 and r["step"] in bf16])


METRICS = {
    "commit_vs_zstd": commit_vs_zstd,
    "cold_read_vs_passthrough": cold_read_vs_passthrough,
    "chain_commit_last_vs_first": chain_commit_last_vs_first,
    "chain_latest_vs_anchor": chain_latest_vs_anchor,
    "chain_recent_vs_anchor": chain_recent_vs_anchor,
    "live_apply_vs_cold_reload": live_apply_vs_cold_reload,
    "dist_cpu_vs_single": dist_cpu_vs_single,
    "dist_exchanged_per_changed": dist_exchanged_per_changed,
    "push_vs_full_sync": push_vs_full_sync,
    "push_bytes_vs_full_sync": push_bytes_vs_full_sync,
    "fp8_read_vs_bf16": fp8_read_vs_bf16,
    "fp8_live_bytes_vs_bf16": fp8_live_bytes_vs_bf16,
    "fp8_live_vs_requant": fp8_live_vs_requant,
    "fp8_push_bytes_vs_bf16": fp8_push_bytes_vs_bf16,
    "fp8_push_time_vs_bf16": fp8_push_time_vs_bf16,
}


def worse_by(value, ref, better):
    """How much worse than the reference value is (0.1: 10% worse; < 0: better)."""
    return value / ref - 1 if better == "lower" else ref / value - 1


def fmt(ratio):
    """Two decimals, three for ratios under 0.1 (bytes of FP8 against BF16)."""
    return f"{ratio:.3f}" if ratio < 0.1 else f"{ratio:.2f}"


def report(results, reference, tolerance, benches):
    flagged = []
    print("| ratio | better | this run [range] | reference | worse by | |")
    print("|---|---|---|---|---|---|")
    for name, ref in reference["metrics"].items():
        if benches and ref["bench"] not in benches:
            continue
        try:
            med, lo, hi = METRICS[name](results)
        except (OSError, KeyError, IndexError, ValueError, ZeroDivisionError) as e:
            flagged.append(name)
            print(f"| {name} | {ref['better']} | not measured ({type(e).__name__}: {e}) | "
                  f"{ref['reference']:g} | - | **FLAGGED** |")
            continue
        worse = worse_by(med, ref["reference"], ref["better"])
        flag = worse > tolerance
        if flag:
            flagged.append(name)
        span = f" [{fmt(lo)}-{fmt(hi)}]" if hi > lo else ""
        print(f"| {name} | {ref['better']} | {fmt(med)}{span} | {ref['reference']:g} | "
              f"{100 * worse:+.0f}% | {'**FLAGGED**' if flag else 'ok'} |")
    return flagged


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="directory of the benchmarks' JSON files")
    ap.add_argument("--reference", default=os.path.join(HERE, "quick_reference.json"))
    ap.add_argument("--tolerance", type=float, default=0.2,
                    help="flag a ratio this much worse than its reference (0.2: 20%%)")
    ap.add_argument("--benches", default="",
                    help="only the ratios of these benchmarks (space-separated; default all)")
    a = ap.parse_args()
    with open(a.reference) as f:
        reference = json.load(f)
    unknown = set(reference["metrics"]) - set(METRICS)
    if unknown:
        sys.exit(f"{a.reference} names ratios this script does not compute: {sorted(unknown)}")
    flagged = report(a.results, reference, a.tolerance, set(a.benches.split()))
    if flagged:
        print(f"\nflagged ({len(flagged)}): {', '.join(flagged)}: more than "
              f"{100 * a.tolerance:.0f}% worse than the reference, or not measured")
        return 1
    print(f"\nno ratio more than {100 * a.tolerance:.0f}% worse than its reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
