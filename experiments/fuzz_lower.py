"""Fuzz the rewriter: random programs, meshes, annotations and strategies, lowered and checked.

    python experiments/fuzz_lower.py --count 300                 # random strategies (default)
    python experiments/fuzz_lower.py --count 50 --solver real    # the planner's own solver
    python experiments/fuzz_lower.py --count 100 --uneven        # also dimensions of 3 and 6

Each program comes from ``tests/lower_cases.py`` (chains and DAGs of
dot_general/einsum, elementwise ops, reductions, reshapes, transposes,
broadcasts, concatenations and slices over 1 to 3 dimensional arrays) on a
random mesh of up to 8 devices in 1, 2 or 3 dimensions, with random pinned
annotations. It is planned (``--solver random``: a random strategy per node
among those every reshard allows; ``greedy``; ``real``: ``shardsolve.encodings``),
lowered with ``shardsolve.lower`` and checked: numerics against the
unsharded function, and predicted == lowered bytes per collective kind and
mesh axes. Prints one line per program, every mismatch with its program, and
a summary: programs fuzzed, mismatches, errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from lower_cases import check_lowering, draw_program, greedy_solver, plan_with_solver, random_solver  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="programs to fuzz (default: 100)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default: 0)")
    parser.add_argument("--solver", choices=("random", "greedy", "real"), default="random")
    parser.add_argument("--max-ops", type=int, default=6, help="operations per program at most (default: 6)")
    parser.add_argument("--uneven", action="store_true", help="also draw dimensions that shards do not divide")
    parser.add_argument("--quiet", action="store_true", help="print mismatches and the summary only")
    args = parser.parse_args(argv)

    from shardsolve.errors import ShardsolveError

    fuzzed = mismatches = errors = refused = 0
    started = time.time()
    for seed in range(args.start, args.start + args.count):
        program = draw_program(seed, max_ops=args.max_ops, uneven=args.uneven)
        solver = {"random": lambda: random_solver(seed), "greedy": greedy_solver, "real": lambda: None}[args.solver]()
        t0 = time.time()
        try:
            plan = plan_with_solver(solver, program.fun, *program.args, mesh=program.mesh,
                                    in_shardings=program.in_specs, out_shardings=program.out_specs)
        except ShardsolveError as e:  # e.g. an annotation the planner does not support
            refused += 1
            if not args.quiet:
                print(f"{seed:6d} refused: {e}")
            continue
        fuzzed += 1
        try:
            outcome = check_lowering(plan, program.args)
        except Exception as e:  # noqa: BLE001 - a crash is a finding
            errors += 1
            print(f"{seed:6d} ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(f"       mesh {program.mesh}; {program.text}; in {program.in_specs}; out {program.out_specs}")
            traceback.print_exc(limit=-2)
            continue
        line = f"{seed:6d} {time.time() - t0:5.1f}s {program.mesh:12s} {len(plan.ops):3d} ops " \
               f"{len(plan.collectives):3d} collectives"
        if outcome.ok:
            if not args.quiet:
                print(line + " ok")
            continue
        mismatches += 1
        print(line + f" MISMATCH numerics={'ok' if outcome.numerics_ok else f'rel {outcome.max_rel:.1e}'} "
                     f"collectives={'ok' if outcome.collectives_ok else 'differ'}")
        print(f"       mesh {program.mesh}; {program.text}; in {program.in_specs}; out {program.out_specs}")
        if not outcome.collectives_ok:
            print(f"       predicted {outcome.predicted}")
            print(f"       lowered   {outcome.lowered}")
    print(f"programs fuzzed: {fuzzed}, mismatches: {mismatches}, errors: {errors}, refused by the planner: "
          f"{refused} ({args.solver} strategies, seeds {args.start}..{args.start + args.count - 1}, "
          f"{time.time() - started:.0f} s)")
    return 1 if mismatches or errors else 0


if __name__ == "__main__":
    sys.exit(main())
