"""Every reduction is exact: brute-force optimum before == after, and lifted assignments keep their cost."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsolve.errors import InfeasibleError
from shardsolve.problem import FORBIDDEN, Edge, Node, Pin, Problem
from shardsolve.encodings.presolve import (
    drop_dominated,
    eliminate_low_degree,
    fold_and_eliminate,
    fold_fixed,
    fold_followers,
    memory_matters,
    merge_parallel_edges,
    reduce,
    restrict,
    split_components,
)


@st.composite
def small_problems(draw, max_nodes: int = 6, max_strategies: int = 3) -> Problem:
    """Random problems small enough to enumerate, with forbidden entries, pins and memory."""
    n = draw(st.integers(1, max_nodes))
    sizes = [draw(st.integers(1, max_strategies)) for _ in range(n)]
    cost = st.one_of(st.integers(0, 9).map(float), st.just(FORBIDDEN))
    nodes = []
    for i, s in enumerate(sizes):
        costs = np.array([draw(st.integers(0, 9).map(float) if k == 0 else cost) for k in range(s)])
        usages = np.array([float(draw(st.integers(0, 4))) for _ in range(s)])
        start = draw(st.integers(0, 4))
        end = draw(st.integers(start, 6))
        nodes.append(Node(f"n{i}", costs, usages, (start, end)))
    edges = []
    for _ in range(draw(st.integers(0, 2 * n))):
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        table = np.array([[draw(cost) for _ in range(sizes[v])] for _ in range(sizes[u])])
        # followers: sometimes make v a copy of u (one finite entry per row)
        if draw(st.booleans()) and sizes[u] == sizes[v] and u != v:
            table = np.where(np.eye(sizes[u]) > 0, table.clip(max=9.0), FORBIDDEN)
        edges.append(Edge(u, v, table))
    limit = draw(st.one_of(st.none(), st.integers(0, 12).map(float)))
    pins = []
    if draw(st.booleans()):
        i = draw(st.integers(0, n - 1))
        pins.append(Pin(i, (draw(st.integers(0, sizes[i] - 1)),), f"pin{i}"))
    return Problem(tuple(nodes), tuple(edges), limit, tuple(pins), "random")


def brute_force(problem: Problem) -> tuple[float, tuple[int, ...] | None]:
    best, arg = math.inf, None
    for x in itertools.product(*(range(n.num_strategies) for n in problem.nodes)):
        c = problem.evaluate(x)
        if c < best:
            best, arg = c, x
    return best, arg


def assert_exact(problem: Problem, reduction) -> None:
    opt, _ = brute_force(problem)
    try:
        reduced, step = reduction(problem)
    except InfeasibleError:
        assert opt == math.inf
        return
    red_opt, red_x = brute_force(reduced)
    if opt == math.inf:
        assert red_opt + step.offset == math.inf
        return
    assert red_opt + step.offset == pytest.approx(opt, rel=1e-12, abs=1e-9)
    lifted = step.lift(red_x)
    assert problem.evaluate(tuple(lifted)) == pytest.approx(opt, rel=1e-12, abs=1e-9)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(small_problems())
def test_restrict_is_exact(problem):
    assert_exact(problem, restrict)


@SETTINGS
@given(small_problems())
def test_merge_parallel_edges_is_exact(problem):
    assert_exact(_pinless(problem), merge_parallel_edges)


def _feasible_restrict(problem: Problem) -> bool:
    try:
        restrict(problem)
        return True
    except InfeasibleError:
        return False


def _pinless(problem: Problem) -> Problem:
    """Pins folded into forbidden costs (the later reductions expect ``restrict`` to have run)."""
    return restrict(problem)[0] if _feasible_restrict(problem) else Problem(problem.nodes, problem.edges, problem.usage_limit)


@SETTINGS
@given(small_problems())
def test_drop_dominated_is_exact(problem):
    assert_exact(_pinless(problem), drop_dominated)


@SETTINGS
@given(small_problems())
def test_fold_fixed_is_exact(problem):
    assert_exact(_pinless(problem), fold_fixed)


@SETTINGS
@given(small_problems())
def test_fold_followers_is_exact(problem):
    assert_exact(_pinless(problem), fold_followers)


@SETTINGS
@given(small_problems())
def test_eliminate_low_degree_is_exact(problem):
    assert_exact(_pinless(problem), eliminate_low_degree)


@SETTINGS
@given(small_problems())
def test_fold_and_eliminate_is_exact(problem):
    assert_exact(_pinless(problem), fold_and_eliminate)


def _restrict_by_sweeps(problem: Problem) -> list[np.ndarray]:
    """Arc consistency and the memory test by whole sweeps to a fixpoint (the plain definition)."""
    ok = [np.asarray(n.costs) < FORBIDDEN for n in problem.nodes]
    for pin in problem.pins:
        mask = np.zeros(len(ok[pin.node]), dtype=bool)
        mask[list(pin.allowed)] = True
        ok[pin.node] &= mask
    changed = True
    while changed and all(m.any() for m in ok):
        changed = False
        for e in problem.edges:
            fin = np.asarray(e.costs) < FORBIDDEN
            if e.u == e.v:
                good = np.diag(fin) & ok[e.u]
                changed |= not np.array_equal(good, ok[e.u])
                ok[e.u] = good
                continue
            sub = fin & ok[e.u][:, None] & ok[e.v][None, :]
            gu, gv = sub.any(axis=1) & ok[e.u], sub.any(axis=0) & ok[e.v]
            changed |= not (np.array_equal(gu, ok[e.u]) and np.array_equal(gv, ok[e.v]))
            ok[e.u], ok[e.v] = gu, gv
        if problem.usage_limit is not None and all(m.any() for m in ok):
            horizon = max(n.interval[1] for n in problem.nodes)
            least = [float(n.usages[m].min()) for n, m in zip(problem.nodes, ok)]
            prof = np.zeros(horizon + 1)
            for n, u in zip(problem.nodes, least):
                prof[n.interval[0]:n.interval[1]] += u
            for i, n in enumerate(problem.nodes):
                s, e = n.interval
                if e > s:
                    rest = prof[s:e].max() - least[i]
                    good = ok[i] & (n.usages + rest <= problem.usage_limit * (1 + 1e-12))
                    changed |= not np.array_equal(good, ok[i])
                    ok[i] = good
    return ok


@SETTINGS
@given(small_problems())
def test_restrict_worklist_matches_sweeps(problem):
    """The worklist keeps exactly the strategies whole sweeps to a fixpoint keep."""
    want = _restrict_by_sweeps(problem)
    try:
        _, step = restrict(problem)
    except InfeasibleError:
        assert not all(m.any() for m in want)
        return
    assert [list(m) for m in step.strategy_maps] == [list(np.flatnonzero(m)) for m in want]


@SETTINGS
@given(small_problems())
def test_restrict_in_batches_matches_sweeps(problem):
    """Checking every dirty edge in batches (one numpy pass per table shape) keeps the same strategies."""
    want = _restrict_by_sweeps(problem)
    try:
        _, step = restrict(problem, batch_edges=1)
    except InfeasibleError:
        assert not all(m.any() for m in want)
        return
    assert [list(m) for m in step.strategy_maps] == [list(np.flatnonzero(m)) for m in want]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(max_nodes=7))
def test_reduce_driver_is_exact(problem):
    opt, _ = brute_force(problem)
    try:
        red = reduce(problem)
    except InfeasibleError:
        assert opt == math.inf
        return
    red_opt, red_x = brute_force(red.problem)
    if opt == math.inf:
        assert red_opt == math.inf
        return
    assert red_opt + red.offset == pytest.approx(opt, rel=1e-12, abs=1e-9)
    assert problem.evaluate(red.lift(red_x)) == pytest.approx(opt, rel=1e-12, abs=1e-9)
    assert red.stats["nodes_before"] == len(problem.nodes)
    assert red.stats["nodes_after"] == len(red.problem.nodes)


@SETTINGS
@given(small_problems())
def test_split_components_is_exact(problem):
    opt, _ = brute_force(problem)
    total = 0.0
    x = [0] * len(problem.nodes)
    for sub, index in split_components(problem):
        c, sx = brute_force(sub)
        total += c
        if sx is not None:
            for k, i in enumerate(index):
                x[i] = sx[k]
    assert total == pytest.approx(opt, rel=1e-12) if math.isfinite(opt) else total == math.inf
    if math.isfinite(opt):
        assert problem.evaluate(tuple(x)) == pytest.approx(opt, rel=1e-12)


def _chain(n: int, limit: float | None = None) -> Problem:
    nodes = tuple(Node(f"n{i}", np.array([1.0, 2.0, 0.5]), np.array([1.0, 1.0, 3.0]), (i, i + 2)) for i in range(n))
    table = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]])
    edges = tuple(Edge(i, i + 1, table) for i in range(n - 1))
    return Problem(nodes, edges, limit)


def test_chain_without_memory_reduces_to_nothing():
    red = reduce(_chain(12))
    assert red.stats["decisions_after"] == 0
    x = red.lift(np.zeros(len(red.problem.nodes), dtype=int))
    assert _chain(12).evaluate(x) == pytest.approx(6.0)  # every node at its cheapest, no edge cost


def test_memory_keeps_nodes_whose_usage_matters():
    p = _chain(6, limit=4.0)
    assert memory_matters(p).all()
    red = reduce(p)
    assert red.stats["decisions_after"] > 0  # strategy 2 (usage 3) competes for memory


def test_slack_memory_does_not_block_elimination():
    p = _chain(6, limit=100.0)
    assert not memory_matters(p).any()
    assert reduce(p).stats["decisions_after"] == 0


def test_dominated_strategy_with_lower_usage_is_kept():
    # strategy 1 costs more but uses less memory: not dominated while memory matters
    nodes = (
        Node("a", np.array([1.0, 2.0]), np.array([5.0, 1.0]), (0, 1)),
        Node("b", np.array([0.0, 0.0]), np.array([5.0, 1.0]), (0, 1)),
    )
    p = Problem(nodes, (Edge(0, 1, np.zeros((2, 2))),), usage_limit=6.0)
    reduced, _ = drop_dominated(p)
    assert reduced.nodes[0].num_strategies == 2


def test_restrict_reports_an_empty_node():
    nodes = (Node("a", np.array([FORBIDDEN, FORBIDDEN]), np.zeros(2), (0, 1)),)
    with pytest.raises(InfeasibleError):
        restrict(Problem(nodes))
