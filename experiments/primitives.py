"""Every ``jax.lax`` primitive accounted for: a rule, an explicit reported fallback, or unsupported.

    python experiments/primitives.py          # writes experiments/results/primitives.md

The primitives are enumerated from JAX's own ``Primitive`` objects (``jax.lax``,
``jax.lax.linalg``, every module under ``jax._src.lax`` and ``jax._src.random``), plus the call
primitives ``trace`` inlines. Each gets one verdict:

* ``rule``: ``shardsolve.rules.RULES`` has a factor rule for it;
* ``inlined``: ``trace`` inlines its body (``jit``, ``custom_jvp/vjp``, ``remat``);
* ``key data``: a PRNG primitive ``trace`` runs on key data (``random_bits``,
  ``random_split``, ...): the traced program holds the key implementation's
  own ``uint32`` computation instead;
* ``planned body``: ``scan``, whose body is planned once, ``while`` (planned
  as a scan: ``trace`` carries its condition), ``cond`` (``trace`` runs every
  branch and selects);
* ``fallback``: no rule; the planner replicates its operands and reports it in
  ``plan.fallbacks`` (and ``shardsolve plan`` prints "N fell back to replication");
* ``unsupported``: named-axis collectives and their async halves, which only
  exist inside ``shard_map``/``pmap``; planning a program that uses one stops with
  the one-line error shown.

Where the table says ``checked``, a sample program was planned, lowered with
``shardsolve.lower`` and compared with the unsharded function (exact numerics,
predicted == lowered collectives), or, for ``unsupported``, planned to get the
message.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax._src.lax as lax_src  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend.core import Primitive  # noqa: E402
from lower_cases import check_lowering  # noqa: E402

import shardsolve  # noqa: E402
from shardsolve.errors import ShardsolveError  # noqa: E402
from shardsolve.rules import RULES  # noqa: E402
from shardsolve.trace import INLINED, KEY_DATA  # noqa: E402

MESH = "data=2,model=4"
OUT = Path(__file__).resolve().parent / "results" / "primitives.md"


def primitives() -> dict[str, str]:
    """name -> the module that defines it, for every Primitive object under jax.lax."""
    modules = ["jax.lax", "jax.lax.linalg"] + sorted(f"jax._src.lax.{m.name}" for m in pkgutil.walk_packages(lax_src.__path__))
    try:
        import jax._src.random as random_src

        modules += sorted(f"jax._src.random.{m.name}" for m in pkgutil.walk_packages(random_src.__path__))
    except ImportError:  # PRNG internals moved
        pass
    found: dict[str, str] = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional backend module
            continue
        for value in vars(module).values():
            if isinstance(value, Primitive):
                found.setdefault(value.name, name)
    return found


def _named_axis() -> set[str]:
    """Primitives of ``jax._src.lax.parallel``: collectives over named axes, only meaningful in shard_map/pmap."""
    import jax._src.lax.parallel as parallel

    return {v.name for v in vars(parallel).values() if isinstance(v, Primitive)}


NAMED_AXIS = _named_axis()


def _x(*shape):
    return jax.random.normal(jax.random.key(0), shape)


def _spd():
    a = _x(8, 8)
    return a @ a.T + 8 * jnp.eye(8)


# Sample programs of primitives that fall back, or have a rule of their own family: planned and lowered, numerics checked.
SAMPLES = {
    # dropout with a legacy uint32 key: random_wrap, random_bits, threefry2x32, iota_2x32_shape
    "random_bits": (lambda x, key: jnp.where(jax.random.bernoulli(key, 0.75, x.shape), x, 0.0),
                    (_x(16, 8), jax.random.PRNGKey(3))),
    "random_split": (lambda x, seed: x * jax.random.normal(jax.random.split(jax.random.key(seed))[1], x.shape),
                     (_x(16, 8), jnp.int32(4))),
    "random_fold_in": (lambda x, seed: x + jax.random.uniform(jax.random.fold_in(jax.random.key(seed), 2), x.shape),
                       (_x(16, 8), jnp.int32(4))),
    "cond": (lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), (_x(16, 8),)),
    "while": (lambda x: lax.while_loop(lambda h: jnp.max(jnp.abs(h)) > 0.05, lambda h: 0.5 * h, x), (_x(16, 8),)),
    "conv_general_dilated": (lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME"), (_x(8, 3, 8, 8), _x(4, 3, 3, 3))),
    "reduce_window_sum": (lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 2), "VALID"), (_x(16, 8),)),
    "reduce_window_max": (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID"), (_x(16, 8),)),
    "fft": (lambda x: jnp.fft.fft(x).real, (_x(16, 8),)),
    "cholesky": (lambda a: jnp.linalg.cholesky(a), (_spd(),)),
    "triangular_solve": (lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True), (jnp.tril(_spd()), _x(8, 4))),
    "rng_bit_generator": (lambda k: lax.rng_bit_generator(k, (16, 8))[1], (jnp.zeros((4,), jnp.uint32),)),
    "select_and_scatter_add": (jax.grad(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID").sum()),
                               (_x(16, 8),)),
    "scatter": (lambda x, i, u: x.at[i].set(u), (_x(16, 8), jnp.array([1, 5]), _x(2, 8))),
    "eigh": (lambda a: jnp.linalg.eigh(a)[0], (_spd(),)),
}
UNSUPPORTED_SAMPLE = (lambda x: lax.psum(x, "i"), (_x(16, 8),))


def check(fn, args) -> str:
    """Plan, lower and compare ``fn(*args)``: "checked" or what went wrong, in one line."""
    try:
        plan = shardsolve.plan(fn, *args, mesh=MESH, time_limit=10)
        outcome = check_lowering(plan, args)
    except ShardsolveError as e:
        return f"error: {e}"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"crash: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if not outcome.numerics_ok:
        return f"numerics off by {outcome.max_rel:.1e}"
    if not outcome.collectives_ok:
        return "predicted != lowered collectives"
    return f"checked (fallbacks {', '.join(f'{p} x{n}' for p, n in plan.fallbacks) or 'none'})"


def unsupported_message() -> str:
    fn, args = UNSUPPORTED_SAMPLE
    try:
        shardsolve.plan(fn, *args, mesh=MESH)
    except ShardsolveError as e:
        return str(e)
    return "(planned without an error)"


def main() -> int:
    found = primitives()
    for name in INLINED:
        found.setdefault(name, "call (inlined by shardsolve.trace)")
    message = unsupported_message()
    rows = []
    for name in sorted(found):
        module = found[name]
        if name in RULES:
            verdict, note = "rule", ""
        elif name in INLINED:
            verdict, note = "inlined", "its body is traced in place"
        elif name in KEY_DATA:
            verdict, note = "key data", "run on key data by trace"
        elif name == "scan":
            verdict, note = "planned body", "body planned once, costs times the trip count"
        elif name == "while":
            verdict, note = "planned body", ("body and condition planned once as a scan's (a loop counted from a "
                                             "constant to a constant: a scan of its trip count)")
        elif name == "cond":
            verdict, note = "planned body", ("every branch planned, the taken one's results selected; a branch "
                                             "with a while loop falls back (operands replicated, reported)")
        elif name in ("empty", "empty2"):
            verdict, note = "inlined", "zeros (the contents are undefined)"
        elif name in NAMED_AXIS:
            verdict, note = "unsupported", message
        else:
            verdict, note = "fallback", "operands replicated, reported in plan.fallbacks"
        if name in SAMPLES:
            checked = check(*SAMPLES[name])
            note = f"{note}; {checked}" if note else checked
        elif name == "psum":
            note = f"{note}; checked"
        rows.append((name, module, verdict, note))
    verdicts = ("rule", "inlined", "key data", "planned body", "fallback", "unsupported")
    counts = {v: sum(1 for r in rows if r[2] == v) for v in verdicts}
    lines = [
        "# Every jax.lax and jax.random primitive accounted for",
        "",
        f"Written by `python experiments/primitives.py` with JAX {jax.__version__}: {len(rows)} primitives, "
        + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".",
        "",
        "| verdict | primitives |",
        "|---|---|",
        *(f"| {v} | {n} |" for v, n in counts.items()),
        "",
        "| primitive | defined in | verdict | what users see |",
        "|---|---|---|---|",
        *(f"| `{n}` | `{m}` | {v} | {note.replace('|', '/')} |" for n, m, v, note in rows),
        "",
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines))
    print("\n".join(lines[:10]))
    bad = [r for r in rows if "crash" in r[3] or "numerics off" in r[3] or "!=" in r[3]]
    for r in bad:
        print("PROBLEM:", r)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
