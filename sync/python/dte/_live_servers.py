"""Servers whose ranks register on several dtefs mounts (several hosts):
the two-phase apply a coordinator drives over their mounts (docs/live.md,
"Servers on several hosts").

    counts = dte.apply_servers(["/mnt/policy-a", "/mnt/policy-b"], version=7)

Every mount first prepares the apply (decides and checks the changes of
the target, writing nothing) and reports the servers' ranks registered
there; the coordinator checks that the union of each server's ranks is the
whole server, then commits on every mount. A failed prepare, or a server
some of whose ranks are on no given mount, aborts every prepared mount:
nothing is written anywhere. A commit that fails on one mount (which then
holds the version it held: live apply writes back the ranks of servers it
wrote before a failing one) makes the coordinator move the mounts it had
committed back to the versions they held, so every server ends where it
was, on every mount.

The coordinator needs only `prepare(mount, version)`: each mount is any
value that callable takes. By default it is a path on this host
(prepare_apply); a controller whose mounts are on several hosts passes a
callable that prepares on the mount's host (an RPC to an agent there
calling prepare_apply and holding the PreparedApply until it is committed
or aborted) and returns an object with PreparedApply's attributes and
methods (mount: a value `prepare` takes again; from_version, to_version,
servers; commit, abort, close).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dte import _lib
from dte._errors import Aborted, FailedPrecondition, InvalidArgument, IOFailure
from dte._handle import _check, _Handle
from dte._lib import lib
from dte._live import LiveCounts, LiveServer, _live_json, _server_list, _servers


class PreparedApply(_Handle):
    """An apply prepared on one mount (its first phase): the changes of
    `to_version` decided and checked, nothing written. It holds its own
    control file: closing it (or exiting) aborts the apply. While it is
    held the mount runs no other apply and registers no buffer. Not
    thread-safe."""

    _close_fn = "dte_live_close"

    def __init__(self, mount: str | os.PathLike[str], version: Optional[int] = None) -> None:
        self._h = None
        self.mount = os.fsdecode(mount)
        v = _lib.LIVE_LATEST if version is None else int(version)
        if version is not None and not 0 <= v < _lib.LIVE_LATEST:
            raise InvalidArgument("bad version %r" % (version,))
        handle = ctypes.c_void_p()
        _check(lib.dte_live_open(os.fsencode(mount), ctypes.byref(handle)))
        self._h = handle
        prepared = ctypes.c_uint32()
        counts = _lib.LiveCounts()
        try:
            _check(lib.dte_live_prepare(self._h, v, ctypes.byref(prepared), ctypes.byref(counts)))
        except BaseException:
            self.close()
            raise
        self.id = prepared.value
        self.counts = LiveCounts.from_c(counts)  # of the first phase (decode_ns)
        self.from_version = self.counts.from_version
        self.to_version = self.counts.to_version
        self.servers = self._prepared_servers()
        self.done = False

    def _prepared_servers(self) -> List[LiveServer]:
        """The servers' ranks the prepare saw (.dte/status, "live" ->
        "prepared"), which the commit checks again."""
        try:
            prepared = _live_json(self.mount, "the prepared apply").get("prepared")
        except IOFailure:
            self.close()
            raise
        if not prepared or int(prepared["id"]) != self.id:
            self.close()
            raise IOFailure("%s: .dte/status shows no prepared apply %d" % (self.mount, self.id))
        return _server_list(prepared["servers"])

    def commit(self) -> LiveCounts:
        """Writes the prepared apply (the second phase); its counts."""
        if not self._h or self.done:
            raise FailedPrecondition("the prepared apply %d of %s is %s"
                                     % (self.id, self.mount, "done" if self.done else "closed"))
        self.done = True
        counts = _lib.LiveCounts()
        _check(lib.dte_live_commit(self._h, self.id, ctypes.byref(counts)))
        return LiveCounts.from_c(counts)

    def abort(self) -> None:
        """Forgets the prepared apply; nothing was written."""
        if self._h and not self.done:
            self.done = True
            _check(lib.dte_live_abort(self._h, self.id))


def prepare_apply(mount: str | os.PathLike[str], version: Optional[int] = None) -> PreparedApply:
    """The first phase of an apply of `version` (None: the newest) on a
    dtefs mount of this host."""
    return PreparedApply(mount, version)


@dataclasses.dataclass(frozen=True)
class ServerSpan:
    """An inference server over the mounts its ranks registered on."""
    name: str
    size: int
    ranks: Tuple[int, ...]                # registered, on any of the mounts
    complete: bool                        # every rank 0 .. size-1 registered once
    version: Optional[int]                # the version its ranks hold; None: inconsistent
    inconsistent: bool                    # its mounts hold different versions
    mounts: Dict[str, Tuple[int, ...]]    # mount -> the ranks registered there
    versions: Dict[str, Optional[int]]    # mount -> its live version


def _spans(by_mount: Dict[str, List[LiveServer]]) -> List[ServerSpan]:
    """The servers of the mounts, each over the mounts holding its ranks;
    InvalidArgument for a server registered with two sizes, or a rank
    registered on two mounts."""
    names: Dict[str, List[Tuple[str, LiveServer]]] = {}
    for mount, servers in by_mount.items():
        for s in servers:
            names.setdefault(s.name, []).append((mount, s))
    out = []
    for name, parts in sorted(names.items()):
        sizes = {s.size for _, s in parts}
        if len(sizes) != 1:
            raise InvalidArgument("server %r has different sizes on its mounts: %s" % (
                name, ", ".join("%s: %d" % (m, s.size) for m, s in parts)))
        ranks: Dict[int, str] = {}
        for mount, s in parts:
            for r in s.ranks:
                if r in ranks:
                    raise InvalidArgument("server %r: rank %d registered on %s and on %s"
                                          % (name, r, ranks[r], mount))
                ranks[r] = mount
        size = sizes.pop()
        versions = {m: s.version for m, s in parts}
        inconsistent = len(set(versions.values())) > 1
        out.append(ServerSpan(name=name, size=size, ranks=tuple(sorted(ranks)),
                              complete=len(ranks) == size, inconsistent=inconsistent,
                              version=None if inconsistent else next(iter(versions.values())),
                              mounts={m: s.ranks for m, s in parts}, versions=versions))
    return out


def live_servers(mounts: Sequence[str | os.PathLike[str]]) -> List[ServerSpan]:
    """The inference servers registered on these mounts of this host, each
    over all of them: complete when its ranks together are the whole
    server, inconsistent when its mounts hold different versions (a
    coordinator died between commits; apply_servers makes it whole)."""
    return _spans({os.fsdecode(m): _servers(m) for m in mounts})


def _move_back(prepare: Callable[[Any, Optional[int]], Any], committed: List[Any]) -> List[str]:
    """Moves each committed mount back to the version it held; the failures."""
    failures = []
    for p in committed:
        try:
            q = prepare(p.mount, p.from_version)
            try:
                q.commit()
            finally:
                q.close()
        except Exception as e:  # noqa: BLE001 (reported, with every other failure)
            failures.append("%s: %s" % (p.mount, e))
    return failures


def apply_servers(mounts: Sequence[Any], version: Optional[int] = None,
                  prepare: Callable[[Any, Optional[int]], Any] = prepare_apply
                  ) -> Dict[Any, LiveCounts]:
    """Makes `version` (None: the newest the first mount sees) live on every
    mount, all or none: the two-phase apply for servers whose ranks register
    on several mounts (see the top of this module). Returns each mount's
    counts. Raises FailedPrecondition (nothing written) when a server's
    ranks on these mounts are not the whole server, and Aborted when a
    commit failed (the committed mounts were moved back: the message says
    so, or names those that could not be)."""
    if not mounts:
        raise InvalidArgument("apply_servers: no mounts given")
    prepared: List[Any] = []
    try:
        for m in mounts:
            p = prepare(m, version)
            prepared.append(p)
            version = p.to_version  # every mount moves to the same version
        spans = _spans({p.mount: p.servers for p in prepared})
        for s in spans:
            if not s.complete:
                missing = sorted(set(range(s.size)) - set(s.ranks))
                raise FailedPrecondition(
                    "apply of %s refused, nothing written: server %r lacks ranks %s on "
                    "these mounts (registered: %s)" % (_name(version), s.name, missing, ", ".join(
                        "%s: %s" % (m, list(r)) for m, r in s.mounts.items())))
    except BaseException:
        for p in prepared:
            _quietly(p.abort)
            _quietly(p.close)
        raise
    counts: Dict[str, LiveCounts] = {}
    for i, p in enumerate(prepared):
        try:
            counts[p.mount] = p.commit()
        except Exception as e:
            for q in prepared[i + 1:]:
                _quietly(q.abort)
            for q in prepared:
                _quietly(q.close)
            # The failed mount too: a commit that failed after its writes
            # (replacing cached pages) left it at the target; one that failed
            # before them moves from its version to the same, writing nothing.
            failures = _move_back(prepare, prepared[:i + 1])
            back = "; moved back: %s" % ", ".join(str(q.mount) for q in prepared[:i + 1])
            if failures:
                back = ("; NOT moved back (their servers are inconsistent until an apply "
                        "makes them whole): " + "; ".join(failures))
            raise Aborted("apply of %s failed on %s: %s%s" % (_name(version), p.mount, e, back)) \
                from None
    for p in prepared:
        p.close()
    return counts


def _name(version: Optional[int]) -> str:
    return "the newest version" if version is None else "v%08d" % version


def _quietly(fn: Callable[[], Any]) -> None:
    """Runs a clean-up step whose failure the caller's error already covers."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass
