"""The ``shardsolve`` command: argument parsing and dispatch to one module per command.

    shardsolve plan models/gpt2.py:gpt2 --mesh data=2,model=4 -o plan.json
    shardsolve verify plan.json
    shardsolve compare models/gpt2.py:gpt2 --mesh data=2,model=4 --size large
    shardsolve explain plan.json --show args
    shardsolve iopddl ../shared/iopddl/asplos-2025-iopddl-B.json.gz --time-limit 60

Bad input prints one line (``error: ...``) and exits with status 2; no
traceback, and no partial output file. SIGINT (Ctrl-C) or SIGTERM writes the
best complete result so far, if there is one, with status ``interrupted``
(atomically), says so in one line and exits with 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from rich.markup import escape

from shardsolve.cli import compare, explain, iopddl, plan, verify
from shardsolve.cli.common import EXIT_BAD_INPUT, console, exit_status, interrupts
from shardsolve.errors import ShardsolveError
from shardsolve.version import __version__

COMMANDS = (plan, verify, compare, explain, iopddl)  # each module: add_parser(sub) and run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsolve",
        description="Plan how a JAX program is split over a device mesh with one global optimisation.",
    )
    parser.add_argument("--version", action="version", version=f"shardsolve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with interrupts() as received:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "func", None):
                parser.print_help()
                return EXIT_BAD_INPUT
            return int(args.func(args) or 0)
        except ShardsolveError as e:  # InfeasibleError included
            console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt as e:  # SIGINT or SIGTERM: the command wrote its best result, if it had one
            return _interrupted(e, received, program=argv is None)
        except Exception as e:
            if not received:
                raise
            # The interrupt turned into another error on its way out (it stopped a module's initialisation:
            # "ImportError: initialization failed"): still an interrupt.
            return _interrupted(e, received, program=argv is None)


def _interrupted(e: BaseException, received: list[int], program: bool) -> int:
    """Say what an interrupted command left (unless it did) and give its exit status."""
    if not getattr(e, "reported", False):
        console(stderr=True).print("interrupted: nothing written", markup=False)
    status = exit_status(received)
    if program:  # the ``shardsolve`` program itself, not a call from Python
        # Interrupted mid-compile, XLA's threads can crash the interpreter's tear-down (SIGSEGV after
        # the line above): everything is written, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
