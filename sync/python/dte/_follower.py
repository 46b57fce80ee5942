"""dte.Follower: the rollout side of async RL. It follows the versions of a
dtefs mount or a store, brings a loaded PyTorch model to one in place, and
says which version the model holds, so that every sample can be stamped
with the exact version that produced it (docs/integrations.md).

    follower = dte.Follower("/mnt/policy", max_lag=2)   # or a store URI
    for version in follower:              # every new version, in order
        held = follower.load_into(model)  # the version the model now holds
        batch = generate(model); batch.version = held
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterator, List, Optional, Union

from dte._errors import (Corrupt, DeadlineExceeded, DteError, FailedPrecondition, InvalidArgument,
                         NotFound)
from dte._follower_live import LiveHold, why_not_live
from dte._sources import MountSource, StoreSource, TensorInfo, version_name
from dte._tensors import Target, fill, targets, tensor_hash


class Stale(FailedPrecondition):
    """The model is more versions behind the newest than max_lag allows
    (Follower(on_lag="raise"))."""


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What Follower.check compared: every tensor's XXH3-128 against the
    version's."""
    version: int
    tensors: int
    seconds: float
    against: str     # "manifest": the store's tensor hashes; "read": a verified read's


class Follower:
    """Follows the versions of `source`: a dtefs mount path (MOUNT/latest,
    MOUNT/vNNNNNNNN, live apply through .dte/control) or a store URI (a
    directory or s3://, read through dte.StoreReader: libdte's checked
    listings, manifests and verified reads).

    live: None (default) uses live apply where the source is a mount and
    the model can be held in registered shared memory, True requires it,
    False never uses it. max_lag: load_into(model) without a version keeps
    the model while it is at most max_lag versions behind the newest, and
    otherwise loads the newest (on_lag="reload") or raises dte.Stale
    (on_lag="raise"); None: every load_into loads the newest. verify: every
    load is checked against the version's tensor hashes (check()).
    wait: seconds to wait for the source to appear (a rollout started
    before the trainer created the store); 0 (default): a store that is not
    there raises dte.NotFound at once. Not thread-safe: one Follower per
    model."""

    def __init__(self, source: Union[str, os.PathLike[str]], *, max_lag: Optional[int] = None,
                 on_lag: str = "reload", live: Optional[bool] = None, verify: bool = True,
                 strict: bool = True, poll_interval: float = 0.05,
                 cache_dir: Optional[str] = None, wait: float = 0.0) -> None:
        path = os.fspath(source)
        if max_lag is not None and int(max_lag) < 0:
            raise InvalidArgument("max_lag must be >= 0 or None, not %r" % (max_lag,))
        if on_lag not in ("reload", "raise"):
            raise InvalidArgument("on_lag must be \"reload\" or \"raise\", not %r" % (on_lag,))
        self.max_lag = None if max_lag is None else int(max_lag)
        self.on_lag, self.verify, self.strict = on_lag, bool(verify), bool(strict)
        self.poll_interval = float(poll_interval)
        deadline = time.monotonic() + max(0.0, float(wait))
        while True:
            is_mount = not path.startswith("s3://") and os.path.isdir(os.path.join(path, ".dte"))
            try:
                self._source: Union[MountSource, StoreSource] = (
                    MountSource(path) if is_mount else StoreSource(path, cache_dir))
                break
            except NotFound:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(self.poll_interval)
        if live and not is_mount:
            raise InvalidArgument("live=True needs a dtefs mount; %s is a store" % path)
        self._live_wanted = live
        self._live: Optional[LiveHold] = None
        self.live_reason = "" if is_mount else "the source is a store, not a mount"
        self._held: Optional[int] = None
        self._model_id: Optional[int] = None
        self._seen: Optional[int] = None

    # Versions.

    def latest(self) -> Optional[int]:
        """The newest version of the source; None when it has none."""
        return self._source.latest()

    def wait_for(self, min_version: int, timeout: Optional[float] = None) -> int:
        """Waits until the newest version is at least `min_version`; returns
        it. Raises dte.DeadlineExceeded after `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            v = self.latest()
            if v is not None and v >= min_version:
                return v
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded("%s: waited %.3g s for %s, newest is %s" % (
                    self._source.describe(), timeout or 0.0, version_name(min_version),
                    "none" if v is None else version_name(v)))
            time.sleep(self.poll_interval)

    def versions(self, *, after: Optional[int] = None, every: bool = True,
                 timeout: Optional[float] = None) -> Iterator[int]:
        """Yields new versions as they are committed, increasing, each once:
        those after `after` (None: after the newest yielded before, or, the
        first time, from the newest there is). every=False yields only the
        newest at each step, skipping the ones a slow loop missed. Ends with
        dte.DeadlineExceeded when none comes within `timeout` seconds (None: never)."""
        last = after if after is not None else self._seen
        if last is None:
            newest = self.latest()
            if newest is not None:
                last = newest - 1
        while True:
            want = 0 if last is None else last + 1
            self.wait_for(want, timeout)
            listed = self._source.versions(last if last is not None and last >= 0 else None)
            found = [v for v in listed if v >= want]
            if not found:  # latest moved before the listing shows it: look again
                time.sleep(self.poll_interval)
            if not every and found:
                found = found[-1:]
            for v in found:
                last = self._seen = v
                yield v

    def __iter__(self) -> Iterator[int]:
        return self.versions()

    # The model.

    @property
    def held(self) -> Optional[int]:
        """The version the model holds since the last load_into (with live
        apply, the mount's live version); None before the first."""
        if self._live is not None:
            self._held = self._live.held()
        return self._held

    def lag(self) -> Optional[int]:
        """How many versions the model is behind the newest (None: not loaded)."""
        held, newest = self.held, self.latest()
        return None if held is None or newest is None else max(0, newest - held)

    def load_into(self, model: Any, version: Optional[int] = None) -> int:
        """Brings `model` (a torch.nn.Module whose state_dict names are the
        version's tensor names) to `version` in place, or with no version to
        the newest as max_lag says; returns the version it now holds."""
        self._check_model(model)
        held = self.held
        if version is None:
            newest = self.wait_for(0) if held is None else self.latest()
            assert newest is not None
            if held is not None and self.max_lag is not None and newest - held <= self.max_lag:
                return held
            if held is not None and self.max_lag is not None and self.on_lag == "raise":
                raise Stale("%s: the model holds %s, %d versions behind %s (max_lag %d)" % (
                    self._source.describe(), version_name(held), newest - held,
                    version_name(newest), self.max_lag))
            version = newest
        if version == held:
            return held
        self._held = self._load(model, int(version))
        self._model_id = id(model)
        if self.verify:
            try:
                self.check(model, self._held)
            except Corrupt:
                self._forget()
                raise
        return self._held

    def _forget(self) -> None:
        """After a failed check: the model holds no known version, so the
        next load_into reads a whole version (and registers again: applies
        only add changes to what a buffer holds)."""
        if self._live is not None:
            self._live.close()
            self._live = None
        self._held = None

    def _check_model(self, model: Any) -> None:
        if self._model_id is not None and id(model) != self._model_id:
            raise InvalidArgument("this Follower holds another model; use one Follower per model")

    def _load(self, model: Any, version: int) -> int:
        layout = self._source.layout(version)
        tgts = targets(model, layout, self.strict)
        if self._live is None and self._live_wanted is not False and self._held is None \
                and isinstance(self._source, MountSource):
            self._start_live(tgts)
        try:
            if self._live is not None:
                return self._live.move_to(version) if self._live.held() != version else version
            for t in tgts:
                fill(t, lambda out, t=t: self._source.read_into(version, t.info, out))
            return version
        except BaseException:
            self._forget()  # some tensors may hold the new version, others not
            raise

    def _start_live(self, tgts: List[Target]) -> None:
        assert isinstance(self._source, MountSource)
        reason = why_not_live(tgts)
        if reason is None:
            hold = LiveHold(self._source, tgts)
            try:
                hold.attach()
                self._live, self.live_reason = hold, ""
                return
            except DteError as e:
                hold.close()
                reason = "the mount refused the registration: %s" % e
        self.live_reason = reason
        if self._live_wanted:
            raise InvalidArgument("live apply into this model is not possible: %s" % reason)

    def check(self, model: Any, version: Optional[int] = None) -> CheckResult:
        """Checks that `model` holds `version` (None: the held one) bit for
        bit: each tensor's XXH3-128, as the stored dtype, against the
        manifest's hash, or where the manifest cannot be read here, against
        the hash of a verified read of the version. Raises dte.Corrupt naming
        the tensors that differ."""
        v = self.held if version is None else version
        if v is None:
            raise InvalidArgument("check: the model holds no version yet and none was given")
        start = time.monotonic()
        layout = self._source.layout(v)
        tgts = targets(model, layout, self.strict)
        against = "manifest" if all(t.info.hash for t in tgts) else "read"
        bad = [t.info.name for t in tgts if tensor_hash(t.tensor, t.info) != self._want(v, t.info)]
        if bad:
            raise Corrupt("the model does not hold %s of %s: %d tensor(s) differ from its hashes: "
                          "%s%s" % (version_name(v), self._source.describe(), len(bad),
                                    ", ".join(bad[:5]), " ..." if len(bad) > 5 else ""))
        return CheckResult(v, len(tgts), time.monotonic() - start, against)

    def _want(self, version: int, info: TensorInfo) -> str:
        if info.hash:
            return info.hash
        from dte._tensors import stored_dtype, torch_module
        out = torch_module().empty(info.shape, dtype=stored_dtype(info))
        self._source.read_into(version, info, out)
        return tensor_hash(out, info)

    def close(self) -> None:
        """Stops following: live registrations end (the model keeps its
        weights but no longer takes applies); the source is closed."""
        if self._live is not None:
            self._live.close()
            self._live = None
        self._source.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live(self) -> bool:
        """Whether the model takes versions by live apply (else whole reads;
        live_reason says why)."""
        return self._live is not None
