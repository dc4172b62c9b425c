"""The dive: branching on the node that holds the LP's gap gives a valid, tighter bound and valid starts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from shardsolve.encodings import bounds, dive, portfolio, solve
from shardsolve.encodings.flat import evaluate, flatten
from shardsolve.problem import Edge, Node, Problem
from test_reductions import brute_force, small_problems

# cost 1 where two neighbours take the same strategy: no assignment of an odd cycle avoids paying once, while the LP
# pays nothing (each node half on each strategy, each edge all on the pairs that differ)
DIFFER = np.array([[1.0, 0.0], [0.0, 1.0]])


def frustrated_cycle(n: int) -> Problem:
    nodes = tuple(Node(f"n{i}", np.array([0.0, 0.0]), np.zeros(2)) for i in range(n))
    edges = tuple(Edge(i, (i + 1) % n, DIFFER) for i in range(n))
    return Problem(nodes, edges, None, (), "odd cycle")


def test_branching_on_an_odd_cycle_closes_the_gap_the_lp_leaves():
    flat = flatten(frustrated_cycle(5))
    lower, node_terms, edge_terms = bounds.trws_bound(flat, 200)
    assert lower == pytest.approx(0.0, abs=1e-9)  # the LP's value, short of every assignment
    worst = np.zeros(flat.n, dtype=np.int64)  # all equal: pays on every edge
    found = dive.dive(flat, node_terms, edge_terms, lower, worst, evaluate(flat, worst), budget=1e9)
    assert found is not None
    assert found.bound == pytest.approx(1.0)  # with one node held, the rest is a path: its LP is exact
    assert found.cost == pytest.approx(1.0) and evaluate(flat, found.x) == pytest.approx(1.0)


def test_the_dive_is_left_out_where_its_ranking_does_not_fit_the_budget():
    flat = flatten(frustrated_cycle(5))
    lower, node_terms, edge_terms = bounds.trws_bound(flat, 200)
    x = np.zeros(flat.n, dtype=np.int64)
    assert dive.dive(flat, node_terms, edge_terms, lower, x, evaluate(flat, x), budget=0.0) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(max_nodes=6, max_strategies=3))
def test_the_dive_and_block_bounds_never_pass_the_optimum_and_the_dives_start_is_valid(problem):
    opt, arg = brute_force(problem)
    if opt == math.inf or any(e.u == e.v for e in problem.edges):  # (the reductions fold an edge of a node to itself)
        return
    flat = flatten(problem)
    x = np.array(arg, dtype=np.int64)
    cost = evaluate(flat, x)  # the optimum: no bound may pass it
    tol = 1e-9 * max(1.0, abs(cost))
    lower, node_terms, edge_terms = bounds.trws_bound(flat, 30)
    blocks, _, _ = dive.block_bound(flat, node_terms, edge_terms, x, budget=1e9)
    assert lower - tol <= blocks <= cost + tol
    found = dive.dive(flat, node_terms, edge_terms, lower - 1e-10 * abs(lower), x, cost, budget=1e9)
    if found is None:
        return
    assert lower - tol <= found.bound <= cost + tol
    if found.x is not None:
        assert evaluate(flat, found.x) == pytest.approx(found.cost)


def test_solve_dives_where_the_probe_leaves_a_gap(monkeypatch):
    # many odd cycles hung off one chain, with costs that keep the reductions from folding them away
    rng = np.random.default_rng(3)
    n_cycles, size = 12, 5
    nodes, edges = [], []
    for c in range(n_cycles):
        base = len(nodes)
        for i in range(size):
            nodes.append(Node(f"c{c}n{i}", rng.integers(0, 3, size=3).astype(float), np.zeros(3)))
        for i in range(size):
            table = rng.integers(0, 2, size=(3, 3)).astype(float) + 4.0 * np.eye(3)
            edges.append(Edge(base + i, base + (i + 1) % size, table))
            edges.append(Edge(base + i, base + (i + 2) % size, 4.0 * np.eye(3)))
        if c:
            edges.append(Edge(base - size, base, rng.integers(0, 3, size=(3, 3)).astype(float)))
    problem = Problem(tuple(nodes), tuple(edges), None, (), "cycles")
    monkeypatch.setattr(portfolio, "TINY_NODES", 0)  # not solved whole by CP-SAT at once
    monkeypatch.setattr(portfolio, "EXACT_NODES", 0)
    dived = []
    real = dive.dive
    monkeypatch.setattr(dive, "dive", lambda *a, **k: dived.append(real(*a, **k)) or dived[-1])
    sol = solve(problem, time_limit=20)
    assert dived and dived[0] is not None
    assert sol.stats["dive_node"] >= 0 and sol.stats["dive_bound"] > sol.stats["probe_bound"]
    assert sol.lower_bound <= sol.cost


def test_a_node_held_to_one_strategy_is_never_branched_on():
    flat = flatten(frustrated_cycle(5))
    x = np.zeros(flat.n, dtype=np.int64)
    _, node_terms, edge_terms = bounds.trws_bound(flat, 200)
    first = dive.gap_node(flat, node_terms, edge_terms, x)
    held = dive.fixed(flat, first, 0)
    _, node_terms, edge_terms = bounds.trws_bound(held, 200)
    assert dive.gap_node(held, node_terms, edge_terms, x) not in (None, first)


def cycles(count: int, size: int = 5, gap: int = 12) -> Problem:
    """``count`` frustrated odd cycles in a row, each joined to the next by a path of ``gap`` nodes that costs
    nothing (longer than a block grows, ``dive.BLOCK_RADIUS``)."""
    n = count * size + (count - 1) * gap
    nodes = tuple(Node(f"n{i}", np.array([0.0, 0.0]), np.zeros(2)) for i in range(n))
    edges = []
    for c in range(count):
        first = c * (size + gap)
        edges += [Edge(first + i, first + (i + 1) % size, DIFFER) for i in range(size)]
        if c < count - 1:
            path = [first] + list(range(first + size, first + size + gap)) + [first + size + gap]
            edges += [Edge(a, b, np.zeros((2, 2))) for a, b in zip(path, path[1:])]
    return Problem(nodes, tuple(edges), None, (), "odd cycles")


def test_blocks_bound_every_cycle_where_one_branching_bounds_one():
    flat = flatten(cycles(4))
    lower, node_terms, edge_terms = bounds.trws_bound(flat, 200)
    x = np.zeros(flat.n, dtype=np.int64)
    one = dive.dive(flat, node_terms, edge_terms, lower, x, evaluate(flat, x), budget=1e9)
    assert one.bound == pytest.approx(1.0, abs=1e-6)
    bound, work, stats = dive.block_bound(flat, node_terms, edge_terms, x, budget=1e9)
    assert stats["blocks_bounded"] == stats["block_count"] == 4
    assert bound == pytest.approx(4.0, abs=1e-6)  # the optimum: each cycle pays once
    assert work > 0
    # without the budget for a single block, the bound is the terms' least values: TRW-S's own
    bound, work, stats = dive.block_bound(flat, node_terms, edge_terms, x, budget=0.0)
    assert stats["blocks_bounded"] == 0 and work == 0.0 and bound == pytest.approx(lower)
