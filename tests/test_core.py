"""Meshes, shardings and the cost model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from shardsolve.cost import collective_time, compute_time, reshard_steps, reshard_time
from shardsolve.errors import ShardsolveError
from shardsolve.mesh import V5E_HBM_BANDWIDTH, MeshSpec, as_mesh_spec
from shardsolve.sharding import Sharding, candidate_shardings

MESH = MeshSpec.parse("data=2,model=4")


# -- mesh ------------------------------------------------------------------------


def test_mesh_parse_and_defaults():
    mesh = MeshSpec.parse("data=2, model=4")
    assert mesh.shape == {"data": 2, "model": 4}
    assert mesh.size == 8
    assert mesh.axis("model").bandwidth == 4.5e10
    assert str(mesh) == "data=2,model=4"
    assert MeshSpec.parse("a:2 b:2").names == ("a", "b")


def test_mesh_link_overrides():
    mesh = MeshSpec.parse("data=2,model=4", bandwidth={"data": 1e9}, latency=2e-6)
    assert mesh.axis("data").bandwidth == 1e9
    assert mesh.axis("model").bandwidth == 4.5e10
    assert mesh.axis("model").latency == 2e-6
    with pytest.raises(ShardsolveError, match="unknown mesh axis 'pipe'"):
        MeshSpec.parse("data=2", bandwidth={"pipe": 1.0})


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "mesh is empty"),
        ("data=2,model", "cannot parse mesh axis 'model'"),
        ("data=2,data=4", "appears twice"),
        ("data=0", "sizes are integers >= 1"),
        ("2=data", "cannot parse mesh axis"),
    ],
)
def test_mesh_parse_errors(text, message):
    with pytest.raises(ShardsolveError, match=message):
        MeshSpec.parse(text)


def test_mesh_from_jax_objects():
    from jax.sharding import AbstractMesh

    spec = as_mesh_spec(AbstractMesh((2, 4), ("data", "model")))
    assert spec.shape == {"data": 2, "model": 4}
    with pytest.raises(ShardsolveError, match="mesh must be"):
        as_mesh_spec(42)


# -- shardings ---------------------------------------------------------------------


def test_sharding_from_spec_and_back():
    s = Sharding.from_spec(P("data", ("model",)), 3, MESH)
    assert s.dims == (("data",), ("model",), ())
    assert s.to_spec() == P("data", "model")
    assert Sharding.from_spec(None, 2) == Sharding.replicated(2)
    assert Sharding.from_spec(P(("data", "model")), 1, MESH).to_spec() == P(("data", "model"))


@pytest.mark.parametrize(
    "spec, ndim, message",
    [
        (P("pipe"), 1, "unknown mesh axis 'pipe'"),
        (P("data", "data"), 2, "uses mesh axis 'data' twice"),
        (P("data", None, None), 2, "has 3 entries but the value has rank 2"),
    ],
)
def test_sharding_from_spec_errors(spec, ndim, message):
    with pytest.raises(ShardsolveError, match=message):
        Sharding.from_spec(spec, ndim, MESH, what="in_shardings[0]")


def test_candidates_divide_evenly():
    cands = candidate_shardings((6, 8), MESH)
    assert cands[0] == Sharding.replicated(2)
    assert all(c.divides((6, 8), MESH) for c in cands)
    assert Sharding((("model",), ())) not in cands  # 6 is not divisible by 4
    assert Sharding((("data",), ("model",))) in cands
    assert len(set(cands)) == len(cands)


def test_scalar_has_one_candidate():
    assert candidate_shardings((), MESH) == [Sharding(())]


def test_sharding_json_round_trip():
    s = Sharding((("data",), ()), ("model",), "max")
    assert Sharding.from_json(s.to_json()) == s


# -- cost model --------------------------------------------------------------------

SHARDINGS_2D = candidate_shardings((8, 16), MESH)


def _with_partial(s: Sharding, draw_axes) -> Sharding:
    free = [a for a in MESH.names if a not in s.axes]
    chosen = [a for a in free if a in draw_axes]
    return s.with_partial(chosen)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SHARDINGS_2D), st.sampled_from(SHARDINGS_2D), st.sets(st.sampled_from(MESH.names)))
def test_reshard_steps_reach_the_target(src, dst, partial):
    src = _with_partial(src, partial)
    steps = reshard_steps((8, 16), 4, src, dst, MESH)
    assert steps is not None
    state = src
    for step in steps:
        assert step.src == state
        state = step.dst
        if step.kind == "all-gather":
            assert step.bytes == step.dst.local_bytes((8, 16), 4, MESH)
        if step.kind == "reduce-scatter":
            assert step.bytes == step.src.local_bytes((8, 16), 4, MESH)
    assert state == dst
    # The price is the one collective formula applied to each step: nothing moves for free, nothing twice.
    time = reshard_time((8, 16), 4, src, dst, MESH)
    assert time == pytest.approx(sum(collective_time(s.kind, s.axes, s.bytes, MESH) for s in steps), rel=1e-12)
    assert (time == 0) == all(s.kind == "slice" for s in steps)
    assert (len(steps) == 0) == (src == dst)


def test_reshard_partial_cases():
    rs = reshard_steps((8, 16), 4, Sharding(((), ()), ("model",)), Sharding((("model",), ())), MESH)
    assert [(s.kind, s.axes) for s in rs] == [("reduce-scatter", ("model",))]
    ar = reshard_steps((8, 16), 4, Sharding(((), ()), ("data", "model")), Sharding(((), ())), MESH)
    assert [(s.kind, s.axes) for s in ar] == [("all-reduce", ("data", "model"))]
    # A value cannot become partial by resharding.
    assert reshard_steps((8, 16), 4, Sharding(((), ())), Sharding(((), ()), ("data",)), MESH) is None
    assert math.isinf(reshard_time((8, 16), 4, Sharding(((), ())), Sharding(((), ()), ("data",)), MESH))


def test_reshard_all_to_all_moves_an_axis():
    steps = reshard_steps((8, 16), 4, Sharding((("model",), ())), Sharding(((), ("model",))), MESH)
    assert [(s.kind, s.axes, s.dim, s.concat_dim) for s in steps] == [("all-to-all", ("model",), 1, 0)]


def test_slicing_is_free_and_gathering_is_not():
    rep = Sharding(((), ()))
    split = Sharding((("model",), ()))
    assert reshard_time((8, 16), 4, rep, split, MESH) == 0.0
    assert reshard_time((8, 16), 4, split, rep, MESH) > 0.0


def test_collective_costs_order():
    nbytes = 1 << 20
    ag = collective_time("all-gather", ("model",), nbytes, MESH)
    ar = collective_time("all-reduce", ("model",), nbytes, MESH)
    alpha = MESH.axis("model").latency
    assert ar - alpha == pytest.approx(2 * (ag - alpha))  # two passes over the bytes, one start-up
    # More bytes, more time; a bigger group moves a larger fraction.
    assert collective_time("all-gather", ("model",), 2 * nbytes, MESH) > ag
    assert collective_time("all-gather", ("data", "model"), nbytes, MESH) > ag
    slow = MESH.with_links(bandwidth={"model": 1e9})
    assert collective_time("all-gather", ("model",), nbytes, slow) > ag


def test_collective_time_is_one_start_up_plus_a_ring_of_bytes():
    """One latency per collective (not per ring hop), whatever the group: the yardstick's formula."""
    nbytes, bw, alpha = 1 << 16, MESH.axis("model").bandwidth, MESH.axis("model").latency
    assert collective_time("all-gather", ("model",), nbytes, MESH) == pytest.approx(alpha + 3 / 4 * nbytes / bw)
    assert collective_time("reduce-scatter", ("model",), nbytes, MESH) == pytest.approx(alpha + 3 / 4 * nbytes / bw)
    assert collective_time("all-to-all", ("model",), nbytes, MESH) == pytest.approx(alpha + 3 / 4 * nbytes / bw)
    assert collective_time("all-reduce", ("model",), nbytes, MESH) == pytest.approx(alpha + 2 * 3 / 4 * nbytes / bw)
    assert collective_time("collective-permute", ("model",), nbytes, MESH) == pytest.approx(alpha + nbytes / bw)
    # Two axes: eight devices, one start-up (the slower axis's), so one all-reduce over both beats two in turn.
    both = collective_time("all-reduce", ("data", "model"), nbytes, MESH)
    assert both == pytest.approx(alpha + 2 * 7 / 8 * nbytes / bw)
    small = 64
    assert collective_time("all-reduce", ("data", "model"), small, MESH) < (
        collective_time("all-reduce", ("data",), small, MESH) + collective_time("all-reduce", ("model",), small, MESH))
    slow = MESH.with_links(latency={"data": 5e-6})
    assert collective_time("all-reduce", ("data", "model"), small, slow) == pytest.approx(5e-6 + 2 * 7 / 8 * small / bw)


def test_compute_time_is_flops_at_peak_or_a_roofline():
    # By default (the yardstick's pricing) bytes cost nothing: compute is FLOPs at peak.
    assert compute_time(MESH.peak_flops, 0, MESH) == pytest.approx(1.0)
    assert compute_time(MESH.peak_flops / 2, 1e15, MESH) == pytest.approx(0.5)
    assert compute_time(MESH.peak_flops / 8, 0, MESH) < compute_time(MESH.peak_flops, 0, MESH)
    # With an HBM bandwidth, the slower of FLOPs and bytes.
    roofline = MeshSpec.parse("data=2,model=4", hbm_bandwidth=V5E_HBM_BANDWIDTH)
    assert compute_time(0, roofline.hbm_bandwidth, roofline) == pytest.approx(1.0)
    assert compute_time(roofline.peak_flops / 2, roofline.hbm_bandwidth, roofline) == pytest.approx(1.0)
    assert compute_time(roofline.peak_flops, roofline.hbm_bandwidth / 2, roofline) == pytest.approx(1.0)
