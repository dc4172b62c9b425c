"""How planning scales with depth: GPT-2-style training steps of 12 to 96 layers on a 2x4 mesh.

For each depth it measures, in one run and side by side: tracing, building the
problem, the graph size before and after the solver's exact reductions and
after layer tying, solving (status and certified gap of the untied problem),
and JAX's own compile time of the same function with the same batch
annotation (Shardy propagation). The ratio
planning / JAX compile is the figure of merit: planning should never be the
bottleneck.

    python experiments/scaling.py                       # 12, 24, 48, 96 layers
    python experiments/scaling.py --layers 12 --time-limit 60
    python experiments/scaling.py --layers 12 --no-tie  # every layer searched on its own

Writes experiments/results/scaling.md: the rows of the depths measured in this run
replace those rows of the file, other rows are kept (each row says the load average
of its run); text below the ``<!-- notes -->`` line is kept as it is.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import shardsolve  # noqa: E402
from shardsolve.mesh import MeshSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_gpt2_module():
    spec = importlib.util.spec_from_file_location("gpt2_model", ROOT / "models" / "gpt2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt2_model"] = module
    spec.loader.exec_module(module)
    return module


def jax_compile_seconds(model, mesh: MeshSpec) -> float:
    """Seconds for jax.jit(...).lower(...).compile() with the model's own annotations (Shardy)."""
    jmesh = mesh.jax_mesh()
    leaves, tree = jax.tree_util.tree_flatten(model.args)
    from shardsolve.annotations import broadcast_annotations

    anns = broadcast_annotations(model.in_shardings, tree, "in_shardings")
    args = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(jmesh, a if a is not None else jax.sharding.PartitionSpec()))
        if a is not None else jax.ShapeDtypeStruct(x.shape, x.dtype)
        for x, a in zip(leaves, anns)
    ]
    start = time.perf_counter()
    with jax.sharding.use_mesh(jmesh) if hasattr(jax.sharding, "use_mesh") else _null():
        jax.jit(model.fun).lower(*jax.tree_util.tree_unflatten(tree, args)).compile()
    return time.perf_counter() - start


def warm_up() -> None:
    """Pay a process's one-time costs before any timing, on both sides: JAX's backend and first compile, and
    importing shardsolve's planner and solvers (which loads the TRW-S kernels from numba's cache, about a
    second), as a user's session pays them once, not per plan."""
    jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((8,), jax.numpy.float32)).compile()
    importlib.import_module("shardsolve.planner")
    importlib.import_module("shardsolve.encodings")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


COLUMNS = ["layers", "ops", "nodes", "after reductions", "after tying", "trace+build s", "solve s", "plan s",
           "JAX compile s", "plan / compile", "status", "gap", "tying", "load"]
NOTES_MARK = "<!-- notes -->"


def read_results(path: Path) -> tuple[list[list[str]], str]:
    """The table rows (in ``COLUMNS`` order; a missing column is ``?``) and the text after ``NOTES_MARK``."""
    if not path.exists():
        return [], ""
    text = path.read_text()
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        row = dict(zip(header, cells))
        if row.get("layers", "").isdigit():
            rows.append([row.get(c, "?") for c in COLUMNS])
    notes = text.split(NOTES_MARK, 1)[1].lstrip("\n") if NOTES_MARK in text else ""
    return rows, notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--mesh", default="data=2,model=4")
    parser.add_argument("--time-limit", type=float, default=None, help="solver seconds (default: 2x JAX's compile time)")
    parser.add_argument("--skip-compile", action="store_true", help="do not compile with JAX (no ratio)")
    parser.add_argument("--no-tie", action="store_true", help="plan every layer on its own (no layer tying)")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "scaling.md"), help="results file")
    args = parser.parse_args(argv)
    console = Console()
    gpt2 = load_gpt2_module()
    mesh = MeshSpec.parse(args.mesh)
    table = Table(title=f"GPT-2 training step on {mesh}: planning vs JAX compile")
    cols = COLUMNS
    for c in cols:
        table.add_column(c, justify="right")
    rows = []
    warm_up()
    load_start = os.getloadavg()[0]
    for n in args.layers:
        model = gpt2.gpt2_layers(n, "large")
        compile_s = float("nan") if args.skip_compile else jax_compile_seconds(model, mesh)
        limit = args.time_limit or (max(10.0, 2 * compile_s) if compile_s == compile_s else 60.0)
        start = time.perf_counter()
        plan = shardsolve.plan(model.fun, *model.args, mesh=mesh, in_shardings=model.in_shardings,
                               out_shardings=model.out_shardings, carry=model.carry, time_limit=limit,
                               tie=not args.no_tie)
        total = time.perf_counter() - start
        stats = dict(plan.stats)
        tying = f"{stats['tying']} ({stats['tie_bound']} bound)" if "tying" in stats else "off"
        row = [
            str(n), str(stats.get("ops", "")), str(stats.get("problem_nodes", "")),
            str(stats.get("decisions_after", stats.get("nodes_after", ""))),
            str(stats.get("tied_decisions", "-")),
            f"{total - plan.solve_time:.1f}", f"{plan.solve_time:.1f}", f"{total:.1f}",
            f"{compile_s:.1f}", f"{total / compile_s:.2f}" if compile_s == compile_s else "-",
            plan.status, f"{plan.gap:.3%}", tying, "",
        ]
        rows.append(row)
        table.add_row(*row)
        console.print(f"{n} layers: plan {total:.1f} s, compile {compile_s:.1f} s, {plan.status}, gap {plan.gap:.3%}")
    load = f"{load_start:.1f} / {os.getloadavg()[0]:.1f}"
    for r in rows:
        r[-1] = load
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old_rows, notes = read_results(out)
    merged = {r[0]: r for r in old_rows}
    merged.update({r[0]: r for r in rows})
    lines = [f"# Planning time vs JAX compile time (GPT-2 training step, mesh {mesh})", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(merged[k]) + " |" for k in sorted(merged, key=lambda k: int(k))]
    lines += [
        "",
        "`nodes`: problem nodes; `after reductions`: decision nodes left by the exact reductions;",
        "`after tying`: decision nodes of the tied problem (repeated layers share strategies,",
        "`shardsolve.encodings.tying`); `trace+build s`: everything but the solver (tracing, building the",
        "problem, the plan's collectives); `JAX compile s`: `jax.jit(...).lower(...).compile()` of",
        "the same function with the same batch annotation, measured first in the same process;",
        "both after `warm_up()`: JAX's backend and first compile, and importing shardsolve's planner",
        "and solvers (about a second: the TRW-S kernels load from numba's cache), paid once a process;",
        "`status`/`gap`: for the *untied* problem (`optimal` only when a certified bound of the",
        "untied problem meets the plan's cost); `tying`: `exact` when that bound proves the tied",
        "plan optimal, `restricted` otherwise, with how the bound was obtained; `load`: load average",
        "(1 min) of the shared 2-core machine at the start / end of the run that measured the row",
        "(rows of other depths are kept from earlier runs); wall-clock times are noisy.",
        "",
        NOTES_MARK,
    ]
    out.write_text("\n".join(lines) + "\n" + notes)
    console.print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
