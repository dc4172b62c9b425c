"""``gather`` and ``scatter-add`` as embedding lookups, their gradients and
``take_along_axis`` produce them; the other scatters (``.at[...].set``, ``.mul``,
``.min``, ``.max``, ``.subtract``) alike.

An embedding lookup ``W[tokens]`` with ``W: f32[V=64, D=16]`` and
``tokens: i32[B=4, S=8]`` is a gather with indices ``i32[4, 8, 1]``:

    ([i, j], [k, l, m])->([k, l, j]) {i=64, j=16, k=4, l=8, m=1} reduction={i} linear={(0)}

The index batch factors (``k``, ``l``) and the gathered row's pass-through
factor (``j``) split freely. The indexed factor ``i`` (the vocabulary) is a
*reduction*: a device holding rows ``[r, r + V/n)`` looks up only the tokens
in its range and writes zeros elsewhere (the masked, vocabulary-parallel
lookup of Megatron), so the result is a partial sum. The index-vector factor
(``m``, size 1 here) is never split.

The gradient, ``scatter-add`` of ``f32[4, 8, 16]`` updates into ``f32[64, 16]``:

    ([i, j], [k, l, m], [k, l, j])->([i, j]) {i=64, j=16, k=4, l=8, m=1} reduction={k, l} linear={(0, 2)}

Here the indexed factor ``i`` passes through (each device keeps only the
updates that land in its rows) and the index batch factors are reductions:
each device scatters its share of the updates, and the operand is counted
on one device of each group. ``take_along_axis`` adds batching factors shared
by operand, indices and result.

Indexed dimensions whose window is wider than one element, and boolean
results of a masked lookup, need replication instead, except a window as wide
as the dimension (it always starts at 0 unless out-of-bounds starts are filled),
which passes through.
"""

from __future__ import annotations

from typing import Callable

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder, numel
from shardsolve.rules.base import Rule


def _is_bool(dtype: object) -> bool:
    return dtype is not None and str(dtype) == "bool"


def _mode_name(mode: object) -> str:
    return getattr(mode, "name", str(mode)).upper()


def gather_rule(op: OpView) -> Rule:
    dn = op.params["dimension_numbers"]
    slice_sizes = tuple(op.params["slice_sizes"])
    operand, indices = op.in_shapes[0], op.in_shapes[1]
    out = op.out_shapes[0]
    b = RuleBuilder()
    maskable = not (op.out_dtypes and _is_bool(op.out_dtypes[0]))
    clamped = _mode_name(op.params.get("mode")) != "FILL_OR_DROP"  # a full-width window always starts at 0
    out_f: list[str | None] = [None] * len(out)
    in_f: list[str | None] = [None] * len(operand)
    idx_f: list[str] = []
    batch_positions = [d for d in range(len(out)) if d not in dn.offset_dims]
    for j in range(len(indices) - 1):
        f = b.new(indices[j])
        idx_f.append(f)
        out_f[batch_positions[j]] = f
        if j in dn.start_indices_batching_dims:
            in_f[dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(j)]] = f
    if indices:
        idx_f.append(b.new(indices[-1], replicate=True))
    offset_operand_dims = [
        d for d in range(len(operand)) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]
    out_of = dict(zip(offset_operand_dims, dn.offset_dims))
    for d, n in enumerate(operand):
        if in_f[d] is not None:
            continue
        indexed = d in dn.start_index_map
        if indexed and slice_sizes[d] == 1 and maskable:
            in_f[d] = b.new(n, reduce=True)
            if d in out_of:
                out_f[out_of[d]] = b.new(1)
        elif (clamped or not indexed) and d in out_of and slice_sizes[d] == n:
            in_f[d] = out_f[out_of[d]] = b.new(n)
        else:
            in_f[d] = b.new(n, replicate=True)
            if d in out_of:
                out_f[out_of[d]] = b.new(out[out_of[d]], replicate=True)
    # gather is linear in the operand: (A1 + A2)[idx] = A1[idx] + A2[idx]
    return b.build([in_f, idx_f], [out_f], linear=((0,),))


def scatter_add_rule(op: OpView) -> Rule:
    return _scatter_rule(op, summed=True)


def scatter_rule(op: OpView) -> Rule:
    """``scatter`` (``.at[...].set``), ``-mul``, ``-min`` and ``-max``: as ``scatter-add`` (``scatter-sub`` is
    one), but the updates are not summed, so their index batch factors are never split. The operand's indexed
    and pass-through factors split as there: each device applies the updates that land in its rows."""
    return _scatter_rule(op, summed=False)


def _scatter_rule(op: OpView, summed: bool) -> Rule:
    dn = op.params["dimension_numbers"]
    operand, indices, updates = op.in_shapes
    b = RuleBuilder()
    in_f: list[str | None] = [None] * len(operand)
    up_f: list[str | None] = [None] * len(updates)
    idx_f: list[str] = []
    scatter_positions = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    for j in range(len(indices) - 1):
        if j in dn.scatter_indices_batching_dims:
            f = b.new(indices[j])
            in_f[dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(j)]] = f
        else:
            f = b.new(indices[j], reduce=True) if summed else b.new(indices[j], replicate=True)
        idx_f.append(f)
        up_f[scatter_positions[j]] = f
    if indices:
        idx_f.append(b.new(indices[-1], replicate=True))
    window_operand_dims = [
        d for d in range(len(operand)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]
    up_of = dict(zip(window_operand_dims, dn.update_window_dims))
    for d, n in enumerate(operand):
        if in_f[d] is not None:
            continue
        indexed = d in dn.scatter_dims_to_operand_dims
        window = updates[up_of[d]] if d in up_of else 1
        if indexed and window == 1:
            in_f[d] = b.new(n)
            if d in up_of:
                up_f[up_of[d]] = b.new(1)
        elif not indexed and d in up_of and window == n:
            in_f[d] = up_f[up_of[d]] = b.new(n)
        else:
            in_f[d] = b.new(n, replicate=True)
            if d in up_of:
                up_f[up_of[d]] = b.new(window, replicate=True)
    # scatter-add (-sub, and a scatter that sets) is linear in operand and updates together:
    # (A1 + A2) + s(U1 + U2) = (A1 + s(U1)) + (A2 + s(U2)); scatter-mul in the operand alone; -min and -max in none
    name = op.primitive
    linear = ((0, 2),) if summed or name == "scatter" else ((0,),) if name in ("scatter-mul", "scatter_mul") else ()
    return b.build([in_f, idx_f, up_f], [in_f], linear=linear, flops=numel(updates))


RULES: dict[str, Callable[[OpView], Rule]] = {
    "gather": gather_rule,
    "scatter-add": scatter_add_rule, "scatter_add": scatter_add_rule,
    "scatter-sub": scatter_add_rule, "scatter_sub": scatter_add_rule,
    "scatter": scatter_rule,
    "scatter-mul": scatter_rule, "scatter_mul": scatter_rule,
    "scatter-min": scatter_rule, "scatter_min": scatter_rule,
    "scatter-max": scatter_rule, "scatter_max": scatter_rule,
}
