"""Reductions, arg-reductions, scans and sorts.

``reduce_sum`` over axis 1 of ``f32[8, 16]``:

    ([i, j])->([i]) {i=8, j=16} reduction={j} linear={(0)}

``reduce_max`` is the same with ``reduction={j}(max)``: splitting ``j``
leaves per-device maximum candidates; boolean ``reduce_or`` and
``reduce_and`` are a maximum and a minimum over ``False < True`` (``pmax`` and
``pmin`` on ``pred``). Reductions whose partial results we cannot combine
(``reduce_prod``, ``argmax``) mark the reduced factor need-replication instead; so do scans (``cumsum``)
along their axis and ``sort``/``top_k`` along theirs. FLOPs are one per input
element, as XLA's cost analysis counts them: a scan's as the CPU backend
computes it (``scan_combines``), a sort's elements times the log of each
device's element count, ``top_k``'s times ``log2`` of the extent.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder, numel
from shardsolve.rules.base import Rule


def _reduce(op: OpView, *, combine: str | None, linear: bool, per_element: float = 1.0) -> Rule:
    """``combine`` is the partial-result operation (sum/max/min) or None: replicate reduced dims. ``per_element``:
    FLOPs an element of the operand costs."""
    b = RuleBuilder()
    shape = op.in_shapes[0]
    axes = {a % max(len(shape), 1) for a in op.params["axes"]}
    in_f = [b.new(n, reduce=combine is not None and d in axes, replicate=combine is None and d in axes) for d, n in enumerate(shape)]
    out_f = [f for d, f in enumerate(in_f) if d not in axes]
    return b.build(
        [in_f],
        [out_f] * len(op.out_shapes),
        reduce_op=combine or "sum",
        linear=((0,),) if linear else (),
        flops=numel(shape) * per_element,
    )


def reduce_sum_rule(op: OpView) -> Rule:
    # reduce_sum is linear: sum(A1 + A2) = sum(A1) + sum(A2)
    return _reduce(op, combine="sum", linear=True)


def reduce_max_rule(op: OpView) -> Rule:
    return _reduce(op, combine="max", linear=False)


def reduce_min_rule(op: OpView) -> Rule:
    return _reduce(op, combine="min", linear=False)


def replicated_reduce_rule(op: OpView) -> Rule:
    return _reduce(op, combine=None, linear=False)


#: FLOPs an element of ``argmax``/``argmin`` costs as ``cost_analysis()`` counts them: XLA reduces a value and
#: its index together, and the comparator takes 9 operations on floats (the NaN checks included), 7 on integers.
ARG_REDUCE_FLOPS = {"f": 9, "i": 7, "u": 7, "b": 7}


def arg_reduce_rule(op: OpView) -> Rule:
    """``argmax``/``argmin``: the reduced dimensions stay whole; priced by their comparator (``ARG_REDUCE_FLOPS``)."""
    kind = np.dtype(op.in_dtypes[0]).kind if op.in_dtypes else "f"
    return _reduce(op, combine=None, linear=False, per_element=ARG_REDUCE_FLOPS.get(kind, 9))


def general_reduce_rule(op: OpView) -> Rule:
    """``lax.reduce`` with a computation of its own (over several operands, say a value and its index): the
    dimensions it keeps split freely and are shared by every operand and result; the reduced ones stay whole
    (the computation is not known to combine partial results)."""
    b = RuleBuilder()
    shape = op.in_shapes[0]
    reduced = set(op.params["dimensions"])
    arrays = len(op.out_shapes)  # the operands, then one scalar initial value each
    in_f = [b.new(n, replicate=d in reduced) for d, n in enumerate(shape)]
    out_f = [f for d, f in enumerate(in_f) if d not in reduced]
    return b.build([in_f] * arrays + [[]] * (len(op.in_shapes) - arrays), [out_f] * arrays,
                   flops=numel(shape) * arrays)


#: FLOPs of one combining step of a cumulative op (``logaddexp``: a max, a difference, an exp, a log1p, ...).
SCAN_COMBINE_FLOPS = {"cumlogsumexp": 8}


def scan_combines(n: int) -> float:
    """Combining steps per element of a cumulative op over ``n`` elements, as XLA's CPU backend counts them.

    It computes the op as a window reduction and splits windows longer than
    16 into a tree (``ReduceWindowRewriter``): up to 16 elements, each output
    sums its whole prefix (``n - 1`` steps an element); beyond, each output of
    the axis padded to a multiple of 16 sums a window of 16, and the tree
    above adds about two steps an element (``cost_analysis()``: 15 at n = 16,
    16.1 at 32, 17.0 at 256, 17.2 at 1000, 17.1 at 65536).
    """
    if n <= 16:
        return max(n - 1, 0)
    return 15 * (-(-n // 16) * 16) / n + 2


def scan_rule(op: OpView, *, linear: bool) -> Rule:
    b = RuleBuilder()
    shape = op.in_shapes[0]
    axis = op.params["axis"] % max(len(shape), 1)
    f = [b.new(n, replicate=d == axis) for d, n in enumerate(shape)]
    per_element = scan_combines(shape[axis]) * SCAN_COMBINE_FLOPS.get(op.primitive, 1) if shape else 0
    return b.build([f], [f], linear=((0,),) if linear else (), flops=numel(shape) * per_element)


def cumsum_rule(op: OpView) -> Rule:
    # cumsum is linear: cumsum(A1 + A2) = cumsum(A1) + cumsum(A2)
    return scan_rule(op, linear=True)


def sort_rule(op: OpView) -> Rule:
    b = RuleBuilder()
    shape = op.in_shapes[0]
    axis = op.params["dimension"] % max(len(shape), 1)
    f = [b.new(n, replicate=d == axis) for d, n in enumerate(shape)]
    # XLA counts a sort as its elements times their log, whatever the number of operands carried along.
    return b.build([f] * len(op.in_shapes), [f] * len(op.out_shapes), flops=numel(shape), log_flops=True)


def top_k_rule(op: OpView) -> Rule:
    b = RuleBuilder()
    shape = op.in_shapes[0]
    axis = op.params.get("axis", op.params.get("reduction_dimension", len(shape) - 1)) % len(shape)
    in_f = [b.new(n, replicate=d == axis) for d, n in enumerate(shape)]
    out_shape = op.out_shapes[0]
    out_f = [b.new(out_shape[d], replicate=True) if d == axis else f for d, f in enumerate(in_f)]
    flops = numel(shape) * max(1, math.ceil(math.log2(max(shape[axis], 1))))
    return b.build([in_f], [out_f] * len(op.out_shapes), flops=flops)


RULES: dict[str, Callable[[OpView], Rule]] = {
    "reduce_sum": reduce_sum_rule,
    "reduce_max": reduce_max_rule,
    "reduce_min": reduce_min_rule,
    "reduce_or": reduce_max_rule,  # any: the maximum of booleans
    "reduce_and": reduce_min_rule,  # all: the minimum
}
for _name in ("reduce_prod", "reduce_xor"):
    RULES[_name] = replicated_reduce_rule
RULES["argmax"] = RULES["argmin"] = arg_reduce_rule
RULES["cumsum"] = cumsum_rule
for _name in ("cumprod", "cummax", "cummin", "cumlogsumexp"):
    RULES[_name] = lambda op: scan_rule(op, linear=False)
RULES["sort"] = sort_rule
RULES["reduce"] = general_reduce_rule
RULES["top_k"] = top_k_rule
RULES["approx_top_k"] = top_k_rule  # along ``reduction_dimension``; the others split (each row's own k)
