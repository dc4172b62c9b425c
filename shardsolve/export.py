"""Export a plan to JAX: ``NamedSharding`` pytrees and ``plan.jit()``.

``plan_jit`` has two ways to run a plan, chosen by ``execution``:

``"lowered"`` (the default)
    the rewriter's program (``shardsolve.lower``): every operation on local
    shards inside one ``jax.shard_map``, every collective one the plan's
    schedule names. Nothing is left to JAX's partitioner, so the program runs
    exactly the planned collectives, partial (pending-sum) values included.
``"pinned"``
    the plan's flat jaxpr re-run with ``jax.lax.with_sharding_constraint`` on
    every intermediate whose planned sharding is a ``PartitionSpec``, under
    ``jax.jit``: JAX's partitioner sees the whole plan but decides where to
    reduce the values the plan keeps partial (a constraint cannot pin a pending
    sum), so its collectives can differ from the plan's. Useful to see what
    propagation makes of a plan; ``shardsolve.verify(..., pinned=True)``
    reports it.

Both take and return arrays laid out as ``plan.in_shardings`` /
``plan.out_shardings``: plain ``NamedSharding``s, the same a user's own
``jax.jit(fun, in_shardings=..., out_shardings=...)`` takes.

JAX refuses a ``NamedSharding`` that does not divide its dimension in
``in_shardings``/``out_shardings`` (and in ``jax.device_put``), but pads one
pinned on an intermediate with ``with_sharding_constraint`` as SpmdPartitioner
does. So an argument or output the plan splits unevenly crosses the boundary
*evened* (``Sharding.evened``: its uneven dimensions unsplit, the others as
planned). ``plan_jit`` pins an uneven argument's planned layout just inside
(a local slice); an uneven output leaves as ``out_shardings`` say, resharded
from its producer, as ``shardsolve.lower`` does and the plan predicts.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.errors import ShardsolveError
from shardsolve.graph import Lit, ScanBoundary
from shardsolve.lower import InOwnMesh, lower
from shardsolve.schedule import is_planned_scan
from shardsolve.sharding import Sharding
from shardsolve.trace import key_data_leaves, key_dims, wrapped_keys


def named(mesh: Any, sharding: Sharding) -> NamedSharding:
    return NamedSharding(mesh, sharding.to_spec())


def boundary(plan, which: str, shardings: Sequence[Sharding] | None = None) -> list[Sharding]:
    """The flat argument (``"in"``) or output shardings as they cross a ``jax.jit`` boundary: evened.

    ``shardings`` defaults to the plan's ``inputs`` or ``outputs``.
    """
    if shardings is None:
        shardings = plan.inputs if which == "in" else plan.outputs
    avals = plan.signature.in_avals if which == "in" else plan.signature.out_avals
    return [s.evened(shape, plan.mesh) for s, (shape, _) in zip(shardings, avals)]


def named_tree(plan, shardings: tuple[Sharding, ...], which: str) -> Any:
    """Shardings as ``NamedSharding``s in the pytree structure of the arguments (``"in"``) or outputs.

    An uneven split is given evened (see the module docstring). A plan not
    bound to its traced program gives a flat tuple.
    """
    mesh = plan.mesh.jax_mesh()
    keys = plan.signature.in_keys if which == "in" else plan.signature.out_keys
    leaves = [named(mesh, s) if key is None else key_named(mesh, s, key)
              for s, key in zip(boundary(plan, which, shardings), keys)]
    traced = plan.graph.traced if plan.graph is not None else None
    if traced is None:
        return tuple(leaves)
    return jax.tree_util.tree_unflatten(traced.in_tree if which == "in" else traced.out_tree, leaves)


def key_named(mesh: Any, data: Sharding, key: str) -> NamedSharding:
    """The ``NamedSharding`` of a typed PRNG key leaf whose data the plan lays out as ``data`` (its trailing key
    dimensions whole, ``build.candidates``)."""
    spec = tuple(data.to_spec())
    rank = data.ndim - key_dims(key)
    if any(spec[rank:]):  # (the planner never splits them: a plan file edited by hand)
        raise ShardsolveError(f"the plan splits a PRNG key's own data ({data.to_spec()}), which no key sharding "
                              "can lay out; plan it again")
    return NamedSharding(mesh, PartitionSpec(*spec[:rank]))


def pinned_function(plan, mesh: Any) -> Callable:
    """The plan's program over flat arguments, with every non-partial intermediate pinned."""
    plan.require_bound()
    graph = plan.graph

    def run(*flat_args):
        # Uneven arguments arrive evened; pin their planned layouts inside.
        args = [_pin(x, s, mesh) if s != e else x for x, s, e in zip(flat_args, plan.inputs, boundary(plan, "in"))]
        return _run_pinned(graph, plan.ops, args, list(graph.const_values), mesh, "ss")

    return run


def _pin(x: Any, sharding: Sharding, mesh: Any) -> Any:
    if not sharding.partial and hasattr(x, "shape") and len(x.shape) == sharding.ndim:
        return jax.lax.with_sharding_constraint(x, named(mesh, sharding))
    return x


def _run_pinned(graph, op_plans, args: list, consts: list, mesh: Any, scope: str) -> list:
    """Evaluate ``graph`` (the program or a scan body) with every planned result pinned.

    Scan ops planned with their body (``OpPlan.body``) are bound again as
    ``jax.lax.scan`` of a body evaluated the same way, so the constraints sit
    inside the loop too. Op ``k`` runs under ``jax.named_scope("ss{k}")`` in
    the program and ``"b{k}"`` inside a scan body (so compiled ``op_name``s of a
    body's collectives name the scan: ``ss5/.../b3``).
    """
    env: dict[int, Any] = {}

    def read(x):
        return x.value if isinstance(x, Lit) else env[x]

    for vid, x in zip(graph.inputs, args):
        env[vid] = x
    for vid, c in zip(graph.consts, consts):
        env[vid] = c
    for op, op_plan in zip(graph.ops, op_plans):
        # "ss{k}" names op k in the compiled HLO's op_name metadata (shardsolve.verify reads it).
        with jax.named_scope(f"{scope}{op.id}"):
            if is_planned_scan(op, op_plan):
                outs = _run_scan(graph, op, op_plan, [read(x) for x in op.inputs], mesh)
            else:
                eqn = op.eqn if op.loop is None else op.loop  # (a while loop not planned with its body: itself)
                outs = op.prim.bind(*map(read, op.inputs), **op.prim.get_bind_params(eqn.params))
                if not op.prim.multiple_results:
                    outs = [outs]
            for vid, out, sharding in zip(op.outputs, outs, op_plan.results):
                env[vid] = _pin(out, sharding, mesh)
    return [read(x) for x in graph.outputs]


def _run_scan(graph, op, op_plan, operands: list, mesh: Any) -> list:
    """``jax.lax.scan`` (or the ``while`` loop) of the op's body (``graph.body(op)``) with the body's planned
    shardings pinned."""
    p = op.params
    body = graph.body(op)
    b = ScanBoundary.of(op, op_plan.operands, op_plan.results, op_plan.body_consts)
    n_consts, n_carry = len(b.consts), len(b.carry)
    consts, carry, xs = operands[:n_consts], operands[n_consts:n_consts + n_carry], operands[n_consts + n_carry:]
    body_consts = list(body.const_values)
    if b.body_consts:
        body_consts = [_pin(c, s, mesh) for c, s in zip(body_consts, b.body_consts)]

    def step(c, x):
        c = [_pin(v, s, mesh) for v, s in zip(c, b.carry)]
        x = [_pin(v, s, mesh) for v, s in zip(x, b.xs)]
        outs = _run_pinned(body, op_plan.body, list(consts) + c + x, body_consts, mesh, "b")
        new_c = [_pin(v, s, mesh) for v, s in zip(outs[:n_carry], b.carry)]
        ys = [_pin(v, s, mesh) for v, s in zip(outs[n_carry:], b.ys)]
        return new_c, ys

    if op.loop is not None:  # a while loop: its condition is its last carry
        return list(jax.lax.while_loop(lambda c: c[-1], lambda c: step(c, [])[0], list(carry)))
    kw = {"reverse": bool(p.get("reverse", False)), "unroll": p.get("unroll", 1)}
    new_carry, ys = jax.lax.scan(step, list(carry), list(xs), length=int(p["length"]), **kw)
    return list(new_carry) + list(ys)


EXECUTIONS = ("lowered", "pinned")


def plan_jit(plan, execution: str = "lowered", **jit_kwargs) -> Callable:
    """The plan's program under ``jax.jit``, with the function's call signature (see the module docstring).

    ``.lower(*args)`` gives the jitted program's ``Lowered`` (arguments may be
    ``ShapeDtypeStruct``s) and ``.flat`` the jitted function over flat arguments.
    """
    if execution not in EXECUTIONS:
        raise ShardsolveError(f"plan.jit(execution={execution!r}) is not a way to run a plan; choose one of "
                              f"{', '.join(map(repr, EXECUTIONS))}")
    if execution == "lowered":
        return lower(plan, **jit_kwargs)
    plan.require_bound()
    mesh = plan.mesh.devices_mesh("plan.jit()")
    run = pinned_function(plan, mesh)
    traced = plan.graph.traced
    in_flat = [named(mesh, s) for s in boundary(plan, "in")]
    out_flat = [named(mesh, s) for s in boundary(plan, "out")]
    flat_jit = InOwnMesh(jax.jit(run, in_shardings=in_flat, out_shardings=out_flat, **jit_kwargs), mesh)

    def flatten(args) -> list:  # typed keys as their data, as the program takes them
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != traced.in_tree:
            raise ShardsolveError(f"arguments do not match the plan's structure: expected {traced.in_tree}, got {tree}")
        return key_data_leaves(leaves, traced.in_keys)

    def call(*args):
        return jax.tree_util.tree_unflatten(traced.out_tree, wrapped_keys(flat_jit(*flatten(args)), traced.out_keys))

    call.lower = lambda *args: flat_jit.lower(*flatten(args))  # type: ignore[attr-defined]
    call.flat = flat_jit  # type: ignore[attr-defined]
    call.flatten = flatten  # type: ignore[attr-defined]
    return call
