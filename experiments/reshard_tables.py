"""Time the problem builder's reshard tables priced in numpy against pricing each pair with ``reshard_time``, side by side.

    python experiments/reshard_tables.py                          # Llama, GPT-2 and the CNN, large, on 2x2x2
    python experiments/reshard_tables.py --models gpt2 --meshes "data=2,model=4;data=2,fsdp=2,model=2"

Each model is traced and its problem built once, recording every table the builder asks
``ReshardTables.table`` for (a value's shape and element size, the source and destination shardings).
The requests are then answered again in the order they came, from cold caches
(``cost.clear_reshard_caches``) and with the cyclic garbage collector off (as the planner builds), by two
forms alternating ``--repeats`` times:

- ``per pair``: the form ``ReshardTables.table`` replaced, one ``reshard_time`` call for each distinct
  (source, destination) pair of a table;
- ``numpy``: ``ReshardTables.table``.

Both must give equal tables, entry for entry to the bit. Prints, per model and mesh: the tables and
pairs asked for, the seconds of each form (the fastest of its runs) and their ratio. Writes
``experiments/results/reshard_tables.md``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "reshard_tables.md"
sys.path.insert(0, str(ROOT / "experiments"))
from report import report  # noqa: E402


def requests(name: str, mesh: str, size: str) -> list[tuple]:
    """Every ``ReshardTables.table`` call building model ``name``'s problem on ``mesh`` makes, as shardings."""
    import shardsolve
    from shardsolve import cost
    from shardsolve.annotations import argument_pins, carry_pairs, output_pins
    from shardsolve.build import build_problem
    from shardsolve.graph import Graph
    from shardsolve.mesh import MeshSpec
    from shardsolve.trace import trace

    model = shardsolve.load_model(str(ROOT / "models" / f"{name}.py") + f":{name}", size)
    spec = MeshSpec.parse(mesh)
    traced = trace(model.fun, *model.args, mesh=spec)
    seen: list[tuple] = []
    table = cost.ReshardTables.table

    def recording(self, shape, itemsize, src, dst):
        seen.append((shape, itemsize, [self.shardings[i] for i in src], [self.shardings[i] for i in dst]))
        return table(self, shape, itemsize, src, dst)

    cost.ReshardTables.table = recording
    try:
        build_problem(Graph.from_traced(traced), spec, argument_pins(traced, model.in_shardings, spec),
                      output_pins(traced, model.out_shardings, spec), None, carry_pairs(traced, model.carry))
    finally:
        cost.ReshardTables.table = table
    return seen


def per_pair(tables, asked: list[tuple]) -> list[np.ndarray]:
    """The tables as ``ReshardTables.table`` priced them before: each distinct pair by ``reshard_time``."""
    from shardsolve.cost import reshard_time

    small: dict[tuple, np.ndarray] = {}
    full: dict[tuple, np.ndarray] = {}
    out = []
    for shape, itemsize, src, dst in asked:
        src, dst = tables.ids(src), tables.ids(dst)
        full_key = (shape, itemsize, src.tobytes(), dst.tobytes())
        if full_key not in full:
            su, si = np.unique(src, return_inverse=True)
            du, di = np.unique(dst, return_inverse=True)
            key = (shape, itemsize, su.tobytes(), du.tobytes())
            if key not in small:
                t = np.empty((len(su), len(du)))
                for a, s in enumerate(su):
                    for b, d in enumerate(du):
                        x = reshard_time(shape, itemsize, tables.shardings[s], tables.shardings[d], tables.mesh)
                        t[a, b] = tables.impossible if math.isinf(x) else x
                small[key] = t
            full[full_key] = small[key][np.ix_(si, di)]
        out.append(full[full_key])
    return out


def in_numpy(tables, asked: list[tuple]) -> list[np.ndarray]:
    return [tables.table(shape, itemsize, tables.ids(src), tables.ids(dst)) for shape, itemsize, src, dst in asked]


def measure(name: str, mesh: str, size: str, repeats: int) -> dict:
    from shardsolve import cost
    from shardsolve.mesh import MeshSpec

    asked = requests(name, mesh, size)
    spec = MeshSpec.parse(mesh)
    seconds: dict[str, list[float]] = {"per pair": [], "numpy": []}
    answers = {}
    for _ in range(repeats):
        for form, run in (("per pair", per_pair), ("numpy", in_numpy)):
            cost.clear_reshard_caches()
            answers.pop(form, None)
            tables = cost.ReshardTables(spec)
            gc.collect()
            gc.disable()  # as the planner builds: its objects stay out of the cyclic collector's passes
            try:
                start = time.perf_counter()
                answers[form] = run(tables, asked)
                seconds[form].append(time.perf_counter() - start)
            finally:
                gc.enable()
    equal = all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(answers["per pair"], answers["numpy"]))
    distinct = {(shape, itemsize, frozenset(src), frozenset(dst)) for shape, itemsize, src, dst in asked}
    entries = sum(len(src) * len(dst) for _, _, src, dst in distinct)
    return {"model": f"{name} ({size})", "mesh": mesh, "tables": len(asked), "distinct": len(distinct), "pairs": entries,
            "per pair": min(seconds["per pair"]), "numpy": min(seconds["numpy"]), "equal": equal}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt2,cnn", help="bundled models, comma-separated")
    parser.add_argument("--meshes", default="data=2,fsdp=2,model=2",
                        help="meshes separated by ';' (default data=2,fsdp=2,model=2)")
    parser.add_argument("--size", default="large", choices=["small", "large"])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each form, alternating (default 2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    console = Console()
    rows = []
    with console.status("preparing") as status:
        for mesh in args.meshes.split(";"):
            for name in args.models.split(","):
                status.update(f"{name} on {mesh}: building and timing")
                rows.append(measure(name, mesh, args.size, args.repeats))
    cols = ["model", "mesh", "tables asked for", "distinct tables", "pairs priced", "per pair s", "numpy s",
            "per pair / numpy", "tables equal"]
    cells = [[r["model"], r["mesh"], f"{r['tables']:,}", f"{r['distinct']:,}", f"{r['pairs']:,}",
              f"{r['per pair']:.2f}", f"{r['numpy']:.2f}", f"{r['per pair'] / r['numpy']:.2f}x",
              "yes" if r["equal"] else "NO"] for r in rows]
    report(console, RESULTS, "Reshard tables", "reshard_tables.py", argv,
           "Every table the problem builder asks for, answered from cold caches by both forms, alternating; the "
           f"fastest of {args.repeats} runs each. `per pair`: one `reshard_time` call for each distinct pair of a "
           "table, the form `ReshardTables.table` replaced.", "Reshard tables: numpy against one reshard_time call "
           "a pair", cols, cells)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
