"""Memory-limited solves from scratch against solves started from the plan without the limit.

Under a memory limit the planner first solves without it; where that plan's
compiled program is over the limit, every solve under the limit starts from it
(``encodings.solve(..., start=)``: made to fit the limit the solver sees, then
searched from). This benchmark measures what the start is worth, side by side
in one run: for each model, the problem is solved without a limit, then under
limits at fractions of that plan's planned peak, each from scratch and from the
free plan, with the same work budget; the table gives both step times, their
ratio, and whether each found a plan.

    python experiments/starts.py                                   # GPT-2 and Llama, large, 2x2x2
    python experiments/starts.py --models gpt2 --mesh data=2,model=4 --fractions 0.8 --out /tmp/starts.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def run(model_name: str, mesh: str, size: str, free_limit: float, limited_limit: float,
        fractions: list[float], say) -> list[dict]:
    import dataclasses

    import shardsolve
    from shardsolve.annotations import argument_pins, carry_pairs, output_pins
    from shardsolve.build import build_problem
    from shardsolve.graph import Graph
    from shardsolve.mesh import MeshSpec
    from shardsolve.planner import search_once, to_plan
    from shardsolve.trace import trace

    sys.path.insert(0, str(ROOT / "experiments"))
    from vs_propagation import MODELS, adapt

    spec = MODELS[model_name]
    model = shardsolve.load_model(str(ROOT / spec.split(":")[0]) + ":" + spec.split(":")[1], size)
    mesh_spec = MeshSpec.parse(mesh)
    ins, outs = adapt(model.in_shardings, mesh_spec.names), adapt(model.out_shardings, mesh_spec.names)
    say(f"{model_name} {mesh}: tracing and building")
    traced = trace(model.fun, *model.args)
    graph = Graph.from_traced(traced)
    built = build_problem(graph, mesh_spec, argument_pins(traced, ins, mesh_spec), output_pins(traced, outs, mesh_spec),
                          None, carry_pairs(traced, model.carry)).plain()  # every latency paid, as under a limit

    def found(solution) -> float:
        return solution.cost if solution.status in ("optimal", "feasible") else math.inf

    say(f"{model_name} {mesh}: solving without a limit ({free_limit:g} s)")
    free = search_once(built, free_limit, 0, True, None)
    peak = to_plan(graph, built, free, mesh_spec, model.fun).cost.peak_memory
    rows = []
    for fraction in fractions:
        limited = dataclasses.replace(built, problem=dataclasses.replace(built.problem, usage_limit=fraction * peak))
        result = {}
        for label, start in (("scratch", None), ("start", free.assignment)):
            say(f"{model_name} {mesh}: under {fraction:.0%} of the free plan's peak, {label}")
            t0 = time.perf_counter()
            solution = search_once(limited, limited_limit, 0, True, None, start=start)
            result[label] = (found(solution), time.perf_counter() - t0)
        rows.append(dict(model=model_name, mesh=mesh, fraction=fraction, free=found(free), peak=peak,
                         scratch=result["scratch"], start=result["start"]))
    return rows


def _ms(cost: float) -> str:
    return f"{cost * 1e3:.4g}" if math.isfinite(cost) else "none"


def write(rows: list[dict], path: Path, args) -> None:
    ratios = [r["scratch"][0] / r["start"][0] for r in rows
              if math.isfinite(r["scratch"][0]) and math.isfinite(r["start"][0])]
    lines = ["# Memory-limited solves: from scratch and from the plan without the limit", "",
             f"Size {args.size}, free solve {args.free_limit:g} s, each limited solve {args.limited_limit:g} s of "
             "work (the planner's first solve under a limit gets 30% of `time_limit`); step times as the model "
             "prices them (ms). `scratch / start` above 1: the start found the faster plan.", ""]
    if ratios:
        lines += [f"Geometric mean scratch / start {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x over "
                  f"{len(ratios)} rows with both; worst {min(ratios):.2f}x; rows where only the start found a plan: "
                  f"{sum(1 for r in rows if math.isinf(r['scratch'][0]) and math.isfinite(r['start'][0]))}.", ""]
    lines += ["| model | mesh | limit (of the free plan's peak) | free ms | scratch ms | start ms | scratch / start "
              "| scratch s | start s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = (f"{r['scratch'][0] / r['start'][0]:.2f}" if math.isfinite(r["scratch"][0])
                 and math.isfinite(r["start"][0]) else "-")
        lines.append(f"| {r['model']} | {r['mesh']} | {r['fraction']:.0%} ({r['fraction'] * r['peak'] / 2**20:,.1f} "
                     f"MiB) | {_ms(r['free'])} | {_ms(r['scratch'][0])} | {_ms(r['start'][0])} | {ratio} | "
                     f"{r['scratch'][1]:.1f} | {r['start'][1]:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama", help="comma-separated bundled models")
    p.add_argument("--mesh", default="data=2,fsdp=2,model=2")
    p.add_argument("--size", default="large", choices=("small", "large"))
    p.add_argument("--fractions", default="0.9,0.7", help="limits, as fractions of the free plan's planned peak")
    p.add_argument("--free-limit", type=float, default=9.0, help="work seconds of the solve without a limit")
    p.add_argument("--limited-limit", type=float, default=6.75, help="work seconds of each solve under a limit")
    p.add_argument("--out", default=str(RESULTS / "starts.md"))
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    say = lambda m: print(f"  .. {m}", file=sys.stderr, flush=True)  # noqa: E731
    fractions = [float(f) for f in args.fractions.split(",") if f]
    rows: list[dict] = []
    for name in args.models.split(","):
        rows += run(name, args.mesh, args.size, args.free_limit, args.limited_limit, fractions, say)
        write(rows, Path(args.out), args)
    for r in rows:
        print(f"{r['model']:8s} {r['mesh']:22s} {r['fraction']:.0%}: free {_ms(r['free'])} ms, scratch "
              f"{_ms(r['scratch'][0])} ms, start {_ms(r['start'][0])} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
