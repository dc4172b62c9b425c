"""Sharding rules for JAX primitives, one family per module.

``rule_for(op)`` returns the factor-notation rule of one jaxpr equation, or
``None`` when the primitive has no rule; the planner then uses
``fallback_rule(op)`` (every dimension needs replication) and reports the
primitive as a fallback.

    >>> from shardsolve.graph import OpView
    >>> op = OpView("dot_general", {"dimension_numbers": (((1,), (0,)), ((), ()))},
    ...             ((8, 4), (4, 8)), ((8, 8),))
    >>> str(rule_for(op))
    '([i, j], [j, k])->([i, k]) {i=8, j=4, k=8} reduction={j} linear={(0), (1)}'
    >>> str(fallback_rule(OpView("while", {}, ((8, 4),), ((8, 4),))))
    '([i, j])->([k, l]) {i=8, j=4, k=8, l=4} need_replication={i, j, k, l}'

Families: ``elementwise`` (pointwise tables, casts, ``select_n``, identities),
``structural`` (broadcast, reshape, transpose, slicing, padding, iota),
``contraction`` (``dot_general``, ``ragged_dot_general``), ``reduction`` (reductions, scans, sorts),
``indexing`` (``gather``, the scatters), ``window`` (convolutions, pools
and the max pool's gradient), ``linalg`` (batched factorisations and solves).
``local`` runs a rule's strategy on local shards for the rewriter.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from shardsolve.graph import OpView
from shardsolve.rules import contraction, elementwise, indexing, linalg, reduction, structural, window
from shardsolve.rules._builder import RuleBuilder, numel
from shardsolve.rules.base import Rule, Strategy

__all__ = ["RULES", "OpView", "Rule", "Strategy", "fallback_rule", "has_rule", "rule_for"]

RULES: dict[str, Callable[[OpView], Rule | None]] = {}
for _family in (elementwise, structural, contraction, reduction, indexing, window, linalg):
    for _name, _make in _family.RULES.items():
        if _name in RULES:
            raise RuntimeError(f"primitive {_name!r} has rules in two families")
        RULES[_name] = _make


def has_rule(primitive: str) -> bool:
    return primitive in RULES


def rule_for(op: OpView) -> Rule | None:
    """The rule of one equation, or ``None`` (use ``fallback_rule`` and report it).

    Rules are immutable and depend only on the primitive, shapes, dtypes and
    parameters, so repeated equations (every layer of a model) share one.
    """
    make = RULES.get(op.primitive)
    if make is None:
        return None
    key = rule_key(op)
    if key is not None:
        hit = _CACHE.get(key, _MISSING)
        if hit is not _MISSING:
            return hit  # type: ignore[return-value]
    try:
        rule = make(op)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        # parameters this rule does not understand (a newer JAX, an unusual form)
        rule = None
    if rule is not None and rule.linear:
        rule = _sound_linear_groups(rule, op)
    if key is not None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = rule
    return rule


_MISSING = object()
_CACHE_SIZE = 65536
_CACHE: dict[tuple, Rule | None] = {}


def rule_key(op: OpView) -> tuple | None:
    """What a rule depends on (primitive, shapes, dtypes, parameters), or None when a parameter is unhashable."""
    try:
        key = (
            op.primitive,
            op.in_shapes,
            op.out_shapes,
            op.in_dtypes,
            op.out_dtypes,
            tuple(sorted(op.params.items())),
        )
        hash(key)
    except TypeError:  # an unhashable parameter: build the rule every time
        return None
    return key


# linear only over floating types: (3 + 4) // 2 != 3 // 2 + 4 // 2
_LINEAR_ONLY_FOR_FLOATS = frozenset({"div"})


def _sound_linear_groups(rule: Rule, op: OpView) -> Rule:
    """Drop linear groups that summands of these dtypes cannot honour.

    Booleans have no sums, so no operand group holding one (and no op
    producing one) passes partial values; integer division is not linear.
    """
    kinds = [_dtype_kind(d) for d in op.in_dtypes]
    if any(_dtype_kind(d) == "b" for d in op.out_dtypes):
        keep: tuple[tuple[int, ...], ...] = ()
    else:
        keep = tuple(g for g in rule.linear if not any(k < len(kinds) and kinds[k] == "b" for k in g))
        if op.primitive in _LINEAR_ONLY_FOR_FLOATS and not all(_dtype_kind(d) in "fc" for d in op.out_dtypes):
            keep = ()
    return rule if keep == rule.linear else dataclasses.replace(rule, linear=keep)


def _dtype_kind(dtype: object) -> str:
    """NumPy's kind letter ('b', 'i', 'u', 'f', 'c'), with bfloat16 and friends as 'f'."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        return ""
    if dt.kind == "V" and "float" in dt.name:  # ml_dtypes types (bfloat16, float8_*)
        return "f"
    return dt.kind


def fallback_rule(op: OpView) -> Rule:
    """Every dimension of every operand and result needs replication."""
    b = RuleBuilder()
    operands = [b.fresh_dims(s, replicate=True) for s in op.in_shapes]
    results = [b.fresh_dims(s, replicate=True) for s in op.out_shapes]
    return b.build(operands, results, flops=sum(numel(s) for s in op.out_shapes))
