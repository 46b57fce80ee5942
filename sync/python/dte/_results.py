"""What a publish did, as typed records: PublishResult (the committed
version), PushReport (its push to inference ranks) and DistStats (one rank's
part of a distributed publish)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, List, Mapping, Optional

from dte import _lib


@dataclasses.dataclass(frozen=True)
class PushReport:
    """What the push of one published version did (docs/push.md). When the
    push could not run at all, `error` says why and the counts are 0."""
    version: int = 0
    pushed: int = 0          # receivers that confirmed the push
    behind: int = 0          # receivers told to catch up instead
    missing: int = 0         # of the PushGroup's `receivers`, those that did not confirm
    elements: int = 0        # elements sent, over all receivers
    bytes: int = 0           # bytes sent, both rounds, over all receivers
    seconds: float = 0.0
    pack_seconds: float = 0.0  # of which remapping and encoding the receivers' messages
    dropped: List[str] = dataclasses.field(default_factory=list)  # receivers dropped, and why
    fp8_parent_reads: int = 0  # FP8 receivers' change sets: parent tensors read whole
    fp8_parent_bytes: int = 0  # and bytes of parent tensors read in all
    error: str = ""

    @classmethod
    def from_json(cls, text: str) -> Optional[PushReport]:
        """The report of the C ABI's push JSON; None for "null" (no push)."""
        d: Optional[Mapping[str, Any]] = json.loads(text)
        if d is None:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass
class PublishResult:
    """What one publish committed. int(result) is the version."""
    version: int
    parent: int
    tensors: int
    elements: int
    changed: int          # elements stored in the delta
    flagged: int          # elements the fused detector reported
    false_positives: int  # reported, then proven unchanged (not stored)
    uncertain: int        # stored whole; at most this many stored elements are unchanged
    stored_bytes: int
    state_bytes: int      # optimizer state read (12 bytes per element), or weights read
    parent_bytes: int = 0  # parent version bytes read (publish_weights; 0 for the AdamW path)
    # Which path found the changes: "adamw" (the optimizer step inverted,
    # docs/engine.md) or "weights" (the new weights compared with the parent
    # version, Publisher.publish_weights).
    path: str = "adamw"
    push: Optional[PushReport] = None  # with push=: what the push did

    def __int__(self) -> int:
        return self.version

    __index__ = __int__

    @classmethod
    def from_c(cls, out: _lib.PublishResult) -> PublishResult:
        values = {f[0]: getattr(out, f[0]) for f in _lib.PublishResult._fields_}
        path = "weights" if values.pop("path") == _lib.PATH_WEIGHTS else "adamw"
        return cls(**values, path=path)


@dataclasses.dataclass(frozen=True)
class DistStats:
    """What the last distributed publish did on this rank."""
    entries_sent: int
    bytes_sent: int
    bytes_received: int
    tensors_owned: int           # tensors this rank encoded
    parent_bytes_read: int       # parent block bytes read to encode them
    messages_sent: int
    push_tensors_kept: int       # changes kept from encoding for this rank's push
    push_tensors_read_back: int  # changes read back from the store for it
    detect_ns: int               # the host screen, or the device kernel and its copy
    encode_ns: int
    commit_ns: int               # its part sent to rank 0 until the outcome
    detect_device_bytes: int     # copied device to host

    @classmethod
    def from_c(cls, out: _lib.DistStats) -> DistStats:
        return cls(*(getattr(out, f[0]) for f in _lib.DistStats._fields_))
