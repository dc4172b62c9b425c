"""The ``shardsolve`` command line: ``main`` (the ``shardsolve`` entry point) and one module per command.

``dispatch.py`` parses and dispatches; ``common.py`` holds what the commands share
(model files and their ``ModelSource``, device set-up, atomic output files);
``plan``, ``verify``, ``compare``, ``explain`` and ``iopddl`` are the commands,
each with its ``add_parser`` and ``run``, and their rich tables.

This module imports nothing heavy: ``main`` holds SIGINT and SIGTERM back while
the commands (and JAX) are imported, and a signal that came meanwhile ends the
command there, with its exit status, before it starts.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

__all__ = ["build_parser", "main"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardsolve`` command on ``argv`` (the program's arguments if None); returns its exit status."""
    with _held_signals() as held:
        from shardsolve.cli.dispatch import main as run_command
    if held:  # a signal while importing: nothing started, nothing written
        print("interrupted: nothing written", file=sys.stderr)
        return 128 + held[0]
    return run_command(argv)  # it handles the signals itself from its first step


def build_parser() -> Any:
    """The ``shardsolve`` argument parser (``shardsolve.cli.dispatch.build_parser``)."""
    from shardsolve.cli.dispatch import build_parser as build

    return build()


@contextmanager
def _held_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM are recorded in the yielded list instead of acting; the previous handlers are restored after.

    The command installs its own handlers inside (``common.interrupts``) and puts
    these back when it is done. Signals ignored by whoever started the process
    stay ignored; outside the main thread nothing is installed.
    """
    held: list[int] = []
    saved = {}
    try:
        for sig in _SIGNALS:
            if signal.getsignal(sig) != signal.SIG_IGN:
                saved[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
    except ValueError:  # not the main thread
        pass
    try:
        yield held
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
