"""Why each collective is there: one line per collective, for plans and for GSPMD/Shardy.

For a plan, every ``PredictedCollective`` already names its value, the
shardings it sits between and the consumer that demanded the second one::

    >>> for e in explain(plan):                                           # doctest: +SKIP
    ...     print(e.line())
    all-gather{model} 16.00 KiB 0.36 us: %2 add [{model}, {data}] -> [{}, {data}], demanded by %3 integer_pow

For a compiled baseline (a ``compare.Column``) the collectives come from the
optimized HLO, which keeps only each instruction's ``op_name`` metadata (the
JAX name stack plus primitive, e.g. ``jit(step)/transpose(jvp())/dot_general``)
and its source line. ``explain_column`` matches those to the operations of the
plan's traced program (same primitive and source line, then name stack), names
the operand or result the collective moves from its per-device shapes, and says
what the plan does at the same operation (``avoided by shardsolve`` when the
plan has no collective there).

``explain_conflicts`` looks at annotations that cannot all hold without
communication (two operands of one op pinned incompatibly, an output pinned
against its producer): the collective the plan chose for each, beside the ones
GSPMD and Shardy inserted at the same operation, with both costs.

Shardings of a baseline are printed per device as ``[8/2, 16, 64]`` (dimension
0 of size 8 split in 2), since the optimized HLO no longer records them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from shardsolve.cost import hlo_collective_time
from shardsolve.hlo import collective_operand_shapes, strip_layouts, tuple_components
from shardsolve.mesh import MeshSpec
from shardsolve.units import format_bytes


@dataclass(frozen=True, slots=True)
class Explanation:
    """One collective, and why it is there."""

    program: str  # "shardsolve", "gspmd", "shardy", "expert"
    kind: str
    axes: tuple[str, ...]
    bytes: int
    time: float  # seconds, the one cost model
    value: str  # the value moved, e.g. "%12" or "args[0]['w1']"
    src: str  # its sharding before
    dst: str  # ... and after
    consumer: str  # the operation (or output) that demanded ``dst``
    producer: str = ""
    where: str = ""  # source "file:line" when known
    note: str = ""  # e.g. "avoided by shardsolve" or what the plan does instead

    def line(self) -> str:
        axes = ",".join(self.axes)
        head = f"{self.kind}{{{axes}}} {format_bytes(self.bytes)} {self.time * 1e6:.2f} us"
        what = f"{self.value} {self.src} -> {self.dst}" if self.src or self.dst else self.value
        text = f"{head}: {what}, demanded by {self.consumer}"
        if self.where:
            text += f" ({self.where})"
        if self.note:
            text += f"; {self.note}"
        return text

    def to_json(self) -> dict:
        return {
            "program": self.program, "kind": self.kind, "axes": list(self.axes), "bytes": self.bytes,
            "time": self.time, "value": self.value, "src": self.src, "dst": self.dst, "consumer": self.consumer,
            "producer": self.producer, "where": self.where, "note": self.note,
        }  # fmt: skip


# -- plans ----------------------------------------------------------------------------


def explain(plan, *, program: str = "shardsolve") -> list[Explanation]:
    """One line per predicted collective of ``plan``, in program order."""
    out = []
    for c in plan.collectives:
        out.append(
            Explanation(
                program, c.kind, tuple(c.axes), int(c.bytes), float(c.time), c.value_name, str(c.src), str(c.dst),
                c.consumer, c.producer,
                note="" if c.dst == c.target else f"on the way to {c.target}",
            )
        )
    return out


# -- baselines ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OpKey:
    primitive: str
    stack: str  # name stack without the outer jit(...)
    where: str  # "file:line"


def _op_keys(graph) -> dict[int, _OpKey]:
    """Primitive, name stack and user source line of every op of the traced program."""
    return {op.id: _OpKey(op.primitive, _normal_stack(op.source), op.where()) for op in graph.ops}


def _normal_stack(stack: str) -> str:
    # Drop ``jit(...)`` wrappers, which inlining may or may not keep.
    stack = re.sub(r"jit\(([^()]*)\)", "", stack)
    stack = re.sub(r"\(\)", "()", stack)
    return stack.strip("/")


def split_op_name(op_name: str) -> list[tuple[str, str]]:
    """``jit(f)/(a/dot_general:b/reduce_sum)`` -> ``[("a", "dot_general"), ("b", "reduce_sum")]``."""
    text = op_name
    m = re.match(r"^jit\([^()]*\)/", text)
    if m:
        text = text[m.end():]
    parts: list[str]
    if text.startswith("(") and text.endswith(")"):
        parts = _split_colons(text[1:-1])
    else:
        parts = [text]
    out = []
    for p in parts:
        stack, _, prim = p.rpartition("/")
        out.append((_normal_stack(stack), prim))
    return out


def _split_colons(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == ":" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in parts if p]


def match_ops(collective, keys: dict[int, _OpKey]) -> list[int]:
    """Ops of the traced program that an HLO collective's metadata points at (best first)."""
    wanted = split_op_name(collective.op_name or "")
    where = collective.source or ""
    found: list[int] = []
    for stack, prim in wanted:
        by_prim = [k for k, key in keys.items() if key.primitive == prim]
        exact = [k for k in by_prim if key_eq(keys[k], stack, where)]
        near = [k for k in by_prim if where and keys[k].where == where]
        named = [k for k in by_prim if keys[k].stack == stack]
        for group in (exact, near, named):
            if group:
                found.extend(k for k in group if k not in found)
                break
    return found


def key_eq(key: _OpKey, stack: str, where: str) -> bool:
    return key.stack == stack and (not where or key.where == where)


def _dims(shape: str) -> tuple[int, ...] | None:
    m = re.match(r"\s*[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    if not m:
        return None
    body = m.group(1).strip()
    return tuple(int(d.strip().lstrip("<=")) for d in body.split(",")) if body else ()


def _compact(shapes: Sequence[str]) -> str:
    """Printed HLO shapes without layouts; repeated tuple members counted (``4 x f32[32,1,64]``)."""
    parts: list[str] = []
    for s in shapes:
        parts.extend(strip_layouts(p) for p in tuple_components(s))
    counts = Counter(parts)
    return ", ".join(p if n == 1 else f"{n} x {p}" for p, n in counts.items())


def tiles(global_shape: Sequence[int], local: Sequence[int]) -> str:
    """``[8/2, 16, 64]``: each dimension with the number of pieces it is cut into."""
    parts = []
    for g, n in zip(global_shape, local):
        parts.append(str(g) if n == g or n == 0 else f"{g}/{max(1, round(g / n))}")
    return "[" + ", ".join(parts) + "]"


def _compatible(global_shape: Sequence[int], local: Sequence[int] | None) -> bool:
    return local is not None and len(global_shape) == len(local) and all(
        n > 0 and g % n == 0 for g, n in zip(global_shape, local)
    ) or (local is not None and len(local) == 0 and len(global_shape) == 0)


def _operand_shapes(column) -> dict[str, list[str]]:
    """HLO instruction name -> printed shapes of its operands, for the collectives of ``column``'s HLO."""
    text = getattr(column, "hlo", "") or ""
    return collective_operand_shapes(text) if text else {}


def explain_column(column, plan=None, mesh: MeshSpec | None = None) -> list[Explanation]:
    """One line per collective of a compiled baseline; with ``plan``, matched to its ops and predictions."""
    return [e for _, e, _ in _explain_pairs(column, plan, mesh)]


def _explain_pairs(column, plan=None, mesh: MeshSpec | None = None) -> list[tuple[Any, Explanation, list[int]]]:
    """(HLO collective, its explanation, the traced ops it was matched to) for each collective of ``column``."""
    mesh = mesh or (plan.mesh if plan is not None else None)
    graph = getattr(plan, "graph", None) if plan is not None else None
    keys = _op_keys(graph) if graph is not None else {}
    operand_shapes = _operand_shapes(column)
    plan_at = _plan_collectives_by_op(plan) if plan is not None else {}
    out = []
    used: set[int] = set()
    for c in column.collectives:
        time = hlo_collective_time(c, mesh) if mesh is not None else 0.0
        ops = match_ops(c, keys) if keys else []
        in_shapes = [s for s in operand_shapes.get(c.name, []) if s]
        ops = _by_shape(ops, c, graph, in_shapes, used)
        value, src, dst, consumer, producer = _describe_move(c, ops, graph, in_shapes)
        where = c.source.rsplit("/", 1)[-1] if c.source else ""
        note = ""
        if plan is not None and ops:
            mine = [p for k in ops for p in plan_at.get(k, [])]
            if not mine:
                note = f"avoided by shardsolve (no collective at {_short(graph.ops[ops[0]].name())})"
            else:
                same = [p for p in mine if p.kind == c.kind and tuple(p.axes) == tuple(c.axes)]
                if not same:
                    p = mine[0]
                    note = f"shardsolve does {p.kind}{{{','.join(p.axes)}}} of {p.value_name} there instead"
                else:
                    note = "shardsolve has it too"
        exp = Explanation(column.name, c.kind, tuple(c.axes), int(c.bytes), time, value, src, dst, consumer,
                          producer, where, note)
        out.append((c, exp, ops))
    return out


def _by_shape(ops: list[int], c, graph, in_shapes: list[str], used: set[int]) -> list[int]:
    """Keep the candidate ops whose values the collective's per-device shapes tile; unused ones first.

    One source line (a layer in a Python loop) often holds several ops of the
    same primitive; the shapes and the order of the HLO tell them apart.
    """
    if graph is None or len(ops) <= 1 or c.shape.startswith("("):
        used.update(ops[:1])
        return ops
    out_dims = _dims(c.shape)
    in_dims = _dims(in_shapes[0]) if len(in_shapes) == 1 else None

    def fits(k: int) -> bool:
        op = graph.ops[k]
        vals = [graph.values[x] for x in op.inputs if isinstance(x, int)] + [graph.values[v] for v in op.outputs]
        return any(_compatible(v.shape, out_dims) and (in_dims is None or _compatible(v.shape, in_dims)) for v in vals)

    fitting = [k for k in ops if fits(k)] or ops
    fitting.sort(key=lambda k: k in used)
    used.add(fitting[0])
    return fitting


def _short(name: str) -> str:
    return name.split(" [", 1)[0]


def _plan_collectives_by_op(plan) -> dict[int, list]:
    """Op id -> the plan's collectives demanded by it (or reducing its partial result)."""
    out: dict[int, list] = {}
    for p in plan.collectives:
        for who in (p.consumer, p.producer):
            m = re.match(r"%(\d+)(?:\.\d+)? ", who + " ")
            if m:
                out.setdefault(int(m.group(1)), []).append(p)
    return out


def _describe_move(c, ops: list[int], graph, in_shapes: list[str]) -> tuple[str, str, str, str, str]:
    """(value, src, dst, consumer, producer) of one HLO collective, as well as the metadata allows."""
    out_dims = _dims(c.shape) if not c.shape.startswith("(") else None
    in_dims = _dims(in_shapes[0]) if len(in_shapes) == 1 else None
    meta = c.op_name.split("/", 1)[-1] if c.op_name else "(no metadata)"
    if len(split_op_name(c.op_name or "")) > 1:
        n = len(split_op_name(c.op_name))
        kinds = sorted({p for _, p in split_op_name(c.op_name)})
        axes = ",".join(c.axes)
        if c.kind == "all-reduce":
            return (f"{n} values combined ({', '.join(kinds)})", f"partial{{{axes}}}", "summed", f"{n} ops", "")
        return (f"{n} values combined ({', '.join(kinds)})", "", "", f"{n} ops", "")
    if graph is None or not ops:
        src = f"per device {_compact(in_shapes)}" if in_shapes else ""
        dst = _compact([c.shape])
        if not c.op_name:
            return ("an argument or output (no op metadata)", src, dst, "the program boundary", "")
        return (f"a value at {meta}", src, dst, meta, "")
    op = graph.ops[ops[0]]
    values = graph.values
    if c.kind in ("all-reduce", "reduce-scatter") and op.outputs:
        # A pending reduction: the op's result was a partial sum over the axes.
        v = values[op.outputs[0]]
        src_local = in_dims if in_dims is not None else out_dims
        src = tiles(v.shape, src_local) + f" partial{{{','.join(c.axes)}}}" if src_local else f"partial{{{','.join(c.axes)}}}"
        dst = tiles(v.shape, out_dims) if out_dims is not None else "reduced"
        consumers = graph.consumers.get(v.id, [])
        consumer = _short(graph.ops[consumers[0][0]].name()) if consumers else "the outputs"
        return (v.name, src, dst, consumer, _short(op.name()))
    # A moved operand: the one whose global shape the collective's shapes tile.
    best = None
    for x in op.inputs:
        if isinstance(x, int) and _compatible(values[x].shape, out_dims) and (in_dims is None or _compatible(values[x].shape, in_dims)):
            best = values[x]
            break
    if best is None and op.outputs and _compatible(values[op.outputs[0]].shape, out_dims):
        best = values[op.outputs[0]]
    if best is None:
        return (f"an operand of {_short(op.name())}", f"per device {_compact(in_shapes)}" if in_shapes else "",
                _compact([c.shape]), _short(op.name()), "")
    producer = _short(graph.ops[best.producer].name()) if best.producer is not None else best.name
    src = tiles(best.shape, in_dims) if in_dims is not None else ""
    dst = tiles(best.shape, out_dims) if out_dims is not None else ""
    return (best.name, src, dst, _short(op.name()), producer)


# -- conflicts ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Conflict:
    """Annotations that cannot all hold without communication, and how each program paid for them."""

    what: str  # e.g. "%3 dot_general: args[0] pinned [{data}, {}] against args[1] pinned [{}, {data}]"
    shardsolve: tuple[Explanation, ...]
    baselines: tuple[tuple[str, tuple[Explanation, ...]], ...]  # (program, its collectives at the same op)

    def lines(self) -> list[str]:
        out = [f"conflict: {self.what}"]
        t = sum(e.time for e in self.shardsolve)
        out.append(f"  shardsolve chose ({t * 1e6:.2f} us):" + ("" if self.shardsolve else " no collective"))
        out += [f"    {e.line()}" for e in self.shardsolve]
        for program, exps in self.baselines:
            t = sum(e.time for e in exps)
            out.append(f"  {program} inserted ({t * 1e6:.2f} us):" + ("" if exps else " no collective there"))
            out += [f"    {e.line()}" for e in exps]
        return out


def explain_conflicts(cmp) -> list[Conflict]:
    """Pinned operands that disagree at one op, and pinned outputs that disagree with their producer.

    Needs the comparison's plan (bound to its traced program) and the pins
    ``compare`` recorded (``cmp.in_pins`` / ``cmp.out_pins``, one per flattened leaf).
    """
    plan = cmp.plan
    if plan is None or plan.graph is None:
        return []
    graph = plan.graph
    pinned_in = {graph.inputs[k]: s for k, s in enumerate(cmp.in_pins) if s is not None}
    baselines = {c.name: _explain_pairs(c, plan) for c in cmp.columns if c.ok and c.name in ("gspmd", "shardy")}
    conflicts: list[Conflict] = []
    # (1) two pinned operands of one op that the op cannot use as they are.
    for op in graph.ops:
        pinned = [x for x in op.inputs if isinstance(x, int) and x in pinned_in]
        if len(set(pinned)) < 2:
            continue
        mine = [p for p in plan.collectives if p.consumer.startswith(f"%{op.id} ") and p.value in pinned_in]
        if not mine:
            continue
        desc = " against ".join(f"{graph.values[x].name} pinned {pinned_in[x]}" for x in dict.fromkeys(pinned))
        conflicts.append(_conflict(f"{_short(op.name())}: {desc}", mine, {op.id}, baselines))
    # (2) an output pinned against what its producer makes.
    for k, sharding in enumerate(cmp.out_pins):
        if sharding is None or k >= len(graph.outputs) or not isinstance(graph.outputs[k], int):
            continue
        mine = [p for p in plan.collectives if p.consumer == f"outputs[{k}]"]
        if not mine:
            continue
        producer = graph.values[graph.outputs[k]].producer
        what = f"outputs[{k}] pinned {sharding} against its producer"
        ops: set[int] = set()
        if producer is not None:
            what += f" {_short(graph.ops[producer].name())}"
            ops = {producer} | {c for c, _ in graph.consumers.get(graph.outputs[k], [])}
        conflicts.append(_conflict(what, mine, ops, baselines, boundary=True))
    return conflicts


def _conflict(what: str, mine: Iterable, op_ids: set[int], baselines, boundary: bool = False) -> Conflict:
    ours = tuple(
        Explanation("shardsolve", p.kind, tuple(p.axes), int(p.bytes), float(p.time), p.value_name, str(p.src),
                    str(p.dst), p.consumer, p.producer)
        for p in mine
    )
    theirs = []
    for program, pairs in baselines.items():
        at = tuple(e for c, e, ops in pairs if (set(ops) & op_ids) or (boundary and not c.op_name))
        theirs.append((program, at))
    return Conflict(what, ours, tuple(theirs))
