#!/opt/dte/venv/bin/python
"""Cross-cluster publish -> follow through an object store over a limited link:
dte deltas against the paper's two baselines, dense zstd checkpoints (the
ByteCheckpoint style) and a sparse publisher in PULSE's wire format,
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
  direct publisher: `dtectl commit --store s3://...` straight into the
         bucket (its blob cache holds what it uploaded before, so the parent
         is read from local disk; docs/s3.md); follower: `dtectl export
         --store s3://...` of the new version, with a blob cache that holds
         the versions it exported before (as a dtefs follower's would).
  dense  publisher: `zstd -1 -T0` of every file, `aws s3 cp --recursive` up;
         follower: `aws s3 cp --recursive` down, `zstd -d` of every file.
  pulse  publisher: holds the previous weights in memory, reads the new
         checkpoint and encodes the changed BF16 elements in PULSE's wire
         format (tools/bench/pulse_format.py: sorted COO per tensor, uint8 /
         int32 row deltas, uint16 / int32 column deltas, raw BF16 values, one
         zstd level-1 frame), `aws s3 cp` of the frame up; follower: `aws s3
         cp` down, decodes the frame onto the weights it holds in memory,
         which are then compared with the new checkpoint bit for bit.

Time = publish (encode: commit/compress + upload) + follow (download +
decode: export/decompress), run one after the other; the encode and decode
steps (CPU) are also reported apart; bytes = both directions at the proxy.
The dte and dense followers' files are compared with the publisher's input.

Rates are scaled: the link runs at NOMINAL / --scale (default 8), so each
row shows the transfer times a model --scale times larger than the
generated one (2 GiB for the default 256 MiB) would see at the nominal rate;
CPU work (commit, zstd, export, encode, decode) is not scaled. Above what
the loopback store sustains (moto and the AWS CLI: ~50 MB/s on the
reference machine) a row is store-bound, and the achieved rate is printed.

Version 0 (an anchor) is published and followed once before the rows,
without a rate limit and not counted, on every dte side; the PULSE sides
load it into memory, not counted.

Usage: /opt/dte/venv/bin/python tools/bench/s3_bench.py [--build-dir DIR] [--work DIR]
       [--size 256MiB] [--scale 8] [--rates-gbps 0.1,1,10] [--json OUT]
"""
import os
import sys
import time

import harness as h
import pulse_format
import s3_proxy
import s3_util

BUCKET = "bench"
METHODS = (("dte", "dte (sync)"), ("direct", "dte direct"), ("pulse", "PULSE format"),
           ("dense", "dense zstd"))


class Bench:
    def __init__(self, a, tools, work):
        self.a, self.tools, self.work = a, tools, work
        self.moto = s3_util.MotoServer()
        self.moto.create_bucket(BUCKET)
        self.proxy = s3_proxy.FaultProxy(self.moto.endpoint, io_timeout=600)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DTE_"))}
        self.cli_env = {**base, **self.moto.env(session=False)}
        self.dte_env = {**base, **self.moto.env(), "AWS_ENDPOINT_URL": self.proxy.endpoint,
                        "DTE_SPOOL_DIR": work("spool")}
        self.pulse_pub = self.pulse_fol = None  # the weights each PULSE side holds

    def close(self):
        self.proxy.stop()
        self.moto.stop()

    def aws(self, *args):
        return (["/usr/bin/aws", *args, "--only-show-errors", "--endpoint-url",
                 self.proxy.endpoint], self.cli_env)

    def dte(self, cmd, store, cache, *args, env=None):
        return self.tools.dtectl_cmd(cmd, store, self.work(cache), *args), env

    def timed(self, steps):
        """Runs steps: (cmd, env) pairs, or callables (in-process work);
        returns {"s", "cpu_s" (the steps that are not `aws`), "up", "down"}."""
        self.proxy.reset_counters()
        total = cpu = 0.0
        for step in steps:
            t0 = time.monotonic()
            if callable(step):
                step()
            else:
                h.run(*step)
            secs = time.monotonic() - t0
            total += secs
            cpu += 0 if not callable(step) and step[0][0] == "/usr/bin/aws" else secs
        return {"s": total, "cpu_s": cpu, "up": self.proxy.bytes_up,
                "down": self.proxy.bytes_down}

    # --- dte: local store, objects pushed to and pulled from S3 --------------

    def dte_publish(self, ckpt):
        local, dst = self.work("pub-store"), f"s3://{BUCKET}/dte"
        return [self.dte("commit", local, "pub-cache", ckpt),
                self.aws("s3", "sync", local, dst, "--exclude", "manifests/*", "--exclude",
                         "tmp/*"),
                self.aws("s3", "sync", local, dst, "--exclude", "*", "--include", "manifests/*")]

    def dte_follow(self, version, out):
        mirror = self.work("follower-mirror")
        return [self.aws("s3", "sync", f"s3://{BUCKET}/dte", mirror),
                self.dte("export", mirror, "follower-cache", "--version", version, out)]

    # --- dte direct: dtectl on the s3:// store, blob caches on both sides ---

    DIRECT = f"s3://{BUCKET}/direct"

    def direct_publish(self, ckpt):
        return [self.dte("commit", self.DIRECT, "direct-pub", ckpt, env=self.dte_env)]

    def direct_follow(self, version, out):
        return [self.dte("export", self.DIRECT, "direct-fol", "--version", version, out,
                         env=self.dte_env)]

    # --- dense: zstd files up and down ---------------------------------------

    def dense_publish(self, ckpt, version):
        z = self.work(f"dense-pub-{version}")
        os.makedirs(z)
        return [(["zstd", "-1", "-T0", "-q", os.path.join(ckpt, f), "-o",
                  os.path.join(z, f + ".zst")], None) for f in sorted(os.listdir(ckpt))] + [
            self.aws("s3", "cp", "--recursive", z, f"s3://{BUCKET}/dense/v{version}")]

    def dense_follow(self, version, out, files):
        z = self.work(f"dense-fol-{version}")
        os.makedirs(out)
        return [self.aws("s3", "cp", "--recursive", f"s3://{BUCKET}/dense/v{version}", z)] + [
            (["zstd", "-d", "-q", os.path.join(z, f + ".zst"), "-o", os.path.join(out, f)], None)
            for f in files]

    # --- PULSE's wire format: one frame per version, weights in memory --------

    def pulse_publish(self, ckpt, version, frame):
        def encode():
            new = pulse_format.Weights(ckpt)
            data, self.pulse_changed = pulse_format.encode(self.pulse_pub, new)
            with open(frame, "wb") as f:
                f.write(data)
            self.pulse_pub = new
        return [encode, self.aws("s3", "cp", frame, f"s3://{BUCKET}/pulse/v{version}.zst")]

    def pulse_follow(self, version, frame):
        def decode():
            with open(frame, "rb") as f:
                self.pulse_fol = pulse_format.decode(f.read(), self.pulse_fol)
        return [self.aws("s3", "cp", f"s3://{BUCKET}/pulse/v{version}.zst", frame), decode]

    # --- set-up and one row ------------------------------------------------------

    def setup(self, ckpt0):
        """Version 0 on every side, moved without a rate limit and not counted."""
        self.proxy.set_rate(None, None)
        h.run(*self.dte("import", self.work("pub-store"), "pub-cache", ckpt0))
        for cmd in self.dte_publish(ckpt0)[1:]:
            h.run(*cmd)
        h.run(*self.dte_follow(0, self.work("out-dte-0"))[0])
        h.run(*self.dte("import", self.DIRECT, "direct-pub", ckpt0, env=self.dte_env))
        h.run(*self.dte("export", self.DIRECT, "direct-fol", "--version", 0,
                        self.work("out-direct-0"), env=self.dte_env))
        self.pulse_pub, self.pulse_fol = (pulse_format.Weights(ckpt0),
                                          pulse_format.Weights(ckpt0))

    def measure(self, version, ckpt, rate):
        self.proxy.set_rate(rate, rate)
        rows = {}
        out = self.work(f"out-dte-{version}")
        rows["dte"] = (self.timed(self.dte_publish(ckpt)), self.timed(self.dte_follow(version, out)))
        h.same_files(out, ckpt)
        out = self.work(f"out-direct-{version}")
        pub = self.timed(self.direct_publish(ckpt))
        requests = len(self.proxy.exchanges())
        rows["direct"] = (pub, self.timed(self.direct_follow(version, out)))
        rows["direct_requests"] = (requests, len(self.proxy.exchanges()))
        h.same_files(out, ckpt)
        frame_pub, frame_fol = self.work(f"pulse-pub-{version}.zst"), self.work(
            f"pulse-fol-{version}.zst")
        rows["pulse"] = (self.timed(self.pulse_publish(ckpt, version, frame_pub)),
                         self.timed(self.pulse_follow(version, frame_fol)))
        if not self.pulse_fol.same(pulse_format.Weights(ckpt)):
            raise RuntimeError(f"BUG: the PULSE follower's weights are not version {version}")
        rows["pulse_frame_bytes"] = os.path.getsize(frame_pub)
        rows["pulse_changed"] = self.pulse_changed
        out = self.work(f"out-dense-{version}")
        rows["dense"] = (self.timed(self.dense_publish(ckpt, version)),
                         self.timed(self.dense_follow(version, out, sorted(os.listdir(ckpt)))))
        h.same_files(out, ckpt)
        self.proxy.set_rate(None, None)
        return rows


def moved(x):
    """Bytes both ways of a (publish, follow) pair."""
    return sum(s["up"] + s["down"] for s in x)


def seconds(x):
    return sum(s["s"] for s in x)


def md_rows(r):
    """The table rows of one link rate, dte's methods and both baselines."""
    label = f"{r['gbps']:g} Gbps ({r['rate'] / h.MB:.2f} MB/s)"
    dense, pulse = r["dense"], r["pulse"]
    out = []
    for method, name in METHODS:
        pub, fol = r[method]
        vs = ("1x" if method == "dense" else
              f"**{moved(dense) / moved(r[method]):.0f}x** fewer, "
              f"{seconds(dense) / seconds(r[method]):.1f}x faster")
        vs_pulse = ("1x" if method == "pulse" else "-" if method == "dense" else
                    f"{moved(pulse) / moved(r[method]):.1f}x fewer, "
                    f"{seconds(pulse) / seconds(r[method]):.1f}x faster")
        # dtectl on the s3:// store encodes and transfers in one command
        cpu = (["(in publish)", "(in follow)"] if method == "direct" else
               [f"{pub['cpu_s']:.2f} s", f"{fol['cpu_s']:.2f} s"])
        out.append([label, name, *cpu,
                    f"{pub['s']:.2f} s", f"{fol['s']:.2f} s",
                    f"**{pub['s'] + fol['s']:.2f} s**", f"{moved(r[method]) / h.MB:.2f} MB",
                    vs, vs_pulse])
    return out


HEADERS = ["link (nominal)", "method", "encode (CPU)", "decode (CPU)", "publish", "follow",
           "publish + follow", "bytes moved", "vs dense zstd", "vs PULSE format"]


def report(a, results, commits):
    print(f"```\n{h.command_line(__file__)}\n```\n")
    ch = results["changed"]
    dtectl_frac = [v["changed_elements"] / v["elements"] for v in commits[1:]]
    print(f"Model: `dte-gen --size {a.size}`, {len(ch)} steps; changed BF16 elements per step "
          f"(numpy over the files): " + ", ".join(f"{c / t:.3%}" for c, t in ch) +
          "; dtectl commit reports " + ", ".join(f"{f:.3%}" for f in dtectl_frac) + ".")
    print(f"Link rates scaled by 1/{a.scale:g}: the generated model stands for one "
          f"{a.scale:g}x larger at the nominal rate.\n")
    print(h.md_table(HEADERS, [row for r in results["rows"] for row in md_rows(r)]))
    print()
    for r in results["rows"]:
        dense = r["dense"]
        print(f"- {r['gbps']:g} Gbps: dte moved {moved(dense) / moved(r['dte']):.0f}x (sync) and "
              f"{moved(dense) / moved(r['direct']):.0f}x (direct) fewer bytes than dense zstd and "
              f"{moved(r['pulse']) / moved(r['dte']):.1f}x / "
              f"{moved(r['pulse']) / moved(r['direct']):.1f}x fewer than the PULSE format "
              f"({r['pulse_frame_bytes'] / h.MB:.2f} MB frame, "
              f"{r['pulse_frame_bytes'] / r['pulse_changed']:.2f} B per changed element); "
              f"the dense baseline moved its bytes at "
              f"{moved(dense) / seconds(dense) / h.MB:.1f} MB/s end to end (zstd included)")
    r = results["rows"][-1]
    pub, fol = r["direct"]
    print(f"- dte direct, last row: the commit sent {r['direct_requests'][0]} requests and "
          f"downloaded {pub['down'] / h.MB:.3f} MB (the parent came from its blob cache); the "
          f"export sent {r['direct_requests'][1]} requests and downloaded "
          f"{fol['down'] / h.MB:.3f} MB")
    print(f"- Each `aws` invocation costs {results['aws_start']:.2f} s before its first byte "
          f"(`aws --version`); dte (sync) runs three per version, dense and PULSE two.")


def main():
    ap = h.parser(__doc__)
    ap.add_argument("--work", default="/tmp/dte-s3-bench")
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--scale", type=float, default=8.0)
    ap.add_argument("--rates-gbps", default="0.1,1,10")
    a = ap.parse_args()
    rates = [float(x) for x in a.rates_gbps.split(",")]
    tools = h.Tools(a.build_dir, names=("dtectl", "dtegen"))
    work = h.Scratch(a.work, fresh=True, keep=True)
    h.log(f"dte-gen --size {a.size} --steps {len(rates)}")
    h.generate(tools, work("gen"), ["--size", a.size], len(rates))
    ckpts = [h.step_dir(work("gen"), s) for s in range(len(rates) + 1)]
    results = {"args": vars(a), "rows": [],
               "changed": [h.bf16_changed(ckpts[i - 1], ckpts[i]) for i in range(1, len(ckpts))],
               "aws_start": h.measure(["/usr/bin/aws", "--version"]).seconds}
    bench = Bench(a, tools, work)
    try:
        bench.setup(ckpts[0])
        for i, gbps in enumerate(rates):
            rate = gbps * 1e9 / 8 / a.scale
            h.log(f"{gbps:g} Gbps nominal: link at {rate / h.MB:.2f} MB/s each way, version {i + 1}")
            results["rows"].append({"gbps": gbps, "rate": rate,
                                    **bench.measure(i + 1, ckpts[i + 1], rate)})
        commits = tools.log(work("pub-store"))
    finally:
        bench.close()
    report(a, results, commits)
    h.write_json(a.json, results)
    worst = min(moved(r["dense"]) / moved(r[m]) for r in results["rows"] for m in ("dte", "direct"))
    if worst < 50:
        sys.exit(f"FAIL: dte moved only {worst:.1f}x fewer bytes than the dense baseline")


if __name__ == "__main__":
    main()
