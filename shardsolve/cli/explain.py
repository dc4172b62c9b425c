"""``shardsolve explain PLAN``: why each predicted collective is there, and which device holds what.

    shardsolve plan models/mlp.py --mesh data=2,model=4 -o plan.json
    shardsolve explain plan.json --show args

Prints one line per predicted collective of a plan file (which value, between
which shardings, demanded by which operation, bytes, time) and, with
``--show``, a grid per tensor of which devices hold which block.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import jax
import numpy as np
from rich.console import Group
from rich.table import Table
from rich.text import Text

from shardsolve.cli.common import ModelSource, console, ms
from shardsolve.cli.plan import leaf_view
from shardsolve.errors import ShardsolveError
from shardsolve.explain import explain
from shardsolve.mesh import MeshSpec
from shardsolve.model import load_model
from shardsolve.plan import Plan, load_plan
from shardsolve.sharding import Sharding


def add_parser(sub: Any) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = console()
    plan = load_plan(args.plan)
    names = _value_names(plan)
    lines = explain(plan)
    out.print(f"[bold]{args.plan}[/bold]: mesh {plan.mesh}, {len(lines)} predicted collectives, "
              f"communication {ms(plan.cost.communication)} ms of {ms(plan.cost.total)} ms")
    shown = sorted(lines, key=lambda e: -e.time)[: args.top] if args.top else lines
    for e in shown:
        out.print(f"  {e.line()}", markup=False)
    if args.top and len(lines) > args.top:
        out.print(f"  ... {len(lines) - args.top} more (--top 0 lists all)")
    if args.show:
        for name, shape, dtype, sharding in _selected(plan, names, args.show):
            out.print(sharding_view(name, shape, dtype, sharding, plan.mesh))
    return 0


def _value_names(plan: Plan) -> list[str]:
    """Names of the plan's arguments: from its trace when bound, else rebuilt from the pytree structure."""
    if plan.input_names:
        return list(plan.input_names)
    if plan.graph is not None:
        return [plan.graph.values[v].name for v in plan.graph.inputs]
    names = _names_from_source(plan)  # a plan file written before plans recorded their argument names
    return names or [f"args[{k}]" for k in range(len(plan.inputs))]


def _names_from_source(plan: Plan) -> list[str] | None:
    """Load the model named in ``plan.source`` just far enough to name its argument leaves."""
    try:
        source = ModelSource.parse(plan.source or "")
    except ShardsolveError:
        return None
    if not source.file_exists:
        return None
    try:
        model = load_model(source.model, source.size)
        paths = jax.tree_util.tree_flatten_with_path(model.args)[0]
        names = [f"args{jax.tree_util.keystr(p)}" for p, _ in paths]
        return names if len(names) == len(plan.inputs) else None
    except Exception:  # noqa: BLE001 - names are a convenience
        return None


def _selected(plan: Plan, names: list[str], show: str) -> list[tuple[str, tuple[int, ...], str, Any]]:
    rows = []
    sig = plan.signature
    args = [(n, *leaf_view(a, sh, key)) for n, a, sh, key in zip(names, sig.in_avals, plan.inputs, sig.in_keys)]
    outs = [(f"outputs[{k}]", *leaf_view(a, sh, key))
            for k, (a, sh, key) in enumerate(zip(sig.out_avals, plan.outputs, sig.out_keys))]
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


def sharding_view(name: str, shape: Sequence[int], dtype: str, sharding: Sharding, mesh: MeshSpec,
                  max_cells: int = 16) -> Group:
    """A rich grid of which devices hold which block of a tensor (like ``jax.debug.visualize_sharding``).

    Rows split the first sharded dimension, columns the second; each cell lists
    the devices (positions in the mesh, row-major) holding that block. Further
    sharded dimensions and partial axes are written under the grid.
    """
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
