"""Batched linear algebra: factorisations and solves of a stack of matrices.

``cholesky``, ``eigh``, ``qr``, ``svd``, ``lu`` and ``triangular_solve`` (and
the parts and relatives ``jax.lax.linalg`` binds: ``geqrf``, ``householder_product``,
``eig``, ``schur``, ...) work on the last dimensions of their operands, one matrix
(or vector) at a time; the
leading dimensions are a batch that every operand and result shares. The
batch factors split freely (each device factorises its own matrices); the
matrix dimensions are never split. A Cholesky factorisation of
``f32[64, 16, 16]``:

    ([i, j, k])->([i, l, m]) {i=64, j=16, k=16, l=16, m=16} need_replication={j, k, l, m}

``eigh`` returns vectors ``[..., n, n]`` and values ``[..., n]``, ``svd``
values and two matrices, ``lu`` the factors and two index vectors
``[..., m]``: every result starts with the operand's batch dimensions, the
rest stays whole. None is linear. FLOPs are priced as ``n**3`` per matrix
(``n`` its largest matrix dimension), a dense factorisation's order.

``fft`` transforms its trailing dimensions the same way, batched over the
leading ones (and, unlike the factorisations, linearly).
"""

from __future__ import annotations

import math
from typing import Callable

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder
from shardsolve.rules.base import Rule


#: The dimensions of one problem in the first operand, where not a matrix's two (a vector of diagonals, pivots).
CORE_RANK = {"tridiagonal_solve": 1, "lu_pivots_to_permutation": 1}


def batched_rule(op: OpView) -> Rule | None:
    """The shared batch of a batched matrix operation (None where the shapes do not share one)."""
    first = op.in_shapes[0]
    core = CORE_RANK.get(op.primitive, 2)
    if len(first) < core:
        return None
    batch = first[:len(first) - core]
    shapes = list(op.in_shapes) + list(op.out_shapes)
    if any(tuple(s[:len(batch)]) != tuple(batch) for s in shapes):
        return None
    b = RuleBuilder()
    batch_f = [b.new(n) for n in batch]

    def dims(shape):
        return batch_f + [b.new(n, replicate=True) for n in shape[len(batch):]]

    operands = [dims(s) for s in op.in_shapes]
    results = [dims(s) for s in op.out_shapes]
    return b.build(operands, results, flops=float(math.prod(batch)) * float(max(first[len(batch):], default=1)) ** 3)


def fft_rule(op: OpView) -> Rule | None:
    """``fft`` over the trailing ``len(fft_lengths)`` dimensions, batched over the leading ones: those split, the
    transformed ones stay whole (a real transform's result is shorter, ``n // 2 + 1``). FLOPs as XLA's cost
    analysis counts them: 8 per element of the operand (an inverse real transform's shorter complex one too)
    times the product of the transformed lengths' log2.

    The transform is linear, FFT(A1 + A2) = FFT(A1) + FFT(A2), but a pending sum is not carried through it:
    XLA's CPU layout assignment gave the inverse real transform of one (a convolution's kernel gradient taken
    by FFT) a transposed operand layout, which its FFT thunk refuses when the program runs
    (``IsMonotonicWithDim0Major``); the sum is reduced first, as propagation's program does."""
    lengths = tuple(op.params["fft_lengths"])
    shape, out = op.in_shapes[0], op.out_shapes[0]
    k = len(lengths)
    if len(shape) < k or len(out) != len(shape) or tuple(shape[:len(shape) - k]) != tuple(out[:len(out) - k]):
        return None
    b = RuleBuilder()
    batch = [b.new(n) for n in shape[:len(shape) - k]]
    operand = batch + [b.new(n, replicate=True) for n in shape[len(shape) - k:]]
    result = batch + [b.new(n, replicate=True) for n in out[len(out) - k:]]
    logs = math.prod(max(1.0, math.log2(max(n, 2))) for n in lengths)
    return b.build([operand], [result], flops=8.0 * math.prod(shape) * logs)


RULES: dict[str, Callable[[OpView], Rule | None]] = {
    name: batched_rule for name in (
        "cholesky", "eigh", "qr", "svd", "lu", "triangular_solve",
        # their parts and relatives, as ``jax.lax.linalg`` binds them
        "eig", "schur", "hessenberg", "tridiagonal", "tridiagonal_solve", "geqrf", "geqp3", "householder_product",
        "ormqr", "symmetric_product", "lu_pivots_to_permutation",
    )
}
RULES["fft"] = fft_rule
