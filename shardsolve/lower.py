"""The rewriter: a plan lowered to one explicit per-device program.

``lower(plan)`` returns a function with the planned function's call signature
that runs the whole program inside one ``jax.shard_map`` over the plan's mesh.
Every value lives as a ``PartitionedValue`` (its local shard, its ``Sharding``
and its global shape, as XLA's ``PartitionedHlo``). Every operation runs on
local shards through its rule's kernel (``rules.local.run_local``), with the
operands first resharded to what the planned strategy reads. A reshard executes
exactly the ``ReshardStep``s of ``cost.reshard_steps``, the function the
solver priced, so the collectives of the lowered program are the plan's
predicted collectives, byte for byte:

    ReshardStep        emitted as
    -----------        ----------
    all-reduce         psum / pmax / pmin over the step's axes
    reduce-scatter     psum_scatter(scatter_dimension=dim, tiled=True)
    all-to-all         all_to_all(split_axis=dim, concat_axis=concat_dim, tiled=True)
    all-gather         all_gather(axis=dim, tiled=True)
    slice              a local dynamic slice at the shard's offset (axis_index)

A reshard cache keyed by (value, target sharding) makes a second demand for
the same layout free, as ``planner.predicted_collectives`` assumes.

A planned ``scan`` runs as ``jax.lax.scan`` over local shards, its body
lowered like the program. The layouts its body reads loop invariants in (its
consts, the body's closed-over constants) are made once before the loop, with
the enclosing scope's cache, and handed to the body's cache: each runs once
per run of the scan, and two scans reading one value in one layout share it,
as predicted, without relying on XLA's loop-invariant code motion and CSE.

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

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from shardsolve.cost import ReshardStep, reshard_steps
from shardsolve.errors import ShardsolveError
from shardsolve.graph import Graph, Lit, Op
from shardsolve.mesh import MeshSpec
from shardsolve.rules.local import fill_padding, identity
from shardsolve.sharding import Sharding

AxisIndex = Callable[[str], Any]


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

    def reshard(
        self,
        target: Sharding,
        *,
        cache: Callable[[PartitionedValue], PartitionedValue] | None = None,
        cached: Callable[[Sharding], PartitionedValue | None] | None = None,
    ) -> PartitionedValue:
        """Run the ``cost.reshard_steps`` from this sharding to ``target``, one collective per step.

        With a cache (``cached(sharding)`` looks a layout up, ``cache(value)``
        stores one), the steps start from the last layout along the way that is
        already known.
        """
        steps = reshard_steps(self.shape, np.dtype(self.local.dtype).itemsize, self.sharding, target, self.mesh)
        if steps is None:
            raise ShardsolveError(f"cannot reshard a value from {self.sharding} to {target}: the plan is inconsistent")
        value, rest = self, steps
        if cached is not None:  # start from the last layout along the way that is already known
            for k in range(len(steps) - 1, -1, -1):
                known = cached(steps[k].dst)
                if known is not None:
                    value, rest = known, steps[k + 1:]
                    break
        for step in rest:
            value = value.apply(step)
            if cache is not None:
                value = cache(value)
        assert value.sharding == target, (value.sharding, target)
        return value

    def replicate(self) -> PartitionedValue:
        return self.reshard(Sharding.replicated(len(self.shape)))

    def apply(self, step: ReshardStep) -> PartitionedValue:
        """One reshard step on the local shard."""
        assert step.src == self.sharding, (step.src, self.sharding)
        x = self.local
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
        else:
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
    view: Any  # rules.base.OpView
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
    return _lowered_ops(plan.graph, plan.ops, plan.mesh, {})


def _lowered_ops(graph: Graph, op_plans: Sequence[Any], mesh: MeshSpec, cache: dict) -> list[LoweredOp]:
    from shardsolve.rules import fallback_rule, rule_for

    if len(op_plans) != len(graph.ops):
        raise ShardsolveError(
            f"the plan has {len(op_plans)} operations where the program has {len(graph.ops)}; plan it again"
        )
    out = []
    for op, op_plan in zip(graph.ops, op_plans):
        view = graph.view(op)
        if op.primitive == "scan" and getattr(op_plan, "length", 0):
            body = tuple(_lowered_ops(graph.body(op), op_plan.body, mesh, cache))
            out.append(LoweredOp(op, view, None, None, False, op_plan, body))
            continue
        rule = None if op_plan.fallback else rule_for(view)
        fallback = rule is None
        if rule is None:
            rule = fallback_rule(view)
        key = (rule, op.literal_operands)
        strategies = cache.get(key)
        if strategies is None:
            strategies = tuple(rule.strategies(mesh, fixed_operands=op.literal_operands))
            cache[key] = strategies
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


class _Rewriter:
    """Runs the plan's graph on local shards (inside shard_map)."""

    def __init__(self, plan, lowered: list[LoweredOp], const_shardings: dict[int, Sharding]):
        self.plan = plan
        self.graph: Graph = plan.graph
        self.mesh: MeshSpec = plan.mesh
        self.lowered = lowered
        self.const_shardings = const_shardings

    def run(self, *flat_locals):
        graph = self.graph
        n_in = len(graph.inputs)
        inputs = []
        preset: dict[tuple[int, Sharding], PartitionedValue] = {}
        for vid, x, s in zip(graph.inputs, flat_locals[:n_in], self.plan.inputs):
            # An uneven argument arrives evened; cutting it to its planned shards is a local slice,
            # and the evened layout stays in the reshard cache (planner.predicted_collectives counts so).
            arrived = self._pv(graph, vid, x, s.evened(graph.values[vid].shape, self.mesh))
            if arrived.sharding != s:
                preset[(vid, arrived.sharding)] = arrived
            inputs.append(arrived if arrived.sharding == s else arrived.reshard(s))
        consts = [self._pv(graph, vid, x, self.const_shardings[vid]) for vid, x in zip(graph.consts, flat_locals[n_in:])]
        # An uneven output leaves evened, resharded straight from its producer.
        targets = [s if isinstance(x, Lit) else s.evened(graph.values[x].shape, self.mesh)
                   for x, s in zip(graph.outputs, self.plan.outputs)]
        return tuple(self._lower_graph(graph, self.lowered, inputs, consts, "ss", targets, "ssout", preset))

    def _pv(self, graph: Graph, vid: int, local, sharding: Sharding) -> PartitionedValue:
        return PartitionedValue(local, sharding, graph.values[vid].shape, self.mesh, jax.lax.axis_index)

    def _lower_graph(self, graph: Graph, lowered: Sequence[LoweredOp], inputs: list[PartitionedValue],
                     consts: list[PartitionedValue], scope: str, out_targets: list[Sharding], out_scope: str,
                     preset: dict[tuple[int, Sharding], PartitionedValue] | None = None) -> list:
        """Local shards of ``graph``'s outputs (laid out as ``out_targets``) from its inputs' and consts' values.

        ``preset`` seeds the reshard cache with layouts made outside (a scan body's hoisted invariants).
        """
        from shardsolve.rules.local import run_local

        mesh = self.mesh
        env: dict[int, PartitionedValue] = dict(zip(graph.inputs, inputs))
        env.update(zip(graph.consts, consts))
        cache: dict[tuple[int, Sharding], PartitionedValue] = dict(preset or {})

        def reshard_from(vid: int, src: PartitionedValue, target: Sharding, where: str) -> PartitionedValue:
            # The reshard cache: every layout a value reaches (the target and each
            # intermediate step) is kept and reused, as planner.predicted_collectives assumes.
            hit = cache.get((vid, target))
            if hit is None:
                with jax.named_scope(f"{where}/ssr{vid}"):
                    hit = src.reshard(target, cache=lambda v: cache.setdefault((vid, v.sharding), v),
                                      cached=lambda t: cache.get((vid, t)))
            return hit

        def demand_pv(vid: int, target: Sharding, where: str) -> PartitionedValue:
            return reshard_from(vid, env[vid], target, where)

        def demand(vid: int, target: Sharding, where: str):
            return demand_pv(vid, target, where).local

        for lo in lowered:
            op = lo.op
            where = f"{scope}{op.id}"
            if lo.strategy is None:  # a scan planned with its body
                operands = []
                for k, x in enumerate(op.inputs):
                    if isinstance(x, Lit):
                        operands.append(jnp.asarray(x.value))
                    else:
                        operands.append(demand(x, lo.plan.operands[k], where))
                hoisted = self._hoist(graph, lo, demand_pv, reshard_from, where)
                with jax.named_scope(where):
                    results = self._scan(graph, lo, operands, hoisted)
                shardings = lo.plan.results
            else:
                strategy = lo.strategy
                operands = []
                for k, x in enumerate(op.inputs):
                    operands.append(x.value if isinstance(x, Lit) else demand(x, strategy.operands[k], where))
                with jax.named_scope(where):
                    results = run_local(lo.view, lo.rule, strategy, mesh, operands, jax.lax.axis_index)
                shardings = strategy.results
            for vid, local, s in zip(op.outputs, results, shardings):
                env[vid] = self._pv(graph, vid, local, s)

        outs = []
        for k, (x, s) in enumerate(zip(graph.outputs, out_targets)):
            if isinstance(x, Lit):
                outs.append(jnp.broadcast_to(jnp.asarray(x.value), s.local_shape(np.shape(x.value), mesh)))
            else:
                outs.append(demand(x, s, f"{out_scope}{k}"))
        return outs

    def _hoist(self, graph: Graph, lo: LoweredOp, demand_pv: Callable, reshard_from: Callable,
               where: str) -> dict[tuple[int, Sharding], Any]:
        """The layouts a scan's body reads its loop invariants in, made once before the loop.

        ``planner.loop_invariant_demands`` lists them. A const is resharded from
        the scan's operand with the enclosing scope's cache (``reshard_from``,
        scope ``{where}/ssr{value}``), so what another scan or op already made is
        reused; a literal const or a closed-over constant of the body with this
        scan's own cache (scope ``{where}/bconst{body value}``). Returns the local
        shards keyed by (body value, sharding), for the body's reshard cache.
        """
        from shardsolve.planner import loop_invariant_demands

        op = lo.op
        body = graph.body(op)
        b = _Boundary.of(graph, lo)
        operand_targets = [bl.plan.operands if bl.strategy is None else bl.strategy.operands for bl in lo.body]
        own: dict[tuple[int, Sharding], PartitionedValue] = {}
        out: dict[tuple[int, Sharding], Any] = {}
        for bvid, target in loop_invariant_demands(body, b.n_consts, operand_targets, b.carry + b.ys):
            if bvid in body.inputs[:b.n_consts]:
                k = body.inputs.index(bvid)
                start_s, x = b.consts[k], op.inputs[k]
                if target == start_s:
                    continue
                if not isinstance(x, Lit):
                    out[(bvid, target)] = reshard_from(x, demand_pv(x, start_s, where), target, where).local
                    continue
                start = self._pv(body, bvid, jnp.asarray(x.value), start_s)
            else:
                k = body.consts.index(bvid)
                start_s = b.body_consts[k]
                if target == start_s:
                    continue
                start = self._body_const(body, k, start_s)
            hit = own.get((bvid, target))
            if hit is None:
                with jax.named_scope(f"{where}/bconst{bvid}"):
                    hit = start.reshard(target, cache=lambda v, bvid=bvid: own.setdefault((bvid, v.sharding), v),
                                        cached=lambda t, bvid=bvid: own.get((bvid, t)))
            out[(bvid, target)] = hit.local
        return out

    def _body_const(self, body: Graph, k: int, sharding: Sharding) -> PartitionedValue:
        """The ``k``-th closed-over constant of ``body``, cut to ``sharding`` from the global array (no collective)."""
        vid = body.consts[k]
        whole = self._pv(body, vid, jnp.asarray(body.const_values[k]), Sharding.replicated(len(body.values[vid].shape)))
        return whole.reshard(sharding) if sharding != whole.sharding else whole

    def _scan(self, graph: Graph, lo: LoweredOp, operands: list, hoisted: dict[tuple[int, Sharding], Any]) -> list:
        """``jax.lax.scan`` over local shards, its body lowered like the program (scopes ``b{k}``).

        The plan fixes the boundary: consts and carry enter as they are in the
        body (carry in == carry out), xs and ys are stacked with their leading
        dimension unsplit. ``hoisted`` holds the loop invariants' layouts made
        before the loop (``_hoist``): the body reads them from its cache.
        """
        op = lo.op
        p = op.params
        body = graph.body(op)
        b = _Boundary.of(graph, lo)
        n_consts, n_carry = b.n_consts, len(b.carry)
        consts_l, carry_l, xs_l = operands[:n_consts], operands[n_consts:n_consts + n_carry], operands[n_consts + n_carry:]

        def step(carry, xs):
            ins = [self._pv(body, vid, x, s) for vid, x, s in
                   zip(body.inputs, list(consts_l) + list(carry) + list(xs), b.consts + b.carry + b.xs)]
            consts = [self._body_const(body, k, s) for k, s in enumerate(b.body_consts)]
            preset = {(vid, s): self._pv(body, vid, local, s) for (vid, s), local in hoisted.items()}
            outs = self._lower_graph(body, lo.body, ins, consts, "b", b.carry + b.ys, "bout", preset)
            return outs[:n_carry], outs[n_carry:]

        kw = {"reverse": bool(p.get("reverse", False)), "unroll": p.get("unroll", 1)}
        new_carry, ys = jax.lax.scan(step, list(carry_l), list(xs_l), length=int(p["length"]), **kw)
        return list(new_carry) + list(ys)


@dataclass(frozen=True)
class _Boundary:
    """A planned scan's shardings as its body sees them: consts, carry, x- and y-slices, closed-over constants."""

    n_consts: int
    consts: list
    carry: list
    xs: list
    ys: list
    body_consts: list

    @classmethod
    def of(cls, graph: Graph, lo: LoweredOp) -> _Boundary:
        op, op_plan = lo.op, lo.plan
        body = graph.body(op)
        n_consts, n_carry = int(op.params["num_consts"]), int(op.params["num_carry"])
        boundary = op_plan.operands
        body_consts = list(getattr(op_plan, "body_consts", ()) or ())
        body_consts += [Sharding.replicated(len(body.values[v].shape)) for v in body.consts[len(body_consts):]]
        return cls(
            n_consts,
            list(boundary[:n_consts]),
            list(boundary[n_consts:n_consts + n_carry]),
            [Sharding(s.dims[1:]) for s in boundary[n_consts + n_carry:]],
            [Sharding(s.dims[1:]) for s in op_plan.results[n_carry:]],
            body_consts,
        )


def _const_shardings(plan) -> dict[int, Sharding]:
    """The planned sharding of each closed-over constant (replicated where the plan does not say)."""
    graph = plan.graph
    planned = tuple(getattr(plan, "consts", ()) or ())
    out = {}
    for k, vid in enumerate(graph.consts):
        out[vid] = planned[k] if k < len(planned) else Sharding.replicated(len(graph.values[vid].shape))
    return out


def _require(plan) -> None:
    if plan.graph is None or plan.fun is None:
        raise ShardsolveError(
            "this plan is not bound to a function; use shardsolve.load_plan(path, fun, *args) or plan.bind(fun, *args)"
        )
    mesh = plan.mesh.jax_mesh()
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ShardsolveError(
            f"lowering needs {plan.mesh.size} devices for mesh {plan.mesh}, but only {len(jax.devices())} are "
            "present; run on more devices (or set XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)"
        )


def lower(plan) -> Callable:
    """The rewriter's program for ``plan``: call it like the planned function.

    The returned function lays its arguments out as ``plan.inputs``
    (``jax.device_put`` with a ``NamedSharding``; an uneven split evened, as
    ``plan.in_shardings`` gives it), runs one jitted
    ``jax.shard_map`` and returns the outputs in the planned function's pytree
    structure, laid out as ``plan.outputs`` (evened, as ``plan.out_shardings``). ``.lower(*args)`` gives the jitted
    program's ``Lowered`` (arguments may be ``ShapeDtypeStruct``s) and ``.flat``
    the jitted function over flat arguments.
    """
    _require(plan)
    mesh = plan.mesh.jax_mesh()
    graph: Graph = plan.graph
    traced = graph.traced
    lowered = op_strategies(plan)
    const_shardings = _const_shardings(plan)
    rewriter = _Rewriter(plan, lowered, const_shardings)
    consts = [const_shardings[v] for v in graph.consts]
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

    flat_jit = jax.jit(flat_program, in_shardings=tuple(in_named[: len(plan.inputs)]), out_shardings=tuple(out_named))

    def flatten(args) -> list:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != traced.in_tree:
            raise ShardsolveError(f"arguments do not match the plan's structure: expected {traced.in_tree}, got {tree}")
        return leaves

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
        return jax.tree_util.tree_unflatten(traced.out_tree, list(flat))

    call.lower = lambda *args: flat_jit.lower(*laid_out(flatten(args)))  # type: ignore[attr-defined]
    call.flat = flat_jit  # type: ignore[attr-defined]
    call.ops = lowered  # type: ignore[attr-defined]
    return call


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
