"""Logical axis names on arguments: one mesh-axis choice per name, and the rules that say it.

Flax users name every parameter dimension (``"embed"``, ``"mlp"``, ``"heads"``,
``"vocab"``) and map names to mesh axes with a list of *logical-axis rules*.
``shardsolve.plan(..., logical_rules=True)`` lets the solver choose those rules:
with ``c_n`` the mesh axes (possibly none) name ``n`` maps to, it adds

    for every dimension d of an argument leaf named n:   axes(d) = c_n     (axis ties)
    for every unnamed dimension d of a named leaf:        axes(d) = ()      (kept whole)

and reads the rules back as ``[(n, c_n), ...]``. Applied with Flax's own
``logical_to_mesh_sharding``, the rules give every named leaf exactly the
planned sharding: Flax resolves a leaf's names one by one, skipping a rule
whose mesh axes another dimension of the leaf already uses, and a plan never
uses one mesh axis on two dimensions of a leaf.

Both constraints are on argument nodes of the problem, in the way carry pairs
tie an argument to its next value (``build.tie_axes``): each further
occurrence of a name is tied to its first occurrence (a star, so the choice is
shared transitively) by an edge forbidding the strategy pairs that split the
two dimensions differently, and a pin keeps unnamed dimensions whole. Leaves
alike in names and shape are first tied whole to one another (``ties``).

    >>> from shardsolve.mesh import MeshSpec
    >>> from shardsolve.sharding import Sharding
    >>> axes = LogicalAxes((("embed", "mlp"), ("mlp", "embed")), ("args[0]['w1']", "args[0]['w2']"),
    ...                    ((64, 256), (256, 64)))
    >>> [(t.a, t.dim_a, t.b, t.dim_b) for t in axes.ties()]   # w2's dims tied to w1's
    [(0, 0, 1, 1), (0, 1, 1, 0)]
    >>> axes.rules((Sharding(((), ("model",))), Sharding((("model",), ()))))
    (('embed', None), ('mlp', 'model'))

Names that cannot share one choice (``"embed"`` on a dimension of 64 and one of
3 on a 4-way axis) or a leaf missing names among named ones are refused with a
one-line ``ShardsolveError`` naming the leaf and the way out (``check``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from shardsolve.build import AxisTie
from shardsolve.errors import ShardsolveError
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding

Names = tuple  # per dimension: a logical name (str) or None


@dataclass(frozen=True, slots=True)
class LogicalAxes:
    """The logical axis names of a program's flattened arguments.

    ``names[k]``: per dimension of argument leaf ``k``, its logical name or
    ``None``; ``None`` for a leaf without names. ``paths[k]``: the leaf's name
    (``args[0]['w']``), ``shapes[k]`` its shape.
    """

    names: tuple[Names | None, ...]
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def named(self) -> list[int]:
        return [k for k, n in enumerate(self.names) if n is not None]

    def occurrences(self) -> dict[str, list[tuple[int, int]]]:
        """Logical name -> (leaf, dimension) of each occurrence, names in order of first appearance."""
        out: dict[str, list[tuple[int, int]]] = {}
        for k in self.named:
            for d, name in enumerate(self.names[k]):
                if name is not None:
                    out.setdefault(name, []).append((k, d))
        return out

    # -- checks -------------------------------------------------------------

    def check(self, mesh: MeshSpec, pinned: Sequence[bool]) -> None:
        """Refuse, in one line, names that cannot be tied: see the module docstring.

        ``pinned[k]``: argument leaf ``k`` is pinned by ``in_shardings`` (so it
        needs no names).
        """
        if not self.named:
            raise ShardsolveError(
                "logical_rules=True, but no argument carries logical axis names; name the parameters' dimensions "
                "(nnx.with_partitioning, nn.with_logical_partitioning) or plan with logical_rules=False"
            )
        for k in self.named:
            names, shape, path = self.names[k], self.shapes[k], self.paths[k]
            if len(names) != len(shape):
                raise ShardsolveError(
                    f"{path} has {len(names)} logical axis names {names} for {len(shape)} dimensions; "
                    f"give one name (or None) per dimension"
                )
            bad = [n for n in names if n is not None and not isinstance(n, str)]
            if bad:
                raise ShardsolveError(f"{path}: logical axis name {bad[0]!r} is not a string; use one name or None "
                                      f"per dimension")
            twice = [n for n in set(names) if n is not None and names.count(n) > 1]
            if twice:
                raise ShardsolveError(
                    f"{path} names two dimensions {twice[0]!r} {names}; a name maps to one set of mesh axes, so give "
                    f"each dimension of a parameter its own name"
                )
        self.check_missing(pinned)
        self.check_sizes(mesh)

    def check_missing(self, pinned: Sequence[bool]) -> None:
        """An argument with named leaves must name all its leaves that have dimensions (or pin them)."""
        tops: dict[str, bool] = {}
        for k in self.named:
            tops[_top(self.paths[k])] = True
        for k, names in enumerate(self.names):
            if names is None and self.shapes[k] and not pinned[k] and _top(self.paths[k]) in tops:
                raise ShardsolveError(
                    f"{self.paths[k]} has no logical axis names, but other leaves of {_top(self.paths[k])} do; "
                    f"name its dimensions (nnx.with_partitioning, nn.with_logical_partitioning) or pin it in "
                    f"in_shardings"
                )

    def check_sizes(self, mesh: MeshSpec) -> None:
        """A name on dimensions of different sizes needs a mesh-axis choice that splits all of them."""
        choices = mesh_choices(mesh)
        for name, places in self.occurrences().items():
            sizes = {self.shapes[k][d] for k, d in places}
            if len(sizes) < 2:
                continue
            splits = lambda size: {c for c in choices if size % _parts(c, mesh) == 0}  # noqa: E731
            common = set.intersection(*(splits(s) for s in sizes))
            if common or not any(splits(s) for s in sizes):
                continue
            (ka, da), (kb, db) = _differing(places, self.shapes, splits)
            raise ShardsolveError(
                f"logical axis name {name!r} is on dimension {da} of {self.paths[ka]} (size {self.shapes[ka][da]}) "
                f"and dimension {db} of {self.paths[kb]} (size {self.shapes[kb][db]}), which no split over mesh "
                f"{mesh} divides alike; rename one of them, or plan with logical_rules=False"
            )

    # -- constraints ----------------------------------------------------------

    def ties(self) -> list[AxisTie]:
        """The ties of the module docstring, in two kinds.

        Leaves with the same names and shape (one projection in every layer,
        its Adam moments) take one sharding: each is tied, dimension by
        dimension, to the first of them (an equality edge, which the solver's
        reductions fold away). Then each further occurrence of a name among
        those first leaves is tied to its first occurrence (a star).
        """
        groups: dict[tuple, list[int]] = {}
        for k in self.named:
            groups.setdefault((self.names[k], self.shapes[k]), []).append(k)
        out = []
        for (names, _), members in groups.items():
            first = members[0]
            out += [AxisTie(first, d, k, d, f"logical axes {names} of {self.paths[k]} and {self.paths[first]}")
                    for k in members[1:] for d in range(len(names))]
        firsts = {members[0] for members in groups.values()}
        for name, places in self.occurrences().items():
            places = [(k, d) for k, d in places if k in firsts]
            (ka, da), rest = places[0], places[1:]
            out += [AxisTie(ka, da, kb, db, f"logical axis {name!r} of {self.paths[kb]} and {self.paths[ka]}")
                    for kb, db in rest]
        return out

    def whole(self) -> list[tuple[int, tuple[int, ...], str]]:
        """(leaf, its unnamed dimensions, label) for every named leaf with unnamed dimensions: they stay whole."""
        out = []
        for k in self.named:
            unnamed = tuple(d for d, n in enumerate(self.names[k]) if n is None and self.shapes[k][d] > 1)
            if unnamed:
                out.append((k, unnamed, f"logical axis names of {self.paths[k]} = {self.names[k]}"))
        return out

    # -- rules ------------------------------------------------------------------

    def rules(self, shardings: Sequence[Sharding]) -> tuple[tuple[str, Any], ...]:
        """``(name, mesh axis | tuple of them | None)`` per name, read from the argument leaves' shardings.

        Refused in one line where two occurrences of a name disagree (a plan made without the ties).
        """
        out = []
        for name, places in self.occurrences().items():
            seen = {shardings[k].dims[d] for k, d in places}
            if len(seen) > 1:
                k, d = places[0]
                raise ShardsolveError(
                    f"the plan splits logical axis {name!r} in {len(seen)} ways (e.g. {self.paths[k]}); plan with "
                    f"logical_rules=True to tie its dimensions"
                )
            axes = next(iter(seen))
            out.append((name, None if not axes else axes[0] if len(axes) == 1 else tuple(axes)))
        return tuple(out)


def mesh_choices(mesh: MeshSpec) -> list[tuple[str, ...]]:
    """Every non-empty choice of mesh axes for one dimension (size-1 axes left out, mesh order kept)."""
    names = [a.name for a in mesh.axes if a.size > 1]
    return [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]


def _parts(choice: tuple[str, ...], mesh: MeshSpec) -> int:
    return math.prod(mesh.axis(a).size for a in choice)


def _differing(places, shapes, splits) -> tuple[tuple[int, int], tuple[int, int]]:
    """Two occurrences whose sizes share no split (for the error message)."""
    for (ka, da), (kb, db) in itertools.combinations(places, 2):
        if not splits(shapes[ka][da]) & splits(shapes[kb][db]):
            return (ka, da), (kb, db)
    return places[0], places[-1]


def _top(path: str) -> str:
    """``args[0]['w']`` -> ``args[0]``: the argument a leaf belongs to."""
    end = path.find("]")
    return path[: end + 1] if end >= 0 else path
