"""From a traced program to a strategy-selection ``Problem``, and back to a ``Plan``.

One problem node per decision:

* every argument and closed-over constant: which sharding it arrives in
  (strategies = candidate shardings; a user annotation pins one);
* every operation: which strategy of its rule it runs (operand shardings,
  result shardings, compute time of one device's share);
* every output: which sharding it leaves in (pinned by ``out_shardings``).

An edge joins a value's producer to each consumer, costing the reshard time
from the producer's result sharding to the sharding the consumer's strategy
needs (``cost.reshard_time``; impossible reshards are forbidden). A node's
memory is the per-device bytes of the values it produces, live from its own
time step to the last reader's (arguments, constants and outputs stay live
throughout). So the solver's objective is compute + communication, and the
memory limit bounds the peak of live bytes per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.cost import reshard_time
from shardsolve.errors import ShardsolveError
from shardsolve.graph import Graph, Lit
from shardsolve.mesh import MeshSpec
from shardsolve.problem import FORBIDDEN, Edge, Node, Pin, Problem
from shardsolve.rules.base import Rule, Strategy
from shardsolve.sharding import Sharding, candidate_shardings


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What one problem node decides."""

    kind: str  # "input", "const", "op", "output"
    ref: int  # value id (input/const), op id, or output position
    shardings: tuple[Sharding, ...] = ()  # for input/const/output nodes: strategy -> sharding
    rule: Rule | None = None
    strategies: tuple[Strategy, ...] = ()
    fallback: bool = False


@dataclass
class Built:
    problem: Problem
    nodes: list[NodeInfo]
    op_node: dict[int, int]  # op id -> node index
    value_node: dict[int, int]  # input/const value id -> node index
    output_node: dict[int, int]  # output position -> node index


# -- annotations ------------------------------------------------------------


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding, Sharding))


def broadcast_annotations(prefix: Any, tree_def: Any, what: str) -> list[Any]:
    """Expand a pytree prefix of annotations to one per leaf of ``tree_def``."""
    dummy = jax.tree_util.tree_unflatten(tree_def, [0] * tree_def.num_leaves)
    if _is_spec_leaf(prefix):
        return [prefix] * tree_def.num_leaves
    if what == "in_shardings" and not isinstance(prefix, (tuple, list)):
        raise ShardsolveError(
            f"{what} must be a tuple with one entry per argument (or one PartitionSpec/None for all), "
            f"got {type(prefix).__name__}"
        )
    if isinstance(prefix, list) and isinstance(dummy, tuple):
        prefix = tuple(prefix)
    try:
        full = jax.tree.broadcast(prefix, dummy, is_leaf=_is_spec_leaf)
        leaves = jax.tree_util.tree_leaves(full, is_leaf=_is_spec_leaf)
        if len(leaves) != tree_def.num_leaves:
            raise ValueError(f"{len(leaves)} annotations for {tree_def.num_leaves} leaves")
        return leaves
    except (ValueError, TypeError) as e:
        first = str(e).splitlines()[0]
        raise ShardsolveError(
            f"{what} does not match the {'arguments' if what == 'in_shardings' else 'outputs'}: {first}; "
            f"give a pytree prefix of them with PartitionSpec or None leaves"
        ) from None


def _to_sharding(ann: Any, shape: tuple[int, ...], mesh: MeshSpec, what: str) -> Sharding | None:
    if ann is None:
        return None
    if isinstance(ann, Sharding):
        s = ann
    else:
        spec = ann.spec if isinstance(ann, NamedSharding) else ann
        s = Sharding.from_spec(spec, len(shape), mesh, what=what)
    for a in s.axes:
        mesh.axis(a)
    if not s.divides(shape, mesh):
        d = next(d for d, n in enumerate(shape) if n % s.dim_shards(d, mesh))
        raise ShardsolveError(
            f"{what}: {s.to_spec()} splits dimension {d} of size {shape[d]} into {s.dim_shards(d, mesh)} "
            f"uneven parts; choose axes whose sizes divide it, or leave it None"
        )
    return s


# -- problem construction --------------------------------------------------


def _candidates(shape: tuple[int, ...], mesh: MeshSpec, pinned: Sharding | None) -> tuple[Sharding, ...]:
    cands = candidate_shardings(shape, mesh)
    if pinned is not None and pinned not in cands:
        cands.append(pinned)
    return tuple(cands)


def build_problem(
    graph: Graph,
    mesh: MeshSpec,
    in_pins: Sequence[tuple[Sharding | None, str]],
    out_pins: Sequence[tuple[Sharding | None, str]],
    memory_limit: float | None = None,
    ties: Sequence[tuple[int, int]] = (),
) -> Built:
    """Turn ``graph`` into a ``Problem``.

    ``in_pins``/``out_pins`` hold (sharding or None, label) per flattened
    argument/output; ``ties`` are (argument leaf, output leaf) pairs that must
    get the same sharding (a training step's state going round the loop).
    """
    from shardsolve.rules import fallback_rule, rule_for

    values = graph.values
    horizon = len(graph.ops) + 2  # t=0 inputs, t=k+1 op k, t=len+1 outputs
    last_use = graph.last_use()
    output_ids = {x for x in graph.outputs if not isinstance(x, Lit)}
    nodes: list[Node] = []
    infos: list[NodeInfo] = []
    pins: list[Pin] = []
    value_node: dict[int, int] = {}
    op_node: dict[int, int] = {}
    output_node: dict[int, int] = {}
    # (node index, strategy -> Sharding of the value) for each value's producer.
    produced: dict[int, tuple[int, list[Sharding]]] = {}

    def add(node: Node, info: NodeInfo) -> int:
        nodes.append(node)
        infos.append(info)
        return len(nodes) - 1

    for vid, (pinned, label) in [(v, in_pins[k]) for k, v in enumerate(graph.inputs)] + [
        (v, (None, "")) for v in graph.consts
    ]:
        value = values[vid]
        cands = _candidates(value.shape, mesh, pinned)
        usage = np.array([s.local_bytes(value.shape, value.itemsize, mesh) for s in cands], dtype=np.float64)
        idx = add(
            Node(value.name, np.zeros(len(cands)), usage, (0, horizon), tuple(map(str, cands))),
            NodeInfo(value.kind, vid, cands),
        )
        value_node[vid] = idx
        produced[vid] = (idx, list(cands))
        if pinned is not None:
            pins.append(Pin(idx, (cands.index(pinned),), label))

    edges: dict[tuple[int, int], np.ndarray] = {}
    tables = _Tables(mesh)
    produced_ids: dict[int, np.ndarray] = {vid: tables.ids(produced[vid][1]) for vid in produced}
    rule_cache: dict[tuple, _RuleStrategies] = {}
    for op in graph.ops:
        view = graph.view(op)
        rule = rule_for(view)
        fallback = rule is None
        if rule is None:
            rule = fallback_rule(view)
        itemsizes = tuple(np.dtype(d).itemsize for d in view.in_dtypes + view.out_dtypes)
        key = (rule, op.literal_operands, itemsizes)
        rs = rule_cache.get(key)
        if rs is None:
            rs = _RuleStrategies.make(rule, op.literal_operands, itemsizes, mesh, tables)
            rule_cache[key] = rs
        end = max((last_use.get(v, op.id) for v in op.outputs), default=op.id)
        if any(v in output_ids for v in op.outputs):
            end = horizon - 1
        idx = add(
            Node(op.name(), rs.costs, rs.usage, (op.id + 1, end + 2), rs.labels),
            NodeInfo("op", op.id, rule=rule, strategies=rs.strategies, fallback=fallback),
        )
        op_node[op.id] = idx
        for r, v in enumerate(op.outputs):
            produced[v] = (idx, [s.results[r] for s in rs.strategies])
            produced_ids[v] = rs.result_ids[r]
        for k, x in enumerate(op.inputs):
            if isinstance(x, Lit):
                continue
            value = values[x]
            table = tables.table(value.shape, value.itemsize, produced_ids[x], rs.operand_ids[k])
            key2 = (produced[x][0], idx)
            edges[key2] = edges[key2] + table if key2 in edges else table

    for k, x in enumerate(graph.outputs):
        if isinstance(x, Lit):
            continue
        value = values[x]
        pinned, label = out_pins[k]
        cands = _candidates(value.shape, mesh, pinned)
        idx = add(
            Node(f"outputs[{k}]", np.zeros(len(cands)), np.zeros(len(cands)), (horizon - 1, horizon), tuple(map(str, cands))),
            NodeInfo("output", k, cands),
        )
        output_node[k] = idx
        if pinned is not None:
            pins.append(Pin(idx, (cands.index(pinned),), label))
        edges[(produced[x][0], idx)] = tables.table(value.shape, value.itemsize, produced_ids[x], tables.ids(cands))

    for arg_leaf, out_leaf in ties:
        if out_leaf not in output_node:
            continue
        u, v = value_node[graph.inputs[arg_leaf]], output_node[out_leaf]
        same = np.array([[0.0 if a == b else FORBIDDEN for b in infos[v].shardings] for a in infos[u].shardings])
        edges[(u, v)] = edges[(u, v)] + same if (u, v) in edges else same

    problem = Problem(
        tuple(nodes),
        tuple(Edge(u, v, np.minimum(c, FORBIDDEN)) for (u, v), c in edges.items()),
        memory_limit,
        tuple(pins),
    )
    return Built(problem, infos, op_node, value_node, output_node)


class _Tables:
    """Reshard-time tables, computed once per distinct (shape, dtype size, shardings) and reused."""

    def __init__(self, mesh: MeshSpec):
        self.mesh = mesh
        self._ids: dict[Sharding, int] = {}
        self.shardings: list[Sharding] = []
        self._small: dict[tuple, np.ndarray] = {}

    def ids(self, shardings: Sequence[Sharding]) -> np.ndarray:
        out = np.empty(len(shardings), dtype=np.int64)
        for k, s in enumerate(shardings):
            i = self._ids.get(s)
            if i is None:
                i = self._ids[s] = len(self.shardings)
                self.shardings.append(s)
            out[k] = i
        return out

    def table(self, shape: tuple[int, ...], itemsize: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Seconds to reshard from each source strategy's sharding to each destination's (forbidden = 1e18)."""
        su, si = np.unique(src, return_inverse=True)
        du, di = np.unique(dst, return_inverse=True)
        key = (shape, itemsize, su.tobytes(), du.tobytes())
        small = self._small.get(key)
        if small is None:
            small = np.empty((len(su), len(du)), dtype=np.float64)
            for a, s in enumerate(su):
                for b, d in enumerate(du):
                    t = reshard_time(shape, itemsize, self.shardings[s], self.shardings[d], self.mesh)
                    small[a, b] = FORBIDDEN if math.isinf(t) else t
            self._small[key] = small
        return small[np.ix_(si, di)]


@dataclass(frozen=True)
class _RuleStrategies:
    """A rule's strategies with their costs, memory and sharding ids (shared by equal ops)."""

    strategies: tuple[Strategy, ...]
    costs: np.ndarray
    usage: np.ndarray
    labels: tuple[str, ...]
    operand_ids: tuple[np.ndarray, ...]
    result_ids: tuple[np.ndarray, ...]

    @classmethod
    def make(cls, rule: Rule, fixed: tuple[int, ...], itemsizes: tuple[int, ...], mesh: MeshSpec, tables: _Tables):
        strategies = tuple(rule.strategies(mesh, fixed_operands=fixed))
        n_in = len(rule.operands)
        costs = np.array([rule.strategy_time(s, mesh, itemsizes) for s in strategies], dtype=np.float64)
        usage = np.array(
            [
                sum(r.local_bytes(rule.result_shape(k), itemsizes[n_in + k], mesh) for k, r in enumerate(s.results))
                for s in strategies
            ],
            dtype=np.float64,
        )
        return cls(
            strategies,
            costs,
            usage,
            tuple(s.describe() for s in strategies),
            tuple(tables.ids([s.operands[k] for s in strategies]) for k in range(n_in)),
            tuple(tables.ids([s.results[k] for s in strategies]) for k in range(len(rule.results))),
        )


# -- solution -> plan --------------------------------------------------------


def predicted_collectives(graph: Graph, built: Built, assignment: Sequence[int], mesh: MeshSpec):
    """The collectives a solution implies, one reshard per (value, demanded sharding).

    A value read twice in the same sharding is resharded once, and a reshard
    whose path (``cost.reshard_steps``) passes through a sharding the value
    already has in the program starts from there: this is the rewriter's
    reshard cache (keyed by value and sharding, intermediate steps included),
    so the prediction matches the lowered program.
    """
    from shardsolve.cost import collective_time, reshard_steps
    from shardsolve.plan import PredictedCollective

    values = graph.values
    current: dict[int, Sharding] = {}
    producer_name: dict[int, str] = {}
    for vid, idx in built.value_node.items():
        current[vid] = built.nodes[idx].shardings[assignment[idx]]
        producer_name[vid] = values[vid].name
    done: set[tuple[int, Sharding]] = set()
    out: list[PredictedCollective] = []

    def demand(vid: int, target: Sharding, consumer: str) -> None:
        if (vid, target) in done:
            return
        value = values[vid]
        steps = reshard_steps(value.shape, value.itemsize, current[vid], target, mesh)
        assert steps is not None, (value.name, current[vid], target)
        for step in steps:
            if (vid, step.dst) in done:  # this layout of the value is already in the program
                continue
            done.add((vid, step.dst))
            if step.is_collective:
                out.append(
                    PredictedCollective(
                        step.kind, step.axes, step.bytes, collective_time(step.kind, step.axes, step.bytes, mesh),
                        vid, value.name, step.src, step.dst, producer_name[vid], consumer, target,
                    )
                )

    for op in graph.ops:
        idx = built.op_node[op.id]
        strategy = built.nodes[idx].strategies[assignment[idx]]
        for k, x in enumerate(op.inputs):
            if not isinstance(x, Lit):
                demand(x, strategy.operands[k], op.name())
        for r, vid in enumerate(op.outputs):
            current[vid] = strategy.results[r]
            producer_name[vid] = op.name()
    for k, x in enumerate(graph.outputs):
        if not isinstance(x, Lit):
            idx = built.output_node[k]
            demand(x, built.nodes[idx].shardings[assignment[idx]], f"outputs[{k}]")
    return tuple(out)


def to_plan(graph: Graph, built: Built, solution, mesh: MeshSpec, fun: Callable | None, source: str = ""):
    from collections import Counter

    from shardsolve.plan import Cost, OpPlan, Plan, Signature

    a = solution.assignment
    inputs = tuple(built.nodes[built.value_node[v]].shardings[a[built.value_node[v]]] for v in graph.inputs)
    outputs = []
    for k, x in enumerate(graph.outputs):
        if isinstance(x, Lit):
            outputs.append(Sharding.replicated(np.ndim(x.value)))
        else:
            idx = built.output_node[k]
            outputs.append(built.nodes[idx].shardings[a[idx]])
    ops = []
    compute = 0.0
    fallbacks: Counter = Counter()
    for op in graph.ops:
        idx = built.op_node[op.id]
        info = built.nodes[idx]
        strategy = info.strategies[a[idx]]
        compute += float(built.problem.nodes[idx].costs[a[idx]])
        if info.fallback:
            fallbacks[op.primitive] += 1
        ops.append(OpPlan(op.primitive, strategy.operands, strategy.results, strategy.describe(), info.fallback))
    collectives = predicted_collectives(graph, built, a, mesh)
    communication = sum(c.time for c in collectives)
    by_kind: Counter = Counter()
    for c in collectives:
        by_kind[c.kind] += c.bytes
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
        outputs=tuple(outputs),
        ops=tuple(ops),
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


def _parse_memory(limit: Any) -> float | None:
    if limit is None:
        return None
    if isinstance(limit, str):
        return parse_bytes(limit)
    if isinstance(limit, (int, float)) and limit > 0:
        return float(limit)
    raise ShardsolveError(f"memory_limit {limit!r} must be a positive number of bytes or a string like '16GiB'")


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184.0; ``"1.5e9"`` -> 1.5e9."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ShardsolveError(f"cannot read memory size {text!r}; write it like '16GiB', '512MB' or '1e9'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ShardsolveError(f"memory size {text!r} must be positive")
    return value


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


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
):
    """Plan the sharding of ``fun(*args)`` on ``mesh``; returns a ``shardsolve.Plan``.

    ``in_shardings``/``out_shardings`` are pytree prefixes of the arguments /
    outputs with ``PartitionSpec`` (pinned) or ``None`` (free) leaves.
    ``memory_limit`` is bytes per device (or a string like ``"16GiB"``),
    ``time_limit`` the solver's seconds. ``carry`` lists (argument index,
    output index) pairs whose leaves must share shardings: the output is the
    next value of the argument, as a training step's parameters are.
    ``progress`` receives one-line status messages.
    """
    from shardsolve.encodings import explain_infeasible, solve
    from shardsolve.errors import InfeasibleError
    from shardsolve.mesh import as_mesh_spec
    from shardsolve.trace import trace

    say = progress or (lambda message: None)
    mesh_spec = as_mesh_spec(mesh)
    limit = _parse_memory(memory_limit)
    if time_limit is not None and not time_limit > 0:
        raise ShardsolveError(f"time_limit {time_limit!r} must be a positive number of seconds")
    say("tracing")
    traced = trace(fun, *args)
    graph = Graph.from_traced(traced)
    in_ann = broadcast_annotations(in_shardings, traced.in_tree, "in_shardings")
    out_ann = broadcast_annotations(out_shardings, traced.out_tree, "out_shardings")
    in_pins = []
    for k, (ann, vid) in enumerate(zip(in_ann, graph.inputs)):
        value = graph.values[vid]
        label = f"in_shardings{value.name[len('args'):]}"
        s = _to_sharding(ann, value.shape, mesh_spec, label)
        in_pins.append((s, f"{label} = {s.to_spec()}" if s is not None else label))
    out_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(traced.out_tree, list(range(traced.out_tree.num_leaves))))[0]]
    out_pins = []
    for k, ann in enumerate(out_ann):
        shape = tuple(traced.out_avals[k].shape)
        label = f"out_shardings{out_paths[k]}"
        s = _to_sharding(ann, shape, mesh_spec, label)
        out_pins.append((s, f"{label} = {s.to_spec()}" if s is not None else label))
    ties = carry_pairs(traced, carry)
    say(f"building the problem ({len(graph.ops)} operations)")
    built = build_problem(graph, mesh_spec, in_pins, out_pins, limit, ties)
    say(f"solving ({len(built.problem.nodes)} nodes, {built.problem.num_strategies} strategies)")
    solution = solve(built.problem, time_limit=time_limit, seed=seed, progress=_solver_progress(say) if progress else None)
    if solution.status in ("infeasible", "unknown") or not math.isfinite(solution.cost):
        if solution.status == "unknown":
            raise ShardsolveError(
                "the solver found no plan within the time limit; raise --time-limit or relax the memory limit"
            )
        conflict = solution.conflict or explain_infeasible(built.problem)
        reason = "; ".join(conflict) if conflict else "the annotations and the memory limit"
        hint = f" (memory limit {format_bytes(limit)} per device)" if limit is not None else ""
        raise InfeasibleError(
            f"no plan satisfies {reason}{hint}; drop or change one of these constraints", conflict
        )
    say("done")
    return to_plan(graph, built, solution, mesh_spec, fun, source)


def _solver_progress(say: Callable[[str], None], every: float = 0.25) -> Callable[[str, float, float], None]:
    """Turn the solver's frequent callbacks into at most one status line per ``every`` seconds."""
    import time

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


def _leaf_ranges(tree_def: Any) -> list[tuple[int, int]] | None:
    """Leaf index range of each top-level child of a tuple/list pytree."""
    dummy = jax.tree_util.tree_unflatten(tree_def, list(range(tree_def.num_leaves)))
    if not isinstance(dummy, (tuple, list)):
        return None
    out, start = [], 0
    for child in dummy:
        n = len(jax.tree_util.tree_leaves(child))
        out.append((start, start + n))
        start += n
    return out


def carry_pairs(traced: Any, carry: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Expand (argument index, output index) pairs to (argument leaf, output leaf) pairs."""
    pairs: list[tuple[int, int]] = []
    if not carry:
        return pairs
    args = _leaf_ranges(traced.in_tree)
    outs = _leaf_ranges(traced.out_tree) or [(0, traced.out_tree.num_leaves)]
    dummy_in = jax.tree_util.tree_unflatten(traced.in_tree, [0] * traced.in_tree.num_leaves)
    dummy_out = jax.tree_util.tree_unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
    for a, o in carry:
        if not (0 <= a < len(args)) or not (0 <= o < len(outs)):
            raise ShardsolveError(
                f"carry pair ({a}, {o}) is out of range: {len(args)} arguments, {len(outs)} outputs"
            )
        out_sub = dummy_out[o] if isinstance(dummy_out, (tuple, list)) else dummy_out
        if jax.tree_util.tree_structure(dummy_in[a]) != jax.tree_util.tree_structure(out_sub):
            raise ShardsolveError(
                f"carry pair ({a}, {o}): argument {a} and output {o} have different pytree structures"
            )
        (a0, a1), (o0, o1) = args[a], outs[o]
        for k in range(a1 - a0):
            if tuple(traced.in_avals[a0 + k].shape) != tuple(traced.out_avals[o0 + k].shape):
                raise ShardsolveError(f"carry pair ({a}, {o}): leaf {k} changes shape between argument and output")
            pairs.append((a0 + k, o0 + k))
    return pairs
