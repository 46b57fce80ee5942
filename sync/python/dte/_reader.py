"""Reading tensors of committed versions back from a store."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, TypeVar

from dte._handle import _check, _Handle, _torch
from dte._lib import lib

_Out = TypeVar("_Out")


class StoreReader(_Handle):
    """Reads tensors of committed versions, verified against their hashes.
    Not thread-safe."""

    _close_fn = "dte_store_close"

    def __init__(self, store: str | os.PathLike[str], cache_dir: Optional[str] = None) -> None:
        handle = ctypes.c_void_p()
        _check(lib.dte_store_open(os.fsencode(store),
                                  os.fsencode(cache_dir) if cache_dir else None,
                                  ctypes.byref(handle)))
        self._h = handle

    def latest(self) -> Optional[int]:
        """The newest committed version, None when there is none. Its manifest
        was read, not only listed, and within this reader the answer never goes
        back while that manifest exists (a listing that lacks it is made again)."""
        has, version = ctypes.c_int(), ctypes.c_uint64()
        _check(lib.dte_store_latest(self._h, ctypes.byref(has), ctypes.byref(version)))
        return version.value if has.value else None

    def read_into(self, version: int, name: str, out: _Out) -> _Out:
        """Fills the contiguous numpy array or CPU torch tensor `out` (exactly the
        tensor's size in bytes) with tensor `name` at `version`; returns it."""
        torch = _torch()
        o: Any = out
        if torch is not None and isinstance(o, torch.Tensor):
            ptr, nbytes = o.data_ptr(), o.numel() * o.element_size()
        else:
            ptr, nbytes = o.ctypes.data, o.nbytes
        _check(lib.dte_store_read_tensor(self._h, int(version), name.encode(),
                                         ctypes.c_void_p(ptr), nbytes))
        return out
