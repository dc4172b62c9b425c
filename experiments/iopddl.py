"""Solve the IOPDDL contest instances and compare with the contest's best known costs.

    python experiments/iopddl.py                   # every instance at 120 s, the goal's limit
    python experiments/iopddl.py --time-limit 10 --instances B G

Prints a table (sizes before and after reductions, cost, best known, ratio,
certified lower bound and gap, wall time, validity under the contest's rules)
and writes it to ``experiments/results/iopddl.md``. Instances are read from
``../shared/iopddl`` beside the repository.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
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
DEFAULT_LIMIT = {"B": 120.0, "G": 120.0, "V": 120.0, "K": 120.0, "P": 120.0, "S": 120.0}


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
    peak = problem.peak_usage(sol.assignment) if sol.assignment else math.inf
    fits = problem.usage_limit is None or peak <= problem.usage_limit
    st = sol.stats
    return {
        "instance": name,
        "nodes": f"{len(problem.nodes):,} -> {st.get('nodes_after', 0):,} ({st.get('decisions_after', 0):,} decisions)",
        "edges": f"{len(problem.edges):,} -> {st.get('edges_after', 0):,}",
        "cost": cost,
        "best": BEST_KNOWN[name],
        "ratio": cost / BEST_KNOWN[name],
        "bound": sol.lower_bound,
        "gap": sol.gap,
        "time": wall,
        "valid": math.isfinite(cost) and fits,
        "memory": f"{peak / problem.usage_limit:.3f}" if problem.usage_limit and math.isfinite(peak) else "-",
        "status": sol.status,
        "limit": time_limit,
        "stats": {k: st.get(k) for k in ("reduce_s", "lp_s", "lp_bound", "probe_passes", "probe_bound",
                                          "trws_passes", "trws_s", "trws_bound", "lagrangian_steps",
                                          "lagrangian_repairs", "lagrangian_s", "lagrangian_bound",
                                          "warm_start_cost", "trws_start_cost", "move_rounds", "priced_rounds",
                                          "descent_steps", "lns_steps", "moves_s", "moves_work_s", "descent_s",
                                          "descent_deterministic_s", "lns_s", "lns_deterministic_s")},
        "phases": st.get("phases", {}),
    }


def render(rows: list[dict]) -> tuple[Table, str]:
    cols = ["instance", "nodes before -> after", "edges before -> after", "cost", "best known", "cost / best",
            "lower bound", "gap", "status", "wall s (limit)", "peak / limit", "valid"]
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
            r["status"],
            f"{r['time']:.0f} ({r['limit']:.0f})",
            r["memory"],
            "yes" if r["valid"] else "no",
        ]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    return table, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per instance (default 120)")
    parser.add_argument("--instances", nargs="*", default=list(BEST_KNOWN), help="subset of B G V K P S")
    args = parser.parse_args(argv)
    console = Console()
    if not DATA.exists():
        console.print(f"no instances at {DATA}")
        return 1
    load_before = os.getloadavg()
    rows = []
    for name in args.instances:
        limit = args.time_limit if args.time_limit is not None else DEFAULT_LIMIT[name]
        rows.append(run_one(name, limit, console))
        console.print(render(rows[-1:])[0])
        write(rows, argv, load_before)
    console.print(render(rows)[0])
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


def write(rows: list[dict], argv: list[str] | None, load_before: tuple[float, float, float]) -> None:
    _, markdown = render(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    load_after = os.getloadavg()
    header = (
        "# IOPDDL instances\n\n"
        f"`python experiments/iopddl.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(" `", "`")
        + f" in one run on {os.cpu_count()} cores; load average {load_before[0]:.1f} at the start and"
        f" {load_after[0]:.1f} at the end.\n"
        "Time limits are the solver's deterministic work budget; `wall s` is the measured wall clock of\n"
        "`solve` (reading the file excluded). Gap = (cost - lower bound) / cost, with the lower bound\n"
        "certified (where memory binds and no LP runs, the Lagrangian dual of the memory constraints: TRW-S on\n"
        "costs priced per byte, less the prices times the capacities; else TRW-S with memory relaxed; where the\n"
        "LP fits and TRW-S proves nothing, the LP with memory, from its duals, over the entries TRW-S leaves an\n"
        "assignment cheaper than the one it read off; where few groups of functionally tied nodes have a\n"
        "choice, CP-SAT's bound on the whole problem over groups, P's). Valid:\n"
        "the contest's evaluation (`Problem.evaluate`) is finite and the peak usage is within the limit.\n\n"
    )
    footer = "\nFor P the best known cost is XLA's own auto-sharding result (651,833,115,436).\n"
    RESULTS.write_text(header + markdown + "\n" + footer + "\n" + stages(rows) + NOTES + K_PROFILE)


def _num(value, spec: str = ",.0f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def stages(rows: list[dict]) -> str:
    """Where each instance's bound and start came from, and where its time went (from ``Solution.stats``)."""
    lines = [
        "## Bounds and starts, per instance (from the solver's stats)\n",
        "| instance | reduce s | probe passes | probe bound | LP s | LP bound | TRW-S passes | TRW-S s | TRW-S bound"
        " | Lagrangian steps (repaired) | Lagrangian s | Lagrangian bound"
        " | heuristic start | TRW-S start | move rounds (priced) | descent steps | LNS steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        st = r["stats"]
        lines.append("| " + " | ".join([
            r["instance"], _num(st["reduce_s"], ".1f"), _num(st["probe_passes"], "d"), _num(st["probe_bound"]),
            _num(st["lp_s"], ".1f"), _num(st["lp_bound"]),
            _num(st["trws_passes"], "d"), _num(st["trws_s"], ".1f"), _num(st["trws_bound"]),
            f"{_num(st['lagrangian_steps'], 'd')} ({_num(st['lagrangian_repairs'], 'd')})",
            _num(st["lagrangian_s"], ".1f"), _num(st["lagrangian_bound"]),
            _num(st["warm_start_cost"]), _num(st["trws_start_cost"]),
            f"{_num(st['move_rounds'], 'd')} ({_num(st['priced_rounds'], 'd')})",
            _num(st["descent_steps"], "d"), _num(st["lns_steps"], "d"),
        ]) + " |")
    names = [name for name in PHASES if any(name in r["phases"] for r in rows)]
    lines += [
        "\n## Where the time went (wall seconds / deterministic work seconds, per phase of `solve`)\n",
        "| instance | reduce | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [r["instance"], _num(r["stats"]["reduce_s"], ".1f")]
        for name in names:
            spent = r["phases"].get(name)
            cells.append(f"{spent['wall_s']:.1f} / {spent['work_s']:.1f}" if spent else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "\n## Inside the search phase (wall seconds / deterministic work seconds)\n",
        "| instance | group moves | component descent | LNS |",
        "|---|---|---|---|",
    ]
    for r in rows:
        st = r["stats"]
        cells = [r["instance"]]
        for wall, work in (("moves_s", "moves_work_s"), ("descent_s", "descent_deterministic_s"),
                           ("lns_s", "lns_deterministic_s")):
            cells.append(f"{st[wall]:.1f} / {st[work]:.1f}" if st[wall] is not None and st[work] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The phases of ``encodings.solve``, in the order they run.
PHASES = ("lp", "starts", "feasibility", "whole model", "lagrangian", "bounds", "search")


NOTES = """
Notes. Up to 5,000 nodes (B, G, V), TRW-S runs first as a probe (memory relaxed, at most 800 passes
and half the budget), reading an assignment off its messages every 16 passes: on B and G its bound
meets one, which proves it optimal with no LP. Where it proves nothing, the LP with memory runs over
the entries an assignment cheaper than the probe's can use, where they fit (on V they do not); the
LP bound is certified from HiGHS's duals (the Lagrangian of any duals is a valid bound whatever the
solver's tolerances), so an integral LP proves optimality only when that certificate meets its cost,
and otherwise CP-SAT on the whole model from the rounding proves it. Where no LP runs and memory
binds (V, K, P, S), the memory constraints are priced (`encodings.lagrange`, 40% of the budget left):
TRW-S on each strategy's cost plus its usage times the prices over its node's interval, thirty passes
a step with the messages kept from step to step, prices moved by Polyak subgradient steps towards the
best cost so far; TRW-S's value less the prices times the capacities is the certified bound, and the
assignment read off each step, repaired for memory, cleared of forbidden pairs by ICM on the softened
problem and polished by group moves, is a start; the one read off at the best bound guides the LNS (one
neighbourhood a round grows from the nodes where the incumbent differs from it, as from the LP's rounding
where an LP runs). K, P and S come to it from least usage, ICM on the
softened problem and an exact repair of every component of forbidden-bearing edges (the first target);
V from its warm starts, which include TRW-S decodings of the costs plus a uniform usage penalty,
repaired. Without the prices (the runs before) the bound of K, P and S was TRW-S with memory relaxed
(gaps 86%, 52%, 84%), and their search started from that repaired least-usage start. Then the search:
vectorised group moves (`encodings.moves`: every node, or every component of forbidden-bearing edges
with its valid joint assignments enumerated, moves at once; two-node moves; a falling price on usage
where memory binds, with memory hard), two sweeps of CP-SAT component descent, and CP-SAT
large-neighbourhood search in three chunks, group moves again after each. The LNS draws its time
windows at the tightest binding memory segments most often (weight 1 / (1 + slack / 0.1% of the
largest capacity)), doubles each neighbourhood's CP-SAT time (0.5 s at first, at most 8 s) after every
round of neighbourhoods that gained nothing, and each chunk goes on at the size and time the one before
reached: on V, balls of 60 to 80 nodes all solve to optimality without a gain, and the search stalled
there (26 steps, no improvement, 1.052 at 120 s); with solves of up to 2 s, two neighbourhoods take
it to 1,617,084 at 120 s, below the best known (the same assignment in two runs), and to 1.025 at 60 s. The
time limit is a deterministic work budget, calibrated for an idle machine; a
wall-clock safety net at 1.05 times the limit plus 1 s stops the search on a loaded one (then the
result depends on the load: compare the wall and work columns above), and the final lift and
evaluation add a few seconds on K, P and S.
"""

K_PROFILE = """
## Where the time goes on K (seconds, an earlier stage-by-stage profile of the reduction and start)

| stage | before (load 0.3-2.6) | after (load 3.3-3.8) |
|---|---|---|
| read the file (outside `solve`) | 8.7 | 4.8 |
| validate | 1.1 | 0.8 |
| `restrict` (first) | 12.9 | 2.6 (worklist arc consistency, vectorised memory test) |
| merge, fold fixed, eliminate low degree, fold followers | 16.7 (four passes) | 3.9 (`fold_and_eliminate`, one pass) |
| `drop_dominated` + second `restrict` | 11.4 | skipped above 5,000 nodes (they removed 7% of K's strategies and none of P's) |
| reduce, whole driver | 45-67 | 5.1 |
| flatten | 0.7 | 0.9 |
| ICM on the softened problem (3 sweeps) | 2.8 | 3.7; it leaves 198 forbidden pairs |
| removing the forbidden pairs | never finished (softened LNS, about 120 s) | 4.8 (198 components, each solved by CP-SAT) |
| component descent | - | 16 s for 10 s of budget: 14.8e9 -> 12.9e9 |

The bound stage is timed per run in the table above (TRW-S s).

## Where the search's time went on K, and what the group moves changed (120 s, light load)

| | before | after |
|---|---|---|
| search phase | 104 s: 511 CP-SAT neighbourhoods 99 s (CP-SAT 66 s, building their models 23 s) | group moves about 30 s, CP-SAT descent and LNS the rest |
| from the feasible start (14.8e9) | one-node moves: 14.2e9 in 0.3 s; component descent (CP-SAT): 7.3e9 in 62 s | group moves: 8.8e9 in 0.9 s (2,680 components as units); two-node moves: 8.5e9 |
| memory | - | the same moves with memory ignored reach 3.5e9: memory is what blocks them; the priced descent: 6.1e9 in 7 s |
| result | 6.36e9 (2.80x best known) | 4.4e9 to 4.5e9 (1.94x to 1.97x) |
"""


if __name__ == "__main__":
    raise SystemExit(main())
