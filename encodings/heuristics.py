"""Fast warm starts for the strategy-selection problem, respecting memory.

The solvers work on a :class:`Flat` view of a (reduced) ``Problem``: numpy
arrays per node (``inf`` marks a forbidden choice), one table per edge, and
the memory constraint compressed to the time segments where it can bind::

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
from dataclasses import dataclass

import numpy as np

from shardsolve.problem import FORBIDDEN, Problem

__all__ = ["Flat", "flatten", "evaluate", "icm", "repair", "forest_descent", "warm_start", "softened", "subproblem", "prune", "least_usage"]

INF = math.inf
#: Deterministic charge (seconds) per node or edge visited by one Python pass (ICM sweep, evaluation).
CHARGE_PER_ITEM = 1.5e-5


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


def _tolerance(flat: Flat) -> float:
    return 1e-9 * float(np.abs(flat.capacity).max()) if len(flat.capacity) else 0.0


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
    tol = _tolerance(flat)
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
    tol = _tolerance(flat)
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


# -- neighbourhoods for large-neighbourhood search -------------------------------------------


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
        cand = tb[(live_count[tb] > 0) & (worst[tb] > capacity[tb] + _tolerance(flat))] if len(tb) else tb
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


def excess_costs(flat: Flat, x: np.ndarray) -> np.ndarray:
    """Per node: what it pays in ``x`` (node cost plus half of each incident edge) above its cheapest option."""
    out = np.zeros(flat.n)
    for i in range(flat.n):
        c = flat.costs[i]
        out[i] = c[x[i]] - c.min()
    for k, t in enumerate(flat.tables):
        u, v = int(flat.eu[k]), int(flat.ev[k])
        extra = t[x[u], x[v]] - t.min()
        out[u] += 0.5 * extra
        out[v] += 0.5 * extra
    return np.where(np.isfinite(out), np.maximum(out, 0.0), 0.0)


def neighbourhood(flat: Flat, size: int, rng: np.random.Generator, decision: np.ndarray, kind: int,
                  weights: np.ndarray | None = None) -> np.ndarray:
    """About ``size`` decision nodes grown along edges from a seed.

    Kind 0: a random node (a graph ball). Kind 1: the nodes live around a
    random binding memory segment (a time window). Kind 2: a node drawn with
    probability proportional to ``weights`` (e.g. ``excess_costs``).
    """
    candidates = np.flatnonzero(decision)
    if len(candidates) <= size:
        return candidates
    chosen: list[int] = []
    seen = np.zeros(flat.n, dtype=bool)
    if kind == 1 and len(flat.binding):
        t = flat.binding[int(rng.integers(len(flat.binding)))]
        mid = 0.5 * (flat.seg_start + flat.seg_end)
        dist = np.where(flat.seg_end > flat.seg_start, np.abs(mid - t) - 0.5 * (flat.seg_end - flat.seg_start), np.inf)
        dist = np.where(decision, dist, np.inf)
        order = np.argsort(dist, kind="stable")
        seeds = [int(i) for i in order[: max(1, size // 2)] if np.isfinite(dist[i])]
    elif kind == 2 and weights is not None and float(weights[decision].sum()) > 0:
        w = np.where(decision, weights, 0.0)
        seeds = [int(rng.choice(flat.n, p=w / w.sum()))]
    else:
        seeds = [int(candidates[rng.integers(len(candidates))])]
    frontier = []
    for s in seeds:
        if not seen[s]:
            seen[s] = True
            chosen.append(s)
            frontier.append(s)
    while frontier and len(chosen) < size:
        nxt = []
        rng.shuffle(frontier)
        for i in frontier:
            for _, j, _ in flat.adj[i]:
                if not seen[j] and decision[j]:
                    seen[j] = True
                    chosen.append(j)
                    nxt.append(j)
                    if len(chosen) >= size:
                        break
            if len(chosen) >= size:
                break
        frontier = nxt
    while len(chosen) < size:  # disconnected: add random nodes
        j = int(candidates[rng.integers(len(candidates))])
        if not seen[j]:
            seen[j] = True
            chosen.append(j)
    return np.array(sorted(chosen), dtype=np.int64)


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
                keep[i] &= flat.usages[i] <= float(flat.capacity[s0:s1].min()) + _tolerance(flat)
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
