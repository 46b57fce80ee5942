"""Distributed publishing from several trainer processes on one machine.

Each test launches `world` processes of tests/py/dist_worker.py, joined in a
torch.distributed gloo group (or dte's TCP transport), that train the same
model with real torch.optim.AdamW steps and each publish only the state they
hold: FSDP2 row shards (uneven, with empty ones), a flat buffer cut across
tensor boundaries (ZeRO, Megatron's distributed optimizer), replicas, and
hybrid row shards with replicas, and DTensors (Shard(0) and Replicate
placements on 1- and 2-dimensional meshes, through DTensor's interface
since Debian's torch has none). Rank 0 also publishes every step with the
single-process publisher into a reference store and reads every version back
against param.to(torch.bfloat16); the test compares the two stores' exports
byte for byte and runs `dtectl verify`. Faults: kill -9 of one rank at random
points inside and between publishes, a stalled rank, and ranks that
disagree; then the job restarts and resumes where the store is. The
examples (FSDP2-style; Megatron-style TP x DP with the distributed optimizer,
TP x PP, and EP for a Qwen3-MoE model) run as processes too and check
themselves.
"""

import json
import os
import random
import signal
import subprocess
import time

import pytest

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
PYTHON = os.environ.get("DTE_PYTHON", "/usr/bin/python3")  # Debian's python3-torch by default
DTECTL = os.path.join(BUILD, "tools", "dtectl")

pytest.importorskip("torch")  # not reached with the project's setup, which installs it


class Job:
    def __init__(self, root, name, world, layout, steps, ref=True, **extra):
        self.root, self.name, self.world = root, name, world
        self.store = os.path.join(root, "store")
        self.cfg = {"world": world, "layout": layout, "steps": steps, "store": self.store,
                    "work": root, "timeout": 20}
        if ref:
            self.cfg["ref"] = os.path.join(root, "ref")
        self.cfg.update(extra)

    def run(self, kill_rank=None, stalled=False, deadline=120, env=None):
        """Runs every rank to its end; returns each rank's result (None for
        rank `kill_rank` if it was killed before writing one). With
        `stalled`, rank `kill_rank` hangs (config "stall") and is killed once
        every other rank has exited: they must fail on their own timeout, and
        no fixed delay guesses how long that takes."""
        attempt = os.path.join(self.root, "%s-%d" % (self.name, time.monotonic_ns()))
        os.makedirs(attempt)
        cfg = dict(self.cfg, init=os.path.join(attempt, "init"), out=os.path.join(attempt, "out"),
                   rendezvous=os.path.join(attempt, "rendezvous"))
        os.makedirs(cfg["rendezvous"])
        path = os.path.join(attempt, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, DTE_BUILD_DIR=BUILD, DTE_SOURCE_DIR=SOURCE, **(env or {}))
        procs = [subprocess.Popen([PYTHON, WORKER, path, str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(self.world)]
        logs = [None] * self.world
        last = [kill_rank] if stalled else []
        for r in [r for r in range(self.world) if r not in last] + last:
            if r in last:
                procs[r].send_signal(signal.SIGKILL)
            out, _ = procs[r].communicate(timeout=deadline)
            logs[r] = out.decode("utf-8", "replace")
        results = []
        for r in range(self.world):
            try:
                with open("%s-%d.json" % (cfg["out"], r)) as f:
                    results.append(json.load(f))
            except FileNotFoundError:
                assert r == kill_rank, "rank %d wrote no result:\n%s" % (r, logs[r])
                results.append(None)
        return results


def dtectl(*args, env=None):
    return subprocess.run([DTECTL, *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))


def versions(store, env=None):
    r = dtectl("log", "--store", store, "--json", env=env)
    assert r.returncode == 0, r.stderr
    return [v["version"] for v in json.loads(r.stdout)]


def same_exports(root, a, b, version):
    outs = []
    for i, store in enumerate((a, b)):
        out = os.path.join(root, "export-%d-%d" % (i, version))
        r = dtectl("export", "--store", store, "--version", str(version), "-q", out)
        assert r.returncode == 0, r.stderr
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            outs.append(f.read())
    return outs[0] == outs[1]


def check_clean(results, steps):
    for res in results:
        assert res["error"] is None, "rank %d: %s" % (res["rank"], res["error"])
        assert [s["version"] for s in res["steps"]] == list(range(1, steps + 1))
    for rec in results[0]["steps"]:
        assert rec["version"] == rec["ref_version"]
        assert rec["changed"] == rec["ref_changed"] > 0
        assert rec["mismatches"] == 0
    for res in results[1:]:
        assert [s["changed"] for s in res["steps"]] == [s["changed"] for s in results[0]["steps"]]
    # Every rank's metrics count the versions it published (the C ABI of the
    # distributed publisher's registry).
    for res in results:
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in res["metrics"].splitlines() if line and not line.startswith("#")}
        assert values["dte_publish_versions_total"] == steps
        assert values["dte_publish_failures_total"] == 0
        assert values["dte_publish_changed_elements_total"] == sum(
            s["changed"] for s in res["steps"])
        assert values["dte_publish_last_version"] == steps
        assert values["dte_publish_dist_entries_sent_total"] > 0 or res["rank"] != 0


def _cuda_devices():
    try:
        out = subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


@pytest.mark.parametrize("world,layout", [(1, "replicated"), (2, "rows"), (3, "flat")])
def test_state_on_the_gpu_publishes_the_single_process_versions(tmp_path, world, layout):
    """Every rank trains on the GPU (torch's CUDA AdamW) and publishes from
    device memory: the changes are found there; the versions equal the
    single-process publisher's from host copies of the same state."""
    if _cuda_devices() == 0:
        pytest.skip("no CUDA device visible to torch; the CPU tests cover the shared element "
                    "math (AdamW.FindChanges*)")
    steps = 3
    job = Job(str(tmp_path), "job", world, layout, steps, transport="tcp", cuda=True)
    check_clean(job.run(), steps)
    for v in range(1, steps + 1):
        assert same_exports(str(tmp_path), job.store, job.cfg["ref"], v), "version %d" % v
    r = dtectl("verify", "--store", job.store)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("world,layout,transport", [
    (1, "replicated", "gloo"),
    (2, "rows", "gloo"),
    (3, "rows", "gloo"),
    (4, "flat", "gloo"),
    (4, "hybrid", "gloo"),
    (3, "flat", "tcp"),
    (3, "flat", "staged"),
    (3, "dtensor", "gloo"),
    (4, "dtensor", "gloo"),
])
def test_every_layout_publishes_the_single_process_versions(tmp_path, world, layout, transport):
    steps = 3
    job = Job(str(tmp_path), "job", world, layout, steps, transport=transport)
    check_clean(job.run(), steps)
    assert versions(job.store) == list(range(steps + 1))
    for v in range(1, steps + 1):
        assert same_exports(str(tmp_path), job.store, job.cfg["ref"], v), "version %d" % v
    r = dtectl("verify", "--store", job.store)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kill_9_of_a_rank_at_random_points_then_the_job_resumes(tmp_path):
    steps, world = 4, 3
    root = str(tmp_path)
    # The reference: the same training, published by one process.
    ref = Job(os.path.join(root, "ref-job"), "ref", 1, "replicated", steps, ref=False)
    os.makedirs(ref.root)
    assert ref.run()[0]["error"] is None
    # Twelve points where rank 1 is killed: (step, exchange, before or after
    # it); exchange -1 is right before the publish. A publish makes ten
    # exchanges: agreement, parent, routing, parts and outcome, each sizes
    # then payloads.
    rng = random.Random(20261125)
    points = [(rng.randint(1, steps), rng.randint(-1, 9), rng.randint(0, 1)) for _ in range(12)]
    for trial, (step, call, after) in enumerate(points):
        where = "trial %d: rank 1 killed at step %d, exchange %d (%s)" % (
            trial, step, call, "after" if after else "before")
        job = Job(os.path.join(root, "trial%d" % trial), "job", world, "rows", steps, ref=False,
                  timeout=10, kill=[1, step, call, after])
        os.makedirs(job.root)
        results = job.run(kill_rank=1)
        assert results[1] is None, where  # it died
        have = versions(job.store)
        # Steps before the kill are in; the killed step is in only if rank 0
        # committed it before the kill (while the outcome was sent).
        assert have[:step] == list(range(step)), (where, have)
        assert len(have) in (step, step + 1), (where, have)
        if len(have) == step + 1:
            assert call in (8, 9) or (call == 7 and after), (where, have)
        r = dtectl("verify", "--store", job.store)
        assert r.returncode == 0, (where, r.stdout + r.stderr)
        for res in (results[0], results[2]):
            done = [s["version"] for s in res["steps"]]
            assert done in (list(range(1, step)), list(range(1, step + 1))), (where, done)
            if done == list(range(1, step)):
                assert res["error"] is not None, where
                assert ("step %d" % step) in res["error"] and "rank 1" in res["error"], \
                    (where, res["error"])
        # Restarted, the job replays what the store has and publishes the rest.
        del job.cfg["kill"]
        for res in job.run():
            assert res["error"] is None, (where, res["error"])
        assert versions(job.store) == list(range(steps + 1)), where
        for v in range(1, steps + 1):
            assert same_exports(job.root, job.store, ref.store, v), (where, v)


def test_a_stalled_rank_fails_the_others_within_the_timeout(tmp_path):
    job = Job(str(tmp_path), "job", 3, "rows", 2, ref=False, timeout=5, stall=[2, 2])
    t0 = time.monotonic()
    # Rank 2 sleeps in step 2; it is killed once the others have exited.
    results = job.run(kill_rank=2, stalled=True)
    elapsed = time.monotonic() - t0
    for res in results[:2]:
        assert res["error"] is not None
        assert "step 2" in res["error"] and "rank 2" in res["error"], res["error"]
        assert [s["version"] for s in res["steps"]] == [1]
    assert versions(job.store) == [0, 1]
    assert elapsed < 60


def test_ranks_that_disagree_fail_before_anything_is_written(tmp_path):
    # Rank 1 passes twice the learning rate of rank 0.
    job = Job(str(tmp_path), "job", 2, "disagree", 1, ref=False)
    for res in job.run():
        assert res["error"] is not None
        assert "step 1: rank 1 disagrees with rank 0 on lr" in res["error"], res["error"]
    assert versions(job.store) == [0]


def test_ranks_that_share_only_an_s3_store_publish_through_it(tmp_path, moto):
    """No process group and no connections between the ranks: the messages
    are objects under exchange/ of the S3 store (moto), read and deleted."""
    import s3_util
    bucket = moto.create_bucket("dist-exchange")
    store = "s3://%s/run7/policy" % bucket
    env = moto.env()
    job = Job(str(tmp_path), "job", 3, "flat", 2, transport="store", job="run7-launch1",
              store=store, timeout=30, cache=True)  # each rank with its blob cache
    job.cfg["import"] = True
    check_clean(job.run(env=env), 2)
    assert versions(store, env) == [0, 1, 2]
    r = dtectl("verify", "--store", store, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    left = [k for k in s3_util.s3_keys(moto, bucket, "run7/policy") if "exchange/" in k]
    assert left == []


@pytest.mark.parametrize("script,nproc,args", [
    ("fsdp2_publish.py", 3, ["--steps", "3"]),
    ("fsdp2_publish.py", 2, ["--steps", "2", "--job", "example"]),
    ("megatron_publish.py", 4, ["--tp", "2", "--steps", "2"]),
    ("megatron_publish.py", 4, ["--tp", "2", "--pp", "2", "--steps", "2"]),
    ("megatron_publish.py", 2, ["--tp", "1", "--moe", "--ep", "2", "--steps", "2"]),
])
def test_the_examples_run_and_check_themselves(tmp_path, script, nproc, args):
    examples = os.path.join(SOURCE, "tools", "examples")
    store = str(tmp_path / "policy")
    r = subprocess.run([PYTHON, os.path.join(examples, "launch.py"), "--nproc", str(nproc),
                        os.path.join(examples, script), "--store", store, *args],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DTE_LIBRARY=os.path.join(BUILD, "sync", "libdte.so")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equals the trainer's" in r.stdout and ": True" in r.stdout, r.stdout
    steps = int(args[args.index("--steps") + 1])
    assert versions(store) == list(range(steps + 1))


def test_dtensor_placements_a_rank_cannot_publish_are_refused(tmp_path):
    """Shard(1), Partial, rows= beside a DTensor, and moments placed unlike
    their param: each fails naming the tensor, before any exchange."""
    script = r'''
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import dist_worker as w
import dte, torch

class Partial:
    def is_shard(self, dim=None): return False
    def is_replicate(self): return False
    def __repr__(self): return "Partial(sum)"

mesh = w.Mesh((0,), (1,))
t = torch.zeros(4, 6)
def dt(pl, local=t, shape=(4, 6), m=mesh):
    return w.DTensor(local, shape, m, [pl])
pub = dte.Publisher(sys.argv[2], rank=0, world_size=1, job="refusals")
cases = {
    "shard1": {"param": dt(w.Shard(1)), "exp_avg": dt(w.Shard(1)), "exp_avg_sq": dt(w.Shard(1))},
    "partial": {"param": dt(Partial()), "exp_avg": dt(Partial()), "exp_avg_sq": dt(Partial())},
    "rows": {"param": dt(w.Shard(0)), "exp_avg": dt(w.Shard(0)), "exp_avg_sq": dt(w.Shard(0)),
             "rows": (0, 4)},
    "mixed": {"param": dt(w.Shard(0)), "exp_avg": t, "exp_avg_sq": dt(w.Shard(0))},
    "placed": {"param": dt(w.Shard(0)), "exp_avg": dt(w.Shard(0), t[:2], m=w.Mesh((1,), (2,))),
               "exp_avg_sq": dt(w.Shard(0))},
}
for name, d in cases.items():
    try:
        pub.publish_adamw(step=1, params={"model.w." + name: d}, lr=1e-3)
        print(name, "accepted")
    except dte.DteError as e:
        print(name, "refused:", e)
'''
    store = str(tmp_path / "store")
    r = subprocess.run([PYTHON, "-c", script, WORKER, store], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, DTE_BUILD_DIR=BUILD,
                                            DTE_SOURCE_DIR=SOURCE))
    assert r.returncode == 0, r.stdout + r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert "model.w.shard1" in got["shard1"] and "Shard(dim=1)" in got["shard1"], got
    assert "model.w.partial" in got["partial"] and "Partial(sum)" in got["partial"], got
    assert "do not also pass rows" in got["rows"], got
    assert "exp_avg is not a DTensor" in got["mixed"], got
    assert "placed differently from param" in got["placed"], got
    assert all(v.startswith("refused: ") for v in got.values()), got
    assert not os.path.exists(os.path.join(store, "dte-store.json")) or versions(store) == []
