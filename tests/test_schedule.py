"""The reshard schedule: built once from a plan's own data, priced by the plan, executed by the rewriter."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from lower_cases import check_lowering, greedy_solver, plan_with_solver, random_solver

import shardsolve
from shardsolve.plan import Plan, predicted_collectives
from shardsolve.schedule import ARGUMENT, LOOP_INVARIANTS, OPERANDS, OUTPUT, Site, build_schedule

MESH = "data=2,model=4"


def _layers(w, ws, x):
    def body(h, wl):
        return jnp.tanh(h @ wl + h @ w), jnp.sum(h, axis=0)

    h, ys = jax.lax.scan(body, x, ws)
    return jnp.mean(h**2), ys


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (16, 16)) / 4, jax.random.normal(k[1], (4, 16, 16)) / 4,
            jax.random.normal(k[2], (32, 16)))


@pytest.fixture(scope="module")
def scan_plan():
    """A scan that closes over ``w`` and reads it in a layout it does not enter in (random strategies)."""
    args = _args()
    for seed in range(40):
        plan = plan_with_solver(random_solver(seed), _layers, *args, mesh=MESH, in_shardings=(P("model"), None, None))
        if any(d.site.kind == LOOP_INVARIANTS and d.collective_steps for d in plan.schedule().demands):
            return plan, args
    pytest.fail("no random plan reshards a loop invariant with a collective")


def test_plan_collectives_are_the_schedule_priced(scan_plan):
    plan, _ = scan_plan
    schedule = plan.schedule()
    assert predicted_collectives(schedule, plan.mesh) == plan.collectives
    steps = list(schedule.collective_steps())
    assert [(s.kind, s.axes, s.bytes, d.consumer) for d, s in steps] == \
           [(c.kind, c.axes, c.bytes, c.consumer) for c in plan.collectives]


def test_pricing_is_separate_from_building(scan_plan):
    """Another cost function prices the same demands: here one second per run of each collective."""
    plan, _ = scan_plan
    flat = predicted_collectives(plan.schedule(), plan.mesh, time=lambda kind, axes, nbytes, mesh: 1.0)
    assert [c.time for c in flat] == [float(c.repeats) for c in plan.collectives]
    assert any(c.repeats == 4 for c in flat) and any(c.repeats == 1 for c in flat)


def test_a_loaded_plan_gets_the_same_schedule(scan_plan, tmp_path):
    plan, args = scan_plan
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = shardsolve.load_plan(path, _layers, *args)
    assert loaded.schedule() == plan.schedule()
    again = Plan.from_json(json.loads(plan.dumps())).bind(_layers, *args)
    assert build_schedule(again.graph, again.mesh, again.inputs, again.consts, again.outputs, again.ops) == \
           plan.schedule()


def test_demands_say_where_they_run(scan_plan):
    plan, _ = scan_plan
    schedule = plan.schedule()
    scan = next(op for op in plan.graph.ops if op.primitive == "scan")
    body = plan.graph.body(scan)
    inner = (scan.id,)
    body_demands = [d for d in schedule.demands if d.site.scope == inner]
    assert body_demands and all(d.repeats == 4 for d in body_demands)  # the body runs length times
    assert {d.site.kind for d in body_demands} <= {OPERANDS, OUTPUT}
    hoisted = schedule.at(Site((), LOOP_INVARIANTS, scan.id))
    assert hoisted and all(d.repeats == 1 and d.into in body.inputs + body.consts for d in hoisted)
    assert all("before the loop" in d.consumer for d in hoisted)
    # the body reads each hoisted layout without resharding it again
    for d in hoisted:
        reads = [b for b in body_demands if b.value == d.into and b.target == d.target]
        assert all(not b.steps for b in reads)
    outputs = [d for d in schedule.demands if d.site == Site((), OUTPUT, d.site.index)]
    assert [d.consumer for d in outputs] == [f"outputs[{k}]" for k in range(len(plan.graph.outputs))]


def test_the_rewriter_runs_exactly_the_schedule(scan_plan):
    plan, args = scan_plan
    outcome = check_lowering(plan, args)
    assert outcome.numerics_ok and outcome.predicted == outcome.lowered and outcome.predicted


def test_uneven_argument_arrives_evened_and_is_cut_locally():
    x = jax.random.normal(jax.random.key(3), (10, 6))
    w = jax.random.normal(jax.random.key(4), (6, 6))
    plan = plan_with_solver(greedy_solver(), lambda x, w: jnp.tanh(x @ w), x, w, mesh=MESH,
                            in_shardings=(P("model"), None))
    (arrival,) = plan.schedule().at(Site((), ARGUMENT, 0))
    assert arrival.source == arrival.target.evened((10, 6), plan.mesh) != arrival.target
    assert arrival.steps and all(s.kind == "slice" for s in arrival.steps)
    outcome = check_lowering(plan, (x, w))
    assert outcome.numerics_ok and outcome.predicted == outcome.lowered


def test_an_unbound_plan_has_no_schedule(scan_plan):
    plan, _ = scan_plan
    with pytest.raises(shardsolve.ShardsolveError, match="not bound"):
        Plan.from_json(json.loads(plan.dumps())).schedule()


def _shared(x, w, v):
    y = x @ w  # a pending sum over "model", read by three operations
    return jnp.sin(y) @ v + jnp.cos(y) * 2.0, jnp.tanh(y).sum(0)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_reshard_starts_from_the_cheapest_layout_made(seed):
    """A read in a layout not yet made reshards from whichever layout of the value made so far reaches it for
    least (the solver prices a layout made once for several readers so), not only from the one it was made in
    or a layout on that path; the rewriter runs the same steps (random strategies)."""
    from shardsolve.cost import collective_time, reshard_steps, reshard_time

    k = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(k[0], (32, 64)), jax.random.normal(k[1], (64, 32)), jax.random.normal(k[2], (32, 32)))
    plan = plan_with_solver(random_solver(seed), _shared, *args, mesh=MESH,
                            in_shardings=(P(None, "model"), P("model", None), None))
    own = {v: r for op, op_plan in zip(plan.graph.ops, plan.ops) for v, r in zip(op.outputs, op_plan.results)}
    own |= dict(zip(plan.graph.inputs, plan.inputs))
    made: dict[int, list] = {}
    elsewhere = 0
    for d in plan.schedule().demands:
        value = plan.graph.values[d.value]
        layouts = made.setdefault(d.value, [own[d.value]])
        assert d.source in layouts
        paid = sum(collective_time(s.kind, s.axes, s.bytes, plan.mesh) for s in d.steps if s.is_collective)
        assert all(paid <= reshard_time(value.shape, value.itemsize, s, d.target, plan.mesh) * (1 + 1e-9)
                   for s in layouts)
        path = reshard_steps(value.shape, value.itemsize, own[d.value], d.target, plan.mesh) or ()
        elsewhere += d.source != own[d.value] and d.source not in [s.dst for s in path]
        layouts.extend(s.dst for s in d.steps if s.dst not in layouts)
    assert elsewhere  # some read starts from a layout off its own path
    outcome = check_lowering(plan, args)
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.predicted == outcome.lowered
