"""Layer tying: repeated layers found, tied plans valid and priced on the untied problem, honest status."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve.encodings import portfolio, solve
from shardsolve.encodings.flat import flatten
from shardsolve.encodings.presolve import reduce
from shardsolve.encodings.tying import layer_classes, merge, origins, solve_tied, tie, trws_bound
from shardsolve.graph import Graph
from shardsolve.mesh import MeshSpec
from shardsolve.planner import build_problem
from shardsolve.problem import Edge, Node, Problem
from shardsolve.trace import trace

MESH = "data=2,model=4"
N_LAYERS = 6
D = 32


def _stack_step(params, x):
    """An SGD step of a stack of identical tanh layers (unrolled)."""

    def loss(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x * x)

    grads = jax.grad(loss)(params, x)
    return [w - 0.1 * g for w, g in zip(params, grads)]


def _stack_args():
    params = [jax.ShapeDtypeStruct((D, D), jnp.float32) for _ in range(N_LAYERS)]
    return params, jax.ShapeDtypeStruct((16, D), jnp.float32)


def _stack_built():
    params, x = _stack_args()
    graph = Graph.from_traced(trace(_stack_step, params, x))
    mesh = MeshSpec.parse(MESH)
    built = build_problem(graph, mesh, [(None, "")] * len(graph.inputs), [(None, "")] * len(graph.outputs))
    return graph, built


def _plan(fun, *args, **kw):
    return shardsolve.plan(fun, *args, mesh=MESH, time_limit=20, **kw)


def test_chain_ends_keep_their_own_colours():
    chain = Problem(
        tuple(Node(f"n{i}", np.array([1.0, 2.0]), np.zeros(2)) for i in range(12)),
        tuple(Edge(i, i + 1, np.array([[0.0, 1.0], [1.0, 0.0]])) for i in range(11)),
    )
    assert layer_classes(chain, rounds=1) == [tuple(range(1, 11))]  # the ends have one neighbour each


def test_finds_the_layers_of_a_stack():
    graph, built = _stack_built()
    classes = layer_classes(built.problem)
    assert classes
    big = [c for c in classes if len(c) >= N_LAYERS - 2]
    assert big, [len(c) for c in classes]
    for cls in classes:
        # Only nodes with identical strategy lists are tied, each in a different layer.
        labels = {built.problem.nodes[i].labels for i in cls}
        assert len(labels) == 1
    # The weights of the middle layers correspond to each other.
    weight_nodes = {built.value_node[v] for v in graph.inputs[1:N_LAYERS - 1]}
    assert any(weight_nodes <= set(c) for c in classes)


def test_tied_solution_is_priced_on_the_untied_problem():
    _, built = _stack_built()
    problem = built.problem
    tied = solve_tied(problem, time_limit=20)
    assert tied is not None
    assert tied.cost == pytest.approx(problem.evaluate(tied.assignment), rel=1e-12)
    assert tied.stats["tied_nodes"] > 0 and tied.stats["tying"] in ("exact", "restricted")
    untied = solve(problem, time_limit=20)
    assert untied.status == "optimal"
    # Honest: the bound never exceeds the untied optimum, and "optimal" means it is the untied optimum.
    assert tied.lower_bound <= untied.cost * (1 + 1e-9)
    if tied.status == "optimal":
        assert tied.cost == pytest.approx(untied.cost, rel=1e-9)
        # "exact" where the tied plan itself is optimal; the pruned untied search may beat it ("restricted")
        assert (tied.stats["tying"] == "exact") == (tied.stats["tied_cost"] <= tied.cost * (1 + 1e-9))


def test_a_deferred_bound_certifies_as_the_bound_in_one_call_does():
    """``solve_tied(certify=False)`` stops at the tied plan (a bound without search, its bound's work reserved);
    ``certify`` with that reserve gives what ``solve_tied`` gives in one call, and other solutions pass through."""
    from shardsolve.encodings.tying import certify

    _, built = _stack_built()
    problem = built.problem
    whole = solve_tied(problem, time_limit=20)
    deferred = solve_tied(problem, time_limit=20, certify=False)
    assert deferred.stats["tie_bound"] == "deferred" and deferred.status == "feasible"
    assert 0.0 <= deferred.lower_bound <= deferred.cost and deferred.stats["bound_reserve_s"] > 0
    assert deferred.cost == pytest.approx(problem.evaluate(deferred.assignment), rel=1e-12)
    done = certify(problem, deferred)
    assert (done.assignment, done.cost, done.lower_bound, done.status) == (
        whole.assignment, whole.cost, whole.lower_bound, whole.status)
    assert done.stats["tie_bound"] == whole.stats["tie_bound"] and "bound_reserve_s" not in done.stats
    assert certify(problem, done) is done


def test_the_untied_bound_run_ahead_is_the_bound_run_after(monkeypatch):
    """The untied bound's passes started on a second thread while the tied problem is solved
    (``tying.BoundAhead``) certify what the passes run after the tied solve do; a bound started and not
    taken is stopped."""
    import threading
    import time

    from shardsolve.encodings import tying

    def running() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "shardsolve-untied-bound"]

    import sys

    _, built = _stack_built()
    problem = built.problem
    switching = sys.getswitchinterval()
    ahead = solve_tied(problem, time_limit=20)
    deferred = solve_tied(problem, time_limit=20, certify=False)
    assert running()  # waiting for the tied plan's cost, which no ``certify`` will bring
    assert sys.getswitchinterval() <= tying.AHEAD_SWITCH_INTERVAL
    tying.cancel_ahead()
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not running() and sys.getswitchinterval() == switching
    monkeypatch.setattr(tying, "AHEAD", False)
    after = solve_tied(problem, time_limit=20)
    assert not running()
    assert (ahead.assignment, ahead.cost, ahead.lower_bound, ahead.status) == (
        after.assignment, after.cost, after.lower_bound, after.status)
    assert ahead.stats["tie_bound"] == after.stats["tie_bound"]
    assert deferred.stats["tie_bound"] == "deferred"


def test_tie_edges_fold_into_one_node_per_class():
    _, built = _stack_built()
    reduced = reduce(built.problem)
    tied = tie(reduced, layer_classes(built.problem))
    assert tied.tied_nodes > 0
    assert len(tied.problem.edges) == len(reduced.problem.edges) + tied.tied_nodes
    folded = reduce(tied.problem)
    assert folded.stats["decisions_after"] < reduced.stats["decisions_after"]
    orig, smaps = origins(reduced)
    assert len(orig) == len(reduced.problem.nodes) and len(set(orig.tolist())) == len(orig)
    for j, node in enumerate(reduced.problem.nodes):
        assert len(smaps[j]) == node.num_strategies


def test_merging_the_ties_is_the_tied_problem():
    _, built = _stack_built()
    reduced = reduce(built.problem)
    tied = tie(reduced, layer_classes(built.problem))
    merged, lift = merge(reduced.problem, tied.pairs)
    assert len(merged.nodes) == len(reduced.problem.nodes) - tied.tied_nodes
    with_edges = solve(tied.problem, time_limit=20)
    folded = solve(merged, time_limit=20)
    assert with_edges.status == folded.status == "optimal"
    x = lift(folded.assignment)
    # The same optimum, and the lifted assignment keeps every tie.
    assert tied.problem.evaluate(x) == pytest.approx(with_edges.cost, rel=1e-12)
    assert merged.evaluate(folded.assignment) == pytest.approx(reduced.problem.evaluate(x), rel=1e-12)


def _repeated_with_memory(n: int = 12) -> Problem:
    """Identical nodes in a chain, all live together: fast (cost 1, 10 bytes) or lean (cost 2, 1 byte).

    With room for five fast ones the untied optimum is 5 * 1 + 7 * 2 = 19. The
    middle eight nodes tie (the two at each end look different), so a tied
    plan has four fast nodes at most: 4 * 1 + 8 * 2 = 20.
    """
    nodes = tuple(Node(f"n{i}", np.array([1.0, 2.0]), np.array([10.0, 1.0]), (0, 2)) for i in range(n))
    edges = tuple(Edge(i, i + 1, np.zeros((2, 2))) for i in range(n - 1))
    return Problem(nodes, edges, usage_limit=5 * 10.0 + 7 * 1.0)


def test_tying_that_restricts_is_reported_and_beaten():
    problem = _repeated_with_memory()
    assert layer_classes(problem)
    tied = solve_tied(problem, time_limit=10)
    assert tied is not None
    assert tied.stats["tying"] == "restricted"
    assert tied.stats["tied_cost"] == pytest.approx(20.0)  # the tied optimum is worse than the untied one ...
    assert tied.cost == pytest.approx(problem.evaluate(tied.assignment))
    # ... and the untied search near the bound finds the untied optimum, proven.
    assert tied.cost == pytest.approx(19.0) and tied.status == "optimal"


def test_trws_bound_is_a_bound_and_tight_on_a_tree():
    rng = np.random.default_rng(0)
    nodes = tuple(Node(f"n{i}", rng.random(3), np.zeros(3)) for i in range(7))
    edges = tuple(Edge(i, 2 * i + 1 if 2 * i + 1 < 7 else 0, rng.random((3, 3))) for i in range(3))
    edges += tuple(Edge(i, 2 * i + 2, rng.random((3, 3))) for i in range(3))
    problem = Problem(nodes, edges)
    best = solve(problem, time_limit=10)
    bound, _, _ = trws_bound(flatten(problem), passes=40)
    assert bound <= best.cost + 1e-12
    assert bound == pytest.approx(best.cost, rel=1e-9)  # a tree: the LP is tight and TRW-S reaches it


def test_plan_with_tying_is_valid_and_honest():
    params, x = _stack_args()
    plan = _plan(_stack_step, params, x, in_shardings=(None, P("data")))
    stats = dict(plan.stats)
    assert stats["tied_nodes"] > 0 and stats["tying"] in ("exact", "restricted")
    untied = _plan(_stack_step, params, x, in_shardings=(None, P("data")), tie=False)
    assert "tying" not in dict(untied.stats)
    assert plan.cost.total <= untied.cost.total * (1 + 1e-9) or plan.status != "optimal"
    assert plan.lower_bound <= untied.cost.total * (1 + 1e-9)
    if plan.status == "optimal" and untied.status == "optimal":
        assert plan.cost.total == pytest.approx(untied.cost.total, rel=1e-9)


def test_model_without_repetition_is_unchanged(tmp_path):
    def f(x, w):
        return jnp.tanh(x @ w).sum(axis=0)

    args = (jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    tied = _plan(f, *args)
    untied = _plan(f, *args, tie=False)
    assert "tying" not in dict(tied.stats)
    tied.save(tmp_path / "a.json")
    untied.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_tied_plans_are_deterministic(tmp_path):
    params, x = _stack_args()
    for name in ("a.json", "b.json"):
        _plan(_stack_step, params, x, in_shardings=(None, P("data"))).save(tmp_path / name)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


STACK_MODEL = """
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import shardsolve

def stack(size="small"):
    def step(params, x):
        def loss(params, x):
            for w in params:
                x = jnp.tanh(x @ w)
            return jnp.mean(x * x)
        grads = jax.grad(loss)(params, x)
        return [w - 0.1 * g for w, g in zip(params, grads)]
    params = [jax.ShapeDtypeStruct((32, 32), jnp.float32) for _ in range(6)]
    return shardsolve.Model(step, (params, jax.ShapeDtypeStruct((16, 32), jnp.float32)), (None, P("data")))
"""


def test_cli_no_tie(capsys, tmp_path):
    """On a model with repeated layers: tied by default, untied with --no-tie."""
    import json

    from shardsolve.cli import main

    model = tmp_path / "stack.py"
    model.write_text(STACK_MODEL)
    for flags, tied in (([], True), (["--no-tie"], False)):
        out = tmp_path / "plan.json"
        assert main(["plan", str(model), "--mesh", MESH, "--time-limit", "20", *flags, "-o", str(out)]) == 0
        assert ("tying" in capsys.readouterr().out) == tied
        assert ("tying" in json.loads(out.read_text())["stats"]) == tied


@pytest.mark.parametrize("limited", [False, True])
def test_a_tied_search_from_a_tied_plan_never_ends_above_it(limited, monkeypatch):
    """``start`` reaches the tied problem: merged (no memory limit) or with tie edges (a limit the start meets)."""
    _, built = _stack_built()
    problem = built.problem
    first = solve_tied(problem, time_limit=5, certify=False)  # a tied plan: members take their representative's
    if limited:  # a tied plan of the problem under a limit it meets (the ties its reductions leave)
        problem = dataclasses.replace(problem, usage_limit=problem.peak_usage(first.assignment))
        first = solve_tied(problem, time_limit=5, certify=False)
    for name in ("TINY_NODES", "LP_MAX_NODES"):  # the search path, where starts count (not the exact solves)
        monkeypatch.setattr(portfolio, name, 0)
    again = solve_tied(problem, time_limit=0.01, start=first.assignment)
    assert again.stats["tied_start_cost"] == pytest.approx(first.cost, rel=1e-9)
    assert again.cost <= first.cost * (1 + 1e-12)
    assert again.cost == pytest.approx(problem.evaluate(again.assignment), rel=1e-12)
