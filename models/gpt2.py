"""A GPT-2-style decoder training step, layers unrolled.

Forward pass: token embedding (``wte[tokens]``, a gather) plus learned
position embedding; ``n_layers`` pre-LayerNorm blocks, each

    x = x + attn(ln1(x))     # causal multi-head attention, mask via jnp.where
    x = x + mlp(ln2(x))      # d -> 4d -> d with gelu

then a final LayerNorm and the unembedding tied to ``wte`` (``x @ wte.T``).
The loss is softmax cross-entropy against the next tokens (``targets``, the
tokens shifted by one, are passed in). One step is ``jax.value_and_grad`` of
the loss plus an optimizer update written in jax.numpy:

* ``optimizer="sgd"`` (default): ``step(params, tokens, targets) -> (new_params, loss)``
* ``optimizer="adam"``: ``step(params, opt_state, tokens, targets)
  -> (new_params, new_opt_state, loss)`` with ``opt_state = {"m", "v", "count"}``
  (first/second moments shaped like ``params``, an int32 step counter).

The loss is always the last output.

Parameters are a dict pytree: ``wte (vocab, d)``, ``wpe (seq, d)``,
``ln_f_g``/``ln_f_b (d,)`` and ``blocks``, a list of per-layer dicts with
``ln1_g, ln1_b, w_qkv (d, 3d), b_qkv (3d,), w_out (d, d), b_out (d,),
ln2_g, ln2_b, w_fc (d, 4d), b_fc (4d,), w_proj (4d, d), b_proj (d,)``.
The columns of ``w_qkv`` are laid out head-major, ``(heads, 3, head_dim)``,
and the rows of ``w_out`` as ``(heads, head_dim)``, so splitting those
dimensions evenly over ``"model"`` keeps whole heads on one device (as long as
the number of heads is divisible by the axis size).

Annotations (mesh axes ``("data", "model")``):

* ``in_shardings``: only ``tokens``/``targets`` are pinned, batch on ``"data"``;
  parameters (and Adam state) are free (``None``).
* ``expert_in_shardings``: Megatron-style tensor parallelism on ``"model"``:
  ``w_qkv``/``b_qkv`` and ``w_fc``/``b_fc`` column-split, ``w_out`` and
  ``w_proj`` row-split (their biases replicated), the embedding table
  vocab-parallel (``P("model", None)``), LayerNorms and ``wpe`` replicated;
  Adam moments follow their parameters; batch on ``"data"``.
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
    learning_rate: float = 0.03
    optimizer: str = "sgd"  # "sgd" or "adam"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Small: everything divisible by 8, ~117k parameters. Large: GPT-2 small
# (124M parameters, vocab padded to 50304 = 393 * 128).
SIZES: dict[str, Config] = {
    "small": Config(n_layers=2, d_model=64, n_heads=4, seq_len=16, vocab=256, batch=8, learning_rate=0.03),
    "large": Config(n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab=50304, batch=16, learning_rate=0.03),
}
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.95, 1e-8
ADAM_LEARNING_RATE = {"small": 3e-3, "large": 3e-4}
LN_EPS = 1e-5


# ---------------------------------------------------------------- parameters


def init_params(key: jax.Array, cfg: Config) -> Params:
    """GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layers)."""
    d, std = cfg.d_model, 0.02
    proj_std = std / (2 * cfg.n_layers) ** 0.5
    k_wte, k_wpe, *k_blocks = jax.random.split(key, 2 + cfg.n_layers)

    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(k, shape, jnp.float32)

    blocks = []
    for k in k_blocks:
        k_qkv, k_out, k_fc, k_proj = jax.random.split(k, 4)
        blocks.append({
            "ln1_g": jnp.ones((d,), jnp.float32), "ln1_b": jnp.zeros((d,), jnp.float32),
            "w_qkv": normal(k_qkv, (d, 3 * d), std), "b_qkv": jnp.zeros((3 * d,), jnp.float32),
            "w_out": normal(k_out, (d, d), proj_std), "b_out": jnp.zeros((d,), jnp.float32),
            "ln2_g": jnp.ones((d,), jnp.float32), "ln2_b": jnp.zeros((d,), jnp.float32),
            "w_fc": normal(k_fc, (d, 4 * d), std), "b_fc": jnp.zeros((4 * d,), jnp.float32),
            "w_proj": normal(k_proj, (4 * d, d), proj_std), "b_proj": jnp.zeros((d,), jnp.float32),
        })  # fmt: skip
    return {
        "wte": normal(k_wte, (cfg.vocab, d), std),
        "wpe": normal(k_wpe, (cfg.seq_len, d), 0.01),
        "blocks": blocks,
        "ln_f_g": jnp.ones((d,), jnp.float32),
        "ln_f_b": jnp.zeros((d,), jnp.float32),
    }


def init_adam(params: Params) -> Params:
    return {
        "m": jax.tree.map(jnp.zeros_like, params),
        "v": jax.tree.map(jnp.zeros_like, params),
        "count": jnp.zeros((), jnp.int32),
    }


def make_batch(key: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """Random ``tokens`` and their next tokens ``targets``, both ``(batch, seq)`` int32."""
    stream = jax.random.randint(key, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
    return stream[:, :-1], stream[:, 1:]


# ---------------------------------------------------------------- forward


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * g + b


def attention(p: Params, x: jax.Array, cfg: Config) -> jax.Array:
    """Causal multi-head self-attention; ``x`` is ``(batch, seq, d)``."""
    B, T, _ = x.shape
    H, hd = cfg.n_heads, cfg.head_dim
    qkv = (x @ p["w_qkv"] + p["b_qkv"]).reshape(B, T, H, 3, hd)  # head-major columns
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]  # (B, T, H, hd)
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(jnp.float32(hd))
    causal = jnp.tril(jnp.ones((T, T), jnp.bool_))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhe->bqhe", weights, v).reshape(B, T, H * hd)
    return out @ p["w_out"] + p["b_out"]


def mlp_block(p: Params, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ p["w_fc"] + p["b_fc"]) @ p["w_proj"] + p["b_proj"]


def forward(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    """Logits ``(batch, seq, vocab)``."""
    T = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:T]
    for p in params["blocks"]:  # unrolled on purpose: one set of ops per layer
        x = x + attention(p, layer_norm(x, p["ln1_g"], p["ln1_b"]), cfg)
        x = x + mlp_block(p, layer_norm(x, p["ln2_g"], p["ln2_b"]))
    x = layer_norm(x, params["ln_f_g"], params["ln_f_b"])
    return x @ params["wte"].T  # tied unembedding


def loss_fn(params: Params, tokens: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    """Mean softmax cross-entropy of the next-token predictions."""
    logp = jax.nn.log_softmax(forward(params, tokens, cfg), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


# ---------------------------------------------------------------- training steps


def sgd_step(params: Params, tokens: jax.Array, targets: jax.Array, *, cfg: Config) -> tuple[Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
    new_params = jax.tree.map(lambda p, g: p - cfg.learning_rate * g, params, grads)
    return new_params, loss


def adam_step(
    params: Params, opt_state: Params, tokens: jax.Array, targets: jax.Array, *, cfg: Config
) -> tuple[Params, Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
    count = opt_state["count"] + 1
    m = jax.tree.map(lambda m, g: ADAM_B1 * m + (1 - ADAM_B1) * g, opt_state["m"], grads)
    v = jax.tree.map(lambda v, g: ADAM_B2 * v + (1 - ADAM_B2) * g * g, opt_state["v"], grads)
    t = count.astype(jnp.float32)
    lr = cfg.learning_rate * jnp.sqrt(1 - ADAM_B2**t) / (1 - ADAM_B1**t)  # bias correction
    new_params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + ADAM_EPS), params, m, v)
    return new_params, {"m": m, "v": v, "count": count}, loss


# ---------------------------------------------------------------- annotations


def megatron_specs(cfg: Config) -> Params:
    """Megatron-style PartitionSpecs for every parameter."""
    block = {
        "ln1_g": P(), "ln1_b": P(),
        "w_qkv": P(None, "model"), "b_qkv": P("model"),  # column-parallel: heads split
        "w_out": P("model", None), "b_out": P(),         # row-parallel: one all-reduce
        "ln2_g": P(), "ln2_b": P(),
        "w_fc": P(None, "model"), "b_fc": P("model"),    # column-parallel
        "w_proj": P("model", None), "b_proj": P(),       # row-parallel
    }  # fmt: skip
    return {
        "wte": P("model", None),  # vocab-parallel embedding and (tied) unembedding
        "wpe": P(),
        "blocks": [dict(block) for _ in range(cfg.n_layers)],
        "ln_f_g": P(),
        "ln_f_b": P(),
    }


# ---------------------------------------------------------------- models


def _build(cfg: Config, size: str, abstract: bool) -> Model:
    key_params, key_batch = jax.random.split(jax.random.key(0))
    make_params = partial(init_params, cfg=cfg)
    make_tokens = partial(make_batch, cfg=cfg)
    if abstract:  # shapes only: nothing is allocated
        params = jax.eval_shape(make_params, key_params)
        tokens, targets = jax.eval_shape(make_tokens, key_batch)
    else:
        params = make_params(key_params)
        tokens, targets = make_tokens(key_batch)

    param_specs = megatron_specs(cfg)
    batch = P("data")
    n_params = sum(p.size for p in jax.tree.leaves(params))
    if cfg.optimizer == "sgd":
        fun = partial(sgd_step, cfg=cfg)
        args: tuple = (params, tokens, targets)
        in_shardings: tuple = (None, batch, batch)
        expert_in: tuple = (param_specs, batch, batch)
        expert_out: tuple = (param_specs, P())
        carry: tuple = ((0, 0),)  # params -> new_params
    elif cfg.optimizer == "adam":
        opt_state = jax.eval_shape(init_adam, params) if abstract else init_adam(params)
        adam_specs = {"m": param_specs, "v": param_specs, "count": P()}
        fun = partial(adam_step, cfg=cfg)
        args = (params, opt_state, tokens, targets)
        in_shardings = (None, None, batch, batch)
        expert_in = (param_specs, adam_specs, batch, batch)
        expert_out = (param_specs, adam_specs, P())
        carry = ((0, 0), (1, 1))  # params, opt_state -> new ones
    else:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose 'sgd' or 'adam'")

    return Model(
        fun=fun,
        args=args,
        in_shardings=in_shardings,
        out_shardings=None,
        name=f"gpt2-{size}-{cfg.n_layers}l" + ("-adam" if cfg.optimizer == "adam" else ""),
        description=(
            f"GPT-2 training step ({cfg.optimizer}): {cfg.n_layers} layers, d_model={cfg.d_model}, "
            f"{cfg.n_heads} heads, seq={cfg.seq_len}, vocab={cfg.vocab}, batch={cfg.batch}; "
            f"{n_params:,} parameters"
        ),
        expert_in_shardings=expert_in,
        expert_out_shardings=expert_out,
        mesh_axes=MESH_AXES,
        carry=carry,
    )


def gpt2_layers(n_layers: int, size: str = "large", optimizer: str = "sgd") -> Model:
    """GPT-2 with ``n_layers`` blocks and the other dimensions of ``size``.

    Benchmarks use this for 12/24/48/96-layer versions of the large model.
    ``size="small"`` gives real arrays, ``"large"`` ShapeDtypeStructs.
    """
    base = SIZES[size]
    lr = ADAM_LEARNING_RATE[size] if optimizer == "adam" else base.learning_rate
    cfg = dataclasses.replace(base, n_layers=n_layers, optimizer=optimizer, learning_rate=lr)
    return _build(cfg, size, abstract=size != "small")


def gpt2(size: str = "small") -> Model:
    """The GPT-2 training step (SGD) at ``size``: "small" (2 layers, d 64) or "large" (GPT-2 small, 124M)."""
    return gpt2_layers(SIZES[size].n_layers, size)


def gpt2_adam(size: str = "small") -> Model:
    """As ``gpt2`` with an Adam update; the moments and step count are arguments."""
    return gpt2_layers(SIZES[size].n_layers, size, optimizer="adam")
