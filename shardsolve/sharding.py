"""Shardings of one value: which mesh axes split which dimension, and which are partial.

A ``Sharding`` gives, per tensor dimension, the mesh axes that split it (major
to minor, like one entry of a ``PartitionSpec``), plus a set of *partial* axes:
along a partial axis each device holds a summand (or a max/min candidate) of
the true value, and a reduction over that axis is still pending.

    >>> from shardsolve.mesh import MeshSpec
    >>> mesh = MeshSpec.parse("data=2,model=4")
    >>> s = Sharding((("data",), ()), partial=("model",))
    >>> str(s)
    '[{data}, {}] partial{model}'
    >>> s.local_shape((8, 16), mesh)
    (4, 16)
    >>> [str(c) for c in candidate_shardings((8, 3), mesh)]
    ['[{}, {}]', '[{data}, {}]', '[{model}, {}]', '[{data, model}, {}]']

A split need not divide its dimension: as in XLA's SpmdPartitioner, every
shard then holds ``ceil(n / shards)`` elements and the last ones hold padding
past the end. JAX lays out only even splits at a ``jax.jit`` boundary, so an
uneven value enters and leaves a program as ``evened``: its uneven dimensions
unsplit.

    >>> s = Sharding((("model",), ()))
    >>> s.local_shape((10, 6), mesh), s.divides((10, 6), mesh), str(s.evened((10, 6), mesh))
    ((3, 6), False, '[{}, {}]')
    >>> uneven_split_fits(10, 4), uneven_split_fits(6, 4)   # shards 3,3,3,1 / 2,2,2,0
    (True, False)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from shardsolve.errors import ShardsolveError
from shardsolve.mesh import MeshSpec

REDUCE_OPS = ("sum", "max", "min")


@dataclass(frozen=True, slots=True, order=True)
class Sharding:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    reduce_op: str = "sum"  # how partial summands combine
    # Computed once: shardings key most of the problem builder's caches, looked up millions of times.
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.dims, self.partial, self.reduce_op)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # the hash of strings differs between processes: a copy computes its own
        return Sharding, (self.dims, self.partial, self.reduce_op)

    # -- construction -----------------------------------------------------

    @classmethod
    def replicated(cls, ndim: int) -> Sharding:
        return cls(((),) * ndim)

    @classmethod
    def from_spec(cls, spec: Any, ndim: int, mesh: MeshSpec | None = None, *, what: str = "value") -> Sharding:
        """Convert a ``PartitionSpec`` (or ``None`` = replicated) to a ``Sharding``.

        Checks axis names against ``mesh`` and that no axis is used twice.
        """
        if spec is None:
            return cls.replicated(ndim)
        entries = tuple(spec)
        if len(entries) > ndim:
            raise ShardsolveError(
                f"{what}: PartitionSpec {spec} has {len(entries)} entries but the value has rank {ndim}; "
                f"give at most {ndim}"
            )
        dims: list[tuple[str, ...]] = []
        seen: set[str] = set()
        for entry in entries + (None,) * (ndim - len(entries)):
            if entry is None:
                axes: tuple[str, ...] = ()
            elif isinstance(entry, str):
                axes = (entry,)
            else:
                axes = tuple(entry)
            for a in axes:
                if not isinstance(a, str):
                    raise ShardsolveError(f"{what}: PartitionSpec {spec} has a non-string axis {a!r}")
                if mesh is not None and a not in mesh.names:
                    raise ShardsolveError(
                        f"{what}: PartitionSpec {spec} names unknown mesh axis {a!r}; mesh axes are {mesh.names}"
                    )
                if a in seen:
                    raise ShardsolveError(f"{what}: PartitionSpec {spec} uses mesh axis {a!r} twice; use each axis once")
                seen.add(a)
            dims.append(axes)
        return cls(tuple(dims))

    # -- queries ----------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes that split some dimension."""
        return tuple(a for d in self.dims for a in d)

    @property
    def is_replicated(self) -> bool:
        return not self.axes and not self.partial

    def dim_shards(self, dim: int, mesh: MeshSpec) -> int:
        return mesh.group_size(self.dims[dim])

    def num_shards(self, mesh: MeshSpec) -> int:
        """Number of distinct pieces the value is split into (partial axes excluded)."""
        return mesh.group_size(self.axes)

    def divides(self, shape: Sequence[int], mesh: MeshSpec) -> bool:
        return all(size % self.dim_shards(d, mesh) == 0 for d, size in enumerate(shape))

    def uneven_dims(self, shape: Sequence[int], mesh: MeshSpec) -> tuple[int, ...]:
        """Dimensions split into parts that do not divide them (their shards hold padding)."""
        return tuple(d for d, size in enumerate(shape) if self.dims[d] and size % self.dim_shards(d, mesh))

    def evened(self, shape: Sequence[int], mesh: MeshSpec) -> Sharding:
        """This sharding with its uneven dimensions unsplit: the layout JAX accepts at a ``jax.jit`` boundary.

        Going from ``evened`` to this sharding is a local slice; back, an all-gather of the uneven dimensions.
        """
        uneven = self.uneven_dims(shape, mesh)
        if not uneven:
            return self
        return Sharding(tuple(() if d in uneven else axes for d, axes in enumerate(self.dims)), self.partial,
                        self.reduce_op)

    def without_unit_axes(self, mesh: MeshSpec) -> Sharding:
        """This sharding with the mesh axes of size 1 left out: the same layout (``P("data")`` on a mesh whose
        ``data`` has one device is ``P()``)."""
        if all(mesh.axis_size(a) > 1 for a in (*self.axes, *self.partial)):
            return self
        keep = tuple(a for a in self.partial if mesh.axis_size(a) > 1)
        return Sharding(tuple(tuple(a for a in d if mesh.axis_size(a) > 1) for d in self.dims), keep,
                        self.reduce_op if keep else "sum")

    def local_shape(self, shape: Sequence[int], mesh: MeshSpec) -> tuple[int, ...]:
        """Per-device shape (dimensions padded up where the split is uneven)."""
        return tuple(-(-size // mesh.group_size(axes)) if axes else size for size, axes in zip(shape, self.dims))

    def local_bytes(self, shape: Sequence[int], itemsize: int, mesh: MeshSpec) -> int:
        n = itemsize
        for size, axes in zip(shape, self.dims):
            n *= -(-size // mesh.group_size(axes)) if axes else size
        return n

    def without_partial(self) -> Sharding:
        return Sharding(self.dims)

    def with_partial(self, axes: Sequence[str], reduce_op: str = "sum") -> Sharding:
        return Sharding(self.dims, tuple(sorted(set(axes))), reduce_op if axes else "sum")

    def to_spec(self):
        """The ``PartitionSpec`` of this sharding (partial axes are not expressible there)."""
        from jax.sharding import PartitionSpec

        if self.partial:
            raise ShardsolveError(f"sharding {self} is partial and has no PartitionSpec; reduce it first")
        entries: list[Any] = [None if not d else (d[0] if len(d) == 1 else d) for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def __str__(self) -> str:
        body = "[" + ", ".join("{" + ", ".join(d) + "}" for d in self.dims) + "]"
        if self.partial:
            op = "" if self.reduce_op == "sum" else f"({self.reduce_op})"
            body += f" partial{op}{{{', '.join(self.partial)}}}"
        return body

    def to_json(self) -> dict:
        out: dict = {"dims": [list(d) for d in self.dims]}
        if self.partial:
            out["partial"] = list(self.partial)
            out["reduce_op"] = self.reduce_op
        return out

    @classmethod
    def from_json(cls, data: dict) -> Sharding:
        return cls(
            tuple(tuple(d) for d in data["dims"]),
            tuple(data.get("partial", ())),
            data.get("reduce_op", "sum"),
        )


def uneven_split_fits(size: int, n: int) -> bool:
    """Whether ``n`` shards of a dimension of ``size`` (not a multiple of ``n``) waste less than one shard.

    Every shard holds ``ceil(size / n)`` elements; a split where a whole
    shard would be padding (``6`` over ``4``: ``2, 2, 2, 0``) does the work of
    fewer devices at the memory of ``n``, and is not offered.
    """
    local = -(-size // n)
    return size >= n and local * n - size < local


def _dim_assignments(shape: Sequence[int], mesh: MeshSpec, allow_uneven: bool) -> Iterator[tuple[tuple[str, ...], ...]]:
    axes = [a for a in mesh.axes if a.size > 1]
    ndim = len(shape)
    # Each axis goes to one dimension or to none (index ndim); axes on one
    # dimension keep mesh order (major to minor).
    for choice in itertools.product(range(ndim + 1), repeat=len(axes)):
        dims: list[list[str]] = [[] for _ in range(ndim)]
        for axis, d in zip(axes, choice):
            if d < ndim:
                dims[d].append(axis.name)
        ok = True
        for d, names in enumerate(dims):
            n = math.prod(mesh.axis(a).size for a in names)
            if n > 1 and shape[d] % n != 0 and not (allow_uneven and uneven_split_fits(shape[d], n)):
                ok = False
                break
        if ok:
            yield tuple(tuple(d) for d in dims)


def candidate_shardings(shape: Sequence[int], mesh: MeshSpec, *, allow_uneven: bool = False) -> list[Sharding]:
    """Every non-partial sharding of ``shape`` on ``mesh`` that splits dimensions evenly.

    With ``allow_uneven``, also splits that do not divide a dimension where no
    shard is all padding (``uneven_split_fits``). Size-1 mesh axes are never
    used; several axes on one dimension keep mesh order. The replicated
    sharding comes first; the order is deterministic.
    """
    out = [Sharding(d) for d in _dim_assignments(tuple(shape), mesh, allow_uneven)]
    out.sort(key=lambda s: (len(s.axes), _mesh_rank(s, mesh)))
    return out


def _mesh_rank(s: Sharding, mesh: MeshSpec) -> tuple:
    pos = {n: i for i, n in enumerate(mesh.names)}
    return tuple((pos[a], d) for d, axes in enumerate(s.dims) for a in axes)
