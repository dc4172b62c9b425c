"""Collectives of a compiled program, read from its optimized HLO text.

``collectives_from_hlo`` finds every all-gather, all-reduce, reduce-scatter,
all-to-all and collective-permute (and their asynchronous ``-start`` forms) in
``jitted.lower(*args).compile().as_text()``, maps each one's replica groups
back to mesh axes, and counts its bytes per device with the convention of
``cost.ReshardStep.bytes``: the larger of the input and output buffers, tuple
shapes summed (XLA combines many all-reduces into one tuple-shaped one).

    >>> from shardsolve.mesh import MeshSpec
    >>> mesh = MeshSpec.parse("data=2,model=4")
    >>> text = '''
    ... ENTRY %main (p: f32[4,8]) -> f32[4,8] {
    ...   %p = f32[4,8]{1,0} parameter(0)
    ...   ROOT %ar = f32[4,8]{1,0} all-reduce(%p), replica_groups=[2,4]<=[8], metadata={op_name="jit(f)/psum"}
    ... }'''
    >>> [(c.kind, c.axes, c.bytes, c.op_name) for c in collectives_from_hlo(text, mesh)]
    [('all-reduce', ('model',), 128, 'jit(f)/psum')]

Replica groups come in three printed forms, all handled: explicit lists
(``{{0,1,2,3},{4,5,6,7}}``), iota lists (``[2,4]<=[8]``,
``[4,2]<=[2,4]T(1,0)``) and mesh-axes lists
(``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, optionally with
``device_ids=(...)`` and sub-axes ``'a':(1)2``). Ids are positions in
``mesh.devices.flat`` of the ``jax.sharding.Mesh`` built by
``MeshSpec.jax_mesh()``. A group that spans whole mesh axes is named by them
(in mesh order; ``group_order`` keeps the order the devices are listed in); a
group that spans part of an axis is named Shardy-style, ``"model:(1)2"``;
anything else keeps ``"?"`` and the printed groups.

Compare inventories by bytes per (kind, axes), never by count: XLA combines
and splits collectives.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from shardsolve.mesh import MeshSpec

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_ITEMSIZE = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}


@dataclass(frozen=True, slots=True)
class HloCollective:
    """One collective instruction of an optimized HLO module."""

    kind: str  # one of KINDS (an async -start is folded into its kind; see is_async)
    axes: tuple[str, ...]  # mesh axes its groups span, in mesh order
    bytes: int  # per device: the larger of the input and output buffers, tuples summed
    shape: str  # the printed result shape
    op_name: str  # metadata op_name: the JAX name stack of the source operation(s)
    source: str  # "file:line" of the source, when the module records it
    name: str = ""  # the HLO instruction name, e.g. "all-reduce.3"
    group_order: tuple[str, ...] = ()  # the axes in the order the groups list devices (major first)
    groups: str = ""  # the replica groups as printed
    is_async: bool = False
    # Runs per step: inside a while body, the loop's known trip count (times enclosing loops').
    # ``bytes`` is one run's, as inventories compare them; time is priced per run, times ``repeats``.
    repeats: int = 1

    def __str__(self) -> str:
        return f"{self.kind}{{{','.join(self.axes)}}} {self.bytes} B {self.shape} [{self.op_name}]"


# -- shapes --------------------------------------------------------------------------

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of a printed HLO shape; tuples are summed (``(f32[2], bf16[4,4])`` -> 40)."""
    total = 0
    for m in _ARRAY.finditer(strip_layouts(shape)):
        dtype, dims = m.group(1), m.group(2)
        size = _itemsize(dtype)
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                n *= int(d)
        total += n * size
    return total


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1
    m = re.fullmatch(r"[a-z]+(\d+)", dtype)
    return max(1, int(m.group(1)) // 8) if m else 0


def strip_layouts(shape: str) -> str:
    # Layouts ({1,0}, {1,0:T(8,128)S(1)}) hold no sizes; drop them so their digits are not read.
    out, depth = [], 0
    for ch in shape:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def tuple_components(shape: str) -> list[str]:
    """The top-level elements of a tuple shape, or [shape] for an array."""
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    inner = s[1:-1]
    return [p.strip() for p in _split_top(inner) if p.strip()]


def _split_top(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


# -- instructions ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    """One instruction of printed HLO: ``%name = shape opcode(operands), attrs``."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def parse_instruction(line: str) -> Instruction | None:
    """The instruction printed on ``line``, or None for anything else (headers, braces, comments)."""
    m = _HEAD.match(line)
    if not m:
        return None
    rest = line[m.end():]
    shape, rest = _take_shape(rest)
    if shape is None:
        return None
    m2 = re.match(r"\s*([\w\-]+)\(", rest)
    if not m2:
        return None
    opcode = m2.group(1)
    body, attrs = _take_parens(rest[m2.end() - 1:])
    operands = []
    for part in _split_top(body):
        part = part.strip()
        if not part:
            continue
        names = re.findall(r"%([\w.\-]+)", part)
        operands.append(names[-1] if names else part.split()[-1])
    return Instruction(m.group(1), shape, opcode, tuple(operands), attrs)


def _take_shape(text: str) -> tuple[str | None, str]:
    text = text.lstrip()
    if text.startswith("("):
        body, rest = _take_parens(text)
        return "(" + body + ")", rest
    m = re.match(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?", text)
    if not m:
        return None, text
    return m.group(0), text[m.end():]


def _take_parens(text: str) -> tuple[str, str]:
    """``"(a, (b)) rest"`` -> ``("a, (b)", " rest")``."""
    assert text.startswith("(")
    depth = 0
    for k, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return text[1:k], text[k + 1:]
    return text[1:], ""


def _attr(attrs: str, key: str) -> str | None:
    """The value of ``key=...`` in an attribute list, braces/brackets balanced."""
    m = re.search(r"(?:^|[,\s])" + re.escape(key) + r"=", attrs)
    if not m:
        return None
    text = attrs[m.end():]
    depth = 0
    in_str = False
    for k, ch in enumerate(text):
        if ch == '"':
            in_str = not in_str
        if in_str:
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            return text[:k].strip()
    return text.strip()


def _replica_groups_text(attrs: str) -> str | None:
    """The replica_groups attribute; the mesh form has a space before its axis set."""
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return None
    text = attrs[m.end():]
    if text.startswith("mesh["):
        # mesh[...](, device_ids=(...))? {axes}
        end = text.index("]") + 1
        rest = text[end:]
        dev = re.match(r",\s*device_ids=\(", rest)
        if dev:
            body, rest2 = _take_parens(rest[dev.end() - 1:])
            end += len(rest) - len(rest2)
            rest = rest2
        ax = re.match(r"\s*\{[^}]*\}", rest)
        if ax:
            end += ax.end()
        return text[:end]
    return _attr(attrs, "replica_groups")


# -- replica groups ------------------------------------------------------------------


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape), dtype=np.int64).reshape(tuple(reshape))
    if perm is not None:
        arr = arr.transpose(tuple(perm))
    return arr.reshape(-1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """Device lists of a printed ``replica_groups`` value (explicit, iota or mesh-axes form)."""
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_groups(text)
    m = re.fullmatch(r"\[([\d,\s]*)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?", text)
    if m:
        group_shape = _ints(m.group(1))
        flat = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        rows = flat.reshape(group_shape[0], -1) if len(group_shape) > 1 else flat.reshape(1, -1)
        return [list(map(int, r)) for r in rows]
    if text.startswith("{"):
        inner = text[1:-1].strip()
        groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
        groups = [g for g in groups if g]
        if not groups:  # {} = one group of every device
            return [list(range(num_devices))]
        return groups
    raise ValueError(f"cannot read replica groups {text!r}")


def _mesh_groups(text: str) -> list[list[int]]:
    m = re.match(r"mesh\[([^\]]*)\]", text)
    assert m
    names, sizes = [], []
    for item in _split_top(m.group(1)):
        name, _, size = item.strip().rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    rest = text[m.end():]
    devices = np.arange(math.prod(sizes), dtype=np.int64)
    dev = re.match(r",\s*device_ids=\(", rest)
    if dev:
        body, rest = _take_parens(rest[dev.end() - 1:])
        body = body.strip()
        it = re.fullmatch(r"\[([\d,\s]*)\](?:<=\[([\d,\s]*)\])?(?:T\(([\d,\s]*)\))?", body)
        if it:
            reshape = _ints(it.group(2)) if it.group(2) else _ints(it.group(1))
            devices = _iota(reshape, _ints(it.group(3)) if it.group(3) else None)
        else:
            devices = np.array(_ints(body), dtype=np.int64)
    ax = re.search(r"\{([^}]*)\}", rest)
    refs = []  # (mesh dim, pre_size, size)
    for item in _split_top(ax.group(1) if ax else ""):
        item = item.strip()
        if not item:
            continue
        sub = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", item)
        if not sub:
            raise ValueError(f"cannot read mesh axis {item!r} in {text!r}")
        d = names.index(sub.group(1))
        if sub.group(2):
            refs.append((d, int(sub.group(2)), int(sub.group(3))))
        else:
            refs.append((d, 1, sizes[d]))
    coords = np.array(np.unravel_index(np.arange(devices.size), tuple(sizes))).T  # position -> coords
    groups: dict[tuple, list[tuple[tuple, int]]] = defaultdict(list)
    for pos, device in enumerate(devices):
        c = list(coords[pos])
        key = list(c)
        order = []
        for d, pre, size in refs:
            post = sizes[d] // (pre * size)
            sub_coord = (c[d] // post) % size
            order.append(sub_coord)
            key[d] -= sub_coord * post
        groups[tuple(key)].append((tuple(order), int(device)))
    return [[dev for _, dev in sorted(members)] for _, members in sorted(groups.items())]


@dataclass(frozen=True, slots=True)
class _Span:
    axes: tuple[str, ...]  # mesh order
    order: tuple[str, ...]  # listing order


def groups_to_axes(groups: Sequence[Sequence[int]], mesh: MeshSpec) -> _Span:
    """The mesh axes every group spans; ``("?",)`` when the groups are no product of (sub-)axes."""
    sizes = tuple(a.size for a in mesh.axes)
    n = mesh.size
    if not groups or any(not g for g in groups):
        return _Span(("?",), ("?",))
    if any(d < 0 or d >= n for g in groups for d in g):
        return _Span(("?",), ("?",))
    if all(len(g) == 1 for g in groups):
        return _Span((), ())
    first = [tuple(int(x) for x in np.unravel_index(d, sizes)) for d in groups[0]]
    names = mesh.names
    labels: dict[int, str] = {}
    for i in range(len(sizes)):
        values = sorted({c[i] for c in first})
        if len(values) <= 1:
            continue
        if len(values) == sizes[i]:
            labels[i] = names[i]
            continue
        stride = values[1] - values[0]
        if values != list(range(values[0], values[0] + stride * len(values), stride)) or values[0] >= stride:
            return _Span(("?",), ("?",))
        pre = sizes[i] // (len(values) * stride)
        labels[i] = f"{names[i]}:({pre}){len(values)}"
    varying = sorted(labels)
    if math.prod(len({c[i] for c in first}) for i in varying) != len(first):
        return _Span(("?",), ("?",))
    # Every group must be a translate of the first.
    shape = [len({c[i] for c in first}) for i in varying]
    for g in groups[1:]:
        if len(g) != len(first):
            return _Span(("?",), ("?",))
        cs = [tuple(int(x) for x in np.unravel_index(d, sizes)) for d in g]
        for i in range(len(sizes)):
            if i not in labels and len({c[i] for c in cs}) != 1:
                return _Span(("?",), ("?",))
        for i, k in zip(varying, shape):
            if len({c[i] for c in cs}) != k:
                return _Span(("?",), ("?",))
    canonical = tuple(labels[i] for i in varying)
    order = canonical
    for perm in itertools.permutations(varying):
        # The device order within group 0, enumerated row-major over perm.
        key = [tuple(c[i] for i in perm) for c in first]
        if key == sorted(key):
            order = tuple(labels[i] for i in perm)
            break
    return _Span(canonical, order)


# -- metadata ------------------------------------------------------------------------


def _stack_sources(text: str) -> dict[int, str]:
    """stack_frame_id -> "file:line" from the module's FileNames/FileLocations/StackFrames tables."""

    def table(title: str) -> dict[int, str]:
        m = re.search(r"^" + title + r"\n((?:\d+ .*\n?)*)", text, re.M)
        out = {}
        if m:
            for line in m.group(1).splitlines():
                k, _, v = line.partition(" ")
                out[int(k)] = v.strip()
        return out

    files = {k: v.strip('"') for k, v in table("FileNames").items()}
    locations = table("FileLocations")
    frames = table("StackFrames")
    out = {}
    for fid, body in frames.items():
        loc = re.search(r"file_location_id=(\d+)", body)
        if not loc or int(loc.group(1)) not in locations:
            continue
        lb = locations[int(loc.group(1))]
        f = re.search(r"file_name_id=(\d+)", lb)
        line = re.search(r"\bline=(\d+)", lb)
        if f and line:
            out[fid] = f"{files.get(int(f.group(1)), '?')}:{line.group(1)}"
    return out


def _metadata(attrs: str, sources: dict[int, str]) -> tuple[str, str]:
    m = re.search(r"metadata=\{(.*?)\}(?:,|$)", attrs)
    if not m:
        return "", ""
    body = m.group(1)
    op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', body)
    src = ""
    f = re.search(r'source_file="((?:[^"\\]|\\.)*)"', body)
    line = re.search(r"source_line=(\d+)", body)
    if f:
        src = f"{f.group(1)}:{line.group(1)}" if line else f.group(1)
    else:
        sf = re.search(r"stack_frame_id=(\d+)", body)
        if sf:
            src = sources.get(int(sf.group(1)), "")
    return (op.group(1) if op else ""), src


# -- the parser ----------------------------------------------------------------------


def collective_kind(opcode: str) -> tuple[str | None, bool]:
    """``("all-gather", True)`` for ``all-gather-start``; ``(None, False)`` for what is no collective."""
    for kind in KINDS:
        if opcode == kind:
            return kind, False
        if opcode == kind + "-start":
            return kind, True
    return None, False


def instructions(text: str) -> list[Instruction]:
    """Every instruction of an HLO module's text, in order (XLA prints one per line)."""
    return [ins for ins in map(parse_instruction, text.splitlines()) if ins is not None]


def collective_operand_shapes(text: str) -> dict[str, list[str]]:
    """Collective instruction name -> the printed shapes of its operands."""
    instrs = instructions(text)
    shape_of = {i.name: i.shape for i in instrs}
    return {i.name: [shape_of.get(o, "") for o in i.operands] for i in instrs if collective_kind(i.opcode)[0]}


def collectives_from_hlo(text: str, mesh: MeshSpec) -> list[HloCollective]:
    """Every collective of an optimized HLO module, in text order (see the module docstring).

    Each one's ``repeats`` says how often it runs per step (``computation_runs``).
    """
    comps, entry = computations(text)
    runs = _runs(comps, entry)
    where = {m.group(1): comp for comp, lines in comps.items() for m in map(_HEAD.match, lines) if m}
    instrs = instructions(text)
    shape_of = {i.name: i.shape for i in instrs}
    done_of: dict[str, str] = {}
    for i in instrs:
        if i.opcode.endswith("-done") and i.operands:
            done_of[i.operands[0]] = i.shape
    sources = _stack_sources(text)
    out: list[HloCollective] = []
    for ins in instrs:
        kind, is_async = collective_kind(ins.opcode)
        if kind is None:
            continue
        in_bytes = sum(shape_bytes(shape_of.get(o, "")) for o in ins.operands)
        if is_async:
            if ins.name in done_of:
                out_shape = done_of[ins.name]
            else:  # a start whose done we cannot see: its largest component
                out_shape = max(tuple_components(ins.shape), key=shape_bytes)
            if kind == "all-reduce" and ins.name not in done_of:
                out_shape = ins.shape
        else:
            out_shape = ins.shape
        nbytes = max(in_bytes, shape_bytes(out_shape))
        if kind == "collective-permute":
            pairs_text = _attr(ins.attrs, "source_target_pairs") or "{}"
            pairs = [_ints(p) for p in re.findall(r"\{([^{}]*)\}", pairs_text[1:-1])]
            span = _permute_axes(pairs, mesh)
            groups_text = pairs_text
        else:
            groups_text = _replica_groups_text(ins.attrs) or "{}"
            try:
                span = groups_to_axes(parse_replica_groups(groups_text, mesh.size), mesh)
            except (ValueError, IndexError):
                span = _Span(("?",), ("?",))
        op_name, source = _metadata(ins.attrs, sources)
        out.append(
            HloCollective(kind, span.axes, nbytes, out_shape, op_name, source, ins.name, span.order, groups_text,
                          is_async, max(1, runs.get(where.get(ins.name, ""), 1)))
        )
    return out


def _permute_axes(pairs: Sequence[Sequence[int]], mesh: MeshSpec) -> _Span:
    sizes = tuple(a.size for a in mesh.axes)
    moved: set[int] = set()
    for p in pairs:
        if len(p) != 2 or not all(0 <= d < mesh.size for d in p):
            return _Span(("?",), ("?",))
        a = np.unravel_index(p[0], sizes)
        b = np.unravel_index(p[1], sizes)
        moved |= {i for i in range(len(sizes)) if a[i] != b[i]}
    axes = tuple(mesh.names[i] for i in sorted(moved))
    return _Span(axes, axes)


# -- computations and loops ------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|false_computation|select"
                     r"|scatter)"
                     r"=(?:\{([^}]*)\}|%?([\w.\-]+))")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Computations that run as code of their own (not inlined into a fusion or applied per element).
_CONTROL = ("body", "condition", "branch_computations", "true_computation", "false_computation")


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """Computation name -> its instruction lines, and the ENTRY computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            if line.startswith("}"):
                current = None
            else:
                comps[current].append(line)
    return comps, entry


def _calls(lines: Sequence[str]) -> list[tuple[str, str, int]]:
    """(callee, how it is called, trip count) of every computation the lines call."""
    out = []
    for line in lines:
        trip = _TRIP.search(line) if " while(" in line else None
        n = int(trip.group(1)) if trip else 1
        for how, listed, one in _CALLEE.findall(line):
            for callee in re.split(r",\s*", listed) if listed else [one]:
                out.append((callee.strip().lstrip("%"), how, n if how in ("body", "condition") else 1))
    return out


def computation_runs(text: str, *, trip_counts: bool = True) -> dict[str, int]:
    """How many times each computation runs per step: a while body its known trip count times its caller's.

    With ``trip_counts=False`` every loop counts once, as ``compiled.cost_analysis()`` counts it.
    A computation that is never called (or whose loop has no known trip count) counts once.
    """
    return _runs(*computations(text), trip_counts=trip_counts)


def _callees_first(comps: dict[str, list[str]], root: str) -> list[str]:
    """``root`` and every computation it calls, each after all those it calls (a post-order of the call graph,
    which HLO keeps acyclic)."""
    def callees(c: str) -> Iterator[str]:
        return iter([d for d, _, _ in _calls(comps.get(c, ())) if d in comps])

    order: list[str] = []
    seen = {root}
    stack = [(root, callees(root))]
    while stack:
        node, todo = stack[-1]
        nxt = next(todo, None)
        if nxt is None:
            order.append(node)
            stack.pop()
        elif nxt not in seen:
            seen.add(nxt)
            stack.append((nxt, callees(nxt)))
    return order


def _runs(comps: dict[str, list[str]], entry: str, *, trip_counts: bool = True) -> dict[str, int]:
    """``computation_runs`` of already parsed ``computations``."""
    if not entry:
        return {c: 1 for c in comps}
    edges = {c: [(d, n) for d, _, n in _calls(lines) if d in comps] for c, lines in comps.items()}
    runs = {c: 0 for c in comps}
    runs[entry] = 1
    for c in reversed(_callees_first(comps, entry)):  # callers before callees
        for d, n in edges[c]:
            runs[d] += runs[c] * (n if trip_counts else 1)
    return {c: max(1, r) for c, r in runs.items()}


_NO_TRAFFIC = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "while", "conditional", "call")


def _dot_flops(ins: Instruction, shape_of: dict[str, str]) -> float:
    """2 * output elements * contracted size of a ``dot``; 0 for anything else."""
    if ins.opcode != "dot" or not ins.operands:
        return 0.0
    dims = _attr(ins.attrs, "lhs_contracting_dims") or "{}"
    lhs = _ARRAY.search(strip_layouts(shape_of.get(ins.operands[0], "")))
    if lhs is None:
        return 0.0
    lhs_dims = [int(d) for d in lhs.group(2).split(",") if d.strip()]
    k = math.prod(lhs_dims[i] for i in _ints(dims) if i < len(lhs_dims))
    out = _ARRAY.search(strip_layouts(ins.shape))
    n = math.prod(int(d) for d in out.group(2).split(",") if d.strip()) if out else 0
    return 2.0 * n * k


def _traffic(ins: Instruction, shape_of: dict[str, str], comps: dict[str, list[str]]) -> float:
    """Bytes one run of a loop body's instruction reads and writes, as XLA's cost analysis counts them.

    A dynamic slice reads its slice, a dynamic-update-slice (in place) writes its
    update; a fusion is counted at its boundary, each parameter that is only
    sliced inside counted at its slices, a dynamic-update-slice root at its update.
    """
    if ins.opcode in _NO_TRAFFIC:
        return 0.0
    operands = [shape_bytes(shape_of.get(o, "")) for o in ins.operands]
    if ins.opcode == "dynamic-slice":
        return 2.0 * shape_bytes(ins.shape)
    if ins.opcode == "dynamic-update-slice":
        return 2.0 * (operands[1] if len(operands) > 1 else 0)
    if ins.opcode != "fusion":
        return float(shape_bytes(ins.shape) + sum(operands))
    called = _attr(ins.attrs, "calls")
    body = [i for i in map(parse_instruction, comps.get((called or "").lstrip("%"), ())) if i is not None]
    if not body:
        return float(shape_bytes(ins.shape) + sum(operands))
    inner_shape = {i.name: i.shape for i in body}
    params = {i.name: int(_ints(i.operands[0])[0]) if i.operands and _ints(i.operands[0]) else -1
              for i in body if i.opcode == "parameter"}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for i in body:
        for o in i.operands:
            users[o].append(i)
    root = body[-1]
    for line in comps.get((called or "").lstrip("%"), ()):
        if line.lstrip().startswith("ROOT"):
            root = parse_instruction(line) or root
    in_place = root.operands[0] if root.opcode == "dynamic-update-slice" and root.operands else None
    total = 0.0
    for name, k in params.items():
        full = operands[k] if 0 <= k < len(operands) else shape_bytes(inner_shape[name])
        uses = users.get(name, [])
        if name == in_place:
            continue
        if uses and all(u.opcode == "dynamic-slice" and u.operands[0] == name for u in uses):
            total += sum(shape_bytes(u.shape) for u in uses)
        else:
            total += full
    if in_place is not None:
        total += shape_bytes(inner_shape.get(root.operands[1], "")) if len(root.operands) > 1 else 0
    else:
        total += shape_bytes(ins.shape)
    return total


def loop_adjustment(text: str) -> tuple[float, float]:
    """(FLOPs, bytes accessed) that ``cost_analysis()`` leaves out by counting each while body once.

    Both counts are taken over the call graph from the entry computation, a
    while loop's body and condition its trip count times, and a conditional's
    costlier branch (as ``cost_analysis()`` counts one: the most of each count
    over its branches); the difference from the same count with every loop run
    once is what ``cost_analysis()`` misses. FLOPs are XLA's own count of each
    loop body, condition and branch (``_xla_flops``: every instruction, the
    elementwise ones and reductions too); where jaxlib cannot count a
    computation, the ``dot`` FLOPs of the call graph stand in. Bytes are what
    the instructions of each computation that runs as code of its own read and
    write (``_traffic``: the instructions of loop bodies, fusions at their
    boundary).
    """
    comps, entry = computations(text)
    if not entry:
        return 0.0, 0.0
    dot_flops, nbytes = _loop_counts(comps, entry)
    flops = _xla_loop_flops(text, comps, entry)
    return (dot_flops if flops is None else flops), nbytes


def _loop_counts(comps: dict[str, list[str]], entry: str) -> tuple[float, float]:
    """``loop_adjustment``'s (dot FLOPs, bytes) from the HLO text alone."""
    control = {entry} | {d for lines in comps.values() for d, how, _ in _calls(lines) if how in _CONTROL}
    memo: dict[tuple[str, bool], tuple[float, float]] = {}
    own: dict[str, tuple[float, float, list]] = {}  # computation -> (its FLOPs, its bytes, the calls of each line)

    def own_counts(comp: str) -> tuple[float, float, list]:
        if comp not in own:
            lines = comps.get(comp, ())
            instrs = [i for i in map(parse_instruction, lines) if i is not None]
            shape_of = {i.name: i.shape for i in instrs}
            own[comp] = (sum(_dot_flops(i, shape_of) for i in instrs),
                         sum(_traffic(i, shape_of, comps) for i in instrs) if comp in control else 0.0,
                         _line_calls(comps, comp))
        return own[comp]

    def total(comp: str, trips: bool) -> tuple[float, float]:
        known = memo.get((comp, trips))
        if known is not None:
            return known
        flops, nbytes, line_calls = own_counts(comp)
        for calls in line_calls:
            branches = [total(d, trips) for d, how, _ in calls if how in _BRANCHES]
            if branches:  # a conditional runs one branch: the costlier one, count by count
                flops += max(f for f, _ in branches)
                nbytes += max(b for _, b in branches)
            for d, how, n in calls:
                if how not in _BRANCHES:
                    f, b = total(d, trips)
                    flops, nbytes = flops + f * (n if trips else 1), nbytes + b * (n if trips else 1)
        memo[(comp, trips)] = (flops, nbytes)
        return flops, nbytes

    (f_all, b_all), (f_once, b_once) = total(entry, True), total(entry, False)
    return f_all - f_once, b_all - b_once


def _line_calls(comps: dict[str, list[str]], comp: str) -> list[list[tuple[str, str, int]]]:
    """The computations each line of ``comp`` calls (lines that call none left out)."""
    return [calls for calls in ([(d, how, n) for d, how, n in _calls([line]) if d in comps]
                                for line in comps.get(comp, ())) if calls]


def _xla_loop_flops(text: str, comps: dict[str, list[str]], entry: str) -> float | None:
    """The FLOPs ``cost_analysis()`` misses, each loop body, condition and branch counted by XLA (``_xla_flops``);
    None where jaxlib cannot count one of them."""
    blocks: dict[str, str] = {}  # read from the text at the first loop or branch (most programs have none)
    counted: dict[str, float | None] = {}
    missed: dict[str, float] = {}

    def xla(comp: str) -> float:
        if comp not in counted:
            if not blocks:
                blocks.update(_computation_blocks(text))
            counted[comp] = _xla_flops(blocks, comps, comp)
        found = counted[comp]
        if found is None:
            raise LookupError(comp)
        return found

    def misses(comp: str) -> float:
        """What XLA's count of ``comp`` run once leaves out: its loops' further trips, and its conditionals'
        branches' own misses (a conditional counts as its costlier branch)."""
        if comp in missed:
            return missed[comp]
        out = 0.0
        for calls in _line_calls(comps, comp):
            branches = [d for d, how, _ in calls if how in _BRANCHES]
            if branches:
                out += max(xla(d) + misses(d) for d in branches) - max(xla(d) for d in branches)
            for d, how, n in calls:
                if how in ("body", "condition"):
                    out += (n - 1) * xla(d) + n * misses(d)
                elif how not in _BRANCHES:
                    out += misses(d)
        missed[comp] = out
        return out

    try:
        return misses(entry)
    except LookupError:
        return None


_METADATA = re.compile(r",\s*metadata=\{[^}]*\}")


def _computation_blocks(text: str) -> dict[str, str]:
    """Computation name -> its whole printed text (header, instructions, closing brace), ``ENTRY`` dropped."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            blocks[current] = [line[len(m.group(1)):] if m.group(1) else line]
        elif current is not None:
            blocks[current].append(line)
            if line.startswith("}"):
                current = None
    return {name: "\n".join(lines) for name, lines in blocks.items()}


def _xla_flops(blocks: dict[str, str], comps: dict[str, list[str]], comp: str) -> float | None:
    """XLA's own FLOP count of one run of ``comp``: ``HloCostAnalysis`` over a module whose entry it is.

    The module holds ``comp`` and every computation it calls (callees first, as
    the HLO parser wants them); loops inside count once and a conditional as its
    costlier branch, as ``cost_analysis()`` counts them. None where jaxlib does
    not offer the parser or the analysis, or cannot read the module.
    """
    try:
        import jax
        from jax._src.lib import xla_client
        from jaxlib import _hlo
    except ImportError:  # pragma: no cover - jaxlib without these entry points
        return None
    module = "HloModule counted\n\n" + "\n\n".join(
        ("ENTRY " if name == comp else "") + _METADATA.sub("", blocks[name]) for name in _callees_first(comps, comp))
    try:
        parsed = _hlo.hlo_module_from_text(module)
        counts = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, parsed)
    except Exception:  # noqa: BLE001 - a module jaxlib cannot read: the caller counts dots instead
        return None
    return float(counts.get("flops", 0.0))


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


# -- memory ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Memory:
    """``compiled.memory_analysis()`` of one device, bytes."""

    argument: int = 0
    output: int = 0
    temp: int = 0
    alias: int = 0

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    def to_json(self) -> dict:
        return {"argument": self.argument, "output": self.output, "temp": self.temp, "alias": self.alias}


def compiled_memory(compiled) -> Memory:
    """``compiled.memory_analysis()`` of one device (all zero where the backend gives none)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return Memory()
    return Memory(
        int(getattr(ma, "argument_size_in_bytes", 0)),
        int(getattr(ma, "output_size_in_bytes", 0)),
        int(getattr(ma, "temp_size_in_bytes", 0)),
        int(getattr(ma, "alias_size_in_bytes", 0)),
    )


# -- inventories ---------------------------------------------------------------------

InventoryKey = tuple[str, tuple[str, ...]]


def inventory(collectives: Iterable, mesh: MeshSpec | None = None) -> dict[InventoryKey, int]:
    """Bytes per (kind, axes) of any collectives with ``kind``, ``axes`` and ``bytes``.

    With ``mesh``, axes are put in mesh order first (HLO collectives already are),
    so collectives of predicted plans and compiled programs compare directly.
    Collectives over no axis (groups of one device) move nothing and are left out.
    """
    out: dict[InventoryKey, int] = defaultdict(int)
    for c in collectives:
        axes = tuple(c.axes)
        if mesh is not None and all(a in mesh.names for a in axes):
            axes = mesh.order(axes)
        if not axes:
            continue
        out[(c.kind, axes)] += int(c.bytes)
    return dict(sorted(out.items()))


def compiled_text(jitted, *args) -> str:
    """Optimized HLO text of ``jitted`` (anything with ``.lower``) for ``args``."""
    return jitted.lower(*args).compile().as_text()
