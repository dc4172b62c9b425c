"""Trace a function to one flat jaxpr, without allocating its arguments.

Nested calls (``jit``/``pjit``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat``/``checkpoint``, ``closed_call``) are inlined: the jaxpr is evaluated
by a small interpreter that steps into their bodies, and the interpreter is
traced again with ``jax.make_jaxpr``. Control flow (``scan``, ``while``,
``cond``) stays as one structured equation each.

    >>> import jax, jax.numpy as jnp
    >>> t = trace(lambda x: jax.jit(jnp.sin)(x) * 2, jax.ShapeDtypeStruct((4,), jnp.float32))
    >>> [e.primitive.name for e in t.jaxpr.eqns]
    ['sin', 'mul']
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

from shardsolve.errors import ShardsolveError

INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
                     "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})


@dataclass(frozen=True)
class Traced:
    """A flat closed jaxpr with the pytree structure of its inputs and outputs."""

    jaxpr: Any  # jax.extend.core.ClosedJaxpr, nested calls inlined
    in_tree: Any  # PyTreeDef of the positional arguments tuple
    out_tree: Any  # PyTreeDef of the result
    in_avals: tuple  # ShapedArray per flattened input
    out_avals: tuple  # ShapedArray per flattened output


def abstractify(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of an array-like argument (arrays are never copied)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    try:
        import numpy as np

        arr = np.asarray(x)
    except Exception as e:
        raise ShardsolveError(f"argument of type {type(x).__name__} is not an array; pass arrays or jax.ShapeDtypeStruct") from e
    return jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype))


def _inner(eqn) -> tuple[Any, Sequence[Any]]:
    """The body of an inlinable equation as (open jaxpr, its consts)."""
    params = eqn.params
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params:
            body = params[key]
            if hasattr(body, "consts"):  # ClosedJaxpr
                return body.jaxpr, body.consts
            return body, ()
    raise ShardsolveError(f"cannot inline {eqn.primitive.name}: no body found in its params {sorted(params)}")


def _source_context(eqn):
    """Keep each equation's name stack, so compiled HLO ``op_name``s still point at the source."""
    try:
        from jax._src import source_info_util

        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        return source_info_util.user_context(eqn.source_info.traceback, name_stack=stack)
    except Exception:  # private API moved: lose the names, keep working
        return contextlib.nullcontext()


def eval_inlined(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate an open jaxpr, stepping into nested calls instead of binding them."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _source_context(eqn):
            if eqn.primitive.name in INLINED:
                # For custom_jvp/vjp calls, ``num_consts`` leading arguments are
                # ordinary arguments of the body: nothing to split off.
                body, body_consts = _inner(eqn)
                outvals = eval_inlined(body, body_consts, *invals)
            else:
                outvals = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outvals = [outvals]
        for var, val in zip(eqn.outvars, outvals):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def trace(fun: Callable, *args: Any) -> Traced:
    """Trace ``fun(*args)`` to a flat closed jaxpr; ``args`` may be ``ShapeDtypeStruct``s."""
    if not callable(fun):
        raise ShardsolveError(f"expected a function to plan, got {type(fun).__name__}")
    abstract = jax.tree_util.tree_map(abstractify, args)
    leaves, in_tree = jax.tree_util.tree_flatten(abstract)
    try:
        nested, out_shape = jax.make_jaxpr(fun, return_shape=True)(*abstract)
    except ShardsolveError:
        raise
    except Exception as e:
        raise ShardsolveError(f"tracing the function failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    out_tree = jax.tree_util.tree_structure(out_shape)

    def flat(*flat_args):
        return eval_inlined(nested.jaxpr, nested.consts, *flat_args)

    closed = jax.make_jaxpr(flat)(*leaves)
    return Traced(
        jaxpr=closed,
        in_tree=in_tree,
        out_tree=out_tree,
        in_avals=tuple(v.aval for v in closed.jaxpr.invars),
        out_avals=tuple(v.aval for v in closed.jaxpr.outvars),
    )
