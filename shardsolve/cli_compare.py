"""The ``shardsolve compare`` and ``shardsolve explain`` commands, and the per-tensor sharding view.

    shardsolve compare models/gpt2.py:gpt2 --mesh data=2,model=4 --size large
    shardsolve plan models/mlp.py --mesh data=2,model=4 -o plan.json
    shardsolve explain plan.json --show args

``compare`` compiles the model with GSPMD and Shardy propagation, shardsolve's
plan and (when the model has one) the expert annotation, and prints one table
judged by the one cost model (see ``shardsolve.compare``). It needs a concrete
mesh: on a machine with fewer devices it asks XLA for that many fake CPU devices
before JAX starts its backend.

``explain`` prints one line per predicted collective of a plan file (which
value, between which shardings, demanded by which operation, bytes, time) and,
with ``--show``, a grid per tensor of which devices hold which block.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any, Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from shardsolve.errors import ShardsolveError

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def ensure_host_devices(n: int) -> bool:
    """Ask XLA for ``n`` fake CPU devices unless JAX's backend already started or a count is set.

    Returns whether the flag was added. Only the CPU platform reads it, so it is
    harmless where accelerators are present.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG in flags:
        return False
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):
        pass
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()
    return True


def _console(stderr: bool = False) -> Console:
    from shardsolve.cli import _console as console

    return console(stderr)


# -- compare ------------------------------------------------------------------------


def cmd_compare(args: argparse.Namespace) -> int:
    from shardsolve.mesh import MeshSpec

    mesh = MeshSpec.parse(args.mesh)
    ensure_host_devices(mesh.size)  # before anything starts JAX's backend (small models allocate arrays)

    import shardsolve
    from shardsolve.cli import _annotations
    from shardsolve.compare import COLUMNS, compare

    out = _console()
    err = _console(stderr=True)
    if args.output and os.path.isdir(args.output):
        raise ShardsolveError(f"output {args.output!r} is a directory; give a file name like compare.json")
    with err.status("loading the model", spinner="dots") as status:
        model = shardsolve.load_model(args.model, args.size)
        in_sh, out_sh = _annotations(model, args.annotations)
        columns = [c for c in COLUMNS if c != "expert" or not args.no_expert]
        cmp = compare(
            model.fun,
            *model.args,
            mesh=mesh,
            in_shardings=in_sh,
            out_shardings=out_sh,
            memory_limit=args.memory_limit,
            time_limit=args.time_limit,
            expert_in_shardings=None if args.annotations == "expert" else model.expert_in_shardings,
            expert_out_shardings=None if args.annotations == "expert" else model.expert_out_shardings,
            progress=lambda message: status.update(message),
            columns=columns,
        )
    title = f"{model.name or args.model} on {mesh} ({args.annotations} annotations)"
    print_comparison(cmp, out, title=title)
    if args.explain:
        print_explanations(cmp, out, top=args.top)
    if args.output:
        import json

        with open(args.output, "w") as f:
            json.dump(cmp.to_json(), f, indent=1, sort_keys=True)
        out.print(f"comparison written to [bold]{args.output}[/bold]")
    if args.plan_output and cmp.plan is not None:
        plan = cmp.plan
        import dataclasses

        plan = dataclasses.replace(plan, source=f"{args.model} --size {args.size} --annotations {args.annotations}")
        plan.save(args.plan_output)
        out.print(f"plan written to [bold]{args.plan_output}[/bold]")
    return 0


def _ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.4f}"


def print_comparison(cmp, console: Console, title: str = "comparison") -> None:
    """One column per program; rows: step time and its parts, communication by kind, memory, fits."""
    from shardsolve.units import format_bytes

    table = Table(title=title)
    table.add_column("", style="bold")
    for c in cmp.columns:
        table.add_column(c.label, justify="right")
    ok = [c for c in cmp.columns if c.ok]
    fastest = min((c.total for c in ok), default=math.inf)

    def row(name: str, cell) -> None:
        table.add_row(name, *[cell(c) if c.ok else Text("failed", style="red") for c in cmp.columns])

    def total(c) -> Text:
        return Text(_ms(c.total), style="green bold" if c.total <= fastest * (1 + 1e-9) else "")

    row("step time (ms, est.)", total)
    row("  compute (ms)", lambda c: _ms(c.compute))
    row("  communication (ms)", lambda c: _ms(c.communication))
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
        status = p.status if p.status == "optimal" else f"{p.status}, gap {p.gap:.2%}"
        console.print(
            f"shardsolve's own estimate: {_ms(p.cost.total)} ms (compute {_ms(p.cost.compute)} + communication "
            f"{_ms(p.cost.communication)}), peak {format_bytes(p.cost.peak_memory)}; solver {status} in "
            f"{p.solve_time:.2f} s; {p.fallback_count} ops fell back to replication"
        )


def print_explanations(cmp, console: Console, top: int = 10) -> None:
    from shardsolve.explain import explain, explain_column, explain_conflicts

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


# -- explain -----------------------------------------------------------------------


def cmd_explain(args: argparse.Namespace) -> int:
    import shardsolve
    from shardsolve.explain import explain

    out = _console()
    plan = shardsolve.load_plan(args.plan)
    names = _value_names(plan)
    lines = explain(plan)
    out.print(f"[bold]{args.plan}[/bold]: mesh {plan.mesh}, {len(lines)} predicted collectives, "
              f"communication {_ms(plan.cost.communication)} ms of {_ms(plan.cost.total)} ms")
    shown = sorted(lines, key=lambda e: -e.time)[: args.top] if args.top else lines
    for e in shown:
        out.print(f"  {e.line()}", markup=False)
    if args.top and len(lines) > args.top:
        out.print(f"  ... {len(lines) - args.top} more (--top 0 lists all)")
    if args.show:
        for name, shape, dtype, sharding in _selected(plan, names, args.show):
            out.print(sharding_view(name, shape, dtype, sharding, plan.mesh))
    return 0


def _value_names(plan) -> list[str]:
    """Names of the plan's arguments: from its trace when bound, else rebuilt from the pytree structure."""
    if plan.graph is not None:
        return [plan.graph.values[v].name for v in plan.graph.inputs]
    names = _names_from_source(plan)
    return names or [f"args[{k}]" for k in range(len(plan.inputs))]


def _names_from_source(plan) -> list[str] | None:
    """Load the model named in ``plan.source`` (``FILE[:NAME] --size S``) just far enough to name its leaves."""
    m = re.match(r"(\S+)(?: --size (\S+))?", plan.source or "")
    if not m or not os.path.isfile(m.group(1).split(":", 1)[0]):
        return None
    try:
        import jax

        import shardsolve

        model = shardsolve.load_model(m.group(1), m.group(2) or "small")
        paths = jax.tree_util.tree_flatten_with_path(model.args)[0]
        names = [f"args{jax.tree_util.keystr(p)}" for p, _ in paths]
        return names if len(names) == len(plan.inputs) else None
    except Exception:  # noqa: BLE001 - names are a convenience
        return None


def _selected(plan, names: list[str], show: str) -> list[tuple[str, tuple[int, ...], str, Any]]:
    rows = []
    args = [(n, tuple(s), d, sh) for n, (s, d), sh in zip(names, plan.signature.in_avals, plan.inputs)]
    outs = [(f"outputs[{k}]", tuple(s), d, sh) for k, ((s, d), sh) in enumerate(zip(plan.signature.out_avals, plan.outputs))]
    if show in ("args", "inputs", "params"):
        rows = args
    elif show == "outputs":
        rows = outs
    elif show == "all":
        rows = args + outs
    else:
        rows = [r for r in args + outs if show in r[0]]
        if not rows:
            raise ShardsolveError(f"no argument or output matches {show!r}; use --show args, outputs, all or part of a name")
    return rows


def sharding_view(name: str, shape: Sequence[int], dtype: str, sharding, mesh, max_cells: int = 16):
    """A rich grid of which devices hold which block of a tensor (like ``jax.debug.visualize_sharding``).

    Rows split the first sharded dimension, columns the second; each cell lists
    the devices (positions in the mesh, row-major) holding that block. Further
    sharded dimensions and partial axes are written under the grid.
    """
    import numpy as np

    shape = tuple(shape)
    sizes = tuple(a.size for a in mesh.axes)
    split = [d for d in range(len(shape)) if sharding.dims[d]]
    rows_dim = split[0] if split else None
    cols_dim = split[1] if len(split) > 1 else None
    coords = np.array(np.unravel_index(np.arange(mesh.size), sizes)).T if mesh.size > 1 else np.zeros((1, len(sizes)), int)
    index = {a.name: i for i, a in enumerate(mesh.axes)}

    def block(device: int, d: int | None) -> int:
        if d is None:
            return 0
        b = 0
        for a in sharding.dims[d]:
            b = b * mesh.axis(a).size + int(coords[device][index[a]])
        return b

    n_rows = sharding.dim_shards(rows_dim, mesh) if rows_dim is not None else 1
    n_cols = sharding.dim_shards(cols_dim, mesh) if cols_dim is not None else 1
    cells: dict[tuple[int, int], list[int]] = {}
    for dev in range(mesh.size):
        cells.setdefault((block(dev, rows_dim), block(dev, cols_dim)), []).append(dev)
    local = sharding.local_shape(shape, mesh)
    spec = str(sharding)
    title = f"{name}  {dtype}{list(shape)}  {spec}  per device {list(local)}"
    grid = Table(show_header=False, show_lines=True, pad_edge=True)
    shown_cols = min(n_cols, max_cells)
    for _ in range(shown_cols + (1 if n_cols > max_cells else 0)):
        grid.add_column(justify="center")
    palette = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
    for r in range(min(n_rows, max_cells)):
        row = []
        for c in range(shown_cols):
            devs = cells.get((r, c), [])
            label = "dev " + ",".join(map(str, devs)) if len(devs) <= 8 else f"{len(devs)} devices"
            row.append(Text(label, style=palette[(r * n_cols + c) % len(palette)]))
        if n_cols > max_cells:
            row.append(Text("..."))
        grid.add_row(*row)
    if n_rows > max_cells:
        grid.add_row(*(["..."] * len(grid.columns)))
    notes = []
    if rows_dim is not None:
        notes.append(f"rows: dim {rows_dim} split over {','.join(sharding.dims[rows_dim])}")
    if cols_dim is not None:
        notes.append(f"columns: dim {cols_dim} split over {','.join(sharding.dims[cols_dim])}")
    for d in split[2:]:
        notes.append(f"dim {d} also split over {','.join(sharding.dims[d])} (not drawn)")
    if sharding.partial:
        notes.append(f"partial over {','.join(sharding.partial)}: each device holds a summand")
    if not split:
        notes.append("replicated: every device holds the whole tensor")
    return Group(Text(title, style="bold"), grid, Text("  " + "; ".join(notes), style="dim"))


# -- registration -----------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    """Register ``compare`` and ``explain`` on the ``shardsolve`` command's subparsers."""
    p = sub.add_parser(
        "compare",
        help="compare shardsolve's plan with GSPMD and Shardy propagation",
        description="Compile FILE[:NAME] with GSPMD and Shardy propagation, shardsolve's plan and (if the model has "
        "one) its expert annotation, from the same annotations, and judge every compiled program with the one "
        "cost model: per-device FLOPs, memory and the collectives of the optimized HLO. Nothing runs; on a "
        "machine with fewer devices than the mesh, fake CPU devices are used.",
    )
    from shardsolve.cli import add_model_arguments

    add_model_arguments(p, annotations_help="which of the model's annotations every program gets (default: the "
                        "model's own)", memory_help="bytes per device for the plan and the 'fits' row, e.g. 16GiB")
    p.add_argument("--no-expert", action="store_true", help="leave out the expert annotation column")
    p.add_argument("--explain", action="store_true", help="list the largest collectives of every column, and conflicts")
    p.add_argument("--top", type=int, default=8, help="collectives per column with --explain (default: 8)")
    p.add_argument("-o", "--output", help="write the comparison as JSON to this file")
    p.add_argument("--plan-output", help="write shardsolve's plan as JSON to this file")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "explain",
        help="explain a plan's collectives and show tensor shardings",
        description="Print one line per predicted collective of a plan file: which value, between which two "
        "shardings, demanded by which operation, bytes and estimated time. With --show, draw which devices hold "
        "which block of the arguments and outputs.",
    )
    p.add_argument("plan", help="plan file written by `shardsolve plan -o`")
    p.add_argument("--show", metavar="WHAT",
                   help="draw shardings: args, outputs, all, or part of a name (e.g. w_qkv)")
    p.add_argument("--top", type=int, default=20, help="largest collectives to list; 0 lists all (default: 20)")
    p.set_defaults(func=cmd_explain)
