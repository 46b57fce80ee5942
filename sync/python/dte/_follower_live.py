"""Live apply for a Follower: the model's parameters moved into a
SharedWeights object registered with the mount's daemon, so that an apply
writes each version's changed elements into them in place (docs/live.md).

Only a model whose every loaded tensor is a CPU parameter held in its
stored dtype, with no two names sharing memory, can be held this way, and
only where the daemon knows the layout (config.json, Llama/Qwen3 names);
otherwise the Follower reads versions whole (why is in Follower.live_reason).
"""

from __future__ import annotations

import itertools
import os
from typing import List, Optional

from dte._errors import DteError, InvalidArgument
from dte._live import LiveReceiver, SharedWeights, apply, live_status
from dte._sources import MountSource, version_name
from dte._tensors import Target, torch_module

_serial = itertools.count()


def why_not_live(targets: List[Target]) -> Optional[str]:
    """Why these model tensors cannot be held live, None when they can."""
    seen = set()
    for t in targets:
        if not t.is_param:
            return "tensor %s is a buffer, not a parameter" % t.info.name
        if not t.direct:
            return ("tensor %s is held as %s on %s, not as the stored %s on the CPU"
                    % (t.info.name, t.tensor.dtype, t.tensor.device, t.info.dtype))
        if t.tensor.data_ptr() in seen:
            return "tensor %s shares memory with another tensor" % t.info.name
        seen.add(t.tensor.data_ptr())
    return None


class LiveHold:
    """The model's parameters in shared memory, registered with the mount:
    they hold the mount's live version, whoever applies it. Not
    thread-safe."""

    def __init__(self, source: MountSource, targets: List[Target]) -> None:
        self.source, self.mount = source, source.mount
        spec = {t.info.name: (t.info.dtype, t.info.shape) for t in targets}
        self.weights = SharedWeights("dte-follower-%d-%d" % (os.getpid(), next(_serial)), spec)
        self.receiver: Optional[LiveReceiver] = None
        self.targets = targets

    def attach(self) -> int:
        """Loads the live version into the shared memory, registers it and
        points the model's parameters at it; returns the version held."""
        for _ in range(3):  # an apply between the load and the registration: again
            live = live_status(self.mount).live_version
            if live is None:
                raise InvalidArgument("%s has no live version" % self.mount)
            # From vNNNNNNNN, not live/: pages of live/ left in the page cache
            # would make every apply patch them too (docs/live.md).
            for t in self.targets:
                self.source.read_bytes(version_name(live), t.info,
                                       memoryview(self.weights.array(t.info.name)).cast("B"))
            rx = LiveReceiver(self.mount, tp=1, rank=0, fuse_qkv=False, fuse_gate_up=False)
            try:
                rx.register_shared(self.weights, version=live)
            except InvalidArgument:
                rx.close()
                if live_status(self.mount).live_version != live:
                    continue
                raise
            self.receiver = rx
            self._point_model()
            return live
        raise InvalidArgument("%s: live applies kept coming between loading and registering"
                              % self.mount)

    def _point_model(self) -> None:
        torch = torch_module()
        for t in self.targets:
            arr = self.weights.array(t.info.name)
            shared = torch.from_numpy(arr.view("u1")).view(t.tensor.dtype).view(t.info.shape)
            with torch.no_grad():
                t.tensor.data = shared

    def held(self) -> Optional[int]:
        """The version the registered weights hold: the mount's live one."""
        return live_status(self.mount).live_version

    def move_to(self, version: int) -> int:
        """Applies `version` on the mount (its registered weights, ours
        among them); returns the version now live."""
        counts = apply(self.mount, version)
        if counts.to_version != version:
            raise InvalidArgument("%s: apply of %s made %s live" % (
                self.mount, version_name(version), counts.to_version))
        return version

    def close(self) -> None:
        if self.receiver is not None:
            try:
                self.receiver.close()
            except DteError:
                pass  # the daemon drops the receiver with its file either way
            self.receiver = None
        self.weights.close()
        self.weights.unlink()
