"""The memory constraints' Lagrangian dual (``encodings.lagrange``): valid bounds, priced starts, the phase."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from shardsolve.encodings import bounds, lagrange, portfolio
from shardsolve.encodings.flat import evaluate, flatten
from shardsolve.encodings.presolve import reduce, restrict
from shardsolve.problem import Edge, Node, Problem
from test_reductions import brute_force, small_problems


def _crowded(n: int = 40, fits: int = 10, seed: int = 0) -> Problem:
    """``n`` nodes live at once, each either fast and large (cost 0-1, 10 bytes) or slow and small (cost 5-6,
    1 byte), a chain of edges that prefers equal neighbours; memory for ``fits`` fast nodes (and the rest small).

    The memory-relaxed optimum takes every node fast and breaks the limit by far; the optimum within it
    keeps the ``fits`` nodes whose slow strategy costs the most more, and pays for the rest.
    """
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(n):
        fast, slow = float(rng.uniform(0, 1)), float(rng.uniform(5, 6))
        nodes.append(Node(f"n{i}", np.array([fast, slow]), np.array([10.0, 1.0]), (0, 1)))
    edges = tuple(Edge(i, i + 1, np.array([[0.0, 0.1], [0.1, 0.0]])) for i in range(n - 1))
    return Problem(tuple(nodes), edges, float(10 * fits + (n - fits)), (), "crowded")


def _flat(problem: Problem):
    return flatten(restrict(problem)[0])


def test_priced_bound_closes_the_gap_memory_relaxes():
    """On a problem where memory binds, the priced bound rises far above the memory-relaxed one, up to the
    optimum (within a few per cent) and never past it; the repaired decodings reach the optimum."""
    problem = _crowded()
    flat = _flat(problem)
    opt = problem.evaluate(np.array(_optimum(problem)))
    relaxed, _, _ = bounds.trws_bound(flat, passes=60, terms=False)
    seen: list[float] = []

    def consider(y):
        seen.append(evaluate(flat, y))
        return min(seen)

    start = problem.evaluate(np.ones(len(problem.nodes), dtype=np.int64))  # every node small: valid, dear
    steps: list[float] = []
    value, used, stats = lagrange.dual_ascent(flat, start, budget=5.0, consider=consider, on_step=steps.append)
    assert len(steps) == stats["lagrangian_steps"] and steps == sorted(steps) and steps[-1] == value
    assert relaxed < 0.25 * opt
    assert 0.95 * opt <= value <= opt + 1e-9 * opt
    assert min(seen) == pytest.approx(opt, rel=1e-9)
    assert stats["lagrangian_steps"] >= 1 and stats["lagrangian_repairs"] >= 1
    assert 0 < used <= 5.0


def _optimum(problem: Problem) -> list[int]:
    """An optimal assignment, by CP-SAT on the whole model (checked against brute force in
    ``test_crowded_optimum``)."""
    from shardsolve.encodings.cpsat import solve_cpsat

    result = solve_cpsat(flatten(problem), time_limit=10.0, seed=0)
    assert result.status == "optimal"
    return [int(s) for s in result.assignment]


def test_crowded_optimum():
    problem = _crowded(n=8, fits=3, seed=1)
    opt, _ = brute_force(problem)
    assert problem.evaluate(np.array(_optimum(problem))) == pytest.approx(opt, rel=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(max_nodes=6))
def test_dual_ascent_bound_is_valid(problem):
    """Whatever the steps do, the bound never exceeds the optimum, and the work stays within the budget."""
    opt, _ = brute_force(problem)
    if opt == math.inf:
        return
    flat = _flat(problem)
    if not len(flat.binding):
        return
    value, used, _ = lagrange.dual_ascent(flat, opt + abs(opt) + 1.0, budget=0.5, consider=lambda y: math.inf,
                                          passes=4)
    assert value <= opt + 1e-9 * max(1.0, abs(opt))
    assert used <= 0.5


def test_no_binding_memory_no_steps():
    problem = _crowded(n=6, fits=6)
    flat = _flat(problem)
    assert not len(flat.binding)
    assert lagrange.dual_ascent(flat, 100.0, budget=5.0, consider=lambda y: math.inf) == (-math.inf, 0.0, {})


def test_portfolio_phase_raises_the_bound_and_the_incumbent():
    """The phase, run after the feasibility start, replaces the memory-relaxed bound and improves the start."""
    problem = _crowded(n=60, fits=15, seed=3)
    opt = problem.evaluate(np.array(_optimum(problem)))
    run = portfolio.Portfolio(problem, reduce(problem), 20.0, time.perf_counter())
    run.find_feasible()
    start, relaxed = run.best_cost, run.bound
    run.lagrangian()
    assert run.stats["lagrangian_steps"] >= 1
    assert run.priced_guide is not None and len(run.priced_guide) == run.flat.n  # the LNS's guide
    assert run.bound >= 0.95 * (opt - run.offset) > relaxed
    assert run.bound <= run.best_cost <= start
    assert run.best_cost < start
    assert opt <= run.best_cost + run.offset <= 1.001 * opt
    assert problem.evaluate(run.reduced.lift(run.best_x)) == pytest.approx(run.best_cost + run.offset, rel=1e-12)


def test_phase_is_deterministic():
    """Two runs of the phase from the same start give the same assignment and bound: its work budget, not
    the clock, ends it (the wall-clock net, a safety net for a loaded machine, is set out of reach here)."""
    problem = _crowded(n=60, fits=15, seed=4)
    results = []
    for _ in range(2):
        run = portfolio.Portfolio(problem, reduce(problem), 20.0, time.perf_counter(), wall_limit=600.0)
        run.find_feasible()
        run.lagrangian()
        results.append((run.best_x.tolist(), run.bound, run.budget))
    assert results[0] == results[1]
