"""Windowed operations: convolutions, pooling and the pooling gradient.

``conv_general_dilated`` names its dimensions by its ``dimension_numbers``:
the input's batch and feature dimensions, the kernel's output and input
feature dimensions, the result's batch and feature dimensions, and the
spatial dimensions of all three. A 3x3 ``SAME`` convolution of NHWC images
``f32[16, 8, 8, 4] * f32[3, 3, 4, 8] -> f32[16, 8, 8, 8]`` is

    ([i, j, k, l], [m, n, l, o])->([i, p, q, o]) {i=16, j=8, k=8, l=4, m=3, n=3, o=8, p=8, q=8}
        reduction={l} need_replication={j, k, m, n, p, q} linear={(0), (1)}

The batch factor is shared by input and result, the input feature factor is
a contraction (splitting it leaves a partial sum), the output feature factor
is shared by kernel and result. A convolution is linear in each operand
alone, as a matmul is: ``(X1 + X2) * W = X1 * W + X2 * W``.

Spatial dimensions need replication in general: a shard's window reaches
into its neighbours' rows (a halo). One layout needs no halo: windows that
tile the dimension, ``window <= stride``, no padding and no dilation, the
input exactly ``stride`` times the output (a patch embedding, a 2x2 pool of
stride 2, a 1x1 convolution of stride 1 or 2). There the input dimension is
made of the output's factor and the position within a window, ``[pw]``
(``w`` never split), and splitting ``p`` hands each device whole windows.
A 2x2 max pool of stride 2 over ``f32[4, 8, 8, 2]`` is

    ([i, jk, lm, n])->([i, j, l, n]) {i=4, j=4, k=2, l=4, m=2, n=2}
        reduction={k, m} need_replication={k, m}

(``k`` and ``m`` are reduced within a window and never split).

Grouped convolutions (``feature_group_count = G``) split the input feature
dimension into ``[g, c]`` and the kernel's output feature dimension into
``[g, o]``: ``g`` is shared by input, kernel and result (each device then
convolves its own groups: ``run_local`` passes the local group count), ``c``
is the contraction. ``batch_group_count = G`` (the kernel gradient of a
grouped convolution, where JAX swaps batch and feature dimensions) keeps the
batch and the output features whole (output feature group ``k`` reads batch
group ``k``) and splits only the contraction, the forward pass's batch, and
the spatial dimensions that tile.

``reduce_window_sum`` is linear (a window's sum of ``A1 + A2`` is the sum of
the windows' sums); ``reduce_window_max``/``min`` are not. ``select_and_scatter_add``
(the max pool's gradient) is linear in its source alone: for a fixed
operand the selected positions are fixed, and scattering ``S1 + S2`` adds.

FLOPs: a convolution does two per (result element, input feature of its
group, kernel tap) that reads a real input element (taps on padding and on
a dilated input's holes are skipped, as XLA's cost analysis counts them); a
pool one per window element after the first.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder
from shardsolve.rules.base import Rule


def tiles(size_in: int, size_out: int, window: int, stride: int, padding: Sequence[int],
          base_dilation: int = 1, window_dilation: int = 1) -> bool:
    """Whether a window's positions tile one dimension: each output element reads its own ``stride`` inputs."""
    return (
        tuple(padding) == (0, 0)
        and base_dilation == 1
        and window_dilation == 1
        and window <= stride
        and size_in == size_out * stride
    )


def window_pairs(size_in: int, size_out: int, window: int, stride: int, padding: Sequence[int],
                 base_dilation: int = 1, window_dilation: int = 1) -> int:
    """How many (output position, window tap) pairs of one dimension read a real input element.

    Taps on padding or on the holes of a dilated input read nothing (XLA's
    cost analysis counts only the others).
    """
    lo = padding[0]
    last = (size_in - 1) * base_dilation
    count = 0
    for o in range(size_out):
        for t in range(window):
            pos = o * stride + t * window_dilation - lo
            count += 0 <= pos <= last and pos % base_dilation == 0
    return count


def _spatial(b: RuleBuilder, size_in: int, size_out: int, window: int, stride: int, padding: Sequence[int],
             base_dilation: int, window_dilation: int, *, window_reduced: bool) -> tuple[list[str], list[str], str | None]:
    """Factors of one windowed dimension: (input dim, output dim, the window's own factor or None).

    A tiling dimension is ``[p, w]`` in, ``[p]`` out (``w`` left out when the
    stride is 1); any other needs replication on both sides. The window's
    factor is the kernel's dimension in a convolution: shared with ``w``
    where the window spans the whole stride.
    """
    if tiles(size_in, size_out, window, stride, padding, base_dilation, window_dilation):
        p = b.new(size_out)
        if stride == 1:
            return [p], [p], None
        w = b.new(stride, reduce=window_reduced, replicate=True)
        return [p, w], [p], w if window == stride else None
    return [b.new(size_in, replicate=True)], [b.new(size_out, replicate=True)], None


def conv_rule(op: OpView) -> Rule | None:
    p = op.params
    batch_groups = int(p.get("batch_group_count", 1))
    if batch_groups != 1 and int(p.get("feature_group_count", 1)) != 1:
        return None
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs, out = op.in_shapes[0], op.in_shapes[1], op.out_shapes[0]
    groups = int(p.get("feature_group_count", 1))
    b = RuleBuilder()
    lf: list[list[str]] = [[] for _ in lhs]
    rf: list[list[str]] = [[] for _ in rhs]
    of: list[list[str]] = [[] for _ in out]

    per_group_in = rhs[rhs_spec[1]]
    per_group_out = rhs[rhs_spec[0]] // groups
    if batch_groups != 1:
        # A grouped convolution's kernel gradient (JAX swaps batch and features): output feature group k reads
        # the lhs batch group k, so the batch and the output features stay whole; the features (the forward
        # pass's batch) are the contraction, split like any other.
        lf[lhs_spec[0]] = [b.new(lhs[lhs_spec[0]], replicate=True)]
        of[out_spec[0]] = [b.new(out[out_spec[0]], replicate=True)]
        c = b.new(per_group_in, reduce=True)
        lf[lhs_spec[1]], rf[rhs_spec[1]] = [c], [c]
        rf[rhs_spec[0]] = [b.new(rhs[rhs_spec[0]], replicate=True)]
        of[out_spec[1]] = [b.new(out[out_spec[1]], replicate=True)]
    else:
        n = b.new(lhs[lhs_spec[0]])
        lf[lhs_spec[0]], of[out_spec[0]] = [n], [n]
        if groups == 1:
            c, o = b.new(per_group_in, reduce=True), b.new(per_group_out)
            lf[lhs_spec[1]], rf[rhs_spec[1]] = [c], [c]
            rf[rhs_spec[0]], of[out_spec[1]] = [o], [o]
        else:
            g = b.new(groups)
            c = b.new(per_group_in, reduce=True)
            o = b.new(per_group_out)
            lf[lhs_spec[1]], rf[rhs_spec[1]] = [g, c], [c]
            rf[rhs_spec[0]], of[out_spec[1]] = [g, o], [g, o]

    pairs = 1  # (output position, kernel tap) pairs that read a real input element
    strides, padding = p["window_strides"], p["padding"]
    lhs_dilation, rhs_dilation = p["lhs_dilation"], p["rhs_dilation"]
    for s, (dl, dr, do) in enumerate(zip(lhs_spec[2:], rhs_spec[2:], out_spec[2:])):
        window = rhs[dr]
        din, dout, shared = _spatial(b, lhs[dl], out[do], window, strides[s], padding[s], lhs_dilation[s],
                                     rhs_dilation[s], window_reduced=True)
        lf[dl], of[do] = din, dout
        rf[dr] = [shared] if shared is not None else [b.new(window, replicate=True)]
        pairs *= window_pairs(lhs[dl], out[do], window, strides[s], padding[s], lhs_dilation[s], rhs_dilation[s])
    flops = 2.0 * out[out_spec[0]] * out[out_spec[1]] * per_group_in * pairs
    # XLA's CPU pipeline expands batch groups into one convolution over them all, masked per group: the compiled
    # program computes (and its cost analysis counts) ``batch_group_count`` times the grouped work
    flops *= batch_groups
    # a convolution is linear in each operand alone: (X1 + X2) * W = X1 * W + X2 * W
    return b.build([lf, rf], [of], linear=((0,), (1,)), flops=flops)


def _pool_dims(b: RuleBuilder, op: OpView, shape_in: Sequence[int], shape_out: Sequence[int]):
    """Per dimension (input factors, output factors) of a pool's window."""
    p = op.params
    ones = (1,) * len(shape_in)
    base = p.get("base_dilation", ones)
    wdil = p.get("window_dilation", ones)
    return [
        _spatial(b, shape_in[d], shape_out[d], p["window_dimensions"][d], p["window_strides"][d], p["padding"][d],
                 base[d], wdil[d], window_reduced=False)[:2]
        for d in range(len(shape_in))
    ]


def _reduce_window(op: OpView, *, linear: bool) -> Rule:
    b = RuleBuilder()
    dims = _pool_dims(b, op, op.in_shapes[0], op.out_shapes[0])
    flops = math.prod(op.out_shapes[0]) * max(1, math.prod(op.params["window_dimensions"]) - 1)
    return b.build([[d for d, _ in dims]], [[o for _, o in dims]], linear=((0,),) if linear else (), flops=flops)


def reduce_window_sum_rule(op: OpView) -> Rule:
    # a window's sum is linear: sum_w(A1 + A2) = sum_w(A1) + sum_w(A2)
    return _reduce_window(op, linear=True)


def reduce_window_extremum_rule(op: OpView) -> Rule:
    return _reduce_window(op, linear=False)


def select_and_scatter_add_rule(op: OpView) -> Rule:
    """``select_and_scatter_add(source, operand)``: the source has the pooled shape, the result the operand's."""
    b = RuleBuilder()
    dims = _pool_dims(b, op, op.in_shapes[1], op.in_shapes[0])
    operand = [d for d, _ in dims]
    flops = math.prod(op.in_shapes[0]) * math.prod(op.params["window_dimensions"])  # a comparison per window element
    # linear in the source alone: the operand fixes which positions are selected
    return b.build([[s for _, s in dims], operand], [operand], linear=((0,),), flops=flops)


RULES: dict[str, Callable[[OpView], Rule | None]] = {
    "conv_general_dilated": conv_rule,
    "reduce_window_sum": reduce_window_sum_rule,
    "reduce_window_max": reduce_window_extremum_rule,
    "reduce_window_min": reduce_window_extremum_rule,
    "select_and_scatter_add": select_and_scatter_add_rule,
}
