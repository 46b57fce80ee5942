"""dte.hf.PublishCallback in a real transformers.Trainer training a tiny
Llama on CPU: version 0 is the starting weights, and after every optimizer
step the store's latest version is the step's number and equals the
model's bfloat16() weights bit for bit (read back with dte.StoreReader).

With the Trainer's default optimizer (torch's fused AdamW) the engine
inverts the AdamW step (path "adamw"); with optim="adamw_torch" (torch 2's
non-fused CPU kernel, which no engine order models), SGD, Adafactor and
BF16 weights the callback compares the weights with the parent version
(path "weights"), as it does for every=2. Also: gradient
accumulation 2, a resume from a Trainer checkpoint (which continues the
numbering, and is refused, naming both numbers, when the store is ahead),
two DDP processes over gloo (hf_ddp_worker.py; on the AdamW path each rank
publishes about half of the tensors over the Trainer's own process group,
on the weights path rank 0 publishes), and the refusals of releases older
than the ones the tests run on and of a Trainer without the
on_optimizer_step event.

FSDP2 through the Trainer: accelerate turns FSDP on only for accelerator
devices (its AcceleratorState sets DistributedType.FSDP for MULTI_GPU,
MULTI_NPU, MULTI_XPU, ..., never MULTI_CPU), so on this CPU-only machine
the Trainer trains FSDP arguments as DDP; the test asserts that fallback
and that the callback publishes every step exactly through it. The callback's FSDP2 paths run against real
FSDP2 (fully_shard over gloo) in test_hf_fsdp2.py."""

import json
import logging
import os
import re
import socket
import subprocess
import sys

import pytest

import follower_util  # noqa: F401 (puts the package on the path)

import dte  # noqa: E402
import dte.hf  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=16, seed=5):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def differing(store, version, model):
    """Names of the model's tensors whose bfloat16() differs from `version`."""
    bad = []
    with dte.StoreReader(store) as r:
        for name, t in model.state_dict().items():
            if hasattr(t, "full_tensor"):  # a DTensor: every rank gathers it
                t = t.full_tensor()
            want = t.detach().to(torch.bfloat16).contiguous()
            got = r.read_into(version, name, torch.empty_like(want))
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                bad.append(name)
    return bad


class Check(transformers.TrainerCallback):
    """After every step: the store's latest version and its weights."""

    def __init__(self, store, every=1):
        self.store, self.every, self.seen = store, every, []

    def on_step_end(self, args, state, control, model=None, **kw):
        with dte.StoreReader(self.store) as r:
            latest = r.latest()
        assert latest == state.global_step // self.every
        if state.global_step % self.every == 0:
            assert differing(self.store, latest, model) == []
        self.seen.append(latest)


def trainer(tmp_path, callbacks, model=None, optim=None, steps=3, lr=3e-3, **kw):
    """A Trainer of the tiny Llama; optim=None leaves the Trainer's default."""
    if optim is not None:
        kw["optim"] = optim
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=lr, weight_decay=0.01, warmup_steps=1, report_to=[],
        save_strategy=kw.pop("save_strategy", "no"), logging_steps=100, use_cpu=True,
        dataloader_num_workers=0, seed=3, **kw)
    if model is None:
        model = follower_util.model(torch.float32).train()
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                callbacks=callbacks)


def train(tmp_path, store, every=1, resume=None, **kw):
    check = Check(store, every if isinstance(every, int) else kw.get("save_steps"))
    pub = dte.hf.PublishCallback(store=store, every=every)
    t = trainer(tmp_path, [pub, check], **kw)
    start = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    t.train(resume_from_checkpoint=resume)
    return t, pub, check, start


def test_the_default_optimizer_is_torchs_fused_adamw_and_is_inverted(tmp_path, caplog):
    """transformers 5's default optim is adamw_torch_fused (a change of the
    default fails here first); on the CPU its step rounds as the engine's
    torch_cpu order, so each version comes from the AdamW state."""
    assert transformers.TrainingArguments.__dataclass_fields__["optim"].default == \
        "adamw_torch_fused"
    store = str(tmp_path / "store")
    with caplog.at_level(logging.INFO, logger="dte.hf"):
        t, pub, check, start = train(tmp_path, store, steps=4)
    opt = t.optimizer.optimizer
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"] is True
    assert pub.path == "adamw"
    assert "AdamW (fused, CPU): inverting the optimizer step (engine order torch_cpu)" in \
        caplog.text
    assert check.seen == [1, 2, 3, 4]
    assert [(r.version, r.path) for r in pub.results] == [(v, "adamw") for v in (1, 2, 3, 4)]
    # The linear warmup's first step runs at lr 0: nothing moves.
    assert [r.changed > 0 for r in pub.results] == [False, True, True, True]
    start_model = follower_util.model(torch.float32)
    start_model.load_state_dict(start)
    assert differing(store, 0, start_model) == []  # version 0: the starting weights


@pytest.mark.parametrize("optim,lr,path,kind", [
    ("adamw_torch", 3e-3, "weights", "AdamW with the single-tensor CPU kernel of torch 2"),
    ("sgd", 0.5, "weights", "torch.optim.sgd.SGD: diffing the weights"),
    ("adafactor", 3e-3, "weights",
     "transformers.optimization.Adafactor: diffing the weights"),
])
def test_each_optimizer_takes_its_path_and_every_step_is_exact(tmp_path, caplog, optim, lr,
                                                               path, kind):
    store = str(tmp_path / "store")
    with caplog.at_level(logging.INFO, logger="dte.hf"):
        _, pub, check, _ = train(tmp_path, store, steps=3, optim=optim, lr=lr)
    assert kind in caplog.text
    assert pub.path == path and check.seen == [1, 2, 3]
    assert [(r.version, r.path) for r in pub.results] == [(v, path) for v in (1, 2, 3)]
    assert sum(r.changed for r in pub.results) > 0
    if path == "weights":
        assert all(r.parent_bytes > 0 and r.state_bytes > 0 for r in pub.results)


def test_bf16_weights_publish_by_comparing_with_the_parent(tmp_path, caplog):
    store = str(tmp_path / "store")
    bf16 = follower_util.model(torch.bfloat16).train()
    with caplog.at_level(logging.INFO, logger="dte.hf"):
        _, pub, check, _ = train(tmp_path, store, model=bf16, steps=3, lr=3e-2)
    assert "AdamW with parameter model.embed_tokens.weight in torch.bfloat16, not FP32" in \
        caplog.text
    assert pub.path == "weights" and check.seen == [1, 2, 3]
    assert [r.path for r in pub.results] == ["weights"] * 3
    assert sum(r.changed for r in pub.results) > 0


def test_gradient_accumulation_publishes_once_per_optimizer_step(tmp_path):
    store = str(tmp_path / "store")
    _, pub, check, _ = train(tmp_path, store, steps=3, gradient_accumulation_steps=2)
    assert check.seen == [1, 2, 3]
    assert [(r.version, r.path) for r in pub.results] == [(v, "adamw") for v in (1, 2, 3)]


def test_weights_on_a_gpu_go_through_the_publisher_of_every_rank(tmp_path, monkeypatch):
    """A single process whose weights are on a GPU publishes through the
    publisher every rank opens, a world of one here (it finds the changes of
    CUDA tensors on their GPU); run here with CPU weights taken for GPU
    ones."""
    monkeypatch.setattr(dte.hf, "_on_gpu", lambda named: True)
    kinds = []
    real = dte.hf.PublishCallback.on_optimizer_step

    def spy(self, *args, **kw):
        kinds.append((type(self._pub), self._pub.rank, self._pub.world_size))
        return real(self, *args, **kw)

    monkeypatch.setattr(dte.hf.PublishCallback, "on_optimizer_step", spy)
    store = str(tmp_path / "store")
    _, pub, check, _ = train(tmp_path, store, steps=3)
    assert check.seen == [1, 2, 3] and [r.version for r in pub.results] == [1, 2, 3]
    assert kinds == [(dte.Publisher, 0, 1)] * 3


@pytest.mark.parametrize("every", [2, "save_steps"])
def test_every_two_steps_publishes_deltas_of_the_weights(tmp_path, caplog, every):
    store = str(tmp_path / "store")
    with caplog.at_level(logging.INFO, logger="dte.hf"):
        _, pub, check, _ = train(tmp_path, store, every=every, steps=4, save_steps=2)
    assert "torch.optim.adamw.AdamW, a version every 2 steps: diffing the weights" in \
        caplog.text
    assert pub.path == "weights" and check.seen == [0, 1, 1, 2]
    assert [(r.version, r.path) for r in pub.results] == [(1, "weights"), (2, "weights")]
    assert all(0 < r.changed < r.elements for r in pub.results)


def test_a_resumed_trainer_continues_the_numbering(tmp_path):
    store = str(tmp_path / "store")
    train(tmp_path, store, steps=2, save_strategy="steps", save_steps=2)
    ckpt = str(tmp_path / "out" / "checkpoint-2")
    _, pub, check, _ = train(tmp_path, store, steps=4, resume=ckpt)
    assert check.seen == [3, 4]
    assert [(r.version, r.path) for r in pub.results] == [(3, "adamw"), (4, "adamw")]
    # The store is at 4 now: resuming from step 2 again, or starting over,
    # is refused, naming both numbers.
    for resume, step in ((ckpt, 2), (None, 0)):
        with pytest.raises(dte.VersionConflict,
                           match=r"global step %d.*latest version is 4" % step):
            train(tmp_path, store, steps=4, resume=resume)


def test_the_pyproject_minimums_are_the_callbacks_and_are_installed():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
    assert "torch>=%s" % dte.hf.MIN_TORCH in extra
    assert "transformers>=%s" % dte.hf.MIN_TRANSFORMERS in extra
    from packaging.version import Version
    assert Version(torch.__version__).release >= Version(dte.hf.MIN_TORCH).release
    assert Version(transformers.__version__).release >= \
        Version(dte.hf.MIN_TRANSFORMERS).release


@pytest.mark.parametrize("module,found,name", [
    (transformers, "5.23.1", "transformers >= 5.24.0"),
    (torch, "2.14.0+cpu", "torch >= 2.15.0"),
])
def test_older_releases_are_refused_at_construction(tmp_path, monkeypatch, module, found,
                                                    name):
    monkeypatch.setattr(module, "__version__", found)
    with pytest.raises(dte.InvalidArgument,
                       match=r"needs %s .*found \w+ %s" % (re.escape(name), re.escape(found))):
        dte.hf.PublishCallback(store=str(tmp_path / "store"))


@pytest.mark.parametrize("owner", [transformers.TrainerCallback,
                                   transformers.trainer_callback.CallbackHandler])
def test_a_transformers_without_on_optimizer_step_is_refused(tmp_path, monkeypatch, owner):
    monkeypatch.delattr(owner, "on_optimizer_step")
    with pytest.raises(dte.InvalidArgument, match=r"%s has no on_optimizer_step event"
                       % owner.__name__):
        dte.hf.PublishCallback(store=str(tmp_path / "store"))


def test_a_trainer_that_never_fires_on_optimizer_step_fails_at_the_first_step(tmp_path,
                                                                             monkeypatch):
    """The event exists but the Trainer's loop does not call it (as
    transformers 4.40's did not): the first step's end raises instead of
    training on without publishing."""
    monkeypatch.setattr(transformers.trainer_callback.CallbackHandler, "on_optimizer_step",
                        lambda self, args, state, control, **kw: control)
    store = str(tmp_path / "store")
    with pytest.raises(dte.InvalidArgument, match=r"ended global step 1 without an "
                       r"on_optimizer_step event"):
        train(tmp_path, store, steps=3)
    with dte.StoreReader(store) as r:
        assert r.latest() == 0


def test_refusals_name_what_they_found(tmp_path):
    store = str(tmp_path / "store")
    with pytest.raises(dte.InvalidArgument, match="every"):
        dte.hf.PublishCallback(store=store, every=0)
    with pytest.raises(dte.InvalidArgument, match="chooses rank itself"):
        dte.hf.PublishCallback(store=store, rank=0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, mode, steps=3):
    """Two processes (the env torch.distributed.run sets; CPU, gloo) of
    hf_ddp_worker.py; their reports."""
    store, port = str(tmp_path / "store"), free_port()
    worker = os.path.join(HERE, "hf_ddp_worker.py")
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, worker, store, str(tmp_path), str(steps),
                                       mode], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return [json.load(open(tmp_path / ("rank-%d.json" % r))) for r in (0, 1)]


def test_two_ddp_ranks_share_the_adamw_publish_over_the_trainers_group(tmp_path):
    """Gradient accumulation 2, the default (fused) AdamW: every step is a
    version equal to both ranks' bfloat16() weights, and each rank
    published about half."""
    reports = run_ranks(tmp_path, "adamw")
    for r in reports:
        assert (r["world"], r["backend"], r["ddp"]) == (2, "gloo", "DistributedDataParallel")
        assert r["seen"] == [1, 2, 3] and r["versions"] == [1, 2, 3]
        assert r["path"] == "adamw"
    mine = [set(r["mine"]) for r in reports]
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    assert mine[0] | mine[1] == set(reports[0]["all"])
    total = reports[0]["elements"] + reports[1]["elements"]
    assert all(abs(r["elements"] - total / 2) < total / 10 for r in reports)


def test_two_ddp_ranks_on_the_weights_path_publish_from_rank_0(tmp_path):
    reports = run_ranks(tmp_path, "sgd")
    for r in reports:
        assert r["ddp"] == "DistributedDataParallel" and r["path"] == "weights"
        assert r["seen"] == [1, 2, 3]
    assert reports[0]["versions"] == [1, 2, 3] and reports[1]["versions"] == []


def test_fsdp2_through_the_trainer(tmp_path):
    """TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...}) on two
    CPU processes: every step is a version equal to both ranks' weights
    (Check, on every rank), whichever wrapping accelerate chose. Without an
    accelerator it chooses DDP (the module docstring), which is asserted,
    so a release that starts sharding on the CPU makes this test check the
    FSDP2 branch instead."""
    reports = run_ranks(tmp_path, "fsdp2", steps=2)
    for r in reports:
        assert r["seen"] == [1, 2]
    if reports[0]["param"] != "DTensor":
        for r in reports:
            assert r["ddp"] == "DistributedDataParallel", r
            assert "CPU" in str(r["distributed_type"]), r
        return
    assert reports[0]["versions"] == [1, 2]
