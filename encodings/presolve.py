"""Exact reductions of a :class:`~shardsolve.problem.Problem` before search.

Every reduction is a pure function ``Problem -> (smaller Problem, Step)``; the
``Step`` lifts any assignment of the smaller problem back to one of the larger
problem with exactly the same cost (``cost_parent = cost_reduced + step.offset``)
and the same feasibility. ``reduce`` applies them to a fixpoint:

==========================  ===================================================
``restrict``                drop strategies that are pinned out, forbidden
                            (node cost >= 1e18), have no finite edge entry
                            towards some neighbour (arc consistency), or use
                            more memory than the limit leaves them at some time
``merge_parallel_edges``    one edge per node pair (tables summed), self-loops
                            folded into node costs
``drop_dominated``          strategy ``a`` of a node goes when some ``b`` is at
                            least as good everywhere: node cost, usage (when
                            the node's usage can matter) and every incident
                            edge row elementwise
``fold_fixed``              single-strategy nodes: their edge rows move into
                            the neighbours' node costs
``fold_followers``          a node ``v`` whose edge to ``u`` has one finite
                            entry per row of ``u`` is a function ``v = f(u)``:
                            its costs and other edges move onto ``u``
``eliminate_low_degree``    degree-0/1/2 nodes eliminated exactly by dynamic
                            programming (min over the node's strategies)
``split_components``        independent sub-problems (edges and memory
                            coupling both connect nodes)
==========================  ===================================================

Every reduction but ``restrict`` expects pins already folded in (``restrict``
turns them into removed strategies); ``reduce`` runs ``restrict`` first.

Memory. A node's usage *matters* when there is a usage limit, its interval is
non-empty, and at some time of its interval the sum of the largest usages of all
live nodes exceeds the limit. Nodes whose usage does not matter are eliminated
freely. A node whose remaining strategies all use the same memory is eliminated
too, but leaves a *ghost*: a single-strategy node, zero cost, no edges, with that
usage and interval, so every time step still sees its memory. Nodes whose usage
matters and differs between strategies are never eliminated, folded or merged
(only their dominated strategies are dropped, comparing usage too).

Worked example: a chain ``a - b - c`` with no memory limit. ``b`` has degree 2,
so it goes: the new edge ``(a, c)`` has table ``T[x, z] = min_y e_ab[x, y] +
cost_b[y] + e_bc[y, z]`` and the step remembers the minimising ``y`` for every
``(x, z)``. Then ``a`` and ``c`` have degree 1, ``a`` goes into ``c``'s node
costs, and ``c`` alone remains: its best strategy, lifted back through both
steps, gives an optimal assignment of the chain.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from shardsolve.errors import InfeasibleError
from shardsolve.problem import FORBIDDEN, Edge, Node, Problem, Solution

__all__ = [
    "Step",
    "Fixed",
    "Follow",
    "Pair",
    "Reduced",
    "restrict",
    "merge_parallel_edges",
    "drop_dominated",
    "fold_fixed",
    "fold_followers",
    "eliminate_low_degree",
    "split_components",
    "fold_and_eliminate",
    "memory_matters",
    "reduce",
]

INF = math.inf
#: Largest table (entries) built when eliminating a degree-2 node.
MAX_PAIR_TABLE = 1 << 21
#: Above this many nodes ``reduce`` runs one round only (each round is a pass in Python).
LARGE_PROBLEM = 5000
#: Deterministic charge (seconds) of ``reduce``: per node and edge per round (measured 6e-5 to 2e-4 s; above
#: ``LARGE_PROBLEM`` nodes, one light round: 5e-5 s on IOPDDL K), per edge-table entry (GPT-2 large on a
#: 2x2x2 mesh, 165M entries in 6,552 tables: 3.6 to 4.9 s in all), and per entry compared by the dominance
#: tests (``stats["reduce_deterministic_s"]``).
ITEM_CHARGE = 1e-4
LARGE_ITEM_CHARGE = 5e-5
ENTRY_CHARGE = 1.8e-8
COMPARE_CHARGE = 6e-9
#: Largest pairwise comparison work (strategies^2 x columns) spent on one node's dominance check. Above it the
#: test finds almost nothing: on GPT-2 large's tied problem for a three-axis mesh (up to 343 strategies a node)
#: nodes above 4M dropped 32 of 25,689 strategies in 2.5 s; on IOPDDL B, G, V and two-axis planner problems
#: nothing changes.
MAX_DOMINANCE_WORK = 1 << 22


# -- lifting records -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fixed:
    """Parent node ``node`` takes strategy ``strategy``."""

    node: int
    strategy: int


@dataclass(frozen=True, slots=True, eq=False)
class Follow:
    """Parent node ``node`` takes ``table[s_leader]``."""

    node: int
    leader: int
    table: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class Pair:
    """Parent node ``node`` takes ``table[s_a, s_b]``."""

    node: int
    a: int
    b: int
    table: np.ndarray


Elimination = Fixed | Follow | Pair


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """Lifts assignments of a reduced problem to its parent.

    Reduced node ``j`` is parent node ``node_map[j]``, its strategy ``k`` is the
    parent's strategy ``strategy_maps[j][k]``; eliminated parent nodes are then
    filled in reverse order of ``eliminated``. Costs differ by ``offset``.
    """

    num_nodes: int
    node_map: np.ndarray
    strategy_maps: tuple[np.ndarray, ...]
    eliminated: tuple[Elimination, ...] = ()
    offset: float = 0.0
    #: Entries the step's dominance tests compared (``drop_dominated``): its work beyond a pass over the tables.
    compared: int = 0

    def lift(self, assignment) -> np.ndarray:
        parent = np.full(self.num_nodes, -1, dtype=np.int64)
        for j, s in enumerate(assignment):
            parent[self.node_map[j]] = self.strategy_maps[j][int(s)]
        for rec in reversed(self.eliminated):
            if isinstance(rec, Fixed):
                parent[rec.node] = rec.strategy
            elif isinstance(rec, Follow):
                parent[rec.node] = rec.table[parent[rec.leader]]
            else:
                parent[rec.node] = rec.table[parent[rec.a], parent[rec.b]]
        return parent


def _identity_step(problem: Problem) -> Step:
    n = len(problem.nodes)
    return Step(n, np.arange(n), tuple(np.arange(node.num_strategies) for node in problem.nodes))


# -- a mutable working copy (local to each reduction) ----------------------------


def _read_only(costs: np.ndarray) -> np.ndarray:
    """``costs`` as float64, read-only: the working copy's tables keep forbidden entries as they come (at or
    above ``FORBIDDEN``; sums of them stay above it) and are replaced, never written into. Converting every
    table to ``inf`` and back was most of ``reduce``'s time on the largest problems, whose tables nearly all
    hold a forbidden entry."""
    c = np.asarray(costs, dtype=np.float64)
    if not c.flags.writeable:
        return c
    view = c.view()
    view.flags.writeable = False
    return view


def _clamped(costs: np.ndarray) -> np.ndarray:
    """``costs`` with forbidden entries at ``FORBIDDEN`` exactly (sums of them, and ``inf``, brought back)."""
    if not costs.size or costs.max() <= FORBIDDEN:
        return costs
    if costs.flags.writeable:  # a table a reduction made: the working copy's own
        return np.minimum(costs, FORBIDDEN, out=costs)
    return np.minimum(costs, FORBIDDEN)


class _Work:
    """Node costs, usages and a pair-keyed edge dict; rebuilt into a Problem at the end."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.costs = [_read_only(n.costs) for n in problem.nodes]
        self.usages = [np.asarray(n.usages, dtype=np.float64) for n in problem.nodes]
        self.alive = np.ones(len(problem.nodes), dtype=bool)
        self.ghost = np.zeros(len(problem.nodes), dtype=bool)
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.adj: list[set[int]] = [set() for _ in problem.nodes]
        self.offset = 0.0
        self.eliminated: list[Elimination] = []
        for e in problem.edges:
            self.add_edge(e.u, e.v, _read_only(e.costs))

    def add_edge(self, u: int, v: int, table: np.ndarray) -> None:
        if u == v:
            self.costs[u] = self.costs[u] + np.diag(table)
            return
        if u > v:
            u, v, table = v, u, table.T
        key = (u, v)
        if key in self.edges:  # summed into whichever table the working copy made (never into the problem's)
            current = self.edges[key]
            if current.flags.writeable:
                current += table
            elif table.flags.writeable:
                table += current
                self.edges[key] = table
            else:
                self.edges[key] = current + table
        else:
            self.edges[key] = np.asarray(table, dtype=np.float64)
            self.adj[u].add(v)
            self.adj[v].add(u)

    def table(self, u: int, v: int) -> np.ndarray:
        """Edge table oriented with ``u``'s strategies as rows."""
        return self.edges[(u, v)] if u < v else self.edges[(v, u)].T

    def remove_edge(self, u: int, v: int) -> np.ndarray:
        t = self.table(u, v)
        del self.edges[(min(u, v), max(u, v))]
        self.adj[u].discard(v)
        self.adj[v].discard(u)
        return t

    def remove_node(self, v: int, ghost_usage: float | None) -> None:
        """Drop ``v`` (its edges must be gone); keep a ghost when its memory still counts.

        A ghost is a single-strategy, zero-cost, edge-free node with ``v``'s
        interval and usage; lifting overwrites its strategy from the
        elimination record (records are replayed after the node maps).
        """
        assert not self.adj[v]
        if ghost_usage is None:
            self.alive[v] = False
        else:
            self.costs[v] = np.zeros(1)
            self.usages[v] = np.array([ghost_usage])
            self.ghost[v] = True

    def build(self, strategy_maps: list[np.ndarray] | None = None) -> tuple[Problem, Step]:
        p = self.problem
        keep = np.flatnonzero(self.alive)
        index = np.full(len(p.nodes), -1, dtype=np.int64)
        index[keep] = np.arange(len(keep))
        nodes = []
        smaps = []
        for i in keep:
            old = p.nodes[i]
            if strategy_maps is not None:
                smap = strategy_maps[i]
            elif self.ghost[i]:
                smap = np.zeros(1, dtype=np.int64)  # the elimination record sets the real strategy
            else:
                smap = np.arange(len(self.costs[i]))
            labels = tuple(old.labels[k] for k in smap) if old.labels else ()
            nodes.append(Node(old.name, _clamped(self.costs[i]), self.usages[i], old.interval, labels))
            smaps.append(smap)
        edges = tuple(
            Edge(int(index[u]), int(index[v]), _clamped(t)) for (u, v), t in sorted(self.edges.items())
        )
        reduced = Problem(tuple(nodes), edges, p.usage_limit, (), p.name)
        return reduced, Step(len(p.nodes), keep, tuple(smaps), tuple(self.eliminated), self.offset)


# -- memory ---------------------------------------------------------------------


def _profile(problem: Problem, per_node: list[float] | np.ndarray) -> np.ndarray:
    horizon = max((n.interval[1] for n in problem.nodes), default=0)
    delta = np.zeros(horizon + 1)
    for node, u in zip(problem.nodes, per_node):
        s, e = node.interval
        if e > s:
            delta[s] += u
            delta[e] -= u
    return np.cumsum(delta)[:horizon]


def _interval_max(profile: np.ndarray, problem: Problem) -> np.ndarray:
    """Max of ``profile`` over each node's interval (``-inf`` for empty intervals)."""
    out = np.full(len(problem.nodes), -INF)
    if len(profile) == 0:
        return out
    # sparse table for range maximum queries
    table = [profile]
    k = 1
    while 2 * k <= len(profile):
        prev = table[-1]
        table.append(np.maximum(prev[:-k], prev[k:]))
        k *= 2
    starts = np.array([n.interval[0] for n in problem.nodes])
    ends = np.array([n.interval[1] for n in problem.nodes])
    ok = ends > starts
    length = np.where(ok, ends - starts, 1)
    level = np.floor(np.log2(length)).astype(int)
    for lv in np.unique(level[ok]):
        sel = ok & (level == lv)
        t = table[lv]
        out[sel] = np.maximum(t[starts[sel]], t[ends[sel] - (1 << lv)])
    return out


def memory_matters(problem: Problem) -> np.ndarray:
    """Per node: could its choice of strategy ever break the usage limit?"""
    n = len(problem.nodes)
    if problem.usage_limit is None:
        return np.zeros(n, dtype=bool)
    peak = _profile(problem, [float(np.max(node.usages)) for node in problem.nodes])
    worst = _interval_max(peak, problem)
    return worst > problem.usage_limit * (1 + 1e-12)


def _constant_usage(usages: np.ndarray) -> bool:
    return bool(np.all(usages == usages[0]))


# -- the reductions -----------------------------------------------------------------


class _EdgeBatches:
    """``restrict``'s edge tables stacked by shape, to check many edges in one numpy pass."""

    def __init__(self, tables: list[tuple[int, int, np.ndarray]], first: np.ndarray):
        by_shape: dict[tuple, list[int]] = {}
        for k, (u, v, finite) in enumerate(tables):
            by_shape.setdefault((u == v,) + finite.shape, []).append(k)
        self.group = np.empty(len(tables), dtype=np.int64)  # table -> its shape's group
        self.slot = np.empty(len(tables), dtype=np.int64)  # table -> its place in the group
        self.groups = []  # (self-loop?, rows of u's strategies, rows of v's strategies, stacked finite masks)
        for g, ((loop, su, sv), ks) in enumerate(by_shape.items()):
            ks_arr = np.array(ks, dtype=np.int64)
            self.group[ks_arr], self.slot[ks_arr] = g, np.arange(len(ks))
            us = np.array([tables[k][0] for k in ks], dtype=np.int64)
            vs = np.array([tables[k][1] for k in ks], dtype=np.int64)
            stacked = np.stack([tables[k][2] for k in ks])
            if loop:  # a self-loop keeps the strategies its diagonal allows
                stacked = np.diagonal(stacked, axis1=1, axis2=2)
            self.groups.append((loop, first[us][:, None] + np.arange(su), first[vs][:, None] + np.arange(sv), stacked))

    def check(self, dirty: np.ndarray, flat_ok: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """Check the ``dirty`` tables against ``flat_ok`` (updated in place, a group at a time); the nodes that
        lost a strategy."""
        killed = []
        order = np.argsort(self.group[dirty], kind="stable")
        dirty = dirty[order]
        bounds = np.flatnonzero(np.diff(self.group[dirty])) + 1
        for part in np.split(dirty, bounds):
            loop, rows_u, rows_v, stacked = self.groups[self.group[part[0]]]
            slots = self.slot[part]
            ru = rows_u[slots]
            oku = flat_ok[ru]
            if loop:
                gone = ru[oku & ~stacked[slots]]
            else:
                rv = rows_v[slots]
                okv = flat_ok[rv]
                sub = stacked[slots] & oku[:, :, None] & okv[:, None, :]
                gone = np.concatenate([ru[oku & ~sub.any(axis=2)], rv[okv & ~sub.any(axis=1)]])
            if gone.size:
                flat_ok[gone] = False
                killed.append(gone)
        return np.unique(owner[np.concatenate(killed)]) if killed else np.zeros(0, dtype=np.int64)


#: ``restrict`` checks its dirty edges in batches (one numpy pass per table shape) while at least this many
#: are dirty, then one by one (a worklist, as in AC-3): batches save the interpreter's per-edge work on
#: the first passes, which visit nearly every edge; the worklist the per-shape work on long tails.
BATCH_EDGES = 64


def restrict(problem: Problem, batch_edges: int = BATCH_EDGES) -> tuple[Problem, Step]:
    """Drop strategies that cannot appear in any feasible assignment.

    Pinned-out and forbidden strategies go; then, to a fixpoint, strategies
    with an all-forbidden row towards some neighbour, and strategies whose usage
    alone, added to the least usage of everything else live at the same time,
    exceeds the limit. Raises ``InfeasibleError`` when a node has none left.

    Only edges with a forbidden entry can remove a strategy; after a first pass
    over them, an edge is looked at again only when one of its nodes lost a
    strategy. While at least ``batch_edges`` edges wait, they are checked
    together, one numpy pass per table shape; fewer, one by one (a worklist,
    as in AC-3). The fixpoint is the same either way. The memory test is one
    vectorised pass over all strategies.
    """
    nodes = problem.nodes
    n = len(nodes)
    sizes = np.array([nd.num_strategies for nd in nodes], dtype=np.int64)
    owner = np.repeat(np.arange(n), sizes)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    flat_ok = np.concatenate([np.asarray(nd.costs) < FORBIDDEN for nd in nodes]) if n else np.zeros(0, dtype=bool)
    for pin in problem.pins:
        mask = np.zeros(nodes[pin.node].num_strategies, dtype=bool)
        mask[list(pin.allowed)] = True
        flat_ok[first[pin.node]:first[pin.node] + sizes[pin.node]] &= mask
    ok = [flat_ok[first[i]:first[i] + sizes[i]] for i in range(n)]  # views: updates go through ``flat_ok``
    # edges with a forbidden entry, and their finite masks
    tables: list[tuple[int, int, np.ndarray]] = []
    incident: list[list[int]] = [[] for _ in range(n)]
    for e in problem.edges:
        finite = np.asarray(e.costs) < FORBIDDEN
        if finite.all():
            continue
        k = len(tables)
        tables.append((e.u, e.v, finite))
        incident[e.u].append(k)
        if e.v != e.u:
            incident[e.v].append(k)
    limit = problem.usage_limit
    flat_usage = np.concatenate([np.asarray(nd.usages, dtype=np.float64) for nd in nodes]) if n else np.zeros(0)
    live = np.array([nd.interval[1] > nd.interval[0] for nd in nodes], dtype=bool)

    def empty(i: int) -> InfeasibleError:
        return InfeasibleError(f"node {i} ({nodes[i].name}) has no feasible strategy left", ())

    for i, m in enumerate(ok):
        if not m.any():
            raise empty(i)
    batches = _EdgeBatches(tables, first) if len(tables) >= batch_edges else None
    pending = list(range(len(tables)))
    queued = np.ones(len(tables), dtype=bool)

    def lost(changed_nodes) -> None:
        """``changed_nodes`` lost strategies: check they have some left, queue their edges again."""
        for i in changed_nodes:
            if not ok[i].any():
                raise empty(i)
            for j in incident[i]:
                if not queued[j]:
                    queued[j] = True
                    pending.append(j)

    while True:
        while len(pending) >= batch_edges and batches is not None:
            dirty, pending[:] = np.array(pending, dtype=np.int64), []
            queued[dirty] = False
            lost(batches.check(dirty, flat_ok, owner))
        while pending:
            k = pending.pop()
            queued[k] = False
            u, v, finite = tables[k]
            changed_nodes = []
            if u == v:
                good = np.diag(finite) & ok[u]
                if not np.array_equal(good, ok[u]):
                    ok[u][:] = good
                    changed_nodes.append(u)
            else:
                sub = finite & ok[u][:, None] & ok[v][None, :]
                gu = sub.any(axis=1)
                gv = sub.any(axis=0)
                if (ok[u] & ~gu).any():
                    ok[u] &= gu
                    changed_nodes.append(u)
                if (ok[v] & ~gv).any():
                    ok[v] &= gv
                    changed_nodes.append(v)
            lost(changed_nodes)
        if limit is None or not live.any():
            break
        least = np.minimum.reduceat(np.where(flat_ok, flat_usage, INF), first)
        base = _profile(problem, least)
        worst_rest = _interval_max(base, problem)
        fits = flat_usage + (worst_rest - least)[owner] <= limit * (1 + 1e-12)
        drop = flat_ok & ~fits & live[owner]
        if not drop.any():
            break
        for i in np.unique(owner[drop]):
            good = ok[i] & fits[first[i]:first[i] + sizes[i]]
            if not good.any():
                raise InfeasibleError(
                    f"node {i} ({nodes[i].name}) fits no strategy under the usage limit {limit:g}", ()
                )
            ok[i][:] = good
        lost(np.unique(owner[drop]))
    smaps = [np.flatnonzero(m) for m in ok]
    whole = [len(sm) == nd.num_strategies for sm, nd in zip(smaps, nodes)]
    new_nodes = tuple(
        nd if whole[i] else
        Node(nd.name, np.asarray(nd.costs, dtype=np.float64)[sm], np.asarray(nd.usages, dtype=np.float64)[sm],
             nd.interval, tuple(nd.labels[k] for k in sm) if nd.labels else ())
        for i, (nd, sm) in enumerate(zip(nodes, smaps))
    )
    new_edges = tuple(
        e if whole[e.u] and whole[e.v] else Edge(e.u, e.v, _rows_cols(e.costs, None if whole[e.u] else smaps[e.u],
                                                                       None if whole[e.v] else smaps[e.v]))
        for e in problem.edges
    )
    reduced = Problem(new_nodes, new_edges, problem.usage_limit, (), problem.name)
    return reduced, Step(len(nodes), np.arange(len(nodes)), tuple(smaps))


def _rows_cols(costs, rows: np.ndarray | None, cols: np.ndarray | None) -> np.ndarray:
    """``costs`` (as float64) at ``rows`` and ``cols`` (None: all of them)."""
    c = np.asarray(costs, dtype=np.float64)
    if rows is not None:
        c = c[rows]
    return c if cols is None else c[:, cols]


def merge_parallel_edges(problem: Problem) -> tuple[Problem, Step]:
    """One edge per unordered node pair, oriented ``u < v``; self-loops folded into node costs."""
    return _Work(problem).build()


def _dominated(matrix: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows ``a`` for which some row ``b`` is ``<=`` everywhere (ties: the lower index survives), and the
    number of entries compared."""
    s, k = matrix.shape
    if s <= 1:
        return np.zeros(s, dtype=bool), 0
    # candidate pairs (b dominates a), filtered column block by column block: a few columns rule out most
    # pairs, so the blocks start narrow and widen (each at most 4M entries gathered)
    cand = np.ones((s, s), dtype=bool)  # cand[a, b]
    np.fill_diagonal(cand, False)
    c0, width, compared = 0, 4, s * s
    while c0 < k:
        a_idx, b_idx = np.nonzero(cand)
        if len(a_idx) == 0:
            break
        block = max(1, min(width, (1 << 22) // len(a_idx)))
        cols = matrix[:, c0:c0 + block]
        le = np.all(cols[b_idx] <= cols[a_idx], axis=1)
        cand[a_idx[~le], b_idx[~le]] = False
        compared += len(a_idx) * cols.shape[1]
        c0, width = c0 + block, 4 * width
    a_idx, b_idx = np.nonzero(cand)
    if len(a_idx) == 0:
        return np.zeros(s, dtype=bool), compared
    equal = np.all(matrix[a_idx] == matrix[b_idx], axis=1)
    strict = ~equal | (b_idx < a_idx)
    out = np.zeros(s, dtype=bool)
    out[a_idx[strict]] = True
    return out, compared + len(a_idx) * k


def drop_dominated(problem: Problem) -> tuple[Problem, Step]:
    """Drop strategies dominated in node cost, usage (where it matters) and every edge row."""
    work = _Work(problem)
    matters = memory_matters(problem)
    smaps: list[np.ndarray] = []
    compared = 0
    for i in range(len(problem.nodes)):
        c = work.costs[i]
        s = len(c)
        if s <= 1:
            smaps.append(np.arange(s))
            continue
        cols = [c[:, None]]
        if matters[i]:
            cols.append(work.usages[i][:, None])
        cols.extend(work.table(i, j) for j in sorted(work.adj[i]))
        width = sum(x.shape[1] for x in cols)
        if s * s * width > MAX_DOMINANCE_WORK:
            smaps.append(np.arange(s))
            continue
        matrix = np.hstack(cols)
        np.minimum(matrix, FORBIDDEN, out=matrix)  # forbidden entries compare equal, however they were summed
        dominated, work_done = _dominated(matrix)
        compared += work_done
        keep = np.flatnonzero(~dominated)
        smaps.append(keep)
    for i, keep in enumerate(smaps):
        work.costs[i] = work.costs[i][keep]
        work.usages[i] = work.usages[i][keep]
    for (u, v), t in list(work.edges.items()):
        work.edges[(u, v)] = t[np.ix_(smaps[u], smaps[v])]
    reduced, step = work.build(smaps)
    return reduced, dataclasses.replace(step, compared=compared)


def fold_fixed(problem: Problem) -> tuple[Problem, Step]:
    """Single-strategy nodes hand their edge rows to their neighbours' node costs."""
    work = _Work(problem)
    _fold_fixed(work, memory_matters(problem))
    return work.build()


def _fold_fixed(work: _Work, matters: np.ndarray) -> None:
    for i in range(len(work.costs)):
        if not work.alive[i]:
            continue
        if len(work.costs[i]) != 1 or (not work.adj[i] and matters[i]):
            continue
        if work.ghost[i]:
            continue
        for j in sorted(work.adj[i]):
            t = work.remove_edge(j, i)
            work.costs[j] = work.costs[j] + t[:, 0]
        if matters[i] or work.costs[i][0] >= FORBIDDEN:
            continue  # keeps its memory (now edge-free), or its infeasibility
        work.offset += float(work.costs[i][0])
        work.eliminated.append(Fixed(i, 0))
        work.remove_node(i, None)


def _eliminable(work: _Work, matters: np.ndarray, v: int) -> tuple[bool, float | None]:
    """Can ``v`` go? Returns (ok, usage of the ghost to leave behind or None)."""
    if not matters[v]:
        return True, None
    u = work.usages[v]
    if _constant_usage(u):
        return True, float(u[0])
    return False, None


def fold_followers(problem: Problem) -> tuple[Problem, Step]:
    """Fold ``v`` into ``u`` when ``v``'s strategy is a function of ``u``'s.

    The edge ``(u, v)`` must have exactly one finite entry per row of ``u``
    (``v = f(s_u)``). ``v``'s node cost, the chosen entry and ``v``'s other
    edges (rows re-indexed by ``f``) move onto ``u``.
    """
    work = _Work(problem)
    _fold_followers(work, memory_matters(problem))
    return work.build()


def _fold_followers(work: _Work, matters: np.ndarray) -> None:
    for v in range(len(work.costs)):
        if not work.alive[v] or work.ghost[v] or len(work.costs[v]) <= 1:
            continue
        ok, ghost = _eliminable(work, matters, v)
        if not ok:
            continue
        for u in sorted(work.adj[v]):
            t = work.table(u, v)
            finite = t < FORBIDDEN
            if not np.all(finite.sum(axis=1) == 1):
                continue
            f = np.argmax(finite, axis=1)
            work.remove_edge(u, v)
            work.costs[u] = work.costs[u] + work.costs[v][f] + t[np.arange(len(f)), f]
            for w in sorted(work.adj[v]):
                d = work.remove_edge(v, w)
                work.add_edge(u, w, d[f, :])
            work.eliminated.append(Follow(v, u, f.astype(np.int64)))
            work.remove_node(v, ghost)
            break


def eliminate_low_degree(problem: Problem) -> tuple[Problem, Step]:
    """Eliminate degree-0, -1 and -2 nodes by dynamic programming, to a fixpoint.

    Degree 0: pick the cheapest strategy. Degree 1 (neighbour ``u``):
    ``cost_u[a] += min_b e[a, b] + cost_v[b]``. Degree 2 (neighbours ``u, w``):
    new edge ``T[a, c] = min_b e_uv[a, b] + cost_v[b] + e_vw[b, c]`` (skipped
    when the table would exceed ``MAX_PAIR_TABLE`` entries).
    """
    work = _Work(problem)
    _eliminate_low_degree(work, memory_matters(problem))
    return work.build()


def _eliminate_low_degree(work: _Work, matters: np.ndarray) -> None:
    queue = list(range(len(work.costs)))
    queued = np.ones(len(work.costs), dtype=bool)
    while queue:
        v = queue.pop()
        queued[v] = False
        if not work.alive[v] or work.ghost[v]:
            continue
        if matters[v] and len(work.costs[v]) == 1 and not work.adj[v]:
            continue  # already a ghost
        ok, ghost = _eliminable(work, matters, v)
        if not ok:
            continue
        nbrs = sorted(work.adj[v])
        cv = work.costs[v]
        if len(nbrs) == 0:
            b = int(np.argmin(cv))
            if cv[b] >= FORBIDDEN:
                continue
            work.offset += float(cv[b])
            work.eliminated.append(Fixed(v, b))
        elif len(nbrs) == 1:
            (u,) = nbrs
            t = work.remove_edge(u, v) + cv[None, :]
            f = np.argmin(t, axis=1)
            work.costs[u] = work.costs[u] + t[np.arange(len(f)), f]
            work.eliminated.append(Follow(v, u, f.astype(np.int64)))
        elif len(nbrs) == 2:
            u, w = nbrs
            su, sv, sw = len(work.costs[u]), len(cv), len(work.costs[w])
            if su * sv * sw > MAX_PAIR_TABLE:
                continue
            a = work.table(u, v) + cv[None, :]
            c = work.table(v, w)
            total = a[:, :, None] + c[None, :, :]  # [su, sv, sw]
            f = np.argmin(total, axis=1)
            best = np.take_along_axis(total, f[:, None, :], axis=1)[:, 0, :]
            work.remove_edge(u, v)
            work.remove_edge(v, w)
            work.add_edge(u, w, best)
            work.eliminated.append(Pair(v, u, w, f.astype(np.int64)))
        else:
            continue
        work.remove_node(v, ghost)
        for x in nbrs:
            if not queued[x]:
                queued[x] = True
                queue.append(x)


def fold_and_eliminate(problem: Problem) -> tuple[Problem, Step]:
    """``merge_parallel_edges``, ``fold_fixed``, ``eliminate_low_degree`` and ``fold_followers`` in one pass.

    The same reductions on one working copy, so the problem is converted and
    rebuilt once rather than four times (the cost that counts on large problems).
    """
    work = _Work(problem)
    matters = memory_matters(problem)
    _fold_fixed(work, matters)
    _eliminate_low_degree(work, matters)
    _fold_followers(work, matters)
    return work.build()


def component_labels(n: int, u, v) -> np.ndarray:
    """Per node of ``0..n-1``, its connected component under the pairs ``(u[k], v[k])``.

    Components are numbered in order of their lowest node.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    u, v = np.asarray(u, dtype=np.int64), np.asarray(v, dtype=np.int64)
    graph = coo_matrix((np.ones(len(u)), (u, v)), shape=(n, n))
    return connected_components(graph, directed=False)[1]


def split_components(problem: Problem) -> list[tuple[Problem, np.ndarray]]:
    """Independent sub-problems and, for each, the indices of its nodes in ``problem``.

    Nodes are connected by edges, and by memory: nodes whose usage matters and
    whose intervals overlap share one usage constraint.
    """
    n = len(problem.nodes)
    pairs = [(e.u, e.v) for e in problem.edges]
    matters = memory_matters(problem)
    live = sorted((problem.nodes[i].interval[0], problem.nodes[i].interval[1], i) for i in np.flatnonzero(matters))
    # overlapping intervals: sweep, joining each interval to the one reaching furthest so far
    reach_end, reach_node = -1, -1
    for s, e, i in live:
        if s < reach_end:
            pairs.append((reach_node, i))
        if e > reach_end:
            reach_end, reach_node = e, i
    roots = component_labels(n, [a for a, _ in pairs], [b for _, b in pairs])
    out = []
    for r in np.unique(roots):
        idx = np.flatnonzero(roots == r)
        index = {int(old): k for k, old in enumerate(idx)}
        nodes = tuple(problem.nodes[i] for i in idx)
        edges = tuple(Edge(index[e.u], index[e.v], e.costs) for e in problem.edges if e.u in index)
        pins = tuple(type(p)(index[p.node], p.allowed, p.label) for p in problem.pins if p.node in index)
        out.append((Problem(nodes, edges, problem.usage_limit, pins, problem.name), idx))
    return out


# -- the driver --------------------------------------------------------------------


REDUCTIONS: tuple[Callable[[Problem], tuple[Problem, Step]], ...] = (
    fold_and_eliminate,  # merge_parallel_edges, fold_fixed, eliminate_low_degree, fold_followers
    drop_dominated,
)


def _size(problem: Problem) -> tuple[int, int, int]:
    decisions = sum(1 for n in problem.nodes if n.num_strategies > 1)
    return decisions, len(problem.edges), problem.num_strategies


@dataclass(frozen=True, slots=True, eq=False)
class Reduced:
    """The reduced problem and the steps that lift its assignments back."""

    original: Problem
    problem: Problem
    steps: tuple[Step, ...]
    stats: dict = field(default_factory=dict)

    @property
    def offset(self) -> float:
        return float(sum(s.offset for s in self.steps))

    def lift(self, solution: Solution | np.ndarray | tuple[int, ...]) -> tuple[int, ...]:
        """Assignment of the original problem from one of the reduced problem."""
        assignment = solution.assignment if isinstance(solution, Solution) else solution
        x = np.asarray(assignment, dtype=np.int64)
        for step in reversed(self.steps):
            x = step.lift(x)
        return tuple(int(s) for s in x)

    def origins(self) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """For each node of the reduced problem: its original node, and its strategies' original indices."""
        node = np.arange(len(self.problem.nodes), dtype=np.int64)
        smaps = [np.arange(n.num_strategies, dtype=np.int64) for n in self.problem.nodes]
        for step in reversed(self.steps):
            smaps = [step.strategy_maps[j][s] for j, s in zip(node, smaps)]
            node = step.node_map[node]
        return node, tuple(smaps)

    def project(self, assignment: Sequence[int]) -> np.ndarray:
        """The reduced problem's assignment closest to ``assignment`` (one of the original problem): each
        surviving node takes the strategy it had, -1 where the reductions dropped that strategy (a
        dominated or restricted one). Nodes with one strategy left take it."""
        x = np.asarray(assignment, dtype=np.int64)
        node, smaps = self.origins()
        out = np.full(len(smaps), -1, dtype=np.int64)
        for j, (i, smap) in enumerate(zip(node.tolist(), smaps)):
            hit = np.flatnonzero(smap == x[i]) if len(smap) > 1 else np.zeros(1, dtype=np.int64)
            if len(hit):
                out[j] = hit[0]
        return out


def reduce(problem: Problem, max_rounds: int = 20, min_gain: float = 0.01) -> Reduced:
    """Apply every reduction to a fixpoint (or until a round shrinks the problem by less than ``min_gain``).

    Above ``LARGE_PROBLEM`` nodes: ``restrict`` and one ``fold_and_eliminate``
    pass only (on IOPDDL K, P and S the dominance test and a second
    ``restrict`` cost seconds each and remove almost nothing).

    ``stats`` reports nodes (with more than one strategy), edges and strategies
    before and after, the number of ghosts, and the work as a deterministic
    charge in seconds (``reduce_deterministic_s``). Raises ``InfeasibleError`` when
    the hard constraints alone leave a node without strategies.
    """
    large = len(problem.nodes) > LARGE_PROBLEM
    if large:
        max_rounds = 1
    steps: list[Step] = []
    current, step = restrict(problem)
    steps.append(step)
    before = _size(problem)
    rounds = 0
    for _ in range(max_rounds):
        rounds += 1
        size = _size(current)
        for reduction in REDUCTIONS[:1] if large else REDUCTIONS:
            current, step = reduction(current)
            steps.append(step)
        if large:
            break
        current, step = restrict(current)
        steps.append(step)
        new = _size(current)
        if sum(new) == sum(size) or sum(size) - sum(new) < min_gain * sum(size):
            break
    after = _size(current)
    compared = sum(step.compared for step in steps)
    work = ((LARGE_ITEM_CHARGE if large else ITEM_CHARGE) * rounds * (len(problem.nodes) + len(problem.edges))
            + ENTRY_CHARGE * sum(e.costs.size for e in problem.edges) + COMPARE_CHARGE * compared)
    stats = {
        "nodes_before": len(problem.nodes),
        "edges_before": len(problem.edges),
        "strategies_before": before[2],
        "decisions_after": after[0],
        "nodes_after": len(current.nodes),
        "edges_after": after[1],
        "strategies_after": after[2],
        "ghosts": sum(1 for n in current.nodes if n.num_strategies == 1),
        "reduce_rounds": rounds,
        "dominance_compared": compared,
        "reduce_deterministic_s": round(work, 6),
    }
    return Reduced(problem, current, tuple(steps), stats)
