"""A decoder-only transformer LM written with Flax NNX, trained with optax AdamW.

The model is what a Flax user writes: ``nnx.Embed`` token and position
embeddings, ``n_layers`` pre-LayerNorm blocks (``nnx.LayerNorm``; causal
multi-head attention from ``nnx.Linear`` projections; a gelu MLP), a final
LayerNorm and an ``nnx.Linear`` unembedding. Every parameter carries logical
axis names (``nnx.with_partitioning``), in MaxText's vocabulary:

==============================  ===========================
parameter                        logical names
==============================  ===========================
``embed.embedding``              ``("vocab", "embed")``
``pos.embedding``                ``("position", "embed")``
``q``/``k``/``v`` kernel, bias   ``("embed", "heads")``, ``("heads",)``
``o`` kernel, bias               ``("heads", "embed")``, ``("embed",)``
``fc`` kernel, bias              ``("embed", "mlp")``, ``("mlp",)``
``proj`` kernel, bias            ``("mlp", "embed")``, ``("embed",)``
LayerNorm scale, bias            ``("norm",)``
``head`` kernel                  ``("embed", "vocab")``
==============================  ===========================

The ``heads`` dimension of a projection is head-major (``heads x head_dim``),
so an even split of it keeps whole heads together.

The training step runs over ``nnx.split`` state, the way an NNX training loop
does under ``jax.jit``::

    step(params, opt_state, tokens, targets) -> (new_params, new_opt_state, loss)

``params = nnx.split(model)[1]``, ``opt_state = nnx.split(optimizer)[1]`` for
``optimizer = nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` (its
moments carry the parameters' logical names too); inside, ``nnx.merge``,
``nnx.value_and_grad`` of the cross-entropy and ``optimizer.update``.

Annotations on a mesh with axes ``mesh_axes`` (default ``("data", "model")``;
``("data", "fsdp", "model")`` for FSDP): ``in_shardings`` pins only the batch,
on MaxText's data-parallel axes (``activation_batch``: ``P("data")``, or
``P(("data", "fsdp"))``); parameters and optimizer state are free.
``expert_in_shardings``: MaxText's default logical-axis rules
(``shardsolve.flax.MAXTEXT_RULES``; ``tensor`` is ``"model"`` here) applied
with Flax's own ``logical_to_mesh``: vocab, heads and mlp on ``"model"``,
embed on ``"fsdp"`` where the mesh has it, norm scales on ``"model"``.

Sizes: ``small`` (2 layers, d 64, 4 heads, seq 16, vocab 256, batch 8; real
arrays) runs numerically on 8 CPU devices; ``large`` has GPT-2 small's shape (12
layers, d 768, 12 heads, seq 1024, vocab 50304, batch 16; 163M parameters with
its untied head), ``jax.ShapeDtypeStruct``s from ``nnx.eval_shape``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardsolve import Model
from shardsolve.flax import logical_specs, maxtext_rules, require_flax, rule_spec

require_flax("models/flax_lm.py")
import optax  # noqa: E402
from flax import nnx  # noqa: E402

MESH_AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class Config:
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab: int
    batch: int
    learning_rate: float = 3e-3
    weight_decay: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


SIZES: dict[str, Config] = {
    "small": Config(n_layers=2, d_model=64, n_heads=4, seq_len=16, vocab=256, batch=8),
    "large": Config(n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab=50304, batch=16, learning_rate=3e-4),
}


def _normal(std: float):
    return nnx.initializers.normal(std)


def _linear(d_in: int, d_out: int, names: tuple[str, str], std: float, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias,
                      kernel_init=nnx.with_partitioning(_normal(std), names),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (names[1],)), rngs=rngs)


def _layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=1e-5,
                         scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",)),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("norm",)), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, std = cfg.d_model, 0.02
        self.n_heads = cfg.n_heads
        self.q = _linear(d, d, ("embed", "heads"), std, rngs)
        self.k = _linear(d, d, ("embed", "heads"), std, rngs)
        self.v = _linear(d, d, ("embed", "heads"), std, rngs)
        self.o = _linear(d, d, ("heads", "embed"), std / (2 * cfg.n_layers) ** 0.5, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = (f(x).reshape(b, t, h, d // h) for f in (self.q, self.k, self.v))
        att = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        att = jax.nn.softmax(jnp.where(causal, att, jnp.finfo(x.dtype).min), axis=-1)
        return self.o(jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d = cfg.d_model
        self.ln1 = _layer_norm(d, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = _layer_norm(d, rngs)
        self.fc = _linear(d, 4 * d, ("embed", "mlp"), 0.02, rngs)
        self.proj = _linear(4 * d, d, ("mlp", "embed"), 0.02 / (2 * cfg.n_layers) ** 0.5, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d = cfg.d_model
        self.embed = nnx.Embed(cfg.vocab, d, embedding_init=nnx.with_partitioning(_normal(0.02), ("vocab", "embed")),
                               rngs=rngs)
        self.pos = nnx.Embed(cfg.seq_len, d, embedding_init=nnx.with_partitioning(_normal(0.01), ("position", "embed")),
                             rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _layer_norm(d, rngs)
        self.head = _linear(d, cfg.vocab, ("embed", "vocab"), 0.02, rngs, bias=False)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def optimizer_for(model: LM, cfg: Config) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adamw(cfg.learning_rate, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay),
                         wrt=nnx.Param)


def init(cfg: Config) -> tuple[LM, nnx.Optimizer]:
    """The model and its optimizer, from the fixed key 0 (names kept as metadata: no mesh is needed)."""
    with nnx.use_eager_sharding(False):
        model = LM(cfg, nnx.Rngs(0))
        return model, optimizer_for(model, cfg)


def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array, *, graphdef: Any,
               opt_graphdef: Any) -> tuple[Any, Any, jax.Array]:
    """One AdamW step over ``nnx.split`` state: ``(new_params, new_opt_state, loss)``."""
    model = nnx.merge(graphdef, params, copy=True)  # copies: the caller's state is never updated in place
    optimizer = nnx.merge(opt_graphdef, opt_state, copy=True)

    def loss_fn(m: LM) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(m(tokens), targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state(model), nnx.state(optimizer), loss


def make_batch(key: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(key, (cfg.batch, cfg.seq_len), 0, cfg.vocab, dtype=jnp.int32)
    return tokens, jnp.roll(tokens, -1, axis=1)


def flax_lm(size: str = "small", mesh_axes: tuple[str, ...] = MESH_AXES) -> Model:
    """The Flax LM's AdamW training step at ``size`` ("small" or "large"), annotated for ``mesh_axes``."""
    cfg = SIZES[size]
    if size == "small":
        model, optimizer = init(cfg)
        tokens, targets = make_batch(jax.random.key(1), cfg)
    else:  # shapes only: nothing is allocated
        model, optimizer = nnx.eval_shape(lambda: init(cfg))
        tokens, targets = jax.eval_shape(partial(make_batch, cfg=cfg), jax.random.key(1))
    graphdef, params = nnx.split(model)
    opt_graphdef, opt_state = nnx.split(optimizer)
    rules = maxtext_rules(mesh_axes)
    batch = rule_spec(rules, "activation_batch")
    param_specs, opt_specs = logical_specs(params, rules), logical_specs(opt_state, rules)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return Model(
        fun=partial(train_step, graphdef=graphdef, opt_graphdef=opt_graphdef),
        args=(params, opt_state, tokens, targets),
        in_shardings=(None, None, batch, batch),
        name=f"flax-lm-{size}-{cfg.n_layers}l",
        description=(f"Flax NNX decoder LM, optax AdamW: {cfg.n_layers} layers, d_model={cfg.d_model}, "
                     f"{cfg.n_heads} heads, seq={cfg.seq_len}, vocab={cfg.vocab}, batch={cfg.batch}; "
                     f"{n_params:,} parameters"),
        expert_in_shardings=(param_specs, opt_specs, batch, batch),
        expert_out_shardings=(param_specs, opt_specs, P()),
        mesh_axes=tuple(mesh_axes),
        carry=((0, 0), (1, 1)),
    )


def flax_lm_fsdp(size: str = "small") -> Model:
    """``flax_lm`` annotated for a mesh with axes ``("data", "fsdp", "model")`` (MaxText's rules put embed on fsdp)."""
    return flax_lm(size, ("data", "fsdp", "model"))
