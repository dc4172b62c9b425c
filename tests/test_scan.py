"""``scan`` bodies are planned once: carry shardings are fixed points, and ``plan.jit()`` pins the loop's body."""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from lower_cases import check_lowering

import shardsolve
from shardsolve.build import build_problem
from shardsolve.plan import Plan
from shardsolve.problem import FORBIDDEN
from shardsolve.sharding import Sharding

MESH = "data=2,model=4"


def _layers(ws, bs, x):
    def body(h, p):
        w, b = p
        h = jnp.tanh(h @ w + b)
        return h, jnp.sum(h, axis=0)

    h, ys = jax.lax.scan(body, x, (ws, bs))
    return jnp.mean(h**2), ys


def _args(layers=8, d=64, batch=32):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k1, (layers, d, d)) / d**0.5, 0.1 * jax.random.normal(k2, (layers, d)),
            jax.random.normal(k3, (batch, d)))


def _close(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-5)


@pytest.fixture(scope="module")
def planned():
    args = _args()
    plan = shardsolve.plan(_layers, *args, mesh=MESH, in_shardings=(None, None, P("data")), time_limit=10)
    return plan, args


def test_scan_body_planned_once_with_fixed_point_carry(planned):
    plan, args = planned
    assert plan.status in ("optimal", "feasible")
    assert plan.fallbacks == ()
    scans = [o for o in plan.ops if o.primitive == "scan"]
    assert len(scans) == 1
    scan = scans[0]
    assert scan.length == 8 and not scan.fallback
    body = plan.graph.body(next(op for op in plan.graph.ops if op.primitive == "scan"))
    assert [o.primitive for o in scan.body] == [op.primitive for op in body.ops]  # each body op once
    assert sum(o.primitive == "dot_general" for o in scan.body) == 1
    # operands: ws, bs (stacked, layer dim unsplit), then the carry x; results: carry, ys
    n_consts, n_carry = 0, 1
    carry_in, carry_out = scan.operands[n_consts], scan.results[0]
    assert carry_in == carry_out
    assert all(s.dims[0] == () for s in scan.operands[n_consts + n_carry:] + scan.results[n_carry:])
    assert plan.inputs[2] == Sharding.from_spec(P("data"), 2)


def test_scan_plan_matches_numerics(planned):
    plan, args = planned
    expected = jax.jit(_layers)(*args)
    _close(plan.jit()(*args), expected)
    outcome = check_lowering(plan, args, expected)
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)


def test_scan_plan_no_worse_than_fallback(planned):
    plan, args = planned
    old = shardsolve.plan(_layers, *args, mesh=MESH, in_shardings=(None, None, P("data")), time_limit=10,
                          expand_scans=False)
    assert old.fallbacks == (("scan", 1),)
    assert plan.cost.total <= old.cost.total * (1 + 1e-9)
    assert plan.cost.total == pytest.approx(plan.cost.compute + plan.cost.communication)


def test_scan_collectives_repeat_per_iteration_and_plan_round_trips(planned):
    plan, args = planned
    for c in plan.collectives:
        assert c.repeats in (1, 8)
        if c.repeats == 8:
            assert c.consumer.startswith("%") and " scan/" in c.consumer
    back = Plan.from_json(json.loads(plan.dumps()))
    assert back.ops == plan.ops and back.collectives == plan.collectives
    bound = back.bind(_layers, *args)
    _close(bound.jit()(*args), jax.jit(_layers)(*args))


def test_scan_transformer_small_plans_and_matches(models_dir):
    model = shardsolve.load_model(str(models_dir / "scan_transformer.py"), "small")
    plan = shardsolve.plan(
        model.fun, *model.args, mesh=MESH, in_shardings=model.in_shardings,
        out_shardings=model.out_shardings, carry=model.carry, time_limit=10,
    )
    assert plan.status in ("optimal", "feasible")
    scans = [o for o in plan.ops if o.primitive == "scan"]
    assert len(scans) == 2 and all(s.body and s.length == 8 for s in scans)
    expected = jax.jit(model.fun)(*model.args)
    _close(plan.jit()(*model.args), expected)
    outcome = check_lowering(plan, model.args, expected)
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)


def test_scan_lowered_by_the_rewriter_matches_prediction(planned):
    from shardsolve import hlo

    plan, args = planned
    run = shardsolve.lower(plan)
    _close(run(*args), jax.jit(_layers)(*args))
    lowered = hlo.collectives_from_hlo(run.lower(*args).compile().as_text(), plan.mesh)
    assert hlo.inventory(lowered, plan.mesh) == hlo.inventory(plan.collectives, plan.mesh)


def _scan_reads(w, x, length):
    def body(h, _):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, None, length=length)
    return h


def _body_edges(length):
    """{(boundary node kind, body primitive): edge table} of a scan over ``length`` iterations reading ``w``."""
    from shardsolve.graph import Graph
    from shardsolve.mesh import MeshSpec
    from shardsolve.trace import trace

    w, x = jnp.ones((16, 16)), jnp.ones((32, 16))
    graph = Graph.from_traced(trace(partial(_scan_reads, length=length), w, x))
    built = build_problem(graph, MeshSpec.parse(MESH), [(None, "")] * 2, [(None, "")])
    (sn,) = built.scans.values()
    body_nodes = {idx: sn.body.ops[op_id].primitive for op_id, idx in sn.op_node.items()}
    out = {}
    for e in built.problem.edges:
        for a, b in ((e.u, e.v), (e.v, e.u)):
            if built.nodes[a].kind in ("scan-const", "scan-carry") and b in body_nodes:
                out[(built.nodes[a].kind, body_nodes[b])] = e.costs if a == e.u else e.costs.T
    return out


def test_loop_invariant_reads_are_priced_once_per_scan():
    """The body reads a const in some layout once, before the loop; the carry's reshards run every iteration."""
    short, long = _body_edges(2), _body_edges(8)
    const_read, carry_read = ("scan-const", "dot_general"), ("scan-carry", "dot_general")
    assert const_read in short and carry_read in short
    assert np.any(short[const_read] > 0) and np.any(short[carry_read] > 0)
    allowed = short[carry_read] < FORBIDDEN
    np.testing.assert_array_equal(long[carry_read] < FORBIDDEN, allowed)
    np.testing.assert_allclose(long[carry_read][allowed], 4 * short[carry_read][allowed])
    np.testing.assert_allclose(long[const_read], short[const_read])


def test_unread_scan_outputs_are_not_planned():
    """A scan's ``ys`` that nothing reads, and the body work only they need, leave the traced program.

    XLA drops them from the compiled loop, so a plan that kept them predicted
    collectives the lowered program never ran (found by fuzz_plan: a 24-byte
    reduce-scatter of ``jnp.sum(c, axis=0)`` in a scan over rows split two ways).
    """
    from shardsolve.trace import trace

    def fun(h, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), jnp.sum(c, axis=0)), h, ws)[0]

    t = trace(fun, jax.ShapeDtypeStruct((16, 6), jnp.float32), jax.ShapeDtypeStruct((2, 6, 6), jnp.float32))
    (scan,) = [e for e in t.jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scan.outvars) == 1
    assert [e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns] == ["dot_general", "tanh"]
    assert len(t.jaxpr.jaxpr.invars) == 2  # every argument stays, read or not
