"""dte.hf.PublishCallback: a transformers.TrainerCallback that publishes a
store version per optimizer step.

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   callbacks=[dte.hf.PublishCallback(store="/data/policy")])
    trainer.train()        # version 0: the starting weights; version k: after step k

A torch.optim.AdamW over FP32 weights (the Trainer's default
"adamw_torch_fused", or "adamw_torch") publishes by inverting the step
from the optimizer state (docs/engine.md); any other optimizer, an AdamW
setting the engine has no model of, or BF16 weights publish by comparing
the new weights with the parent version (Publisher.publish_weights).
Logger "dte.hf" says at on_train_begin which path was chosen and why.

Needs torch >= MIN_TORCH and transformers >= MIN_TRANSFORMERS (imported by
this module only). See docs/integrations.md, "Trainers: dte.hf.PublishCallback".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Union

import transformers

from dte import _torch_adamw
from dte._arrays import _is_dtensor
from dte._errors import DteError, InternalError, InvalidArgument, VersionConflict
from dte._publisher import Publisher
from dte._reader import StoreReader
from dte._results import PublishResult

__all__ = ["PublishCallback", "MIN_TORCH", "MIN_TRANSFORMERS"]

# The oldest releases the tests have run the callback on (pyproject.toml's
# "hf" extra says the same; tests/py/test_hf_callback.py checks both).
MIN_TORCH = "2.15.0"
MIN_TRANSFORMERS = "5.24.0"

_log = logging.getLogger("dte.hf")


def _check_versions() -> None:
    """Refuses torch or transformers older than the tests have run on, and
    a Trainer without the on_optimizer_step event (each step is published
    on it: without it a run would train and publish nothing)."""
    import torch
    from packaging.version import Version
    for name, found, need in (("torch", torch.__version__, MIN_TORCH),
                              ("transformers", transformers.__version__, MIN_TRANSFORMERS)):
        if Version(found).release < Version(need).release:
            raise InvalidArgument("dte.hf.PublishCallback needs %s >= %s (the oldest its tests "
                                  "have run on); found %s %s" % (name, need, name, found))
    # The handler (a TrainerCallback itself) must dispatch the event, not
    # inherit the callbacks' no-op.
    handler = getattr(transformers.trainer_callback, "CallbackHandler", object)
    for defines, label in ((hasattr(transformers.TrainerCallback, "on_optimizer_step"),
                            "TrainerCallback"),
                           ("on_optimizer_step" in vars(handler), "CallbackHandler")):
        if not defines:
            raise InvalidArgument("dte.hf.PublishCallback: transformers %s's %s has no "
                                  "on_optimizer_step event, on which each step is published; "
                                  "use transformers >= %s"
                                  % (transformers.__version__, label, MIN_TRANSFORMERS))


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's (and DeepSpeed-less Trainer's)
    wrappers."""
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def _trained(model: Any, optimizer: Any) -> Dict[str, Any]:
    """{HF tensor name: parameter} of the parameters the optimizer trains."""
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = {name: p for name, p in model.named_parameters() if id(p) in in_opt}
    if not named:  # frozen parameters are unchanged in every version
        raise InvalidArgument("dte.hf.PublishCallback: the optimizer holds none of the "
                              "model's parameters")
    return named


@dataclasses.dataclass
class _Plan:
    """How the callback publishes: path "adamw" (the engine inverts the
    optimizer step, in `order`) or "weights" (the new weights compared
    with the parent version); why: what chose it, for the log."""
    path: str
    why: str
    named: Dict[str, Any]  # HF name -> trained parameter
    sharded: bool          # DTensor parameters (FSDP2): gathered for the weights path
    order: Optional[str] = None
    level: int = logging.INFO


def _plan(model: Any, optimizer: Any, every: int) -> _Plan:
    """The path for this optimizer and these parameters, publishing every
    `every` steps (docs/integrations.md)."""
    import torch
    if optimizer is None:
        raise InvalidArgument("dte.hf.PublishCallback: the Trainer gave on_train_begin no "
                              "optimizer")
    opt = _unwrap(optimizer)
    named = _trained(model, opt)
    sharded = any(_is_dtensor(p) for p in named.values())
    level = logging.INFO
    if every > 1:  # a delta of several steps: no one step to invert
        why = "%s.%s, a version every %d steps" % (type(opt).__module__,
                                                   type(opt).__qualname__, every)
    elif type(opt) is torch.optim.AdamW:
        order, how = _torch_adamw.order(opt, named)
        if order is not None:
            _torch_adamw.require_order(order, how)
            return _Plan("adamw", "AdamW (%s): inverting the optimizer step (engine order %s)"
                         % (how, order), named, sharded, order)
        why, level = "AdamW with %s, which the engine has no model of" % how, logging.WARNING
    else:
        why = "%s.%s" % (type(opt).__module__, type(opt).__qualname__)
    return _Plan("weights", why + ": diffing the weights against the parent version", named,
                 sharded, level=level)


def _bf16(t: Any) -> Any:
    """A tensor as a version holds it: floating point cast to BF16."""
    import torch
    t = t.detach()
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _on_gpu(named: Mapping[str, Any]) -> bool:
    return any(p.device.type != "cpu" for p in named.values())


def _share(named: Mapping[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """This rank's tensors: the largest first, each to the least loaded rank."""
    load = [0] * world
    mine: Dict[str, Any] = {}
    for name in sorted(named, key=lambda n: (-named[n].numel(), n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += int(named[name].numel())
        if r == rank:
            mine[name] = named[name]
    return mine


class _Gathered(Mapping[str, Any]):
    """Full BF16 copies of DTensor (FSDP2) tensors, each gathered when read
    (full_tensor(): a collective every rank makes, in the same order).
    Rank 0 reads them in order through publish_weights or save_pretrained;
    then every rank calls finish(), which gathers those not read, so all
    ranks make the same collectives. Each rank holds one full tensor at a
    time, and rank 0 what its reader keeps."""

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self._tensors = tensors
        self._names = list(tensors)
        self._next = 0

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __getitem__(self, name: str) -> Any:
        if self._next >= len(self._names) or name != self._names[self._next]:
            # Another order would pair different tensors' collectives.
            raise InternalError("tensor %s: gathered tensors are read once each, in order"
                                % name)
        self._next += 1
        t = self._tensors[name]
        if _is_dtensor(t):
            import torch
            with torch.no_grad():
                t = t.full_tensor()
        return _bf16(t)

    def finish(self) -> None:
        while self._next < len(self._names):
            self[self._names[self._next]]


class PublishCallback(transformers.TrainerCallback):
    """Publishes the Trainer's policy to a dte store (a directory or
    s3://bucket/prefix): version 0 is the starting weights (imported when
    the store is empty), then one version per optimizer step (every=1) or
    one per `every` steps (every=N or "save_steps"), each a sparse delta.
    Version v is the weights after step v * every, so a Trainer resumed
    from a checkpoint continues the store's numbering; a store whose latest
    version is not the checkpoint's is refused (dte.VersionConflict).

    Each step's delta comes from the AdamW state (path "adamw": a
    torch.optim.AdamW the engine models, over FP32 weights) or from the
    weights compared with the parent version (path "weights": any other
    optimizer or precision, and every=N); `path` and `reason` say which and
    why after on_train_begin, as logger "dte.hf" does.

    Under DDP (the Trainer's torch.distributed group, world_size > 1) every
    rank publishes about 1/world of the tensors over that group on the
    AdamW path; on the weights path rank 0 publishes, gathering FSDP2's
    DTensors one tensor at a time on every rank.

    options go to dte.Publisher (cache_dir, anchor_budget, anchor_every,
    join_budget, push, secret, timeout). results: the PublishResult of
    each publish of this process. Refused at construction: torch or
    transformers older than MIN_TORCH / MIN_TRANSFORMERS, and a
    transformers without the on_optimizer_step event."""

    def __init__(self, store: Union[str, os.PathLike[str]], *, every: Union[int, str] = 1,
                 **options: Any) -> None:
        _check_versions()
        for banned in ("rank", "world_size", "group", "rendezvous", "job", "converter"):
            if banned in options:
                raise InvalidArgument("dte.hf.PublishCallback chooses %s itself (the Trainer's "
                                      "process group, Hugging Face names); do not pass it"
                                      % banned)
        if every != "save_steps" and (isinstance(every, bool) or not isinstance(every, int)
                                      or every < 1):
            raise InvalidArgument("dte.hf.PublishCallback: every must be a positive int or "
                                  "\"save_steps\", not %r" % (every,))
        self.store = os.fspath(store)
        self.every = every
        self.options = options
        self.results: List[PublishResult] = []
        self.path: Optional[str] = None    # "adamw" or "weights", from on_train_begin
        self.reason: Optional[str] = None  # why that path
        self._pub: Optional[Publisher] = None
        self._plan: Optional[_Plan] = None
        self._named: Dict[str, Any] = {}
        self._rank, self._world, self._n = 0, 1, 1
        self._stepped: Optional[int] = None  # the step on_optimizer_step saw last

    def _every(self, args: Any) -> int:
        if self.every == "save_steps":
            n = args.save_steps
            if not isinstance(n, int) or n < 1:
                raise InvalidArgument("dte.hf.PublishCallback(every=\"save_steps\") needs an "
                                      "integer save_steps >= 1, found %r" % (n,))
            return n
        assert isinstance(self.every, int)
        return self.every

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self._n = self._every(args)
        plan = _plan(model, optimizer, self._n)
        _log.log(plan.level, "dte.hf.PublishCallback: %s", plan.why)
        self._rank, self._world = int(args.process_index), int(args.world_size)
        step = int(state.global_step)
        self._start_store(model, step, plan.sharded)
        with StoreReader(self.store) as reader:
            latest = reader.latest()
        expected = step // self._n
        if latest != expected or step % self._n:
            raise VersionConflict(
                "dte.hf.PublishCallback: the Trainer is at global step %d, so store %s should "
                "hold version %d (one version per %d step(s)), but its latest version is %s; "
                "resume from the checkpoint of the store's latest version, or use a fresh "
                "store" % (step, self.store, expected, self._n, latest))
        self._open(plan)
        self._plan, self.path, self.reason = plan, plan.path, plan.why

    def _open(self, plan: _Plan) -> None:
        """This rank's publisher: on every rank, of the Trainer's world,
        for the AdamW path of several ranks, sharded tensors or weights on
        a GPU (it finds the changes of CUDA tensors on their GPU; a world of
        one needs no process group), else on rank 0 alone, a world of
        one."""
        if self._n == 1 and plan.path == "adamw" and (self._world > 1 or plan.sharded
                                                      or _on_gpu(plan.named)):
            self._named = (plan.named if plan.sharded
                           else _share(plan.named, self._rank, self._world))
            self._pub = Publisher(self.store, rank=self._rank, world_size=self._world,
                                  **self.options)
        else:
            self._named = plan.named
            if self._rank == 0:
                self._pub = Publisher(self.store, **self.options)

    def _start_store(self, model: Any, step: int, sharded: bool) -> None:
        """Imports the starting weights as version 0 when the store is empty
        (gathered on every rank when sharded)."""
        empty = self._on_rank0("open store %s" % self.store, self._store_is_empty)
        if not empty:
            return
        if step != 0:
            raise VersionConflict("dte.hf.PublishCallback: the Trainer resumes at global step "
                                  "%d but store %s is empty; start from a store holding the "
                                  "checkpoint's version" % (step, self.store))
        weights = _Gathered(model.state_dict()) if sharded else None
        self._on_rank0("import the starting weights into %s" % self.store,
                       lambda: self._import_start(model, weights),
                       weights.finish if weights is not None else None)

    def _store_is_empty(self) -> bool:
        with Publisher(self.store, **self.options):  # creates the store
            with StoreReader(self.store) as reader:
                return reader.latest() is None

    def _import_start(self, model: Any, weights: Optional[_Gathered]) -> None:
        """Commits the model's weights, cast to BF16, as version 0 (a
        temporary save_pretrained, then Publisher.import_checkpoint)."""
        if weights is None:
            bf16 = {k: _bf16(v) for k, v in model.state_dict().items()}
        else:
            bf16 = dict(weights.items())
        with Publisher(self.store, **self.options) as pub:
            with tempfile.TemporaryDirectory(prefix="dte-hf-") as d:
                model.save_pretrained(d, state_dict=bf16, safe_serialization=True)
                version = pub.import_checkpoint(d)
        if version != 0:
            raise VersionConflict("store %s: the starting weights became version %d, not 0"
                                  % (self.store, version))

    def _on_rank0(self, what: str, fn: Callable[[], Any],
                  every_rank: Optional[Callable[[], None]] = None) -> Any:
        """fn() on rank 0, then every_rank() on every rank (the collectives
        rank 0's fn did not make); returns fn's value on every rank, or
        raises on every rank when it failed (rank 0 its own error)."""
        value, failure, error = None, None, None
        if self._rank == 0:
            try:
                value = fn()
            except Exception as e:  # told to the other ranks, then raised
                error, failure = e, "%s: %s" % (type(e).__name__, e)
        if every_rank is not None:
            every_rank()
        if self._world > 1:
            import torch.distributed as dist
            box = [(value, failure)]
            dist.broadcast_object_list(box, src=0)
            value, failure = box[0]
        if error is not None:
            raise error
        if failure is not None:
            raise DteError("dte.hf.PublishCallback: rank 0 failed to %s: %s" % (what, failure))
        return value

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                          **kwargs: Any) -> None:
        # After optimizer.step(), before the scheduler moves the lr and
        # before global_step counts the step.
        step = int(state.global_step) + 1
        self._stepped = step
        if self._n != 1:
            return
        assert self._plan is not None
        if self._plan.path == "weights":
            self._publish_weights(step, step)
            return
        opt = _unwrap(optimizer)
        assert self._pub is not None
        if self._named or self._world == 1:
            self.results.append(self._pub.publish_torch_adamw(opt, self._named, step=step))
            return
        g = opt.param_groups[0]  # a rank with no tensor of its own still takes part
        self.results.append(self._pub.publish_adamw(step, {}, lr=g["lr"], betas=g["betas"],
                                                    eps=g["eps"],
                                                    weight_decay=g["weight_decay"],
                                                    order=self._plan.order or "torch_cpu"))

    def _publish_weights(self, step: Optional[int], version: int) -> None:
        """Publishes the trained tensors as version `version` by comparing
        them with the parent version: rank 0 publishes (DDP replicas are
        identical; FSDP2's DTensors are gathered one at a time on every
        rank)."""
        assert self._plan is not None
        weights: Mapping[str, Any] = self._named
        finish = None
        if self._plan.sharded:
            gathered = _Gathered(self._named)
            weights, finish = gathered, gathered.finish

        def publish() -> None:
            assert self._pub is not None
            result = self._pub.publish_weights(weights, step=step)
            if result.version != version:
                raise VersionConflict("store %s: this step became version %d, not %d"
                                      % (self.store, result.version, version))
            self.results.append(result)

        self._on_rank0("publish version %d" % version, publish, finish)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._n == 1:
            if self._stepped != state.global_step:
                raise InvalidArgument(
                    "dte.hf.PublishCallback: the Trainer ended global step %d without an "
                    "on_optimizer_step event after its optimizer step (last seen: %s), so "
                    "nothing was published for it; transformers %s, needs >= %s"
                    % (state.global_step, self._stepped, transformers.__version__,
                       MIN_TRANSFORMERS))
            return
        if state.global_step % self._n == 0:
            self._publish_weights(None, state.global_step // self._n)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close()
            self._pub = None
