r"""The array form of a (reduced) strategy-selection problem, which every solver reads.

A :class:`Flat` holds, per node, numpy arrays of costs and usages (``inf``
marks a forbidden choice), one cost table per edge, adjacency lists, and the
memory constraint compressed to the time *segments* where it can bind::

    sum_{i live in segment t} usage_i[s_i]  <=  capacity[t] = limit - base[t]

``base`` collects each live node's least usage, so usages are measured above
it, and ``binding`` keeps only the segments whose constraint is not implied
by a neighbour's (``flatten``). Three derived forms serve the searches:

=================  ==========================================================
``subproblem``     the nodes of a neighbourhood with every other node held:
                   edges to held nodes become node costs, capacities lose
                   the held nodes' usage
``prune``          strategies that cannot be part of a feasible assignment
                   removed (forbidden, arc-inconsistent, too big anywhere)
``softened``       forbidden edge entries at a finite penalty above any
                   feasible cost (memory stays hard)
=================  ==========================================================

Worked example: nodes ``a`` and ``b`` live over ``[0, 2)`` and ``[1, 3)``,
each with usages ``[4, 1]``, limit 5. The time points 0, 1, 2, 3 give
segments 0, 1, 2; the least usages fill ``base = [1, 2, 1]``, so
``capacity = [4, 3, 4]`` for the usages above the minimum ``[3, 0]``.
Segments 0 and 2 hold one node each (at most 3 above the minimum, within
4): only segment 1 can bind, and ``binding == (1,)``: ``a`` and ``b`` may
not both take strategy 0.

``evaluate`` is the cost in these arrays (``inf`` when forbidden or over the
limit); it equals ``Problem.evaluate`` of the reduced problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardsolve.problem import FORBIDDEN, Problem

__all__ = ["Flat", "EdgeReads", "edge_reads", "flatten", "evaluate", "profile", "interval_sums", "evaluation_charge", "tolerance", "subproblem", "prune", "softened", "CHARGE_PER_ITEM",
           "CHARGE_PER_TABLE_ENTRY", "sweep_charge"]

INF = math.inf
#: Deterministic charge (seconds) per node or edge visited by one Python pass (ICM sweep, evaluation).
CHARGE_PER_ITEM = 1.5e-5
#: ... and per edge-table entry that a pass of table work reads (a TRW-S message, a diffusion update): 0.5 to
#: 2.5 ns measured on planner problems with 0.2M to 17M entries (a three-axis mesh's tables hold a hundred
#: or more strategies a side, where the entries cost more than the nodes and edges).
CHARGE_PER_TABLE_ENTRY = 1.5e-9


def sweep_charge(flat: "Flat") -> float:
    """Deterministic charge (seconds) of one pass over ``flat``'s nodes, edges and table entries."""
    return CHARGE_PER_ITEM * (flat.n + len(flat.tables)) + CHARGE_PER_TABLE_ENTRY * sum(t.size for t in flat.tables)


@dataclass(frozen=True, slots=True, eq=False)
class Flat:
    """Array view of a Problem for the solvers (costs in the problem's units)."""

    costs: tuple[np.ndarray, ...]  # [S_i], inf = forbidden
    usages: tuple[np.ndarray, ...]  # [S_i]
    eu: np.ndarray  # [E] first node of each edge
    ev: np.ndarray  # [E]
    tables: tuple[np.ndarray, ...]  # [S_u, S_v], inf = forbidden
    adj: tuple[tuple[tuple[int, int, bool], ...], ...]  # per node: (edge, other node, node is the edge's u)
    limit: float | None
    seg_start: np.ndarray  # [N] first memory segment of each node (variable-usage nodes only)
    seg_end: np.ndarray  # [N] one past the last segment; == seg_start when the node uses no segment
    capacity: np.ndarray  # [T] limit - base usage, per segment
    binding: tuple[int, ...]  # segments whose constraint is not implied by another's

    @property
    def n(self) -> int:
        return len(self.costs)

    def table(self, e: int, is_u: bool) -> np.ndarray:
        """Edge ``e`` oriented with this node's strategies as rows."""
        return self.tables[e] if is_u else self.tables[e].T

    def live(self, t: int) -> np.ndarray:
        return np.flatnonzero((self.seg_start <= t) & (self.seg_end > t))


@dataclass(frozen=True, slots=True, eq=False)
class EdgeReads:
    """Index arrays that read edge tables at the neighbours' strategies (see ``edge_reads``)."""

    table: np.ndarray  # every edge's table, raveled and concatenated in edge order (empty with ``own``)
    start: np.ndarray  # where each edge's table starts in ``table`` (zeros with ``own``)
    u_target: np.ndarray  # u side: entry (edge k, row a) adds table_k[a, x_v] to strategy slot u_target
    u_base: np.ndarray
    u_other: np.ndarray
    v_target: np.ndarray  # v side: entry (edge k, column b) adds table_k[x_u, b] to strategy slot v_target
    v_base: np.ndarray
    v_other: np.ndarray
    v_stride: np.ndarray
    # Without ``table``: the read edges' own tables and their ends, read a column and a row each per ``add``.
    own: tuple | None = None

    def add(self, out: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``out`` (one entry per strategy slot) plus every read edge's entries towards the strategies ``x``."""
        if not len(self.u_target):
            return out
        if self.own is None:
            u_side = self.table[self.u_base + x[self.u_other]]
            v_side = self.table[self.v_base + x[self.v_other] * self.v_stride]
        else:  # the same entries, in the same order
            tables, us, vs = self.own
            u_side = np.concatenate([t[:, xv] for t, xv in zip(tables, x[vs].tolist())])
            v_side = np.concatenate([t[xu, :] for t, xu in zip(tables, x[us].tolist())])
        out += np.bincount(self.u_target, u_side, minlength=len(out))
        out += np.bincount(self.v_target, v_side, minlength=len(out))
        return out


def edge_reads(eu: np.ndarray, ev: np.ndarray, sizes: np.ndarray, offsets: np.ndarray,
               tables, edges: np.ndarray | None = None, copy: bool = True) -> EdgeReads:
    """The reads of the edges ``edges`` (all where None) of a problem whose node ``i`` has ``sizes[i]``
    strategies in slots from ``offsets[i]``: two ``bincount`` calls then give every strategy's edge cost
    towards its neighbours' current strategies (``EdgeReads.add``).

    With ``copy`` the tables are copied into one flat array, read by index arrays (for callers that read
    them many times, and at entries of their own: ``EdgeReads.table``); without, each ``add`` reads a
    column and a row of each edge's own table (a planner's problem on a three-axis mesh holds 10^8 or
    more entries, and copying them took seconds of a call that reads them a few times)."""
    eu, ev = eu.astype(np.int64), ev.astype(np.int64)
    su, sv = sizes[eu], sizes[ev]
    edges = np.arange(len(eu)) if edges is None else edges
    if copy:
        toff = np.concatenate([[0], np.cumsum(su * sv)[:-1]]).astype(np.int64)
        table = np.concatenate([t.ravel() for t in tables]) if len(tables) else np.zeros(0)
    else:
        toff, table = np.zeros(len(eu), dtype=np.int64), np.zeros(0)
    if not len(edges):
        none = np.zeros(0, dtype=np.int64)
        return EdgeReads(table, toff, none, none, none, none, none, none, none)
    k_u = np.repeat(edges, su[edges])
    a = np.arange(len(k_u)) - np.repeat(np.concatenate([[0], np.cumsum(su[edges])[:-1]]), su[edges])
    k_v = np.repeat(edges, sv[edges])
    b = np.arange(len(k_v)) - np.repeat(np.concatenate([[0], np.cumsum(sv[edges])[:-1]]), sv[edges])
    own = None if copy else (tuple(np.asarray(tables[k]) for k in edges.tolist()), eu[edges], ev[edges])
    return EdgeReads(table, toff, offsets[eu][k_u] + a, toff[k_u] + a * sv[k_u], ev[k_u],
                     offsets[ev][k_v] + b, toff[k_v] + b, eu[k_v], sv[k_v], own)


def _finite(costs: np.ndarray) -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64)
    return np.where(c >= FORBIDDEN, INF, c)


def flatten(problem: Problem) -> Flat:
    """The array view, with the memory constraint on compressed, non-implied segments."""
    n = len(problem.nodes)
    costs = tuple(_finite(node.costs) for node in problem.nodes)
    usages = tuple(np.asarray(node.usages, dtype=np.float64) for node in problem.nodes)
    eu = np.array([e.u for e in problem.edges], dtype=np.int64)
    ev = np.array([e.v for e in problem.edges], dtype=np.int64)
    tables = tuple(_finite(e.costs) for e in problem.edges)
    adj: list[list[tuple[int, int, bool]]] = [[] for _ in range(n)]
    for k, e in enumerate(problem.edges):
        adj[e.u].append((k, e.v, True))
        adj[e.v].append((k, e.u, False))
    limit = problem.usage_limit
    starts = np.array([node.interval[0] for node in problem.nodes], dtype=np.int64)
    ends = np.array([node.interval[1] for node in problem.nodes], dtype=np.int64)
    live = ends > starts
    if limit is None or not live.any():
        zero = np.zeros(n, dtype=np.int64)
        return Flat(costs, usages, eu, ev, tables, tuple(tuple(a) for a in adj), limit, zero, zero, np.zeros(0), ())
    times = np.unique(np.concatenate([starts[live], ends[live]]))
    seg_s = np.searchsorted(times, starts)
    seg_e = np.searchsorted(times, ends)
    seg_s[~live] = 0
    seg_e[~live] = 0
    horizon = len(times) - 1
    umin = np.array([u.min() if len(u) else 0.0 for u in usages])
    umax = np.array([u.max() if len(u) else 0.0 for u in usages])
    variable = live & (umax > umin)
    base_delta = np.zeros(horizon + 1)
    np.add.at(base_delta, seg_s[live], umin[live])
    np.add.at(base_delta, seg_e[live], -umin[live])
    base = np.cumsum(base_delta)[:horizon]
    capacity = limit - base  # room for the usage above each node's minimum
    slack_delta = np.zeros(horizon + 1)
    np.add.at(slack_delta, seg_s[variable], (umax - umin)[variable])
    np.add.at(slack_delta, seg_e[variable], -(umax - umin)[variable])
    worst = np.cumsum(slack_delta)[:horizon]
    seg_s = np.where(variable, seg_s, 0)
    seg_e = np.where(variable, seg_e, 0)
    binding = _binding_segments(seg_s, seg_e, variable, capacity, worst)
    # usages become "above the minimum" so that capacity is what remains for them
    usages = tuple(u - m if v else np.zeros_like(u) for u, m, v in zip(usages, umin, variable))
    return Flat(costs, usages, eu, ev, tables, tuple(tuple(a) for a in adj), limit, seg_s, seg_e, capacity, binding)


def _binding_segments(seg_s, seg_e, variable, capacity, worst) -> tuple[int, ...]:
    """Segments whose constraint can bind and is not implied by a neighbour's.

    Segment ``t`` is implied by ``t+1`` when no variable node ends at the
    boundary between them (live set of ``t`` within that of ``t+1``) and its
    capacity is no smaller; symmetrically for ``t-1``. Chains of implications
    leave their last member; ties keep the earliest.
    """
    horizon = len(capacity)
    if horizon == 0:
        return ()
    ends_at = np.zeros(horizon + 1, dtype=np.int64)
    np.add.at(ends_at, seg_e[variable], 1)
    starts_at = np.zeros(horizon + 1, dtype=np.int64)
    np.add.at(starts_at, seg_s[variable], 1)
    keep = worst > capacity * (1 + 1e-12) + 1e-9
    t = np.arange(horizon)
    # implied by the next segment: nothing ends at boundary t+1, capacity(t) >= capacity(t+1)
    nxt = np.zeros(horizon, dtype=bool)
    nxt[:-1] = (ends_at[1:horizon] == 0) & (capacity[:-1] >= capacity[1:])
    # implied by the previous one: nothing starts at boundary t, capacity(t) > capacity(t-1) (strict: ties kept once)
    prv = np.zeros(horizon, dtype=bool)
    prv[1:] = (starts_at[1:horizon] == 0) & (capacity[1:] > capacity[:-1])
    keep &= ~nxt & ~prv
    # identical neighbours (both directions, equal capacity): keep the first of the run
    return tuple(int(x) for x in t[keep])


# -- evaluation and memory ----------------------------------------------------------


def evaluate(flat: Flat, x: np.ndarray) -> float:
    """Cost of ``x`` (``inf`` if forbidden or over the memory limit)."""
    total = float(sum(c[s] for c, s in zip(flat.costs, x)))
    for k, t in enumerate(flat.tables):
        total += float(t[x[flat.eu[k]], x[flat.ev[k]]])
    if not math.isfinite(total):
        return INF
    if len(flat.capacity) and np.any(profile(flat, x) > flat.capacity + 1e-9 * np.abs(flat.capacity).max()):
        return INF
    return total


def profile(flat: Flat, x: np.ndarray) -> np.ndarray:
    horizon = len(flat.capacity)
    delta = np.zeros(horizon + 1)
    use = np.array([u[s] for u, s in zip(flat.usages, x)])
    np.add.at(delta, flat.seg_start, use)
    np.add.at(delta, flat.seg_end, -use)
    return np.cumsum(delta)[:horizon]


def interval_sums(flat: Flat, per_segment: np.ndarray, segments: np.ndarray | None = None) -> np.ndarray:
    """Per node, the sum of ``per_segment`` over the segments its interval covers (``per_segment`` given for
    every segment, or for the segments ``segments`` only, the others zero): a price per byte on each node."""
    at = np.zeros(len(flat.capacity) + 1)
    if segments is None:
        at[:len(per_segment)] = per_segment
    else:
        at[np.asarray(segments, dtype=np.int64)] = per_segment
    cum = np.concatenate([[0.0], np.cumsum(at)])
    return cum[flat.seg_end] - cum[flat.seg_start]


def evaluation_charge(flat: Flat) -> float:
    """Deterministic charge (seconds) of one ``evaluate`` (35 ms measured on IOPDDL S)."""
    return 0.05 * CHARGE_PER_ITEM * (flat.n + len(flat.tables))


def tolerance(flat: Flat) -> float:
    """Slack allowed on a memory comparison: a part in 1e9 of the largest capacity."""
    return 1e-9 * float(np.abs(flat.capacity).max()) if len(flat.capacity) else 0.0


# -- derived forms for the searches ------------------------------------------------------------


def subproblem(flat: Flat, free: np.ndarray, x: np.ndarray, prof: np.ndarray | None = None) -> Flat:
    """The problem over the nodes ``free`` with every other node held at ``x``.

    Edges to held nodes become node costs; memory capacities lose the held
    nodes' usage (``prof`` is ``profile(flat, x)`` when the caller keeps it).
    Segments implied in ``flat`` stay implied, so ``binding`` is a subset.
    """
    free = np.asarray(free, dtype=np.int64)
    index = np.full(flat.n, -1, dtype=np.int64)
    index[free] = np.arange(len(free))
    costs = []
    sub_edges: list[tuple[int, int, int]] = []
    for k, i in enumerate(free):
        c = flat.costs[i].copy()
        for e, j, is_u in flat.adj[i]:
            if index[j] < 0:
                c += flat.tables[e][:, x[j]] if is_u else flat.tables[e][x[j], :]
            elif is_u:
                sub_edges.append((e, k, int(index[j])))
        costs.append(c)
    eu = np.array([a for _, a, _ in sub_edges], dtype=np.int64)
    ev = np.array([b for _, _, b in sub_edges], dtype=np.int64)
    tables = tuple(flat.tables[e] for e, _, _ in sub_edges)
    adj: list[list[tuple[int, int, bool]]] = [[] for _ in free]
    for k, (_, a, b) in enumerate(sub_edges):
        adj[a].append((k, b, True))
        adj[b].append((k, a, False))
    seg_s, seg_e = flat.seg_start[free], flat.seg_end[free]
    if len(flat.capacity):
        if prof is None:
            prof = profile(flat, x)
        delta = np.zeros(len(flat.capacity) + 1)
        use = np.array([flat.usages[i][x[i]] for i in free])
        np.add.at(delta, seg_s, use)
        np.add.at(delta, seg_e, -use)
        held = prof - np.cumsum(delta)[:-1]
        capacity = flat.capacity - held
        touched = np.zeros(len(flat.capacity) + 1, dtype=np.int64)
        np.add.at(touched, seg_s, 1)
        np.add.at(touched, seg_e, -1)
        live_count = np.cumsum(touched)[:-1]
        # a segment binds only if the free nodes' largest usages can exceed what the held ones leave
        top = np.array([float(flat.usages[i].max()) if len(flat.usages[i]) else 0.0 for i in free])
        wdelta = np.zeros(len(flat.capacity) + 1)
        np.add.at(wdelta, seg_s, top)
        np.add.at(wdelta, seg_e, -top)
        worst = np.cumsum(wdelta)[:-1]
        tb = np.asarray(flat.binding, dtype=np.int64)
        cand = tb[(live_count[tb] > 0) & (worst[tb] > capacity[tb] + tolerance(flat))] if len(tb) else tb
        if len(cand):
            # the live set of free nodes only changes at their boundaries: one
            # constraint per region between boundaries, the tightest one
            bounds_ = np.unique(np.concatenate([seg_s, seg_e]))
            region = np.searchsorted(bounds_, cand, side="right")
            order = np.lexsort((capacity[cand], region))
            first = np.ones(len(order), dtype=bool)
            first[1:] = region[order][1:] != region[order][:-1]
            binding = tuple(int(t) for t in np.sort(cand[order][first]))
        else:
            binding = ()
    else:
        capacity, binding = flat.capacity, ()
    return Flat(tuple(costs), tuple(flat.usages[i] for i in free), eu, ev, tables,
                tuple(tuple(a) for a in adj), flat.limit, seg_s, seg_e, capacity, binding)



def prune(flat: Flat) -> tuple[Flat, tuple[np.ndarray, ...]]:
    """Drop strategies that cannot be part of a feasible assignment; returns the kept indices per node.

    Forbidden node costs, rows of an edge with no finite entry towards the
    other node's remaining strategies (to a fixpoint), and usages above the
    capacity anywhere in the node's interval go.
    """
    keep = [np.isfinite(c) for c in flat.costs]
    if len(flat.capacity):
        for i in range(flat.n):
            s0, s1 = flat.seg_start[i], flat.seg_end[i]
            if s1 > s0:
                keep[i] &= flat.usages[i] <= float(flat.capacity[s0:s1].min()) + tolerance(flat)
    finite = [np.isfinite(t) for t in flat.tables]
    changed = True
    while changed:
        changed = False
        for k, fin in enumerate(finite):
            u, v = int(flat.eu[k]), int(flat.ev[k])
            sub = fin & keep[u][:, None] & keep[v][None, :]
            ku, kv = sub.any(axis=1) & keep[u], sub.any(axis=0) & keep[v]
            if ku.sum() != keep[u].sum() or kv.sum() != keep[v].sum():
                keep[u], keep[v] = ku, kv
                changed = True
    if any(not k.any() for k in keep):
        keep = [np.ones(len(c), dtype=bool) for c in flat.costs]  # infeasible: leave it to the solver to say so
    maps = tuple(np.flatnonzero(k) for k in keep)
    costs = tuple(c[m] for c, m in zip(flat.costs, maps))
    usages = tuple(u[m] for u, m in zip(flat.usages, maps))
    tables = tuple(t[np.ix_(maps[int(flat.eu[k])], maps[int(flat.ev[k])])] for k, t in enumerate(flat.tables))
    pruned = Flat(costs, usages, flat.eu, flat.ev, tables, flat.adj, flat.limit, flat.seg_start, flat.seg_end,
                  flat.capacity, flat.binding)
    return pruned, maps


def softened(flat: Flat) -> tuple[Flat, float]:
    """``flat`` with forbidden edge entries at a finite penalty ``M`` above any feasible cost.

    Any assignment with cost below ``M`` in the softened problem is feasible
    (memory stays a hard constraint), so a search started from an assignment
    that breaks forbidden pairs (e.g. ``least_usage``) can stop once under ``M``.
    """
    top = 0.0
    for c in flat.costs:
        f = c[np.isfinite(c)]
        top += float(f.max()) if len(f) else 0.0
    for t in flat.tables:
        f = t[np.isfinite(t)]
        top += float(f.max()) if len(f) else 0.0
    penalty = 2.0 * top + 1.0
    tables = tuple(np.where(np.isfinite(t), t, penalty) for t in flat.tables)
    soft = Flat(flat.costs, flat.usages, flat.eu, flat.ev, tables, flat.adj, flat.limit, flat.seg_start,
                flat.seg_end, flat.capacity, flat.binding)
    return soft, penalty
