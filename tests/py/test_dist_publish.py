"""Distributed publishing from several trainer processes on one machine.

Each test runs tests/py/dist_worker.py, which forks `world` rank processes,
joined in a torch.distributed gloo group (or dte's TCP transport, or the
store), that train with real torch.optim.AdamW steps and each publish only
the state they hold: a real FSDP2 trainer (torch.distributed.fsdp's
fully_shard) of a small transformers Llama on 2 and 3 ranks (Shard(0),
uneven and empty shards) and HSDP on a 2 x 2 mesh, handing its DTensors
over as they are; and a dict of parameters cut as FSDP2 row shards, a flat
buffer cut across tensor boundaries (ZeRO, Megatron's distributed
optimizer), replicas, and hybrid row shards with replicas. Rank 0 also publishes every step with the
single-process publisher into a reference store, from the state gathered
whole, and reads every version back against the full parameters' BF16; the
test compares the two stores' exports byte for byte and runs `dtectl
verify`. Faults: kill -9 of one FSDP2 rank inside and between publishes,
then the job restarts from its newest torch.distributed.checkpoint (DCP)
save and goes on from the store's latest version; a DCP resume behind the
store; a stalled rank; ranks that disagree. The examples (FSDP2 and HSDP;
Megatron-style TP x DP with the distributed optimizer, TP x PP, and EP for
a Qwen3-MoE model) run as processes too and check themselves.
"""

import functools
import json
import os
import subprocess
import sys
import time

import pytest

import dtectl_util

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
PYTHON = sys.executable  # the interpreter running the tests, with its torch

pytest.importorskip("torch")  # not reached with the project's setup, which installs it

# The FSDP2 trainers' Llama: k_proj and v_proj are (2, 64) with 2-element
# biases, so on 3 ranks the last shard of each is empty; the 257-row
# embedding and lm_head split 129 / 128 on 2 ranks.
MODEL = {"vocab_size": 257, "hidden_size": 64, "intermediate_size": 170, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 2,
         "attention_bias": True, "tie_word_embeddings": False, "max_position_embeddings": 64}


class Job:
    def __init__(self, root, name, world, layout, steps, ref=True, **extra):
        self.root, self.name, self.world = root, name, world
        self.store = os.path.join(root, "store")
        self.cfg = {"world": world, "layout": layout, "steps": steps, "store": self.store,
                    "work": root, "timeout": 20, "model": MODEL,
                    "checkpoints": os.path.join(root, "checkpoints")}
        if ref:
            self.cfg["ref"] = os.path.join(root, "ref")
        self.cfg.update(extra)

    def run(self, kill_rank=None, stalled=False, deadline=300, env=None):
        """Runs every rank to its end (the worker forks them); returns each
        rank's result (None for rank `kill_rank` if it was killed before
        writing one). With `stalled`, rank `kill_rank` hangs (config
        "stall") and the worker kills it once every other rank has exited."""
        assert not stalled or self.cfg.get("stall", [None])[0] == kill_rank
        attempt = os.path.join(self.root, "%s-%d" % (self.name, time.monotonic_ns()))
        os.makedirs(attempt)
        cfg = dict(self.cfg, init=os.path.join(attempt, "init"), out=os.path.join(attempt, "out"),
                   rendezvous=os.path.join(attempt, "rendezvous"))
        os.makedirs(cfg["rendezvous"])
        path = os.path.join(attempt, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        env = dict(os.environ, DTE_BUILD_DIR=BUILD, DTE_SOURCE_DIR=SOURCE, **(env or {}))
        r = subprocess.run([PYTHON, WORKER, path], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=deadline)
        log = r.stdout.decode("utf-8", "replace")
        assert r.returncode == 0, log
        results = []
        for rank in range(self.world):
            try:
                with open("%s-%d.json" % (cfg["out"], rank)) as f:
                    results.append(json.load(f))
            except FileNotFoundError:
                assert rank == kill_rank, "rank %d wrote no result:\n%s" % (rank, log)
                results.append(None)
        return results


def dtectl(*args, env=None):
    return dtectl_util.run(*args, env=env, timeout=300)


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


def check_clean(results, steps, whole=False):
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
    # publisher's registry).
    for res in results:
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in res["metrics"].splitlines() if line and not line.startswith("#")}
        assert values["dte_publish_versions_total"] == steps
        assert values["dte_publish_failures_total"] == 0
        assert values["dte_publish_changed_elements_total"] == sum(
            s["changed"] for s in res["steps"])
        assert values["dte_publish_last_version"] == steps
        # A world of one holding whole host tensors publishes them whole,
        # routing nothing; ranges, and every world of several, route.
        assert (values["dte_publish_dist_entries_sent_total"] > 0) != whole or res["rank"] != 0


@functools.lru_cache(maxsize=None)
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
    (2, "fsdp2", "gloo"),
    (4, "hsdp", "gloo"),
])
def test_every_layout_publishes_the_single_process_versions(tmp_path, world, layout, transport):
    steps = 3
    job = Job(str(tmp_path), "job", world, layout, steps, transport=transport)
    results = job.run()
    check_published(job, results, steps)
    if layout in ("fsdp2", "hsdp"):
        check_fsdp2_shards(results, world, layout)


def check_published(job, results, steps):
    """A clean run: every rank's steps, rank 0's read-back, the reference's
    exports, dtectl verify."""
    check_clean(results, steps, whole=len(results) == 1 and job.cfg["layout"] == "replicated")
    assert versions(job.store) == list(range(steps + 1))
    for v in range(1, steps + 1):
        assert same_exports(job.root, job.store, job.cfg["ref"], v), "version %d" % v
    r = dtectl("verify", "--store", job.store)
    assert r.returncode == 0, r.stdout + r.stderr


def check_fsdp2_shards(results, world, layout):
    """FSDP2 cut the shapes MODEL was chosen for: torch.chunk's rows per
    shard, uneven on 2 ranks, empty on the last of 3; HSDP's replicas hold
    the same rows."""
    shards = 2 if layout == "hsdp" else world
    for name, rows in (("model.embed_tokens.weight", 257),
                       ("model.layers.0.self_attn.k_proj.weight", 2),
                       ("model.layers.1.self_attn.v_proj.bias", 2)):
        chunk = -(-rows // shards)
        want = [max(0, min(chunk, rows - chunk * (r % shards))) for r in range(world)]
        assert [res["local_shapes"][name][0] for res in results] == want, name
    if layout == "fsdp2" and world == 3:
        assert results[2]["local_shapes"]["model.layers.0.self_attn.k_proj.bias"] == [0]
    if layout == "fsdp2" and world == 2:
        assert [res["local_shapes"]["lm_head.weight"] for res in results] == [[129, 64],
                                                                              [128, 64]]


KILL_STEPS, KILL_SAVE = 4, 2  # the kill test's FSDP2 job: 4 steps, a DCP save after step 2


@pytest.fixture(scope="module")
def fsdp2_on_3_ranks(tmp_path_factory):
    """An FSDP2 job on 3 ranks that nothing interrupts: the kill test's
    reference."""
    job = Job(str(tmp_path_factory.mktemp("fsdp2-3")), "job", 3, "fsdp2", KILL_STEPS,
              save_at=[KILL_SAVE])
    return job, job.run()


def test_fsdp2_on_3_ranks_with_empty_shards_publishes_the_single_process_versions(
        fsdp2_on_3_ranks):
    job, results = fsdp2_on_3_ranks
    check_published(job, results, KILL_STEPS)
    check_fsdp2_shards(results, 3, "fsdp2")


# (step, exchange, before (0) or after (1) it) where rank 1 of the FSDP2
# job kills itself; exchange -1 is right before the publish. A publish
# makes ten exchanges: agreement, parent, routing, parts and outcome, each
# sizes then payloads.
KILL_POINTS = [
    (3, -1, 0),  # the step after the checkpoint, before it is published
    (2, 9, 1),   # step 2 committed, the checkpoint after it never made
    (4, 3, 1),   # the parent exchanged, a step past the checkpoint
    (4, 8, 0),   # the outcome of a step past the checkpoint: committed or not
]


def check_killed(job, results, step, call, after, where):
    """What a kill of rank 1 at (step, call, after) left; returns the
    store's versions. Steps before the kill are in; the killed step only if
    rank 0 committed it (while the outcome was sent). A survivor that did
    not publish it names the step and rank 1."""
    assert results[1] is None, where  # it died
    have = versions(job.store)
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
    return have


def test_kill_9_of_an_fsdp2_rank_then_the_job_resumes_from_its_checkpoint(tmp_path,
                                                                          fsdp2_on_3_ranks):
    """Rank 1 of the FSDP2 job is killed inside or between publishes: the
    other ranks fail naming it, and the store holds every step before the
    kill and the killed one only if rank 0 committed it. Restarted, the job
    loads its newest DCP checkpoint (none when the kill came before the
    save), replays the steps the store holds past it, checks the latest
    version against its weights, and publishes the rest: every version
    equals the uninterrupted job's."""
    steps, world, root = KILL_STEPS, 3, str(tmp_path)
    ref = fsdp2_on_3_ranks[0].store
    for trial, (step, call, after) in enumerate(KILL_POINTS):
        where = "trial %d: rank 1 killed at step %d, exchange %d (%s)" % (
            trial, step, call, "after" if after else "before")
        job = Job(os.path.join(root, "trial%d" % trial), "job", world, "fsdp2", steps, ref=False,
                  timeout=10, kill=[1, step, call, after], save_at=[KILL_SAVE])
        os.makedirs(job.root)
        have = check_killed(job, job.run(kill_rank=1), step, call, after, where)
        del job.cfg["kill"]
        checkpoint = KILL_SAVE if step > KILL_SAVE else 0
        for res in job.run():
            assert res["error"] is None, (where, res["error"])
            assert res["resumed"] == [checkpoint, len(have) - 1], (where, res["resumed"])
            assert [s["version"] for s in res["steps"]] == list(range(len(have), steps + 1))
        assert versions(job.store) == list(range(steps + 1)), where
        for v in range(1, steps + 1):
            assert same_exports(job.root, job.store, ref, v), (where, v)


def test_a_dcp_resume_behind_the_store_replays_up_to_its_latest_version(tmp_path):
    """The job saves a DCP checkpoint at step 2 and publishes step 3 before
    it stops. Restarted, it may not publish step 3 again on top of version
    3: when it may not replay it refuses, naming both numbers, before
    anything is written; when it may, it replays step 3, checks version 3
    bit for bit, and publishes steps 4 and 5."""
    job = Job(str(tmp_path), "job", 2, "fsdp2", 3, save_at=[2])
    check_clean(job.run(), 3)
    job.cfg.update(steps=5, replay=False)
    for res in job.run():
        assert res["error"] is not None
        assert "is at version 3, ahead of the checkpoint of step 2" in res["error"], res["error"]
        assert res["steps"] == []
    assert versions(job.store) == [0, 1, 2, 3]
    job.cfg.update(replay=True)
    results = job.run()
    for res in results:
        assert res["error"] is None, res["error"]
        assert res["resumed"] == [2, 3]
        assert [s["version"] for s in res["steps"]] == [4, 5]
    assert all(s["mismatches"] == 0 and s["version"] == s["ref_version"]
               for s in results[0]["steps"])
    assert versions(job.store) == list(range(6))
    for v in range(1, 6):
        assert same_exports(str(tmp_path), job.store, job.cfg["ref"], v), "version %d" % v
    r = dtectl("verify", "--store", job.store)
    assert r.returncode == 0, r.stdout + r.stderr


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
    ("fsdp2_publish.py", 3, ["--steps", "2"]),
    ("fsdp2_publish.py", 4, ["--steps", "2", "--mesh", "2x2", "--job", "example"]),
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


# Publishes one tensor per case into an empty store from a world of one
# rank (a gloo group, so the DTensors have a mesh) and prints the outcome.
REFUSALS = r'''
import os, sys
sys.path.insert(0, os.path.join(os.environ["DTE_SOURCE_DIR"], "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(os.environ["DTE_BUILD_DIR"], "sync",
                                                  "libdte.so"))
import dte, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

dist.init_process_group("gloo", init_method="file://" + sys.argv[2] + ".init", rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
t = torch.zeros(4, 6)
def dt(pl, local=t):
    return DTensor.from_local(local, mesh, [pl], run_check=False)
pub = dte.Publisher(sys.argv[1], rank=0, world_size=1, job="refusals")
three = lambda pl: {"param": dt(pl), "exp_avg": dt(pl), "exp_avg_sq": dt(pl)}
cases = {
    "shard1": three(Shard(1)),
    "partial": three(Partial()),
    "strided": three(_StridedShard(0, split_factor=2)),
    "rows": dict(three(Shard(0)), rows=(0, 4)),
    "mixed": {"param": dt(Shard(0)), "exp_avg": t, "exp_avg_sq": dt(Shard(0))},
    "placed": {"param": dt(Shard(0)), "exp_avg": dt(Shard(0), t[:2]),
               "exp_avg_sq": dt(Shard(0))},
}
for name, d in cases.items():
    try:
        pub.publish_adamw(step=1, params={"model.w." + name: d}, lr=1e-3)
        print(name, "accepted")
    except dte.DteError as e:
        print(name, "refused:", e)
dist.destroy_process_group()
'''


def test_dtensor_placements_a_rank_cannot_publish_are_refused(tmp_path):
    """Shard(1), Partial, _StridedShard (FSDP2 over TP), rows= beside a
    DTensor, and moments placed unlike their param: each fails naming the
    tensor, before any exchange. Real DTensors on a mesh of one rank."""
    store = str(tmp_path / "store")
    r = subprocess.run([PYTHON, "-c", REFUSALS, store, str(tmp_path / "pg")], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, DTE_BUILD_DIR=BUILD,
                                                        DTE_SOURCE_DIR=SOURCE))
    assert r.returncode == 0, r.stdout + r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert "model.w.shard1" in got["shard1"] and "Shard(dim=1)" in got["shard1"], got
    assert "model.w.partial" in got["partial"] and "Partial(sum)" in got["partial"], got
    assert "model.w.strided" in got["strided"] and "_StridedShard" in got["strided"], got
    assert "do not also pass rows" in got["rows"], got
    assert "exp_avg is not a DTensor" in got["mixed"], got
    assert "placed differently from param" in got["placed"], got
    assert all(v.startswith("refused: ") for v in got.values()), got
    assert not os.path.exists(os.path.join(store, "dte-store.json")) or versions(store) == []
