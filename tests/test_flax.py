"""Flax models plan as Flax users write them: NNX state, Linen trees, logical-axis rules out, plans applied back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardsolve
import shardsolve.flax as ssflax

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

MESH = "data=2,model=4"


def _named(init, names):
    return nnx.with_partitioning(init, names)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, names: bool = True):
        n = _named if names else (lambda init, _: init)
        self.norm = nnx.LayerNorm(16, scale_init=n(nnx.initializers.ones_init(), ("embed",)),
                                  bias_init=n(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)
        self.up = nnx.Linear(16, 64, kernel_init=n(nnx.initializers.lecun_normal(), ("embed", "mlp")),
                             bias_init=n(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=n(nnx.initializers.lecun_normal(), ("mlp", "embed")),
                               bias_init=n(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(self.norm(x))))


def _nnx_setup(names: bool = True):
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(0), names)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    graphdef, params = nnx.split(model)
    opt_graphdef, opt_state = nnx.split(optimizer)

    def step(params, opt_state, x, y):
        m = nnx.merge(graphdef, params, copy=True)
        opt = nnx.merge(opt_graphdef, opt_state, copy=True)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        opt.update(m, grads)
        return nnx.state(m), nnx.state(opt), loss

    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (32, 16)), jax.random.normal(ky, (32, 16))
    return model, step, (params, opt_state, x, y)


def _plan(step, args, **kw):
    return shardsolve.plan(step, *args, mesh=MESH, in_shardings=(None, None, P("data"), P("data")),
                           carry=((0, 0), (1, 1)), **kw)


@pytest.fixture(scope="module")
def nnx_plan():
    model, step, args = _nnx_setup()
    return model, step, args, _plan(step, args, logical_rules=True)


@pytest.fixture(scope="module")
def pinned_plan():
    """The MLP planned with its up-projection pinned column-split, so the rules split "mlp"."""
    _, step, args = _nnx_setup()
    flat, tree = jax.tree_util.tree_flatten_with_path(args[0])
    pins = jax.tree_util.tree_unflatten(tree, [P(None, "model") if jax.tree_util.keystr(p).startswith("['up']['kernel']")
                                              else None for p, _ in flat])
    return shardsolve.plan(step, *args, mesh=MESH, in_shardings=(pins, None, P("data"), P("data")),
                           carry=((0, 0), (1, 1)), logical_rules=True)


def _specs_equal(a, b, shapes) -> bool:
    la = jax.tree_util.tree_leaves(a, is_leaf=lambda x: isinstance(x, NamedSharding))
    lb = jax.tree_util.tree_leaves(b, is_leaf=lambda x: isinstance(x, NamedSharding))
    return len(la) == len(lb) == len(shapes) and all(x.is_equivalent_to(y, len(s)) for x, y, s in zip(la, lb, shapes))


def _shapes(tree):
    return [x.shape for x in jax.tree_util.tree_leaves(tree)]


# -- NNX ---------------------------------------------------------------------------------


def test_nnx_train_step_plans_runs_and_names_parameters_by_path(nnx_plan, tmp_path: Path) -> None:
    _, step, args, plan = nnx_plan
    assert plan.status == "optimal"
    assert "args[0]['up']['kernel']" in plan.input_names
    assert "args[1]['opt_state'][0]['mu']['down']['kernel']" in plan.input_names
    want = jax.jit(step)(*args)
    got = plan.jit()(*args)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    # the plan file carries the names and the rules; a loaded plan shows them
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["input_names"][: len(plan.input_names)] == list(plan.input_names)
    loaded = shardsolve.load_plan(path)
    assert loaded.input_names == plan.input_names
    assert loaded.logical_axis_rules == plan.logical_axis_rules


def test_logical_rules_reproduce_the_plan_through_flax(nnx_plan) -> None:
    _, _, args, plan = nnx_plan
    rules = plan.logical_axis_rules
    assert [n for n, _ in rules] == ["embed", "mlp"]
    assert all(a is None or isinstance(a, (str, tuple)) for _, a in rules)
    mesh = plan.mesh.jax_mesh()
    for k in (0, 1):  # parameters, and the optimizer's moments, which carry the same names
        assert _specs_equal(ssflax.logical_shardings(args[k], mesh, rules), plan.in_shardings[k], _shapes(args[k]))
        with nnx.logical_axis_rules(rules):  # NNX's own path: rules from the context
            assert _specs_equal(nnx.get_named_sharding(args[k], mesh), plan.in_shardings[k], _shapes(args[k]))
    stats = dict(plan.stats)
    assert stats["logical_cost"] == pytest.approx(plan.cost.total)
    assert stats["logical_free_cost"] <= stats["logical_cost"] * (1 + 1e-9)
    assert stats["logical_overhead"] >= -1e-9


def test_apply_plan_lays_out_a_live_module(nnx_plan, pinned_plan) -> None:
    model, plan = nnx_plan[0], pinned_plan
    with nnx.use_eager_sharding(False):
        live = MLP(nnx.Rngs(0))
    assert ssflax.apply_plan(live, plan) is live
    state = nnx.state(live)
    got = jax.tree_util.tree_leaves(jax.tree.map(lambda x: x.sharding, state))
    assert _specs_equal(got, plan.in_shardings[0], _shapes(state))
    np.testing.assert_array_equal(np.asarray(live.up.kernel[...]), np.asarray(model.up.kernel[...]))
    assert any(s.spec != P() and any(s.spec) for s in got)  # something is split


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 64, kernel_init=_named(nnx.initializers.lecun_normal(), ("embed", "mlp")),
                             bias_init=_named(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=_named(nnx.initializers.lecun_normal(), ("mlp", "embed")),
                               bias_init=_named(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.up(x))))


def test_a_module_with_dropout_plans_with_its_rng_state_in_the_carry() -> None:
    """NNX keeps a dropout stream's key (a typed PRNG key) and counter in the module's state: the whole state,
    keys included, goes round the training step, planned on the key's data and handed back as a key."""
    with nnx.use_eager_sharding(False):
        model = DropoutMLP(nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(model)

    def step(state, x, y):
        m = nnx.merge(graphdef, state, copy=True)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        _, params, _ = nnx.split(m, nnx.Param, ...)
        nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return nnx.state(m), loss

    x = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16) / 512
    args = (state, x, jnp.cos(x))
    # (the stream's key and counter carry no logical names: they have no dimensions of their own to split)
    plan = shardsolve.plan(step, *args, mesh=MESH, in_shardings=(None, P("data"), P("data")), carry=((0, 0),),
                           logical_rules=True)
    assert [n for n, _ in plan.logical_axis_rules] == ["embed", "mlp"]
    assert "args[0]['drop']['rngs']['key']" in plan.input_names
    assert "threefry2x32" in plan.signature.in_keys
    report = shardsolve.verify(plan, *args)
    assert report.ok, report
    want = jax.jit(step)(*args)
    for run in (plan.jit(), jax.jit(step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)):
        got = run(*args)
        for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    # the step's next key is the one the unplanned step hands on: the stream advances as written
    assert int(got[0]["drop"]["rngs"]["count"][...]) == int(state["drop"]["rngs"]["count"][...]) + 1
    with nnx.use_eager_sharding(False):
        live = DropoutMLP(nnx.Rngs(0, dropout=1))
    ssflax.apply_plan(live, plan, argument=0)
    assert isinstance(live.drop.rngs.key[...].sharding, NamedSharding)


def test_a_pinned_parameter_sets_its_names_rule(pinned_plan) -> None:
    plan = pinned_plan
    rules = dict(plan.logical_axis_rules)
    assert rules["mlp"] == "model" and rules["embed"] != "model"
    assert plan.in_shardings[1]["opt_state"][0]["mu"]["down"]["kernel"].get_value().spec[0] == "model"


# -- Linen -----------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("mlp",)))(x)
        return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)))(nn.gelu(h))


def test_linen_params_plan_the_same_way() -> None:
    module = LinenMLP()
    x, y = jax.random.normal(jax.random.key(1), (32, 16)), jax.random.normal(jax.random.key(2), (32, 16))
    params = module.init(jax.random.key(0), x)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((module.apply(p, x) - y) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    plan = shardsolve.plan(step, params, x, y, mesh=MESH, in_shardings=(None, P("data"), P("data")),
                           carry=((0, 0),), logical_rules=True)
    assert "args[0]['params']['Dense_0']['kernel']" in plan.input_names
    mesh = plan.mesh.jax_mesh()
    want = nn.logical_to_mesh_sharding(nn.get_partition_spec(params), mesh, list(plan.logical_axis_rules))
    assert _specs_equal(want, plan.in_shardings[0], _shapes(params))
    got = plan.jit()(params, x, y)
    ref = jax.jit(step)(params, x, y)
    for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    laid_out = ssflax.apply_plan(params, plan)
    assert _specs_equal(jax.tree.map(lambda a: a.sharding, jax.tree_util.tree_leaves(laid_out)), plan.in_shardings[0],
                        _shapes(params))


# -- bad input -------------------------------------------------------------------------------


def test_missing_names_are_refused_naming_the_parameter() -> None:
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(0))
        model.extra = nnx.Param(jnp.ones((16, 4)))  # no names
    graphdef, params = nnx.split(model)

    def step(params, x):
        return jnp.sum(nnx.merge(graphdef, params, copy=True)(x))

    with pytest.raises(shardsolve.ShardsolveError, match=r"args\[0\]\['extra'\] has no logical axis names.*pin it") as e:
        shardsolve.plan(step, params, jnp.ones((8, 16)), mesh=MESH, logical_rules=True)
    assert "\n" not in str(e.value)


def test_conflicting_names_are_refused_naming_both_parameters() -> None:
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(0))
        model.odd = nnx.Param(jnp.ones((3,)), out_sharding=("mlp",))  # 'mlp' is 64 elsewhere: no split fits both
    graphdef, params = nnx.split(model)

    def step(params, x):
        return jnp.sum(nnx.merge(graphdef, params, copy=True)(x)) + jnp.sum(params["odd"][...])

    with pytest.raises(shardsolve.ShardsolveError, match=r"'mlp'.*args\[0\]\['odd'\].*rename one") as e:
        shardsolve.plan(step, params, jnp.ones((8, 16)), mesh=MESH, logical_rules=True)
    assert "\n" not in str(e.value)


def test_no_names_at_all_is_refused() -> None:
    _, step, args = _nnx_setup(names=False)
    with pytest.raises(shardsolve.ShardsolveError, match="no argument carries logical axis names"):
        _plan(step, args, logical_rules=True)


def test_without_flax_the_core_plans_and_flax_features_name_the_extra(monkeypatch) -> None:
    for name in [m for m in sys.modules if m == "flax" or m.startswith("flax.")]:
        monkeypatch.setitem(sys.modules, name, None)  # imports of flax now fail as if it were not installed
    f = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    args = (jnp.ones((16, 8)), jnp.ones((32, 16)))
    plan = shardsolve.plan(f, *args, mesh=MESH, in_shardings=(None, P("data")))
    assert plan.input_names == ("args[0]", "args[1]")
    for call in (lambda: shardsolve.plan(f, *args, mesh=MESH, logical_rules=True),
                 lambda: ssflax.apply_plan({"w": args[0]}, plan)):
        with pytest.raises(shardsolve.ShardsolveError, match=r"needs Flax.*pip install -e '\.\[flax\]'") as e:
            call()
        assert "\n" not in str(e.value)


# -- the Flax LM in models/ ----------------------------------------------------------------------


def test_flax_lm_small_plans_with_rules_and_runs_exactly(models_dir: Path) -> None:
    model = shardsolve.load_model(str(models_dir / "flax_lm.py"), "small")
    plan = shardsolve.plan(model.fun, *model.args, mesh=MESH, in_shardings=model.in_shardings, carry=model.carry,
                           logical_rules=True)
    names = dict(plan.logical_axis_rules)
    assert set(names) == {"vocab", "embed", "position", "heads", "mlp", "norm"}
    mesh = plan.mesh.jax_mesh()
    assert _specs_equal(ssflax.logical_shardings(model.args[0], mesh, plan.logical_axis_rules), plan.in_shardings[0],
                        _shapes(model.args[0]))
    want = jax.jit(model.fun)(*model.args)
    got = plan.jit()(*model.args)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_flax_lm_maxtext_annotation_and_large_shapes(models_dir: Path) -> None:
    small = shardsolve.load_model(str(models_dir / "flax_lm.py"), "small")
    params_specs = small.expert_in_shardings[0]
    assert params_specs["embed"]["embedding"].get_value() == P("model", None)  # vocab on the tensor axis, embed unsplit
    assert params_specs["blocks"][0]["fc"]["kernel"].get_value() == P(None, "model")
    large = shardsolve.load_model(str(models_dir / "flax_lm.py"), "large")
    leaves = jax.tree_util.tree_leaves(large.args)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(large.args[0]))
    assert 120e6 < n_params < 170e6


def test_cli_plans_the_flax_lm_with_rules_and_explains_by_parameter_path(capsys, tmp_path: Path,
                                                                         models_dir: Path) -> None:
    from shardsolve.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(models_dir / "flax_lm.py"), "--mesh", MESH, "--logical-rules", "-o", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "logical-axis rules" in stdout and "embed ->" in stdout and "vs the free plan" in stdout
    assert main(["explain", str(out), "--show", "fc"]) == 0
    assert "args[0]['blocks'][0]['fc']['kernel']" in capsys.readouterr().out


def test_an_old_flax_is_refused_naming_the_version(monkeypatch) -> None:
    monkeypatch.setattr(flax, "__version__", "0.10.7")
    with pytest.raises(shardsolve.ShardsolveError, match=r"needs flax>=0\.12, found 0\.10\.7"):
        ssflax.require_flax("logical_rules=True")
