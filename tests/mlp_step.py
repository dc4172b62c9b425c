"""A small MLP training step and its annotations, shared by the tests of hints and of propagation's start."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MESH = "data=2,model=4"


def mlp_step(params, x):
    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value


ARGS = ({"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)},
        jax.ShapeDtypeStruct((32, 64), jnp.float32))
BATCH = (None, P("data"))
EXPERT = ({"w1": P(None, "model"), "w2": P("model", None)}, P("data"))
