"""``shardsolve plan FILE[:NAME] --mesh ...``: plan a model file and print (and save) the plan.

    shardsolve plan models/gpt2.py:gpt2 --mesh data=2,model=4 --size large -o plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table

from shardsolve.cli.common import (add_model_arguments, annotations_of, check_output, console, keep_interrupted, mesh_of,
                                    solver_status, source_of)
from shardsolve.errors import Interrupted
from shardsolve.mesh import MeshSpec
from shardsolve.model import load_model
from shardsolve.plan import Plan
from shardsolve.planner import plan as make_plan
from shardsolve.sharding import Sharding
from shardsolve.trace import key_dims
from shardsolve.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a model file's shardings",
        description="Trace FILE[:NAME] (a function returning shardsolve.Model; NAME defaults to the file's stem), "
        "solve for the cheapest sharding of every value, print the plan and optionally write it as JSON. "
        "FILE is imported and run as Python code: give only files you trust (plan files are JSON, never run). "
        "Ctrl-C or SIGTERM writes the best plan so far (status interrupted) to -o and exits 130 or 143.",
    )
    add_model_arguments(p, annotations_help="which of the model's annotations to pin (default: the model's own, "
                        "usually the batch only)", memory_help="bytes per device, e.g. 16GiB (default: no limit)")
    p.add_argument("-o", "--output", help="write the plan as JSON to this file")
    p.add_argument("--no-tie", action="store_true",
                   help="search every layer on its own (default: repeated layers share shardings, "
                        "reported as optimal only when a bound of the untied problem proves it)")
    p.add_argument("--logical-rules", action="store_true",
                   help="tie each logical axis name of the parameters (Flax metadata) to one mesh-axis choice and "
                        "print the rules (needs the flax extra)")
    p.add_argument("--top", type=int, default=10, help="how many collectives to list (default: 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = console()
    mesh = mesh_of(args)
    check_output(args.output, "plan.json")
    try:
        plan = _make(args, mesh)
    except Interrupted as interrupt:
        best = interrupt.plan
        keep_interrupted(interrupt, best, "plan", args.output, lambda path: best.save(path),
                         "" if best is None else f"gap {best.gap:.2%}")
        raise
    print_plan(plan, out, top=args.top)
    if args.output:
        plan.save(args.output)
        out.print(f"plan written to [bold]{args.output}[/bold]")
    return 0


def _make(args: argparse.Namespace, mesh: MeshSpec) -> Plan:
    with console(stderr=True).status("loading the model", spinner="dots") as status:
        model = load_model(args.model, args.size)
        in_sh, out_sh = annotations_of(model, args.annotations)
        return make_plan(
            model.fun,
            *model.args,
            mesh=mesh,
            in_shardings=in_sh,
            out_shardings=out_sh,
            memory_limit=args.memory_limit,
            time_limit=args.time_limit,
            carry=model.carry,
            progress=lambda message: status.update(message),
            source=str(source_of(args)),
            tie=not args.no_tie,
            logical_rules=args.logical_rules,
        )


def print_plan(plan: Plan, console: Console, top: int = 10) -> None:
    """A summary table, the arguments' and outputs' shardings, and the largest predicted collectives."""
    summary = Table(title="plan", show_header=False, box=None)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("mesh", str(plan.mesh))
    summary.add_row("operations", f"{len(plan.ops)} ({plan.fallback_count} fell back to replication)")
    status = solver_status(plan)
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
    if plan.logical_axis_rules:
        summary.add_row("logical-axis rules", ", ".join(f"{n} -> {a}" for n, a in plan.logical_axis_rules))
        if "logical_free_cost" in stats:
            summary.add_row("rules cost", f"{stats['logical_overhead']:+.2%} vs the free plan "
                            f"({stats['logical_free_cost'] * 1e3:.4f} ms)")
    console.print(summary)

    table = Table(title="arguments and outputs")
    for col in ("value", "shape", "sharding"):
        table.add_column(col)
    names = plan.input_names or [f"args[{k}]" for k in range(len(plan.inputs))]
    sig = plan.signature
    rows = list(zip(names, sig.in_avals, plan.inputs, sig.in_keys))
    rows += [(f"outputs[{k}]", *leaf) for k, leaf in enumerate(zip(sig.out_avals, plan.outputs, sig.out_keys))]
    for name, aval, s, key in rows:
        shape, dtype, s = leaf_view(aval, s, key)
        table.add_row(name, f"{dtype}{list(shape)}", str(s.to_spec()))
    console.print(table)

    if plan.collectives:
        coll = Table(title=f"largest predicted collectives ({len(plan.collectives)} in all)")
        for col in ("kind", "axes", "bytes", "time (us)", "value", "from -> to", "demanded by"):
            coll.add_column(col)
        for p in sorted(plan.collectives, key=lambda p: -p.time)[:top]:
            coll.add_row(p.kind + (" (merged)" if p.merged else ""), ",".join(p.axes), format_bytes(p.bytes),
                         f"{p.time * 1e6:.2f}", p.value_name,
                         f"{p.src} -> {p.dst}", p.consumer)
        console.print(coll)


def leaf_view(aval: tuple, sharding: Sharding, key: str | None) -> tuple[tuple[int, ...], str, Sharding]:
    """A plan's argument or output leaf (its ``Signature`` aval, its sharding and its key implementation) as
    shown: a typed PRNG key as the key, its data's trailing dimensions (never split) left out."""
    shape, dtype = tuple(aval[0]), aval[1]
    if key is None:
        return shape, dtype, sharding
    rank = len(shape) - key_dims(key)
    return shape[:rank], f"key<{key}>", dataclasses.replace(sharding, dims=sharding.dims[:rank])
