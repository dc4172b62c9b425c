"""Data movement: broadcast, reshape, transpose, squeeze, slicing, padding, iota.

Each dimension that survives unchanged keeps its factor; a dimension whose
extent changes (sliced, padded, concatenated, reversed) needs replication.
``reshape`` splits and merges dimensions with compound factors, as Shardy
does. Splitting ``f32[32]`` into ``f32[4, 8]``:

    ([ij])->([i, j]) {i=4, j=8} linear={(0)}

and a general reshape ``f32[6, 4] -> f32[2, 12]`` factorised greedily from the
major end (``6 = 2*3``, ``3*4 = 12``):

    ([ij, k])->([i, jk]) {i=2, j=3, k=4} linear={(0)}

Where no common factor exists (``f32[2, 3] -> f32[3, 2]``) the dimensions get
factors of their own that need replication. ``iota`` has result-only factors
(``()->([i, j]) {i=8, j=4}``): each device fills its own block.
All of these only move data, so their FLOPs are 0.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder
from shardsolve.rules.base import Rule

LINEAR0 = ((0,),)


def broadcast_in_dim_rule(op: OpView) -> Rule:
    # broadcast is linear: bcast(A1 + A2) = bcast(A1) + bcast(A2)
    b = RuleBuilder()
    in_shape, out_shape = op.in_shapes[0], op.out_shapes[0]
    out_f = b.fresh_dims(out_shape)
    dims = []
    for d, target in enumerate(op.params["broadcast_dimensions"]):
        n = in_shape[d]
        dims.append(out_f[target] if n == out_shape[target] else b.new(n, replicate=n != 1))
    extra = [[] for _ in op.in_shapes[1:]]  # dynamic-shape operands, if any
    return b.build([dims, *extra], [out_f], linear=LINEAR0)


def factorize_reshape(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]], set[int]] | None:
    """Factor a row-major reshape into shared sub-dimensions, greedily from the major end.

    Returns, per input and per output dimension, its factors as ``(id, size)``
    (major first), and the ids that need replication. Factors shared by an
    input and an output dimension cover the same contiguous stride range.
    Size-1 dimensions get factors of their own; ``None`` for size-0 shapes.
    """
    if 0 in in_shape or 0 in out_shape:
        return None
    ins: list[list[tuple[int, int]]] = [[] for _ in in_shape]
    outs: list[list[tuple[int, int]]] = [[] for _ in out_shape]
    replicate: set[int] = set()
    counter = [0]

    def fresh(size: int) -> int:
        counter[0] += 1
        return counter[0] - 1

    for d, n in enumerate(in_shape):
        if n == 1:
            ins[d].append((fresh(1), 1))
    for d, n in enumerate(out_shape):
        if n == 1:
            outs[d].append((fresh(1), 1))
    a = [d for d, n in enumerate(in_shape) if n != 1]
    c = [d for d, n in enumerate(out_shape) if n != 1]
    ia = ic = 0
    rest_a = in_shape[a[0]] if a else 1
    rest_c = out_shape[c[0]] if c else 1
    while ia < len(a) and ic < len(c):
        g = math.gcd(rest_a, rest_c)
        if g > 1:
            f = fresh(g)
            ins[a[ia]].append((f, g))
            outs[c[ic]].append((f, g))
            rest_a //= g
            rest_c //= g
        else:
            # no common major factor: the rest of this segment needs replication
            f = fresh(rest_a)
            ins[a[ia]].append((f, rest_a))
            replicate.add(f)
            f = fresh(rest_c)
            outs[c[ic]].append((f, rest_c))
            replicate.add(f)
            total_a, total_c = rest_a, rest_c
            rest_a = rest_c = 1
            # consume whole dimensions until both sides close the segment
            while total_a != total_c:
                if total_a < total_c:
                    ia += 1
                    n = in_shape[a[ia]]
                    f = fresh(n)
                    ins[a[ia]].append((f, n))
                    replicate.add(f)
                    total_a *= n
                else:
                    ic += 1
                    n = out_shape[c[ic]]
                    f = fresh(n)
                    outs[c[ic]].append((f, n))
                    replicate.add(f)
                    total_c *= n
        if rest_a == 1:
            ia += 1
            rest_a = in_shape[a[ia]] if ia < len(a) else 1
        if rest_c == 1:
            ic += 1
            rest_c = out_shape[c[ic]] if ic < len(c) else 1
    return ins, outs, replicate


def reshape_rule(op: OpView) -> Rule | None:
    # reshape is linear: reshape(A1 + A2) = reshape(A1) + reshape(A2)
    if op.params.get("dimensions") is not None:
        return None
    in_shape, out_shape = op.in_shapes[0], op.out_shapes[0]
    b = RuleBuilder()
    found = factorize_reshape(in_shape, out_shape)
    if found is None:
        return b.build([b.fresh_dims(in_shape, replicate=True)], [b.fresh_dims(out_shape, replicate=True)])
    ins, outs, replicate = found
    names: dict[int, str] = {}

    def name(fid: int, size: int) -> str:
        if fid not in names:
            names[fid] = b.new(size, replicate=fid in replicate and size != 1)
        return names[fid]

    in_dims = [[name(f, n) for f, n in d] for d in ins]
    out_dims = [[name(f, n) for f, n in d] for d in outs]
    return b.build([in_dims, *[[] for _ in op.in_shapes[1:]]], [out_dims], linear=LINEAR0)


def transpose_rule(op: OpView) -> Rule:
    # transpose is linear: (A1 + A2)^T = A1^T + A2^T
    b = RuleBuilder()
    in_f = b.fresh_dims(op.in_shapes[0])
    return b.build([in_f], [[in_f[p] for p in op.params["permutation"]]], linear=LINEAR0)


def squeeze_rule(op: OpView) -> Rule:
    # squeeze is linear: squeeze(A1 + A2) = squeeze(A1) + squeeze(A2)
    b = RuleBuilder()
    in_f = b.fresh_dims(op.in_shapes[0])
    dropped = {d % max(len(in_f), 1) for d in op.params["dimensions"]}
    return b.build([in_f], [[f for d, f in enumerate(in_f) if d not in dropped]], linear=LINEAR0)


def expand_dims_rule(op: OpView) -> Rule:
    """``expand_dims`` (where a program has it as a primitive): new size-1 dimensions."""
    # expand_dims is linear: expand(A1 + A2) = expand(A1) + expand(A2)
    b = RuleBuilder()
    in_f = b.fresh_dims(op.in_shapes[0])
    out = op.out_shapes[0]
    new = {d % len(out) for d in op.params["dimensions"]}
    it = iter(in_f)
    return b.build([in_f], [[b.new(1) if d in new else next(it) for d in range(len(out))]], linear=LINEAR0)


def _same_or_replicated(b: RuleBuilder, in_shape: Sequence[int], out_shape: Sequence[int], keep: Sequence[bool]):
    """Shared factors where ``keep[d]``; separate need-replication factors elsewhere."""
    in_f, out_f = [], []
    for d, (n, m) in enumerate(zip(in_shape, out_shape)):
        if keep[d] and n == m:
            f = b.new(n)
            in_f.append(f)
            out_f.append(f)
        else:
            in_f.append(b.new(n, replicate=True))
            out_f.append(b.new(m, replicate=True))
    return in_f, out_f


def _windowed(b: RuleBuilder, op: OpView, whole: Sequence[bool]) -> tuple[list[str], list[str]]:
    """Factors of a slice's operand and result: shared where ``whole[d]`` (the dimension passes through); where
    the slice narrows it, a masked lookup (a device holding a stretch reads the slice's elements in its stretch
    and zeros elsewhere: a reduction factor, the result a partial sum), or replicated for a boolean result."""
    shape, out = op.in_shapes[0], op.out_shapes[0]
    maskable = not (op.out_dtypes and str(op.out_dtypes[0]) == "bool")
    in_f, out_f = [], []
    for d, n in enumerate(shape):
        if whole[d]:
            f = b.new(n)
            in_f.append(f)
            out_f.append(f)
        else:
            in_f.append(b.new(n, reduce=True) if maskable else b.new(n, replicate=True))
            out_f.append(b.new(out[d], replicate=True))
    return in_f, out_f


def slice_rule(op: OpView) -> Rule:
    # slice is linear: (A1 + A2)[s] = A1[s] + A2[s]
    # A narrowed dimension split over devices is a masked lookup (``_windowed``): the first token of a sequence
    # split over devices costs a small reduction, not the sequence gathered.
    b = RuleBuilder()
    shape = op.in_shapes[0]
    starts, limits = op.params["start_indices"], op.params["limit_indices"]
    strides = op.params.get("strides") or (1,) * len(shape)
    in_f, out_f = _windowed(b, op, [starts[d] == 0 and limits[d] == n and strides[d] == 1
                                    for d, n in enumerate(shape)])
    return b.build([in_f], [out_f], linear=LINEAR0)


def pad_rule(op: OpView) -> Rule:
    # pad is linear in operand and padding value together: pad(A1 + A2, v1 + v2) = pad(A1, v1) + pad(A2, v2)
    b = RuleBuilder()
    shape = op.in_shapes[0]
    keep = [tuple(cfg) == (0, 0, 0) for cfg in op.params["padding_config"]]
    in_f, out_f = _same_or_replicated(b, shape, op.out_shapes[0], keep)
    return b.build([in_f, []], [out_f], linear=((0, 1),))


def rev_rule(op: OpView) -> Rule:
    # rev is linear: rev(A1 + A2) = rev(A1) + rev(A2)
    b = RuleBuilder()
    shape = op.in_shapes[0]
    reversed_dims = set(op.params["dimensions"])
    in_f = [b.new(n, replicate=d in reversed_dims) for d, n in enumerate(shape)]
    return b.build([in_f], [in_f], linear=LINEAR0)


def concatenate_rule(op: OpView) -> Rule:
    # concatenate is linear in all operands together: [A1 + A2, B1 + B2] = [A1, B1] + [A2, B2]
    # One operand alone non-empty along the axis (``jnp.pad(mode="edge")`` concatenates empty pieces): the result
    # is that operand, and the axis may be split like any other dimension.
    b = RuleBuilder()
    axis = op.params["dimension"]
    out = op.out_shapes[0]
    filled = [k for k, shape in enumerate(op.in_shapes) if shape[axis] > 0]
    out_f = [b.new(n, replicate=d == axis and len(filled) > 1) for d, n in enumerate(out)]
    operands = []
    for k, shape in enumerate(op.in_shapes):
        operands.append([(out_f[d] if filled == [k] else b.new(n, replicate=True)) if d == axis else out_f[d]
                         for d, n in enumerate(shape)])
    return b.build(operands, [out_f], linear=(tuple(range(len(op.in_shapes))),))


def split_rule(op: OpView) -> Rule:
    # split is linear: split(A1 + A2) = split(A1) + split(A2), piece by piece
    b = RuleBuilder()
    axis = op.params["axis"]
    shape = op.in_shapes[0]
    in_f = [b.new(n, replicate=d == axis) for d, n in enumerate(shape)]
    results = []
    for out in op.out_shapes:
        results.append([b.new(n, replicate=True) if d == axis else in_f[d] for d, n in enumerate(out)])
    return b.build([in_f], results, linear=LINEAR0)


def stack_rule(op: OpView) -> Rule:
    # stack is linear in all operands together, as concatenate: stack(A1 + A2, B1 + B2) = stack(A1, B1) + stack(A2, B2)
    b = RuleBuilder()
    axis = op.params["axis"]
    out = op.out_shapes[0]
    out_f = [b.new(n, replicate=d == axis) for d, n in enumerate(out)]
    operand = [f for d, f in enumerate(out_f) if d != axis]
    return b.build([operand] * len(op.in_shapes), [out_f], linear=(tuple(range(len(op.in_shapes))),))


def unstack_rule(op: OpView) -> Rule:
    # unstack is linear: each piece of A1 + A2 is the sum of the pieces
    b = RuleBuilder()
    axis = op.params["axis"]
    in_f = [b.new(n, replicate=d == axis) for d, n in enumerate(op.in_shapes[0])]
    piece = [f for d, f in enumerate(in_f) if d != axis]
    return b.build([in_f], [piece] * len(op.out_shapes), linear=LINEAR0)


def dynamic_slice_rule(op: OpView) -> Rule:
    # dynamic_slice is linear in the operand: (A1 + A2)[i:] = A1[i:] + A2[i:]
    # A window narrower than its dimension is a masked lookup there (``_windowed``, as gather's indexed dimensions).
    b = RuleBuilder()
    sizes = op.params["slice_sizes"]
    in_f, out_f = _windowed(b, op, [sizes[d] == n for d, n in enumerate(op.in_shapes[0])])
    indices = [[] for _ in op.in_shapes[1:]]
    return b.build([in_f, *indices], [out_f], linear=LINEAR0)


def dynamic_update_slice_rule(op: OpView) -> Rule:
    # dynamic_update_slice is linear in operand and update together: (A1 + A2)[i:] <- (U1 + U2) is the sum of both updates
    # Where the update is narrower than its dimension, the operand may still be split there (a cache over the
    # sequence): each device writes the update's elements that land in its stretch (``local``).
    b = RuleBuilder()
    shape, update = op.in_shapes[0], op.in_shapes[1]
    in_f, up_f = [], []
    for d, n in enumerate(shape):
        if update[d] == n:
            f = b.new(n)
            in_f.append(f)
            up_f.append(f)
        else:
            in_f.append(b.new(n))
            up_f.append(b.new(update[d], replicate=True))
    indices = [[] for _ in op.in_shapes[2:]]
    return b.build([in_f, up_f, *indices], [in_f], linear=((0, 1),))


def iota_rule(op: OpView) -> Rule:
    b = RuleBuilder()
    return b.build([[] for _ in op.in_shapes], [b.fresh_dims(op.out_shapes[0])])


def iota_2x32_shape_rule(op: OpView) -> Rule | None:
    """The PRNG's counters: each element's flat (row-major) index, as high and low 32-bit words.

    Any split works (``run_local`` adds each shard's offsets), where the flat
    index fits in the low word; a larger array falls back.
    """
    shape = op.out_shapes[0]
    if math.prod(shape) >= 2**32:
        return None
    b = RuleBuilder()
    dims = b.fresh_dims(shape)
    return b.build([], [dims, dims])


RULES: dict[str, Callable[[OpView], Rule | None]] = {
    "broadcast_in_dim": broadcast_in_dim_rule,
    "reshape": reshape_rule,
    "transpose": transpose_rule,
    "squeeze": squeeze_rule,
    "expand_dims": expand_dims_rule,
    "slice": slice_rule,
    "pad": pad_rule,
    "rev": rev_rule,
    "concatenate": concatenate_rule,
    "split": split_rule,
    "stack": stack_rule,
    "unstack": unstack_rule,
    "dynamic_slice": dynamic_slice_rule,
    "dynamic_update_slice": dynamic_update_slice_rule,
    "iota": iota_rule,
    "iota_2x32_shape": iota_2x32_shape_rule,
}
