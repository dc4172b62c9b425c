"""``dot_general``: batch, contracting and free dimensions as factors (``ragged_dot_general`` alike, its
ragged and group dimensions whole).

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


def ragged_dot_rule(op: OpView) -> Rule | None:
    """``ragged_dot_general`` (``lax.ragged_dot``: rows of the left operand in consecutive groups, each
    multiplied by its group's matrix, as a mixture of experts' tokens sorted by expert), without batch dimensions.

    The ragged dimension and the group dimension stay whole (a device would not know where its rows' groups
    start); contracting factors are reductions, as in ``dot_general``, and the other free dimensions split.
    Where the ragged dimension is itself contracted (the gradient of the experts' weights), the result leads
    with the group dimension, whole. XLA's CPU pipeline computes it as a dense product per group, masked:
    FLOPs are the groups' count times the dense product's (as its cost analysis counts them).
    """
    dn = op.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    ragged, groups_at = tuple(dn.lhs_ragged_dimensions), tuple(dn.rhs_group_dimensions)
    if lb or rb or len(ragged) != 1 or len(op.in_shapes) != 3:
        return None
    lhs, rhs, sizes = op.in_shapes
    groups = sizes[0] if sizes else 1
    b = RuleBuilder()
    lf: list[str | None] = [None] * len(lhs)
    rf: list[str | None] = [None] * len(rhs)
    contracted_ragged = ragged[0] in lc
    for dl, dr in zip(lc, rc):
        lf[dl] = rf[dr] = b.new(lhs[dl], replicate=True) if dl == ragged[0] else b.new(lhs[dl], reduce=True)
    for d in groups_at:
        rf[d] = b.new(rhs[d], replicate=True)
    lhs_free = [d for d in range(len(lhs)) if lf[d] is None]
    rhs_free = [d for d in range(len(rhs)) if rf[d] is None]
    for d in lhs_free:
        lf[d] = b.new(lhs[d], replicate=d == ragged[0])
    for d in rhs_free:
        rf[d] = b.new(rhs[d])
    out = [lf[d] for d in lhs_free] + [rf[d] for d in rhs_free]
    if contracted_ragged:
        if groups_at:
            return None
        out = [b.new(groups, replicate=True)] + out
    dense = 2 * math.prod(b.sizes.values()) / (groups if (groups_at or contracted_ragged) else 1)
    # linear in each operand alone, as dot_general
    return b.build([lf, rf, [b.new(groups, replicate=True)] if sizes else []], [out], linear=((0,), (1,)),
                   flops=dense * groups)


RULES: dict[str, Callable[[OpView], Rule | None]] = {"dot_general": dot_general_rule,
                                                     "ragged_dot_general": ragged_dot_rule}
