"""Uneven splits end to end: pins, rules, the rewriter, plan.jit() and the cost model.

A split that does not divide its dimension (10 rows over 4 devices) is padded
as XLA's SpmdPartitioner pads it: shards of ``ceil(10 / 4) = 3`` rows, the
last one holding 1 row and 2 rows of padding. Each end-to-end check plans a
program, runs ``shardsolve.lower(plan)`` and ``plan.jit()`` against the
unsharded function, and compares the plan's predicted collectives with those
in the lowered program's compiled HLO, bytes per kind and mesh axes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve.cost import reshard_steps
from shardsolve.errors import ShardsolveError
from shardsolve.mesh import V5E_HBM_BANDWIDTH, MeshSpec
from shardsolve.rules.validate import check_many, find_equation, literal_operands, rule_of
from shardsolve.sharding import Sharding, candidate_shardings, uneven_split_fits

sys.path.insert(0, str(Path(__file__).parent))
from lower_cases import check_lowering, draw_program, plan_with_solver, random_solver  # noqa: E402

MESH = "data=2,model=4"
SPEC = MeshSpec.parse(MESH)


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _uneven_ops(plan) -> list[str]:
    """The operations that read or write a value split unevenly."""
    graph, out = plan.graph, []
    for op, op_plan in zip(graph.ops, plan.ops, strict=True):
        values = [(v, s) for v, s in zip(op.inputs, op_plan.operands, strict=True) if isinstance(v, int)]
        values += list(zip(op.outputs, op_plan.results, strict=True))
        if any(not s.divides(graph.values[v].shape, plan.mesh) for v, s in values):
            out.append(f"{op.primitive} {op_plan.strategy}")
    return out


def _check_end_to_end(plan, args, tol: float = 1e-5):
    """lower(plan) and plan.jit() match the unsharded function; predicted bytes == lowered bytes.

    Errors are relative to each output's largest magnitude (sums run in another order on shards).
    """
    outcome = check_lowering(plan, args, rtol=tol, atol=tol)
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.predicted == outcome.lowered
    want = jax.tree_util.tree_leaves(plan.fun(*args))
    got = jax.tree_util.tree_leaves(plan.jit()(*args))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape
        scale = float(np.max(np.abs(b), initial=0.0))
        assert float(np.max(np.abs(a - b), initial=0.0)) <= tol * (1.0 + scale)
    return outcome


# -- shardings and candidates ----------------------------------------------------------------


def test_uneven_split_fits_only_where_no_shard_is_all_padding():
    assert uneven_split_fits(10, 4)  # 3, 3, 3, 1
    assert uneven_split_fits(3, 2)  # 2, 1
    assert not uneven_split_fits(6, 4)  # 2, 2, 2, 0
    assert not uneven_split_fits(3, 4)  # more shards than elements
    cands = candidate_shardings((10, 6), SPEC, allow_uneven=True)
    assert Sharding((("model",), ())) in cands
    assert Sharding(((), ("model",))) not in cands  # 6 over 4 leaves a shard empty
    assert all(c.divides((10, 6), SPEC) for c in candidate_shardings((10, 6), SPEC))


def test_evened_unsplits_only_the_uneven_dimensions():
    s = Sharding((("model",), ("data",)))
    assert s.evened((10, 6), SPEC) == Sharding(((), ("data",)))
    assert s.evened((12, 6), SPEC) == s
    assert s.uneven_dims((10, 6), SPEC) == (0,)


def test_per_device_bytes_use_the_padded_shard():
    s = Sharding((("model",), ()))
    assert s.local_shape((10, 6), SPEC) == (3, 6)
    assert s.local_bytes((10, 6), 4, SPEC) == 3 * 6 * 4
    # Gathering an uneven dimension moves every padded shard: 4 x 3 rows.
    (step,) = reshard_steps((10, 6), 4, s, Sharding(((), ())), SPEC)
    assert (step.kind, step.bytes) == ("all-gather", 4 * 3 * 6 * 4)


def test_uneven_output_pays_for_leaving_evened():
    """The output edge prices the reshard from the producer straight to the evened layout."""
    from shardsolve.cost import reshard_time
    from shardsolve.graph import Graph
    from shardsolve.build import build_problem
    from shardsolve.trace import trace

    x = jax.ShapeDtypeStruct((10, 6), jnp.float32)
    graph = Graph.from_traced(trace(jnp.tanh, x))
    s = Sharding((("model",), ()))
    built = build_problem(graph, SPEC, [(None, "in")], [(s, "out_shardings[0]")])
    op, out = built.op_node[graph.ops[0].id], built.output_node[0]
    edge = next(e for e in built.problem.edges if (e.u, e.v) == (op, out))
    col = built.nodes[out].shardings.index(s)
    for k, strategy in enumerate(built.nodes[op].strategies):
        produced = strategy.results[0]
        assert edge.costs[k, col] == reshard_time((10, 6), 4, produced, Sharding(((), ())), SPEC)
    split = next(k for k, st in enumerate(built.nodes[op].strategies) if st.results[0] == s)
    assert edge.costs[split, col] > 0.0  # the all-gather of the padded rows
    assert edge.costs[0, col] == 0.0  # produced replicated: already evened


# -- rules on uneven shards --------------------------------------------------------------------

RULE_CASES = [
    ("contraction", lambda a, b: a @ b, ((6, 10), (10, 3)), "dot_general"),
    ("reduce_sum", lambda a: jnp.exp(a).sum(1), ((6, 10),), "reduce_sum"),
    ("reduce_max", lambda a: a.max(0), ((10, 3),), "reduce_max"),
    ("reduce_min", lambda a: a.min(0), ((10, 3),), "reduce_min"),
    ("cumsum_other_dim", lambda a: jnp.cumsum(a, 1), ((10, 3),), "cumsum"),
    ("argmax_other_dim", lambda a: jnp.argmax(a, 1), ((10, 3),), "argmax"),
    ("iota", lambda a: a + jnp.arange(10.0)[:, None], ((10, 3),), "iota"),
    ("reshape", lambda a: a.reshape(10, 3, 2), ((10, 6),), "reshape"),
    ("slice_rows", lambda a: a[1:9:2], ((10, 3),), "slice"),
]


def _uneven_strategies(eqn, mesh):
    rule = rule_of(eqn)
    fixed = literal_operands(eqn)
    even = set(rule.strategies(mesh, fixed_operands=fixed, allow_uneven=False))
    return rule, [s for s in rule.strategies(mesh, fixed_operands=fixed) if s not in even]


@pytest.mark.parametrize("name, fn, shapes, primitive", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_uneven_strategies_are_numerically_valid(name, fn, shapes, primitive):
    """Every uneven strategy, run on shards whose padding holds NaN: padding never reaches a result."""
    eqn = find_equation(fn, *[jnp.ones(s) for s in shapes], primitive=primitive)
    rule, strategies = _uneven_strategies(eqn, SPEC)
    assert strategies, f"{rule} offers no uneven strategy"
    assert not check_many(eqn, rule, strategies, SPEC)


def test_dynamic_windows_on_uneven_rows():
    """A window read from, or written into, rows split unevenly (10 over 4): the padding is never read, and
    starts out of range are clamped as JAX clamps them."""
    x, u = jnp.ones((10, 6)), jnp.ones((3, 6))
    for fn, primitive in [(lambda x, i: jax.lax.dynamic_slice(x, (i, 0), (3, 6)), "dynamic_slice"),
                          (lambda x, u, i: jax.lax.dynamic_update_slice(x, u, (i, 0)), "dynamic_update_slice")]:
        args = (x, jnp.int32(0)) if primitive == "dynamic_slice" else (x, u, jnp.int32(0))
        eqn = find_equation(fn, *args, primitive=primitive)
        rule, strategies = _uneven_strategies(eqn, SPEC)
        assert strategies
        assert not check_many(eqn, rule, strategies, SPEC, int_range=(-2, 12))


def test_gather_and_scatter_add_on_uneven_rows():
    table, tokens = jnp.ones((10, 6)), jnp.zeros((5, 3), jnp.int32)
    for fn, primitive in [(lambda w, t: w[t], "gather"),
                          (lambda w, t: jax.grad(lambda w: w[t].sum())(w), "scatter-add")]:
        eqn = find_equation(fn, table, tokens, primitive=primitive)
        rule, strategies = _uneven_strategies(eqn, SPEC)
        assert strategies
        assert not check_many(eqn, rule, strategies, SPEC, int_range=(0, 10))


def test_padding_sensitive_dimensions_are_never_split():
    """A scan's or sort's axis, reversed and concatenated dimensions keep need-replication (a sliced one is a
    masked lookup that never reads the padding: ``slice_rows`` in ``RULE_CASES``)."""
    x = jnp.ones((10, 3))
    for fn, primitive in [(lambda a: jnp.cumsum(a, 0), "cumsum"), (lambda a: jnp.sort(a, 0), "sort"),
                          (lambda a: a[::-1], "rev"), (lambda a: jnp.concatenate([a, a]), "concatenate")]:
        rule = rule_of(find_equation(fn, x, primitive=primitive))
        for s in rule.strategies(SPEC):
            assert not s.operands[0].dims[0], (primitive, s.describe())


def test_compound_reshape_dimensions_stay_even():
    """``[ij]`` with ``i`` split unevenly would not line up with the merged dimension's shards."""
    rule = rule_of(find_equation(lambda a: a.reshape(30), jnp.ones((10, 3)), primitive="reshape"))
    assert all(s.operands[0].divides((10, 3), SPEC) for s in rule.strategies(SPEC))


def test_validator_catches_padding_read_by_a_reduction():
    """Without the identity fill, a contraction over an uneven split sums the padding."""
    eqn = find_equation(lambda a, b: a @ b, jnp.ones((6, 10)), jnp.ones((10, 3)), primitive="dot_general")
    rule, strategies = _uneven_strategies(eqn, SPEC)
    split_k = [s for s in strategies if s.axes_of(rule.reduction[0])]
    assert split_k and len(check_many(eqn, rule, split_k, SPEC, clear_padding=False)) == len(split_k)
    assert not check_many(eqn, rule, split_k, SPEC)  # with it, every one of them is right


# -- planner: pins ---------------------------------------------------------------------------------


def _chain(x, w1, w2):
    h = jnp.maximum(x @ w1, 0.0)
    y = h @ w2
    return jnp.exp(0.1 * y).max(axis=1), y.sum(axis=0)


def _chain_args():
    return _rand((10, 12), 0), _rand((12, 6), 1), _rand((6, 6), 2)


def test_uneven_input_pin_plans_lowers_and_jits_exactly():
    """(10, 12) @ (12, 6) with P("model") on the 10 rows: 4 shards of 3 rows."""
    args = _chain_args()
    plan = shardsolve.plan(_chain, *args, mesh=MESH, in_shardings=(P("model"), None, None))
    assert plan.inputs[0] == Sharding((("model",), ()))
    # JAX takes the argument evened: rows unsplit; the plan cuts it inside
    assert plan.in_shardings[0] == NamedSharding(plan.mesh.jax_mesh(), P())
    _check_end_to_end(plan, args)


@pytest.mark.parametrize("seed", [3, 5])
def test_uneven_input_pin_read_by_random_strategies(seed):
    """The same chain at these sizes is cheapest on the whole argument; random strategies read its shards."""
    args = _chain_args()
    plan = plan_with_solver(random_solver(seed), _chain, *args, mesh=MESH, in_shardings=(P("model"), None, None))
    used = _uneven_ops(plan)
    assert any(u.startswith(("dot_general i:model", "reduce_max i:model")) for u in used), used
    _check_end_to_end(plan, args)


def test_evened_argument_layout_is_reused_without_collectives():
    """6 rows pinned over 4 devices (shards 2, 2, 2, 0) arrive whole: reading them whole costs nothing."""

    def f(x, w):
        return jnp.tanh(x @ w).sum(0), x * 2

    x, w = _rand((6, 8)), _rand((8, 5), 1)
    plan = shardsolve.plan(f, x, w, mesh=MESH, in_shardings=(P("model"), P(None, "model")),
                           out_shardings=(P("model"), P("model", "data")))
    assert plan.inputs[0] == Sharding((("model",), ()))
    assert plan.collectives == ()
    outcome = _check_end_to_end(plan, (x, w))
    assert outcome.lowered == {}


def test_uneven_output_pin_leaves_evened():
    args = _chain_args()
    plan = shardsolve.plan(_chain, *args, mesh=MESH, in_shardings=(P("model"), None, None),
                           out_shardings=(P("model"), P("model")))
    assert plan.outputs == (Sharding((("model",),)), Sharding((("model",),)))
    assert plan.out_shardings[0] == NamedSharding(plan.mesh.jax_mesh(), P())  # 10 over 4: evened
    assert plan.out_shardings[1] == NamedSharding(plan.mesh.jax_mesh(), P())  # 6 over 4: evened
    _check_end_to_end(plan, args)
    assert plan.jit()(*args)[0].sharding.spec == P()


@pytest.mark.parametrize("seed", [1, 5])
def test_uneven_output_is_gathered_to_its_evened_layout_as_predicted(seed):
    """Produced in shards of 3 rows, the 10-row output is all-gathered (4 padded shards) before it leaves."""
    args = _chain_args()
    plan = plan_with_solver(random_solver(seed), _chain, *args, mesh=MESH, in_shardings=(P("model"), None, None),
                            out_shardings=(P("model"), P("model")))
    leaving = [(c.kind, c.axes, c.bytes) for c in plan.collectives if c.consumer == "outputs[0]"]
    assert ("all-gather", ("model",), 4 * 3 * 4) in leaving
    _check_end_to_end(plan, args)


def _reductions(x):
    # exp: padding left at 0 would add exp(0) = 1; max/min of values far from 0: padding 0 would win
    return jnp.exp(x).sum(axis=0), (x - 5.0).max(axis=0), (x + 5.0).min(axis=0)


@pytest.mark.parametrize("seed, reductions", [(3, ("reduce_max", "reduce_min")), (13, ("reduce_max",)),
                                              (11, ("exp", "reduce_sum"))])
def test_reduction_over_an_uneven_split_pads_with_the_identity(seed, reductions):
    """sum, max and min over 10 rows split 4 ways (shards of 3), under random strategies."""
    x = _rand((10, 64))
    plan = plan_with_solver(random_solver(seed), _reductions, x, mesh=MESH, in_shardings=P("model"))
    used = _uneven_ops(plan)
    for r in reductions:
        assert any(u.startswith(f"{r} i:model") for u in used), used
    _check_end_to_end(plan, (x,))


def test_reductions_with_an_uneven_pin_plan_and_run():
    """The real solver's plan: the argument arrives whole, so it reduces along the even columns instead."""
    x = _rand((10, 64))
    plan = shardsolve.plan(_reductions, x, mesh=MESH, in_shardings=P("model"))
    _check_end_to_end(plan, (x,))


def test_user_sharding_constraint_with_an_uneven_split_runs():
    """A ``with_sharding_constraint`` inside the function (JAX pads it under jit) lowers and jits."""
    jmesh = SPEC.jax_mesh()

    def f(x, w):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(jmesh, P("model")))
        return jnp.tanh(h).sum(0)

    x, w = _rand((10, 12), 0), _rand((12, 6), 1)
    want = np.asarray(jax.jit(f)(x, w))  # eagerly, JAX refuses the uneven constraint
    plan = shardsolve.plan(f, x, w, mesh=MESH)
    outcome = check_lowering(plan, (x, w), reference=want)
    assert outcome.numerics_ok and outcome.predicted == outcome.lowered
    np.testing.assert_allclose(np.asarray(plan.jit()(x, w)), want, rtol=1e-5, atol=1e-5)


def test_truly_invalid_pins_are_still_refused():
    x = _rand((10, 3))
    with pytest.raises(ShardsolveError, match=r"dimension 1 of size 3 into 4 parts, more than it has") as info:
        shardsolve.plan(jnp.sin, x, mesh=MESH, in_shardings=P(None, "model"))
    assert "\n" not in str(info.value)
    with pytest.raises(ShardsolveError, match="twice"):
        shardsolve.plan(jnp.sin, x, mesh=MESH, in_shardings=P("model", "model"))
    with pytest.raises(ShardsolveError, match=r"out_shardings.*more than it has"):
        shardsolve.plan(jnp.sin, x, mesh=MESH, out_shardings=P(None, ("data", "model")))


def test_uneven_plan_round_trips_through_json(tmp_path):
    args = _chain_args()
    plan = shardsolve.plan(_chain, *args, mesh=MESH, in_shardings=(P("model"), None, None))
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = shardsolve.load_plan(path, _chain, *args)
    assert loaded.inputs == plan.inputs and loaded.ops == plan.ops
    assert loaded.in_shardings == plan.in_shardings


def test_memory_counts_padded_shards_and_evened_arguments():
    """An op's uneven result costs its padded shard per device; an uneven argument its evened buffer."""
    from shardsolve.graph import Graph
    from shardsolve.build import build_problem
    from shardsolve.trace import trace

    x = jax.ShapeDtypeStruct((10, 6), jnp.float32)
    graph = Graph.from_traced(trace(lambda x: jnp.tanh(x) @ jnp.ones((6, 3)), x))  # tanh's result: a buffer
    pinned = Sharding((("model",), ()))
    built = build_problem(graph, SPEC, [(pinned, "in_shardings[0]")], [(None, "out")])
    node = built.value_node[graph.inputs[0]]
    pin = built.problem.pins[0].allowed[0]
    assert built.nodes[node].shardings[pin] == pinned
    assert built.problem.nodes[node].usages[pin] == 10 * 6 * 4  # arrives with its rows unsplit
    op = built.op_node[graph.ops[0].id]
    k = next(k for k, st in enumerate(built.nodes[op].strategies) if st.results[0] == pinned)
    assert built.problem.nodes[op].usages[k] == 3 * 6 * 4  # ceil(10 / 4) rows per device


def test_scan_body_runs_uneven_intermediates():
    """Body ops split 10 rows over 4 devices (the carry and slices stay even); random strategies."""

    def f(c, xs, w):
        def body(c, x):
            y = jnp.tanh(x @ w)
            return c + y.max(0) + (x * 2.0).sum(0) @ w, y.sum(1)

        return jax.lax.scan(body, c, xs)

    args = (_rand((6,), 0), _rand((3, 10, 6), 1), _rand((6, 6), 2))
    plan = plan_with_solver(random_solver(4), f, *args, mesh=MESH)
    scan = next(op for op in plan.graph.ops if op.primitive == "scan")
    body, body_plans = plan.graph.body(scan), plan.ops[scan.id].body
    assert any(not r.divides(body.values[v].shape, plan.mesh)
               for bop, bp in zip(body.ops, body_plans, strict=True) for v, r in zip(bop.outputs, bp.results, strict=True))
    _check_end_to_end(plan, args)


# -- the solver picks uneven splits where they pay ------------------------------------------------


def _heavy(x):
    return jnp.sum(jnp.tanh(x) * 2.0, axis=1)


def test_solver_picks_uneven_split_where_it_pays():
    """3002 rows and columns on data=2,model=4: 3002 = 2 x 1501, so model (4) splits nothing evenly.

    The best even plan works on halves; the uneven plan splits the columns over
    model too (shards of 751) and is cheaper, collectives included: the fused
    tanh-scale-sum loop reads a quarter of the bytes for an all-reduce of 1501 sums (compute priced as a
    roofline, so that the loop's bytes count).
    """
    x = _rand((3002, 3002))
    mesh = MeshSpec.parse(MESH, hbm_bandwidth=V5E_HBM_BANDWIDTH)
    plan = shardsolve.plan(_heavy, x, mesh=mesh)
    even = shardsolve.plan(_heavy, x, mesh=mesh, uneven=False)
    assert even.status == plan.status == "optimal"
    assert not _uneven_ops(even)
    assert _uneven_ops(plan)
    assert plan.cost.total < even.cost.total
    _check_end_to_end(plan, (x,))


# -- random programs with uneven pins, planned by the real solver ---------------------------------

# Seeds of ``draw_program(seed, uneven=True)`` whose annotations split some argument unevenly
# (and whose plans read it so), drawn once (the random solver's again when the rules' strategies changed:
# its pick on seed 128 stopped reading a value split unevenly); a longer campaign is experiments/fuzz_lower.py.
REAL_SOLVER_SEEDS = (38, 59, 63, 106, 136, 159)
RANDOM_SOLVER_SEEDS = (63, 133, 136)


@pytest.mark.parametrize("seed", REAL_SOLVER_SEEDS)
def test_random_uneven_programs_lower_exactly(seed):
    program = draw_program(seed, uneven=True)
    plan = shardsolve.plan(program.fun, *program.args, mesh=program.mesh, in_shardings=program.in_specs,
                           out_shardings=program.out_specs)
    assert any(not s.divides(a.shape, plan.mesh) for s, a in zip(plan.inputs, program.args)), program.text
    _check_end_to_end(plan, program.args)


@pytest.mark.parametrize("seed", RANDOM_SOLVER_SEEDS)
def test_random_uneven_strategies_lower_exactly(seed):
    program = draw_program(seed, uneven=True)
    plan = plan_with_solver(random_solver(seed), program.fun, *program.args, mesh=program.mesh,
                            in_shardings=program.in_specs, out_shardings=program.out_specs)
    assert _uneven_ops(plan), program.text
    _check_end_to_end(plan, program.args)
