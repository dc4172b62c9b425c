"""Time TRW-S's compiled passes against the same passes indexing the flat tables at an offset, side by side.

    python experiments/trws_passes.py                  # IOPDDL B, V, K and GPT-2 large's untied problem
    python experiments/trws_passes.py --llama          # ... and Llama large's tied problem on 2x2x2 (slower to build)

``kernels`` reads each table row through a view indexed from 0; the reference pass here is the form it
replaced, which indexes the flat array of all tables at ``base + a * s + b`` (numba then tests every index
for being negative, and the compiler gathers the row entry by entry). Both run the same passes from zero
messages on the same packed arrays, alternating, and must end with bitwise equal messages. Prints, per
problem: milliseconds a pass for each, their ratio, nanoseconds per table entry, and how far
``bounds.trws_pass_charge`` sits above the measured pass. Writes ``experiments/results/trws_passes.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "iopddl"
RESULTS = ROOT / "experiments" / "results" / "trws_passes.md"
sys.path.insert(0, str(ROOT / "experiments"))
from report import report  # noqa: E402
_I, _F, _I2 = "int64[::1]", "float64[::1]", "int64[:, ::1]"


@njit(f"void(boolean, {_I}, {_F}, {_F}, {_I}, {_I2}, {_I}, {_F}, {_I}, {_F}, {_I}, {_F}, int64)", nogil=True)
def offset_pass(forward, noff, hat, gamma, ptr, sends, toff, tables, uoff, to_u, voff, to_v, buffer):
    """One TRW-S pass as ``kernels`` ran it before, every table entry read at an offset into ``tables``."""
    n = len(noff) - 1
    share = np.empty(buffer)
    m = np.empty(buffer)
    d = np.empty(buffer)
    for step in range(n):
        i = step if forward else n - 1 - step
        start, end = ptr[i], ptr[i + 1]
        if start == end:
            continue
        si = noff[i + 1] - noff[i]
        for a in range(si):
            share[a] = gamma[i] * hat[noff[i] + a]
        for k in range(start, end):
            e, is_u, j = sends[k, 0], sends[k, 1], sends[k, 2]
            sj = noff[j + 1] - noff[j]
            base = toff[e]
            if is_u:
                for b in range(sj):
                    m[b] = np.inf
                for a in range(si):
                    s = share[a] - to_u[uoff[e] + a]
                    row = base + a * sj
                    for b in range(sj):
                        x = s + tables[row + b]
                        m[b] = x if x < m[b] else m[b]
                out, off = to_v, voff[e]
            else:
                for b in range(si):
                    d[b] = share[b] - to_v[voff[e] + b]
                for a in range(sj):
                    row = base + a * si
                    best = np.inf
                    for b in range(si):
                        x = tables[row + b] + d[b]
                        best = x if x < best else best
                    m[a] = best
                out, off = to_u, uoff[e]
            low = np.inf
            for b in range(sj):
                if m[b] < low:
                    low = m[b]
            hj = noff[j]
            for b in range(sj):
                x = m[b] - low
                hat[hj + b] += x - out[off + b]
                out[off + b] = x


def problems(llama: bool, say) -> list[tuple[str, object]]:
    """(name, flat) of each problem timed: IOPDDL instances and planner problems, reduced as the solver sees
    them."""
    from shardsolve.encodings.flat import flatten
    from shardsolve.encodings.presolve import reduce
    from shardsolve.iopddl import read_iopddl

    out = []
    for name in ("B", "V", "K"):
        path = DATA / f"asplos-2025-iopddl-{name}.json.gz"
        if path.exists():
            say(f"reading IOPDDL {name}")
            out.append((f"IOPDDL {name}", flatten(reduce(read_iopddl(path)).problem)))
    models = [("GPT-2 large, data=2,model=4, untied", "gpt2", "data=2,model=4", False)]
    if llama:
        models.append(("Llama large, data=2,fsdp=2,model=2, tied", "llama", "data=2,fsdp=2,model=2", True))
    for label, name, mesh, tied in models:
        say(f"building {label}")
        out.append((label, flatten(planner_problem(name, mesh, tied))))
    return out


def planner_problem(name: str, mesh: str, tied: bool):
    """The reduced problem of model ``name`` (large) on ``mesh``, its repeated layers merged where ``tied``."""
    import shardsolve
    from shardsolve.annotations import argument_pins, carry_pairs, output_pins
    from shardsolve.build import build_problem
    from shardsolve.encodings import tying
    from shardsolve.encodings.presolve import reduce
    from shardsolve.graph import Graph
    from shardsolve.mesh import MeshSpec
    from shardsolve.trace import trace

    model = shardsolve.load_model(str(ROOT / "models" / f"{name}.py") + f":{name}", "large")
    spec = MeshSpec.parse(mesh)
    traced = trace(model.fun, *model.args)
    problem = build_problem(Graph.from_traced(traced), spec, argument_pins(traced, model.in_shardings, spec),
                            output_pins(traced, model.out_shardings, spec), None,
                            carry_pairs(traced, model.carry)).problem
    reduced = reduce(problem)
    if not tied:
        return reduced.problem
    merged, _ = tying.merge(reduced.problem, tying.tie(reduced, tying.layer_classes(problem)).pairs)
    return reduce(merged).problem


def time_passes(flat, seconds: float) -> dict:
    """Both passes on ``flat``'s packed arrays, alternating rounds of equal passes, for about ``seconds``."""
    from shardsolve.encodings import bounds, kernels

    p = bounds.TrwsSetup.of(flat).packed
    runs = {"view": [p.messages(), 0.0], "offset": [p.messages(), 0.0]}
    for state in runs.values():
        state.append(kernels.hats(p, *state[0]))

    def view(k, hat, to_u, to_v):
        kernels.trws_pass(p, k % 2 == 0, hat, to_u, to_v)

    def offset(k, hat, to_u, to_v):
        forward = k % 2 == 0
        ptr, sends = (p.ahead_ptr, p.ahead) if forward else (p.behind_ptr, p.behind)
        offset_pass(forward, p.noff, hat, p.gamma, ptr, sends, p.toff, p.tables, p.uoff, to_u, p.voff, to_v,
                    max(p.buffer, 1))

    passes, chunk, started = 0, 2, time.perf_counter()
    while passes < 4 or time.perf_counter() - started < seconds:
        for key, fn in (("view", view), ("offset", offset)):
            (to_u, to_v), _, hat = runs[key]
            t = time.perf_counter()
            for k in range(passes, passes + chunk):
                fn(k, hat, to_u, to_v)
            runs[key][1] += time.perf_counter() - t
        passes += chunk
    (vu, vv), (ou, ov) = runs["view"][0], runs["offset"][0]
    entries = int(p.toff[-1])
    view_s, offset_s = runs["view"][1] / passes, runs["offset"][1] / passes
    return {
        "nodes": flat.n, "edges": len(flat.tables), "entries": entries, "passes": passes,
        "view_ms": 1e3 * view_s, "offset_ms": 1e3 * offset_s, "speedup": offset_s / view_s,
        "ns_entry": 1e9 * view_s / max(1, entries), "charge": bounds.trws_pass_charge(flat) / view_s,
        "equal": bool(np.array_equal(vu, ou) and np.array_equal(vv, ov)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama", action="store_true", help="also Llama large's tied problem on 2x2x2")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of passes per problem (default 4)")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    console = Console()
    with console.status("preparing") as status:
        found = problems(args.llama, status.update)
        rows = []
        for name, flat in found:
            status.update(f"timing {name}")
            rows.append({"problem": name} | time_passes(flat, args.seconds))
    cols = ["problem", "nodes", "edges", "table entries", "passes", "ms a pass (view)", "ms a pass (offset)",
            "offset / view", "ns an entry (view)", "charge / measured", "messages equal"]
    cells = [[r["problem"], f"{r['nodes']:,}", f"{r['edges']:,}", f"{r['entries']:,}", str(r["passes"]),
              f"{r['view_ms']:.3f}", f"{r['offset_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['ns_entry']:.2f}",
              f"{r['charge']:.2f}x", "yes" if r["equal"] else "NO"] for r in rows]
    report(console, RESULTS, "TRW-S passes", "trws_passes.py", argv,
           "Both passes run alternately on the same packed arrays from zero messages; `offset` is the form "
           "`encodings/kernels.py` replaced.", "TRW-S passes: rows read through views against offsets", cols, cells)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
