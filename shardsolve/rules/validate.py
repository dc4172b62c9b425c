"""Numerical validation of rules: run strategies on sharded data and compare.

For one jaxpr equation and one strategy, lay every operand out as
``strategy.operands[k]`` on a real mesh (a partial operand as random summands
that add up to the true value), run ``local.run_local`` inside
``jax.shard_map``, gather every device's result shard, combine partial
results (sum, max or min over their partial axes), check that devices which
should agree do, and compare with the primitive run unsharded. This is
DTensor's ``strategy_validation.py`` idea applied to factor rules.

A dimension split unevenly is laid out as SpmdPartitioner lays it out, every
shard ``ceil(n / shards)`` long, and its padding is filled with garbage (NaN,
or a large integer, or ``True``), so a kernel that reads padding where it
should not shows up as a mismatch; results are compared on their logical extent.

    >>> import jax, jax.numpy as jnp
    >>> from shardsolve.mesh import MeshSpec
    >>> eqn = find_equation(lambda a, b: a @ b, jnp.ones((8, 4)), jnp.ones((4, 8)), primitive="dot_general")
    >>> op = op_view(eqn)
    >>> mesh = MeshSpec.parse(f"x={len(jax.devices())}")
    >>> rule = rule_for(op)
    >>> all(check(eqn, rule, s, mesh, seed=0) is None for s in rule.strategies(mesh)[:2])
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.graph import OpView
from shardsolve.mesh import MeshSpec
from shardsolve.rules import fallback_rule, rule_for
from shardsolve.rules.base import Rule, Strategy
from shardsolve.rules.local import run_local
from shardsolve.sharding import Sharding

# -- equations ----------------------------------------------------------------


def equations(jaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr``, those of nested calls (``jaxpr``/``call_jaxpr`` parameters) before the call."""
    for eqn in jaxpr.eqns:
        for key in ("jaxpr", "call_jaxpr"):
            sub = eqn.params.get(key)
            if sub is not None:
                yield from equations(getattr(sub, "jaxpr", sub))
        yield eqn


def find_equation(fn: Callable, *args: Any, primitive: str, index: int = 0):
    """The ``index``-th equation of ``primitive`` in ``fn``'s jaxpr (nested calls included)."""
    found = [e for e in equations(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == primitive]
    if len(found) <= index:
        raise LookupError(f"no equation #{index} of {primitive!r} in the jaxpr of {fn}")
    return found[index]


def op_view(eqn) -> OpView:
    """What a rule sees of a jaxpr equation (as ``graph.Graph.view`` gives it for a planned op)."""
    return OpView(
        eqn.primitive.name,
        eqn.params,
        tuple(tuple(v.aval.shape) for v in eqn.invars),
        tuple(tuple(v.aval.shape) for v in eqn.outvars),
        tuple(v.aval.dtype for v in eqn.invars),
        tuple(v.aval.dtype for v in eqn.outvars),
        prim=eqn.primitive,
    )


def literal_operands(eqn) -> tuple[int, ...]:
    return tuple(k for k, v in enumerate(eqn.invars) if isinstance(v, jax.extend.core.Literal))


def rule_of(eqn) -> Rule:
    op = op_view(eqn)
    return rule_for(op) or fallback_rule(op)


# -- data ---------------------------------------------------------------------


def random_operands(eqn, rng: np.random.Generator, int_range: tuple[int, int] = (0, 4)) -> list[np.ndarray]:
    """Values for the equation's operands: literals as they are, others random."""
    out = []
    for v in eqn.invars:
        if isinstance(v, jax.extend.core.Literal):
            out.append(np.asarray(v.val))
            continue
        shape, dtype = v.aval.shape, np.dtype(v.aval.dtype)
        if dtype == np.bool_:
            out.append(rng.random(shape) < 0.5)
        elif jnp.issubdtype(dtype, jnp.integer):
            out.append(rng.integers(int_range[0], int_range[1], size=shape).astype(dtype))
        else:
            out.append(rng.standard_normal(shape).astype(dtype))
    return out


def _spec(sharding: Sharding, lead: Sequence[str]) -> PartitionSpec:
    entries: list[Any] = list(lead)
    entries += [None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in sharding.dims]
    return PartitionSpec(*entries)


def _summands(value: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random arrays (stacked on axis 0) that add up to ``value``."""
    value = np.asarray(value)
    if n == 1:
        return value[None]
    if jnp.issubdtype(value.dtype, jnp.integer):
        parts = rng.integers(-3, 4, size=(n - 1,) + value.shape).astype(value.dtype)
    else:
        parts = (rng.standard_normal((n - 1,) + value.shape) * 0.5).astype(value.dtype)
    last = (value - parts.sum(axis=0, dtype=value.dtype)).astype(value.dtype)
    return np.concatenate([parts, last[None]], axis=0)


# -- the check ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Why a strategy failed: which result and by how much (or the exception)."""

    strategy: str
    result: int
    message: str

    def __str__(self) -> str:
        return f"strategy {self.strategy} result {self.result}: {self.message}"


def expected_results(eqn, operands: Sequence[np.ndarray]) -> list[np.ndarray]:
    out = eqn.primitive.bind(*[jnp.asarray(x) for x in operands], **eqn.params)
    return [np.asarray(o) for o in (out if eqn.primitive.multiple_results else [out])]


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One strategy's sharded inputs and the shard_map that runs it."""

    strategy: Strategy
    inputs: tuple[Any, ...]
    run: Callable[..., Any]
    extras: tuple[tuple[str, ...], ...]  # per result: mesh axes stacked in front (not splitting it)


def _garbage(dtype: np.dtype) -> Any:
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        return 77
    return np.nan


def _padded(value: np.ndarray, sharding: Sharding, mesh: MeshSpec) -> np.ndarray:
    """``value`` padded past the end of its unevenly split dimensions with garbage."""
    value = np.asarray(value)
    if value.ndim != sharding.ndim or sharding.divides(value.shape, mesh):
        return value
    local = sharding.local_shape(value.shape, mesh)
    shape = tuple(c * sharding.dim_shards(d, mesh) for d, c in enumerate(local))
    out = np.full(shape, _garbage(value.dtype), dtype=value.dtype)
    out[tuple(slice(0, n) for n in value.shape)] = value
    return out


def _prepare(op: OpView, rule: Rule, strategy: Strategy, mesh: MeshSpec, jax_mesh, operands, rng,
             clear_padding: bool = True) -> _Prepared:
    ins, in_specs, leads = [], [], []
    for value, sharding in zip(operands, strategy.operands):
        lead = tuple(sharding.partial)
        stacked = _padded(value, sharding, mesh)
        for a in reversed(lead):  # one leading dimension per partial axis, in ``lead`` order
            stacked = _summands(stacked, mesh.axis(a).size, rng)
        spec = _spec(sharding, lead)
        ins.append(jax.device_put(stacked, NamedSharding(jax_mesh, spec)))
        in_specs.append(spec)
        leads.append(len(lead))
    extras, out_specs = [], []
    for sharding in strategy.results:
        used = set(sharding.axes)
        extra = tuple(a for a in mesh.names if a not in used)
        extras.append(extra)
        out_specs.append(_spec(sharding, extra))

    def local(*xs):
        xs = [x.reshape(x.shape[n:]) for x, n in zip(xs, leads)]
        outs = run_local(op, rule, strategy, mesh, xs, jax.lax.axis_index, clear_padding=clear_padding)
        return tuple(o.reshape((1,) * len(e) + o.shape) for o, e in zip(outs, extras))

    run = jax.shard_map(local, mesh=jax_mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs), check_vma=False)
    return _Prepared(strategy, tuple(ins), run, tuple(extras))


def _compare(prepared: _Prepared, got, expected, rtol: float, atol: float) -> Mismatch | None:
    strategy = prepared.strategy
    for k, (g, e, sharding, extra) in enumerate(zip(got, expected, strategy.results, prepared.extras)):
        g = np.asarray(g)
        if g.ndim == len(extra) + e.ndim:  # drop the padding of uneven splits
            g = g[(slice(None),) * len(extra) + tuple(slice(0, n) for n in e.shape)]
        for a in extra:  # leading dims, one per extra axis, in mesh order; consume from the front
            if a in sharding.partial:
                if jnp.issubdtype(g.dtype, jnp.floating):
                    g = g.astype(np.float64)
                g = {"sum": np.sum, "max": np.max, "min": np.min}[sharding.reduce_op](g, axis=0)
            else:
                first = g[0]
                if not all(_close(first, g[i], rtol, atol) for i in range(1, g.shape[0])):
                    return Mismatch(strategy.describe(), k, f"devices along {a!r} disagree on a replicated result")
                g = first
        if g.shape != e.shape:
            return Mismatch(strategy.describe(), k, f"shape {g.shape} != expected {e.shape}")
        if not _close(g, e, rtol, atol):
            diff = np.abs(g.astype(np.float64) - e.astype(np.float64))
            err = float(np.nanmax(diff)) if g.size and not np.isnan(diff).all() else float("nan") if g.size else 0.0
            return Mismatch(strategy.describe(), k, f"values differ (max abs error {err:.3g})")
    return None


def check_many(
    eqn,
    rule: Rule,
    strategies: Sequence[Strategy],
    mesh: MeshSpec,
    *,
    seed: int = 0,
    operands: Sequence[np.ndarray] | None = None,
    int_range: tuple[int, int] = (0, 4),
    rtol: float = 1e-4,
    atol: float = 1e-4,
    clear_padding: bool = True,
) -> list[Mismatch]:
    """Run each of ``strategies`` for ``eqn`` on ``mesh`` and compare with the unsharded result.

    All strategies run in one compiled program (compiles dominate the cost);
    when that fails, each runs alone so the failure is pinned to its strategy.
    ``clear_padding``: passed to ``local.run_local``.
    """
    rng = np.random.default_rng(seed)
    if operands is None:
        operands = random_operands(eqn, rng, int_range)
    expected = expected_results(eqn, operands)
    op = op_view(eqn)
    jax_mesh = mesh.jax_mesh()
    prepared = [_prepare(op, rule, s, mesh, jax_mesh, operands, rng, clear_padding) for s in strategies]

    def run_all(*groups):
        return [p.run(*xs) for p, xs in zip(prepared, groups)]

    try:
        results = jax.jit(run_all)(*[p.inputs for p in prepared])
    except Exception:  # noqa: BLE001 - rerun one by one to name the failing strategy
        results = []
        for p in prepared:
            try:
                results.append(jax.jit(p.run)(*p.inputs))
            except Exception as err:  # noqa: BLE001
                results.append(err)
    out = []
    for p, got in zip(prepared, results):
        if isinstance(got, Exception):
            out.append(Mismatch(p.strategy.describe(), -1, f"{type(got).__name__}: {got}"))
            continue
        m = _compare(p, got, expected, rtol, atol)
        if m is not None:
            out.append(m)
    return out


def check(eqn, rule: Rule, strategy: Strategy, mesh: MeshSpec, **kwargs: Any) -> Mismatch | None:
    """``check_many`` for one strategy: the mismatch, or ``None`` when it agrees."""
    bad = check_many(eqn, rule, [strategy], mesh, **kwargs)
    return bad[0] if bad else None


def _close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.integer):
        return bool(np.array_equal(a, b))
    wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64  # (eig's values)
    return bool(np.allclose(a.astype(wide), b.astype(wide), rtol=rtol, atol=atol, equal_nan=True))


def sample(strategies: Sequence[Strategy], n: int) -> list[Strategy]:
    """Up to ``n`` strategies, deterministically: evenly spaced, plus the first
    few with partial operands and with reductions, so every kind is exercised."""
    if len(strategies) <= n:
        return list(strategies)
    step = len(strategies) / n
    picked = {int(k * step) for k in range(n)}
    with_partial_in = [k for k, s in enumerate(strategies) if s.partial_via]
    with_reduction = [k for k, s in enumerate(strategies) if not s.partial_via and any(r.partial for r in s.results)]
    picked |= set(with_partial_in[:: max(1, len(with_partial_in) // 3)][:3])
    picked |= set(with_reduction[:: max(1, len(with_reduction) // 3)][:3])
    return [strategies[k] for k in sorted(picked)]


def validate(
    eqn,
    mesh: MeshSpec,
    *,
    limit: int | None = 20,
    seed: int = 0,
    int_range: tuple[int, int] = (0, 4),
    rtol: float = 1e-4,
    atol: float = 1e-4,
    batch: int = 32,
) -> tuple[int, list[Mismatch]]:
    """Check (a sample of) every strategy of ``eqn``'s rule on ``mesh``; returns (checked, mismatches)."""
    rule = rule_of(eqn)
    strategies = rule.strategies(mesh, fixed_operands=literal_operands(eqn))
    chosen = strategies if limit is None else sample(strategies, limit)
    operands = random_operands(eqn, np.random.default_rng(seed), int_range)
    bad = []
    for start in range(0, len(chosen), batch):
        part = chosen[start : start + batch]
        bad += check_many(eqn, rule, part, mesh, seed=seed + start, operands=operands, rtol=rtol, atol=atol)
    return len(chosen), bad
