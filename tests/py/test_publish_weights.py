"""Publisher.publish_weights, the path for any optimizer and any precision,
against real torch training of a tiny transformers Llama on CPU.

After every optimizer step (SGD with momentum, torch's Adafactor, a
BF16-only model under SGD, and ml_dtypes BF16 arrays) the publisher
compares the new weights with the parent version it reads back, and the
test requires the committed version to equal param.to(torch.bfloat16) bit
for bit (read through libdte's verified reader), the delta to hold exactly
the elements whose BF16 bits changed (counted against the trainer's own
previous weights, which only the test keeps), and `dtectl verify` to pass.
Rejections (an unknown tensor, integer weights, a distributed publisher, a
step that does not follow) name what is wrong and leave the store's latest
version as it was."""

import os
import subprocess

import pytest

import follower_util  # noqa: F401 (puts the package on the path)

import dte  # noqa: E402
import torch  # noqa: E402

BUILD = follower_util.BUILD
DTECTL = os.path.join(BUILD, "tools", "dtectl")


def bf16(t):
    return t.detach().to(torch.bfloat16).contiguous()


def import_model(store, model, tmp_path):
    d = tmp_path / "ckpt0"
    model.save_pretrained(d, state_dict={k: bf16(v) for k, v in model.state_dict().items()},
                          safe_serialization=True)
    with dte.Publisher(store) as pub:
        assert pub.import_checkpoint(d) == 0


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def expect_version(store, version, model):
    with dte.StoreReader(store) as r:
        assert r.latest() == version
        for name, t in model.state_dict().items():
            want = bf16(t)
            got = r.read_into(version, name, torch.empty_like(want))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


def changed_elements(before, model):
    return sum(int((bf16(t).view(torch.int16) != before[k].view(torch.int16)).sum())
               for k, t in model.state_dict().items())


def verify(store):
    r = subprocess.run([DTECTL, "verify", "--store", store], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("optimizer", ["sgd", "adafactor", "bf16_sgd"])
def test_versions_equal_the_weights_after_every_step(tmp_path, optimizer):
    dtype = torch.bfloat16 if optimizer == "bf16_sgd" else torch.float32
    model = follower_util.model(dtype, seed=4).train()
    store = str(tmp_path / "store")
    import_model(store, model, tmp_path)
    params = list(model.parameters())
    if optimizer == "adafactor":
        opt = torch.optim.Adafactor(params, lr=1e-2)
    else:
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    with dte.Publisher(store, cache_dir=str(tmp_path / "cache")) as pub:
        for step in range(1, 11):
            before = {k: bf16(t).clone() for k, t in model.state_dict().items()}
            train_step(model, opt, step)
            r = pub.publish_weights(dict(model.named_parameters()), step=step)
            assert (r.version, r.parent, r.path) == (step, step - 1, "weights")
            assert r.changed == changed_elements(before, model) > 0
            assert r.elements == sum(p.numel() for p in params)
            assert r.parent_bytes == 2 * r.elements
            assert r.state_bytes == r.elements * (2 if dtype == torch.bfloat16 else 4)
            expect_version(store, step, model)
    verify(store)


def test_numpy_bf16_arrays_and_the_metrics(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    model = follower_util.model(torch.float32, seed=5)
    store = str(tmp_path / "store")
    import_model(store, model, tmp_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    arrays = {k: bf16(v).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
              for k, v in model.named_parameters()}
    with dte.Publisher(store) as pub:
        r = pub.publish_weights(arrays)
        assert (r.version, r.path) == (1, "weights")
        text = pub.metrics_text()
    expect_version(store, 1, model)
    assert "dte_publish_weights_versions_total 1" in text


def test_rejections_name_what_is_wrong_and_commit_nothing(tmp_path):
    model = follower_util.model(torch.float32, seed=6)
    store = str(tmp_path / "store")
    import_model(store, model, tmp_path)
    named = dict(model.named_parameters())
    with dte.Publisher(store) as pub:
        with pytest.raises(dte.InvalidArgument, match="model.missing.weight is not in v00000000"):
            pub.publish_weights({"model.missing.weight": torch.zeros(3)})
        with pytest.raises(dte.InvalidArgument, match="lm_head.weight: weights are torch.int64"):
            pub.publish_weights({"lm_head.weight": torch.zeros(256, 64, dtype=torch.int64)})
        with pytest.raises(dte.InvalidArgument, match="model.norm.weight: weights have shape"):
            pub.publish_weights({"model.norm.weight": torch.zeros(65)})
        with dte.StoreReader(store) as r:
            assert r.latest() == 0
        assert pub.publish_weights(named, step=1).version == 1
        with pytest.raises(dte.InvalidArgument, match="step 3 does not follow step 1"):
            pub.publish_weights(named, step=3)
    # A world of one is the publisher above; a rank of several does not
    # publish weights (refused before any exchange, so no peer is needed).
    with dte.Publisher(store, rank=1, world_size=2, job="weights") as rank1:
        with pytest.raises(dte.InvalidArgument,
                           match="publishing weights is for a world of one, and this publisher "
                                 "is rank 1 of 2"):
            rank1.publish_weights(named)
    with dte.StoreReader(store) as r:
        assert r.latest() == 1


def test_fp16_and_fp64_weights_are_cast_as_torch_casts(tmp_path):
    model = follower_util.model(torch.float32, seed=7)
    store = str(tmp_path / "store")
    import_model(store, model, tmp_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    weights = {k: (v.to(torch.float64) if i % 2 else v.to(torch.float16))
               for i, (k, v) in enumerate(model.named_parameters())}
    with dte.Publisher(store) as pub:
        assert pub.publish_weights(weights).version == 1
    with dte.StoreReader(store) as r:
        for k, v in weights.items():
            want = v.detach().to(torch.bfloat16)
            got = r.read_into(1, k, torch.empty_like(want))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), k
