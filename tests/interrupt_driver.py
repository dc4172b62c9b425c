"""Run the ``shardsolve`` command with its solver tapped, for tests that send signals at a known moment.

    python tests/interrupt_driver.py MODE MARKER shardsolve-arguments...

MODE ``tap``: the real solver; MARKER is written once its search holds a
complete solution (the first progress report with a finite cost), so a signal
sent after it finds one to hand back. MODE ``hold``: a search that finds the
solver's own answer, marks it as its incumbent, writes MARKER, and then goes
on until a signal stops it (layer tying is off, so that it is the search the
planner runs). Any other MODE: the plain command (the test's
model file writes MARKER itself).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from pathlib import Path

import shardsolve.encodings as encodings


def tapped(real, marker: Path):
    def solve(problem, **options):
        progress = options.get("progress")

        def tap(message: str, best: float, bound: float) -> None:
            if best < float("inf") and not marker.exists():
                marker.write_text(message)
            if progress:
                progress(message, best, bound)

        options["progress"] = tap
        return real(problem, **options)

    return solve


def holding(real, marker: Path):
    def search(problem, *, incumbent, **options):
        found = real(problem, **options)
        incumbent["solution"] = lambda: dataclasses.replace(found, status="interrupted")
        marker.write_text("holding")
        while True:  # a search that never ends on its own
            time.sleep(0.02)

    return encodings.interruptible(search)


def main() -> int:
    # Python's own actions for both signals, as from a terminal: a test run started in the background
    # (``pytest &``) hands its children SIGINT ignored, which the command would keep.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    mode, marker, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    if mode == "tap":
        encodings.solve = tapped(encodings.solve, marker)
    elif mode == "hold":
        import shardsolve.planner

        encodings.solve = holding(encodings.solve, marker)
        shardsolve.planner.solve_tied = lambda problem, **options: None  # the held search is the untied one
    from shardsolve.cli.dispatch import main as shardsolve

    return shardsolve(argv)


if __name__ == "__main__":
    sys.exit(main())
