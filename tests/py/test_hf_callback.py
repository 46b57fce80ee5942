"""dte.hf.PublishCallback in a real transformers.Trainer training a tiny
Llama on CPU: version 0 is the starting weights, and after every optimizer
step the store's latest version is the step's number and equals the
model's bfloat16() weights bit for bit (read back with dte.StoreReader);
with gradient accumulation 2, with a publish every 2 steps, and across a
resume from a Trainer checkpoint (which continues the numbering, and is
refused, naming both numbers, when the store is ahead); and in two DDP
processes over gloo, each rank publishing about half of the tensors over the
Trainer's own process group. An SGD optimizer and BF16 weights are refused,
naming what was found."""

import json
import os
import socket
import subprocess
import sys

import pytest

import follower_util  # noqa: F401 (puts the package on the path)

import dte  # noqa: E402
import dte.hf  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402


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


def trainer(tmp_path, callbacks, model=None, optim="adamw_torch", steps=3, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=1, optim=optim, report_to=[],
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


@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_step_is_a_version_equal_to_the_bf16_weights(tmp_path, accumulate):
    store = str(tmp_path / "store")
    t, pub, check, start = train(tmp_path, store, steps=4, gradient_accumulation_steps=accumulate)
    assert check.seen == [1, 2, 3, 4]
    assert [r.version for r in pub.results] == [1, 2, 3, 4]
    # The linear warmup's first step runs at lr 0: nothing moves.
    assert [r.changed > 0 for r in pub.results] == [False, True, True, True]
    # Version 0: the starting weights.
    start_model = follower_util.model(torch.float32)
    start_model.load_state_dict(start)
    assert differing(store, 0, start_model) == []


def test_weights_on_a_gpu_go_through_the_distributed_publisher(tmp_path, monkeypatch):
    """A single process whose weights are on a GPU publishes through a
    distributed publisher of world 1 (it reads CUDA memory); run here with
    CPU weights taken for GPU ones."""
    monkeypatch.setattr(dte.hf, "_on_gpu", lambda named: True)
    kinds = []
    real = dte.hf.PublishCallback.on_optimizer_step

    def spy(self, *args, **kw):
        kinds.append((self._pub.world_size, self._pub._dist))
        return real(self, *args, **kw)

    monkeypatch.setattr(dte.hf.PublishCallback, "on_optimizer_step", spy)
    store = str(tmp_path / "store")
    _, pub, check, _ = train(tmp_path, store, steps=3)
    assert check.seen == [1, 2, 3] and [r.version for r in pub.results] == [1, 2, 3]
    assert kinds == [(1, True)] * 3


@pytest.mark.parametrize("every", [2, "save_steps"])
def test_every_two_steps_commits_whole_versions(tmp_path, every):
    store = str(tmp_path / "store")
    _, pub, check, _ = train(tmp_path, store, every=every, steps=4, save_steps=2)
    assert check.seen == [0, 1, 1, 2]
    assert pub.results == []


def test_a_resumed_trainer_continues_the_numbering(tmp_path):
    store = str(tmp_path / "store")
    train(tmp_path, store, steps=2, save_strategy="steps", save_steps=2)
    ckpt = str(tmp_path / "out" / "checkpoint-2")
    _, pub, check, _ = train(tmp_path, store, steps=4, resume=ckpt)
    assert check.seen == [3, 4]
    assert [r.version for r in pub.results] == [3, 4]
    # The store is at 4 now: resuming from step 2 again, or starting over,
    # is refused, naming both numbers.
    for resume, step in ((ckpt, 2), (None, 0)):
        with pytest.raises(dte.VersionConflict,
                           match=r"global step %d.*latest version is 4" % step):
            train(tmp_path, store, steps=4, resume=resume)


def test_sgd_and_bf16_weights_are_refused(tmp_path):
    store = str(tmp_path / "store")
    with pytest.raises(dte.InvalidArgument, match=r"found torch\.optim\.sgd\.SGD"):
        train(tmp_path, store, optim="sgd")
    bf16 = follower_util.model(torch.bfloat16).train()
    with pytest.raises(dte.InvalidArgument, match=r"FP32 master.*model\.embed_tokens\.weight is "
                       r"torch\.bfloat16"):
        train(tmp_path, store, model=bf16)
    assert not os.path.exists(store)  # refused before anything was written
    with pytest.raises(dte.InvalidArgument, match="every"):
        dte.hf.PublishCallback(store=store, every=0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ddp_ranks_share_the_publish_over_the_trainers_group(tmp_path):
    """Two processes (the env torch.distributed.run sets; DDP on CPU over
    gloo), gradient accumulation 2: every step is a version equal to both
    ranks' bfloat16() weights, and each rank published about half."""
    store, port = str(tmp_path / "store"), free_port()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_ddp_worker.py")
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, worker, store, str(tmp_path), "3"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    reports = [json.load(open(tmp_path / ("rank-%d.json" % r))) for r in (0, 1)]
    for r in reports:
        assert (r["world"], r["backend"], r["ddp"]) == (2, "gloo", "DistributedDataParallel")
        assert r["seen"] == [1, 2, 3] and r["versions"] == [1, 2, 3]
    mine = [set(r["mine"]) for r in reports]
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    assert mine[0] | mine[1] == set(reports[0]["all"])
    total = reports[0]["elements"] + reports[1]["elements"]
    assert all(abs(r["elements"] - total / 2) < total / 10 for r in reports)
