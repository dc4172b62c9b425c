"""The reshard schedule: every read of a value in the layout its reader needs, as data.

A plan fixes every value's sharding and every operation's strategy; what is
left is *how* each value gets from the layout it is made in to the layouts its
readers demand. ``build_schedule`` answers that once, from the plan's own data
(the graph, ``Plan.inputs/consts/outputs`` and each op's ``OpPlan``, scan bodies
and their ``body_consts`` included), so a plan loaded from JSON gets the same
schedule as the one just solved. The plan prices it (``plan.collectives`` are
its collective steps, ``shardsolve.plan.predicted_collectives``) and the
rewriter (``shardsolve.lower``) executes it, step for step: "predicted ==
lowered" holds by construction.

Each ``Demand`` is one read: a value (in the graph of ``scope``), the layout
its steps start from, the target its reader needs, the ``cost.ReshardStep``s
that actually run, the consumer, and how often it runs (``repeats``). The
steps are those of ``cost.reshard_steps`` after a *reshard cache*: every layout
a value reaches (each step's result) is kept, so a second read in a layout
already made runs nothing, and a reshard starts from the layout already made
that reaches its target for least: one its path passes through, or any
other (``source``).

Where it runs (``Site``): an uneven argument arriving evened (JAX lays out no
uneven split at a jit boundary) is cut to its planned shards (``ARGUMENT``, a
local slice; the evened layout stays known); each op's operands
(``OPERANDS``); a scan's loop invariants before its loop (``LOOP_INVARIANTS``,
see ``loop_invariant_demands``); the outputs (``OUTPUT``: the program's leave
evened). A scan body is scheduled once, its demands running ``length`` times
(``repeats``). Example: ``f(x, w) = tanh(x @ w).sum(0)`` with ``x: f32[32, 16]``
pinned ``P("data")`` and ``w: f32[16, 8]`` pinned ``P("model")`` on
``data=2,model=4``; the plan reads ``w`` column-split in the matmul and
reduces over rows that ``data`` no longer splits::

    >>> for d in plan.schedule().demands:                                 # doctest: +SKIP
    ...     print(d.site.kind, d.site.index, d.value_name, d.source, "->", d.target,
    ...           [(s.kind, s.axes, s.bytes) for s in d.steps], "for", d.consumer)
    operands 0 args[0] [{data}, {}] -> [{data}, {}] [] for %0 dot_general
    operands 0 args[1] [{model}, {}] -> [{}, {model}] [('all-to-all', ('model',), 128)] for %0 dot_general
    operands 1 %0 [{data}, {model}] -> [{data}, {model}] [] for %1 tanh
    operands 2 %1 [{data}, {model}] -> [{}, {model}] [('all-gather', ('data',), 256)] for %2 reduce_sum
    output 0 %2 [{model}] -> [{model}] [] for outputs[0]

Pricing is separate from building: ``Schedule.collective_steps()`` yields every
(demand, step) that communicates, for any cost function to price
(``plan.predicted_collectives`` uses ``cost.collective_time`` times ``repeats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from shardsolve.cost import ReshardStep, collective_time, reshard_steps, reshard_time
from shardsolve.errors import ShardsolveError
from shardsolve.graph import CondGroup, Graph, Lit, Op, ScanBoundary, Value, cond_groups, scan_counts
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding

Scope = tuple[int, ...]  # () the program; (k,) the body of scan op k; (k, j) the body of scan op j in that body

ARGUMENT = "argument"  # index: the argument's position
OPERANDS = "operands"  # index: the op's id in its scope
LOOP_INVARIANTS = "loop-invariants"  # index: the scan op's id; runs before its loop, in the scan's scope
OUTPUT = "output"  # index: the output's position (a scan body's: carry, then y-slices)
CASES = "cases"  # index: a conditional's select op; ``branch``: the branch whose result it reads, in that branch


@dataclass(frozen=True, slots=True)
class Site:
    """Where in the program a reshard runs: a scope and a moment in it (see the module docstring)."""

    scope: Scope
    kind: str  # ARGUMENT, OPERANDS, LOOP_INVARIANTS, OUTPUT or CASES
    index: int
    branch: int = -1  # CASES: the branch of the conditional it runs in


@dataclass(frozen=True, slots=True)
class Demand:
    """One read of a value in a layout, and the reshard steps that make that layout."""

    site: Site
    scope: Scope  # the graph ``value`` belongs to: ``site.scope``, or a scan body's (a literal const or a
    #               closed-over constant of the body, resharded before the loop from its own planned layout)
    value: int  # value id in the graph of ``scope``
    source: Sharding  # the layout the steps start from: one the value already has at this point
    target: Sharding  # the layout the consumer reads
    steps: tuple[ReshardStep, ...]  # what runs (``()`` when the target is already there)
    consumer: str  # the operation (or output) that reads it, e.g. "%3 dot_general [block_0]"
    repeats: int  # runs of it: the product of the enclosing scans' lengths
    value_name: str  # e.g. "%2", "args[0]['w']", "%5 scan/%3" (a body value, named by its scan)
    producer: str  # the operation (or argument) that made the value
    anchor: int  # a value id of the program: the value itself, or for a body value its scan's first result
    into: int | None = None  # LOOP_INVARIANTS: the body value that receives the result

    @property
    def collective_steps(self) -> tuple[ReshardStep, ...]:
        return tuple(s for s in self.steps if s.is_collective)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Every demand of a plan, in program order (the order the rewriter runs them)."""

    demands: tuple[Demand, ...]
    _by_site: dict[Site, tuple[Demand, ...]] = field(default_factory=dict, compare=False, repr=False)
    graph: Graph | None = field(default=None, compare=False, repr=False)  # the program the demands are of

    def __post_init__(self) -> None:
        index: dict[Site, list[Demand]] = {}
        for d in self.demands:
            index.setdefault(d.site, []).append(d)
        object.__setattr__(self, "_by_site", {site: tuple(ds) for site, ds in index.items()})

    def at(self, site: Site) -> tuple[Demand, ...]:
        """The demands that run at ``site``, in order."""
        return self._by_site.get(site, ())

    def graph_of(self, scope: Scope) -> Graph:
        """The graph of ``scope``: the program, or the body of the scan ops it names."""
        if self.graph is None:
            raise ShardsolveError("this schedule was built without its program")
        return self.graph.nested(scope)

    def branch_of(self, site: Site) -> tuple[int, int] | None:
        """(the conditional's first select, the branch) of a site inside a conditional's branch
        (``graph.cond_groups``: its ops' operands and its cases), None for one outside any."""
        if site.kind == CASES:
            return site.index, site.branch
        if site.kind != OPERANDS or self.graph is None:
            return None
        for group in cond_groups(self.graph_of(site.scope)):
            for b, ops in enumerate(group.branches):
                if site.index in ops:
                    return group.selects[0], b
        return None

    def collective_steps(self) -> Iterator[tuple[Demand, ReshardStep]]:
        """Every (demand, step) that communicates, in program order: what a cost function prices."""
        for d in self.demands:
            for step in d.steps:
                if step.is_collective:
                    yield d, step


def loop_invariant_demands(body: Graph, n_consts: int, operand_targets: Sequence[Sequence[Sharding]],
                           output_targets: Sequence[Sharding]) -> list[tuple[int, Sharding]]:
    """The layouts a scan body reads its loop invariants in, in the order it first reads them.

    A scan's loop invariants are its consts (the body's first ``n_consts``
    inputs) and its body's closed-over constants: the same in every
    iteration, so each layout the body reads one in is made once, before the
    loop, and handed in, as XLA's loop-invariant code motion would hoist it.
    ``operand_targets[j]`` are the shardings body op ``j`` reads its operands
    in, ``output_targets`` those of the carry-out and y-slices. Reshards made
    before the loop share the enclosing scope's reshard cache, so two scans
    closing over the same value in the same layout reshard it once;
    ``build.ProblemBuilder`` prices their reads at the scan's scale, not
    ``length`` times.
    """
    invariant = set(body.inputs[:n_consts]) | set(body.consts)
    out: list[tuple[int, Sharding]] = []
    seen: set[tuple[int, Sharding]] = set()

    def read(x: int | Lit, target: Sharding) -> None:
        if not isinstance(x, Lit) and x in invariant and (x, target) not in seen:
            seen.add((x, target))
            out.append((x, target))

    for op, targets in zip(body.ops, operand_targets, strict=True):
        for x, target in zip(op.inputs, targets):
            read(x, target)
    for x, target in zip(body.outputs, output_targets):
        read(x, target)
    return out


def is_planned_scan(op: Op, op_plan: Any) -> bool:
    """Whether ``op`` is a scan planned with its body (``OpPlan.length`` iterations of ``OpPlan.body``)."""
    return op.primitive == "scan" and bool(getattr(op_plan, "length", 0))


def build_schedule(graph: Graph, mesh: MeshSpec, inputs: Sequence[Sharding], consts: Sequence[Sharding],
                   outputs: Sequence[Sharding], ops: Sequence[Any]) -> Schedule:
    """The schedule of a plan: ``inputs``/``consts``/``outputs`` per flattened argument, closed-over constant
    and output, ``ops`` the ``OpPlan`` of every op of ``graph`` (constants not covered are replicated)."""
    if len(ops) != len(graph.ops):
        raise ShardsolveError(f"the plan has {len(ops)} operations where the program has {len(graph.ops)}; "
                              "plan it again")
    consts = tuple(consts) + tuple(Sharding.replicated(len(graph.values[v].shape)) for v in graph.consts[len(consts):])
    return _Builder(mesh).program(graph, inputs, consts, outputs, ops)


@dataclass
class _Scope:
    """What the builder knows while walking one graph (the program or a scan body)."""

    graph: Graph
    scope: Scope
    current: dict[int, Sharding]  # the layout each value is made in
    producer: dict[int, str]
    seen: set[tuple[int, Sharding]]  # (value, layout) made so far: the reshard cache
    repeats: int
    prefix: str  # "" for the program, "%5 scan/" in the body of scan op 5
    anchor: int | None  # None for the program (a value anchors itself), else the enclosing scan's first result
    made: dict[int, list[Sharding]] = field(default_factory=dict)  # ``seen`` by value, in the order made

    def remember(self, pairs: Iterator[tuple[int, Sharding]] | Sequence[tuple[int, Sharding]]) -> None:
        """Record (value, layout) pairs as made (the reshard cache)."""
        for vid, layout in pairs:
            if (vid, layout) not in self.seen:
                self.seen.add((vid, layout))
                self.made.setdefault(vid, []).append(layout)


class _Builder:
    """Walks the program once, in the order the rewriter runs it, recording every demand."""

    def __init__(self, mesh: MeshSpec):
        self.mesh = mesh
        self.demands: list[Demand] = []

    def program(self, graph: Graph, inputs: Sequence[Sharding], consts: Sequence[Sharding],
                outputs: Sequence[Sharding], ops: Sequence[Any]) -> Schedule:
        values = graph.values
        current = dict(zip(graph.inputs, inputs)) | dict(zip(graph.consts, consts))
        top = _Scope(graph, (), current, {v: values[v].name for v in current}, set(), 1, "", None)
        # An uneven argument arrives evened (JAX lays out no uneven split) and is cut to its planned shards:
        # the evened layout is in the program too.
        for k, (vid, s) in enumerate(zip(graph.inputs, inputs)):
            arrived = s.evened(values[vid].shape, self.mesh)
            if arrived != s:
                self.reshard(top, Site((), ARGUMENT, k), values[vid], vid, arrived, s, "arguments", cache=False)
                top.remember([(vid, arrived)])
        targets = [s if isinstance(x, Lit) else s.evened(values[x].shape, self.mesh)
                   for x, s in zip(graph.outputs, outputs)]  # an uneven output leaves evened
        self.walk(top, ops, targets, [f"outputs[{k}]" for k in range(len(graph.outputs))])
        return Schedule(tuple(self.demands), graph=graph)

    def reshard(self, at: _Scope, site: Site, value: Value, vid: int, start: Sharding, target: Sharding,
                consumer: str, *, into: int | None = None, cache: bool = True) -> None:
        """Demand ``vid``, a value of ``at``'s graph, in ``target``, from ``start`` (running at ``site``).

        With the reshard cache (``at.seen``): a layout already made costs nothing, and the steps start
        after the last layout along the way already made, or from another layout made before where that
        reaches the target for less (the solver prices a layout made once for several readers that way:
        ``build.ProblemBuilder.add_reads``). ``cache=False``: the steps are not recorded as made.
        """
        if (vid, target) in at.seen:
            source, steps = target, ()
        else:
            path = reshard_steps(value.shape, value.wire_itemsize, start, target, self.mesh)
            if path is None:
                raise ShardsolveError(f"cannot reshard {value.name} from {start} to {target}: the plan is "
                                      "inconsistent; plan the model again")
            known = [k for k, step in enumerate(path) if (vid, step.dst) in at.seen]
            source, steps = (path[known[-1]].dst, path[known[-1] + 1:]) if known else (start, path)
            if cache and vid in at.made:
                source, steps = self._cheapest(value, at.made[vid], source, steps, target)
            if cache:
                at.remember((vid, step.dst) for step in steps)
        self.demands.append(Demand(
            site, at.scope, vid, source, target, tuple(steps), consumer, at.repeats, at.prefix + value.name,
            at.producer[vid], vid if at.anchor is None else at.anchor, into,
        ))

    def _cheapest(self, value: Value, made: Sequence[Sharding], source: Sharding, steps: tuple[ReshardStep, ...],
                  target: Sharding) -> tuple[Sharding, tuple[ReshardStep, ...]]:
        """(source, steps) to ``target``: the given ones, or those from a layout in ``made`` that cost less."""
        mesh = self.mesh
        best = sum(collective_time(s.kind, s.axes, s.bytes, mesh) for s in steps if s.is_collective)
        for layout in made:
            if not best > 0:  # nothing runs: nothing is cheaper
                break
            if layout == source:
                continue
            t = reshard_time(value.shape, value.wire_itemsize, layout, target, mesh)
            if t < best * (1 - 1e-9):
                source, steps, best = layout, reshard_steps(value.shape, value.wire_itemsize, layout, target, mesh), t
        return source, steps

    def walk(self, at: _Scope, ops: Sequence[Any], out_targets: Sequence[Sharding], out_names: Sequence[str]) -> None:
        """Demands of every op of ``at``'s graph, then of its outputs; a conditional's branches (``cond``) where
        the rewriter runs them, at its first select."""
        g = at.graph
        groups = cond_groups(g)
        conds = {group.selects[0]: group for group in groups}
        in_branch = {k for group in groups for branch in group.branches for k in branch}
        selects = {k for group in groups for k in group.selects}
        for op, op_plan in zip(g.ops, ops):
            if op.id in conds:
                self.cond(at, ops, conds[op.id])
            if op.id in in_branch:
                continue
            if is_planned_scan(op, op_plan):
                self.scan(at, op, op_plan, at.prefix + op.name())
                continue
            self.operation(at, op, op_plan, 1 if op.id in selects else len(op.inputs))  # (a select's cases: ``cond``)
        for k, (x, target) in enumerate(zip(g.outputs, out_targets)):
            if not isinstance(x, Lit):
                self.reshard(at, Site(at.scope, OUTPUT, k), g.values[x], x, at.current[x], target, out_names[k])

    def operation(self, at: _Scope, op: Op, op_plan: Any, reads: int) -> None:
        """Demands of ``op``'s first ``reads`` operands (at its ``OPERANDS`` site), then its results as made."""
        g, name = at.graph, at.prefix + op.name()
        site = Site(at.scope, OPERANDS, op.id)
        for k, x in enumerate(op.inputs[:reads]):
            if not isinstance(x, Lit):
                self.reshard(at, site, g.values[x], x, at.current[x], op_plan.operands[k], name)
        for r, vid in enumerate(op.outputs):
            at.current[vid] = op_plan.results[r]
            at.producer[vid] = name

    def cond(self, at: _Scope, ops: Sequence[Any], group: CondGroup) -> None:
        """A conditional's branches (``graph.CondGroup``), each as it runs: its ops, then the selects' reads of
        its results (``CASES``), from the layouts made before the conditional; a layout made in a branch is
        that branch's alone (the rewriter's ``lax.switch`` makes it there), so the cache is restored after each.
        The selects' index is read where they are (``walk``)."""
        g = at.graph
        seen, made = set(at.seen), {v: list(ls) for v, ls in at.made.items()}
        for b, branch in enumerate(group.branches):
            for k in branch:
                self.operation(at, g.ops[k], ops[k], len(g.ops[k].inputs))
            for k in group.selects:
                x = g.ops[k].inputs[b + 1]
                if not isinstance(x, Lit):
                    self.reshard(at, Site(at.scope, CASES, k, b), g.values[x], x, at.current[x],
                                 ops[k].operands[b + 1], at.prefix + g.ops[k].name())
            at.seen, at.made = set(seen), {v: list(ls) for v, ls in made.items()}

    def scan(self, at: _Scope, op: Op, op_plan: Any, name: str) -> None:
        """A scan planned with its body: its operands, its loop invariants, its body (``length`` runs), its results."""
        g = at.graph
        body = g.body(op)
        b = ScanBoundary.of(op, op_plan.operands, op_plan.results, op_plan.body_consts, body)
        site = Site(at.scope, OPERANDS, op.id)
        for k, (x, target) in enumerate(zip(op.inputs, b.operands)):
            if not isinstance(x, Lit):
                self.reshard(at, site, g.values[x], x, at.current[x], target, name)
        inner = _Scope(
            body, at.scope + (op.id,),
            dict(zip(body.inputs, b.body_inputs)) | dict(zip(body.consts, b.body_consts)),
            {v: f"{name}/{body.values[v].name}" for v in body.inputs + body.consts},
            set(), at.repeats * op_plan.length, f"{name.split(' [')[0]}/",
            at.anchor if at.anchor is not None else op.outputs[0] if op.outputs else None,
        )
        hoisted = loop_invariant_demands(body, len(b.consts), [o.operands for o in op_plan.body], b.body_outputs)
        self.loop_invariants(at, op, inner, hoisted, name)
        inner.remember(hoisted)  # the body finds them made
        n_carry = len(b.carry)
        self.walk(inner, op_plan.body, b.body_outputs,
                  [f"{name.split(' [')[0]} " + (f"carry[{r}]" if r < n_carry else f"ys[{r - n_carry}]")
                   for r in range(len(body.outputs))])
        for vid, s in zip(op.outputs, b.results):
            at.current[vid] = s
            at.producer[vid] = name

    def loop_invariants(self, at: _Scope, op: Op, inner: _Scope, hoisted: Sequence[tuple[int, Sharding]],
                        name: str) -> None:
        """The layouts the body reads its loop invariants in, made before the loop (``loop_invariant_demands``).

        A const is resharded from the layout it enters the body in with the enclosing scope's cache
        (shared with the outer value's other reshards: two scans reading it in one layout reshard it
        once); a literal const or a closed-over constant of the body from its own planned layout, with
        a cache of this scan's own.
        """
        body = inner.graph
        site = Site(at.scope, LOOP_INVARIANTS, op.id)
        where = f"{name} before the loop, for its body"
        own = _Scope(body, inner.scope, inner.current, inner.producer, set(), at.repeats, inner.prefix, inner.anchor)
        n_consts = scan_counts(op)[0]
        for bvid, target in hoisted:
            start = inner.current[bvid]
            if target == start:
                continue
            k = body.inputs.index(bvid) if bvid in body.inputs[:n_consts] else None
            if k is not None and not isinstance(op.inputs[k], Lit):
                x = op.inputs[k]
                self.reshard(at, site, at.graph.values[x], x, start, target, where, into=bvid)
            else:
                self.reshard(own, site, body.values[bvid], bvid, start, target, where, into=bvid)
