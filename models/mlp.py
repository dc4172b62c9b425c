"""A 4-layer MLP training step: the smallest model worth planning.

The network is two up/down blocks, ``d -> hidden -> d -> hidden -> d``, with
gelu after every layer but the last, trained with mean-squared error and one
SGD step::

    step(params, (x, y)) -> (new_params, loss)

Parameters are a dict pytree ``{"w1", "b1", ..., "w4", "b4"}``; ``w1``/``w3``
are ``(d, hidden)`` and ``w2``/``w4`` are ``(hidden, d)``.

Annotations (mesh axes ``("data", "model")``):

* ``in_shardings``: only the batch dimension of ``x`` and ``y`` is pinned to
  ``"data"``; the parameters are left free (``None``) for the solver.
* ``expert_in_shardings``: Megatron-style tensor parallelism. In each block the
  up-projection is column-split (``P(None, "model")``, its bias ``P("model")``)
  and the down-projection row-split (``P("model", None)``, bias replicated), so
  the hidden activations stay sharded on ``"model"`` and each block needs one
  all-reduce forward; the batch is split on ``"data"``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardsolve import Model

# size -> (d, hidden, batch). Small: ~258 KB of float32 parameters.
# Large: ~1.07e9 parameters (4.3 GB), planned from shapes only.
SIZES: dict[str, tuple[int, int, int]] = {
    "small": (64, 256, 32),
    "large": (8192, 32768, 1024),
}
N_LAYERS = 4
LEARNING_RATE = 0.2
MESH_AXES = ("data", "model")

Params = dict[str, jax.Array]


def init_params(key: jax.Array, d: int, hidden: int) -> Params:
    """Scaled-normal weights and zero biases for the four layers."""
    dims = [d, hidden, d, hidden, d]
    keys = jax.random.split(key, N_LAYERS)
    params: Params = {}
    for i, (k, n_in, n_out) in enumerate(zip(keys, dims[:-1], dims[1:]), start=1):
        params[f"w{i}"] = jax.random.normal(k, (n_in, n_out), jnp.float32) / jnp.sqrt(n_in)
        params[f"b{i}"] = jnp.zeros((n_out,), jnp.float32)
    return params


def forward(params: Params, x: jax.Array) -> jax.Array:
    """``x @ w1 + b1 -> gelu -> ... -> @ w4 + b4`` (no activation on the output)."""
    h = x
    for i in range(1, N_LAYERS + 1):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < N_LAYERS:
            h = jax.nn.gelu(h)
    return h


def loss_fn(params: Params, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((forward(params, x) - y) ** 2)


def train_step(params: Params, batch: tuple[jax.Array, jax.Array]) -> tuple[Params, jax.Array]:
    """One SGD step: returns ``(new_params, loss)``."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    new_params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return new_params, loss


def _make_batch(key: jax.Array, d: int, batch: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    return (
        jax.random.normal(kx, (batch, d), jnp.float32),
        jax.random.normal(ky, (batch, d), jnp.float32),
    )


def megatron_specs() -> Params:
    """Column-split up-projections, row-split down-projections."""
    return {
        "w1": P(None, "model"), "b1": P("model"),
        "w2": P("model", None), "b2": P(),
        "w3": P(None, "model"), "b3": P("model"),
        "w4": P("model", None), "b4": P(),
    }  # fmt: skip


def mlp(size: str = "small") -> Model:
    """The MLP training step at ``size`` ("small": real arrays; "large": shapes only)."""
    d, hidden, batch = SIZES[size]
    key_params, key_batch = jax.random.split(jax.random.key(0))
    make_params = partial(init_params, d=d, hidden=hidden)
    make_batch = partial(_make_batch, d=d, batch=batch)
    if size == "small":
        params, data = make_params(key_params), make_batch(key_batch)
    else:  # abstract evaluation: ShapeDtypeStructs, nothing allocated
        params, data = jax.eval_shape(make_params, key_params), jax.eval_shape(make_batch, key_batch)

    batch_specs = (P("data"), P("data"))
    expert_params = megatron_specs()
    return Model(
        fun=train_step,
        args=(params, data),
        in_shardings=(None, batch_specs),
        out_shardings=None,
        name=f"mlp-{size}",
        description=(
            f"{N_LAYERS}-layer MLP training step (d={d}, hidden={hidden}, batch={batch}, "
            f"gelu, MSE loss, SGD); {sum(p.size for p in jax.tree.leaves(params)):,} parameters"
        ),
        expert_in_shardings=(expert_params, batch_specs),
        expert_out_shardings=(expert_params, P()),
        mesh_axes=MESH_AXES,
        carry=((0, 0),),  # params -> new_params
    )
