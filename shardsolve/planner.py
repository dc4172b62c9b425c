"""``shardsolve.plan``: trace, build the problem, solve it, and turn the solution into a ``Plan``.

    plan = shardsolve.plan(step, params, batch, mesh="data=2,model=4",
                           in_shardings=(None, P("data")), memory_limit="16GiB")

The stages: ``trace`` (the program as a closed jaxpr), ``graph`` (values and
operations), ``annotations`` (pins from ``in_shardings``/``out_shardings``),
``build`` (the strategy-selection ``Problem``), ``encodings`` (the solver; with
layer tying from ``tying`` where the program repeats itself), then
``to_plan``: every op's ``OpPlan``, the reshard schedule and its price.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np

import shardsolve.encodings as encodings
from shardsolve.annotations import argument_pins, carry_pairs, output_pins
from shardsolve.build import BuildOptions, Built, build_problem
from shardsolve.encodings.tying import solve_tied
from shardsolve.errors import InfeasibleError, ShardsolveError
from shardsolve.graph import Graph, Lit
from shardsolve.mesh import MeshSpec, as_mesh_spec
from shardsolve.plan import Cost, OpPlan, Plan, Signature, predicted_collectives
from shardsolve.schedule import build_schedule
from shardsolve.sharding import Sharding
from shardsolve.trace import trace
from shardsolve.units import format_bytes, parse_memory_limit

# -- solution -> plan --------------------------------------------------------


def _op_plans(g: Graph, built: Built, a: Sequence[int], scope: tuple, fallbacks: Counter,
              compute: list[float]) -> tuple[OpPlan, ...]:
    """The ``OpPlan`` of every op of ``g`` (a program or a scan body), summing node costs into ``compute``."""
    ops = []
    for op in g.ops:
        sn = built.scans.get(scope + (op.id,))
        if sn is not None:
            b = sn.boundary(built.nodes, a)
            body = _op_plans(sn.body, built, a, scope + (op.id,), fallbacks, compute)
            ops.append(OpPlan(op.primitive, b.operands, b.results, f"body planned once, x{sn.length}", False,
                              body=body, length=sn.length, body_consts=b.body_consts))
            continue
        idx = built.op_node_of(scope, op.id)
        info = built.nodes[idx]
        strategy = info.strategies[a[idx]]
        compute[0] += float(built.problem.nodes[idx].costs[a[idx]])
        if info.fallback:
            fallbacks[op.primitive] += 1
        ops.append(OpPlan(op.primitive, strategy.operands, strategy.results, strategy.describe(), info.fallback))
    return tuple(ops)


def to_plan(graph: Graph, built: Built, solution, mesh: MeshSpec, fun: Callable | None, source: str = "") -> Plan:
    """The ``Plan`` of a solution of ``built``'s problem."""
    a = solution.assignment
    inputs = tuple(built.sharding(built.value_node[v], a) for v in graph.inputs)
    consts = tuple(built.sharding(built.value_node[v], a) for v in graph.consts)
    outputs = tuple(Sharding.replicated(np.ndim(x.value)) if isinstance(x, Lit) else built.sharding(built.output_node[k], a)
                    for k, x in enumerate(graph.outputs))
    fallbacks: Counter = Counter()
    total = [0.0]
    ops = _op_plans(graph, built, a, (), fallbacks, total)
    compute = total[0]
    collectives = predicted_collectives(build_schedule(graph, mesh, inputs, consts, outputs, ops), mesh)
    communication = sum(c.time for c in collectives)
    by_kind: Counter = Counter()
    for c in collectives:
        by_kind[c.kind] += c.bytes  # one run of each (a scan body's collectives once, as in the HLO)
    cost = Cost(
        total=compute + communication,
        compute=compute,
        communication=communication,
        peak_memory=built.problem.peak_usage(a),
        objective=float(solution.cost),
        bytes_by_kind=tuple(sorted(by_kind.items())),
    )
    stats = dict(solution.stats or {})
    stats.update(
        {
            "ops": len(graph.ops),
            "problem_nodes": len(built.problem.nodes),
            "problem_edges": len(built.problem.edges),
            "strategies": built.problem.num_strategies,
        }
    )
    return Plan(
        mesh=mesh,
        signature=Signature.of(graph.traced),
        inputs=inputs,
        consts=consts,
        outputs=outputs,
        ops=ops,
        collectives=collectives,
        cost=cost,
        status=solution.status,
        gap=float(solution.gap),
        lower_bound=float(solution.lower_bound),
        solve_time=float(solution.wall_time),
        fallbacks=tuple(sorted(fallbacks.items())),
        stats=tuple(sorted((k, v) for k, v in stats.items() if isinstance(v, (int, float, str, bool)))),
        source=source,
        fun=fun,
        graph=graph,
    )


def plan(
    fun: Callable,
    *args: Any,
    mesh: Any,
    in_shardings: Any = None,
    out_shardings: Any = None,
    memory_limit: Any = None,
    time_limit: float | None = None,
    carry: Sequence[tuple[int, int]] = (),
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    source: str = "",
    tie: bool = True,
    expand_scans: bool = True,
    uneven: bool = True,
) -> Plan:
    """Plan the sharding of ``fun(*args)`` on ``mesh``; returns a ``shardsolve.Plan``.

    ``in_shardings``/``out_shardings`` are pytree prefixes of the arguments /
    outputs with ``PartitionSpec`` (pinned) or ``None`` (free) leaves.
    ``memory_limit`` is bytes per device (or a string like ``"16GiB"``),
    ``time_limit`` the solver's seconds. ``carry`` lists (argument index,
    output index) pairs whose leaves must share shardings: the output is the
    next value of the argument, as a training step's parameters are.
    ``progress`` receives one-line status messages.

    ``tie``: where the program repeats itself (an unrolled stack of layers),
    corresponding values of the repeated layers take the same sharding and
    the solver searches about one layer (``shardsolve.tying``). Tying is a
    restriction: the plan's ``status`` is ``"optimal"`` only when a certified
    bound of the untied problem meets the tied plan's cost, else
    ``"feasible"`` with that gap, and ``plan.stats`` say which (``tying``:
    ``"exact"`` or ``"restricted"``). Programs without repetition are solved
    as they are. ``tie=False`` always searches untied.

    ``expand_scans`` and ``uneven`` are ``build.BuildOptions`` (both on by
    default; off reproduces the planner before scan bodies, resp. uneven
    splits, were planned).
    """
    say = progress or (lambda message: None)
    mesh_spec = as_mesh_spec(mesh)
    limit = parse_memory_limit(memory_limit)
    if time_limit is not None and not time_limit > 0:
        raise ShardsolveError(f"time_limit {time_limit!r} must be a positive number of seconds")
    options = BuildOptions(expand_scans=expand_scans, uneven=uneven)
    graph, built = _traced_problem(fun, args, mesh_spec, in_shardings, out_shardings, limit, carry, options, say)
    say(f"solving ({len(built.problem.nodes)} nodes, {built.problem.num_strategies} strategies)")
    solution = _solve(built, time_limit, seed, tie, say if progress else None)
    if solution.status in ("infeasible", "unknown") or not math.isfinite(solution.cost):
        if solution.status == "unknown":
            raise ShardsolveError(
                "the solver found no plan within the time limit; raise --time-limit or relax the memory limit"
            )
        conflict = solution.conflict or encodings.explain_infeasible(built.problem)
        reason = "; ".join(conflict) if conflict else "the annotations and the memory limit"
        hint = f" (memory limit {format_bytes(limit)} per device)" if limit is not None else ""
        raise InfeasibleError(
            f"no plan satisfies {reason}{hint}; drop or change one of these constraints", conflict
        )
    say("done")
    return to_plan(graph, built, solution, mesh_spec, fun, source)


def _traced_problem(fun: Callable, args: tuple, mesh: MeshSpec, in_shardings: Any, out_shardings: Any,
                    limit: float | None, carry: Sequence[tuple[int, int]], options: BuildOptions,
                    say: Callable[[str], None]) -> tuple[Graph, Built]:
    """Trace ``fun(*args)``, read the annotations and build the problem."""
    say("tracing")
    # Tracing and building make millions of small objects and few reference cycles: the cyclic
    # collector's full passes over them cost about a third of this stage, and find little.
    collecting = gc.isenabled()
    gc.disable()
    try:
        traced = trace(fun, *args)
        graph = Graph.from_traced(traced)
        in_pins = argument_pins(traced, in_shardings, mesh)
        out_pins = output_pins(traced, out_shardings, mesh)
        ties = carry_pairs(traced, carry)
        say(f"building the problem ({len(graph.ops)} operations)")
        built = build_problem(graph, mesh, in_pins, out_pins, limit, ties, options)
    finally:
        if collecting:
            gc.enable()
    return graph, built


def _solve(built: Built, time_limit: float | None, seed: int, tie: bool, say: Callable[[str], None] | None):
    """The solver's ``Solution``: tied where the program repeats itself (``tie``), else searched untied."""
    solver_progress = _solver_progress(say) if say else None
    solution = None
    if tie:
        solution = solve_tied(built.problem, time_limit=time_limit, seed=seed, progress=solver_progress)
        if solution is not None and say:
            st = solution.stats
            say(f"tied {st['tied_nodes']} nodes in {st['tie_classes']} classes of repeated layers: "
                f"{st['tying']} ({st['tie_bound']} bound of the untied problem)")
    if solution is None:
        solution = encodings.solve(built.problem, time_limit=time_limit, seed=seed, progress=solver_progress)
    return solution


def _solver_progress(say: Callable[[str], None], every: float = 0.25) -> Callable[[str, float, float], None]:
    """Turn the solver's frequent callbacks into at most one status line per ``every`` seconds."""
    last = [0.0, ""]

    def report(message: str, best: float, bound: float) -> None:
        now = time.monotonic()
        if message == last[1] and now - last[0] < every:
            return
        last[0], last[1] = now, message
        detail = f"solving: {message}"
        if math.isfinite(best):
            gap = (best - bound) / best if best > 0 and math.isfinite(bound) else math.inf
            detail += f", best {best * 1e3:.4f} ms" + (f", gap {gap:.1%}" if math.isfinite(gap) else "")
        say(detail)

    return report


