"""shardsolve vs GSPMD and Shardy propagation (and a hand-written expert plan), judged on compiled output.

For every model in ``models/`` and every mesh, two annotation settings:

* ``batch``: only the batch dimension pinned (``P("data")``; on a mesh with an
  ``fsdp`` axis the batch is split over ``("data", "fsdp")``);
* ``expert``: the model's expert annotation (Megatron-style on ``"model"``) pinned.

Columns, all compiled by JAX for the same concrete mesh and priced by the one
cost model (``shardsolve.compare``): GSPMD, Shardy, the expert annotation,
shardsolve, and shardsolve with a memory limit equal to the expert program's
measured peak memory per device (``batch`` setting only).

    python experiments/vs_propagation.py                          # everything, small sizes
    python experiments/vs_propagation.py --models mlp,gpt2 --meshes data=2,model=4 --size large

Writes ``experiments/results/vs_propagation.md`` and ``.png`` and prints the
ratios: shardsolve vs the better propagation (above 1: shardsolve faster), and
shardsolve-at-the-expert's-memory vs the expert. Where the outside ruler
``../shared/yardstick/yardstick.py`` is present, the same two ratios are also
given as it prices the same compiled programs (per-device FLOPs with while
bodies times their trips, one latency per collective, no HBM bytes), so the
table shows where the two rulers rank plans differently.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
YARDSTICK = ROOT.parent / "shared" / "yardstick"
RESULTS = ROOT / "experiments" / "results"
MODELS = {
    "mlp": "models/mlp.py:mlp",
    "gpt2": "models/gpt2.py:gpt2",
    "llama": "models/llama.py:llama",
    "moe": "models/moe.py:moe",
    "scan_transformer": "models/scan_transformer.py:scan_transformer",
    "cnn": "models/cnn.py:cnn",
}
MESHES = ("data=1,model=8", "data=2,model=4", "data=2,fsdp=2,model=2")


def adapt(tree, mesh_names: tuple[str, ...]):
    """Put ``"data"`` entries over ``("data", "fsdp")`` when the mesh has an ``fsdp`` axis (``("data", "model")`` too)."""
    import jax
    from jax.sharding import PartitionSpec as P

    if "fsdp" not in mesh_names or tree is None:
        return tree

    def entry(e):
        if e == "data":
            return ("data", "fsdp")
        if isinstance(e, tuple) and "data" in e:
            return tuple(a for x in e for a in (("data", "fsdp") if x == "data" else (x,)))
        return e

    def one(spec):
        if not isinstance(spec, P):
            return spec
        return P(*[entry(e) for e in spec])

    return jax.tree.map(one, tree, is_leaf=lambda x: x is None or isinstance(x, P))


@dataclass
class Row:
    model: str
    mesh: str
    setting: str
    columns: dict = field(default_factory=dict)  # name -> compare.Column
    plan_status: str = ""
    seconds: float = 0.0

    def total(self, name: str) -> float:
        c = self.columns.get(name)
        return c.total if c is not None and c.ok else math.nan

    def best_propagation(self, total=None) -> tuple[str, float]:
        total = total or self.total
        cands = [(n, total(n)) for n in ("gspmd", "shardy") if not math.isnan(total(n))]
        return min(cands, key=lambda x: x[1]) if cands else ("-", math.nan)

    def yardstick(self, name: str) -> float:
        """Seconds, as the outside ruler prices the column's compiled program (nan: no column, or no ruler)."""
        from shardsolve.mesh import MeshSpec

        c = self.columns.get(name)
        return yardstick_seconds(c, MeshSpec.parse(self.mesh).size) if c is not None and c.ok and c.hlo else math.nan


def yardstick_seconds(col, devices: int) -> float:
    """``yardstick.measure``'s step time of a compared column (nan where ``../shared/yardstick`` is absent).

    The column keeps what the ruler reads of a compiled program: its optimized
    HLO, ``memory_analysis()`` and FLOPs (less ``shardsolve.hlo``'s own while-loop
    addition, which the ruler makes itself).
    """
    from types import SimpleNamespace

    if not (YARDSTICK / "yardstick.py").exists():
        return math.nan
    if str(YARDSTICK) not in sys.path:
        sys.path.insert(0, str(YARDSTICK))
    import yardstick

    from shardsolve.hlo import loop_adjustment

    flops = col.flops - loop_adjustment(col.hlo)[0]
    m = col.memory
    compiled = SimpleNamespace(
        cost_analysis=lambda: {"flops": flops},
        as_text=lambda: col.hlo,
        memory_analysis=lambda: SimpleNamespace(argument_size_in_bytes=m.argument, output_size_in_bytes=m.output,
                                                temp_size_in_bytes=m.temp, alias_size_in_bytes=m.alias),
    )
    return yardstick.measure(compiled, devices)["step_s"]


def run_one(model_name: str, spec: str, mesh: str, setting: str, size: str, time_limit: float, say) -> Row:
    import shardsolve
    from shardsolve.compare import compare, failed
    from shardsolve.mesh import MeshSpec

    mesh_spec = MeshSpec.parse(mesh)
    model = shardsolve.load_model(str(ROOT / spec.split(":")[0]) + ":" + spec.split(":")[1], size)
    expert_in = adapt(model.expert_in_shardings, mesh_spec.names)
    expert_out = adapt(model.expert_out_shardings, mesh_spec.names)
    if setting == "batch":
        ins, outs = adapt(model.in_shardings, mesh_spec.names), adapt(model.out_shardings, mesh_spec.names)
    else:
        ins, outs = expert_in, expert_out
    t0 = time.perf_counter()
    cmp = compare(model.fun, *model.args, mesh=mesh, in_shardings=ins, out_shardings=outs, time_limit=time_limit,
                  expert_in_shardings=expert_in, expert_out_shardings=expert_out, carry=model.carry,
                  progress=lambda m: say(f"{model_name} {mesh} {setting}: {m}"))
    row = Row(model_name, mesh, setting, {c.name: c for c in cmp.columns})
    if cmp.plan is not None:
        row.plan_status = cmp.plan.status
    expert = row.columns.get("expert")
    if setting == "batch" and expert is not None and expert.ok:
        limit = expert.peak_memory
        say(f"{model_name} {mesh} {setting}: planning under the expert's memory ({limit} B)")
        try:
            plan = shardsolve.plan(model.fun, *model.args, mesh=mesh, in_shardings=ins, out_shardings=outs,
                                   memory_limit=limit, time_limit=time_limit, carry=model.carry, hints=expert_in)
            col = compare(model.fun, *model.args, mesh=mesh, in_shardings=ins, out_shardings=outs,
                          memory_limit=limit, columns=("shardsolve",), plan=plan).columns[0]
            col = _renamed(col, "shardsolve_mem", "shardsolve @ expert memory")
        except Exception as e:  # noqa: BLE001 - an infeasible or failed plan is a result of the run
            col = failed("shardsolve_mem", (str(e).splitlines() or [type(e).__name__])[0],
                         label="shardsolve @ expert memory")
        row.columns["shardsolve_mem"] = col
    row.seconds = time.perf_counter() - t0
    return row


def _renamed(col, name: str, label: str):
    import dataclasses

    return dataclasses.replace(col, name=name, label=label)


# -- output ------------------------------------------------------------------------


COLS = [("gspmd", "GSPMD"), ("shardy", "Shardy"), ("expert", "expert"), ("shardsolve", "shardsolve"),
        ("shardsolve_mem", "shardsolve @ expert mem")]


def _fmt_ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.4f}"


def _mib(c) -> str:
    return "-" if c is None or not c.ok else f"{c.peak_memory / 2**20:.2f}"


def ratios(row: Row, total=None) -> tuple[float, float]:
    """(best propagation / shardsolve, expert / shardsolve-at-expert-memory): above 1 means shardsolve is faster.

    ``total(name)`` prices a column (default: ``Row.total``, the one cost model; ``Row.yardstick``: the ruler).
    """
    total = total or row.total
    _, best = row.best_propagation(total)
    ss = total("shardsolve")
    vs_prop = best / ss if ss and not math.isnan(ss) else math.nan
    mem = total("shardsolve_mem")
    exp = total("expert")
    vs_exp = exp / mem if mem and not math.isnan(mem) else math.nan
    return vs_prop, vs_exp


def summary(rows: list[Row]) -> list[str]:
    """One line per ruler: the geometric mean and the worst row of shardsolve vs the better propagation."""
    out = []
    for ruler, total in (("the one cost model", None), ("the yardstick", "yardstick")):
        scored = [(ratios(r, getattr(r, total) if total else None)[0], r) for r in rows]
        scored = [(x, r) for x, r in scored if not math.isnan(x) and x > 0]
        if not scored:
            continue
        geo = math.exp(sum(math.log(x) for x, _ in scored) / len(scored))
        worst, w = min(scored, key=lambda t: t[0])
        at_least = sum(x >= 0.995 for x, _ in scored)
        out.append(f"By {ruler}: geometric mean {geo:.2f}x the better of GSPMD/Shardy over {len(scored)} rows, "
                   f"{at_least} at 1.00x or more; worst {worst:.2f}x ({w.model} {w.mesh} {w.setting}).")
    return out


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def write_markdown(rows: list[Row], path: Path, size: str) -> None:
    lines = [
        f"# shardsolve vs propagation ({size} models)",
        "",
        "Step time (ms, estimated by the one cost model from JAX's compiled output: per-device FLOPs and bytes from",
        "`cost_analysis()`, collectives parsed from the optimized HLO) and peak memory per device (MiB,",
        "`memory_analysis()`). `vs prop` = best of GSPMD/Shardy / shardsolve; `vs expert` = expert /",
        "shardsolve planned under the expert's measured memory (both: above 1 means shardsolve is faster).",
        "`yardstick vs prop` / `yardstick vs expert`: the same ratios as `../shared/yardstick` prices the same",
        "compiled programs (FLOPs at peak plus one latency per collective, no HBM bytes; `-` without it).",
        "",
        "| model | mesh | pinned | " + " | ".join(f"{label} ms" for _, label in COLS)
        + " | " + " | ".join(f"{label} MiB" for _, label in COLS)
        + " | vs prop | vs expert | yardstick vs prop | yardstick vs expert | solver |",
        "|" + "---|" * (3 + 2 * len(COLS) + 5),
    ]
    for r in rows:
        vp, ve = ratios(r)
        yp, ye = ratios(r, r.yardstick)
        cells = [_fmt_ms(r.total(n)) for n, _ in COLS] + [_mib(r.columns.get(n)) for n, _ in COLS]
        lines.append(
            f"| {r.model} | {r.mesh} | {r.setting} | " + " | ".join(cells)
            + f" | {_ratio(vp)} | {_ratio(ve)} | {_ratio(yp)} | {_ratio(ye)} | {r.plan_status or '-'} |"
        )
    lines[2:2] = summary(rows) + [""]
    errors = [(r, c) for r in rows for c in r.columns.values() if not c.ok]
    if errors:
        lines += ["", "Failed columns:", ""]
        lines += [f"- {r.model} {r.mesh} {r.setting} {c.label}: {c.error}" for r, c in errors]
    path.write_text("\n".join(lines) + "\n")


def write_chart(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r.model}\n{r.mesh.replace(',', ' ')}\n{r.setting}" for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / len(COLS)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 5))
    for k, (name, label) in enumerate(COLS):
        vals = []
        for r in rows:
            _, best = r.best_propagation()
            t = r.total(name)
            vals.append(t / best if best and not math.isnan(best) and not math.isnan(t) else 0.0)
        ax.bar(x + (k - len(COLS) / 2 + 0.5) * width, vals, width, label=label)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("step time / best propagation (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("shardsolve vs GSPMD / Shardy / expert (one cost model, compiled HLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--meshes", default=";".join(MESHES), help="semicolon-separated meshes")
    p.add_argument("--settings", default="batch,expert", help="batch, expert or both")
    p.add_argument("--size", default="small", choices=("small", "large"))
    p.add_argument("--time-limit", type=float, default=30.0, help="solver seconds per plan")
    p.add_argument("--out", default=str(RESULTS / "vs_propagation"), help="output path without extension")
    args = p.parse_args(argv)
    meshes = [m for m in args.meshes.split(";") if m]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    rows: list[Row] = []
    say = lambda m: print(f"  .. {m}", file=sys.stderr, flush=True)  # noqa: E731
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        for mesh in meshes:
            for setting in args.settings.split(","):
                row = run_one(name, MODELS[name], mesh, setting, args.size, args.time_limit, say)
                rows.append(row)
                vp, ve = ratios(row)
                best_name, _ = row.best_propagation()
                print(f"{name:17s} {mesh:22s} {setting:6s} "
                      + " ".join(f"{n}={_fmt_ms(row.total(n))}" for n, _ in COLS)
                      + f"  shardsolve vs best propagation ({best_name}) {vp:.2f}x"
                      + (f" (yardstick {ratios(row, row.yardstick)[0]:.2f}x)" if YARDSTICK.exists() else "")
                      + (f", vs expert at equal memory {ve:.2f}x" if not math.isnan(ve) else "")
                      + f"  [{row.seconds:.0f} s]", flush=True)
                write_markdown(rows, out.with_suffix(".md"), args.size)  # an interrupted campaign keeps its rows
    write_markdown(rows, out.with_suffix(".md"), args.size)
    write_chart(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
