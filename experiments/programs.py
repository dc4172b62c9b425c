"""Training steps written outside ``models/``, in the shapes a new user brings: the planner's generality check.

Each program is a plain function ``step(params, batch) -> (new_params, loss)``
with ``jax.ShapeDtypeStruct`` arguments (nothing allocated) and only the batch
annotated (``P("data")``); ``PROGRAMS[name](size)`` returns ``(step, args,
in_shardings)`` at ``size`` "small" or "large". None of them has an expert
annotation or anything the planner was tuned on:

* ``vit``: a vision transformer, images patchified by reshape and transpose;
* ``gru``: a GRU over time steps with ``lax.scan``, a dense readout;
* ``mixer``: MLP-Mixer blocks (token mixing through transposes);
* ``twotower``: two embedding tables gathered (a bag of ids summed) and a
  contrastive loss over the batch;
* ``conv1d``: strided 1-D convolutions over raw audio, mean pooled.

``experiments/new_programs.py`` plans and compiles them; ``tests/test_new_programs.py`` keeps a small slice.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

f32 = jnp.float32
S = jax.ShapeDtypeStruct
BATCH = (P("data"), P("data"))


def sgd(loss: Callable) -> Callable:
    """One SGD step of ``loss(params, batch)``: ``(new_params, loss)``."""

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    return step


def layer_norm(x, gain, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * gain + bias


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def vit(size: str):
    """Patchify by reshape and transpose, pre-norm attention blocks, mean pool, classifier."""
    batch, side, patch, d, heads, depth, classes = (
        (256, 224, 16, 768, 12, 4, 1000) if size == "large" else (16, 32, 8, 64, 4, 2, 10))
    n = (side // patch) ** 2
    params = {"embed": S((patch * patch * 3, d), f32), "pos": S((n, d), f32), "head": S((d, classes), f32)}
    for i in range(depth):
        params[f"b{i}"] = {"qkv": S((d, 3 * d), f32), "o": S((d, d), f32), "up": S((d, 4 * d), f32),
                           "down": S((4 * d, d), f32), "g1": S((d,), f32), "b1": S((d,), f32),
                           "g2": S((d,), f32), "b2": S((d,), f32)}
    data = (S((batch, side, side, 3), f32), S((batch,), jnp.int32))

    def loss(p, data):
        x, y = data
        b = x.shape[0]
        x = x.reshape(b, side // patch, patch, side // patch, patch, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, n, -1)
        h = x @ p["embed"] + p["pos"]
        for i in range(depth):
            w = p[f"b{i}"]
            a = layer_norm(h, w["g1"], w["b1"])
            q, k, v = (t.reshape(b, n, heads, d // heads) for t in jnp.split(a @ w["qkv"], 3, -1))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d / heads)
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, n, d)
            h = h + o @ w["o"]
            a = layer_norm(h, w["g2"], w["b2"])
            h = h + jax.nn.gelu(a @ w["up"]) @ w["down"]
        return cross_entropy(h.mean(1) @ p["head"], y)

    return sgd(loss), (params, data), (None, BATCH)


def gru(size: str):
    """A GRU cell scanned over the time steps (``lax.scan``), the last state read out densely."""
    batch, steps, d, hidden = (512, 64, 1024, 2048) if size == "large" else (16, 8, 32, 64)
    params = {"wx": S((d, 3 * hidden), f32), "wh": S((hidden, 3 * hidden), f32), "b": S((3 * hidden,), f32),
              "out": S((hidden, d), f32)}
    data = (S((batch, steps, d), f32), S((batch, d), f32))

    def loss(p, data):
        x, y = data
        xs = jnp.einsum("btd,dh->tbh", x, p["wx"]) + p["b"]

        def cell(h, xt):
            hh = h @ p["wh"]
            z = jax.nn.sigmoid(xt[:, :hidden] + hh[:, :hidden])
            r = jax.nn.sigmoid(xt[:, hidden:2 * hidden] + hh[:, hidden:2 * hidden])
            c = jnp.tanh(xt[:, 2 * hidden:] + r * hh[:, 2 * hidden:])
            return (1 - z) * h + z * c, None

        h, _ = lax.scan(cell, jnp.zeros((x.shape[0], hidden), f32), xs)
        return jnp.mean((h @ p["out"] - y) ** 2)

    return sgd(loss), (params, data), (None, BATCH)


def mixer(size: str):
    """MLP-Mixer blocks: token mixing through transposes, then channel mixing."""
    batch, tokens, d, depth = (512, 196, 768, 4) if size == "large" else (16, 16, 32, 2)
    params = {f"l{i}": {"t1": S((tokens, 4 * tokens), f32), "t2": S((4 * tokens, tokens), f32),
                        "c1": S((d, 4 * d), f32), "c2": S((4 * d, d), f32)} for i in range(depth)}
    data = (S((batch, tokens, d), f32), S((batch, tokens, d), f32))

    def loss(p, data):
        x, y = data
        for i in range(depth):
            w = p[f"l{i}"]
            x = x + jnp.swapaxes(jax.nn.gelu(jnp.swapaxes(x, 1, 2) @ w["t1"]) @ w["t2"], 1, 2)
            x = x + jax.nn.gelu(x @ w["c1"]) @ w["c2"]
        return jnp.mean((x - y) ** 2)

    return sgd(loss), (params, data), (None, BATCH)


def twotower(size: str):
    """Two embedding tables (a bag of user ids summed, one item id), a contrastive loss over the batch."""
    vocab, d, batch, bag = (262144, 256, 4096, 16) if size == "large" else (512, 16, 32, 4)
    params = {"user": S((vocab, d), f32), "item": S((vocab, d), f32), "w": S((d, d), f32)}
    data = (S((batch, bag), jnp.int32), S((batch,), jnp.int32))

    def loss(p, data):
        users, items = data
        u = jnp.take(p["user"], users, axis=0).sum(1) @ p["w"]
        v = jnp.take(p["item"], items, axis=0)
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(u @ v.T, -1)))

    return sgd(loss), (params, data), (None, BATCH)


def conv1d(size: str):
    """Strided 1-D convolutions over raw audio (NWC), mean pooled, a classifier."""
    batch, samples, channels, depth = (64, 16000, 256, 5) if size == "large" else (8, 256, 16, 3)
    dims = ("NWC", "WIO", "NWC")
    params = {"c0": S((10, 1, channels), f32), "head": S((channels, 32), f32)}
    for i in range(1, depth):
        params[f"c{i}"] = S((3, channels, channels), f32)
    data = (S((batch, samples, 1), f32), S((batch,), jnp.int32))

    def loss(p, data):
        x, y = data
        x = jax.nn.gelu(lax.conv_general_dilated(x, p["c0"], (5,), "VALID", dimension_numbers=dims))
        for i in range(1, depth):
            x = jax.nn.gelu(lax.conv_general_dilated(x, p[f"c{i}"], (2,), "SAME", dimension_numbers=dims))
        return cross_entropy(x.mean(1) @ p["head"], y)

    return sgd(loss), (params, data), (None, BATCH)


PROGRAMS: dict[str, Callable] = {"vit": vit, "gru": gru, "mixer": mixer, "twotower": twotower, "conv1d": conv1d}
