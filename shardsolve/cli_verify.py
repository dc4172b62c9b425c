"""``shardsolve verify plan.json``: re-load the planned model, lower the plan and check it.

    shardsolve plan models/mlp.py:mlp --mesh data=2,model=4 -o plan.json
    shardsolve verify plan.json              # the model named in the plan's source
    shardsolve verify plan.json --size large # compile only if the arguments are abstract

The model comes from the plan's ``source`` (``"FILE[:NAME] --size S
--annotations A"``, written by ``shardsolve plan``). A plan made for another
signature, mesh or file-format version is refused with a message saying
which. Prints the numerics, the predicted / lowered / JAX bytes per collective
kind and mesh axes, and every difference. Exit status: 0 when the plan
verifies, 1 on a mismatch, 2 on bad input; never a traceback.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from shardsolve.errors import ShardsolveError


def add_verify_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check a plan: numerics and collectives, predicted vs lowered vs JAX",
        description="Re-load the model named in PLAN's source, lower the plan with shardsolve's rewriter and "
        "compare (1) its numerics and those of plan.jit() with the unsharded function and (2) the collectives the "
        "plan predicts with those in the compiled programs, bytes per kind and mesh axes. Exit status 1 on a "
        "mismatch.",
    )
    p.add_argument("plan", metavar="PLAN", help="plan file written by `shardsolve plan -o`")
    p.add_argument("--size", choices=("small", "large"), default=None,
                   help="model size (default: the one the plan was made for)")
    p.add_argument("--top", type=int, default=20, help="how many differences to list (default: 20)")
    p.set_defaults(func=cmd_verify)


def parse_source(source: str) -> tuple[str, str, str]:
    """``"models/mlp.py:mlp --size small --annotations default"`` -> (spec, size, annotations)."""
    if not source.strip():
        raise ShardsolveError(
            "the plan names no model (its 'source' is empty); verify it from Python with "
            "shardsolve.verify(shardsolve.load_plan(path, fun, *args), *args)"
        )
    try:
        words = shlex.split(source)
    except ValueError as e:
        raise ShardsolveError(f"cannot read the plan's source {source!r}: {e}") from None
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("model")
    parser.add_argument("--size", default="small")
    parser.add_argument("--annotations", default="default")
    try:
        ns, _ = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit):
        raise ShardsolveError(
            f"cannot read the plan's source {source!r}; expected 'FILE[:NAME] --size S --annotations A'"
        ) from None
    return ns.model, ns.size, ns.annotations


def _check_mesh(plan, model) -> None:
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


def cmd_verify(args: argparse.Namespace) -> int:
    from shardsolve.cli import _console
    from shardsolve.cli_compare import ensure_host_devices
    from shardsolve.plan import load_plan

    out = _console()
    err = _console(stderr=True)
    plan = load_plan(args.plan)  # format and version checked here
    spec, planned_size, annotations = parse_source(plan.source)
    size = args.size or planned_size
    ensure_host_devices(plan.mesh.size)

    import jax

    import shardsolve
    from shardsolve.verify import verify

    with err.status("loading the model", spinner="dots") as status:
        model = shardsolve.load_model(spec, size)
        _check_mesh(plan, model)
        if len(jax.devices()) < plan.mesh.size:
            raise ShardsolveError(
                f"the plan's mesh {plan.mesh} needs {plan.mesh.size} devices, but only {len(jax.devices())} are "
                f"present; run where there are more, or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{plan.mesh.size} on CPU"
            )
        plan = load_plan(args.plan, model.fun, *model.args)  # signature checked here
        status.update("lowering, compiling and running the plan")
        try:
            report = verify(plan, *model.args)
        except ShardsolveError:
            raise
        except Exception as e:  # a bug in lowering or compiling: report it, exit 1
            err.print(f"[red]error:[/red] verifying the plan failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            return 1
    print_report(report, out, title=f"{args.plan} ({spec}, size {size}, annotations {annotations})", top=args.top)
    return 0 if report.ok else 1


def print_report(report, console, *, title: str = "", top: int = 20) -> None:
    from rich.markup import escape
    from rich.table import Table

    from shardsolve.units import format_bytes

    verdict = "[green]ok[/green]" if report.ok else "[red]MISMATCH[/red]"
    console.print(f"verify {escape(title)} on mesh {report.mesh}: {verdict}")

    if report.numerics_checked:
        table = Table(title="numerics against the unsharded function")
        for col in ("output", "shape", "lowered abs", "lowered rel", "plan.jit abs", "plan.jit rel", "tolerance", ""):
            table.add_column(col)
        for c in report.numerics:
            table.add_row(escape(c.path), escape(f"{c.dtype}{list(c.shape)}"), f"{c.lowered_abs:.2e}", f"{c.lowered_rel:.2e}",
                          f"{c.jit_abs:.2e}", f"{c.jit_rel:.2e}", f"{c.tolerance:.1e}",
                          "ok" if c.ok else "[red]differs[/red]")
        console.print(table)
    else:
        console.print("numerics: skipped (the arguments are abstract; the programs were only compiled)")

    table = Table(title="collectives: bytes per device, by kind and mesh axes")
    for col in ("kind", "axes", "predicted", "lowered", "JAX", ""):
        table.add_column(col)
    for kind, axes, p, lo, j in report.rows():
        mark = "" if p == lo else "[red]predicted != lowered[/red]"
        table.add_row(kind, ",".join(axes), format_bytes(p), format_bytes(lo), format_bytes(j), mark)
    total = [sum(r[k] for r in report.rows()) for k in (2, 3, 4)]
    table.add_row("total", "", *(format_bytes(t) for t in total), "")
    console.print(table)

    diffs = list(report.differences) + list(report.jax_differences)
    if diffs:
        table = Table(title=f"differences ({len(report.differences)} vs lowered, "
                            f"{len(report.jax_differences)} vs JAX; JAX is reported, not required to match)")
        for col in ("against", "where", "predicted", "found", "why"):
            table.add_column(col, overflow="fold")

        def side(items):
            return ", ".join(f"{k}{{{','.join(a)}}} {format_bytes(b)}" for k, a, b in items) or "none"

        for d in diffs[:top]:
            table.add_row(d.against, escape(d.where), side(d.predicted), side(d.found), escape(d.why))
        console.print(table)
        if len(diffs) > top:
            console.print(f"... and {len(diffs) - top} more (--top N lists more)")
