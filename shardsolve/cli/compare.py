"""``shardsolve compare FILE[:NAME] --mesh ...``: shardsolve's plan beside GSPMD and Shardy, in one table.

    shardsolve compare models/gpt2.py:gpt2 --mesh data=2,model=4 --size large

Compiles the model with GSPMD and Shardy propagation, shardsolve's plan and
(when the model has one) the expert annotation, and prints one table judged by
the one cost model (see ``shardsolve.compare``). It needs a concrete mesh: on a
machine with fewer devices it asks XLA for that many fake CPU devices before
JAX starts its backend.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardsolve.cli.common import (
    add_model_arguments,
    annotations_of,
    check_output,
    console,
    ensure_host_devices,
    keep_interrupted,
    mesh_of,
    ms,
    solver_status,
    source_of,
    write_json,
)
from shardsolve.compare import COLUMNS, Comparison, compare
from shardsolve.explain import explain, explain_column, explain_conflicts
from shardsolve.mesh import MeshSpec
from shardsolve.model import Model, load_model
from shardsolve.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="compare shardsolve's plan with GSPMD and Shardy propagation",
        description="Compile FILE[:NAME] with GSPMD and Shardy propagation, shardsolve's plan and (if the model has "
        "one) its expert annotation, from the same annotations, and judge every compiled program with the one "
        "cost model: per-device FLOPs, memory and the collectives of the optimized HLO. Nothing runs; on a "
        "machine with fewer devices than the mesh, fake CPU devices are used. FILE is imported and run as Python "
        "code: give only files you trust.",
    )
    add_model_arguments(p, annotations_help="which of the model's annotations every program gets (default: the "
                        "model's own)", memory_help="bytes per device for the plan and the 'fits' row, e.g. 16GiB")
    p.add_argument("--no-expert", action="store_true",
                   help="leave out the expert annotation: its column, and its argument shardings as the planner's hints")
    p.add_argument("--explain", action="store_true", help="list the largest collectives of every column, and conflicts")
    p.add_argument("--top", type=int, default=8, help="collectives per column with --explain (default: 8)")
    p.add_argument("-o", "--output", help="write the comparison as JSON to this file")
    p.add_argument("--plan-output", help="write shardsolve's plan as JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mesh = mesh_of(args)
    ensure_host_devices(mesh.size)  # before anything starts JAX's backend (small models allocate arrays)
    out = console()
    check_output(args.output, "compare.json")
    check_output(args.plan_output, "plan.json")
    try:
        model, cmp = _compare(args, mesh)
    except KeyboardInterrupt as interrupt:  # a comparison is complete only when every column is compiled
        keep_interrupted(interrupt, None, "comparison", args.output, lambda path: None)
        raise
    title = f"{model.name or args.model} on {mesh} ({args.annotations} annotations)"
    print_comparison(cmp, out, title=title)
    if args.explain:
        print_explanations(cmp, out, top=args.top)
    if args.output:
        write_json(args.output, cmp.to_json())
        out.print(f"comparison written to [bold]{args.output}[/bold]")
    if args.plan_output and cmp.plan is not None:
        cmp.plan.save(args.plan_output)
        out.print(f"plan written to [bold]{args.plan_output}[/bold]")
    return 0


def _compare(args: argparse.Namespace, mesh: MeshSpec) -> tuple[Model, Comparison]:
    with console(stderr=True).status("loading the model", spinner="dots") as status:
        model = load_model(args.model, args.size)
        in_sh, out_sh = annotations_of(model, args.annotations)
        columns = [c for c in COLUMNS if c != "expert" or not args.no_expert]
        return model, compare(
            model.fun,
            *model.args,
            mesh=mesh,
            in_shardings=in_sh,
            out_shardings=out_sh,
            memory_limit=args.memory_limit,
            time_limit=args.time_limit,
            expert_in_shardings=None if args.annotations == "expert" or args.no_expert else model.expert_in_shardings,
            expert_out_shardings=None if args.annotations == "expert" or args.no_expert else model.expert_out_shardings,
            progress=lambda message: status.update(message),
            columns=columns,
            source=str(source_of(args)),
            carry=model.carry,
        )


def print_comparison(cmp: Comparison, console: Console, title: str = "comparison") -> None:
    """One column per program; rows: step time and its parts, communication by kind, memory, fits."""
    table = Table(title=title)
    table.add_column("", style="bold")
    for c in cmp.columns:
        table.add_column(c.label, justify="right")
    ok = [c for c in cmp.columns if c.ok]
    fastest = min((c.total for c in ok), default=math.inf)

    def row(name: str, cell) -> None:
        table.add_row(name, *[cell(c) if c.ok else Text("failed", style="red") for c in cmp.columns])

    def total(c) -> Text:
        return Text(ms(c.total), style="green bold" if c.total <= fastest * (1 + 1e-9) else "")

    row("step time (ms, est.)", total)
    row("  compute (ms)", lambda c: ms(c.compute))
    row("  communication (ms)", lambda c: ms(c.communication))
    row("FLOPs per device", lambda c: f"{c.flops:.3g}")
    kinds = sorted({k for c in ok for k, _ in c.bytes_by_kind})
    for kind in kinds:
        row(f"{kind} bytes", lambda c, kind=kind: format_bytes(dict(c.bytes_by_kind).get(kind, 0)))
    row("peak memory per device", lambda c: format_bytes(c.peak_memory))
    if cmp.memory_limit is not None:
        row(f"fits {format_bytes(cmp.memory_limit)}",
            lambda c: Text("yes", style="green") if c.fits else Text("no", style="red"))
    best = cmp.best_propagation()
    if best is not None:
        row(f"speed-up vs {best.label}", lambda c: f"{best.total / c.total:.2f}x" if c.total > 0 else "-")
    row("compile time (s)", lambda c: f"{c.compile_time:.1f}")
    console.print(table)
    for c in cmp.columns:
        if not c.ok:
            console.print(f"[red]{c.label} failed:[/red] {c.error}")
    if cmp.plan is not None:
        p = cmp.plan
        status = solver_status(p)
        console.print(
            f"shardsolve's own estimate: {ms(p.cost.total)} ms (compute {ms(p.cost.compute)} + communication "
            f"{ms(p.cost.communication)}), peak {format_bytes(p.cost.peak_memory)}; solver {status} in "
            f"{p.solve_time:.2f} s; {p.fallback_count} ops fell back to replication"
        )


def print_explanations(cmp: Comparison, console: Console, top: int = 10) -> None:
    for c in cmp.columns:
        if not c.ok:
            continue
        if c.name == "shardsolve" and cmp.plan is not None:
            lines = explain(cmp.plan)
            title = "shardsolve (predicted)"
        else:
            lines = explain_column(c, cmp.plan, cmp.mesh)
            title = c.label
        console.print(f"[bold]{title}[/bold]: {len(lines)} collectives" + (f", largest {top}:" if len(lines) > top else ":"))
        for e in sorted(lines, key=lambda e: -e.time)[:top]:
            console.print(f"  {e.line()}", markup=False)
    for conflict in explain_conflicts(cmp):
        for line in conflict.lines():
            console.print(line, markup=False)
