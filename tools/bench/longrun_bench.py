#!/opt/dte/venv/bin/python
"""Long RL runs: do commit, read, join and memory costs stay flat over thousands
of versions? Each run commits one dte-gen step per version, as a trainer that
publishes every step would, and reports against baselines measured in the
same run:

  commit    dtectl commit wall time, mean of the first and last 50 versions
            (ratio last/first; goal <= 1.2)
  store     bytes of the store (every blob of every version, and the join
            tables kept) against the same run's deltas alone (the store minus
            every full and join table: what a store without policy anchors
            holds; goal <= 2 with the default policy), the zstd ratio of the
            full tables, and the bytes written against the deltas (join
            tables are written and deleted again)
  join      a fresh dtefs mount (empty cache directory) reading every file of
            `latest`, and of the worst recent version (the one just before
            the newest join table: the most deltas past a join table a read
            of latest can meet), against a fresh mount reading the first
            anchor (goal <= 2), medians of --reps
  export    dtectl export of latest with an empty cache, against export of
            the anchor
  memory    dtefs VmHWM after `ls` of the mount and reading one shard of
            --spread versions spread over the run, at several points of the
            run (the curve; goal <= 512 MiB and flat)
  listing   `ls` of the mount and `dtectl log` / `log --limit 20` latency at
            the end

Runs: `small` (--small-steps versions of a --small-size model, local store),
`tiny` (--tiny-steps versions of a --tiny-size model: the memory curve up to
10,000 versions and the listing latencies), `budget` (--budget-steps
versions of a --small-size model for each of --budgets: store bytes against
join cost, the trade of the anchor budget), `joins` (--budget-steps
versions of a --joins-size model for each of --join-budgets: bytes written
against join cost, the trade of the join budget), `big` (--big-steps of
--big-size, local store) and `s3` (--s3-steps of --s3-size on the moto S3
server the tests use; commit and store only).
Checkpoints are generated in batches of --batch steps (dte-gen replays the
earlier steps without writing them) and removed once committed, so disk use
stays near one batch.

Usage: /opt/dte/venv/bin/python tools/bench/longrun_bench.py [--build-dir build]
       [--runs small,tiny,big,s3] [--json out.json]
"""

import json
import os
import shutil
import statistics
import tempfile
import time

import harness as h

MIB = h.MIB


def log(msg):
    h.log(f"[longrun] {msg}")


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


class Run:
    """One long run: a store, its cache, the dte-gen model and the commits."""

    def __init__(self, a, name, size, steps, store=None, env=None, commit_args=()):
        self.a, self.name, self.size, self.steps = a, name, size, steps
        self.commit_args = list(map(str, commit_args))
        self.root = os.path.join(a.work, name)
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        self.store = store or os.path.join(self.root, "store")
        self.cache = os.path.join(self.root, "cache")
        self.env = env
        self.commits = []  # per version: seconds and dtectl's JSON (stored_bytes, full_table, ...)
        self.memory = []   # (versions committed, dtefs VmHWM after ls + spread reads)

    def dtectl(self, *args, cache=None):
        return self.a.tools.dtectl_cmd(args[0], self.store, cache or self.cache, *args[1:])

    def commit_all(self, checkpoints=()):
        def after(step, rec):
            if step in checkpoints:
                self.memory.append((step + 1, self.dtefs_memory()))
            if step % self.a.batch == self.a.batch - 1 or step == self.steps:
                log(f"{self.name}: {step + 1}/{self.steps + 1} versions committed, last commit "
                    f"{rec['seconds']:.3f} s")

        self.commits = h.commit_chain(
            self.a.tools, self.store, self.cache, ["--size", self.size, "--seed", 7], self.steps,
            gen_dir=os.path.join(self.root, "gen"), batch=self.a.batch,
            commit_args=self.commit_args, env=self.env, after=after)["commits"]

    def mount(self, cache, *args):
        mnt = os.path.join(self.root, "mnt")
        return h.dtefs_mount(self.a.tools, self.store, mnt, cache, *map(str, args),
                             log_path=os.path.join(self.root, "dtefs.log")).start()

    def fresh_cache(self, tag):
        path = os.path.join(self.root, f"cache-{tag}")
        shutil.rmtree(path, ignore_errors=True)
        return path

    def dtefs_memory(self):
        """dtefs VmHWM after listing the mount and reading one shard of
        --spread versions spread over what is committed."""
        m = self.mount(self.fresh_cache("mem"))
        try:
            names = sorted(n for n in os.listdir(m.path) if n.startswith("v"))
            pick = names[::max(1, len(names) // self.a.spread)]
            for n in pick:
                shard = sorted(f for f in os.listdir(os.path.join(m.path, n))
                               if f.endswith(".safetensors"))[0]
                with open(os.path.join(m.path, n, shard), "rb") as f:
                    while f.read(MIB):
                        pass
            return h.proc_status(m.proc.pid, "VmHWM")
        finally:
            m.unmount()

    def join(self, version_dir):
        """Seconds for a fresh mount to read every file of version_dir. The
        mount builds no snapshot, so the figure is the read path's alone (a
        snapshot of latest built meanwhile would make it depend on timing)."""
        m = self.mount(self.fresh_cache("join"), "--snapshot-every", 0)
        try:
            t0 = time.monotonic()
            d = os.path.join(m.path, version_dir)
            h.read_sequential([os.path.join(d, n) for n in sorted(os.listdir(d))])
            return time.monotonic() - t0
        finally:
            m.unmount()

    def export(self, version):
        out = os.path.join(self.root, "export")
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.monotonic()
        h.run(self.dtectl("export", "--version", version, out, cache=self.fresh_cache("export")))
        secs = time.monotonic() - t0
        shutil.rmtree(out)
        return secs

    def join_tables(self):
        """(versions with a join table now, their blob bytes)."""
        jdir = os.path.join(self.store, "joins")
        versions, size = [], 0
        for name in sorted(os.listdir(jdir)) if os.path.isdir(jdir) else []:
            with open(os.path.join(jdir, name)) as f:
                j = json.load(f)
            versions.append(j["version"])
            size += j["block_table"]["size"] + sum(b["size"] for b in j["blobs"])
        return versions, size

    def store_bytes(self):
        """(all blob bytes, full- and join-table bytes, full-table dense bytes,
        join-table bytes) from the manifests and the join tables kept."""
        total = full = full_dense = 0
        mdir = os.path.join(self.store, "manifests")
        for name in os.listdir(mdir):
            with open(os.path.join(mdir, name)) as f:
                m = json.load(f)
            total += m["stats"]["stored_bytes"]
            if m.get("full"):
                fb = m["full"]["block_table"]["size"] + sum(b["size"] for b in m["full"]["blobs"])
                full += fb
                full_dense += m["stats"]["dense_bytes"]
        _, joins = self.join_tables()
        return total + joins, full + joins, full_dense, joins

    def worst_recent(self):
        """The version just before the newest join table (read from the older
        one plus a join interval of deltas), or None without two join tables."""
        versions, _ = self.join_tables()
        return versions[-1] - 1 if len(versions) >= 2 else None

    def written_ratio(self):
        """Bytes written to the store (deltas, full tables, join tables written
        and later deleted) over the deltas alone."""
        c = self.commits[1:]
        deltas = sum(x["stored_bytes"] - x.get("full_bytes", 0) for x in c)
        return sum(x["stored_bytes"] + x.get("join_bytes", 0) for x in c) / deltas if deltas else None

    def timed(self, argv, reps=5):
        return statistics.median(h.repeat(lambda rep: h.timed(h.run, argv)[0], reps))

    def listing(self):
        m = self.mount(self.fresh_cache("ls"))
        try:
            ls = self.timed(["ls", m.path])
            ls_l = self.timed(["ls", "-l", m.path])
        finally:
            m.unmount()
        return {"ls": ls, "ls_l": ls_l, "log": self.timed(self.dtectl("log")),
                "log_limit20": self.timed(self.dtectl("log", "--limit", 20))}

    def report(self, local=True, joins=True, listing=False):
        c = self.commits[1:]  # version 0 is the import
        first, last = [x["seconds"] for x in c[:50]], [x["seconds"] for x in c[-50:]]
        out = {"run": self.name, "size": self.size, "versions": len(self.commits),
               "commit_first50_s": mean(first), "commit_last50_s": mean(last),
               "commit_ratio": mean(last) / mean(first),
               "full_tables": sum(1 for x in c if x.get("full_table")),
               "join_tables_written": sum(1 for x in c if x.get("join_table"))}
        if not local:
            out["store_bytes"] = sum(x["stored_bytes"] for x in self.commits)
            return out
        total, full, full_dense, joins = self.store_bytes()
        out.update({"store_bytes": total, "deltas_only_bytes": total - full,
                    "store_ratio": total / (total - full),
                    "full_zstd_ratio": full_dense / (full - joins) if full > joins else None})
        out["written_ratio"] = self.written_ratio()
        out["dtefs_hwm"] = [(n, b) for n, b in self.memory]
        if listing:
            out.update(self.listing())
        if not joins:
            return out
        reps = self.a.reps
        joins = [self.join("latest") for _ in range(reps)]
        anchors = [self.join("v00000000") for _ in range(reps)]
        out.update({"join_latest_s": statistics.median(joins),
                    "join_anchor_s": statistics.median(anchors)})
        out["join_ratio"] = out["join_latest_s"] / out["join_anchor_s"]
        worst = self.worst_recent()
        if worst is not None:
            out["join_worst_version"] = worst
            out["join_worst_s"] = statistics.median(
                self.join(f"v{worst:08d}") for _ in range(reps))
            out["join_worst_ratio"] = out["join_worst_s"] / out["join_anchor_s"]
        latest = len(self.commits) - 1
        out["export_latest_s"] = statistics.median(self.export(latest) for _ in range(reps))
        out["export_anchor_s"] = statistics.median(self.export(0) for _ in range(reps))
        return out


def trade_rows(a, option, values, size, prefer_join_tables):
    """The trade of one budget (`option`: --join-budget or --anchor-budget)
    over --budget-steps versions of a `size` model per value: store bytes
    (and bytes written) against the cost of a fresh mount reading latest and
    the worst version, against the anchor. The worst version is the one just
    before the newest join table (prefer_join_tables, when there are two) or
    else just before the last full table: the most deltas a read can meet."""
    rows = []
    for b in values.split(","):
        r = Run(a, f"{option.strip('-')}-{b}", size, a.budget_steps, commit_args=(option, b))
        r.commit_all()
        total, full, _, _ = r.store_bytes()
        fulls = [i + 1 for i, c in enumerate(r.commits[1:]) if c.get("full_table")]
        worst = r.worst_recent() if prefer_join_tables else None
        if worst is None:
            worst = (fulls[-1] - 1) if fulls else len(r.commits) - 1
        reads = {v: statistics.median(r.join(v) for _ in range(a.reps))
                 for v in ("v00000000", "latest", f"v{worst:08d}")}
        anchor = reads["v00000000"]
        rows.append({"budget": float(b), "versions": len(r.commits), "full_tables": len(fulls),
                     "join_tables_written": sum(1 for c in r.commits[1:] if c.get("join_table")),
                     "store_ratio": total / (total - full), "written_ratio": r.written_ratio(),
                     "join_anchor_s": anchor, "join_latest_ratio": reads["latest"] / anchor,
                     "join_worst_ratio": reads[f"v{worst:08d}"] / anchor, "worst_version": worst})
        log(json.dumps(rows[-1]))
        shutil.rmtree(r.root, ignore_errors=True)
    print(h.md_table([f"`{option}`", "full / join tables written", "store / deltas only",
                      "written / deltas", "join latest / anchor", "join worst / anchor"], [
        [f"{x['budget']:g}", f"{x['full_tables']} / {x['join_tables_written']} in {x['versions']}",
         f"{x['store_ratio']:.2f}x", f"{x['written_ratio']:.2f}x", f"{x['join_latest_ratio']:.2f}x",
         f"{x['join_worst_ratio']:.2f}x (v{x['worst_version']})"] for x in rows]))
    return rows


def s3_env(a):
    import s3_util  # tests/py, on the path through harness
    server = s3_util.MotoServer()
    server.create_bucket("longrun")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DTE_"))}
    return server, {**base, **server.env()}


def print_report(rows):
    for r in rows:
        log(json.dumps(r))
    print("| run | versions | commit first 50 | last 50 | ratio | full / join tables written | "
          "store / deltas only | written / deltas | zstd | join latest / anchor | "
          "join worst recent / anchor | export latest / anchor | dtefs VmHWM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = ", ".join(f"{n}: {b / MIB:.0f} MiB" for n, b in r.get("dtefs_hwm", []))
        store = (f"{r['store_bytes'] / MIB:.1f} / {r['deltas_only_bytes'] / MIB:.1f} MiB "
                 f"= {r['store_ratio']:.2f}x" if "store_ratio" in r
                 else f"{r['store_bytes'] / MIB:.1f} MiB")
        zstd = f"{r['full_zstd_ratio']:.2f}x" if r.get("full_zstd_ratio") else "-"
        join = (f"{r['join_latest_s']:.3f} / {r['join_anchor_s']:.3f} s = "
                f"{r['join_ratio']:.2f}x" if "join_ratio" in r else "-")
        worst = (f"{r['join_worst_s']:.3f} s = {r['join_worst_ratio']:.2f}x "
                 f"(v{r['join_worst_version']})" if "join_worst_ratio" in r else "-")
        written = f"{r['written_ratio']:.2f}x" if r.get("written_ratio") else "-"
        exp = (f"{r['export_latest_s']:.3f} / {r['export_anchor_s']:.3f} s"
               if "export_latest_s" in r else "-")
        print(f"| {r['run']} ({r['size']}) | {r['versions']} | {r['commit_first50_s']:.3f} s | "
              f"{r['commit_last50_s']:.3f} s | {r['commit_ratio']:.2f}x | {r['full_tables']} / "
              f"{r['join_tables_written']} | {store} | {written} | {zstd} | {join} | {worst} | "
              f"{exp} | {mem or '-'} |")
    for r in rows:
        if "ls" in r:
            print(f"{r['run']}: ls {r['ls'] * 1000:.1f} ms, ls -l {r['ls_l'] * 1000:.1f} ms, "
                  f"dtectl log {r['log'] * 1000:.1f} ms, log --limit 20 "
                  f"{r['log_limit20'] * 1000:.1f} ms at {r['versions']} versions")


def main():
    p = h.parser(__doc__.split("\n\n")[0])
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--runs", default="small,big,s3")
    p.add_argument("--small-size", default="4MiB")
    p.add_argument("--small-steps", type=int, default=2000)
    p.add_argument("--budgets", default="0.25,0.5,1,2")
    p.add_argument("--budget-steps", type=int, default=400)
    p.add_argument("--join-budgets", default="0,0.0625,0.125,0.25")
    p.add_argument("--joins-size", default="64MiB")
    p.add_argument("--join-budget", default=None,
                   help="--join-budget of the small, tiny, big and s3 runs (default: dtectl's)")
    p.add_argument("--tiny-size", default="1MiB")
    p.add_argument("--tiny-steps", type=int, default=10000)
    p.add_argument("--big-size", default="512MiB")
    p.add_argument("--big-steps", type=int, default=300)
    p.add_argument("--s3-size", default="16MiB")
    p.add_argument("--s3-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=100, help="steps generated at a time")
    p.add_argument("--spread", type=int, default=100, help="versions read for the memory figure")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    a.tools = h.Tools(a.build_dir)
    a.work = a.work or tempfile.mkdtemp(prefix="dte-longrun-")
    h.install_cleanup()
    rows = []
    jb = ("--join-budget", a.join_budget) if a.join_budget is not None else ()
    try:
        for name in a.runs.split(","):
            if name == "small":
                steps = a.small_steps
                marks = {s - 1 for s in (100, 500, 1000, 2000, 5000, 10000) if s <= steps + 1}
                r = Run(a, "small", a.small_size, steps, commit_args=jb)
                r.commit_all(marks)
                rows.append(r.report())
            elif name == "budget":
                trade_rows(a, "--anchor-budget", a.budgets, a.small_size, False)
                continue
            elif name == "joins":
                trade_rows(a, "--join-budget", a.join_budgets, a.joins_size, True)
                continue
            elif name == "tiny":
                steps = a.tiny_steps
                marks = {s - 1 for s in (100, 1000, 3000, 10000) if s <= steps + 1}
                r = Run(a, "tiny", a.tiny_size, steps, commit_args=jb)
                r.commit_all(marks)
                rows.append(r.report(joins=False, listing=True))
            elif name == "big":
                r = Run(a, "big", a.big_size, a.big_steps, commit_args=jb)
                r.commit_all({a.big_steps})
                rows.append(r.report())
            elif name == "s3":
                server, env = s3_env(a)
                try:
                    r = Run(a, "s3", a.s3_size, a.s3_steps, store="s3://longrun/run", env=env,
                            commit_args=jb)
                    r.commit_all()
                    rows.append(r.report(local=False))
                finally:
                    server.stop()
            log(json.dumps(rows[-1]))
    finally:
        h.unmount_all()
        h.write_json(a.json, rows)
    print_report(rows)


if __name__ == "__main__":
    main()
