"""The canonical error vocabulary from Python (docs/errors.md): each C ABI
code is its own class and the fitting builtin, transient as libdte's
dte_code_transient says, the retired names warn, and real failures raise
the class their code names.

Needs libdte.so ($DTE_BUILD_DIR/sync/libdte.so or $DTE_LIBRARY), torch and
safetensors.
"""

import os
import sys
import warnings

import numpy as np
import pytest

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import dte  # noqa: E402
from dte import _errors  # noqa: E402
from dte._lib import lib  # noqa: E402

# docs/errors.md: the C value, the class, the builtin it also is, transient.
TABLE = [(1, dte.InvalidArgument, ValueError, False),
         (2, dte.NotFound, FileNotFoundError, False),
         (3, dte.VersionConflict, FileExistsError, False),
         (4, dte.Corrupt, RuntimeError, False),
         (5, dte.IOFailure, OSError, False),
         (7, dte.Unimplemented, NotImplementedError, False),
         (8, dte.InternalError, RuntimeError, False),
         (9, dte.PermissionDenied, PermissionError, False),
         (10, dte.FailedPrecondition, RuntimeError, False),
         (11, dte.Aborted, RuntimeError, True),
         (12, dte.DeadlineExceeded, TimeoutError, True),
         (13, dte.Unavailable, ConnectionError, True)]


@pytest.mark.parametrize("code,cls,builtin,transient", TABLE)
def test_each_code_raises_its_class_which_is_also_its_builtin(code, cls, builtin, transient):
    e = _errors.error(code, "store /x: v00000003 not there")
    assert type(e) is cls and isinstance(e, builtin) and isinstance(e, dte.DteError)
    assert e.code == code and str(e) == "store /x: v00000003 not there"
    assert e.transient is transient and _errors.is_transient(code) is transient
    assert cls.__name__ in dte.__all__ or cls is dte.VersionConflict


def test_python_and_the_library_agree_on_which_codes_are_transient():
    assert lib.dte_c_api_version() == 14
    for code in range(-1, 20):
        assert bool(lib.dte_code_transient(code)) == _errors.is_transient(code), code
    assert 6 not in _errors.CODE_NAMES  # DTE_BUSY, retired: its number stays unused
    assert type(_errors.error(6, "from an old library")) is dte.InternalError


@pytest.mark.parametrize("old,new", [("Timeout", dte.DeadlineExceeded), ("Busy", dte.Unavailable)])
def test_retired_names_are_aliases_that_warn(old, new):
    with pytest.warns(DeprecationWarning, match="dte.%s is deprecated: use dte.%s"
                      % (old, new.__name__)):
        assert getattr(dte, old) is new
    with pytest.warns(DeprecationWarning):
        assert getattr(_errors, old) is new
    assert old not in dte.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            dte.NoSuchName  # noqa: B018


def test_a_missing_version_of_a_real_store_is_not_found(tmp_path):
    import safetensors.torch
    import torch
    init = tmp_path / "init"
    init.mkdir()
    safetensors.torch.save_file({"w": torch.zeros(8, 4, dtype=torch.bfloat16)},
                                str(init / "model.safetensors"), metadata={"format": "pt"})
    (init / "config.json").write_text('{"model_type": "llama"}')
    store = str(tmp_path / "store")
    with dte.Publisher(store) as pub:
        assert pub.import_checkpoint(str(init)) == 0
    with dte.StoreReader(store) as r:
        with pytest.raises(FileNotFoundError, match="v00000007") as e:
            r.tensors(7)
    assert type(e.value) is dte.NotFound and e.value.code == 2 and not e.value.transient


def test_a_push_receiver_that_waits_in_vain_exceeds_its_deadline():
    w = np.zeros(4, np.float32)
    with dte.PushReceiver("127.0.0.1:1", {"w": ("F32", w)}, version=None) as rx:
        with pytest.raises(TimeoutError, match="timed out after 200 ms") as e:
            rx.wait_for(1, timeout=0.2)
    assert type(e.value) is dte.DeadlineExceeded and e.value.code == 12 and e.value.transient
    assert "not connected" in str(e.value)
