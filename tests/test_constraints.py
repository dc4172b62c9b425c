"""``with_sharding_constraint`` (and ``device_put`` onto a ``NamedSharding``) inside the planned function: a
user annotation, held as a hard constraint.

A function that needs a context mesh is traced with the plan's, so a bare
``PartitionSpec`` names its axes as it does under ``jax.set_mesh``; the
constrained value is laid out as asked (dimensions left
``PartitionSpec.UNCONSTRAINED`` stay free), and propagation's baselines in
``compare`` see the same constraint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve.errors import ShardsolveError
from shardsolve.sharding import Sharding

MESH = "data=2,model=4"
X = jax.ShapeDtypeStruct((64, 128), jnp.float32)
W = jax.ShapeDtypeStruct((128, 256), jnp.float32)


def _constrained(spec):
    def f(x, w):
        y = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), spec)
        return (y * 2).sum(axis=1)

    return f


def _laid_out(plan) -> list[Sharding]:
    return [op.results[0] for op in plan.ops if op.primitive == "sharding_constraint"]


def _values(*shapes):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("spec", [P(None, "model"), P("data", "model"), P(None, ("data", "model"))])
def test_a_bare_partition_spec_is_held_and_runs(spec):
    f = _constrained(spec)
    plan = shardsolve.plan(f, X, W, mesh=MESH, in_shardings=(P("data"), None))
    (got,) = _laid_out(plan)
    assert got == Sharding.from_spec(spec, 2)
    x, w = _values((64, 128), (128, 256))
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)):
        want = np.asarray(jax.jit(f)(x, w))
    np.testing.assert_allclose(np.asarray(plan.jit()(x, w)), want, rtol=1e-4, atol=1e-4)
    report = shardsolve.verify(plan, x, w)  # the unsharded reference run under the plan's mesh
    assert report.ok, report


def test_the_constraint_binds_where_the_free_plan_lays_the_value_out_otherwise():
    free = shardsolve.plan(_constrained(P()), X, W, mesh=MESH, in_shardings=(P("data"), None))
    assert _laid_out(free) == [Sharding.replicated(2)]  # the replicated pin holds too
    loose = shardsolve.plan(_constrained(P(P.UNCONSTRAINED, P.UNCONSTRAINED)), X, W, mesh=MESH,
                            in_shardings=(P("data"), None))
    pinned = shardsolve.plan(_constrained(P(None, "model")), X, W, mesh=MESH, in_shardings=(P("data"), None))
    assert _laid_out(loose) != [Sharding.from_spec(P(None, "model"), 2)]
    assert _laid_out(pinned) == [Sharding.from_spec(P(None, "model"), 2)]
    assert pinned.cost.total > loose.cost.total  # the constraint costs its reshard


def test_an_axis_of_size_one_splits_nothing():
    plan = shardsolve.plan(_constrained(P("data", "model")), X, W, mesh="data=1,model=8")
    (got,) = _laid_out(plan)
    assert got.dims[0] in ((), ("data",)) and got.dims[1] == ("model",)


def test_an_unconstrained_dimension_stays_free():
    plan = shardsolve.plan(_constrained(P(P.UNCONSTRAINED, "model")), X, W, mesh=MESH, in_shardings=(P("data"), None))
    (got,) = _laid_out(plan)
    assert got.dims[1] == ("model",)
    assert got.dims[0] == ("data",)  # the batch split the argument brings, kept: the free choice


def test_a_constraint_inside_a_scan_body_is_held():
    def f(x, ws):
        def body(c, w):
            return jax.lax.with_sharding_constraint(jnp.tanh(c @ w), P(None, "model")), None

        return jax.lax.scan(body, x, ws)[0].sum()

    ws = jax.ShapeDtypeStruct((3, 128, 128), jnp.float32)
    plan = shardsolve.plan(f, X, ws, mesh=MESH, in_shardings=(P("data"), None))
    (scan,) = [op for op in plan.ops if op.primitive == "scan"]
    assert [op.results[0] for op in scan.body if op.primitive == "sharding_constraint"] == [
        Sharding.from_spec(P(None, "model"), 2)]
    x, w = _values((64, 128), (3, 128, 128))
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)):
        want = np.asarray(jax.jit(f)(x, w))
    np.testing.assert_allclose(np.asarray(plan.jit()(x, w)), want, rtol=1e-3)


def test_a_device_put_onto_named_shardings_inside_the_function_is_held():
    jmesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def f(x, w):
        h, y = jax.device_put((jnp.tanh(x @ w), x * 2), (NamedSharding(jmesh, P(None, "model")),
                                                         NamedSharding(jmesh, P(None, "data"))))
        return h.sum(axis=1) + y.sum(axis=1)

    plan = shardsolve.plan(f, X, W, mesh=MESH, in_shardings=(P("data"), None))
    (op,) = [op for op in plan.ops if op.primitive == "device_put"]
    assert list(op.results) == [Sharding.from_spec(P(None, "model"), 2), Sharding.from_spec(P(None, "data"), 2)]
    x, w = _values((64, 128), (128, 256))
    np.testing.assert_allclose(np.asarray(plan.jit()(x, w)), np.tanh(x @ w).sum(1) + (x * 2).sum(1), rtol=1e-4)


def test_compare_gives_propagation_the_same_constraint():
    result = shardsolve.compare(_constrained(P(None, "model")), X, W, mesh=MESH, in_shardings=(P("data"), None),
                                columns=("shardy", "shardsolve"))
    assert result.columns and not any(c.error for c in result.columns), [c.error for c in result.columns]


@pytest.mark.parametrize("spec, match", [
    (P(None, ("model", "data")), r"out of the mesh's order .* write \('data', 'model'\)"),
    (P("model", "model"), "tracing the function failed: DuplicateSpecError"),
    (P("nope"), "tracing the function failed: .*nope"),
])
def test_a_constraint_the_plan_cannot_hold_is_refused_in_one_line(spec, match):
    with pytest.raises(ShardsolveError, match=match) as info:
        shardsolve.plan(_constrained(spec), X, W, mesh=MESH)
    assert "\n" not in str(info.value)


def test_a_constraint_on_a_mesh_of_other_sizes_is_refused_in_one_line():
    other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ShardsolveError, match=r"'data' has size 4 in the constraint's mesh but 2 in the plan's") as info:
        shardsolve.plan(_constrained(NamedSharding(other, P("data"))), X, W, mesh=MESH)
    assert "\n" not in str(info.value) and "test_constraints.py:" in str(info.value)


def test_tracing_with_the_plan_s_mesh_adds_no_operations():
    """A function that needs a context mesh is traced with the plan's, where JAX adds ``reshard``s (an
    ``.at[...].add``'s updates) that change nothing on automatic axes: ``trace`` drops them, in scan bodies
    too, so the program is the one a ``NamedSharding`` constraint traces to without a context mesh."""
    from shardsolve.graph import Graph
    from shardsolve.mesh import MeshSpec
    from shardsolve.trace import trace

    def program(spec):
        def f(ids, g):
            def body(c, x):
                return c.at[ids].add(x), None

            start = jax.lax.with_sharding_constraint(jnp.zeros((64, 8)).at[ids].add(g[0]), spec)
            return jax.lax.scan(body, start, g)[0]

        return f

    args = (jax.ShapeDtypeStruct((16,), jnp.int32), jax.ShapeDtypeStruct((3, 16, 8), jnp.float32))
    named = NamedSharding(jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2), P("model"))

    def primitives(graph):
        return [(op.primitive, primitives(graph.body(op)) if op.primitive == "scan" else None) for op in graph.ops]

    plain_traced = trace(program(named), *args, mesh=MeshSpec.parse(MESH))
    mesh_traced = trace(program(P("model")), *args, mesh=MeshSpec.parse(MESH))
    assert mesh_traced.needs_mesh and not plain_traced.needs_mesh  # the mesh only where the function needs one
    plain = primitives(Graph.from_traced(plain_traced))
    in_mesh = primitives(Graph.from_traced(mesh_traced))
    assert in_mesh == plain
    assert "reshard" not in str(plain) and "scatter-add" in str(plain) and "sharding_constraint" in str(plain)
    with pytest.raises(ShardsolveError, match="tracing the function failed: .*mesh"):
        trace(program(P("model")), *args)  # no mesh to trace it with


def _explicit_mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_a_plan_made_under_a_context_mesh_of_explicit_axes_runs():
    """``jax.set_mesh(jax.make_mesh(...))`` (Explicit axes, JAX's default): the plan's programs run with their own
    mesh as context mesh (``shard_map`` refuses any other)."""
    def f(x, w):
        return (jnp.tanh(x @ w) * 2).sum(axis=1)

    x, w = _values((64, 128), (128, 256))
    with jax.set_mesh(_explicit_mesh()):
        plan = shardsolve.plan(f, X, W, mesh=MESH, in_shardings=(P("data"), None))
        want = (np.tanh(x @ w) * 2).sum(1)
        np.testing.assert_allclose(np.asarray(plan.jit()(x, w)), want, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(plan.jit(execution="pinned")(x, w)), want, rtol=1e-4)
        result = shardsolve.compare(f, X, W, mesh=MESH, in_shardings=(P("data"), None), plan=plan,
                                    columns=("shardy", "shardsolve"))
    assert not any(c.error for c in result.columns), [c.error for c in result.columns]


def test_values_sharded_in_their_types_are_refused_in_one_line():
    def f(x, w):
        return jax.sharding.reshard(jnp.tanh(x @ w), P(None, "model")).sum()

    with jax.set_mesh(_explicit_mesh()):
        with pytest.raises(ShardsolveError, match=r"shards values in their types \(reshard at .*test_constraints.py:") as info:
            shardsolve.plan(f, X, W, mesh=MESH)
    assert "\n" not in str(info.value) and "AxisType.Auto" in str(info.value)
