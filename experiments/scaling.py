"""How planning scales with depth: GPT-2-style training steps of 12 to 96 layers on a 2x4 mesh.

For each depth it measures, in one run and side by side: tracing, building the
problem, the graph size before and after the solver's exact reductions,
solving (status and certified gap), and JAX's own compile time of the same
function with the same batch annotation (Shardy propagation). The ratio
planning / JAX compile is the figure of merit: planning should never be the
bottleneck.

    python experiments/scaling.py                       # 12, 24, 48, 96 layers
    python experiments/scaling.py --layers 12 --time-limit 60

Writes experiments/results/scaling.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import shardsolve  # noqa: E402
from shardsolve.mesh import MeshSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_gpt2_module():
    spec = importlib.util.spec_from_file_location("gpt2_model", ROOT / "models" / "gpt2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt2_model"] = module
    spec.loader.exec_module(module)
    return module


def jax_compile_seconds(model, mesh: MeshSpec) -> float:
    """Seconds for jax.jit(...).lower(...).compile() with the model's own annotations (Shardy)."""
    jmesh = mesh.jax_mesh()
    leaves, tree = jax.tree_util.tree_flatten(model.args)
    from shardsolve.planner import broadcast_annotations

    anns = broadcast_annotations(model.in_shardings, tree, "in_shardings")
    args = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(jmesh, a if a is not None else jax.sharding.PartitionSpec()))
        if a is not None else jax.ShapeDtypeStruct(x.shape, x.dtype)
        for x, a in zip(leaves, anns)
    ]
    start = time.perf_counter()
    with jax.sharding.use_mesh(jmesh) if hasattr(jax.sharding, "use_mesh") else _null():
        jax.jit(model.fun).lower(*jax.tree_util.tree_unflatten(tree, args)).compile()
    return time.perf_counter() - start


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--mesh", default="data=2,model=4")
    parser.add_argument("--time-limit", type=float, default=None, help="solver seconds (default: 2x JAX's compile time)")
    parser.add_argument("--skip-compile", action="store_true", help="do not compile with JAX (no ratio)")
    args = parser.parse_args(argv)
    console = Console()
    gpt2 = load_gpt2_module()
    mesh = MeshSpec.parse(args.mesh)
    table = Table(title=f"GPT-2 training step on {mesh}: planning vs JAX compile")
    cols = ["layers", "ops", "nodes", "nodes after reductions", "trace+build s", "solve s", "plan s",
            "JAX compile s", "plan / compile", "status", "gap"]
    for c in cols:
        table.add_column(c, justify="right")
    rows = []
    for n in args.layers:
        model = gpt2.gpt2_layers(n, "large")
        compile_s = float("nan") if args.skip_compile else jax_compile_seconds(model, mesh)
        limit = args.time_limit or (max(10.0, 2 * compile_s) if compile_s == compile_s else 60.0)
        start = time.perf_counter()
        plan = shardsolve.plan(model.fun, *model.args, mesh=mesh, in_shardings=model.in_shardings,
                               out_shardings=model.out_shardings, carry=model.carry, time_limit=limit)
        total = time.perf_counter() - start
        stats = dict(plan.stats)
        row = [
            str(n), str(stats.get("ops", "")), str(stats.get("problem_nodes", "")),
            str(stats.get("reduced_nodes", stats.get("nodes_after", ""))),
            f"{total - plan.solve_time:.1f}", f"{plan.solve_time:.1f}", f"{total:.1f}",
            f"{compile_s:.1f}", f"{total / compile_s:.2f}" if compile_s == compile_s else "-",
            plan.status, f"{plan.gap:.3%}",
        ]
        rows.append(row)
        table.add_row(*row)
        console.print(f"{n} layers: plan {total:.1f} s, compile {compile_s:.1f} s, {plan.status}, gap {plan.gap:.3%}")
    console.print(table)
    out = ROOT / "experiments" / "results" / "scaling.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# Planning time vs JAX compile time (GPT-2 training step, mesh {mesh})", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    out.write_text("\n".join(lines) + "\n")
    console.print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
