"""Fast warm starts for the strategy-selection problem, respecting memory.

The solvers work on the array form of a (reduced) ``Problem``
(:class:`~shardsolve.encodings.flat.Flat`): numpy arrays per node (``inf``
marks a forbidden choice), one table per edge, and the memory constraint
compressed to the time segments where it can bind::

    sum_{i live in segment t} usage_i[s_i]  <=  limit - base[t]

(``base`` collects nodes with a single usage). ``warm_start`` combines:

1. a memory-safe start: every node at its least usage (the only assignment
   certain to be feasible when memory is tight), then
2. Lagrangian rounds: penalise usage with per-segment multipliers
   ``lambda_t``, so node ``i`` pays ``usage_i[s] * sum_{t in i} lambda_t``,
   and solve the penalised pairwise problem by exact dynamic programming on
   induced forests (every other node held fixed, a block coordinate descent);
   multipliers rise on segments over the limit (subgradient steps),
3. repair (lower the usage of live nodes at over-full segments at the least
   cost per byte) and iterated conditional modes (ICM: each node moves to its
   best strategy given its neighbours, only if memory stays within the limit).

Everything is deterministic: iteration counts, never wall-clock time, bound
the work.
"""


from __future__ import annotations

import math

import numpy as np

from shardsolve.encodings.flat import INF, Flat, evaluate, profile, tolerance

__all__ = ["icm", "repair", "forest_descent", "warm_start", "least_usage"]


# -- local search ----------------------------------------------------------------------


def _local_costs(flat: Flat, x: np.ndarray, i: int) -> np.ndarray:
    c = flat.costs[i].copy()
    for e, j, is_u in flat.adj[i]:
        c += flat.tables[e][:, x[j]] if is_u else flat.tables[e][x[j], :]
    return c


def icm(flat: Flat, x: np.ndarray, sweeps: int = 10) -> np.ndarray:
    """Iterated conditional modes keeping memory within the limit (``x`` must be feasible)."""
    x = x.copy()
    prof = profile(flat, x) if len(flat.capacity) else np.zeros(0)
    tol = tolerance(flat)
    order = np.arange(flat.n)
    for _ in range(sweeps):
        moved = 0
        for i in order:
            if len(flat.costs[i]) <= 1:
                continue
            c = _local_costs(flat, x, i)
            cur = x[i]
            s0, s1 = flat.seg_start[i], flat.seg_end[i]
            if s1 > s0:
                room = float(np.min(flat.capacity[s0:s1] - prof[s0:s1])) + flat.usages[i][cur]
                c = np.where(flat.usages[i] <= room + tol, c, INF)
            best = int(np.argmin(c))
            if c[best] < c[cur] - 1e-12 * max(1.0, abs(c[cur])):
                if s1 > s0:
                    prof[s0:s1] += flat.usages[i][best] - flat.usages[i][cur]
                x[i] = best
                moved += 1
        if moved == 0:
            break
    return x


def repair(flat: Flat, x: np.ndarray, rounds: int = 10_000) -> np.ndarray:
    """Lower usage at over-full segments, cheapest cost per byte first, until memory fits."""
    x = x.copy()
    if not len(flat.capacity):
        return x
    prof = profile(flat, x)
    tol = tolerance(flat)
    for _ in range(rounds):
        over = prof - flat.capacity
        t = int(np.argmax(over))
        if over[t] <= tol:
            break
        best = None
        for i in flat.live(t):
            u = flat.usages[i]
            saving = u[x[i]] - u
            ok = saving > 0
            if not ok.any():
                continue
            c = _local_costs(flat, x, i)
            extra = c - c[x[i]]
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                ratio = np.where(ok & np.isfinite(c), np.maximum(extra, 0) / np.minimum(saving, over[t]).clip(min=1e-300), INF)
            s = int(np.argmin(ratio))
            if math.isfinite(ratio[s]) and (best is None or ratio[s] < best[0]):
                best = (ratio[s], i, s)
        if best is None:
            break
        _, i, s = best
        prof[flat.seg_start[i]:flat.seg_end[i]] += flat.usages[i][s] - flat.usages[i][x[i]]
        x[i] = s
    return x


# -- forest dynamic programming -----------------------------------------------------------


def _forest(flat: Flat, rng: np.random.Generator) -> tuple[np.ndarray, list[list[tuple[int, int, bool]]]]:
    """A random induced forest: nodes added in random order when they join at most one tree once each."""
    n = flat.n
    parent_of = list(range(n))

    def find(a: int) -> int:
        while parent_of[a] != a:
            parent_of[a] = parent_of[parent_of[a]]
            a = parent_of[a]
        return a

    in_forest = np.zeros(n, dtype=bool)
    for i in rng.permutation(n):
        roots = [find(j) for _, j, _ in flat.adj[i] if in_forest[j]]
        if len(roots) != len(set(roots)):
            continue  # two edges into the same tree would close a cycle
        in_forest[i] = True
        for r in roots:
            parent_of[r] = i
    tree_adj: list[list[tuple[int, int, bool]]] = [[] for _ in range(n)]
    for i in np.flatnonzero(in_forest):
        tree_adj[i] = [(e, j, is_u) for e, j, is_u in flat.adj[i] if in_forest[j]]
    return in_forest, tree_adj


def forest_descent(flat: Flat, x: np.ndarray, penalty: np.ndarray, rng: np.random.Generator, rounds: int = 4) -> np.ndarray:
    """Block coordinate descent: exact min-sum DP on random induced forests, the rest held fixed.

    Node ``i`` pays ``costs_i + penalty[i] * usages_i``. Memory is not enforced here.
    """
    x = x.copy()
    for _ in range(rounds):
        in_forest, tree_adj = _forest(flat, rng)
        unary = []
        for i in range(flat.n):
            c = flat.costs[i] + penalty[i] * flat.usages[i]
            if in_forest[i]:
                for e, j, is_u in flat.adj[i]:
                    if not in_forest[j]:
                        c = c + (flat.tables[e][:, x[j]] if is_u else flat.tables[e][x[j], :])
            unary.append(c)
        visited = np.zeros(flat.n, dtype=bool)
        for root in np.flatnonzero(in_forest):
            if visited[root]:
                continue
            # iterative DFS order
            order, parent = [], {root: (-1, -1, True)}
            stack = [root]
            visited[root] = True
            while stack:
                i = stack.pop()
                order.append(i)
                for e, j, is_u in tree_adj[i]:
                    if not visited[j]:
                        visited[j] = True
                        parent[j] = (i, e, is_u)  # is_u: i is the edge's u
                        stack.append(j)
            msg = {i: unary[i].copy() for i in order}
            arg = {}
            for i in reversed(order[1:]):
                p, e, p_is_u = parent[i]
                t = flat.tables[e] if p_is_u else flat.tables[e].T  # rows: parent's strategies
                total = t + msg[i][None, :]
                a = np.argmin(total, axis=1)
                arg[i] = a
                msg[p] = msg[p] + total[np.arange(len(a)), a]
            if not np.isfinite(msg[root]).any():
                continue
            x[root] = int(np.argmin(msg[root]))
            for i in order[1:]:
                p = parent[i][0]
                x[i] = int(arg[i][x[p]])
    return x


# -- the driver --------------------------------------------------------------------------


def least_usage(flat: Flat) -> np.ndarray:
    """Per node the least-usage strategy (cheapest among ties, forbidden last)."""
    x = np.empty(flat.n, dtype=np.int64)
    for i, (c, u) in enumerate(zip(flat.costs, flat.usages)):
        x[i] = int(np.lexsort((c, u, ~np.isfinite(c)))[0])
    return x


def _segment_penalty(flat: Flat, lam: np.ndarray) -> np.ndarray:
    """Per node the sum of segment multipliers over its interval."""
    if not len(lam):
        return np.zeros(flat.n)
    cum = np.concatenate([[0.0], np.cumsum(lam)])
    return cum[flat.seg_end] - cum[flat.seg_start]


def warm_start(flat: Flat, seed: int = 0, rounds: int = 12, x0: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """A good feasible assignment (or the least-bad one found) and its cost.

    ``x0``, when given and feasible, is a start to improve (never made worse).
    """
    rng = np.random.default_rng(seed)
    candidates: list[np.ndarray] = []
    start = least_usage(flat)
    start = icm(flat, start) if math.isfinite(evaluate(flat, start)) else start
    candidates.append(start)
    if x0 is not None and math.isfinite(evaluate(flat, x0)):
        candidates.append(icm(flat, np.asarray(x0, dtype=np.int64)))
    best = min(candidates, key=lambda y: evaluate(flat, y))
    best_cost = evaluate(flat, best)
    horizon = len(flat.capacity)
    lam = np.zeros(horizon)
    x = best.copy()
    scale = abs(best_cost) if math.isfinite(best_cost) and best_cost > 0 else 1.0
    cap_scale = float(np.abs(flat.capacity).max()) if horizon else 1.0
    step = 0.5 * scale / max(cap_scale, 1e-300) ** 2  # cost per byte, per byte over
    for r in range(rounds):
        x = forest_descent(flat, x, _segment_penalty(flat, lam), rng, rounds=3)
        if horizon:
            over = profile(flat, x) - flat.capacity
            lam = np.maximum(0.0, lam + step * over / math.sqrt(r + 1))
        y = repair(flat, x)
        if math.isfinite(evaluate(flat, y)):
            y = icm(flat, y)
            c = evaluate(flat, y)
            if c < best_cost:
                best, best_cost = y, c
    return best, best_cost

