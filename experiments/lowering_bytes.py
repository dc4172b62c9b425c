"""Collective bytes per device of every bundled model: predicted by the plan, lowered, and JAX's own.

For each model in ``models/`` (size ``small``, the model's own annotations and
carry pairs) on one mesh, plan with each solver asked for (``real``:
``shardsolve.plan`` with ``--time-limit``; ``greedy``: the node-by-node
cheapest strategy of ``tests/lower_cases.py``, layers untied), then
``shardsolve.verify``:

* predicted: ``plan.collectives``, bytes per device of one run (a scan body's
  collectives once, as the compiled while loop shows them);
* lowered: the collectives the rewriter wrote (the traced program of
  ``shardsolve.lower(plan)``, before XLA);
* JAX: the optimized HLO of ``plan.jit()``, the same program as XLA compiled it
  (what runs);
* pinned: the optimized HLO of ``plan.jit(execution="pinned")``, JAX's
  partitioner with the plan's non-partial shardings pinned, for reference;
* numerics of ``plan.jit()`` (and of the pinned program) against the unsharded function.

Predicted, lowered and JAX are compared per (collective kind, mesh axes), byte
for byte; the pinned program is reported beside them. Optionally a fuzz campaign
(``experiments/fuzz_lower.py``) runs afterwards and its summary lines are
recorded in the same results file.

    python experiments/lowering_bytes.py                                  # all models, real + greedy
    python experiments/lowering_bytes.py --models mlp,gpt2 --solvers real --time-limit 10
    python experiments/lowering_bytes.py --fuzz 100 --fuzz-uneven 50      # plus the rewriter fuzz campaign

Prints a table and writes ``experiments/results/lowering_bytes.md``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
MODELS = {
    "mlp": "models/mlp.py:mlp",
    "gpt2": "models/gpt2.py:gpt2",
    "llama": "models/llama.py:llama",
    "moe": "models/moe.py:moe",
    "scan_transformer": "models/scan_transformer.py:scan_transformer",
    "cnn": "models/cnn.py:cnn",
}


@dataclass
class Row:
    model: str
    solver: str
    status: str
    predicted: int
    lowered: int
    jax: int
    pinned: int
    exact: bool  # predicted == lowered == JAX per (kind, axes)
    lowered_numerics: bool
    pinned_numerics: bool
    kinds: list  # (kind, axes, predicted, lowered, jax, pinned)
    seconds: float
    error: str = ""


def run_one(name: str, solver: str, mesh: str, time_limit: float) -> Row:
    import shardsolve

    sys.path.insert(0, str(ROOT / "tests"))
    from lower_cases import greedy_solver, plan_with_solver

    file, fn = MODELS[name].split(":")
    model = shardsolve.load_model(f"{ROOT / file}:{fn}", "small")
    started = time.time()
    kwargs = dict(mesh=mesh, in_shardings=model.in_shardings, out_shardings=model.out_shardings, carry=model.carry)
    if solver == "real":
        plan = shardsolve.plan(model.fun, *model.args, time_limit=time_limit, **kwargs)
    else:  # every node its cheapest strategy given the ones before, untied (no layer tying where planning ties)
        if "tie" in inspect.signature(shardsolve.plan).parameters:
            kwargs["tie"] = False
        plan = plan_with_solver(greedy_solver(), model.fun, *model.args, **kwargs)
    report = shardsolve.verify(plan, *model.args, pinned=True)
    rows = [(k, a, p, lo, j, report.pinned.get((k, a), 0)) for k, a, p, lo, j in report.rows()]
    status = plan.status + (f" {plan.gap:.1%}" if plan.status == "feasible" and solver == "real" else "")
    return Row(
        model.name, solver, status,
        sum(report.predicted.values()), sum(report.lowered.values()), sum(report.jax.values()),
        sum(report.pinned.values()), report.collectives_ok,
        all(c.lowered_ok for c in report.numerics), all(c.pinned_ok for c in report.numerics),
        rows, time.time() - started,
    )


def fuzz(count: int, uneven: bool) -> tuple[str, list[str]]:
    """Run ``experiments/fuzz_lower.py --quiet``; its summary line and any mismatch or error lines."""
    cmd = [sys.executable, str(ROOT / "experiments" / "fuzz_lower.py"), "--count", str(count), "--quiet"]
    if uneven:
        cmd.append("--uneven")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if ln.startswith("programs fuzzed")), f"no summary (exit {done.returncode})")
    findings = [ln for ln in lines if "MISMATCH" in ln or "ERROR" in ln]
    return " ".join(cmd[1:]).replace(str(ROOT) + "/", ""), [summary] + findings


def _kb(n: int) -> str:
    return f"{n / 1024:,.1f}"


def table(rows: list[Row]) -> list[str]:
    out = [
        "| model | solver | status | predicted KiB | lowered KiB | JAX (plan.jit) KiB | pinned KiB | "
        "predicted == lowered == JAX | numerics plan.jit / pinned | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            out.append(f"| {r.model} | {r.solver} | error: {r.error} | | | | | | | |")
            continue
        out.append(
            f"| {r.model} | {r.solver} | {r.status} | {_kb(r.predicted)} | {_kb(r.lowered)} | {_kb(r.jax)} | "
            f"{_kb(r.pinned)} | {'yes' if r.exact else 'NO'} | {'ok' if r.lowered_numerics else 'MISMATCH'} / "
            f"{'ok' if r.pinned_numerics else 'MISMATCH'} | {r.seconds:.0f} |"
        )
    return out


def details(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        if r.error:
            continue
        out += [f"**{r.model}, {r.solver}** (bytes per device)", "",
                "| kind | axes | predicted | lowered | JAX | pinned |", "|---|---|---|---|---|---|"]
        for kind, axes, p, lo, j, pin in r.kinds:
            mark = "" if p == lo == j else " (differs)"
            out.append(f"| {kind} | {','.join(axes)} | {p:,}{mark} | {lo:,} | {j:,} | {pin:,} |")
        out.append("")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--solvers", default="real,greedy", help="comma-separated: real, greedy (default: both)")
    p.add_argument("--mesh", default="data=2,model=4")
    p.add_argument("--time-limit", type=float, default=20.0, help="seconds for the real solver (default: 20)")
    p.add_argument("--fuzz", type=int, default=0, help="also fuzz this many random programs (fuzz_lower.py)")
    p.add_argument("--fuzz-uneven", type=int, default=0, help="... and this many with uneven dimensions")
    p.add_argument("--out", default=str(RESULTS / "lowering_bytes.md"))
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    models = [m for m in args.models.split(",") if m]
    solvers = [s for s in args.solvers.split(",") if s]
    for m in models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for s in solvers:
        if s not in ("real", "greedy"):
            p.error(f"unknown solver {s!r}; choose real or greedy")

    rows: list[Row] = []
    for m in models:
        for s in solvers:
            print(f"{m} ({s}) ...", flush=True)
            try:
                rows.append(run_one(m, s, args.mesh, args.time_limit))
            except Exception as e:  # noqa: BLE001 - recorded in the table
                rows.append(Row(m, s, "", 0, 0, 0, 0, False, False, False, [], 0.0,
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    lines = [
        f"# Collective bytes per device: predicted, lowered, JAX (mesh {args.mesh}, size small)",
        "",
        "Written by `python experiments/lowering_bytes.py "
        + " ".join(a for a in (argv if argv is not None else sys.argv[1:])) + "`. Each model with its own "
        "annotations and carry pairs; *real*: `shardsolve.plan` with a "
        f"{args.time_limit:g} s time limit; *greedy*: the node-by-node cheapest strategy (`tests/lower_cases.py`), layers untied. "
        "Predicted: `plan.collectives`; lowered: the collectives the rewriter wrote (the traced program of "
        "`shardsolve.lower(plan)`); JAX: the compiled HLO of `plan.jit()` (that program, as it runs); pinned: the "
        "compiled HLO of `plan.jit(execution=\"pinned\")` (JAX's partitioner with the plan's shardings pinned). A "
        "scan body's collectives count once, as the while loop shows them. Numerics: both programs against the "
        "unsharded function (`shardsolve.verify(..., pinned=True)`).",
        "",
    ] + table(rows) + [""] + details(rows)
    fuzz_runs = [(n, u) for n, u in ((args.fuzz, False), (args.fuzz_uneven, True)) if n > 0]
    if fuzz_runs:
        lines += ["## Rewriter fuzz campaign (`experiments/fuzz_lower.py`, random strategies)", ""]
        for n, u in fuzz_runs:
            print(f"fuzz --count {n}{' --uneven' if u else ''} ...", flush=True)
            cmd, found = fuzz(n, u)
            lines += [f"* `python {cmd}`: {found[0]}"] + [f"  * `{f}`" for f in found[1:]]
        lines.append("")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(table(rows)))
    for ln in lines:
        if ln.startswith("* `python"):
            print(ln)
    print(f"wrote {out}")
    ok = all(r.exact and r.lowered_numerics and not r.error for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
