"""The live-apply client without a daemon: dtectl apply/status and the Python
module's apply, live_status and LiveReceiver on paths that are not dtefs mounts,
the ctypes mirror of sync/live/live_abi.h, and SharedWeights.

Applies against a real mount are tested with dtefs (tests/py/test_fs_live*).
Needs dtectl and libdte.so ($DTE_BUILD_DIR or $DTE_LIBRARY).
"""

import ctypes
import os
import stat
import subprocess
import sys
import uuid

import numpy as np
import pytest

import dtectl_util
from dtectl_util import ERROR, OK, USAGE

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402
from dte import _lib  # noqa: E402


def dtectl(*args, env=None):
    """dtectl without a store: apply and status must not need one."""
    return dtectl_util.run(*args, env=env, timeout=60)


def one_line(stderr):
    lines = stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0], f"expected one line on stderr, got {stderr!r}"
    return lines[0]


@pytest.fixture
def fake_mount(tmp_path):
    """A directory with a regular file at .dte/control, which takes no ioctls."""
    d = tmp_path / "fake"
    (d / ".dte").mkdir(parents=True)
    (d / ".dte" / "control").write_bytes(b"")
    return d


# --- dtectl ---------------------------------------------------------------------

@pytest.mark.parametrize("args", [("apply",), ("apply", "--json"), ("apply", "--version", "3"),
                                  ("status",), ("status", "--json")])
def test_dtectl_on_plain_directory_is_not_a_dtefs_mount(tmp_path, args):
    r = dtectl(*args[:1], tmp_path, *args[1:], env={"DTE_STORE": str(tmp_path / "store")})
    assert r.returncode == ERROR, r
    assert r.stdout == ""
    assert one_line(r.stderr) == (f"dtectl {args[0]}: error: {tmp_path} is not a dtefs mount "
                                  "with live apply (no .dte/control)")


@pytest.mark.parametrize("cmd", ["apply", "status"])
def test_dtectl_on_file_without_ioctls_is_not_a_dtefs_mount(fake_mount, cmd):
    r = dtectl(cmd, fake_mount)
    assert r.returncode == ERROR, r
    assert one_line(r.stderr) == f"dtectl {cmd}: error: {fake_mount} is not a dtefs mount (ENOTTY)"


def test_dtectl_on_missing_path_names_it(tmp_path):
    r = dtectl("apply", tmp_path / "nothing")
    assert r.returncode == ERROR, r
    assert one_line(r.stderr) == (f"dtectl apply: error: {tmp_path / 'nothing'}: "
                                  f"{os.strerror(2)}")


def test_dtectl_apply_usage_errors(tmp_path):
    r = dtectl("apply")
    assert r.returncode == USAGE and "MOUNT" in r.stderr, r
    assert dtectl("status").returncode == USAGE
    r = dtectl("apply", tmp_path, "--version", "seven")
    assert r.returncode == USAGE, r
    assert one_line(r.stderr) == ('dtectl apply: error: bad version "seven" '
                                  '(a number, vNNNNNNNN or latest)')
    # The store commands still insist on a store.
    r = dtectl("log")
    assert r.returncode == USAGE and "no store given" in r.stderr, r


def test_dtectl_apply_help_needs_no_store():
    r = dtectl("apply", "--help")
    assert r.returncode == OK and "--version" in r.stdout and "--store" not in r.stdout, r


# --- the Python module ------------------------------------------------------------

def test_python_apply_on_plain_directory_raises_naming_it(tmp_path):
    for call in (lambda: dte.apply(tmp_path), lambda: dte.apply(str(tmp_path), version=3),
                 lambda: dte.live_status(tmp_path), lambda: dte.LiveReceiver(tmp_path)):
        with pytest.raises(dte.NotFound) as e:
            call()
        assert e.value.code == 2
        assert str(e.value) == (f"not found: {tmp_path} is not a dtefs mount with live apply "
                                "(no .dte/control)")


def test_python_on_file_without_ioctls(fake_mount):
    want = f"invalid argument: {fake_mount} is not a dtefs mount (ENOTTY)"
    with pytest.raises(dte.InvalidArgument, match=r"\(ENOTTY\)$") as e:
        dte.apply(fake_mount)
    assert (e.value.code, str(e.value)) == (1, want)
    with dte.LiveReceiver(fake_mount, tp=2, rank=1) as rx:  # the file opens
        with pytest.raises(dte.DteError) as e:
            rx.register("model.norm.weight", "/some-shm", 64, "BF16", (16,))
        assert str(e.value) == want
        with pytest.raises(dte.DteError) as e:
            rx.unregister()
        assert str(e.value) == want
    with pytest.raises(dte.DteError, match="is closed"):
        rx.unregister(3)


def test_python_checks_arguments_before_the_daemon(fake_mount):
    with pytest.raises(dte.DteError, match="rank 2 of tp 2"):
        dte.LiveReceiver(fake_mount, tp=2, rank=2)
    with dte.LiveReceiver(fake_mount) as rx:
        with pytest.raises(dte.DteError, match="longer than 255 bytes"):
            rx.register("x" * 256, "shm", 0, "BF16", (1,))
        with pytest.raises(dte.DteError, match="at most 8"):
            rx.register("w", "shm", 0, "BF16", (1,) * 9)
        # Which shared memory names are fine is the daemon's to say.
        with pytest.raises(dte.DteError, match=r"\(ENOTTY\)$"):
            rx.register("w", "../a", 0, "BF16", (1,))
    with pytest.raises(dte.DteError, match="bad version"):
        dte.apply(fake_mount, version=-1)


def test_ctypes_mirror_matches_live_abi():
    sizes = {_lib.LiveCounts: 104, _lib.LiveApply: 1152, _lib.LiveStatus: 1200,
             _lib.LiveRegister: 1816}
    for struct, size in sizes.items():
        assert ctypes.sizeof(struct) == size, struct.__name__
    assert _lib.LiveApply.counts.offset == 24
    assert _lib.LiveStatus.last.offset == 72
    offsets = {"name": 24, "dtype": 280, "ndim": 288, "shape": 296, "shm_name": 360,
               "offset": 616, "cuda_ipc_handle": 624, "cuda_device": 688, "buffer_id": 696,
               "error": 704, "message": 712, "version": 1736, "server": 1744,
               "server_size": 1808}
    for field, offset in offsets.items():
        assert getattr(_lib.LiveRegister, field).offset == offset, field
    assert _lib.LIVE_LATEST == 0xFFFFFFFFFFFFFFFF


# --- SharedWeights ---------------------------------------------------------------

@pytest.fixture
def shm_name():
    name = f"dte-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


TENSORS = {"model.embed_tokens.weight": ("BF16", (10, 7)),
           "model.norm.weight": ("F32", (7,)),
           "lm_head.bias": ("F16", (3,)),
           "step": ("I64", ()),
           "scale": ("F64", (2, 1, 3))}
NUMPY = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16, "I64": np.int64,
         "F64": np.float64}


def test_shared_weights_layout_and_views(shm_name):
    w = dte.SharedWeights(shm_name, TENSORS)
    path = os.path.join("/dev/shm", shm_name)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == w.size
    end = 0
    for name, (dtype, shape) in TENSORS.items():
        off = w.offset(name)
        assert off % 64 == 0 and off >= end, name
        a = w.array(name)
        assert a.shape == shape and a.dtype == NUMPY[dtype], name
        assert not a.any()  # zero-filled
        end = off + a.nbytes
    assert w.size % 64 == 0 and w.size >= end
    assert [n for n in w.tensors] == list(TENSORS)
    # The first tensor's 140 bytes end at 140: the next starts at 192.
    assert w.offset("model.norm.weight") == 192

    emb = w.array("model.embed_tokens.weight")
    emb[...] = np.arange(70, dtype=np.uint16).reshape(10, 7) + 0x3F00
    w.array("scale")[1, 0, 2] = 2.5
    w.array("step")[()] = -9
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) == w.size
    off = w.offset("model.embed_tokens.weight")
    assert raw[off:off + 140] == emb.astype("<u2").tobytes()
    off = w.offset("scale")
    assert np.frombuffer(raw, "<f8", 6, off)[5] == 2.5
    assert np.frombuffer(raw, "<i8", 1, w.offset("step"))[0] == -9
    # Bytes written to the object show in the views (the daemon's side).
    with open(path, "r+b") as f:
        f.seek(w.offset("model.norm.weight"))
        f.write(np.array([1.5] * 7, "<f4").tobytes())
    assert (w.array("model.norm.weight") == 1.5).all()
    with pytest.raises(dte.DteError, match="not in"):
        w.array("missing")
    w.close()
    with pytest.raises(dte.DteError, match="is closed"):
        w.array("step")
    assert emb[0, 1] == 0x3F01  # views outlive close()
    w.unlink()
    assert not os.path.exists(path)


def test_shared_weights_refuses_an_existing_name(shm_name):
    path = os.path.join("/dev/shm", shm_name)
    with dte.SharedWeights("/" + shm_name, {"w": ("F32", (4,))}) as w:
        assert w.name == shm_name and w.path == path
        with pytest.raises(dte.AlreadyExists) as e:
            dte.SharedWeights(shm_name, {"w": ("F32", (4,))})
        assert e.value.code == 3 and path in str(e.value)
        assert os.path.exists(path)  # the refused one left it alone
        w.array("w")[:] = 7
    assert not os.path.exists(path)  # the context manager unlinks


def test_shared_weights_rejects_bad_specs(shm_name):
    with pytest.raises(dte.DteError, match="unknown dtype 'BF8'"):
        dte.SharedWeights(shm_name, {"w": ("BF8", (4,))})
    with pytest.raises(dte.DteError, match="bad shape"):
        dte.SharedWeights(shm_name, {"w": ("F32", (4, -1))})
    with pytest.raises(dte.DteError, match="bad shared memory name"):
        dte.SharedWeights("a/b", {"w": ("F32", (4,))})
    assert not os.path.exists(os.path.join("/dev/shm", shm_name))


def test_register_shared_registers_every_tensor(shm_name, fake_mount, monkeypatch):
    """register_shared hands the daemon each tensor's name, offset, dtype and
    shape; the C call is replaced to see what it is given."""
    seen = []

    def fake_register(handle, ref):
        r = ref._obj
        seen.append((r.name.decode(), r.shm_name.decode(), r.offset, r.dtype.decode(),
                     tuple(r.shape[:r.ndim]), r.tp, r.rank, r.fuse_qkv, r.fuse_gate_up, r.kind))
        r.buffer_id = len(seen)
        return 0

    with dte.SharedWeights(shm_name, TENSORS) as w, \
            dte.LiveReceiver(fake_mount, tp=4, rank=3, fuse_qkv=False) as rx:
        monkeypatch.setattr(dte._live.lib, "dte_live_register_buffer", fake_register)
        assert rx.register_shared(w) == list(range(1, len(TENSORS) + 1))
        assert seen == [(n, shm_name, w.offset(n), d, s, 4, 3, 0, 1, _lib.LIVE_HOST_SHM)
                        for n, (d, s) in TENSORS.items()]
