"""From a traced program to a strategy-selection ``Problem``.

One problem node per decision:

* every argument and closed-over constant: which sharding it arrives in
  (strategies = candidate shardings; a user annotation pins one);
* every operation: which strategy of its rule it runs (operand shardings,
  result shardings, compute time of one device's share, counting the memory
  traffic XLA's loop fusion leaves: ``memory_traffic``);
* every output: which sharding it leaves in (pinned by ``out_shardings``).

An edge joins a value's producer to each consumer, costing the reshard time
from the producer's result sharding to the sharding the consumer's strategy
needs (``cost.reshard_time``; impossible reshards are forbidden). Where
several operations read a value and may reshard it, a *hub* node (the layout
it is resharded to once, for all of them) sits between the producer and its
readers, so a layout the reshard cache serves to several readers is paid
once, as the plan runs it (``add_reads``). A node's
memory is the per-device bytes of the values it produces, live from its own
time step to the last reader's, as XLA's compiled program holds them:
arguments, constants and outputs (allocated by their output nodes) for the
whole program; a read by an op fused into a later one counted there
(``read_until``); a buffer taken over by an in-place update or an elementwise
op not live in that op's step (``updated_in_place``); an op that reads only
arguments run just before its first reader (``first_reader``); an op's
operand layouts and its scratch (``shardsolve.workspace``) during its own
step. So the solver's objective is compute + communication, and the memory
limit bounds the peak of live bytes per device (``shardsolve.memory`` counts
a solved plan's buffers more closely, knowing which reads reshard).

A ``scan`` is expanded (``BuildOptions.expand_scans``): its body's ops become
nodes once, their costs and internal edges times ``length``, and its boundary
(consts, one node per carry shared by carry-in, body and carry-out, x/y slices)
is described in ``ScanNodes``. Reads of loop invariants (the scan's consts,
the body's closed-over constants) are resharded once, before the loop
(``schedule.loop_invariant_demands``), so their edges are not multiplied by
``length``.

``ProblemBuilder`` adds the problem in sections, one method each:

=====================  ===========================================================
method                 adds
=====================  ===========================================================
``add_arguments``      argument and constant nodes, pinned by ``in_shardings``
``add_ops``            op nodes (``add_op``) and scans (``add_scan``) in program order
``add_operands``       beside each op node: the operand layouts it reads and its scratch, live during its step
``add_scan``           a scan's boundary nodes (``add_scan_operands``), its body's
                       closed-over constants, its body's ops, its y-slices
``read_edge``          notes a read of a value by one consumer
``add_reads``          the reads' edges: producer -> consumer, or through the value's hub
``add_outputs``        output nodes, pinned by ``out_shardings``
``add_ties``           carry pairs: an argument and its next value share a sharding
=====================  ===========================================================

``tie_axes`` adds, to a built problem, ties between dimensions of arguments
(one logical axis name, one mesh-axis choice: ``shardsolve.logical``) the same
way: an edge forbidding the strategy pairs that break the tie.

    built = build_problem(graph, mesh, in_pins, out_pins, memory_limit=None, ties=())
    built.problem        # the Problem the solver reads
    built.nodes[k]       # what node k decides (NodeInfo)
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from shardsolve.annotations import constraint_sharding
from shardsolve.cost import COMBINE_COUNT, ReshardTables, collective_cost, fusion_classes, reshard_time_given, wire_type
from shardsolve.errors import ShardsolveError
from shardsolve.graph import Graph, Lit, Op, ScanBoundary, scan_counts
from shardsolve.mesh import MeshSpec
from shardsolve.problem import FORBIDDEN, Edge, Node, Pin, Problem
from shardsolve.rules import fallback_rule, rule_for
from shardsolve.rules.elementwise import POINTWISE
from shardsolve.rules.base import Rule, Strategy, strategies_of
from shardsolve.sharding import Sharding, candidate_shardings
from shardsolve.trace import key_dims
from shardsolve.workspace import may_need_scratch, prefetch, scratch_bytes, workspace_ratio

Scope = tuple[int, ...]  # () for the program; (k, ...) inside the body of scan op k, ...
Pins = Sequence[tuple[Sharding | None, str]]


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """How the problem is built; the defaults are what ``shardsolve.plan`` does.

    ``expand_scans``: plan a scan's body once (``False``: a scan is one op that
    falls back to replicating its operands, as before scan support; kept for
    comparison). ``uneven``: offer rule strategies that split a factor unevenly
    (``False``: even splits only, as before uneven support). ``kept_layouts``:
    under a memory limit, count the layouts the reshard cache keeps for an
    argument's next read (``ProblemBuilder.add_kept_layouts``); off by default:
    the solver's heuristic starts find no valid assignment on such problems
    as often, and at the expert's memory it plans no faster (Llama small on
    1x8: 0.68x the expert's step time with it, 1.43x without; GPT-2 small
    on 1x8: 0.67x and 0.58x).
    """

    expand_scans: bool = True
    uneven: bool = True
    kept_layouts: bool = False


@dataclass(frozen=True, slots=True)
class AxisTie:
    """Dimension ``dim_a`` of argument leaf ``a`` and dimension ``dim_b`` of argument leaf ``b`` take the same mesh axes."""

    a: int
    dim_a: int
    b: int
    dim_b: int
    label: str = ""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What one problem node decides."""

    kind: str  # "input", "const", "op", "operands", "output", "scan-const", "scan-carry", "scan-xs", "scan-ys",
    # "scan-body-const", "merged" (a merge key's latency: ``share_merged_latency``), "kept" (a layout the
    # reshard cache keeps: ``add_kept_layouts``), "hub" (the layout a value's readers share: ``add_reads``)
    ref: int  # value id (input/const), op id, or output position
    shardings: tuple[Sharding, ...] = ()  # for input/const/output nodes: strategy -> sharding
    rule: Rule | None = None
    strategies: tuple[Strategy, ...] = ()
    fallback: bool = False
    scope: Scope = ()


@dataclass(frozen=True, slots=True)
class Read:
    """An edge of the program (scope ``()``): node ``to`` reads value ``value`` in layouts ``dst`` (ids)."""

    producer: int  # the node the read's edge starts from: the value's producer, or its hub (``add_reads``)
    to: int
    value: int
    consumer: int | None  # the reading op's id (a scan's for its boundary nodes); None for an output
    dst: np.ndarray
    src: np.ndarray | None = None  # layout ids per strategy of ``producer`` where it is a hub (None: the value's)


@dataclass
class ScanNodes:
    """The problem nodes of one scan whose body is planned once.

    * ``const[k]``: the sharding of the k-th const inside the body; its edge
      from the outer producer is a reshard paid once, before the loop, and so
      are its edges to the body ops reading it in other layouts (a loop
      invariant: the rewriter makes each such layout before the loop, see
      ``schedule.loop_invariant_demands``). ``body_consts`` likewise.
    * ``carry[k]``: ONE sharding for the k-th carry wherever it appears: the
      scan's carry-in operand (edge from the outer producer, paid once), the
      body's carry invar, the body's carry outvar (edge from the body's
      producer, paid every iteration: the carry leaves each iteration as it
      entered, a fixed point) and the scan's carry-out result.
    * ``xs[k]``: the sharding of the k-th x-slice in the body; the scan's xs
      operand is read stacked (``ScanBoundary.stacked``).
    * ``ys[k]``: likewise for the k-th y-slice and the scan's ys result (the
      body's producer reshards into it every iteration).

    Body ops are problem nodes once, their costs and internal edges times
    ``length`` (times the enclosing scans' lengths when nested), except reads
    of the loop invariants (``const``, ``body_consts``). Memory: body
    ops, consts and xs live only during the scan's time step of the enclosing
    program (all at once, an over-estimate of one iteration's peak, at their
    per-iteration bytes; the plan's ``memory.peak_memory`` counts that
    peak); carry and ys nodes hold the scan's results and live from that
    step to their last reader.
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

    def boundary(self, nodes: Sequence[NodeInfo], assignment: Sequence[int]) -> ScanBoundary:
        """The scan's boundary shardings under ``assignment``."""
        pick = lambda idx: nodes[idx].shardings[assignment[idx]]  # noqa: E731
        return ScanBoundary(*(tuple(pick(i) for i in group)
                              for group in (self.const, self.carry, self.xs, self.ys, self.body_consts)))


@dataclass(frozen=True, slots=True, eq=False)
class MergeTerm:
    """One terminal read whose collective XLA may merge with the others of its key (``share_merged_latency``)."""

    key: tuple  # (kind, mesh axes, reduction)
    value: int
    producer: int  # node
    forced: np.ndarray  # [producer strategies]: every layout the reader may take needs the collective
    edge: tuple[int, int]  # the read's edge, as the problem stores it
    latency: np.ndarray  # on that edge (its orientation): the latency where the reader's strategy decides


def merge_discounts(terms: Sequence[MergeTerm], counts: dict[tuple, int]) -> dict[tuple[int, int], np.ndarray]:
    """Per edge, the latency its terms save when ``counts[key]`` collectives of each key merge (missing: 1).

    ``m`` merged collectives pay one latency between them: each term's edge
    pays ``1/m`` of its own (at most ``COMBINE_COUNT`` merge into one).
    """
    discount: dict[tuple[int, int], np.ndarray] = {}
    for t in terms:
        m = min(counts.get(t.key, 1), COMBINE_COUNT)
        if m > 1 and t.latency.any():
            rest = t.latency * (1 - 1 / m)
            discount[t.edge] = discount[t.edge] + rest if t.edge in discount else rest
    return discount


def discounted(costs: np.ndarray, drop: np.ndarray) -> np.ndarray:
    """An edge's ``costs`` less ``drop``, forbidden entries left forbidden."""
    return np.where(costs < FORBIDDEN, costs - drop, costs)


@dataclass
class Built:
    problem: Problem
    nodes: list[NodeInfo]
    op_node: dict[int, int]  # op id -> node index (expanded scans have no node: see ``scans``)
    value_node: dict[int, int]  # input/const value id -> node index
    output_node: dict[int, int]  # output position -> node index
    scans: dict[Scope, ScanNodes] = field(default_factory=dict)  # scope (scan op ids) -> nodes
    # The problem's edges without ``share_merged_latency``'s optimistic discounts (None: it made none).
    plain_edges: tuple[Edge, ...] | None = None
    merge_terms: tuple[MergeTerm, ...] = ()  # the reads those discounts were taken from
    # Built under a memory limit: the same program built without it (its reads sharing hubs, which a limited
    # problem leaves out: ``ProblemBuilder.reserve_hub``), nodes in the same order, for the plan without the limit.
    unlimited: Built | None = None
    # hub node -> (its value's producer node, the hub strategy of the producer's own layout per producer strategy)
    hub_sources: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)

    def plain(self) -> Built:
        """This problem with the edges that pay every latency merging may not save (itself if none)."""
        if self.plain_edges is None:
            return self
        return dataclasses.replace(self, problem=dataclasses.replace(self.problem, edges=self.plain_edges),
                                   plain_edges=None, merge_terms=())

    def merge_counts(self, assignment: Sequence[int]) -> dict[tuple, int]:
        """Per merge key, how many terminal values ``assignment`` reduces with a collective of that key."""
        running: dict[tuple, set[int]] = {}
        for t in self.merge_terms:
            u, v = t.edge
            if t.forced[assignment[t.producer]] or t.latency[assignment[u], assignment[v]] > 0:
                running.setdefault(t.key, set()).add(t.value)
        return {key: len(values) for key, values in running.items()}

    def priced_for(self, counts: dict[tuple, int]) -> Built:
        """This problem with each key's merged latency shared by ``counts[key]`` collectives (missing: 1).

        ``share_merged_latency`` shares it between every terminal value of a
        key, as if all of them were reduced; given the counts a plan has
        (``merge_counts``), the shares are those of that plan: exact for it,
        and a key that plan reduces once gets no discount.
        """
        if self.plain_edges is None:
            return self
        discount = merge_discounts(self.merge_terms, counts)
        edges = tuple(Edge(e.u, e.v, discounted(e.costs, discount[(e.u, e.v)])) if (e.u, e.v) in discount else e
                      for e in self.plain_edges)
        return dataclasses.replace(self, problem=dataclasses.replace(self.problem, edges=edges))

    def sharding(self, idx: int, assignment: Sequence[int]) -> Sharding:
        """The sharding node ``idx`` (an argument, constant, output or scan boundary node) takes."""
        return self.nodes[idx].shardings[assignment[idx]]

    def op_node_of(self, scope: Scope, op_id: int) -> int:
        return self.op_node[op_id] if not scope else self.scans[scope].op_node[op_id]


FUSED_PRODUCERS, FUSED_CONSUMERS = fusion_classes(POINTWISE)


def memory_traffic(g: Graph, op: Op) -> tuple[bool, ...]:
    """Which of ``op``'s operands, then results, move through memory once XLA has fused its loops.

    A value is fused (never written, never loaded) when its producer is a
    fusable producer, every reader a fusable consumer (``cost.fusion_classes``)
    and it is no output of ``g``, and either it has one reader or its producer
    is as cheap to repeat as a broadcast or an iota (XLA writes out a value of
    several readers rather than compute it again). A matrix's transpose read
    only by matmuls is fused too: XLA folds it into their dimension numbers (a
    transpose of more dimensions feeding a batched matmul it writes out, as
    XLA's CPU backend lays batch dimensions first). Everything else (matmuls,
    gathers, arguments, outputs, a scan's boundary) moves.
    """
    known = g.memo.get(memory_traffic)
    if known is None:
        known = g.memo[memory_traffic] = {}
    hit = known.get(op.id)
    if hit is None:  # (asked by the builder, the plan's memory and its lowering, op by op)
        hit = known[op.id] = tuple([not fused(g, x) if not isinstance(x, Lit) else False for x in op.inputs]
                                   + [not fused(g, v) for v in op.outputs])
    return hit


_REPEATABLE = frozenset({"broadcast_in_dim", "iota"})

#: Primitives whose result takes operand 0's buffer where that operand is read for the last time (XLA updates
#: it in place; otherwise it copies it first).
IN_PLACE = frozenset({"scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max", "dynamic_update_slice",
                      "sort"})


def runs_in(g: Graph) -> list[int]:
    """For each op of ``g``, the op in whose step its work is done: its own, or, where every result of it is
    fused into its readers (``fused``), the last of those readers' (XLA computes it inside them, so what it
    reads is read there)."""
    runs = list(range(len(g.ops)))
    for op in reversed(g.ops):
        if op.outputs and all(fused(g, v) for v in op.outputs):
            readers = [k for v in op.outputs for k, _ in g.consumers.get(v, [])]
            if readers:
                runs[op.id] = max(runs[k] for k in readers)
    return runs


def read_until(g: Graph) -> dict[int, int]:
    """For each value of ``g`` that is read, the op in whose step it is read for the last time (``runs_in``: a
    read by a fused op counts where that op's work is done); ``len(g.ops)`` for an output."""
    runs = runs_in(g)
    out: dict[int, int] = {}
    for op in g.ops:
        for x in op.inputs:
            if not isinstance(x, Lit):
                out[x] = max(out.get(x, -1), runs[op.id])
    for x in g.outputs:
        if not isinstance(x, Lit):
            out[x] = len(g.ops)
    return out


def first_reader(g: Graph, op: Op) -> int | None:
    """The first op that reads ``op``'s results, where ``op`` (no scan) reads only arguments, constants and
    literals and makes no output; None otherwise.

    Nothing such an op needs comes later, so XLA's scheduler runs it just
    before that reader (a broadcast of zeros into a gradient's buffer, an
    iota), and its results are live from there, not from its place in the
    program.
    """
    if op.primitive == "scan" or any(not isinstance(x, Lit) and g.values[x].kind == "result" for x in op.inputs):
        return None
    if any(v in g.output_ids for v in op.outputs):
        return None
    readers = [k for v in op.outputs for k, _ in g.consumers.get(v, [])]
    return min(readers) if readers else None


def updated_in_place(g: Graph, vid: int, last: dict[int, int]) -> bool:
    """Whether value ``vid`` (an op's written result) hands its buffer to its last reader's result.

    XLA's buffer assignment lets a result share a buffer of an operand read
    for the last time there: an ``IN_PLACE`` update's operand 0, and an
    elementwise op's first such operand of the result's own shape and type
    (the result written out, not fused). Such a value is not live in its
    reader's step: the reader's result is.
    """
    k = last.get(vid)
    if k is None or k >= len(g.ops) or g.values[vid].kind != "result" or vid in g.output_ids:
        return False
    reader = g.ops[k]
    if reader.inputs.count(vid) != 1:
        return False
    if reader.primitive in IN_PLACE:
        return reader.inputs[0] == vid
    if reader.primitive not in POINTWISE or len(reader.outputs) != 1 or fused(g, vid):
        return False
    out, v = g.values[reader.outputs[0]], g.values[vid]
    if fused(g, out.id) or out.shape != v.shape or out.itemsize != v.itemsize:
        return False
    first = next(x for x in reader.inputs if not isinstance(x, Lit) and last.get(x) == k
                 and g.values[x].kind == "result" and x not in g.output_ids and not fused(g, x)
                 and g.values[x].shape == v.shape and g.values[x].itemsize == v.itemsize)
    return first == vid


def fused(g: Graph, vid: int) -> bool:
    """Whether value ``vid`` of ``g`` stays inside one of XLA's loop fusions (see ``memory_traffic``)."""
    known = g.memo.get(fused)
    if known is None:
        known = g.memo[fused] = {}
    hit = known.get(vid)
    if hit is None:
        hit = known[vid] = _fused(g, vid)
    return hit


def _fused(g: Graph, vid: int) -> bool:
    v = g.values[vid]
    if v.kind != "result":
        return False
    producer = g.ops[v.producer].primitive
    readers = g.consumers.get(vid, [])
    if producer not in FUSED_PRODUCERS or not readers or vid in g.output_ids:
        return False
    if producer == "transpose" and len(v.shape) == 2 and all(g.ops[k].primitive == "dot_general" for k, _ in readers):
        return True  # XLA folds a matrix's transpose into the matmuls that read it (a batched one it copies)
    if len(readers) > 1 and producer not in _REPEATABLE:
        return False
    return all(g.ops[k].primitive in FUSED_CONSUMERS for k, _ in readers)


def stacked_ys_time(g: Graph, vid: int, stacked_bytes: np.ndarray, mesh: MeshSpec) -> np.ndarray:
    """Memory time of a scan's stacked output beyond the body's writes of its slices, per candidate.

    XLA allocates the stacked buffer and fills it before the loop (one write),
    and copies it whole (a read and a write) where a later loop reads it as its
    xs (the forward pass's residuals read by the backward pass's loop).
    """
    passes = 1 + 2 * any(g.ops[k].primitive == "scan" for k, _ in g.consumers.get(vid, []))
    return passes * stacked_bytes / mesh.hbm_bandwidth


#: Ops XLA's loop-invariant code motion leaves in the loop: loops and conditionals of their own, and those
#: that make nothing from their operands (an ``iota``, a broadcast of a literal: hoisted only with a reader).
_NOT_HOISTED = frozenset({"scan", "while", "cond", "rng_bit_generator", "rng_uniform"})


def loop_invariant_ops(body: Graph, invariants: frozenset[int]) -> frozenset[int]:
    """The ops of a loop body that read only the loop's invariants (``invariants``: its consts and closed-over
    constants) and other such ops' results: XLA hoists them out of the while loop and computes them once.

    An op with no operand but literals (an ``iota``) makes an invariant but stays where it is: XLA hoists it
    only along with a reader, and it costs next to nothing either way.
    """
    made = set(invariants)
    once: set[int] = set()
    for op in body.ops:
        if op.primitive in _NOT_HOISTED:
            continue
        reads = [x for x in op.inputs if not isinstance(x, Lit)]
        if all(x in made for x in reads):
            made.update(op.outputs)
            if reads:
                once.add(op.id)
    return frozenset(once)


def expandable(op: Op) -> bool:
    """Whether ``op`` is a scan whose body can be planned once."""
    p = op.params
    return all(k in p for k in ("jaxpr", "length", "num_consts", "num_carry")) and int(p["length"]) > 0


def replicated_scan_time(graph: Graph, op: Op, mesh: MeshSpec) -> float:
    """Compute time of a scan whose body runs replicated: every body op's replicated strategy, ``length`` times.

    The price of a scan that is not expanded, so that plans with and without
    expansion are priced alike.
    """
    body = graph.body(op)
    total = 0.0
    for bop in body.ops:
        if bop.primitive == "scan" and expandable(bop):
            total += replicated_scan_time(body, bop, mesh)
        view = body.view(bop)
        rule = rule_for(view) or fallback_rule(view)
        replicated = rule.strategies(mesh, allow_partial=False, fixed_operands=bop.literal_operands)[0]
        itemsizes = tuple(np.dtype(d).itemsize for d in view.in_dtypes + view.out_dtypes)
        total += rule.strategy_time(replicated, mesh, itemsizes)
    return total * int(op.params["length"])


def candidates(shape: tuple[int, ...], mesh: MeshSpec, pinned: Sharding | None, whole: int = 0) -> tuple[Sharding, ...]:
    """The candidate shardings of an argument or output, the pinned one included; ``whole``: how many trailing
    dimensions stay unsplit (a typed PRNG key's data, which crosses the boundary as the key)."""
    cands = candidate_shardings(shape, mesh)
    if whole:
        cands = [c for c in cands if not any(c.dims[len(shape) - whole:])]
    if pinned is not None and pinned not in cands:
        cands.append(pinned)
    return tuple(cands)


@dataclass(frozen=True)
class RuleStrategies:
    """A rule's strategies with their costs, memory and sharding ids (shared by equal ops)."""

    strategies: tuple[Strategy, ...]
    costs: np.ndarray
    usage: np.ndarray
    operand_usage: np.ndarray  # bytes of the operand layouts each strategy reads from memory (not its scratch)
    labels: tuple[str, ...]
    operand_ids: tuple[np.ndarray, ...]
    result_ids: tuple[np.ndarray, ...]
    result_layouts: tuple[tuple[Sharding, ...], ...]  # per result: its sharding under each strategy

    @classmethod
    def make(cls, rule: Rule, fixed: tuple[int, ...], itemsizes: tuple[int, ...], mesh: MeshSpec,
             tables: ReshardTables, uneven: bool = True, traffic: tuple[bool, ...] | None = None,
             live_out: tuple[bool, ...] = ()) -> RuleStrategies:
        strategies = strategies_of(rule, mesh, tuple(fixed), uneven)
        n_in = len(rule.operands)
        shapes = rule.shapes()
        costs = np.array([rule.strategy_time(s, mesh, itemsizes, traffic, shapes) for s in strategies],
                         dtype=np.float64)
        written = traffic[n_in:] if traffic is not None else (True,) * len(rule.results)
        if live_out:  # a program output is its output node's buffer
            written = tuple(w and not out for w, out in zip(written, live_out))
        known: dict[tuple[int, Sharding], int] = {}  # (operand or n_in + result, layout) -> its local bytes

        def local_bytes(k: int, layout: Sharding) -> int:
            n = known.get((k, layout))
            if n is None:
                n = known[(k, layout)] = layout.local_bytes(shapes[k], itemsizes[k], mesh)
            return n

        usage = np.array(  # a result fused into its readers is never allocated
            [sum(local_bytes(n_in + k, r) for k, r in enumerate(s.results) if written[k]) for s in strategies],
            dtype=np.float64,
        )
        read = traffic[:n_in] if traffic is not None else (True,) * n_in
        operand_usage = np.array(  # the layouts it reads, materialised (a reshard's result is a new buffer)
            [sum(local_bytes(k, o) for k, o in enumerate(s.operands) if read[k] and k not in fixed)
             for s in strategies],
            dtype=np.float64,
        )
        return cls(
            strategies,
            costs,
            usage,
            operand_usage,
            tuple(s.describe() for s in strategies),
            tuple(tables.ids([s.operands[k] for s in strategies]) for k in range(n_in)),
            tuple(tables.ids([s.results[k] for s in strategies]) for k in range(len(rule.results))),
            tuple(tuple(s.results[k] for s in strategies) for k in range(len(rule.results))),
        )


#: Primitives whose operands' shards the program lays out by hand: no plan runs them (``ProblemBuilder.add_op``).
HAND_LAID_OUT = frozenset({"shard_map"})


#: A value's reads share a hub (``ProblemBuilder.add_reads``) only where it has at most this many layouts: on
#: three-axis meshes (100 to 340 layouts a value) hubs added a third to the table entries, and the search of
#: Llama large on 2x2x2 lost its way (72.3 ms with a 32% gap at 30 s, against 55.5 ms and 4.4% without them);
#: two-axis meshes have at most 47.
HUB_MAX_LAYOUTS = 64
# The most strategies a node may have: its tables with a neighbour of as many hold 8192^2 entries (512 MiB). Every
# bundled model's largest on a mesh of three axes has 285 to 727; GPT-2 small on four axes of 2 has 4,066 (a
# 220-s build); on six axes one op has 117,035, whose table with itself alone would take 102 GiB.
MAX_STRATEGIES = 8192


class _Capped:
    """Edge tables with every entry at most ``FORBIDDEN`` (a scaled forbidden entry is forbidden): the table
    itself where it is already so (tables are shared between edges: each is looked at once)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, table: np.ndarray) -> np.ndarray:
        hit = self.seen.get(id(table))
        if hit is None or hit[0] is not table:
            capped = table if not table.size or table.max() <= FORBIDDEN else np.minimum(table, FORBIDDEN)
            hit = self.seen[id(table)] = (table, capped)
        return hit[1]


@functools.lru_cache(maxsize=None)
def _same_strategy(n: int) -> np.ndarray:
    """The edge table that makes two nodes of ``n`` strategies take the same one (shared: read-only)."""
    table = np.where(np.eye(n, dtype=bool), 0.0, FORBIDDEN)
    table.flags.writeable = False
    return table


class ProblemBuilder:
    """Builds the ``Problem`` of one program, section by section (see the module docstring).

    Values are keyed by (scope, value id): scope ``()`` is the program, ``(k,)``
    the body of scan op ``k``, ``(k, j)`` the body of scan op ``j`` inside that
    body, ... ``produced_at`` maps each to its producer node and the sharding
    of the value under each of the producer's strategies (``ids_at``: as
    ``ReshardTables`` ids).
    """

    def __init__(self, graph: Graph, mesh: MeshSpec, options: BuildOptions = BuildOptions(),
                 like: ProblemBuilder | None = None):
        self.graph = graph
        self.mesh = mesh
        self.options = options
        self.horizon = len(graph.ops) + 2  # t=0 inputs, t=k+1 op k, t=len+1 outputs
        self.nodes: list[Node] = []
        self.infos: list[NodeInfo] = []
        self.pins: list[Pin] = []
        self.value_node: dict[int, int] = {}
        self.op_node: dict[int, int] = {}
        self.output_node: dict[int, int] = {}
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        # ``like``: a builder of the same program, mesh and options whose reshard tables and priced rules serve
        self.tables = ReshardTables(mesh, impossible=FORBIDDEN) if like is None else like.tables
        self.produced_at: dict[tuple, tuple[int, Sequence[Sharding]]] = {}
        self.ids_at: dict[tuple, np.ndarray] = {}
        self.rule_cache: dict[tuple, RuleStrategies] = {} if like is None else like.rule_cache
        self.scans: dict[Scope, ScanNodes] = {}
        # A scan's loop invariants (its consts, its body's closed-over constants) are resharded
        # once, before the loop (see ``schedule.loop_invariant_demands``): their reads cost the scan's scale.
        self.invariant_scale: dict[tuple, float] = {}
        self.uneven_arguments: set[int] = set()  # arguments with a candidate that splits them unevenly
        self.reads: list[Read] = []  # the program's reads (scope ()), for ``add_kept_layouts``
        self.edge_reads: list[Read] = []  # the same as their edges run them (``add_reads``): ``share_merged_latency``
        # (scope, value id) -> (value, producer node, [(reader node, layout ids per strategy, scale, consumer)])
        self.pending_reads: dict[tuple, tuple[Any, int, list[tuple[int, np.ndarray, float, int | None]]]] = {}
        self.hub_sources: dict[int, tuple[int, np.ndarray]] = {}  # ``Built.hub_sources``
        self.hub_at: dict[tuple, int] = {}  # (scope, value id) -> the node its reads may share (``reserve_hub``)
        self.plain_edges: dict[tuple[int, int], np.ndarray] | None = None
        self.merge_terms: list[MergeTerm] = []
        self.pending_scratch: list[tuple[int, Graph, Op, Rule, RuleStrategies]] = []  # (``add_scratch``)

    def build(self, in_pins: Pins, out_pins: Pins, memory_limit: float | None = None,
              ties: Sequence[tuple[int, int]] = ()) -> Built:
        prefetch(self.planned_graphs(self.graph))  # the backend's compiles run beside the building
        self.add_arguments(in_pins)
        self.add_ops(self.graph, (), 1.0, None, "")
        self.add_outputs(out_pins)
        self.add_ties(ties)
        self.add_reads(shared=memory_limit is None)
        if memory_limit is not None and self.options.kept_layouts:
            self.add_kept_layouts()
        self.share_merged_latency()
        self.add_scratch()
        capped = _Capped()
        problem = Problem(
            tuple(self.nodes),
            tuple(Edge(u, v, capped(c)) for (u, v), c in self.edges.items()),
            memory_limit,
            tuple(self.pins),
        )
        plain = None
        if self.plain_edges is not None:
            plain = tuple(Edge(u, v, capped(self.plain_edges.get((u, v), c))) for (u, v), c in self.edges.items())
        return Built(problem, self.infos, self.op_node, self.value_node, self.output_node, self.scans, plain,
                     tuple(self.merge_terms) if plain is not None else (), hub_sources=self.hub_sources)

    # -- nodes and edges ---------------------------------------------------------------

    def add(self, node: Node, info: NodeInfo) -> int:
        if len(node.costs) > MAX_STRATEGIES:
            raise ShardsolveError(
                f"{node.name}: {len(node.costs):,} sharding strategies on mesh {self.mesh} (at most {MAX_STRATEGIES:,} "
                "can be planned: a reshard table holds one entry per pair of strategies); plan on a mesh of fewer "
                "axes, merging axes that play the same part (three axes plan in seconds)")
        self.nodes.append(node)
        self.infos.append(info)
        return len(self.nodes) - 1

    def produce(self, key: tuple, idx: int, shardings: list[Sharding], ids: np.ndarray | None = None) -> None:
        """Value ``key`` = (scope, value id) is made by node ``idx``, as ``shardings[s]`` under its strategy ``s``."""
        self.produced_at[key] = (idx, shardings)
        self.ids_at[key] = self.tables.ids(shardings) if ids is None else ids
        self.reserve_hub(key)

    def reserve_hub(self, key: tuple) -> None:
        """A place, right after value ``key``'s producer, for the hub of its reads (``add_reads``) where two or
        more operations read it: the hub then comes before its readers, in program order like them.

        Left unused (one strategy, no edges) under a memory limit, so that the problem without the limit
        has its nodes in the same order: a layout made once for several readers is a buffer from the first
        read to the last, which a hub's strategy alone cannot count (the producer's own layout holds nothing
        more), and counted through a pair of strategies per layout tied to the producer's, the limited
        search lost its way (GPT-2 small on 2x4 at the expert's memory: 0.15x the expert, 0.64x without hubs).
        """
        scope, v = key
        g = self.graph if not scope else self.scans[scope].body
        if len({k for k, _ in g.consumers.get(v, ())}) >= 2:
            self.hub_at[key] = self.add(Node(f"{g.values[v].name} shared reads", np.zeros(1), np.zeros(1)),
                                        NodeInfo("hub", v, scope=scope))

    def add_edge(self, u: int, v: int, table: np.ndarray) -> None:
        if u == v:  # a scan body handing a carry straight back: same node, same sharding
            return
        edges = self.edges
        if (v, u) in edges:  # a carry node and a body op read each other: one edge per pair
            u, v, table = v, u, table.T
        edges[(u, v)] = edges[(u, v)] + table if (u, v) in edges else table

    def read_edge(self, scope: Scope, g: Graph, x: int, dst: np.ndarray, to: int, scale: float) -> None:
        """Node ``to`` reads value ``x`` of ``g`` in the shardings ``dst`` (ids, per strategy of ``to``)."""
        scale = self.invariant_scale.get((scope, x), scale)
        value = g.values[x]
        producer, srcs = self.produced_at[(scope, x)]
        if not scope and x in self.uneven_arguments:
            # An uneven argument arrives evened and keeps that layout too: reaching it again is free.
            mesh, shardings = self.mesh, self.tables.shardings
            table = np.array([[min(reshard_time_given(value.shape, value.wire_itemsize, s, shardings[t], mesh,
                                                      s.evened(value.shape, mesh)), FORBIDDEN) for t in dst]
                              for s in srcs], dtype=np.float64)
            self.add_edge(producer, to, table * scale if scale != 1 else table)
            return
        info = self.infos[to]
        consumer = info.ref if info.kind != "output" else None
        if not scope and scale == 1:
            self.reads.append(Read(producer, to, x, consumer, dst))
        self.pending_reads.setdefault((scope, x), (value, producer, []))[2].append((to, dst, scale, consumer))

    def add_reads(self, shared: bool = True) -> None:
        """The edges of every read ``read_edge`` noted, priced as the reshard cache runs them.

        The schedule (``shardsolve.schedule``) makes each layout of a value
        once and serves later reads from it, so a pairwise edge per read pays
        a shared reshard once per reader (three readers of a pending sum that
        all need it whole: three all-reduces priced, one run). Per value:

        * one reader's reads (``x * x``) pay each distinct layout once;
        * two or more readers that may reshard share a *hub* node (where the
          value has at most ``HUB_MAX_LAYOUTS`` layouts among them): its
          strategy is the layout the value is resharded to for them (any
          source layout or layout a reader takes); the producer's edge pays
          source -> hub once, each reader's pays hub -> its layouts. With the
          hub in the producer's own layout that is the edge per read, so no
          plan is priced above it; a hub elsewhere prices a layout made once
          for several readers (a reader taking another pays from the hub's
          layout, where the cache may start).

        The program's reads, as their edges run them, go to ``edge_reads``
        (``share_merged_latency``). Without ``shared`` (under a memory limit)
        every hub is left unused (one strategy, no edges: ``reserve_hub`` says
        why).
        """
        tables = self.tables
        sums = None
        for key, (value, producer, reads) in self.pending_reads.items():
            src = self.ids_at[key]
            by_reader: dict[int, list[tuple[np.ndarray, float, int | None]]] = {}
            for to, dst, scale, consumer in reads:
                by_reader.setdefault(to, []).append((dst, scale, consumer))
            # a reader's reads in layouts an earlier read of it takes are served from the cache
            distinct = {to: [r for k, r in enumerate(rs) if not any(np.array_equal(r[0], q[0]) for q in rs[:k])]
                        for to, rs in by_reader.items()}
            direct = {to: self._read_table(value, src, read) for to, read in by_reader.items()}
            scales = {scale for _, _, scale, _ in reads}
            hub = None
            if shared and key in self.hub_at and len(scales) == 1 and sum(
                    bool(np.any((t > 0) & (t < FORBIDDEN))) for t in direct.values()) >= 2:  # readers may share
                hub = np.unique(np.concatenate([src] + [dst for _, dst, _, _ in reads]))
            if hub is None or len(hub) > HUB_MAX_LAYOUTS:
                for to, table in direct.items():  # (a hub left unused: one strategy)
                    self.add_edge(producer, to, table)
                    if not key[0]:
                        self.edge_reads.extend(Read(producer, to, key[1], c, dst)
                                               for dst, scale, c in distinct[to] if scale == 1)
                continue
            (scale,) = scales
            made = tables.table(value.shape, value.wire_itemsize, src, hub)
            made = made * scale if scale != 1 else made
            rows = [self._read_table(value, hub, read) for read in by_reader.values()]
            idx = self.hub_at[key]
            self.nodes[idx] = Node(self.nodes[idx].name, np.zeros(len(hub)), np.zeros(len(hub)), (0, 0),
                                   tuple(str(tables.shardings[i]) for i in hub))
            self.infos[idx] = NodeInfo("hub", key[1], tuple(tables.shardings[i] for i in hub), scope=key[0])
            self.hub_sources[idx] = (producer, np.searchsorted(hub, src))
            self.add_edge(producer, idx, made)
            for to, row in zip(by_reader, rows):
                self.add_edge(idx, to, row)
            if not key[0] and scale == 1:
                if sums is None:
                    sums = self.graph.reaching(self.pending_sums(), together=True)
                # the hub's reshard runs before every reader: terminal where each of them is
                consumers = [c for _, _, _, c in reads]
                later = [c for c in consumers if c is not None and sums[c]]
                self.edge_reads.append(Read(producer, idx, key[1], later[0] if later else consumers[0], hub))
                self.edge_reads.extend(Read(idx, to, key[1], c, dst, hub)
                                       for to in by_reader for dst, _, c in distinct[to])
        self.pending_reads.clear()

    def _read_table(self, value: Any, rows: np.ndarray, reads: Sequence[tuple]) -> np.ndarray:
        """One reader's reads of ``value`` ((layout ids per its strategy, scale, ...)) from layouts ``rows``: each layout
        its strategy takes paid once (a layout an earlier read takes is served from the reshard cache)."""
        total = None
        for k, (dst, scale, *_) in enumerate(reads):
            t = self.tables.table(value.shape, value.wire_itemsize, rows, dst)
            if k:
                again = np.any(np.stack([r[0] == dst for r in reads[:k]]), axis=0)
                t = np.where(again[None, :], 0.0, t)
            t = t * scale if scale != 1 else t
            total = t if total is None else total + t
        return total

    def pending_sums(self) -> list[int]:
        """The program's values that may start a pending sum.

        An op's result does when some strategy makes it partial from operands
        that are not (a contraction, a reduction); what only passes a pending
        sum on (a scaling, an addition, a reshape) does not. A value made by
        anything but an op (a scan's boundary) does when it may be partial.
        """
        starting = []
        for (scope, v), (idx, shardings) in self.produced_at.items():
            if scope:
                continue
            info = self.infos[idx]
            if info.kind == "op" and info.strategies:
                k = self.graph.ops[info.ref].outputs.index(v)
                starts = any(st.results[k].partial and not any(o.partial for o in st.operands)
                             for st in info.strategies)
            else:
                starts = any(sh.partial for sh in shardings)
            if starts:
                starting.append(v)
        return starting

    def terminal_reads(self) -> list[tuple[Read, dict[tuple, np.ndarray]]]:
        """The program's terminal reads that may run a mergeable collective, with its latency per merge key
        (``share_merged_latency``)."""
        tables, values = self.tables, self.graph.values
        sums = self.graph.reaching(self.pending_sums(), together=True)
        found = []
        for r in self.edge_reads:
            if r.consumer is not None and sums[r.consumer]:
                continue
            value = values[r.value]
            lat = tables.mergeable_latency(value.shape, value.wire_itemsize,
                                           self.ids_at[((), r.value)] if r.src is None else r.src, r.dst)
            if lat:  # (XLA merges collectives of one element type: ``cost.wire_type``)
                found.append((r, {(*k, wire_type(value.dtype)): t for k, t in lat.items()}))
        return found

    def share_merged_latency(self) -> None:
        """Price the program's last reductions as XLA runs them: merged, one latency for all of them.

        XLA merges independent collectives of a kind (``cost.COMBINED_KINDS``)
        over the same devices into one. A read is *terminal* when nothing
        computed from its reader (``Graph.reaching``) may start a pending sum
        (``pending_sums``): terminal reads of different sums never depend on
        each other (a training step's gradient reductions are the typical
        ones). For each merge key with two or more terminal values:

        * a node (off, on) pays the key's latency once when on; a producer
          strategy whose every read layout needs that collective forces it on,
          and its read edge drops that latency (exact: the merged collective
          pays one latency);
        * where the reader's strategy decides whether the collective runs (it
          may take another layout instead), the edge pays ``1/m`` of the
          latency, ``m`` the number of terminal values (optimistic: as if all
          merged). The undiscounted edges are kept (``plain_edges``), and
          each such read (``merge_terms``): when the optimism cost the plan,
          the planner prices the merges again with the counts its plan has
          (``Built.priced_for``) and solves that, then the plain problem.

        The plan's price of its own collectives (``plan.combined_latencies``)
        follows the merges of the plan it gets.
        """
        mesh, edges = self.mesh, self.edges
        pinned = {p.node: list(p.allowed) for p in self.pins}
        terminal: dict[tuple, list[tuple[Read, np.ndarray, np.ndarray]]] = {}
        for r, lat in self.terminal_reads():
            edge = edges[(r.producer, r.to)] if (r.producer, r.to) in edges else edges[(r.to, r.producer)].T
            allowed = edge < FORBIDDEN
            if r.to in pinned:  # a pinned reader takes only its pinned layouts
                allowed = allowed & np.isin(np.arange(edge.shape[1]), pinned[r.to])
            for key, table in lat.items():
                terminal.setdefault(key, []).append((r, allowed, table))
        self.merge_terms = []
        merging_by_key: dict[tuple, int] = {}
        for key, reads in terminal.items():
            merging = len({r.value for r, _, _ in reads})
            if merging < 2:
                continue
            merging_by_key[key] = merging
            kind, axes = key[:2]
            c = collective_cost(kind, axes, mesh)
            aux = None
            for r, allowed, table in reads:
                once = np.where(allowed, table, np.inf).min(axis=1)
                forced = np.isfinite(once) & (once > 0)
                if forced.any():
                    if aux is None:
                        aux = self.add(Node(f"merged {kind}{{{','.join(axes)}}}",
                                            np.array([0.0, c.latency * math.ceil(merging / COMBINE_COUNT)]),
                                            np.zeros(2), (self.horizon - 1, self.horizon), ("off", "on")),
                                       NodeInfo("merged", -1))
                    self.add_edge(r.producer, aux, np.stack([np.where(forced, FORBIDDEN, 0.0), np.zeros(len(forced))], 1))
                    self._discount(r, np.where(forced[:, None] & allowed, np.where(forced, once, 0.0)[:, None], 0.0))
                decided = np.where(forced[:, None] | ~allowed, 0.0, table)
                k = (r.producer, r.to) if (r.producer, r.to) in edges else (r.to, r.producer)
                decided = decided if k == (r.producer, r.to) else decided.T
                self.merge_terms.append(MergeTerm(key, r.value, r.producer, forced, k, decided))
        optimistic = merge_discounts(self.merge_terms, merging_by_key)  # as if every terminal value is reduced
        self.plain_edges = dict(edges) if optimistic else None
        for k, rest in optimistic.items():
            edges[k] = discounted(edges[k], rest)

    def add_kept_layouts(self) -> None:
        """The memory of the layouts the reshard cache keeps between a value's reads.

        A read in a layout other than the value's own makes a buffer
        (``add_operands`` counts it during the read's step), and the reshard
        cache (``schedule``) keeps it for the value's later reads in that
        layout: an FSDP weight gathered for the forward pass stays gathered
        until the backward pass reads it (XLA merges repeated identical
        gathers, so the compiled program keeps it too). For each read of an
        argument but its last, a node holds the read's layout from the
        step after the read up to the argument's next read, where the layout is
        not the value's own and no smaller than it (a smaller one is a local
        cut, made at each read), and the next read takes it too. Its strategies
        are the read's layout with why it holds nothing (the layout is the
        source's, or the next read takes another) or that it is kept: an edge
        to the reader fixes the layout, one to the producer allows the first
        reason only where it holds, one to each next reader the second, so
        the bytes are exact given the three ends (a layout kept past a read in
        another, for a read after that, is left out).
        Op results are left out: held over their backward reads, every
        activation would carry such a node, and the search under a limit
        slows several times over on large programs (their kept layouts are
        counted by ``memory.peak_memory``, not by the bound).
        """
        runs = runs_in(self.graph)
        arguments = set(self.graph.inputs)
        by_argument: dict[int, list[tuple[int, Read]]] = {}
        for r in self.reads:
            if r.consumer is not None and r.value in arguments:
                by_argument.setdefault(r.value, []).append((runs[r.consumer] + 1, r))
        shardings, mesh, values = self.tables.shardings, self.mesh, self.graph.values
        for x, reads in by_argument.items():
            steps = sorted({step for step, _ in reads})
            if len(steps) < 2:
                continue
            value = values[x]
            src = self.ids_at[((), x)]
            src_ids = np.unique(src)
            src_bytes = {int(i): shardings[i].local_bytes(value.shape, value.itemsize, mesh) for i in src_ids}
            src_row = np.searchsorted(src_ids, src)  # the producer's layout, per strategy
            for step, r in reads:
                following = steps[bisect.bisect_right(steps, step)] if step < steps[-1] else None
                if following is None or following <= step + 1:
                    continue
                layouts = np.unique(r.dst)
                nbytes = np.array([shardings[j].local_bytes(value.shape, value.itemsize, mesh) for j in layouts])
                # kept[i, j]: source layout i read as layout j leaves a buffer of j's bytes behind
                kept = np.array([[i != j and nbytes[b] >= src_bytes[int(i)] for b, j in enumerate(layouts)]
                                 for i in src_ids])
                if not kept.any():
                    continue
                n = len(layouts)
                # strategies: (layout, the source's own), (layout, the next read takes another), (layout, kept)
                usage = np.concatenate([np.zeros(2 * n), nbytes])
                labels = tuple(f"{shardings[j]}{why}" for why in ("", " not read next", " kept") for j in layouts)
                aux = self.add(Node(f"{value.name} kept for step {following}", np.zeros(3 * n), usage,
                                    (step + 1, following), labels), NodeInfo("kept", x))
                at = np.searchsorted(layouts, r.dst)  # the reader's layout per strategy
                reader = np.full((3 * n, len(r.dst)), FORBIDDEN)
                for block in range(3):
                    reader[block * n + at, np.arange(len(r.dst))] = 0.0
                self.add_edge(aux, r.producer, np.concatenate([
                    np.where(kept[src_row].T, FORBIDDEN, 0.0), np.zeros((2 * n, len(src)))]))
                self.add_edge(aux, r.to, reader)
                for _, later in (read for read in reads if read[0] == following):
                    same = layouts[:, None] == later.dst[None, :]  # (layouts, the later reader's strategies)
                    self.add_edge(aux, later.to, np.concatenate([
                        np.zeros((n, len(later.dst))), np.where(same, FORBIDDEN, 0.0), np.zeros((n, len(later.dst)))]))

    def _discount(self, r: Read, drop: np.ndarray) -> None:
        """Take ``drop`` (producer strategies x reader strategies) off the edge of read ``r``."""
        edges = self.edges
        if (r.producer, r.to) in edges:
            k = (r.producer, r.to)
        else:
            k, drop = (r.to, r.producer), drop.T
        edges[k] = discounted(edges[k], drop)

    # -- arguments, constants, outputs, ties ---------------------------------------------

    def add_arguments(self, in_pins: Pins) -> None:
        graph, mesh = self.graph, self.mesh
        keys = graph.traced.in_keys
        for vid, (pinned, label), key in [(v, in_pins[k], keys[k]) for k, v in enumerate(graph.inputs)] + [
            (v, (None, ""), None) for v in graph.consts
        ]:
            value = graph.values[vid]
            cands = candidates(value.shape, mesh, pinned, key_dims(key))
            # An uneven argument arrives evened (JAX lays out no uneven split at a jit boundary): that buffer stays live.
            usage = np.array([s.evened(value.shape, mesh).local_bytes(value.shape, value.itemsize, mesh)
                              for s in cands], dtype=np.float64)
            idx = self.add(
                Node(value.name, np.zeros(len(cands)), usage, (0, self.horizon), tuple(map(str, cands))),
                NodeInfo(value.kind, vid, cands),
            )
            self.value_node[vid] = idx
            self.produce(((), vid), idx, list(cands))
            if value.kind == "input" and not all(s.divides(value.shape, mesh) for s in cands):
                self.uneven_arguments.add(vid)
            if pinned is not None:
                self.pins.append(Pin(idx, (cands.index(pinned),), label))

    def add_outputs(self, out_pins: Pins) -> None:
        graph, mesh, tables = self.graph, self.mesh, self.tables
        keys = graph.traced.out_keys
        for k, x in enumerate(graph.outputs):
            if isinstance(x, Lit):
                continue
            value = graph.values[x]
            pinned, label = out_pins[k]
            cands = candidates(value.shape, mesh, pinned, key_dims(keys[k]))
            producer = self.produced_at[((), x)][0]
            # XLA allocates each output for the whole program (``memory_analysis()`` counts it in full): its
            # bytes are here, not its producer's (a scan's boundary nodes hold its outputs too: counted twice).
            usage = np.array([c.evened(value.shape, mesh).local_bytes(value.shape, value.itemsize, mesh)
                              for c in cands], dtype=np.float64)
            idx = self.add(
                Node(f"outputs[{k}]", np.zeros(len(cands)), usage, (0, self.horizon), tuple(map(str, cands))),
                NodeInfo("output", k, cands),
            )
            self.output_node[k] = idx
            if pinned is not None:
                self.pins.append(Pin(idx, (cands.index(pinned),), label))
            # An uneven output leaves evened (JAX returns no uneven split): the producer reshards straight to that.
            leave = tables.ids([c.evened(value.shape, mesh) for c in cands])
            self.edges[(producer, idx)] = tables.table(value.shape, value.wire_itemsize, self.ids_at[((), x)], leave)
            self.reads.append(Read(producer, idx, x, None, leave))
            self.edge_reads.append(self.reads[-1])

    def add_ties(self, ties: Sequence[tuple[int, int]]) -> None:
        """(argument leaf, output leaf) pairs take the same sharding, as JAX lays them out at the boundary (an
        argument split unevenly arrives evened, ``Sharding.evened``; a pin over a mesh axis of one device is the
        layout without it, ``Sharding.without_unit_axes``): a forbidden cost off the diagonal."""
        mesh = self.mesh
        for arg_leaf, out_leaf in ties:
            if out_leaf not in self.output_node:
                continue
            value = self.graph.inputs[arg_leaf]
            u, v = self.value_node[value], self.output_node[out_leaf]
            shape = self.graph.values[value].shape

            def layout(s: Sharding) -> Sharding:
                return s.evened(shape, mesh).without_unit_axes(mesh)

            same = tie_table(self.infos[u].shardings, self.infos[v].shardings, lambda a, b: layout(a) == layout(b))
            self.edges[(u, v)] = self.edges[(u, v)] + same if (u, v) in self.edges else same

    # -- operations --------------------------------------------------------------------

    def add_ops(self, g: Graph, scope: Scope, scale: float, within: tuple[int, int] | None, prefix: str,
                hoisted: tuple[float, frozenset[int]] | None = None) -> None:
        """Every op of ``g`` (the program, or a scan body living in the time step ``within``).

        ``hoisted``: a body's (the scan's own scale, its loop invariants): an op of the body that reads only
        those (``loop_invariant_ops``) is computed once, before the loop (XLA's loop-invariant code motion), so
        its costs count at the scan's scale, not at each iteration's.
        """
        g_last, g_read = g.last_use(), read_until(g)
        g_outputs = {x for x in g.outputs if not isinstance(x, Lit)}
        once = loop_invariant_ops(g, hoisted[1]) if hoisted is not None else frozenset()
        for op in g.ops:
            if within is None:  # the program: op k runs at time k + 1, results live to their last reader
                late = first_reader(g, op)
                step = op.id + 1 if late is None else late + 1
                end = max((g_read.get(v, op.id) + 2
                           - (g_read.get(v) == g_last.get(v) and updated_in_place(g, v, g_last)) for v in op.outputs),
                          default=op.id + 2)
                if any(v in g_outputs for v in op.outputs):
                    end = self.horizon + 1
                interval = (step, end)
            else:  # inside a scan body: everything lives in the scan's time step
                step, end = within[0], within[1]
                interval = within
            name = op.name() if not prefix else f"{prefix}{op.name()}"
            if op.primitive == "scan" and self.options.expand_scans and expandable(op):
                self.add_scan(g, op, scope, scale, step, end, name)
            else:
                self.add_op(g, op, scope, hoisted[0] if op.id in once else scale, interval, name)

    def planned_graphs(self, g: Graph) -> Iterator[Graph]:
        """``g`` and the bodies of the scans in it that ``add_ops`` plans op by op."""
        yield g
        for op in g.ops:
            if op.primitive == "scan" and self.options.expand_scans and expandable(op):
                yield from self.planned_graphs(g.body(op))

    def rule_strategies(self, g: Graph, op: Op, live_out: tuple[bool, ...] = ()) -> tuple[Rule, bool, RuleStrategies]:
        """``op``'s rule (or the fallback, reported), and its strategies priced (shared by equal ops); ``live_out``
        marks the results that are program outputs (allocated as such, not by the op)."""
        view = g.view(op)
        rule = rule_for(view)
        fallback = rule is None
        if rule is None:
            rule = fallback_rule(view)
        itemsizes = tuple(np.dtype(d).itemsize for d in view.in_dtypes + view.out_dtypes)
        traffic = memory_traffic(g, op)
        # A rule's equality leaves out its FLOPs: a sort and a cumulative op of one shape are equal rules.
        key = (rule, rule.flops, rule.log_flops, op.literal_operands, itemsizes, traffic, live_out)
        rs = self.rule_cache.get(key)
        if rs is None:
            rs = RuleStrategies.make(rule, op.literal_operands, itemsizes, self.mesh, self.tables, self.options.uneven,
                                     traffic, live_out)
            self.rule_cache[key] = rs
        return rule, fallback, rs

    def add_op(self, g: Graph, op: Op, scope: Scope, scale: float, interval: tuple[int, int], name: str) -> None:
        if op.primitive in HAND_LAID_OUT:
            where = op.where()
            raise ShardsolveError(
                f"jax.{op.primitive}{f' at {where}' if where else ''}: a region whose shards are laid out by hand, "
                "which the plan's own shard_map program cannot run; plan the parts before and after it as functions "
                "of their own"
            )
        live_out = () if scope else tuple(v in g.output_ids for v in op.outputs)
        rule, fallback, rs = self.rule_strategies(g, op, live_out if any(live_out) else ())
        costs = rs.costs * scale if scale != 1 else rs.costs
        if op.primitive == "scan" and expandable(op):  # not expanded: its body runs replicated
            costs = costs + scale * replicated_scan_time(g, op, self.mesh)
        idx = self.add(
            Node(name, costs, rs.usage, interval, rs.labels),
            NodeInfo("op", op.id, rule=rule, strategies=rs.strategies, fallback=fallback, scope=scope),
        )
        if scope:
            self.scans[scope].op_node[op.id] = idx
        else:
            self.op_node[op.id] = idx
            self.add_operands(idx, rs, interval[0], name, g, op, rule)
        if op.primitive in ("sharding_constraint", "device_put"):
            self.pin_constraint(g, op, idx, rs)
        produced_at, ids_at = self.produced_at, self.ids_at
        for r, v in enumerate(op.outputs):
            produced_at[(scope, v)] = (idx, rs.result_layouts[r])
            ids_at[(scope, v)] = rs.result_ids[r]
            self.reserve_hub((scope, v))
        read_edge = self.read_edge
        for k, x in enumerate(op.inputs):
            if not isinstance(x, Lit):
                read_edge(scope, g, x, rs.operand_ids[k], idx, scale)

    def pin_constraint(self, g: Graph, op: Op, idx: int, rs: RuleStrategies) -> None:
        """A ``with_sharding_constraint`` (or a ``device_put`` onto a ``NamedSharding``) inside the function is a
        user annotation: its op node (an identity) keeps the strategies whose results are laid out as it asks
        (dimensions it leaves unconstrained free)."""
        if op.primitive == "sharding_constraint":
            asked = [(op.params.get("sharding"), op.params.get("unconstrained_dims"))]
        else:
            asked = [(d, ()) for d in op.params.get("devices", ())]
        where = op.where()
        what = (f"{'with_sharding_constraint' if op.primitive == 'sharding_constraint' else 'device_put'}"
                + (f" at {where}" if where else f" ({op.name()})"))
        sizes = self.mesh.shape

        def split(axes: tuple[str, ...]) -> tuple[str, ...]:  # an axis of size 1 splits nothing
            return tuple(a for a in axes if sizes[a] > 1)

        wanted = {}
        for k, (ns, unconstrained) in enumerate(asked[:len(op.outputs)]):
            found = constraint_sharding(ns, unconstrained, tuple(g.values[op.outputs[k]].shape), self.mesh, what)
            if found is not None:
                wanted[k] = found
        if not wanted:
            return
        label = f"{what} = " + ", ".join(str(s.to_spec()) for s, _ in wanted.values())
        allowed = tuple(i for i, st in enumerate(rs.strategies)
                        if all(not st.results[k].partial
                               and all(d in free or split(got) == split(want)
                                       for d, (got, want) in enumerate(zip(st.results[k].dims, s.dims)))
                               for k, (s, free) in wanted.items()))
        if allowed:
            self.pins.append(Pin(idx, allowed, label))
            return
        mixed = [axes for s, _ in wanted.values() for axes in s.dims if axes != self.mesh.order(axes)]
        if mixed:
            raise ShardsolveError(f"{label}: splits a dimension over {mixed[0]}, out of the mesh's order "
                                  f"{self.mesh.names}; the planner splits a dimension over several axes in mesh "
                                  f"order: write {self.mesh.order(mixed[0])}")
        raise ShardsolveError(f"{label}: no strategy of the planner lays the value out so"
                              + ("" if self.options.uneven else " with even splits alone (uneven=False)")
                              + "; drop the constraint or change its PartitionSpec")

    def add_operands(self, idx: int, rs: RuleStrategies, step: int, name: str, g: Graph, op: Op, rule: Rule) -> None:
        """The memory of the operand layouts op node ``idx`` reads, live during its own time step, and of the
        scratch it runs with (``add_scratch``).

        A consumer reads each operand in its strategy's layout; where that is
        not the producer's, the reshard's result is a buffer of its own (an
        all-gathered weight of FSDP is a whole weight). The node takes the op's
        strategy (an edge forbids any other), costs nothing and holds those
        bytes from ``step`` to ``step + 1``: where no reshard is needed it
        counts the operand twice for one step, so the peak errs high.
        """
        scratch = may_need_scratch(g, op)
        if not scratch and not np.any(rs.operand_usage):
            return
        aux = self.add(Node(f"{name} operands", np.zeros(len(rs.strategies)), rs.operand_usage, (step, step + 1),
                            rs.labels), NodeInfo("operands", op.id, strategies=rs.strategies))
        n = len(rs.strategies)
        self.edges[(idx, aux)] = _same_strategy(n)
        if scratch:
            self.pending_scratch.append((aux, g, op, rule, rs))

    def add_scratch(self) -> None:
        """Each op's scratch (``workspace``: measured by compiling it alone) on its operands node: asked for
        once the rest is built, so that the compiles ``build`` started run beside the building."""
        by_rule: dict[tuple, np.ndarray] = {}
        for aux, g, op, rule, rs in self.pending_scratch:
            ratio = workspace_ratio(g, op)
            if not ratio:
                continue
            itemsizes = tuple(np.dtype(d).itemsize for d in g.view(op).in_dtypes)
            key = (id(rs), ratio, itemsizes)
            extra = by_rule.get(key)
            if extra is None:
                shapes = [rule.operand_shape(k) for k in range(len(rule.operands))]
                extra = by_rule[key] = np.array([scratch_bytes(ratio, s, shapes, itemsizes, op.literal_operands,
                                                               self.mesh) for s in rs.strategies], dtype=np.float64)
            node = self.nodes[aux]
            self.nodes[aux] = dataclasses.replace(node, usages=node.usages + extra)
        self.pending_scratch.clear()

    # -- scans -------------------------------------------------------------------------

    def add_scan(self, g: Graph, op: Op, scope: Scope, scale: float, step: int, end: int, name: str) -> None:
        """A scan's body planned once; see ``ScanNodes``."""
        length = int(op.params["length"])
        body = g.body(op)
        inner = scope + (op.id,)
        sn = self.scans[inner] = ScanNodes(op.id, length, body)
        within = (step, step + 1)
        self.add_scan_operands(g, op, scope, scale, step, end, name, sn)
        self.add_body_consts(inner, scale, name, within, sn)
        self.add_ops(body, inner, scale * length, within, f"{name}/",
                     hoisted=(scale, frozenset(body.inputs[:scan_counts(op)[0]]) | frozenset(body.consts)))
        self.add_scan_outputs(g, op, scope, scale * length, step, end, name, sn)

    def add_scan_operands(self, g: Graph, op: Op, scope: Scope, scale: float, step: int, end: int, name: str,
                          sn: ScanNodes) -> None:
        """One node per const, carry and x-slice, read from the scan's operands."""
        mesh, tables = self.mesh, self.tables
        n_consts, n_carry = scan_counts(op)
        inner = scope + (op.id,)
        for k, x in enumerate(op.inputs):
            bvid = sn.body.inputs[k]
            bval = sn.body.values[bvid]
            cands = tuple(candidate_shardings(bval.shape, mesh))
            kind = "const" if k < n_consts else "carry" if k < n_consts + n_carry else "xs"
            outer = cands if kind != "xs" else tuple(ScanBoundary.stacked(c) for c in cands)
            if kind == "carry":
                usage = [c.local_bytes(bval.shape, bval.itemsize, mesh) for c in cands]
                interval = (step, end)
            else:  # consts and xs are the operands' own buffers (a resharded copy is not counted)
                usage, interval = [0.0] * len(cands), (step, step + 1)
            group = getattr(sn, kind)
            idx = self.add(
                Node(f"{name} {kind}[{len(group)}]", np.zeros(len(cands)), np.array(usage, dtype=np.float64),
                     interval, tuple(map(str, cands))),
                NodeInfo(f"scan-{kind}", op.id, cands, scope=inner),
            )
            group.append(idx)
            if kind == "const":
                self.invariant_scale[(inner, bvid)] = scale
            self.produce((inner, bvid), idx, list(cands))
            if not isinstance(x, Lit):
                self.read_edge(scope, g, x, tables.ids(outer), idx, scale)

    def add_body_consts(self, inner: Scope, scale: float, name: str, within: tuple[int, int], sn: ScanNodes) -> None:
        """One node per closed-over constant of the body: a loop invariant, made before the loop (at ``scale``)."""
        mesh = self.mesh
        for k, bvid in enumerate(sn.body.consts):
            bval = sn.body.values[bvid]
            cands = tuple(candidate_shardings(bval.shape, mesh))
            idx = self.add(
                Node(f"{name} body const[{k}]", np.zeros(len(cands)),
                     np.array([c.local_bytes(bval.shape, bval.itemsize, mesh) for c in cands], dtype=np.float64),
                     within, tuple(map(str, cands))),
                NodeInfo("scan-body-const", bvid, cands, scope=inner),
            )
            sn.body_consts.append(idx)
            self.invariant_scale[(inner, bvid)] = scale
            self.produce((inner, bvid), idx, list(cands))

    def add_scan_outputs(self, g: Graph, op: Op, scope: Scope, inner_scale: float, step: int, end: int, name: str,
                         sn: ScanNodes) -> None:
        """One node per y-slice; the body's outputs read into the carry and y nodes; the scan's results."""
        mesh = self.mesh
        n_carry = scan_counts(op)[1]
        inner = scope + (op.id,)
        outer_scale = inner_scale / max(1, int(op.params["length"]))
        for r, bx in enumerate(sn.body.outputs):
            if r < n_carry:
                to = sn.carry[r]
            else:
                out_val = g.values[op.outputs[r]]
                cands = tuple(candidate_shardings(out_val.shape[1:], mesh))
                stacked = np.array([ScanBoundary.stacked(c).local_bytes(out_val.shape, out_val.itemsize, mesh)
                                    for c in cands], dtype=np.float64)
                to = self.add(
                    Node(f"{name} ys[{r - n_carry}]", stacked_ys_time(g, op.outputs[r], stacked, mesh) * outer_scale,
                         stacked, (step, end), tuple(map(str, cands))),
                    NodeInfo("scan-ys", op.id, cands, scope=inner),
                )
                sn.ys.append(to)
            if not isinstance(bx, Lit):
                self.read_edge(inner, sn.body, bx, self.tables.ids(self.infos[to].shardings), to, inner_scale)
        for r, v in enumerate(op.outputs):
            to = sn.carry[r] if r < n_carry else sn.ys[r - n_carry]
            shardings = list(self.infos[to].shardings)
            if r >= n_carry:
                shardings = [ScanBoundary.stacked(c) for c in shardings]
            self.produce((scope, v), to, shardings)


def tie_table(us: Sequence[Sharding], vs: Sequence[Sharding], same) -> np.ndarray:
    """An equality edge: 0 where ``same(u's sharding, v's sharding)``, forbidden elsewhere."""
    return np.array([[0.0 if same(a, b) else FORBIDDEN for b in vs] for a in us], dtype=np.float64)


def tie_axes(built: Built, graph: Graph, ties: Sequence[AxisTie],
             whole: Sequence[tuple[int, tuple[int, ...], str]] = ()) -> Built:
    """``built`` with argument dimensions tied, as ``add_ties`` ties carry pairs.

    Each ``AxisTie`` forbids the strategy pairs of its two argument nodes that
    split the tied dimensions over different mesh axes (ties between one pair
    of nodes share one edge); each ``(leaf, dims, label)`` of ``whole`` pins
    that argument to the candidates that leave ``dims`` unsplit.
    """
    nodes = built.nodes
    node_of = [built.value_node[v] for v in graph.inputs]
    by_pair: dict[tuple[int, int], list[AxisTie]] = {}
    for t in ties:
        u, v = node_of[t.a], node_of[t.b]
        if u != v:
            by_pair.setdefault((u, v) if u < v else (v, u), []).append(t if u < v else
                                                                      AxisTie(t.b, t.dim_b, t.a, t.dim_a, t.label))
    tables = {}
    for (u, v), group in by_pair.items():
        dims = [(t.dim_a, t.dim_b) for t in group]
        tables[(u, v)] = tie_table(nodes[u].shardings, nodes[v].shardings,
                                   lambda a, b: all(a.dims[i] == b.dims[j] for i, j in dims))

    def tied(problem_edges: Sequence[Edge]) -> tuple[Edge, ...]:
        edges = {(e.u, e.v): e.costs for e in problem_edges}
        for (u, v), table in tables.items():
            if (u, v) in edges:
                edges[(u, v)] = np.minimum(edges[(u, v)] + table, FORBIDDEN)
            elif (v, u) in edges:
                edges[(v, u)] = np.minimum(edges[(v, u)] + table.T, FORBIDDEN)
            else:
                edges[(u, v)] = table
        return tuple(Edge(u, v, c) for (u, v), c in edges.items())

    pins = list(built.problem.pins)
    for leaf, dims, label in whole:
        idx = node_of[leaf]
        allowed = tuple(k for k, s in enumerate(nodes[idx].shardings) if all(not s.dims[d] for d in dims))
        pins.append(Pin(idx, allowed, label))
    p = built.problem
    problem = Problem(p.nodes, tied(p.edges), p.usage_limit, tuple(pins), p.name)
    plain = None if built.plain_edges is None else tied(built.plain_edges)
    unlimited = None if built.unlimited is None else tie_axes(built.unlimited, graph, ties, whole)
    return dataclasses.replace(built, problem=problem, plain_edges=plain, unlimited=unlimited)


def build_problem(
    graph: Graph,
    mesh: MeshSpec,
    in_pins: Pins,
    out_pins: Pins,
    memory_limit: float | None = None,
    ties: Sequence[tuple[int, int]] = (),
    options: BuildOptions = BuildOptions(),
) -> Built:
    """Turn ``graph`` into a ``Problem``.

    ``in_pins``/``out_pins`` hold (sharding or None, label) per flattened
    argument/output; ``ties`` are (argument leaf, output leaf) pairs that must
    get the same sharding (a training step's state going round the loop).
    Under a memory limit the result carries the problem without it too
    (``Built.unlimited``).
    """
    builder = ProblemBuilder(graph, mesh, options)
    built = builder.build(in_pins, out_pins, memory_limit, ties)
    if memory_limit is None:
        return built
    unlimited = ProblemBuilder(graph, mesh, options, like=builder).build(in_pins, out_pins, None, ties)
    return dataclasses.replace(built, unlimited=unlimited)
