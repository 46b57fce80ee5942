"""The torch side of a Follower: which model tensor each stored tensor goes
to, the dtypes a model may hold a stored dtype in, raw byte views, and the
XXH3-128 of a tensor's bytes as the store hashes them."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Dict, List, Mapping

from dte._errors import InvalidArgument
from dte._handle import _torch
from dte._sources import TensorInfo

# Stored float dtypes, and the torch dtypes a model may hold each in: the
# same, or a wider one that holds every value exactly (so that the stored
# bits can be recovered from the model's and checked).
_FLOAT_TARGETS = {"BF16": ("bfloat16", "float32", "float64"),
                  "F16": ("float16", "float32", "float64"),
                  "F32": ("float32", "float64"), "F64": ("float64",)}
_EXACT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
          "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
          "I64": "int64"}


def torch_module() -> Any:
    torch = _torch()
    if torch is None:
        raise InvalidArgument("a Follower loads into PyTorch models: torch is not installed")
    return torch


def stored_dtype(info: TensorInfo) -> Any:
    """The torch dtype of info's stored bits."""
    name = _EXACT.get(info.dtype)
    if name is None:
        raise InvalidArgument("tensor %s is %s, which this torch cannot hold"
                              % (info.name, info.dtype))
    return getattr(torch_module(), name)


def byte_view(t: Any) -> memoryview:
    """A writable byte view of contiguous tensor t's memory (CPU)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def tensor_hash(t: Any, info: TensorInfo) -> str:
    """The XXH3-128 (32 hex digits) of t's values as info's stored bits."""
    import xxhash
    t = t.detach()
    want = stored_dtype(info)
    if t.dtype != want:
        t = t.to(want)
    t = t.cpu().contiguous()
    return xxhash.xxh3_128_hexdigest(byte_view(t))


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one stored tensor goes in the model."""
    info: TensorInfo
    tensor: Any          # the model's parameter or buffer (a torch.Tensor)
    is_param: bool
    direct: bool         # same dtype, contiguous on the CPU: read straight into it


def _check_dtype(name: str, info: TensorInfo, t: Any) -> None:
    if tuple(t.shape) != info.shape:
        raise InvalidArgument("tensor %s: the model holds shape %s, the version %s"
                              % (name, tuple(t.shape), info.shape))
    dtype = str(t.dtype).replace("torch.", "")
    allowed = _FLOAT_TARGETS.get(info.dtype, (_EXACT.get(info.dtype, "?"),))
    if dtype not in allowed:
        raise InvalidArgument("tensor %s is stored as %s; the model holds it as %s, which is not "
                              "one of %s (a model may hold a float tensor in its own dtype or "
                              "a wider one)" % (name, info.dtype, dtype, ", ".join(allowed)))


def targets(model: Any, layout: Mapping[str, TensorInfo], strict: bool) -> List[Target]:
    """The model tensor of each stored tensor, checked: names, shapes and
    dtypes. strict: every stored tensor has a model tensor and every model
    tensor (state_dict) is stored or shares memory with one that is."""
    state: Dict[str, Any] = model.state_dict(keep_vars=True)
    params = {id(p) for p in model.parameters()}
    missing = sorted(n for n in layout if n not in state)
    if strict and missing:
        raise InvalidArgument("the version holds tensors the model lacks: %s%s (strict=False loads "
                              "the tensors both hold)" % (", ".join(missing[:5]),
                                                         " ..." if len(missing) > 5 else ""))
    out: List[Target] = []
    for name, info in layout.items():
        if name not in state:
            continue
        t = state[name]
        _check_dtype(name, info, t)
        direct = (t.device.type == "cpu" and t.is_contiguous()
                  and t.dtype == stored_dtype(info))
        out.append(Target(info, t, id(t) in params, direct))
    held = {t.tensor.data_ptr() for t in out}
    extra = sorted(n for n, t in state.items() if n not in layout and t.data_ptr() not in held)
    if strict and extra:
        raise InvalidArgument("the model holds tensors the version lacks: %s%s (strict=False "
                              "leaves them as they are)" % (", ".join(extra[:5]),
                                                           " ..." if len(extra) > 5 else ""))
    return out


def fill(target: Target, read: Any) -> None:
    """Sets target's model tensor to the stored tensor; read(out) fills a
    CPU tensor of the stored dtype (the model's own memory where direct)."""
    torch = torch_module()
    with torch.no_grad():
        if target.direct:
            read(target.tensor.data)
            return
        staged = torch.empty(target.info.shape, dtype=stored_dtype(target.info))
        read(staged)
        target.tensor.data.copy_(staged)
