"""Reading committed versions of a store, and what Python needs to know of
the stored format, all through libdte (sync/capi/c_api.h): the versions
(checked listings, a latest that never goes back), a version's tensor table
from its manifest, a safetensors file's from its header, dtype widths, and
verified reads of tensors. Python parses no manifest and lists no store
itself: a local directory and s3:// are read by the same C++ code as
dtectl and dtefs read them."""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from dte import _lib
from dte._handle import _check, _Handle, _torch
from dte._lib import lib

_Out = TypeVar("_Out")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a version, as its manifest or safetensors header says."""
    name: str
    dtype: str               # a safetensors dtype name ("BF16", "F32", ...)
    shape: Tuple[int, ...]
    nbytes: int
    file: str                # the safetensors file holding it
    offset: int              # of its first byte in that file
    hash: Optional[str]      # XXH3-128, 32 hex digits; None: not known (a file's header)


def _tensor_table(open_table: Callable[[Any], int]) -> Dict[str, TensorInfo]:
    """{name: TensorInfo} of the dte_tensor_table that open_table(&handle)
    opens, in its order; the table is closed before this returns."""
    handle = ctypes.c_void_p()
    _check(open_table(ctypes.byref(handle)))
    try:
        entries = ctypes.POINTER(_lib.TensorTableEntry)()
        count = ctypes.c_size_t()
        _check(lib.dte_tensor_table_entries(handle, ctypes.byref(entries), ctypes.byref(count)))
        out: Dict[str, TensorInfo] = {}
        for e in entries[:count.value]:
            name = (e.name or b"").decode("utf-8")
            out[name] = TensorInfo(name, (e.dtype or b"").decode(), tuple(e.shape[:e.ndim]),
                                   int(e.bytes), os.fsdecode(e.file or b""), int(e.offset),
                                   (e.hash or b"").decode() or None)
    finally:
        rc = lib.dte_tensor_table_close(handle)
    _check(rc)
    return out


def file_tensors(path: str | os.PathLike[str]) -> Dict[str, TensorInfo]:
    """The tensors of the safetensors file at `path`, from its header as
    libdte's parser validates it (offsets in that file; no hashes)."""
    return _tensor_table(lambda out: lib.dte_safetensors_tensors(os.fsencode(path), out))


def dtype_width(dtype: str) -> Optional[int]:
    """Bytes per element of safetensors dtype `dtype`; None for one dte
    does not know."""
    width = ctypes.c_int32()
    if not isinstance(dtype, str) or lib.dte_dtype_width(dtype.encode(),
                                                         ctypes.byref(width)) != 0:
        return None
    return width.value


class StoreReader(_Handle):
    """Reads committed versions of a store (a directory or s3://): which
    versions there are, their tensor tables, and their tensors, verified
    against their hashes. Not thread-safe."""

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

    def versions(self, after: Optional[int] = None) -> List[int]:
        """The committed versions, increasing; only those newer than `after`
        (None or negative: all). From a checked listing whose newest version's
        manifest was read: a listing that lacks a version whose manifest
        exists, or names one that does not, is not believed."""
        listed = ctypes.POINTER(ctypes.c_uint64)()
        count = ctypes.c_size_t()
        start = -1 if after is None else int(after)
        _check(lib.dte_store_list_versions(self._h, int(start >= 0), max(start, 0),
                                           ctypes.byref(listed), ctypes.byref(count)))
        return [int(v) for v in listed[:count.value]]

    def tensors(self, version: int) -> Dict[str, TensorInfo]:
        """{name: TensorInfo} of committed `version`, from its manifest, with
        every tensor's hash. dte.NotFound when it is not committed."""
        h = self._h
        return _tensor_table(lambda out: lib.dte_store_version_tensors(h, int(version), out))

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
