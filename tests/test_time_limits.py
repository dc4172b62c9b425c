"""Time-limited planning: deterministic work budgets give the same plan twice, and a tied model's limit holds."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve import planner
from shardsolve.encodings import portfolio

from test_tying import _stack_step  # noqa: I001 - an SGD step of repeated layers, for tying

MESH = "data=2,model=4"


ARGS = ([jax.ShapeDtypeStruct((32, 32), jnp.float32) for _ in range(6)], jax.ShapeDtypeStruct((16, 32), jnp.float32))


@pytest.fixture
def searched(monkeypatch):
    """The large-problem path (repair, descent, TRW-S, LNS) on a small model, so its time limit binds.

    Every decision is taken by deterministic work; the wall-clock safety net
    (``1.05 * limit + 1`` s) is widened so that a loaded machine cannot end a
    run early and the test checks the decisions, not the machine.
    """
    for name in ("TINY_NODES", "EXACT_NODES", "LARGE_NODES", "LP_MAX_NODES"):
        monkeypatch.setattr(portfolio, name, 0)
    monkeypatch.setattr(portfolio, "WALL_SLACK", 100.0)


def test_time_limited_plan_is_the_same_twice(searched):
    a, b = (shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), time_limit=1.0, tie=False)
            for _ in range(2))
    assert a.status == "feasible" and a.gap > 0  # the limit ended the search, not a proof
    assert dict(a.stats)["descent_steps"] > 0
    assert a.dumps() == b.dumps()  # byte for byte


def test_tied_model_under_a_time_limit_finishes_with_a_plan(searched):
    plans = [shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), time_limit=1.0)
             for _ in range(2)]
    stats = dict(plans[0].stats)
    assert "tying" in stats  # the tied search ran, its limit included
    assert plans[0].status in ("optimal", "feasible")
    assert plans[0].dumps() == plans[1].dumps()


def _recorded_limits(monkeypatch) -> list:
    """The time limit of every solve ``shardsolve.plan`` starts, in order."""
    limits, search = [], planner.search_once

    def recording(built, time_limit, *args, **kwargs):
        limits.append(time_limit)
        return search(built, time_limit, *args, **kwargs)

    monkeypatch.setattr(planner, "search_once", recording)
    return limits


def test_the_solves_of_a_memory_search_share_the_time_limit(monkeypatch):
    """Every re-solve of the compiled-memory search comes out of the one limit: ``time_limit`` bounds the call."""
    limits = _recorded_limits(monkeypatch)
    # A compiled program 30% over the model's peak, so that each plan overshoots and the limit is searched.
    monkeypatch.setattr(planner, "compiled_peak", lambda plan, args: int(1.3 * plan.cost.peak_memory))
    free = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False)
    limits.clear()
    try:
        plan = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False,
                               time_limit=8.0, memory_limit=int(0.7 * free.cost.peak_memory))
    except shardsolve.InfeasibleError as error:
        assert "compiled program fits" in str(error)
        plan = None
    # First the plan without the limit (its merge pricings' solves within its share), then the first
    # solve under the limit with its share, then the searched limits, one solve each.
    under = limits.index(8.0 * planner.FIRST_SOLVE_SHARE)
    assert 1 <= under and sum(limits[:under]) <= 8.0 * planner.UNLIMITED_SHARE * (1 + 1e-9)
    assert all(t == pytest.approx(8.0 * planner.LATER_SHARE) for t in limits[under + 1:])
    assert len(limits) - under >= 2  # the limit was searched
    if plan is not None:
        assert dict(plan.stats)["memory_rounds"] == len(limits) - under
    assert sum(limits) <= 8.0


def test_small_problems_are_searched_untied_under_a_memory_limit(monkeypatch):
    """Repeated layers are tied without a memory limit; under one, a problem of at most
    ``UNTIED_UNDER_LIMIT_NODES`` nodes is searched per layer, a larger one stays tied."""
    ties, search = [], planner.search_once

    def recording(built, time_limit, seed, tie, *args, **kwargs):
        ties.append((built.problem.usage_limit is not None, tie))
        return search(built, time_limit, seed, tie, *args, **kwargs)

    monkeypatch.setattr(planner, "search_once", recording)
    free = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")))
    assert "tying" in dict(free.stats) and ties and all(tie for _, tie in ties)
    limit = 1.2 * free.cost.peak_memory
    for nodes, tied in ((planner.UNTIED_UNDER_LIMIT_NODES, False), (0, True)):
        monkeypatch.setattr(planner, "UNTIED_UNDER_LIMIT_NODES", nodes)
        ties.clear()
        shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), memory_limit=limit,
                        memory_check="model")
        assert ties and all(tie == tied for limited, tie in ties if limited), ties
        assert any(limited for limited, _ in ties)


def test_a_small_compiled_overshoot_tightens_the_searched_limit_by_as_much(monkeypatch):
    """A program that compiles a few KiB over the limit: the next solve's limit is that much lower, not half (the
    search halved from zero, and lost its rounds to limits nothing fits); never below the arguments' floor."""
    solves, search = [], planner.search_once

    def recording(built, *args, **kwargs):
        solution = search(built, *args, **kwargs)
        if built.problem.usage_limit is not None:  # the limit, the plan's bound, the arguments' floor
            solves.append((built.problem.usage_limit, built.problem.peak_usage(solution.assignment),
                           planner.allocated_floor(built)))
        return solution

    free = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False)
    limit = int(0.7 * free.cost.peak_memory)
    monkeypatch.setattr(planner, "search_once", recording)
    monkeypatch.setattr(planner, "compiled_peak", lambda plan, args: limit + 4096)  # every program 4 KiB over
    with pytest.raises(shardsolve.InfeasibleError, match="compiled program fits"):
        shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False, time_limit=8.0,
                        memory_limit=limit)
    # nothing fits: the search goes on past MEMORY_ROUNDS while the time limit has room
    assert planner.MEMORY_ROUNDS < len(solves) <= planner.MEMORY_ROUNDS_UNFIT, solves
    hi = math.inf
    for (searched, bound, floor), (later, _, _) in zip(solves, solves[1:]):
        if not bound:  # no plan under that limit: from there on the interval is halved
            assert later == pytest.approx((max(searched, floor) + hi) / 2), solves
            break
        hi = min(hi, searched, bound)  # the least limit known to be too loose
        expected = hi - 4096 if hi - 4096 > floor else (floor + hi) / 2
        assert later == pytest.approx(expected), solves


def test_the_plan_without_the_limit_is_kept_where_it_fits_as_compiled(monkeypatch):
    """A limit the model's fastest plan breaks (as the model counts) but whose compiled program keeps: that plan,
    with no slower one searched for under the limit."""
    limits = _recorded_limits(monkeypatch)
    free = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False)
    limit = int(0.7 * free.cost.peak_memory)
    monkeypatch.setattr(planner, "compiled_peak", lambda plan, args: int(0.5 * plan.cost.peak_memory))
    limits.clear()
    plan = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False,
                           time_limit=8.0, memory_limit=limit)
    assert plan.cost == free.cost and plan.inputs == free.inputs
    assert plan.cost.peak_memory > limit >= dict(plan.stats)["compiled_peak_memory"]
    assert 8.0 * planner.FIRST_SOLVE_SHARE not in limits  # nothing solved under the limit
    # Without the compiled check the model's bound holds the limit: a slower plan, of less memory (the plan's
    # own count may pass the limit by a layout the reshard cache keeps, which the bound leaves out).
    held = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False,
                           time_limit=8.0, memory_limit=limit, memory_check="model")
    assert held.cost.peak_memory < free.cost.peak_memory and held.cost.total > free.cost.total


def test_the_first_solve_under_a_limit_has_the_models_overestimate_as_room(monkeypatch):
    """The model's bound errs high (operands counted twice): the first solve under a limit sees it raised by
    what the bound over-counts on the plan without the limit, as compiled; the plan kept fits as compiled."""
    seen, search = [], planner.search_once

    def recording(built, *args, **kwargs):
        seen.append(built.problem.usage_limit)
        return search(built, *args, **kwargs)

    monkeypatch.setattr(planner, "search_once", recording)
    free = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False)
    monkeypatch.setattr(planner, "compiled_peak", lambda plan, args: int(0.6 * plan.cost.peak_memory))
    # The plan without the limit compiles over it, priced with shared reshards or without (each read from the
    # value's own layout, as a limited problem prices it: ``planner.search_plan`` probes both).
    plain = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False,
                            memory_limit=2**40, memory_check="model")
    limit = int(0.8 * 0.6 * min(free.cost.peak_memory, plain.cost.peak_memory))
    seen.clear()
    plan = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False,
                           time_limit=8.0, memory_limit=limit)
    limited = [x for x in seen if x is not None]
    assert limited and limited[0] > limit
    assert dict(plan.stats)["compiled_peak_memory"] <= limit


def test_logical_rules_reference_solve_shares_the_time_limit(monkeypatch):
    pytest.importorskip("flax")
    from test_flax import _nnx_setup, _plan

    limits = _recorded_limits(monkeypatch)
    _, step, args = _nnx_setup()
    plan = _plan(step, args, logical_rules=True, time_limit=6.0)
    assert "logical_free_cost" in dict(plan.stats)  # the reference solve without the ties ran
    assert len(limits) >= 2 and sum(limits) <= 6.0


def test_a_spent_safety_net_still_gives_a_valid_answer(monkeypatch):
    """With nothing valid yet, the forbidden-pair repair runs past the wall-clock net: a valid answer first.

    On instance K (34,932 nodes) the least-usage start breaks forbidden pairs; with the net spent at once
    the repair used to stop before its first component, and CP-SAT's feasibility model then took minutes
    to build and found nothing.
    """
    from conftest import IOPDDL_DIR  # noqa: I001
    from shardsolve.encodings import solve
    from shardsolve.iopddl import read_iopddl

    path = IOPDDL_DIR / "asplos-2025-iopddl-K.json.gz"
    if not path.exists():
        pytest.skip("the shared IOPDDL instances are not here")
    problem = read_iopddl(path)
    monkeypatch.setattr(portfolio, "WALL_SLACK", 0.0)  # the safety net spent from the start
    monkeypatch.setattr(portfolio, "WALL_EXTRA", 0.0)
    solution = solve(problem, time_limit=10.0)
    assert solution.status == "feasible" and solution.assignment
    assert problem.evaluate(solution.assignment) == solution.cost < float("inf")


def test_the_solves_of_one_call_share_one_wall_clock_net(monkeypatch):
    """Each solve's net is what the call's (``1.05 * limit + 1`` s of solving in all) has left, at most its own."""
    from shardsolve import encodings

    calls, solve = [], encodings.solve

    def recording(problem, **options):
        started = time.perf_counter()
        try:
            return solve(problem, **options)
        finally:
            calls.append((options.get("time_limit"), options.get("wall_limit"), time.perf_counter() - started))

    monkeypatch.setattr(encodings, "solve", recording)
    monkeypatch.setattr(planner, "compiled_peak", lambda plan, args: int(1.3 * plan.cost.peak_memory))
    free = shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False)
    calls.clear()
    limit = 8.0
    try:
        shardsolve.plan(_stack_step, *ARGS, mesh=MESH, in_shardings=(None, P("data")), tie=False, time_limit=limit,
                        memory_limit=int(0.7 * free.cost.peak_memory))
    except shardsolve.InfeasibleError:
        pass
    assert len(calls) >= 2  # the memory search re-solved
    net, spent = portfolio.WALL_SLACK * limit + portfolio.WALL_EXTRA, 0.0
    for share, wall, seconds in calls:
        assert wall is not None
        assert wall <= portfolio.WALL_SLACK * share + portfolio.WALL_EXTRA + 1e-9  # at most the solve's own net
        assert wall <= net - spent + 1e-9  # at most what the call's net has left
        spent += seconds
