"""Behaviour no other test covered: CLI flags and commands end to end, control flow planned and lowered,
conflicts through ``shardsolve.plan``, and plans identical across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from lower_cases import check_lowering

import shardsolve
from shardsolve.cli import main
from shardsolve.errors import InfeasibleError
from shardsolve.iopddl import read_iopddl
from shardsolve.units import parse_memory_limit

from conftest import IOPDDL_DIR  # noqa: I001

MESH = "data=2,model=4"


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_iopddl_command_solves_instance_b(capsys, tmp_path):
    path = IOPDDL_DIR / "asplos-2025-iopddl-B.json.gz"
    if not path.exists():
        pytest.skip("IOPDDL instances not available")
    out = tmp_path / "answer.json"
    code, stdout, _ = _run(capsys, "iopddl", path, "--time-limit", "30", "--out", out)
    assert code == 0, stdout
    answer = json.loads(out.read_text())
    assert answer["status"] == "optimal"
    assert answer["cost"] == read_iopddl(path).evaluate(answer["solution"]) == answer["lower_bound"]
    assert "optimal" in stdout and f"wrote {out}" in stdout


@pytest.mark.parametrize("annotations", ["expert", "none"])
def test_plan_annotations_time_limit_and_a_memory_limit_that_holds(capsys, tmp_path, models_dir, annotations):
    out = tmp_path / "plan.json"
    code, stdout, _ = _run(capsys, "plan", f"{models_dir}/mlp.py:mlp", "--mesh", MESH, "--annotations", annotations,
                           "--time-limit", "5", "--memory-limit", "1MiB", "--top", "3", "-o", out)
    assert code == 0, stdout
    data = json.loads(out.read_text())
    assert data["source"].endswith(f"--annotations {annotations}")
    assert data["cost"]["peak_memory"] <= parse_memory_limit("1MiB")
    plan = shardsolve.load_plan(out)
    model = shardsolve.load_model(f"{models_dir}/mlp.py:mlp")
    if annotations == "expert":  # every expert annotation pinned
        assert plan.inputs[0].axes  # w1 split as the expert plan says
    assert plan.solve_time <= 5 * 1.05 + 2
    assert len(plan.inputs) == len(jax.tree_util.tree_leaves(model.args))


def test_plan_size_large_plans_abstract_arguments(capsys, tmp_path, models_dir):
    out = tmp_path / "plan.json"
    code, stdout, _ = _run(capsys, "plan", f"{models_dir}/mlp.py:mlp", "--mesh", MESH, "--size", "large",
                           "--time-limit", "10", "-o", out)
    assert code == 0, stdout
    data = json.loads(out.read_text())
    assert "--size large" in data["source"]
    assert max(max(shape) for shape, _ in data["signature"]["in_avals"]) >= 8192  # the large shapes


def test_explain_show_draws_the_arguments(capsys, tmp_path, models_dir):
    out = tmp_path / "plan.json"
    assert _run(capsys, "plan", f"{models_dir}/mlp.py:mlp", "--mesh", MESH, "-o", out)[0] == 0
    code, stdout, _ = _run(capsys, "explain", out, "--show", "args")
    assert code == 0
    assert "per device" in stdout and "dev 0" in stdout
    code, _, stderr = _run(capsys, "explain", out, "--show", "no_such_value")
    assert code == 2 and "no argument or output matches" in stderr


def test_compare_no_expert_leaves_out_the_expert_column(capsys, tmp_path, models_dir):
    out = tmp_path / "cmp.json"
    code, stdout, _ = _run(capsys, "compare", f"{models_dir}/mlp.py:mlp", "--mesh", MESH, "--no-expert",
                           "--time-limit", "5", "-o", out)
    assert code == 0, stdout
    names = [c["name"] for c in json.loads(out.read_text())["columns"]]
    assert "expert" not in names and "shardsolve" in names


def _x(*shape, key=0):
    return jax.random.normal(jax.random.key(key), shape)


def _cond(x, w):
    return lax.cond(x.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a * 2.0, x)


def _while(x, w):
    return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]


@jax.checkpoint
def _block(x, w):
    return jnp.sin(x @ w)


def _remat(x, w):
    return jax.grad(lambda w: _block(x, w).sum())(w)


@jax.custom_vjp
def _act(x):
    return jnp.tanh(x)


_act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))


def _custom_vjp(x, w):
    return jax.grad(lambda w: _act(x @ w).sum())(w)


def _nested_scans(x, w):
    def outer(h, _):
        def inner(g, _):
            return jnp.tanh(g @ w), None

        h, _ = lax.scan(inner, h, None, length=2)
        return h, h.sum()

    return lax.scan(outer, x, None, length=3)


@pytest.mark.parametrize("fun, fallbacks", [(_cond, (("cond", 1),)), (_while, (("while", 1),)), (_remat, ()),
                                            (_custom_vjp, ()), (_nested_scans, ())])
def test_control_flow_plans_and_lowers_exactly(fun, fallbacks):
    """remat and custom_vjp are inlined, scans nest; cond and while fall back, reported, never silently."""
    x, w = _x(16, 8), _x(8, 8, key=1) / 8**0.5
    plan = shardsolve.plan(fun, x, w, mesh=MESH, in_shardings=(P("data"), None), time_limit=10)
    assert plan.fallbacks == fallbacks
    outcome = check_lowering(plan, (x, w))
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)


def test_infeasible_error_names_its_conflict_through_plan():
    x, w = jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)
    with pytest.raises(InfeasibleError) as info:
        shardsolve.plan(lambda x, w: x @ w, x, w, mesh=MESH, in_shardings=(P(), P()), memory_limit="8KiB")
    conflict = info.value.conflict
    assert conflict and any("memory" in c for c in conflict), conflict
    assert all(c in str(info.value) for c in conflict)


def test_plans_are_byte_identical_across_processes(tmp_path, models_dir):
    outs = []
    for name in ("a.json", "b.json"):
        out = tmp_path / name
        subprocess.run([sys.executable, "-m", "shardsolve.cli", "plan", f"{models_dir}/mlp.py:mlp", "--mesh", MESH,
                        "--time-limit", "10", "-o", str(out)], check=True, capture_output=True, env=dict(os.environ))
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_pin_splitting_a_dimension_too_finely_is_refused_in_one_line():
    x = jax.ShapeDtypeStruct((6, 4), jnp.float32)
    with pytest.raises(shardsolve.ShardsolveError) as info:
        shardsolve.plan(lambda x: x * 2, x, mesh="x=8", in_shardings=(P("x"),))
    text = str(info.value)
    assert "splits dimension 0 of size 6 into 8 parts, more than it has elements" in text and "\n" not in text


def test_named_axis_collective_outside_shard_map_is_refused_in_one_line():
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    with pytest.raises(shardsolve.ShardsolveError) as info:
        shardsolve.plan(lambda x: lax.psum(x, "i"), x, mesh=MESH)
    text = str(info.value)
    assert text.startswith("tracing the function failed: NameError") and "unbound axis name" in text
    assert "\n" not in text


def test_a_shard_map_inside_the_function_is_refused_in_one_line():
    """Its shards are laid out by hand, and a nested shard_map over the plan's (already manual) axes cannot run
    inside the plan's own program: refused where it is, not at ``plan.jit()``."""
    jmesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x):
        h = jnp.tanh(x)
        return jax.shard_map(lambda a: a * lax.psum(a.sum(), "data"), mesh=jmesh, in_specs=P("data"),
                             out_specs=P("data"))(h).sum()

    with pytest.raises(shardsolve.ShardsolveError, match=r"jax.shard_map at .*test_coverage.py:\d+: a region") as info:
        shardsolve.plan(f, jax.ShapeDtypeStruct((8, 4), jnp.float32), mesh="data=2,model=4")
    assert "\n" not in str(info.value)
