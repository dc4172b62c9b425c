"""``dot_general``: batch, contracting and free dimensions as factors.

A batched matmul ``f32[b, m, k] x f32[b, k, n] -> f32[b, m, n]``
(``dimension_numbers=(((2,), (1,)), ((0,), (0,)))``) is

    ([i, j, k], [i, k, l])->([i, j, l]) {i=4, j=8, k=32, l=16} reduction={k} linear={(0), (1)}

Batch factors are shared by all three; contracting factors are reductions
(splitting them leaves a partial sum); free factors belong to one operand and
the result. ``dot_general`` is linear in each operand alone:
``(A1 + A2) @ B = A1 @ B + A2 @ B``. FLOPs are ``2 * product of all factor sizes``.
"""

from __future__ import annotations

import math
from typing import Callable

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder
from shardsolve.rules.base import Rule


def dot_general_rule(op: OpView) -> Rule:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.in_shapes[0], op.in_shapes[1]
    b = RuleBuilder()
    lf: list[str | None] = [None] * len(lhs)
    rf: list[str | None] = [None] * len(rhs)
    batch = []
    for dl, dr in zip(lb, rb):
        f = b.new(lhs[dl]) if lhs[dl] == rhs[dr] else b.new(lhs[dl], replicate=True)
        lf[dl] = rf[dr] = f
        batch.append(f)
    for dl, dr in zip(lc, rc):
        lf[dl] = rf[dr] = b.new(lhs[dl], reduce=True)
    lhs_free = [d for d in range(len(lhs)) if lf[d] is None]
    rhs_free = [d for d in range(len(rhs)) if rf[d] is None]
    for d in lhs_free:
        lf[d] = b.new(lhs[d])
    for d in rhs_free:
        rf[d] = b.new(rhs[d])
    out = batch + [lf[d] for d in lhs_free] + [rf[d] for d in rhs_free]
    flops = 2 * math.prod(b.sizes.values())
    # dot_general is linear in each operand alone: (A1 + A2) @ B = A1 @ B + A2 @ B
    return b.build([lf, rf], [out], linear=((0,), (1,)), flops=flops)


RULES: dict[str, Callable[[OpView], Rule]] = {"dot_general": dot_general_rule}
