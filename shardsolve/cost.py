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


def _build_template(shape: tuple[int, ...], src: Sharding, dst: Sharding, mesh: MeshSpec) -> tuple | None:
    """The steps of ``reshard_steps`` with their byte counts left as specs (see ``_spec_bytes``).

    The steps that turn a value sharded as ``src`` into ``dst``, or ``None`` if impossible.

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
    steps: list[tuple] = []
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
                    in_bytes = ("pad", before, d, mesh.group_size(taken))
                    cur_dims[d] = cur_dims[d] + taken
                    cur_partial = [a for a in cur_partial if a not in taken]
                    after = state(cur_partial)
                    steps.append(("reduce-scatter", mesh.order(taken), in_bytes, before, after, d, None))
        if cur_partial:
            before = state(cur_partial)
            nb = ("local", before)
            axes = mesh.order(cur_partial)
            cur_partial = []
            steps.append(("all-reduce", axes, nb, before, state(cur_partial), None, None))

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
                    nb = ("local", before)
                    cur_dims[i] = cur_dims[i][:-1]
                    cur_dims[j] = cur_dims[j] + [axis]
                    after = state(())
                    if any(_uneven(shape, sh.dims[x], x, mesh) for sh in (before, after) for x in (i, j)):
                        # Keep to even splits; undo and gather instead.
                        cur_dims[i].append(axis)
                        cur_dims[j].pop()
                        continue
                    steps.append(("all-to-all", (axis,), nb, before, after, j, i))
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
            nb = ("gather", after, before, d, mesh.group_size(gathered))
            steps.append(("all-gather", tuple(gathered), nb, before, after, d, None))

    # (4) local slices for the axes dst adds.
    for d in range(len(cur_dims)):
        if tuple(cur_dims[d]) != dst.dims[d]:
            before = state(())
            added = dst.dims[d][len(cur_dims[d]) :]
            cur_dims[d] = list(dst.dims[d])
            after = state(())
            steps.append(("slice", tuple(added), ("local", before), before, after, d, None))
    assert state(()) == dst, (src, dst, state(()))
    return tuple(steps)


def _spec_bytes(spec: tuple, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec) -> int:
    """Per-device bytes of one step of a template, for ``shape``."""
    if spec[0] == "local":
        return _nbytes(shape, itemsize, spec[1], mesh)
    if spec[0] == "pad":
        return _padded_bytes(shape, itemsize, spec[1], spec[2], spec[3], mesh)
    _, after, before, d, n = spec  # "gather": the gathered buffer holds every shard, padding included
    return max(_nbytes(shape, itemsize, after, mesh), _padded_bytes(shape, itemsize, before, d, 1, mesh) * n)


def _local_bytes(shape: tuple[int, ...], itemsize: int, parts: tuple[int, ...]) -> int:
    """``Sharding.local_bytes`` with each dimension's number of parts given (0: unsplit)."""
    n = itemsize
    for size, k in zip(shape, parts):
        n *= -(-size // k) if k else size
    return n


def _compile_step(step: tuple, mesh: MeshSpec) -> tuple:
    """One template step as (byte formula, time formula): integers and floats only, for ``_step_time``.

    Byte formulas: ``(0, parts)`` local bytes; ``(1, parts, d, n)`` local bytes
    with dimension ``d`` padded to a multiple of ``n``; ``(2, parts_after,
    parts_before, g)`` the larger of the gathered buffer and ``g`` padded shards.
    Time formulas follow ``collective_time`` term for term, so the floats are the same.
    """
    kind, axes, spec = step[0], step[1], step[2]

    def parts(sh: Sharding) -> tuple[int, ...]:
        return tuple(mesh.group_size(ax) if ax else 0 for ax in sh.dims)

    if spec[0] == "local":
        nb = (0, parts(spec[1]))
    elif spec[0] == "pad":
        nb = (1, parts(spec[1]), spec[2], spec[3])
    else:
        nb = (2, parts(spec[1]), parts(spec[2]), spec[4])
    n = mesh.group_size(axes) if axes else 0
    if kind == "slice" or not axes or n <= 1:
        return nb, (0,)
    bw = min(mesh.axis(a).bandwidth for a in axes)
    alpha = sum(mesh.axis(a).latency for a in axes)
    if kind == "collective-permute":
        return nb, (1, alpha, bw)
    if kind not in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        raise ValueError(f"unknown collective kind {kind!r}")
    return nb, (3 if kind == "all-reduce" else 2, alpha * (n - 1), n - 1, n, bw)


def _step_time(compiled: tuple, shape: tuple[int, ...], itemsize: int) -> float:
    nb, how = compiled
    if how[0] == 0:
        return 0.0
    if nb[0] == 0:
        nbytes = _local_bytes(shape, itemsize, nb[1])
    elif nb[0] == 1:
        local = [-(-size // k) if k else size for size, k in zip(shape, nb[1])]
        d, n = nb[2], nb[3]
        local[d] = -(-local[d] // n) * n
        nbytes = math.prod(local) * itemsize
    else:
        nbytes = max(_local_bytes(shape, itemsize, nb[1]), _local_bytes(shape, itemsize, nb[2]) * nb[3])
    if how[0] == 1:
        return how[1] + nbytes / how[2]
    one_pass = how[1] + nbytes * how[2] / how[3] / how[4]
    return 2.0 * one_pass if how[0] == 3 else one_pass


# (src, dst, mesh) -> (per dimension: product of the sizes of the axes src or dst split it by,
#                      {shape class: (template, compiled steps)})
_TEMPLATES: dict[tuple, tuple[tuple[int, ...], dict]] = {}


def _template_entry(shape: tuple[int, ...], src: Sharding, dst: Sharding, mesh: MeshSpec) -> tuple:
    """(``_build_template``, its compiled steps), shared by every shape of the same class.

    The steps only ask whether a dimension is split evenly by axes of
    ``src`` or ``dst`` on it; every such group size divides the product of
    those axes' sizes, so it divides the dimension iff it divides the gcd of
    the two: shapes with equal gcds (their class) take the same steps.
    """
    pair = (src, dst, mesh)
    hit = _TEMPLATES.get(pair)
    if hit is None:
        if len(_TEMPLATES) >= 1 << 16:
            _TEMPLATES.clear()
        if len(src.dims) != len(shape) or len(dst.dims) != len(shape):
            return _build_template(shape, src, dst, mesh), None  # let the builder complain; cache nothing
        prods = tuple(mesh.group_size(set(a) | set(b)) for a, b in zip(src.dims, dst.dims))
        hit = _TEMPLATES[pair] = (prods, {})
    prods, by_class = hit
    cls = tuple(math.gcd(size, p) for size, p in zip(shape, prods))
    entry = by_class.get(cls)
    if entry is None:
        tpl = _build_template(shape, src, dst, mesh)
        entry = by_class[cls] = (tpl, None if tpl is None else tuple(_compile_step(st, mesh) for st in tpl))
    return entry


def _steps_from(
    tpl: tuple | None, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec
) -> tuple[ReshardStep, ...] | None:
    if tpl is None:
        return None
    return tuple(ReshardStep(kind, axes, _spec_bytes(spec, shape, itemsize, mesh), before, after, dim, concat)
                 for kind, axes, spec, before, after, dim, concat in tpl)


def reshard_steps_uncached(
    shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec
) -> tuple[ReshardStep, ...] | None:
    """``reshard_steps`` worked out for this shape alone (no shared template; for tests)."""
    shape = tuple(shape)
    return _steps_from(_build_template(shape, src, dst, mesh), shape, itemsize, mesh)


@functools.lru_cache(maxsize=1 << 18)
def reshard_steps(
    shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec
) -> tuple[ReshardStep, ...] | None:
    """The steps that turn a value sharded as ``src`` into ``dst``, or ``None`` if impossible.

    See ``_build_template`` for the order of the steps.
    """
    shape = tuple(shape)
    return _steps_from(_template_entry(shape, src, dst, mesh)[0], shape, itemsize, mesh)


@functools.lru_cache(maxsize=1 << 18)
def reshard_time(shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec) -> float:
    """Seconds to reshard, ``inf`` when impossible."""
    shape = tuple(shape)
    tpl, compiled = _template_entry(shape, src, dst, mesh)
    if tpl is None:
        return math.inf
    if compiled is None:
        return sum(collective_time(kind, axes, _spec_bytes(spec, shape, itemsize, mesh), mesh)
                   for kind, axes, spec, *_ in tpl)
    return sum([_step_time(c, shape, itemsize) for c in compiled])


@functools.lru_cache(maxsize=1 << 16)
def reshard_time_given(
    shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec, present: Sharding
) -> float:
    """Seconds to reshard ``src`` to ``dst`` when the value is also at hand as ``present``.

    Where the steps pass through ``present`` they start from there instead
    (the rewriter's reshard cache holds it): an argument split unevenly
    arrives evened, so gathering it back is free.
    """
    steps = reshard_steps(shape, itemsize, src, dst, mesh)
    if steps is None:
        return math.inf
    known = [k for k, s in enumerate(steps) if s.dst == present]
    rest = steps[known[-1] + 1:] if known else steps
    return sum(collective_time(s.kind, s.axes, s.bytes, mesh) for s in rest)
