"""What every ``shardsolve`` command shares: consoles, model files, devices, output files.

A plan written by ``shardsolve plan`` (or ``compare --plan-output``) records
where its model came from in ``Plan.source``, one ``ModelSource``:

    >>> str(ModelSource("models/mlp.py:mlp", "large", "expert"))
    'models/mlp.py:mlp --size large --annotations expert'
    >>> ModelSource.parse("models/mlp.py:mlp --size large --annotations expert").size
    'large'

Bad input raises ``ShardsolveError``; ``cli.dispatch.main`` prints its one line and
exits with ``EXIT_BAD_INPUT``. Output files are written whole or not at all
(``files.write_atomically``).
"""

from __future__ import annotations

import _thread
import argparse
import json
import math
import os
import shlex
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console

from shardsolve.errors import ShardsolveError
from shardsolve.files import write_atomically
from shardsolve.mesh import MeshSpec
from shardsolve.model import Model

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
ANNOTATIONS = ("default", "expert", "none")
SIZES = ("small", "large")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def console(stderr: bool = False) -> Console:
    """A rich console for tables: no highlighting, 160 columns when not a terminal."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def ms(seconds: float) -> str:
    """Seconds as milliseconds with four decimals; ``-`` for infinity (a failed column)."""
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.4f}"


def solver_status(plan: Any) -> str:
    """A plan's solver status for a summary line: ``optimal``, the status with its certified gap, or, where the
    plan is propagation's (faster than the solver's as plans are priced, ``plan.stats``' ``propagation_kept``),
    that no bound speaks for it."""
    if plan.status == "optimal":
        return "optimal"
    if dict(plan.stats).get("propagation_kept"):
        return f"{plan.status}: propagation's plan, faster than the solver's as plans are priced (no certified gap)"
    return f"{plan.status}, gap {plan.gap:.2%}"


# -- model files ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model file, its size and which of its annotations were pinned: ``Plan.source`` as the CLI writes it."""

    model: str  # FILE[:NAME]
    size: str = "small"
    annotations: str = "default"

    def __str__(self) -> str:
        return f"{shlex.quote(self.model)} --size {self.size} --annotations {self.annotations}"

    @classmethod
    def parse(cls, source: str) -> ModelSource:
        """Inverse of ``str``; a one-line ``ShardsolveError`` for a source it cannot read."""
        if not source.strip():
            raise ShardsolveError(
                "the plan names no model (its 'source' is empty); verify it from Python with "
                "shardsolve.verify(shardsolve.load_plan(path, fun, *args), *args)"
            )
        try:
            words = shlex.split(source)
        except ValueError as e:
            raise ShardsolveError(f"cannot read the plan's source {source!r}: {e}") from None
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        parser.add_argument("model")
        parser.add_argument("--size", default="small")
        parser.add_argument("--annotations", default="default")
        try:
            ns, _ = parser.parse_known_args(words)
        except (argparse.ArgumentError, SystemExit):
            raise ShardsolveError(
                f"cannot read the plan's source {source!r}; expected 'FILE[:NAME] --size S --annotations A'"
            ) from None
        return cls(ns.model, ns.size, ns.annotations)

    @property
    def file_exists(self) -> bool:
        return os.path.isfile(self.model.split(":", 1)[0])


def annotations_of(model: Model, which: str) -> tuple[Any, Any]:
    """(in_shardings, out_shardings) of ``model`` for ``--annotations default|expert|none``."""
    if which == "expert":
        if model.expert_in_shardings is None:
            raise ShardsolveError(f"model {model.name!r} has no expert annotation; use --annotations default")
        return model.expert_in_shardings, model.expert_out_shardings
    if which == "none":
        return None, None
    return model.in_shardings, model.out_shardings


def add_model_arguments(p: argparse.ArgumentParser, *, annotations_help: str, memory_help: str) -> None:
    """The arguments every command that loads a model file takes."""
    p.add_argument("model", metavar="FILE[:NAME]", help="model file, e.g. models/gpt2.py:gpt2")
    p.add_argument("--mesh", required=True, help="mesh axes, e.g. data=2,model=4")
    p.add_argument("--size", default="small", choices=SIZES, help="model size (default: small)")
    p.add_argument("--annotations", default="default", choices=ANNOTATIONS, help=annotations_help)
    p.add_argument("--memory-limit", help=memory_help)
    p.add_argument("--time-limit", type=float,
                   help="solver seconds per plan, all its solves together (default: no limit for the plan, 30 "
                        "for each of its solves; stops sooner when proven optimal)")
    p.add_argument("--hbm-bandwidth", type=float, metavar="BYTES_PER_S",
                   help="price compute as a roofline at this HBM bandwidth per device, e.g. 8.19e11 for a TPU v5e "
                        "(default: FLOPs at peak, as the yardstick prices them)")


def mesh_of(args: argparse.Namespace) -> MeshSpec:
    """``--mesh``, with ``--hbm-bandwidth`` where given (a positive number of bytes/s)."""
    hbm = getattr(args, "hbm_bandwidth", None)
    if hbm is None:
        return MeshSpec.parse(args.mesh)
    if not hbm > 0:
        raise ShardsolveError(f"--hbm-bandwidth {hbm!r} must be a positive number of bytes/s, e.g. 8.19e11")
    return MeshSpec.parse(args.mesh, hbm_bandwidth=hbm)


def source_of(args: argparse.Namespace) -> ModelSource:
    """The ``ModelSource`` of a command's model arguments."""
    return ModelSource(args.model, args.size, args.annotations)


# -- devices --------------------------------------------------------------------------


def ensure_host_devices(n: int) -> bool:
    """Ask XLA for ``n`` fake CPU devices unless JAX's backend already started or a count is set.

    Returns whether the flag was added. Only the CPU platform reads it, so it is
    harmless where accelerators are present. Call it before anything starts
    JAX's backend (small models allocate arrays when loaded).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG in flags:
        return False
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):
        pass
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()
    return True


# -- output files ---------------------------------------------------------------------


def check_output(path: str | None, example: str) -> None:
    """Refuse, before any work, an output path that is a directory or lies in a missing one."""
    if not path:
        return
    if os.path.isdir(path):
        raise ShardsolveError(f"output {path!r} is a directory; give a file name like {example}")
    directory = Path(path).parent if str(Path(path).parent) else Path(".")
    if not directory.is_dir():
        raise ShardsolveError(f"cannot write {path}: directory {directory} does not exist")


def write_json(path: str, data: Any) -> None:
    """``data`` as indented, key-sorted JSON, written atomically."""
    check_output(path, "out.json")
    write_atomically(Path(path), json.dumps(data, indent=1, sort_keys=True).encode())


# -- interrupts -----------------------------------------------------------------------


@contextmanager
def interrupts() -> Iterator[list[int]]:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` inside; yields a list that records the signals received.

    The exit status of an interrupted command is ``exit_status(signals)``:
    130 for SIGINT, 143 for SIGTERM (128 + the signal's number, as a shell
    reports a process killed by it). Outside the main thread nothing is installed,
    nor for a signal the process was started with ignored (a background job
    of a non-interactive shell ignores SIGINT, as Python itself then does).
    """
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    def unraisable(info: Any) -> None:
        # Python drops an exception raised where it cannot propagate (a garbage-collector callback of
        # JAX's, a __del__): the interrupt would be lost and the command run on. Deliver it again from
        # another thread, so that it lands on a later line of ordinary code (or, dropped again, comes back).
        if isinstance(info.exc_value, KeyboardInterrupt) and received:
            again = threading.Timer(0.05, _thread.interrupt_main, args=(received[0],))
            again.daemon = True
            again.start()
            return
        previous_hook(info)

    saved = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) == signal.SIG_IGN:  # ignored by whoever started us (``cmd &``, nohup): keep so
                continue
            saved[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    previous_hook = sys.unraisablehook
    if saved:
        sys.unraisablehook = unraisable
    try:
        yield received
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
        if saved:
            sys.unraisablehook = previous_hook


def exit_status(received: list[int]) -> int:
    """130 after SIGINT (or a ``KeyboardInterrupt`` raised otherwise), 143 after SIGTERM."""
    return EXIT_TERMINATED if received and received[0] == signal.SIGTERM else EXIT_INTERRUPTED


def keep_interrupted(interrupt: BaseException, result: Any, what: str, path: str | None,
                     write: Callable[[str], None], detail: str = "") -> None:
    """Say in one line what an interrupted command leaves: its best complete ``result`` written to ``path``, or nothing.

    ``write(path)`` writes the result atomically; ``detail`` describes it
    (status and gap). Marks ``interrupt`` as reported, so ``cli.dispatch.main`` adds no line of its own.
    """
    err = console(stderr=True)
    if result is None:
        err.print(f"interrupted: no complete {what} yet; nothing written", soft_wrap=True, markup=False)
    elif not path:
        err.print(f"interrupted: best {what} so far ({detail}) not written (no output file given)", soft_wrap=True,
                  markup=False)
    else:
        write(path)
        err.print(f"interrupted: best {what} so far ({detail}) written to {path} with status interrupted",
                  soft_wrap=True, markup=False)
    interrupt.reported = True
