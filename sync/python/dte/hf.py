"""dte.hf.PublishCallback: a transformers.TrainerCallback that publishes a
store version per optimizer step from the Trainer's own AdamW state.

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   callbacks=[dte.hf.PublishCallback(store="/data/policy")])
    trainer.train()        # version 0: the starting weights; version k: after step k

Needs transformers (imported by this module only). See docs/integrations.md,
"Trainers: dte.hf.PublishCallback".
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Union

import transformers  # type: ignore[import]  # (no type hints)

from dte._errors import DteError, InvalidArgument, VersionConflict
from dte._publisher import Publisher
from dte._reader import StoreReader
from dte._results import PublishResult

__all__ = ["PublishCallback"]


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's (and DeepSpeed-less Trainer's)
    wrappers."""
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def _check_optimizer(optimizer: Any) -> None:
    """Refuses what the publisher cannot invert, naming what it found."""
    import torch
    opt = _unwrap(optimizer)
    if type(opt) is not torch.optim.AdamW:
        raise InvalidArgument("dte.hf.PublishCallback needs the Trainer's optimizer to be "
                              "torch.optim.AdamW (TrainingArguments(optim=\"adamw_torch\")), "
                              "found %s.%s" % (type(opt).__module__, type(opt).__qualname__))
    first = opt.param_groups[0]
    for i, g in enumerate(opt.param_groups):
        for flag in ("amsgrad", "maximize", "fused", "capturable"):
            if g.get(flag):
                raise InvalidArgument("dte.hf.PublishCallback: param group %d of the AdamW has "
                                      "%s=True, which the publisher does not support" % (i, flag))
        if tuple(g["betas"]) != tuple(first["betas"]) or g["eps"] != first["eps"]:
            raise InvalidArgument("dte.hf.PublishCallback: param group %d has betas %s, eps %s; "
                                  "group 0 has betas %s, eps %s (one publish takes one of each)"
                                  % (i, tuple(g["betas"]), g["eps"], tuple(first["betas"]),
                                     first["eps"]))


def _trained(model: Any, optimizer: Any) -> Dict[str, Any]:
    """{HF tensor name: parameter} of the optimizer's FP32 parameters;
    refuses a parameter that is not an FP32 master."""
    import torch
    in_opt = {id(p) for g in _unwrap(optimizer).param_groups for p in g["params"]}
    named: Dict[str, Any] = {}
    for name, p in model.named_parameters():
        if id(p) not in in_opt:
            continue  # frozen: unchanged in every version
        if p.dtype != torch.float32:
            raise InvalidArgument("dte.hf.PublishCallback needs FP32 master weights (published "
                                  "as BF16 versions); parameter %s is %s" % (name, p.dtype))
        named[name] = p
    if not named:
        raise InvalidArgument("dte.hf.PublishCallback: the optimizer holds none of the "
                              "model's parameters")
    return named


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


class PublishCallback(transformers.TrainerCallback):
    """Publishes the Trainer's policy to a dte store (a directory or
    s3://bucket/prefix): version 0 is the starting weights (imported when
    the store is empty), then one version per optimizer step (every=1: a
    sparse delta from the AdamW state, docs/engine.md) or one per `every`
    steps (every=N or "save_steps": the BF16 weights committed whole).
    Version v is the weights after step v * every, so a Trainer resumed
    from a checkpoint continues the store's numbering; a store whose latest
    version is not the checkpoint's is refused (dte.VersionConflict).

    Under DDP (the Trainer's torch.distributed group, world_size > 1) every
    rank publishes about 1/world of the tensors over that group
    (every=1), or rank 0 commits alone (every > 1).

    options go to dte.Publisher (cache_dir, anchor_budget, anchor_every,
    join_budget, push, secret, timeout). results: the PublishResult of
    each publish of this process."""

    def __init__(self, store: Union[str, os.PathLike[str]], *, every: Union[int, str] = 1,
                 **options: Any) -> None:
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
        self._pub: Optional[Publisher] = None
        self._named: Dict[str, Any] = {}
        self._rank, self._world, self._n = 0, 1, 1

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
        _check_optimizer(optimizer)
        named = _trained(model, optimizer)
        self._n = self._every(args)
        self._rank, self._world = int(args.process_index), int(args.world_size)
        step = int(state.global_step)
        failed: Optional[DteError] = None
        if self._rank == 0:
            try:
                self._start_store(model, step)
            except DteError as e:
                failed = e  # after the barrier: the other ranks are waiting at it
        self._barrier()
        if failed is not None:
            raise failed
        with StoreReader(self.store) as reader:
            latest = reader.latest()
        expected = step // self._n
        if latest != expected or step % self._n:
            raise VersionConflict(
                "dte.hf.PublishCallback: the Trainer is at global step %d, so store %s should "
                "hold version %d (one version per %d step(s)), but its latest version is %s; "
                "resume from the checkpoint of the store's latest version, or use a fresh "
                "store" % (step, self.store, expected, self._n, latest))
        if self._n == 1 and (self._world > 1 or _on_gpu(named)):
            # The distributed publisher: shares the tensors among the ranks,
            # and finds the changes of CUDA tensors on their GPU (a world
            # of one needs no process group).
            self._named = _share(named, self._rank, self._world)
            self._pub = Publisher(self.store, rank=self._rank, world_size=self._world,
                                  **self.options)
        else:
            self._named = named
            if self._rank == 0:
                self._pub = Publisher(self.store, **self.options)

    def _start_store(self, model: Any, step: int) -> None:
        """Imports the starting weights as version 0 when the store is empty."""
        with Publisher(self.store, **self.options) as pub:  # creates the store
            with StoreReader(self.store) as reader:
                if reader.latest() is not None:
                    return
            if step != 0:
                raise VersionConflict("dte.hf.PublishCallback: the Trainer resumes at global step "
                                      "%d but store %s is empty; start from a store holding the "
                                      "checkpoint's version" % (step, self.store))
            version = self._commit_whole(pub, model)
        if version != 0:
            raise VersionConflict("store %s: the starting weights became version %d, not 0"
                                  % (self.store, version))

    def _commit_whole(self, pub: Publisher, model: Any) -> int:
        """Commits the model's weights, cast to BF16, as a new version."""
        import torch
        bf16 = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        with tempfile.TemporaryDirectory(prefix="dte-hf-") as d:
            model.save_pretrained(d, state_dict=bf16, safe_serialization=True)
            return pub.import_checkpoint(d)

    def _barrier(self) -> None:
        if self._world > 1:
            import torch.distributed as dist
            dist.barrier()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                          **kwargs: Any) -> None:
        # After optimizer.step(), before the scheduler moves the lr and
        # before global_step counts the step.
        if self._n != 1:
            return
        step = int(state.global_step) + 1
        opt = _unwrap(optimizer)
        if self._named or self._world == 1:
            assert self._pub is not None
            self.results.append(self._pub.publish_torch_adamw(opt, self._named, step=step))
            return
        g = opt.param_groups[0]  # a rank with no tensor of its own still takes part
        assert self._pub is not None
        self.results.append(self._pub.publish_adamw(step, {}, lr=g["lr"], betas=g["betas"],
                                                    eps=g["eps"],
                                                    weight_decay=g["weight_decay"]))

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> None:
        if self._n == 1 or state.global_step % self._n:
            return
        if self._pub is not None:
            version = self._commit_whole(self._pub, model)
            expected = state.global_step // self._n
            if version != expected:
                raise VersionConflict("store %s: step %d became version %d, not %d"
                                      % (self.store, state.global_step, version, expected))
        self._barrier()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close()
            self._pub = None
