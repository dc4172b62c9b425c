"""``plan(..., hints=...)``: argument shardings known to be good, solved as a pinned candidate beside the free search."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P
from mlp_step import ARGS, BATCH, EXPERT, MESH, mlp_step

import shardsolve
from shardsolve import planner
from shardsolve.errors import InfeasibleError, ShardsolveError


def test_a_hinted_plan_is_no_slower_than_the_best_plan_with_those_argument_shardings():
    hinted = shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, hints=EXPERT, carry=[(0, 0)])
    pinned = shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=EXPERT, carry=[(0, 0)])
    free = shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, carry=[(0, 0)])
    stats = dict(hinted.stats)
    assert stats["hint"] in ("kept", "not kept")
    assert stats["hint_cost"] == pytest.approx(pinned.cost.total, rel=1e-9)  # the hinted search is the pinned one
    assert hinted.cost.total <= min(pinned.cost.total, free.cost.total) * (1 + 1e-9)
    assert hinted.in_shardings[1].spec == P("data")  # the user's pin holds


def test_the_hinted_search_starts_from_the_plan_without_the_hints(monkeypatch):
    """The hinted search's first solve starts from the first assignment the search without the hints found (its
    hinted arguments repaired by the solver), with or without a memory limit, and where that search then finds
    no plan that fits."""
    calls, search = [], planner.search_once

    def recording(built, *args, start=None, **kwargs):
        solution = search(built, *args, start=start, **kwargs)
        calls.append((len(built.problem.pins) > 1, start, tuple(solution.assignment)))
        return solution

    monkeypatch.setattr(planner, "search_once", recording)
    for limit in (None, "1GiB"):
        calls.clear()
        shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, hints=EXPERT, memory_limit=limit)
        free = [found for hinted, _, found in calls if not hinted]
        first_hinted = next(start for hinted, start, _ in calls if hinted)
        assert free and first_hinted is not None and tuple(first_hinted) in free, calls
    calls.clear()  # the search without the hints ends in no plan that fits
    monkeypatch.setattr(planner, "compiled_peak", lambda plan, args: 2**40)  # every plan compiles over
    with pytest.raises(InfeasibleError):
        shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, hints=EXPERT, memory_limit="1GiB")
    free = [found for hinted, _, found in calls if not hinted]
    assert free and any(hinted and start is not None and tuple(start) in free for hinted, start, _ in calls), calls


def test_the_hinted_plan_is_kept_where_the_search_without_it_finds_none(monkeypatch):
    """Where the search without the hints ends in ``InfeasibleError``, the hinted plan is the answer, its argument
    shardings the hinted ones; where both fail the first error is raised."""
    search = planner.search_plan

    def unhinted_fails(built, *args, **kwargs):
        if len(built.problem.pins) <= 1:  # only the batch pin: the search without the hints
            raise InfeasibleError("no plan satisfies the memory limit", ("memory limit",))
        return search(built, *args, **kwargs)

    monkeypatch.setattr(planner, "search_plan", unhinted_fails)
    plan = shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, hints=EXPERT)
    assert dict(plan.stats)["hint"] == "kept"
    assert plan.status == "feasible" and plan.lower_bound == 0.0  # optimal only with the hints pinned: no bound
    assert plan.in_shardings[0]["w1"].spec == P(None, "model") and plan.in_shardings[0]["w2"].spec == P("model")
    with pytest.raises(InfeasibleError, match="memory limit"):
        shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, hints=({"w1": None, "w2": None}, None))


def test_a_hint_naming_no_mesh_axis_is_one_line_naming_it():
    with pytest.raises(ShardsolveError, match="hints") as info:
        shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, hints=({"w1": P("nope"), "w2": None}, None))
    assert "\n" not in str(info.value)
