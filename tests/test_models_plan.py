"""Every bundled model, planned from its own annotations, runs through ``plan.jit()`` with exact numerics."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import shardsolve
from shardsolve.sharding import Sharding

MODELS = ["mlp.py:mlp", "gpt2.py:gpt2", "llama.py:llama", "moe.py:moe", "scan_transformer.py:scan_transformer"]


@pytest.mark.parametrize("name", MODELS)
def test_model_plan_matches_unsharded(models_dir, name):
    if not (models_dir / name.split(":")[0]).exists():
        pytest.skip(f"{name} is not bundled")
    model = shardsolve.load_model(f"{models_dir}/{name}", "small")
    plan = shardsolve.plan(
        model.fun, *model.args, mesh="data=2,model=4", in_shardings=model.in_shardings,
        out_shardings=model.out_shardings, carry=model.carry, time_limit=10,
    )
    assert plan.status in ("optimal", "feasible")
    # Annotations are respected exactly.
    from shardsolve.annotations import broadcast_annotations

    tree = jax.tree_util.tree_structure(model.args)
    for got, ann in zip(plan.inputs, broadcast_annotations(model.in_shardings, tree, "in_shardings")):
        if ann is not None:
            assert got == Sharding.from_spec(ann, got.ndim)
    expected = jax.jit(model.fun)(*model.args)
    got = plan.jit()(*model.args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
