"""The one cost model: collectives, compute and memory, per device.

Everything that prices a plan calls these functions: the solver's objective,
the plan's predicted collectives, the rewriter in ``shardsolve.lower`` (which
executes exactly the ``ReshardStep``s that ``reshard_steps`` returns), and the
comparison with GSPMD/Shardy. So "predicted == lowered" is checkable to the byte.

Collectives use the alpha-beta model on the mesh axes they span. For a group
of ``n`` devices along axes ``A`` with per-link bandwidth ``bw = min_a bw_a``
and start-up latency ``alpha = max_a alpha_a``, paid once per collective, and
``B`` the bytes per device of the larger of the collective's input and output
buffers:

    all-gather, reduce-scatter, all-to-all:  alpha + B*(n-1)/n / bw
    all-reduce:                              alpha + 2 * B*(n-1)/n / bw
    collective-permute:                      alpha + B / bw

This is the formula of the yardstick plans are judged with from outside
(``shared/yardstick``: one latency per collective in the optimized HLO, the
bandwidth term of a ring), so a plan ranks the same in both. One latency per
collective rather than one per ring hop: XLA runs a collective as one
operation, and a plan that splits one all-reduce over two axes into two
(cheaper per hop) pays two start-ups.

That formula lives in one place, ``CollectiveCost.time``; ``collective_time``
prices one collective with it, ``reshard_time`` every step of a reshard, and
``hlo_collective_time`` a collective read from a compiled program (groups over
part of an axis, or irregular ones, priced as an axis of their size).

Compute is roofline-style per device: ``max(flops/peak_flops, bytes/hbm_bw)``
where flops and bytes are one device's share, so replicated work is never free.
The mesh's HBM bandwidth is unbounded by default (``mesh.DEFAULT_HBM_BANDWIDTH``),
which leaves FLOPs at peak, the yardstick's compute; with a finite one the
bytes count.
The bytes are those a compiled kernel moves through HBM: XLA fuses chains of
elementwise and layout operations into one loop (``FUSED_PRODUCERS`` /
``FUSED_CONSUMERS``), so a value made by one such operation and read only by
others is never written out, and its readers do not load it.

Reshard prices are cached here, and only here: the steps of a (source,
destination) pair are worked out once per shape class and compiled
(``StepTemplate``: their byte formulas and ``CollectiveCost``s), ``reshard_steps``
and ``reshard_time`` are memoised per shape, and ``ReshardTables`` holds the
problem builder's edge tables per (shape, sharding sets).

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
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from shardsolve.errors import ShardsolveError
from shardsolve.hlo import collective_kind, instructions, parse_replica_groups, shape_bytes, tuple_components
from shardsolve.mesh import MeshAxis, MeshSpec
from shardsolve.sharding import Sharding


LOCAL_STEPS = ("slice", "relabel")  # reshard steps that move no data between devices


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One step of a resharding: a collective, a local ``slice``, or a ``relabel`` (neither: see below).

    A ``relabel`` adds or drops mesh axes of size 1, which change neither a
    device's shard nor who holds it: ``P(("data", "model"))`` on a mesh with
    ``data=1`` is ``P("model")``, and a sum pending over a group of one device
    is complete.

    ``src`` and ``dst`` are the value's shardings before and after the step.
    ``dim`` is the dimension gathered/scattered/sliced (for all-to-all: the
    dimension that becomes sharded, i.e. split); ``concat_dim`` is the
    dimension an all-to-all unshards. ``bytes`` is per device, the larger of
    the step's input and output buffers, at the itemsize its caller gives
    (the planner's: what the backend's collectives move, ``wire_itemsize``).
    A step of an empty value (a dimension of size 0) moves nothing and is no
    collective: it costs nothing, and the rewriter makes the empty shard of
    ``dst`` where it is.
    """

    kind: str  # all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute, slice or relabel
    axes: tuple[str, ...]
    bytes: int
    src: Sharding
    dst: Sharding
    dim: int | None = None
    concat_dim: int | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind not in LOCAL_STEPS and self.bytes > 0


# -- collectives and compute ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """The alpha-beta price of one collective kind over a set of mesh axes, as a function of its bytes.

    ``time(B) = latency + passes * B * share / group / bandwidth``: for a
    collective over ``n`` devices ``latency = alpha`` (its start-up, paid once),
    ``share = n - 1`` and ``group = n`` (a collective-permute: 1 and 1);
    ``passes`` is 2 for an all-reduce (a reduce-scatter, then an all-gather),
    1 for the other collectives, 0 for what moves nothing.
    """

    latency: float
    share: int
    group: int
    bandwidth: float
    passes: float

    def time(self, nbytes: float) -> float:
        if not self.passes or nbytes <= 0:  # (an empty value moves nothing)
            return 0.0
        return self.latency + self.passes * nbytes * self.share / self.group / self.bandwidth


FREE = CollectiveCost(0.0, 0, 1, 1.0, 0.0)


@functools.lru_cache(maxsize=1 << 14)
def collective_cost(kind: str, axes: tuple[str, ...], mesh: MeshSpec) -> CollectiveCost:
    """The ``CollectiveCost`` of a ``kind`` collective over ``axes`` (``FREE`` for a slice or a group of one)."""
    if kind in LOCAL_STEPS or not axes:
        return FREE
    n = mesh.group_size(axes)
    if n <= 1:
        return FREE
    bw = min(mesh.axis(a).bandwidth for a in axes)
    alpha = max(mesh.axis(a).latency for a in axes)
    if kind == "collective-permute":
        return CollectiveCost(alpha, 1, 1, bw, 1.0)
    if kind not in ("all-gather", "reduce-scatter", "all-to-all", "all-reduce"):
        raise ValueError(f"unknown collective kind {kind!r}")
    return CollectiveCost(alpha, n - 1, n, bw, 2.0 if kind == "all-reduce" else 1.0)


def collective_time(kind: str, axes: Sequence[str], nbytes: float, mesh: MeshSpec) -> float:
    """Seconds for one collective over ``axes`` moving ``nbytes`` per device."""
    return collective_cost(kind, tuple(axes), mesh).time(nbytes)


# XLA's collective combiners, as the compiled programs priced here run them: the CPU pipeline merges
# independent all-reduces over the same devices into one (no byte threshold, at most 256 operands), so
# they pay one latency between them; all-gathers and reduce-scatters run one by one.
COMBINED_KINDS = frozenset({"all-reduce"})
COMBINE_COUNT = 256


def combine_groups(keys: Sequence[Any], depends: Callable[[int, int], bool],
                   count: int = COMBINE_COUNT) -> list[list[int]]:
    """Which of collectives ``0..n-1`` (in program order) XLA's combiner merges: a list of groups.

    ``keys[i]`` is what must match for two to merge (``None``: never merged);
    ``depends(i, j)`` for ``i < j`` whether ``j`` needs ``i``'s result. Like
    XLA's ``CombineInstructionsByKey``: the first collective left opens a group
    of its key, the later ones of that key join it until one depends on a
    member (or ``count`` are in); the rest are walked again.
    """
    left = [i for i, k in enumerate(keys) if k is not None]
    groups = [[i] for i, k in enumerate(keys) if k is None]
    while left:
        first, rest = left[0], []
        group, closed = [first], False
        for i in left[1:]:
            if closed or keys[i] != keys[first]:
                rest.append(i)
            elif any(depends(j, i) for j in group):
                closed = True
                rest.append(i)
            else:
                group.append(i)
                closed = len(group) >= count
        groups.append(group)
        left = rest
    return sorted(groups)


# XLA's loop fusion, as the cost model sees it: an operation in FUSED_PRODUCERS fuses into the readers of
# its result that are in FUSED_CONSUMERS (elementwise and layout operations; reductions read a fused input
# but their result is written out, as a fusion's root).
_LAYOUT = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "transpose", "iota",
           "select_n", "slice", "concatenate", "pad", "rev")
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax",
               "argmin", "dynamic_slice")


def fusion_classes(pointwise: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(FUSED_PRODUCERS, FUSED_CONSUMERS) given the names of the pointwise primitives."""
    producers = frozenset(pointwise) | frozenset(_LAYOUT)
    return producers, producers | frozenset(_REDUCTIONS)


def compute_time(flops: float, nbytes: float, mesh: MeshSpec) -> float:
    """Roofline time of one device's share of an operation."""
    return max(flops / mesh.peak_flops, nbytes / mesh.hbm_bandwidth)


# -- collectives of compiled programs ---------------------------------------------------


def hlo_collective_time(c: Any, mesh: MeshSpec) -> float:
    """``collective_time`` of one collective parsed from HLO (``hlo.HloCollective``, or anything alike).

    ``shardsolve.hlo`` names groups that span part of an axis Shardy-style
    (``"model:(1)2"``) and irregular groups ``"?"``; those are priced as an axis
    of the group's size with the links of the axis they lie in (for ``"?"``,
    the slowest link of the mesh and the largest latency).
    """
    axes = tuple(c.axes)
    if all(a in mesh.names for a in axes):
        return collective_time(c.kind, axes, c.bytes, mesh)
    extra: list[MeshAxis] = []
    names: list[str] = []
    for k, a in enumerate(axes):
        if a in mesh.names:
            names.append(a)
            continue
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*):\((\d+)\)(\d+)", a)
        if m and m.group(1) in mesh.names:
            base = mesh.axis(m.group(1))
            extra.append(MeshAxis(f"_sub{k}", int(m.group(3)), base.bandwidth, base.latency))
        else:
            size = _irregular_group_size(c, mesh)
            extra.append(
                MeshAxis(f"_irregular{k}", size, min(x.bandwidth for x in mesh.axes), max(x.latency for x in mesh.axes))
            )
        names.append(extra[-1].name)
    priced = MeshSpec(mesh.axes + tuple(extra), peak_flops=mesh.peak_flops, hbm_bandwidth=mesh.hbm_bandwidth)
    return collective_time(c.kind, tuple(names), c.bytes, priced)


def _irregular_group_size(c: Any, mesh: MeshSpec) -> int:
    if c.kind == "collective-permute":
        return 2
    try:
        groups = parse_replica_groups(c.groups, mesh.size)
        return max(1, max(len(g) for g in groups))
    except (ValueError, IndexError, AttributeError):
        return mesh.size


def communication_time(collectives: Iterable[Any], mesh: MeshSpec) -> float:
    """Seconds per step of the given collectives (``hlo.HloCollective`` or predicted ones) under the cost model.

    Each counts ``repeats`` runs (a collective in a while body runs its trip count times).
    """
    return sum(hlo_collective_time(c, mesh) * getattr(c, "repeats", 1) for c in collectives)


#: Elements in the all-reduce ``wire_itemsize`` compiles (per device).
_WIRE_PROBE = 64


@functools.lru_cache(maxsize=None)
def wire_itemsize(dtype: Any) -> int:
    """Bytes per element a collective of ``dtype`` moves on the default backend (the dtype's own size elsewhere).

    XLA's CPU backend runs the collectives of a bfloat16 value in float32
    (its float normalization widens them, and narrows the result back), so
    they move twice the value's bytes; float16, the integers and accelerators'
    collectives move the value as it is. Measured once per dtype by compiling
    an all-reduce of it over two devices and reading the element type XLA
    gives it; a dtype that is no float narrower than four bytes, a process
    with one device, or a compile that fails is taken at its own size.
    """
    dt = np.dtype(dtype)
    if dt.itemsize >= 4:
        return dt.itemsize
    try:
        import jax
        from jax.sharding import Mesh, PartitionSpec

        if not jax.numpy.issubdtype(dt, jax.numpy.floating):  # (a sum of booleans, say, is JAX's int32 sum)
            return dt.itemsize
        devices = jax.devices()
        if len(devices) < 2:
            return dt.itemsize
        mesh = Mesh(np.array(devices[:2]), ("wire",))
        reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "wire"), mesh=mesh, in_specs=PartitionSpec("wire"),
                                       out_specs=PartitionSpec()))
        text = reduce.lower(jax.ShapeDtypeStruct((2 * _WIRE_PROBE,), dt)).compile().as_text()
    except Exception:  # noqa: BLE001 - a backend that cannot say keeps the dtype's own size
        return dt.itemsize
    for ins in instructions(text):
        kind, is_async = collective_kind(ins.opcode)
        if kind == "all-reduce":  # (an async start's shape is the pair (operand, result))
            shape = tuple_components(ins.shape)[-1] if is_async else ins.shape
            return max(dt.itemsize, shape_bytes(shape) // _WIRE_PROBE)
    return dt.itemsize


def wire_type(dtype: Any) -> tuple[str, int]:
    """The element type a collective of ``dtype`` runs in on the default backend: its kind (``"f"`` float,
    ``"c"`` complex, ``"i"``/``"u"`` signed/unsigned integer, ``"b"`` boolean) and ``wire_itemsize``.

    XLA's combiners merge all-reduces of one element type only (a float32 and
    an int32 or complex64 sum stay two collectives); a bfloat16 sum runs in
    float32 on the CPU backend (``wire_itemsize``) and merges with float32 ones.
    """
    import jax.numpy as jnp

    dt = np.dtype(dtype)
    kind = next((k for k, t in (("c", jnp.complexfloating), ("f", jnp.floating), ("u", jnp.unsignedinteger),
                                ("i", jnp.signedinteger), ("b", jnp.bool_)) if jnp.issubdtype(dt, t)), dt.kind)
    return kind, wire_itemsize(dt)


# -- reshard steps ---------------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 14)
def _uneven(size: int, axes: tuple[str, ...], mesh: MeshSpec) -> bool:
    """Whether ``axes`` split a dimension of ``size`` unevenly."""
    n = mesh.group_size(axes)
    return n > 1 and size % n != 0


def _build_template(shape: tuple[int, ...], src: Sharding, dst: Sharding, mesh: MeshSpec) -> tuple | None:
    """The steps of ``reshard_steps`` with their byte counts left as specs (see ``StepTemplate.compile``).

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
    bare_src, bare_dst = without_unit_axes(src, mesh), without_unit_axes(dst, mesh)
    if (bare_src, bare_dst) != (src, dst):
        # Axes of size 1 move nothing: relabel them away, reshard what is left, relabel them back.
        if bare_src == bare_dst:
            return (("relabel", (), ("local", src), src, dst, None, None),)
        inner = _build_template(shape, bare_src, bare_dst, mesh)
        if inner is None:
            return None
        head = (("relabel", (), ("local", src), src, bare_src, None, None),) if src != bare_src else ()
        tail = (("relabel", (), ("local", dst), bare_dst, dst, None, None),) if dst != bare_dst else ()
        return head + inner + tail
    if set(dst.partial) - set(src.partial):
        return None
    if dst.partial and src.reduce_op != dst.reduce_op:
        return None
    walk = _StepWalk(shape, src, dst, mesh)
    walk.reductions()
    walk.all_to_alls()
    walk.all_gathers()
    walk.slices()
    assert walk.state(()) == dst, (src, dst, walk.state(()))
    return tuple(walk.steps)


@functools.lru_cache(maxsize=64)
def _has_unit_axes(mesh: MeshSpec) -> bool:
    return any(a.size == 1 for a in mesh.axes)


def without_unit_axes(s: Sharding, mesh: MeshSpec) -> Sharding:
    """``s`` without the mesh axes of size 1 (on its dimensions and among its partial axes)."""
    if not _has_unit_axes(mesh) or all(mesh.axis(a).size > 1 for a in s.axes + s.partial):
        return s
    dims = tuple(tuple(a for a in d if mesh.axis(a).size > 1) for d in s.dims)
    partial = tuple(a for a in s.partial if mesh.axis(a).size > 1)
    return Sharding(dims, partial, s.reduce_op if partial else "sum")


class _StepWalk:
    """``_build_template``'s state: the value's layout so far (``dims``, ``partial``) and the steps taken.

    Each step is ``(kind, axes, byte spec, before, after, dim, concat_dim)``;
    byte specs: ``("local", sharding)`` the local buffer; ``("pad", sharding,
    d, n)`` it with dimension ``d`` padded to a multiple of ``n``;
    ``("gather", after, before, d, n)`` the larger of the gathered buffer and
    ``n`` padded source shards.
    """

    def __init__(self, shape: tuple[int, ...], src: Sharding, dst: Sharding, mesh: MeshSpec):
        self.shape, self.src, self.dst, self.mesh = shape, src, dst, mesh
        self.dims = list(src.dims)  # a tuple of axes per dimension, replaced (never changed) as steps are taken
        self.partial = [a for a in src.partial if a not in dst.partial]
        self.keep_partial = tuple(dst.partial)
        self._kept = tuple(sorted(set(dst.partial)))
        self.steps: list[tuple] = []
        self._last: Sharding | None = None  # the state made last: a step's layout after is the next one's before

    def state(self, partial: Sequence[str]) -> Sharding:
        all_partial = tuple(sorted(set(partial) | set(self._kept))) if partial else self._kept
        dims, last = tuple(self.dims), self._last
        if last is not None and last.dims == dims and last.partial == all_partial:
            return last
        self._last = Sharding(dims, all_partial, self.src.reduce_op if all_partial else "sum")
        return self._last

    def uneven(self, axes: Sequence[str], d: int) -> bool:
        return _uneven(self.shape[d], axes, self.mesh)

    def common_prefix(self, d: int) -> int:
        """How many leading axes of dimension ``d`` stay (0 where an uneven split must be gathered whole)."""
        target, cur = self.dst.dims[d], self.dims[d]
        if cur != target and (self.uneven(cur, d) or self.uneven(target, d)):
            return 0  # uneven: gather the dimension whole, then slice (nested uneven shards do not line up)
        p = 0
        while p < len(cur) and p < len(target) and cur[p] == target[p]:
            p += 1
        return p

    def reductions(self) -> None:
        """(1) Pending reductions: reduce-scatters into the next axes ``dst`` splits, then one all-reduce."""
        if not self.partial:
            return
        mesh, dims = self.mesh, self.dims
        if self.src.reduce_op == "sum":
            for d, target in enumerate(self.dst.dims):
                # Reduce-scatter along d while dst's next axis on d is pending here.
                taken: list[str] = []
                # An uneven split is only scattered into from an unsplit dimension (shard
                # boundaries of nested uneven splits do not line up).
                if dims[d] and self.uneven(target, d):
                    continue
                while (
                    len(dims[d]) + len(taken) < len(target)
                    and target[: len(dims[d])] == dims[d]
                    and target[len(dims[d]) + len(taken)] in self.partial
                    and target[len(dims[d]) + len(taken)] not in taken
                ):
                    taken.append(target[len(dims[d]) + len(taken)])
                if taken:
                    before = self.state(self.partial)
                    in_bytes = ("pad", before, d, mesh.group_size(taken))
                    dims[d] = dims[d] + tuple(taken)
                    self.partial = [a for a in self.partial if a not in taken]
                    after = self.state(self.partial)
                    self.steps.append(("reduce-scatter", mesh.order(taken), in_bytes, before, after, d, None))
        if self.partial:
            before = self.state(self.partial)
            axes = mesh.order(self.partial)
            self.partial = []
            self.steps.append(("all-reduce", axes, ("local", before), before, self.state(self.partial), None, None))

    def all_to_alls(self) -> None:
        """(2) Move the minor-most axis of one dimension to the next slot of another, while one fits."""
        dims = self.dims
        wanted = {a: j for j, target in enumerate(self.dst.dims) for a in target}
        if all(wanted.get(a, i) == i for i, d in enumerate(dims) for a in d):
            return  # no axis is on a dimension other than the one dst wants it on
        moved = True
        while moved:
            moved = False
            for i in range(len(dims)):
                # Only the dimension dst wants the minor-most axis on can take it (an axis is on one dimension).
                j = wanted.get(dims[i][-1]) if dims[i] else None
                if j is None or j == i or len(dims[i]) - self.common_prefix(i) != 1:
                    continue
                axis, target = dims[i][-1], self.dst.dims[j]
                p_j = self.common_prefix(j)
                if not (p_j == len(dims[j]) and p_j < len(target) and target[p_j] == axis):
                    continue
                before = self.state(())
                dims[i] = dims[i][:-1]
                dims[j] = dims[j] + (axis,)
                after = self.state(())
                if any(self.uneven(sh.dims[x], x) for sh in (before, after) for x in (i, j)):
                    # Keep to even splits; undo and gather instead.
                    dims[i] = dims[i] + (axis,)
                    dims[j] = dims[j][:-1]
                    continue
                self.steps.append(("all-to-all", (axis,), ("local", before), before, after, j, i))
                moved = True
                break

    def all_gathers(self) -> None:
        """(3) All-gathers, one per dimension (minor axes first would be the same bytes)."""
        dims = self.dims
        for d in range(len(dims)):
            p = self.common_prefix(d)
            if p < len(dims[d]):
                before = self.state(())
                gathered = dims[d][p:]
                dims[d] = dims[d][:p]
                after = self.state(())
                # The gathered buffer holds every shard, padding included, before it is trimmed.
                nb = ("gather", after, before, d, self.mesh.group_size(gathered))
                self.steps.append(("all-gather", tuple(gathered), nb, before, after, d, None))

    def slices(self) -> None:
        """(4) Local slices for the axes ``dst`` adds."""
        dims = self.dims
        for d in range(len(dims)):
            if dims[d] != self.dst.dims[d]:
                before = self.state(())
                added = self.dst.dims[d][len(dims[d]):]
                dims[d] = self.dst.dims[d]
                after = self.state(())
                self.steps.append(("slice", tuple(added), ("local", before), before, after, d, None))


@functools.lru_cache(maxsize=1 << 16)
def _parts(dims: tuple[tuple[str, ...], ...], mesh: MeshSpec) -> tuple[int, ...]:
    """Shards per dimension (0: unsplit)."""
    return tuple(mesh.group_size(ax) if ax else 0 for ax in dims)


class StepTemplate(NamedTuple):
    """One step of ``_build_template``, for every shape of a class: a ``ReshardStep`` but for its bytes.

    Its bytes per device, for a value of ``shape``: the local buffer with
    ``parts[d]`` shards of dimension ``d`` (0: unsplit), dimension ``pad_dim``
    padded up to a multiple of ``pad_to`` (a reduce-scatter's input); an
    all-gather's counts ``gathered`` padded source shards (``parts_before``)
    when that is larger. ``price`` is the step's ``CollectiveCost``.

    An immutable ``NamedTuple`` rather than a frozen dataclass: the problem
    builder makes one per step of every (source, destination, shape class),
    and a tuple is built several times faster.
    """

    kind: str
    axes: tuple[str, ...]
    src: Sharding
    dst: Sharding
    dim: int | None
    concat_dim: int | None
    price: CollectiveCost
    parts: tuple[int, ...]
    pad_dim: int | None = None
    pad_to: int = 1
    gathered: int = 0
    parts_before: tuple[int, ...] = ()

    @classmethod
    def compile(cls, step: tuple, mesh: MeshSpec) -> StepTemplate:
        kind, axes, spec, before, after, dim, concat = step

        def parts(sh: Sharding) -> tuple[int, ...]:
            return _parts(sh.dims, mesh)

        price = collective_cost(kind, tuple(axes), mesh)
        if spec[0] == "local":
            return cls(kind, axes, before, after, dim, concat, price, parts(spec[1]))
        if spec[0] == "pad":
            return cls(kind, axes, before, after, dim, concat, price, parts(spec[1]), spec[2], spec[3])
        _, gathered_into, gathered_from, _, n = spec  # "gather"
        return cls(kind, axes, before, after, dim, concat, price, parts(gathered_into), gathered=n,
                   parts_before=parts(gathered_from))

    def nbytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        n = itemsize
        if self.pad_dim is None:
            for size, k in zip(shape, self.parts):
                n *= -(-size // k) if k else size
        else:
            for d, (size, k) in enumerate(zip(shape, self.parts)):
                local = -(-size // k) if k else size
                n *= -(-local // self.pad_to) * self.pad_to if d == self.pad_dim else local
        if self.gathered:
            m = itemsize * self.gathered
            for size, k in zip(shape, self.parts_before):
                m *= -(-size // k) if k else size
            n = max(n, m)
        return n

    def time(self, shape: tuple[int, ...], itemsize: int) -> float:
        return self.price.time(self.nbytes(shape, itemsize)) if self.price.passes else 0.0

    def step(self, shape: tuple[int, ...], itemsize: int) -> ReshardStep:
        return ReshardStep(self.kind, self.axes, self.nbytes(shape, itemsize), self.src, self.dst, self.dim,
                           self.concat_dim)


# (src, dst, mesh) -> (per dimension: product of the sizes of the axes src or dst split it by,
#                      {shape class: compiled steps, or None when impossible})
_TEMPLATES: dict[tuple, tuple[tuple[int, ...], dict]] = {}
# Cleared whole when full. A three-axis mesh asks for some 200,000 pairs (Llama small on 2x2x2: 197k, about
# 2 KiB each); a cap below that rebuilds the templates over and over (2.1M builds, 224 s of problem building,
# against 229k builds and 79 s with this cap).
TEMPLATE_CAP = 1 << 18


def _compiled(shape: tuple[int, ...], src: Sharding, dst: Sharding, mesh: MeshSpec) -> tuple[StepTemplate, ...] | None:
    if (set(src.partial) > set(dst.partial) and (not dst.partial or src.reduce_op == dst.reduce_op)
            and src == without_unit_axes(src, mesh) and dst == without_unit_axes(dst, mesh)):
        # Pending reductions first, then the steps from where they leave the value, which every source
        # sharding with the same dimensions and other pending axes shares (``_template`` holds them).
        walk = _StepWalk(shape, src, dst, mesh)
        walk.reductions()
        rest = _template(shape, walk.state(()), dst, mesh)
        return tuple(StepTemplate.compile(st, mesh) for st in walk.steps) + rest
    tpl = _build_template(shape, src, dst, mesh)
    return None if tpl is None else tuple(StepTemplate.compile(st, mesh) for st in tpl)


@functools.lru_cache(maxsize=1 << 14)
def _union_size(a: tuple[str, ...], b: tuple[str, ...], mesh: MeshSpec) -> int:
    """The size of the mesh axes in ``a`` or ``b`` (those that split one dimension in two shardings)."""
    return mesh.group_size(set(a) | set(b))


def _template(shape: tuple[int, ...], src: Sharding, dst: Sharding, mesh: MeshSpec) -> tuple[StepTemplate, ...] | None:
    """The compiled steps of ``_build_template``, shared by every shape of the same class.

    The steps only ask whether a dimension is split evenly by axes of
    ``src`` or ``dst`` on it; every such group size divides the product of
    those axes' sizes, so it divides the dimension iff it divides the gcd of
    the two: shapes with equal gcds (their class) take the same steps.
    """
    pair = (src, dst, mesh)
    hit = _TEMPLATES.get(pair)
    if hit is None:
        if len(_TEMPLATES) >= TEMPLATE_CAP:
            _TEMPLATES.clear()
        if len(src.dims) != len(shape) or len(dst.dims) != len(shape):
            return _compiled(shape, src, dst, mesh)  # let the builder complain; cache nothing
        prods = tuple(map(_union_size, src.dims, dst.dims, itertools.repeat(mesh)))
        hit = _TEMPLATES[pair] = (prods, {})
    prods, by_class = hit
    cls = tuple(map(math.gcd, shape, prods))
    if cls not in by_class:
        by_class[cls] = _compiled(shape, src, dst, mesh)
    return by_class[cls]


def reshard_steps_uncached(
    shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec
) -> tuple[ReshardStep, ...] | None:
    """``reshard_steps`` worked out for this shape alone (no shared template; for tests)."""
    shape = tuple(shape)
    steps = _compiled(shape, src, dst, mesh)
    return None if steps is None else tuple(t.step(shape, itemsize) for t in steps)


@functools.lru_cache(maxsize=1 << 18)
def reshard_steps(
    shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec
) -> tuple[ReshardStep, ...] | None:
    """The steps that turn a value sharded as ``src`` into ``dst``, or ``None`` if impossible.

    See ``_build_template`` for the order of the steps.
    """
    shape = tuple(shape)
    steps = _template(shape, src, dst, mesh)
    return None if steps is None else tuple(t.step(shape, itemsize) for t in steps)


@functools.lru_cache(maxsize=1 << 18)
def reshard_time(shape: tuple[int, ...], itemsize: int, src: Sharding, dst: Sharding, mesh: MeshSpec) -> float:
    """Seconds to reshard, ``inf`` when impossible: the ``collective_time`` of each step of ``reshard_steps``."""
    shape = tuple(shape)
    steps = _template(shape, src, dst, mesh)
    if steps is None:
        return math.inf
    return sum([t.time(shape, itemsize) for t in steps])


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


def clear_reshard_caches() -> None:
    """Forget every reshard template and memoised reshard price (for benchmarks that time them from cold)."""
    _TEMPLATES.clear()
    for cached in (reshard_steps, reshard_time, reshard_time_given, _parts, _uneven, _union_size):
        cached.cache_clear()


# -- reshard tables (the problem builder's) -------------------------------------------------


def _row_width(rank: int) -> int:
    return 2 * rank + 9


# A pair's key in a ``_StepStore``: its shape class's number << 48 | source sharding id << 24 | destination id.
_ID_MASK = (1 << 24) - 1
_CLASS_LIMIT = 1 << 15
# Columns of a ``_step_rows`` row after its 2 * rank shard counts.
_PAD_DIM, _PAD_TO, _GATHERED, _MERGE, _LATENCY = range(5)


def _step_rows(steps: tuple[StepTemplate, ...] | None, rank: int,
               merge: Callable[[StepTemplate], int]) -> list[tuple[float, ...]]:
    """The steps of one reshard that move bytes (or may merge), a row of numbers each.

    A row: ``parts`` and ``parts_before`` (``rank`` each), ``pad_dim``
    (-1: none), ``pad_to``, ``gathered``, the step's ``merge`` number (-1
    for a collective XLA does not merge), then the ``CollectiveCost``'s
    latency, passes, share, group and bandwidth (every integer is exact in
    a float64). An impossible reshard (``steps`` ``None``) is one row of
    infinite latency.
    """
    if steps is None:
        return [(0,) * (2 * rank) + (-1, 1, 0, -1, math.inf, 1, 1, 1, 1)]
    return [t.parts + (t.parts_before or (0,) * rank)
            + (-1 if t.pad_dim is None else t.pad_dim, t.pad_to, t.gathered, merge(t), t.price.latency,
               t.price.passes, t.price.share, t.price.group, t.price.bandwidth)
            for t in steps if t.price.passes or t.kind in COMBINED_KINDS]


def _distinct_rows(a: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0)``'s first index of each distinct row and each row's number, for entries in [0, ``bound``].

    The rows are read as numbers in base ``bound + 1`` (renumbered where the
    next digit would overflow), sorted once rather than row by row.
    """
    code = np.zeros(len(a), dtype=np.int64)
    for column in a.T:
        if (int(code.max(initial=0)) + 1) * (bound + 1) >= 1 << 62:
            code = np.unique(code, return_inverse=True)[1]
        code = code * (bound + 1) + column
    _, first, which = np.unique(code, return_index=True, return_inverse=True)
    return first, which


def _local_elements(shape: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """Elements per dimension of the local buffer with ``parts`` shards of each dimension (0: unsplit)."""
    return np.where(parts > 0, -(-shape // np.maximum(parts, 1)), shape)


def _bytes(shape: tuple[int, ...], itemsize: int, rows: np.ndarray) -> np.ndarray:
    """``StepTemplate.nbytes`` of each of ``rows`` (``_step_rows``) for a value of ``shape``."""
    rank = len(shape)
    dims = np.asarray(shape, dtype=np.int64)
    ints = rows[:, :2 * rank + _MERGE].astype(np.int64)
    local = _local_elements(dims, ints[:, :rank])
    padded = np.flatnonzero(ints[:, 2 * rank + _PAD_DIM] >= 0)
    if len(padded):
        d, to = ints[padded, 2 * rank + _PAD_DIM], ints[padded, 2 * rank + _PAD_TO]
        local[padded, d] = -(-local[padded, d] // to) * to
    nbytes = itemsize * np.prod(local, axis=1)
    gathered = ints[:, 2 * rank + _GATHERED]
    if gathered.any():
        held = itemsize * gathered * np.prod(_local_elements(dims, ints[:, rank:2 * rank]), axis=1)
        nbytes = np.where(gathered > 0, np.maximum(nbytes, held), nbytes)
    return nbytes


def _seconds(shape: tuple[int, ...], itemsize: int, rows: np.ndarray, pair: np.ndarray, pairs: int) -> np.ndarray:
    """Seconds of each of ``pairs`` reshards of a value of ``shape``: its ``_step_rows`` ``rows`` summed by ``pair``.

    ``StepTemplate.time`` in numpy, operation for operation, and the steps
    added in their order, so every sum is ``reshard_time``'s float.
    """
    if not len(rows):
        return np.zeros(pairs)
    nbytes = _bytes(shape, itemsize, rows)
    latency, passes, share, group, bandwidth = rows[:, 2 * len(shape) + _LATENCY:].T
    t = np.where((nbytes > 0) | np.isinf(latency), latency + passes * nbytes * share / group / bandwidth, 0.0)
    return np.bincount(pair, weights=t, minlength=pairs)


class _StepStore:
    """The ``_step_rows`` of reshard templates of one rank in one growing array, found by pair key in numpy.

    Template ``i``'s rows are ``rows[start[i]:start[i] + count[i]]``. A
    pair key (``ReshardTables._pair_steps``) maps to its template's number
    through sorted keys searched at once; keys added since the last merge
    wait in a second sorted array until it is a quarter of the first.
    """

    def __init__(self, width: int):
        self.rows = np.empty((1024, width))
        self.used = 0
        self.start = np.empty(1024, dtype=np.int64)
        self.count = np.empty(1024, dtype=np.int64)
        self.templates = 0
        self.keys = [np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)]  # merged, recent
        self.numbers = [np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)]

    def add(self, rows: list[tuple[float, ...]], counts: list[int]) -> None:
        """Templates numbered from ``templates`` on, of ``counts`` of ``rows`` each in turn."""
        n, m = len(counts), len(rows)
        while self.used + m > len(self.rows):
            self.rows = np.concatenate([self.rows, np.empty_like(self.rows)])
        while self.templates + n > len(self.start):
            self.start = np.concatenate([self.start, np.empty_like(self.start)])
            self.count = np.concatenate([self.count, np.empty_like(self.count)])
        if m:
            self.rows[self.used:self.used + m] = rows
        self.count[self.templates:self.templates + n] = counts
        self.start[self.templates:self.templates + n] = self.used + np.cumsum(counts) - counts
        self.used += m
        self.templates += n

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Each key's template number, -1 for a key not seen."""
        out = np.full(len(keys), -1, dtype=np.int64)
        for known, numbers in zip(self.keys, self.numbers):
            if not len(known):
                continue
            at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
            hit = known[at] == keys
            out[hit] = numbers[at[hit]]
        return out

    def remember(self, keys: np.ndarray, numbers: np.ndarray) -> None:
        recent = np.concatenate([self.keys[1], keys])
        order = np.argsort(recent, kind="stable")
        self.keys[1], self.numbers[1] = recent[order], np.concatenate([self.numbers[1], numbers])[order]
        if len(self.keys[1]) > len(self.keys[0]) // 4:
            merged = np.concatenate(self.keys)
            order = np.argsort(merged, kind="stable")
            self.keys = [merged[order], np.empty(0, dtype=np.int64)]
            self.numbers = [np.concatenate(self.numbers)[order], np.empty(0, dtype=np.int64)]

    def gather(self, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of templates ``found`` in turn, and the position in ``found`` each row belongs to."""
        count = self.count[found]
        ends = np.cumsum(count)
        pair = np.repeat(np.arange(len(found)), count)
        at = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(self.start[found] - (ends - count), count)
        return self.rows[at], pair


class ReshardTables:
    """Reshard-time tables, computed once per distinct (shape, dtype size, shardings) and reused.

    Shardings are numbered (``ids``) so that a table is keyed by arrays of
    sharding ids; a table over distinct ids (``_small``) is priced once and
    expanded to each requested order (``_full``). An impossible reshard costs
    ``impossible`` (the problem's ``FORBIDDEN`` for the problem builder).

    A table is priced in numpy, equal to the bit to ``reshard_time`` of
    each pair: every pair's template (``_template``) is kept as rows of
    numbers, one per step that moves bytes or may merge (``_step_rows``, in
    a ``_StepStore`` per rank), found for all the table's pairs at once by
    their sharding ids and shape class (``_pair_steps``), and the rows'
    bytes and seconds are computed and summed per pair at once
    (``_seconds``); ``mergeable_latency`` reads the same rows. A three-axis
    mesh asks for some two million pairs (Llama large on 2x2x2): priced one
    by one with ``reshard_time``, the tables took 10.5 s of its problem
    building.
    """

    def __init__(self, mesh: MeshSpec, impossible: float = math.inf):
        self.mesh = mesh
        self.impossible = impossible
        self._ids: dict[Sharding, int] = {}
        self.shardings: list[Sharding] = []
        self._small: dict[tuple, np.ndarray] = {}
        self._full: dict[tuple, np.ndarray] = {}
        self._merged: dict[tuple, dict[tuple, np.ndarray]] = {}
        self._merged_full: dict[tuple, dict[tuple, np.ndarray]] = {}
        self._stores: dict[int, _StepStore] = {}  # per rank: its pairs' templates (``_pair_steps``)
        self._class_ids: dict[tuple[int, ...], int] = {}
        self._masks: list[tuple[int, ...]] = []  # per sharding id and dimension: its axes as bits of mesh.axes
        # (id of a template, rank) -> (it, its number in the rank's store); it is held, so no other object takes its id
        self._numbers: dict[tuple[int, int], tuple[Any, int]] = {}
        self._merge_keys: dict[tuple, int] = {}  # mergeable_latency's keys, numbered for ``_step_rows``

    def _merge_number(self, step: StepTemplate) -> int:
        """The number of ``step``'s ``mergeable_latency`` key, -1 for a collective XLA does not merge."""
        if step.kind not in COMBINED_KINDS:
            return -1
        return self._merge_keys.setdefault((step.kind, step.axes, step.src.reduce_op), len(self._merge_keys))

    def ids(self, shardings: Sequence[Sharding]) -> np.ndarray:
        out = np.empty(len(shardings), dtype=np.int64)
        for k, s in enumerate(shardings):
            i = self._ids.get(s)
            if i is None:
                i = self._ids[s] = len(self.shardings)
                self.shardings.append(s)
            out[k] = i
        return out

    def table(self, shape: tuple[int, ...], itemsize: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Seconds to reshard from each source strategy's sharding to each destination's (or ``impossible``).

        The returned array may be shared between edges: never modify it in place.
        """
        full_key = (shape, itemsize, src.tobytes(), dst.tobytes())
        hit = self._full.get(full_key)
        if hit is not None:
            return hit
        su, si = np.unique(src, return_inverse=True)
        du, di = np.unique(dst, return_inverse=True)
        key = (shape, itemsize, su.tobytes(), du.tobytes())
        small = self._small.get(key)
        if small is None:
            rows, pair = self._pair_steps(shape, su, du)
            t = _seconds(shape, itemsize, rows, pair, len(su) * len(du)).reshape(len(su), len(du))
            t[np.isinf(t)] = self.impossible
            small = self._small[key] = t
        out = self._full[full_key] = small[np.ix_(si, di)]
        out.flags.writeable = False
        return out

    def _pair_steps(self, shape: tuple[int, ...], su: np.ndarray, du: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The priced steps of every (source in ``su``, destination in ``du``) pair for a value of ``shape``.

        ``(rows, pair)``: ``_step_rows`` of every pair's steps in turn and
        each row's pair (``a * len(du) + b``). A pair's rows are those of
        its template (``_template``), found by the pair and its shape class,
        which numpy works out for every pair at once; only a pair not seen
        before in its class is looked up in Python.
        """
        rank = len(shape)
        classes = np.gcd(np.asarray(shape, dtype=np.int64), self._split_sizes(su, du)).reshape(len(su) * len(du), rank)
        first, which = _distinct_rows(classes, self.mesh.size)
        ids = np.array([self._class_ids.setdefault(tuple(c), len(self._class_ids)) for c in classes[first].tolist()],
                       dtype=np.int64)
        if len(self.shardings) > _ID_MASK or len(self._class_ids) > _CLASS_LIMIT:
            raise ShardsolveError(f"the reshard tables number at most {_ID_MASK + 1} shardings and {_CLASS_LIMIT} "
                                  f"shape classes; this problem has {len(self.shardings)} and {len(self._class_ids)}")
        keys = ((ids[which].reshape(len(su), len(du)) << 48) | (su[:, None] << 24) | du[None, :]).ravel()
        store = self._stores.get(rank)
        if store is None:
            store = self._stores[rank] = _StepStore(_row_width(rank))
        found = store.find(keys)
        new = np.flatnonzero(found < 0)
        numbers, shardings, mesh = self._numbers, self.shardings, self.mesh
        rows, counts = [], []
        for k, key in zip(new.tolist(), keys[new].tolist()):
            steps = _template(shape, shardings[(key >> 24) & _ID_MASK], shardings[key & _ID_MASK], mesh)
            # (by the steps' identity: an impossible or empty reshard's are shared by many pairs)
            known = numbers.get((id(steps), rank))
            if known is None:
                more = _step_rows(steps, rank, self._merge_number)
                known = numbers[id(steps), rank] = (steps, store.templates + len(counts))
                rows += more
                counts.append(len(more))
            found[k] = known[1]
        store.add(rows, counts)
        store.remember(keys[new], found[new])
        return store.gather(found)

    def _split_sizes(self, su: np.ndarray, du: np.ndarray) -> np.ndarray:
        """Per (source, destination, dimension): the size of the mesh axes either sharding splits it by.

        ``_template``'s products, whose gcd with a dimension gives its shape
        class.
        """
        masks, shardings, names = self._masks, self.shardings, self.mesh.names
        for s in shardings[len(masks):]:
            masks.append(tuple(sum(1 << names.index(a) for a in axes) for axes in s.dims))
        union = np.array([masks[s] for s in su.tolist()], dtype=np.int64)[:, None, :] | np.array(
            [masks[d] for d in du.tolist()], dtype=np.int64)[None, :, :]
        sizes = np.ones(union.shape, dtype=np.int64)
        for k, axis in enumerate(self.mesh.axes):
            sizes *= np.where((union >> k) & 1, axis.size, 1)
        return sizes

    def mergeable_latency(self, shape: tuple[int, ...], itemsize: int, src: np.ndarray,
                          dst: np.ndarray) -> dict[tuple, np.ndarray]:
        """The latency in ``table``'s seconds of collectives XLA may merge (``COMBINED_KINDS``), per merge key.

        A key is (kind, axes, reduction) (the caller adds the element type:
        ``wire_type``); a merged collective pays its latency
        once for all its members. The returned arrays may be shared between
        edges: never modify them in place.
        """
        full_key = (shape, itemsize, src.tobytes(), dst.tobytes())
        hit = self._merged_full.get(full_key)
        if hit is not None:
            return hit
        su, si = np.unique(src, return_inverse=True)
        du, di = np.unique(dst, return_inverse=True)
        key = (shape, itemsize, su.tobytes(), du.tobytes())
        small = self._merged.get(key)
        if small is None:
            # The rows of merged collectives that move bytes, summed per key and pair in order, keys in the order
            # the pairs and their steps first meet them.
            rows, pair = self._pair_steps(shape, su, du)
            column = 2 * len(shape)
            merge = rows[:, column + _MERGE].astype(np.int64)
            at = np.flatnonzero(merge >= 0)
            at = at[_bytes(shape, itemsize, rows[at]) > 0]
            numbers, first = np.unique(merge[at], return_index=True)
            keys = {n: k for k, n in self._merge_keys.items()}
            small = self._merged[key] = {}
            for n in numbers[np.argsort(first)].tolist():
                these = at[merge[at] == n]
                small[keys[n]] = np.bincount(pair[these], weights=rows[these, column + _LATENCY],
                                             minlength=len(su) * len(du)).reshape(len(su), len(du))
        out = self._merged_full[full_key] = {k: t[np.ix_(si, di)] for k, t in small.items()}
        for t in out.values():
            t.flags.writeable = False
        return out
