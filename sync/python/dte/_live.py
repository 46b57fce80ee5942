"""Live apply from Python: the ioctls of a dtefs mount's .dte/control
(sync/live/live_abi.h, docs/live.md) through libdte's C ABI, and the host
shared-memory weight buffers a receiver registers.

    with dte.SharedWeights("policy-rank0", {"lm_head.weight": ("BF16", (vocab, dim))}) as w, \\
         dte.LiveReceiver("/mnt/policy") as rx:
        rx.register_shared(w)          # the daemon writes every apply into w
        ...
        dte.apply("/mnt/policy")       # usually from another process: dtectl apply
        w.array("lm_head.weight")      # the new weights, BF16 bits as uint16
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import mmap
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from dte import _lib
from dte._errors import AlreadyExists, InvalidArgument, IOFailure, NotFound
from dte._fp8 import Fp8Options
from dte._handle import _check, _Handle
from dte._lib import lib
from dte._reader import dtype_width

# safetensors dtype name -> numpy dtype of the view (BF16 and FP8 as raw bits).
_NUMPY_DTYPES = {"BOOL": "?", "U8": "u1", "I8": "i1", "F8_E4M3": "u1", "F8_E5M2": "u1",
                 "U16": "<u2", "I16": "<i2", "F16": "<f2", "BF16": "<u2", "U32": "<u4",
                 "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "F64": "<f8"}
ALIGNMENT = 64  # of every tensor in a SharedWeights object
_SHM_DIR = "/dev/shm"

_COUNT_FIELDS = ("entries", "bytes", "pages", "receivers", "buffers", "elapsed_ns", "decode_ns",
                 "scatter_ns", "pagecache_ns", "blocks", "compared_blocks")


def _version(v: int) -> Optional[int]:
    return None if v == _lib.LIVE_LATEST else v


@dataclasses.dataclass(frozen=True)
class LiveCounts:
    """What one live apply did (docs/live.md, "Status")."""
    from_version: Optional[int]  # None: nothing was live
    to_version: Optional[int]
    entries: int          # changed elements applied
    bytes: int
    pages: int            # page-cache pages of the live copy written
    receivers: int
    buffers: int          # registered buffers written
    elapsed_ns: int
    decode_ns: int
    scatter_ns: int
    pagecache_ns: int
    blocks: int
    compared_blocks: int

    @property
    def seconds(self) -> float:
        return self.elapsed_ns / 1e9

    @classmethod
    def from_c(cls, c: _lib.LiveCounts) -> LiveCounts:
        return cls(_version(c.from_version), _version(c.to_version),
                   *(getattr(c, f) for f in _COUNT_FIELDS))


@dataclasses.dataclass(frozen=True)
class LiveServer:
    """An inference server whose ranks registered on a dtefs mount
    (docs/live.md, "Servers"): an apply writes its buffers only when it is
    complete, and is refused while it is not."""
    name: str
    size: int
    ranks: Tuple[int, ...]        # registered
    complete: bool                # every rank 0 .. size-1 registered
    version: Optional[int]        # the live version, which its buffers hold


@dataclasses.dataclass(frozen=True)
class LiveStatus:
    """The live state of a dtefs mount."""
    live_version: Optional[int]    # None: none yet
    latest_version: Optional[int]
    applying: bool
    receivers: int
    buffers: int
    applies: int
    failed_applies: int
    last_apply_time: Optional[int]  # None: no apply yet
    last_error: int                 # an errno, 0: none
    last_message: str
    last: LiveCounts                # the counts of the last successful apply
    servers: List[LiveServer] = dataclasses.field(default_factory=list)
    # The id of the prepared apply the mount holds (docs/live.md, "Servers
    # on several hosts"); None: none.
    prepared: Optional[int] = None


def apply(mount: str | os.PathLike[str], version: Optional[int] = None) -> LiveCounts:
    """Makes `version` (None: the newest) live on the dtefs mount, in place in
    the live copy and in every registered buffer; returns the apply's counts."""
    v = _lib.LIVE_LATEST if version is None else int(version)
    if version is not None and not 0 <= v < _lib.LIVE_LATEST:
        raise InvalidArgument("bad version %r" % (version,))
    out = _lib.LiveCounts()
    _check(lib.dte_live_apply_version(os.fsencode(mount), v, ctypes.byref(out)))
    return LiveCounts.from_c(out)


def _live_json(mount: str | os.PathLike[str], what: str) -> Dict[str, Any]:
    """The "live" object of MOUNT/.dte/status (what the fixed-size status
    ioctl has no room for); `what` names the reader's purpose in errors."""
    try:
        with open(os.path.join(os.fsdecode(mount), ".dte", "status"), "rb") as f:
            live: Dict[str, Any] = json.loads(f.read()).get("live", {})
            return live
    except (OSError, ValueError) as e:
        raise IOFailure("cannot read %s of %s from .dte/status: %s"
                        % (what, os.fsdecode(mount), e)) from None


def _server_list(servers: Sequence[Mapping[str, Any]]) -> List[LiveServer]:
    """LiveServers of the server objects of .dte/status."""
    return [LiveServer(name=s["name"], size=int(s["size"]), ranks=tuple(s["ranks"]),
                       complete=bool(s["complete"]), version=s["version"]) for s in servers]


def _servers(mount: str | os.PathLike[str]) -> List[LiveServer]:
    """The servers of MOUNT/.dte/status ("live" -> "servers")."""
    return _server_list(_live_json(mount, "the servers").get("servers", []))


def live_status(mount: str | os.PathLike[str]) -> LiveStatus:
    """The live state of the dtefs mount, with the inference servers whose
    ranks registered there."""
    s = _lib.LiveStatus()
    _check(lib.dte_live_get_status(os.fsencode(mount), ctypes.byref(s)))
    return LiveStatus(live_version=_version(s.live_version),
                      latest_version=_version(s.latest_version), applying=bool(s.applying),
                      receivers=s.receivers, buffers=s.buffers, applies=s.applies,
                      failed_applies=s.failed_applies,
                      last_apply_time=s.last_apply_time or None, last_error=s.last_error,
                      last_message=s.last_message.decode("utf-8", "replace"),
                      last=LiveCounts.from_c(s.last), servers=_servers(mount),
                      prepared=s.prepared or None)


class SharedTensor(NamedTuple):
    """Where one tensor of a SharedWeights object is."""
    dtype: str               # a safetensors dtype name
    shape: Tuple[int, ...]
    offset: int              # bytes from the start of the object
    nbytes: int


def _shm_name(name: str | bytes) -> str:
    """The object's name under /dev/shm: POSIX shm_open style "/name" or "name"."""
    name = os.fsdecode(name)
    if name.startswith("/"):
        name = name[1:]
    if (not name or "/" in name or "\0" in name or name in (".", "..")
            or len(os.fsencode(name)) >= _lib.LIVE_NAME_BYTES):
        raise InvalidArgument("bad shared memory name %r (one path component, "
                              "shorter than %d bytes)" % (name, _lib.LIVE_NAME_BYTES))
    return name


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _layout(tensors: Mapping[str, Tuple[str, Sequence[int]]]
            ) -> Tuple[Dict[str, SharedTensor], int]:
    """{name: SharedTensor} with 64-byte aligned offsets, and the size."""
    import numpy as np
    layout: Dict[str, SharedTensor] = collections.OrderedDict()
    end = 0
    for name, spec in tensors.items():
        try:
            dtype, shape = spec
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise InvalidArgument("tensor %s: expected (dtype, shape), not %r"
                                  % (name, spec)) from None
        if dtype not in _NUMPY_DTYPES:
            raise InvalidArgument("tensor %s: unknown dtype %r (one of %s)"
                                  % (name, dtype, ", ".join(_NUMPY_DTYPES)))
        if any(d < 0 for d in shape) or len(shape) > _lib.LIVE_MAX_DIMS:
            raise InvalidArgument("tensor %s: bad shape %r" % (name, shape))
        offset = _align(end)
        nbytes = np.dtype(_NUMPY_DTYPES[dtype]).itemsize * int(np.prod(shape, dtype=np.int64))
        layout[name] = SharedTensor(dtype, shape, offset, nbytes)
        end = offset + nbytes
    return layout, max(_align(end), ALIGNMENT)


class SharedWeights:
    """A new /dev/shm object holding named tensors, each at a 64-byte aligned
    offset in the order given, mapped into this process.

    tensors: an ordered mapping name -> (dtype, shape), dtype a safetensors
    name ("BF16", "F16", "F32", ...). The object is created exclusively (an
    existing name is an error) with mode 0600 and zero-filled. Views from
    array() write through to the object; they stay valid after close() until
    they are dropped. As a context manager it closes and unlinks on exit.
    Not thread-safe."""

    def __init__(self, name: str | bytes, tensors: Mapping[str, Tuple[str, Sequence[int]]]
                 ) -> None:
        self.name = _shm_name(name)
        self.path = os.path.join(_SHM_DIR, self.name)
        self._layout, self.size = _layout(tensors)
        self._mm: Optional[mmap.mmap] = None
        self._unlinked = False
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise AlreadyExists("shared memory object %s exists (unlink it or "
                                "choose another name)" % self.path) from None
        except OSError as e:
            raise IOFailure("cannot create %s: %s" % (self.path, e.strerror)) from None
        try:
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            self.unlink()
            raise IOFailure("cannot size or map %s (%d bytes): %s"
                            % (self.path, self.size, e.strerror)) from None
        finally:
            os.close(fd)

    def _entry(self, name: str) -> SharedTensor:
        try:
            return self._layout[name]
        except KeyError:
            raise NotFound("tensor %s is not in %s" % (name, self.path)) from None

    @property
    def tensors(self) -> Dict[str, SharedTensor]:
        """{name: SharedTensor(dtype, shape, offset, nbytes)} in layout order."""
        return dict(self._layout)

    def offset(self, name: str) -> int:
        """The byte offset of tensor `name` in the object."""
        return self._entry(name).offset

    def array(self, name: str) -> Any:
        """A writable numpy view of tensor `name` (BF16 and FP8 as raw bits)."""
        import numpy as np
        dtype, shape, offset, nbytes = self._entry(name)
        if self._mm is None:
            raise InvalidArgument("%s is closed" % self.path)
        # frombuffer holds the buffer exported, so the mapping stays while a
        # view lives (np.ndarray(buffer=) would not: close() would unmap it).
        dt = np.dtype(_NUMPY_DTYPES[dtype])
        count = nbytes // dt.itemsize
        return np.frombuffer(self._mm, dtype=dt, count=count, offset=offset).reshape(shape)

    def close(self) -> None:
        """Unmaps the object (once no view of it is left); does not unlink it."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views exist: the mapping goes with the last of them

    def unlink(self) -> None:
        """Removes the name from /dev/shm; mappings (the daemon's too) stay valid."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()


_TORCH_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32",
                 "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2",
                 "torch.int8": "I8", "torch.uint8": "U8", "torch.int16": "I16",
                 "torch.int32": "I32", "torch.int64": "I64", "torch.float64": "F64"}


def _cuda_ipc(name: str, tensor: Any) -> Tuple[int, bytes, int]:
    """(device, the 64-byte cudaIpcMemHandle_t of the allocation holding
    `tensor`, the tensor's byte offset in it), from PyTorch's own sharing of
    CUDA storages between processes."""
    if getattr(tensor, "device", None) is None or tensor.device.type != "cuda":
        raise InvalidArgument("tensor %s is not a CUDA tensor" % name)
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor %s is not contiguous" % name)
    storage = (tensor.untyped_storage() if hasattr(tensor, "untyped_storage")
               else tensor.storage()._untyped())
    shared = storage._share_cuda_()
    device, handle, storage_offset = int(shared[0]), bytes(shared[1]), int(shared[3])
    if len(handle) != 64:
        raise InvalidArgument("tensor %s: PyTorch gave a %d-byte CUDA IPC handle, not a "
                              "cudaIpcMemHandle_t (expandable segments are not supported)"
                              % (name, len(handle)))
    return device, handle, storage_offset + tensor.storage_offset() * tensor.element_size()


def _fixed(value: str | bytes, size: int, what: str) -> bytes:
    b = os.fsencode(value) if not isinstance(value, bytes) else value
    if len(b) >= size or b"\0" in b:
        raise InvalidArgument("%s %r is longer than %d bytes or holds a NUL"
                              % (what, value, size - 1))
    return b


class LiveReceiver(_Handle):
    """One receiver of live applies: an open MOUNT/.dte/control whose
    registered buffers the daemon writes on every apply, laid out as a rank
    of (tp, fuse_qkv, fuse_gate_up) holds them. A buffer must hold the live
    version when it is registered and be written by nobody but the daemon
    afterwards: an apply adds the changes to what it holds. Closing the
    receiver (or exiting) unregisters them all. Not thread-safe.

    A rank of an inference server names it: server="rollout-3",
    server_size=8 (rank: its rank there). An apply writes the server's
    buffers only when every rank 0 .. server_size-1 registered on this
    mount, and is refused while one is missing, so the
    server's ranks never hold two versions (docs/live.md, "Servers"). A
    server whose ranks register on several mounts (several hosts) moves by
    dte.apply_servers over them (docs/live.md, "Servers on several hosts").
    server=None: a receiver of no server.

    An FP8 receiver (fp8=Fp8Options(...)) registers its quantized tensors
    with dtype "F8_E4M3" and their scales "<module>.weight_scale_inv" as
    "F32" of the block grid's shape, and the others as the layout has them;
    an apply writes only the E4M3 bytes and scales that changed, so the
    buffers always equal the target version quantized (docs/live.md)."""

    _close_fn = "dte_live_close"

    def __init__(self, mount: str | os.PathLike[str], *, tp: int = 1, rank: int = 0,
                 fuse_qkv: bool = True, fuse_gate_up: bool = True,
                 fp8: Optional[Fp8Options] = None, server: Optional[str] = None,
                 server_size: int = 1) -> None:
        self._h = None
        self.mount = os.fsdecode(mount)
        self.tp, self.rank = int(tp), int(rank)
        if self.tp < 1 or not 0 <= self.rank < self.tp:
            raise InvalidArgument("bad receiver layout: rank %d of tp %d (tp >= 1, 0 <= rank < tp)"
                                  % (self.rank, self.tp))
        # The daemon checks the server against its other ranks' registrations.
        self.server, self.server_size = server, int(server_size)
        self._server = b"" if server is None else _fixed(server, _lib.LIVE_SERVER_BYTES,
                                                          "server name")
        self.fuse_qkv, self.fuse_gate_up = bool(fuse_qkv), bool(fuse_gate_up)
        if fp8 is not None and not isinstance(fp8, Fp8Options):
            raise InvalidArgument("fp8 must be a dte.Fp8Options, not %r" % (fp8,))
        if fp8 is not None and fp8.block_rows != fp8.block_cols:
            raise InvalidArgument("live apply takes square FP8 blocks (one side in the live "
                                  "ABI), not %r; the push takes any" % (fp8.block,))
        self.fp8 = fp8
        handle = ctypes.c_void_p()
        _check(lib.dte_live_open(os.fsencode(mount), ctypes.byref(handle)))
        self._h = handle

    def register(self, name: str, shm_name: str | bytes, offset: int, dtype: str,
                 shape: Sequence[int], version: Optional[int] = None) -> int:
        """Registers tensor `name` (its name in this receiver's layout, e.g.
        model.layers.0.self_attn.qkv_proj.weight) held at byte `offset` of
        the /dev/shm object `shm_name` with `dtype` and rank-local `shape`;
        returns its buffer id. `version` is the version the buffer holds
        (the daemon refuses it unless that is the live version); None: not
        checked."""
        if not self._h:
            raise InvalidArgument("the receiver of %s is closed" % self.mount)
        r = self._request(name, dtype, shape, version)
        r.kind = _lib.LIVE_HOST_SHM
        # The daemon decides which names it maps ("a/b" is refused there).
        shm = os.fsencode(shm_name)
        r.shm_name = _fixed(shm[1:] if shm.startswith(b"/") else shm, _lib.LIVE_NAME_BYTES,
                            "shared memory name")
        r.offset = int(offset)
        _check(lib.dte_live_register_buffer(self._h, ctypes.byref(r)))
        return r.buffer_id

    def _request(self, name: str, dtype: str, shape: Sequence[int],
                 version: Optional[int]) -> _lib.LiveRegister:
        """A registration of tensor `name` in this receiver's layout, the
        buffer's kind and place left to fill."""
        shape = tuple(int(d) for d in shape)
        if len(shape) > _lib.LIVE_MAX_DIMS:
            raise InvalidArgument("tensor %s has %d dimensions, at most %d"
                                  % (name, len(shape), _lib.LIVE_MAX_DIMS))
        r = _lib.LiveRegister()
        r.tp, r.rank = self.tp, self.rank
        r.fuse_qkv, r.fuse_gate_up = int(self.fuse_qkv), int(self.fuse_gate_up)
        r.name = _fixed(name, _lib.LIVE_NAME_BYTES, "tensor name")
        r.dtype = _fixed(dtype, 8, "dtype")
        r.ndim = len(shape)
        for i, d in enumerate(shape):
            r.shape[i] = d
        r.version = _lib.LIVE_LATEST if version is None else int(version)
        fp8 = self.fp8 or Fp8Options()
        r.fp8_block, r.fp8_scale_rule = fp8.block_rows, fp8.rule_code
        r.server, r.server_size = self._server, self.server_size
        return r

    def register_cuda(self, name: str, tensor: Any, version: Optional[int] = None,
                      dtype: Optional[str] = None) -> int:
        """Registers tensor `name` (as register) held by `tensor`, a
        contiguous PyTorch CUDA tensor of this process, through a CUDA IPC
        handle of the allocation holding it and its offset there; returns
        its buffer id. The tensor must stay allocated while it is
        registered. Needs PyTorch's default CUDA allocator (an allocation
        per IPC handle: not expandable segments). `dtype` overrides the
        safetensors dtype taken from the tensor's: "F8_E4M3" for the FP8
        bytes of an FP8 receiver held in a uint8 tensor (PyTorch without
        float8 dtypes)."""
        if not self._h:
            raise InvalidArgument("the receiver of %s is closed" % self.mount)
        width = None if dtype is None else dtype_width(dtype)
        if dtype is not None and width != tensor.element_size():
            # The daemon writes elements of `dtype` into the tensor's memory:
            # a wider dtype would write past the tensor.
            raise InvalidArgument("tensor %s: dtype %s (%s-byte elements) does not match the "
                                  "tensor's %d-byte %s elements"
                                  % (name, dtype, width or "unknown",
                                     tensor.element_size(), tensor.dtype))
        dtype = dtype or _TORCH_DTYPES.get(str(tensor.dtype))
        if dtype is None:
            raise InvalidArgument("tensor %s: %s has no safetensors name here"
                                  % (name, tensor.dtype))
        device, handle, offset = _cuda_ipc(name, tensor)
        r = self._request(name, dtype, tuple(tensor.shape), version)
        r.kind = _lib.LIVE_CUDA_IPC
        ctypes.memmove(r.cuda_ipc_handle, handle, len(handle))
        r.cuda_device = device
        r.offset = offset
        _check(lib.dte_live_register_buffer(self._h, ctypes.byref(r)))
        return r.buffer_id

    def register_shared(self, weights: SharedWeights, version: Optional[int] = None) -> List[int]:
        """Registers every tensor of a SharedWeights, which holds `version`
        (as register); returns their buffer ids."""
        return [self.register(name, weights.name, offset, dtype, shape, version)
                for name, (dtype, shape, offset, _) in weights.tensors.items()]

    def unregister(self, id: int = 0) -> None:  # noqa: A002 (the buffer id)
        """Drops buffer `id`; 0 drops every buffer of this receiver."""
        if not self._h:
            raise InvalidArgument("the receiver of %s is closed" % self.mount)
        _check(lib.dte_live_unregister(self._h, int(id)))

