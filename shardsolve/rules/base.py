"""Sharding rules in factor notation, and the strategies they allow.

A rule names every dimension of every operand and result by *factors*
(as Shardy's op sharding rules do). Dimensions that share a factor are split
the same way. A factor missing from the results is a *reduction*: splitting it
leaves the results partial (a pending sum, max or min). A *need-replication*
factor is never split. A dimension made of several factors (``[ij]``, from a
reshape) is split by its major factor's axes first, then the minor one's, and
the minor factor may only be split once the major one is split completely.

The printed form is the single source of truth in tests:

    >>> rule = Rule.parse("([i, k], [k, j])->([i, j]) {i=8, j=8, k=4} reduction={k}")
    >>> str(rule)
    '([i, k], [k, j])->([i, j]) {i=8, j=8, k=4} reduction={k}'
    >>> from shardsolve.mesh import MeshSpec
    >>> s = rule.strategies(MeshSpec.parse("x=2"))
    >>> [f"{', '.join(map(str, t.operands))} -> {t.results[0]}" for t in s]
    ['[{}, {}], [{}, {}] -> [{}, {}]', '[{x}, {}], [{}, {}] -> [{x}, {}]', '[{}, {x}], [{x}, {}] -> [{}, {}] partial{x}', '[{}, {}], [{}, {x}] -> [{}, {x}]']

A factor may be split unevenly (``f=10`` over 4 devices: shards of 3, the
last one holding padding) where no shard is all padding
(``sharding.uneven_split_fits``) and the factor alone makes up every
dimension it appears in (a compound dimension's shards would not line up
with its factors'). Padding holds unspecified values; ``local.run_local``
sets it to the reduction's identity (0 for a sum, -inf for a max) where a
reduction factor is split unevenly, and padding-sensitive dimensions (a
scan's or sort's axis, sliced, padded, reversed or concatenated dimensions)
are need-replication anyway.

*Linear* operand groups let partial values flow through: an ``add`` is linear
in both operands together (``(A1 + A2) + (B1 + B2) = (A1 + B1) + (A2 + B2)``),
a ``mul`` in each operand alone. For a linear group ``g``, a strategy may mark
an unused mesh axis *partial via g*: the operands in ``g`` arrive partial along
it and the results leave partial along it.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from shardsolve.cost import compute_time
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding, uneven_split_fits

Dims = tuple[tuple[str, ...], ...]  # per dimension, its factors (major first)

_FACTOR_TOKEN = re.compile(r"z_\d+|[a-z]")


def factor_names(n: int) -> list[str]:
    """Canonical factor names: i, j, k, ... (Shardy style), then z_1, z_2, ..."""
    letters = "ijklmnopqrstuvwxyabcdefgh"
    return [letters[k] if k < len(letters) else f"z_{k - len(letters) + 1}" for k in range(n)]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an operation: how each factor is split over mesh axes."""

    assignment: tuple[tuple[str, tuple[str, ...]], ...]  # (factor, mesh axes) for split factors
    operands: tuple[Sharding, ...]
    results: tuple[Sharding, ...]
    work_split: int  # devices that share the work (product of axes on factors)
    partial_via: tuple[tuple[str, int], ...] = ()  # (mesh axis, linear group index)

    def axes_of(self, factor: str) -> tuple[str, ...]:
        return dict(self.assignment).get(factor, ())

    def describe(self) -> str:
        parts = [f"{f}:{'*'.join(a)}" for f, a in self.assignment]
        parts += [f"partial[{a}]<-g{g}" for a, g in self.partial_via]
        return ", ".join(parts) or "replicated"


@dataclass(frozen=True, slots=True)
class Rule:
    """A primitive's sharding rule in factor notation. See the module docstring."""

    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    sizes: tuple[tuple[str, int], ...]  # factor -> size, in first-appearance order
    reduction: tuple[str, ...] = ()
    need_replication: tuple[str, ...] = ()
    reduce_op: str = "sum"
    linear: tuple[tuple[int, ...], ...] = ()
    flops: float = field(default=0.0, compare=False)
    # ``flops`` counts elements, and a device's share of n elements costs n * ceil(log2 n) (a sort, as XLA's cost
    # analysis counts it: the local sort's elements times their log).
    log_flops: bool = field(default=False, compare=False)
    _size: dict = field(default=None, compare=False, repr=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_size", dict(self.sizes))
        used = {f for group in (self.operands, self.results) for dims in group for d in dims for f in d}
        missing = used - set(self._size)
        if missing:
            raise ValueError(f"rule {self}: factors {sorted(missing)} have no size")
        in_results = {f for dims in self.results for d in dims for f in d}
        for f in self.reduction:
            if f in in_results:
                raise ValueError(f"rule {self}: reduction factor {f} appears in a result")

    # -- builders ---------------------------------------------------------

    @classmethod
    def build(
        cls,
        operands: Sequence[Sequence[Sequence[str] | str]],
        results: Sequence[Sequence[Sequence[str] | str]],
        sizes: dict[str, int],
        *,
        reduction: Sequence[str] = (),
        need_replication: Sequence[str] = (),
        reduce_op: str = "sum",
        linear: Sequence[Sequence[int]] = (),
        flops: float = 0.0,
        log_flops: bool = False,
    ) -> Rule:
        """Build a rule from factor lists; factors are renamed canonically (i, j, k, ...)."""

        def norm(groups):
            return tuple(tuple((d,) if isinstance(d, str) else tuple(d) for d in dims) for dims in groups)

        ops, res = norm(operands), norm(results)
        order: list[str] = []
        for dims in ops + res:
            for d in dims:
                for f in d:
                    if f not in order:
                        order.append(f)
        for f in list(reduction) + list(need_replication):
            if f not in order:
                order.append(f)
        rename = dict(zip(order, factor_names(len(order))))

        def ren(groups):
            return tuple(tuple(tuple(rename[f] for f in d) for d in dims) for dims in groups)

        return cls(
            ren(ops),
            ren(res),
            tuple((rename[f], int(sizes[f])) for f in order),
            tuple(sorted((rename[f] for f in set(reduction)), key=_factor_key)),
            tuple(sorted((rename[f] for f in set(need_replication)), key=_factor_key)),
            reduce_op,
            tuple(tuple(sorted(g)) for g in linear),
            float(flops),
            bool(log_flops),
        )

    # -- printed form -----------------------------------------------------

    def __str__(self) -> str:
        def side(groups: tuple[Dims, ...]) -> str:
            return "(" + ", ".join("[" + ", ".join("".join(d) for d in dims) + "]" for dims in groups) + ")"

        text = f"{side(self.operands)}->{side(self.results)}"
        text += " {" + ", ".join(f"{f}={n}" for f, n in sorted(self.sizes, key=lambda x: _factor_key(x[0]))) + "}"
        if self.reduction:
            text += " reduction={" + ", ".join(self.reduction) + "}"
            if self.reduce_op != "sum":
                text += f"({self.reduce_op})"
        if self.need_replication:
            text += " need_replication={" + ", ".join(self.need_replication) + "}"
        if self.linear:
            text += " linear={" + ", ".join("(" + ", ".join(map(str, g)) + ")" for g in self.linear) + "}"
        return text

    @classmethod
    def parse(cls, text: str, *, flops: float = 0.0) -> Rule:
        """Inverse of ``str(rule)``."""
        m = re.fullmatch(
            r"\s*\((.*?)\)\s*->\s*\((.*?)\)\s*\{(.*?)\}"
            r"(?:\s*reduction=\{(.*?)\}(?:\((sum|max|min)\))?)?"
            r"(?:\s*need_replication=\{(.*?)\})?"
            r"(?:\s*linear=\{(.*?)\})?\s*",
            text,
        )
        if not m:
            raise ValueError(f"cannot parse rule {text!r}")

        def side(body: str) -> tuple[Dims, ...]:
            groups = re.findall(r"\[(.*?)\]", body)
            out = []
            for g in groups:
                dims = [d.strip() for d in g.split(",")] if g.strip() else []
                out.append(tuple(tuple(_FACTOR_TOKEN.findall(d)) for d in dims))
            return tuple(out)

        sizes = tuple(
            (k.strip(), int(v)) for k, v in (item.split("=") for item in m.group(3).split(",") if item.strip())
        )
        names = lambda s: tuple(x.strip() for x in s.split(",") if x.strip()) if s else ()  # noqa: E731
        linear = tuple(
            tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\((.*?)\)", m.group(7) or "")
        )
        order = [f for f, _ in sizes]
        ops, res = side(m.group(1)), side(m.group(2))
        seen: list[str] = []
        for dims in ops + res:
            for d in dims:
                for f in d:
                    if f not in seen:
                        seen.append(f)
        seen += [f for f in order if f not in seen]
        size_map = dict(sizes)
        return cls(
            ops,
            res,
            tuple((f, size_map[f]) for f in seen),
            names(m.group(4)),
            names(m.group(6)),
            m.group(5) or "sum",
            linear,
            flops,
        )

    # -- queries ----------------------------------------------------------

    def size(self, factor: str) -> int:
        return self._size[factor]

    @property
    def factors(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.sizes)

    def operand_shape(self, k: int) -> tuple[int, ...]:
        return tuple(math.prod(self._size[f] for f in d) for d in self.operands[k])

    def result_shape(self, k: int) -> tuple[int, ...]:
        return tuple(math.prod(self._size[f] for f in d) for d in self.results[k])

    # -- strategies -------------------------------------------------------

    def splittable(self) -> tuple[str, ...]:
        return tuple(f for f, n in self.sizes if n > 1 and f not in self.need_replication)

    def sole_factors(self) -> frozenset[str]:
        """Factors that alone make up every dimension they appear in (size-1 companions aside)."""
        compound = {
            f
            for group in (self.operands, self.results)
            for dims in group
            for d in dims
            if sum(self._size[g] > 1 for g in d) > 1
            for f in d
        }
        return frozenset(f for f in self.factors if f not in compound)

    def strategies(
        self,
        mesh: MeshSpec,
        *,
        allow_partial: bool = True,
        fixed_operands: Sequence[int] = (),
        allow_uneven: bool = True,
    ) -> list[Strategy]:
        """Every valid strategy on ``mesh``, replicated first, in a deterministic order.

        ``fixed_operands`` are operands that can never arrive partial
        (literals, constants): linear groups containing them are skipped.
        ``allow_uneven`` admits factors split unevenly (see the module
        docstring; ``False``: even splits only, the planner's behaviour before
        uneven support, kept for comparison).
        """
        axes = [a for a in mesh.axes if a.size > 1]
        factors = self.splittable()
        groups = []
        if allow_partial and self.reduce_op == "sum":
            groups = [g for g in self.linear if not set(g) & set(fixed_operands)]
        options: list[Any] = [None] + list(factors) + [("partial", k) for k in range(len(groups))]
        uneven = self.sole_factors() if allow_uneven else frozenset()
        out: list[Strategy] = []
        for choice in itertools.product(options, repeat=len(axes)):
            strategy = self._strategy(mesh, axes, choice, groups, uneven)
            if strategy is not None:
                out.append(strategy)
        return out

    def _strategy(self, mesh: MeshSpec, axes, choice, groups, uneven: frozenset[str] = frozenset()) -> Strategy | None:
        on: dict[str, list[str]] = {}
        partial_via: list[tuple[str, int]] = []
        for axis, opt in zip(axes, choice):
            if opt is None:
                continue
            if isinstance(opt, tuple):
                partial_via.append((axis.name, opt[1]))
            else:
                on.setdefault(opt, []).append(axis.name)
        split: dict[str, int] = {}
        for f, names in on.items():
            n = math.prod(mesh.axis(a).size for a in names)
            if self._size[f] % n != 0 and not (f in uneven and uneven_split_fits(self._size[f], n)):
                return None
            split[f] = n

        def dims_sharding(dims: Dims) -> tuple[tuple[str, ...], ...] | None:
            out = []
            for d in dims:
                names: list[str] = []
                complete = True
                for f in d:
                    if f in on:
                        if not complete:
                            return None  # minor factor split before the major one is complete
                        names += on[f]
                    if split.get(f, 1) != self._size[f]:
                        complete = False
                out.append(tuple(names))
            return tuple(out)

        operands = []
        for k, dims in enumerate(self.operands):
            ds = dims_sharding(dims)
            if ds is None:
                return None
            partial = sorted(a for a, g in partial_via if k in groups[g])
            operands.append(Sharding(ds, tuple(partial)))
        reduced = sorted(a for f in self.reduction for a in on.get(f, ()))
        results = []
        for dims in self.results:
            ds = dims_sharding(dims)
            if ds is None:
                return None
            partial = sorted(reduced + [a for a, _ in partial_via])
            op = self.reduce_op if reduced else "sum"
            results.append(Sharding(ds, tuple(partial), op if partial else "sum"))
        assignment = tuple((f, tuple(on[f])) for f in self.factors if f in on)
        return Strategy(assignment, tuple(operands), tuple(results), math.prod(split.values()), tuple(partial_via))

    def shapes(self) -> list[tuple[int, ...]]:
        """The operands' shapes, then the results'."""
        return ([self.operand_shape(k) for k in range(len(self.operands))]
                + [self.result_shape(k) for k in range(len(self.results))])

    def strategy_time(self, strategy: Strategy, mesh: MeshSpec, itemsizes: Sequence[int],
                      traffic: Sequence[bool] | None = None, shapes: Sequence[tuple[int, ...]] | None = None) -> float:
        """Compute time of one device's share under ``strategy``.

        ``itemsizes`` gives bytes per element of the operands then the results;
        ``traffic`` (same order, default all) which of them move through memory
        (an operand or result fused with its neighbour does not); ``shapes``: ``self.shapes()``, where the
        caller prices many strategies.
        """
        nbytes = 0
        if shapes is None:
            shapes = self.shapes()
        moved = traffic if traffic is not None else (True,) * len(shapes)
        for shape, sharding, itemsize, m in zip(shapes, strategy.operands + strategy.results, itemsizes, moved):
            if m:
                nbytes += sharding.local_bytes(shape, itemsize, mesh)
        # An uneven split's shards are padded: each of a factor's n devices works on ceil(size / n) of it.
        padded = exact = 1
        for f, axes in strategy.assignment:
            n = mesh.group_size(axes)
            padded *= -(-self._size[f] // n) * n
            exact *= self._size[f]
        flops = self.flops / strategy.work_split * (padded / exact)
        if self.log_flops:
            flops *= max(1, math.ceil(math.log2(max(flops, 1.0))))
        return compute_time(flops, nbytes, mesh)


def _factor_key(name: str) -> tuple[int, int | str]:
    if name.startswith("z_"):
        return (1, int(name[2:]))
    return (0, factor_names(25).index(name) if name in factor_names(25) else name)


@functools.lru_cache(maxsize=1 << 12)
def strategies_of(rule: Rule, mesh: MeshSpec, fixed_operands: tuple[int, ...] = (),
                  allow_uneven: bool = True) -> tuple[Strategy, ...]:
    """``rule.strategies(mesh, ...)``, kept: the problem builder and the lowering of every plan of a program ask
    for the same rules' strategies again (a three-axis mesh has hundreds per rule).

    Rules of one structure whose factor sizes split alike (``_split_class``: an elementwise op on ``[B, S, D]``
    and on ``[B, S, 4D]``) have the same strategies, worked out once."""
    key = (rule.operands, rule.results, tuple(f for f, _ in rule.sizes),
           tuple(_split_class(n, mesh) for _, n in rule.sizes), rule.reduction, rule.need_replication,
           rule.reduce_op, rule.linear, mesh, fixed_operands, allow_uneven)
    hit = _BY_STRUCTURE.get(key)
    if hit is None:
        if len(_BY_STRUCTURE) >= 1 << 14:
            _BY_STRUCTURE.clear()
        hit = _BY_STRUCTURE[key] = tuple(rule.strategies(mesh, fixed_operands=fixed_operands,
                                                         allow_uneven=allow_uneven))
    return hit


_BY_STRUCTURE: dict[tuple, tuple[Strategy, ...]] = {}


@functools.lru_cache(maxsize=1 << 14)
def _split_class(size: int, mesh: MeshSpec) -> tuple:
    """All ``Rule.strategies`` asks of a factor's size: whether it is above 1, and for each number of devices a
    group of the mesh's axes (any subset of them) can split it over, whether that divides it, splits it
    unevenly within ``uneven_split_fits`` and splits it whole (one element a device)."""
    return (size > 1,) + tuple((size % n == 0, uneven_split_fits(size, n), size == n) for n in _group_sizes(mesh))


@functools.lru_cache(maxsize=64)
def _group_sizes(mesh: MeshSpec) -> tuple[int, ...]:
    """The device counts of every nonempty subset of ``mesh``'s axes of size above 1 (sorted, distinct)."""
    sizes = [a.size for a in mesh.axes if a.size > 1]
    return tuple(sorted({math.prod(c) for k in range(1, len(sizes) + 1) for c in itertools.combinations(sizes, k)}))
