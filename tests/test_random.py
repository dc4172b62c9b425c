"""Programs that draw random numbers: dropout in a training step plans, runs and lowers like any other.

``jax.random`` works on typed key arrays (``key<fry>[]``) even when the caller
passes legacy ``uint32[2]`` keys; ``trace`` carries every key as its key data,
so the planned program holds ordinary arrays and draws the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from lower_cases import check_lowering

import shardsolve
from shardsolve.errors import ShardsolveError
from shardsolve.trace import key_impl, trace

MESH = "data=2,model=4"


def _dropout_step(w, x, key):
    """One SGD step of a two-layer MLP with dropout on the hidden layer."""

    def loss(w):
        h = jnp.tanh(x @ w["a"])
        keep = jax.random.bernoulli(key, 0.75, h.shape)
        h = jnp.where(keep, h / 0.75, 0.0)
        return jnp.mean((h @ w["b"]) ** 2)

    value, grads = jax.value_and_grad(loss)(w)
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), value


def _args():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    w = {"a": jax.random.normal(k1, (16, 64)) / 4, "b": jax.random.normal(k2, (64, 8)) / 8}
    x = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16) / 512
    return w, x, jax.random.PRNGKey(7)


def _no_key_types(traced) -> bool:
    avals = [v.aval for e in traced.jaxpr.jaxpr.eqns for v in (*e.invars, *e.outvars)]
    return not any(key_impl(a) for a in avals + list(traced.in_avals) + list(traced.out_avals))


def test_dropout_with_a_legacy_key_plans_runs_and_lowers_exactly():
    args = _args()
    traced = trace(_dropout_step, *args)
    assert _no_key_types(traced)
    assert "threefry2x32" in {e.primitive.name for e in traced.jaxpr.jaxpr.eqns}
    plan = shardsolve.plan(_dropout_step, *args, mesh=MESH, in_shardings=(None, P("data"), None), time_limit=10)
    assert not plan.fallbacks, plan.fallbacks  # the counters and the hash have rules: the mask can be split
    want = _dropout_step(*args)
    for a, b in zip(jax.tree.leaves(plan.jit()(*args)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    outcome = check_lowering(plan, args, want)
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)


def test_typed_keys_made_split_indexed_and_folded_inside_draw_the_same_bits():
    def f(x, seed):
        key = jax.random.key(seed)
        keys = jax.random.split(key, 4)
        a, b = keys[1], keys[2:].reshape(2)[0]
        noise = jax.random.normal(jax.random.fold_in(a, 3), x.shape)
        return x * noise + jax.random.uniform(b, x.shape[-1:])

    x = jnp.arange(32 * 8, dtype=jnp.float32).reshape(32, 8)
    seed = jnp.int32(5)
    assert _no_key_types(trace(f, x, seed))
    plan = shardsolve.plan(f, x, seed, mesh=MESH, in_shardings=(P("data"), None), time_limit=10)
    outcome = check_lowering(plan, (x, seed))
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)
    # the same bits: other bits would give other numbers, not last-place rounding
    np.testing.assert_allclose(np.asarray(plan.jit()(x, seed)), np.asarray(f(x, seed)), rtol=1e-5)


def _step_with_a_typed_key(w, x, key):
    """Dropout from a typed key argument, which the step splits and hands back for the next step."""
    key, sub = jax.random.split(key)
    h = jnp.tanh(x @ w)
    return jnp.where(jax.random.bernoulli(sub, 0.75, h.shape), h / 0.75, 0.0).sum(0), key


def test_a_typed_key_argument_and_result_are_planned_on_their_data_and_cross_the_boundary_as_keys(tmp_path):
    w = jnp.arange(16 * 64, dtype=jnp.float32).reshape(16, 64) / 1024
    x = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16) / 512
    key = jax.random.key(3)
    plan = shardsolve.plan(_step_with_a_typed_key, w, x, key, mesh=MESH, in_shardings=(None, P("data"), None),
                           carry=((2, 1),), time_limit=10)
    assert plan.signature.in_keys == (None, None, "threefry2x32")
    assert plan.signature.out_keys == (None, "threefry2x32")
    assert plan.signature.in_avals[2] == ((2,), "uint32")  # the program takes the key's data
    # The boundary is the key's: a NamedSharding of the key's rank, usable by jax.jit as it is.
    assert plan.in_shardings[2].spec == P() and plan.out_shardings[1].spec == P()
    want = _step_with_a_typed_key(w, x, key)
    for run in (plan.jit(), plan.jit(execution="pinned"),
                jax.jit(_step_with_a_typed_key, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)):
        got = run(w, x, key)
        assert key_impl(got[1]) is not None  # a typed key comes back
        np.testing.assert_array_equal(jax.random.key_data(got[1]), jax.random.key_data(want[1]))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    report = shardsolve.verify(plan, w, x, key)
    assert report.ok, report
    # A plan file keeps the keys, and binds only to a function that takes and gives them.
    plan.save(tmp_path / "plan.json")
    loaded = shardsolve.load_plan(tmp_path / "plan.json", _step_with_a_typed_key, w, x, key)
    assert loaded.signature == plan.signature and loaded.in_shardings[2].spec == P()
    with pytest.raises(ShardsolveError, match="PRNG key arguments differ") as e:
        shardsolve.load_plan(tmp_path / "plan.json", lambda w, x, k: _step_with_a_typed_key(w, x, jax.random.wrap_key_data(k)),
                             w, x, jax.random.key_data(key))
    assert "\n" not in str(e.value)


def test_an_array_of_keys_is_split_like_its_batch_and_its_data_keeps_the_key_dimension_whole():
    def noisy(x, keys):
        noise = jax.vmap(lambda k, row: jax.random.normal(k, row.shape))(keys, x)
        return x + noise, jax.vmap(lambda k: jax.random.split(k)[0])(keys)

    x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
    keys = jax.random.split(jax.random.key(0), 16)
    plan = shardsolve.plan(noisy, x, keys, mesh=MESH, in_shardings=(P("data"), P("data")), time_limit=10)
    key_node = plan.inputs[1]
    assert key_node.dims[0] and not key_node.dims[1], key_node  # split by rows, each key's two words whole
    assert plan.in_shardings[1].spec == P("data")
    report = shardsolve.verify(plan, x, keys)
    assert report.ok, report
    with pytest.raises(ShardsolveError, match=r"in_shardings\[1\]: .* names 2 dimensions of a PRNG key array of "
                                              r"rank 1; give at most 1") as e:
        shardsolve.plan(noisy, x, keys, mesh=MESH, in_shardings=(P("data"), P("data", None)))
    assert "\n" not in str(e.value)
    with pytest.raises(ShardsolveError, match=r"argument args\[1\] must be a PRNG key array"):
        shardsolve.verify(plan, x, jax.random.key_data(keys))


def _split_by_scan(x, seed):
    def body(key, _):
        key, sub = jax.random.split(key)
        return key, jax.random.uniform(sub)

    _, draws = jax.lax.scan(body, jax.random.key(seed), None, length=4)
    return x * draws.sum()


def _dropout_per_layer(x, seed):
    """A key sliced per layer (``xs``) by a scan over layers."""
    keys = jax.random.split(jax.random.key(seed), 3)
    return jax.lax.scan(lambda h, k: (jnp.tanh(h) * jax.random.bernoulli(k, 0.9, h.shape), None), x, keys)[0]


def _key_through_cond(x, seed):
    key = jax.lax.cond(x.sum() > 0, lambda k: jax.random.split(k)[0], lambda k: k, jax.random.key(seed))
    return x * jax.random.normal(key, x.shape)


@pytest.mark.parametrize("fun", [_split_by_scan, _dropout_per_layer, _key_through_cond])
def test_key_arrays_through_control_flow_run_on_their_data(fun):
    """A key carried or sliced by a scan, or chosen by a cond, is run on its data like the rest of the program
    (each was refused before): the plan draws the same bits."""
    x = jax.random.normal(jax.random.key(1), (16, 8))
    plan = shardsolve.plan(fun, x, jnp.int32(3), mesh=MESH, in_shardings=(P("data"), None))
    report = shardsolve.verify(plan, x, jnp.int32(3))
    assert report.ok, report
    assert not plan.fallbacks


def test_a_key_array_through_a_cond_kept_whole_is_refused_in_one_line():
    def f(x, seed):
        key = jax.lax.cond(x.sum() > 0, lambda k: jax.lax.while_loop(lambda k: False, lambda k: k, k), lambda k: k,
                           jax.random.key(seed))
        return x * jax.random.normal(key, x.shape)

    with pytest.raises(ShardsolveError, match=r"cond on a PRNG key array .*key_data") as e:
        shardsolve.plan(f, jnp.ones((8, 8)), jnp.int32(0), mesh=MESH)
    assert "\n" not in str(e.value)


def test_poisson_loops_over_its_keys_and_is_planned():
    """``jax.random.poisson`` draws in a while loop over its keys (it raised an AttributeError once, and was
    refused after): the loop is planned with its body, on the keys' data, and draws the same samples."""
    mu = jnp.ones((16, 8))
    plan = shardsolve.plan(lambda k, mu: mu * jax.random.poisson(k, 3.0, (16, 1)), jax.random.PRNGKey(1), mu,
                           mesh="data=2,model=4", in_shardings=(None, P("data")))
    assert shardsolve.verify(plan, jax.random.PRNGKey(1), mu).ok
    assert not plan.fallbacks


def test_samplers_that_loop_inside_a_primitive_are_refused_in_one_line():
    """``jax.random.gamma`` (beta, dirichlet) loops over its keys inside a primitive the planner cannot follow:
    one line says so, and how to pass the samples in."""
    mu = jnp.ones((16, 8))
    with pytest.raises(ShardsolveError, match=r"random_gamma draws from a PRNG key inside the function") as e:
        shardsolve.plan(lambda k, mu: mu * jax.random.gamma(k, 2.0, (16, 1)), jax.random.PRNGKey(1), mu,
                        mesh="data=2,model=4", in_shardings=(None, P("data")))
    assert "\n" not in str(e.value)
