r"""Least memory among equal costs: a solution moved to strategies that cost exactly as much and use less.

A solver minimises step time; where several strategies of a node cost the
same given its neighbours (a broadcast of zeros made whole or already split,
an operation whose operands arrive either way at no cost), which one it
returns is an accident of the search, and the memory of the plan with it. A
*polish* keeps the solution's cost and moves such nodes to their least-usage
equal-cost strategy, so a plan holds no buffer larger than its time needs.

Units: nodes joined by identity edges (square tables finite only on the
diagonal, as the builder joins an operation to the node holding its operand
layouts) take one strategy index together; every other node is a unit alone.
A round, vectorised over all units::

    ext[i, s]   = c_i[s] + sum_{edges (i, j) leaving i's unit} C_ij[s, x_j]
    cost[u, s]  = sum_{i in u} ext[i, s] + sum_{edges inside u} C[s, s]
    eligible    = cost[u, s] <= cost[u, x_u]  and  usage_i[s] <= usage_i[x_u] for every member
    target[u]   = the eligible s of least summed usage, where it is below the current one

Movers joined by an edge keep the one of the lower index, so that every
move's cost change is the one computed. Usages never rise, so the peak never
does and a solution within a memory limit stays within it; the cost never
rises (but by floating-point rounding, ``ROUNDING``). Each round is a few
array passes over every strategy and table row, with no Python loop per
node, and nothing depends on the clock.
"""

from __future__ import annotations

import numpy as np

from shardsolve.encodings.flat import edge_reads
from shardsolve.problem import FORBIDDEN, Problem

__all__ = ["polish_usage", "MAX_ROUNDS", "ROUNDING"]

#: Rounds at most (each moves a set of non-adjacent units; most problems settle in a few).
MAX_ROUNDS = 32
#: The cost summed again over the whole problem may differ from the moves' own sums by rounding: this much of it.
ROUNDING = 1e-12


def _identity(table: np.ndarray) -> bool:
    """Whether an edge table is finite exactly on its diagonal (the two nodes take one index)."""
    if table.ndim != 2 or table.shape[0] != table.shape[1]:
        return False
    finite = table < FORBIDDEN
    return bool(np.array_equal(finite, np.eye(len(table), dtype=bool)))


def _units(problem: Problem) -> np.ndarray:
    """The unit of every node: union-find over identity edges."""
    parent = np.arange(len(problem.nodes))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return int(i)

    identity: dict[int, tuple[np.ndarray, bool]] = {}  # tables are shared between edges: each looked at once
    for e in problem.edges:
        seen = identity.get(id(e.costs))
        if seen is None or seen[0] is not e.costs:
            seen = identity[id(e.costs)] = (e.costs, _identity(np.asarray(e.costs)))
        if seen[1]:
            a, b = find(e.u), find(e.v)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return np.array([find(i) for i in range(len(parent))], dtype=np.int64)


def polish_usage(problem: Problem, assignment) -> tuple[tuple[int, ...], int]:
    """``assignment`` with units moved to least-usage strategies of equal cost; and how many units moved.

    The returned assignment costs at most as much (``problem.evaluate``) and
    no node uses more than before; where floating point says otherwise, the
    assignment comes back unchanged.
    """
    n = len(problem.nodes)
    x = np.array(assignment, dtype=np.int64)
    if n == 0 or len(x) != n:
        return tuple(int(s) for s in x), 0
    sizes = np.array([len(node.costs) for node in problem.nodes], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    costs = np.concatenate([np.minimum(np.asarray(node.costs, np.float64), FORBIDDEN) for node in problem.nodes])
    usages = np.concatenate([np.asarray(node.usages, np.float64) for node in problem.nodes])
    slot_node = np.repeat(np.arange(n), sizes)
    slot_index = np.arange(len(costs)) - offsets[slot_node]
    for pin in problem.pins:  # a pinned node keeps to its allowed strategies
        barred = np.ones(sizes[pin.node], dtype=bool)
        barred[list(pin.allowed)] = False
        costs[offsets[pin.node] + np.flatnonzero(barred)] = FORBIDDEN

    unit = _units(problem)
    # Units whose members differ in strategy count cannot share an index (never so from identity edges).
    roots, unit_id = np.unique(unit, return_inverse=True)
    usize = sizes[roots]
    if np.any(sizes != usize[unit_id]):
        return tuple(int(s) for s in x), 0
    uoff = np.concatenate([[0], np.cumsum(usize)[:-1]]).astype(np.int64)
    slot_unit = uoff[unit_id[slot_node]] + slot_index  # a member's strategy -> its unit's strategy

    eu = np.array([e.u for e in problem.edges], dtype=np.int64)
    ev = np.array([e.v for e in problem.edges], dtype=np.int64)
    tables = [np.asarray(e.costs, np.float64) for e in problem.edges]
    inside = unit_id[eu] == unit_id[ev] if len(eu) else np.zeros(0, dtype=bool)
    # Inside a unit an edge is read on its diagonal: cost[u, s] gets C[s, s].
    diag_slot, diag_cost = [], []
    for e in np.flatnonzero(inside):
        t = tables[e]
        k = min(t.shape)
        diag_slot.append(uoff[unit_id[eu[e]]] + np.arange(k))
        diag_cost.append(np.diagonal(t)[:k])
    n_uslots = int(usize.sum())
    internal = np.zeros(n_uslots)
    if diag_slot:
        internal = np.bincount(np.concatenate(diag_slot), weights=np.concatenate(diag_cost), minlength=n_uslots)
    # Edges leaving a unit: row a of u's side reads T[a, x_v]; column b of v's side reads T[x_u, b] (``edge_reads``).
    out = np.flatnonzero(~inside)
    leaving = edge_reads(eu, ev, sizes, offsets, tables, out, copy=False)
    out_uu, out_uv = unit_id[eu[out]], unit_id[ev[out]]
    uusage = np.bincount(slot_unit, weights=usages, minlength=n_uslots)
    slot_owner = np.repeat(np.arange(len(roots)), usize)

    before_cost, before_usage = problem.evaluate(tuple(int(s) for s in x)), usages[offsets + x]
    moved_units = 0
    for _ in range(MAX_ROUNDS):
        ext = leaving.add(costs.copy(), x)
        ucost = np.bincount(slot_unit, weights=ext, minlength=n_uslots) + internal
        current_usage = usages[offsets[slot_node] + x[slot_node]]  # each slot's member, as it is now
        rising = np.bincount(slot_unit, weights=(usages > current_usage).astype(np.float64), minlength=n_uslots)
        cur_slot = uoff + x[roots]
        eligible = (ucost <= ucost[cur_slot][slot_owner]) & (rising == 0) & (uusage < uusage[cur_slot][slot_owner])
        eligible &= ucost < FORBIDDEN
        if not eligible.any():
            break
        # per unit, the eligible strategy of least usage (then least cost, then lowest index)
        cand = np.flatnonzero(eligible)
        order = np.lexsort((cand, ucost[cand], uusage[cand], slot_owner[cand]))
        cand = cand[order]
        first = np.concatenate([[True], slot_owner[cand][1:] != slot_owner[cand][:-1]])
        best = cand[first]
        mover = np.zeros(len(roots), dtype=bool)
        target = np.zeros(len(roots), dtype=np.int64)
        mover[slot_owner[best]] = True
        target[slot_owner[best]] = best - uoff[slot_owner[best]]
        clash = mover[out_uu] & mover[out_uv]
        if clash.any():  # two movers joined by an edge: the higher index waits for the next round
            mover[np.maximum(out_uu[clash], out_uv[clash])] = False
        moving = mover[unit_id]
        x = np.where(moving, target[unit_id], x)
        moved_units += int(mover.sum())
    after = tuple(int(s) for s in x)
    worse = problem.evaluate(after) > before_cost + ROUNDING * abs(before_cost)
    if moved_units and (worse or np.any(usages[offsets + x] > before_usage)):
        return tuple(int(s) for s in assignment), 0
    return after, moved_units
