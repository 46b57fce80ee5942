"""Publisher.publish_torch_adamw chooses how a torch.optim.AdamW step is
published: the engine order that rounds as the optimizer's kernel does on
the parameters' device (torch's fused CPU kernel as torch_cpu; on CUDA
fused, foreach and single-tensor each its own, by torch release, a
foreach of None as torch decides), or, for a step the engine has no model
of (amsgrad, maximize, capturable without fused on CUDA, BF16 parameters,
and torch 2's non-fused CPU kernels, whose torch.sqrt is not correctly
rounded), the weights compared with the parent version (path "weights",
logged on logger "dte"). Each version, read back whole (the reader checks
every block against its hash), equals the weights' bfloat16() bit for
bit. CUDA parameters are stand-ins here (the order is chosen from their
device; no GPU runs them)."""

import logging
import re
import tempfile
import types

import pytest

import follower_util  # noqa: F401 (puts the package on the path)

import dte  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from dte import _lib  # noqa: E402
from dte import _torch_adamw  # noqa: E402


def start(store, model):
    with dte.Publisher(store) as pub, tempfile.TemporaryDirectory() as d:
        bf16 = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        model.save_pretrained(d, state_dict=bf16, safe_serialization=True)
        assert pub.import_checkpoint(d) == 0


def exact(store, version, named):
    with dte.StoreReader(store) as r:
        for name, p in named.items():
            want = p.detach().to(torch.bfloat16)
            got = r.read_into(version, name, torch.empty_like(want))
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                return False
    return True


def wide():
    """A Llama of 3.3 million elements (the tiny one has 115 thousand)."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=4096,
                                      max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config)


def steps(tmp_path, dtype=torch.float32, n=3, model=None, lr=1e-2, **adamw):
    """n AdamW steps of the tiny Llama (or `model`), each published; the
    results."""
    store = str(tmp_path / "store")
    model = (model or follower_util.model(dtype)).to(dtype).train()
    start(store, model)
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, **adamw)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    results = []
    with dte.Publisher(store) as pub:
        for step in range(1, n + 1):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            results.append(pub.publish_torch_adamw(opt, named))
            assert results[-1].version == step and exact(store, step, named)
    return results


def spread(n, g):
    """n values of magnitudes from 1e-5 to 10, either sign."""
    return torch.randn(n, generator=g) * 10.0 ** (torch.rand(n, generator=g) * 6 - 5)


@pytest.mark.parametrize("lr", [1e-6, 1e-4, 1e-2])
def test_torchs_foreach_and_single_tensor_cpu_adamw_compute_the_same_bits(lr):
    """From the same weights and gradients, torch's foreach and
    single-tensor CPU AdamW hold the same FP32 weights and state, bit for
    bit, after each of 5 steps. (Its fused CPU kernel does not: on these
    inputs 0.4% to 14% of the FP32 weights differ from the others' after a
    step, the moments not; its versions are checked below instead.)"""
    g = torch.Generator().manual_seed(7)
    start, grads = spread(1 << 18, g), [spread(1 << 18, g) for _ in range(5)]
    bits = []
    for kernel in ({"foreach": True}, {"foreach": False}):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.1, **kernel)
        seen = []
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
            st = opt.state[p]
            seen.append(torch.cat([p.detach(), st["exp_avg"], st["exp_avg_sq"]]).view(torch.int32))
        bits.append(torch.stack(seen))
    assert torch.equal(bits[0], bits[1])


@pytest.mark.parametrize("kernel,path", [({"fused": True}, "adamw"),
                                         ({"foreach": True}, "weights"),
                                         ({"foreach": False}, "weights")])
def test_each_cpu_kernel_takes_its_path(tmp_path, kernel, path):
    results = steps(tmp_path, **kernel)
    assert [r.path for r in results] == [path] * 3
    assert all(r.changed > 0 for r in results)


@pytest.mark.parametrize("kernel,path", [({"fused": True}, "adamw"),
                                         ({"foreach": False}, "weights")])
def test_a_wider_model_publishes_each_cpu_kernels_steps_exactly(tmp_path, kernel, path):
    """3.3 million elements, lr 1e-3, weight decay 0.01, 4 steps. Inverting
    the single-tensor kernel's steps as torch_cpu stored as many elements
    as changed, yet made versions that fail their block hashes on read
    (lm_head.weight of v3, and of v2 once v3 was committed), which is why
    torch 2's non-fused CPU kernels take the weights path."""
    results = steps(tmp_path, n=4, model=wide(), lr=1e-3, **kernel)
    assert [r.path for r in results] == [path] * 4
    assert all(r.changed > r.elements // 2 for r in results)


@pytest.mark.parametrize("release,kernel,order", [
    ("2.15.0+cu132", {"foreach": False}, None),
    ("2.0.0", {"foreach": True}, None),
    ("1.13.1", {"foreach": False}, "torch_cpu"),
    ("1.13.1", {"foreach": True}, "torch_cpu"),
    ("2.15.0", {"fused": True}, "torch_cpu"),
])
def test_non_fused_cpu_kernels_are_modelled_before_torch_2(monkeypatch, release, kernel,
                                                           order):
    model = follower_util.model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **kernel)
    monkeypatch.setattr(torch, "__version__", release)
    got, how = _torch_adamw.order(opt, dict(model.named_parameters()))
    assert got == order
    if order is None:
        assert how.startswith("the %s CPU kernel of torch %s (its torch.sqrt is not correctly "
                              "rounded" % ("foreach" if kernel["foreach"] else "single-tensor",
                                           release))


@pytest.mark.parametrize("setting,dtype,why", [
    ({"amsgrad": True}, torch.float32, r"amsgrad=True \(param group 0\)"),
    ({"maximize": True}, torch.float32, r"maximize=True \(param group 0\)"),
    ({}, torch.bfloat16, r"parameter model\.embed_tokens\.weight in torch\.bfloat16"),
])
def test_a_step_without_an_engine_model_publishes_the_weights(tmp_path, caplog, setting,
                                                              dtype, why):
    with caplog.at_level(logging.WARNING, logger="dte"):
        results = steps(tmp_path, dtype=dtype, **setting)
    assert [r.path for r in results] == ["weights"] * 3
    assert sum(r.changed for r in results) > 0
    said = [m for m in caplog.messages if "comparing the weights with the parent" in m]
    assert len(said) == 1  # once per reason and publisher
    assert re.search(why, said[0])


def on_cuda(model):
    """Stand-ins of the model's parameters on a CUDA device."""
    return {n: types.SimpleNamespace(device=torch.device("cuda", 0), dtype=p.dtype)
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernel,order", [
    ({"fused": True}, "torch_cuda_fused_fp32"),
    ({"fused": True, "capturable": True}, "torch_cuda_fused_fp32"),
    ({"foreach": True}, "torch_cuda_foreach"),
    ({"foreach": False}, "torch_cuda_single_tensor"),
    ({"capturable": True}, None),
])
def test_cuda_parameters_take_their_kernels_order(kernel, order):
    model = follower_util.model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **kernel)
    got, how = _torch_adamw.order(opt, on_cuda(model))
    assert got == order
    if order is None:
        assert how == "capturable=True without fused on CUDA"


@pytest.mark.parametrize("release,order", [("2.15.0+cu132", "torch_cuda_fused_fp32"),
                                           ("2.11.0", "torch_cuda_fused_fp32"),
                                           ("2.10.1", "torch_cuda_fused"),
                                           ("2.4.0a0", "torch_cuda_fused")])
def test_the_fused_cuda_order_follows_the_torch_release(monkeypatch, release, order):
    """torch 2.11 made the fused CUDA kernel all FP32 (kernels/adamw.h)."""
    model = follower_util.model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    monkeypatch.setattr(torch, "__version__", release)
    assert _torch_adamw.order(opt, on_cuda(model)) == (order, "fused, CUDA")
    _torch_adamw.require_order(order, "fused, CUDA")  # the library has both


def test_a_default_foreach_on_cuda_is_torchs_own_choice(monkeypatch):
    """foreach=None: torch picks foreach for parameters of the types and
    devices its foreach kernels support; made to support the real (CPU)
    parameters here, it picks foreach, and the order follows."""
    model = follower_util.model(torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    assert _torch_adamw.order(opt, on_cuda(model))[0] == "torch_cuda_single_tensor"
    import torch.optim.optimizer as optimizer
    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices",
                        lambda: ["cpu", "cuda"])
    assert _torch_adamw.order(opt, on_cuda(model))[0] == "torch_cuda_foreach"


def test_an_order_the_library_lacks_is_refused_naming_it(monkeypatch):
    monkeypatch.delitem(_lib.ORDERS, "torch_cuda_fused_fp32")
    with pytest.raises(dte.InvalidArgument, match=r"AdamW \(fused, CUDA\) needs the engine "
                       r"order torch_cuda_fused_fp32, which this dte's library does not have"):
        _torch_adamw.require_order("torch_cuda_fused_fp32", "fused, CUDA")
    _torch_adamw.require_order("torch_cuda_foreach", "foreach, CUDA")
