"""Time-limited planning: deterministic work budgets give the same plan twice, and a tied model's limit holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardsolve
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
