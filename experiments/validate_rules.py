"""Validate every strategy of every rule numerically (the long campaign).

Runs ``shardsolve.rules.validate`` over all strategies (not a sample) of the
representative equations in ``tests/rule_cases.py`` on 8 fake CPU devices, for
each mesh, and prints one line per (equation, mesh) plus totals. Writes the
table to ``experiments/results/rule_validation.md``.

    python experiments/validate_rules.py                  # everything
    python experiments/validate_rules.py --case embedding --mesh a=2,b=4
    python experiments/validate_rules.py --limit 50       # a sample per pair
    python experiments/validate_rules.py --model models/gpt2.py:gpt2 --limit 12
        # every distinct equation of a model's training step instead of the cases
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from rule_cases import CASES, MESHES, Case, equation  # noqa: E402

from shardsolve.mesh import MeshSpec  # noqa: E402
from shardsolve.rules.validate import rule_of, validate  # noqa: E402


def model_cases(spec: str, int_high: int) -> list[Case]:
    """One case per distinct equation (primitive, shapes, dtypes, parameters) of a model."""
    import jax

    import shardsolve
    from shardsolve.rules import rule_key
    from shardsolve.rules.validate import equations, op_view

    model = shardsolve.load_model(spec, "small")
    jaxpr = jax.make_jaxpr(model.fun)(*model.args).jaxpr
    seen: set = set()
    out = []
    for eqn in equations(jaxpr):
        if eqn.primitive.name in ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "scan", "while", "cond"):
            continue
        key = rule_key(op_view(eqn)) or id(eqn)
        if key in seen:
            continue
        seen.add(key)
        name = f"{eqn.primitive.name}#{len(out)}"
        out.append(Case(name, (lambda e=eqn: e), (), "<eqn>", int_range=(0, int_high), family=eqn.primitive.name))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="case name (repeatable); default: all")
    parser.add_argument("--mesh", action="append", help="mesh like a=2,b=4 (repeatable); default: x=8, a=2,b=4, a=2,b=2,c=2")
    parser.add_argument("--limit", type=int, default=None, help="strategies per (case, mesh); default: all")
    parser.add_argument("--model", help="FILE:NAME of a model (small size): validate its distinct equations")
    parser.add_argument("--int-high", type=int, default=16, help="integer operands of model equations lie in [0, this)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "rule_validation.md")
    args = parser.parse_args(argv)

    cases = model_cases(args.model, args.int_high) if args.model else CASES
    cases = [c for c in cases if not args.case or c.name in args.case]
    meshes = args.mesh or list(MESHES)
    rows = ["| case | family | mesh | strategies | failures | seconds | rule |", "|---|---|---|---|---|---|---|"]
    total = failed = 0
    start = time.perf_counter()
    for case in cases:
        eqn = case.fn() if case.primitive == "<eqn>" else equation(case)
        rule = rule_of(eqn)
        for mesh in meshes:
            t = time.perf_counter()
            checked, bad = validate(
                eqn, MeshSpec.parse(mesh), limit=args.limit, int_range=case.int_range, rtol=case.rtol, atol=case.atol
            )
            dt = time.perf_counter() - t
            total += checked
            failed += len(bad)
            print(f"{case.name:24s} {mesh:14s} {checked:4d} strategies {len(bad):3d} failures {dt:6.1f}s", flush=True)
            for m in bad:
                print(f"    {m}")
            rows.append(f"| {case.name} | {case.family} | {mesh} | {checked} | {len(bad)} | {dt:.1f} | `{rule}` |")
    elapsed = time.perf_counter() - start
    summary = f"{total} strategies checked, {failed} failures, {elapsed:.0f} s"
    print(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Rule validation\n\n" + summary + "\n\n" + "\n".join(rows) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
