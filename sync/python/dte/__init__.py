"""dte: publish BF16 policy versions from a PyTorch training loop.

    pub = dte.Publisher(store="/data/policy")   # or "s3://bucket/prefix"
    pub.import_checkpoint(hf_dir)               # version 0, once
    for step in ...:
        optimizer.step()
        r = pub.publish_adamw(step=step, params={name: (master, exp_avg, exp_avg_sq)},
                              lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        # or, from a torch.optim.AdamW: pub.publish_torch_adamw(optimizer, named_params)

From Megatron-Core shards, give the model and layout instead of "hf":

    pub = dte.Publisher(store=..., converter={"config": "init/config.json", "tp": 2, "ep": 1})
    pub.publish_adamw(step=step, params={(mcore_name, tp_rank, ep_rank): (master, m, v)}, ...)

The same Publisher runs on every rank of a sharded trainer, each rank
publishing the state it holds (whole tensors, rows=(begin, end) of dim 0, or
flat=(begin, end) ranges); a world of one rank, the default, is its simplest
case and takes the same pieces, DTensors and CUDA tensors:

    pub = dte.Publisher(store=..., rank=rank, world_size=world)  # torch.distributed group
    pub.publish_adamw(step=step, params={name: {"param": p, "exp_avg": m,
                                                "exp_avg_sq": v, "rows": (r0, r1)}}, ...)

No copy of the previous weights is kept: the engine inverts the AdamW step.
See docs/engine.md.

On the inference side, a dtefs mount applies versions in place into
registered buffers (docs/live.md):

    with dte.SharedWeights("rank0", {name: ("BF16", shape), ...}) as w, \\
         dte.LiveReceiver("/mnt/policy", tp=2, rank=0) as rx:
        rx.register_shared(w)
        dte.apply("/mnt/policy")            # or `dtectl apply /mnt/policy`

Inside one cluster, the trainer can push each version's changed elements
straight into inference ranks' weights (docs/push.md):

    pub = dte.Publisher(store=..., push=dte.PushGroup(address="0.0.0.0:29600"))
    # a sharded trainer, every rank: each pushes the tensors it owns
    pub = dte.Publisher(store=..., rank=rank, world_size=world, rendezvous=...,
                        push=dte.PushGroup(address="trainer-0:29600", receivers=8))
    rx = dte.PushReceiver(address="trainer-0:29600", rank=tp_rank,
                          layout=dte.FusedReceiverLayout(tp),
                          tensors=dict(model.named_parameters()), version=loaded_version)
    rx.wait_for(version)                # dte.MissedPushes: rx.catch_up(store) first

A transformers.Trainer publishes every optimizer step with a callback
(import dte.hf; docs/integrations.md):

    trainer = transformers.Trainer(..., callbacks=[dte.hf.PublishCallback(store="/data/policy")])

A rollout loop follows a mount or a store and stamps samples with the
version its model holds (docs/integrations.md):

    follower = dte.Follower("/mnt/policy", max_lag=2)   # or a store URI
    version = follower.load_into(model)   # in place; verified against the hashes

Failures raise a subclass of dte.DteError per canonical code, each also the
fitting builtin (dte.InvalidArgument, also a ValueError; dte.NotFound, a
FileNotFoundError; dte.DeadlineExceeded, a TimeoutError; dte.Unavailable, a
ConnectionError; ... docs/errors.md); .code keeps the C ABI's code and
.transient says whether retrying can succeed. dte.Timeout and dte.Busy are
deprecated aliases of DeadlineExceeded and Unavailable.
"""

import typing as _typing

from dte._arrays import chunk_rows
from dte._errors import (Aborted, AlreadyExists, Corrupt, DeadlineExceeded, DteError,
                         FailedPrecondition, InternalError, InvalidArgument, IOFailure,
                         MissedPushes, NotFound, PermissionDenied, Unavailable, Unimplemented,
                         VersionConflict)
from dte._errors import deprecated as _deprecated
from dte._follower import CheckResult, Follower, Stale
from dte._fp8 import Fp8Options
from dte._live import (LiveCounts, LiveReceiver, LiveServer, LiveStatus, SharedTensor,
                       SharedWeights, apply, live_status)
from dte._live_servers import (PreparedApply, ServerSpan, apply_servers, live_servers,
                               prepare_apply)
from dte._publisher import MetricsCollector, Params, Publisher
from dte._push import (FusedReceiverLayout, PushGroup, PushGroupReceiver, PushGroupStatus,
                       PushReceiver, PushReceiverStatus, PushServerState, ReceiverLayout,
                       ReceiverTensor)
from dte._reader import StoreReader, TensorInfo
from dte._results import DistStats, PublishResult, PushReport

__all__ = ["Aborted", "AlreadyExists", "CheckResult", "Corrupt", "DeadlineExceeded", "DistStats",
           "DteError", "FailedPrecondition", "Follower", "Fp8Options", "FusedReceiverLayout",
           "InternalError", "InvalidArgument", "IOFailure", "LiveCounts", "LiveReceiver",
           "LiveServer", "LiveStatus", "MetricsCollector", "MissedPushes", "NotFound", "Params",
           "PermissionDenied", "PreparedApply", "Publisher", "PublishResult", "PushGroup", "PushGroupReceiver",
           "PushGroupStatus", "PushReceiver", "PushReceiverStatus", "PushReport",
           "PushServerState", "ReceiverLayout", "ReceiverTensor", "ServerSpan", "SharedTensor", "SharedWeights", "Stale", "StoreReader", "TensorInfo",
           "Unavailable", "Unimplemented", "VersionConflict", "apply", "apply_servers", "chunk_rows", "live_servers",
           "live_status", "prepare_apply"]


def __getattr__(name: str) -> _typing.Any:
    """dte.Timeout and dte.Busy, retired: their replacements, with a
    DeprecationWarning (removed in the next release)."""
    return _deprecated(__name__, name)
