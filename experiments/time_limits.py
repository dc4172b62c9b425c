"""Time limits against the wall clock, in every solving path.

``time_limit`` is a deterministic work budget (the same input and limit give
the same answer); the wall clock is only a safety net. This benchmark measures
how long the solving actually takes, path by path, against the goal of at most
``1.05 * limit + 2`` seconds:

* ``plan``, untied and tied (the tied solve, the untied bound that certifies it,
  the untied fallback), small and large, on a two-axis and a three-axis mesh;
* ``plan`` under a memory limit held as compiled (the first solve and the
  re-solves of the compiled-memory search);
* the IOPDDL solver on a shared contest instance (reading the file excluded).

*Solving* is the wall time inside the planner's solves (``planner.search_once``,
summed over a call's solves) or inside ``encodings.solve``; tracing, building
and compiling programs for the memory check are not solving and are shown
apart as the call's total.

    python experiments/time_limits.py                     # limits 10 and 30 s
    python experiments/time_limits.py --limits 5,20 --out /tmp/time_limits.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
IOPDDL = ROOT.parent / "shared" / "iopddl"
SLACK, EXTRA = 1.05, 2.0  # the goal: solving within SLACK * limit + EXTRA seconds


class Solving:
    """Sums the wall time spent inside the planner's solves while active."""

    def __init__(self):
        from shardsolve import planner

        self.planner, self.search, self.seconds, self.solves = planner, planner.search_once, 0.0, 0

    def __enter__(self):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return self.search(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.solves += 1

        self.planner.search_once = timed
        return self

    def __exit__(self, *exc):
        self.planner.search_once = self.search


def plan_case(spec: str, size: str, mesh: str, *, tie: bool = True, memory_fraction: float | None = None):
    """A ``run(limit) -> (status, solving s, solves, total s)`` that plans ``spec`` with its batch annotation."""
    import shardsolve

    def run(limit: float):
        model = shardsolve.load_model(str(ROOT / spec.split(":")[0]) + ":" + spec.split(":")[1], size)
        kwargs = dict(mesh=mesh, in_shardings=model.in_shardings, out_shardings=model.out_shardings,
                      carry=model.carry, tie=tie)
        if memory_fraction is not None:  # a limit below the free plan's: the compiled-memory search runs
            free = shardsolve.plan(model.fun, *model.args, time_limit=limit, **kwargs)
            kwargs["memory_limit"] = int(memory_fraction * free.cost.peak_memory)
        started = time.perf_counter()
        with Solving() as solving:
            try:
                plan = shardsolve.plan(model.fun, *model.args, time_limit=limit, **kwargs)
                status = plan.status + (f" {plan.gap:.1%}" if plan.status == "feasible" else "")
                status += f", {plan.cost.total * 1e3:.4g} ms"
                rounds = dict(plan.stats).get("memory_rounds")
                if rounds:
                    status += f", {rounds} memory rounds"
            except shardsolve.ShardsolveError as error:
                status = type(error).__name__
        return status, solving.seconds, solving.solves, time.perf_counter() - started

    return run


def iopddl_case(name: str):
    def run(limit: float):
        from shardsolve.encodings import solve
        from shardsolve.iopddl import read_iopddl

        problem = read_iopddl(IOPDDL / f"asplos-2025-iopddl-{name}.json.gz")
        started = time.perf_counter()
        solution = solve(problem, time_limit=limit)
        seconds = time.perf_counter() - started
        return f"{solution.status} {solution.gap:.1%}, cost {solution.cost:.4g}", seconds, 1, seconds

    return run


CASES = {  # name: (what it runs, its run(limit))
    "gpt2-small": ("plan, GPT-2 small, 2x4, tied",
                   lambda: plan_case("models/gpt2.py:gpt2", "small", "data=2,model=4")),
    "llama-untied": ("plan, Llama large, 2x4, untied",
                     lambda: plan_case("models/llama.py:llama", "large", "data=2,model=4", tie=False)),
    "llama-tied": ("plan, Llama large, 2x4, tied",
                   lambda: plan_case("models/llama.py:llama", "large", "data=2,model=4")),
    "gpt2-3axis": ("plan, GPT-2 large, 2x2x2, tied",
                   lambda: plan_case("models/gpt2.py:gpt2", "large", "data=2,fsdp=2,model=2")),
    "llama-memory": ("plan, Llama small, 2x4, memory limit 0.5x the free plan's",
                     lambda: plan_case("models/llama.py:llama", "small", "data=2,model=4", memory_fraction=0.5)),
    "iopddl-K": ("IOPDDL instance K", lambda: iopddl_case("K")),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limits", default="10,30", help="comma-separated time limits in seconds")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--out", default=str(RESULTS / "time_limits.md"))
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    limits = [float(x) for x in args.limits.split(",")]
    names = [n.strip() for n in args.cases.split(",")]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}; choose from: {', '.join(CASES)}")
    load = [os.getloadavg()[0]]
    rows = []
    for name in names:
        label, make = CASES[name]
        run = make()
        for limit in limits:
            status, solving, solves, total = run(limit)
            within = solving <= SLACK * limit + EXTRA
            rows.append((label, limit, solves, solving, total, status, within))
            print(f"{label}, limit {limit:g} s: solving {solving:.1f} s in {solves} solves "
                  f"({solving / limit:.2f}x), call {total:.1f} s, {status}, {'within' if within else 'OVER'}",
                  file=sys.stderr, flush=True)
    load.append(os.getloadavg()[0])
    over = sum(not r[-1] for r in rows)
    lines = [
        "# Time limits against the wall clock",
        "",
        f"Written by `python experiments/time_limits.py --limits {args.limits}"
        + ("" if args.cases == ",".join(CASES) else f" --cases {args.cases}")
        + f"` on {os.cpu_count()} cores; load "
        f"average {load[0]:.1f} at the start and {load[1]:.1f} at the end. *Solving*: wall seconds inside the "
        "solves (summed over a plan call's solves; reading the IOPDDL file excluded); *call*: the whole "
        "`shardsolve.plan` call (tracing, building and, under a memory limit, compiling each candidate plan "
        f"included). Goal: solving within {SLACK:g} x limit + {EXTRA:g} s.",
        "",
        f"{len(rows) - over} of {len(rows)} runs within the goal; worst solving / limit "
        f"{max(r[3] / r[1] for r in rows):.2f}.",
        "",
        "| path | limit s | solves | solving s | solving / limit | call s | result | within |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, limit, solves, solving, total, status, within in rows:
        lines.append(f"| {name} | {limit:g} | {solves} | {solving:.1f} | {solving / limit:.2f} | {total:.1f} | "
                     f"{status} | {'yes' if within else 'no'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0 if over == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
