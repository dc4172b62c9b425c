"""A mixture-of-experts layer training step: top-k routing, one-hot dispatch and combine by einsum.

GShard/Switch style. Tokens come in groups, ``x (groups, tokens, d)``; each
group routes its tokens independently:

    probs    = softmax(x @ router)                          # (g, s, E)
    top_k    = lax.top_k(probs, k)                          # the k experts of each token
    position = cumsum of each expert's one-hot mask         # a token's slot in its expert's buffer
    dispatch = one_hot(expert) * one_hot(position, C)       # (g, s, E, C), 0/1; tokens past capacity C drop
    combine  = dispatch * gate probability                  # (g, s, E, C)
    expert_in  = einsum("gsec,gsd->egcd", dispatch, x)      # gather tokens into expert buffers
    expert_out = gelu(expert_in @ w_in[e]) @ w_out[e]       # per-expert FFN, einsum over e
    y          = x + einsum("gsec,egcd->gsd", combine, expert_out)

The loss is the mean squared error of ``y`` against ``targets`` plus the
Switch load-balancing loss (``E * sum_e fraction_e * mean_prob_e``); one step is
``jax.value_and_grad`` plus SGD::

    step(params, x, targets) -> (new_params, loss)

Parameters: ``router (d, E)``, ``w_in (E, d, hidden)``, ``w_out (E, hidden, d)``.

Annotations (mesh axes ``("data", "model")``):

* ``in_shardings``: ``x``/``targets`` split on the group dimension over ``"data"``;
  parameters free.
* ``expert_in_shardings``: expert parallelism on ``"model"`` (the experts' weights
  split on the expert dimension, so ``dispatch``/``combine`` become all-to-alls),
  router replicated, groups on ``"data"``.
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
    d_model: int
    hidden: int
    n_experts: int
    top_k: int
    groups: int
    group_size: int  # tokens per group
    capacity: int  # slots per expert per group
    learning_rate: float = 0.1
    aux_weight: float = 0.01


# Small: ~132k parameters, every dimension divisible by 8. Large: 64 experts of
# d 2048 x 8192 (2.1B parameters), 16 groups of 1024 tokens, capacity 40 (1.25 x fair share).
SIZES: dict[str, Config] = {
    "small": Config(d_model=64, hidden=128, n_experts=8, top_k=2, groups=8, group_size=16, capacity=8),
    "large": Config(d_model=2048, hidden=8192, n_experts=64, top_k=2, groups=16, group_size=1024, capacity=40,
                    learning_rate=0.01),
}


def init_params(key: jax.Array, cfg: Config) -> Params:
    k_r, k_in, k_out = jax.random.split(key, 3)
    d, h, E = cfg.d_model, cfg.hidden, cfg.n_experts
    return {
        "router": 0.02 * jax.random.normal(k_r, (d, E), jnp.float32),
        "w_in": jax.random.normal(k_in, (E, d, h), jnp.float32) / jnp.sqrt(d),
        "w_out": jax.random.normal(k_out, (E, h, d), jnp.float32) / jnp.sqrt(h),
    }


def make_batch(key: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    shape = (cfg.groups, cfg.group_size, cfg.d_model)
    return jax.random.normal(kx, shape, jnp.float32), jax.random.normal(ky, shape, jnp.float32)


def route(x: jax.Array, router: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dispatch, combine, aux_loss)``; dispatch and combine are ``(groups, tokens, E, C)``."""
    E, C = cfg.n_experts, cfg.capacity
    probs = jax.nn.softmax(x @ router, axis=-1)  # (g, s, E)
    gates, experts = jax.lax.top_k(probs, cfg.top_k)  # (g, s, k)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    masks = jax.nn.one_hot(experts, E, dtype=jnp.float32)  # (g, s, k, E)
    dispatch = jnp.zeros(x.shape[:2] + (E, C), jnp.float32)
    combine = jnp.zeros(x.shape[:2] + (E, C), jnp.float32)
    filled = jnp.zeros((x.shape[0], 1, E), jnp.float32)  # slots taken by earlier choices
    for i in range(cfg.top_k):  # first choices get slots before second choices
        mask = masks[:, :, i, :]  # (g, s, E)
        position = (jnp.cumsum(mask, axis=1) - 1.0 + filled) * mask  # slot within the expert's buffer
        filled = filled + jnp.sum(mask, axis=1, keepdims=True)
        keep = mask * (position < C)
        slot = jax.nn.one_hot(position.astype(jnp.int32), C, dtype=jnp.float32)  # (g, s, E, C)
        d_i = keep[..., None] * slot
        dispatch = dispatch + d_i
        combine = combine + d_i * gates[:, :, i, None, None]
    fraction = jnp.mean(masks[:, :, 0, :], axis=(0, 1))  # share of first choices per expert
    aux = E * jnp.sum(fraction * jnp.mean(probs, axis=(0, 1)))
    return dispatch, combine, aux


def moe_layer(params: Params, x: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    dispatch, combine, aux = route(x, params["router"], cfg)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("egcd,edh->egch", expert_in, params["w_in"]))
    expert_out = jnp.einsum("egch,ehd->egcd", h, params["w_out"])
    y = x + jnp.einsum("gsec,egcd->gsd", combine, expert_out)
    return y, aux


def loss_fn(params: Params, x: jax.Array, targets: jax.Array, cfg: Config) -> jax.Array:
    y, aux = moe_layer(params, x, cfg)
    return jnp.mean(jnp.square(y - targets)) + cfg.aux_weight * aux


def sgd_step(params: Params, x: jax.Array, targets: jax.Array, *, cfg: Config) -> tuple[Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, targets, cfg)
    return jax.tree.map(lambda p, g: p - cfg.learning_rate * g, params, grads), loss


def expert_specs() -> Params:
    return {"router": P(), "w_in": P("model", None, None), "w_out": P("model", None, None)}


def moe(size: str = "small") -> Model:
    """The MoE training step at ``size`` ("small": real arrays; "large": shapes only)."""
    cfg = SIZES[size]
    key_params, key_batch = jax.random.split(jax.random.key(0))
    make_params = partial(init_params, cfg=cfg)
    make = partial(make_batch, cfg=cfg)
    if size == "small":
        params, (x, targets) = make_params(key_params), make(key_batch)
    else:
        params, (x, targets) = jax.eval_shape(make_params, key_params), jax.eval_shape(make, key_batch)
    batch = P("data")
    specs = expert_specs()
    n_params = sum(p.size for p in jax.tree.leaves(params))
    return Model(
        fun=partial(sgd_step, cfg=cfg),
        args=(params, x, targets),
        in_shardings=(None, batch, batch),
        out_shardings=None,
        name=f"moe-{size}",
        description=(
            f"MoE layer training step (SGD): {cfg.n_experts} experts, top-{cfg.top_k}, d={cfg.d_model}, "
            f"hidden={cfg.hidden}, {cfg.groups} groups x {cfg.group_size} tokens, capacity {cfg.capacity}; "
            f"{n_params:,} parameters"
        ),
        expert_in_shardings=(specs, batch, batch),
        expert_out_shardings=(specs, P()),
        mesh_axes=MESH_AXES,
        carry=((0, 0),),
    )
