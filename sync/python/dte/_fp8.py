"""How an FP8 receiver holds its quantized tensors (docs/fp8.md): the block
size and the scale rule, declared once per receiver (dte.LiveReceiver's
fp8=)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Tuple, Union

from dte._errors import InvalidArgument

ScaleRule = Literal["plain", "pow2"]
_RULES = {"plain": 0, "pow2": 1}  # enum dte_live_fp8_scale_rule


@dataclasses.dataclass(frozen=True)
class Fp8Options:
    """Block-scaled E4M3: one FP32 scale per block of elements (block: N for
    N x N, or (rows, cols); (N, N) is kept as N), from the block's absolute
    maximum: amax / 448 ("plain", the public checkpoints' `weight_scale_inv`)
    or that rounded up to a power of two ("pow2", UE8M0-style). A weight
    is held in FP8 only when its canonical rows and columns are multiples
    of the block (of a fused tensor, every part's); any other is held in
    BF16, as MOUNT/fp8 of that block keeps it (docs/fp8.md). The
    receiver's tensor-parallel splits must fall on block boundaries (the
    registration says which one does not). Live apply takes square blocks
    only (its ABI has one block side); the push takes any."""
    block: Union[int, Tuple[int, int]] = 128
    scale_rule: ScaleRule = "plain"

    def __post_init__(self) -> None:
        sides = self.block if isinstance(self.block, tuple) else (self.block, self.block)
        if len(sides) != 2 or not all(
                isinstance(n, int) and not isinstance(n, bool) and 1 <= n < 2**32
                for n in sides):
            raise InvalidArgument("FP8 block must be an integer in [1, 2^32) or a pair of them "
                                  "(rows, cols), not %r" % (self.block,))
        if isinstance(self.block, tuple) and sides[0] == sides[1]:
            # (N, N) is N x N: one value, so that equal options compare equal.
            object.__setattr__(self, "block", sides[0])
        if self.scale_rule not in _RULES:
            raise InvalidArgument("FP8 scale rule %r is not one of %s"
                                  % (self.scale_rule, ", ".join(_RULES)))

    @property
    def block_rows(self) -> int:
        return self.block[0] if isinstance(self.block, tuple) else self.block

    @property
    def block_cols(self) -> int:
        return self.block[1] if isinstance(self.block, tuple) else self.block

    @property
    def rule_code(self) -> int:
        """The C ABI's dte_live_fp8_scale_rule."""
        return _RULES[self.scale_rule]

    @staticmethod
    def scale_name(weight: str) -> str:
        """The scale tensor of an FP8 weight: "<module>.weight_scale_inv"."""
        return (weight[:-len(".weight")] if weight.endswith(".weight") else weight) \
            + ".weight_scale_inv"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of a rank-local rows x cols tensor."""
        rows, cols = shape
        return (-(-rows // self.block_rows), -(-cols // self.block_cols))
