"""The reshard cost cache: steps worked out once per (src, dst, shape class) agree with working them out per shape."""

from __future__ import annotations

import math
import random

import pytest

from shardsolve.cost import collective_time, reshard_steps, reshard_steps_uncached, reshard_time
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
