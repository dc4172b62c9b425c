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
* ``conv1d``: strided 1-D convolutions over raw audio, mean pooled;
* ``remat_lm``: a causal language model whose layers are rematerialised
  (``jax.checkpoint``), attention by ``jax.nn.dot_product_attention``;
* ``bf16_mlp``: float32 parameters, the matmuls in bfloat16 (mixed precision);
* ``adam_mlp``: an MLP trained by Adam, its two moments carried as state;
* ``cnn2d``: 2-D convolutions with max pooling (``reduce_window``);
* ``mobilenet``: depthwise-separable convolutions (``feature_group_count``; their
  kernel gradients are batch-grouped convolutions);
* ``moe_top2``: a top-2 router (``lax.top_k``) over experts written with ``einsum``;
* ``segment_bag``: bags of embeddings summed by ``jax.ops.segment_sum``;
* ``gnn``: message passing, node features gathered at both ends of every edge
  and the messages summed into the nodes (``segment_sum``);
* ``accum_steps``: gradients accumulated, Adam applied every fourth step by
  ``lax.cond`` (``optax.MultiSteps``' pattern);
* ``decode_loop``: greedy decoding into a KV cache by ``lax.while_loop``
  until every sequence has ended (a condition over the split batch);
* ``vae``: a variational autoencoder drawing its noise from a typed PRNG key
  carried in the state and split each step;
* ``block_attention``: attention over key/value blocks in a ``lax.fori_loop`` with an online softmax;
* ``hvp_step``: a step scaled by a Hessian-vector product along the gradient (``jax.jvp`` of ``jax.grad``);
* ``circular_pipeline``: pipeline stages under ``jax.vmap`` in a ``lax.scan``, the state rolled each step;
* ``switched_heads``: a shared trunk and one of three heads chosen by ``lax.switch``;
* ``sampled_decode``: sampling by ``jax.random.categorical`` in a ``lax.fori_loop``, the output layer tied
  to the embedding (``h @ embed.T``, a loop invariant);
* ``chunked_ce``: a cross-entropy whose log-sum-exp runs over vocabulary chunks in ``lax.map``, the target
  logits gathered from the same embedding (its gradient sums a scatter and a matmul);
* ``linear_attention``: causal linear attention, running sums of outer products by ``jnp.cumsum``;
* ``ragged_moe``: experts as grouped matmuls over tokens sorted by expert (``lax.ragged_dot``);
* ``fft_conv``: a sequence-long convolution through ``jnp.fft.rfft``/``irfft``;
* ``gp_marginal``: a Gaussian process's marginal likelihood through a Cholesky factor and a solve;
* ``constrained_lm``: a language model with MaxText-style activation
  constraints inside (``with_sharding_constraint`` with bare ``PartitionSpec``s),
  which propagation and the planner both hold.

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


def remat_lm(size: str):
    """A causal language model, each layer rematerialised in the backward pass (``jax.checkpoint``)."""
    batch, seq, d, heads, depth, vocab = (16, 512, 1024, 16, 4, 32768) if size == "large" else (8, 16, 32, 4, 2, 64)
    params = {"embed": S((vocab, d), f32), "head": S((d, vocab), f32),
              "layers": [{"qkv": S((d, 3 * d), f32), "o": S((d, d), f32), "up": S((d, 4 * d), f32),
                          "down": S((4 * d, d), f32), "g1": S((d,), f32), "g2": S((d,), f32)} for _ in range(depth)]}
    data = (S((batch, seq), jnp.int32), S((batch, seq), jnp.int32))

    def loss(p, data):
        tokens, targets = data
        x = jnp.take(p["embed"], tokens, axis=0)

        @jax.checkpoint
        def layer(x, w):
            h = layer_norm(x, w["g1"], 0.0)
            q, k, v = jnp.split((h @ w["qkv"]).reshape(batch, seq, 3 * heads, d // heads), 3, axis=2)
            x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, seq, d) @ w["o"]
            return x + jax.nn.gelu(layer_norm(x, w["g2"], 0.0) @ w["up"]) @ w["down"]

        for w in p["layers"]:
            x = layer(x, w)
        return cross_entropy((x @ p["head"]).reshape(batch * seq, vocab), targets.reshape(-1))

    return sgd(loss), (params, data), (None, BATCH)


def bf16_mlp(size: str):
    """Float32 parameters, every matmul and activation in bfloat16, the loss in float32."""
    batch, d, depth = (2048, 4096, 4) if size == "large" else (16, 32, 3)
    params = [S((d, d), f32) for _ in range(depth)]
    data = (S((batch, d), f32), S((batch, d), f32))

    def loss(p, data):
        x, y = data
        h = x.astype(jnp.bfloat16)
        for w in p:
            h = jax.nn.relu(h @ w.astype(jnp.bfloat16))
        return jnp.mean((h.astype(f32) - y) ** 2)

    return sgd(loss), (params, data), (None, BATCH)


def adam_mlp(size: str):
    """A two-layer MLP trained by Adam: the state (parameters, two moments, step count) goes in and comes out."""
    batch, d, hidden = (4096, 4096, 16384) if size == "large" else (16, 32, 64)
    weights = {"w1": S((d, hidden), f32), "w2": S((hidden, d), f32)}
    state = (weights, weights, weights, S((), f32))
    data = (S((batch, d), f32), S((batch, d), f32))

    def loss(p, data):
        x, y = data
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(state, data):
        p, m, v, t = state
        value, g = jax.value_and_grad(loss)(p, data)
        t = t + 1
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        p = jax.tree.map(lambda q, a, b: q - 1e-3 * (a / (1 - 0.9 ** t)) / (jnp.sqrt(b / (1 - 0.999 ** t)) + 1e-8),
                         p, m, v)
        return (p, m, v, t), value

    return step, (state, data), (None, BATCH)


def cnn2d(size: str):
    """3x3 convolutions (NHWC), each followed by a 2x2 max pool, mean pooled into a classifier."""
    batch, side, widths, classes = (128, 64, (3, 64, 128, 256), 1000) if size == "large" else (8, 16, (3, 8, 16), 10)
    params = {"convs": [S((3, 3, a, b), f32) for a, b in zip(widths, widths[1:])], "head": S((widths[-1], classes), f32)}
    data = (S((batch, side, side, 3), f32), S((batch,), jnp.int32))

    def loss(p, data):
        x, y = data
        for k in p["convs"]:
            x = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = lax.reduce_window(jax.nn.relu(x), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return cross_entropy(x.mean((1, 2)) @ p["head"], y)

    return sgd(loss), (params, data), (None, BATCH)


def mobilenet(size: str):
    """Depthwise-separable blocks (MobileNet): a 3x3 convolution per channel (``feature_group_count``), whose
    kernel gradient is a batch-grouped convolution, then a 1x1 convolution mixing the channels."""
    batch, side, width, blocks, classes = (128, 56, 128, 4, 1000) if size == "large" else (8, 8, 8, 2, 10)
    dn = ("NHWC", "HWIO", "NHWC")
    params = {"stem": S((3, 3, 3, width), f32), "head": S((width, classes), f32),
              "blocks": [{"depthwise": S((3, 3, 1, width), f32), "pointwise": S((1, 1, width, width), f32)}
                         for _ in range(blocks)]}
    data = (S((batch, side, side, 3), f32), S((batch,), jnp.int32))

    def loss(p, data):
        x, y = data
        x = jax.nn.relu(lax.conv_general_dilated(x, p["stem"], (2, 2), "SAME", dimension_numbers=dn))
        for blk in p["blocks"]:
            h = lax.conv_general_dilated(x, blk["depthwise"], (1, 1), "SAME", dimension_numbers=dn,
                                         feature_group_count=width)
            x = x + jax.nn.relu(lax.conv_general_dilated(jax.nn.relu(h), blk["pointwise"], (1, 1), "SAME",
                                                         dimension_numbers=dn))
        return cross_entropy(x.mean((1, 2)) @ p["head"], y)

    return sgd(loss), (params, data), (None, BATCH)


def moe_top2(size: str):
    """Tokens routed to their top two experts (``lax.top_k``); every expert computed, the two kept by weight."""
    tokens, d, experts, hidden = (8192, 1024, 8, 1024) if size == "large" else (32, 16, 4, 32)
    params = {"router": S((d, experts), f32), "w1": S((experts, d, hidden), f32), "w2": S((experts, hidden, d), f32)}
    data = (S((tokens, d), f32), S((tokens, d), f32))

    def loss(p, data):
        x, y = data
        gate, chosen = lax.top_k(x @ p["router"], 2)
        weights = (jax.nn.one_hot(chosen, experts) * jax.nn.softmax(gate, -1)[..., None]).sum(1)
        h = jax.nn.relu(jnp.einsum("td,edh->teh", x, p["w1"]))
        out = jnp.einsum("te,teh,ehd->td", weights, h, p["w2"])
        return jnp.mean((out - y) ** 2)

    return sgd(loss), (params, data), (None, BATCH)


def segment_bag(size: str):
    """Bags of embeddings (ids grouped by a sorted segment id) summed with ``jax.ops.segment_sum``."""
    vocab, d, ids, bags = (131072, 256, 65536, 4096) if size == "large" else (64, 16, 32, 8)
    params = {"embed": S((vocab, d), f32), "w": S((d, d), f32)}
    data = (S((ids,), jnp.int32), S((ids,), jnp.int32), S((bags, d), f32))

    def loss(p, data):
        token, bag, y = data
        summed = jax.ops.segment_sum(jnp.take(p["embed"], token, axis=0), bag, num_segments=bags)
        return jnp.mean((jnp.tanh(summed @ p["w"]) - y) ** 2)

    return sgd(loss), (params, data), (None, (P("data"), P("data"), None))


def gnn(size: str):
    """Message passing over a graph's edges: both ends' features gathered per edge, summed into the nodes."""
    nodes, edges, d, depth = (65536, 524288, 256, 3) if size == "large" else (32, 128, 16, 2)
    params = [{"msg": S((2 * d, d), f32), "upd": S((2 * d, d), f32)} for _ in range(depth)]
    data = (S((nodes, d), f32), S((edges,), jnp.int32), S((edges,), jnp.int32), S((nodes, d), f32))

    def loss(p, data):
        x, src, dst, y = data
        for w in p:
            m = jax.nn.relu(jnp.concatenate([x[src], x[dst]], -1) @ w["msg"])
            x = jnp.tanh(jnp.concatenate([x, jax.ops.segment_sum(m, dst, num_segments=nodes)], -1) @ w["upd"])
        return jnp.mean((x - y) ** 2)

    return sgd(loss), (params, data), (None, (P("data"),) * 4)


def constrained_lm(size: str):
    """A language model whose activations carry MaxText-style ``with_sharding_constraint``s with bare
    ``PartitionSpec``s (the residual stream on ``"data"``, the MLP's hidden units on ``"model"``)."""
    b, s, d, heads, depth, vocab = (8, 1024, 2048, 16, 2, 32000) if size == "large" else (4, 16, 64, 8, 2, 128)
    dh = d // heads
    params = {"embed": S((vocab, d), f32),
              "layers": [{"qkv": S((d, 3 * d), f32), "o": S((d, d), f32), "up": S((d, 4 * d), f32),
                          "down": S((4 * d, d), f32), "n1": S((d,), f32), "n2": S((d,), f32)} for _ in range(depth)]}
    data = (S((b, s), jnp.int32), S((b, s), jnp.int32))
    constrain = jax.lax.with_sharding_constraint

    def rms(x, g):
        return x * lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g

    def loss(p, data):
        tokens, targets = data
        x = constrain(p["embed"][tokens], P("data", None, None))
        for w in p["layers"]:
            q, k, v = jnp.split((rms(x, w["n1"]) @ w["qkv"]).reshape(b, s, 3 * heads, dh), 3, axis=2)
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(dh)
            att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9), -1)
            x = constrain(x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d) @ w["o"], P("data", None, None))
            hidden = constrain(jax.nn.gelu(rms(x, w["n2"]) @ w["up"]), P("data", None, "model"))
            x = constrain(x + hidden @ w["down"], P("data", None, None))
        return cross_entropy((x @ p["embed"].T).reshape(-1, vocab), targets.reshape(-1))

    return sgd(loss), (params, data), (None, BATCH)


def accum_steps(size: str):
    """Gradients accumulated over micro-steps, the Adam update applied every fourth step by ``lax.cond``
    (``optax.MultiSteps``' pattern): the state (parameters, moments, accumulated gradient, counter) in and out."""
    batch, d, hidden = (4096, 4096, 16384) if size == "large" else (16, 32, 64)
    weights = {"w1": S((d, hidden), f32), "w2": S((hidden, d), f32)}
    state = (weights, weights, weights, weights, S((), jnp.int32))
    data = (S((batch, d), f32), S((batch, d), f32))

    def loss(p, data):
        x, y = data
        return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(state, data):
        p, m, v, acc, n = state
        value, g = jax.value_and_grad(loss)(p, data)
        acc = jax.tree.map(jnp.add, acc, g)

        def update(p, m, v, acc):
            g = jax.tree.map(lambda a: a / 4, acc)
            m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
            v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
            p = jax.tree.map(lambda q, a, b: q - 1e-3 * a / (jnp.sqrt(b) + 1e-8), p, m, v)
            return p, m, v, jax.tree.map(jnp.zeros_like, acc)

        p, m, v, acc = lax.cond(n % 4 == 3, update, lambda *s: s, p, m, v, acc)
        return (p, m, v, acc, n + 1), value

    return step, (state, data), (None, BATCH)


def decode_loop(size: str):
    """Greedy decoding into a KV cache by ``lax.while_loop`` until every sequence has drawn its end token (a
    condition over the split batch) or the cache is full: ``((params, cache), prompt) -> ((params, cache),
    tokens)``."""
    batch, d, heads, seq, vocab = (64, 2048, 16, 1024, 32768) if size == "large" else (16, 32, 4, 8, 64)
    hd = d // heads
    params = {"embed": S((vocab, d), f32), "qkv": S((d, 3 * d), f32), "o": S((d, d), f32), "up": S((d, 4 * d), f32),
              "down": S((4 * d, d), f32), "head": S((d, vocab), f32)}
    cache = (S((batch, seq, heads, hd), f32), S((batch, seq, heads, hd), f32))

    def step(state, prompt):
        p, (ck, cv) = state

        def body(c):
            i, tok, done, ck, cv, out = c
            x = jnp.take(p["embed"], tok, axis=0)
            q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
            ck = lax.dynamic_update_slice(ck, k.reshape(batch, 1, heads, hd), (0, i, 0, 0))
            cv = lax.dynamic_update_slice(cv, v.reshape(batch, 1, heads, hd), (0, i, 0, 0))
            s = jnp.einsum("bhd,bthd->bht", q.reshape(batch, heads, hd), ck) / hd ** 0.5
            s = jnp.where(jnp.arange(seq)[None, None] <= i, s, -1e9)
            x = x + jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1), cv).reshape(batch, d) @ p["o"]
            x = x + jax.nn.gelu(x @ p["up"]) @ p["down"]
            tok = jnp.argmax(x @ p["head"], -1).astype(jnp.int32)
            out = lax.dynamic_update_slice(out, tok[:, None], (0, i))
            return i + 1, tok, done | (tok == 0), ck, cv, out

        init = (0, prompt, jnp.zeros((batch,), bool), ck, cv, jnp.zeros((batch, seq), jnp.int32))
        _, _, _, ck, cv, out = lax.while_loop(lambda c: (c[0] < seq) & ~jnp.all(c[2]), body, init)
        return (p, (ck, cv)), out

    return step, ((params, cache), S((batch,), jnp.int32)), ((None, (P("data"), P("data"))), P("data"))


def vae(size: str):
    """A variational autoencoder whose reparameterisation noise is drawn from a typed PRNG key carried in the
    state (``jax.random.key``), split each step and handed on, as a Flax NNX ``Rngs`` stream is."""
    batch, d, hidden, z = (4096, 4096, 8192, 512) if size == "large" else (16, 32, 64, 8)
    weights = {"e": S((d, hidden), f32), "mu": S((hidden, z), f32), "lv": S((hidden, z), f32),
               "d1": S((z, hidden), f32), "d2": S((hidden, d), f32)}
    state = (weights, S((), jax.random.key(0).dtype))
    data = (S((batch, d), f32), S((batch, d), f32))

    def step(state, data):
        p, key = state
        key, noise_key = jax.random.split(key)
        x, _ = data

        def loss(p):
            h = jax.nn.relu(x @ p["e"])
            mu, lv = h @ p["mu"], h @ p["lv"]
            latent = mu + jnp.exp(0.5 * lv) * jax.random.normal(noise_key, mu.shape)
            rec = jax.nn.relu(latent @ p["d1"]) @ p["d2"]
            kl = -0.5 * jnp.sum(1 + lv - mu ** 2 - jnp.exp(lv), axis=-1)
            return jnp.mean(jnp.sum((rec - x) ** 2, axis=-1) + kl)

        value, g = jax.value_and_grad(loss)(p)
        return (jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), key), value

    return step, (state, data), (None, BATCH)


def block_attention(size: str):
    """Attention over key/value blocks in a ``lax.fori_loop`` with an online softmax (a running maximum and
    sum rescale the accumulated output), flash-attention's recurrence: ``(params, x) -> (params, loss)``."""
    batch, seq, d, block = (16, 2048, 1024, 256) if size == "large" else (8, 64, 32, 16)
    params = {"q": S((d, d), f32), "k": S((d, d), f32), "v": S((d, d), f32)}

    def loss(p, x):
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]

        def body(i, c):
            top, total, acc = c
            kb = lax.dynamic_slice_in_dim(k, i * block, block, 1)
            vb = lax.dynamic_slice_in_dim(v, i * block, block, 1)
            s = jnp.einsum("bqd,bkd->bqk", q, kb) / d ** 0.5
            new_top = jnp.maximum(top, s.max(-1))
            w = jnp.exp(s - new_top[..., None])
            scale = jnp.exp(top - new_top)
            return new_top, total * scale + w.sum(-1), acc * scale[..., None] + jnp.einsum("bqk,bkd->bqd", w, vb)

        init = (jnp.full((batch, seq), -1e30), jnp.zeros((batch, seq)), jnp.zeros((batch, seq, d)))
        _, total, acc = lax.fori_loop(0, seq // block, body, init)
        return jnp.mean((acc / total[..., None] - x) ** 2)

    return sgd(loss), (params, S((batch, seq, d), f32)), (None, P("data"))


def hvp_step(size: str):
    """A step along the gradient scaled by its curvature: a Hessian-vector product (``jax.jvp`` of
    ``jax.grad``) and the gradients flattened for ``jnp.vdot``: ``(params, x) -> (params, loss)``."""
    batch, d = (1024, 4096) if size == "large" else (16, 64)
    params = {"w1": S((d, 2 * d), f32), "w2": S((2 * d, d), f32)}

    def loss(p, x):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        _, hv = jax.jvp(lambda q: jax.grad(loss)(q, x), (p,), (g,))
        num = sum(jnp.vdot(a, a) for a in jax.tree.leaves(g))
        den = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(hv))) + 1e-6
        return jax.tree.map(lambda a, b: a - num / den * b, p, g), loss(p, x)

    return step, (params, S((batch, d), f32)), (None, P("data"))


def circular_pipeline(size: str):
    """A circular pipeline of stages (``jax.vmap`` over stacked stage weights) in a ``lax.scan`` over
    microbatches, the state rolled one stage on each step (praxis' pattern): ``(params, microbatches) ->
    (params, loss)``, the microbatches' batch dimension annotated."""
    stages, micro, batch, d = (4, 8, 256, 2048) if size == "large" else (4, 8, 8, 64)
    params = {"w": S((stages, d, d), f32)}

    def loss(p, mbs):
        def body(c, t):
            state, outs = c
            state = state.at[0].set(jnp.where(t < micro, mbs[jnp.minimum(t, micro - 1)], 0.0))
            state = jax.vmap(lambda w, h: jnp.tanh(h @ w))(p["w"], state)
            outs = lax.dynamic_update_index_in_dim(outs, state[-1], jnp.clip(t - stages + 1, 0, micro - 1), 0)
            return (jnp.roll(state, 1, 0), outs), None

        init = (jnp.zeros((stages, batch, d)), jnp.zeros_like(mbs))
        (_, outs), _ = lax.scan(body, init, jnp.arange(micro + stages - 1))
        return jnp.mean((outs - mbs) ** 2)

    return sgd(loss), (params, S((micro, batch, d), f32)), (None, P(None, "data"))


def switched_heads(size: str):
    """A shared trunk and one of three heads chosen per step by ``lax.switch`` on a traced index (a task id read
    from the batch), trained by SGD: ``(params, (x, task)) -> (params, loss)``; the heads' matmuls run as XLA's
    conditional, the one taken."""
    batch, d, hidden = (2048, 2048, 8192) if size == "large" else (16, 32, 64)
    params = {"trunk": S((d, hidden), f32), **{f"head{k}": S((hidden, d), f32) for k in range(3)}}

    def loss(p, data):
        x, task = data
        h = jax.nn.relu(x @ p["trunk"])
        heads = [lambda h, k=k: jnp.tanh(h @ p[f"head{k}"]) for k in range(3)]
        return jnp.mean((lax.switch(jnp.clip(task[0], 0, 2), heads, h) - x) ** 2)

    return sgd(loss), (params, (S((batch, d), f32), S((batch,), jnp.int32))), (None, BATCH)


def sampled_decode(size: str):
    """Sampling with a tied output layer: each step of a ``lax.fori_loop`` embeds the last token, reads the
    embedding transposed (``h @ embed.T``, a loop invariant) and draws the next token by
    ``jax.random.categorical``; returns the tokens and their log-probabilities."""
    batch, d, vocab, steps = (64, 1024, 32768, 32) if size == "large" else (8, 64, 256, 16)
    params = {"embed": S((vocab, d), f32), "w": S((d, d), f32)}

    def step(p, start):
        def body(i, c):
            toks, logp = c
            h = jnp.tanh(p["embed"][toks[:, i - 1]] @ p["w"])
            logits = h @ p["embed"].T
            tok = jax.random.categorical(jax.random.fold_in(jax.random.key(0), i), logits).astype(jnp.int32)
            logp = logp + jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0]
            return lax.dynamic_update_slice(toks, tok[:, None], (0, i)), logp

        toks = jnp.zeros((batch, steps), jnp.int32).at[:, 0].set(start)
        return p, lax.fori_loop(1, steps, body, (toks, jnp.zeros((batch,), f32)))

    return step, (params, S((batch,), jnp.int32)), (None, P("data"))


def chunked_ce(size: str):
    """A cross-entropy over a large vocabulary, its log-sum-exp taken chunk by chunk (``lax.map`` over the
    embedding's rows) and the target logits gathered from the same embedding."""
    batch, d, vocab, chunks = (512, 1024, 65536, 8) if size == "large" else (32, 64, 1024, 4)
    params = {"w": S((d, d), f32), "embed": S((vocab, d), f32)}

    def loss(p, b):
        x, y = b
        h = jnp.tanh(x @ p["w"])
        lse = lax.map(lambda e: jax.nn.logsumexp(h @ e.T, -1), p["embed"].reshape(chunks, vocab // chunks, d))
        target = jnp.sum(h * p["embed"][jnp.clip(y, 0, vocab - 1)], -1)
        return jnp.mean(jax.nn.logsumexp(lse, 0) - target)

    return sgd(loss), (params, (S((batch, d), f32), S((batch,), jnp.int32))), (None, BATCH)


def linear_attention(size: str):
    """Causal linear attention: running sums (``jnp.cumsum``) of the keys' outer products with the values,
    read by each query (an ``einsum`` over the summed state)."""
    batch, seq, d = (16, 256, 128) if size == "large" else (8, 32, 16)
    params = {k: S((d, d), f32) for k in ("wq", "wk", "wv")}

    def loss(p, b):
        x, y = b
        q, k = jax.nn.elu(x @ p["wq"]) + 1, jax.nn.elu(x @ p["wk"]) + 1
        v = x @ p["wv"]
        state = jnp.cumsum(k[..., :, None] * v[..., None, :], axis=1)
        norm = jnp.einsum("btd,btd->bt", q, jnp.cumsum(k, axis=1))[..., None]
        return jnp.mean((jnp.einsum("btd,btde->bte", q, state) / norm - y) ** 2)

    return sgd(loss), (params, (S((batch, seq, d), f32), S((batch, seq, d), f32))), (None, BATCH)


def ragged_moe(size: str):
    """Tokens sorted by their expert and run through grouped matmuls (``lax.ragged_dot``), one group of rows
    per expert, then put back in order and weighted by the router."""
    tokens, d, experts = (4096, 512, 8) if size == "large" else (128, 32, 4)
    params = {"router": S((d, experts), f32), "w1": S((experts, d, 2 * d), f32), "w2": S((experts, 2 * d, d), f32)}

    def loss(p, b):
        x, y = b
        logits = x @ p["router"]
        expert = jnp.argmax(logits, -1)
        order = jnp.argsort(expert)
        sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
        h = jax.nn.gelu(lax.ragged_dot(x[order], p["w1"], sizes))
        out = jnp.zeros_like(x).at[order].set(lax.ragged_dot(h, p["w2"], sizes))
        return jnp.mean((out * jax.nn.softmax(logits).max(-1, keepdims=True) - y) ** 2)

    return sgd(loss), (params, (S((tokens, d), f32), S((tokens, d), f32))), (None, BATCH)


def fft_conv(size: str):
    """A long convolution (Hyena-style): each channel filtered along the sequence through ``jnp.fft.rfft`` and
    ``irfft`` with a learned filter as long as the sequence, between two dense projections."""
    batch, seq, d = (16, 2048, 256) if size == "large" else (8, 64, 16)
    params = {"w_in": S((d, d), f32), "filter": S((seq, d), f32), "w_out": S((d, d), f32)}

    def loss(p, b):
        x, y = b
        u = x @ p["w_in"]
        spectrum = jnp.fft.rfft(u, n=2 * seq, axis=1) * jnp.fft.rfft(p["filter"], n=2 * seq, axis=0)[None]
        h = jnp.fft.irfft(spectrum, n=2 * seq, axis=1)[:, :seq]
        return jnp.mean((jax.nn.gelu(h) @ p["w_out"] - y) ** 2)

    return sgd(loss), (params, (S((batch, seq, d), f32), S((batch, seq, d), f32))), (None, BATCH)


def gp_marginal(size: str):
    """A Gaussian process's negative log marginal likelihood under a learned feature map: a kernel matrix over
    the batch, its Cholesky factor (``jnp.linalg.cholesky``) and a solve against the targets."""
    batch, d = (1024, 256) if size == "large" else (64, 16)
    params = {"w": S((d, d), f32), "log_noise": S((), f32)}

    def loss(p, b):
        x, y = b
        z = jnp.tanh(x @ p["w"])
        kernel = z @ z.T / d + (jnp.exp(p["log_noise"]) + 1e-3) * jnp.eye(batch)
        factor = jnp.linalg.cholesky(kernel)
        alpha = jax.scipy.linalg.cho_solve((factor, True), y)
        return 0.5 * jnp.sum(y * alpha) + jnp.sum(jnp.log(jnp.diag(factor)))

    return sgd(loss), (params, (S((batch, d), f32), S((batch,), f32))), (None, BATCH)


PROGRAMS: dict[str, Callable] = {"vit": vit, "gru": gru, "mixer": mixer, "twotower": twotower, "conv1d": conv1d,
                                 "remat_lm": remat_lm, "bf16_mlp": bf16_mlp, "adam_mlp": adam_mlp, "cnn2d": cnn2d,
                                 "moe_top2": moe_top2, "segment_bag": segment_bag, "gnn": gnn,
                                 "constrained_lm": constrained_lm, "mobilenet": mobilenet, "accum_steps": accum_steps,
                                 "decode_loop": decode_loop, "vae": vae, "block_attention": block_attention,
                                 "hvp_step": hvp_step, "circular_pipeline": circular_pipeline,
                                 "switched_heads": switched_heads, "sampled_decode": sampled_decode,
                                 "chunked_ce": chunked_ce, "linear_attention": linear_attention,
                                 "ragged_moe": ragged_moe, "fft_conv": fft_conv, "gp_marginal": gp_marginal}
