"""``shardsolve iopddl FILE``: solve one IOPDDL contest instance (``shardsolve.iopddl.run`` does the work).

    shardsolve iopddl ../shared/iopddl/asplos-2025-iopddl-B.json.gz --time-limit 60 --out solution.json
"""

from __future__ import annotations

import argparse
from typing import Any

from shardsolve.cli.common import console
from shardsolve.iopddl import run as solve_instance


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "iopddl",
        help="solve an IOPDDL contest instance",
        description="Solve one strategy-selection instance in the IOPDDL contest format (.json or .json.gz) and "
        "print its cost, best lower bound and gap.",
    )
    p.add_argument("file", help="instance file")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds (default: 60)")
    p.add_argument("--out", help="write {solution, cost, lower_bound, status} as JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return solve_instance(args.file, time_limit=args.time_limit, out=args.out, console=console())
