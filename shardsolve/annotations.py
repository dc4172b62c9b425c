"""User annotations -> pinned shardings, one per flattened argument and output.

``in_shardings`` and ``out_shardings`` are pytree prefixes of the arguments /
outputs whose leaves are ``PartitionSpec``s (pinned), ``NamedSharding``s,
shardsolve ``Sharding``s or ``None`` (free for the solver). They are broadcast
to one entry per leaf and checked against the mesh and the leaf's shape; each
pin carries the label the solver's conflict explanations print:

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from shardsolve.mesh import MeshSpec
    >>> from shardsolve.trace import trace
    >>> f = lambda params, x: (params, x @ params["w"])
    >>> t = trace(f, {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    >>> [(str(s), label) for s, label in argument_pins(t, (None, P("data")), MeshSpec.parse("data=2,model=4"))]
    [('None', "in_shardings[0]['w']"), ('[{data}, {}]', "in_shardings[1] = P('data',)")]
    >>> carry_pairs(t, [(0, 0)])   # argument 0 comes back as output 0: leaf 0 -> leaf 0
    [(0, 0)]

A split that does not divide its dimension is allowed (padded, see
``sharding.Sharding.evened``); one with more parts than elements, an unknown
mesh axis or an axis used twice is refused with a one-line ``ShardsolveError``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardsolve.errors import ShardsolveError
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding
from shardsolve.trace import key_dims, leaf_names

Pins = list[tuple[Sharding | None, str]]  # per flattened leaf: the pinned sharding (None: free) and its label


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding, Sharding))


def broadcast_annotations(prefix: Any, tree_def: Any, what: str) -> list[Any]:
    """Expand a pytree prefix of annotations to one per leaf of ``tree_def``."""
    dummy = jax.tree_util.tree_unflatten(tree_def, [0] * tree_def.num_leaves)
    if _is_spec_leaf(prefix):
        return [prefix] * tree_def.num_leaves
    if what == "in_shardings" and not isinstance(prefix, (tuple, list)):
        raise ShardsolveError(
            f"{what} must be a tuple with one entry per argument (or one PartitionSpec/None for all), "
            f"got {type(prefix).__name__}"
        )
    if isinstance(prefix, list) and isinstance(dummy, tuple):
        prefix = tuple(prefix)
    try:
        full = jax.tree.broadcast(prefix, dummy, is_leaf=_is_spec_leaf)
        # up to the arguments' own structure: an argument that is None (no leaves) keeps its annotation out
        leaves = tree_def.flatten_up_to(full)
        if len(leaves) != tree_def.num_leaves:
            raise ValueError(f"{len(leaves)} annotations for {tree_def.num_leaves} leaves")
        return leaves
    except (ValueError, TypeError) as e:
        first = str(e).splitlines()[0]
        raise ShardsolveError(
            f"{what} does not match the {'arguments' if what == 'in_shardings' else 'outputs'}: {first}; "
            f"give a pytree prefix of them with PartitionSpec or None leaves"
        ) from None


def to_sharding(ann: Any, shape: tuple[int, ...], mesh: MeshSpec, what: str) -> Sharding | None:
    """One annotation leaf as a ``Sharding`` of a value of ``shape`` (``None`` stays ``None``), checked."""
    if ann is None:
        return None
    if isinstance(ann, Sharding):
        s = ann
    else:
        spec = ann.spec if isinstance(ann, NamedSharding) else ann
        s = Sharding.from_spec(spec, len(shape), mesh, what=what)
    for a in s.axes:
        mesh.axis(a)
    if len(set(s.axes)) != len(s.axes):
        raise ShardsolveError(f"{what}: sharding {s} uses a mesh axis twice; use each axis once")
    # A split that does not divide its dimension is padded (see sharding.Sharding.evened); one with
    # more parts than elements leaves whole devices empty.
    for d, size in enumerate(shape):
        n = s.dim_shards(d, mesh)
        if 0 < size < n:  # (an empty dimension splits into empty parts, as JAX lays it out)
            raise ShardsolveError(
                f"{what}: {s.to_spec()} splits dimension {d} of size {size} into {n} parts, more than it has "
                f"elements; use fewer mesh axes on it, or leave it None"
            )
    return s


def constraint_sharding(ns: Any, unconstrained: Sequence[int], shape: tuple[int, ...], mesh: MeshSpec,
                        what: str) -> tuple[Sharding, frozenset[int]] | None:
    """A layout asked for inside the function (``with_sharding_constraint``'s ``sharding`` and
    ``unconstrained_dims``, or one of ``device_put``'s ``devices``) as the sharding it pins and the dimensions
    it leaves free (``PartitionSpec.UNCONSTRAINED``); ``None`` where it names no mesh layout (a device, a
    memory kind or layout alone). Checked like ``in_shardings`` (``to_sharding``); its mesh must give each
    axis it uses the plan's size."""
    if not isinstance(ns, NamedSharding):
        return None
    sizes = dict(ns.mesh.shape)
    spec = tuple(ns.spec)
    free = set(unconstrained or ())
    free.update(d for d, entry in enumerate(spec) if entry is PartitionSpec.UNCONSTRAINED)
    named = [None if d in free else entry for d, entry in enumerate(spec)]
    for entry in named:
        for a in (entry,) if isinstance(entry, str) else (entry or ()):
            if a in mesh.names and sizes.get(a) != mesh.axis_size(a):
                raise ShardsolveError(
                    f"{what}: mesh axis {a!r} has size {sizes.get(a)} in the constraint's mesh but "
                    f"{mesh.axis_size(a)} in the plan's ({mesh}); plan on the mesh the function constrains to"
                )
    return to_sharding(PartitionSpec(*named), shape, mesh, what), frozenset(free)


def leaf_paths(tree_def: Any) -> list[str]:
    """The key path of every leaf of ``tree_def``, e.g. ``["[0]['w']", "[1]"]`` (``trace.leaf_names``)."""
    return leaf_names(tree_def)


def _pins(annotations: Any, tree_def: Any, avals: Sequence[Any], mesh: MeshSpec, what: str,
          keys: Sequence[str | None]) -> Pins:
    pins: Pins = []
    for ann, path, aval, key in zip(broadcast_annotations(annotations, tree_def, what), leaf_paths(tree_def), avals,
                                    keys):
        label = f"{what}{path}"
        if key is not None and ann is not None and not isinstance(ann, Sharding):
            # A typed key is planned on its data (``trace.key_data_leaves``): its annotation names the key's
            # dimensions, and the data's trailing ones stay whole.
            rank = len(aval.shape) - key_dims(key)
            spec = tuple(ann.spec if isinstance(ann, NamedSharding) else ann)
            if len(spec) > rank:
                raise ShardsolveError(
                    f"{label}: {PartitionSpec(*spec)} names {len(spec)} dimensions of a PRNG key array of rank "
                    f"{rank}; give at most {rank}"
                )
        s = to_sharding(ann, tuple(aval.shape), mesh, label)
        pins.append((s, f"{label} = {s.to_spec()}" if s is not None else label))
    return pins


def argument_pins(traced: Any, in_shardings: Any, mesh: MeshSpec) -> Pins:
    """(pinned sharding or None, label) per flattened argument of a ``trace.Traced`` program."""
    return _pins(in_shardings, traced.in_tree, traced.in_avals, mesh, "in_shardings", traced.in_keys)


def hint_pins(traced: Any, hints: Any, mesh: MeshSpec) -> Pins:
    """(hinted sharding or None, label) per flattened argument: ``plan``'s ``hints``, read as ``in_shardings``."""
    return _pins(hints, traced.in_tree, traced.in_avals, mesh, "hints", traced.in_keys)


def output_pins(traced: Any, out_shardings: Any, mesh: MeshSpec) -> Pins:
    """(pinned sharding or None, label) per flattened output of a ``trace.Traced`` program."""
    return _pins(out_shardings, traced.out_tree, traced.out_avals, mesh, "out_shardings", traced.out_keys)


def _leaf_ranges(tree_def: Any) -> list[tuple[int, int]] | None:
    """Leaf index range of each top-level child of a tuple/list pytree."""
    dummy = jax.tree_util.tree_unflatten(tree_def, list(range(tree_def.num_leaves)))
    if not isinstance(dummy, (tuple, list)):
        return None
    out, start = [], 0
    for child in dummy:
        n = len(jax.tree_util.tree_leaves(child))
        out.append((start, start + n))
        start += n
    return out


def carry_pairs(traced: Any, carry: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Expand (argument index, output index) pairs to (argument leaf, output leaf) pairs."""
    pairs: list[tuple[int, int]] = []
    if not carry:
        return pairs
    args = _leaf_ranges(traced.in_tree)
    outs = _leaf_ranges(traced.out_tree) or [(0, traced.out_tree.num_leaves)]
    dummy_in = jax.tree_util.tree_unflatten(traced.in_tree, [0] * traced.in_tree.num_leaves)
    dummy_out = jax.tree_util.tree_unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
    for a, o in carry:
        if not (0 <= a < len(args)) or not (0 <= o < len(outs)):
            raise ShardsolveError(
                f"carry pair ({a}, {o}) is out of range: {len(args)} arguments, {len(outs)} outputs"
            )
        out_sub = dummy_out[o] if isinstance(dummy_out, (tuple, list)) else dummy_out
        if jax.tree_util.tree_structure(dummy_in[a]) != jax.tree_util.tree_structure(out_sub):
            raise ShardsolveError(
                f"carry pair ({a}, {o}): argument {a} and output {o} have different pytree structures"
            )
        (a0, a1), (o0, _) = args[a], outs[o]
        for k in range(a1 - a0):
            if tuple(traced.in_avals[a0 + k].shape) != tuple(traced.out_avals[o0 + k].shape):
                raise ShardsolveError(f"carry pair ({a}, {o}): leaf {k} changes shape between argument and output")
            pairs.append((a0 + k, o0 + k))
    return pairs
