"""Run one rule's strategy on local shards, inside ``jax.shard_map``.

``run_local`` is what the rewriter (``shardsolve.lower``) calls for every
equation: each operand arrives as its local shard laid out as
``strategy.operands[k]`` (a partial operand holds one summand), and each
result leaves laid out as ``strategy.results[k]`` (a partial result holds its
summand, or its max/min candidate). No collective is issued here: pending
reductions are the rewriter's to resolve.

Most primitives simply re-bind with their shape-carrying parameters made
local; layout requests (``sharding_constraint``, ``device_put``) pass their
shards through. For ``broadcast_in_dim`` of ``f32[8] -> f32[8, 4]`` under
``[{}, {x}]`` on ``x=2`` the local call is ``broadcast_in_dim(shape=(8, 2))``.
The others:

- ``iota`` adds the shard's offset along a split ``dimension``; ``iota_2x32_shape``
  (the PRNG's counters) computes its elements' global flat indices;
- ``slice``/``dynamic_slice`` take the whole local extent of passed-through dims;
  along a split dimension the slice is narrower than, they read the slice's
  elements this device holds and zeros elsewhere (a partial sum);
- ``dynamic_update_slice`` writes in place unless another operation reads
  its operand's buffer (``in_place=False``): then it selects the update,
  placed in a fresh buffer, over the operand; along a split dimension the
  update is narrower than, each device selects the update's elements that
  land in its stretch;
- ``gather`` with a split indexed dimension looks up only the indices in the
  shard's range (shifted by the shard's offset) and writes zeros elsewhere;
  ``FILL_OR_DROP`` fill values are written by one device of the partial group;
- ``scatter-add`` (and every other scatter) with a split indexed dimension drops
  updates outside the shard's rows; when its index batch factors are split
  (``scatter-add``/``-sub`` only), one device of each group keeps the operand
  and the others start from zeros;
- ``conv_general_dilated`` with split groups convolves the local ones
  (``feature_group_count`` from the local shapes).

Uneven splits: a dimension split into parts that do not divide it arrives
padded to ``ceil(n / shards)`` per shard, the padding past its end holding
unspecified values. Where that dimension carries a *reduction* factor, its
padding is first set to the reduction's identity in every operand (0 for a
sum or a contraction, -inf for a max, +inf for a min), so ``f32[10] @ f32[10]``
contracted over 4 shards of 3 sums exactly the 10 products. Padding elsewhere
stays padding: pointwise work on it is wasted, never read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shardsolve.graph import OpView
from shardsolve.mesh import MeshSpec
from shardsolve.rules.base import Rule, Strategy

AxisIndex = Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class LocalCall:
    """Everything a local kernel needs besides the operand shards."""

    op: OpView
    rule: Rule
    strategy: Strategy
    mesh: MeshSpec
    axis_index: AxisIndex
    in_place: bool = True  # no other operation reads the first operand: an update may overwrite it

    def out_local_shape(self, k: int = 0) -> tuple[int, ...]:
        return self.strategy.results[k].local_shape(self.op.out_shapes[k], self.mesh)

    def shard_index(self, axes: Sequence[str]):
        """Linear index of this device's shard along ``axes`` (major to minor)."""
        import jax.numpy as jnp

        idx = jnp.int32(0)
        for a in axes:
            idx = idx * self.mesh.axis(a).size + self.axis_index(a)
        return idx

    def is_first(self, axes: Sequence[str]):
        """True on the devices whose index along every one of ``axes`` is 0."""
        import jax.numpy as jnp

        out = jnp.bool_(True)
        for a in axes:
            out = out & (self.axis_index(a) == 0)
        return out

    def bind(self, operands: Sequence[Any], **changes: Any) -> list[Any]:
        prim = self.op.prim
        if prim is None:
            raise ValueError(f"OpView of {self.op.primitive!r} carries no primitive; set OpView.prim to run it on shards")
        params = _local_params(self.op.params)
        params.update(changes)
        out = prim.bind(*operands, **prim.get_bind_params(params))  # (a primitive with a body: as JAX binds it)
        return list(out) if prim.multiple_results else [out]


def _local_params(params: dict) -> dict:
    """The equation's parameters with global sharding annotations dropped."""
    out = dict(params)
    for key in ("sharding", "out_sharding"):
        if key in out:
            out[key] = None
    return out


Kernel = Callable[[LocalCall, list], list]


def run_local(
    op: OpView,
    rule: Rule,
    strategy: Strategy,
    mesh: MeshSpec,
    operands: list,
    axis_index: AxisIndex,
    *,
    clear_padding: bool = True,
    in_place: bool = True,
) -> list:
    """Each result's local shard, from each operand's local shard (see the module docstring).

    ``clear_padding=False`` leaves the padding of unevenly split reduction
    factors as it is (for the validator's own test: a reduction then sums it).
    ``in_place=False`` says another operation of the program reads the first
    operand as well (``dynamic_update_slice`` then writes a fresh buffer).
    """
    kernel = KERNELS.get(op.primitive, _rebind)
    if clear_padding:
        operands = _clear_reduced_padding(op, rule, strategy, mesh, list(operands), axis_index)
    return kernel(LocalCall(op, rule, strategy, mesh, axis_index, in_place), operands)


def _clear_reduced_padding(op: OpView, rule: Rule, strategy: Strategy, mesh: MeshSpec, operands: list,
                           axis_index: AxisIndex) -> list:
    """Set the padding of unevenly split reduction factors to the reduction's identity."""
    reduced = {f for f in rule.reduction if strategy.axes_of(f) and rule.size(f) % mesh.group_size(strategy.axes_of(f))}
    if not reduced:
        return operands
    out = []
    for k, x in enumerate(operands):
        dims = rule.operands[k] if k < len(rule.operands) else ()
        for d, factors in enumerate(dims):
            if reduced & set(factors) and hasattr(x, "ndim") and x.ndim == len(dims):
                x = fill_padding(x, d, op.in_shapes[k][d], strategy.operands[k].dims[d], mesh, axis_index,
                                 identity(rule.reduce_op, x.dtype))
        out.append(x)
    return out


def identity(reduce_op: str, dtype: Any) -> Any:
    """The identity of a ``sum``/``max``/``min`` reduction in ``dtype``."""
    import jax.numpy as jnp

    if reduce_op == "sum":
        return 0
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if reduce_op == "max" else jnp.inf
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.min if reduce_op == "max" else info.max
    return reduce_op == "min"  # bool: max identity False, min identity True


def fill_padding(x: Any, d: int, size: int, axes: Sequence[str], mesh: MeshSpec, axis_index: AxisIndex, value: Any):
    """Set the elements of the local shard ``x`` past the end of global dimension ``d`` (of ``size``) to ``value``.

    ``axes`` split dimension ``d`` (major to minor); each shard holds ``x.shape[d]`` elements.
    """
    import jax
    import jax.numpy as jnp

    if not axes or size % mesh.group_size(axes) == 0:
        return x
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh.axis(a).size + axis_index(a)
    pos = idx * x.shape[d] + jax.lax.broadcasted_iota(jnp.int32, x.shape, d)
    return jnp.where(pos < size, x, jnp.asarray(value, x.dtype))


# -- kernels --------------------------------------------------------------


def _rebind(call: LocalCall, operands: list) -> list:
    return call.bind(operands)


def _layout_only(call: LocalCall, operands: list) -> list:
    """``sharding_constraint``/``device_put``: layout requests; the plan has laid the shards out already."""
    return list(operands)


def _broadcast_in_dim(call: LocalCall, operands: list) -> list:
    return call.bind(operands, shape=call.out_local_shape())


def _reshape(call: LocalCall, operands: list) -> list:
    return call.bind(operands, new_sizes=call.out_local_shape())


def _iota(call: LocalCall, operands: list) -> list:
    import jax.numpy as jnp

    shape = call.out_local_shape()
    dim = call.op.params["dimension"]
    (out,) = call.bind(operands, shape=shape)
    axes = call.strategy.results[0].dims[dim]
    if axes:
        out = out + (call.shard_index(axes) * shape[dim]).astype(out.dtype)
    return [jnp.asarray(out)]


def _iota_2x32_shape(call: LocalCall, operands: list) -> list:
    """The flat indices of the shard's elements in the global array (they fit in the low word: see the rule)."""
    import jax
    import jax.numpy as jnp

    shape, local = call.op.out_shapes[0], call.out_local_shape()
    flat = jnp.zeros(local, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = jax.lax.broadcasted_iota(jnp.uint32, local, d)
        axes = call.strategy.results[0].dims[d]
        if axes:
            index = index + (call.shard_index(axes) * local[d]).astype(jnp.uint32)
        flat = flat + index * jnp.uint32(stride)
        stride *= shape[d]
    return [jnp.zeros(local, jnp.uint32), flat]


def _slice(call: LocalCall, operands: list) -> list:
    """Passed-through split dimensions taken whole; a split dimension sliced narrower: the slice's elements this
    device holds, zeros elsewhere (the rule's partial sum)."""
    op = call.op
    shape, out = op.in_shapes[0], op.out_shapes[0]
    x = operands[0]
    local = x.shape
    starts, limits = list(op.params["start_indices"]), list(op.params["limit_indices"])
    strides = list(op.params.get("strides") or (1,) * len(shape))
    masked = False
    for d, axes in enumerate(call.strategy.operands[0].dims):
        if not axes:
            continue
        if starts[d] == 0 and limits[d] == shape[d] and strides[d] == 1:  # passed through: take all of it
            limits[d] = local[d]
            continue
        import jax.numpy as jnp

        offset = call.shard_index(axes) * local[d]
        x = _masked_take(x, starts[d] + strides[d] * jnp.arange(out[d], dtype=jnp.int32) - offset, d)
        starts[d], limits[d], strides[d], masked = 0, out[d], 1, True
    if not masked:
        return call.bind(operands, limit_indices=tuple(limits))
    from jax import lax

    return [lax.slice(x, tuple(starts), tuple(limits), tuple(strides))]


def _windowed_split(call: LocalCall) -> list[int]:
    """The dimensions a ``dynamic_slice``/``dynamic_update_slice`` window (or update) is narrower than, which
    its operand's strategy splits."""
    op = call.op
    shape = op.in_shapes[0]
    window = op.params["slice_sizes"] if op.primitive == "dynamic_slice" else op.in_shapes[1]
    dims = call.strategy.operands[0].dims
    return [d for d in range(len(shape)) if dims[d] and window[d] < shape[d]]


def _stretch(call: LocalCall, d: int, start: Any, width: int, local: int):
    """Along split dimension ``d`` of the operand: the start of the window of ``width`` (clamped as JAX clamps
    it) and the position of this device's stretch of ``local`` elements."""
    import jax.numpy as jnp

    n = call.op.in_shapes[0][d]
    start = jnp.clip(start.astype(jnp.int32), 0, n - width)
    offset = call.shard_index(call.strategy.operands[0].dims[d]) * local
    return start, offset


def _along(mask: Any, d: int, ndim: int):
    """A 1-D ``mask`` shaped to broadcast along dimension ``d`` of an array of ``ndim`` dimensions."""
    return mask.reshape(tuple(-1 if k == d else 1 for k in range(ndim)))


def _masked_take(x: Any, at: Any, d: int) -> Any:
    """The elements of ``x`` at local positions ``at`` along dimension ``d``, zeros where ``at`` falls outside
    this device's stretch (a masked lookup: the partial sum of a slice along a split dimension)."""
    import jax.numpy as jnp

    local = x.shape[d]
    held = (at >= 0) & (at < local)
    x = jnp.take(x, jnp.clip(at, 0, local - 1), axis=d)
    return jnp.where(_along(held, d, x.ndim), x, jnp.zeros((), x.dtype))


def _dynamic_slice(call: LocalCall, operands: list) -> list:
    """Split dimensions narrower than the window: the window's elements this device holds, zeros elsewhere
    (the rule's partial sum); the others sliced as usual."""
    split = _windowed_split(call)
    if not split:
        return call.bind(operands, slice_sizes=call.out_local_shape())
    import jax.numpy as jnp
    from jax import lax

    operand, *starts = operands
    sizes = call.op.params["slice_sizes"]
    x = operand
    for d in split:
        start, offset = _stretch(call, d, starts[d], sizes[d], operand.shape[d])
        x = _masked_take(x, start + jnp.arange(sizes[d], dtype=jnp.int32) - offset, d)
    rest = [jnp.zeros((), s.dtype) if d in split else s for d, s in enumerate(starts)]
    return [lax.dynamic_slice(x, rest, call.out_local_shape())]


def _dynamic_update_slice(call: LocalCall, operands: list) -> list:
    """In place when nothing else reads the operand; else a select of the placed update over the operand.

    XLA (CPU, jax 0.10.2) fuses ``dynamic_slice(u, i)`` into an in-place
    ``dynamic_update_slice(u, f(slice), j)`` when ``u`` reaches the update
    through a bitcast (a shard of an all-to-all, for one), and overwrites rows
    the slice still reads where ``i < j`` overlap. Writing the update into
    fresh buffers and selecting leaves ``u`` read-only, with the same clamped
    start indices.
    """
    split = _windowed_split(call)
    if split:
        return [_update_split(call, operands, split)]
    if call.in_place:
        return call.bind(operands)
    import jax.numpy as jnp
    from jax import lax

    operand, update, *starts = operands
    inside = lax.dynamic_update_slice(jnp.zeros(operand.shape, bool), jnp.ones(update.shape, bool), starts)
    placed = lax.dynamic_update_slice(jnp.zeros(operand.shape, operand.dtype), update, starts)
    return [jnp.where(inside, placed, operand)]


def _update_split(call: LocalCall, operands: list, split: list[int]):
    """``dynamic_update_slice`` into an operand split along dimensions the update is narrower than: along each,
    the update's elements for this device's positions (taken where the update covers them), then placed along
    the other dimensions as usual and selected over the operand."""
    import jax.numpy as jnp
    from jax import lax

    operand, update, *starts = operands
    widths = call.op.in_shapes[1]
    covered = jnp.ones((), bool)
    for d in split:
        local = operand.shape[d]
        start, offset = _stretch(call, d, starts[d], widths[d], local)
        at = offset + jnp.arange(local, dtype=jnp.int32) - start
        inside = (at >= 0) & (at < widths[d])
        update = jnp.take(update, jnp.clip(at, 0, widths[d] - 1), axis=d)
        covered = covered & _along(inside, d, operand.ndim)
    rest = [jnp.zeros((), s.dtype) if d in split else s for d, s in enumerate(starts)]
    placed = lax.dynamic_update_slice(jnp.zeros(operand.shape, operand.dtype), update, rest)
    inside = lax.dynamic_update_slice(jnp.zeros(operand.shape, bool), jnp.broadcast_to(covered, update.shape), rest)
    return jnp.where(inside, placed, operand)


def _mode_name(mode: Any) -> str:
    return getattr(mode, "name", str(mode)).upper()


def _default_fill(dtype: Any) -> Any:
    import jax.numpy as jnp
    import numpy as np

    if jnp.issubdtype(dtype, jnp.inexact):
        return np.nan
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return jnp.iinfo(dtype).min
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return jnp.iinfo(dtype).max
    return True


def _gather(call: LocalCall, operands: list) -> list:
    import jax.numpy as jnp
    from jax import lax

    operand, indices = operands
    op = call.op
    dn = op.params["dimension_numbers"]
    in_sh, out_sh = call.strategy.operands[0], call.strategy.results[0]
    global_shape, local_shape = op.in_shapes[0], operand.shape
    global_sizes = tuple(op.params["slice_sizes"])
    slice_sizes = list(global_sizes)
    for d, axes in enumerate(in_sh.dims):
        if axes and global_sizes[d] == global_shape[d]:  # a passed-through dimension
            slice_sizes[d] = local_shape[d]
    # split indexed dims with a one-element window (full windows pass through, starting at 0)
    split_indexed = {d for d in dn.start_index_map if in_sh.dims[d] and global_sizes[d] < global_shape[d]}
    fill_mode = _mode_name(op.params["mode"]) == "FILL_OR_DROP"
    if not split_indexed and not (fill_mode and out_sh.partial):
        return call.bind(operands, slice_sizes=tuple(slice_sizes))

    keep = jnp.ones(indices.shape[:-1], bool)
    oob = jnp.zeros(indices.shape[:-1], bool)
    cols = []
    for k, d in enumerate(dn.start_index_map):
        col = indices[..., k]
        hi = global_shape[d] - global_sizes[d]
        if fill_mode:
            oob = oob | (col < 0) | (col > hi)
        col = jnp.clip(col, 0, hi)
        if d in split_indexed:
            n_local = local_shape[d]
            col = col - (call.shard_index(in_sh.dims[d]) * n_local).astype(col.dtype)
            keep = keep & (col >= 0) & (col < n_local)
            col = jnp.clip(col, 0, n_local - 1)
        cols.append(col)
    local_indices = jnp.stack(cols, axis=-1).astype(indices.dtype)
    (out,) = call.bind(
        [operand, local_indices],
        slice_sizes=tuple(slice_sizes),
        mode=lax.GatherScatterMode.CLIP,
        fill_value=None,
    )
    batch_positions = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)

    def spread(mask):
        return lax.broadcast_in_dim(mask, out.shape, batch_positions)

    if fill_mode:
        keep = keep & ~oob
    out = jnp.where(spread(keep), out, jnp.zeros((), out.dtype))
    if fill_mode:
        fill = op.params.get("fill_value")
        fill = _default_fill(out.dtype) if fill is None else fill
        out = jnp.where(spread(oob) & call.is_first(out_sh.partial), jnp.asarray(fill, out.dtype), out)
    return [out]


def _scatter_add(call: LocalCall, operands: list) -> list:
    import jax.numpy as jnp
    from jax import lax

    operand, indices, updates = operands
    op = call.op
    dn = op.params["dimension_numbers"]
    in_sh, out_sh = call.strategy.operands[0], call.strategy.results[0]
    changes: dict[str, Any] = {}
    zero_axes = [a for a in out_sh.partial if a not in in_sh.partial]
    if zero_axes:  # split scatter (index batch) factors: count the operand once per group
        operand = jnp.where(call.is_first(zero_axes), operand, jnp.zeros((), operand.dtype))
    split_indexed = {d for d in dn.scatter_dims_to_operand_dims if in_sh.dims[d]}
    if split_indexed:
        global_shape, local_shape = op.in_shapes[0], operand.shape
        window_dims = [
            d for d in range(len(global_shape)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
        ]
        window = {d: op.in_shapes[2][u] for d, u in zip(window_dims, dn.update_window_dims)}
        clip = _mode_name(op.params["mode"]) == "CLIP"
        cols = []
        for k, d in enumerate(dn.scatter_dims_to_operand_dims):
            col = indices[..., k]
            if clip:
                col = jnp.clip(col, 0, global_shape[d] - window.get(d, 1))
            if d in split_indexed:
                col = col - (call.shard_index(in_sh.dims[d]) * local_shape[d]).astype(col.dtype)
            cols.append(col)
        indices = jnp.stack(cols, axis=-1).astype(indices.dtype)
        changes["mode"] = lax.GatherScatterMode.FILL_OR_DROP  # drop updates outside this shard
    return call.bind([operand, indices, updates], **changes)


def _conv(call: LocalCall, operands: list) -> list:
    """A grouped convolution convolves the local groups: the local input features over the kernel's per group."""
    groups = call.op.params.get("feature_group_count", 1)
    if groups == 1:
        return call.bind(operands)
    dn = call.op.params["dimension_numbers"]
    lhs, rhs = operands
    return call.bind(operands, feature_group_count=lhs.shape[dn.lhs_spec[1]] // rhs.shape[dn.rhs_spec[1]])


KERNELS: dict[str, Kernel] = {
    "sharding_constraint": _layout_only,
    "device_put": _layout_only,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "iota": _iota,
    "iota_2x32_shape": _iota_2x32_shape,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "gather": _gather,
    "scatter-add": _scatter_add,
    "scatter_add": _scatter_add,
    **{name: _scatter_add for kind in ("sub", "mul", "min", "max") for name in (f"scatter-{kind}", f"scatter_{kind}")},
    "scatter": _scatter_add,
    "conv_general_dilated": _conv,
}
