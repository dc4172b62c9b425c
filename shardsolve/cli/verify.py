"""``shardsolve verify PLAN``: re-load the planned model, lower the plan and check it.

    shardsolve plan models/mlp.py:mlp --mesh data=2,model=4 -o plan.json
    shardsolve verify plan.json              # the model named in the plan's source
    shardsolve verify plan.json --size large # compile only if the arguments are abstract

The model comes from the plan's source (``common.ModelSource``, written by
``shardsolve plan``). A plan made for another signature, mesh or file-format
version is refused with a message saying which. Prints the numerics, the
predicted / lowered / JAX bytes per collective kind and mesh axes, and every
difference. Exit status: 0 when the plan verifies, 1 on a mismatch, 2 on bad
input; never a traceback.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardsolve.cli.common import EXIT_MISMATCH, EXIT_OK, ModelSource, console, ensure_host_devices
from shardsolve.errors import ShardsolveError
from shardsolve.model import Model, load_model
from shardsolve.plan import Plan, load_plan
from shardsolve.units import format_bytes
from shardsolve.verify import VerifyReport, verify


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check a plan: numerics and collectives, predicted vs lowered vs JAX",
        description="Re-load the model named in PLAN's source, lower the plan with shardsolve's rewriter and "
        "compare (1) the numerics of plan.jit() with the unsharded function and (2) the collectives the "
        "plan predicts with those in the compiled programs, bytes per kind and mesh axes. Exit status 1 on a "
        "mismatch.",
    )
    p.add_argument("plan", metavar="PLAN", help="plan file written by `shardsolve plan -o`")
    p.add_argument("--size", choices=("small", "large"), default=None,
                   help="model size (default: the one the plan was made for)")
    p.add_argument("--top", type=int, default=20, help="how many differences to list (default: 20)")
    p.set_defaults(func=run)


def check_mesh(plan: Plan, model: Model) -> None:
    """Refuse a plan whose mesh lacks an axis the model annotates, or whose shardings name unknown axes."""
    names = set(plan.mesh.names)
    missing = [a for a in getattr(model, "mesh_axes", ()) if a not in names]
    if missing:
        raise ShardsolveError(
            f"the plan's mesh {plan.mesh} lacks mesh axis {missing[0]!r} that model {model.name or '?'} annotates "
            f"(it uses {', '.join(model.mesh_axes)}); plan it again for a mesh with those axes"
        )
    used = {a for s in plan.inputs + plan.outputs for a in s.axes + s.partial}
    used |= {a for o in plan.ops for s in o.operands + o.results for a in s.axes + s.partial}
    unknown = sorted(used - names)
    if unknown:
        raise ShardsolveError(
            f"the plan's shardings use mesh axis {unknown[0]!r}, which its mesh {plan.mesh} does not have; "
            "the file is inconsistent: plan the model again"
        )


def run(args: argparse.Namespace) -> int:
    out = console()
    err = console(stderr=True)
    plan = load_plan(args.plan)  # format and version checked here
    source = ModelSource.parse(plan.source)
    size = args.size or source.size
    ensure_host_devices(plan.mesh.size)
    with err.status("loading the model", spinner="dots") as status:
        model = load_model(source.model, size)
        check_mesh(plan, model)
        plan.mesh.devices_mesh("verifying the plan")
        plan = load_plan(args.plan, model.fun, *model.args)  # signature checked here
        status.update("lowering, compiling and running the plan")
        try:
            report = verify(plan, *model.args)
        except ShardsolveError:
            raise
        except Exception as e:  # a bug in lowering or compiling: report it, exit 1
            err.print(f"[red]error:[/red] verifying the plan failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            return EXIT_MISMATCH
    print_report(report, out, title=f"{args.plan} ({source.model}, size {size}, annotations {source.annotations})",
                 top=args.top)
    return EXIT_OK if report.ok else EXIT_MISMATCH


def print_report(report: VerifyReport, console: Console, *, title: str = "", top: int = 20) -> None:
    """The verdict, the numerics per output leaf, the inventories side by side, and the differences."""
    verdict = "[green]ok[/green]" if report.ok else "[red]MISMATCH[/red]"
    console.print(f"verify {escape(title)} on mesh {report.mesh}: {verdict}")

    if report.numerics_checked:
        table = Table(title="numerics against the unsharded function")
        for col in ("output", "shape", "abs error", "rel error", "tolerance", ""):
            table.add_column(col)
        for c in report.numerics:
            table.add_row(escape(c.path), escape(f"{c.dtype}{list(c.shape)}"), f"{c.lowered_abs:.2e}", f"{c.lowered_rel:.2e}",
                          f"{c.tolerance:.1e}", "ok" if c.ok else "[red]differs[/red]")
        console.print(table)
    else:
        console.print("numerics: skipped (the arguments are abstract; the programs were only compiled)")

    table = Table(title="collectives: bytes per device, by kind and mesh axes")
    for col in ("kind", "axes", "predicted", "lowered", "JAX", ""):
        table.add_column(col)
    for kind, axes, p, lo, j in report.rows():
        mark = "" if p == lo == j else "[red]differs[/red]"
        table.add_row(kind, ",".join(axes), format_bytes(p), format_bytes(lo), format_bytes(j), mark)
    total = [sum(r[k] for r in report.rows()) for k in (2, 3, 4)]
    table.add_row("total", "", *(format_bytes(t) for t in total), "")
    console.print(table)

    diffs = list(report.differences) + list(report.jax_differences)
    if diffs:
        table = Table(title=f"differences ({len(report.differences)} vs lowered, {len(report.jax_differences)} vs JAX)")
        for col in ("against", "where", "predicted", "found", "why"):
            table.add_column(col, overflow="fold")

        def side(items):
            return ", ".join(f"{k}{{{','.join(a)}}} {format_bytes(b)}" for k, a, b in items) or "none"

        for d in diffs[:top]:
            table.add_row(d.against, escape(d.where), side(d.predicted), side(d.found), escape(d.why))
        console.print(table)
        if len(diffs) > top:
            console.print(f"... and {len(diffs) - top} more (--top N lists more)")
