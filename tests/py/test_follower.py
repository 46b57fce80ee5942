"""dte.Follower over a real store (versions of a tiny transformers Llama
committed by dtectl) and a real dtefs mount of it: a rollout loop in another
process sees every version in order while they are committed; load_into
makes a model equal to the version bit for bit (live apply, reads through
the mount, reads through StoreReader from a directory and from s3://); a
model changed after loading is detected; max_lag keeps or reloads or
raises; wait_for times out with dte.DeadlineExceeded."""

import os
import subprocess
import sys
import time

import pytest

import follower_util
from follower_util import Versions, differing
from fs_util import mounts

import dte  # noqa: E402 (follower_util put the package on the path)
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def versions(tmp_path):
    v = Versions(tmp_path, str(tmp_path / "store"))
    v.commit()
    return v


@pytest.fixture
def mount(mount, versions):
    """conftest's mount, started on `versions`' store."""
    return mount(versions.dtectl.store)


def source_of(kind, versions, mount):
    return mount.path if kind.startswith("mount") else versions.dtectl.store


@pytest.mark.parametrize("kind", ["store", "mount-read", "mount-live"])
def test_load_into_makes_the_model_equal_to_each_version(kind, versions, mount):
    f = dte.Follower(source_of(kind, versions, mount), live=kind == "mount-live"
                     if kind.startswith("mount") else None)
    model = follower_util.model()
    with f:
        assert f.load_into(model) == 0
        assert f.live == (kind == "mount-live"), f.live_reason
        assert differing(model, versions.states[0]) == []
        for v in (1, 2):
            versions.commit()
            assert f.wait_for(v, timeout=10) == v
            assert f.load_into(model) == v and f.held == v
            assert differing(model, versions.states[v]) == []
            assert f.check(model).against == "manifest"
        if kind == "mount-live":
            assert dte.live_status(mount.path).live_version == 2


def test_a_float32_model_holds_the_bf16_version_exactly(versions):
    model = follower_util.model(torch.float32)
    with dte.Follower(versions.dtectl.store) as f:
        assert f.load_into(model) == 0
        assert differing(model, versions.states[0]) == []
        assert model.lm_head.weight.dtype == torch.float32


def test_a_model_that_does_not_hold_its_version_is_detected(versions, mount):
    model = follower_util.model()
    with dte.Follower(mount.path) as f:
        f.load_into(model)
        f.check(model)
        with torch.no_grad():
            w = model.model.layers[1].mlp.down_proj.weight
            w.view(torch.int16)[3, 5] ^= 1  # one bit of one element
        with pytest.raises(dte.Corrupt, match=r"layers\.1\.mlp\.down_proj\.weight"):
            f.check(model)
    other = follower_util.model()
    with dte.Follower(versions.dtectl.store) as f:
        with pytest.raises(dte.Corrupt, match="v00000000"):
            f.check(other, 0)  # random weights claimed as version 0


def test_max_lag_keeps_then_reloads_or_raises(versions):
    model = follower_util.model()
    with dte.Follower(versions.dtectl.store, max_lag=1) as f:
        assert f.load_into(model) == 0
        versions.commit()
        assert f.load_into(model) == 0 and f.lag() == 1  # within max_lag: kept
        assert differing(model, versions.states[0]) == []
        versions.commit()
        assert f.load_into(model) == 2                    # 2 behind: reloaded
        assert differing(model, versions.states[2]) == []
    with dte.Follower(versions.dtectl.store, max_lag=0, on_lag="raise") as f:
        assert f.load_into(model, 1) == 1
        with pytest.raises(dte.Stale, match="v00000001, 1 versions behind v00000002"):
            f.load_into(model)
        assert f.load_into(model, 2) == 2  # an explicit version always loads


def test_a_store_not_there_yet_is_waited_for_only_when_asked(tmp_path, versions):
    missing = str(tmp_path / "not-yet")
    with pytest.raises(dte.NotFound):
        dte.Follower(missing)  # wait=0: at once
    t = time.monotonic()
    with pytest.raises(dte.NotFound):
        dte.Follower(missing, wait=0.3)
    assert time.monotonic() - t >= 0.3

    import shutil
    import threading
    copier = threading.Timer(0.3, shutil.copytree, (versions.dtectl.store, missing))
    copier.start()
    try:
        with dte.Follower(missing, wait=30) as f:  # appears while it waits
            assert f.wait_for(0, timeout=10) == 0
    finally:
        copier.join()


def test_wait_for_raises_timeout(versions, mount):
    for source in (versions.dtectl.store, mount.path):
        with dte.Follower(source) as f:
            assert f.latest() == 0
            t = time.monotonic()
            with pytest.raises(dte.DeadlineExceeded, match="v00000005") as e:
                f.wait_for(5, timeout=0.2)
            assert isinstance(e.value, TimeoutError)
            assert 0.2 <= time.monotonic() - t < 5


def test_a_model_with_other_tensors_is_refused(versions):
    with dte.Follower(versions.dtectl.store) as f:
        cfg = follower_util.config()
        cfg.num_hidden_layers = 1
        import transformers
        small = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        with pytest.raises(dte.InvalidArgument, match="model.layers.1"):
            f.load_into(small)
        half = follower_util.model(torch.float16)
        with pytest.raises(ValueError, match="stored as BF16; the model holds it as float16"):
            f.load_into(half)


@pytest.mark.parametrize("kind", ["store", "mount"])
def test_a_follower_in_another_process_sees_every_version_in_order(kind, versions, mount):
    last = 4
    env = dict(os.environ, PYTHONPATH=HERE)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "follower_worker.py"),
                             source_of(kind, versions, mount), str(last)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        for _ in range(last):
            versions.commit()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    lines = [line.split() for line in out.splitlines()]
    assert [int(x[0]) for x in lines] == list(range(last + 1)), out
    assert all(x[0] == x[1] for x in lines), out          # each stamp is the version loaded
    assert {x[2] for x in lines} == {"True" if kind == "mount" else "False"}, out
    # The versions differ, so the worker really generated with each.
    assert len({x[3] for x in lines}) > 1, out


def test_load_into_from_an_s3_store(tmp_path, moto, bucket, monkeypatch):
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    versions = Versions(tmp_path, f"s3://{bucket}/policy", env=moto.env())
    versions.commit()
    versions.commit()
    model = follower_util.model()
    with dte.Follower(f"s3://{bucket}/policy", cache_dir=str(tmp_path / "rc")) as f:
        assert f.latest() == 1
        assert f.load_into(model) == 1
        assert differing(model, versions.states[1]) == []
        assert f.check(model).against == "manifest"
        it = f.versions(after=-1, timeout=0.5)
        assert [next(it), next(it)] == [0, 1]  # the checked listing, through libdte


def test_without_the_manifest_check_compares_with_a_read_through_the_mount(versions, mount,
                                                                          monkeypatch):
    """A mount of a store this process cannot read: the expected hashes come
    from reading the version through the mount."""
    from dte._sources import MountSource
    monkeypatch.setattr(MountSource, "_hashes_from_store", lambda self, version: {})
    model = follower_util.model()
    with dte.Follower(mount.path, live=False) as f:
        assert f.load_into(model) == 0
        assert f.check(model).against == "read"
        with torch.no_grad():
            model.model.norm.weight.view(torch.int16)[7] ^= 1
        with pytest.raises(dte.Corrupt, match=r"model\.norm\.weight"):
            f.check(model)


def test_versions_every_false_skips_to_the_newest(versions):
    with dte.Follower(versions.dtectl.store) as f:
        every = f.versions(after=-1, timeout=5)
        assert next(every) == 0
        for _ in range(3):
            versions.commit()
        assert [next(every) for _ in range(3)] == [1, 2, 3]
        versions.commit()
        newest = f.versions(after=0, every=False, timeout=0.3)
        assert next(newest) == 4  # 1..3 skipped
        with pytest.raises(dte.DeadlineExceeded):
            next(newest)


def test_a_live_model_written_by_someone_else_is_detected_and_reloaded(versions, mount):
    """A live apply adds changes to what the buffer holds, so a stray write
    stays wrong through later versions: the check after the apply finds
    it, and the next load_into reads the whole version again."""
    model = follower_util.model()
    with dte.Follower(mount.path, live=True) as f:
        assert f.load_into(model) == 0 and f.live
        versions.commit(fraction=0.02)
        f.wait_for(1, timeout=10)
        same = versions.states[1]["lm_head.weight"] == versions.states[0]["lm_head.weight"]
        row, col = (int(i) for i in same.nonzero()[0])  # an element v1 leaves as it was
        with torch.no_grad():
            model.lm_head.weight.view(torch.int16)[row, col] ^= 0x40
        with pytest.raises(dte.Corrupt, match=r"lm_head\.weight"):
            f.load_into(model)
        assert f.held is None and not f.live
        assert f.load_into(model) == 1 and f.live
        assert differing(model, versions.states[1]) == []


def test_a_load_that_fails_half_way_forgets_the_version(versions, monkeypatch):
    """Some tensors at the new version and some at the old: the model holds
    no version, and the next load_into reads a whole one."""
    from dte._sources import StoreSource
    model = follower_util.model()
    with dte.Follower(versions.dtectl.store) as f:
        assert f.load_into(model) == 0
        versions.commit()
        real, calls = StoreSource.read_into, []

        def failing(self, version, info, out):
            calls.append(info.name)
            if len(calls) == 3:
                raise dte.IOFailure("injected: %s" % info.name)
            real(self, version, info, out)
        monkeypatch.setattr(StoreSource, "read_into", failing)
        with pytest.raises(dte.IOFailure, match="injected"):
            f.load_into(model)
        assert f.held is None
        monkeypatch.setattr(StoreSource, "read_into", real)
        assert f.load_into(model) == 1
        assert differing(model, versions.states[1]) == []


def test_tied_embeddings_stay_tied_through_live_applies(tmp_path):
    """save_pretrained stores a tied lm_head once; the model's lm_head.weight
    shares the embedding's memory, so it is loaded (and applied) with it."""
    versions = Versions(tmp_path, str(tmp_path / "store"), tied=True)
    versions.commit()
    model = follower_util.model(tied=True)
    with mounts(str(tmp_path)) as start:
        m = start(versions.dtectl.store)
        with dte.Follower(m.path) as f:
            assert f.load_into(model) == 0 and f.live, f.live_reason
            versions.commit(fraction=0.05)
            f.wait_for(1, timeout=10)
            assert f.load_into(model) == 1
            assert differing(model, versions.states[1]) == []
            assert model.lm_head.weight is model.model.embed_tokens.weight
