"""Programs written outside ``models/`` (``experiments/programs.py``), planned and judged as a new user would.

For each program, size and mesh, with only the batch annotated: GSPMD and
Shardy from that annotation, and ``plan.jit()``, all compiled by JAX for 8
CPU devices and priced by the one cost model (``shardsolve.compare``); the
plan's own estimate beside its compiled program (time and memory ratios,
compiled over planned, as in ``experiments/fidelity.py``); the solver's status
and the seconds planning took. Where ``../shared/yardstick`` is present, the
gain over propagation is also given as that ruler prices the same programs.

    python experiments/new_programs.py                                  # large, 2x4, 2x2x2 and 1x8
    python experiments/new_programs.py --programs gru,vit --sizes small --meshes "data=2,model=4"

Writes ``experiments/results/new_programs.md`` (rows as they finish).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from programs import PROGRAMS  # noqa: E402
from vs_propagation import yardstick_seconds  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
MESHES = ("data=2,model=4", "data=2,fsdp=2,model=2", "data=1,model=8")
HEADER = ("| program | size | mesh | GSPMD ms | Shardy ms | shardsolve ms | planned ms | time ratio | vs prop "
          "| yardstick vs prop | propagation MiB | shardsolve MiB | planned MiB | memory ratio | solver | plan s |")


def run_one(name: str, size: str, mesh: str, time_limit: float) -> str:
    from shardsolve.compare import compare
    from shardsolve.mesh import MeshSpec

    fun, args, ins = PROGRAMS[name](size)
    started = time.perf_counter()
    try:
        cmp = compare(fun, *args, mesh=mesh, in_shardings=ins, carry=((0, 0),), time_limit=time_limit)
    except Exception as e:  # noqa: BLE001 - a failure is a row of the table
        return f"| {name} | {size} | {mesh} | failed: {(str(e).splitlines() or [type(e).__name__])[0][:120]} |"
    seconds = time.perf_counter() - started
    cols = {c.name: c for c in cmp.columns}
    devices = MeshSpec.parse(mesh).size

    def ms(c) -> str:
        return f"{c.total * 1e3:.3f}" if c is not None and c.ok else "failed"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b and math.isfinite(a) and math.isfinite(b) else "-"

    ours, plan = cols.get("shardsolve"), cmp.plan
    props = [c for n, c in cols.items() if n in ("gspmd", "shardy") and c.ok]
    best = min(props, key=lambda c: c.total) if props else None
    planned_ms = f"{plan.cost.total * 1e3:.3f}" if plan is not None else "-"
    if ours is None or not ours.ok or plan is None or best is None:
        error = ours.error if ours is not None and not ours.ok else "no plan"
        return f"| {name} | {size} | {mesh} | {ms(cols.get('gspmd'))} | {ms(cols.get('shardy'))} | {error[:120]} |"
    yard = ratio(yardstick_seconds(best, devices), yardstick_seconds(ours, devices))
    status = plan.status + (f" {plan.gap:.1%}" if plan.status == "feasible" else "")
    return (f"| {name} | {size} | {mesh} | {ms(cols.get('gspmd'))} | {ms(cols.get('shardy'))} | {ms(ours)} "
            f"| {planned_ms} | {ratio(ours.total, plan.cost.total)} | {ratio(best.total, ours.total)} | {yard} "
            f"| {best.peak_memory / 2**20:.1f} | {ours.peak_memory / 2**20:.1f} | {plan.cost.peak_memory / 2**20:.1f} "
            f"| {ratio(ours.peak_memory, plan.cost.peak_memory)} | {status} | {seconds:.0f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, from {','.join(PROGRAMS)}")
    p.add_argument("--sizes", default="large", help="comma-separated: small, large")
    p.add_argument("--meshes", default=";".join(MESHES), help="semicolon-separated meshes")
    p.add_argument("--time-limit", type=float, default=30.0, help="solver seconds per plan")
    p.add_argument("--out", default=str(RESULTS / "new_programs.md"))
    args = p.parse_args(argv)
    unknown = [n for n in args.programs.split(",") if n not in PROGRAMS]
    if unknown:
        p.error(f"unknown programs {unknown}; choose from {', '.join(PROGRAMS)}")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    command = "python experiments/new_programs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Programs written outside models/, planned from the batch annotation alone", "",
        f"Written by `{command.strip()}` (8 CPU devices, one process). Times: the one cost model over each "
        "compiled program (`shardsolve.compare`); `time ratio` and `memory ratio`: compiled `plan.jit()` over the "
        "plan's own estimate; `vs prop`: the better of GSPMD/Shardy over shardsolve, compiled (above 1: "
        "shardsolve faster); `yardstick vs prop`: the same ratio as `../shared/yardstick` prices the programs.", "",
        HEADER, "|" + "---|" * (HEADER.count("|") - 1),
    ]
    for size in args.sizes.split(","):
        for mesh in (m for m in args.meshes.split(";") if m):
            for name in args.programs.split(","):
                row = run_one(name, size, mesh, args.time_limit)
                lines.append(row)
                print(row, flush=True)
                out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
