"""``shardsolve iopddl FILE``: solve one IOPDDL contest instance, show cost, bound and gap, write the answer.

    shardsolve iopddl ../shared/iopddl/asplos-2025-iopddl-B.json.gz --time-limit 60 --out solution.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shardsolve.cli.common import console as make_console
from shardsolve.encodings import solve
from shardsolve.errors import Interrupted
from shardsolve.files import write_atomically
from shardsolve.iopddl import read_iopddl, solution_to_json, time_spent

#: Seconds of search when ``--time-limit`` is not given.
DEFAULT_TIME_LIMIT = 60.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "iopddl",
        help="solve an IOPDDL contest instance",
        description="Solve one strategy-selection instance in the IOPDDL contest format (.json or .json.gz) and "
        "print its cost, best lower bound and gap.",
    )
    p.add_argument("file", help="instance file")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, help="seconds (default: 60)")
    p.add_argument("--out", help="write {solution, cost, lower_bound, status, seconds} as JSON to this file")
    p.add_argument("--verbose", action="store_true", help="also show where the time went, phase by phase")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return solve_instance(args.file, time_limit=args.time_limit, out=args.out, console=make_console(),
                          verbose=args.verbose)


def solve_instance(path: str | os.PathLike, time_limit: float | None = None, out: str | os.PathLike | None = None,
                   console: Console | None = None, verbose: bool = False) -> int:
    """Solve one contest instance and print cost, lower bound and gap.

    Arguments: ``path`` the instance (``.json`` or ``.json.gz``); ``time_limit``
    seconds for the search (``None``: 60); ``out`` where to write the answer JSON
    (see :func:`shardsolve.iopddl.solution_to_json`; written atomically), or
    ``None``; ``console`` a ``rich.console.Console`` (a new one when ``None``);
    ``verbose`` adds a table of the phases (wall seconds, deterministic work)
    and the search's counts. The progress line shows the best cost and the
    bound as they move.

    Returns the exit status: 0 when a valid solution was found, 1 when none was
    found in the time, 2 when the instance has none (status ``"infeasible"``,
    with the conflicting constraints where the solver can name them); bad input
    raises ``ShardsolveError`` (the CLI prints its one-line message and exits
    with 2). Ctrl-C (or SIGTERM in the CLI) writes the best solution so far to
    ``out`` with status ``"interrupted"``, or nothing when there is none, says
    which in one line and re-raises ``errors.Interrupted``.
    """
    console = console or Console()
    started = time.perf_counter()
    problem = read_iopddl(path)
    read_s = time.perf_counter() - started
    console.print(
        f"[bold]{Path(path).name}[/]: {len(problem.nodes):,} nodes, {len(problem.edges):,} edges, "
        f"{problem.num_strategies:,} strategies, usage limit {problem.usage_limit if problem.usage_limit is not None else 'none'}"
    )
    limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    with console.status("solving", spinner="dots") as status:

        def progress(message: str, best: float, bound: float) -> None:
            gap = f"{(best - bound) / best:.2%}" if math.isfinite(best) and best > 0 else "-"
            cost = f"{best:,.0f}" if math.isfinite(best) else "none yet"
            status.update(f"{message}: cost {cost}, bound {bound:,.0f}, gap {gap}  [{time.perf_counter() - started:.0f}s]")

        try:
            solution = solve(problem, time_limit=limit, progress=progress)
        except Interrupted as interrupt:
            keep_interrupted(problem, interrupt, out, console)
            raise
    cost = problem.evaluate(solution.assignment) if solution.assignment else math.inf
    table = Table(show_header=False)
    table.add_row("status", solution.status)
    table.add_row("cost", f"{cost:,.0f}" if math.isfinite(cost) else "no valid solution")
    table.add_row("lower bound", f"{solution.lower_bound:,.0f}")
    table.add_row("gap", f"{solution.gap:.3%}" if math.isfinite(solution.gap) else "-")
    table.add_row("time", f"{time.perf_counter() - started:.1f} s")
    if solution.conflict:
        table.add_row("conflict", ", ".join(solution.conflict))
    console.print(table)
    seconds = time_spent(solution, read_s)
    if verbose:
        console.print(phases_table(solution, seconds))
    if out is not None:
        payload = json.dumps(solution_to_json(problem, solution, seconds), indent=None).encode()
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(out), payload)
        console.print(f"wrote {out}")
    if math.isfinite(cost):
        return 0
    return 2 if solution.status == "infeasible" else 1


def keep_interrupted(problem, interrupt: Interrupted, out, console: Console) -> None:
    """Write an interrupted search's best solution (if any, and ``out`` is given); one line says which."""
    best = interrupt.solution
    if best is None:
        line = "interrupted: no complete solution yet; nothing written"
    else:
        gap = f"{best.gap:.2%}" if math.isfinite(best.gap) else "unknown"
        what = f"best solution so far (cost {best.cost:,.0f}, gap {gap})"
        if out is None:
            line = f"interrupted: {what} not written (no --out given)"
        else:
            write_atomically(Path(out), json.dumps(solution_to_json(problem, best), indent=None).encode())
            line = f"interrupted: {what} written to {out} with status interrupted"
    console.print(line, markup=False, soft_wrap=True)
    interrupt.reported = True


#: Search counts shown by ``--verbose``, when the solver reports them.
COUNTS = ("lp_rounding_free_nodes", "repair_components", "repair_left", "feasibility_status", "descent_sweeps",
          "descent_steps", "descent_improvements", "trws_passes", "lns_steps", "lns_improvements", "cpsat_status")


def phases_table(solution, seconds: dict[str, float]) -> Table:
    """Where the time went: wall seconds and deterministic work per stage, then the search's counts."""
    stats = solution.stats or {}
    phases = stats.get("phases", {})
    table = Table("stage", "wall s", "work s", title="where the time went")
    for name, wall in seconds.items():
        work = phases.get(name, {}).get("work_s")
        table.add_row(name, f"{wall:.2f}", "-" if work is None else f"{work:.2f}")
    for key in COUNTS:
        if key in stats:
            table.add_row(key.replace("_", " "), str(stats[key]), "")
    return table
