"""The ``shardsolve`` command.

    shardsolve plan models/gpt2.py:gpt2 --mesh data=2,model=4 -o plan.json
    shardsolve iopddl ../shared/iopddl/asplos-2025-iopddl-B.json.gz --time-limit 60

Bad input prints one line (``error: ...``) and exits with status 2; no
traceback, and no partial output file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardsolve.errors import ShardsolveError


def _console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


# -- plan ---------------------------------------------------------------------


def _annotations(model, which: str):
    if which == "expert":
        if model.expert_in_shardings is None:
            raise ShardsolveError(f"model {model.name!r} has no expert annotation; use --annotations default")
        return model.expert_in_shardings, model.expert_out_shardings
    if which == "none":
        return None, None
    return model.in_shardings, model.out_shardings


def cmd_plan(args: argparse.Namespace) -> int:
    import shardsolve
    from shardsolve.mesh import MeshSpec

    out = _console()
    err = _console(stderr=True)
    mesh = MeshSpec.parse(args.mesh)
    if args.output and os.path.isdir(args.output):
        raise ShardsolveError(f"output {args.output!r} is a directory; give a file name like plan.json")
    with err.status("loading the model", spinner="dots") as status:
        model = shardsolve.load_model(args.model, args.size)
        in_sh, out_sh = _annotations(model, args.annotations)
        plan = shardsolve.plan(
            model.fun,
            *model.args,
            mesh=mesh,
            in_shardings=in_sh,
            out_shardings=out_sh,
            memory_limit=args.memory_limit,
            time_limit=args.time_limit,
            carry=model.carry,
            progress=lambda message: status.update(message),
            source=f"{args.model} --size {args.size} --annotations {args.annotations}",
            tie=not args.no_tie,
        )
    print_plan(plan, out, top=args.top)
    if args.output:
        plan.save(args.output)
        out.print(f"plan written to [bold]{args.output}[/bold]")
    return 0


def print_plan(plan, console: Console, top: int = 10) -> None:
    from shardsolve.units import format_bytes

    graph = plan.graph
    summary = Table(title="plan", show_header=False, box=None)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("mesh", str(plan.mesh))
    summary.add_row("operations", f"{len(plan.ops)} ({plan.fallback_count} fell back to replication)")
    status = plan.status if plan.status == "optimal" else f"{plan.status}, gap {plan.gap:.2%}"
    summary.add_row("solver", f"{status} in {plan.solve_time:.2f} s")
    stats = dict(plan.stats)
    if "tying" in stats:
        summary.add_row("tying", f"{stats['tied_nodes']} nodes of repeated layers tied in {stats['tie_classes']} classes, "
                        f"{stats['tying']} ({stats['tie_bound']} bound of the untied problem)")
    c = plan.cost
    summary.add_row("step time (est.)", f"{c.total * 1e3:.4f} ms = compute {c.compute * 1e3:.4f} ms + communication {c.communication * 1e3:.4f} ms")
    summary.add_row("peak memory", f"{format_bytes(c.peak_memory)} per device")
    if c.bytes_by_kind:
        summary.add_row("communication", ", ".join(f"{k} {format_bytes(b)}" for k, b in c.bytes_by_kind))
    if plan.fallbacks:
        summary.add_row("fallbacks", ", ".join(f"{p} x{n}" for p, n in plan.fallbacks))
    console.print(summary)

    table = Table(title="arguments and outputs")
    for col in ("value", "shape", "sharding"):
        table.add_column(col)
    names = [graph.values[v].name for v in graph.inputs] if graph else [f"args[{k}]" for k in range(len(plan.inputs))]
    for name, (shape, dtype), s in zip(names, plan.signature.in_avals, plan.inputs):
        table.add_row(name, f"{dtype}{list(shape)}", str(s.to_spec()))
    for k, ((shape, dtype), s) in enumerate(zip(plan.signature.out_avals, plan.outputs)):
        table.add_row(f"outputs[{k}]", f"{dtype}{list(shape)}", str(s.to_spec()))
    console.print(table)

    if plan.collectives:
        coll = Table(title=f"largest predicted collectives ({len(plan.collectives)} in all)")
        for col in ("kind", "axes", "bytes", "time (us)", "value", "from -> to", "demanded by"):
            coll.add_column(col)
        for p in sorted(plan.collectives, key=lambda p: -p.time)[:top]:
            coll.add_row(p.kind, ",".join(p.axes), format_bytes(p.bytes), f"{p.time * 1e6:.2f}", p.value_name,
                         f"{p.src} -> {p.dst}", p.consumer)
        console.print(coll)


# -- iopddl ---------------------------------------------------------------------


def cmd_iopddl(args: argparse.Namespace) -> int:
    from shardsolve.iopddl import run

    return run(args.file, time_limit=args.time_limit, out=args.out, console=_console())


# -- main -------------------------------------------------------------------------


def add_model_arguments(p: argparse.ArgumentParser, *, annotations_help: str, memory_help: str) -> None:
    """The arguments every command that loads a model file takes."""
    p.add_argument("model", metavar="FILE[:NAME]", help="model file, e.g. models/gpt2.py:gpt2")
    p.add_argument("--mesh", required=True, help="mesh axes, e.g. data=2,model=4")
    p.add_argument("--size", default="small", choices=("small", "large"), help="model size (default: small)")
    p.add_argument("--annotations", default="default", choices=("default", "expert", "none"), help=annotations_help)
    p.add_argument("--memory-limit", help=memory_help)
    p.add_argument("--time-limit", type=float, help="solver time limit in seconds (default: 30; stops sooner when proven optimal)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsolve",
        description="Plan how a JAX program is split over a device mesh with one global optimisation.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "plan",
        help="plan a model file's shardings",
        description="Trace FILE[:NAME] (a function returning shardsolve.Model; NAME defaults to the file's stem), "
        "solve for the cheapest sharding of every value, print the plan and optionally write it as JSON.",
    )
    add_model_arguments(p, annotations_help="which of the model's annotations to pin (default: the model's own, "
                        "usually the batch only)", memory_help="bytes per device, e.g. 16GiB (default: no limit)")
    p.add_argument("-o", "--output", help="write the plan as JSON to this file")
    p.add_argument("--no-tie", action="store_true",
                   help="search every layer on its own (default: repeated layers share shardings, "
                        "reported as optimal only when a bound of the untied problem proves it)")
    p.add_argument("--top", type=int, default=10, help="how many collectives to list (default: 10)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "iopddl",
        help="solve an IOPDDL contest instance",
        description="Solve one strategy-selection instance in the IOPDDL contest format (.json or .json.gz) and "
        "print its cost, best lower bound and gap.",
    )
    p.add_argument("file", help="instance file")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds (default: 60)")
    p.add_argument("--out", help="write {solution, cost, lower_bound, status} as JSON to this file")
    p.set_defaults(func=cmd_iopddl)

    from shardsolve.cli_compare import add_parsers  # compare, explain

    add_parsers(sub)

    from shardsolve.cli_verify import add_verify_parser  # verify

    add_verify_parser(sub)
    return parser


def _version() -> str:
    from shardsolve import __version__

    return f"shardsolve {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ShardsolveError as e:  # InfeasibleError included
        _console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        _console(stderr=True).print("[red]interrupted[/red]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
