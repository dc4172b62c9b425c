"""A small ResNet-style CNN training step: convolutions, pooling and residual blocks.

The network (images NHWC) is a 3x3 stem convolution, a 2x2 max pool, then
residual stages of two 3x3 convolutions each; every stage after the first
halves the resolution with a stride-2 first convolution and a 1x1 stride-2
projection of its shortcut. A global average pool, a dense head and softmax
cross-entropy over integer labels follow, trained with one SGD step::

    step(params, images, labels) -> (new_params, loss)

Parameters are a dict pytree: ``stem`` ``(3, 3, 3, w0)``; per stage ``s``
``s{s}a``/``s{s}b`` ``(3, 3, c_in, c)``, ``s{s}p`` ``(1, 1, c_in, c)`` where
the stage downsamples; ``head`` ``(c, classes)`` and ``head_b``. The forward
pass uses ``lax.conv_general_dilated`` and ``lax.reduce_window``, so its
gradient holds the transposed convolutions (input gradients with a dilated
input, kernel gradients contracting the batch) and ``select_and_scatter_add``
(the max pool's gradient).

Annotations (mesh axes ``("data", "model")``):

* ``in_shardings``: only the batch dimension of the images and labels is
  pinned to ``"data"``; the parameters are left free (``None``).
* ``expert_in_shardings``: data parallelism over every device, the usual way
  a CNN of this size is trained: the batch split over ``("data", "model")``
  and every parameter replicated (one gradient all-reduce).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from shardsolve import Model

# size -> (batch, image side, stage widths, classes).
SIZES: dict[str, tuple[int, int, tuple[int, ...], int]] = {
    "small": (16, 16, (8, 16), 16),
    "large": (256, 64, (64, 128, 256, 512), 1000),
}
LEARNING_RATE = 0.1
MESH_AXES = ("data", "model")
DIMENSIONS = ("NHWC", "HWIO", "NHWC")

Params = dict[str, jax.Array]


def conv(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    """``SAME``-padded convolution of NHWC images with an HWIO kernel."""
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=DIMENSIONS)


def max_pool(x: jax.Array) -> jax.Array:
    """2x2 max pool with stride 2 over the spatial dimensions."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def init_params(key: jax.Array, widths: tuple[int, ...], classes: int) -> Params:
    """He-scaled kernels, a zero head bias."""
    keys = iter(jax.random.split(key, 3 * len(widths) + 2))

    def kernel(k: int, c_in: int, c_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (k, k, c_in, c_out), jnp.float32) * jnp.sqrt(2.0 / (k * k * c_in))

    params: Params = {"stem": kernel(3, 3, widths[0])}
    c_in = widths[0]
    for s, c in enumerate(widths):
        params[f"s{s}a"] = kernel(3, c_in, c)
        params[f"s{s}b"] = kernel(3, c, c)
        if s > 0:
            params[f"s{s}p"] = kernel(1, c_in, c)
        c_in = c
    params["head"] = jax.random.normal(next(keys), (c_in, classes), jnp.float32) / jnp.sqrt(c_in)
    params["head_b"] = jnp.zeros((classes,), jnp.float32)
    return params


def forward(params: Params, images: jax.Array) -> jax.Array:
    """Logits ``(batch, classes)``."""
    h = max_pool(jax.nn.relu(conv(images, params["stem"])))
    s = 0
    while f"s{s}a" in params:
        stride = 1 if s == 0 else 2
        y = jax.nn.relu(conv(h, params[f"s{s}a"], stride))
        y = conv(y, params[f"s{s}b"])
        shortcut = conv(h, params[f"s{s}p"], stride) if s > 0 else h
        h = jax.nn.relu(y + shortcut)
        s += 1
    pooled = jnp.mean(h, axis=(1, 2))
    return pooled @ params["head"] + params["head_b"]


def loss_fn(params: Params, images: jax.Array, labels: jax.Array) -> jax.Array:
    logits = forward(params, images)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def train_step(params: Params, images: jax.Array, labels: jax.Array) -> tuple[Params, jax.Array]:
    """One SGD step: returns ``(new_params, loss)``."""
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    new_params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return new_params, loss


def _make_batch(key: jax.Array, batch: int, side: int, classes: int) -> tuple[jax.Array, jax.Array]:
    ki, kl = jax.random.split(key)
    images = jax.random.normal(ki, (batch, side, side, 3), jnp.float32)
    labels = jax.random.randint(kl, (batch,), 0, classes, jnp.int32)
    return images, labels


def cnn(size: str = "small") -> Model:
    """The CNN training step at ``size`` ("small": real arrays; "large": shapes only)."""
    batch, side, widths, classes = SIZES[size]
    key_params, key_batch = jax.random.split(jax.random.key(0))
    make_params = partial(init_params, widths=widths, classes=classes)
    make_batch = partial(_make_batch, batch=batch, side=side, classes=classes)
    if size == "small":
        params, (images, labels) = make_params(key_params), make_batch(key_batch)
    else:  # abstract evaluation: ShapeDtypeStructs, nothing allocated
        params, (images, labels) = jax.eval_shape(make_params, key_params), jax.eval_shape(make_batch, key_batch)

    replicated = {name: P() for name in params}
    everywhere = P(("data", "model"))
    return Model(
        fun=train_step,
        args=(params, images, labels),
        in_shardings=(None, P("data"), P("data")),
        out_shardings=None,
        name=f"cnn-{size}",
        description=(
            f"ResNet-style CNN training step ({len(widths)} stages of widths {widths}, {side}x{side} images, "
            f"batch {batch}, {classes} classes, max pool, SGD); "
            f"{sum(p.size for p in jax.tree.leaves(params)):,} parameters"
        ),
        expert_in_shardings=(replicated, everywhere, everywhere),
        expert_out_shardings=(replicated, P()),
        mesh_axes=MESH_AXES,
        carry=((0, 0),),
    )
