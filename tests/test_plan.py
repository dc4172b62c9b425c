"""End to end: plan small programs, run ``plan.jit()`` on 8 fake CPU devices, compare numerics."""

from __future__ import annotations

import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lower_cases import check_lowering

import shardsolve
from shardsolve.errors import InfeasibleError, ShardsolveError
from shardsolve.sharding import Sharding


def _close(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-5)


def _mlp_step(params, x):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        y = h @ p["w2"]
        return jnp.mean(y**2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value


def _mlp_args(batch=16, d=32, h=64):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (d, h)) / d**0.5, "w2": jax.random.normal(k2, (h, d)) / h**0.5}
    return params, jax.random.normal(k3, (batch, d))


def test_mlp_plan_respects_annotations_and_matches_numerics():
    params, x = _mlp_args()
    plan = shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")))
    assert plan.status in ("optimal", "feasible")
    assert plan.in_shardings[1] == NamedSharding(plan.mesh.jax_mesh(), P("data"))
    assert isinstance(plan.in_shardings[0], dict) and set(plan.in_shardings[0]) == {"w1", "w2"}
    out = plan.jit()(params, x)
    _close(out, _mlp_step(params, x))
    # The jitted function really uses the planned layouts: every output leaves as the plan says.
    leaves, wanted = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(plan.out_shardings)
    assert len(leaves) == len(wanted) == 3
    for leaf, sharding in zip(leaves, wanted, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
    assert any(not s.is_fully_replicated for s in wanted[:2])  # a weight stays split
    # The rewriter's program computes the same, with the collectives the plan predicts.
    outcome = check_lowering(plan, (params, x))
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)
    assert plan.cost.total == pytest.approx(plan.cost.compute + plan.cost.communication)
    assert plan.cost.peak_memory > 0


def test_a_plan_call_works_out_each_assignment_once(monkeypatch):
    """Pricing a solution in the search and handing back its plan ask for the same program: one schedule per
    assignment in a ``plan`` call, and the plan handed back is the one worked out afresh."""
    from shardsolve import planner

    seen, schedules = [], []
    to_plan, build_schedule = planner.to_plan, planner.build_schedule

    def keep(graph, built, solution, *rest, **kw):
        seen.append((graph, built, solution, rest))
        return to_plan(graph, built, solution, *rest, **kw)

    def count(*args, **kw):
        schedules.append(1)
        return build_schedule(*args, **kw)

    monkeypatch.setattr(planner, "to_plan", keep)
    monkeypatch.setattr(planner, "build_schedule", count)
    monkeypatch.setattr(planner, "PROPAGATION_CANDIDATE_OPS", 0)  # propagation's plan, priced last, is another
    params, x = _mlp_args()
    plan = shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")))
    assignments = {tuple(solution.assignment) for _, _, solution, _ in seen}
    assert len(seen) > len(assignments) >= 1  # the solution priced is the one handed back
    assert len(schedules) == len(assignments)
    graph, built, solution, rest = seen[-1]
    fresh = to_plan(graph, built, solution, *rest)  # outside a plan call: nothing kept
    assert fresh.cost == plan.cost and fresh.collectives == plan.collectives and fresh.ops == plan.ops


def test_plan_accepts_shape_dtype_structs_without_allocating():
    big = {"w1": jax.ShapeDtypeStruct((8192, 32768), jnp.float32), "w2": jax.ShapeDtypeStruct((32768, 8192), jnp.float32)}
    x = jax.ShapeDtypeStruct((1024, 8192), jnp.float32)
    plan = shardsolve.plan(
        _mlp_step, big, x, mesh="data=2,model=4", in_shardings=(None, P("data")), carry=((0, 0),),
        memory_limit="1GiB", time_limit=20,
    )
    assert plan.inputs[2] == Sharding.from_spec(P("data"), 2)
    # 2 GiB of weights planned without allocating them; under 1 GiB per device every weight is split.
    assert all(s.axes for s in plan.inputs[:2])
    assert plan.cost.peak_memory <= 2**30


def test_no_annotations_tiny_program_is_not_all_replicated():
    def f(x, w):
        return jnp.tanh(x @ w) @ w.T

    x = jnp.ones((64, 128))
    w = jnp.ones((128, 128)) * 0.01
    plan = shardsolve.plan(f, x, w, mesh="x=8")
    assert any(s.axes for s in plan.inputs + plan.outputs) or any(o.results[0].axes for o in plan.ops)
    replicated = shardsolve.plan(f, x, w, mesh="x=8", in_shardings=(P(), P()), out_shardings=P())
    assert plan.cost.total < replicated.cost.total
    _close(plan.jit()(x, w), f(x, w))


def test_memory_limit_forces_weight_sharding():
    """Rediscovery: batch pinned, weights too big to replicate -> the plan splits the weights."""
    params, x = _mlp_args(batch=16, d=64, h=256)
    free = shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")))
    weights = sum(v.size * 4 for v in jax.tree_util.tree_leaves(params))
    limit = 0.6 * weights  # replicated weights alone exceed it
    tight = shardsolve.plan(
        _mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")), memory_limit=limit
    )
    assert tight.cost.peak_memory <= limit
    assert all(s.axes for s in tight.inputs[:2]), [str(s) for s in tight.inputs]
    assert tight.cost.total >= free.cost.total - 1e-12
    _close(tight.jit()(params, x), _mlp_step(params, x))


def test_unsatisfiable_memory_limit_is_explained():
    params, x = _mlp_args()
    with pytest.raises(InfeasibleError, match="memory"):
        shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(P(), P()), memory_limit=1024)


def test_an_infeasible_limit_is_explained_once(monkeypatch):
    """The solves under the limit (tied, untied, hinted) look for no conflict: the error looks once."""
    from shardsolve import encodings
    from shardsolve.encodings import portfolio

    explained, explain = [], portfolio.explain_infeasible

    def counted(problem, *args, **kwargs):
        explained.append(problem.usage_limit)
        return explain(problem, *args, **kwargs)

    monkeypatch.setattr(portfolio, "explain_infeasible", counted)
    monkeypatch.setattr(encodings, "explain_infeasible", counted)
    params, x = _mlp_args()
    with pytest.raises(InfeasibleError, match="memory_limit"):
        shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(P(), P()), memory_limit=1024,
                        time_limit=5.0)
    assert len(explained) == 1


def test_out_shardings_are_respected():
    def f(x):
        return jnp.sin(x) * 2

    x = jnp.arange(64.0).reshape(8, 8)
    plan = shardsolve.plan(f, x, mesh="a=2,b=4", in_shardings=P("a", "b"), out_shardings=P("b", "a"))
    assert plan.outputs[0] == Sharding.from_spec(P("b", "a"), 2)
    out = plan.jit()(x)
    assert out.sharding.spec == P("b", "a")
    _close(out, f(x))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mesh="data=2,,model"), "cannot parse mesh axis"),
        (dict(mesh="data=2,model=4", in_shardings=(None, P("pipe"))), "unknown mesh axis 'pipe'"),
        (dict(mesh="data=2,model=4", in_shardings=(None, P("data", "data"))), "twice"),
        (dict(mesh="data=2,model=4", in_shardings=(None, P(None, None, "model"))), r"in_shardings\[1\].*rank 2"),
        (dict(mesh="data=2,model=4", in_shardings=(None, P("data"), None)), "in_shardings does not match"),
        (dict(mesh="data=2,model=4", in_shardings=({"w1": None}, None)), "in_shardings does not match"),
        (dict(mesh="data=2,model=4", time_limit=-1), "time_limit"),
        (dict(mesh="data=2,model=4", memory_limit="lots"), "cannot read memory size"),
    ],
)
def test_bad_input_one_line_errors(kwargs, message):
    params, x = _mlp_args(d=30)
    with pytest.raises(ShardsolveError, match=message) as info:
        shardsolve.plan(_mlp_step, params, x, **kwargs)
    assert "\n" not in str(info.value)


def test_uneven_pins_are_planned_and_oversized_splits_refused():
    """30 columns over 4 devices pad to shards of 8 (see tests/test_uneven.py); 3 rows over 4 leave a device empty."""
    params, x = _mlp_args(d=30)
    plan = shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P(None, "model")))
    assert plan.inputs[-1] == Sharding.from_spec(P(None, "model"), 2)
    assert plan.in_shardings[1] == NamedSharding(plan.mesh.jax_mesh(), P())  # JAX takes it evened
    _close(plan.jit()(params, x), _mlp_step(params, x))
    params, x = _mlp_args(batch=3, d=30)
    with pytest.raises(ShardsolveError, match=r"in_shardings\[1\].*dimension 0 of size 3 into 4 parts") as info:
        shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("model")))
    assert "\n" not in str(info.value)


def test_plan_is_deterministic_and_round_trips(tmp_path):
    params, x = _mlp_args()
    a = shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")))
    b = shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")))
    assert a.dumps() == b.dumps()  # plan files are byte-for-byte deterministic
    path = tmp_path / "plan.json"
    a.save(path)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # an ordinary file, not a private temp file
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    loaded = shardsolve.load_plan(path)
    assert loaded.inputs == a.inputs and loaded.ops == a.ops and loaded.collectives == a.collectives
    bound = shardsolve.load_plan(path, _mlp_step, params, x)
    _close(bound.jit()(params, x), _mlp_step(params, x))
    with pytest.raises(ShardsolveError, match="different function"):
        shardsolve.load_plan(path, _mlp_step, params, jnp.ones((8, 32)))


def test_verify_without_a_plan_says_so():
    with pytest.raises(ShardsolveError, match="verify expects a Plan .* got NoneType"):
        shardsolve.verify(None, jnp.ones((4, 4)))


def test_load_plan_refuses_other_versions(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "shardsolve-plan", "version": 99, "shardsolve": "9.9"}))
    with pytest.raises(ShardsolveError, match="version 99"):
        shardsolve.load_plan(path)
    path.write_text("{not json")
    with pytest.raises(ShardsolveError, match="not valid JSON"):
        shardsolve.load_plan(path)


def test_predicted_collectives_name_value_and_consumer():
    def f(x, w):
        return (x @ w).sum(axis=0)

    x = jnp.ones((16, 32))
    w = jnp.ones((32, 8))
    # Contracting dimension split: the result is partial and must be reduced.
    plan = shardsolve.plan(f, x, w, mesh="x=8", in_shardings=(P(None, "x"), P("x")), out_shardings=P())
    kinds = {c.kind for c in plan.collectives}
    assert kinds & {"all-reduce", "reduce-scatter"}
    for c in plan.collectives:
        assert c.bytes > 0 and c.time > 0 and c.value_name and c.consumer and c.producer
    _close(plan.jit()(x, w), f(x, w))


# -- random programs ---------------------------------------------------------------

MESHES = ["x=8", "a=2,b=4", "a=4,b=2", "a=2,b=2,c=2"]
UNARY = [jnp.tanh, jnp.exp, lambda v: v * 2.0, lambda v: jnp.maximum(v, 0.0), jnp.negative]


@st.composite
def programs(draw):
    n_layers = draw(st.integers(1, 3))
    dims = [draw(st.sampled_from([8, 16, 32])) for _ in range(n_layers + 1)]
    batch = draw(st.sampled_from([8, 16]))
    acts = [draw(st.integers(0, len(UNARY) - 1)) for _ in range(n_layers)]
    reduce = draw(st.sampled_from(["none", "sum0", "sum1", "mean"]))
    mesh = draw(st.sampled_from(MESHES))
    axes = [a.split("=")[0] for a in mesh.split(",")]
    x_spec = draw(st.sampled_from([None, P(axes[0]), P(None, axes[-1]), P(tuple(axes[:2])) if len(axes) > 1 else P(axes[0])]))
    return dims, batch, acts, reduce, mesh, x_spec


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
# exp(exp(exp(.))) overflows: the lowered program must match the infs in place.
@example(([8, 8, 8, 8], 8, [1, 1, 1], "none", "x=8", None))
def test_random_programs_match_numerics(program):
    dims, batch, acts, reduce, mesh, x_spec = program

    def f(x, ws):
        h = x
        for w, a in zip(ws, acts):
            h = UNARY[a](h @ w)
        if reduce == "sum0":
            return h.sum(axis=0)
        if reduce == "sum1":
            return h.sum(axis=1)
        if reduce == "mean":
            return h.mean()
        return h

    keys = jax.random.split(jax.random.key(1), len(dims))
    x = jax.random.normal(keys[0], (batch, dims[0]))
    ws = [jax.random.normal(k, (a, b)) / a**0.5 for k, a, b in zip(keys[1:], dims, dims[1:])]
    plan = shardsolve.plan(f, x, ws, mesh=mesh, in_shardings=(x_spec, None))
    if x_spec is not None:
        assert plan.inputs[0] == Sharding.from_spec(x_spec, 2)
    _close(plan.jit()(x, ws), f(x, ws))
    outcome = check_lowering(plan, (x, ws))
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)


def test_carry_ties_state_to_its_next_value():
    params, x = _mlp_args()
    plan = shardsolve.plan(
        _mlp_step, params, x, mesh="data=2,model=4", in_shardings=(None, P("data")), carry=((0, 0),)
    )
    n = len(jax.tree_util.tree_leaves(params))
    assert plan.inputs[:n] == plan.outputs[:n]
    _close(plan.jit()(params, x), _mlp_step(params, x))
    with pytest.raises(ShardsolveError, match="different pytree structures"):
        shardsolve.plan(_mlp_step, params, x, mesh="data=2,model=4", carry=((1, 0),))


def test_arguments_jax_jit_takes_are_taken():
    """What ``jax.jit`` accepts, planned and verified alike: a Python scalar (float32 as JAX takes it), an argument
    that is None beside per-argument annotations, an empty dimension beside a pinned one, and a psum over an axis
    ``vmap`` names (a local reduction, no collective)."""
    w = jnp.full((16, 16), 0.1)
    x = jax.random.normal(jax.random.key(0), (8, 16))
    mesh = "data=2,model=4"

    def scaled(w, x, lr):
        return x @ w * lr

    plan = shardsolve.plan(scaled, w, x, 0.5, mesh=mesh, in_shardings=(None, P("data"), None))
    _close(plan.jit()(w, x, 0.5), scaled(w, x, 0.5))
    assert shardsolve.verify(plan, w, x, 0.5).ok

    def masked(w, x, mask):
        return x @ w if mask is None else (x @ w) * mask

    plan = shardsolve.plan(masked, w, x, None, mesh=mesh, in_shardings=(None, P("data"), None))
    assert plan.inputs[1] == Sharding.from_spec(P("data"), 2)
    _close(plan.jit()(w, x, None), masked(w, x, None))

    def both(x, z):
        return x * 2, z + 1

    z = jnp.zeros((8, 0))
    plan = shardsolve.plan(both, x, z, mesh=mesh, in_shardings=(P("data"), P("data")))
    assert plan.inputs[1] == Sharding.from_spec(P("data"), 2)
    _close(plan.jit()(x, z)[0], x * 2)

    def centred(w, x):
        return jax.vmap(lambda r: r - jax.lax.pmean(r, "b"), axis_name="b")(x @ w)

    plan = shardsolve.plan(centred, w, x, mesh=mesh, in_shardings=(None, P("data")))
    report = shardsolve.verify(plan, w, x)
    assert report.ok and report.numerics_ok, str(report)


@pytest.mark.parametrize("pad", [
    lambda x: jnp.pad(x, ((0, 0), (1, 1), (0, 0)), mode="edge"),  # slices rows into empty pieces it concatenates
    lambda x: jax.lax.concatenate([jnp.zeros((0, 16, 8)), x], 0) * 2,
])
def test_empty_pieces_keep_the_batch_split(pad):
    """Concatenating empty pieces along the split batch, or computing them from a row of it, moves nothing (as
    GSPMD plans it): the pieces have no elements, so the concatenation is its one non-empty operand."""
    x = jax.random.normal(jax.random.key(0), (64, 16, 8))
    plan = shardsolve.plan(pad, x, mesh="data=2,model=4", in_shardings=(P("data"),))
    assert plan.collectives == ()
    assert plan.outputs[0].dims[0][:1] == ("data",)
    _close(plan.jit()(x), pad(x))


def test_verify_allows_the_rounding_of_the_precision_computed_in():
    """A float32 gradient of bfloat16 matmuls over a split batch sums rounded bfloat16 partials: ``verify`` judges
    it at bfloat16's tolerance, the precision the program computes in, not at its float32 output's."""
    rng = np.random.default_rng(0)
    w = {"w1": jnp.asarray(rng.standard_normal((32, 64)).astype(np.float32) * 0.1),
         "w2": jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32) * 0.1)}
    batch = (jnp.asarray(rng.standard_normal((16, 32)), jnp.float32), jnp.asarray(rng.standard_normal((16, 32)), jnp.float32))

    def grads(p, batch):
        def loss(p):
            x, y = batch
            h = jax.nn.gelu(x.astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16))
            return jnp.mean(((h @ p["w2"].astype(jnp.bfloat16)).astype(jnp.float32) - y) ** 2)
        return jax.grad(loss)(p)

    plan = shardsolve.plan(grads, w, batch, mesh="data=2,model=4", in_shardings=(None, (P("data"), P("data"))))
    report = shardsolve.verify(plan, w, batch)
    assert report.ok, str(report)
    assert all(c.tolerance > 1e-3 * float(jnp.abs(grads(w, batch)[k]).max())
               for c, k in zip(report.numerics, ("w1", "w2")))
    f32 = shardsolve.plan(_mlp_step, *_mlp_args(), mesh="data=2,model=4", in_shardings=(None, P("data")))
    assert all(c.tolerance < 1e-3 for c in shardsolve.verify(f32, *_mlp_args()).numerics if c.dtype == "float32")


def test_a_cache_split_over_the_sequence_is_updated_where_it_lies():
    """A decode step whose KV cache is pinned split over the sequence (``P("data", "model")``), updated at a traced
    position: each device writes the new entry where it lands in its stretch, nothing of the cache's size moves
    (only the attention's small reductions), and the results match."""
    B, T, H, D, d = 4, 32, 2, 8, 16
    rng = np.random.default_rng(0)
    params = {n: jnp.asarray(rng.standard_normal((d, H * D)), jnp.float32) * 0.1 for n in ("wq", "wk", "wv")}
    cache = {n: jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for n in ("k", "v")}
    x = jnp.asarray(rng.standard_normal((B, d)), jnp.float32)

    def step(p, cache, x, pos):
        q = (x @ p["wq"]).reshape(B, H, D)
        kc = jax.lax.dynamic_update_slice(cache["k"], (x @ p["wk"]).reshape(B, 1, H, D), (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(cache["v"], (x @ p["wv"]).reshape(B, 1, H, D), (0, pos, 0, 0))
        s = jnp.where(jnp.arange(T) <= pos, jnp.einsum("bhd,bthd->bht", q, kc), -1e9)
        return jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1), vc), {"k": kc, "v": vc}

    pos = jnp.int32(13)
    plan = shardsolve.plan(step, params, cache, x, pos, mesh="data=2,model=4", carry=((1, 1),),
                           in_shardings=(None, P("data", "model"), P("data"), None))
    assert plan.inputs[3] == Sharding.from_spec(P("data", "model"), 4)  # the cache as pinned
    cache_bytes = B * T * H * D * 4 // 8
    assert all(c.bytes < cache_bytes for c in plan.collectives), [(c.kind, c.bytes) for c in plan.collectives]
    _close(plan.jit()(params, cache, x, pos), step(params, cache, x, pos))
    _close(plan.jit()(params, cache, x, jnp.int32(31)), step(params, cache, x, jnp.int32(31)))


def test_a_reshape_with_dimensions_is_planned_as_transpose_then_reshape():
    """``lax.reshape(x, sizes, dimensions)`` (a grouped convolution's kernel gradient has one) transposes first:
    traced as the two operations, each with its rule, rather than a fallback."""
    x = jax.random.normal(jax.random.key(0), (8, 4, 6))

    def f(x):
        return jax.lax.reshape(x, (6, 32), dimensions=(2, 0, 1)) * 2

    plan = shardsolve.plan(f, x, mesh="data=2,model=4", in_shardings=(P("data"),))
    assert not plan.fallbacks
    _close(plan.jit()(x), f(x))


def test_linear_solves_and_checkpoint_names_are_planned_not_replicated():
    """``jnp.linalg.solve``/``inv`` (a ``custom_linear_solve`` around an LU) trace as their forward solve, split
    over the batch of matrices, gradients included; ``checkpoint_name`` is an identity. No fallback, as in
    GSPMD's plan nothing moves."""
    a = jax.random.normal(jax.random.key(0), (16, 4, 4)) + 3 * jnp.eye(4)
    b = jax.random.normal(jax.random.key(1), (16, 4, 1))

    def solved(a, b):
        x = checkpoint_name(jnp.linalg.solve(a, b), "x")
        return x, jnp.linalg.inv(a), jax.grad(lambda a: (jnp.linalg.solve(a, b) ** 2).sum())(a)

    plan = shardsolve.plan(solved, a, b, mesh="data=2,model=4", in_shardings=(P("data"), P("data")))
    assert not plan.fallbacks and plan.collectives == ()
    _close(plan.jit()(a, b), solved(a, b))


def test_carry_ties_an_uneven_pin_as_jax_lays_it_out():
    """An argument pinned to an uneven split (30 columns over 4 devices) arrives evened at the ``jax.jit``
    boundary; its next value is tied to that layout, so the step can be called again with its own output
    (the tie used to demand the uneven split of the output too, and found no plan)."""
    u = jax.random.normal(jax.random.key(0), (30, 30))
    plan = shardsolve.plan(lambda u: u * 2, u, mesh="data=2,model=4", in_shardings=(P("data", "model"),),
                           carry=((0, 0),))
    assert plan.inputs[0] == Sharding.from_spec(P("data", "model"), 2)
    assert jax.tree.leaves(plan.in_shardings)[0] == jax.tree.leaves(plan.out_shardings)[0]
    step = plan.jit()
    _close(step(step(u)), u * 4)


def test_a_token_sliced_from_a_split_sequence_moves_only_that_token():
    """The first token of a sequence split over devices (a ViT's class token under sequence parallelism): each
    device reads it where it lies and a small sum combines them; the sequence is never gathered."""
    x = jax.random.normal(jax.random.key(0), (4, 64, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))

    def head(x, w):
        return x[:, 0] @ w

    plan = shardsolve.plan(head, x, w, mesh="data=2,model=4", in_shardings=(P("data", "model"), None))
    token = 4 * 32 * 4 // 2  # one token per example, of the data shard
    assert all(c.bytes <= token for c in plan.collectives), [(c.kind, c.bytes) for c in plan.collectives]
    _close(plan.jit()(x, w), head(x, w))


def test_a_pin_over_a_mesh_axis_of_one_device_holds_through_a_carry():
    """``P("data")`` on a mesh whose ``data`` has one device is the replicated layout: an argument pinned so and
    carried to an output (``carry``) ties to that output's layout (it was called infeasible)."""
    x = jnp.ones((16, 8))
    for f in (lambda x: x * 2, lambda x: jax.lax.while_loop(lambda h: h.sum() < 1000, lambda h: h * 2, x)):
        plan = shardsolve.plan(f, x, mesh="data=1,model=8", in_shardings=(P("data"),), carry=((0, 0),),
                               time_limit=10)
        assert plan.outputs[0].without_unit_axes(plan.mesh) == plan.inputs[0].without_unit_axes(plan.mesh)
        assert shardsolve.verify(plan, x).ok


def test_a_convolution_by_fft_runs_as_planned():
    """An FFT convolution's kernel gradient: the plan runs (XLA's CPU FFT once refused the transposed layout it
    gave the inverse transform of a pending sum) and matches the unsharded step."""
    def step(k, x):
        def loss(k):
            y = jnp.fft.irfft(jnp.fft.rfft(x, axis=1) * jnp.fft.rfft(k, axis=0)[None], n=x.shape[1], axis=1)
            return jnp.mean(y ** 2)

        value, grad = jax.value_and_grad(loss)(k)
        return k - 0.1 * grad, value

    k, x = jax.random.normal(jax.random.key(0), (32, 64)), jax.random.normal(jax.random.key(1), (16, 32, 64))
    plan = shardsolve.plan(step, k, x, mesh="data=2,model=4", in_shardings=(None, P("data")), time_limit=10)
    assert shardsolve.verify(plan, k, x).ok


def test_any_and_all_over_a_split_dimension_combine_booleans_not_the_rows():
    """``any``/``all`` over the rows a batch pin splits are a maximum and a minimum of booleans: each device
    reduces its rows and one all-reduce of the booleans combines them (the rows were gathered before)."""
    x = jax.random.normal(jax.random.key(0), (4096, 4))

    def flags(x):
        return (x > 2).any(0), (x > -3).all(0)

    plan = shardsolve.plan(flags, x, mesh="data=8", in_shardings=(P("data"),), time_limit=10)
    assert sorted((c.kind, c.bytes) for c in plan.collectives) == [("all-reduce", 4), ("all-reduce", 4)]
    report = shardsolve.verify(plan, x)
    assert report.ok, report
