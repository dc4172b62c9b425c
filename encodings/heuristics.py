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
import time

import numpy as np

from shardsolve.encodings.flat import CHARGE_PER_ITEM, INF, Flat, edge_reads, evaluate, interval_sums, profile, tolerance

__all__ = ["icm", "complete", "repair", "forest_descent", "warm_start", "least_usage", "OneNodeMoves"]


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


def complete(flat: Flat, x: np.ndarray, free: np.ndarray, sweeps: int = 20) -> np.ndarray:
    """``x`` with the nodes ``free`` (indices) moved, one at a time in index order, to their cheapest strategy
    given their neighbours (ICM over those nodes alone, memory left to a later repair): an assignment known
    in part (``propagation.propagated_assignment``) made whole."""
    x = x.copy()
    for _ in range(sweeps):
        moved = 0
        for i in free:
            c = _local_costs(flat, x, int(i))
            best, current = int(np.argmin(c)), c[x[i]]
            if not math.isfinite(current) or c[best] < current - 1e-12 * max(1.0, abs(current)):
                moved += best != x[i]
                x[i] = best
        if moved == 0:
            break
    return x


def repair(flat: Flat, x: np.ndarray, rounds: int = 10_000, work: list | None = None) -> np.ndarray:
    """Lower usage at over-full segments, cheapest cost per byte first, until memory fits.

    With a list ``work``, appends the number of live nodes weighed (the repair's work, to charge it).
    """
    x = x.copy()
    if not len(flat.capacity):
        return x
    prof = profile(flat, x)
    tol = tolerance(flat)
    visits = 0
    for _ in range(rounds):
        over = prof - flat.capacity
        t = int(np.argmax(over))
        if over[t] <= tol:
            break
        best = None
        live = flat.live(t)
        visits += len(live)
        for i in live:
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
    if work is not None:
        work.append(visits)
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


def warm_start(flat: Flat, seed: int = 0, rounds: int = 12, x0: np.ndarray | None = None,
               wall_limit: float | None = None) -> tuple[np.ndarray, float]:
    """A good feasible assignment (or the least-bad one found) and its cost.

    ``x0``, when given and feasible, is a start to improve (never made worse).
    ``rounds`` of Lagrangian forest descent follow the least-usage start, fewer
    where ``wall_limit`` (seconds from the call) runs out first.
    """
    started = time.perf_counter()
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
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
        x = forest_descent(flat, x, interval_sums(flat, lam), rng, rounds=3)
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



# -- vectorised one-node moves ---------------------------------------------------------------


#: ``OneNodeMoves`` is not built when the edge tables hold more entries than this (a copy of them is made).
MOVES_MAX_ENTRIES = 60_000_000
#: Deterministic charge (seconds) per strategy and table-row entry touched by one round of moves.
CHARGE_PER_ENTRY = 2e-8


class OneNodeMoves:
    """Iterated conditional modes for all nodes at once, in numpy: rounds of simultaneous one-node moves.

    A round computes every strategy's local cost (node cost plus the incident
    edges' entries towards the neighbours' current strategies) with two
    ``bincount`` calls over precomputed indices, the memory room of every node
    (the least free capacity over its interval, from a sparse table of range
    minima, plus its own usage), and each node's best allowed strategy. The
    nodes that gain and beat every gaining neighbour (larger gain, ties to the
    lower index) move together: no two movers share an edge, so the cost falls
    by exactly the sum of their gains. Movers that raise usage in a segment
    left over capacity are moved back (all but the best when that would leave
    none: alone it fits), so every round keeps the assignment valid. Rounds
    stop when nothing gains or after ``rounds``; the work is charged per
    entry touched, so the result does not depend on the clock.
    """

    def __init__(self, flat: Flat):
        self.flat = flat
        sizes = np.array([len(c) for c in flat.costs], dtype=np.int64)
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.node_of = np.repeat(np.arange(flat.n), sizes)
        self.costs = np.concatenate(flat.costs) if flat.n else np.zeros(0)
        self.usages = np.concatenate(flat.usages) if flat.n else np.zeros(0)
        self.decision = sizes > 1
        # entry (edge k, row a) adds table_k[a, x_v] to strategy a of u; (edge k, column b) table_k[x_u, b] to b of v
        self.reads = edge_reads(flat.eu, flat.ev, sizes, self.offsets, flat.tables)
        self.round_charge = CHARGE_PER_ENTRY * (len(self.costs) + len(self.reads.u_target) + len(self.reads.v_target)) \
            + CHARGE_PER_ITEM * 0.1 * (flat.n + len(flat.tables))

    @staticmethod
    def fits(flat: Flat) -> bool:
        return sum(t.size for t in flat.tables) <= MOVES_MAX_ENTRIES

    def local_costs(self, x: np.ndarray) -> np.ndarray:
        """Every strategy's cost given the neighbours' current strategies in ``x``."""
        return self.reads.add(self.costs.copy(), x)

    def room(self, prof: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Per node, the usage it may take: its current usage plus the least free capacity over its interval."""
        flat = self.flat
        own = self.usages[self.offsets + x]
        s0, s1 = flat.seg_start, flat.seg_end
        out = np.full(flat.n, INF)
        has = s1 > s0
        if not len(flat.capacity) or not has.any():
            return out
        free = flat.capacity - prof
        levels = [free]
        while (1 << len(levels)) <= len(free):
            prev, step = levels[-1], 1 << (len(levels) - 1)
            levels.append(np.minimum(prev[:-step], prev[step:]))
        length = (s1 - s0)[has]
        k = np.floor(np.log2(length)).astype(np.int64)
        lo = s0[has]
        hi = s1[has] - (1 << k)
        least = np.empty(len(lo))
        for j in np.unique(k):
            sel = k == j
            least[sel] = np.minimum(levels[j][lo[sel]], levels[j][hi[sel]])
        out[has] = least + own[has]
        return out

    def descend(self, x: np.ndarray, rounds: int = 50) -> tuple[np.ndarray, int, float]:
        """Rounds of moves from a valid ``x``; returns (new assignment, rounds run, deterministic work)."""
        flat = self.flat
        x = np.asarray(x, dtype=np.int64).copy()
        tol = tolerance(flat)
        memory = len(flat.capacity) > 0
        prof = profile(flat, x) if memory else np.zeros(0)
        spent = 0.0
        done = 0
        for done in range(1, rounds + 1):
            spent += self.round_charge
            local = self.local_costs(x)
            cur = self.offsets + x
            allowed = local
            if memory:
                room = self.room(prof, x)
                allowed = np.where(self.usages <= room[self.node_of] + tol, local, INF)
            least = np.minimum.reduceat(allowed, self.offsets)
            now = local[cur]
            gain = now - least
            cand = self.decision & np.isfinite(least) & (gain > 1e-9 * np.maximum(1.0, np.abs(now)))
            if not cand.any():
                break
            both = cand[flat.eu] & cand[flat.ev]
            eu, ev = flat.eu[both], flat.ev[both]
            u_wins = (gain[eu] > gain[ev]) | ((gain[eu] == gain[ev]) & (eu < ev))
            beaten = np.zeros(flat.n, dtype=bool)
            beaten[ev[u_wins]] = True
            beaten[eu[~u_wins]] = True
            movers = np.flatnonzero(cand & ~beaten)
            hit = np.flatnonzero((allowed == least[self.node_of]) & np.isin(self.node_of, movers))
            first = np.unique(self.node_of[hit], return_index=True)[1]
            best = hit[first]  # the first best strategy of each mover, in mover order
            new = best - self.offsets[movers]
            if memory:
                change = self.usages[best] - self.usages[cur[movers]]
                trial = _shifted_profile(flat, prof, movers, change)
                over = trial > flat.capacity + tol
                if over.any():
                    count = np.concatenate([[0], np.cumsum(over)])
                    covers = count[flat.seg_end[movers]] - count[flat.seg_start[movers]] > 0
                    keep = ~(covers & (change > 0))
                    if not keep.any():  # alone, the best of them fits (its room says so)
                        keep[int(np.argmax(gain[movers]))] = True
                    movers, new, change = movers[keep], new[keep], change[keep]
                    trial = _shifted_profile(flat, prof, movers, change)
                prof = trial
            if not len(movers):
                break
            x[movers] = new
        return x, done, spent


def _shifted_profile(flat: Flat, prof: np.ndarray, nodes: np.ndarray, change: np.ndarray) -> np.ndarray:
    delta = np.zeros(len(flat.capacity) + 1)
    np.add.at(delta, flat.seg_start[nodes], change)
    np.add.at(delta, flat.seg_end[nodes], -change)
    return prof + np.cumsum(delta)[:-1]
