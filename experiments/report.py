"""A side-by-side benchmark's table, printed with rich and written as Markdown under ``experiments/results``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def report(console: Console, path: Path, heading: str, script: str, argv: list[str] | None, method: str,
           title: str, cols: list[str], cells: list[list[str]]) -> None:
    """Print ``cells`` under ``cols`` as a table titled ``title``; write it to ``path`` as Markdown under
    ``heading``, after the command that made it (``python experiments/<script> <args>``), this machine's load
    and ``method`` (how both sides were measured)."""
    table = Table(*cols, title=title)
    for c in cells:
        table.add_row(*c)
    console.print(table)
    args = " ".join(argv if argv is not None else sys.argv[1:])
    path.write_text(
        f"# {heading}\n\n"
        f"`python experiments/{script} {args}`".replace(" `", "`")
        + f" in one run on this machine (load average {os.getloadavg()[0]:.1f} at the end). {method}\n\n"
        + "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
        + "".join("| " + " | ".join(c) + " |\n" for c in cells))
