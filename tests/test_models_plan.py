"""Every bundled model, planned from its own annotations, runs through ``plan.jit()`` and the rewriter's
lowering with exact numerics, and the lowering runs the collectives the plan predicts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from lower_cases import check_lowering

import shardsolve
from shardsolve.sharding import Sharding

# scan_transformer is planned and lowered the same way in test_scan.py. With only the batch pinned the
# small models' plans all-gather and little else; the expert (Megatron) pins make them all-reduce and
# reduce-scatter partial sums, so the lowering's reductions are checked too.
MODELS = ["mlp.py:mlp", "gpt2.py:gpt2", "gpt2.py:gpt2_adam", "llama.py:llama", "moe.py:moe", "cnn.py:cnn",
          "mlp.py:mlp expert", "gpt2.py:gpt2 expert"]


@pytest.mark.parametrize("name", MODELS)
def test_model_plan_matches_unsharded(models_dir, name):
    name, _, annotations = name.partition(" ")
    if not (models_dir / name.split(":")[0]).exists():
        pytest.skip(f"{name} is not bundled")
    model = shardsolve.load_model(f"{models_dir}/{name}", "small")
    in_shardings = model.expert_in_shardings if annotations == "expert" else model.in_shardings
    plan = shardsolve.plan(
        model.fun, *model.args, mesh="data=2,model=4", in_shardings=in_shardings,
        out_shardings=model.out_shardings, carry=model.carry, time_limit=10,
    )
    if annotations == "expert":
        assert {k for k, _ in plan.cost.bytes_by_kind} & {"all-reduce", "reduce-scatter"}
    assert plan.status in ("optimal", "feasible")
    assert not plan.fallbacks, plan.fallbacks  # every primitive of the bundled models has a rule
    # Annotations are respected exactly.
    from shardsolve.annotations import broadcast_annotations

    tree = jax.tree_util.tree_structure(model.args)
    for got, ann in zip(plan.inputs, broadcast_annotations(in_shardings, tree, "in_shardings"), strict=True):
        if ann is not None:
            assert got == Sharding.from_spec(ann, got.ndim)
    expected = jax.jit(model.fun)(*model.args)
    got = plan.jit()(*model.args)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # plan.jit() only pins layouts (JAX computes the same whatever they are): the rewriter's program
    # is what a bad plan would break.
    outcome = check_lowering(plan, model.args, expected)
    assert outcome.numerics_ok, f"{name}: lowered numerics off by {outcome.max_rel:.2e}"
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)
