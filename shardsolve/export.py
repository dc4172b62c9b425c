"""Export a plan to JAX: ``NamedSharding`` pytrees and a pinned ``jax.jit``.

``plan_jit`` re-runs the plan's flat jaxpr with
``jax.lax.with_sharding_constraint`` on every intermediate whose planned
sharding is expressible as a ``PartitionSpec`` (partial values are not), so
JAX's partitioner sees the whole plan, not only its boundary.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from shardsolve.errors import ShardsolveError
from shardsolve.graph import Lit
from shardsolve.sharding import Sharding


def named(mesh: Any, sharding: Sharding) -> NamedSharding:
    return NamedSharding(mesh, sharding.to_spec())


def named_tree(plan, shardings: tuple[Sharding, ...], which: str) -> Any:
    """Shardings as ``NamedSharding``s in the pytree structure of the arguments (``"in"``) or outputs."""
    from shardsolve.plan import tree_of

    mesh = plan.mesh.jax_mesh()
    leaves = [named(mesh, s) for s in shardings]
    tree = tree_of(plan, which)
    if tree is None:
        return tuple(leaves)
    return jax.tree_util.tree_unflatten(tree, leaves)


def _require_bound(plan) -> None:
    if plan.graph is None or plan.fun is None:
        raise ShardsolveError(
            "this plan is not bound to a function; use shardsolve.load_plan(path, fun, *args) or plan.bind(fun, *args)"
        )


def pinned_function(plan, mesh: Any) -> Callable:
    """The plan's program over flat arguments, with every non-partial intermediate pinned."""
    _require_bound(plan)
    graph = plan.graph
    op_plans = plan.ops

    def run(*flat_args):
        env: dict[int, Any] = {}

        def read(x):
            return x.value if isinstance(x, Lit) else env[x]

        for vid, x in zip(graph.inputs, flat_args):
            env[vid] = x
        for vid, c in zip(graph.consts, graph.const_values):
            env[vid] = c
        for op, op_plan in zip(graph.ops, op_plans):
            outs = op.prim.bind(*map(read, op.inputs), **op.prim.get_bind_params(op.params))
            if not op.prim.multiple_results:
                outs = [outs]
            for vid, out, sharding in zip(op.outputs, outs, op_plan.results):
                if not sharding.partial and hasattr(out, "shape") and len(out.shape) == sharding.ndim:
                    out = jax.lax.with_sharding_constraint(out, named(mesh, sharding))
                env[vid] = out
        return [read(x) for x in graph.outputs]

    return run


def plan_jit(plan, **jit_kwargs) -> Callable:
    """``jax.jit`` of the plan's function with its shardings; same call signature as the function."""
    _require_bound(plan)
    mesh = plan.mesh.jax_mesh()
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ShardsolveError(
            f"plan.jit() needs {plan.mesh.size} devices for mesh {plan.mesh}, but only {len(jax.devices())} are "
            "present; run on more devices (or set XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)"
        )
    run = pinned_function(plan, mesh)
    traced = plan.graph.traced
    in_flat = [named(mesh, s) for s in plan.inputs]
    out_flat = [named(mesh, s) for s in plan.outputs]
    flat_jit = jax.jit(run, in_shardings=in_flat, out_shardings=out_flat, **jit_kwargs)

    def call(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != traced.in_tree:
            raise ShardsolveError(f"arguments do not match the plan's structure: expected {traced.in_tree}, got {tree}")
        return jax.tree_util.tree_unflatten(traced.out_tree, flat_jit(*leaves))

    call.lower = lambda *args: flat_jit.lower(*jax.tree_util.tree_leaves(args))  # type: ignore[attr-defined]
    call.flat = flat_jit  # type: ignore[attr-defined]
    return call
