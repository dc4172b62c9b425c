"""Solver-chosen logical-axis rules vs MaxText's default rules vs the free plan, on the Flax LM.

The model is ``models/flax_lm.py`` (a Flax NNX decoder LM, optax AdamW; every
parameter carries logical axis names). Only the batch is pinned, on the data
parallel axes. For each mesh:

* **MaxText rules**: MaxText's default logical-axis rules
  (``shardsolve.flax.MAXTEXT_RULES``, ``tensor`` = ``"model"``) applied with
  Flax's ``logical_to_mesh`` to parameters and optimizer state (the model's
  ``expert_in_shardings``), compiled by ``jax.jit`` with Shardy propagation;
* **solver rules**: ``shardsolve.plan(..., logical_rules=True)``: the plan
  whose parameter shardings follow one mesh-axis choice per logical name,
  compiled as ``plan.jit()``; and the same rules handed to Flax
  (``logical_to_mesh``) and compiled by ``jax.jit`` with Shardy, as a Flax
  user would use them without shardsolve;
* **solver rules @ MaxText memory**: the same with a memory limit equal to
  the MaxText program's measured peak memory, where the unlimited plan used more;
* **free plan**: ``shardsolve.plan`` without the ties, ``plan.jit()``.

Every program is compiled for 8 fake CPU devices and judged alike
(``shardsolve.compare``): step time estimated by the one cost model from the
compiled program (per-device FLOPs and bytes from ``cost_analysis()``,
collectives from the optimized HLO), peak memory per device from
``memory_analysis()``.

    python experiments/flax_rules.py                       # large (GPT-2 124M size), both meshes
    python experiments/flax_rules.py --size small --meshes data=2,model=4

Writes ``experiments/results/flax_rules.md`` (``flax_rules_small.md`` for the small size).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
MESHES = ("data=2,model=4", "data=2,fsdp=2,model=2")
ENTRY = {False: "flax_lm", True: "flax_lm_fsdp"}  # models/flax_lm.py functions, by whether the mesh has fsdp


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def run_mesh(mesh: str, size: str, time_limit: float, say) -> dict:
    from jax.sharding import PartitionSpec as P

    import shardsolve
    from shardsolve.compare import compare, compile_column, concrete_mesh, jit_with
    from shardsolve.flax import logical_specs, maxtext_rules
    from shardsolve.mesh import MeshSpec

    spec = MeshSpec.parse(mesh)
    model = shardsolve.load_model(str(ROOT / "models" / f"flax_lm.py:{ENTRY['fsdp' in spec.names]}"), size)
    kw = dict(mesh=spec, in_shardings=model.in_shardings, carry=model.carry, time_limit=time_limit)
    out: dict = {"mesh": mesh, "model": model, "maxtext_rules": maxtext_rules(spec.names)}

    say(f"{mesh}: planning with logical rules")
    t0 = time.perf_counter()
    tied = shardsolve.plan(model.fun, *model.args, logical_rules=True, **kw)
    out["tied_plan"], out["tied_seconds"] = tied, time.perf_counter() - t0
    say(f"{mesh}: planning free")
    free = shardsolve.plan(model.fun, *model.args, **kw)
    out["free_plan"] = free

    say(f"{mesh}: compiling MaxText rules and the rule-tied plan")
    cmp = compare(model.fun, *model.args, mesh=spec, in_shardings=model.in_shardings, plan=tied,
                  expert_in_shardings=model.expert_in_shardings, expert_out_shardings=model.expert_out_shardings,
                  columns=("expert", "shardsolve"))
    out["maxtext"], out["tied"] = cmp["expert"], cmp["shardsolve"]
    say(f"{mesh}: compiling the free plan")
    out["free"] = compare(model.fun, *model.args, mesh=spec, plan=free, columns=("shardsolve",))["shardsolve"]

    say(f"{mesh}: compiling the solver's rules through Flax (jax.jit, Shardy)")
    rules = list(tied.logical_axis_rules)
    params, opt_state = model.args[0], model.args[1]
    ins = (logical_specs(params, rules), logical_specs(opt_state, rules), model.in_shardings[2], model.in_shardings[3])
    outs = (ins[0], ins[1], P())
    jmesh = concrete_mesh(spec, spec)
    out["rules_jit"] = compile_column("rules", lambda: jit_with(model.fun, model.args, jmesh, ins, outs), spec, None,
                                      label="solver rules (jax.jit)")

    if out["maxtext"].ok and out["tied"].ok and out["tied"].peak_memory > out["maxtext"].peak_memory:
        limit = out["maxtext"].peak_memory
        say(f"{mesh}: planning with logical rules at MaxText's memory ({_mib(limit)} MiB)")
        try:
            capped = shardsolve.plan(model.fun, *model.args, logical_rules=True, memory_limit=limit,
                                     **{**kw, "time_limit": min(time_limit, 60.0)})
            out["capped_plan"] = capped
            out["capped"] = compare(model.fun, *model.args, mesh=spec, plan=capped, memory_limit=limit,
                                    columns=("shardsolve",))["shardsolve"]
        except shardsolve.ShardsolveError as e:
            out["capped_error"] = str(e)
    return out


def _row(name: str, how: str, col, base, plan=None) -> str:
    if col is None:
        return ""
    if not col.ok:
        return f"| {name} | {how} | failed: {col.error} | | | | | | |\n"
    vs = base.total / col.total if base is not None and base.ok and col.total > 0 else float("nan")
    predicted = f"{plan.cost.total * 1e3:.3f}" if plan is not None else "-"
    comm = sum(b for _, b in col.bytes_by_kind)
    return (f"| {name} | {how} | {col.total * 1e3:.3f} | {col.compute * 1e3:.3f} | {col.communication * 1e3:.3f} | "
            f"{_mib(col.peak_memory)} | {_mib(comm)} | {predicted} | {vs:.2f} |\n")


def _rules_table(r: dict) -> str:
    mine = dict(r["tied_plan"].logical_axis_rules)
    theirs: dict = {}
    for n, a in r["maxtext_rules"]:
        theirs.setdefault(n, a)  # Flax takes the first rule of a name whose mesh axes are free
    lines = "| logical name | solver | MaxText (first rule) |\n|---|---|---|\n"
    for n in mine:
        lines += f"| {n} | {mine[n]} | {theirs.get(n, '(no rule: None)')} |\n"
    return lines


def report(results: list[dict], size: str) -> str:
    text = f"# Solver-chosen logical-axis rules vs MaxText's rules (Flax LM, size {size})\n\n"
    text += ("Written by `python experiments/flax_rules.py" + (" --size small" if size == "small" else "") + "`. "
             "Each program compiled by JAX for 8 fake CPU devices; step time (ms) estimated by the one cost model "
             "from the compiled program (per-device FLOPs and bytes from `cost_analysis()`, collectives from the "
             "optimized HLO), peak memory per device (MiB) from `memory_analysis()`, collective bytes per device. "
             "`plan ms`: the plan's own prediction. `vs MaxText` = MaxText ms / this ms (above 1: faster than "
             "MaxText's rules). Only the batch is pinned, on MaxText's `activation_batch` axes.\n\n")
    for r in results:
        m = r["model"]
        text += f"## {r['mesh']}\n\n{m.description}\n\n"
        st = dict(r["tied_plan"].stats)
        text += (f"Rule-tied plan: {r['tied_plan'].status}, planned in {r['tied_seconds']:.0f} s (two solves); "
                 f"its predicted cost {st.get('logical_cost', 0) * 1e3:.3f} ms vs the free plan's "
                 f"{st.get('logical_free_cost', float('nan')) * 1e3:.3f} ms "
                 f"(overhead {st.get('logical_overhead', float('nan')):+.2%}, `plan.stats`).\n\n")
        text += _rules_table(r) + "\n"
        text += ("| program | compiled as | step ms | compute ms | comm ms | peak MiB | comm MiB | plan ms | vs MaxText |\n"
                 "|---|---|---|---|---|---|---|---|---|\n")
        base = r["maxtext"]
        text += _row("MaxText default rules", "jax.jit, Shardy", base, base)
        text += _row("solver rules", "plan.jit()", r["tied"], base, r["tied_plan"])
        text += _row("solver rules", "Flax logical_to_mesh + jax.jit, Shardy", r["rules_jit"], base)
        if "capped" in r:
            text += _row("solver rules @ MaxText memory", "plan.jit()", r["capped"], base, r["capped_plan"])
        elif "capped_error" in r:
            text += f"| solver rules @ MaxText memory | | {r['capped_error']} | | | | | | |\n"
        text += _row("free plan (no ties)", "plan.jit()", r["free"], base, r["free_plan"])
        text += "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large", choices=("small", "large"))
    parser.add_argument("--meshes", default=";".join(MESHES),
                        help="meshes separated by ';' (default: both)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="solver seconds per plan")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    say = lambda m: print(f"[{time.perf_counter() - t0:6.0f}s] {m}", flush=True)  # noqa: E731
    results = [run_mesh(m, args.size, args.time_limit, say) for m in args.meshes.split(";") if m]
    text = report(results, args.size)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("flax_rules.md" if args.size == "large" else "flax_rules_small.md")
    path.write_text(text)
    print(text)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
