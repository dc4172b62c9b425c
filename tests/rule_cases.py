"""Representative equations of every rule family, shared by the numeric tests
and ``experiments/validate_rules.py``.

Each case is a small JAX function, example arguments, the primitive whose
(first) equation to check, and the range integer operands are drawn from
(indices). Shapes are small and split evenly over 8 devices where it matters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lax import linalg as _lax_linalg


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    primitive: str
    int_range: tuple[int, int] = (0, 4)
    rtol: float = 1e-4
    atol: float = 1e-4
    index: int = 0
    family: str = field(default="")


def prng_counters(shape: tuple[int, ...]):
    """``iota_2x32_shape``: the counters ``jax.random`` hashes (reached only through JAX's PRNG internals)."""
    from jax._src.random.prng import iota_2x32_shape

    return iota_2x32_shape(shape)


def u32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.uint32)


def f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def b1(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.bool_)


_take_along = lambda x, i: jnp.take_along_axis(x, i, axis=-1)  # noqa: E731


def _conv(x, w, stride: int, padding: str, groups: int = 1):
    return lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


def _pool(x, init, op):
    return lax.reduce_window(x, init, op, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

CASES: list[Case] = [
    # elementwise
    Case("add", lambda a, b: a + b, (f32(8, 4), f32(8, 4)), "add", family="elementwise"),
    Case("add_literal", lambda a: a + 1.0, (f32(8, 4),), "add", family="elementwise"),
    Case("zeta", lambda a: jax.scipy.special.zeta(a * a + 2, a * a + 1), (f32(8, 4),), "zeta", rtol=1e-3, family="elementwise"),
    Case("mul_scalar_operand", lambda a, s: a * s, (f32(8, 4), f32()), "mul", family="elementwise"),
    Case("mul_size1_broadcast", lambda a, s: lax.mul(a, s), (f32(8, 4), f32(1, 1)), "mul", family="elementwise"),
    Case("sub_scalars", lambda a, b: a - b, (f32(), f32()), "sub", family="elementwise"),
    Case("div", lambda a, b: a / b, (f32(8, 4), f32(8, 4)), "div", family="elementwise"),
    Case("neg", lambda a: -a, (f32(2, 8, 4),), "neg", family="elementwise"),
    Case("max", lambda a, b: jnp.maximum(a, b), (f32(8, 4), f32(8, 4)), "max", family="elementwise"),
    Case("exp", jnp.exp, (f32(8, 4),), "exp", family="elementwise"),
    Case("tanh", jnp.tanh, (f32(8, 4),), "tanh", family="elementwise"),
    Case("logistic", jax.nn.sigmoid, (f32(8, 4),), "logistic", family="elementwise"),
    Case("integer_pow", lambda a: a**3, (f32(8, 4),), "integer_pow", rtol=1e-3, family="elementwise"),
    Case("select_n", lambda p, a, b: lax.select(p, a, b), (b1(8, 4), f32(8, 4), f32(8, 4)), "select_n", family="elementwise"),
    Case("select_n_scalar_pred", lambda p, a, b: lax.select_n(p, a, b), (b1(), f32(8, 4), f32(8, 4)), "select_n", family="elementwise"),
    Case("convert_bf16", lambda a: a.astype(jnp.bfloat16), (f32(8, 4),), "convert_element_type", rtol=2e-2, atol=5e-2, family="elementwise"),
    Case("convert_int", lambda a: a.astype(jnp.int32), (f32(8, 4),), "convert_element_type", family="elementwise"),
    Case("clamp", lambda lo, a, hi: lax.clamp(lo, a, hi), (f32(), f32(8, 4), f32()), "clamp", family="elementwise"),
    Case("eq", lambda a, b: a == b, (i32(8, 4), i32(8, 4)), "eq", family="elementwise"),
    Case("and", lambda a, b: a & b, (b1(8, 4), b1(8, 4)), "and", family="elementwise"),
    # structural
    Case("broadcast_rank1", lambda a: jnp.broadcast_to(a[:, None], (8, 4)), (f32(8),), "broadcast_in_dim", family="structural"),
    Case("broadcast_size1", lambda a: lax.broadcast_in_dim(a, (8, 4), (0, 1)), (f32(8, 1),), "broadcast_in_dim", family="structural"),
    Case("broadcast_scalar", lambda a: jnp.broadcast_to(a, (8, 4)), (f32(),), "broadcast_in_dim", family="structural"),
    Case("reshape_split", lambda a: a.reshape(4, 8), (f32(32),), "reshape", family="structural"),
    Case("reshape_merge", lambda a: a.reshape(32), (f32(4, 8),), "reshape", family="structural"),
    Case("reshape_heads", lambda a: a.reshape(2, 8, 4, 2), (f32(2, 8, 8),), "reshape", family="structural"),
    Case("reshape_general", lambda a: a.reshape(2, 16), (f32(8, 4),), "reshape", family="structural"),
    Case("reshape_mismatch", lambda a: a.reshape(4, 6), (f32(6, 4),), "reshape", family="structural"),
    Case("reshape_size1", lambda a: a.reshape(8, 4), (f32(8, 1, 4),), "reshape", family="structural"),
    Case("transpose", lambda a: a.transpose(2, 0, 1), (f32(2, 8, 4),), "transpose", family="structural"),
    Case("squeeze", lambda a: a.squeeze(1), (f32(8, 1, 4),), "squeeze", family="structural"),
    Case("expand_dims", lambda a: jnp.expand_dims(a, 1), (f32(8, 4),), "broadcast_in_dim", family="structural"),
    Case("slice", lambda a: a[:, 1:3], (f32(8, 4),), "slice", family="structural"),
    Case("slice_rows", lambda a: a[1:7:2], (f32(16, 4),), "slice", family="structural"),
    Case("slice_first_token", lambda a: a[:, 0], (f32(4, 16, 8),), "slice", family="structural"),
    Case("pad", lambda a: jnp.pad(a, ((0, 0), (1, 2))), (f32(8, 4),), "pad", family="structural"),
    Case("rev", lambda a: a[:, ::-1], (f32(8, 4),), "rev", family="structural"),
    Case("concatenate", lambda a, b: jnp.concatenate([a, b], 1), (f32(8, 4), f32(8, 2)), "concatenate", family="structural"),
    Case("split", lambda a: jnp.split(a, 2, axis=1), (f32(8, 4),), "split", family="structural"),
    Case("stack", lambda a, b: jnp.stack([a, b], 1), (f32(8, 4), f32(8, 4)), "stack", family="structural"),
    Case("unstack", lambda a: jax.lax.unstack(a, 1), (f32(8, 2, 4),), "unstack", family="structural"),
    Case("dynamic_slice", lambda a, i: lax.dynamic_slice(a, (0, i), (8, 2)), (f32(8, 4), i32()), "dynamic_slice", family="structural"),
    Case(
        "dynamic_update_slice",
        lambda a, u, i: lax.dynamic_update_slice(a, u, (0, i)),
        (f32(8, 4), f32(8, 2), i32()),
        "dynamic_update_slice",
        family="structural",
    ),
    # windows narrower than a dimension split over devices (starts drawn out of range too: JAX clamps them)
    Case("dynamic_slice_window", lambda a, i: lax.dynamic_slice(a, (0, i), (4, 3)), (f32(4, 16), i32()),
         "dynamic_slice", int_range=(-3, 20), family="structural"),
    Case("dynamic_slice_window_2d", lambda a, i, j: lax.dynamic_slice(a, (i, j), (3, 2)), (f32(16, 8), i32(), i32()),
         "dynamic_slice", int_range=(-3, 20), family="structural"),
    Case("dynamic_update_window", lambda a, u, i: lax.dynamic_update_slice(a, u, (0, i)),
         (f32(4, 16), f32(4, 3), i32()), "dynamic_update_slice", int_range=(-3, 20), family="structural"),
    Case("dynamic_update_cache", lambda c, u, i: lax.dynamic_update_slice(c, u, (0, i, 0)),
         (f32(2, 16, 4), f32(2, 1, 4), i32()), "dynamic_update_slice", int_range=(-3, 20), family="structural"),
    Case("dynamic_update_window_2d", lambda a, u, i, j: lax.dynamic_update_slice(a, u, (i, j)),
         (f32(16, 8), f32(3, 2), i32(), i32()), "dynamic_update_slice", int_range=(-3, 20), family="structural"),
    Case("iota", lambda a: a + lax.broadcasted_iota(jnp.int32, (8, 4), 0), (i32(8, 4),), "iota", family="structural"),
    Case("iota_minor", lambda a: a + lax.broadcasted_iota(jnp.int32, (4, 8), 1), (i32(4, 8),), "iota", family="structural"),
    Case("iota_2x32_shape", lambda a: a + prng_counters((8, 4, 6))[1], (u32(8, 4, 6),), "iota_2x32_shape",
         family="structural"),
    # contraction
    Case("matmul", lambda a, b: a @ b, (f32(8, 4), f32(4, 8)), "dot_general", family="contraction"),
    # ragged_dot: 16 rows in 4 consecutive groups of at most 4 (a mixture of experts' sorted tokens), and its gradients
    Case("ragged_dot", lax.ragged_dot, (f32(16, 8), f32(4, 8, 8), i32(4)), "ragged_dot_general", int_range=(0, 5),
         family="contraction"),
    Case("ragged_dot_weight_grad", jax.grad(lambda b, a, g: (lax.ragged_dot(a, b, g) ** 2).sum()),
         (f32(4, 8, 8), f32(16, 8), i32(4)), "ragged_dot_general", int_range=(0, 5), index=1, family="contraction"),
    Case("ragged_dot_input_grad", jax.grad(lambda a, b, g: (lax.ragged_dot(a, b, g) ** 2).sum()),
         (f32(16, 8), f32(4, 8, 8), i32(4)), "ragged_dot_general", int_range=(0, 5), index=1, family="contraction"),
    Case("batch_matmul", lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (f32(2, 4, 8), f32(2, 8, 4)), "dot_general", family="contraction"),
    Case("dot_outer", lambda a, b: jnp.einsum("bsd,bte->bst", a, b), (f32(2, 4, 2), f32(2, 4, 2)), "dot_general", family="contraction"),
    # reductions
    Case("reduce_sum", lambda a: a.sum(1), (f32(8, 8),), "reduce_sum", family="reduction"),
    Case("reduce_sum_all", lambda a: a.sum(), (f32(8, 4),), "reduce_sum", family="reduction"),
    Case("reduce_max", lambda a: a.max(0), (f32(8, 4),), "reduce_max", family="reduction"),
    Case("approx_top_k", lambda a: lax.approx_max_k(a, 2), (f32(8, 16),), "approx_top_k", family="reduction"),
    Case("reduce_general", lambda a, b: lax.reduce((a, b), (0.0, -jnp.inf), lambda x, y: (x[0] + y[0], jnp.maximum(x[1], y[1])),
                                                   (1,)), (f32(8, 4), f32(8, 4)), "reduce", family="reduction"),
    Case("reduce_min", lambda a: a.min(1), (f32(4, 8),), "reduce_min", family="reduction"),
    Case("argmax", lambda a: jnp.argmax(a, 1), (f32(8, 4),), "argmax", family="reduction"),
    Case("cumsum", lambda a: jnp.cumsum(a, 1), (f32(8, 4),), "cumsum", family="reduction"),
    Case("cummax", lambda a: lax.cummax(a, 0), (f32(8, 4),), "cummax", family="reduction"),
    Case("sort", lambda a: jnp.sort(a, 1), (f32(8, 4),), "sort", family="reduction"),
    Case("top_k", lambda a: lax.top_k(a, 2), (f32(8, 4),), "top_k", family="reduction"),
    # indexing
    Case("embedding", lambda w, t: w[t], (f32(16, 8), i32(4, 8)), "gather", int_range=(0, 16), family="indexing"),
    Case("embedding_oob", lambda w, t: w[t], (f32(16, 8), i32(4, 8)), "gather", int_range=(-3, 20), family="indexing"),
    Case("take_clip", lambda w, t: jnp.take(w, t, axis=0, mode="clip"), (f32(16, 8), i32(8)), "gather", int_range=(-3, 20), family="indexing"),
    Case(
        "take_fill_zero",
        lambda w, t: w.at[t].get(mode="fill", fill_value=0.0),
        (f32(16, 8), i32(8)),
        "gather",
        int_range=(-3, 20),
        family="indexing",
    ),
    Case(
        "gather_window",
        jax.vmap(lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, axis=0), in_axes=(None, 0)),
        (f32(16, 8), i32(8)),
        "gather",
        int_range=(-3, 20),
        family="indexing",
    ),
    Case("take_along_axis", _take_along, (f32(2, 4, 8), i32(2, 4, 1)), "gather", int_range=(-1, 9), family="indexing"),
    Case(
        "embedding_grad",
        jax.grad(lambda w, t: (w[t] ** 2).sum()),
        (f32(16, 8), i32(4, 8)),
        "scatter-add",
        int_range=(0, 16),
        family="indexing",
    ),
    Case(
        "scatter_add_clip",
        lambda w, t, u: w.at[t].add(u, mode="clip"),
        (f32(16, 8), i32(8), f32(8, 8)),
        "scatter-add",
        int_range=(-3, 20),
        family="indexing",
    ),
    *(Case(f"scatter_{kind}", fn, (f32(16, 8), i32(8), f32(8, 8)), prim, int_range=(-3, 20), family="indexing")
      for kind, fn, prim in (
          ("set", lambda w, t, u: w.at[t].set(u), "scatter"),
          ("set_rows", lambda w, t, u: w.at[jnp.arange(16)[:, None], t[None, :] % 8].set(1.0), "scatter"),
          ("mul", lambda w, t, u: w.at[t].multiply(u), "scatter-mul"),
          ("max", lambda w, t, u: w.at[t].max(u), "scatter-max"),
          ("sub", lambda w, t, u: w.at[t].subtract(u), "scatter-sub"),
      )),
    Case(
        "take_along_axis_grad",
        jax.grad(lambda x, i: _take_along(x, i).sum()),
        (f32(2, 4, 8), i32(2, 4, 1)),
        "scatter-add",
        int_range=(-1, 9),
        family="indexing",
    ),
    # batched linear algebra: a stack of matrices, one factorisation each
    Case("cholesky", jnp.linalg.cholesky, (f32(8, 4, 4),), "cholesky", family="linalg"),
    Case("eigh", jnp.linalg.eigh, (f32(8, 4, 4),), "eigh", rtol=1e-3, atol=1e-3, family="linalg"),
    Case("qr", jnp.linalg.qr, (f32(8, 6, 4),), "qr", rtol=1e-3, atol=1e-3, family="linalg"),
    Case("svd", jnp.linalg.svd, (f32(8, 4, 6),), "svd", rtol=1e-3, atol=1e-3, family="linalg"),
    Case("lu", lax.linalg.lu, (f32(8, 4, 4),), "lu", rtol=1e-3, atol=1e-3, family="linalg"),
    Case("triangular_solve", lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
         (f32(8, 4, 4), f32(8, 4, 2)), "triangular_solve", rtol=1e-3, atol=1e-3, family="linalg"),
    *(Case(name, fn, (f32(8, 4, 4),), name, rtol=1e-3, atol=1e-3, family="linalg") for name, fn in (
        ("eig", lambda a: lax.linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=False)),
        ("hessenberg", lambda a: _lax_linalg.hessenberg(a)),
        ("geqrf", lambda a: _lax_linalg.geqrf(a)),
        ("householder_product", lambda a: _lax_linalg.householder_product(a, a[..., 0])),
        ("tridiagonal_solve", lambda a: _lax_linalg.tridiagonal_solve(a[..., 0], a[..., 1], a[..., 2] + 4, a)),
    )),
    Case("rfft2", jnp.fft.rfft2, (f32(8, 4, 8, 8),), "fft", rtol=1e-3, atol=1e-3, family="linalg"),
    Case("irfft", lambda a: jnp.fft.irfft(a.astype(jnp.complex64) * 1j + a), (f32(8, 4, 5),), "fft", rtol=1e-3,
         atol=1e-3, family="linalg"),
    Case("fft_complex", lambda a: jnp.fft.fft(a.astype(jnp.complex64)), (f32(8, 16),), "fft", rtol=1e-3, atol=1e-3,
         family="linalg"),
    # windows: convolutions (NHWC images, HWIO kernels), pools and the max pool's gradient
    Case("conv_same", lambda x, w: _conv(x, w, 1, "SAME"), (f32(8, 4, 4, 8), f32(3, 3, 8, 8)), "conv_general_dilated", family="window"),
    Case("conv_strided", lambda x, w: _conv(x, w, 2, "SAME"), (f32(8, 4, 4, 8), f32(3, 3, 8, 8)), "conv_general_dilated", family="window"),
    Case("conv_1x1_strided", lambda x, w: _conv(x, w, 2, "VALID"), (f32(8, 8, 8, 8), f32(1, 1, 8, 8)), "conv_general_dilated", family="window"),
    Case("conv_patches", lambda x, w: _conv(x, w, 2, "VALID"), (f32(2, 16, 16, 2), f32(2, 2, 2, 8)), "conv_general_dilated", family="window"),
    Case("conv_input_grad", jax.grad(lambda x, w: _conv(x, w, 2, "SAME").sum()), (f32(8, 4, 4, 8), f32(3, 3, 8, 8)), "conv_general_dilated", index=1, family="window"),
    Case("conv_kernel_grad", jax.grad(lambda w, x: _conv(x, w, 1, "SAME").sum()), (f32(3, 3, 8, 8), f32(8, 4, 4, 8)), "conv_general_dilated", index=1, family="window"),
    Case("conv_depthwise_kernel_grad",
         jax.grad(lambda w, x: (_conv(x, w, 1, "SAME", groups=8) ** 2).sum()), (f32(3, 3, 1, 8), f32(8, 4, 4, 8)),
         "conv_general_dilated", index=1, family="window"),
    Case("conv_grouped", lambda x, w: _conv(x, w, 1, "SAME", groups=4), (f32(8, 4, 4, 16), f32(3, 3, 4, 16)), "conv_general_dilated", family="window"),
    Case("conv_depthwise", lambda x, w: _conv(x, w, 1, "SAME", groups=8), (f32(8, 4, 4, 8), f32(3, 3, 1, 8)), "conv_general_dilated", family="window"),
    Case("conv_uneven", lambda x, w: _conv(x, w, 1, "SAME"), (f32(6, 4, 4, 6), f32(3, 3, 6, 10)), "conv_general_dilated", family="window"),
    Case("conv_nchw", lambda x, w: lax.conv(x, w, (1, 1), "SAME"), (f32(8, 8, 4, 4), f32(8, 8, 3, 3)), "conv_general_dilated", family="window"),
    Case("max_pool", lambda x: _pool(x, -jnp.inf, lax.max), (f32(8, 8, 8, 8),), "reduce_window_max", family="window"),
    Case("min_pool", lambda x: _pool(x, jnp.inf, lax.min), (f32(8, 8, 8, 8),), "reduce_window_min", family="window"),
    Case("sum_pool", lambda x: _pool(x, 0.0, lax.add), (f32(8, 8, 8, 8),), "reduce_window_sum", family="window"),
    Case("sum_pool_overlapping", lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"), (f32(8, 4, 4, 8),), "reduce_window_sum", family="window"),
    Case("max_pool_grad", jax.grad(lambda x: (_pool(x, -jnp.inf, lax.max) ** 2).sum()), (f32(8, 8, 8, 8),), "select_and_scatter_add", family="window"),
]

MESHES = ("x=8", "a=2,b=4", "a=2,b=2,c=2")


def by_name(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def equation(case: Case):
    from shardsolve.rules.validate import find_equation

    return find_equation(case.fn, *case.args, primitive=case.primitive, index=case.index)
