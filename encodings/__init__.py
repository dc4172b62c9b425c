"""Solvers for the strategy-selection problem (imported as ``shardsolve.encodings``).

``solve`` is the one entry point the planner calls::

    problem --reduce--> reduced problem --flatten--> arrays
        tiny (<= 60 decisions): CP-SAT on the whole model, exactly (milliseconds)
        moderate: LP relaxation with memory (GLOP): a certified bound, and its
                  rounding, with the fractional nodes solved exactly, as a start
        warm starts: heuristics (least usage, Lagrangian forest DP, repair, ICM);
                  where the LP is skipped (up to 5,000 nodes): TRW-S decodings of
                  the costs plus usage penalties, repaired (memory, ICM, forbidden pairs);
                  when none is valid (large problems): least usage, ICM on the
                  softened problem, and an exact repair of every component of
                  forbidden-bearing edges that still holds a forbidden pair
        <= 400 decisions and 5,000 strategies: the whole model, hinted, for a share of the budget
        then (> 400 decisions): sweeps of component descent (components of
              forbidden-bearing edges, costliest first, each solved exactly
              with the rest held); then CP-SAT large-neighbourhood search (graph balls, time windows,
              costliest nodes, disagreement with the LP, whole components)
        bound: CP-SAT's / the LP's, or (LP too big) TRW-S message passing, memory
               relaxed, for a share of the budget (and min-sum diffusion, the larger)
    --lift--> assignment of the original problem, cost from ``Problem.evaluate``

On IOPDDL instances B and G the LP relaxation with the memory constraints is
integral or nearly so: its rounding is optimal and CP-SAT proves it.

``explain_infeasible`` names a minimal set of pins (and the memory limit) that
cannot hold together, from z3 unsat cores.

Time limits are *deterministic* work budgets in seconds (CP-SAT's
deterministic time, a fixed charge per model term built, per node and edge
reduced, and per node and edge visited by a Python pass), so the same
problem and options give the same assignment byte for byte, as long as the
budget is spent before a wall-clock safety net of ``WALL_SLACK`` (1.05)
times the limit plus ``WALL_EXTRA`` (1 s) stops the search (see ``solve``).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from shardsolve.errors import InfeasibleError, Interrupted, ShardsolveError
from shardsolve.problem import Problem, Solution
from shardsolve.reductions import reduce

__all__ = ["solve", "interruptible", "explain_infeasible", "DEFAULT_TIME_LIMIT"]

#: Budget when ``time_limit`` is None.
DEFAULT_TIME_LIMIT = 30.0
#: Problems with at most this many decision nodes (after reduction) are solved whole, exactly.
TINY_NODES = 60
#: Up to this many decision nodes the whole model also gets a share of the budget after the warm start.
EXACT_NODES = 400
#: ... and at most this many strategies in all (IOPDDL V, 10k strategies on 294 nodes, gains nothing from it).
EXACT_STRATEGIES = 5000
#: The LP relaxation is built up to this many nodes (and ``bounds.LP_MAX_PAIRS`` pair variables).
LP_MAX_NODES = 5000
#: Above this many nodes (after reduction) the Python heuristics are skipped.
LARGE_NODES = 5000
#: Deterministic charge (seconds) per LP variable.
LP_CHARGE = 2e-6
#: Share of the remaining budget for ``cpsat.component_descent`` (sweeps) before the LNS.
DESCENT_SHARE = 0.6
#: Deterministic charge (seconds) per node and per edge of the input, for checking and reducing it.
REDUCE_CHARGE = 1e-4
#: TRW-S bound (where the LP is skipped): at most this many passes, and this share of the budget.
TRWS_PASSES = 200
TRWS_SHARE = 0.12
#: TRW-S warm starts (up to ``LARGE_NODES``): usage penalties tried, per byte, relative to the start's cost
#: per byte of capacity, each followed by ``TRWS_START_PASSES`` passes and a decoding.
TRWS_PENALTIES = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
TRWS_START_PASSES = 30
#: Wall-clock safety net: ``WALL_SLACK * time_limit + WALL_EXTRA`` seconds, after which every stage
#: stops at its next check (the final lift and evaluation still run).
WALL_SLACK = 1.05
WALL_EXTRA = 1.0
#: Largest problem ``explain_infeasible`` hands to z3 (node strategies).
EXPLAIN_MAX_STRATEGIES = 20_000

Progress = Callable[[str, float, float], None]


def _quiet(message: str, best: float, bound: float) -> None:
    return None


def interruptible(search: Callable[..., Solution]) -> Callable[..., Solution]:
    """Turn a ``KeyboardInterrupt`` during ``search`` into ``errors.Interrupted`` carrying the best so far.

    ``search`` gets one more keyword, ``incumbent``: a dict it keeps holding
    ``"solution"``, a function returning the best complete assignment found so far
    as a ``Solution`` of the original problem with status ``"interrupted"``.
    """

    def run(problem: Problem, **options) -> Solution:
        incumbent: dict = {}
        try:
            return search(problem, incumbent=incumbent, **options)
        except Interrupted:
            raise
        except KeyboardInterrupt:
            best = incumbent.get("solution")
            raise Interrupted(best() if best is not None else None) from None

    run.__doc__, run.__name__, run.__wrapped__ = search.__doc__, search.__name__, search
    return run


@interruptible
def solve(
    problem: Problem,
    *,
    time_limit: float | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Progress | None = None,
    incumbent: dict | None = None,
) -> Solution:
    """Pick one strategy per node, minimising cost under pins and the memory limit.

    ``time_limit``: deterministic work budget in seconds (default 30); ``seed``:
    the random seed of every randomised step; ``workers``: CP-SAT threads for
    whole-model solves (default 1; results stay deterministic either way);
    ``progress(message, best_cost, lower_bound)`` is called as the search improves.

    Determinism and wall time trade off. The budget is calibrated so that an
    idle machine spends it in about ``time_limit`` seconds; a run that does
    so is deterministic. The wall clock is only a safety net, at
    ``1.05 * time_limit + 1`` seconds (then every stage stops at its next
    check, and the final lift and evaluation take a few seconds more on the
    largest problems): on a loaded machine the net ends the search first, so
    the run takes about the limit in wall time, but where it stops, and so
    the result, depends on the load. A larger net would keep such runs
    deterministic at the price of overrunning the limit (by 1.5 times with a
    net at 1.5 times); callers who want determinism on a loaded machine
    should pass a smaller ``time_limit``.

    Returns a :class:`Solution` whose ``cost`` is ``problem.evaluate(assignment)``
    and whose ``lower_bound`` is certified. ``status``: ``"optimal"``,
    ``"feasible"``, ``"infeasible"`` (with ``conflict`` when it could be
    explained) or ``"unknown"`` (nothing feasible found in the budget).
    Ctrl-C raises ``errors.Interrupted`` with the best complete solution so
    far (status ``"interrupted"``), or none.
    """
    from shardsolve.encodings import bounds, cpsat, heuristics

    started = time.perf_counter()
    try:
        problem.validate()
    except ValueError as exc:
        raise ShardsolveError(f"invalid problem {problem.name!r}: {exc}") from None
    budget = DEFAULT_TIME_LIMIT if time_limit is None else max(0.0, float(time_limit))
    total_budget = budget
    wall_limit = WALL_SLACK * budget + WALL_EXTRA

    def wall_left() -> float:
        return max(0.0, wall_limit - (time.perf_counter() - started))
    report = progress or _quiet
    threads = 1 if workers is None else max(1, int(workers))

    def finish(assignment, status: str, bound: float, stats: dict, conflict=()) -> Solution:
        if assignment is None:
            return Solution((), math.inf, bound, status, time.perf_counter() - started, tuple(conflict), stats)
        cost = problem.evaluate(assignment)
        if not math.isfinite(cost):  # defensive: never report an invalid assignment as a solution
            return Solution((), math.inf, bound, "unknown", time.perf_counter() - started, (), stats)
        bound = min(bound, cost)
        if status != "optimal" and bound >= cost - 1e-9 * abs(cost):
            status = "optimal"
        if status == "optimal":
            bound = cost
        stats["wall_s"] = round(time.perf_counter() - started, 3)
        return Solution(tuple(int(s) for s in assignment), cost, bound, status, time.perf_counter() - started, (), stats)

    def infeasible(stats: dict) -> Solution:
        conflict = explain_infeasible(problem) if problem.num_strategies <= EXPLAIN_MAX_STRATEGIES else ()
        return finish(None, "infeasible", math.inf, stats, conflict)

    try:
        reduced = reduce(problem)
    except InfeasibleError:
        return infeasible({"reduced": False})
    stats: dict = dict(reduced.stats)
    stats["reduce_s"] = round(time.perf_counter() - started, 3)
    budget -= REDUCE_CHARGE * (len(problem.nodes) + len(problem.edges))
    offset = reduced.offset
    flat = heuristics.flatten(reduced.problem)
    decision = sum(1 for c in flat.costs if len(c) > 1)

    if decision == 0:
        x = np.zeros(flat.n, dtype=np.int64)
        if not math.isfinite(heuristics.evaluate(flat, x)):
            return infeasible(stats)
        return finish(reduced.lift(x), "optimal", -math.inf, stats)

    def shifted(message: str, best: float, bound: float) -> None:
        report(message, best + offset, bound + offset)

    bound = bounds.trivial_bound(flat)
    best_x: np.ndarray | None = None
    best_cost = math.inf

    def consider(x: np.ndarray | None, cost: float) -> None:
        nonlocal best_x, best_cost
        if x is not None and cost < best_cost:
            best_x, best_cost = np.asarray(x, dtype=np.int64), cost
            if incumbent is not None:
                incumbent["solution"] = lambda x=best_x: _interrupted(problem, reduced.lift(x), bound + offset,
                                                                      time.perf_counter() - started, stats)

    # 1. LP relaxation (moderate sizes): a bound, a guide for the search, and often the optimum.
    #    Planner problems and IOPDDL B/G have an integral LP: its rounding is optimal.
    guide = None
    marginals = None
    if flat.n <= LP_MAX_NODES and sum(int(np.isfinite(t).sum()) for t in flat.tables) <= bounds.LP_MAX_PAIRS:
        lp_started = time.perf_counter()
        lp_value, lp_margin, marginals = bounds.lp_solve(flat, time_limit=max(10.0, 0.5 * budget))
        stats["lp_s"] = round(time.perf_counter() - lp_started, 3)
        if lp_value == math.inf:
            return infeasible(stats)
        if math.isfinite(lp_value):
            stats["lp_bound"] = lp_value - lp_margin + offset
            bound = max(bound, lp_value - lp_margin)
        if marginals is not None:
            guide = np.array([int(np.argmax(m)) for m in marginals], dtype=np.int64)
            budget -= LP_CHARGE * sum(len(c) for c in flat.costs) + LP_CHARGE * sum(t.size for t in flat.tables)
            integral = all(float(np.max(m)) >= 1.0 - 1e-6 for m in marginals)
            if integral:
                c_guide = heuristics.evaluate(flat, guide)
                # An integral LP optimum whose exact cost is the LP value: optimal (to the LP's tolerance).
                if c_guide <= lp_value + 1e-9 * abs(c_guide):
                    stats["proof"] = "integral LP"
                    return finish(reduced.lift(guide), "optimal", bound + offset, stats)

    # 2. Tiny: the whole model, exactly.
    if decision <= TINY_NODES:
        hint = guide if guide is not None and math.isfinite(heuristics.evaluate(flat, guide)) else None
        result = cpsat.solve_cpsat(flat, hint=hint, time_limit=budget, seed=seed, workers=threads, progress=shifted,
                                   wall_limit=wall_left())
        stats.update(result.stats)
        if result.status == "infeasible":
            return infeasible(stats)
        if result.status == "optimal" or result.assignment is None:
            status = result.status if result.assignment is not None else "unknown"
            lifted = reduced.lift(result.assignment) if result.assignment is not None else None
            return finish(lifted, status, max(bound, result.lower_bound) + offset, stats)
        return finish(reduced.lift(result.assignment), "feasible", max(bound, result.lower_bound) + offset, stats)

    # 3. Warm starts: heuristics, and the LP rounded (its fractional part solved exactly).
    if flat.n <= LARGE_NODES:
        x0, c0 = heuristics.warm_start(flat, seed=seed)
        consider(x0, c0)
        stats["warm_start_cost"] = c0 + offset if math.isfinite(c0) else None
        if guide is None and decision > TINY_NODES:
            # no LP to round: TRW-S decodings (memory penalised, then repaired) as further starts
            x_t, c_t, used = _trws_starts(flat, c0, seed)
            budget -= used
            consider(x_t, c_t)
            stats["trws_start_cost"] = c_t + offset if math.isfinite(c_t) else None
    if guide is not None:
        frac = np.array([len(m) > 1 and float(np.max(m)) < 1.0 - 1e-6 for m in marginals])
        free = set(np.flatnonzero(frac).tolist())
        for i in list(free):
            free.update(j for _, j, _ in flat.adj[i] if len(flat.costs[j]) > 1)
        free_idx = np.array(sorted(free), dtype=np.int64)
        if len(free_idx):
            sub = heuristics.subproblem(flat, free_idx, guide)
            y, _, _, used = cpsat.solve_neighbourhood(sub, guide[free_idx], min(0.2 * budget, 20.0), seed)
            budget -= used
            if y is not None:
                x_r = guide.copy()
                x_r[free_idx] = y
                consider(x_r, heuristics.evaluate(flat, x_r))
        else:
            consider(guide, heuristics.evaluate(flat, guide))
        stats["lp_rounding_free_nodes"] = int(len(free_idx))
    if best_x is None:
        # Least usage always fits memory but may break forbidden pairs. ICM on the
        # softened problem (forbidden pairs at a finite penalty) removes most of them;
        # forbidden pairs only couple nodes within a component of forbidden-bearing
        # edges, so each component still holding one is then solved exactly on its own.
        soft, penalty = heuristics.softened(flat)
        start = heuristics.icm(soft, heuristics.least_usage(flat), sweeps=3)
        budget -= 3 * heuristics.CHARGE_PER_ITEM * (flat.n + len(flat.tables))
        start, used, repair_stats = cpsat.repair_forbidden(
            flat, start, budget=0.5 * budget, seed=seed,
            wall_limit=0.5 * (wall_limit - (time.perf_counter() - started)),
        )
        budget -= used
        stats.update(repair_stats)
        if repair_stats["repair_left"]:
            # what is left (memory too tight around a component): search the softened problem
            x_soft, c_soft, soft_stats = cpsat.lns(
                soft, start, budget=0.5 * budget, seed=seed, stop_below=penalty,
                wall_limit=0.5 * (wall_limit - (time.perf_counter() - started)),
            )
            budget -= soft_stats.get("lns_deterministic_s", 0.0)
            stats["repair_steps"] = soft_stats.get("lns_steps", 0)
            start = x_soft
        consider(start, heuristics.evaluate(flat, start))
    if best_x is not None:
        report("warm start", best_cost + offset, bound + offset)

    # 4. Medium: the whole model, hinted, for a share of the budget (may prove optimality).
    strategies = sum(len(c) for c in flat.costs)
    if (decision <= EXACT_NODES and strategies <= EXACT_STRATEGIES) or (best_x is None and flat.n <= LARGE_NODES):
        share = max(1.0, 0.1 * budget) if best_x is not None else max(1.0, 0.5 * budget)
        result = cpsat.solve_cpsat(flat, hint=best_x, time_limit=share, seed=seed, workers=threads, progress=shifted,
                                   wall_limit=0.5 * wall_left() if best_x is not None else wall_left())
        stats.update(result.stats)
        budget -= result.stats.get("cpsat_deterministic_s", 0.0) + cpsat.CHARGE_PER_STEP
        bound = max(bound, result.lower_bound)
        if result.status == "infeasible":
            return infeasible(stats)
        consider(result.assignment, result.cost)
        if result.status == "optimal":
            return finish(reduced.lift(best_x), "optimal", bound + offset, stats)
    if best_x is None:
        return finish(None, "unknown", bound + offset, stats)

    # 5. Certified lower bound (memory relaxed) where the LP was too big: TRW-S, and min-sum diffusion
    #    where it is cheap (the larger of the two).
    if guide is None:
        passes = _trws_passes(flat, min(total_budget, 2.0 * max(0.0, budget)))
        trws_started = time.perf_counter()
        value, _, _ = bounds.trws_bound(
            flat, passes=passes, wall_limit=0.5 * wall_left(), final_only=True,
        )
        value -= 1e-9 * max(1.0, abs(value))  # floating-point margin, as ``dual_bound``'s
        stats["trws_passes"] = passes
        stats["trws_s"] = round(time.perf_counter() - trws_started, 3)
        stats["trws_bound"] = value + offset
        bound = max(bound, value)
        budget -= (passes + 3) * heuristics.CHARGE_PER_ITEM * (flat.n + len(flat.tables))
        if flat.n <= LARGE_NODES:
            bound = max(bound, bounds.dual_bound(flat, iterations=50))
            budget -= 100 * heuristics.CHARGE_PER_ITEM * (flat.n + len(flat.tables))

    # 6. Component descent (where forbidden pairs tie nodes together), then large-neighbourhood search.
    if decision > EXACT_NODES:
        x, cost, used, descent_stats = cpsat.component_descent(
            flat, best_x, budget=DESCENT_SHARE * max(0.0, budget), seed=seed,
            wall_limit=DESCENT_SHARE * (wall_limit - (time.perf_counter() - started)),
        )
        budget -= used
        stats.update(descent_stats)
        consider(x, cost)
        report("component descent", best_cost + offset, bound + offset)
    x, cost, lns_stats = cpsat.lns(
        flat, best_x, budget=max(0.0, budget), seed=seed, progress=shifted,
        lower_bound=bound, wall_limit=wall_left(), guide=guide,
    )
    stats.update(lns_stats)
    consider(x, cost)
    return finish(reduced.lift(best_x), "feasible", bound + offset, stats)


def _interrupted(problem: Problem, assignment, bound: float, wall: float, stats: dict) -> Solution | None:
    """The ``Solution`` an interrupted search hands back: a complete assignment, its cost and the bound so far."""
    cost = problem.evaluate(assignment)
    if not math.isfinite(cost):
        return None
    return Solution(tuple(int(s) for s in assignment), cost, min(bound, cost), "interrupted", wall, (), dict(stats))


def _trws_passes(flat, budget: float) -> int:
    """TRW-S passes that fit ``TRWS_SHARE`` of ``budget`` (a pass costs about a sweep over nodes and edges)."""
    from shardsolve.encodings.heuristics import CHARGE_PER_ITEM

    per_pass = 1.5 * CHARGE_PER_ITEM * (flat.n + len(flat.tables))  # the table work: above a plain sweep
    return int(max(2, min(TRWS_PASSES, TRWS_SHARE * budget / per_pass)))


def _trws_starts(flat, reference: float, seed: int) -> tuple[np.ndarray | None, float, float]:
    """Warm starts from TRW-S decodings of the costs plus a usage penalty, repaired; the best, its cost, the work.

    The decoding ignores memory; the penalty (``mu`` times the reference
    cost per byte of capacity, on every byte a strategy uses) steers it
    towards assignments that fit. Each decoding is repaired: memory first
    (``heuristics.repair`` on the softened problem), then ICM on the softened
    problem, then ``cpsat.repair_forbidden`` for the forbidden pairs left.
    """
    import dataclasses

    from shardsolve.encodings import bounds, cpsat, heuristics

    soft, _ = heuristics.softened(flat)
    cap = float(np.abs(flat.capacity).max()) if len(flat.capacity) else 1.0
    if not math.isfinite(reference):
        reference = heuristics.evaluate(soft, heuristics.least_usage(flat))
    scale = abs(reference) if math.isfinite(reference) and reference != 0 else 1.0
    usages = [np.asarray(u, dtype=np.float64) for u in flat.usages]
    best_x, best_cost, spent = None, math.inf, 0.0
    items = flat.n + len(flat.tables)
    for k, mu in enumerate(TRWS_PENALTIES):
        if mu and not len(flat.capacity):
            break
        per_byte = mu * scale / max(cap, 1e-300)
        penalised = dataclasses.replace(flat, costs=tuple(c + per_byte * u for c, u in zip(flat.costs, usages)))
        decoded: list = []
        bounds.trws_bound(penalised, passes=TRWS_START_PASSES, decoded=decoded)
        x = heuristics.icm(soft, heuristics.repair(soft, decoded[0]), sweeps=3)
        x, used, _ = cpsat.repair_forbidden(flat, x, budget=1.0, seed=seed + k)
        spent += used + (1.5 * TRWS_START_PASSES + 5) * heuristics.CHARGE_PER_ITEM * items
        cost = heuristics.evaluate(flat, x)
        if cost < best_cost:
            best_x, best_cost = x, cost
    return best_x, best_cost, spent


def explain_infeasible(problem: Problem) -> tuple[str, ...]:
    """Labels of a minimal set of pins, plus ``MEMORY_LIMIT_LABEL`` when the memory limit is part of it.

    Empty when the problem is feasible, or infeasible without any pin or the
    memory limit (its forbidden costs alone conflict).
    """
    from shardsolve.encodings import smt

    return smt.explain(problem)


