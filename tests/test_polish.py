"""Least memory among equal costs (``encodings.polish``): on small problems, and on a plan."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve.encodings.polish import polish_usage
from shardsolve.problem import FORBIDDEN, Edge, Node, Pin, Problem


def _node(name, costs, usages, interval=(0, 2)):
    return Node(name, np.array(costs, float), np.array(usages, float), interval)


def test_equal_costs_move_to_the_least_usage():
    a = _node("a", [1.0, 1.0, 1.0], [10.0, 4.0, 1.0])
    b = _node("b", [0.0, 0.0], [0.0, 0.0])
    # a's third strategy costs more next to b's current strategy: it stays out of reach
    problem = Problem((a, b), (Edge(0, 1, np.array([[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]])),))
    assignment, moved = polish_usage(problem, (0, 0))
    assert assignment == (1, 0) and moved == 1
    assert problem.evaluate(assignment) == problem.evaluate((0, 0))


def test_pins_and_rising_usage_hold():
    a = _node("a", [1.0, 1.0], [10.0, 1.0])
    b = _node("b", [1.0, 1.0], [10.0, 1.0])
    problem = Problem((a, b), (), pins=(Pin(0, (0,), "pinned"),))
    assignment, moved = polish_usage(problem, (0, 0))
    assert assignment == (0, 1) and moved == 1  # the pinned node stays, the free one moves


def test_identity_joined_nodes_move_together():
    op = _node("op", [2.0, 2.0], [8.0, 8.0])
    operands = _node("op operands", [0.0, 0.0], [6.0, 1.0])
    same = np.where(np.eye(2, dtype=bool), 0.0, FORBIDDEN)
    problem = Problem((op, operands), (Edge(0, 1, same),))
    assignment, moved = polish_usage(problem, (0, 0))
    assert assignment == (1, 1) and moved == 1  # alone, neither could leave strategy 0


def test_a_move_that_raises_a_members_usage_is_not_made():
    op = _node("op", [2.0, 2.0], [1.0, 8.0], (0, 1))
    operands = _node("op operands", [0.0, 0.0], [9.0, 0.0], (1, 2))
    same = np.where(np.eye(2, dtype=bool), 0.0, FORBIDDEN)
    problem = Problem((op, operands), (Edge(0, 1, same),))
    assert polish_usage(problem, (0, 0)) == ((0, 0), 0)  # less in sum, but more in op's own interval


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_random_problems_keep_cost_and_never_raise_usage(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 8))
    sizes = rng.integers(1, 4, size=n)
    nodes = tuple(_node(f"n{i}", rng.integers(0, 3, size=s).astype(float), rng.integers(0, 5, size=s).astype(float),
                        (int(i), int(i) + 2)) for i, s in enumerate(sizes))
    edges = []
    for u in range(n):
        for v in range(u + 1, n):
            if rng.random() < 0.4:
                edges.append(Edge(u, v, rng.integers(0, 3, size=(sizes[u], sizes[v])).astype(float)))
    problem = Problem(nodes, tuple(edges))
    start = tuple(int(rng.integers(0, s)) for s in sizes)
    assignment, _ = polish_usage(problem, start)
    assert problem.evaluate(assignment) <= problem.evaluate(start)
    for node, s0, s1 in zip(nodes, start, assignment):
        assert node.usages[s1] <= node.usages[s0]


def test_a_plan_keeps_no_buffer_its_time_does_not_need():
    def f(x, i):
        # a zero buffer that rows are added into: made whole and sliced, or made split, it costs the same time
        return jnp.zeros((64, 512)).at[jnp.arange(64), i].add(x)

    x, i = jnp.ones((64,)), jnp.zeros((64,), jnp.int32)
    plan = shardsolve.plan(f, x, i, mesh="x=8", in_shardings=(P("x"), P("x")), out_shardings=P("x"))
    whole = 64 * 512 * 4
    assert plan.cost.peak_memory < whole  # the zero buffer is made split, never whole


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_edge_reads_without_the_copied_tables_read_the_same_entries(seed):
    """``edge_reads(copy=False)`` (polish's: each edge's own table, a column and a row per read) adds the same
    floats as reading the tables copied into one array, in the same order."""
    from shardsolve.encodings.flat import edge_reads

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    sizes = rng.integers(1, 6, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    m = int(rng.integers(1, 14))
    eu, ev = rng.integers(0, n, m), rng.integers(0, n, m)
    tables = [rng.standard_normal((sizes[u], sizes[v])) * 10.0 ** rng.integers(-6, 6) for u, v in zip(eu, ev)]
    edges = np.flatnonzero(rng.random(m) < 0.7)
    copied = edge_reads(eu, ev, sizes, offsets, tables, edges)
    held = edge_reads(eu, ev, sizes, offsets, tables, edges, copy=False)
    for _ in range(3):
        x = np.array([rng.integers(0, s) for s in sizes])
        base = rng.standard_normal(int(sizes.sum()))
        assert np.array_equal(copied.add(base.copy(), x), held.add(base.copy(), x))
