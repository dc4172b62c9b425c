"""The reshard cost cache: steps worked out once per (src, dst, shape class) agree with working them out per shape."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shardsolve.cost import COMBINED_KINDS, ReshardTables, collective_cost, collective_time, reshard_steps, reshard_steps_uncached, reshard_time
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding, candidate_shardings

MESHES = [
    MeshSpec.parse("data=2,model=4"),
    MeshSpec.parse("a=2,b=3,c=2", bandwidth={"b": 1e10}),
    MeshSpec.parse("x=8"),
]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 30, 768, 50257]


def _random_pair(rng: random.Random, shape: tuple[int, ...], mesh: MeshSpec) -> tuple[Sharding, Sharding]:
    cands = candidate_shardings(shape, mesh, allow_uneven=True)
    src, dst = rng.choice(cands), rng.choice(cands)
    free = [a for a in mesh.names if a not in src.axes]
    src = src.with_partial([a for a in free if rng.random() < 0.4], rng.choice(["sum", "sum", "max"]))
    if rng.random() < 0.2:
        free = [a for a in mesh.names if a not in dst.axes]
        dst = dst.with_partial([a for a in free if rng.random() < 0.5], rng.choice(["sum", "max"]))
    return src, dst


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_cached_reshards_match_uncached(mesh):
    rng = random.Random(str(mesh))
    for _ in range(600):
        rank = rng.choice([1, 2, 3])
        shape = tuple(rng.choice(SIZES) for _ in range(rank))
        src, dst = _random_pair(rng, shape, mesh)
        itemsize = rng.choice([2, 4])
        # The same pair on another shape of the rank first, so that shapes share the cache.
        for sh in (tuple(rng.choice(SIZES) for _ in range(rank)), shape):
            want = reshard_steps_uncached(sh, itemsize, src, dst, mesh)
            assert reshard_steps(sh, itemsize, src, dst, mesh) == want, (sh, src, dst)
            got = reshard_time(sh, itemsize, src, dst, mesh)
            if want is None:
                assert math.isinf(got)
            else:
                # The same float, to the bit: plans must not change with the cache.
                assert got == sum(collective_time(s.kind, s.axes, s.bytes, mesh) for s in want), (sh, src, dst)


TABLE_MESHES = MESHES + [MeshSpec.parse("a=2,one=1,b=4", latency={"b": 3e-6})]


@pytest.mark.parametrize("mesh", TABLE_MESHES, ids=str)
def test_tables_equal_reshard_time_to_the_bit(mesh):
    """``ReshardTables`` prices whole tables in numpy: every entry is ``reshard_time``'s float, or ``impossible``."""
    rng = random.Random(f"tables {mesh}")
    tables = ReshardTables(mesh, impossible=-1.0)
    checked = impossible = merges = 0
    for _ in range(60):
        rank = rng.choice([0, 1, 2, 3])
        shape = tuple(rng.choice(SIZES) for _ in range(rank))
        pool = [_random_pair(rng, shape, mesh) for _ in range(12)]
        if "one" in mesh.names and rank:  # axes of size 1, which move nothing
            pool.append((Sharding((("one",),) + ((),) * (rank - 1)), Sharding(((),) * rank, partial=("one",))))
        src = tables.ids(rng.sample([p[0] for p in pool], rng.randint(1, len(pool))) + [p[1] for p in pool[:2]])
        dst = tables.ids([p[1] for p in pool] + [p[0] for p in pool[:3]])
        # The same sharding sets again on other shapes of the rank: the second finds every pair's steps known.
        for sh in (shape, tuple(rng.choice(SIZES) for _ in range(rank)), shape[::-1]):
            itemsize = rng.choice([2, 4])
            got = tables.table(sh, itemsize, src, dst)
            assert got.shape == (len(src), len(dst))
            merged = tables.mergeable_latency(sh, itemsize, src, dst)
            want_merged = _merged_latency(tables, sh, itemsize, src, dst)
            assert list(merged) == list(want_merged)  # the same keys, in the same order
            assert all(np.array_equal(merged[k], want_merged[k]) for k in merged)
            merges += len(merged)
            for a, s in enumerate(src):
                for b, d in enumerate(dst):
                    want = reshard_time(sh, itemsize, tables.shardings[s], tables.shardings[d], mesh)
                    if math.isinf(want):
                        assert got[a, b] == -1.0, (sh, tables.shardings[s], tables.shardings[d])
                        impossible += 1
                    else:
                        assert got[a, b] == want, (sh, tables.shardings[s], tables.shardings[d], got[a, b], want)
                    checked += 1
    assert 0 < impossible < checked and merges  # both kinds of entry are met, and mergeable all-reduces


def _merged_latency(tables, shape, itemsize, src, dst) -> dict:
    """``ReshardTables.mergeable_latency`` worked out pair by pair (distinct ids in order) and step by step."""
    su, si = np.unique(src, return_inverse=True)
    du, di = np.unique(dst, return_inverse=True)
    out: dict = {}
    for a, s in enumerate(su):
        for b, d in enumerate(du):
            for step in reshard_steps(shape, itemsize, tables.shardings[s], tables.shardings[d], tables.mesh) or ():
                if step.kind in COMBINED_KINDS and step.is_collective:
                    k = (step.kind, step.axes, step.src.reduce_op)
                    out.setdefault(k, np.zeros((len(su), len(du))))[a, b] += collective_cost(
                        step.kind, step.axes, tables.mesh).latency
    return {k: t[np.ix_(si, di)] for k, t in out.items()}
