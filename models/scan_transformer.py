"""A transformer training step whose layers run under ``jax.lax.scan`` over stacked parameters.

The usual way to keep compile time flat in depth: every per-layer parameter is
stacked on a leading ``n_layers`` dimension and one ``scan`` applies the block
``n_layers`` times, carrying the activations::

    def block(x, p):                       # p: one layer's slice of the stacked params
        x = x + attn(rms_norm(x))          # causal multi-head attention
        x = x + mlp(rms_norm(x))           # d -> 4d -> d, gelu
        return x, None
    x, _ = jax.lax.scan(block, embed[tokens] + pos, params["layers"])

then a final RMSNorm, an untied unembedding and next-token cross-entropy; one
step is ``jax.value_and_grad`` (the backward pass is a second, reversed scan)
plus SGD::

    step(params, tokens, targets) -> (new_params, loss)

Parameters: ``embed (vocab, d)``, ``pos (seq, d)``, ``norm_f (d,)``,
``lm_head (d, vocab)`` and ``layers``, a dict of stacked arrays
``norm1 (L, d), w_qkv (L, d, 3d), w_out (L, d, d), norm2 (L, d),
w_fc (L, d, 4d), w_proj (L, 4d, d)`` (``w_qkv`` columns head-major).

Annotations (mesh axes ``("data", "model")``):

* ``in_shardings``: ``tokens``/``targets`` batch on ``"data"``; parameters free.
* ``expert_in_shardings``: Megatron-style on ``"model"`` for every layer at once
  (the layer dimension unsplit): ``w_qkv``/``w_fc`` column-split
  ``P(None, None, "model")``, ``w_out``/``w_proj`` row-split
  ``P(None, "model", None)``, embedding vocab-parallel, ``lm_head`` split on the
  vocabulary; batch on ``"data"``.
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
    seq_len: int
    vocab: int
    batch: int
    learning_rate: float = 0.05
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Small: 8 layers of d 64 (~430k parameters). Large: 24 layers of d 1024, 16 heads,
# seq 1024, vocab 32768 (~370M parameters), planned from shapes.
SIZES: dict[str, Config] = {
    "small": Config(n_layers=8, d_model=64, n_heads=8, seq_len=16, vocab=256, batch=8),
    "large": Config(n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab=32768, batch=16, learning_rate=0.01),
}


def init_params(key: jax.Array, cfg: Config) -> Params:
    L, d, std = cfg.n_layers, cfg.d_model, 0.02
    out_std = std / (2 * L) ** 0.5
    ke, kp, kh, kq, ko, kf, kr = jax.random.split(key, 7)

    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(k, shape, jnp.float32)

    return {
        "embed": normal(ke, (cfg.vocab, d), std),
        "pos": normal(kp, (cfg.seq_len, d), 0.01),
        "layers": {
            "norm1": jnp.ones((L, d), jnp.float32),
            "w_qkv": normal(kq, (L, d, 3 * d), std),
            "w_out": normal(ko, (L, d, d), out_std),
            "norm2": jnp.ones((L, d), jnp.float32),
            "w_fc": normal(kf, (L, d, 4 * d), std),
            "w_proj": normal(kr, (L, 4 * d, d), out_std),
        },
        "norm_f": jnp.ones((d,), jnp.float32),
        "lm_head": normal(kh, (d, cfg.vocab), std),
    }


def make_batch(key: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    stream = jax.random.randint(key, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
    return stream[:, :-1], stream[:, 1:]


def rms_norm(x: jax.Array, g: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * g


def block(x: jax.Array, p: Params, cfg: Config) -> tuple[jax.Array, None]:
    """One layer; ``p`` holds this layer's slice of every stacked parameter."""
    B, T, d = x.shape
    H, hd = cfg.n_heads, cfg.head_dim
    h = rms_norm(x, p["norm1"], cfg.norm_eps)
    qkv = (h @ p["w_qkv"]).reshape(B, T, H, 3, hd)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.float32(hd))
    scores = jnp.where(jnp.tril(jnp.ones((T, T), jnp.bool_)), scores, jnp.finfo(jnp.float32).min)
    attn = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v).reshape(B, T, d)
    x = x + attn @ p["w_out"]
    h = rms_norm(x, p["norm2"], cfg.norm_eps)
    x = x + jax.nn.gelu(h @ p["w_fc"]) @ p["w_proj"]
    return x, None


def forward(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    x, _ = jax.lax.scan(partial(block, cfg=cfg), x, params["layers"])
    return rms_norm(x, params["norm_f"], cfg.norm_eps) @ params["lm_head"]


def loss_fn(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    logp = jax.nn.log_softmax(forward(params, tokens, cfg), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def sgd_step(params: Params, tokens: jax.Array, targets: jax.Array, *, cfg: Config) -> tuple[Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
    return jax.tree.map(lambda p, g: p - cfg.learning_rate * g, params, grads), loss


def megatron_specs() -> Params:
    return {
        "embed": P("model", None),
        "pos": P(),
        "layers": {
            "norm1": P(), "w_qkv": P(None, None, "model"), "w_out": P(None, "model", None),
            "norm2": P(), "w_fc": P(None, None, "model"), "w_proj": P(None, "model", None),
        },  # fmt: skip
        "norm_f": P(),
        "lm_head": P(None, "model"),
    }


def scan_transformer(size: str = "small") -> Model:
    """The scanned transformer training step at ``size`` ("small": real arrays; "large": shapes only)."""
    cfg = SIZES[size]
    key_params, key_batch = jax.random.split(jax.random.key(0))
    make_params = partial(init_params, cfg=cfg)
    make = partial(make_batch, cfg=cfg)
    if size == "small":
        params, (tokens, targets) = make_params(key_params), make(key_batch)
    else:
        params, (tokens, targets) = jax.eval_shape(make_params, key_params), jax.eval_shape(make, key_batch)
    batch = P("data")
    specs = megatron_specs()
    n_params = sum(p.size for p in jax.tree.leaves(params))
    return Model(
        fun=partial(sgd_step, cfg=cfg),
        args=(params, tokens, targets),
        in_shardings=(None, batch, batch),
        out_shardings=None,
        name=f"scan-transformer-{size}-{cfg.n_layers}l",
        description=(
            f"transformer training step, layers under lax.scan (SGD): {cfg.n_layers} layers, d_model={cfg.d_model}, "
            f"{cfg.n_heads} heads, seq={cfg.seq_len}, vocab={cfg.vocab}, batch={cfg.batch}; {n_params:,} parameters"
        ),
        expert_in_shardings=(specs, batch, batch),
        expert_out_shardings=(specs, P()),
        mesh_axes=MESH_AXES,
        carry=((0, 0),),
    )
