"""A Llama-style decoder training step, layers unrolled.

Forward pass: token embedding (``embed[tokens]``, a gather); ``n_layers``
pre-norm blocks, each

    x = x + attn(rms_norm(x))   # rotary position embeddings, grouped-query causal attention
    x = x + swiglu(rms_norm(x)) # (silu(x @ w_gate) * (x @ w_up)) @ w_down

then a final RMSNorm and an untied unembedding ``x @ lm_head``. The loss is
softmax cross-entropy against the next tokens; one step is
``jax.value_and_grad`` of the loss plus an SGD update::

    step(params, tokens, targets) -> (new_params, loss)

Grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value
heads; queries are reshaped to ``(batch, seq, kv_heads, group, head_dim)`` and
attend with one einsum per group, so keys and values are never repeated.
Rotary embeddings rotate the two halves of each head (``rotate_half``) by
angles ``position / 10000^(2i/head_dim)``, computed inside the step.

Parameters are a dict pytree: ``embed (vocab, d)``, ``lm_head (d, vocab)``,
``norm_f (d,)`` and ``blocks``, a list of per-layer dicts with
``attn_norm (d,), wq (d, H*hd), wk (d, KV*hd), wv (d, KV*hd), wo (H*hd, d),
mlp_norm (d,), w_gate (d, ffn), w_up (d, ffn), w_down (ffn, d)``. Columns of
``wq``/``wk``/``wv`` are head-major, so an even split over ``"model"`` keeps
whole heads together.

Annotations (mesh axes ``("data", "model")``):

* ``in_shardings``: ``tokens``/``targets`` batch on ``"data"``; parameters free.
* ``expert_in_shardings``: Megatron-style tensor parallelism on ``"model"``:
  ``wq``/``wk``/``wv``/``w_gate``/``w_up`` column-split, ``wo``/``w_down``
  row-split, the embedding vocab-parallel (``P("model", None)``), ``lm_head``
  column-split on the vocabulary, norms replicated; batch on ``"data"``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardsolve import Model

MESH_AXES = ("data", "model")
Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Config:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    seq_len: int
    vocab: int
    batch: int
    learning_rate: float = 0.05
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Small: every dimension divisible by 8 (~131k parameters). Large: a 0.5B-parameter
# Llama-style model (8 layers of d 2048; vocab 32000 = 8 * 4000), planned from shapes.
SIZES: dict[str, Config] = {
    "small": Config(n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, ffn=192, seq_len=16, vocab=256, batch=8),
    "large": Config(n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, ffn=5632, seq_len=1024, vocab=32000,
                    batch=8, learning_rate=0.01),
}


# ---------------------------------------------------------------- parameters


def init_params(key: jax.Array, cfg: Config) -> Params:
    d, hd, std = cfg.d_model, cfg.head_dim, 0.02
    out_std = std / (2 * cfg.n_layers) ** 0.5
    k_embed, k_head, *k_blocks = jax.random.split(key, 2 + cfg.n_layers)

    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(k, shape, jnp.float32)

    blocks = []
    for k in k_blocks:
        kq, kk, kv, ko, kg, ku, kd = jax.random.split(k, 7)
        blocks.append({
            "attn_norm": jnp.ones((d,), jnp.float32),
            "wq": normal(kq, (d, cfg.n_heads * hd), std),
            "wk": normal(kk, (d, cfg.n_kv_heads * hd), std),
            "wv": normal(kv, (d, cfg.n_kv_heads * hd), std),
            "wo": normal(ko, (cfg.n_heads * hd, d), out_std),
            "mlp_norm": jnp.ones((d,), jnp.float32),
            "w_gate": normal(kg, (d, cfg.ffn), std),
            "w_up": normal(ku, (d, cfg.ffn), std),
            "w_down": normal(kd, (cfg.ffn, d), out_std),
        })  # fmt: skip
    return {
        "embed": normal(k_embed, (cfg.vocab, d), std),
        "blocks": blocks,
        "norm_f": jnp.ones((d,), jnp.float32),
        "lm_head": normal(k_head, (d, cfg.vocab), std),
    }


def make_batch(key: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Random ``tokens`` and their next tokens ``targets``, both ``(batch, seq)`` int32."""
    stream = jax.random.randint(key, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
    return stream[:, :-1], stream[:, 1:]


# ---------------------------------------------------------------- forward


def rms_norm(x: jax.Array, g: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * g


def rotary(x: jax.Array, base: float) -> jax.Array:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)`` by its position (rotate-half form)."""
    T, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / base ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)  # (hd/2,)
    angles = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def attention(p: Params, x: jax.Array, cfg: Config) -> jax.Array:
    """Causal grouped-query attention with rotary embeddings; ``x`` is ``(batch, seq, d)``."""
    B, T, _ = x.shape
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G = H // KV
    q = rotary((x @ p["wq"]).reshape(B, T, H, hd), cfg.rope_base)
    k = rotary((x @ p["wk"]).reshape(B, T, KV, hd), cfg.rope_base)
    v = (x @ p["wv"]).reshape(B, T, KV, hd)
    q = q.reshape(B, T, KV, G, hd)  # query heads grouped by the kv head they share
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(jnp.float32(hd))
    causal = jnp.tril(jnp.ones((T, T), jnp.bool_))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(B, T, H * hd)
    return out @ p["wo"]


def swiglu(p: Params, x: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def forward(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    """Logits ``(batch, seq, vocab)``."""
    x = params["embed"][tokens]
    for p in params["blocks"]:  # unrolled: one set of ops per layer
        x = x + attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), cfg)
        x = x + swiglu(p, rms_norm(x, p["mlp_norm"], cfg.norm_eps))
    return rms_norm(x, params["norm_f"], cfg.norm_eps) @ params["lm_head"]


def loss_fn(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    logp = jax.nn.log_softmax(forward(params, tokens, cfg), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def sgd_step(params: Params, tokens: jax.Array, targets: jax.Array, *, cfg: Config) -> tuple[Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
    return jax.tree.map(lambda p, g: p - cfg.learning_rate * g, params, grads), loss


# ---------------------------------------------------------------- annotations


def megatron_specs(cfg: Config) -> Params:
    block = {
        "attn_norm": P(),
        "wq": P(None, "model"), "wk": P(None, "model"), "wv": P(None, "model"),  # heads split
        "wo": P("model", None),                                                  # row-parallel
        "mlp_norm": P(),
        "w_gate": P(None, "model"), "w_up": P(None, "model"),                    # column-parallel
        "w_down": P("model", None),                                              # row-parallel
    }  # fmt: skip
    return {
        "embed": P("model", None),  # vocab-parallel embedding
        "blocks": [dict(block) for _ in range(cfg.n_layers)],
        "norm_f": P(),
        "lm_head": P(None, "model"),  # vocab-parallel logits
    }


def llama(size: str = "small") -> Model:
    """The Llama-style training step at ``size`` ("small": real arrays; "large": shapes only)."""
    cfg = SIZES[size]
    key_params, key_batch = jax.random.split(jax.random.key(0))
    make_params = partial(init_params, cfg=cfg)
    make_tokens = partial(make_batch, cfg=cfg)
    if size == "small":
        params = make_params(key_params)
        tokens, targets = make_tokens(key_batch)
    else:  # shapes only: nothing is allocated
        params = jax.eval_shape(make_params, key_params)
        tokens, targets = jax.eval_shape(make_tokens, key_batch)
    specs = megatron_specs(cfg)
    batch = P("data")
    n_params = sum(p.size for p in jax.tree.leaves(params))
    return Model(
        fun=partial(sgd_step, cfg=cfg),
        args=(params, tokens, targets),
        in_shardings=(None, batch, batch),
        out_shardings=None,
        name=f"llama-{size}-{cfg.n_layers}l",
        description=(
            f"Llama-style training step (SGD): {cfg.n_layers} layers, d_model={cfg.d_model}, {cfg.n_heads} heads "
            f"({cfg.n_kv_heads} kv), SwiGLU {cfg.ffn}, seq={cfg.seq_len}, vocab={cfg.vocab}, batch={cfg.batch}; "
            f"{n_params:,} parameters"
        ),
        expert_in_shardings=(specs, batch, batch),
        expert_out_shardings=(specs, P()),
        mesh_axes=MESH_AXES,
        carry=((0, 0),),
    )
