"""Propagation's program as a plan: the shardings Shardy gives every value, read back as an assignment, and the
memory-limited search that starts from it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mlp_step import ARGS, BATCH, MESH, mlp_step

import shardsolve
from shardsolve import planner
from shardsolve.annotations import argument_pins, output_pins
from shardsolve.build import build_problem
from shardsolve.compare import concrete_mesh
from shardsolve.graph import Graph
from shardsolve.hlo import compiled_memory
from shardsolve.mesh import MeshSpec
from shardsolve.propagation import propagated_assignment, propagated_scopes, propagated_shardings
from shardsolve.sharding import Sharding
from shardsolve.trace import trace


def test_every_value_gets_the_sharding_shardy_propagates_and_every_operation_a_strategy_that_makes_it():
    mesh = MeshSpec.parse(MESH)
    traced = trace(lambda x, w: jnp.tanh(x @ w),
                   jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32))
    graph = Graph.from_traced(traced)
    pins = (P("data", None), P(None, "model"))
    x_s, w_s = (Sharding.from_spec(p, 2, mesh) for p in pins)
    shardings = propagated_shardings(graph, mesh, [x_s, w_s], [None])
    dot, tanh = graph.ops
    both = Sharding.from_spec(P("data", "model"), 2, mesh)
    assert shardings[graph.inputs[0]] == x_s and shardings[graph.inputs[1]] == w_s
    assert shardings[dot.outputs[0]] == both and shardings[tanh.outputs[0]] == both
    built = build_problem(graph, mesh, argument_pins(traced, pins, mesh), output_pins(traced, None, mesh), None, [])
    x, matched = propagated_assignment(graph, built, {(): shardings})
    for k, info in enumerate(built.nodes):
        if info.kind == "op":
            assert matched[k]
            strategy = info.strategies[x[k]]
            assert strategy.results[0] == both and not strategy.results[0].partial
            assert list(strategy.operands) == [shardings[v] for v in graph.ops[info.ref].inputs]
        if info.kind == "input":
            assert matched[k] and info.shardings[x[k]] == shardings[info.ref]


def test_under_propagations_own_memory_the_plan_is_no_slower_than_propagation(monkeypatch):
    """With the memory limit at what propagation's program compiles to from the same annotations, and the plan
    without the limit compiling over it, the search starts from propagation's program (read back as a plan):
    the answer fits as compiled and is no slower in the model."""
    jmesh = concrete_mesh(MESH, MeshSpec.parse(MESH))
    shardings = jax.tree.map(lambda s: NamedSharding(jmesh, s), BATCH[1])
    limit = compiled_memory(jax.jit(mlp_step, in_shardings=(None, shardings)).lower(*ARGS).compile()).peak
    compiled, peaks, said = planner.compiled_peak, [], []

    def over_without_the_limit(plan, args):  # the plans solved without the limit are made to miss it
        peaks.append((said[-1], 2**40 if said[-1] == "compiling it to read its memory" else compiled(plan, args)))
        return peaks[-1][1]

    monkeypatch.setattr(planner, "compiled_peak", over_without_the_limit)
    plan = shardsolve.plan(mlp_step, *ARGS, mesh=MESH, in_shardings=BATCH, memory_limit=limit, time_limit=10,
                           progress=said.append)
    stats = dict(plan.stats)
    propagation = [peak for message, peak in peaks if message == "compiling propagation's plan to read its memory"]
    assert len(propagation) == 1 and propagation[0] <= limit  # it fits, as compiled
    assert "propagation_cost" in stats, stats
    assert stats["compiled_peak_memory"] <= limit
    assert plan.cost.total <= stats["propagation_cost"] * (1 + 1e-9)


def test_a_scan_body_is_read_from_the_shardings_its_operands_take_outside():
    def layers(x, ws):
        def body(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(body, x, ws)[0]

    mesh = MeshSpec.parse(MESH)
    args = (jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((3, 64, 64), jnp.float32))
    pins = (P("data", None), P(None, None, "model"))
    traced = trace(layers, *args)
    graph = Graph.from_traced(traced)
    built = build_problem(graph, mesh, argument_pins(traced, pins, mesh), output_pins(traced, None, mesh), None, [])
    scoped = propagated_scopes(graph, built, mesh, [Sharding.from_spec(p, len(a.shape), mesh)
                                                    for p, a in zip(pins, args)], [None])
    (scope, nodes), = built.scans.items()
    inner = scoped[scope]
    w_slice = inner[nodes.body.inputs[-1]]  # the x-slice: the stacked weights' sharding less the stacked dimension
    assert w_slice == Sharding.from_spec(P(None, "model"), 2, mesh)
    x, matched = propagated_assignment(graph, built, scoped)
    body_ops = [k for k, info in enumerate(built.nodes) if info.kind == "op" and info.scope == scope]
    assert body_ops and all(matched[k] for k in body_ops)
    for k in body_ops:
        op = nodes.body.ops[built.nodes[k].ref]
        results = built.nodes[k].strategies[x[k]].results
        assert [Sharding(r.dims) for r in results] == [inner[v] for v in op.outputs]
    assert all(matched[k] for k in nodes.carry + nodes.xs)


def test_an_option_the_compiler_does_not_know_is_left_out_of_the_fast_compile(monkeypatch):
    """The extra compile's options are speed-ups only: one a JAX release no longer knows is dropped, and the
    shardings read are the same."""
    from shardsolve import propagation

    mesh = MeshSpec.parse(MESH)
    traced = trace(lambda x, w: jnp.tanh(x @ w),
                   jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32))
    graph = Graph.from_traced(traced)
    pins = [Sharding.from_spec(P("data", None), 2, mesh), None]
    want = propagated_shardings(graph, mesh, pins, [None])
    monkeypatch.setattr(propagation, "FAST_COMPILE", {**propagation.FAST_COMPILE, "xla_no_such_option": True})
    assert propagated_shardings(graph, mesh, pins, [None]) == want


def test_a_split_with_an_empty_part_is_read_by_its_parts_that_hold_data():
    """Shardy leaves a zero-width result unsplit; it holds no data, so the split is read by its other part."""
    def halves(x):
        head, empty = jnp.split(x, [x.shape[1]], axis=1)
        return jnp.tanh(head), empty

    mesh = MeshSpec.parse(MESH)
    args = (jax.ShapeDtypeStruct((16, 8), jnp.float32),)
    pins = (P("data", None),)
    traced = trace(halves, *args)
    graph = Graph.from_traced(traced)
    built = build_problem(graph, mesh, argument_pins(traced, pins, mesh), output_pins(traced, None, mesh), None, [])
    shardings = propagated_shardings(graph, mesh, [Sharding.from_spec(pins[0], 2, mesh)], [None, None])
    (split,) = [op for op in graph.ops if op.primitive == "split"]
    assert 0 in graph.values[split.outputs[1]].shape
    x, matched = propagated_assignment(graph, built, {(): shardings})
    k = built.op_node[split.id]
    assert matched[k]
    assert built.nodes[k].strategies[x[k]].results[0] == shardings[split.outputs[0]] == Sharding.from_spec(
        P("data", None), 2, mesh)
