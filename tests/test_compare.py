"""shardsolve.compare: GSPMD, Shardy and shardsolve compiled side by side and judged by one cost model.

Compile-only on 8 fake CPU devices, with small programs so the file stays fast.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve.compare import Comparison, gspmd_propagation
from shardsolve.cost import collective_time, communication_time, compute_time, hlo_collective_time
from shardsolve.explain import Explanation, explain, explain_column, explain_conflicts, split_op_name, tiles
from shardsolve.hlo import HloCollective
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding

MESH = "data=2,model=4"


def mlp2(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


X = jax.ShapeDtypeStruct((32, 64), jnp.float32)
W1 = jax.ShapeDtypeStruct((64, 128), jnp.float32)
W2 = jax.ShapeDtypeStruct((128, 64), jnp.float32)


def conflicting(x, w):
    return jnp.tanh(x @ w)


@pytest.fixture(scope="module")
def cmp() -> Comparison:
    return shardsolve.compare(
        mlp2, X, W1, W2, mesh=MESH, in_shardings=(P("data"), None, None), time_limit=20,
        expert_in_shardings=(P("data"), P(None, "model"), P("model", None)), memory_limit="1MiB",
    )


@pytest.fixture(scope="module")
def conflict_cmp() -> Comparison:
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    # x's rows and w's rows (the contracted dimension) both on "data"; x returned as it came, pinned on "model".
    return shardsolve.compare(lambda x, w: (conflicting(x, w), x), x, w, mesh=MESH,
                              in_shardings=(P("data", None), P("data", None)),
                              out_shardings=(P(None, "model"), P(None, "model")), time_limit=20)


def test_all_columns_present_and_compiled(cmp: Comparison) -> None:
    assert cmp.names == ("gspmd", "shardy", "shardsolve", "expert")
    for column in cmp.columns:
        assert column.ok, (column.name, column.error)
        assert column.flops > 0 and column.bytes_accessed > 0
        assert column.peak_memory > 0
        assert column.fits is (column.peak_memory <= 2**20)
    assert cmp.best_propagation() is not None
    assert cmp.plan is not None


def test_one_cost_model_for_every_column(cmp: Comparison) -> None:
    mesh = cmp.mesh
    for column in cmp.columns:
        assert column.compute == pytest.approx(compute_time(column.flops, column.bytes_accessed, mesh))
        expected = sum(collective_time(c.kind, c.axes, c.bytes, mesh) for c in column.collectives)
        assert column.communication == pytest.approx(expected)
        assert column.total == pytest.approx(column.compute + column.communication)
        assert dict(column.bytes_by_kind) == {
            k: sum(c.bytes for c in column.collectives if c.kind == k) for k in {c.kind for c in column.collectives}
        }
    # The expert plan splits the weights over "model": its per-device FLOPs are a quarter of replicated ones'.
    assert cmp["expert"].flops < cmp["shardy"].flops
    assert any(c.kind == "all-reduce" and c.axes == ("model",) for c in cmp["expert"].collectives)


def test_json_round_trip(cmp: Comparison) -> None:
    data = json.loads(json.dumps(cmp.to_json()))
    assert [c["name"] for c in data["columns"]] == list(cmp.names)
    assert data["columns"][0]["total"] == pytest.approx(cmp.columns[0].total)


def test_failing_baseline_is_reported_in_its_column() -> None:
    # 64 rows do not split evenly in 3: JAX rejects the annotation; planning is still attempted.
    cmp = shardsolve.compare(mlp2, X, W1, W2, mesh="data=2,model=4", in_shardings=(P("data"), None, None),
                             expert_in_shardings=(P("data"), P(None, "nope"), None), columns=("shardy", "expert"))
    assert cmp["shardy"].ok
    expert = cmp["expert"]
    assert not expert.ok and math.isinf(expert.total)
    assert "nope" in expert.error and "\n" not in expert.error


def test_uneven_pins_are_given_to_propagation_evened() -> None:
    # 10 rows over the 4 devices of "model": jax.jit refuses that pin; GSPMD, Shardy and the expert are given it
    # evened (the rows unsplit), as plan.jit() takes the plan's, and say so in their label.
    x = jax.ShapeDtypeStruct((10, 64), jnp.float32)
    said: list[str] = []
    cmp = shardsolve.compare(mlp2, x, W1, W2, mesh=MESH, in_shardings=(P("model"), None, None), time_limit=20,
                             expert_in_shardings=(P("model"), P(None, "data"), None), progress=said.append)
    for name in ("gspmd", "shardy", "expert"):
        assert cmp[name].ok, cmp[name].error
        assert cmp[name].label.endswith("(evened)")
        assert cmp[name].in_specs[0] == "P()", cmp[name].in_specs
    assert cmp["expert"].in_specs[1] == "P(None, 'data')"  # the even pins stay as given
    assert cmp["shardsolve"].ok and cmp["shardsolve"].label == "shardsolve"
    assert any("args[0] split unevenly" in m for m in said)
    even = shardsolve.compare(mlp2, X, W1, W2, mesh=MESH, in_shardings=(P("data"), None, None), columns=("shardy",))
    assert even["shardy"].label == "Shardy"  # an even pin is given as it is


def test_gspmd_setting_is_restored_even_on_error() -> None:
    before = jax.config.jax_use_shardy_partitioner
    with pytest.raises(RuntimeError):
        with gspmd_propagation():
            assert jax.config.jax_use_shardy_partitioner is False
            raise RuntimeError("boom")
    assert jax.config.jax_use_shardy_partitioner == before


def test_subaxis_and_irregular_groups_are_priced() -> None:
    mesh = MeshSpec.parse(MESH)
    sub = HloCollective("all-reduce", ("model:(1)2",), 1024, "f32[256]", "", "", groups="[4,2]<=[8]")
    assert hlo_collective_time(sub, mesh) == pytest.approx(
        collective_time("all-reduce", ("data",), 1024, mesh)  # a group of 2 on the same links
    )
    odd = HloCollective("all-gather", ("?",), 1024, "f32[256]", "", "", groups="{{0,5},{1,4},{2,7},{3,6}}")
    assert 0 < hlo_collective_time(odd, mesh) < math.inf
    assert communication_time([sub, odd], mesh) > 0


def test_explain_plan_lines_name_value_shardings_and_consumer(cmp: Comparison) -> None:
    plan = cmp.plan
    lines = explain(plan)
    assert len(lines) == len(plan.collectives)
    for e, c in zip(lines, plan.collectives, strict=True):
        text = e.line()
        assert c.value_name in text and str(c.src) in text and str(c.dst) in text and c.consumer in text
        assert e.bytes == c.bytes and e.time == pytest.approx(c.time)


def test_explain_baseline_attributes_collectives(cmp: Comparison) -> None:
    lines = explain_column(cmp["expert"], cmp.plan)
    assert len(lines) == len(cmp["expert"].collectives) > 0
    for e in lines:
        assert isinstance(e, Explanation)
        assert "demanded by" in e.line()
        assert e.time > 0
    # The row-split w2 leaves a partial sum: an all-reduce over "model" at the second dot_general.
    ar = [e for e in lines if e.kind == "all-reduce" and e.axes == ("model",)]
    assert ar and any("dot_general" in e.producer for e in ar)
    assert any("partial{model}" in e.src for e in ar)
    assert all(e.note for e in ar)  # says what shardsolve does at the same op


def test_conflicting_annotations_show_both_resolutions(conflict_cmp: Comparison) -> None:
    assert all(c.ok for c in conflict_cmp.columns), [c.error for c in conflict_cmp.columns]
    conflicts = explain_conflicts(conflict_cmp)
    whats = [c.what for c in conflicts]
    assert any("dot_general" in w and "args[0]" in w and "args[1]" in w for w in whats), whats
    assert any(w.startswith("outputs[1] pinned") for w in whats), whats
    for conflict in conflicts:
        assert conflict.shardsolve  # the solver's chosen collective(s), with their cost
        assert {p for p, _ in conflict.baselines} == {"gspmd", "shardy"}
        text = "\n".join(conflict.lines())
        assert "shardsolve chose" in text and "gspmd inserted" in text and "shardy inserted" in text
    dot = next(c for c in conflicts if "dot_general" in c.what)
    assert any(exps for _, exps in dot.baselines)  # propagation inserted something at the dot


def test_helpers() -> None:
    assert split_op_name("jit(f)/(a/dot_general:transpose(jvp())/reduce_sum)") == [
        ("a", "dot_general"), ("transpose(jvp())", "reduce_sum")]
    assert split_op_name("jit(f)/jvp(jit(g))/mul") == [("jvp()", "mul")]
    assert tiles((8, 16, 64), (4, 16, 16)) == "[8/2, 16, 64/4]"


def test_sharding_view_draws_device_blocks() -> None:
    from rich.console import Console

    from shardsolve.cli.explain import sharding_view

    console = Console(width=100, record=True)
    mesh = MeshSpec.parse(MESH)
    console.print(sharding_view("w", (64, 256), "float32", Sharding((("data",), ("model",))), mesh))
    text = console.export_text()
    assert "dev 0" in text and "dev 7" in text and "dim 0 split over data" in text
    rows = [ln for ln in text.splitlines() if "│ dev" in ln]
    assert rows[0].count("dev") == 4 and len(rows) == 2  # 2 x 4 blocks
    console.print(sharding_view("b", (64,), "float32", Sharding(((),)), mesh))
    assert "dev 0,1,2,3,4,5,6,7" in console.export_text()


TINY_MODEL = """
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import shardsolve

def step(w, x):
    return jnp.tanh(x @ w["w1"]) @ w["w2"]

def tiny(size="small"):
    w = {"w1": jax.ShapeDtypeStruct((64, 128), jnp.float32), "w2": jax.ShapeDtypeStruct((128, 64), jnp.float32)}
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    return shardsolve.Model(step, (w, x), in_shardings=(None, P("data")), name="tiny",
                            expert_in_shardings=({"w1": P(None, "model"), "w2": P("model", None)}, P("data")))
"""


def test_cli_compare_and_explain(tmp_path, capsys) -> None:
    from shardsolve.cli import main

    model_file = tmp_path / "tiny.py"
    model_file.write_text(TINY_MODEL)
    out = tmp_path / "cmp.json"
    plan_file = tmp_path / "plan.json"
    rc = main(["compare", f"{model_file}:tiny", "--mesh", MESH, "--time-limit", "20", "--explain",
               "-o", str(out), "--plan-output", str(plan_file)])
    text = capsys.readouterr().out
    assert rc == 0
    for label in ("GSPMD", "Shardy", "shardsolve", "expert", "step time", "peak memory"):
        assert label in text
    data = json.loads(out.read_text())
    assert len(data["columns"]) == 4
    rc = main(["explain", str(plan_file), "--show", "w1"])
    text = capsys.readouterr().out
    assert rc == 0 and "predicted collectives" in text and "args[0]['w1']" in text and "dev " in text
