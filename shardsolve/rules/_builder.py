"""A small helper that hands out factor names while a rule is being written.

Rules are built per equation: each family names the dimensions of operands and
results with fresh factors, marks some of them as reductions or
need-replication, and then calls ``Rule.build`` (which renames the factors
canonically, so the names chosen here never show).

    >>> b = RuleBuilder()
    >>> i, k, j = b.new(8), b.new(4, reduce=True), b.new(8)
    >>> str(b.build([[i, k], [k, j]], [[i, j]], flops=2 * 8 * 4 * 8))
    '([i, j], [j, k])->([i, k]) {i=8, j=4, k=8} reduction={j}'
"""

from __future__ import annotations

import math
from typing import Sequence

from shardsolve.rules.base import Rule


class RuleBuilder:
    """Collects factor sizes and their kinds for one rule."""

    __slots__ = ("sizes", "reduction", "need_replication")

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.reduction: list[str] = []
        self.need_replication: list[str] = []

    def new(self, size: int, *, reduce: bool = False, replicate: bool = False) -> str:
        name = f"f{len(self.sizes)}"
        self.sizes[name] = int(size)
        if reduce:
            self.reduction.append(name)
        if replicate and size > 1:  # size-1 factors are never split anyway
            self.need_replication.append(name)
        return name

    def fresh_dims(self, shape: Sequence[int], *, replicate: bool = False) -> list[str]:
        """One new factor per dimension of ``shape``."""
        return [self.new(n, replicate=replicate) for n in shape]

    def build(
        self,
        operands: Sequence[Sequence[str | Sequence[str]]],
        results: Sequence[Sequence[str | Sequence[str]]],
        *,
        reduce_op: str = "sum",
        linear: Sequence[Sequence[int]] = (),
        flops: float = 0.0,
        log_flops: bool = False,
    ) -> Rule:
        return Rule.build(
            operands,
            results,
            self.sizes,
            reduction=self.reduction,
            need_replication=self.need_replication,
            reduce_op=reduce_op,
            linear=linear,
            flops=flops,
            log_flops=log_flops,
        )


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
