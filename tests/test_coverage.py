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


def _switch_out_of_range(x, w):
    """``lax.switch`` clamps its index; the ``cond`` primitive itself takes its last branch out of range."""
    branches = [lambda a, v: jnp.tanh(a @ v), lambda a, v: a * 2.0, lambda a, v: jnp.sin(a) @ v]
    index = (x[0, 0] > 0).astype(jnp.int32) * -7 + 4  # -3 (these arguments) or 4: out of range either way
    return lax.cond_p.bind(index, x, w, branches=tuple(jax.make_jaxpr(b)(x, w) for b in branches))[0]


def _cond_with_loop(x, w):
    """A branch with a while loop is kept whole: its loop might not end where the index does not take it."""
    return lax.cond(x.sum() > 0, lambda a: lax.while_loop(lambda h: h.sum() > 0, lambda h: h - 1.0, a), jnp.tanh, x)


def _while_until_small(x, w):
    """A loop whose condition reduces over the split batch: every device must agree when it ends."""
    return lax.while_loop(lambda h: jnp.max(jnp.abs(h)) > 0.05, lambda h: 0.5 * jnp.tanh(h @ w), x)


def _fori_dynamic(x, w):
    """``fori_loop`` with a bound that is a traced value: a while loop, its count a carry."""
    return lax.fori_loop(0, jnp.int32(x.shape[1]) // 4, lambda i, h: jnp.tanh(h @ w) + h, x)


def _while_in_scan(x, w):
    def outer(h, _):
        return lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (h, 0))[0], h.sum()

    return lax.scan(outer, x, None, length=3)


@pytest.mark.parametrize("fun, fallbacks", [(_cond, ()), (_switch_out_of_range, ()), (_cond_with_loop, (("cond", 1),)),
                                            (_while, ()), (_while_until_small, ()), (_fori_dynamic, ()),
                                            (_while_in_scan, ()), (_remat, ()), (_custom_vjp, ()), (_nested_scans, ())])
def test_control_flow_plans_and_lowers_exactly(fun, fallbacks):
    """remat and custom_vjp are inlined, scans nest, a while loop's body (its condition in it) is planned once
    as a scan's is, a cond runs every branch and selects; a cond with a loop in a branch falls back, reported,
    never silently."""
    x, w = _x(16, 8), _x(8, 8, key=1) / 8**0.5
    plan = shardsolve.plan(fun, x, w, mesh=MESH, in_shardings=(P("data"), None), time_limit=10)
    assert plan.fallbacks == fallbacks
    outcome = check_lowering(plan, (x, w))
    assert outcome.numerics_ok, outcome.max_rel
    assert outcome.collectives_ok, (outcome.predicted, outcome.lowered)


def _counted(x, w, start=1, bound=10, step=2):
    return lax.while_loop(lambda c: bound > c[1], lambda c: (jnp.tanh(c[0] @ w), step + c[1]), (x, start))[0]


def _counted_through(x, w):  # i <= 4 from 0: five runs
    return lax.while_loop(lambda c: c[1] <= 4, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]


@pytest.mark.parametrize("fun, length", [(_while, 3), (_counted, 5), (_counted_through, 5),
                                         (lambda x, w: _counted(x, w, 12), None),
                                         (_fori_dynamic, 1), (_while_until_small, 1)])
def test_a_counted_while_loop_is_a_scan_of_its_trip_count(fun, length):
    """A loop from a literal to a literal bound (which XLA counts too) runs as a scan of its trip count; one
    that never runs is no op; any other loop is counted once, as XLA's cost_analysis counts it."""
    x, w = _x(16, 8), _x(8, 8, key=1) / 8**0.5
    plan = shardsolve.plan(fun, x, w, mesh=MESH, in_shardings=(P("data"), None), time_limit=10)
    assert [o.length for o in plan.ops if o.primitive == "scan"] == ([length] if length else [])
    assert check_lowering(plan, (x, w)).numerics_ok


def _newton_sqrt(a, y):
    """Newton's step and its test read the same ``y * y - a``: it runs in the loop's condition and in its body."""
    def step(c):
        y, it = c
        return y - (y * y - a) / (2 * y), it + 1

    return lax.while_loop(lambda c: (jnp.max(jnp.abs(c[0] * c[0] - a)) > 1e-4) & (c[1] < 50), step, (y, 0))


@pytest.mark.parametrize("fun", [_while_until_small, _newton_sqrt])
def test_a_while_loop_runs_its_condition_in_the_loops_condition(fun):
    """The condition planned inside the body (``trace._predicate_carried``) runs where the loop tests it: its
    all-reduce in the compiled loop's condition, no select and no flag in the body, and exactly the planned
    collectives."""
    x, w = jnp.abs(_x(64, 8)) + 1.0, jnp.abs(_x(64, 8, key=1)) + 1.0
    if fun is _while_until_small:
        w = _x(8, 8, key=1) / 8**0.5
    plan = shardsolve.plan(fun, x, w, mesh=MESH, in_shardings=(P("data"), P("data") if fun is _newton_sqrt else None),
                           time_limit=10)
    text = plan.jit().lower(x, w).as_text()
    loop = text[text.index("stablehlo.while"):]
    condition, body = loop[:loop.index("} do {")], loop[loop.index("} do {"):]
    assert "all_reduce" in condition
    assert "stablehlo.select" not in body[:body.index("stablehlo.return")]
    outcome = check_lowering(plan, (x, w))
    assert outcome.numerics_ok and outcome.collectives_ok, (outcome.max_rel, outcome.predicted, outcome.lowered)


def test_a_while_loop_keeps_its_carry_split():
    """The loop's carry stays split over the batch as it was pinned: no collective gathers it (the fallback
    replicated the whole carry); a condition over the split batch costs one all-reduce of a scalar a step."""
    x, w = _x(4096, 64), _x(64, 64, key=1) / 64**0.5  # (gathering a megabyte costs more than the latency)
    for fun, reduced in ((_fori_dynamic, False), (_while_until_small, True)):
        plan = shardsolve.plan(fun, x, w, mesh=MESH, in_shardings=(P("data"), None), out_shardings=P("data"),
                               time_limit=10)
        assert not plan.fallbacks
        assert all(c.kind == "all-reduce" and c.bytes <= 4 for c in plan.collectives), plan.collectives
        assert bool(plan.collectives) == reduced


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


def test_a_scan_body_is_rewritten_as_the_program_is():
    """Every equation the program's trace rewrites is rewritten in a scan body too: ``checkpoint_name`` there
    is the identity it is (it fell back, replicating the carry), a ``while`` loop and a ``cond`` are planned."""
    from jax.ad_checkpoint import checkpoint_name

    def f(x, w):
        def body(h, _):
            h = checkpoint_name(jnp.tanh(h @ w), "act")
            h = lax.cond(h.sum() > 0, jnp.sin, jnp.cos, h)
            return lax.while_loop(lambda g: jnp.max(jnp.abs(g)) > 0.5, lambda g: 0.5 * g, h), None

        return lax.scan(body, x, None, length=3)[0]

    x, w = _x(16, 8), _x(8, 8, key=1) / 8**0.5
    plan = shardsolve.plan(f, x, w, mesh=MESH, in_shardings=(P("data"), None), time_limit=10)
    assert plan.fallbacks == ()
    outcome = check_lowering(plan, (x, w))
    assert outcome.numerics_ok and outcome.collectives_ok, (outcome.max_rel, outcome.predicted, outcome.lowered)


def test_too_many_strategies_for_a_node_are_refused_in_one_line():
    """On a mesh of many axes a value's layouts multiply (six axes of 2 over three dimensions: tens of thousands),
    and a reshard table holds one entry per pair: refused by name, with the way out, before any table is made."""
    x = jax.ShapeDtypeStruct((64, 64, 64), jnp.float32)
    with pytest.raises(shardsolve.ShardsolveError, match=r"sharding strategies on mesh a=2,b=2,c=2,d=2,e=2,f=2 "
                                                         r"\(at most 8,192 can be planned") as info:
        shardsolve.plan(lambda x: jnp.tanh(x) * 2.0, x, mesh="a=2,b=2,c=2,d=2,e=2,f=2")
    assert "plan on a mesh of fewer axes" in str(info.value) and "\n" not in str(info.value)
