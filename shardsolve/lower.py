"""The rewriter: a plan lowered to one explicit per-device program.

``lower(plan)`` returns a function with the planned function's call signature
that runs the whole program inside one ``jax.shard_map`` over the plan's mesh.
Every value lives as a ``PartitionedValue`` (its local shard, its ``Sharding``
and its global shape, as XLA's ``PartitionedHlo``). Every operation runs on
local shards through its rule's kernel (``rules.local.run_local``), with the
operands first resharded to what the planned strategy reads. The reshards are
the plan's schedule (``shardsolve.schedule``), executed: each ``Demand`` is run
by taking its ``source`` layout from the table of layouts made so far and
applying exactly its ``ReshardStep``s, the steps the plan priced, so the
collectives of the lowered program are the plan's predicted collectives, byte
for byte, by construction:

    ReshardStep        emitted as
    -----------        ----------
    all-reduce         psum / pmax / pmin over the step's axes
    reduce-scatter     psum_scatter(scatter_dimension=dim, tiled=True)
    all-to-all         all_to_all(split_axis=dim, concat_axis=concat_dim, tiled=True)
    all-gather         all_gather(axis=dim, tiled=True)
    slice              a local dynamic slice at the shard's offset (axis_index)

The schedule's reshard cache (a layout made once is reused) is the table: the
rewriter keeps every layout a demand makes and decides nothing itself.

A planned ``scan`` runs as ``jax.lax.scan`` over local shards, its body
lowered like the program. The schedule's ``LOOP_INVARIANTS`` demands (the
layouts its body reads loop invariants in) run once before the loop and are
handed to the body's table, without relying on XLA's loop-invariant code
motion and CSE. A ``while`` loop planned as a scan (``graph.as_scan``) runs
as ``jax.lax.while_loop``: its condition's ops in the loop's condition, the
rest in its body (``_Rewriter._while``), or, where that would run other
collectives than planned, its body as planned, flag and selects included.

    plan = shardsolve.plan(step, params, batch, mesh="data=2,model=4",
                           in_shardings=(None, P("data")))
    run = shardsolve.lower(plan)
    new_params, loss = run(params, batch)     # same results as step(params, batch)
    run.lower(params, batch).compile().as_text()   # the program, for shardsolve.hlo

Names: operation ``k`` runs under ``jax.named_scope("ss{k}")`` and the reshard
of value ``v`` it demands under ``"ss{k}/ssr{v}"`` (outputs: ``"ssout{k}/ssr{v}"``),
so each collective in the compiled HLO's ``op_name`` names its value and the
operation that demanded it (``attribution``).

Uneven splits (a dimension not divisible by its shards' count) are padded as
SpmdPartitioner pads: every shard has the size ``ceil(n / shards)`` and the
padding lies past the end of the dimension. ``cost.reshard_steps`` gathers an
uneven dimension whole before splitting it again (nested uneven shards do not
line up), and its bytes count the padded buffers, so reshards of uneven values
are exact too. ``pad_with_zero`` sets the padding to zero (or a reduction's
identity) for kernels that read it; ``rules.local.run_local`` does so for a
reduction over an uneven split. JAX lays out no uneven split at a ``jax.jit``
or ``shard_map`` boundary, so an argument planned as ``[{model}, {}]`` on
``f32[10, 6]`` enters evened (``Sharding.evened``: ``[{}, {}]``, the user
passes it so) and is cut to its padded shards of 3 rows inside by a local
slice; an uneven output is resharded from its producer straight to its evened
layout, the reshard the plan predicts.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from shardsolve.cost import ReshardStep, reshard_steps, wire_itemsize
from shardsolve.errors import ShardsolveError
from shardsolve.graph import CondGroup, Graph, Lit, Op, OpView, ScanBoundary, cond_groups
from shardsolve.mesh import MeshSpec
from shardsolve.rules import fallback_rule, rule_for
from shardsolve.rules.base import strategies_of
from shardsolve.rules.local import fill_padding, identity, run_local
from shardsolve.schedule import (
    ARGUMENT,
    CASES,
    LOOP_INVARIANTS,
    OPERANDS,
    OUTPUT,
    Demand,
    Schedule,
    Scope,
    Site,
    is_planned_scan,
)
from shardsolve.sharding import Sharding
from shardsolve.trace import key_data_leaves, wrapped_keys

AxisIndex = Callable[[str], Any]


# Primitives XLA may turn into a bitcast of their operand's buffer (a view, no copy).
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "sharding_constraint", "device_put"})


def _read_elsewhere(graph: Graph, vid: int | Lit) -> bool:
    """Whether another operation reads the buffer of ``vid``: ``vid`` itself, or a view it was made from.

    A ``dynamic_update_slice`` of such a buffer is not written in place
    (``rules.local``): XLA's in-place fusion miscompiles it when a dynamic
    slice of the same buffer feeds the update.
    """
    while not isinstance(vid, Lit):
        if len(graph.consumers.get(vid, ())) > 1 or vid in graph.output_ids:
            return True
        value = graph.values[vid]
        if value.kind != "result" or graph.ops[value.producer].primitive not in VIEWS:
            return False
        vid = graph.ops[value.producer].inputs[0]
    return False


# -- partitioned values ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionedValue:
    """A value inside the per-device program: its local shard, sharding and global shape."""

    local: Any  # jax.Array (a tracer inside shard_map)
    sharding: Sharding
    shape: tuple[int, ...]
    mesh: MeshSpec = field(compare=False)
    axis_index: AxisIndex = field(default=jax.lax.axis_index, compare=False, repr=False)

    # -- layout queries ---------------------------------------------------

    def local_shape(self) -> tuple[int, ...]:
        return self.sharding.local_shape(self.shape, self.mesh)

    def shard_index(self, axes: Sequence[str]):
        """This device's position along ``axes`` (major to minor) as an int32 scalar."""
        idx = jnp.int32(0)
        for a in axes:
            idx = idx * self.mesh.axis(a).size + self.axis_index(a)
        return idx

    @property
    def is_even(self) -> bool:
        return self.sharding.divides(self.shape, self.mesh)

    # -- resharding -------------------------------------------------------

    def reshard(self, target: Sharding) -> PartitionedValue:
        """Run the ``cost.reshard_steps`` from this sharding to ``target``, one collective per step."""
        steps = reshard_steps(self.shape, wire_itemsize(self.local.dtype), self.sharding, target, self.mesh)
        if steps is None:
            raise ShardsolveError(f"cannot reshard a value from {self.sharding} to {target}: the plan is inconsistent")
        value = self.run(steps)
        assert value.sharding == target, (value.sharding, target)
        return value

    def run(self, steps: Sequence[ReshardStep]) -> PartitionedValue:
        """Apply ``steps`` in order (the first must start from this sharding)."""
        value = self
        for step in steps:
            value = value.apply(step)
        return value

    def replicate(self) -> PartitionedValue:
        return self.reshard(Sharding.replicated(len(self.shape)))

    def apply(self, step: ReshardStep) -> PartitionedValue:
        """One reshard step on the local shard."""
        assert step.src == self.sharding, (step.src, self.sharding)
        x = self.local
        if 0 in self.shape:  # an empty value moves nothing: its empty shard in the new layout
            return PartitionedValue(jnp.zeros(step.dst.local_shape(self.shape, self.mesh), x.dtype), step.dst,
                                    self.shape, self.mesh, self.axis_index)
        if step.is_collective:
            # Keep XLA from rewriting the collective away (it folds an all-gather of a
            # broadcast, or an all-reduce of a value it proves replicated): the program
            # runs exactly the collectives the plan priced.
            x = jax.lax.optimization_barrier(x)
        src, dst = step.src, step.dst
        if step.kind == "all-reduce":
            x = _REDUCE[src.reduce_op](self._padded_identity(x, src.reduce_op), step.axes)
        elif step.kind == "reduce-scatter":
            d = step.dim
            axes = dst.dims[d][len(src.dims[d]):]
            x = self._grow(x, d, dst)
            x = jax.lax.psum_scatter(x, _names(axes), scatter_dimension=d, tiled=True)
        elif step.kind == "all-to-all":
            (axis,) = step.axes
            x = self._grow(x, step.dim, dst)
            x = jax.lax.all_to_all(x, axis, split_axis=step.dim, concat_axis=step.concat_dim, tiled=True)
            x = self._trim(x, step.concat_dim, dst)
        elif step.kind == "all-gather":
            d = step.dim
            axes = src.dims[d][len(dst.dims[d]):]
            x = jax.lax.all_gather(x, _names(axes), axis=d, tiled=True)
            x = self._trim(x, d, dst)
        elif step.kind == "slice":
            d = step.dim
            added = dst.dims[d][len(src.dims[d]):]
            x = self._grow(x, d, dst)
            size = dst.local_shape(self.shape, self.mesh)[d]
            start = self.shard_index(added) * size
            x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=d)
        elif step.kind != "relabel":  # a relabel changes axes of size 1 only: the shard stays as it is
            raise ShardsolveError(f"the rewriter has no lowering for a {step.kind!r} reshard step")
        return PartitionedValue(x, dst, self.shape, self.mesh, self.axis_index)

    # -- padding ----------------------------------------------------------

    def pad_with_zero(self, identity: Any = 0) -> PartitionedValue:
        """The same value with the padding of uneven shards set to ``identity`` (zero by default)."""
        return PartitionedValue(_fill_padding(self.local, self.sharding, self.shape, self.mesh, self.axis_index,
                                              identity), self.sharding, self.shape, self.mesh, self.axis_index)

    def _padded_identity(self, x, reduce_op: str):
        if self.is_even:
            return x
        return _fill_padding(x, self.sharding, self.shape, self.mesh, self.axis_index, identity(reduce_op, x.dtype))

    def _grow(self, x, d: int, dst: Sharding):
        """Pad dimension ``d`` so it splits evenly into ``dst``'s local size along it."""
        want = dst.local_shape(self.shape, self.mesh)[d] * math.prod(
            self.mesh.axis(a).size for a in dst.dims[d][len(_common(self.sharding.dims[d], dst.dims[d])):]
        )
        have = x.shape[d]
        if want > have:
            pad = [(0, 0)] * x.ndim
            pad[d] = (0, want - have)
            x = jnp.pad(x, pad)
        return x

    def _trim(self, x, d: int, dst: Sharding):
        want = dst.local_shape(self.shape, self.mesh)[d]
        if x.shape[d] > want:
            x = jax.lax.slice_in_dim(x, 0, want, axis=d)
        return x


def _common(a: Sequence[str], b: Sequence[str]) -> tuple[str, ...]:
    out = []
    for x, y in zip(a, b):
        if x != y:
            break
        out.append(x)
    return tuple(out)


def _names(axes: Sequence[str]):
    return axes[0] if len(axes) == 1 else tuple(axes)


_REDUCE = {
    "sum": lambda x, axes: jax.lax.psum(x, _names(axes)),
    "max": lambda x, axes: jax.lax.pmax(x, _names(axes)),
    "min": lambda x, axes: jax.lax.pmin(x, _names(axes)),
}


def _fill_padding(x, sharding: Sharding, shape: Sequence[int], mesh: MeshSpec, axis_index: AxisIndex, value):
    """Set the elements of the local shard ``x`` past the end of every unevenly split dimension to ``value``."""
    for d, axes in enumerate(sharding.dims):
        x = fill_padding(x, d, shape[d], axes, mesh, axis_index, value)
    return x


# -- strategies of planned operations -------------------------------------------------------


@dataclass(frozen=True)
class LoweredOp:
    """What the rewriter needs to run one planned operation.

    A scan planned with its body (``OpPlan.length``) has no rule strategy:
    ``body`` holds the lowered ops of its body graph instead.
    """

    op: Op
    view: OpView
    rule: Any  # rules.base.Rule, None for a planned scan
    strategy: Any  # rules.base.Strategy, None for a planned scan
    fallback: bool
    plan: Any = None  # the OpPlan
    body: tuple = ()  # LoweredOps of a planned scan's body


def op_strategies(plan) -> list[LoweredOp]:
    """Re-derive each operation's ``Strategy`` object from the plan's ``OpPlan``.

    The rule's strategies are enumerated as the planner did
    (``rule.strategies(mesh, fixed_operands=op.literal_operands)``) and the one
    reading and writing the planned shardings is picked (its description
    breaks ties). Scan bodies planned once are handled recursively.
    """
    return _lowered_ops(plan.graph, plan.ops, plan.mesh)


def _lowered_ops(graph: Graph, op_plans: Sequence[Any], mesh: MeshSpec) -> list[LoweredOp]:
    if len(op_plans) != len(graph.ops):
        raise ShardsolveError(
            f"the plan has {len(op_plans)} operations where the program has {len(graph.ops)}; plan it again"
        )
    out = []
    for op, op_plan in zip(graph.ops, op_plans):
        view = graph.view(op)
        if is_planned_scan(op, op_plan):
            body = tuple(_lowered_ops(graph.body(op), op_plan.body, mesh))
            out.append(LoweredOp(op, view, None, None, False, op_plan, body))
            continue
        rule = None if op_plan.fallback else rule_for(view)
        fallback = rule is None
        if rule is None:
            rule = fallback_rule(view)
        strategies = strategies_of(rule, mesh, tuple(op.literal_operands))
        matching = [s for s in strategies if s.operands == op_plan.operands and s.results == op_plan.results]
        if not matching:
            raise ShardsolveError(
                f"{op.name()}: the plan runs it as {op_plan.strategy!r}, which its rule no longer offers on mesh "
                f"{mesh}; plan the model again"
            )
        chosen = next((s for s in matching if s.describe() == op_plan.strategy), matching[0])
        out.append(LoweredOp(op, view, rule, chosen, fallback, op_plan))
    return out


# -- the rewriter --------------------------------------------------------------------------

Layouts = dict[tuple[int, Sharding], PartitionedValue]  # (value id, sharding) -> that layout, made


class _Rewriter:
    """Runs the plan's graph on local shards (inside shard_map), executing its reshard schedule.

    Every scope (the program, each run of a scan body) keeps a table of the
    layouts made so far, keyed by (value, sharding): each value as its producer
    made it, and each step result of the schedule's demands. A demand is run
    by looking its ``source`` up there and applying exactly its ``steps``;
    operands are then read from the table in the layouts their strategy needs.
    """

    def __init__(self, plan, lowered: list[LoweredOp], schedule: Schedule):
        self.graph: Graph = plan.graph
        self.mesh: MeshSpec = plan.mesh
        self.plan = plan
        self.lowered = lowered
        self.schedule = schedule

    def run(self, *flat_locals):
        graph, plan = self.graph, self.plan
        n_in = len(graph.inputs)
        table: Layouts = {}
        for k, (vid, x, s) in enumerate(zip(graph.inputs, flat_locals[:n_in], plan.inputs)):
            # An uneven argument arrives evened; its demand cuts it to the planned shards (a local slice).
            self._define(table, graph, vid, x, s.evened(graph.values[vid].shape, self.mesh))
            self._execute(self.schedule.at(Site((), ARGUMENT, k)), table, {}, "")
        for vid, x, s in zip(graph.consts, flat_locals[n_in:], self.consts()):
            self._define(table, graph, vid, x, s)
        targets = [s if isinstance(x, Lit) else s.evened(graph.values[x].shape, self.mesh)
                   for x, s in zip(graph.outputs, plan.outputs)]
        return tuple(self._lower_graph((), graph, self.lowered, table, targets))

    def consts(self) -> list[Sharding]:
        """The planned sharding of each closed-over constant (replicated where the plan does not say)."""
        graph, planned = self.graph, tuple(self.plan.consts)
        return [planned[k] if k < len(planned) else Sharding.replicated(len(graph.values[v].shape))
                for k, v in enumerate(graph.consts)]

    def _pv(self, graph: Graph, vid: int, local, sharding: Sharding) -> PartitionedValue:
        return PartitionedValue(local, sharding, graph.values[vid].shape, self.mesh, jax.lax.axis_index)

    def _define(self, table: Layouts, graph: Graph, vid: int, local, sharding: Sharding) -> PartitionedValue:
        pv = table[(vid, sharding)] = self._pv(graph, vid, local, sharding)
        return pv

    def _execute(self, demands: Sequence[Demand], table: Layouts, own: Layouts, prefix: str) -> None:
        """Run each demand's steps from its source layout, keeping every layout made.

        ``own`` holds the layouts of a scan's literal consts and closed-over
        constants (demands whose value belongs to the body, made before its
        loop). Name scopes: ``{prefix}/ssr{value}`` (``{prefix}/bconst{value}``
        for those), so compiled collectives name their value (``attribution``).
        """
        for d in demands:
            layouts = own if d.scope != d.site.scope else table
            key = (d.value, d.source)
            if key not in layouts:
                raise ShardsolveError(f"the schedule reads {d.value_name} in {d.source}, which the program has not "
                                      "made; the plan is inconsistent: plan the model again")
            if not d.steps:
                continue
            value = layouts[key]
            scope = contextlib.nullcontext() if not prefix else jax.named_scope(
                f"{prefix}/bconst{d.value}" if layouts is own else f"{prefix}/ssr{d.value}")
            with scope:
                for step in d.steps:
                    value = layouts[(d.value, step.dst)] = value.apply(step)

    def _lower_graph(self, scope: Scope, graph: Graph, lowered: Sequence[LoweredOp], table: Layouts,
                     out_targets: Sequence[Sharding]) -> list:
        """Local shards of ``graph``'s outputs (laid out as ``out_targets``), given the layouts in ``table``."""
        mesh = self.mesh
        out_tag = "ssout" if not scope else "bout"
        self._lower_ops(scope, graph, lowered, table)
        outs = []
        for k, (x, s) in enumerate(zip(graph.outputs, out_targets)):
            if isinstance(x, Lit):
                outs.append(jnp.broadcast_to(jnp.asarray(x.value), s.local_shape(np.shape(x.value), mesh)))
            else:
                self._execute(self.schedule.at(Site(scope, OUTPUT, k)), table, {}, f"{out_tag}{k}")
                outs.append(table[(x, s)].local)
        return outs

    def _lower_ops(self, scope: Scope, graph: Graph, lowered: Sequence[LoweredOp], table: Layouts) -> None:
        """Run ``lowered`` (ops of ``graph``, in program order), each after its operands' demands; their
        results land in ``table``. A conditional's ops (``graph.cond_groups``) run at its first select, as a
        ``lax.switch`` (``_cond``)."""
        by_id = {lo.op.id: lo for lo in lowered}
        every = cond_groups(graph)
        whole = [group for group in every if group.ops <= by_id.keys()]
        at_select = {group.selects[0]: group for group in whole}
        inside = {k for group in whole for k in group.ops}
        # A conditional split between a while loop's condition and its body (``_loop_parts``) runs its part as
        # traced, every branch and the selects, each select's cases made first.
        cases = {k: len(group.branches) for group in every for k in group.selects}
        for lo in lowered:
            if lo.op.id in at_select:
                self._cond(scope, graph, by_id, table, at_select[lo.op.id])
            elif lo.op.id not in inside:
                for b in range(cases.get(lo.op.id, 0)):
                    self._execute(self.schedule.at(Site(scope, CASES, lo.op.id, b)), table, {}, _where(scope, lo.op.id))
                self._lower_op(scope, graph, lo, table)

    def _lower_op(self, scope: Scope, graph: Graph, lo: LoweredOp, table: Layouts) -> None:
        """Run one op after its operands' demands; its results land in ``table``."""
        op = lo.op
        where = _where(scope, op.id)
        self._execute(self.schedule.at(Site(scope, OPERANDS, op.id)), table, {}, where)
        targets = lo.plan.operands if lo.strategy is None else lo.strategy.operands
        operands = []
        for x, t in zip(op.inputs, targets):
            if isinstance(x, Lit):
                operands.append(jnp.asarray(x.value) if lo.strategy is None else x.value)
            else:
                operands.append(table[(x, t)].local)
        if lo.strategy is None:  # a scan planned with its body
            hoisted = self._loop_invariants(scope, graph, lo, table, where)
            with jax.named_scope(where):
                results = self._scan(scope, graph, lo, operands, hoisted)
            shardings = lo.plan.results
        else:
            in_place = op.primitive != "dynamic_update_slice" or not _read_elsewhere(graph, op.inputs[0])
            with jax.named_scope(where):
                results = run_local(lo.view, lo.rule, lo.strategy, self.mesh, operands, jax.lax.axis_index,
                                    in_place=in_place)
            shardings = lo.strategy.results
        for vid, local, s in zip(op.outputs, results, shardings):
            self._define(table, graph, vid, local, s)

    def _cond(self, scope: Scope, graph: Graph, lowered: dict[int, LoweredOp], table: Layouts,
              group: CondGroup) -> None:
        """A conditional (``graph.CondGroup``) as ``lax.switch`` on its selects' index: each branch runs its ops
        and its cases' demands (``CASES``) from the layouts made before it, and hands back its results in the
        layouts the selects read them in, which are the selects' results."""
        selects = [lowered[k] for k in group.selects]
        for lo in selects:  # the index (the selects' operand 0)
            self._execute(self.schedule.at(Site(scope, OPERANDS, lo.op.id)), table, {}, _where(scope, lo.op.id))
        index = table[(selects[0].op.inputs[0], selects[0].strategy.operands[0])].local

        def branch(b: int) -> Callable[[], tuple]:
            def run() -> tuple:
                own = dict(table)  # a layout made in a branch stays in it
                for k in group.branches[b]:
                    self._lower_op(scope, graph, lowered[k], own)
                outs = []
                for lo in selects:
                    x, target = lo.op.inputs[b + 1], lo.strategy.operands[b + 1]
                    self._execute(self.schedule.at(Site(scope, CASES, lo.op.id, b)), own, {}, _where(scope, lo.op.id))
                    shape = target.local_shape(graph.values[lo.op.outputs[0]].shape, self.mesh)
                    dtype = graph.values[lo.op.outputs[0]].dtype
                    local = own[(x, target)].local if not isinstance(x, Lit) else jnp.asarray(x.value)
                    outs.append(jnp.broadcast_to(jnp.asarray(local, dtype), shape))
                return tuple(outs)
            return run

        with jax.named_scope(_where(scope, group.selects[0])):
            results = jax.lax.switch(jnp.asarray(index).astype(jnp.int32),
                                     [branch(b) for b in range(len(group.branches))])
        for lo, local in zip(selects, results):
            self._define(table, graph, lo.op.outputs[0], local, lo.strategy.results[0])

    def _loop_invariants(self, scope: Scope, graph: Graph, lo: LoweredOp, table: Layouts,
                         where: str) -> dict[tuple[int, Sharding], Any]:
        """The scan's ``LOOP_INVARIANTS`` demands, run before its loop: local shards by (body value, sharding).

        A const read from an outer value is resharded in ``table``; a literal
        const or a closed-over constant of the body starts from its own planned
        layout, in a table of this scan's own (``own``).
        """
        op = lo.op
        body = graph.body(op)
        b = ScanBoundary.of(op, lo.plan.operands, lo.plan.results, lo.plan.body_consts, body)
        demands = self.schedule.at(Site(scope, LOOP_INVARIANTS, op.id))
        starts = dict(zip(body.inputs, b.body_inputs)) | dict(zip(body.consts, b.body_consts))
        own: Layouts = {}
        for d in demands:
            if d.scope != d.site.scope and (d.value, starts[d.value]) not in own:  # a value of the body
                own[(d.value, starts[d.value])] = self._invariant(body, op, d.value, starts[d.value])
        self._execute(demands, table, own, where)
        return {(d.into, d.target): (own if d.scope != d.site.scope else table)[(d.value, d.target)].local
                for d in demands}

    def _invariant(self, body: Graph, op: Op, bvid: int, start: Sharding) -> PartitionedValue:
        """A literal const or a closed-over constant of the body, laid out as ``start`` (no collective)."""
        if bvid in body.consts:
            return self._body_const(body, body.consts.index(bvid), start)
        k = body.inputs.index(bvid)
        return self._pv(body, bvid, jnp.asarray(op.inputs[k].value), start)

    def _body_const(self, body: Graph, k: int, sharding: Sharding) -> PartitionedValue:
        """The ``k``-th closed-over constant of ``body``, cut to ``sharding`` from the global array (no collective)."""
        vid = body.consts[k]
        whole = self._pv(body, vid, jnp.asarray(body.const_values[k]), Sharding.replicated(len(body.values[vid].shape)))
        return whole.reshard(sharding) if sharding != whole.sharding else whole

    def _scan(self, scope: Scope, graph: Graph, lo: LoweredOp, operands: list,
              hoisted: dict[tuple[int, Sharding], Any]) -> list:
        """``jax.lax.scan`` over local shards, its body lowered like the program (scopes ``b{k}``).

        The plan fixes the boundary (``ScanBoundary``): consts and carry enter as
        they are in the body (carry in == carry out), xs and ys are stacked.
        ``hoisted`` holds the loop invariants' layouts made before the loop: the
        body finds them in its table.
        """
        op = lo.op
        p = op.params
        body = graph.body(op)
        b = ScanBoundary.of(op, lo.plan.operands, lo.plan.results, lo.plan.body_consts, body)
        n_consts, n_carry = len(b.consts), len(b.carry)
        consts_l, carry_l, xs_l = operands[:n_consts], operands[n_consts:n_consts + n_carry], operands[n_consts + n_carry:]
        inner = scope + (op.id,)

        def step(carry, xs):
            table = self._body_table(body, b, list(consts_l) + list(carry) + list(xs), hoisted)
            outs = self._lower_graph(inner, body, lo.body, table, b.body_outputs)
            return outs[:n_carry], outs[n_carry:]

        if op.loop is not None:  # a while loop: its condition is its last carry, laid out alike on every device
            split = _loop_parts(self.schedule, inner, body, lo.body, b)
            if split is not None:
                try:
                    return self._while(inner, body, split, b, list(consts_l), list(carry_l), hoisted)
                except ShardsolveError:  # a layout one part makes and the other reads: run it as planned
                    pass
            return list(jax.lax.while_loop(lambda carry: carry[-1], lambda carry: step(carry, [])[0], list(carry_l)))
        kw = {"reverse": bool(p.get("reverse", False)), "unroll": p.get("unroll", 1)}
        new_carry, ys = jax.lax.scan(step, list(carry_l), list(xs_l), length=int(p["length"]), **kw)
        return list(new_carry) + list(ys)

    def _body_table(self, body: Graph, b: ScanBoundary, inputs: list,
                    hoisted: dict[tuple[int, Sharding], Any]) -> Layouts:
        """The layouts a loop body starts an iteration with: its inputs (those given: a while loop's condition
        and body leave out its flag), its closed-over constants and the loop invariants made before the loop."""
        table: Layouts = {}
        for vid, x, s in zip(body.inputs, inputs, b.body_inputs):
            self._define(table, body, vid, x, s)
        for k, s in enumerate(b.body_consts):
            table[(body.consts[k], s)] = self._body_const(body, k, s)
        for (vid, s), local in hoisted.items():
            self._define(table, body, vid, local, s)
        return table

    def _while(self, inner: Scope, body: Graph, split: tuple, b: ScanBoundary, consts_l: list, carry_l: list,
               hoisted: dict[tuple[int, Sharding], Any]) -> list:
        """A while loop planned with its condition carried (``trace._predicate_carried``), run as the loop it
        was: the condition's ops in ``jax.lax.while_loop``'s condition, the body's in its body, the selects
        and the flag left out (``_loop_parts`` says where that runs the same collectives)."""
        cond_ops, body_ops, selects = split

        def condition(state):
            table = self._body_table(body, b, consts_l + list(state), hoisted)
            self._lower_ops(inner, body, cond_ops, table)
            k = len(b.carry) - 1
            self._execute(self.schedule.at(Site(inner, OUTPUT, k)), table, {}, f"bout{k}")
            return table[(body.outputs[k], b.body_outputs[k])].local

        def step(state):
            table = self._body_table(body, b, consts_l + list(state), hoisted)
            self._lower_ops(inner, body, body_ops, table)
            new = []
            for lo in selects:
                x, target = lo.op.inputs[2], lo.strategy.operands[2]
                if isinstance(x, Lit):
                    shape = target.local_shape(np.shape(x.value), self.mesh)
                    new.append(jnp.broadcast_to(jnp.asarray(x.value), shape))
                    continue
                demands = [d for d in self.schedule.at(Site(inner, OPERANDS, lo.op.id)) if d.value == x]
                self._execute(demands, table, {}, f"b{lo.op.id}")
                new.append(table[(x, target)].local)
            return tuple(new)

        state = jax.lax.while_loop(condition, step, tuple(carry_l[:-1]))
        return list(state) + [jnp.zeros((), bool)]


def _where(scope: Scope, k: int) -> str:
    """The name scope of op ``k``'s work and its reshards (``attribution`` reads it back): ``ss{k}`` in the
    program, ``b{k}`` in a scan body."""
    return f"{'ss' if not scope else 'b'}{k}"


def _loop_parts(schedule: Schedule, inner: Scope, body: Graph, lowered: Sequence[LoweredOp],
                b: ScanBoundary) -> tuple[list, list, list] | None:
    """The condition's ops, the body's ops and the selects of a while loop's body planned with its condition
    carried (``trace._predicate_carried``), where running the first two apart (``_Rewriter._while``) runs
    exactly the planned collectives: an op both parts read reshards nothing (it runs in each), each select
    keeps its carry's layout and reads the old carry and the condition as they are; None otherwise (the loop
    then runs as planned, flag and selects included).
    """
    import networkx as nx

    n_consts, n_carry = len(b.consts), len(b.carry)
    outs, lo_of = body.outputs, {lo.op.id: lo for lo in lowered}

    def producer(x) -> Op | None:
        value = None if isinstance(x, Lit) else body.values[x]
        return body.ops[value.producer] if value is not None and value.kind == "result" else None

    pred = outs[n_carry - 1]
    flag = body.inputs[n_consts + n_carry - 1]
    if isinstance(pred, Lit) or body.consumers.get(flag):
        return None
    selects = []
    for i in range(n_carry - 1):
        sel = producer(outs[i])
        if (sel is None or sel.primitive != "select_n" or len(sel.inputs) != 3 or sel.inputs[0] != pred
                or sel.inputs[1] != body.inputs[n_consts + i] or lo_of[sel.id].strategy is None):
            return None
        st = lo_of[sel.id].strategy
        carry = b.carry[i]
        if st.results[0] != carry or st.operands[1] != carry or st.operands[2] != carry or any(
                d.steps for d in schedule.at(Site(inner, OPERANDS, sel.id)) if d.value in (pred, sel.inputs[1])):
            return None
        if any(d.steps for d in schedule.at(Site(inner, OUTPUT, i))):
            return None
        selects.append(lo_of[sel.id])

    dataflow = body.to_networkx()

    def ancestors(values) -> set[int]:
        """The ops that make ``values``, and every op those read from."""
        made = {op.id for op in map(producer, values) if op is not None}
        return made | {k for m in made for kind, k in nx.ancestors(dataflow, ("op", m)) if kind == "op"}

    in_cond = ancestors([pred])
    in_body = ancestors([lo.op.inputs[2] for lo in selects])
    chosen = {lo.op.id for lo in selects}
    if chosen & (in_cond | in_body) or len(in_cond | in_body | chosen) != len(body.ops):
        return None
    # An op both parts read (``y * y - a`` of Newton's step and of its test) runs in each, where it reshards nothing.
    if any(d.steps for k in in_cond & in_body for d in schedule.at(Site(inner, OPERANDS, k))):
        return None
    return ([lo for lo in lowered if lo.op.id in in_cond], [lo for lo in lowered if lo.op.id in in_body], selects)


class InOwnMesh:
    """A jitted function called, lowered and traced with its own mesh as JAX's context mesh where the caller set
    another (``jax.set_mesh`` of a mesh with ``Explicit`` axes, ``jax.make_mesh``'s default): ``shard_map``
    refuses a context mesh other than its own. Everything else is the jitted function's."""

    def __init__(self, fn: Callable, mesh: Any):
        self._fn, self._mesh = fn, mesh

    def _context(self):
        current = jax.sharding.get_abstract_mesh()
        if current.empty or current == self._mesh.abstract_mesh:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh)

    def __call__(self, *args, **kwargs):
        with self._context():
            return self._fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self._context():
            return self._fn.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with self._context():
            return self._fn.trace(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def lower(plan, **jit_kwargs) -> Callable:
    """The rewriter's program for ``plan``: call it like the planned function.

    The returned function lays its arguments out as ``plan.inputs``
    (``jax.device_put`` with a ``NamedSharding``; an uneven split evened, as
    ``plan.in_shardings`` gives it), runs one jitted
    ``jax.shard_map`` and returns the outputs in the planned function's pytree
    structure, laid out as ``plan.outputs`` (evened, as ``plan.out_shardings``). ``.lower(*args)`` gives the jitted
    program's ``Lowered`` (arguments may be ``ShapeDtypeStruct``s) and ``.flat``
    the jitted function over flat arguments. ``jit_kwargs`` go to ``jax.jit``
    (``donate_argnums`` counts flattened argument leaves).
    """
    plan.require_bound()
    mesh = plan.mesh.devices_mesh("lowering")
    graph: Graph = plan.graph
    traced = graph.traced
    lowered = op_strategies(plan)
    rewriter = _Rewriter(plan, lowered, plan.schedule())
    consts = rewriter.consts()
    # JAX lays out only even splits: uneven arguments and outputs cross the boundary evened (see _Rewriter.run).
    in_specs = tuple(s.evened(graph.values[v].shape, plan.mesh).to_spec() for v, s in zip(graph.inputs, plan.inputs))
    in_specs += tuple(s.to_spec() for s in consts)
    out_specs = tuple(s.to_spec() if isinstance(x, Lit) else s.evened(graph.values[x].shape, plan.mesh).to_spec()
                      for x, s in zip(graph.outputs, plan.outputs))
    body = jax.shard_map(rewriter.run, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    in_named = [NamedSharding(mesh, s) for s in in_specs]
    out_named = [NamedSharding(mesh, s) for s in out_specs]
    const_values = [jax.device_put(c, NamedSharding(mesh, s.to_spec())) for c, s in zip(graph.const_values, consts)]

    def flat_program(*flat_args):
        return body(*flat_args, *const_values)

    flat_jit = InOwnMesh(jax.jit(flat_program, in_shardings=tuple(in_named[: len(plan.inputs)]),
                                 out_shardings=tuple(out_named), **jit_kwargs), mesh)

    def flatten(args) -> list:  # typed keys as their data, as the program takes them
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != traced.in_tree:
            raise ShardsolveError(f"arguments do not match the plan's structure: expected {traced.in_tree}, got {tree}")
        return key_data_leaves(leaves, traced.in_keys)

    def laid_out(leaves: list) -> list:
        out = []
        for x, s in zip(leaves, in_named):
            if isinstance(x, jax.ShapeDtypeStruct):
                out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))
            elif isinstance(x, jax.core.Tracer):
                out.append(x)
            else:
                out.append(jax.device_put(x, s))
        return out

    def call(*args):
        flat = flat_jit(*laid_out(flatten(args)))
        return jax.tree_util.tree_unflatten(traced.out_tree, wrapped_keys(flat, traced.out_keys))

    call.lower = lambda *args: flat_jit.lower(*laid_out(flatten(args)))  # type: ignore[attr-defined]
    call.flat = flat_jit  # type: ignore[attr-defined]
    call.flatten = flatten  # type: ignore[attr-defined]
    call.laid_out = laid_out  # type: ignore[attr-defined]
    call.ops = lowered  # type: ignore[attr-defined]
    return call


# -- the collectives a lowered program emits -----------------------------------------------

# Collective primitives of a shard_map body and the HLO kind each becomes.
_EMITTED = {
    "psum": "all-reduce", "psum_invariant": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce",
    "all_gather": "all-gather", "all_gather_invariant": "all-gather", "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all", "ppermute": "collective-permute",
}


@dataclass(frozen=True, slots=True)
class EmittedCollective:
    """One collective the rewriter wrote into its program, read from the program's jaxpr.

    ``bytes`` per device, the larger of the input and output buffers (the
    convention of ``cost.ReshardStep`` and ``hlo.HloCollective``), at the
    element size the backend moves (``cost.wire_itemsize``); ``op_name`` the
    JAX name stack (``ss12/ssr7``, as ``attribution`` reads). A collective in a
    scan body is listed once, as a compiled while loop shows it.
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    op_name: str
    name: str = ""


def emitted_collectives(run: Callable, *args: Any) -> list[EmittedCollective]:
    """The collectives in the traced program of ``run = lower(plan)`` for ``args``, before XLA optimises it.

    These are what the rewriter wrote, step by step from the schedule; the
    optimized HLO of the same program (``shardsolve.hlo.collectives_from_hlo``)
    is what XLA made of them.
    """
    closed = jax.make_jaxpr(run.flat)(*run.laid_out(run.flatten(args)))
    out: list[EmittedCollective] = []
    _walk_emitted(closed.jaxpr, "", out)
    return out


def _walk_emitted(jaxpr, prefix: str, out: list[EmittedCollective]) -> None:
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        where = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
        kind = _EMITTED.get(eqn.primitive.name)
        if kind is not None:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            # a positional axis (a psum that vmap made of a named axis it mapped) reduces locally
            axes = tuple(a for a in axes if not isinstance(a, int))
            sizes = [math.prod(v.aval.shape) * wire_itemsize(v.aval.dtype)
                     for v in list(eqn.invars) + list(eqn.outvars) if hasattr(v.aval, "shape")]
            if axes:
                out.append(EmittedCollective(kind, tuple(str(a) for a in axes), int(max(sizes, default=0)), where,
                                             eqn.primitive.name))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _walk_emitted(inner, where, out)


# -- attribution -------------------------------------------------------------------------

_SCOPE = re.compile(r"(?:^|/)ss(out)?(\d+)(?:/ssr(\d+))?(?=/|$)")
_BODY = re.compile(r"/b(?:out)?\d+/ssr\d+(?=/|$)")


def attribution(op_name: str) -> list[tuple[str, int | None]]:
    """(consumer, value id) pairs named by a lowered collective's ``op_name``.

    ``"jit(f)/shard_map/ss12/ssr7/psum"`` -> ``[("op 12", 7)]``; a combined
    collective (``"(ss3/ssr1/psum:ss4/ssr2/psum)"``) names several.
    A collective inside a scan body (``ss5/.../b3/ssr7/...``) is named by the
    scan: ``("op 5", None)``.
    """
    out = []
    for part in re.split(r"[():]", op_name):
        ms = list(_SCOPE.finditer(part))
        if not ms:
            continue
        m = ms[0]
        consumer = f"outputs[{m.group(2)}]" if m.group(1) else f"op {m.group(2)}"
        inside_body = bool(_BODY.search(part[m.end():]))
        out.append((consumer, None if inside_body or not m.group(3) else int(m.group(3))))
    return out
