"""Search over a feasible assignment: neighbourhoods, repair, component descent, LNS.

Every search here frees a set of nodes, holds the rest, and solves the
sub-problem (``flat.subproblem``) exactly with CP-SAT
(``cpsat.solve_neighbourhood``), keeping what improves:

=======================  =====================================================
``repair_forbidden``     one pass over the components of forbidden-bearing
                         edges that still hold a forbidden pair: each is solved
                         with forbidden pairs and memory hard (a valid
                         assignment from one that respects memory)
``component_descent``    sweeps over those components by decreasing excess
                         cost, each freed with the nodes around it (functional
                         edges make a component's nodes change together)
``lns``                  large-neighbourhood search: graph balls, time
                         windows around binding memory segments (the
                         tightest most often), costliest nodes, disagreement
                         with a guide, whole components; the size adapts to
                         how the solves end, and each solve's time doubles
                         after a round without a gain
``trws_starts``          warm starts from TRW-S decodings of the costs plus a
                         usage penalty, repaired
=======================  =====================================================

``neighbourhood`` and ``excess_costs`` draw the neighbourhoods. Budgets are
deterministic work in seconds (CP-SAT's deterministic time, a fixed charge per
neighbourhood and per Python pass over the arrays); wall-clock limits are a
safety net only, so the same inputs give the same assignment.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from shardsolve.encodings import bounds
from shardsolve.encodings.cpsat import CHARGE_PER_TERM, solve_neighbourhood
from shardsolve.encodings.flat import CHARGE_PER_ITEM, Flat, evaluate, profile, softened, subproblem, sweep_charge
from shardsolve.encodings.heuristics import icm, least_usage, repair
from shardsolve.encodings.presolve import component_labels

__all__ = ["lns", "repair_forbidden", "made_valid", "component_descent", "trws_starts", "forbidden_components", "violated_edges",
           "neighbourhood", "excess_costs"]

#: Largest neighbourhood ``repair_forbidden`` frees at once (a ball inside a bigger component), and the most
#: strategies and table entries it holds: a component of 298 nodes on a three-axis mesh held 6.4M entries, and
#: building its model took 11 s of a 2-s net for a repair CP-SAT then had 0.35 s to search.
REPAIR_MAX_NODES = 400
REPAIR_MAX_ENTRIES = 400_000
#: ``component_descent``: largest neighbourhood, and the nodes around a small component freed with it.
DESCENT_MAX_NODES = 600
DESCENT_GROW = 100
#: ... and the most strategies and table entries it grows to: CP-SAT's model of a neighbourhood is about one
#: term an entry, and building it outgrew the step's own search on meshes of three axes (600 nodes of tables
#: 45 strategies a side: 9M terms, 11 s to build, for a step of 1 s).
DESCENT_MAX_ENTRIES = 200_000

#: TRW-S warm starts (``trws_starts``): usage penalties tried, per byte, relative to the start's cost
#: per byte of capacity, each followed by ``TRWS_START_PASSES`` passes and a decoding.
TRWS_PENALTIES = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
TRWS_START_PASSES = 30
#: ``lns``: the fewest decision nodes a neighbourhood shrinks to, and the size it starts at.
LNS_MIN_SIZE = 8.0
LNS_START_SIZE = 60.0
#: ``lns``: CP-SAT's deterministic time per neighbourhood at first, and at most (after rounds without a gain).
LNS_STEP = 0.5
LNS_MAX_STEP = 8.0
#: ``segment_weights``: slack is measured in this share of the largest capacity.
SEGMENT_SLACK_SCALE = 1e-3


def _left(started: float, wall_limit: float | None) -> float | None:
    """Seconds left of a wall-clock net of ``wall_limit`` seconds from ``started`` (``None``: no net)."""
    return None if wall_limit is None else max(0.0, wall_limit - (time.perf_counter() - started))


# -- neighbourhoods ---------------------------------------------------------------------------


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
                  weights: np.ndarray | None = None, prof: np.ndarray | None = None) -> np.ndarray:
    """About ``size`` decision nodes grown along edges from a seed.

    Kind 0: a random node (a graph ball). Kind 1: the nodes live around a
    binding memory segment (a time window), drawn by ``segment_weights`` of
    the memory profile ``prof`` where given (the tightest most often), else
    uniformly. Kind 2: a node drawn with probability proportional to
    ``weights`` (e.g. ``excess_costs``).
    """
    candidates = np.flatnonzero(decision)
    if len(candidates) <= size:
        return candidates
    chosen: list[int] = []
    seen = np.zeros(flat.n, dtype=bool)
    if kind == 1 and len(flat.binding):
        if prof is None:
            t = flat.binding[int(rng.integers(len(flat.binding)))]
        else:
            w = segment_weights(flat, prof)
            t = flat.binding[int(rng.choice(len(w), p=w))]
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



def segment_weights(flat: Flat, prof: np.ndarray) -> np.ndarray:
    """Probabilities over the binding segments, the tightest most likely: ``1 / (1 + slack / scale)``,
    normalised, with ``scale`` ``SEGMENT_SLACK_SCALE`` of the largest capacity (on IOPDDL V 4 of its 84
    binding segments are within 1% of the limit, and the windows around them are where the search gains)."""
    binding = np.asarray(flat.binding, dtype=np.int64)
    slack = np.maximum(flat.capacity[binding] - prof[binding], 0.0)
    scale = SEGMENT_SLACK_SCALE * max(float(np.abs(flat.capacity).max()), 1e-300)
    w = 1.0 / (1.0 + slack / scale)
    return w / w.sum()


# -- large-neighbourhood search ---------------------------------------------------------------


def _moved_profile(flat: Flat, prof: np.ndarray, free: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The memory profile after nodes ``free`` move from strategies ``old`` to ``new``."""
    delta = np.zeros(len(flat.capacity) + 1)
    change = np.array([flat.usages[i][b] - flat.usages[i][a] for i, a, b in zip(free, old, new)])
    np.add.at(delta, flat.seg_start[free], change)
    np.add.at(delta, flat.seg_end[free], -change)
    return prof + np.cumsum(delta)[:-1]


def lns(
    flat: Flat,
    x: np.ndarray,
    *,
    budget: float,
    seed: int = 0,
    progress: Callable[[str, float, float], None] | None = None,
    lower_bound: float = -math.inf,
    offset: float = 0.0,
    wall_limit: float | None = None,
    guide: np.ndarray | None = None,
    stop_below: float = -math.inf,
    log: list | None = None,
    size: float | None = None,
    step_limit: float | None = None,
) -> tuple[np.ndarray, float, dict]:
    """Large-neighbourhood search from a feasible ``x``: free a neighbourhood, solve it exactly, keep improvements.

    Neighbourhoods alternate between graph balls and time windows (nodes live
    around a binding memory segment, grown along edges). Their size adapts:
    it grows after a neighbourhood is solved to optimality and shrinks after
    a time-out. With ``guide`` (e.g. the rounded LP relaxation), one
    neighbourhood in each round grows from nodes where ``x`` disagrees with it.
    When forbidden pairs tie nodes into components (functional edges: one
    node's strategy fixes another's), one neighbourhood per round is a whole
    component, drawn by its excess cost, and the nodes around it: such
    nodes can only change together. Each solve gets ``step_limit`` seconds of
    CP-SAT's deterministic time (``LNS_STEP``), doubled (up to
    ``LNS_MAX_STEP``) after every round in which no neighbourhood improved:
    the incumbent is then a local optimum at the sizes that fit, and only
    larger neighbourhoods, which need longer solves, can improve it (on IOPDDL
    V, balls of 60 to 80 nodes all solve to optimality without a gain, and a
    120-node window around its tightest memory segment gains 4.4% after 4 s).
    ``size`` and ``step_limit`` start where a previous call's ``stats``
    (``lns_final_size``, ``lns_step_limit``) left them, when given.
    ``budget`` is deterministic work (CP-SAT deterministic time
    plus a fixed charge per neighbourhood), so runs are reproducible;
    ``wall_limit`` is a wall-clock safety net.
    """
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.int64).copy()
    cost = evaluate(flat, x)
    decision = np.array([len(c) > 1 for c in flat.costs])
    n_dec = int(decision.sum())
    stats = {"lns_steps": 0, "lns_improvements": 0}
    if n_dec == 0 or not math.isfinite(cost):
        return x, cost, stats
    started = time.perf_counter()
    size = float(min(n_dec, LNS_START_SIZE if size is None else max(LNS_MIN_SIZE, size)))
    step_limit = LNS_STEP if step_limit is None else min(LNS_MAX_STEP, max(LNS_STEP, step_limit))
    stale = 0  # neighbourhoods solved since the last improvement
    spent = 0.0
    prof = profile(flat, x) if len(flat.capacity) else None
    step = 0
    excess, excess_step = None, 0
    kinds = [0, 1, 2] + ([3] if guide is not None else [])
    comp = forbidden_components(flat)
    spent += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    if np.bincount(comp).max(initial=0) > 1:
        kinds.append(4)
    while spent < budget and cost >= stop_below:
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
        kind = kinds[step % len(kinds)]
        if kind in (2, 4):
            if excess is None or step - excess_step >= 3 * len(kinds):  # a full pass: refreshed every third use
                excess, excess_step = excess_costs(flat, x), step
                spent += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
            weights = excess
        elif kind == 3:  # nodes where the incumbent and the LP relaxation disagree
            weights = (x != guide).astype(np.float64)
            kind = 2
        else:
            weights = None
        if kind == 4:
            free = _component_neighbourhood(flat, int(size), rng, decision, comp, weights)
        else:
            free = neighbourhood(flat, int(size), rng, decision, kind, weights, prof)
        sub = subproblem(flat, free, x, prof)
        # building its model alone (about a term per table entry) would overrun the work or the net left:
        # a smaller neighbourhood, or none where it is already the smallest
        building = CHARGE_PER_TERM * (sum(t.size for t in sub.tables) + 2 * sum(len(c) for c in sub.costs))
        left = budget - spent if wall_limit is None else min(budget - spent, _left(started, wall_limit))
        if building > left:
            if size <= LNS_MIN_SIZE:
                break
            size = max(LNS_MIN_SIZE, 0.5 * size)
            continue
        before = evaluate(sub, x[free])
        y, after, optimal, used = solve_neighbourhood(sub, x[free], min(step_limit, budget - spent + 1e-3), seed + step,
                                                      _left(started, wall_limit))
        spent += used
        step += 1
        if log is not None:
            log.append((kind, len(free), optimal, before - after if y is not None else 0.0, used))
        if y is not None and after < before - 1e-9 * max(1.0, abs(before)):
            if prof is not None:
                prof = _moved_profile(flat, prof, free, x[free], y)
            x[free] = y
            cost += after - before
            stats["lns_improvements"] += 1
            stale = 0
            if progress is not None:
                progress("LNS", cost + offset, lower_bound)
        else:
            stale += 1
            if stale >= len(kinds):  # a whole round found nothing: longer solves, for larger neighbourhoods
                step_limit, stale = min(LNS_MAX_STEP, 2.0 * step_limit), 0
        if optimal:
            size = min(float(n_dec), size * 1.15 + 1)
        else:
            size = max(LNS_MIN_SIZE, size * 0.85)
    cost = evaluate(flat, x)  # exact, without the rounding of the running sum
    stats["lns_steps"] = step
    stats["lns_final_size"] = int(size)
    stats["lns_step_limit"] = step_limit
    stats["lns_deterministic_s"] = round(spent, 3)
    return x, cost, stats


# -- repairing forbidden pairs ------------------------------------------------------------


def forbidden_components(flat: Flat) -> np.ndarray:
    """Per node, its component in the graph of edges that have a forbidden entry.

    Forbidden pairs only couple nodes within one such component, so a
    component can be made consistent on its own with every other node held.
    """
    forb = np.array([not np.isfinite(t).all() for t in flat.tables], dtype=bool)
    return component_labels(flat.n, flat.eu[forb], flat.ev[forb])


def violated_edges(flat: Flat, x: np.ndarray) -> np.ndarray:
    """Indices of the edges whose chosen pair is forbidden in ``x``."""
    return np.array([k for k, t in enumerate(flat.tables) if not np.isfinite(t[x[flat.eu[k]], x[flat.ev[k]]])],
                    dtype=np.int64)


def _ball(flat: Flat, seeds: list[int], allowed: np.ndarray, size: int, entries: float = math.inf) -> np.ndarray:
    """Breadth-first ball of at most ``size`` nodes from ``seeds`` along edges, within ``allowed``; it stops
    growing before its strategies and the entries of the tables inside it pass ``entries`` (the seeds are
    kept whatever they hold)."""
    seen = np.zeros(flat.n, dtype=bool)
    order = []
    for s in seeds:
        if not seen[s]:
            seen[s] = True
            order.append(s)
    held = 0.0 if math.isinf(entries) else float(_entries_of(flat, order))
    head = 0
    while head < len(order) and len(order) < size:
        i = order[head]
        head += 1
        for _, j, _ in flat.adj[i]:
            if allowed[j] and not seen[j]:
                if not math.isinf(entries):
                    more = _entries_joining(flat, j, seen)
                    if held + more > entries:
                        return np.array(sorted(order), dtype=np.int64)
                    held += more
                seen[j] = True
                order.append(j)
                if len(order) >= size:
                    break
    return np.array(sorted(order), dtype=np.int64)


def _entries_of(flat: Flat, nodes: np.ndarray) -> int:
    """The strategies of ``nodes`` and the entries of the tables between them."""
    inside = np.zeros(flat.n, dtype=bool)
    total = 0
    for j in nodes:
        total += _entries_joining(flat, int(j), inside)
        inside[j] = True
    return total


def _entries_joining(flat: Flat, j: int, inside: np.ndarray) -> int:
    """What node ``j`` adds to a neighbourhood of the nodes ``inside``: its strategies and its tables to them."""
    return len(flat.costs[j]) + sum(flat.tables[e].size for e, k, _ in flat.adj[j] if inside[k])


def _component_neighbourhood(flat: Flat, size: int, rng: np.random.Generator, decision: np.ndarray,
                             comp: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The component (of forbidden-bearing edges) of a node drawn by ``weights``, grown along edges to ``size``.

    A component larger than ``size`` gives a ball of ``size`` nodes inside it.
    """
    w = np.where(decision, weights, 0.0)
    if float(w.sum()) <= 0:
        w = decision.astype(np.float64)
    seed = int(rng.choice(flat.n, p=w / w.sum()))
    members = np.flatnonzero((comp == comp[seed]) & decision)
    if len(members) >= size:
        return _ball(flat, [seed], (comp == comp[seed]) & decision, size)
    return _ball(flat, [seed] + [int(i) for i in members if i != seed], decision, size)


def repair_forbidden(flat: Flat, x: np.ndarray, *, budget: float, seed: int = 0,
                     wall_limit: float | None = None, strict: bool = False) -> tuple[np.ndarray, float, dict]:
    """Make ``x`` free of forbidden pairs, one component of forbidden-bearing edges at a time.

    ``x`` must respect memory (e.g. least usage, then ICM on the softened
    problem). For every component holding a forbidden pair (in the order of
    the edges that break one), its nodes (a ball around the pair when the component has more
    than ``REPAIR_MAX_NODES`` nodes, or more than ``REPAIR_MAX_ENTRIES`` strategies and table entries) are
    freed and solved exactly by CP-SAT with everything else held, forbidden pairs and memory hard, the true
    costs as objective. Every such component is visited whatever ``budget`` says
    (it only sets how long each solve may take, at least 0.05 s): a valid
    assignment matters more than the time limit. With ``strict`` (where a
    valid assignment is in hand elsewhere), no further component is visited
    once ``budget`` is spent. Returns the new assignment,
    the deterministic work spent and stats (``repair_left``: forbidden pairs
    still present).
    """
    started = time.perf_counter()
    x = np.asarray(x, dtype=np.int64).copy()
    stats = {"repair_components": 0, "repair_left": 0}
    bad = violated_edges(flat, x)
    if not len(bad):
        return x, 0.0, stats
    comp = forbidden_components(flat)
    decision = np.array([len(c) > 1 for c in flat.costs])
    prof = profile(flat, x) if len(flat.capacity) else None
    spent = 0.0
    done: set[int] = set()
    for k in bad:
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break  # the wall-clock safety net stops it; the budget shapes each solve, not their number ...
        if strict and spent >= budget:
            break  # ... unless ``strict``
        u, v = int(flat.eu[k]), int(flat.ev[k])
        if np.isfinite(flat.tables[k][x[u], x[v]]):
            continue  # an earlier repair fixed it
        c = int(comp[u])
        members = np.flatnonzero((comp == c) & decision)
        if c in done or len(members) > REPAIR_MAX_NODES or _entries_of(flat, members) > REPAIR_MAX_ENTRIES:
            free = _ball(flat, [u, v], decision, REPAIR_MAX_NODES, REPAIR_MAX_ENTRIES)
        else:
            free = members
        done.add(c)
        if not len(free):
            continue
        sub = subproblem(flat, free, x, prof)
        limit = min(1.0 + 0.01 * len(free), max(0.05, budget - spent))
        y, _, _, used = solve_neighbourhood(sub, x[free], limit, seed + len(done), _left(started, wall_limit))
        spent += used
        stats["repair_components"] += 1
        if y is None:
            continue
        if prof is not None:
            prof = _moved_profile(flat, prof, free, x[free], y)
        x[free] = y
    stats["repair_left"] = int(len(violated_edges(flat, x)))
    stats["repair_deterministic_s"] = round(spent, 3)
    return x, spent, stats


def component_descent(flat: Flat, x: np.ndarray, *, budget: float, seed: int = 0, max_sweeps: int = 4,
                      wall_limit: float | None = None) -> tuple[np.ndarray, float, float, dict]:
    """Block coordinate descent over the components of forbidden-bearing edges.

    Components are visited by decreasing excess cost (``excess_costs``); each
    is freed with about ``DESCENT_GROW`` nodes around it (a ball of
    ``DESCENT_MAX_NODES`` around its costliest node when bigger) and solved by
    CP-SAT, everything else held. Functional edges make a component's nodes
    change together, which single-node moves and random balls rarely manage:
    on IOPDDL P one sweep halves the cost of the least-usage start. Sweeps
    repeat (up to ``max_sweeps``) while one gains at least 0.1% and budget is left.
    ``x`` must be feasible. Returns (assignment, cost, deterministic work, stats).
    """
    started = time.perf_counter()
    x = np.asarray(x, dtype=np.int64).copy()
    cost = evaluate(flat, x)
    stats = {"descent_steps": 0, "descent_improvements": 0}
    if not math.isfinite(cost):
        return x, cost, 0.0, stats
    comp = forbidden_components(flat)
    decision = np.array([len(c) > 1 for c in flat.costs])
    spent = CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    prof = profile(flat, x) if len(flat.capacity) else None
    for sweep in range(max_sweeps):
        swept = cost
        x, cost, spent = _descent_sweep(flat, x, cost, comp, decision, prof, budget, spent, seed, stats, started, wall_limit)
        if len(flat.capacity):
            prof = profile(flat, x)
        stats["descent_sweeps"] = sweep + 1
        if spent >= budget or cost >= swept - 1e-3 * abs(swept):
            break
    cost = evaluate(flat, x)
    stats["descent_deterministic_s"] = round(spent, 3)
    return x, cost, spent, stats


def _descent_sweep(flat: Flat, x: np.ndarray, cost: float, comp: np.ndarray, decision: np.ndarray,
                   prof: np.ndarray | None, budget: float, spent: float, seed: int, stats: dict, started: float,
                   wall_limit: float | None) -> tuple[np.ndarray, float, float]:
    """One pass of ``component_descent`` (``x`` is updated in place); returns (x, cost, work spent so far)."""
    excess = excess_costs(flat, x)
    spent += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    total = np.bincount(comp, weights=excess)
    for c in np.argsort(-total, kind="stable"):
        if total[c] <= 0 or spent >= budget:
            break
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
        inside = (comp == c) & decision
        members = np.flatnonzero(inside)
        if not len(members):
            continue
        if len(members) > DESCENT_MAX_NODES or _entries_of(flat, members) > DESCENT_MAX_ENTRIES:
            free = _ball(flat, [int(members[np.argmax(excess[members])])], inside, DESCENT_MAX_NODES,
                         DESCENT_MAX_ENTRIES)
        else:
            free = _ball(flat, [int(i) for i in members], decision, max(len(members), DESCENT_GROW),
                         DESCENT_MAX_ENTRIES)
        sub = subproblem(flat, free, x, prof)
        before = evaluate(sub, x[free])
        limit = min(1.0, max(0.05, budget - spent))
        y, after, _, used = solve_neighbourhood(sub, x[free], limit, seed + stats["descent_steps"],
                                                _left(started, wall_limit))
        spent += used
        stats["descent_steps"] += 1
        if y is not None and after < before - 1e-9 * max(1.0, abs(before)):
            if prof is not None:
                prof = _moved_profile(flat, prof, free, x[free], y)
            x[free] = y
            cost += after - before
            stats["descent_improvements"] += 1
    return x, cost, spent


# -- warm starts from message passing ----------------------------------------------------------


def made_valid(flat: Flat, soft: Flat, x: np.ndarray, seed: int, wall_limit: float | None = None,
               budget: float | None = None) -> tuple[np.ndarray, float]:
    """``x`` made valid as the solver makes its starts: memory first (``heuristics.repair`` on ``soft``, the
    softened ``flat``), then ICM on ``soft``, then ``repair_forbidden`` for the forbidden pairs left; returns the
    assignment and the work ``repair_forbidden`` charged (the sweeps are the caller's to charge). With a
    ``budget`` (a valid assignment is in hand elsewhere), the repair stops once it is spent, and ``x`` may stay
    invalid; without, every forbidden pair is visited."""
    x = icm(soft, repair(soft, x), sweeps=3)
    x, used, _ = repair_forbidden(flat, x, budget=1.0 if budget is None else budget, seed=seed,
                                  wall_limit=wall_limit, strict=budget is not None)
    return x, used


def trws_starts(flat: Flat, reference: float, seed: int, wall_limit: float | None = None,
                budget: float | None = None) -> tuple[np.ndarray | None, float, float]:
    """Warm starts from TRW-S decodings of the costs plus a usage penalty, repaired; the best, its cost, the work.

    The decoding ignores memory; the penalty (``mu`` times the reference
    cost per byte of capacity, on every byte a strategy uses) steers it
    towards assignments that fit. Each decoding is repaired: memory first
    (``heuristics.repair`` on the softened problem), then ICM on the softened
    problem, then ``repair_forbidden`` for the forbidden pairs left.
    ``wall_limit``: the caller's wall-clock net, in seconds from now.
    ``budget``: deterministic work, within which each further penalty is tried
    once some start is valid (``reference`` finite, or a decoding's cost); the
    penalties go from none upwards, so a tight budget keeps the cheap ones.
    """
    started = time.perf_counter()
    valid = math.isfinite(reference)
    soft, _ = softened(flat)
    cap = float(np.abs(flat.capacity).max()) if len(flat.capacity) else 1.0
    if not math.isfinite(reference):
        reference = evaluate(soft, least_usage(flat))
    scale = abs(reference) if math.isfinite(reference) and reference != 0 else 1.0
    usages = [np.asarray(u, dtype=np.float64) for u in flat.usages]
    best_x, best_cost, spent = None, math.inf, 0.0
    decoding = bounds.trws_charge(flat, TRWS_START_PASSES) + 5 * sweep_charge(flat)  # the passes, repairs and ICM
    for k, mu in enumerate(TRWS_PENALTIES):
        if mu and not len(flat.capacity):
            break
        if (valid or math.isfinite(best_cost)) and (
                (budget is not None and spent + decoding > budget) or _left(started, wall_limit) == 0.0):
            break
        per_byte = mu * scale / max(cap, 1e-300)
        penalised = dataclasses.replace(flat, costs=tuple(c + per_byte * u for c, u in zip(flat.costs, usages)))
        decoded: list = []
        bounds.trws_bound(penalised, passes=TRWS_START_PASSES, decoded=decoded, wall_limit=_left(started, wall_limit),
                          terms=False)
        # With a valid start in hand, a decoding's repair keeps to what the budget leaves (it may stay invalid):
        # repairing every forbidden pair of a decoding far from valid took 8 to 10 s past a 1.4 s budget.
        held = budget is not None and (valid or math.isfinite(best_cost))
        x, used = made_valid(flat, soft, decoded[0], seed + k, _left(started, wall_limit),
                             budget=max(0.0, budget - spent - decoding) if held else None)
        spent += used + decoding
        cost = evaluate(flat, x)
        if cost < best_cost:
            best_x, best_cost = x, cost
    return best_x, best_cost, spent

