#!/opt/dte/venv/bin/python
"""Distributed publishing: per-rank cost at world sizes 1, 2, 4, 8 on the same
total optimizer state, against the single-process publisher in the same run.

The model is --tensors BF16 matrices of --rows x --cols (a 1 GiB model by
default: 32 x 4096 x 4096). Every rank of a torch.distributed gloo group
holds FSDP2 row shards of every tensor (torch.chunk of dim 0) in FP32: theta,
exp_avg and exp_avg_sq after real torch.optim.AdamW steps taken on its shard
only (AdamW is elementwise, so a shard's step is the slice of the whole
step). Rank 0 imports the initial BF16 weights once per world size. Each rank
publishes two steps; the second is reported:

  wall, cpu   seconds of publish_adamw on the rank (wall clock, and the
              process's user + system CPU time, all threads)
  extra       peak RSS during a publish minus RSS before it (the memory the
              publish adds to the state the trainer holds anyway; VmHWM reset
              through /proc/self/clear_refs), the larger of the two steps
  exchanged   bytes this rank sent to other ranks, per changed element of the
              version
  stored      bytes the version added to the store per changed element
  messages    messages this rank sent (a transport that stores each message
              as an object, as `job=` does, makes 1 PUT, 1 GET and 1 DELETE
              per message, plus polls)

The baseline: the single-process Publisher (dte.Publisher without a world
size) publishing the same two steps of the whole model in one process. The
version each world size commits is exported and hashed file by file and
must equal the baseline's.

With --cuda every rank moves its state to its GPU before the timed publish,
which then finds the changes there (docs/engine.md, "State on the GPU"); the
baseline still publishes from host memory, and the versions must match.

--lr sets the learning rate (default 2e-6: ~2% of BF16 weights change per
step, as in RL fine-tuning; 1e-4 changes ~70%).

With --s3 it counts object store requests per version instead, against a
moto S3 server (the model given by --tensors/--rows/--cols):

  /opt/dte/venv/bin/python tools/bench/dist_publish_bench.py --s3 --worlds 1,2,4 \
      --tensors 8 --rows 2048 --cols 2048

Usage: /opt/dte/venv/bin/python tools/bench/dist_publish_bench.py [--build-dir build]
       [--worlds 1,2,4,8] [--tensors 32 --rows 4096 --cols 4096] [--lr 2e-6]
       [--json out]
"""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

import harness as h

SOURCE = h.ROOT
WD = 0.1


def log(msg):
    h.log("[dist-bench] %s" % msg)


def names(a):
    return ["model.layers.%d.mlp.weight" % i for i in range(a.tensors)]


def initial(a, i):
    import torch
    g = torch.Generator().manual_seed(i)
    return torch.randn((a.rows, a.cols), generator=g) * 0.02


def grad(a, i, step, r0, r1):
    """Rows [r0, r1) of tensor i's gradient at `step` (the same rows whatever
    the sharding: row generators)."""
    import torch
    out = torch.empty((r1 - r0, a.cols))
    g = torch.Generator()
    for r in range(r0, r1):
        g.manual_seed(1_000_003 * step + 7919 * i + r)
        out[r - r0] = torch.randn(a.cols, generator=g)
    return out * 1e-2


def worker(a):
    """One rank (or, with world 0, the single-process baseline)."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    import dte
    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    single = world == 0
    if not single:
        dist.init_process_group("gloo", init_method="file://" + a.init, rank=rank,
                                world_size=world)
    shards, opts = {}, []
    for i, n in enumerate(names(a)):
        r0, r1 = (0, a.rows) if single else dte.chunk_rows(a.rows, rank, world)
        p = torch.nn.Parameter(initial(a, i)[r0:r1].clone())
        shards[n] = (p, r0, r1)
        opts.append(p)
    opt = torch.optim.AdamW(opts, lr=a.lr, weight_decay=WD, fused=True)
    kwargs = {} if single else {"rank": rank, "world_size": world}
    if a.job and not single:
        kwargs["job"] = a.job
    if a.cache_root:
        kwargs["cache_dir"] = os.path.join(a.cache_root, "rank%d" % rank)
    pub = dte.Publisher(a.store, **kwargs)
    rows = []
    for step in range(1, a.steps + 1):
        for i, n in enumerate(names(a)):
            p, r0, r1 = shards[n]
            p.grad = grad(a, i, step, r0, r1)
        opt.step()
        params = {}
        for n, (p, r0, r1) in shards.items():
            st = opt.state[p]
            d = {"param": p.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                 "step": int(st["step"].item())}
            if not single:
                d["rows"] = (r0, r1)
            params[n] = d
        if a.cuda and not single:
            # The state as a GPU trainer holds it: the changes are found on
            # the device (the same values as on the host: the same version).
            params = {n: {k: (v.to("cuda") if torch.is_tensor(v) else v) for k, v in d.items()}
                      for n, d in params.items()}
            torch.cuda.synchronize()
        if not single:
            dist.barrier()
        h.trim_heap()
        before_rss = h.proc_status("self", "VmRSS")
        h.reset_peak()
        c0, t0 = h.self_cpu_seconds(), time.monotonic()
        r = pub.publish_adamw(step=step, params=params, lr=a.lr, weight_decay=WD)
        wall, cpu = time.monotonic() - t0, h.self_cpu_seconds() - c0
        stats = {} if single else dataclasses.asdict(pub.last_stats())
        rows.append({"step": step, "version": r.version, "wall": wall, "cpu": cpu,
                     "extra_mib": (h.proc_status("self", "VmHWM") - before_rss) / h.MIB,
                     "state_mib": sum(3 * p.numel() * 4 for p, _, _ in shards.values()) / 2**20,
                     "changed": r.changed, "stored_bytes": r.stored_bytes, **stats})
    with open(a.out, "w") as f:
        json.dump(rows, f)
    os._exit(0)


def run_world(a, world, root, store=None, env=None, steps=2, job=None, cache_root=None,
              on_imported=None):
    s3 = store is not None
    store = store or os.path.join(root, "store-%d" % world)
    env = dict(os.environ, DTE_LIBRARY=a.lib, **(env or {}))
    init = os.path.join(root, "ckpt")
    subprocess.run([a.python, "-c", (
        "import sys; sys.path.insert(0, %r); import dte; "
        "p = dte.Publisher(%r); p.import_checkpoint(%r)") %
        (os.path.join(SOURCE, "sync", "python"), store, init)], check=True, env=env)
    if on_imported:
        on_imported()  # the S3 count starts after the import
    procs, outs = [], []
    n = max(world, 1)
    rdv = os.path.join(root, "init-%d-%d" % (world, time.monotonic_ns()))  # fresh per run
    for rank in range(n):
        out = os.path.join(root, "out-%d-%d.json" % (world, rank))
        outs.append(out)
        argv = [a.python, os.path.abspath(__file__), "--worker", "--rank", str(rank),
                "--world", str(world), "--init", rdv, "--store", store, "--out", out,
                "--tensors", str(a.tensors), "--rows", str(a.rows), "--cols", str(a.cols),
                "--lr", repr(a.lr), "--steps", str(steps)] + (["--job", job] if job else []) + \
            (["--cuda"] if a.cuda else []) + \
            (["--cache-root", cache_root] if cache_root else [])
        procs.append(subprocess.Popen(argv, env=env))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("a rank of world %d failed" % world)
    ranks = []
    for o in outs:
        rows = json.load(open(o))
        # Extra memory: the larger of the two publishes (the first one
        # starts from a heap the allocator has not grown yet).
        rows[-1]["extra_mib"] = max(r["extra_mib"] for r in rows)
        ranks.append(rows[-1])
    if s3:
        return ranks
    ranks[0]["digest"] = export_digest(a, store, ranks[0]["version"], root)
    h.remove(store)
    return ranks


def export_digest(a, store, version, root):
    """SHA-256 over the exported version's files (names and bytes)."""
    out = os.path.join(root, "export")
    subprocess.run([os.path.join(a.build_dir, "tools", "dtectl"), "export", "-q", "--store",
                    store, "--cache-dir", os.path.join(root, "cache"), "--version",
                    str(version), out], check=True)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(out, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    h.remove(out, os.path.join(root, "cache"))
    return digest.hexdigest()


def write_initial(a, root):
    import torch
    import safetensors.torch
    d = os.path.join(root, "ckpt")
    os.makedirs(d)
    tensors = {n: initial(a, i).to(torch.bfloat16) for i, n in enumerate(names(a))}
    safetensors.torch.save_file(tensors, os.path.join(d, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}\n')


def s3_requests(a, root):
    """Object store requests per version: each world publishes 1 and then,
    into a fresh prefix, 2 steps through a counting proxy in front of a moto
    S3 server; the difference is one version's requests (the import and
    setup cancel out). With the process group and with the store transport
    (job=), whose messages are objects too; without and with a cache_dir per
    rank (its blob cache: parent blocks read in 4 MiB chunks, and those the
    rank published the step before read from disk)."""
    import s3_proxy  # tests/py, on the path through harness
    import s3_util
    moto = s3_util.MotoServer()
    proxy = s3_proxy.FaultProxy(moto.endpoint, io_timeout=600)
    bucket = moto.create_bucket("dist-bench")
    env = dict(moto.env(), AWS_ENDPOINT_URL=proxy.endpoint)
    rows = []
    try:
        for w in [int(x) for x in a.worlds.split(",")]:
            for transport, cached in (("group", False), ("group", True), ("store", True)):
                counts = []
                for steps in (1, 2):
                    name = "w%d-%s-%d-%d" % (w, transport, cached, steps)
                    store = "s3://%s/%s" % (bucket, name)
                    run_world(a, w, root, store=store, env=env, steps=steps,
                              on_imported=proxy.reset_counters,
                              job="bench-" + name if transport == "store" else None,
                              cache_root=os.path.join(root, "cache-" + name) if cached else None)
                    by = {}
                    for ex in proxy.exchanges():
                        kind = ex.method + (" (list)" if "list-type" in ex.query else "")
                        by[kind] = by.get(kind, 0) + 1
                    counts.append(by)
                per = {k: counts[1].get(k, 0) - counts[0].get(k, 0)
                       for k in set(counts[0]) | set(counts[1])}
                rows.append({"world": w, "transport": transport, "blob_cache": cached,
                             "per_version": per})
                log("world %d, %s, blob cache %s: %s" % (w, transport, cached, per))
    finally:
        proxy.stop()
        moto.stop()
    print(h.md_table(["ranks", "exchange", "blob cache", "requests per version", "by kind"], [
        [r["world"], r["transport"], "yes" if r["blob_cache"] else "no",
         sum(r["per_version"].values()),
         ", ".join("%s %d" % (k, v) for k, v in sorted(r["per_version"].items()) if v)]
        for r in rows]))
    return rows


def main():
    ap = h.parser(__doc__, work=None)
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--s3", action="store_true",
                    help="count object store requests per version instead (moto S3)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--job")
    ap.add_argument("--cache-root")
    ap.add_argument("--python", help="interpreter of the ranks (default: this one)")
    ap.add_argument("--cuda", action="store_true",
                    help="ranks hand their state over in GPU memory (the baseline stays on the "
                         "host)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--init")
    ap.add_argument("--store")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    a.python = a.python or sys.executable
    a.lib = os.path.join(os.path.abspath(a.build_dir), "sync", "libdte.so")
    work = h.Scratch(a.work, prefix="dist-bench-", keep=a.keep or a.work is not None)
    with work:
        root = work.path
        write_initial(a, root)
        if a.s3:
            h.write_json(a.json, s3_requests(a, root))
            return
        model_gib = a.tensors * a.rows * a.cols * 2 / 2**30
        log("model %.2f GiB of BF16 (%d x %d x %d), FP32 state %.1f GiB, lr %g" % (
            model_gib, a.tensors, a.rows, a.cols, model_gib * 6, a.lr))
        results = {"model_gib": model_gib, "lr": a.lr}
        log("single-process publisher")
        results["single"] = run_world(a, 0, root)[0]
        worlds = [int(x) for x in a.worlds.split(",")]
        for w in worlds:
            log("world %d" % w)
            results[str(w)] = run_world(a, w, root)
    base = results["single"]
    elements = a.tensors * a.rows * a.cols
    log("%d of %d BF16 elements changed in the reported step (%.2f%%)" % (
        base["changed"], elements, 100.0 * base["changed"] / elements))
    rows = [["single process", "%.2f s" % base["wall"], "%.2f s" % base["cpu"],
             "%.2f s" % base["cpu"], "%.0f MiB" % base["extra_mib"],
             "%.0f MiB" % base["state_mib"], "-", "%.3f" % (base["stored_bytes"] / base["changed"]),
             "-"]]
    for w in worlds:
        rs = results[str(w)]
        changed = rs[0]["changed"]
        rows.append([w, "%.2f s" % max(r["wall"] for r in rs), "%.2f s" % max(r["cpu"] for r in rs),
                     "%.2f s" % sum(r["cpu"] for r in rs),
                     "%.0f MiB" % max(r["extra_mib"] for r in rs),
                     "%.0f MiB" % max(r["state_mib"] for r in rs),
                     "%.2f" % (sum(r["bytes_sent"] for r in rs) / changed),
                     "%.3f" % (rs[0]["stored_bytes"] / changed),
                     max(r["messages_sent"] for r in rs)])
        assert rs[0]["digest"] == base["digest"], "world %d committed another version" % w
    print(h.md_table(["ranks", "wall (max)", "CPU per rank (max)", "CPU all ranks",
                      "extra RSS per rank (max)", "state per rank", "exchanged B / changed",
                      "stored B / changed", "messages per rank"], rows))
    h.write_json(a.json, results)


if __name__ == "__main__":
    main()
