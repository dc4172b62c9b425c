"""Solve the IOPDDL contest instances and compare with the contest's best known costs.

    python experiments/iopddl.py                   # B, G, V at 60 s; K, P, S at 120 s
    python experiments/iopddl.py --time-limit 10 --instances B G

Prints a table (sizes before and after reductions, cost, best known, ratio,
certified lower bound and gap, wall time, validity under the contest's rules)
and writes it to ``experiments/results/iopddl.md``. Instances are read from
``../shared/iopddl`` beside the repository.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardsolve.encodings import solve
from shardsolve.iopddl import read_iopddl

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "iopddl"
RESULTS = ROOT / "experiments" / "results" / "iopddl.md"

#: Best known costs (the contest's published final results, see ../shared/iopddl/README.md).
BEST_KNOWN = {
    "B": 532_843,
    "G": 217_039,
    "V": 1_632_051,
    "K": 2_274_276_676,
    "P": 651_833_115_436,
    "S": 1_534_613_444,
}
DEFAULT_LIMIT = {"B": 60.0, "G": 60.0, "V": 60.0, "K": 120.0, "P": 120.0, "S": 120.0}


def run_one(name: str, time_limit: float, console: Console) -> dict:
    path = DATA / f"asplos-2025-iopddl-{name}.json.gz"
    problem = read_iopddl(path)
    started = time.perf_counter()
    with console.status(f"{name}: solving") as status:

        def progress(message: str, best: float, bound: float) -> None:
            status.update(f"{name}: {message} cost {best:,.0f} bound {bound:,.0f} [{time.perf_counter() - started:.0f}s]")

        sol = solve(problem, time_limit=time_limit, progress=progress)
    wall = time.perf_counter() - started
    cost = problem.evaluate(sol.assignment) if sol.assignment else math.inf
    return {
        "instance": name,
        "nodes": f"{len(problem.nodes):,} -> {sol.stats.get('decisions_after', '?'):,}",
        "edges": f"{len(problem.edges):,} -> {sol.stats.get('edges_after', '?'):,}",
        "cost": cost,
        "best": BEST_KNOWN[name],
        "ratio": cost / BEST_KNOWN[name],
        "bound": sol.lower_bound,
        "gap": sol.gap,
        "time": wall,
        "valid": math.isfinite(cost),
        "status": sol.status,
        "limit": time_limit,
    }


def render(rows: list[dict]) -> tuple[Table, str]:
    cols = ["instance", "nodes (decisions after)", "edges", "cost", "best known", "cost / best", "lower bound",
            "gap", "time s (limit)", "valid"]
    table = Table(*cols, title="IOPDDL instances")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            r["instance"], r["nodes"], r["edges"],
            f"{r['cost']:,.0f}" if r["valid"] else "none",
            f"{r['best']:,}",
            f"{r['ratio']:.3f}" if r["valid"] else "-",
            f"{r['bound']:,.0f}" if math.isfinite(r["bound"]) else "-",
            f"{r['gap']:.1%}" if math.isfinite(r["gap"]) else "-",
            f"{r['time']:.0f} ({r['limit']:.0f})",
            "yes" if r["valid"] else "no",
        ]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    return table, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per instance (default 60 / 120)")
    parser.add_argument("--instances", nargs="*", default=list(BEST_KNOWN), help="subset of B G V K P S")
    args = parser.parse_args(argv)
    console = Console()
    if not DATA.exists():
        console.print(f"no instances at {DATA}")
        return 1
    rows = []
    for name in args.instances:
        limit = args.time_limit if args.time_limit is not None else DEFAULT_LIMIT[name]
        rows.append(run_one(name, limit, console))
        console.print(render(rows[-1:])[0])
    table, markdown = render(rows)
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# IOPDDL instances\n\n"
        "`python experiments/iopddl.py` on this machine (2 cores, shared). Time limits are the solver's\n"
        "deterministic work budget; `time` is the measured wall clock. Gap = (cost - lower bound) / cost,\n"
        "with the lower bound certified (memory relaxed for the dual bound).\n\n"
    )
    RESULTS.write_text(header + markdown + "\n")
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
