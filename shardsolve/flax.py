"""Flax: plan NNX and Linen models as Flax users write them, and hand plans back to them.

A Flax model's state is a pytree (``nnx.split`` gives a ``State`` of
``Variable``s; Linen gives nested dicts, boxed in ``LogicallyPartitioned``
where names were given), so a training step over it plans as any JAX program,
each parameter named by its path (``args[0]['blocks'][0]['attn']['q']['kernel']``)::

    graphdef, params = nnx.split(model)
    opt_graphdef, opt_state = nnx.split(nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
    plan = shardsolve.plan(step, params, opt_state, tokens, targets, mesh="data=2,model=4",
                           in_shardings=(None, None, P("data"), P("data")), carry=((0, 0), (1, 1)),
                           logical_rules=True)
    plan.logical_axis_rules                    # [('vocab', 'model'), ('embed', None), ...]
    shardsolve.flax.apply_plan(model, plan)    # the live module's state laid out as planned

``logical_rules=True`` reads each parameter's logical axis names from its
metadata (``logical_names``): NNX's ``nnx.with_partitioning`` (stored as
``out_sharding`` in Flax 0.12), Linen's ``nn.with_logical_partitioning``
(``LogicallyPartitioned.names``); ``shardsolve.logical`` ties them. The rules
it hands back reproduce the plan's parameter shardings through Flax's own
``nn.logical_to_mesh_sharding`` (``logical_shardings``).

``MAXTEXT_RULES`` are MaxText's default logical-axis rules (its ``base.yml``),
the hand-written anchor plans are compared with; ``maxtext_rules`` fits them to
a mesh.

Flax is optional (``pip install -e '.[flax]'``): this module imports it only
where a function needs it, and refuses in one line when it is missing.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.errors import ShardsolveError
from shardsolve.trace import leaf_names

INSTALL = "pip install -e '.[flax]'"
MIN_VERSION = (0, 12)
#: NNX variable metadata that holds logical axis names, newest Flax first.
NAME_KEYS = ("out_sharding", "sharding_names", "sharding")

#: MaxText's default logical-axis rules (``MaxText/configs/base.yml``) for parameters and the batch, in its order.
#: Its mesh axes: data, stage, fsdp, fsdp_transpose, sequence, context, tensor, tensor_transpose,
#: tensor_sequence, expert, autoregressive.
MAXTEXT_RULES: tuple[tuple[str, Any], ...] = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("vocab", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("q_heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("kv_heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
    ("embed", ("fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context", "expert")),
    ("embed", ("fsdp", "sequence", "tensor_transpose", "context", "expert")),
    ("embed", ("fsdp", "fsdp_transpose", "sequence", "context", "expert")),
    ("embed", ("fsdp", "sequence", "context", "expert")),
    ("norm", ("tensor", "tensor_transpose", "tensor_sequence")),
    ("layers", "stage"),
    ("kv", ()),
    ("kv_head_dim", ()),
    ("exp", "expert"),
)


def require_flax(feature: str) -> Any:
    """The ``flax`` module, or a one-line ``ShardsolveError`` naming the extra to install (or the version needed)."""
    try:
        flax = importlib.import_module("flax")
        importlib.import_module("flax.nnx")
    except ImportError:
        raise ShardsolveError(f"{feature} needs Flax, which is not installed; install shardsolve's flax extra: "
                              f"{INSTALL}") from None
    version = tuple(int(p) for p in flax.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_VERSION:
        raise ShardsolveError(f"{feature} needs flax>={'.'.join(map(str, MIN_VERSION))}, found {flax.__version__}; "
                              f"upgrade it: {INSTALL}")
    return flax


# -- logical axis names --------------------------------------------------------------


def _is_box(x: Any) -> bool:
    from flax import nnx
    from flax.core import meta

    return isinstance(x, (nnx.Variable, meta.AxisMetadata))


def box_names(box: Any) -> tuple | None:
    """The logical axis names of one NNX ``Variable`` or Linen ``LogicallyPartitioned`` (None if it has none)."""
    import flax.linen as nn
    from flax import nnx

    names = None
    if isinstance(box, nn.LogicallyPartitioned):
        names = box.names
    elif isinstance(box, nnx.Variable):
        metadata = box.get_metadata()
        names = next((metadata[k] for k in NAME_KEYS if metadata.get(k)), None)
    if names is None:
        return None
    if isinstance(names, NamedSharding):
        names = names.spec
    return tuple(names)


def logical_names(args: Any) -> list[tuple | None]:
    """Per flattened leaf of ``args`` (as ``jax.tree_util`` flattens it): its logical axis names, or None."""
    require_flax("logical_rules=True")
    out: list[tuple | None] = []
    for x in jax.tree_util.tree_leaves(args, is_leaf=_is_box):
        if _is_box(x):
            names = box_names(x)
            out += [names] * len(jax.tree_util.tree_leaves(x))
        else:
            out.append(None)
    return out


# -- rules ----------------------------------------------------------------------------


def maxtext_rules(mesh_axes: Sequence[str], tensor: str = "model") -> list[tuple[str, Any]]:
    """``MAXTEXT_RULES`` on a mesh with axes ``mesh_axes``: MaxText's ``tensor`` axis called ``tensor``, absent axes dropped.

    MaxText keeps every axis in its mesh, at size 1 where unused; dropping an
    absent axis from a rule is the same choice. A rule left with no axis maps
    its name to ``None`` (replicated).

        >>> maxtext_rules(("data", "model"))[:3]
        [('activation_batch', 'data'), ('mlp', 'model'), ('vocab', 'model')]
    """
    present = set(mesh_axes)
    out = []
    for name, axes in MAXTEXT_RULES:
        axes = (axes,) if isinstance(axes, str) else axes
        kept = tuple(tensor if a == "tensor" else a for a in axes if (tensor if a == "tensor" else a) in present)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return out


def rule_spec(rules: Sequence[tuple[str, Any]], name: str) -> PartitionSpec:
    """The ``PartitionSpec`` of one dimension named ``name`` under ``rules`` (e.g. the batch's)."""
    return logical_spec((name,), rules)


def logical_spec(names: Sequence[str | None], rules: Sequence[tuple[str, Any]]) -> PartitionSpec:
    """Flax's own resolution of one leaf's names: ``nn.logical_to_mesh_axes(names, rules)``."""
    require_flax("shardsolve.flax.logical_spec")
    import flax.linen as nn

    return nn.logical_to_mesh_axes(tuple(names), list(rules))


def logical_specs(tree: Any, rules: Sequence[tuple[str, Any]]) -> Any:
    """Mesh ``PartitionSpec``s for every leaf of an NNX state or Linen tree, by Flax's own functions.

    NNX: ``nnx.get_partition_spec`` then ``nn.logical_to_mesh``; Linen:
    ``nn.get_partition_spec`` then ``nn.logical_to_mesh``. A pytree prefix
    of the tree, usable as ``in_shardings``.
    """
    require_flax("shardsolve.flax.logical_specs")
    import flax.linen as nn
    from flax import nnx

    has_variables = any(isinstance(x, nnx.Variable)
                        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    specs = nnx.get_partition_spec(tree) if has_variables else nn.get_partition_spec(tree)
    return nn.logical_to_mesh(specs, list(rules))


def logical_shardings(tree: Any, mesh: Any, rules: Sequence[tuple[str, Any]]) -> Any:
    """``NamedSharding``s for every leaf of ``tree`` from logical-axis rules: ``nn.logical_to_mesh_sharding``."""
    require_flax("shardsolve.flax.logical_shardings")
    import flax.linen as nn
    from flax import nnx

    has_variables = any(isinstance(x, nnx.Variable)
                        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    specs = nnx.get_partition_spec(tree) if has_variables else nn.get_partition_spec(tree)
    return nn.logical_to_mesh_sharding(specs, mesh, list(rules))


# -- applying a plan ------------------------------------------------------------------


def plan_shardings(plan: Any, tree: Any, argument: int | None = None, mesh: Any = None) -> Any:
    """The plan's ``NamedSharding`` for every leaf of ``tree`` (a state or parameter tree like one of its arguments).

    Leaves are matched by name (``plan.input_names``), so a plan loaded from
    a file works too. ``argument``: which argument ``tree`` is (default: the
    one whose leaf names all match). ``mesh``: a concrete ``jax`` ``Mesh``
    (default: the plan's mesh over the first devices).
    """
    paths = leaf_names(jax.tree_util.tree_structure(tree))
    names = list(plan.input_names)
    if not names:
        raise ShardsolveError("this plan records no argument names (written by an older shardsolve); plan it again")
    where = {n: k for k, n in enumerate(names)}
    candidates = range(len(names)) if argument is None else [argument]
    k = next((a for a in candidates if paths and all(f"args[{a}]{p}" in where for p in paths)), None)
    if k is None:
        what = f"argument {argument}" if argument is not None else "any argument"
        raise ShardsolveError(
            f"the tree's leaves ({paths[0] if paths else 'none'}, ...) are not those of {what} of the plan; "
            f"pass the state the plan was made for (nnx.state(module)) or argument=K"
        )
    if mesh is None:
        mesh = plan.mesh.devices_mesh("shardsolve.flax.apply_plan")
    flat = jax.tree_util.tree_leaves(plan.in_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    leaves = [NamedSharding(mesh, flat[where[f"args[{k}]{p}"]].spec) for p in paths]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)


def apply_plan(target: Any, plan: Any, *, argument: int | None = None, mesh: Any = None) -> Any:
    """Lay out a live Flax model (or parameter tree) with the plan's shardings; returns it.

    An NNX module or optimizer (any NNX graph node): its state (``nnx.state``)
    is ``jax.device_put`` with the plan's shardings of the matching argument,
    then written back with ``nnx.update``, in place. A Linen parameter tree (or
    any pytree): a laid-out copy. See ``plan_shardings`` for ``argument`` and
    ``mesh``.
    """
    require_flax("shardsolve.flax.apply_plan")
    from flax import nnx

    if isinstance(target, nnx.Pytree):  # modules, optimizers: NNX graph nodes
        state = nnx.state(target)
        try:
            shardings = plan_shardings(plan, state, argument, mesh)
        except ShardsolveError:
            state = nnx.state(target, nnx.Param)  # a plan made over the parameters only
            shardings = plan_shardings(plan, state, argument, mesh)
        nnx.update(target, jax.device_put(state, shardings))
        return target
    return jax.device_put(target, plan_shardings(plan, target, argument, mesh))
