"""How a torch.optim.AdamW step is published (Publisher.publish_torch_adamw,
dte.hf.PublishCallback): publish_adamw's params from the optimizer's state,
and the engine order whose FP32 operations are those of the optimizer's
kernel on the parameters' device, or why the engine has no model of the
step (then the weights are compared with the parent version instead)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from dte import _lib
from dte._arrays import ParamState, _step_value
from dte._errors import InvalidArgument
from dte._handle import _torch


def state(optimizer: Any, named_params: Mapping[str, Any]
          ) -> Tuple[Dict[str, ParamState], Mapping[str, Any], set[int]]:
    """publish_adamw's params for named_params of a torch AdamW (each with
    its state's step and its group's lr and weight decay), the param group
    of the first, and the steps of their states."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    params: Dict[str, ParamState] = {}
    first: Optional[Mapping[str, Any]] = None
    steps: set[int] = set()
    for name, p in named_params.items():
        g = group_of.get(id(p))
        if g is None:
            raise InvalidArgument("tensor %s is not a parameter of the optimizer" % name)
        st = optimizer.state[p]
        if "step" not in st:
            raise InvalidArgument("tensor %s has no optimizer state: publish after "
                                  "optimizer.step()" % name)
        first = first or g
        steps.add(_step_value(st["step"]))
        params[name] = {"param": p, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                        "step": _step_value(st["step"]), "lr": g["lr"],
                        "weight_decay": g["weight_decay"]}
    if first is None:
        raise InvalidArgument("publish_torch_adamw: named_params is empty")
    return params, first, steps


def order(optimizer: Any, named_params: Mapping[str, Any]) -> Tuple[Optional[str], str]:
    """The engine order (_lib.ORDERS, docs/engine.md) whose FP32 operations
    are those of this torch AdamW's step on these parameters, and how it was
    chosen ("fused, CPU"); (None, why) for a step the engine has no model of.
    On the CPU the fused kernel is torch_cpu; the foreach and single-tensor
    ones are too up to torch 1.13, but from torch 2 (measured in 2.15,
    docs/engine.md, "Fused AdamW") their torch.sqrt is 1 ulp off on some
    inputs, which no order models: None, so the weights are compared
    instead of publishing wrong old bits. On CUDA each kernel has its own
    order (the fused one two: torch_cuda_fused to torch 2.10,
    torch_cuda_fused_fp32 from 2.11), and a foreach of None is torch's
    default for the group's parameters."""
    torch = _torch()
    assert torch is not None
    groups = optimizer.param_groups
    why = _unmodelled(torch, groups, named_params)
    if why is not None:
        return None, why
    g = groups[0]
    devices = {p.device.type for p in named_params.values()}
    if devices == {"cpu"}:
        if g.get("fused"):
            return "torch_cpu", "fused, CPU"
        kind = "foreach" if g.get("foreach") else "single-tensor"
        if _release(torch.__version__) >= (2, 0):
            return None, ("the %s CPU kernel of torch %s (its torch.sqrt is not correctly "
                          "rounded, which torch_cpu does not model; fused=True is modelled)"
                          % (kind, torch.__version__))
        return "torch_cpu", kind + ", CPU"
    if devices != {"cuda"}:
        return None, "parameters on %s" % " and ".join(sorted(devices))
    if g.get("fused"):  # capturable or not: the same kernel, all FP32 from torch 2.11
        fp32 = _release(torch.__version__) >= (2, 11)
        return ("torch_cuda_fused_fp32" if fp32 else "torch_cuda_fused"), "fused, CUDA"
    if g.get("capturable"):
        return None, "capturable=True without fused on CUDA"
    foreach = {grp.get("foreach") for grp in groups}
    if foreach == {None}:  # torch's choice for each group's parameters
        from torch.optim.optimizer import _default_to_fused_or_foreach
        foreach = {_default_to_fused_or_foreach(grp["params"], False, False)[1]
                   for grp in groups}
    if len(foreach) != 1:
        return None, "param groups whose default CUDA kernels differ"
    if foreach.pop():
        return "torch_cuda_foreach", "foreach, CUDA"
    return "torch_cuda_single_tensor", "single-tensor, CUDA"


def _release(version: Any) -> Tuple[int, int]:
    """(major, minor) of a version string such as torch's "2.15.0+cu132"."""
    parts = str(version).split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _unmodelled(torch: Any, groups: Sequence[Mapping[str, Any]],
                named_params: Mapping[str, Any]) -> Optional[str]:
    """What makes an AdamW step one the engine has no model of, or None."""
    first = groups[0]
    for i, g in enumerate(groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if g.get(flag):
                return "%s=True (param group %d)" % (flag, i)
        if not g.get("decoupled_weight_decay", True):
            return "decoupled_weight_decay=False (param group %d)" % i
        if any(isinstance(x, torch.Tensor) for x in (g["lr"], *g["betas"])):
            return "a tensor lr or betas (param group %d)" % i
        for key in ("betas", "eps", "fused", "foreach", "capturable"):
            if _setting(g, key) != _setting(first, key):
                return "param groups 0 and %d of different %s" % (i, key)
    for name, p in named_params.items():
        if p.dtype != torch.float32:
            return "parameter %s in %s, not FP32" % (name, p.dtype)
    return None


def _setting(group: Mapping[str, Any], key: str) -> Any:
    """A param group's setting as compared between groups."""
    if key == "betas":
        return tuple(group[key])
    value = group.get(key)
    if key in ("fused", "capturable"):
        return bool(value)  # None and False alike
    return value  # eps; foreach: None (torch's default), True or False


def require_order(order: str, how: str) -> None:
    """Refuses an order this libdte lacks (torch_cuda_fused before the
    engine has it), naming it and what to use meanwhile."""
    if order not in _lib.ORDERS:
        raise InvalidArgument("AdamW (%s) needs the engine order %s, which this dte's library "
                              "does not have (it has %s); use foreach=True, or "
                              "TrainingArguments(optim=\"adamw_torch\"), until it does"
                              % (how, order, ", ".join(_lib.ORDERS)))
