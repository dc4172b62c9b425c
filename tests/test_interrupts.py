"""SIGINT and SIGTERM during ``plan``, ``compare`` and ``iopddl``: the best complete result so far, or nothing.

Each run is a subprocess signalled once a marker file says where it is (a
complete solution in hand, or still tracing), never after a fixed delay. An
interrupted command writes its best complete result atomically with status
``interrupted`` (or no file at all), says which in one line, and exits with
130 after SIGINT and 143 after SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardsolve
from shardsolve.errors import Interrupted
from shardsolve.iopddl import read_iopddl

from conftest import IOPDDL_DIR  # noqa: I001

DRIVER = Path(__file__).with_name("interrupt_driver.py")
MESH = "data=2,model=4"
SLOW_MODEL = """
import time
from pathlib import Path
import jax, jax.numpy as jnp
import shardsolve

def slow(size="small"):
    def step(x):
        Path({marker!r}).write_text("tracing")
        time.sleep(60)  # still tracing when the signal comes
        return x * 2
    return shardsolve.Model(step, (jax.ShapeDtypeStruct((8, 8), jnp.float32),))
"""


def _signalled(tmp_path: Path, mode: str, argv: list[str], sig: int, wait_s: float = 300.0):
    """Start the driver, wait for its marker, send ``sig``; (exit status, stdout + stderr)."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, str(DRIVER), mode, str(marker), *argv], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + wait_s  # a safety net against a hang, not a timing assertion
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"finished before the marker: {proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("no marker")
            time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=wait_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


def _interrupted_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("interrupted")]


def _files(tmp_path: Path) -> list[str]:
    """What the command left in its directory (temporary files included)."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in ("marker", "slow.py"))


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_plan_interrupted_writes_its_best_plan(tmp_path, models_dir, sig, status):
    out = tmp_path / "plan.json"
    code, text = _signalled(tmp_path, "hold", ["plan", f"{models_dir}/mlp.py:mlp", "--mesh", MESH, "-o", str(out)],
                            sig)
    assert code == status, text
    (line,) = _interrupted_lines(text)
    assert "best plan so far" in line and str(out) in line and "Traceback" not in text
    data = json.loads(out.read_text())
    assert data["status"] == "interrupted" and data["format"] == "shardsolve-plan"
    plan = shardsolve.load_plan(out)  # complete and valid
    assert plan.status == "interrupted" and 0 <= plan.gap <= 1
    assert _files(tmp_path) == ["plan.json"]  # no temporary file left behind


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_interrupted_before_any_result_writes_nothing(tmp_path, command):
    model = tmp_path / "slow.py"
    model.write_text(SLOW_MODEL.format(marker=str(tmp_path / "marker")))
    out = tmp_path / "out.json"
    code, text = _signalled(tmp_path, "plain", [command, str(model), "--mesh", MESH, "-o", str(out)], signal.SIGTERM)
    assert code == 143, text
    (line,) = _interrupted_lines(text)
    assert "nothing written" in line and "Traceback" not in text
    assert _files(tmp_path) == []


def test_iopddl_interrupted_writes_its_best_solution(tmp_path):
    path = IOPDDL_DIR / "asplos-2025-iopddl-V.json.gz"  # its search runs the whole limit: there is time to stop it
    if not path.exists():
        pytest.skip("IOPDDL instances not available")
    out = tmp_path / "answer.json"
    code, text = _signalled(tmp_path, "tap", ["iopddl", str(path), "--time-limit", "120", "--out", str(out)],
                            signal.SIGINT)
    assert code == 130, text
    (line,) = _interrupted_lines(text)
    assert "best solution so far" in line and str(out) in line
    answer = json.loads(out.read_text())
    assert answer["status"] == "interrupted"
    problem = read_iopddl(path)
    assert answer["cost"] == problem.evaluate(answer["solution"]) < float("inf")  # a valid solution
    assert answer["lower_bound"] is None or answer["lower_bound"] <= answer["cost"]
    assert _files(tmp_path) == ["answer.json"]


def test_python_api_reraises_keyboard_interrupt_with_the_best_plan(monkeypatch):
    """``shardsolve.plan`` re-raises the interrupt (a ``KeyboardInterrupt``) with the best plan attached."""
    import jax
    import jax.numpy as jnp

    import shardsolve.encodings as encodings

    real = encodings.solve

    def search(problem, *, incumbent, **options):
        found = real(problem, **options)
        incumbent["solution"] = lambda: __import__("dataclasses").replace(found, status="interrupted")
        raise KeyboardInterrupt  # as Ctrl-C would, mid-search

    monkeypatch.setattr(encodings, "solve", encodings.interruptible(search))
    x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    with pytest.raises(KeyboardInterrupt) as info:
        shardsolve.plan(lambda x, w: jnp.tanh(x @ w), x, w, mesh=MESH, tie=False)
    assert isinstance(info.value, Interrupted)
    plan = info.value.plan
    assert plan is not None and plan.status == "interrupted" and len(plan.inputs) == 2

    def nothing_yet(problem, *, incumbent, **options):
        raise KeyboardInterrupt

    monkeypatch.setattr(encodings, "solve", encodings.interruptible(nothing_yet))
    with pytest.raises(Interrupted) as info:
        shardsolve.plan(lambda x, w: jnp.tanh(x @ w), x, w, mesh=MESH, tie=False)
    assert info.value.plan is None and info.value.solution is None


def test_an_interrupt_python_drops_is_delivered_again():
    """A signal handled inside a garbage-collector callback or ``__del__`` raises where Python drops it."""
    from shardsolve.cli.common import exit_status, interrupts

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, where Python ignores it
            time.sleep(0.01)

    with interrupts() as received:
        with pytest.raises(KeyboardInterrupt):
            thing = Dropped()
            del thing
            for _ in range(1000):  # ordinary code: the interrupt is delivered again here
                time.sleep(0.001)
    assert received[0] == signal.SIGTERM and exit_status(received) == 143


def test_an_error_raised_by_the_interrupt_still_exits_as_interrupted(capsys, monkeypatch):
    """An interrupt that stops a module's initialisation comes out as ImportError; it is still an interrupt."""
    import shardsolve.cli.plan as plan_command
    from shardsolve.cli import main

    def interrupted_import(args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        raise AssertionError("not reached")

    def broken_import(args):
        try:
            interrupted_import(args)
        except KeyboardInterrupt as e:
            raise ImportError("initialization failed") from e

    monkeypatch.setattr(plan_command, "run", broken_import)
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, even under ``pytest &``
    try:
        assert main(["plan", "m.py", "--mesh", MESH]) == 130
    finally:
        signal.signal(signal.SIGINT, saved)
    assert capsys.readouterr().err.strip() == "interrupted: nothing written"


@pytest.mark.parametrize("stage", ["tied search", "untied bound"])
def test_an_interrupted_tied_search_hands_back_a_plan_of_the_whole_program(monkeypatch, stage):
    """Ctrl-C while repeated layers are tied: the tied search's best, lifted to every value, is the plan so far."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from shardsolve.encodings import tying

    from test_tying import _stack_step  # noqa: I001

    if stage == "tied search":
        real = tying.solve_tied_problem

        def inner(problem, *args, **kwargs):
            found = real(problem, *args, **kwargs)
            raise Interrupted(dataclasses.replace(found, status="interrupted"))

        monkeypatch.setattr(tying, "solve_tied_problem", inner)
    else:
        def bound(*args, **kwargs):
            raise KeyboardInterrupt  # where no search attaches its best: the tied plan is the best so far

        monkeypatch.setattr(tying, "untied_bound", bound)
    args = ([jax.ShapeDtypeStruct((32, 32), jnp.float32) for _ in range(6)],
            jax.ShapeDtypeStruct((16, 32), jnp.float32))
    with pytest.raises(Interrupted) as info:
        shardsolve.plan(_stack_step, *args, mesh=MESH, in_shardings=(None, P("data")))
    plan = info.value.plan
    assert plan is not None and plan.status == "interrupted"
    assert len(plan.inputs) == 7 and 0 < plan.gap <= 1  # no untied bound yet: the trivial one, 0


def test_an_interrupted_memory_search_hands_back_the_best_plan_that_fits(monkeypatch):
    """Ctrl-C during a re-solve of the compiled-memory search: the fastest plan known to fit is the plan so far."""
    import jax
    import jax.numpy as jnp

    from shardsolve import planner

    limit = 1 << 20
    # The plan without the limit, propagation's and the first under the limit compile far over the limit, later
    # ones as the model counts.
    first, fitted = [2 * limit] * 3, []

    def compiled_peak(plan, args):
        peak = first.pop() if first else int(plan.cost.peak_memory)
        fitted.extend([plan] if peak <= limit else [])
        return peak

    monkeypatch.setattr(planner, "compiled_peak", compiled_peak)
    search = planner.search_once

    def interrupted_once_one_fits(*args, **kwargs):
        if fitted:  # the search goes on for a faster plan: Ctrl-C now
            raise Interrupted(None)
        return search(*args, **kwargs)

    monkeypatch.setattr(planner, "search_once", interrupted_once_one_fits)
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    with pytest.raises(Interrupted) as info:
        shardsolve.plan(lambda x, w: jnp.tanh(x @ w), x, w, mesh=MESH, tie=False, memory_limit=limit)
    plan = info.value.plan
    assert plan is not None and plan.status == "interrupted"
    assert plan.inputs == fitted[-1].inputs and plan.cost == fitted[-1].cost  # the plan that fits


def test_a_signal_the_process_was_started_ignoring_stays_ignored():
    """A background job of a non-interactive shell starts with SIGINT ignored: the CLI keeps it so."""
    from shardsolve.cli.common import interrupts

    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # SIGTERM still handled
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


IMPORTING_JAX_SIGNALLED = """
import builtins, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, even under ``pytest &``
real_import = builtins.__import__

def importing(name, *args, **kwargs):  # the signal comes as the command first imports JAX
    if name == "jax" and "jax" not in sys.modules:
        os.kill(os.getpid(), signal.{sig})
    return real_import(name, *args, **kwargs)

builtins.__import__ = importing
import shardsolve.cli
assert "jax" not in sys.modules, "importing the command line imported JAX"
sys.exit(shardsolve.cli.main(["iopddl", "missing.json.gz", "--out", "out.json"]))
"""


@pytest.mark.parametrize("sig, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_the_command_imports_jax_ends_it_before_it_starts(tmp_path, sig, status):
    """Held back until the imports are done: one line and the signal's exit status, no traceback, no file."""
    proc = subprocess.run([sys.executable, "-c", IMPORTING_JAX_SIGNALLED.format(sig=sig)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stderr
    assert proc.stderr.strip() == "interrupted: nothing written"
    assert _files(tmp_path) == []


def test_importing_shardsolve_does_not_import_jax():
    code = ("import sys, shardsolve; assert 'jax' not in sys.modules; "
            "assert shardsolve.plan.__module__ == 'shardsolve.planner'; "
            "import shardsolve.plan, shardsolve.compare, shardsolve.lower, shardsolve.verify; "
            "from shardsolve.plan import Plan; assert shardsolve.Plan is Plan; "
            "assert all(callable(getattr(shardsolve, n)) for n in ('plan', 'compare', 'lower', 'verify')), "
            "'a submodule took the name of its function'; "
            "assert 'jax' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
