"""The plan beside the program that runs: planned step time and memory against the compiled ``plan.jit()``.

For every bundled model, size, mesh and annotation setting (``batch``: only the
batch pinned; ``expert``: the model's Megatron-style annotation pinned, as in
``experiments/vs_propagation.py``), plan with the model's carry pairs, compile
``plan.jit()`` (the rewriter's program, what a user runs) and price the
compiled program with the same cost model (``shardsolve.compare.judge``:
FLOPs and bytes from ``cost_analysis()`` with while bodies times their trip
count, every collective of the optimized HLO, memory from
``memory_analysis()``). Each row shows the planned and the compiled figures
and their ratio, compiled over planned; 1.00 means the model predicts the
program exactly.

    python experiments/fidelity.py                                    # everything (long)
    python experiments/fidelity.py --sizes small --models mlp,gpt2 --meshes "data=2,model=4"

Writes ``experiments/results/fidelity.md`` (rows are written as they finish)
and prints each row and the worst ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from vs_propagation import MESHES, MODELS, adapt  # noqa: E402

RESULTS = ROOT / "experiments" / "results"


@dataclass
class Row:
    model: str
    size: str
    mesh: str
    setting: str
    planned_total: float = math.nan
    planned_compute: float = math.nan
    planned_comm: float = math.nan
    planned_memory: float = math.nan
    compiled_total: float = math.nan
    compiled_compute: float = math.nan
    compiled_comm: float = math.nan
    compiled_memory: float = math.nan
    status: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def time_ratio(self) -> float:
        return self.compiled_total / self.planned_total if self.planned_total else math.nan

    @property
    def memory_ratio(self) -> float:
        return self.compiled_memory / self.planned_memory if self.planned_memory else math.nan


def run_one(name: str, size: str, mesh: str, setting: str, time_limit: float) -> Row:
    import shardsolve
    from shardsolve.compare import compare
    from shardsolve.mesh import MeshSpec

    row = Row(name, size, mesh, setting)
    t0 = time.perf_counter()
    spec = MeshSpec.parse(mesh)
    file, fn = MODELS[name].split(":")
    model = shardsolve.load_model(f"{ROOT / file}:{fn}", size)
    if setting == "batch":
        ins, outs = adapt(model.in_shardings, spec.names), adapt(model.out_shardings, spec.names)
    else:
        ins, outs = adapt(model.expert_in_shardings, spec.names), adapt(model.expert_out_shardings, spec.names)
    try:
        plan = shardsolve.plan(model.fun, *model.args, mesh=mesh, in_shardings=ins, out_shardings=outs,
                               carry=model.carry, time_limit=time_limit)
        col = compare(model.fun, *model.args, mesh=mesh, in_shardings=ins, out_shardings=outs,
                      columns=("shardsolve",), plan=plan).columns[0]
    except Exception as e:  # noqa: BLE001 - a failure is a row of the table
        row.error = (str(e).splitlines() or [type(e).__name__])[0][:200]
        row.seconds = time.perf_counter() - t0
        return row
    c = plan.cost
    row.planned_total, row.planned_compute, row.planned_comm, row.planned_memory = (
        c.total, c.compute, c.communication, c.peak_memory)
    row.status = plan.status + (f" {plan.gap:.1%}" if plan.status == "feasible" else "")
    if col.ok:
        row.compiled_total, row.compiled_compute, row.compiled_comm = col.total, col.compute, col.communication
        row.compiled_memory = col.peak_memory
    else:
        row.error = col.error[:200]
    row.seconds = time.perf_counter() - t0
    return row


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.3f}"


def _mib(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / 2**20:,.1f}"


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


HEADER = ("| model | size | mesh | pinned | planned ms (compute + comm) | compiled ms (compute + comm) | time ratio "
          "| planned MiB | compiled MiB | memory ratio | solver |")


def table(rows: list[Row]) -> list[str]:
    out = [HEADER, "|" + "---|" * 11]
    for r in rows:
        if r.error and math.isnan(r.planned_total):
            out.append(f"| {r.model} | {r.size} | {r.mesh} | {r.setting} | error: {r.error} | | | | | | |")
            continue
        out.append(
            f"| {r.model} | {r.size} | {r.mesh} | {r.setting} | {_ms(r.planned_total)} ({_ms(r.planned_compute)} + "
            f"{_ms(r.planned_comm)}) | {_ms(r.compiled_total)} ({_ms(r.compiled_compute)} + {_ms(r.compiled_comm)}) "
            f"| {_ratio(r.time_ratio)} | {_mib(r.planned_memory)} | {_mib(r.compiled_memory)} "
            f"| {_ratio(r.memory_ratio)} | {r.status} |"
        )
    return out


def summary(rows: list[Row]) -> list[str]:
    ok = [r for r in rows if not r.error]
    if not ok:
        return ["No row compiled."]

    def worst(key) -> Row:
        return max(ok, key=lambda r: abs(math.log(key(r))) if key(r) > 0 else math.inf)

    def gmean(vals) -> float:
        vals = [v for v in vals if v > 0 and not math.isnan(v)]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else math.nan

    wt, wm = worst(lambda r: r.time_ratio), worst(lambda r: r.memory_ratio)
    within_t = sum(0.9 <= r.time_ratio <= 1.1 for r in ok)
    within_m = sum(0.9 <= r.memory_ratio <= 1.1 for r in ok)
    return [
        f"{len(ok)} rows compiled ({len(rows) - len(ok)} failed). Time ratio within [0.9, 1.1]: {within_t} of {len(ok)}, "
        f"geometric mean {gmean(r.time_ratio for r in ok):.3f}; memory ratio within [0.9, 1.1]: {within_m} of "
        f"{len(ok)}, geometric mean {gmean(r.memory_ratio for r in ok):.3f}.",
        f"Worst time ratio {wt.time_ratio:.2f}: {wt.model} {wt.size} {wt.mesh} {wt.setting}. "
        f"Worst memory ratio {wm.memory_ratio:.2f}: {wm.model} {wm.size} {wm.mesh} {wm.setting}.",
    ]


def write(rows: list[Row], path: Path, command: str) -> None:
    lines = [
        "# Fidelity: the plan against the compiled `plan.jit()`",
        "",
        f"Written by `{command}`. Planned: `plan.cost` (step time = compute + communication, peak memory per "
        "device). Compiled: `plan.jit()` compiled by JAX for 8 CPU devices and priced by the same cost model "
        "(`shardsolve.compare.judge`: `cost_analysis()` FLOPs and bytes with while bodies times their trip count, "
        "the optimized HLO's collectives, `memory_analysis()` argument + output + temp - alias). Ratios are "
        "compiled / planned.",
        "",
        *summary(rows),
        "",
        *table(rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--sizes", default="small,large", help="comma-separated: small, large")
    p.add_argument("--meshes", default=";".join(MESHES), help="semicolon-separated meshes")
    p.add_argument("--settings", default="batch,expert", help="batch, expert or both")
    p.add_argument("--time-limit", type=float, default=30.0, help="solver seconds per plan")
    p.add_argument("--out", default=str(RESULTS / "fidelity.md"))
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    command = "python experiments/fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for size in args.sizes.split(","):
        for name in args.models.split(","):
            for mesh in (m for m in args.meshes.split(";") if m):
                for setting in args.settings.split(","):
                    row = run_one(name, size, mesh, setting, args.time_limit)
                    rows.append(row)
                    print(table([row])[-1] + (f" {row.error}" if row.error else "") + f" [{row.seconds:.0f} s]",
                          flush=True)
                    write(rows, out, command.strip())
    for line in summary(rows):
        print(line)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
