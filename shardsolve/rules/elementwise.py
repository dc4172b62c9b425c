"""Pointwise primitives: every operand dimension shares its factor with the result.

``mul`` of two ``f32[8, 4]`` values:

    ([i, j], [i, j])->([i, j]) {i=8, j=4} linear={(0), (1)}

Operands of rank 0 (scalars JAX did not broadcast) get ``[]``; a size-1
operand dimension facing a larger result dimension (implicit broadcasting)
gets a factor of its own, so ``mul(f32[8, 4], f32[1, 1])`` is

    ([i, j], [k, l])->([i, j]) {i=8, j=4, k=1, l=1} linear={(0), (1)}

``linear`` lists the operand groups a partial (pending-sum) value may flow
through: each table entry below carries the one-line algebraic reason.
FLOPs per result element are those XLA's cost analysis counts once the
op is compiled (``compiled.cost_analysis()["flops"]``, which the yardstick
prices): one for an op that stays one elementwise HLO op; none for an HLO
transcendental (``exp``, ``log``, ``tanh``, ``erf``...: XLA counts those apart,
as ``transcendentals``); the ops of its expansion for one that JAX or XLA
expands (``erf_inv`` a polynomial of 37, ``threefry2x32`` 197 a pair of words: XLA's CPU backend runs
its twenty rounds as a loop of five trips, and each trip counts, as ``hlo.loop_adjustment`` counts loops).
``tests/test_rules.py`` checks the table against XLA's counts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from shardsolve.graph import OpView
from shardsolve.rules._builder import RuleBuilder, numel
from shardsolve.rules.base import Rule

Linear = tuple[tuple[int, ...], ...]
NONE: Linear = ()
TOGETHER2: Linear = ((0, 1),)
EACH2: Linear = ((0,), (1,))
FIRST: Linear = ((0,),)

# name -> (linear groups, FLOPs per element)
POINTWISE: dict[str, tuple[Linear, float]] = {
    # add is linear in both together: (A1 + A2) + (B1 + B2) = (A1 + B1) + (A2 + B2)
    "add": (TOGETHER2, 1.0),
    # add_any is add: (A1 + A2) + (B1 + B2) = (A1 + B1) + (A2 + B2)
    "add_any": (TOGETHER2, 1.0),
    # sub is linear in both together: (A1 + A2) - (B1 + B2) = (A1 - B1) + (A2 - B2)
    "sub": (TOGETHER2, 1.0),
    # mul is linear in each operand alone: (A1 + A2) * B = A1 * B + A2 * B
    "mul": (EACH2, 1.0),
    # div is linear in the numerator: (A1 + A2) / B = A1 / B + A2 / B
    "div": (FIRST, 1.0),
    # neg is linear: -(A1 + A2) = -A1 + -A2
    "neg": (FIRST, 1.0),
    # copy is the identity: copy(A1 + A2) = A1 + A2
    "copy": (FIRST, 0.0),
    "copy_p": (FIRST, 0.0),
    # stop_gradient is the identity on values: stop_gradient(A1 + A2) = A1 + A2
    "stop_gradient": (FIRST, 0.0),
    # real and imag are R-linear: re(A1 + A2) = re(A1) + re(A2)
    "real": (FIRST, 0.0),
    "imag": (FIRST, 0.0),
    # conj is R-linear: conj(A1 + A2) = conj(A1) + conj(A2)
    "conj": (FIRST, 0.0),
    # reduce_precision rounds, which commutes with sums up to rounding error (like a cast)
    "reduce_precision": (FIRST, 1.0),
    # max and min are not linear: max(A1 + A2, B) != max(A1, B) + max(A2, B)
    "max": (NONE, 1.0),
    "min": (NONE, 1.0),
    # the rest are nonlinear: f(A1 + A2) != f(A1) + f(A2)
    "abs": (NONE, 1.0),
    "sign": (NONE, 1.0),
    "floor": (NONE, 1.0),
    "ceil": (NONE, 1.0),
    "round": (NONE, 1.0),
    "square": (NONE, 1.0),
    "integer_pow": (NONE, 1.0),  # per multiply: ``integer_pow_flops``
    "rem": (NONE, 1.0),
    "is_finite": (NONE, 1.0),
    "nextafter": (NONE, 23.0),
    "and": (NONE, 1.0),
    "or": (NONE, 1.0),
    "not": (NONE, 1.0),
    "xor": (NONE, 1.0),
    "shift_left": (NONE, 1.0),
    "shift_right_logical": (NONE, 1.0),
    "shift_right_arithmetic": (NONE, 1.0),
    "population_count": (NONE, 1.0),
    "clz": (NONE, 1.0),
    "eq": (NONE, 1.0),
    "ne": (NONE, 1.0),
    "lt": (NONE, 1.0),
    "le": (NONE, 1.0),
    "gt": (NONE, 1.0),
    "ge": (NONE, 1.0),
    # total-order comparisons (NaNs and signed zeros ordered), as jnp.searchsorted and jnp.histogram compare
    "eq_to": (NONE, 1.0),
    "le_to": (NONE, 1.0),
    "lt_to": (NONE, 1.0),
    "clamp": (NONE, 1.0),
    "complex": (NONE, 1.0),
    "bitcast_convert_type": (NONE, 0.0),
    "mulhi": (NONE, 1.0),
    "threefry2x32": (NONE, 197.0),
    "exp": (NONE, 0.0),
    "exp2": (NONE, 1.0),
    "expm1": (NONE, 0.0),
    "log": (NONE, 0.0),
    "log1p": (NONE, 0.0),
    "tanh": (NONE, 0.0),
    "logistic": (NONE, 3.0),
    "sin": (NONE, 0.0),
    "cos": (NONE, 0.0),
    "tan": (NONE, 0.0),
    "asin": (NONE, 5.0),
    "acos": (NONE, 3.0),
    "atan": (NONE, 0.0),
    "sinh": (NONE, 10.0),
    "cosh": (NONE, 3.0),
    "asinh": (NONE, 11.0),
    "acosh": (NONE, 7.0),
    "atanh": (NONE, 6.0),
    "atan2": (NONE, 0.0),
    "sqrt": (NONE, 0.0),
    "rsqrt": (NONE, 0.0),
    "cbrt": (NONE, 0.0),
    "pow": (NONE, 0.0),
    "erf": (NONE, 0.0),
    "erfc": (NONE, 60.0),
    "erf_inv": (NONE, 37.0),
    "lgamma": (NONE, 52.0),
    "digamma": (NONE, 73.0),
    "igamma": (NONE, 268.0),
    "igammac": (NONE, 268.0),
    "bessel_i0e": (NONE, 83.0),
    "bessel_i1e": (NONE, 83.0),
    "igamma_grad_a": (NONE, 539.0),
    "polygamma": (NONE, 71.0),
    "zeta": (NONE, 124.0),
    "regularized_incomplete_beta": (NONE, 198.0),
}


def _is_float(dtype: object) -> bool:
    if dtype is None:
        return False
    import jax.numpy as jnp  # local: only dtype queries, no tracing

    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return False


def pointwise_rule(op: OpView, linear: Sequence[Sequence[int]] = (), flops_per_element: float = 1.0) -> Rule:
    """Operands aligned to the (first) result from the right, NumPy style.

    Operand dimensions equal to the result's share its factor; a smaller one
    (size 1) gets a factor of its own; any other mismatch needs replication.
    All results (``threefry2x32`` has two) share the first result's factors.
    """
    b = RuleBuilder()
    out = op.out_shapes[0]
    out_f = b.fresh_dims(out)
    operands = []
    for shape in op.in_shapes:
        offset = len(out) - len(shape)
        dims = []
        for d, n in enumerate(shape):
            target = d + offset
            if 0 <= target < len(out) and n == out[target]:
                dims.append(out_f[target])
            else:
                dims.append(b.new(n, replicate=n != 1))
        operands.append(dims)
    results = []
    for shape in op.out_shapes:
        results.append(out_f if tuple(shape) == tuple(out) else b.fresh_dims(shape, replicate=True))
    return b.build(operands, results, linear=linear, flops=flops_per_element * numel(out))


def integer_pow_flops(y: int) -> float:
    """XLA's FLOPs per element of ``x ** y``: its multiplies by repeated squaring, and a division where ``y < 0``."""
    n = abs(int(y))
    return float(max(0, n.bit_length() + bin(n).count("1") - 2) + (y < 0))


def integer_pow_rule(op: OpView) -> Rule:
    return pointwise_rule(op, NONE, integer_pow_flops(op.params.get("y", 2)))


#: FLOPs an element of a total-order comparison of floats (``eq_to``, ``le_to``, ``lt_to``: ``jnp.sort``'s and
#: ``searchsorted``'s) costs as XLA counts it: the floats are mapped to integers that order alike first.
#: Integers compare as they are (the table's one).
TOTAL_ORDER_FLOPS = 9.0


def total_order_rule(op: OpView) -> Rule:
    linear, per = POINTWISE[op.primitive]
    floats = bool(op.in_dtypes) and np.dtype(op.in_dtypes[0]).kind in "fc"
    return pointwise_rule(op, linear, TOTAL_ORDER_FLOPS if floats else per)


def _table_rule(name: str) -> Callable[[OpView], Rule]:
    linear, per = POINTWISE[name]
    return lambda op: pointwise_rule(op, linear, per)


def select_n_rule(op: OpView) -> Rule:
    # select_n is linear in the cases together: select(p, A1 + A2, B1 + B2) = select(p, A1, B1) + select(p, A2, B2)
    return pointwise_rule(op, (tuple(range(1, len(op.in_shapes))),), 1.0)


def convert_element_type_rule(op: OpView) -> Rule:
    # a cast between floating types is linear up to rounding: f32(A1 + A2) ~ f32(A1) + f32(A2);
    # to or from integers it is not (int(0.5 + 0.5) != int(0.5) + int(0.5))
    floats = all(_is_float(d) for d in tuple(op.in_dtypes) + tuple(op.out_dtypes)) and op.in_dtypes and op.out_dtypes
    return pointwise_rule(op, FIRST if floats else NONE, 1.0)


def identity_rule(op: OpView) -> Rule:
    """Operand ``k`` is result ``k`` (``device_put``, ``optimization_barrier``, ``sharding_constraint``)."""
    # the identity is linear in all operands together: id(A1 + A2) = A1 + A2
    b = RuleBuilder()
    dims = [b.fresh_dims(shape) for shape in op.in_shapes]
    return b.build(dims, dims, linear=(tuple(range(len(dims))),) if dims else (), flops=0.0)


RULES: dict[str, Callable[[OpView], Rule]] = {name: _table_rule(name) for name in POINTWISE}
RULES["integer_pow"] = integer_pow_rule
for _name in ("eq_to", "le_to", "lt_to"):
    RULES[_name] = total_order_rule
RULES["select_n"] = select_n_rule
RULES["convert_element_type"] = convert_element_type_rule
for _name in ("device_put", "optimization_barrier", "sharding_constraint"):
    RULES[_name] = identity_rule
