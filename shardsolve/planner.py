"""``shardsolve.plan``: trace, build the problem, solve it, and turn the solution into a ``Plan``.

    plan = shardsolve.plan(step, params, batch, mesh="data=2,model=4",
                           in_shardings=(None, P("data")), memory_limit="16GiB")

The stages: ``trace`` (the program as a closed jaxpr), ``graph`` (values and
operations), ``annotations`` (pins from ``in_shardings``/``out_shardings``),
``build`` (the strategy-selection ``Problem``), ``encodings`` (the solver; with
layer tying from ``encodings.tying`` where the program repeats itself), then
``to_plan``: every op's ``OpPlan``, the reshard schedule and its price.
"""

from __future__ import annotations

import contextvars
import dataclasses
import gc
import math
import time
from collections import Counter
from typing import Any, Callable, Sequence

import jax
import numpy as np

import shardsolve.encodings as encodings
from shardsolve.annotations import argument_pins, carry_pairs, hint_pins, output_pins
from shardsolve.build import BuildOptions, Built, build_problem, tie_axes
from shardsolve.encodings import portfolio
from shardsolve.encodings.flat import flatten
from shardsolve.encodings.heuristics import complete
from shardsolve.encodings.polish import polish_usage
from shardsolve.encodings.tying import cancel_ahead, certify, solve_tied
from shardsolve.errors import InfeasibleError, Interrupted, ShardsolveError
from shardsolve.flax import logical_names
from shardsolve.graph import Graph, Lit, cond_groups
from shardsolve.hlo import compiled_memory
from shardsolve.logical import LogicalAxes
from shardsolve.memory import peak_memory
from shardsolve.mesh import MeshSpec, as_mesh_spec
from shardsolve.plan import Cost, OpPlan, Plan, Signature, predicted_collectives
from shardsolve.problem import MEMORY_LIMIT_LABEL, Pin, Solution
from shardsolve.propagation import propagated_assignment, propagated_scopes
from shardsolve.schedule import build_schedule
from shardsolve.sharding import Sharding
from shardsolve.trace import abstractify, key_dims, trace
from shardsolve.units import format_bytes, parse_memory_limit

# -- solution -> plan --------------------------------------------------------


def _op_plans(g: Graph, built: Built, a: Sequence[int], scope: tuple, fallbacks: Counter) -> tuple[OpPlan, ...]:
    """The ``OpPlan`` of every op of ``g`` (a program or a scan body)."""
    ops = []
    for op in g.ops:
        sn = built.scans.get(scope + (op.id,))
        if sn is not None:
            b = sn.boundary(built.nodes, a)
            body = _op_plans(sn.body, built, a, scope + (op.id,), fallbacks)
            how = (f"body planned once, x{sn.length}" if op.loop is None
                   else "while loop: body and condition planned once, counted once")
            ops.append(OpPlan(op.primitive, b.operands, b.results, how, False,
                              body=body, length=sn.length, body_consts=b.body_consts))
            continue
        idx = built.op_node_of(scope, op.id)
        info = built.nodes[idx]
        strategy = info.strategies[a[idx]]
        if info.fallback:
            fallbacks[op.primitive] += 1
        ops.append(OpPlan(op.primitive, strategy.operands, strategy.results, strategy.describe(), info.fallback))
    return tuple(ops)


@dataclasses.dataclass(frozen=True)
class _Executed:
    """What an assignment makes of the program, whatever solve found it: its shardings, ops, collectives, step
    time and peak memory (``to_plan``'s work, done once per assignment of a ``plan`` call)."""

    inputs: tuple
    consts: tuple
    outputs: tuple
    ops: tuple
    fallbacks: tuple
    collectives: tuple
    compute: float
    communication: float
    peak_memory: float
    bytes_by_kind: tuple


#: Per ``plan`` call, the ``_Executed`` of the assignments it made plans of: pricing a solution in the
#: search and handing back its plan ask for the same (None outside ``plan``).
_EXECUTED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shardsolve_executed", default=None)


def _executed(graph: Graph, built: Built, a: Sequence[int], mesh: MeshSpec) -> _Executed:
    memo = _EXECUTED.get()
    # ``built``'s variants (a memory limit, merges priced otherwise) share their nodes, which is all it reads.
    key = (id(graph), id(built.nodes), mesh, np.asarray(a, dtype=np.int64).tobytes())
    if memo is not None and key in memo:
        kept_graph, kept_nodes, found = memo[key]
        if kept_graph is graph and kept_nodes is built.nodes:
            return found
    inputs = tuple(built.sharding(built.value_node[v], a) for v in graph.inputs)
    consts = tuple(built.sharding(built.value_node[v], a) for v in graph.consts)
    outputs = tuple(Sharding.replicated(np.ndim(x.value)) if isinstance(x, Lit) else built.sharding(built.output_node[k], a)
                    for k, x in enumerate(graph.outputs))
    fallbacks: Counter = Counter()
    ops = _op_plans(graph, built, a, (), fallbacks)
    # Every node's cost is compute or memory time (ops, a scan's stacked outputs), but for the latency of
    # merged collectives (build.share_merged_latency); reshards are on the edges.
    compute = float(sum(node.costs[a[k]] for k, (node, info) in enumerate(zip(built.problem.nodes, built.nodes))
                        if info.kind != "merged")) - _untaken_branches(graph, built, a)
    schedule = build_schedule(graph, mesh, inputs, consts, outputs, ops)
    collectives = predicted_collectives(schedule, mesh)
    by_kind: Counter = Counter()
    for c in collectives:
        by_kind[c.kind] += c.bytes  # one run of each (a scan body's collectives once, as in the HLO)
    found = _Executed(inputs, consts, outputs, ops, tuple(sorted(fallbacks.items())), collectives, compute,
                      sum(c.time for c in collectives), peak_memory(graph, built, a, schedule, mesh),
                      tuple(sorted(by_kind.items())))
    if memo is not None:
        memo[key] = (graph, built.nodes, found)
    return found


def _untaken_branches(graph: Graph, built: Built, a: Sequence[int]) -> float:
    """The cost of the work a conditional does not do: the problem charges every branch of it and the selects
    of their results (as the trace has it), the program runs one branch, as dear as the dearest at most
    (``graph.cond_groups``; XLA's cost analysis counts a conditional so)."""
    nodes = built.problem.nodes

    def cost(ops, op_node) -> float:
        return sum(float(nodes[op_node[k]].costs[a[op_node[k]]]) for k in ops if k in op_node)

    saved = 0.0
    for g, op_node in [(graph, built.op_node)] + [(sn.body, sn.op_node) for sn in built.scans.values()]:
        for group in cond_groups(g):
            branches = [cost(ops, op_node) for ops in group.branches]
            saved += sum(branches) - max(branches, default=0.0) + cost(group.selects, op_node)
    return saved


def to_plan(graph: Graph, built: Built, solution, mesh: MeshSpec, fun: Callable | None, source: str = "") -> Plan:
    """The ``Plan`` of a solution of ``built``'s problem."""
    done = _executed(graph, built, solution.assignment, mesh)
    cost = Cost(
        total=done.compute + done.communication,
        compute=done.compute,
        communication=done.communication,
        peak_memory=done.peak_memory,
        objective=float(solution.cost),
        bytes_by_kind=done.bytes_by_kind,
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
        inputs=done.inputs,
        consts=done.consts,
        outputs=done.outputs,
        ops=done.ops,
        collectives=done.collectives,
        cost=cost,
        status=solution.status,
        gap=float(solution.gap),
        lower_bound=float(solution.lower_bound),
        solve_time=float(solution.wall_time),
        fallbacks=done.fallbacks,
        stats=tuple(sorted((k, v) for k, v in stats.items() if isinstance(v, (int, float, str, bool)))),
        source=source,
        input_names=tuple(graph.values[v].name for v in graph.inputs),
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
    memory_check: str = "compiled",
    logical_rules: bool = False,
    hints: Any = None,
) -> Plan:
    """Plan the sharding of ``fun(*args)`` on ``mesh``; returns a ``shardsolve.Plan``.

    ``in_shardings``/``out_shardings`` are pytree prefixes of the arguments /
    outputs with ``PartitionSpec`` (pinned) or ``None`` (free) leaves. A
    ``with_sharding_constraint`` (or ``device_put`` onto a ``NamedSharding``)
    inside ``fun`` pins the value it lays out (its
    ``PartitionSpec.UNCONSTRAINED`` dimensions stay free); a bare
    ``PartitionSpec`` there names ``mesh``'s axes (``trace.trace``).
    ``memory_limit`` is bytes per device (or a string like ``"16GiB"``),
    ``time_limit`` the solver's seconds, for all of this call's solves
    together (see ``FIRST_SOLVE_SHARE``): a deterministic work budget, with a
    wall-clock net of 1.05 times it plus 1 s of solving (``SolvingNet``). ``carry`` lists (argument index,
    output index) pairs whose leaves must share shardings: the output is the
    next value of the argument, as a training step's parameters are.
    ``progress`` receives one-line status messages.

    ``tie``: where the program repeats itself (an unrolled stack of layers),
    corresponding values of the repeated layers take the same sharding and
    the solver searches about one layer (``shardsolve.encodings.tying``). Tying is a
    restriction: the plan's ``status`` is ``"optimal"`` only when a certified
    bound of the untied problem meets the tied plan's cost, else
    ``"feasible"`` with that gap, and ``plan.stats`` say which (``tying``:
    ``"exact"`` or ``"restricted"``). Programs without repetition are solved
    as they are. ``tie=False`` always searches untied; under a memory limit,
    so do problems of at most ``UNTIED_UNDER_LIMIT_NODES`` nodes.

    ``logical_rules``: the arguments' logical axis names (Flax metadata,
    ``shardsolve.flax.logical_names``) are tied: every dimension with one name
    takes one mesh-axis choice, unnamed dimensions of named leaves stay whole
    (``shardsolve.logical``). ``plan.logical_axis_rules`` then lists the
    choices as Flax/MaxText rules, and ``plan.stats`` hold the cost of the
    cheapest plan found without the ties beside it (the tied plan is one of
    them: ``logical_free_cost``, ``logical_cost``, ``logical_overhead``:
    seconds, seconds, tied / free - 1).

    Ctrl-C while solving raises ``errors.Interrupted`` (a ``KeyboardInterrupt``)
    whose ``plan`` is the best complete plan found so far (``status``
    ``"interrupted"``, with its gap), or ``None`` where there was none yet.

    ``hints``: a pytree prefix of the arguments with ``PartitionSpec`` (or
    ``None``) leaves, shardings known to be good (an expert's). The problem
    is also solved with the hinted arguments pinned (``HINT_SHARE`` of
    ``time_limit``, under the memory limit and its compiled check as the
    rest, starting from the plan found without the hints), and that plan is
    kept where it is faster, or where it is the only one that fits the
    memory limit: the plan is never slower in the model
    than the best plan with the hinted argument shardings, and no memory
    limit that such a plan meets is called infeasible. ``in_shardings``
    pins win over hints; ``plan.stats`` say whether the hinted plan was
    kept (``hint``).

    ``expand_scans`` and ``uneven`` are ``build.BuildOptions`` (both on by
    default; off reproduces the planner before scan bodies, resp. uneven
    splits, were planned).

    ``memory_check``: with a ``memory_limit``, ``"compiled"`` (the default)
    holds the limit as XLA compiles the plan: ``plan.jit()`` is compiled for
    the example arguments (``ShapeDtypeStruct``s are enough; nothing runs) and
    its ``memory_analysis()`` peak (argument + output + temp - alias) must be
    within the limit. The plan without the limit is solved first and compiled:
    where its peak fits, it is the plan (the fastest in the model, whatever the
    limit). Where it does not, the problem is solved under the limit (raised
    by as much as the model over-counts that plan, as compiled: the model's
    bound counts every operand twice in the step that reads it), and
    where that plan's compiled peak is over, the limit the solver sees is searched
    (lowered by the overshoot, then bisected) and the plan solved again. The
    program Shardy propagates from the same annotations, read back as a plan
    (``shardsolve.propagation``), is compiled too: where it fits, the search
    starts from it and returns nothing slower (``plan.stats``:
    ``propagation_cost``). The
    fastest plan whose compiled peak fits is returned (``plan.stats``:
    ``memory_rounds``, ``compiled_peak_memory``), or ``InfeasibleError`` after
    ``MEMORY_ROUNDS`` solves. The solves share ``time_limit``: the one without the
    limit gets 40% of it, the first under the limit 30%, each later one a
    tenth. ``"model"`` trusts the cost model's
    estimate. Without enough devices for the mesh the model is trusted.
    """
    if time_limit is not None and not time_limit > 0:
        raise ShardsolveError(f"time_limit {time_limit!r} must be a positive number of seconds")
    token = _NET.set(None if time_limit is None else SolvingNet(float(time_limit)))
    executed = _EXECUTED.set({})
    try:
        with portfolio.frozen_heap():  # see ``_traced_problem``
            return _plan(fun, args, mesh, in_shardings, out_shardings, memory_limit, time_limit, carry, seed,
                         progress, source, tie, expand_scans, uneven, memory_check, logical_rules, hints)
    finally:
        cancel_ahead()  # an untied bound started for a plan not kept
        _EXECUTED.reset(executed)
        _NET.reset(token)


def _plan(fun, args, mesh, in_shardings, out_shardings, memory_limit, time_limit, carry, seed, progress, source, tie,
          expand_scans, uneven, memory_check, logical_rules, hints=None) -> Plan:
    """``plan``'s body, inside the call's ``SolvingNet``."""
    say = progress or (lambda message: None)
    mesh_spec = as_mesh_spec(mesh)
    limit = parse_memory_limit(memory_limit)
    options = BuildOptions(expand_scans=expand_scans, uneven=uneven)
    graph, built = _traced_problem(fun, args, mesh_spec, in_shardings, out_shardings, limit, carry, options, say)
    if memory_check not in MEMORY_CHECKS:
        raise ShardsolveError(f"memory_check={memory_check!r} is not one of {', '.join(map(repr, MEMORY_CHECKS))}")
    hinted = None if hints is None else _hinted(graph, built, hints, mesh_spec)
    free = None

    def price(solution) -> float:  # a solution's step time as its plan counts it (merged collectives included)
        return to_plan(graph, built, solution, mesh_spec, fun, source).cost.total

    if logical_rules:
        axes = _logical_axes(args, graph, in_shardings, mesh_spec)
        say(f"solving without logical-axis ties ({len(built.problem.nodes)} nodes)")
        free = _solve(built, _share(time_limit, LOGICAL_FREE_SHARE), seed, tie, say if progress else None, price)
        built = tie_axes(built, graph, axes.ties(), axes.whole())
        hinted = None if hinted is None else tie_axes(hinted, graph, axes.ties(), axes.whole())
        time_limit = _share(time_limit, 1 - LOGICAL_FREE_SHARE)
    search = (graph, mesh_spec, fun, args, source, limit, seed, tie, say, progress, price, memory_check)
    if hinted is None:
        result = search_plan(built, time_limit, *search)
    else:
        result = _with_hint(built, hinted, time_limit, search, say)
    if free is None:
        return result
    stats = dict(result.stats)
    stats["logical_cost"] = result.cost.total
    if _found(free):
        free_cost = to_plan(graph, built, free, mesh_spec, fun, source).cost
        if result.cost.total < free_cost.total:  # the tied plan is a plan without the ties too, and the cheaper
            free_cost = result.cost
        stats.update(logical_free_cost=free_cost.total, logical_free_peak_memory=free_cost.peak_memory,
                     logical_overhead=result.cost.total / free_cost.total - 1 if free_cost.total > 0 else 0.0)
    return dataclasses.replace(result, logical_axis_rules=axes.rules(result.inputs), stats=tuple(sorted(stats.items())))


def search_plan(built: Built, time_limit: float | None, graph: Graph, mesh_spec: MeshSpec, fun: Callable,
                args: tuple, source: str, limit: float | None, seed: int, tie: bool, say: Callable[[str], None],
                progress, price: Callable[[Any], float], memory_check: str,
                start: Sequence[int] | None = None, fastest: list | None = None,
                free_start: Sequence[int] | None = None) -> Plan:
    """The plan of ``built`` within ``time_limit``: solved, and under a memory limit held as compiled (``plan``'s
    ``memory_check``). ``start``: an assignment of ``built``'s problem the first solve starts from
    (``encodings.solve``'s ``start``); ``fastest`` (a list) gets the first plan solved, the one without the
    memory limit where the compiled check probes it, whether or not the search then finds one that fits, as
    (its assignment of ``built``'s problem, of ``built.unlimited``'s or None); ``free_start`` is such a
    second one, for that probe (else ``start`` carried over: ``adopted``)."""
    check_compiled = limit is not None and memory_check == "compiled" and _devices_present(mesh_spec)
    unlimited = None
    if check_compiled:  # the fastest plan of all, where it fits as compiled, needs no search under the limit
        free = built if built.unlimited is None or not built.unlimited.hub_sources else built.unlimited
        if free is not built and free_start is None and start is not None:
            free_start = adopted(start, built, free)
        share = UNLIMITED_SHARE if free is built else UNLIMITED_SHARE / 2  # (halves: a second probe below)
        unlimited = _unlimited_probe(graph, free, mesh_spec, fun, args, source, time_limit, seed, tie, say,
                                     progress, price if free is built else _pricing(graph, free, mesh_spec, fun, source),
                                     start if free is built else free_start, share)
        raw = None if unlimited is None or free is built else unlimited[2]
        if raw is not None:  # the search goes on in ``built``'s problem
            unlimited = (unlimited[0], unlimited[1], adopted(raw, free, built))
        if unlimited is not None and fastest is not None:
            fastest.append((unlimited[2], raw))
        if raw is not None and unlimited[1] > limit:
            # Shared layouts live from their first read to their last: the plan priced without them (each
            # read from the value's own layout) needs less memory and may fit (Llama large on 2x4 at the
            # expert's 5.98 GiB: 53.6 ms, where the search from the plan with them ended at 56.7 ms).
            plain = _unlimited_probe(graph, built, mesh_spec, fun, args, source, time_limit, seed, tie, say,
                                     progress, price, unlimited[2], share)
            unlimited = unlimited if plain is None else plain
    if unlimited is not None and unlimited[1] <= limit:
        say("the plan without the memory limit fits it as compiled: done")
        plan, compiled, _ = unlimited
        stats = dict(plan.stats) | {"memory_rounds": 1, "compiled_peak_memory": compiled}
        return dataclasses.replace(plan, stats=tuple(sorted(stats.items())))
    # The model's bound errs high by what it over-counts on the plan without the limit, as compiled: the first
    # solve sees that much more room (the search below tightens it where its plan compiles over).
    internal = limit
    if unlimited is not None and limit >= allocated_floor(built):  # (below the floor: infeasible as it is)
        internal = limit + max(0.0, built.problem.peak_usage(unlimited[2]) - unlimited[1])
    known = _propagation_plan(graph, built, mesh_spec, fun, args, source, limit, say) if check_compiled else None
    if known is not None:  # propagation's program fits: the search sees room for it, and starts from it
        internal = max(internal, built.problem.peak_usage(known[2]))
    first_start = known[2] if known is not None else start if unlimited is None else unlimited[2]
    say(f"solving{' under the memory limit' if check_compiled else ''} ({len(built.problem.nodes)} nodes, "
        f"{built.problem.num_strategies} strategies" + (f"; {format_bytes(internal)} as the model counts it"
                                                        if internal != limit else "") + ")")
    try:
        first = _share(time_limit, FIRST_SOLVE_SHARE) if check_compiled else time_limit
        solution = _solve(_limited(built, internal), first, seed, _tied_under_limit(built, tie, internal),
                          say if progress else None, price, first_start)
    except KeyboardInterrupt as interrupt:  # Ctrl-C: hand back the best complete plan so far, where there is one
        interrupt = _as_interrupted(interrupt)
        best = interrupt.solution
        if best is not None and len(best.assignment) == len(built.problem.nodes):
            interrupt.plan = to_plan(graph, built, best, mesh_spec, fun, source)
        raise interrupt from None
    if fastest is not None and unlimited is None and _found(solution):
        fastest.append((tuple(solution.assignment), None))
    if check_compiled:  # an interrupt here carries the best plan that fits as compiled, or none
        return _within_compiled_memory(graph, built, solution, mesh_spec, fun, args, source, limit, time_limit,
                                       seed, tie, say, progress, price, unlimited, internal, known)
    _refuse_unsolved(built, solution, limit)
    plan = to_plan(graph, built, solution, mesh_spec, fun, source)
    size = len(graph.ops) + sum(len(scan.body.ops) for scan in built.scans.values())
    if limit is None and _devices_present(mesh_spec) and size <= PROPAGATION_CANDIDATE_OPS:
        plan = _no_slower_than_propagation(plan, graph, built, mesh_spec, fun, source, say)
    say("done")
    return plan


def _no_slower_than_propagation(plan: Plan, graph: Graph, built: Built, mesh: MeshSpec, fun: Callable,
                                source: str, say: Callable[[str], None]) -> Plan:
    """``plan``, or the plan of the shardings Shardy propagates from the same annotations where that one is
    faster as plans are priced (``plan.stats``: ``propagation_cost``, and ``propagation_kept``); the problem's
    pricing of merged collectives can miss a plan whose reductions XLA merges into one."""
    known = _propagated(graph, built, mesh, fun, source, say)
    if known is None:
        return plan
    stats = dict(plan.stats) | {"propagation_cost": known[0].cost.total}
    if known[0].cost.total < plan.cost.total:
        say(f"propagation's plan is faster ({known[0].cost.total:.4g} s against {plan.cost.total:.4g} s): kept")
        stats["propagation_kept"] = True
        plan = dataclasses.replace(known[0], solve_time=plan.solve_time)
    return dataclasses.replace(plan, stats=tuple(sorted(stats.items())))


#: With ``hints``, the solves with the hinted arguments pinned get this share of ``time_limit``, the rest the others.
HINT_SHARE = 0.25


def _hinted(graph: Graph, built: Built, hints: Any, mesh: MeshSpec) -> Built | None:
    """``built`` with every hinted argument pinned to its hint (where ``in_shardings`` left it free); None where
    that pins nothing more."""
    pinned = {p.node for p in built.problem.pins}
    pins = list(built.problem.pins)
    for k, (sharding, label) in enumerate(hint_pins(graph.traced, hints, mesh)):
        node = built.value_node.get(graph.inputs[k])
        if sharding is None or node is None or node in pinned:
            continue
        cands = built.nodes[node].shardings
        if sharding not in cands:
            raise ShardsolveError(f"{label} is not a sharding the planner considers for this argument (an uneven "
                                  "or partial split); hint another or leave it free")
        pins.append(Pin(node, (cands.index(sharding),), label))
    if len(pins) == len(built.problem.pins):
        return None
    unlimited = None if built.unlimited is None else _hinted(graph, built.unlimited, hints, mesh)
    return dataclasses.replace(built, problem=dataclasses.replace(built.problem, pins=tuple(pins)),
                               unlimited=unlimited)


def _with_hint(built: Built, hinted: Built, time_limit: float | None, search: tuple,
               say: Callable[[str], None]) -> Plan:
    """The faster of ``built``'s plan and ``hinted``'s (``HINT_SHARE`` of ``time_limit``), or the one found; the
    first's ``InfeasibleError`` where neither is."""
    error, fastest = None, []
    try:
        plan = search_plan(built, _share(time_limit, 1 - HINT_SHARE), *search, fastest=fastest)
    except ShardsolveError as e:  # no plan (infeasible, or none within the time): the hinted one may be
        plan, error = None, e
    say("solving with the hinted argument shardings pinned")
    try:  # from the fastest plan without the hints (the hinted arguments repaired): in its share of the time,
        # the hinted search finds its own far from the optimum on large problems (GPT-2 large: 69 ms, 31 ms from it)
        hint_plan = search_plan(hinted, _share(time_limit, HINT_SHARE), *search,
                                start=fastest[0][0] if fastest else None, free_start=fastest[0][1] if fastest else None)
    except ShardsolveError:
        hint_plan = None
    except KeyboardInterrupt as interrupt:  # the plan without the hints is complete: the best so far, or the hinted
        interrupt = _as_interrupted(interrupt)  # one's best where that is faster
        if plan is not None and (interrupt.plan is None or plan.cost.total <= interrupt.plan.cost.total):
            interrupt.plan = dataclasses.replace(plan, status="interrupted")
        raise interrupt from None
    if hint_plan is None and plan is None:
        raise error
    kept = plan is None or (hint_plan is not None and hint_plan.cost.total < plan.cost.total)
    best = hint_plan if kept else plan
    stats = dict(best.stats) | {"hint": "kept" if kept else "not kept",
                                "hint_cost": None if hint_plan is None else hint_plan.cost.total}
    best = dataclasses.replace(best, stats=tuple(sorted(stats.items())))
    if not kept:
        return best
    # The hinted plan is optimal (at best) with the hints pinned; of the problem without them, only the other
    # search's bound speaks (none where it found no plan).
    cost = best.cost.total
    bound = min(cost, plan.lower_bound) if plan is not None else 0.0
    proven = bound >= cost - 1e-9 * abs(cost)
    return dataclasses.replace(best, status="optimal" if proven else "feasible", lower_bound=bound,
                               gap=0.0 if proven or cost <= 0 else (cost - bound) / cost)


def _logical_axes(args: tuple, graph: Graph, in_shardings: Any, mesh: MeshSpec) -> LogicalAxes:
    """The arguments' logical axis names, checked (``logical.LogicalAxes.check``)."""
    names = logical_names(args)
    values = [graph.values[v] for v in graph.inputs]
    if len(names) != len(values):
        raise ShardsolveError(f"found logical names for {len(names)} argument leaves, but the program has "
                              f"{len(values)}; pass the arguments as plain pytrees of arrays and Flax variables")
    # a typed key's names are of the key's own dimensions, not its data's trailing ones
    shapes = tuple(v.shape[:len(v.shape) - key_dims(key)] for v, key in zip(values, graph.traced.in_keys))
    axes = LogicalAxes(tuple(names), tuple(v.name for v in values), shapes)
    axes.check(mesh, [s is not None for s, _ in argument_pins(graph.traced, in_shardings, mesh)])
    return axes


MEMORY_CHECKS = ("compiled", "model")
MEMORY_ROUNDS = 4  # solves under the limit at most, the first included
#: While no plan found fits as compiled, the search goes on to this many solves, as long as the solves so far
#: (their wall clock) leave ``time_limit`` room for one more: a limit a known sharding meets is not refused
#: while time remains (MoE small on 1x8 under its expert's 368 KiB: the fifth solve's plan compiles to 346 KiB).
MEMORY_ROUNDS_UNFIT = 12
#: ``time_limit`` covers every solve of one ``plan`` call, in fixed shares (so that the plan does not depend on
#: the clock): with a compiled memory check the solve without the limit gets ``UNLIMITED_SHARE`` of it (where
#: its plan fits, it is the answer: as much time as can be spared), the first solve under the limit
#: ``FIRST_SOLVE_SHARE`` and each re-solve under a searched limit (``MEMORY_ROUNDS - 1`` at most) ``LATER_SHARE``;
#: with ``logical_rules`` the reference solve without the ties gets ``LOGICAL_FREE_SHARE``.
UNLIMITED_SHARE = 0.4
FIRST_SOLVE_SHARE = 0.3
LATER_SHARE = (1 - UNLIMITED_SHARE - FIRST_SOLVE_SHARE) / (MEMORY_ROUNDS - 1)
LOGICAL_FREE_SHARE = 0.3
OPTIMISM = 0.005  # how much a problem's pricing of merged collectives may cost its plan before another is solved
#: ... and the shares of the time limit of the problems solved in turn where the first's optimism costs more:
#: all terminal reductions merged, merged as the first plan merges them (``Built.priced_for``), none merged
#: (the later ones start from problems whose layers prove alike, and usually end in a fraction of a second).
MERGE_SHARES = (0.6, 0.2, 0.2)
#: Without a memory limit, the plan of the shardings Shardy propagates from the same annotations is read and
#: priced as a candidate where the program has at most this many operations (scan bodies' included): reading
#: them compiles the program once, which on small programs costs about a second (the 53 operations of an Adam
#: step 0.6 s, a 449-operation ViT 2.3 s) and on a 12-layer GPT-2 (22,000 operations with its gradient) 7 s,
#: three times its plan. On small programs the latency of merged collectives, which the solver's problem prices
#: only approximately, is most of the step time.
PROPAGATION_CANDIDATE_OPS = 1000


class SolvingNet:
    """The wall-clock net of one ``plan`` call's solves: ``WALL_SLACK * time_limit + WALL_EXTRA`` seconds of
    solving in all, the solver's margins (``encodings.portfolio``); tracing, building and compiling between
    the solves do not count.

    ``time_limit`` stays a deterministic work budget, split in fixed shares; the net
    only stops a solve that overruns its share on a loaded machine, as each solve's
    own net does (``encodings.solve``'s ``wall_limit``). A solve's net is the least of
    what is left of the call's and its own (``WALL_SLACK`` times its share plus ``WALL_EXTRA``).
    """

    def __init__(self, time_limit: float):
        self.total = portfolio.wall_net(time_limit)
        self.spent = 0.0

    def left(self) -> float:
        return max(0.0, self.total - self.spent)

    def for_solve(self, share: float | None) -> float:
        """The net of one solve with work budget ``share`` (None: the solver's default)."""
        own = portfolio.wall_net(encodings.DEFAULT_TIME_LIMIT if share is None else share)
        return min(own, self.left())


#: The net of ``plan``'s solves (``SolvingNet``); None outside ``plan`` or without a time limit.
_NET: contextvars.ContextVar[SolvingNet | None] = contextvars.ContextVar("shardsolve_solving_net", default=None)


def _share(time_limit: float | None, part: float) -> float | None:
    """``part`` of ``time_limit`` (None, no limit, stays None)."""
    return None if time_limit is None else part * time_limit


def _refuse_unsolved(built: Built, solution, limit: float | None, detail: str = "") -> None:
    """Raise the one-line error of a solve that found no plan (unknown, or infeasible with its conflict)."""
    if _found(solution):
        return
    if solution.status == "unknown":
        raise ShardsolveError(
            "the solver found no plan within the time limit; raise --time-limit or relax the memory limit"
        )
    net = _NET.get()  # the conflict within what the call's net has left (``portfolio.EXPLAIN_MIN_S`` at least)
    seconds = portfolio.EXPLAIN_S if net is None else max(portfolio.EXPLAIN_MIN_S, net.left())
    conflict = solution.conflict or encodings.explain_infeasible(built.problem, seconds)
    reason = "; ".join(conflict) if conflict else "the annotations and the memory limit"
    hint = f" (memory limit {format_bytes(limit)} per device{detail})" if limit is not None else ""
    raise InfeasibleError(f"no plan satisfies {reason}{hint}; drop or change one of these constraints", conflict)


def _devices_present(mesh: MeshSpec) -> bool:
    return len(jax.devices()) >= mesh.size


def compiled_peak(plan: Plan, args: tuple) -> int:
    """``memory_analysis()`` peak per device of the compiled ``plan.jit()`` (argument + output + temp - alias)."""
    abstract = [jax.tree.map(abstractify, a) for a in args]
    return compiled_memory(plan.jit().lower(*abstract).compile()).peak


def adopted(assignment: Sequence[int], source: Built, target: Built) -> tuple[int, ...]:
    """An assignment of ``source``'s problem as one of ``target``'s, the same program built otherwise (with or
    without a memory limit: ``Built.unlimited``): a node with the same strategies keeps its strategy; a hub
    the source leaves unused takes the producer's own layout (each read priced from it, as in the source); a
    hub the target leaves unused, or a node of its own (a merged latency's), its last (one strategy; on)."""
    nodes, kept = target.problem.nodes, source.problem.nodes
    out = [int(assignment[k]) if k < len(kept) and kept[k].labels == node.labels
           and node.num_strategies == kept[k].num_strategies else node.num_strategies - 1
           for k, node in enumerate(nodes)]
    for hub, (producer, own) in target.hub_sources.items():
        if hub >= len(kept) or kept[hub].num_strategies == 1:  # unused in the source: the producer's own layout
            out[hub] = int(own[out[producer]])
    return tuple(out)


def _pricing(graph: Graph, built: Built, mesh: MeshSpec, fun: Callable, source: str) -> Callable[[Any], float]:
    """A solution's step time as its plan counts it, for solutions of ``built``'s problem."""
    return lambda solution: to_plan(graph, built, solution, mesh, fun, source).cost.total


def _unlimited_probe(graph: Graph, built: Built, mesh: MeshSpec, fun: Callable, args: tuple, source: str,
                     time_limit: float | None, seed: int, tie: bool, say: Callable[[str], None], progress,
                     price: Callable[[Any], float] | None,
                     start: Sequence[int] | None = None,
                     share: float = UNLIMITED_SHARE) -> tuple[Plan, int, tuple[int, ...]] | None:
    """The plan solved without the memory limit (from ``start`` where given), its compiled peak and its
    assignment (None where none was found).

    It is the fastest plan in the model; where its compiled program fits the
    limit, nothing slower need be searched for, and where it does not, its
    planned and compiled peaks tell the search how far the model is off. It
    gets ``share`` of ``time_limit`` (``UNLIMITED_SHARE``, halved where a
    second probe may follow). Ctrl-C here hands back no plan: none is known
    to fit yet.
    """
    say(f"solving without the memory limit ({len(built.problem.nodes)} nodes, "
        f"{built.problem.num_strategies} strategies)")
    try:
        free = _solve(_limited(built, None), _share(time_limit, share), seed, tie, say if progress else None,
                      price, start)
    except KeyboardInterrupt:
        raise Interrupted(None) from None
    if not _found(free):
        return None
    plan = to_plan(graph, _limited(built, None), free, mesh, fun, source)
    say("compiling it to read its memory")
    return plan, compiled_peak(plan, args), tuple(free.assignment)


def _within_compiled_memory(graph: Graph, built: Built, solution, mesh: MeshSpec, fun: Callable, args: tuple,
                            source: str, limit: float, time_limit: float | None, seed: int, tie: bool,
                            say: Callable[[str], None], progress, price: Callable[[Any], float] | None = None,
                            unlimited: tuple[Plan, int, tuple[int, ...]] | None = None,
                            internal: float | None = None,
                            known: tuple[Plan, int, tuple[int, ...]] | None = None) -> Plan:
    """The fastest plan found whose compiled program's peak memory is within ``limit`` (``plan``'s
    ``memory_check``).

    The model's peak and the compiled one differ by what the model does not
    see (reshard temporaries, XLA's own buffers), and not in proportion, so the
    limit the solver sees is searched: first ``internal`` (``limit`` raised by
    what the model over-counts on the plan without the limit, as compiled;
    ``limit`` itself without that plan), then, while no plan fits, each
    plan's compiled overshoot taken off, then halving the interval between the
    largest limit known to fit (or to be infeasible in the model; at least
    ``allocated_floor``, below which nothing fits) and the
    smallest known to be too loose (where the solver found a plan under
    ``limit``, at first the planned peak of the plan without the limit, which
    compiles over it), for at most ``MEMORY_ROUNDS`` solves, or, while no
    plan fits, ``MEMORY_ROUNDS_UNFIT`` as long as the solves' wall clock
    leaves ``time_limit`` room for one more (``time_limit`` is the whole
    call's: each solve here gets its later share). ``unlimited``:
    the plan without the limit, its compiled peak and its assignment (from
    ``_unlimited_probe``). Where the first solve finds the limit infeasible,
    even with that slack, the error names the constraints. Each solve starts from the fastest plan known to fit, or, before
    one is known, from the plan without the limit (``encodings.solve``'s
    ``start``: repaired where it breaks the limit the solver sees). ``known``:
    a plan known to fit as compiled (propagation's: ``_propagation_plan``), its
    compiled peak and assignment; the answer is never slower.
    """
    best: tuple[Plan, int, tuple[int, ...]] | None = known
    lo, hi, rounds, compiled = 0.0, math.inf, 0, None
    if known is not None:  # a limit the solver sees with room for it is known to fit
        lo = built.problem.peak_usage(known[2])
    floor = allocated_floor(built)  # no plan fits below it
    internal = limit if internal is None else internal  # the limit ``solution`` was solved under

    if unlimited is not None and unlimited[1] > limit and _found(solution):
        hi = built.problem.peak_usage(unlimited[2])  # the plan without the limit, as the solver holds it: too loose
    whole, time_limit = time_limit, _share(time_limit, LATER_SHARE)  # the call's, each re-solve's
    if not math.isfinite(solution.cost) and solution.status == "infeasible":  # even with the model's slack
        _refuse_unsolved(built, solution, limit)
    try:  # Ctrl-C from here on (a re-solve, a compile) hands back the fastest plan known to fit, or none
        while True:
            rounds += 1
            solved = _found(solution)
            if not solved:
                lo = max(lo, internal)
            else:
                plan = to_plan(graph, _limited(built, internal), solution, mesh, fun, source)
                compiled = compiled_peak(plan, args)
                if compiled <= limit:
                    if best is None or plan.cost.total < best[0].cost.total:
                        best = (plan, compiled, tuple(solution.assignment))
                    lo = max(lo, internal)
                else:
                    hi = min(hi, internal, built.problem.peak_usage(solution.assignment))
            net = _NET.get()
            if best is not None and hi <= lo * 1.05:
                break
            if rounds >= MEMORY_ROUNDS and (best is not None or rounds >= MEMORY_ROUNDS_UNFIT or (
                    net is not None and net.spent + time_limit > whole)):
                break
            if best is not None and net is not None and net.left() <= 0:  # the time limit is spent: keep what fits
                break
            if math.isinf(hi):  # fits at the limit itself: nothing looser to try
                break
            # While nothing fits, each plan that compiles over takes its overshoot off (halving from below the
            # last limit undershoots by far where the overshoot is small); then the interval is halved.
            over = solved and compiled > limit and best is None
            internal = hi - (compiled - limit) if over else (max(lo, floor) + hi) / 2
            if internal <= max(lo, floor):
                internal = (max(lo, floor) + hi) / 2
            why = (f"compiled peak memory {format_bytes(compiled)} is over the limit" if solved and compiled > limit
                   else "no plan under the last limit" if not solved else "looking for a faster plan that fits")
            say(f"{why}: solving again under {format_bytes(internal)} as the model counts it")
            start = best[2] if best is not None else None if unlimited is None else unlimited[2]
            solution = _solve(_limited(built, internal), time_limit, seed, _tied_under_limit(built, tie, internal),
                              say if progress else None, price, start)
    except KeyboardInterrupt:
        raise Interrupted(None, None if best is None else dataclasses.replace(best[0], status="interrupted")) from None
    if best is None:
        if compiled is None:
            _refuse_unsolved(_limited(built, internal), solution, limit, f", {format_bytes(internal)} as the model "
                             "counts it")
        raise InfeasibleError(
            f"no plan found whose compiled program fits the memory limit {format_bytes(limit)} per device (the "
            f"last compiled to {format_bytes(compiled)} after {rounds} solves); raise the memory limit",
            (MEMORY_LIMIT_LABEL,),
        )
    say("done")
    plan, compiled, _ = best
    stats = dict(plan.stats) | {"memory_rounds": rounds, "compiled_peak_memory": compiled}
    if known is not None:
        stats["propagation_cost"] = known[0].cost.total
    return dataclasses.replace(plan, stats=tuple(sorted(stats.items())))


def _propagation_plan(graph: Graph, built: Built, mesh: MeshSpec, fun: Callable, args: tuple, source: str,
                      limit: float, say: Callable[[str], None]) -> tuple[Plan, int, tuple[int, ...]] | None:
    """Propagation's program from the same annotations (``built``'s pins of one strategy, hints included) as a
    plan of ``built``'s problem, its compiled peak and its assignment, where it fits ``limit`` as compiled; None
    where it does not, or where its shardings cannot be read (``shardsolve.propagation``)."""
    found = _propagated(graph, built, mesh, fun, source, say)
    if found is None:
        return None
    plan, x = found
    say("compiling propagation's plan to read its memory")
    try:
        compiled = compiled_peak(plan, args)
    except KeyboardInterrupt:
        raise Interrupted(None) from None
    if compiled > limit:
        say(f"propagation's plan compiles to {format_bytes(compiled)}, over the limit")
        return None
    say(f"propagation's plan fits as compiled ({format_bytes(compiled)}): the search starts from it")
    return plan, compiled, x


def _propagated(graph: Graph, built: Built, mesh: MeshSpec, fun: Callable, source: str,
                say: Callable[[str], None]) -> tuple[Plan, tuple[int, ...]] | None:
    """The plan of the shardings Shardy propagates from ``built``'s pins of one strategy (hints included), as a
    plan of ``built``'s problem without a memory limit, and its assignment; None where they cannot be read or
    make no plan the model allows (``shardsolve.propagation``)."""
    say("reading the shardings Shardy propagates from the annotations")
    free = _limited(built, None)
    try:
        scoped = propagated_scopes(graph, built, mesh, *_pinned_shardings(graph, built))
    except KeyboardInterrupt:  # Ctrl-C: no plan is known from it yet
        raise Interrupted(None) from None
    except Exception as e:  # noqa: BLE001 - a program propagation cannot compile is planned without it
        say(f"propagation's shardings could not be read ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "going on without them")
        return None
    x, matched = propagated_assignment(graph, free, scoped)
    x = tuple(int(s) for s in complete(flatten(free.problem), x, np.flatnonzero(~matched)))
    cost = free.problem.evaluate(x)
    if not math.isfinite(cost):
        say("propagation's shardings make no plan the model allows: going on without them")
        return None
    return to_plan(graph, free, Solution(x, cost, 0.0, "feasible"), mesh, fun, source), x


def _pinned_shardings(graph: Graph, built: Built) -> tuple[list[Sharding | None], list[Sharding | None]]:
    """The sharding pinned to every flat argument and result of ``graph``'s program (None where free or where
    a pin allows several)."""
    one = {pin.node: pin.allowed[0] for pin in built.problem.pins if len(pin.allowed) == 1}

    def pinned(node: int | None) -> Sharding | None:
        return None if node is None or node not in one else built.nodes[node].shardings[one[node]]

    inputs = [pinned(built.value_node.get(v)) for v in graph.inputs]
    outputs = [pinned(built.output_node.get(k)) for k in range(len(graph.outputs))]
    return inputs, outputs


#: Under a memory limit, problems of at most this many nodes are searched untied: repeated layers differ in
#: what is live beside them, so tying restricts the plan, and on small problems its restricted search is far
#: from the untied one (GPT-2 small on 1x8 at 1.22 MiB, 3 s: tied 56.0 us with a 99.5% gap, untied 25.2 us with
#: 4.8%); larger ones keep tying, which their untied search needs (GPT-2 large: 5,087 nodes).
UNTIED_UNDER_LIMIT_NODES = 2_000


def _tied_under_limit(built: Built, tie: bool, limit: float | None) -> bool:
    """Whether a solve under memory limit ``limit`` (None: none) ties repeated layers (``UNTIED_UNDER_LIMIT_NODES``)."""
    return tie and (limit is None or len(built.problem.nodes) > UNTIED_UNDER_LIMIT_NODES)


def allocated_floor(built: Built) -> float:
    """The least bytes per device the arguments, constants and outputs can take (pins respected): the compiled
    program allocates each of them whole (``memory_analysis()``), so no plan fits a smaller limit."""
    allowed = {pin.node: pin.allowed for pin in built.problem.pins}
    total = 0.0
    for k, (node, info) in enumerate(zip(built.problem.nodes, built.nodes)):
        if info.kind in ("input", "const", "output") and len(node.usages):
            total += float(np.min(node.usages[list(allowed[k])] if k in allowed else node.usages))
    return total


def _limited(built: Built, limit: float | None) -> Built:
    """``built`` with the problem's memory limit set to ``limit``."""
    if built.problem.usage_limit == limit:
        return built
    return dataclasses.replace(built, problem=dataclasses.replace(built.problem, usage_limit=limit))


def _traced_problem(fun: Callable, args: tuple, mesh: MeshSpec, in_shardings: Any, out_shardings: Any,
                    limit: float | None, carry: Sequence[tuple[int, int]], options: BuildOptions,
                    say: Callable[[str], None]) -> tuple[Graph, Built]:
    """Trace ``fun(*args)``, read the annotations and build the problem."""
    say("tracing")
    # Tracing and building make millions of small objects and few reference cycles: the cyclic
    # collector's full passes over them cost about a third of this stage, and find little. Inside ``plan``'s
    # ``frozen_heap`` they stay out of its passes until the plan is made (a full pass while pricing a
    # 12-layer GPT-2 plan: 0.17 s).
    collecting = gc.isenabled()
    gc.disable()
    try:
        traced = trace(fun, *args, mesh=mesh)
        graph = Graph.from_traced(traced)
        in_pins = argument_pins(traced, in_shardings, mesh)
        out_pins = output_pins(traced, out_shardings, mesh)
        ties = carry_pairs(traced, carry)
        say(f"building the problem ({len(graph.ops)} operations)")
        built = build_problem(graph, mesh, in_pins, out_pins, limit, ties, options)
    finally:
        portfolio.freeze_alive()
        if collecting:
            gc.enable()
    return graph, built


def _solve(built: Built, time_limit: float | None, seed: int, tie: bool, say: Callable[[str], None] | None,
           price: Callable[[Any], float] | None = None, start: Sequence[int] | None = None):
    """The solver's ``Solution``, tied where the program repeats itself (``tie``).

    Where the problem prices merged collectives optimistically
    (``Built.plain_edges``, see ``build.share_merged_latency``) and ``price``
    (a solution's step time as the plan counts it) says the optimism cost more
    than ``OPTIMISM`` of it, two more problems are solved in turn: the merges
    priced as that plan makes them (``Built.priced_for`` its
    ``merge_counts``), then, where that one's pricing is off by more than
    ``OPTIMISM`` too, the problem with every latency paid; the plan with the
    least price is kept. The solves get the ``MERGE_SHARES`` of ``time_limit``,
    each whether or not the next runs (so the plan does not depend on the
    clock). Under a memory limit one problem is solved, with the whole limit:
    priced for the merges ``start`` makes where given, else the plain one.
    The first solve starts from ``start`` where given (``encodings.solve``'s).
    Where repeated layers are tied, only the plan kept gets its certified bound of
    the untied problem (``tying.certify``), with the time the solves left:
    the bounds' shares of those run and the shares of those not run.
    """
    if built.plain_edges is not None and built.problem.usage_limit is not None:
        # Under a memory limit the search needs its whole time (and the compiled-memory search its rounds): one
        # problem, with the merges its start makes (the plan it searches near, exact for it), else the plain
        # one, whose merged latencies are the exact ones. Every latency paid, the limited search prices the
        # small collectives merging makes nearly free as if each ran alone, and trades them for memory at the
        # wrong rate (GPT-2 small on 2x4 at the expert's 692 KiB: 0.16x the expert plain, 0.58x so priced).
        limited = built.plain() if start is None else built.priced_for(built.merge_counts(start))
        return search_once(limited, time_limit, seed, tie, say, start=start)
    if price is None or built.plain_edges is None:
        return search_once(built, time_limit, seed, tie, say, start=start)
    shares = iter(MERGE_SHARES)
    unused = 1.0 - next(shares)
    solution = search_once(built, _share(time_limit, 1.0 - unused), seed, tie, say, certify=False, start=start)
    solved = [solution]
    if not _found(solution):
        return solution
    exact = price(solution)
    optimism = _optimism(solution, exact)
    solution = dataclasses.replace(solution, stats=dict(solution.stats) | {"merge_optimism": optimism})
    best, best_price, best_problem = solution, exact, built.problem
    counts, priced = built.merge_counts(solution.assignment), "optimistically"
    for pricing, problem, what in (("as planned", built.priced_for(counts), "the merges that plan makes"),
                                   ("plain", built.plain(), "every latency paid")):
        if optimism <= OPTIMISM:
            break
        if say:
            say(f"merged collectives priced {priced} cost the plan {optimism:.1%}: solving with {what}")
        priced = pricing
        part = next(shares)
        unused -= part
        try:
            found = search_once(problem, _share(time_limit, part), seed, tie, say, certify=False)
        except KeyboardInterrupt as interrupt:  # the plans found so far are complete; keep the best
            interrupt = _as_interrupted(interrupt)
            if interrupt.solution is None or not price(interrupt.solution) < best_price:
                interrupt.solution = dataclasses.replace(best, status="interrupted")
            raise interrupt from None
        solved.append(found)
        if not _found(found):
            continue
        exact = price(found)
        if exact < best_price:
            best, best_price = dataclasses.replace(found, stats=dict(found.stats) | {"merge_pricing": pricing}), exact
            best_problem = problem.problem
        optimism = _optimism(found, exact)
    # The bound of the plan kept, with what the solves left: their bounds' reserves and the shares not used.
    reserve = None if time_limit is None else (
        unused * time_limit + sum(float((s.stats or {}).get("bound_reserve_s", 0.0)) for s in solved))
    return certify_once(best_problem, best, reserve, seed, say)


def _optimism(solution, exact: float) -> float:
    """How far below the plan's own price ``exact`` a solution's objective put it (a fraction of ``exact``)."""
    return (exact - solution.cost) / exact if exact > 0 else 0.0


def _as_interrupted(interrupt: KeyboardInterrupt) -> Interrupted:
    """``interrupt`` as ``errors.Interrupted``; a bare ``KeyboardInterrupt`` (one that landed outside the
    solver's searches, which attach their best) carries nothing."""
    return interrupt if isinstance(interrupt, Interrupted) else Interrupted(None)


def _found(solution) -> bool:
    """Whether the solve found a plan (a finite cost, not infeasible or unknown)."""
    return solution.status not in ("infeasible", "unknown") and math.isfinite(solution.cost)


def search_once(built: Built, time_limit: float | None, seed: int, tie: bool, say: Callable[[str], None] | None,
                certify: bool = True, start: Sequence[int] | None = None):
    """The solver's ``Solution``: tied where the program repeats itself (``tie``), else searched untied; from
    ``start`` (an assignment of ``built``'s problem) where given.

    ``certify=False``: a tied plan comes without its bound of the untied problem (``tying.solve_tied``), for
    ``certify_once`` to add.
    """
    solver_progress = _solver_progress(say) if say else None
    solution, started = None, time.perf_counter()
    net = _NET.get()
    wall = None if net is None else net.for_solve(time_limit)
    try:
        with portfolio.frozen_heap():  # the collector leaves the traced program and the problem alone
            if tie:
                solution = solve_tied(built.problem, time_limit=time_limit, seed=seed, progress=solver_progress,
                                      wall_limit=wall, certify=certify, start=start)
                if solution is not None and say and certify:
                    _say_tying(say, solution)
            if solution is None:  # untied, in the time tying left (all of it where tying returned at once)
                spent = time.perf_counter() - started
                left = time_limit if time_limit is None or spent < 0.25 * time_limit else max(0.5, time_limit - spent)
                solution = encodings.solve(built.problem, time_limit=left, seed=seed, progress=solver_progress,
                                           wall_limit=None if wall is None else max(0.0, wall - spent),
                                           start=start, explain=False)  # ``_refuse_unsolved`` explains
        solution = _polished(built, solution)  # inside the net: its time is the solve's
    finally:
        if net is not None:
            net.spent += time.perf_counter() - started
    return solution


def _polished(built: Built, solution):
    """``solution`` with the least memory among strategies of equal cost (``encodings.polish``)."""
    if solution is None or not _found(solution):
        return solution
    assignment, moved = polish_usage(built.problem, solution.assignment)
    if not moved:
        return solution
    cost = min(float(solution.cost), built.problem.evaluate(assignment))
    return dataclasses.replace(solution, assignment=assignment, cost=cost,
                               stats=dict(solution.stats or {}) | {"polished_units": moved})


def certify_once(problem, solution, time_limit: float | None, seed: int, say: Callable[[str], None] | None = None):
    """``solution`` of ``search_once(..., certify=False)`` on ``problem`` with its bound of the untied problem
    (``tying.certify``, ``time_limit`` of work), within the call's wall-clock net; others as they are."""
    if (solution.stats or {}).get("tie_bound") != "deferred":
        return solution
    started = time.perf_counter()
    net = _NET.get()
    try:
        with portfolio.frozen_heap():
            solution = certify(problem, solution, time_limit=time_limit, seed=seed,
                               wall_limit=None if net is None else net.for_solve(time_limit))
    finally:
        if net is not None:
            net.spent += time.perf_counter() - started
    if say:
        _say_tying(say, solution)
    return solution


def _say_tying(say: Callable[[str], None], solution) -> None:
    st = solution.stats
    say(f"tied {st['tied_nodes']} nodes in {st['tie_classes']} classes of repeated layers: "
        f"{st['tying']} ({st['tie_bound']} bound of the untied problem)")


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


