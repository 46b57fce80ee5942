#!/opt/dte/venv/bin/python
"""Cross-cluster publish -> follow through an object store over a limited link:
dte deltas vs dense zstd checkpoints (the ByteCheckpoint-style baseline),
measured in the same run on the same model sequence.

A moto S3 server on loopback stands for the object store. Every byte between
the two "clusters" (publisher, follower) and the store passes through
tests/py/s3_proxy.py, which limits each direction to the link's rate and
counts the bytes (request and response heads included).

For each link rate one new version of a `dte-gen` sequence (~1.5% of BF16
elements changed per step; the measured fraction is reported) is published
and followed:

  dte    publisher: `dtectl commit` into its local store (the parent is read
         from local disk), then the new objects go to S3 with `aws s3 sync`,
         blobs first and manifests last (the layout is the same on S3,
         docs/s3.md; a version is visible once its manifest is); follower:
         `aws s3 sync` into its local mirror of the store, then `dtectl
         export` of the new version from the mirror.
  dense  publisher: `zstd -1 -T0` of every file, `aws s3 cp --recursive` up;
         follower: `aws s3 cp --recursive` down, `zstd -d` of every file.

  direct publisher: `dtectl commit --store s3://...` straight into the
         bucket (its blob cache holds what it uploaded before, so the parent
         is read from local disk; docs/s3.md); follower: `dtectl export
         --store s3://...` of the new version, with a blob cache that holds
         the versions it exported before (as a dtefs follower's would).

Time = publish (compress/commit + upload) + follow (download + decompress/
export), run one after the other; bytes = both directions at the proxy. The
follower's files are compared with the publisher's input.

Rates are scaled: the link runs at NOMINAL / --scale (default 8), so each
row shows the transfer times a model --scale times larger than the
generated one (2 GiB for the default 256 MiB) would see at the nominal rate;
CPU work (commit, zstd, export) is not scaled. Above what the loopback store
sustains (moto and the AWS CLI: ~50 MB/s on the reference machine) a row is
store-bound, and the achieved rate is printed.

Version 0 (an anchor) is published and followed once before the rows,
without a rate limit and not counted, on every dte side.

Usage: /opt/dte/venv/bin/python tools/bench/s3_bench.py [--build-dir DIR] [--work DIR]
       [--size 256MiB] [--scale 8] [--rates-gbps 0.1,1,10] [--json OUT]
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "py"))
import s3_proxy  # noqa: E402
import s3_util  # noqa: E402

BUCKET = "bench"
MB = 1e6


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd, env=None):
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {shlex.join(map(str, cmd))}\n{p.stderr}")
    return p


class Bench:
    def __init__(self, a):
        self.a = a
        self.dtectl = os.path.join(a.build_dir, "tools", "dtectl")
        self.work = a.work
        self.moto = s3_util.MotoServer()
        self.moto.create_bucket(BUCKET)
        self.proxy = s3_proxy.FaultProxy(self.moto.endpoint, io_timeout=600)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DTE_"))}
        self.cli_env = {**base, **self.moto.env(session=False)}
        self.dte_env = {**base, **self.moto.env(), "AWS_ENDPOINT_URL": self.proxy.endpoint,
                        "DTE_SPOOL_DIR": os.path.join(self.work, "spool")}

    def close(self):
        self.proxy.stop()
        self.moto.stop()

    def aws(self, *args):
        return ["/usr/bin/aws", *args, "--only-show-errors", "--endpoint-url", self.proxy.endpoint]

    def dte(self, cmd, store, cache, *args):
        return [self.dtectl, cmd, "--store", store, "--cache-dir", os.path.join(self.work, cache),
                "-q", *args]

    def timed(self, steps):
        """Runs (cmd, env) steps; returns (seconds, bytes up, bytes down)."""
        self.proxy.reset_counters()
        t0 = time.monotonic()
        for cmd, env in steps:
            run(cmd, env)
        return time.monotonic() - t0, self.proxy.bytes_up, self.proxy.bytes_down

    # --- dte: local store, objects pushed to and pulled from S3 --------------

    def dte_publish(self, ckpt):
        local = os.path.join(self.work, "pub-store")
        dst = f"s3://{BUCKET}/dte"
        return [(self.dte("commit", local, "pub-cache", ckpt), None),
                (self.aws("s3", "sync", local, dst, "--exclude", "manifests/*", "--exclude",
                          "tmp/*"), self.cli_env),
                (self.aws("s3", "sync", local, dst, "--exclude", "*", "--include",
                          "manifests/*"), self.cli_env)]

    def dte_follow(self, version, out):
        mirror = os.path.join(self.work, "follower-mirror")
        return [(self.aws("s3", "sync", f"s3://{BUCKET}/dte", mirror), self.cli_env),
                (self.dte("export", mirror, "follower-cache", "--version", version, out), None)]

    # --- dense: zstd files up and down ---------------------------------------

    def dense_publish(self, ckpt, version):
        z = os.path.join(self.work, f"dense-pub-{version}")
        os.makedirs(z)
        files = sorted(os.listdir(ckpt))
        steps = [(["zstd", "-1", "-T0", "-q", os.path.join(ckpt, f), "-o",
                   os.path.join(z, f + ".zst")], None) for f in files]
        return steps + [(self.aws("s3", "cp", "--recursive", z, f"s3://{BUCKET}/dense/v{version}"),
                         self.cli_env)]

    def dense_follow(self, version, out, files):
        z = os.path.join(self.work, f"dense-fol-{version}")
        steps = [(self.aws("s3", "cp", "--recursive", f"s3://{BUCKET}/dense/v{version}", z),
                  self.cli_env)]
        os.makedirs(out)
        return steps + [(["zstd", "-d", "-q", os.path.join(z, f + ".zst"), "-o",
                          os.path.join(out, f)], None) for f in files]

    def setup_dte(self, ckpt0):
        """Version 0 on both sides, moved without a rate limit and not counted."""
        self.proxy.set_rate(None, None)
        run(self.dte("import", os.path.join(self.work, "pub-store"), "pub-cache", ckpt0))
        for cmd, env in self.dte_publish(ckpt0)[1:]:
            run(cmd, env)
        run(self.dte_follow(0, os.path.join(self.work, "out-dte-0"))[0][0], self.cli_env)

    def measure(self, version, ckpt, rate):
        self.proxy.set_rate(rate, rate)
        rows = {}
        out = os.path.join(self.work, f"out-dte-{version}")
        pub = self.timed(self.dte_publish(ckpt))
        fol = self.timed(self.dte_follow(version, out))
        same(out, ckpt)
        rows["dte"] = (pub, fol)
        out = os.path.join(self.work, f"out-direct-{version}")
        pub = self.timed(self.direct_publish(ckpt))
        requests = len(self.proxy.exchanges())
        fol = self.timed(self.direct_follow(version, out))
        same(out, ckpt)
        rows["direct"] = (pub, fol)
        rows["direct_requests"] = (requests, len(self.proxy.exchanges()))
        out = os.path.join(self.work, f"out-dense-{version}")
        pub = self.timed(self.dense_publish(ckpt, version))
        fol = self.timed(self.dense_follow(version, out, sorted(os.listdir(ckpt))))
        same(out, ckpt)
        rows["dense"] = (pub, fol)
        self.proxy.set_rate(None, None)
        return rows

    # --- dte direct: dtectl on the s3:// store, blob caches on both sides ---

    DIRECT = f"s3://{BUCKET}/direct"

    def setup_direct(self, ckpt0):
        """Version 0 imported and exported once (caches warm), not counted."""
        self.proxy.set_rate(None, None)
        run(self.dte("import", self.DIRECT, "direct-pub", ckpt0), self.dte_env)
        run(self.dte("export", self.DIRECT, "direct-fol", "--version", 0,
                     os.path.join(self.work, "out-direct-0")), self.dte_env)

    def direct_publish(self, ckpt):
        return [(self.dte("commit", self.DIRECT, "direct-pub", ckpt), self.dte_env)]

    def direct_follow(self, version, out):
        return [(self.dte("export", self.DIRECT, "direct-fol", "--version", version, out),
                 self.dte_env)]


def same(a, b):
    for f in sorted(os.listdir(b)):
        run(["cmp", os.path.join(a, f), os.path.join(b, f)])
    if sorted(os.listdir(a)) != sorted(os.listdir(b)):
        sys.exit(f"{a} and {b} hold different files")


def bf16_changed(prev, cur):
    """(changed, total) BF16 elements between two checkpoint directories."""
    changed = total = 0
    for f in sorted(os.listdir(cur)):
        if not f.endswith(".safetensors"):
            continue
        data = {}
        for side, d in (("old", prev), ("new", cur)):
            with open(os.path.join(d, f), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
                data[side] = (header, np.frombuffer(fh.read(), dtype=np.uint8))
        header, new = data["new"]
        old = data["old"][1]
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] != "BF16":
                continue
            b, e = info["data_offsets"]
            o, c = old[b:e].view(np.uint16), new[b:e].view(np.uint16)
            changed += int(np.count_nonzero(o != c))
            total += c.size
    return changed, total


def row(label, rate_label, r, dense_total=None):
    (pt, pu, pd), (ft, fu_, fd) = r
    total = pu + pd + fu_ + fd
    ratio = f"**{dense_total / total:.0f}x** fewer" if dense_total else "1x"
    return (f"| {rate_label} | {label} | {pt:.2f} s | {ft:.2f} s | **{pt + ft:.2f} s** | "
            f"{(pu + pd) / MB:.2f} MB | {(fu_ + fd) / MB:.2f} MB | {total / MB:.2f} MB | {ratio} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.environ.get("DTE_BUILD_DIR",
                                                          os.path.join(ROOT, "build")))
    ap.add_argument("--work", default="/tmp/dte-s3-bench")
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--scale", type=float, default=8.0)
    ap.add_argument("--rates-gbps", default="0.1,1,10")
    ap.add_argument("--json")
    a = ap.parse_args()
    rates = [float(x) for x in a.rates_gbps.split(",")]
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    gen = os.path.join(a.work, "gen")
    log(f"dte-gen --size {a.size} --steps {len(rates)}")
    run([os.path.join(a.build_dir, "tools", "dte-gen"), "--out", gen, "--size", a.size,
         "--steps", len(rates), "-q"])
    ckpts = [os.path.join(gen, f"step-{s:06d}") for s in range(len(rates) + 1)]
    fractions = [bf16_changed(ckpts[i - 1], ckpts[i]) for i in range(1, len(ckpts))]
    bench = Bench(a)
    t0 = time.monotonic()
    run(["/usr/bin/aws", "--version"])
    results = {"args": vars(a), "rows": [], "changed": fractions,
               "aws_start": time.monotonic() - t0}
    try:
        bench.setup_dte(ckpts[0])
        bench.setup_direct(ckpts[0])
        for i, gbps in enumerate(rates):
            rate = gbps * 1e9 / 8 / a.scale
            log(f"{gbps:g} Gbps nominal: link at {rate / MB:.2f} MB/s each way, version {i + 1}")
            r = bench.measure(i + 1, ckpts[i + 1], rate)
            results["rows"].append({"gbps": gbps, "rate": rate, **r})
        commits = json.loads(run([bench.dtectl, "log", "--store",
                                  os.path.join(a.work, "pub-store"), "--json"]).stdout)
    finally:
        bench.close()
    report(a, results, commits)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    worst = min(dense_over(r, m) for r in results["rows"] for m in ("dte", "direct"))
    if worst < 50:
        sys.exit(f"FAIL: dte moved only {worst:.1f}x fewer bytes than the dense baseline")


def moved(x):
    """Bytes both ways of a (publish, follow) pair."""
    return sum(x[0][1:]) + sum(x[1][1:])


def dense_over(r, method):
    return moved(r["dense"]) / moved(r[method])


def report(a, results, commits):
    cmd = sys.executable + " tools/bench/s3_bench.py " + " ".join(
        shlex.quote(x) for x in sys.argv[1:])
    print(f"```\n{cmd}\n```\n")
    ch = results["changed"]
    dtectl_frac = [v["changed_elements"] / v["elements"] for v in commits[1:]]
    print(f"Model: `dte-gen --size {a.size}`, {len(ch)} steps; changed BF16 elements per step "
          f"(numpy over the files): " + ", ".join(f"{c / t:.3%}" for c, t in ch) +
          "; dtectl commit reports " + ", ".join(f"{f:.3%}" for f in dtectl_frac) + ".")
    print(f"Link rates scaled by 1/{a.scale:g}: the generated model stands for one "
          f"{a.scale:g}x larger at the nominal rate.\n")
    print("| link (nominal) | method | publish | follow | publish + follow | bytes publish "
          "| bytes follow | bytes total | bytes vs dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        label = f"{r['gbps']:g} Gbps ({r['rate'] / MB:.2f} MB/s)"
        dense = r["dense"]
        dense_total = sum(dense[0][1:]) + sum(dense[1][1:])
        print(row("dte (sync)", label, r["dte"], dense_total))
        print(row("dte direct", label, r["direct"], dense_total))
        print(row("dense zstd", label, dense))
    print()
    for r in results["rows"]:
        (pt, pu, pd), (ft, fu_, fd) = r["dense"]
        dense_time = pt + ft
        times = {m: sum(x[0] for x in r[m]) for m in ("dte", "direct")}
        print(f"- {r['gbps']:g} Gbps: dte moved {dense_over(r, 'dte'):.0f}x (sync) and "
              f"{dense_over(r, 'direct'):.0f}x (direct) fewer bytes and took "
              f"{dense_time / times['dte']:.1f}x and {dense_time / times['direct']:.1f}x less "
              f"time; the dense baseline moved its bytes at "
              f"{(pu + pd + fu_ + fd) / dense_time / MB:.1f} MB/s end to end (zstd included)")
    r = results["rows"][-1]
    (pt, pu, pd), (ft, fu_, fd) = r["direct"]
    print(f"- dte direct, last row: the commit sent {r['direct_requests'][0]} requests and "
          f"downloaded {pd / MB:.3f} MB (the parent came from its blob cache); the export sent "
          f"{r['direct_requests'][1]} requests and downloaded {fd / MB:.3f} MB")
    print(f"- Each `aws` invocation costs {results['aws_start']:.2f} s before its first byte "
          f"(`aws --version`); dte (sync) runs three per version, dense two.")


if __name__ == "__main__":
    main()
