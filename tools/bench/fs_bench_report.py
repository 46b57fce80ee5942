"""Markdown report of tools/bench/fs_bench.py: the command, machine notes, the
comparison table, daemon CPU per GB and dtefs's own counters."""
import datetime
import os
import platform
import shlex
import statistics
import subprocess

import harness as h

GB = 1e9


def deltas(d):
    return f"{d} delta{'' if d == 1 else 's'} past its anchor"


def sh(cmd):
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def ratios(num, den, invert=False):
    """Per-repetition ratios num/den (den/num for times)."""
    return [(d / n if invert else n / d) for n, d in zip(num, den)]


def fmt_ratio(rs, target=None):
    med = statistics.median(rs)
    s = f"**{med:.2f}x** [{min(rs):.2f}-{max(rs):.2f}]"
    if target is not None:
        s += " ok" if med >= target else " **MISSED**"
    return s


def med(xs):
    return statistics.median(xs)


def table_rows(version, depth, r):
    tag = f"v{version} ({deltas(depth)})"
    rows = [
        (f"cold sequential read, 1 reader, all files", tag, f"{med(r['cold_dtefs']):.2f} GB/s",
         f"passthrough_ll {med(r['cold_pt']):.2f} GB/s",
         fmt_ratio(ratios(r["cold_dtefs"], r["cold_pt"]), 1.0), ">= 1.0x"),
        (f"(context) cold sequential read: dtefs vs plain files, no FUSE", tag,
         f"{med(r['cold_dtefs']):.2f} GB/s", f"ext4 directly {med(r['cold_plain']):.2f} GB/s",
         fmt_ratio(ratios(r["cold_dtefs"], r["cold_plain"])), ""),
        (f"warm sequential read, 1 reader", tag, f"{med(r['warm_dtefs']):.2f} GB/s",
         f"plain file, page cache {med(r['warm_plain']):.2f} GB/s",
         fmt_ratio(ratios(r["warm_dtefs"], r["warm_plain"]), 0.8), ">= 0.8x"),
        (f"cold, 8 readers (1 shard each) vs 1 reader (same 8 shards)", tag,
         f"{med(r['par8_dtefs']):.2f} GB/s", f"dtefs 1 reader {med(r['one8_dtefs']):.2f} GB/s",
         fmt_ratio(ratios(r["par8_dtefs"], r["one8_dtefs"]), 1.5), ">= 1.5x"),
        (f"(context) passthrough_ll, cold, 8 readers vs 1 reader", tag,
         f"{med(r['par8_pt']):.2f} GB/s", f"passthrough_ll 1 reader {med(r['one8_pt']):.2f} GB/s",
         fmt_ratio(ratios(r["par8_pt"], r["one8_pt"])), ""),
        (f"(context) cold, 8 readers: dtefs vs passthrough_ll", tag,
         f"{med(r['par8_dtefs']):.2f} GB/s", f"passthrough_ll {med(r['par8_pt']):.2f} GB/s",
         fmt_ratio(ratios(r["par8_dtefs"], r["par8_pt"])), ""),
    ]
    for loader in ("mmap", "pread"):
        for state in ("cold", "warm"):
            if f"load_{loader}_{state}_dtefs" not in r:
                continue
            d, p = r[f"load_{loader}_{state}_dtefs"], r[f"load_{loader}_{state}_plain"]
            rows.append((f"safetensors load, every shard ({loader}), {state}", tag,
                         f"{med(d):.2f} s ({r['load_bytes'] / med(d) / GB:.2f} GB/s)",
                         f"plain directory {med(p):.2f} s "
                         f"({r['load_bytes'] / med(p) / GB:.2f} GB/s)",
                         fmt_ratio(ratios(d, p, invert=True)), ""))
    return rows


def cpu_rows(version, depth, r, nbytes):
    d = [c / (nbytes / GB) for c in r["cold_cpu_dtefs"]]
    p = [c / (nbytes / GB) for c in r["cold_cpu_pt"]]
    return (f"| v{version} ({depth}) | {med(d):.2f} | {med(p):.2f} | {med(d) / med(p):.1f}x |")


def status_row(b, version, depth, mode):
    """Medians of dtefs's .dte/status counters over the cold runs of one kind."""
    runs = [s for s in b.status if s["tag"] == (version, mode) and s["reads"]]
    if not runs:
        return None
    return (f"| v{version} ({depth}) | {mode} | "
            f"{med([s['bytes_served'] / s['reads'] for s in runs]) / 1024:.0f} KiB | "
            f"{med([s['blocks_decoded'] for s in runs]):.0f} | "
            f"{med([s['records_decoded'] / max(1, s['blocks_decoded']) for s in runs]):.1f} | "
            f"{med([s['payload_bytes'] / max(1, s['bytes']) for s in runs]):.3f} |")


def machine_notes(a, b, tools, versions, model):
    df = sh(["df", "-h", a.work]).strip().splitlines()[-1]
    fstype = sh(["stat", "-f", "-c", "%T", a.work]).strip()
    dev, dev_ra = h.block_device_readahead_kb(a.work)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"- machine: {platform.node()}, Linux {platform.release()}, {os.cpu_count()} cores, "
        f"{mem:.0f} GiB memory",
        f"- work dir `{a.work}` ({fstype}): `{df}`; store, exports and both FUSE daemons' "
        f"sources on this one filesystem",
        f"- underlying block device {dev}: read_ahead_kb {dev_ra} (left as is)",
        f"- FUSE read_ahead_kb in effect after mounting (sysfs, read back): dtefs "
        f"{sorted(b.readahead['dtefs'])}, passthrough_ll {sorted(b.readahead['pt'])}",
        f"- dtefs `--readahead-kb`: "
        + (f"passed ({tools.dtefs_option('--readahead-kb')})" if tools.dtefs_option("--readahead-kb")
           else "not in this dtefs (`dtefs --help`); set through sysfs only"),
        f"- dtefs `--snapshot-every`: "
        + (f"default used ({tools.dtefs_option('--snapshot-every')})"
           if tools.dtefs_option("--snapshot-every") else "not in this dtefs (no host-local snapshots)"),
        f"- dtefs: `{shlex.join(['dtefs', 'STORE', 'MNT'] + b.argv['dtefs'][3:])}` (default "
        f"block cache, -o options as built in)",
        f"- passthrough_ll: `{b.pt_source}` built with `cc -O2 $(pkg-config fuse3 --cflags) "
        f"passthrough_ll.c $(pkg-config fuse3 --libs)`, run as "
        f"`passthrough_ll -f -o source=EXPORTS MNT` (its defaults: cache=auto, timeout=1)",
        f"- cold = FUSE fs remounted, then `{b.dropper.method}`",
        f"- model: `dte-gen --size {a.size} --steps {a.steps} --shard-size {a.shard_size}`: "
        f"{model['files']} files, {model['bytes'] / 2**20:.1f} MiB, {model['shards']} shards; "
        f"versions measured: " + ", ".join(f"v{v} ({deltas(d)})" for v, d in versions),
        f"- safetensors loaders: " + "; ".join(f"{k}: `{b.loader_notes[k]}`" for k in b.loaders),
        f"- other load: before each timed run, waited for <= {100 * a.max_busy:.0f}% of all "
        f"cores busy (up to {a.quiet_timeout:.0f} s), and a run during which other processes "
        f"used more than {a.max_other} cores was repeated (up to {a.retries} times): "
        f"{b.load.report()}",
        f"- GB = 10^9 bytes; every figure the median of {a.repeat} repetitions; ratio = dtefs "
        f"throughput / baseline throughput (time ratio inverted), median and [min-max] of the "
        f"per-repetition ratios (so not always the quotient of the two medians shown)",
    ]
    return lines


def report(a, b, tools, versions, model, results):
    print(f"# dtefs read benchmark\n\n```\n{a.cmdline}\n```\n")
    print(f"Measured {datetime.date.today().isoformat()}.\n")
    print("\n".join(machine_notes(a, b, tools, versions, model)) + "\n")
    print("| test | version | dtefs | baseline (same run) | ratio [range] | target |")
    print("|---|---|---|---|---|---|")
    for v, d in versions:
        for row in table_rows(v, d, results[v]):
            print("| " + " | ".join(row) + " |")
    print("\nDaemon CPU per GB served, cold sequential read (user+system seconds of the "
          "FUSE daemon):\n")
    print("| version | dtefs s/GB | passthrough_ll s/GB | dtefs / passthrough_ll |")
    print("|---|---|---|---|")
    for v, d in versions:
        print(cpu_rows(v, d, results[v], model["bytes"]))
    print("\ndtefs `.dte/status` counters over the cold runs (medians; seq = one reader, all "
          "files; par = 8 readers; one = 1 reader, 8 shards):\n")
    print("| version | run | mean FUSE read request | blocks decoded | records per block | "
          "store payload bytes per byte read |")
    print("|---|---|---|---|---|---|")
    for v, d in versions:
        for mode in ("seq", "par", "one"):
            row = status_row(b, v, d, mode)
            if row:
                print(row)
