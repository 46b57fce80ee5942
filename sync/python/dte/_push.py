"""Same-cluster push from Python (sync/push/push_server.h, docs/push.md): the trainer's
PushGroup, given to a Publisher, sends each published version's changed
elements straight into the tensors of every registered PushReceiver (the
ranks of inference servers), remapped to their tensor-parallel, fused
layouts.

    # trainer (DTE_JOB_SECRET_FILE=/run/secrets/dte-job, or secret=...)
    pub = dte.Publisher(store=..., push=dte.PushGroup(address="0.0.0.0:29600"))
    r = pub.publish_adamw(...)            # r.push: what the push did

    # every inference rank (the same job secret)
    rx = dte.PushReceiver(address="trainer-0:29600", rank=tp_rank,
                          layout=dte.FusedReceiverLayout(tp),
                          tensors=dict(model.named_parameters()), version=loaded_version)
    rx.wait_for(version)                  # applies the pushes (pause generation around it)

Every connection proves the job secret both ways before anything else
crosses it (docs/push.md, "Security"): secret= (str or bytes), else
DTE_JOB_SECRET or DTE_JOB_SECRET_FILE. Without one a PushGroup listens on
loopback only and refuses any other address.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from dte import _lib
from dte._errors import FAILED_PRECONDITION, DeadlineExceeded, InvalidArgument, MissedPushes
from dte._fp8 import Fp8Options
from dte._handle import _check, _Handle, _secret_arg, _text, _torch
from dte._lib import lib
from dte._reader import StoreReader, dtype_width

_TORCH_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16", "float64": "F64",
                 "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                 "bool": "BOOL", "float8_e4m3fn": "F8_E4M3"}


# A receiver's tensor: a CPU or CUDA torch tensor, or a ("DTYPE", numpy array) pair.
ReceiverTensor = Union[Any, Tuple[str, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class ReceiverLayout:
    """How a receiver holds the model: its tensor-parallel degree, and
    whether q/k/v and gate/up projections are fused into one tensor each.
    Layouts with the same fields are equal, whatever their class."""
    tp: int = 1
    fuse_qkv: bool = False
    fuse_gate_up: bool = False

    def __post_init__(self) -> None:
        if int(self.tp) < 1:
            raise InvalidArgument("a receiver layout's tp must be at least 1, not %r" % (self.tp,))

    def _fields(self) -> Tuple[int, bool, bool]:
        return int(self.tp), bool(self.fuse_qkv), bool(self.fuse_gate_up)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReceiverLayout):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())


@dataclasses.dataclass(frozen=True, eq=False)
class FusedReceiverLayout(ReceiverLayout):
    """vLLM's and SGLang's layout: qkv_proj and gate_up_proj fused, TP of degree tp."""
    fuse_qkv: bool = True
    fuse_gate_up: bool = True


@dataclasses.dataclass(frozen=True)
class PushGroupReceiver:
    """One receiver connected to a push group, as the server sees it."""
    id: int                 # the connection's number, for its events
    rank: int
    layout: ReceiverLayout
    version: Optional[int]  # the version it confirmed; None: unknown
    behind: bool            # told to catch up from the store
    pushes: int
    elements: int
    bytes: int              # bytes sent to it
    fp8: Optional[Fp8Options] = None  # an FP8 receiver's block and scale rule
    server: str = ""        # the inference server it is a rank of ("": none)
    server_size: int = 1


@dataclasses.dataclass(frozen=True)
class PushServerState:
    """An inference server as its connected ranks report it (docs/push.md,
    "Servers")."""
    name: str
    size: int                  # its ranks
    ranks: List[int]           # the ranks connected
    complete: bool             # every rank 0 .. size-1 is connected
    version: Optional[int]     # what its ranks agreed on and applied; None: not yet reported
    staleness: Optional[int]   # the trainer's latest version minus `version`
    inconsistent: bool         # its ranks hold no version in common: it applies nothing
    error: str                 # why it is inconsistent


def _fp8_of(d: Optional[Dict[str, Any]]) -> Optional[Fp8Options]:
    """A receiver's FP8 options as the server's status lists them."""
    if d is None:
        return None
    rows, cols = (int(n) for n in d["block"])
    return Fp8Options(block=(rows, cols), scale_rule=d["scale_rule"])


@dataclasses.dataclass(frozen=True)
class PushGroupStatus:
    """A push group's server: where it listens and who is connected."""
    port: int
    address: str             # HOST:PORT receivers reach it at
    authenticated: bool      # connections must prove the job secret
    refused: int             # connections refused (no or a wrong proof)
    part: int                # this server's part of every push, of `parts`
    parts: int
    expected: int            # the `receivers` the group was given (0: none)
    receivers: List[PushGroupReceiver]
    events: List[str]        # receivers refused or dropped since the last call that took them
    servers: List[PushServerState] = dataclasses.field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> PushGroupStatus:
        d: Dict[str, Any] = json.loads(text)
        receivers = [PushGroupReceiver(
            id=r["id"], rank=r["rank"], layout=ReceiverLayout(r["tp"], r["fuse_qkv"],
                                                              r["fuse_gate_up"]),
            version=r["version"], behind=r["behind"], pushes=r["pushes"],
            elements=r["elements"], bytes=r["bytes"], fp8=_fp8_of(r.get("fp8")),
            server=r.get("server", ""), server_size=r.get("server_size", 1))
            for r in d["receivers"]]
        servers = [PushServerState(
            name=g["name"], size=g["size"], ranks=list(g["ranks"]), complete=g["complete"],
            version=g["version"], staleness=g["staleness"], inconsistent=g["inconsistent"],
            error=g["error"]) for g in d.get("servers", [])]
        return cls(port=d["port"], address=d["address"], authenticated=d["authenticated"],
                   refused=d["refused"], part=d["part"], parts=d["parts"],
                   expected=d["expected"], receivers=receivers, events=list(d["events"]),
                   servers=servers)


@dataclasses.dataclass(frozen=True)
class PushReceiverStatus:
    """Where a push receiver stands."""
    version: Optional[int]  # the version its tensors hold; None: unknown or inconsistent
    inconsistent: bool      # a catch-up failed part way: catch up again
    connected: bool
    behind: Optional[int]   # the server's version when told to catch up, else None
    pending: int            # pushes received, not yet applied
    pushes: int             # pushes applied
    elements: int           # elements they wrote (FP8 bytes and scales included)
    error: str              # the last problem, "" when none
    bytes: int = 0          # bytes they wrote (elements times their width)
    server: str = ""        # the inference server it is a rank of ("": none)
    # What the server's ranks last agreed on and applied (the same on every
    # rank once apply_pending returned); inconsistent: they hold no version
    # in common and apply nothing until they do (server_error says why).
    server_version: Optional[int] = None
    server_inconsistent: bool = False
    server_error: str = ""
    staged_bytes: int = 0   # memory of the pushes and moves staged


class PushGroup(_Handle):
    """The trainer's push server. address "HOST:PORT": where receivers
    connect (port 0: any free port; see .port and .address). timeout
    (seconds) bounds each push: a receiver that has not confirmed by then is
    dropped and the publish goes on. receivers: how many receiver ranks the
    inference fleet has (every TP rank of every server); each push then
    reports how many of them it missed ("missing"), and wait_for_receivers()
    waits for them. cache_mib: the memory a push keeps packed data in
    (PushServerOptions::cache_bytes; default 256), which a distributed
    publisher's rank also keeps the changes it encodes in for its push.

    A distributed publisher takes a PushGroup on rank 0 only (rank 0 pushes
    every tensor) or on every rank, all given rank 0's address: each rank
    pushes the tensors it owns, rank 0 listens on `address`, the other ranks
    on `listen` (default: port 0 of the address's host when that is a
    loopback address, else of every interface) and are reached at
    `advertise` (default: the listen host, or this machine's host name);
    receivers are told of them by rank 0. The server starts when first
    needed (its port or status asked for, or a publisher given it).

    secret: the job secret every connection must prove (str or bytes;
    None: the Publisher's secret=, else DTE_JOB_SECRET or
    DTE_JOB_SECRET_FILE); its receivers need the same. Without one the
    server listens on loopback only: a non-loopback address raises
    InvalidArgument naming it and how to give a secret."""

    _close_fn = "dte_push_server_close"

    def __init__(self, address: str = "127.0.0.1:0", *, timeout: float = 30.0,
                 receivers: Optional[int] = None, listen: Optional[str] = None,
                 advertise: Optional[str] = None, cache_mib: Optional[float] = None,
                 secret: str | bytes | None = None) -> None:
        self._h = None
        self._secret = _secret_arg(secret)
        self._address, self._timeout = address, timeout
        self._receivers = int(receivers or 0)
        self._cache = -1 if cache_mib is None else int(cache_mib * (1 << 20))
        self._listen, self._advertise = listen, advertise
        self._part: Optional[int] = None

    def _start(self, part: int = 0, parts: int = 1, secret: Optional[bytes] = None) -> None:
        """Starts the server (part 0 on `address`, others on `listen`) or,
        when it runs, checks it is the same part. secret: the publisher's,
        used when this group was given none."""
        if self._h:
            if part != 0 and self._part == 0 and parts > 1:
                raise InvalidArgument("this PushGroup listens at %s as rank 0's; give every other "
                                      "rank its own PushGroup" % self.address)
        else:
            listen = self._address
            if part != 0:
                host = self._address.rsplit(":", 1)[0]
                loop = host in ("127.0.0.1", "localhost", "::1", "[::1]")
                listen = self._listen or ("%s:0" % (host if loop else "0.0.0.0"))
            handle = ctypes.c_void_p()
            _check(lib.dte_push_server_start(listen.encode(),
                                             self._advertise.encode() if self._advertise else None,
                                             int(self._timeout * 1000), self._receivers,
                                             self._cache, self._secret or secret, None,
                                             ctypes.byref(handle)))
            self._h = handle
            self._part = part
        _check(lib.dte_push_server_set_group(self._h, part, parts))

    def _handle(self) -> ctypes.c_void_p:
        if not self._h:
            self._start()
        assert self._h is not None
        return self._h

    @property
    def port(self) -> int:
        """The port this server listens on."""
        port = ctypes.c_int32()
        _check(lib.dte_push_server_port(self._handle(), ctypes.byref(port)))
        return port.value

    @property
    def address(self) -> str:
        """HOST:PORT receivers reach this server at."""
        text = ctypes.c_char_p()
        _check(lib.dte_push_server_address(self._handle(), ctypes.byref(text)))
        return _text(text)

    def wait_for_receivers(self, timeout: float = 60.0,
                           version: Optional[int] = None) -> PushGroupStatus:
        """Waits until the `receivers` given at construction are connected
        (and, with version, hold it); returns the status. Raises
        dte.DeadlineExceeded, saying how many are there, when `timeout` (seconds)
        runs out."""
        end = time.monotonic() + timeout
        while True:
            st = self.status(events=False)
            there = [r for r in st.receivers
                     if version is None or (r.version == version and not r.behind)]
            if len(there) >= self._receivers:
                return st
            if time.monotonic() >= end:
                raise DeadlineExceeded("%d of %d receivers%s after %.1f s" % (
                    len(there), self._receivers,
                    "" if version is None else " at v%d" % version, timeout))
            time.sleep(0.02)

    def wait_for_servers(self, version: int, timeout: float = 60.0,
                         count: Optional[int] = None) -> PushGroupStatus:
        """Waits until every inference server connected (at least `count` of
        them, when given) has all its ranks connected and has applied
        `version` or newer on every rank together; returns the status.
        Raises dte.DeadlineExceeded naming the servers not there when
        `timeout` (seconds) runs out."""
        end = time.monotonic() + timeout
        while True:
            st = self.status(events=False)
            late = [g for g in st.servers
                    if not g.complete or g.inconsistent or g.version is None
                    or g.version < version]
            if not late and len(st.servers) >= (count or 1):
                return st
            if time.monotonic() >= end:
                raise DeadlineExceeded("%d server(s) at v%d or newer of %s after %.1f s; late: %s"
                                       % (len(st.servers) - len(late), version,
                                          count or len(st.servers), timeout,
                                          ", ".join("%s (ranks %s of %d, %s)" % (
                                              g.name, g.ranks, g.size,
                                              "inconsistent" if g.inconsistent else
                                              "v%s" % g.version) for g in late) or "none"))
            time.sleep(0.02)

    def status(self, events: bool = True) -> PushGroupStatus:
        """Where the server listens, who is connected, and the events (lines
        about receivers refused or dropped) since the last call that took
        them (events=False: none taken; they stay for a later call)."""
        text = ctypes.c_char_p()
        _check(lib.dte_push_server_status_json(self._handle(), int(bool(events)),
                                               ctypes.byref(text)))
        return PushGroupStatus.from_json(_text(text))


def _tensor_entry(name: str, value: ReceiverTensor, keep: List[Any]) -> _lib.PushTensor:
    """A _lib.PushTensor over the memory of a CPU or CUDA torch tensor or a
    ("DTYPE", numpy array) pair, written in place by pushes."""
    torch = _torch()
    device = -1
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            device = value.device.index if value.device.index is not None else 0
        elif value.device.type != "cpu":
            raise InvalidArgument("tensor %s is on %s; pushes go into CPU or CUDA memory"
                                  % (name, value.device))
        if not value.is_contiguous():
            raise InvalidArgument("tensor %s is not contiguous: pushes write it in place" % name)
        dtype = _TORCH_DTYPES.get(str(value.dtype).replace("torch.", ""))
        if dtype is None:
            raise InvalidArgument("tensor %s: dtype %s has no safetensors name"
                                  % (name, value.dtype))
        ptr, shape = value.data_ptr(), tuple(value.shape)
    else:
        try:
            dtype, array = value
        except (TypeError, ValueError):
            raise InvalidArgument("tensor %s: give a torch tensor or a (\"DTYPE\", numpy array) "
                                  "pair" % name) from None
        if not array.flags["C_CONTIGUOUS"] or not array.flags["WRITEABLE"]:
            raise InvalidArgument("tensor %s: the array must be C-contiguous and writeable" % name)
        width = dtype_width(dtype)
        if width != array.itemsize:
            # Pushes write elements of `dtype` into the array's memory: a
            # wider dtype would write past it.
            raise InvalidArgument("tensor %s: dtype %s (%s-byte elements) does not match the "
                                  "array's %d-byte %s elements"
                                  % (name, dtype, width or "unknown", array.itemsize,
                                     array.dtype))
        ptr, shape = array.ctypes.data, tuple(array.shape)
        value = array
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    encoded, dt = name.encode(), dtype.encode()
    keep.extend((value, dims, encoded, dt))
    return _lib.PushTensor(encoded, dt, len(shape), dims, ptr or None, device)


# Versions a rank of a server sends its server's other ranks per
# apply_pending() call, its path's length included.
_PATH_ROW = 64


class PushReceiver(_Handle):
    """One inference rank's receiver. tensors: {name: tensor} in the rank's
    own layout (e.g. dict(model.named_parameters()) of a vLLM worker), CPU
    or CUDA torch tensors or ("DTYPE", numpy array) pairs, written in place
    (on a GPU with the CUDA remap-and-apply kernel).
    version: the version they hold now (None: unknown; the server then says
    which one it is at and the receiver catches up). With auto_apply, pushes
    are written as they arrive, on the receiver's own thread; otherwise they
    wait, received and checked, until apply_pending() or wait_for().
    secret: the job secret (str or bytes; None: DTE_JOB_SECRET or
    DTE_JOB_SECRET_FILE), proved to every server, which must prove it
    back.
    fp8: an FP8 receiver (dte.Fp8Options: block, scale_rule): the weights
    the FP8 policy quantizes are given as F8_E4M3 tensors (torch
    float8_e4m3fn, or ("F8_E4M3", uint8 array) pairs), each with its F32
    scales "<module>.weight_scale_inv" (Fp8Options.scale_name/scale_shape);
    pushes write the E4M3 bytes and scales that changed, catch_up the
    version quantized. Every tensor-parallel split of them must fall on
    block boundaries (else the server refuses the receiver, naming the
    tensor, the split and the block).

    server, server_size: the inference server this receiver is a rank of
    (docs/push.md, "Servers"). With server_size > 1, group must be the
    torch.distributed process group of exactly that server's ranks (a gloo
    group, e.g. vLLM's get_tp_group().cpu_group): apply_pending() then
    gathers every rank's staged path over it and applies only the version
    all of them staged, so every rank calls it at the same point between
    batches and no forward pass runs on a mix of versions. stage_mib: the
    most memory pushes and moves wait in, staged (default 4096)."""

    _close_fn = "dte_push_receiver_close"

    def __init__(self, address: str, tensors: Mapping[str, ReceiverTensor], *, rank: int = 0,
                 layout: Optional[ReceiverLayout] = None, version: Optional[int] = None,
                 auto_apply: bool = False, timeout: float = 30.0,
                 secret: str | bytes | None = None, fp8: Optional[Fp8Options] = None,
                 server: Optional[str] = None, server_size: int = 1, group: Any = None,
                 stage_mib: Optional[float] = None) -> None:
        layout = layout or ReceiverLayout()
        if not isinstance(layout, ReceiverLayout):
            raise InvalidArgument("layout must be a dte.ReceiverLayout, not %r" % (layout,))
        if fp8 is not None and not isinstance(fp8, Fp8Options):
            raise InvalidArgument("fp8 must be a dte.Fp8Options, not %r" % (fp8,))
        server_size = int(server_size)
        if server_size > 1:
            if not server:
                raise InvalidArgument("server_size %d needs a server name" % server_size)
            if group is None:
                raise InvalidArgument(
                    "receiver rank %d of server %r (%d ranks) needs group=, the "
                    "torch.distributed process group of exactly its server's ranks, to agree "
                    "on the version they apply" % (rank, server, server_size))
            torch = _torch()
            if torch is None:
                raise InvalidArgument("receiver rank %d of server %r needs torch.distributed "
                                      "for its group, and torch is not installed"
                                      % (rank, server))
            found = torch.distributed.get_world_size(group)
            if found != server_size:
                raise InvalidArgument("group has %d ranks, but server %r has server_size %d"
                                      % (found, server, server_size))
        self._group = group if server_size > 1 else None
        self._keep: List[Any] = []
        entries = (_lib.PushTensor * max(len(tensors), 1))()
        for i, (name, value) in enumerate(tensors.items()):
            entries[i] = _tensor_entry(name, value, self._keep)
        handle = ctypes.c_void_p()
        args = (address.encode(), int(rank), int(layout.tp), int(layout.fuse_qkv),
                int(layout.fuse_gate_up), int(version is not None),
                int(version if version is not None else 0), entries, len(tensors),
                int(bool(auto_apply)), int(timeout * 1000), _secret_arg(secret))
        _check(lib.dte_push_receiver_open_server(
            *args, int(fp8 is not None), fp8.block_rows if fp8 else 0,
            fp8.block_cols if fp8 else 0, fp8.rule_code if fp8 else 0,
            server.encode() if server else None, server_size,
            0 if stage_mib is None else int(stage_mib * (1 << 20)), ctypes.byref(handle)))
        self._h = handle
        self.rank, self.layout, self.fp8 = int(rank), layout, fp8
        self.server, self.server_size = server or "", server_size

    def apply_pending(self) -> int:
        """Writes every push (and move) staged so far into the tensors;
        returns how many. On a rank of a server of several ranks this is a
        collective over its group: every rank must call it (at the same
        point between batches), and each applies up to the version every
        rank staged; when they hold no version in common nothing is written
        and status() says server_inconsistent. The ranks exchange one row
        of 64 int64 each (a gloo all_gather), whatever the model."""
        n = ctypes.c_uint64()
        if self._group is None:
            _check(lib.dte_push_receiver_apply_pending(self._h, ctypes.byref(n)))
            return n.value
        # One fixed-size int64 row per rank: its path's length, then the
        # path (the first _PATH_ROW - 1 versions: agreeing on a prefix is
        # as safe, the rest is applied at a later call).
        import torch
        import torch.distributed
        mine = self.path()[:_PATH_ROW - 1]
        if mine and max(mine) >= 2**63:
            raise InvalidArgument("version %d does not fit the server's exchange" % max(mine))
        row = torch.zeros(_PATH_ROW, dtype=torch.int64)
        row[0] = len(mine)
        row[1:1 + len(mine)] = torch.tensor(mine, dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.server_size)]
        torch.distributed.all_gather(rows, row, group=self._group)
        paths = [r[1:1 + int(r[0])].tolist() for r in rows]
        flat = [int(v) for p in paths for v in p]
        versions = (ctypes.c_uint64 * max(len(flat), 1))(*flat)
        lengths = (ctypes.c_size_t * self.server_size)(*[len(p) for p in paths])
        _check(lib.dte_push_receiver_apply_agreed(self._h, versions, lengths, self.server_size,
                                                  ctypes.byref(n)))
        return n.value

    @property
    def group(self) -> Any:
        """The process group of the server's ranks (None: no server of
        several). Set it to the new group after the ranks formed one again
        (a rank restarted); the server's size must not change."""
        return self._group

    @group.setter
    def group(self, group: Any) -> None:
        if self.server_size <= 1:
            raise InvalidArgument("this receiver is not a rank of a server of several")
        import torch.distributed
        found = torch.distributed.get_world_size(group)
        if found != self.server_size:
            raise InvalidArgument("group has %d ranks, but server %r has server_size %d"
                                  % (found, self.server, self.server_size))
        self._group = group

    def path(self) -> List[int]:
        """The versions this receiver can be at without the store: the one
        its tensors hold, then each staged version in apply order ([] when
        the version held is unknown)."""
        cap = 64
        while True:
            out = (ctypes.c_uint64 * cap)()
            n = ctypes.c_size_t()
            _check(lib.dte_push_receiver_path(self._h, out, cap, ctypes.byref(n)))
            if n.value <= cap:
                return [int(out[i]) for i in range(n.value)]
            cap = n.value

    def move_to(self, store: Union[str, os.PathLike[str], StoreReader], version: int,
                cache_dir: Optional[str] = None) -> int:
        """Moves the tensors to `version`, back (a rollback) or forward,
        writing only the elements that differ, read from the store's deltas:
        staged, then applied as apply_pending() applies (on a rank of a
        server, every rank calls move_to with the same version, and they
        move together). Returns what apply_pending() returned. Raises
        FailedPrecondition when the version held is unknown or the two are
        not on one chain of the store (catch_up() then)."""
        reader = store if isinstance(store, StoreReader) else StoreReader(store, cache_dir)
        try:
            _check(lib.dte_push_receiver_move_to(self._h, reader._h, int(version)))
        finally:
            if reader is not store:
                reader.close()
        return self.apply_pending()

    def wait_for(self, version: int, timeout: float = 60.0) -> None:
        """Applies pushes until the tensors hold `version` or newer (on a
        rank of a server of several: until `version` is staged; then
        apply_pending() on every rank applies it). Raises
        MissedPushes when this receiver missed pushes (catch_up() first),
        DeadlineExceeded when `timeout` (seconds) ran out."""
        _check(lib.dte_push_receiver_wait_for(self._h, int(version), int(timeout * 1000)),
               {FAILED_PRECONDITION: MissedPushes})

    def catch_up(self, store: Union[str, os.PathLike[str], StoreReader],
                 version: Optional[int] = None, cache_dir: Optional[str] = None) -> None:
        """Copies `version` (default: the one the server said it is at) from
        the store (a path, an s3:// URI or a dte.StoreReader) into the
        tensors and tells the server, which pushes again from there. On a
        rank of a server that knows the version it holds, the catch-up is
        staged instead (the elements that differ, as move_to reads them) and
        applied with the server's other ranks by apply_pending()."""
        reader = store if isinstance(store, StoreReader) else StoreReader(store, cache_dir)
        try:
            _check(lib.dte_push_receiver_catch_up(self._h, reader._h, int(version is not None),
                                                  int(version if version is not None else 0)))
        finally:
            if reader is not store:
                reader.close()

    def status(self) -> PushReceiverStatus:
        """Where this receiver stands."""
        st = _lib.PushReceiverStatus()
        err = ctypes.c_char_p()
        _check(lib.dte_push_receiver_get_status(self._h, ctypes.byref(st), ctypes.byref(err)))
        has, sv, bad, why = ctypes.c_int32(), ctypes.c_uint64(), ctypes.c_int32(), ctypes.c_char_p()
        _check(lib.dte_push_receiver_server_status(self._h, ctypes.byref(has), ctypes.byref(sv),
                                                   ctypes.byref(bad), ctypes.byref(why)))
        return PushReceiverStatus(
            version=st.version if st.has_version else None,
            inconsistent=bool(st.inconsistent), connected=bool(st.connected),
            behind=st.behind if st.has_behind else None, pending=st.pending, pushes=st.pushes,
            elements=st.elements, error=_text(err), bytes=st.bytes, server=self.server,
            server_version=sv.value if has.value else None, server_inconsistent=bool(bad.value),
            server_error=_text(why), staged_bytes=st.staged_bytes)

    @property
    def version(self) -> Optional[int]:
        """The version the tensors hold (None: unknown or inconsistent)."""
        return self.status().version
