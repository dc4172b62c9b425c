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

A ``scan`` is expanded (``EXPAND_SCAN``): its body's ops become nodes once,
their costs and internal edges times ``length``, and its boundary (consts,
one node per carry shared by carry-in, body and carry-out, x/y slices) is
described in ``ScanNodes``. Reads of loop invariants (the scan's consts, the
body's closed-over constants) are resharded once, before the loop
(``loop_invariant_demands``), so their edges are not multiplied by ``length``.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.cost import reshard_time, reshard_time_given
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
    scope: tuple[int, ...] = ()  # () for the program; (k, ...) inside the body of scan op k, ...


# Plan a scan's body once (True), or treat the whole scan as one op that falls back to
# replicating its operands (False, the behaviour before scan support; kept for comparison).
EXPAND_SCAN = True


def _expandable(op) -> bool:
    p = op.params
    return all(k in p for k in ("jaxpr", "length", "num_consts", "num_carry")) and int(p["length"]) > 0


def _replicated_scan_time(graph: Graph, op, mesh: MeshSpec) -> float:
    """Compute time of a scan whose body runs replicated: every body op's replicated strategy, ``length`` times.

    The price of a scan that is not expanded (``EXPAND_SCAN = False``), so that
    plans with and without expansion are priced alike.
    """
    from shardsolve.rules import fallback_rule, rule_for

    body = graph.body(op)
    total = 0.0
    for bop in body.ops:
        if bop.primitive == "scan" and _expandable(bop):
            total += _replicated_scan_time(body, bop, mesh)
        view = body.view(bop)
        rule = rule_for(view) or fallback_rule(view)
        replicated = rule.strategies(mesh, allow_partial=False, fixed_operands=bop.literal_operands)[0]
        itemsizes = tuple(np.dtype(d).itemsize for d in view.in_dtypes + view.out_dtypes)
        total += rule.strategy_time(replicated, mesh, itemsizes)
    return total * int(op.params["length"])


@dataclass
class ScanNodes:
    """The problem nodes of one scan whose body is planned once.

    * ``const[k]``: the sharding of the k-th const inside the body; its edge
      from the outer producer is a reshard paid once, before the loop, and so
      are its edges to the body ops reading it in other layouts (a loop
      invariant: the rewriter makes each such layout before the loop, see
      ``loop_invariant_demands``). ``body_consts`` likewise.
    * ``carry[k]``: ONE sharding for the k-th carry wherever it appears: the
      scan's carry-in operand (edge from the outer producer, paid once), the
      body's carry invar, the body's carry outvar (edge from the body's
      producer, paid every iteration: the carry leaves each iteration as it
      entered, a fixed point) and the scan's carry-out result.
    * ``xs[k]``: the sharding of the k-th x-slice in the body; the scan's xs
      operand is read with the stacked dimension unsplit (``((),) + slice``).
    * ``ys[k]``: likewise for the k-th y-slice and the scan's ys result (the
      body's producer reshards into it every iteration).

    Body ops are problem nodes once, their costs and internal edges times
    ``length`` (times the enclosing scans' lengths when nested), except reads
    of the loop invariants (``const``, ``body_consts``). Memory: body
    ops, consts and xs live only during the scan's time step of the enclosing
    program (all at once, an over-estimate of one iteration's peak, at their
    per-iteration bytes); carry and ys nodes hold the scan's results and live
    from that step to their last reader.
    """

    op: int  # the scan's op id in its graph
    length: int
    body: Graph
    const: list[int] = field(default_factory=list)
    carry: list[int] = field(default_factory=list)
    xs: list[int] = field(default_factory=list)
    ys: list[int] = field(default_factory=list)
    body_consts: list[int] = field(default_factory=list)  # closed-over constants of the body
    op_node: dict[int, int] = field(default_factory=dict)  # body op id -> node (expanded scans excluded)


@dataclass
class Built:
    problem: Problem
    nodes: list[NodeInfo]
    op_node: dict[int, int]  # op id -> node index (expanded scans have no node: see ``scans``)
    value_node: dict[int, int]  # input/const value id -> node index
    output_node: dict[int, int]  # output position -> node index
    scans: dict[tuple[int, ...], ScanNodes] = field(default_factory=dict)  # scope (scan op ids) -> nodes


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
    if len(set(s.axes)) != len(s.axes):
        raise ShardsolveError(f"{what}: sharding {s} uses a mesh axis twice; use each axis once")
    # A split that does not divide its dimension is padded (see sharding.Sharding.evened); one with
    # more parts than elements leaves whole devices empty.
    for d, size in enumerate(shape):
        n = s.dim_shards(d, mesh)
        if n > size:
            raise ShardsolveError(
                f"{what}: {s.to_spec()} splits dimension {d} of size {size} into {n} parts, more than it has "
                f"elements; use fewer mesh axes on it, or leave it None"
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
        # An uneven argument arrives evened (JAX lays out no uneven split at a jit boundary): that buffer stays live.
        usage = np.array([s.evened(value.shape, mesh).local_bytes(value.shape, value.itemsize, mesh) for s in cands],
                         dtype=np.float64)
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
    # Values are keyed by (scope, value id): scope () is the program, (k,) the body of
    # scan op k, (k, j) the body of scan op j inside that body, ...
    produced_at: dict[tuple, tuple[int, list[Sharding]]] = {((), v): p for v, p in produced.items()}
    ids_at: dict[tuple, np.ndarray] = {key: tables.ids(p[1]) for key, p in produced_at.items()}
    rule_cache: dict[tuple, _RuleStrategies] = {}
    scans: dict[tuple, ScanNodes] = {}
    # A scan's loop invariants (its consts, its body's closed-over constants) are resharded
    # once, before the loop (see ``loop_invariant_demands``): their reads cost the scan's scale.
    invariant_scale: dict[tuple, float] = {}

    def add_edge(u: int, v: int, table: np.ndarray) -> None:
        if u == v:  # a scan body handing a carry straight back: same node, same sharding
            return
        if (v, u) in edges:  # a carry node and a body op read each other: one edge per pair
            u, v, table = v, u, table.T
        edges[(u, v)] = edges[(u, v)] + table if (u, v) in edges else table

    arguments = set(graph.inputs)

    def read_edge(scope: tuple, g: Graph, x: int, dst: np.ndarray, to: int, scale: float) -> None:
        scale = invariant_scale.get((scope, x), scale)
        value = g.values[x]
        srcs = produced_at[(scope, x)][1]
        if not scope and x in arguments and not all(s.divides(value.shape, mesh) for s in srcs):
            # An uneven argument arrives evened and keeps that layout too: reaching it again is free.
            table = np.array([[min(reshard_time_given(value.shape, value.itemsize, s, tables.shardings[t], mesh,
                                                      s.evened(value.shape, mesh)), FORBIDDEN) for t in dst]
                              for s in srcs], dtype=np.float64)
        else:
            table = tables.table(value.shape, value.itemsize, ids_at[(scope, x)], dst)
        add_edge(produced_at[(scope, x)][0], to, table * scale if scale != 1 else table)

    def add_op(g: Graph, op, scope: tuple, scale: float, interval: tuple[int, int], name: str) -> None:
        view = g.view(op)
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
        costs = rs.costs * scale if scale != 1 else rs.costs
        if op.primitive == "scan" and _expandable(op):  # not expanded: its body runs replicated
            costs = costs + scale * _replicated_scan_time(g, op, mesh)
        idx = add(
            Node(name, costs, rs.usage, interval, rs.labels),
            NodeInfo("op", op.id, rule=rule, strategies=rs.strategies, fallback=fallback, scope=scope),
        )
        if scope:
            scans[scope].op_node[op.id] = idx
        else:
            op_node[op.id] = idx
        for r, v in enumerate(op.outputs):
            produced_at[(scope, v)] = (idx, [s.results[r] for s in rs.strategies])
            ids_at[(scope, v)] = rs.result_ids[r]
        for k, x in enumerate(op.inputs):
            if not isinstance(x, Lit):
                read_edge(scope, g, x, rs.operand_ids[k], idx, scale)

    def add_scan(g: Graph, op, scope: tuple, scale: float, step: int, end: int, name: str) -> None:
        """A scan's body planned once; see ``ScanNodes``."""
        p = op.params
        length, n_consts, n_carry = int(p["length"]), int(p["num_consts"]), int(p["num_carry"])
        body = g.body(op)
        inner = scope + (op.id,)
        inner_scale = scale * length
        sn = scans[inner] = ScanNodes(op.id, length, body)
        within = (step, step + 1)
        for k, x in enumerate(op.inputs):
            bvid = body.inputs[k]
            bval = body.values[bvid]
            cands = tuple(candidate_shardings(bval.shape, mesh))
            kind = "const" if k < n_consts else "carry" if k < n_consts + n_carry else "xs"
            outer = cands if kind != "xs" else tuple(Sharding(((),) + c.dims) for c in cands)
            if kind == "carry":
                usage = [c.local_bytes(bval.shape, bval.itemsize, mesh) for c in cands]
                interval = (step, end)
            else:  # consts and xs are the operands' own buffers (a resharded copy is not counted)
                usage, interval = [0.0] * len(cands), within
            idx = add(
                Node(f"{name} {kind}[{len(getattr(sn, kind))}]", np.zeros(len(cands)), np.array(usage, dtype=np.float64),
                     interval, tuple(map(str, cands))),
                NodeInfo(f"scan-{kind}", op.id, cands, scope=inner),
            )
            getattr(sn, kind).append(idx)
            if kind == "const":
                invariant_scale[(inner, bvid)] = scale
            produced_at[(inner, bvid)] = (idx, list(cands))
            ids_at[(inner, bvid)] = tables.ids(cands)
            if not isinstance(x, Lit):
                read_edge(scope, g, x, tables.ids(outer), idx, scale)
        for k, bvid in enumerate(body.consts):
            bval = body.values[bvid]
            cands = tuple(candidate_shardings(bval.shape, mesh))
            idx = add(
                Node(f"{name} body const[{k}]", np.zeros(len(cands)),
                     np.array([c.local_bytes(bval.shape, bval.itemsize, mesh) for c in cands], dtype=np.float64),
                     within, tuple(map(str, cands))),
                NodeInfo("scan-body-const", bvid, cands, scope=inner),
            )
            sn.body_consts.append(idx)
            invariant_scale[(inner, bvid)] = scale
            produced_at[(inner, bvid)] = (idx, list(cands))
            ids_at[(inner, bvid)] = tables.ids(cands)
        add_ops(body, inner, inner_scale, within, f"{name}/")
        for r, bx in enumerate(body.outputs):
            if r < n_carry:
                to = sn.carry[r]
            else:
                out_val = g.values[op.outputs[r]]
                cands = tuple(candidate_shardings(out_val.shape[1:], mesh))
                to = add(
                    Node(f"{name} ys[{r - n_carry}]", np.zeros(len(cands)),
                         np.array([Sharding(((),) + c.dims).local_bytes(out_val.shape, out_val.itemsize, mesh)
                                   for c in cands], dtype=np.float64),
                         (step, end), tuple(map(str, cands))),
                    NodeInfo("scan-ys", op.id, cands, scope=inner),
                )
                sn.ys.append(to)
            if not isinstance(bx, Lit):
                read_edge(inner, body, bx, tables.ids(infos[to].shardings), to, inner_scale)
        for r, v in enumerate(op.outputs):
            to = sn.carry[r] if r < n_carry else sn.ys[r - n_carry]
            shardings = list(infos[to].shardings)
            if r >= n_carry:
                shardings = [Sharding(((),) + c.dims) for c in shardings]
            produced_at[(scope, v)] = (to, shardings)
            ids_at[(scope, v)] = tables.ids(shardings)

    def add_ops(g: Graph, scope: tuple, scale: float, within: tuple[int, int] | None, prefix: str) -> None:
        g_last = g.last_use()
        g_outputs = {x for x in g.outputs if not isinstance(x, Lit)}
        for op in g.ops:
            if within is None:  # the program: op k runs at time k + 1, results live to their last reader
                step = op.id + 1
                end = max((g_last.get(v, op.id) for v in op.outputs), default=op.id) + 2
                if any(v in g_outputs for v in op.outputs):
                    end = horizon + 1
                interval = (step, end)
            else:  # inside a scan body: everything lives in the scan's time step
                step, end = within[0], within[1]
                interval = within
            name = op.name() if not prefix else f"{prefix}{op.name()}"
            if op.primitive == "scan" and EXPAND_SCAN and _expandable(op):
                add_scan(g, op, scope, scale, step, end, name)
            else:
                add_op(g, op, scope, scale, interval, name)

    add_ops(graph, (), 1.0, None, "")
    produced = {v: p for (scope, v), p in produced_at.items() if scope == ()}
    produced_ids = {v: i for (scope, v), i in ids_at.items() if scope == ()}

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
        # An uneven output leaves evened (JAX returns no uneven split): the producer reshards straight to that.
        leave = tables.ids([c.evened(value.shape, mesh) for c in cands])
        edges[(produced[x][0], idx)] = tables.table(value.shape, value.itemsize, produced_ids[x], leave)

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
    return Built(problem, infos, op_node, value_node, output_node, scans)


class _Tables:
    """Reshard-time tables, computed once per distinct (shape, dtype size, shardings) and reused."""

    def __init__(self, mesh: MeshSpec):
        self.mesh = mesh
        self._ids: dict[Sharding, int] = {}
        self.shardings: list[Sharding] = []
        self._small: dict[tuple, np.ndarray] = {}
        self._full: dict[tuple, np.ndarray] = {}

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
        """Seconds to reshard from each source strategy's sharding to each destination's (forbidden = 1e18).

        The returned array may be shared between edges: never modify it in place.
        """
        full_key = (shape, itemsize, src.tobytes(), dst.tobytes())
        hit = self._full.get(full_key)
        if hit is not None:
            return hit
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
        out = self._full[full_key] = small[np.ix_(si, di)]
        out.flags.writeable = False
        return out


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


def loop_invariant_demands(body: Graph, n_consts: int, operand_targets: Sequence[Sequence[Sharding]],
                           output_targets: Sequence[Sharding]) -> list[tuple[int, Sharding]]:
    """The layouts a scan body reads its loop invariants in, in the order it first reads them.

    A scan's loop invariants are its consts (the body's first ``n_consts``
    inputs) and its body's closed-over constants: the same in every
    iteration, so each layout the body reads one in is made once, before the
    loop, and handed in (the rewriter's ``_Rewriter._scan``), as XLA's
    loop-invariant code motion would hoist it. ``operand_targets[j]`` are the
    shardings body op ``j`` reads its operands in, ``output_targets`` those of
    the carry-out and y-slices. Reshards made before the loop share the
    enclosing scope's reshard cache, so two scans closing over the same value
    in the same layout reshard it once; ``build_problem`` prices their reads at
    the scan's scale, not ``length`` times.
    """
    invariant = set(body.inputs[:n_consts]) | set(body.consts)
    out: list[tuple[int, Sharding]] = []
    seen: set[tuple[int, Sharding]] = set()

    def read(x: int | Lit, target: Sharding) -> None:
        if not isinstance(x, Lit) and x in invariant and (x, target) not in seen:
            seen.add((x, target))
            out.append((x, target))

    for op, targets in zip(body.ops, operand_targets, strict=True):
        for x, target in zip(op.inputs, targets):
            read(x, target)
    for x, target in zip(body.outputs, output_targets):
        read(x, target)
    return out


def _body_operand_targets(body: Graph, built: Built, assignment: Sequence[int], scope: tuple) -> list[tuple]:
    """The shardings each op of a scan body (scope ``scope``) reads its operands in, as planned."""
    sharding_of = lambda idx: built.nodes[idx].shardings[assignment[idx]]  # noqa: E731
    out = []
    for op in body.ops:
        sn = built.scans.get(scope + (op.id,))
        if sn is None:
            idx = built.scans[scope].op_node[op.id]
            out.append(built.nodes[idx].strategies[assignment[idx]].operands)
        else:
            n_cc = len(sn.const) + len(sn.carry)
            boundary = [sharding_of(i) for i in sn.const + sn.carry + sn.xs]
            out.append(tuple(s if k < n_cc else Sharding(((),) + s.dims) for k, s in enumerate(boundary)))
    return out


def predicted_collectives(graph: Graph, built: Built, assignment: Sequence[int], mesh: MeshSpec):
    """The collectives a solution implies, one reshard per (value, demanded sharding).

    A value read twice in the same sharding is resharded once, and a reshard
    whose path (``cost.reshard_steps``) passes through a sharding the value
    already has in the program starts from there: this is the rewriter's
    reshard cache (keyed by value and sharding, intermediate steps included),
    so the prediction matches the lowered program.

    Inside a scan body (planned once), each collective is listed once with
    ``repeats`` = the number of iterations (the product of the enclosing
    scans' lengths): ``bytes`` is one run's, as the compiled while loop's body
    shows it once, and ``time`` is the total over all runs. Values are named
    ``%<scan> scan/<body value>`` and consumers ``%<scan> scan/%<k> <primitive>``;
    ``value`` is a value id of ``graph`` (ids are per graph), so for a body
    value it is the scan's first result.

    The layouts a body reads its loop invariants in (``loop_invariant_demands``)
    are made before the loop, in the scan's scope, once per run of the scan:
    consumer ``%<scan> scan ... before the loop, for its body``. A const is
    resharded from the layout it enters the body in, sharing the enclosing
    scope's cache with the outer value (two scans reading it in one layout
    reshard it once); a literal const or a closed-over constant of the body
    from its own planned layout, per scan.
    """
    from shardsolve.cost import collective_time, reshard_steps
    from shardsolve.plan import PredictedCollective

    out: list[PredictedCollective] = []

    def emit(value, key: Any, start: Sharding, target: Sharding, seen: set, value_name: str, producer: str,
             consumer: str, repeats: int, anchor: int) -> None:
        """The collectives of resharding ``value`` from ``start`` to ``target``; ``seen``: its layouts so far."""
        if (key, target) in seen:
            return
        steps = reshard_steps(value.shape, value.itemsize, start, target, mesh)
        assert steps is not None, (value.name, start, target)
        # Start from the last layout along the way that is already in the program (as lower's reshard does).
        known = [k for k, step in enumerate(steps) if (key, step.dst) in seen]
        for step in steps[known[-1] + 1:] if known else steps:
            seen.add((key, step.dst))
            if step.is_collective:
                out.append(
                    PredictedCollective(
                        step.kind, step.axes, step.bytes,
                        collective_time(step.kind, step.axes, step.bytes, mesh) * repeats,
                        anchor, value_name, step.src, step.dst, producer, consumer, target, repeats,
                    )
                )

    def walk(g: Graph, scope: tuple, current: dict[int, Sharding], producer_name: dict[int, str],
             repeats: int, prefix: str, anchor: int | None, preset: Sequence[tuple[int, Sharding]] = ()) -> None:
        values = g.values
        done: set[tuple[int, Sharding]] = set(preset)  # layouts the enclosing scope hands in (hoisted)

        def demand(vid: int, target: Sharding, consumer: str, src: Sharding | None = None) -> None:
            """Reshard ``vid`` from ``src`` (default: its layout here) to ``target``."""
            emit(values[vid], vid, current[vid] if src is None else src, target, done, prefix + values[vid].name,
                 producer_name[vid], consumer, repeats, vid if anchor is None else anchor)

        sharding_of = lambda idx: built.nodes[idx].shardings[assignment[idx]]  # noqa: E731
        for op in g.ops:
            name = prefix + op.name()
            inner = scope + (op.id,)
            sn = built.scans.get(inner)
            if sn is None:
                table = built.op_node if not scope else built.scans[scope].op_node
                idx = table[op.id]
                strategy = built.nodes[idx].strategies[assignment[idx]]
                for k, x in enumerate(op.inputs):
                    if not isinstance(x, Lit):
                        demand(x, strategy.operands[k], name)
                for r, vid in enumerate(op.outputs):
                    current[vid] = strategy.results[r]
                    producer_name[vid] = name
                continue
            body = sn.body
            boundary = [sharding_of(i) for i in sn.const + sn.carry + sn.xs]
            n_cc = len(sn.const) + len(sn.carry)
            for k, x in enumerate(op.inputs):
                if not isinstance(x, Lit):
                    demand(x, boundary[k] if k < n_cc else Sharding(((),) + boundary[k].dims), name)
            b_current: dict[int, Sharding] = {}
            b_producer: dict[int, str] = {}
            for k, bvid in enumerate(body.inputs):
                b_current[bvid] = boundary[k]
                b_producer[bvid] = f"{name}/{body.values[bvid].name}"
            for k, bvid in enumerate(body.consts):
                b_current[bvid] = sharding_of(sn.body_consts[k])
                b_producer[bvid] = f"{name}/{body.values[bvid].name}"
            b_prefix = f"{name.split(' [')[0]}/"
            b_anchor = anchor if anchor is not None else op.outputs[0] if op.outputs else None
            # The loop invariants' reshards run here, once, before the loop (as the rewriter hoists them):
            # a const from its outer value's reshards (shared with this scope's), a literal const or a
            # closed-over constant from this scan's own layouts.
            n_consts = len(sn.const)
            own: set[tuple[int, Sharding]] = set()
            hoisted = loop_invariant_demands(body, n_consts, _body_operand_targets(body, built, assignment, inner),
                                             [sharding_of(i) for i in sn.carry + sn.ys])
            for bvid, target in hoisted:
                if target == b_current[bvid]:
                    continue
                where = f"{name} before the loop, for its body"
                k = body.inputs.index(bvid) if bvid in body.inputs[:n_consts] else None
                if k is not None and not isinstance(op.inputs[k], Lit):
                    demand(op.inputs[k], target, where, src=b_current[bvid])
                else:
                    bval = body.values[bvid]
                    emit(bval, bvid, b_current[bvid], target, own, b_prefix + bval.name, b_producer[bvid], where,
                         repeats, b_anchor)
            walk(body, inner, b_current, b_producer, repeats * sn.length, b_prefix, b_anchor,
                 [(bvid, t) for bvid, t in hoisted])
            ends = [sharding_of(i) for i in sn.carry + sn.ys]
            for r, vid in enumerate(op.outputs):
                s = ends[r] if r < len(sn.carry) else Sharding(((),) + ends[r].dims)
                current[vid] = s
                producer_name[vid] = name
        if scope:
            sn = built.scans[scope]
            ends = [sharding_of(i) for i in sn.carry + sn.ys]
            for r, x in enumerate(g.outputs):
                if not isinstance(x, Lit):
                    kind = f"carry[{r}]" if r < len(sn.carry) else f"ys[{r - len(sn.carry)}]"
                    demand(x, ends[r], f"{prefix[:-1]} {kind}")
        else:
            for k, x in enumerate(g.outputs):
                if not isinstance(x, Lit):
                    idx = built.output_node[k]
                    demand(x, sharding_of(idx).evened(values[x].shape, mesh), f"outputs[{k}]")  # leaves evened

    current: dict[int, Sharding] = {}
    producer_name: dict[int, str] = {}
    for vid, idx in built.value_node.items():
        current[vid] = built.nodes[idx].shardings[assignment[idx]]
        producer_name[vid] = graph.values[vid].name
    # An uneven argument arrives evened (JAX lays out no uneven split): that layout is in the program too.
    arrived = [(v, current[v].evened(graph.values[v].shape, mesh)) for v in graph.inputs]
    walk(graph, (), current, producer_name, 1, "", None, [(v, e) for v, e in arrived if e != current[v]])
    return tuple(out)


def _op_plans(g: Graph, built: Built, a: Sequence[int], scope: tuple, fallbacks, compute: list[float]) -> tuple:
    """The ``OpPlan`` of every op of ``g`` (a program or a scan body), summing node costs into ``compute``."""
    from shardsolve.plan import OpPlan

    ops = []
    for op in g.ops:
        sn = built.scans.get(scope + (op.id,))
        if sn is not None:
            pick = lambda idx: built.nodes[idx].shardings[a[idx]]  # noqa: E731
            const, carry, xs, ys = ([pick(i) for i in group] for group in (sn.const, sn.carry, sn.xs, sn.ys))
            operands = tuple(const + carry + [Sharding(((),) + s.dims) for s in xs])
            results = tuple(carry + [Sharding(((),) + s.dims) for s in ys])
            body = _op_plans(sn.body, built, a, scope + (op.id,), fallbacks, compute)
            ops.append(OpPlan(op.primitive, operands, results, f"body planned once, x{sn.length}", False,
                              body=body, length=sn.length, body_consts=tuple(pick(i) for i in sn.body_consts)))
            continue
        idx = built.op_node[op.id] if not scope else built.scans[scope].op_node[op.id]
        info = built.nodes[idx]
        strategy = info.strategies[a[idx]]
        compute[0] += float(built.problem.nodes[idx].costs[a[idx]])
        if info.fallback:
            fallbacks[op.primitive] += 1
        ops.append(OpPlan(op.primitive, strategy.operands, strategy.results, strategy.describe(), info.fallback))
    return tuple(ops)


def to_plan(graph: Graph, built: Built, solution, mesh: MeshSpec, fun: Callable | None, source: str = ""):
    from collections import Counter

    from shardsolve.plan import Cost, Plan, Signature

    a = solution.assignment
    inputs = tuple(built.nodes[built.value_node[v]].shardings[a[built.value_node[v]]] for v in graph.inputs)
    outputs = []
    for k, x in enumerate(graph.outputs):
        if isinstance(x, Lit):
            outputs.append(Sharding.replicated(np.ndim(x.value)))
        else:
            idx = built.output_node[k]
            outputs.append(built.nodes[idx].shardings[a[idx]])
    fallbacks: Counter = Counter()
    total = [0.0]
    ops = _op_plans(graph, built, a, (), fallbacks, total)
    compute = total[0]
    collectives = predicted_collectives(graph, built, a, mesh)
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
        consts=tuple(built.nodes[built.value_node[v]].shardings[a[built.value_node[v]]] for v in graph.consts),
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
    tie: bool = True,
):
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
    # Tracing and building make millions of small objects and few reference cycles: the cyclic
    # collector's full passes over them cost about a third of this stage, and find little.
    collecting = gc.isenabled()
    gc.disable()
    try:
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
    finally:
        if collecting:
            gc.enable()
    say(f"solving ({len(built.problem.nodes)} nodes, {built.problem.num_strategies} strategies)")
    solver_progress = _solver_progress(say) if progress else None
    solution = None
    if tie:
        from shardsolve.tying import solve_tied

        solution = solve_tied(built.problem, time_limit=time_limit, seed=seed, progress=solver_progress)
        if solution is not None:
            st = solution.stats
            say(f"tied {st['tied_nodes']} nodes in {st['tie_classes']} classes of repeated layers: "
                f"{st['tying']} ({st['tie_bound']} bound of the untied problem)")
    if solution is None:
        solution = solve(built.problem, time_limit=time_limit, seed=seed, progress=solver_progress)
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
        (a0, a1), (o0, _) = args[a], outs[o]
        for k in range(a1 - a0):
            if tuple(traced.in_avals[a0 + k].shape) != tuple(traced.out_avals[o0 + k].shape):
                raise ShardsolveError(f"carry pair ({a}, {o}): leaf {k} changes shape between argument and output")
            pairs.append((a0 + k, o0 + k))
    return pairs
