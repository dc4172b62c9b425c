"""Check a plan end to end: numerics, and the collectives it predicts against those that run.

``verify(plan, *args)`` checks the program ``plan.jit()`` runs (the rewriter's
``shard_map`` program, ``shardsolve.lower``):

1. numerics: its outputs against the unsharded function ``fun(*args)``, per
   output leaf (max abs and relative error; relative to the leaf's largest
   magnitude), within a tolerance of the least precise floating type the
   program computes in (a bfloat16 matmul's gradient summed over devices
   rounds otherwise than on one device, though it is returned as float32);
2. three collective inventories, bytes per (kind, mesh axes), never counts:
   *predicted* (``plan.collectives``, the schedule priced), *lowered* (what the
   rewriter wrote: the collectives in the traced program, before XLA) and
   *JAX* (the optimized HLO of the compiled ``plan.jit()``, what runs);
3. every difference, with the value and the operation it belongs to: lowered
   collectives carry ``ss{op}/ssr{value}`` name scopes, so ``op_name`` metadata
   leads back to the plan.

``report.ok`` holds when the numerics match and predicted == lowered == JAX
for every (kind, axes). A scan body's collectives count once in all three, as
a compiled while loop shows them.

``verify(plan, *args, pinned=True)`` also compiles (and runs) the plan as
``plan.jit(execution="pinned")``: JAX's partitioner with every non-partial
intermediate pinned. Its inventory and differences are reported, not required
to match: a value the plan keeps partial cannot be pinned with
``with_sharding_constraint``, so JAX reduces it where it likes.

    report = shardsolve.verify(plan, params, batch)
    report.ok, report.predicted == report.lowered == report.jax
    print(report)

Arguments may be ``jax.ShapeDtypeStruct``s: then nothing runs (no numerics)
and the programs are only compiled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from shardsolve.errors import ShardsolveError
from shardsolve.hlo import HloCollective, collectives_from_hlo, inventory
from shardsolve.lower import attribution, emitted_collectives, lower
from shardsolve.trace import key_data_leaves, key_impl, key_name

Inventory = dict[tuple[str, tuple[str, ...]], int]


@dataclass(frozen=True, slots=True)
class LeafCheck:
    """Errors of one output leaf against the unsharded function: ``plan.jit()`` (the lowered program), and
    the pinned program where it was checked (``None`` otherwise)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    lowered_abs: float
    lowered_rel: float
    tolerance: float  # allowed max abs error for this leaf
    lowered_ok: bool
    pinned_abs: float | None = None
    pinned_rel: float | None = None
    pinned_ok: bool | None = None

    @property
    def ok(self) -> bool:
        return self.lowered_ok and self.pinned_ok is not False


@dataclass(frozen=True, slots=True)
class Difference:
    """Collectives that differ between the plan and a compiled program, at one place in the program."""

    against: str  # "lowered", "jax" or "pinned"
    where: str  # the values and operations involved, in the plan's names
    predicted: tuple[tuple[str, tuple[str, ...], int], ...]  # (kind, axes, bytes)
    found: tuple[tuple[str, tuple[str, ...], int], ...]
    why: str

    def __str__(self) -> str:
        def side(items):
            return ", ".join(f"{k}{{{','.join(a)}}} {b} B" for k, a, b in items) or "none"

        return f"[{self.against}] {self.where}: predicted {side(self.predicted)}; found {side(self.found)} ({self.why})"


@dataclass(frozen=True)
class VerifyReport:
    mesh: str
    numerics: tuple[LeafCheck, ...]  # empty when the arguments were ShapeDtypeStructs
    numerics_checked: bool
    predicted: Inventory
    lowered: Inventory  # what the rewriter wrote (the traced program)
    jax: Inventory  # what XLA compiled from it (plan.jit()'s optimized HLO)
    differences: tuple[Difference, ...]  # predicted vs lowered
    jax_differences: tuple[Difference, ...]  # predicted vs the compiled plan.jit()
    lowered_collectives: tuple[Any, ...] = field(default=(), repr=False)  # lower.EmittedCollective
    jax_collectives: tuple[HloCollective, ...] = field(default=(), repr=False)
    pinned: Inventory | None = None  # plan.jit(execution="pinned")'s optimized HLO, where checked
    pinned_differences: tuple[Difference, ...] = ()  # predicted vs the pinned program (reported only)

    @property
    def numerics_ok(self) -> bool:
        return all(c.ok for c in self.numerics)

    @property
    def collectives_ok(self) -> bool:
        return self.predicted == self.lowered == self.jax

    @property
    def ok(self) -> bool:
        return self.numerics_ok and self.collectives_ok

    def rows(self) -> list[tuple[str, tuple[str, ...], int, int, int]]:
        """(kind, axes, predicted, lowered, jax) bytes for every key of any inventory."""
        keys = sorted(set(self.predicted) | set(self.lowered) | set(self.jax) | set(self.pinned or {}))
        return [(k, a, self.predicted.get((k, a), 0), self.lowered.get((k, a), 0), self.jax.get((k, a), 0))
                for k, a in keys]

    def __str__(self) -> str:
        lines = [f"verify on mesh {self.mesh}: {'ok' if self.ok else 'MISMATCH'}"]
        if self.numerics_checked:
            worst = max(self.numerics, key=lambda c: c.lowered_rel, default=None)
            lines.append(
                f"  numerics: {'ok' if self.numerics_ok else 'MISMATCH'} over {len(self.numerics)} leaves"
                + (f" (worst rel error {worst.lowered_rel:.2e})" if worst else "")
            )
        else:
            lines.append("  numerics: skipped (abstract arguments)")
        pinned = self.pinned is not None
        lines.append("  bytes per kind and axes: predicted / lowered / jax" + (" / pinned" if pinned else ""))
        for k, a, p, lo, j in self.rows():
            mark = "" if p == lo == j else "   <- differs"
            extra = f" / {self.pinned.get((k, a), 0)}" if pinned else ""
            lines.append(f"    {k}{{{','.join(a)}}}: {p} / {lo} / {j}{extra}{mark}")
        for d in self.differences + self.jax_differences + self.pinned_differences:
            lines.append(f"  {d}")
        return "\n".join(lines)


# -- arguments -------------------------------------------------------------------------


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def check_arguments(plan, args: Sequence[Any]) -> list[Any]:
    """The flat argument leaves, after checking structure, shapes and dtypes against the plan."""
    leaves_with_paths, tree = jax.tree_util.tree_flatten_with_path(tuple(args))
    traced = plan.graph.traced if plan.graph is not None else None
    if traced is not None and tree != traced.in_tree:
        raise ShardsolveError(
            f"the arguments' structure {tree} differs from the plan's {traced.in_tree}; pass the arguments the plan was made for"
        )
    if len(leaves_with_paths) != len(plan.signature.in_avals):
        raise ShardsolveError(
            f"{len(leaves_with_paths)} argument leaves given, the plan has {len(plan.signature.in_avals)}; "
            "pass the arguments the plan was made for"
        )
    leaves = []
    for (path, x), (shape, dtype), key in zip(leaves_with_paths, plan.signature.in_avals, plan.signature.in_keys):
        name = "args" + jax.tree_util.keystr(path)
        if key is not None:
            if key_name(x) != key:
                raise ShardsolveError(f"argument {name} must be a PRNG key array of implementation {key}, as the "
                                      "plan was made for; pass one (jax.random.key)")
            x = key_data_leaves([x], [key])[0]  # checked as the data the program takes
        elif key_impl(x) is not None:
            raise ShardsolveError(f"argument {name} is a PRNG key array where the plan was made for "
                                  f"{dtype}{list(shape)}; pass the arguments the plan was made for")
        got_shape = tuple(int(d) for d in np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
        # as JAX takes it: a Python float is float32, a float64 array float32, without jax_enable_x64
        got_dtype = str(jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x)))
        if got_shape != tuple(shape) or got_dtype != dtype:
            raise ShardsolveError(
                f"argument {name} is {got_dtype}{list(got_shape)} but the plan was made for {dtype}{list(shape)}; "
                "pass an argument of the planned shape, or plan again for these shapes"
            )
        leaves.append(x)
    return leaves


# -- numerics --------------------------------------------------------------------------


def _tolerance(dtype: np.dtype, scale: float, rtol: float | None, atol: float | None,
               computed_in: np.dtype | None = None) -> float:
    """Allowed max abs error of an output leaf of ``dtype`` and largest magnitude ``scale``; a floating leaf's
    defaults follow the least precise of ``dtype`` and ``computed_in`` (the program's least precise float)."""
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        return 0.0
    if computed_in is not None and jnp.issubdtype(dtype, jnp.floating) and computed_in.itemsize < np.dtype(dtype).itemsize:
        dtype = computed_in
    if rtol is None:
        rtol = 2e-2 if np.dtype(dtype).itemsize <= 2 else (1e-4 if np.dtype(dtype).itemsize == 4 else 1e-9)
    if atol is None:
        atol = 1e-5 if np.dtype(dtype).itemsize >= 4 else 1e-2
    return atol + rtol * scale


def _errors(got: Any, want: np.ndarray) -> tuple[float, float]:
    got = np.asarray(got)
    if got.shape != want.shape:
        return float("inf"), float("inf")
    if want.size == 0:
        return 0.0, 0.0
    a = got.astype(np.float64) if not np.iscomplexobj(got) else got.astype(np.complex128)
    b = want.astype(np.float64) if not np.iscomplexobj(want) else want.astype(np.complex128)
    both_nan = np.isnan(a) & np.isnan(b) if np.issubdtype(a.dtype, np.floating) else np.zeros(a.shape, bool)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    max_abs = float(np.max(diff)) if diff.size else 0.0
    if np.isnan(max_abs):
        max_abs = float("inf")
    finite = np.abs(b[np.isfinite(b)]) if np.size(b) else np.array([0.0])
    scale = float(np.max(finite)) if finite.size else 0.0
    return max_abs, max_abs / max(scale, 1e-30) if max_abs else 0.0


def _least_float(plan) -> np.dtype | None:
    """The least precise floating type among the values the plan's program computes (None without floats)."""
    floats = {v.dtype for v in plan.graph.values if jnp.issubdtype(v.dtype, jnp.floating)}  # bfloat16 too
    return min(floats, key=lambda d: d.itemsize) if floats else None


def _numerics(lowered_out, pinned_out, expected, rtol, atol, computed_in=None) -> tuple[LeafCheck, ...]:
    """Per output leaf, the errors of ``lowered_out`` (and ``pinned_out``, unless None) against ``expected``."""
    exp_leaves, exp_paths = _leaves_with_paths(expected)
    low_leaves, _ = _leaves_with_paths(lowered_out)
    pin_leaves = _leaves_with_paths(pinned_out)[0] if pinned_out is not None else [None] * len(exp_leaves)
    if not len(low_leaves) == len(pin_leaves) == len(exp_leaves):
        raise ShardsolveError(f"the planned program returned {len(low_leaves)} output leaves where the function "
                              f"returns {len(exp_leaves)}; plan it again")
    out = []
    for path, want, low, pin in zip(exp_paths, exp_leaves, low_leaves, pin_leaves):
        want = np.asarray(want)
        la, lr = _errors(low, want)
        finite = np.abs(want[np.isfinite(want)]).astype(np.float64) if want.size else np.zeros(0)
        scale = float(finite.max()) if finite.size else 0.0
        tol = _tolerance(want.dtype, scale, rtol, atol, computed_in)
        pa, pr = _errors(pin, want) if pin is not None else (None, None)
        out.append(LeafCheck(path, tuple(want.shape), str(want.dtype), la, lr, tol, la <= tol,
                             pa, pr, None if pa is None else pa <= tol))
    return tuple(out)


def _leaves_with_paths(tree: Any) -> tuple[list[Any], list[str]]:
    """Output leaves (typed PRNG keys as their data, compared bit for bit) and their names."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return ([jax.random.key_data(x) if key_impl(x) is not None else x for _, x in flat],
            ["outputs" + jax.tree_util.keystr(p) for p, _ in flat])


# -- attribution of differences ----------------------------------------------------------


class _Groups:
    """Union-find over tags (an operation, or a (consumer, value) reshard)."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, tags: Iterable[Any]) -> Any:
        tags = list(tags)
        root = self.find(tags[0])
        for t in tags[1:]:
            r = self.find(t)
            if r != root:
                self.parent[r] = root
        return root


_CONSUMER = re.compile(r"^%(\d+)\b")


def _consumer_tag(consumer: str) -> str:
    m = _CONSUMER.match(consumer)
    return f"op {m.group(1)}" if m else consumer


def _describe_tags(plan, tags: Iterable[Any]) -> str:
    graph = plan.graph
    parts = []
    for tag in sorted(tags, key=str):
        if isinstance(tag, tuple):
            consumer, vid = tag
            if vid is None:
                parts.append(_op_label(graph, consumer))
                continue
            v = graph.values[vid]
            parts.append(f"{v.name} ({np.dtype(v.dtype).name}{list(v.shape)}) for {_op_label(graph, consumer)}")
        else:
            parts.append(_op_label(graph, tag))
    return "; ".join(parts)


def _op_label(graph, tag: str) -> str:
    m = re.fullmatch(r"op (\d+)", tag)
    if m and graph is not None and int(m.group(1)) < len(graph.ops):
        return graph.ops[int(m.group(1))].name()
    return tag


def _diff(against: str, plan, predicted_items, found_items, why) -> list[Difference]:
    """Group both sides' (tags, kind, axes, bytes) by connected tags; a Difference per unequal group."""
    mesh = plan.mesh
    groups = _Groups()
    for tags, *_ in predicted_items + found_items:
        groups.union(tags)
    pred: dict[Any, dict] = {}
    found: dict[Any, dict] = {}
    members: dict[Any, set] = {}
    for side, items in ((pred, predicted_items), (found, found_items)):
        for tags, kind, axes, nbytes in items:
            if not axes:
                continue
            root = groups.find(tags[0])
            members.setdefault(root, set()).update(tags)
            key = (kind, mesh.order(axes) if all(a in mesh.names for a in axes) else tuple(axes))
            side.setdefault(root, {}).setdefault(key, 0)
            side[root][key] += nbytes
    out = []
    for root in sorted(set(pred) | set(found), key=str):
        p, f = pred.get(root, {}), found.get(root, {})
        if p == f:
            continue
        out.append(
            Difference(
                against,
                _describe_tags(plan, members[root]),
                tuple((k, a, b) for (k, a), b in sorted(p.items())),
                tuple((k, a, b) for (k, a), b in sorted(f.items())),
                why(members[root], p, f),
            )
        )
    return out


def _lowered_differences(plan, lowered: Sequence[Any], against: str = "lowered") -> list[Difference]:
    """Predicted collectives against those of the rewriter's program (``against``: its trace, or compiled)."""
    predicted_items = []
    for c in plan.collectives:
        # Inside a scan body the lowered program names the scan only (see lower.attribution).
        in_body = "scan/" in c.value_name or "scan/" in c.consumer
        predicted_items.append(([(_consumer_tag(c.consumer), None if in_body else c.value)], c.kind, c.axes, c.bytes))
    found_items = []
    for c in lowered:
        tags = attribution(c.op_name) or [(f"unattributed: {c.name} [{c.op_name}]", None)]
        found_items.append((tags, c.kind, c.axes, c.bytes))

    program = "the lowered program" if against == "lowered" else "the compiled program (XLA removed or rewrote it)"

    def why(tags, p, f):
        if not f:
            return f"predicted, but not in {program}"
        if not p:
            return f"in {program.split(' (')[0]}, but not predicted"
        if sum(p.values()) == sum(f.values()):
            return "same bytes, different kinds or axes" + (": XLA rewrote the collective" if against != "lowered" else "")
        return "different bytes"

    return _diff(against, plan, predicted_items, found_items, why)


_SS = re.compile(r"(?:^|[/(:])ss(\d+)(?=/|$|[):])")


def _pinned_differences(plan, found: Sequence[HloCollective]) -> list[Difference]:
    """Predicted collectives against JAX's partitioner running the pinned program (named ``ss{op}``)."""
    graph = plan.graph
    predicted_items = []
    for c in plan.collectives:
        # JAX's partitioner names a reshard after the operation that needed it, as the plan does.
        predicted_items.append(([_consumer_tag(c.consumer)], c.kind, c.axes, c.bytes))
    found_items = []
    for c in found:
        ops = sorted({int(m.group(1)) for m in _SS.finditer(c.op_name)})
        tags = [f"op {k}" for k in ops] or [f"unattributed: {c.name} [{c.op_name or 'no op_name'}]"]
        found_items.append((tags, c.kind, c.axes, c.bytes))

    def why(tags, p, f):
        ops = [int(t[3:]) for t in tags if isinstance(t, str) and re.fullmatch(r"op \d+", t)]
        partial = [graph.ops[k].name() for k in ops if any(s.partial for s in plan.ops[k].results)]
        reasons = []
        if partial:
            reasons.append(
                f"the plan keeps the result of {', '.join(partial)} partial, which with_sharding_constraint cannot "
                "pin, so JAX chooses where to reduce it"
            )
        if not f:
            reasons.append("JAX's partitioner needed no collective here")
        elif not p:
            reasons.append("JAX's partitioner resharded here where the plan needs no collective")
        elif sum(p.values()) == sum(f.values()):
            reasons.append("same bytes in other kinds or axes")
        elif sum(f.values()) < sum(p.values()):
            reasons.append("JAX moved fewer bytes here")
        else:
            reasons.append("JAX moved more bytes here")
        if any("unattributed" in str(t) for t in tags):
            reasons.append("the collective's op_name names no planned operation")
        return "; ".join(reasons)

    return _diff("pinned", plan, predicted_items, found_items, why)


# -- verify ------------------------------------------------------------------------------


def _reference(plan, args: tuple) -> Any:
    """The unsharded function's outputs; where it runs only under a context mesh (a bare ``PartitionSpec`` in a
    ``with_sharding_constraint``), under the plan's, as ``trace`` traced it. It gets the arguments' containers
    rebuilt: a function that writes into boxes it is given (Flax NNX's ``merge`` and ``update`` of a ``State``)
    changes those copies, not the arguments the planned program then runs on."""
    args = jax.tree.map(lambda x: x, args)
    if not plan.graph.traced.needs_mesh:
        return plan.fun(*args)
    with jax.set_mesh(plan.mesh.devices_mesh("verify")):
        return plan.fun(*args)


def verify(plan, *args: Any, rtol: float | None = None, atol: float | None = None,
           pinned: bool = False) -> VerifyReport:
    """Numerics and collective inventories of ``plan`` for ``args`` (see the module docstring)."""
    if not hasattr(plan, "require_bound"):
        raise ShardsolveError(f"verify expects a Plan from shardsolve.plan (or compare(...).plan), got "
                              f"{type(plan).__name__}: plan the function first")
    plan.require_bound()
    leaves = check_arguments(plan, args)
    abstract = any(_is_abstract(x) for x in leaves)
    run = lower(plan)  # what plan.jit() runs
    emitted = emitted_collectives(run, *args)
    compiled = collectives_from_hlo(run.lower(*args).compile().as_text(), plan.mesh)
    pinned_fn = plan.jit(execution="pinned") if pinned else None
    pinned_colls = (collectives_from_hlo(pinned_fn.lower(*args).compile().as_text(), plan.mesh)
                    if pinned_fn is not None else None)

    numerics: tuple[LeafCheck, ...] = ()
    if not abstract:
        expected = _reference(plan, args)
        numerics = _numerics(run(*args), pinned_fn(*args) if pinned_fn is not None else None, expected, rtol, atol,
                             _least_float(plan))

    return VerifyReport(
        mesh=str(plan.mesh),
        numerics=numerics,
        numerics_checked=not abstract,
        predicted=inventory(plan.collectives, plan.mesh),
        lowered=inventory(emitted, plan.mesh),
        jax=inventory(compiled, plan.mesh),
        differences=tuple(_lowered_differences(plan, emitted)),
        jax_differences=tuple(_lowered_differences(plan, compiled, "jax")),
        lowered_collectives=tuple(emitted),
        jax_collectives=tuple(compiled),
        pinned=inventory(pinned_colls, plan.mesh) if pinned_colls is not None else None,
        pinned_differences=tuple(_pinned_differences(plan, pinned_colls)) if pinned_colls is not None else (),
    )
