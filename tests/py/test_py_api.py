"""The Python package's surface (sync/python/dte): an exception class per
kind of failure, typed layouts and results, a world of one rank publishing
with no process group, and publish_torch_adamw as a Publisher method.

Needs libdte.so ($DTE_BUILD_DIR/sync/libdte.so or $DTE_LIBRARY), torch and
safetensors.
"""

import dataclasses
import os
import sys

import numpy as np
import pytest

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402
from dte import _errors  # noqa: E402

# Each C ABI code (sync/capi/c_api.h), its class and the builtin it also is.
CODES = [(1, dte.InvalidArgument, ValueError), (2, dte.NotFound, FileNotFoundError),
         (3, dte.VersionConflict, FileExistsError), (4, dte.Corrupt, dte.DteError),
         (5, dte.IOFailure, OSError), (7, dte.Unimplemented, NotImplementedError),
         (8, dte.InternalError, dte.DteError), (9, dte.PermissionDenied, PermissionError),
         (10, dte.FailedPrecondition, dte.DteError), (11, dte.Aborted, dte.DteError),
         (12, dte.DeadlineExceeded, TimeoutError), (13, dte.Unavailable, ConnectionError)]


@pytest.mark.parametrize("code,cls,also", CODES)
def test_every_code_has_its_class(code, cls, also):
    e = _errors.error(code, "store /x: something")
    assert type(e) is cls and isinstance(e, also) and isinstance(e, dte.DteError)
    assert e.code == code and str(e) == "store /x: something"
    assert isinstance(e, RuntimeError)  # what DteError was before it had kinds


def test_a_call_refines_what_a_code_means_for_it_and_unknown_codes_stay_internal():
    refine = {10: dte.MissedPushes}
    missed = _errors.error(10, "m", refine)
    assert type(missed) is dte.MissedPushes and isinstance(missed, dte.FailedPrecondition)
    assert missed.code == 10 and not missed.transient
    assert type(_errors.error(1, "x", refine)) is dte.InvalidArgument
    with pytest.raises(TypeError):
        _errors.error(1, "x", {1: dte.MissedPushes})  # a missed push is no InvalidArgument
    odd = _errors.error(42, "from a newer library")
    assert type(odd) is dte.InternalError and odd.code == 42


def test_errors_from_the_library_and_from_python_raise_their_class(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found: store .*/none does not exist") as e:
        dte.StoreReader(str(tmp_path / "none"))
    assert type(e.value) is dte.NotFound and e.value.code == 2
    with pytest.raises(ValueError, match="secret must be"):
        dte.PushGroup("127.0.0.1:0", secret="")
    with pytest.raises(dte.InvalidArgument, match="unknown order"):
        with dte.Publisher(str(tmp_path / "s"), rank=0, world_size=1) as pub:
            pub.publish_adamw(step=1, params={}, lr=1e-3, order="fastest")
    name = "dte-test-api-%d" % os.getpid()
    with dte.SharedWeights(name, {"w": ("F32", (4,))}):
        with pytest.raises(dte.AlreadyExists) as e:
            dte.SharedWeights(name, {"w": ("F32", (4,))})
        assert e.value.code == 3 and not isinstance(e.value, dte.VersionConflict)


def test_layouts_are_frozen_dataclasses_and_a_dict_is_refused():
    fused = dte.FusedReceiverLayout(4)
    assert (fused.tp, fused.fuse_qkv, fused.fuse_gate_up) == (4, True, True)
    assert isinstance(fused, dte.ReceiverLayout)
    assert fused == dte.ReceiverLayout(4, True, True) and fused != dte.ReceiverLayout(4)
    assert len({fused, dte.ReceiverLayout(4, fuse_qkv=True, fuse_gate_up=True)}) == 1
    assert dataclasses.asdict(dte.ReceiverLayout(2)) == {"tp": 2, "fuse_qkv": False,
                                                         "fuse_gate_up": False}
    with pytest.raises(dataclasses.FrozenInstanceError):
        fused.tp = 2
    with pytest.raises(dte.InvalidArgument, match="tp must be at least 1"):
        dte.ReceiverLayout(0)
    w = np.zeros(4, np.float32)
    with pytest.raises(dte.InvalidArgument, match="layout must be a dte.ReceiverLayout"):
        dte.PushReceiver("127.0.0.1:1", {"w": ("F32", w)},
                         layout={"tp": 1, "fuse_qkv": False, "fuse_gate_up": False})


def test_push_report_reads_the_c_json():
    r = dte.PushReport.from_json('{"version": 3, "pushed": 2, "behind": 0, "missing": 1, '
                                 '"elements": 10, "bytes": 80, "seconds": 0.5, '
                                 '"pack_seconds": 0.1, "dropped": ["rank 1: gone"]}')
    assert (r.version, r.pushed, r.missing, r.dropped, r.error) == (3, 2, 1, ["rank 1: gone"], "")
    assert dte.PushReport.from_json("null") is None
    assert dte.PushReport.from_json('{"error": "no config.json"}').error == "no config.json"


def _checkpoint(tmp_path):
    """A one-tensor HF checkpoint, imported as version 0 of a new store;
    returns (store, the model's parameter, an AdamW over it)."""
    import safetensors.torch
    import torch
    torch.manual_seed(0)
    w = torch.nn.Parameter(0.02 * torch.randn(48, 40))
    init = tmp_path / "init"
    init.mkdir()
    safetensors.torch.save_file({"w": w.detach().to(torch.bfloat16)},
                                str(init / "model.safetensors"), metadata={"format": "pt"})
    (init / "config.json").write_text('{"model_type": "llama"}')
    store = str(tmp_path / "store")
    with dte.Publisher(store) as pub:
        assert pub.import_checkpoint(str(init)) == 0
    return store, w, torch.optim.AdamW([w], lr=1e-3, weight_decay=0.01, fused=True)


def _stored(store, version):
    import torch
    out = torch.empty(48, 40, dtype=torch.bfloat16)
    with dte.StoreReader(store) as r:
        return r.read_into(version, "w", out)


def test_a_world_of_one_publishes_with_no_group_or_rendezvous(tmp_path):
    import torch
    import torch.distributed as dist
    assert not dist.is_initialized()
    store, w, opt = _checkpoint(tmp_path)
    with dte.Publisher(store, rank=0, world_size=1) as pub:
        for step in (1, 2):
            w.grad = torch.randn_like(w)
            opt.step()
            st = opt.state[w]
            half = 24  # two pieces of rows, as a sharded rank may hold them
            pieces = [{"param": w.detach()[r0:r1], "exp_avg": st["exp_avg"][r0:r1],
                       "exp_avg_sq": st["exp_avg_sq"][r0:r1], "rows": (r0, r1)}
                      for r0, r1 in ((0, half), (half, 48))]
            r = pub.publish_adamw(step=step, params={"w": pieces}, lr=1e-3, weight_decay=0.01)
            assert (r.version, r.parent) == (step, step - 1) and r.changed > 0, r
            assert torch.equal(_stored(store, step), w.detach().to(torch.bfloat16))
        stats = pub.last_stats()
        assert isinstance(stats, dte.DistStats) and stats.tensors_owned == 1, stats
        assert stats.bytes_sent == 0 and stats.messages_sent == 0, stats  # no other rank


def test_more_ranks_without_a_group_are_refused_naming_the_ways_to_exchange(tmp_path):
    with pytest.raises(dte.InvalidArgument) as e:
        dte.Publisher(str(tmp_path / "s"), rank=0, world_size=2)
    for way in ("process group", "rendezvous", "job="):
        assert way in str(e.value), str(e.value)


def test_publish_torch_adamw_is_a_publisher_method(tmp_path):
    import torch
    store, w, opt = _checkpoint(tmp_path)
    with dte.Publisher(store) as pub:
        w.grad = torch.randn_like(w)
        opt.step()
        r = pub.publish_torch_adamw(opt, {"w": w})
        assert isinstance(r, dte.PublishResult) and int(r) == 1
        assert torch.equal(_stored(store, 1), w.detach().to(torch.bfloat16))
        with pytest.raises(dte.InvalidArgument, match="needs a torch.optim.AdamW"):
            pub.publish_torch_adamw(torch.optim.SGD([w], lr=0.1), {"w": w})
    assert not hasattr(dte, "publish_torch_adamw") and not hasattr(dte, "Receiver")


def test_every_exported_name_exists():
    assert sorted(n for n in dte.__all__ if not hasattr(dte, n)) == []
