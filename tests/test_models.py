"""The example models in models/: they load, run, learn, and plan from shapes at size large."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardsolve

# file:function; each step returns its updated state (the leading arguments) and then the loss.
MODELS = ["mlp.py:mlp", "gpt2.py:gpt2", "gpt2.py:gpt2_adam"]


# Small models are compiled without XLA's backend optimisations: it halves the compile
# time of the GPT-2 steps (~5 s -> ~2.5 s of CPU each) and changes no result we check.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_fast(jitted: Any, args: tuple) -> Any:
    return jitted.lower(*args).compile(FAST_COMPILE)


def load(models_dir: Path, spec: str, size: str) -> shardsolve.Model:
    return shardsolve.load_model(str(models_dir / spec), size)


def is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def broadcast(prefix: Any, tree: Any) -> list[tuple[Any, Any]]:
    """Pair each leaf of ``tree`` with the PartitionSpec/None of the pytree prefix above it."""
    if is_spec(prefix):
        return [(prefix, leaf) for leaf in jax.tree.leaves(tree)]
    if isinstance(prefix, dict):
        assert isinstance(tree, dict) and prefix.keys() == tree.keys()
        return [pair for k in prefix for pair in broadcast(prefix[k], tree[k])]
    assert isinstance(prefix, (list, tuple)) and isinstance(tree, (list, tuple)) and len(prefix) == len(tree)
    return [pair for p, t in zip(prefix, tree) for pair in broadcast(p, t)]


def with_state(args: tuple, out: tuple) -> tuple:
    """Next step's arguments: the returned state replaces the leading arguments."""
    state = out[:-1]
    return (*state, *args[len(state) :])


def count_eqns(jaxpr: Jaxpr, prims: set[str]) -> int:
    """Equations including those of nested jaxprs (pjit, custom_jvp, ...); collects primitive names."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        prims.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(sub, ClosedJaxpr):
                    n += count_eqns(sub.jaxpr, prims)
                elif isinstance(sub, Jaxpr):
                    n += count_eqns(sub, prims)
    return n


# ---------------------------------------------------------------- small: real numbers


@functools.cache
def small_losses(models_dir: Path, spec: str, steps: int = 4) -> tuple[float, ...]:
    """Losses of ``steps`` unsharded training steps at size small (compiled once per model)."""
    model = load(models_dir, spec, "small")
    step = compile_fast(jax.jit(model.fun), model.args)
    args, losses = model.args, []
    for _ in range(steps):
        out = step(*args)
        jax.tree.map(lambda new, old: np.testing.assert_equal(new.shape, old.shape), out[:-1], args[: len(out) - 1])
        losses.append(float(out[-1]))
        args = with_state(args, out)
    return tuple(losses)


@pytest.mark.parametrize("spec", MODELS)
def test_small_runs_and_learns(models_dir: Path, spec: str) -> None:
    model = load(models_dir, spec, "small")
    assert model.mesh_axes == ("data", "model")
    leaves = jax.tree.leaves(model.args)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert sum(x.nbytes for x in leaves) < 2**21  # hundreds of KB (GPT-2 + Adam moments: 1.4 MB)
    losses = small_losses(models_dir, spec)
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.01, losses


@pytest.mark.parametrize("spec", MODELS[:2])  # gpt2_adam shares gpt2's specs; each compile costs seconds
def test_small_expert_plan_runs_on_2x4_mesh(models_dir: Path, spec: str) -> None:
    """The Megatron annotations are valid jit shardings and give the same loss."""
    model = load(models_dir, spec, "small")
    mesh = jax.make_mesh((2, 4), model.mesh_axes)
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=is_spec)  # noqa: E731
    jitted = jax.jit(
        model.fun,
        in_shardings=named(model.expert_in_shardings),
        out_shardings=named(model.expert_out_shardings),
    )
    out = compile_fast(jitted, model.args)(*model.args)
    assert out[-1].sharding.is_fully_replicated
    expected = jax.eval_shape(model.fun, *model.args)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), out) == jax.tree.map(lambda x: (x.shape, x.dtype), expected)
    np.testing.assert_allclose(float(out[-1]), small_losses(models_dir, spec)[0], rtol=1e-5)


# ---------------------------------------------------------------- annotations


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("spec", MODELS)
def test_annotations(models_dir: Path, spec: str, size: str) -> None:
    model = load(models_dir, spec, size)
    # User annotations: batch on "data", everything else free.
    pinned = [(s, x) for s, x in broadcast(model.in_shardings, model.args) if s is not None]
    assert pinned and all(s == P("data") for s, _ in pinned)
    assert sum(x.size for _, x in pinned) < sum(x.size for x in jax.tree.leaves(model.args))
    # Expert annotations cover every argument and every output, and divide evenly on 2x4 and 4x2 meshes.
    out_shapes = jax.eval_shape(model.fun, *model.args)
    for prefix, tree in [(model.expert_in_shardings, model.args), (model.expert_out_shardings, out_shapes)]:
        pairs = broadcast(prefix, tree)
        assert len(pairs) == len(jax.tree.leaves(tree))
        for s, x in pairs:
            assert isinstance(s, P) and len(s) <= x.ndim
            for sizes in [(2, 4), (4, 2)]:
                axis_size = dict(zip(model.mesh_axes, sizes))
                for dim, axis in zip(x.shape, s):
                    assert axis is None or dim % axis_size[axis] == 0, (s, x.shape)
    # Megatron: some weight is column-split and some row-split on "model".
    specs = set(jax.tree.leaves(model.expert_in_shardings, is_leaf=is_spec))
    assert {P(None, "model"), P("model", None)} <= specs


# ---------------------------------------------------------------- large: shapes only


@pytest.mark.parametrize("spec", MODELS)
def test_large_is_abstract(models_dir: Path, spec: str) -> None:
    before = sum(a.nbytes for a in jax.live_arrays())
    model = load(models_dir, spec, "large")
    assert sum(a.nbytes for a in jax.live_arrays()) - before < 2**20  # nothing large allocated
    leaves = jax.tree.leaves(model.args)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) > 10**8
    out = jax.eval_shape(model.fun, *model.args)
    assert out[-1].shape == () and out[-1].dtype == jnp.float32
    assert jax.tree.structure(out[:-1]) == jax.tree.structure(model.args[: len(out) - 1])
    # Every carried argument comes back as the output of the same index, same shapes.
    assert model.carry == tuple((i, i) for i in range(len(out) - 1))
    for a, o in model.carry:
        assert jax.tree.map(lambda x: (x.shape, x.dtype), model.args[a]) == jax.tree.map(
            lambda x: (x.shape, x.dtype), out[o]
        )


def test_gpt2_large_jaxpr_has_thousands_of_equations(models_dir: Path) -> None:
    # Measured with JAX 0.10.2: 3,100 top-level equations, 3,271 counting nested jaxprs.
    model = load(models_dir, "gpt2.py:gpt2", "large")
    jaxpr = jax.make_jaxpr(model.fun)(*model.args)
    prims: set[str] = set()
    total = count_eqns(jaxpr.jaxpr, prims)
    print(f"gpt2 large: {len(jaxpr.eqns)} equations, {total} with nested jaxprs")
    assert 1_000 < len(jaxpr.eqns) <= total < 20_000
    assert {"dot_general", "gather", "select_n", "exp", "reduce_max", "rsqrt"} <= prims


def test_gpt2_layers(models_dir: Path) -> None:
    """``gpt2_layers(n)`` builds deeper/shallower versions for benchmarks, from shapes only."""
    spec = importlib.util.spec_from_file_location("_test_models_gpt2", models_dir / "gpt2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need their module registered
    spec.loader.exec_module(module)
    n_eqns = {}
    for n in (1, 2):
        model = module.gpt2_layers(n)
        assert len(model.args[0]["blocks"]) == n == len(model.expert_in_shardings[0]["blocks"])
        n_eqns[n] = len(jax.make_jaxpr(model.fun)(*model.args).eqns)
    assert n_eqns[2] > n_eqns[1]
    deep = module.gpt2_layers(96)
    assert len(deep.args[0]["blocks"]) == 96
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(deep.args))
    small = module.gpt2_layers(3, "small")
    assert len(small.args[0]["blocks"]) == 3 and isinstance(small.args[1], jax.Array)
