"""Fuzz the planner end to end with control flow: random programs planned, run and lowered, then checked.

    python experiments/fuzz_plan.py --count 1000           # writes experiments/results/fuzz_plan.md
    python experiments/fuzz_plan.py --count 20 --seed 1    # another deterministic slice

Programs are drawn by hypothesis (derandomized: the same ``--seed`` and
``--count`` give the same programs) as chains over a 2-D activation ``h`` of
elementwise ops, ``dot_general`` with weight arguments, reductions and
broadcasts, reshapes, transposes, gather/scatter, concatenate, dynamic slices
and updates, ``scan`` (also nested), ``cond``, ``while_loop``,
``custom_jvp``/``custom_vjp`` and ``remat``, sometimes differentiated, on
1-D, 2-D and 3-D meshes of up to 8 devices, with even and uneven shapes,
random pinned annotations and memory limits. Each is planned with
``shardsolve.plan``, run through ``plan.jit()`` and ``shardsolve.lower(plan)``
against the unsharded function, and checked for predicted == lowered bytes
per collective kind and mesh axes (``tests/lower_cases.check_lowering``).
An ``InfeasibleError`` for a memory limit, and a one-line ``ShardsolveError``
refusing a pin that splits a dimension into more parts than it has elements,
are expected outcomes, not failures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from lower_cases import check_lowering  # noqa: E402

import shardsolve  # noqa: E402
from shardsolve.errors import InfeasibleError, ShardsolveError  # noqa: E402

MESHES = ("x=8", "x=4", "a=2,b=4", "a=4,b=2", "a=2,b=2", "a=2,b=2,c=2")
OPS = ("tanh", "sin_mul", "dot", "center", "reshape", "transpose", "gather", "scatter", "concat", "dynamic",
       "scan", "nested_scan", "cond", "while", "custom_jvp", "custom_vjp", "remat")
OUT = Path(__file__).resolve().parent / "results" / "fuzz_plan.md"


@jax.custom_jvp
def _softsign(x):
    return x / (1.0 + jnp.abs(x))


_softsign.defjvp(lambda primals, tangents: (_softsign(primals[0]), tangents[0] / (1.0 + jnp.abs(primals[0])) ** 2))


@jax.custom_vjp
def _scaled_tanh(x):
    return 0.5 * jnp.tanh(x)


_scaled_tanh.defvjp(lambda x: (0.5 * jnp.tanh(x), x), lambda x, g: (0.5 * g * (1.0 - jnp.tanh(x) ** 2),))


@dataclass
class Program:
    """A drawn program: ``fun(h, ws)``, its example arguments, mesh, pins and memory limit, and its text."""

    ops: tuple[str, ...]
    batch: int
    width: int
    mesh: str
    h_spec: object
    w_specs: tuple
    memory: str | None
    grad: bool
    seed: int
    args: tuple = field(default=())

    @property
    def text(self) -> str:
        return (f"ops={list(self.ops)} h=({self.batch},{self.width}) mesh={self.mesh} h_spec={self.h_spec} "
                f"w_specs={list(self.w_specs)} memory={self.memory} grad={self.grad} seed={self.seed}")

    def n_weights(self) -> int:
        return sum(op in ("dot", "scan", "nested_scan") for op in self.ops)

    def fun(self, h, ws):
        ws = list(ws)
        b, d = self.batch, self.width
        k = 0
        for op in self.ops:
            if op == "tanh":
                h = jnp.tanh(h)
            elif op == "sin_mul":
                h = jnp.sin(h) * h
            elif op == "dot":
                h = jnp.tanh(h @ ws[k])
                k += 1
            elif op == "center":  # reduction + broadcast
                h = h - jnp.mean(h, axis=1, keepdims=True) + jnp.max(h, axis=0)
            elif op == "reshape":
                h = h.reshape(b, d // 2, 2).transpose(0, 2, 1).reshape(b, d) if d % 2 == 0 else h.reshape(-1).reshape(b, d)
            elif op == "transpose":
                h = (h.T * 1.5).T
            elif op == "gather":
                h = jnp.take(h, jnp.array([(3 * i + 1) % b for i in range(b)]), axis=0)
            elif op == "scatter":
                h = h.at[jnp.array([0, b - 1])].add(jnp.ones((2, d)))
            elif op == "concat":
                h = jnp.concatenate([h, 2.0 * h], axis=1)[:, d // 2: d // 2 + d]
            elif op == "dynamic":
                i = jnp.argmax(h[0]) % 2
                part = lax.dynamic_slice_in_dim(h, i, b // 2, axis=0)
                h = lax.dynamic_update_slice_in_dim(h, jnp.cos(part), b - b // 2 - i, axis=0)
            elif op == "scan":
                def body(c, w):
                    return jnp.tanh(c @ w), jnp.sum(c, axis=0)

                h, _ = lax.scan(body, h, ws[k])
                k += 1
            elif op == "nested_scan":
                def outer(c, w):
                    def inner(g, _):
                        return jnp.tanh(g @ w), None

                    c, _ = lax.scan(inner, c, None, length=2)
                    return c, None

                h, _ = lax.scan(outer, h, ws[k])
                k += 1
            elif op == "cond":
                h = lax.cond(jnp.sum(h) > 0, lambda a: jnp.sin(a), lambda a: a * 0.5, h)
            elif op == "while":
                h = lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0]) * 1.1, c[1] + 1), (h, 0))[0]
            elif op == "custom_jvp":
                h = _softsign(h)
            elif op == "custom_vjp":
                h = _scaled_tanh(h)
            elif op == "remat":
                h = jax.checkpoint(lambda a: jnp.sin(a) * jnp.cos(a))(h)
        return h

    def program(self):
        if not self.grad:
            return self.fun

        def step(h, ws):
            loss, grads = jax.value_and_grad(lambda ws: jnp.mean(self.fun(h, ws) ** 2))(ws)
            return loss, grads

        return step


@st.composite
def programs(draw) -> Program:
    n = draw(st.integers(1, 4))
    ops = tuple(draw(st.sampled_from(OPS)) for _ in range(n))
    batch = draw(st.sampled_from((8, 16, 6, 12)))
    width = draw(st.sampled_from((8, 16, 6, 12)))
    mesh = draw(st.sampled_from(MESHES))
    axes = [a.split("=")[0] for a in mesh.split(",")]
    h_spec = draw(st.sampled_from((None, P(axes[0]), P(None, axes[-1]), P(tuple(axes[:2])))))
    n_w = sum(op in ("dot", "scan", "nested_scan") for op in ops)
    w_specs = tuple(draw(st.sampled_from((None, None, P(None, axes[-1]), P(axes[0])))) for _ in range(n_w))
    memory = draw(st.sampled_from((None, None, "1MiB", "6KiB")))
    grad = n_w > 0 and "while" not in ops and draw(st.booleans())  # JAX cannot differentiate a while_loop
    return Program(ops, batch, width, mesh, h_spec, w_specs, memory, grad, draw(st.integers(0, 2**16)))


def arguments(p: Program) -> tuple:
    keys = jax.random.split(jax.random.key(p.seed), 1 + p.n_weights())
    h = jax.random.normal(keys[0], (p.batch, p.width))
    ws, k = [], 1
    for op in p.ops:
        if op == "dot":
            ws.append(jax.random.normal(keys[k], (p.width, p.width)) / p.width**0.5)
        elif op in ("scan", "nested_scan"):
            ws.append(jax.random.normal(keys[k], (2, p.width, p.width)) / p.width**0.5)
        else:
            continue
        k += 1
    return h, ws


@dataclass
class Result:
    program: Program
    outcome: str  # ok, infeasible, refused, crash, numerics, collectives
    detail: str = ""
    fallbacks: tuple = ()


def _close(got, want, rtol=2e-4, atol=2e-5) -> float | None:
    """None when every leaf agrees, else the worst relative error."""
    a_leaves, b_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(a_leaves) != len(b_leaves):
        return float("inf")
    worst, ok = 0.0, True
    for a, b in zip(a_leaves, b_leaves, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return float("inf")
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        ok &= err <= atol + rtol * scale
        worst = max(worst, err / max(scale, 1e-30))
    return None if ok else worst


def reference(fun, args: tuple):
    """The unsharded function run op by op (``jax.disable_jit``): one primitive per XLA program.

    Not ``jax.jit(fun)``: XLA (CPU, jax 0.10.2) fuses a ``dynamic_slice`` of a
    fresh buffer into the in-place ``dynamic_update_slice`` of that buffer and
    overwrites rows the slice still reads, so the jitted reference of
    ``ops=['reshape', 'gather', 'transpose', 'dynamic']`` is itself wrong.
    """
    with jax.disable_jit():
        return jax.tree_util.tree_map(np.asarray, fun(*args))


def run_one(p: Program, time_limit: float = 10) -> Result:
    h, ws = arguments(p)
    fun = p.program()
    args = (h, ws)
    stacked = [op in ("scan", "nested_scan") for op in p.ops if op in ("dot", "scan", "nested_scan")]
    w_specs = [P(None, *spec) if spec is not None and is_stacked else spec for spec, is_stacked in zip(p.w_specs, stacked, strict=True)]
    in_specs = (p.h_spec, w_specs)  # a scan's weights are pinned past their layer dimension
    try:
        plan = shardsolve.plan(fun, *args, mesh=p.mesh, in_shardings=in_specs, memory_limit=p.memory,
                               time_limit=time_limit)
    except InfeasibleError as e:
        return Result(p, "infeasible", str(e)[:160])
    except ShardsolveError as e:  # a pin the shapes cannot take: refused in one line, as it should be
        return Result(p, "refused", str(e)[:160])
    except Exception as e:  # noqa: BLE001
        return Result(p, "crash", f"plan: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    try:
        want = reference(fun, args)
        worst = _close(plan.jit()(*args), want)
        if worst is not None:
            return Result(p, "numerics", f"plan.jit() off by {worst:.2e}", plan.fallbacks)
        outcome = check_lowering(plan, args, want, rtol=2e-4, atol=2e-5)
    except Exception as e:  # noqa: BLE001
        return Result(p, "crash", f"run: {type(e).__name__}: {str(e).splitlines()[0][:300]}\n"
                                  + traceback.format_exc(limit=-3), plan.fallbacks)
    if not outcome.numerics_ok:
        return Result(p, "numerics", f"lower() off by {outcome.max_rel:.2e}", plan.fallbacks)
    if not outcome.collectives_ok:
        return Result(p, "collectives", f"predicted {outcome.predicted} != lowered {outcome.lowered}", plan.fallbacks)
    return Result(p, "ok", "", plan.fallbacks)


def fuzz(count: int, start: int = 0, on_result=None) -> list[Result]:
    """Run ``count`` hypothesis programs drawn from seed ``start``; every result, failures included."""
    results: list[Result] = []

    @seed(start)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def each(p):
        r = run_one(p)
        results.append(r)
        if on_result:
            on_result(r)

    each()
    return results


def summary(results: list[Result], seconds: float, start: int = 0) -> str:
    kinds = ("ok", "infeasible", "refused", "crash", "numerics", "collectives")
    counts = {k: sum(r.outcome == k for r in results) for k in kinds}
    with_cf = sum(any(op in ("scan", "nested_scan", "cond", "while") for op in r.program.ops) for r in results)
    lines = [
        "# Fuzzing the planner with control flow",
        "",
        f"Written by `python experiments/fuzz_plan.py --count {len(results)} --seed {start}`: {len(results)} programs "
        f"in {seconds:.0f} s, {len({r.program.text for r in results})} distinct "
        f"({with_cf} with scan, cond or while_loop).",
        "",
        "| outcome | programs |",
        "|---|---|",
        *(f"| {k} | {counts[k]} |" for k in kinds),
        "",
    ]
    bad = [r for r in results if r.outcome in ("crash", "numerics", "collectives")]
    if bad:
        lines += ["## Failures", ""] + [f"- {r.outcome}: `{r.program.text}`: {r.detail.splitlines()[0]}" for r in bad]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    started = time.perf_counter()

    so_far: list[Result] = []

    def show(r: Result) -> None:
        print(f"{r.outcome:12s} {r.program.text} {r.detail.splitlines()[0] if r.detail else ''}", flush=True)
        so_far.append(r)
        if len(so_far) % 25 == 0:  # an interrupted campaign keeps its figures
            Path(args.out).write_text(summary(so_far, time.perf_counter() - started, args.seed))

    results = fuzz(args.count, args.seed, show)
    text = summary(results, time.perf_counter() - started, args.seed)
    Path(args.out).write_text(text)
    print(text)
    return 1 if any(r.outcome in ("crash", "numerics", "collectives") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
