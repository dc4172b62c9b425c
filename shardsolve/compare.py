"""shardsolve's plan beside GSPMD and Shardy propagation, judged on JAX's compiled output.

From one set of annotations, ``compare`` compiles (never runs) several programs
for the same concrete mesh and judges each one the same way:

=============  ==========================================================================
column         program
=============  ==========================================================================
``shardy``     ``jax.jit(fun, in_shardings=..., out_shardings=...)``, Shardy propagation
``gspmd``      the same with GSPMD propagation (``jax_use_shardy_partitioner=False``)
``shardsolve`` ``shardsolve.plan(...).jit()``: the plan's own program (its collectives, no others)
``expert``     optional: ``jax.jit`` with a hand-written annotation, Shardy propagation
=============  ==========================================================================

Each compiled program is read, not trusted: per-device FLOPs and bytes accessed
from ``compiled.cost_analysis()`` (which counts a while body once: the runs it
misses are added from the optimized HLO, ``hlo.loop_adjustment``), per-device memory from
``compiled.memory_analysis()`` (argument + output + temp - alias), and the
collectives from the optimized HLO (``shardsolve.hlo``). Then the one cost model
(``shardsolve.cost``) prices every column alike::

    compute        = cost.compute_time(flops, bytes_accessed, mesh)
    communication  = cost.communication_time(collectives, mesh)   # cost.hlo_collective_time of each, times its runs
    step time      = compute + communication
    fits           = peak_memory <= memory_limit

A column that fails (JAX rejects an annotation, the solver finds no plan, XLA
fails to compile) keeps JAX's (or the planner's) reason in one line and the
other columns go on.

    >>> cmp = shardsolve.compare(step, params, batch, mesh="data=2,model=4",
    ...                          in_shardings=(None, P("data")))       # doctest: +SKIP
    >>> cmp["shardy"].total, cmp["shardsolve"].total                  # doctest: +SKIP
    >>> cmp.speedup("shardsolve", cmp.best_propagation().name)        # doctest: +SKIP

Arguments may be ``jax.ShapeDtypeStruct``s at realistic sizes: nothing runs, so
nothing is allocated. The mesh must be concrete (``mesh.size`` devices present);
on a CPU-only machine set ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
before JAX starts its backend (the ``shardsolve compare`` command does that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.annotations import argument_pins, broadcast_annotations, output_pins
from shardsolve.cost import communication_time, compute_time
from shardsolve.errors import ShardsolveError
from shardsolve.hlo import HloCollective, Memory, collectives_from_hlo, compiled_memory, loop_adjustment
from shardsolve.mesh import MeshSpec, as_mesh_spec
from shardsolve.plan import Plan
from shardsolve.planner import plan as make_plan
from shardsolve.propagation import concrete_mesh, shardy_propagation
from shardsolve.sharding import Sharding
from shardsolve.trace import abstractify, in_mesh, leaf_names
from shardsolve.units import parse_memory_limit

COLUMNS = ("gspmd", "shardy", "shardsolve", "expert")
PROPAGATION = ("gspmd", "shardy")
LABELS = {
    "gspmd": "GSPMD",
    "shardy": "Shardy",
    "shardsolve": "shardsolve",
    "expert": "expert",
}
_GSPMD_WARNING = re.compile(r"GSPMD sharding propagation is going to be deprecated|consider migrating to Shardy")


# -- results ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    """One compiled program, judged by the one cost model (seconds and bytes per device)."""

    name: str  # one of COLUMNS (or a caller's own label)
    label: str  # for tables: "GSPMD", "Shardy", "shardsolve", "expert"
    error: str = ""  # one line when this column failed; everything below is then empty
    flops: float = 0.0  # per device, from cost_analysis() with while bodies times their trip count
    bytes_accessed: float = 0.0  # per device, likewise
    compute: float = 0.0
    communication: float = 0.0
    memory: Memory = field(default_factory=Memory)
    fits: bool | None = None  # None when no memory limit was given
    collectives: tuple[HloCollective, ...] = ()  # in HLO text order
    compile_time: float = 0.0
    in_specs: tuple[str, ...] = ()  # the compiled program's input shardings, per flattened argument
    out_specs: tuple[str, ...] = ()
    hlo: str = field(default="", repr=False, compare=False)  # optimized HLO text, for explanations

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def total(self) -> float:
        """Estimated step time: compute + communication (``inf`` when the column failed)."""
        return self.compute + self.communication if self.ok else math.inf

    @property
    def peak_memory(self) -> int:
        return self.memory.peak

    @property
    def bytes_by_kind(self) -> tuple[tuple[str, int], ...]:
        by_kind: Counter = Counter()
        for c in self.collectives:
            if c.axes:
                by_kind[c.kind] += c.bytes
        return tuple(sorted(by_kind.items()))

    @property
    def communication_bytes(self) -> int:
        return sum(b for _, b in self.bytes_by_kind)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"name": self.name, "label": self.label}
        if self.error:
            d["error"] = self.error
            return d
        d.update(
            {
                "total": self.total,
                "compute": self.compute,
                "communication": self.communication,
                "flops": self.flops,
                "bytes_accessed": self.bytes_accessed,
                "memory": self.memory.to_json(),
                "peak_memory": self.peak_memory,
                "fits": self.fits,
                "bytes_by_kind": dict(self.bytes_by_kind),
                "collectives": [
                    {"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "shape": c.shape, "op_name": c.op_name}
                    for c in self.collectives
                ],
                "compile_time": self.compile_time,
                "in_specs": list(self.in_specs),
                "out_specs": list(self.out_specs),
            }
        )
        return d


@dataclass(frozen=True)
class Comparison:
    """Columns side by side; ``cmp["shardy"]`` is one ``Column``."""

    mesh: MeshSpec
    columns: tuple[Column, ...]
    memory_limit: float | None = None
    plan: Plan | None = None  # the shardsolve Plan, when planning succeeded
    annotations: str = ""  # what was pinned, for reports
    in_pins: tuple = ()  # Sharding or None per flattened argument (when the plan's trace is known)
    out_pins: tuple = ()  # ... per flattened output

    def __getitem__(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"no column {name!r}; columns are {[c.name for c in self.columns]}")

    def __contains__(self, name: object) -> bool:
        return any(c.name == name for c in self.columns)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def best_propagation(self) -> Column | None:
        """The faster of the GSPMD and Shardy columns that compiled (fitting the limit first)."""
        cands = [self[n] for n in PROPAGATION if n in self and self[n].ok]
        if not cands:
            return None
        return min(cands, key=lambda c: (c.fits is False, c.total))

    def speedup(self, name: str, baseline: str) -> float:
        """``baseline.total / name.total``: above 1 means ``name`` is faster (nan if either failed)."""
        a, b = self[name], self[baseline]
        if not (a.ok and b.ok) or a.total <= 0:
            return math.nan
        return b.total / a.total

    def to_json(self) -> dict:
        return {
            "mesh": str(self.mesh),
            "memory_limit": self.memory_limit,
            "annotations": self.annotations,
            "columns": [c.to_json() for c in self.columns],
        }


# -- judging one compiled program ---------------------------------------------------


def one_line(e: BaseException) -> str:
    """``"IndivisibleError: Sharding ... should evenly divide the shape"``: the first meaningful line."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    # XLA errors often start with a status code line ("INTERNAL: ..."); keep it, it says what failed.
    if len(first) > 400:
        first = first[:397] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _cost_dict(compiled) -> dict:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older JAX: one dict per program
        ca = ca[0] if ca else {}
    return dict(ca or {})


def judge(
    name: str,
    compiled,
    mesh: MeshSpec,
    memory_limit: float | None = None,
    *,
    label: str | None = None,
    compile_time: float = 0.0,
) -> Column:
    """Read one compiled program and price it with the one cost model."""
    costs = _cost_dict(compiled)
    text = compiled.as_text()
    loop_flops, loop_bytes = loop_adjustment(text)
    flops = float(costs.get("flops", 0.0)) + loop_flops
    nbytes = float(costs.get("bytes accessed", 0.0)) + loop_bytes
    memory = compiled_memory(compiled)
    collectives = tuple(c for c in collectives_from_hlo(text, mesh) if c.axes)
    fits = None if memory_limit is None else memory.peak <= memory_limit
    return Column(
        name=name,
        label=label or LABELS.get(name, name),
        flops=flops,
        bytes_accessed=nbytes,
        compute=compute_time(flops, nbytes, mesh),
        communication=communication_time(collectives, mesh),
        memory=memory,
        fits=fits,
        collectives=collectives,
        compile_time=compile_time,
        in_specs=_specs(getattr(compiled, "input_shardings", None)),
        out_specs=_specs(getattr(compiled, "output_shardings", None)),
        hlo=text,
    )


def _specs(shardings) -> tuple[str, ...]:
    if shardings is None:
        return ()
    try:
        leaves = jax.tree_util.tree_leaves(shardings)
    except Exception:  # noqa: BLE001 - informational only
        return ()
    return tuple(str(getattr(s, "spec", s)) for s in leaves)


def failed(name: str, reason: str, *, label: str | None = None) -> Column:
    return Column(name=name, label=label or LABELS.get(name, name), error=reason)


# -- GSPMD, quietly -------------------------------------------------------------------


@contextlib.contextmanager
def _filtered_stderr(pattern: re.Pattern) -> Iterator[None]:
    """Route file descriptor 2 through a file for the block, then replay all but ``pattern``'s lines.

    XLA's C++ logging writes straight to descriptor 2, so ``sys.stderr`` alone cannot hold it back.
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        fd = 2
    try:
        sys.stderr.flush()
    except (AttributeError, ValueError):
        pass
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (AttributeError, ValueError):
                pass
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True) if not pattern.search(ln)]
            if kept:
                os.write(fd, "".join(kept).encode())


@contextlib.contextmanager
def gspmd_propagation() -> Iterator[None]:
    """Select GSPMD propagation for the block (restored afterwards, even on error), without its warning."""
    old = jax.config.jax_use_shardy_partitioner
    with _filtered_stderr(_GSPMD_WARNING), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        jax.config.update("jax_use_shardy_partitioner", False)
        try:
            yield
        finally:
            jax.config.update("jax_use_shardy_partitioner", old)


# -- annotations to jax.jit ------------------------------------------------------------


def _to_named(ann: Any, jmesh, ndim: int) -> Any:
    """PartitionSpec / NamedSharding / shardsolve Sharding / None -> what ``jax.jit`` takes (None stays None)."""
    if ann is None:
        return None
    if isinstance(ann, NamedSharding):
        return NamedSharding(jmesh, ann.spec)
    if isinstance(ann, Sharding):
        return NamedSharding(jmesh, ann.to_spec())
    if isinstance(ann, PartitionSpec):
        return NamedSharding(jmesh, ann)
    raise ShardsolveError(f"annotation {ann!r} is not a PartitionSpec, NamedSharding or None")


def _evened(ann: Any, shape: tuple[int, ...], mesh: MeshSpec) -> Any:
    """``ann`` with the dimensions it splits unevenly unsplit (``Sharding.evened``): the layout ``jax.jit``
    accepts at its boundary; ``ann`` itself where it splits none (or is not a spec this can read)."""
    spec = ann.spec if isinstance(ann, NamedSharding) else ann
    if isinstance(spec, Sharding):
        sharding = spec
    elif isinstance(spec, PartitionSpec):
        try:
            sharding = Sharding.from_spec(spec, len(shape), mesh)
        except ShardsolveError:
            return ann  # jax.jit names what is wrong with it
    else:
        return ann
    if sharding.partial or not sharding.uneven_dims(shape, mesh):
        return ann
    return sharding.evened(shape, mesh).to_spec()


def jit_with(fun: Callable, args: Sequence[Any], jmesh, in_shardings: Any, out_shardings: Any,
             even: MeshSpec | None = None, evened: list[str] | None = None):
    """``jax.jit(fun)`` with the annotations as ``NamedSharding`` pytrees (None leaves left to propagation).

    ``fun`` runs with the mesh as JAX's context mesh (``trace.in_mesh``; the same program where it needs
    none): a ``with_sharding_constraint(x, PartitionSpec(...))`` inside it holds for propagation as for the
    planner. With ``even`` (the mesh), an annotation that splits a dimension its parts do not divide, which
    ``jax.jit`` refuses, is given evened (``Sharding.evened``: that dimension unsplit), as ``plan.jit()``
    takes the plan's; the names of the leaves evened (``args[0]``, ``outputs[1]``) are added to ``evened``.
    """
    def leaf(ann: Any, x: Any, name: str) -> Any:
        if even is not None:
            given = _evened(ann, tuple(x.shape), even)
            if given is not ann and evened is not None:
                evened.append(name)
            ann = given
        return _to_named(ann, jmesh, len(x.shape))

    inner = fun

    def fun(*a):
        with in_mesh(jmesh):
            return inner(*a)

    abstract = tuple(jax.tree.map(abstractify, a) for a in args)
    in_tree = jax.tree_util.tree_structure(abstract)
    kwargs: dict[str, Any] = {}
    if in_shardings is not None:
        flat = broadcast_annotations(in_shardings, in_tree, "in_shardings")
        leaves = jax.tree_util.tree_leaves(abstract)
        names = leaf_names(in_tree, "args")
        kwargs["in_shardings"] = jax.tree_util.tree_unflatten(
            in_tree, [leaf(a, x, n) for a, x, n in zip(flat, leaves, names)]
        )
    if out_shardings is not None:
        out_abstract = jax.eval_shape(fun, *abstract)
        out_tree = jax.tree_util.tree_structure(out_abstract)
        flat = broadcast_annotations(out_shardings, out_tree, "out_shardings")
        out_leaves = jax.tree_util.tree_leaves(out_abstract)
        names = leaf_names(out_tree, "outputs")
        kwargs["out_shardings"] = jax.tree_util.tree_unflatten(
            out_tree, [leaf(a, x, n) for a, x, n in zip(flat, out_leaves, names)]
        )
    return jax.jit(fun, **kwargs), abstract


# -- compare ---------------------------------------------------------------------------


def compile_column(
    name: str,
    build: Callable[[], Any],
    mesh: MeshSpec,
    memory_limit: float | None,
    *,
    gspmd: bool = False,
    label: str | None = None,
) -> Column:
    """Compile ``build()`` (a jitted function and its arguments) and judge it; any failure lands in the column."""
    ctx = gspmd_propagation() if gspmd else shardy_propagation()
    t0 = time.perf_counter()
    try:
        with ctx:
            jitted, args = build()
            compiled = jitted.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a baseline's failure is a result, reported in its column
        return failed(name, one_line(e), label=label)
    elapsed = time.perf_counter() - t0
    try:
        return judge(name, compiled, mesh, memory_limit, label=label, compile_time=elapsed)
    except Exception as e:  # noqa: BLE001
        return failed(name, f"reading the compiled program failed: {one_line(e)}", label=label)


def compare(
    fun: Callable,
    *args: Any,
    mesh: Any,
    in_shardings: Any = None,
    out_shardings: Any = None,
    memory_limit: Any = None,
    time_limit: float | None = None,
    expert_in_shardings: Any = None,
    expert_out_shardings: Any = None,
    progress: Callable[[str], None] | None = None,
    columns: Sequence[str] = COLUMNS,
    plan: Plan | None = None,
    seed: int = 0,
    source: str = "",
    carry: Sequence[tuple[int, int]] = (),
) -> Comparison:
    """Compile ``fun(*args)`` with GSPMD, Shardy and shardsolve's plan from the same annotations, and judge all alike.

    ``expert_in_shardings`` (and ``expert_out_shardings``) add an ``expert``
    column: ``jax.jit`` with that annotation under Shardy, and the planner takes
    ``expert_in_shardings`` as ``hints`` (its plan is then never slower in the
    model than the best plan with the expert's argument shardings). ``plan`` reuses an
    already made plan instead of planning again. ``memory_limit`` is passed to
    the planner and sets each column's ``fits``; ``source`` is recorded in the
    plan (``Plan.source``); ``carry`` goes to the planner (``shardsolve.plan``).
    A pin that splits a dimension unevenly, which ``jax.jit`` refuses, is given
    to GSPMD, Shardy and the expert evened (that dimension unsplit, as
    ``plan.jit()`` takes the plan's), and their label says ``(evened)``.
    See the module docstring.
    """
    say = progress or (lambda message: None)
    spec = as_mesh_spec(mesh)
    limit = parse_memory_limit(memory_limit)
    jmesh = concrete_mesh(mesh, spec)
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise ShardsolveError(f"unknown comparison columns {unknown}; choose from {list(COLUMNS)}")

    def baseline(name: str, ins: Any, outs: Any, gspmd: bool = False) -> Column:
        label = LABELS[name]
        evened: list[str] = []
        col = compile_column(name, lambda: jit_with(fun, args, jmesh, ins, outs, even=spec, evened=evened), spec,
                             limit, gspmd=gspmd, label=label)
        if evened:  # as plan.jit() takes them: JAX lays out no uneven split at its boundary
            say(f"{label}: {', '.join(evened)} split unevenly, given to jax.jit evened (those dimensions unsplit)")
            col = dataclasses.replace(col, label=f"{label} (evened)")
        return col

    out: list[Column] = []
    for name in columns:
        if name == "gspmd":
            say("compiling with GSPMD propagation")
            out.append(baseline("gspmd", in_shardings, out_shardings, gspmd=True))
        elif name == "shardy":
            say("compiling with Shardy propagation")
            out.append(baseline("shardy", in_shardings, out_shardings))
        elif name == "expert":
            if expert_in_shardings is None and expert_out_shardings is None:
                continue
            say("compiling the expert annotation")
            out.append(baseline("expert", expert_in_shardings, expert_out_shardings))
        elif name == "shardsolve":
            if plan is None:
                say("planning with shardsolve")
                try:
                    plan = make_plan(
                        fun, *args, mesh=spec, in_shardings=in_shardings, out_shardings=out_shardings,
                        memory_limit=limit, time_limit=time_limit, seed=seed, source=source, carry=carry,
                        hints=expert_in_shardings,
                        progress=(lambda m: say(f"planning: {m}")) if progress else None,
                    )
                except ShardsolveError as e:
                    out.append(failed("shardsolve", str(e).splitlines()[0] if str(e) else type(e).__name__))
                    plan = None
                    continue
                except Exception as e:  # noqa: BLE001 - JAX may reject the program while tracing
                    out.append(failed("shardsolve", one_line(e)))
                    plan = None
                    continue
            say("compiling shardsolve's plan")
            bound = plan

            def build_plan() -> Any:
                jitted = bound.jit()
                return jitted.flat, tuple(jitted.flatten(jax.tree.map(abstractify, args)))  # typed keys as data

            out.append(compile_column("shardsolve", build_plan, spec, limit))
    say("done")
    in_pins, out_pins = _pins(plan, spec, in_shardings, out_shardings)
    return Comparison(spec, tuple(out), limit, plan, _describe(in_shardings), in_pins, out_pins)


def _pins(plan: Plan | None, spec: MeshSpec, in_shardings: Any, out_shardings: Any) -> tuple[tuple, tuple]:
    """The annotations as one ``Sharding`` (or None) per flattened argument and output of the plan's trace."""
    if plan is None or plan.graph is None or plan.graph.traced is None:
        return (), ()
    traced = plan.graph.traced
    try:
        in_pins = tuple(s for s, _ in argument_pins(traced, in_shardings, spec))
        out_pins = tuple(s for s, _ in output_pins(traced, out_shardings, spec))
    except ShardsolveError:
        return (), ()
    return in_pins, out_pins


def _describe(ann: Any) -> str:
    if ann is None:
        return "none"
    leaves = jax.tree_util.tree_leaves(ann, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
    pinned = [x for x in leaves if x is not None]
    return f"{len(pinned)} of {len(leaves)} annotation leaves pinned"
