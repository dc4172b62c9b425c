"""Random small programs, meshes and annotations for the rewriter's property tests.

Shared by ``tests/test_lower.py`` (a deterministic slice) and
``experiments/fuzz_lower.py`` (a longer campaign). A program is drawn from a
seed: a few input arrays, then chains and DAGs of ``dot_general``/einsum,
elementwise ops, reductions, reshapes, transposes, broadcasts,
concatenations and slices over the values made so far, and one to three of
the values as outputs. Shapes are small (dimensions 2 to 8; with
``uneven=True`` also 3 and 6, and annotations that split them unevenly).

``random_solver(seed)`` stands in for ``shardsolve.encodings.solve``: it picks
a random strategy per node among those every incoming reshard allows, so a
planned program exercises arbitrary strategies, not only optimal ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

MESHES = (
    "x=2", "x=4", "x=8",
    "a=2,b=2", "a=2,b=4", "a=4,b=2", "a=2,b=1,c=4",
    "a=2,b=2,c=2",
)  # fmt: skip

DIMS = (2, 4, 8)


@dataclass
class Program:
    """A drawn program: ``fun(*args)``, its arguments, its description and pins."""

    fun: Callable
    args: tuple
    text: str
    mesh: str
    in_specs: tuple
    out_specs: Any
    lines: list[str] = field(default_factory=list)


def _rand_shape(rng: random.Random, rank: int) -> tuple[int, ...]:
    return tuple(rng.choice(DIMS) for _ in range(rank))


def draw_program(seed: int, *, max_ops: int = 6, uneven: bool = False) -> Program:
    """A random program with its mesh and annotations, all from ``seed``."""
    rng = random.Random(seed)
    mesh = rng.choice(MESHES)
    dims = DIMS + ((3, 6) if uneven else ())
    shapes: list[tuple[int, ...]] = []  # shapes of the inputs
    n_inputs = rng.randint(1, 2)
    for _ in range(n_inputs):
        shapes.append(tuple(rng.choice(dims) for _ in range(rng.randint(1, 3))))
    steps: list[tuple[str, tuple]] = []  # (kind, params) over the value list
    vshapes = list(shapes)
    n_ops = rng.randint(1, max_ops)
    for _ in range(n_ops):
        k = rng.randrange(len(vshapes))
        s = vshapes[k]
        kind = rng.choice(
            ["dot", "dot", "unary", "binary", "bias", "reduce", "reshape", "transpose", "broadcast",
             "concat", "slice"]
        )
        if kind == "dot":
            # contract the last dim of value k with a new input (last, n) or a batched einsum
            if len(s) == 3 and rng.random() < 0.5:
                other = (s[0], s[2], rng.choice(dims))
                shapes.append(other)
                vshapes.append(other)
                steps.append(("input", (len(vshapes) - 1,)))
                steps.append(("einsum", (k, len(vshapes) - 1, "bij,bjk->bik")))
                vshapes.append((s[0], s[1], other[2]))
                continue
            other = (s[-1], rng.choice(dims))
            shapes.append(other)
            vshapes.append(other)
            steps.append(("input", (len(vshapes) - 1,)))
            steps.append(("dot", (k, len(vshapes) - 1)))
            vshapes.append(s[:-1] + (other[1],))
        elif kind == "unary":
            fn = rng.choice(["tanh", "sin", "neg", "exp_small", "square"])
            steps.append(("unary", (k, fn)))
            vshapes.append(s)
        elif kind == "binary":
            same = [j for j, t in enumerate(vshapes) if t == s]
            j = rng.choice(same)
            fn = rng.choice(["add", "mul", "sub", "max"])
            if j == k and fn == "max":  # XLA folds max(x, x) to x: a simplification no plan predicts
                fn = "add"
            steps.append(("binary", (k, j, fn)))
            vshapes.append(s)
        elif kind == "bias":
            shapes.append((s[-1],))
            vshapes.append((s[-1],))
            steps.append(("input", (len(vshapes) - 1,)))
            steps.append(("bias", (k, len(vshapes) - 1)))
            vshapes.append(s)
        elif kind == "reduce":
            if len(s) < 2:
                continue
            axis = rng.randrange(len(s))
            fn = rng.choice(["sum", "max", "sum"])
            steps.append(("reduce", (k, axis, fn)))
            vshapes.append(s[:axis] + s[axis + 1:])
        elif kind == "reshape":
            if len(s) >= 2 and rng.random() < 0.6:
                d = rng.randrange(len(s) - 1)
                new = s[:d] + (s[d] * s[d + 1],) + s[d + 2:]
            else:
                d = rng.randrange(len(s))
                if s[d] % 2:
                    continue
                new = s[:d] + (2, s[d] // 2) + s[d + 1:]
                if len(new) > 4:
                    continue
            steps.append(("reshape", (k, new)))
            vshapes.append(new)
        elif kind == "transpose":
            if len(s) < 2:
                continue
            perm = list(range(len(s)))
            rng.shuffle(perm)
            steps.append(("transpose", (k, tuple(perm))))
            vshapes.append(tuple(s[p] for p in perm))
        elif kind == "broadcast":
            if len(s) >= 3:
                continue
            d = rng.randrange(len(s) + 1)
            n = rng.choice(dims)
            steps.append(("broadcast", (k, d, n)))
            vshapes.append(s[:d] + (n,) + s[d:])
        elif kind == "concat":
            same = [j for j, t in enumerate(vshapes) if t == s]
            j = rng.choice(same)
            axis = rng.randrange(len(s))
            steps.append(("concat", (k, j, axis)))
            vshapes.append(s[:axis] + (2 * s[axis],) + s[axis + 1:])
        elif kind == "slice":
            axis = rng.randrange(len(s))
            if s[axis] < 2:
                continue
            start = rng.randrange(0, s[axis] // 2 + 1)
            stop = rng.randrange(start + 1, s[axis] + 1)
            steps.append(("slice", (k, axis, start, stop)))
            vshapes.append(s[:axis] + (stop - start,) + s[axis + 1:])
    # Inputs appear in value order: value ids 0..n_inputs-1, then steps may add inputs.
    n_values = len(vshapes)
    outs = sorted({n_values - 1} | {rng.randrange(n_inputs, n_values) for _ in range(rng.randint(0, 2))
                                    if n_values > n_inputs})
    input_values = list(range(n_inputs)) + [p[0] for kind, p in steps if kind == "input"]

    def fun(*args):
        vals: dict[int, Any] = {}
        it = iter(args)
        for v in range(n_inputs):
            vals[v] = next(it)
        nxt = n_inputs
        for kind, p in steps:
            if kind == "input":
                vals[p[0]] = next(it)
                nxt = p[0] + 1
                continue
            vals[nxt] = _apply(kind, p, vals)
            nxt += 1
        return tuple(vals[o] for o in outs)

    key = np.random.default_rng(seed)
    args = tuple(jnp.asarray(key.uniform(-1, 1, vshapes[v]).astype(np.float32)) for v in input_values)
    text = _describe(n_inputs, steps, vshapes, outs, input_values)
    in_specs = tuple(_random_spec(rng, vshapes[v], mesh, uneven) for v in input_values)
    out_specs = tuple(_random_spec(rng, vshapes[o], mesh, uneven) if rng.random() < 0.3 else None for o in outs)
    return Program(fun, args, text, mesh, in_specs, out_specs)


def _apply(kind: str, p: tuple, vals: dict) -> Any:
    if kind == "dot":
        return vals[p[0]] @ vals[p[1]]
    if kind == "einsum":
        return jnp.einsum(p[2], vals[p[0]], vals[p[1]])
    if kind == "unary":
        x = vals[p[0]]
        return {"tanh": jnp.tanh, "sin": jnp.sin, "neg": jnp.negative,
                "exp_small": lambda y: jnp.exp(0.1 * y), "square": jnp.square}[p[1]](x)
    if kind == "binary":
        a, b = vals[p[0]], vals[p[1]]
        return {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}[p[2]](a, b)
    if kind == "bias":
        return vals[p[0]] + vals[p[1]]
    if kind == "reduce":
        x = vals[p[0]]
        return jnp.sum(x, axis=p[1]) if p[2] == "sum" else jnp.max(x, axis=p[1])
    if kind == "reshape":
        return jnp.reshape(vals[p[0]], p[1])
    if kind == "transpose":
        return jnp.transpose(vals[p[0]], p[1])
    if kind == "broadcast":
        x = vals[p[0]]
        y = jnp.expand_dims(x, p[1])
        shape = list(y.shape)
        shape[p[1]] = p[2]
        return jnp.broadcast_to(y, tuple(shape))
    if kind == "concat":
        return jnp.concatenate([vals[p[0]], vals[p[1]]], axis=p[2])
    if kind == "slice":
        return jax.lax.slice_in_dim(vals[p[0]], p[2], p[3], axis=p[1])
    raise ValueError(kind)


def _describe(n_inputs, steps, vshapes, outs, input_values) -> str:
    lines = [f"v{v}: input {list(vshapes[v])}" for v in range(n_inputs)]
    nxt = n_inputs
    for kind, p in steps:
        if kind == "input":
            lines.append(f"v{p[0]}: input {list(vshapes[p[0]])}")
            nxt = p[0] + 1
            continue
        lines.append(f"v{nxt}: {kind}{p} -> {list(vshapes[nxt])}")
        nxt += 1
    lines.append(f"outputs: {['v%d' % o for o in outs]}")
    return "; ".join(lines)


def _random_spec(rng: random.Random, shape: tuple[int, ...], mesh: str, uneven: bool):
    """A random PartitionSpec (or None = free) of ``shape`` on ``mesh`` whose splits divide it.

    With ``uneven``, a split may also leave padding (never more parts than elements).
    """
    if rng.random() < 0.4:
        return None
    axes = [(name, int(size)) for name, size in (a.split("=") for a in mesh.split(",")) if int(size) > 1]
    entries: list[list[str]] = [[] for _ in shape]
    for name, size in axes:
        d = rng.randrange(len(shape) + 1)
        if d == len(shape):
            continue
        n = math.prod(dict(axes)[a] for a in entries[d]) * size
        if shape[d] % n == 0 or (uneven and shape[d] >= n and rng.random() < 0.5):
            entries[d].append(name)
    spec = [None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries]
    return P(*spec)


# -- a random solver ----------------------------------------------------------------------


def random_solver(seed: int) -> Callable:
    """A ``solve(problem, ...)`` that picks random strategies every reshard allows."""
    from shardsolve.problem import FORBIDDEN, Solution

    def solve(problem, *, time_limit=None, seed_=None, progress=None, **_):
        rng = np.random.default_rng(seed)
        incoming: dict[int, list] = {}
        for e in problem.edges:
            incoming.setdefault(e.v, []).append(e)
        allowed = {p.node: set(p.allowed) for p in problem.pins}
        assignment: list[int] = []
        for i, node in enumerate(problem.nodes):
            ok = []
            for s in range(node.num_strategies):
                if i in allowed and s not in allowed[i]:
                    continue
                if node.costs[s] >= FORBIDDEN:
                    continue
                if all(e.u > i or e.costs[assignment[e.u], s] < FORBIDDEN for e in incoming.get(i, ())):
                    ok.append(s)
            if not ok:
                return Solution((), math.inf, math.inf, "infeasible")
            assignment.append(int(rng.choice(ok)))
        cost = problem.evaluate(tuple(assignment))
        return Solution(tuple(assignment), cost, cost, "feasible")

    return solve


def plan_with_solver(solver: Callable | None, fun: Callable, *args: Any, **kwargs: Any):
    """``shardsolve.plan`` with ``solver`` standing in for ``shardsolve.encodings.solve`` (None: the real one),
    its plan kept as it is (propagation's plan is no candidate)."""
    import shardsolve
    import shardsolve.encodings as encodings
    from shardsolve import planner

    if solver is None:
        return shardsolve.plan(fun, *args, **kwargs)
    missing = object()
    saved = getattr(encodings, "solve", missing)
    saved_ops = planner.PROPAGATION_CANDIDATE_OPS
    encodings.solve = solver
    planner.PROPAGATION_CANDIDATE_OPS = -1
    if not hasattr(encodings, "explain_infeasible"):
        encodings.explain_infeasible = lambda problem: ()
    try:
        return shardsolve.plan(fun, *args, **kwargs)
    finally:
        planner.PROPAGATION_CANDIDATE_OPS = saved_ops
        if saved is missing:
            del encodings.solve
        else:
            encodings.solve = saved


@dataclass
class Outcome:
    """What lowering one plan showed."""

    numerics_ok: bool
    collectives_ok: bool
    max_rel: float
    predicted: dict
    lowered: dict
    plan: Any = None

    @property
    def ok(self) -> bool:
        return self.numerics_ok and self.collectives_ok


def check_lowering(plan, args: tuple, reference: Any = None, *, rtol: float = 1e-4, atol: float = 1e-5) -> Outcome:
    """Run ``lower(plan)`` against the unsharded function and compare predicted and lowered collectives."""
    from shardsolve.hlo import collectives_from_hlo, inventory
    from shardsolve.lower import lower

    run = lower(plan)
    want = plan.fun(*args) if reference is None else reference
    got = run(*args)
    numerics_ok, worst = True, 0.0
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(want):
        return Outcome(False, False, math.inf, {}, {}, plan)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            numerics_ok, worst = False, math.inf
            continue
        # Overflow is part of the function: an inf or nan must be matched in place, and
        # the finite entries are compared as numbers.
        finite = np.isfinite(b)
        if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], b[~finite], equal_nan=True):
            numerics_ok, worst = False, math.inf
            continue
        a, b = a[finite], b[finite]
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        worst = max(worst, err / max(scale, 1e-30) if err else 0.0)
        numerics_ok &= err <= atol + rtol * scale
    text = run.lower(*args).compile().as_text()
    predicted = inventory(plan.collectives, plan.mesh)
    lowered = inventory(collectives_from_hlo(text, plan.mesh), plan.mesh)
    return Outcome(numerics_ok, predicted == lowered, worst, predicted, lowered, plan)


def greedy_solver() -> Callable:
    """A ``solve(problem, ...)`` that takes, node by node, the strategy cheapest given the ones before."""
    from shardsolve.problem import FORBIDDEN, Solution

    def solve(problem, *, time_limit=None, progress=None, **_):
        incoming: dict[int, list] = {}
        for e in problem.edges:
            incoming.setdefault(e.v, []).append(e)
        allowed = {p.node: set(p.allowed) for p in problem.pins}
        assignment: list[int] = []
        for i, node in enumerate(problem.nodes):
            best, best_cost = None, math.inf
            for s in range(node.num_strategies):
                if i in allowed and s not in allowed[i]:
                    continue
                c = float(node.costs[s])
                for e in incoming.get(i, ()):
                    c += float(e.costs[assignment[e.u], s]) if e.u < i else 0.0
                if c < FORBIDDEN and c < best_cost:
                    best, best_cost = s, c
            if best is None:
                return Solution((), math.inf, math.inf, "infeasible")
            assignment.append(best)
        cost = problem.evaluate(tuple(assignment))
        return Solution(tuple(assignment), cost, 0.0, "feasible")

    return solve
