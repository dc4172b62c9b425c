"""Collectives read back from optimized HLO: real compiled programs and golden strings."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardsolve.hlo import (
    collectives_from_hlo,
    groups_to_axes,
    inventory,
    parse_replica_groups,
    shape_bytes,
)
from shardsolve.mesh import MeshSpec

MESH = MeshSpec.parse("data=2,model=4")


def _compiled(fun, *args) -> str:
    return jax.jit(fun).lower(*args).compile().as_text()


# -- real programs ---------------------------------------------------------------------


def test_shard_map_collectives_kinds_axes_and_bytes():
    mesh = MESH.jax_mesh()

    def f(x):  # local x: f32[4, 4] (64 bytes)
        a = jax.lax.psum(x, "model")
        b = jax.lax.all_gather(x, "data", axis=0, tiled=True)  # -> f32[8, 4]
        c = jax.lax.psum_scatter(x, "model", scatter_dimension=1, tiled=True)  # f32[4, 4] -> f32[4, 1]
        d = jax.lax.all_to_all(x, "model", 0, 1, tiled=True)  # f32[4, 4] -> f32[1, 16]
        e = jax.lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])
        g = jax.lax.pmax(x, ("data", "model"))
        return a, b, c, d, e, g

    sm = jax.shard_map(f, mesh=mesh, in_specs=P("data", "model"), out_specs=(P(),) * 6, check_vma=False)
    found = collectives_from_hlo(_compiled(sm, jnp.ones((8, 16))), MESH)
    inv = inventory(found)
    assert inv == {
        ("all-gather", ("data",)): 128,
        ("all-reduce", ("data", "model")): 64,
        ("all-reduce", ("model",)): 64,
        ("all-to-all", ("model",)): 64,
        ("collective-permute", ("model",)): 64,
        ("reduce-scatter", ("model",)): 64,
    }
    names = {c.kind: c.op_name for c in found}
    assert names["all-gather"].endswith("all_gather")
    assert names["collective-permute"].endswith("ppermute")
    # Every collective names its source line: the line of this file that called it.
    lines = Path(__file__).read_text().splitlines()
    calls = {"all-gather": ("all_gather(",), "all-reduce": ("psum(", "pmax("), "reduce-scatter": ("psum_scatter(",),
             "all-to-all": ("all_to_all(",), "collective-permute": ("ppermute(",)}
    assert len(found) >= 6
    for c in found:
        file, _, line = c.source.rpartition(":")
        assert Path(file).resolve() == Path(__file__).resolve(), c
        assert any(call in lines[int(line) - 1] for call in calls[c.kind]), (c, lines[int(line) - 1])


def test_jit_partitioned_collectives_map_to_mesh_axes():
    mesh = MESH.jax_mesh()
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    # Sum over the data-sharded dimension: one all-reduce over "data" of the local result.
    f = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P("data", "model")),
                out_shardings=NamedSharding(mesh, P("model")))
    inv = inventory(collectives_from_hlo(f.lower(x).compile().as_text(), MESH))
    assert inv == {("all-reduce", ("data",)): 8 * 4}
    # Replicating a fully sharded array: all-gathers whose bytes add up to the result per step.
    g = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data", "model")),
                out_shardings=NamedSharding(mesh, P()))
    found = collectives_from_hlo(g.lower(x).compile().as_text(), MESH)
    assert {c.kind for c in found} == {"all-gather"}
    assert {a for c in found for a in c.axes} == {"data", "model"}
    assert max(c.bytes for c in found) == 64 * 32 * 4


def test_one_and_three_dimensional_meshes():
    for text in ("x=8", "a=2,b=2,c=2"):
        spec = MeshSpec.parse(text)
        mesh = spec.jax_mesh()
        last = spec.names[-1]

        def f(x):
            return jax.lax.psum(x, last), jax.lax.psum(x * 2, spec.names)

        sm = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=(P(), P()), check_vma=False)
        inv = inventory(collectives_from_hlo(_compiled(sm, jnp.ones((4, 4))), spec))
        if len(spec.names) == 1:
            assert inv == {("all-reduce", (last,)): 128}
        else:
            assert inv == {("all-reduce", (last,)): 64, ("all-reduce", spec.names): 64}


# -- golden strings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, axes",
    [
        ("{{0,1,2,3},{4,5,6,7}}", ("model",)),
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("{{0,1,2,3,4,5,6,7}}", ("data", "model")),
        ("{}", ("data", "model")),
        ("[2,4]<=[8]", ("model",)),
        ("[4,2]<=[2,4]T(1,0)", ("data",)),
        ("[1,8]<=[8]", ("data", "model")),
        ("[4,2]<=[8]", ("model:(2)2",)),
        ("{{0,2},{1,3},{4,6},{5,7}}", ("model:(1)2",)),
        ("{{0,1},{2,3},{4,5},{6,7}}", ("model:(2)2",)),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ("model",)),
        ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", ("data",)),
        ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", ("model",)),
        ("mesh['a'=8] {'a':(1)2}", ("data",)),
        ("mesh['a'=8] {'a':(2)4}", ("model",)),
        ("mesh['a'=8] {'a'}", ("data", "model")),
        ("{{0,1},{2,5},{3,4},{6,7}}", ("?",)),
        ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    ],
)
def test_replica_groups_forms(text, axes):
    assert groups_to_axes(parse_replica_groups(text, 8), MESH).axes == axes


def test_group_order_keeps_listing_order():
    span = groups_to_axes(parse_replica_groups("{{0,4,1,5,2,6,3,7}}", 8), MESH)
    assert span.axes == ("data", "model") and span.order == ("model", "data")


def test_shape_bytes():
    assert shape_bytes("f32[4,8]{1,0}") == 128
    assert shape_bytes("(f32[16]{0}, bf16[8,32]{1,0})") == 64 + 512
    assert shape_bytes("pred[]") == 1
    assert shape_bytes("f32[4,8]{1,0:T(8,128)}") == 128


GOLDEN = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[4,8], p1: f32[16]) -> f32[8,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %ar = (f32[4,8]{1,0}, f32[16]{0}) all-reduce(%p0, %p1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/(dot_general:reduce_sum)" source_file="model.py" source_line=12}
  %ags = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p0), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/ss3/mul"}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %rs = f32[1,8]{1,0} reduce-scatter(f32[4,8]{1,0} %p0), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%p0), channel_id=4, source_target_pairs={{0,4},{4,0}}
  ROOT %cpd = f32[4,8]{1,0} collective-permute-done(%cps)
}
"""


def test_golden_module_async_tuple_and_typed_operands():
    found = collectives_from_hlo(GOLDEN, MESH)
    rows = [(c.kind, c.axes, c.bytes, c.is_async, c.op_name, c.source) for c in found]
    assert rows == [
        ("all-reduce", ("model",), 128 + 64, False, "jit(step)/(dot_general:reduce_sum)", "model.py:12"),
        ("all-gather", ("data",), 256, True, "jit(step)/ss3/mul", ""),
        ("reduce-scatter", ("model",), 128, False, "", ""),
        ("collective-permute", ("data",), 128, True, "", ""),
    ]
    assert inventory(found) == {
        ("all-gather", ("data",)): 256,
        ("all-reduce", ("model",)): 192,
        ("collective-permute", ("data",)): 128,
        ("reduce-scatter", ("model",)): 128,
    }


def test_inventory_puts_axes_in_mesh_order():
    class C:
        kind, axes, bytes = "all-gather", ("model", "data"), 10

    assert inventory([C()], MESH) == {("all-gather", ("data", "model")): 10}
    assert inventory([C()]) == {("all-gather", ("model", "data")): 10}
