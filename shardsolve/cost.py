"""The one cost model: collectives, compute and memory, per device.

Everything that prices a plan calls these functions: the solver's objective,
the plan's predicted collectives, the rewriter in ``shardsolve.lower`` (which
executes exactly the ``ReshardStep``s that ``reshard_steps`` returns), and the
comparison with GSPMD/Shardy. So "predicted == lowered" is checkable to the byte.

Collectives use the alpha-beta model on the mesh axes they span. For a group
of ``n`` devices along axes ``A`` with per-link bandwidth ``bw = min_a bw_a``
and latency ``alpha = sum_a alpha_a``, and ``B`` the bytes per device of the
larger of the collective's input and output buffers:

    all-gather, reduce-scatter, all-to-all:  alpha*(n-1) + B*(n-1)/n / bw
    all-reduce:                              2 * (alpha*(n-1) + B*(n-1)/n / bw)
    collective-permute:                      alpha + B / bw

Compute is roofline-style per device: ``max(flops/peak_flops, bytes/hbm_bw)``
where flops and bytes are one device's share, so replicated work is never free.

    >>> from shardsolve.mesh import MeshSpec
    >>> from shardsolve.sharding import Sharding
    >>> mesh = MeshSpec.parse("data=2,model=4")
    >>> steps = reshard_steps((8, 16), 4, Sharding((("data",), ())), Sharding(((), ("data",))), mesh)
    >>> [(s.kind, s.axes, s.bytes) for s in steps]
    [('all-to-all', ('data',), 256)]
    >>> steps = reshard_steps((8, 16), 4, Sharding(((), ()), partial=("model",)), Sharding((("model",), ())), mesh)
    >>> [(s.kind, s.axes, s.bytes, str(s.dst)) for s in steps]
    [('reduce-scatter', ('model',), 512, '[{model}, {}]')]
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One step of a resharding: a collective, or a local ``slice`` (no communication).

    ``src`` and ``dst`` are the value's shardings before and after the step.
    ``dim`` is the dimension gathered/scattered/sliced (for all-to-all: the
    dimension that becomes sharded, i.e. split); ``concat_dim`` is the
    dimension an all-to-all unshards. ``bytes`` is per device, the larger of
    the step's input and output buffers.
    """

    kind: str  # one of COLLECTIVE_KINDS, or "slice"
    axes: tuple[str, ...]
    bytes: int
    src: Sharding
    dst: Sharding
    dim: int | None = None
    concat_dim: int | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind != "slice"


FORBIDDEN_RESHARD = None  # returned by reshard_steps for impossible reshards


def collective_time(kind: str, axes: Sequence[str], nbytes: float, mesh: MeshSpec) -> float:
    """Seconds for one collective over ``axes`` moving ``nbytes`` per device."""
    if kind == "slice" or not axes:
        return 0.0
    n = mesh.group_size(axes)
    if n <= 1:
        return 0.0
    bw = min(mesh.axis(a).bandwidth for a in axes)
    alpha = sum(mesh.axis(a).latency for a in axes)
    if kind == "collective-permute":
        return alpha + nbytes / bw
    one_pass = alpha * (n - 1) + nbytes * (n - 1) / n / bw
    if kind == "all-reduce":
        return 2.0 * one_pass
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return one_pass
    raise ValueError(f"unknown collective kind {kind!r}")


def compute_time(flops: float, nbytes: float, mesh: MeshSpec) -> float:
    """Roofline time of one device's share of an operation."""
    return max(flops / mesh.peak_flops, nbytes / mesh.hbm_bandwidth)


def _nbytes(shape: Sequence[int], itemsize: int, sharding: Sharding, mesh: MeshSpec) -> int:
    return sharding.local_bytes(shape, itemsize, mesh)


def _uneven(shape: Sequence[int], axes: Sequence[str], d: int, mesh: MeshSpec) -> bool:
    n = mesh.group_size(axes)
    return n > 1 and shape[d] % n != 0


def _padded_bytes(shape: Sequence[int], itemsize: int, sharding: Sharding, d: int, n: int, mesh: MeshSpec) -> int:
    """Bytes of ``sharding``'s local buffer with dimension ``d`` padded up to a multiple of ``n``."""
    local = list(sharding.local_shape(shape, mesh))
    local[d] = -(-local[d] // n) * n
    return math.prod(local) * itemsize


@functools.lru_cache(maxsize=1 << 18)
def reshard_steps(
    shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec
) -> tuple[ReshardStep, ...] | None:
    """The steps that turn a value sharded as ``src`` into ``dst``, or ``None`` if impossible.

    Order: (1) pending reductions: a partial axis that ``dst`` shards on some
    dimension (as the next axis of that dimension) becomes a reduce-scatter,
    the rest one all-reduce; (2) an axis that leaves the minor end of one
    dimension for the next free place of another is one all-to-all; (3) the
    remaining axes ``dst`` does not keep are all-gathered, per dimension;
    (4) axes ``dst`` adds are taken by a local slice.

    Impossible: ``dst`` partial on an axis ``src`` is not, or partial with a
    different reduction.
    """
    shape = tuple(shape)
    if src == dst:
        return ()
    if set(dst.partial) - set(src.partial):
        return None
    if dst.partial and src.reduce_op != dst.reduce_op:
        return None
    steps: list[ReshardStep] = []
    cur_dims = [list(d) for d in src.dims]
    cur_partial = [a for a in src.partial if a not in dst.partial]
    keep_partial = tuple(dst.partial)

    def state(partial: Sequence[str]) -> Sharding:
        all_partial = tuple(sorted(set(partial) | set(keep_partial)))
        return Sharding(tuple(tuple(d) for d in cur_dims), all_partial, src.reduce_op if all_partial else "sum")

    # (1) pending reductions.
    if cur_partial:
        if src.reduce_op == "sum":
            for d, target in enumerate(dst.dims):
                # Reduce-scatter along d while dst's next axis on d is pending here.
                taken: list[str] = []
                # An uneven split is only scattered into from an unsplit dimension (shard
                # boundaries of nested uneven splits do not line up).
                if cur_dims[d] and _uneven(shape, target, d, mesh):
                    continue
                while (
                    len(cur_dims[d]) + len(taken) < len(target)
                    and list(target[: len(cur_dims[d])]) == cur_dims[d]
                    and target[len(cur_dims[d]) + len(taken)] in cur_partial
                    and target[len(cur_dims[d]) + len(taken)] not in taken
                ):
                    taken.append(target[len(cur_dims[d]) + len(taken)])
                if taken:
                    before = state(cur_partial)
                    in_bytes = _padded_bytes(shape, itemsize, before, d, mesh.group_size(taken), mesh)
                    cur_dims[d] = cur_dims[d] + taken
                    cur_partial = [a for a in cur_partial if a not in taken]
                    after = state(cur_partial)
                    steps.append(ReshardStep("reduce-scatter", mesh.order(taken), in_bytes, before, after, dim=d))
        if cur_partial:
            before = state(cur_partial)
            nb = _nbytes(shape, itemsize, before, mesh)
            axes = mesh.order(cur_partial)
            cur_partial = []
            steps.append(ReshardStep("all-reduce", axes, nb, before, state(cur_partial)))

    def common_prefix(d: int) -> int:
        target = dst.dims[d]
        if tuple(cur_dims[d]) != target and (_uneven(shape, cur_dims[d], d, mesh) or _uneven(shape, target, d, mesh)):
            return 0  # uneven: gather the dimension whole, then slice (nested uneven shards do not line up)
        p = 0
        while p < len(cur_dims[d]) and p < len(target) and cur_dims[d][p] == target[p]:
            p += 1
        return p

    # (2) all-to-all: move the minor-most axis of one dimension to the next slot of another.
    moved = True
    while moved:
        moved = False
        for i in range(len(cur_dims)):
            p_i = common_prefix(i)
            if len(cur_dims[i]) - p_i != 1:
                continue
            axis = cur_dims[i][-1]
            for j in range(len(cur_dims)):
                if j == i:
                    continue
                p_j = common_prefix(j)
                target = dst.dims[j]
                if p_j == len(cur_dims[j]) and p_j < len(target) and target[p_j] == axis:
                    before = state(())
                    nb = _nbytes(shape, itemsize, before, mesh)
                    cur_dims[i] = cur_dims[i][:-1]
                    cur_dims[j] = cur_dims[j] + [axis]
                    after = state(())
                    if any(_uneven(shape, sh.dims[x], x, mesh) for sh in (before, after) for x in (i, j)):
                        # Keep to even splits; undo and gather instead.
                        cur_dims[i].append(axis)
                        cur_dims[j].pop()
                        continue
                    steps.append(ReshardStep("all-to-all", (axis,), nb, before, after, dim=j, concat_dim=i))
                    moved = True
                    break
            if moved:
                break

    # (3) all-gathers, one per dimension (minor axes first would be the same bytes).
    for d in range(len(cur_dims)):
        p = common_prefix(d)
        if p < len(cur_dims[d]):
            before = state(())
            gathered = cur_dims[d][p:]
            cur_dims[d] = cur_dims[d][:p]
            after = state(())
            # The gathered buffer holds every shard, padding included, before it is trimmed.
            nb = max(_nbytes(shape, itemsize, after, mesh), _padded_bytes(shape, itemsize, before, d, 1, mesh)
                     * mesh.group_size(gathered))
            steps.append(ReshardStep("all-gather", tuple(gathered), nb, before, after, dim=d))

    # (4) local slices for the axes dst adds.
    for d in range(len(cur_dims)):
        if tuple(cur_dims[d]) != dst.dims[d]:
            before = state(())
            added = dst.dims[d][len(cur_dims[d]) :]
            cur_dims[d] = list(dst.dims[d])
            after = state(())
            steps.append(ReshardStep("slice", tuple(added), _nbytes(shape, itemsize, before, mesh), before, after, dim=d))
    assert state(()) == dst, (src, dst, state(()))
    return tuple(steps)


@functools.lru_cache(maxsize=1 << 18)
def reshard_time(shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec) -> float:
    """Seconds to reshard, ``inf`` when impossible."""
    steps = reshard_steps(shape, itemsize, src, dst, mesh)
    if steps is None:
        return math.inf
    return sum(collective_time(s.kind, s.axes, s.bytes, mesh) for s in steps)
