"""Signals at random moments: every output file absent or complete and valid, the exit status as documented.

Runs each CLI command (``plan``, ``compare``, ``iopddl``) ``--runs`` times as
a subprocess, sends SIGINT or SIGTERM (alternately) after a random delay drawn
uniformly from zero to the command's own uninterrupted duration (measured
first), and checks what it left:

* exit status 130 after SIGINT, 143 after SIGTERM, or 0 when the command had
  finished before the signal;
* the output file is absent, or complete and valid: a plan file that
  ``shardsolve.load_plan`` reads back, a comparison that is valid JSON with
  every column, an IOPDDL solution whose assignment the contest's evaluation
  prices finitely within the memory limit, with its status ``interrupted``
  exactly when the run was;
* no temporary file left beside it;
* at most one line saying what was written (``interrupted: ...``) and no
  traceback. A signal while the command imports JAX is held back until the
  imports are done, and the command then stops before it starts. Only in the
  milliseconds before that (Python's own start-up) does the process die of
  the signal (the default action), leaving nothing; a signal that comes after
  the command wrote its result, while the process exits, kills it the same
  way, its complete result in place.

    python experiments/interrupts.py                  # 20 runs of each command
    python experiments/interrupts.py --runs 5 --commands iopddl

Writes ``experiments/results/interrupts.md``; exits 1 if any run broke a rule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
INSTANCE = ROOT.parent / "shared" / "iopddl" / "asplos-2025-iopddl-B.json.gz"
MESH = "data=2,model=4"
COMMANDS = {  # name: (argv after "shardsolve", the output file's name)
    "plan": (["plan", str(ROOT / "models" / "gpt2.py:gpt2"), "--mesh", MESH, "--time-limit", "10", "-o", "out.json"],
             "out.json"),
    "compare": (["compare", str(ROOT / "models" / "mlp.py:mlp"), "--mesh", MESH, "--time-limit", "10",
                 "-o", "out.json"], "out.json"),
    "iopddl": (["iopddl", str(INSTANCE), "--time-limit", "20", "--out", "out.json"], "out.json"),
}


def run(argv: list[str], workdir: Path, delay: float | None, sig: int) -> tuple[int, str, float, bool]:
    """Run ``shardsolve argv`` in ``workdir``; signal it after ``delay`` s (None: never).

    Returns (exit status, output, seconds, whether the signal was sent while it ran). The child starts with
    the default action for both signals, as from a terminal, whatever this process inherited.
    """
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    started, sent = time.perf_counter(), False

    def default_signals():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-m", "shardsolve.cli", *argv], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)
    try:
        if delay is not None:
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
                sent = True
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, time.perf_counter() - started, sent


def check(command: str, workdir: Path, output: str, status: int, sig: int, sent: bool) -> list[str]:
    """The rules a run broke (empty: none)."""
    problems = []
    if sent and status == 0:
        problems.append("the signal was lost: the command ran on and exited 0")
    expected = {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
    if status not in (0, expected, -sig):
        problems.append(f"exit status {status} (expected 0 or {expected})")
    left = sorted(p.name for p in workdir.iterdir())
    out_file = workdir / COMMANDS[command][1]
    if [n for n in left if n != out_file.name]:
        problems.append(f"left behind: {', '.join(n for n in left if n != out_file.name)}")
    if "Traceback" in output and status != -sig:
        problems.append("a traceback")
    if len([line for line in output.splitlines() if line.startswith("interrupted")]) > 1:
        problems.append("more than one 'interrupted' line")
    if status == 0 and not out_file.exists() and command != "compare":
        problems.append("finished without its output file")
    if out_file.exists():  # killed by the signal (-sig) with a file: the command had finished, on its way out
        problems.extend(validate(command, out_file, interrupted=status not in (0, -sig)))
    return problems


def validate(command: str, path: Path, interrupted: bool) -> list[str]:
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        return [f"output is not JSON ({error})"]
    if command == "plan":
        import shardsolve

        try:
            plan = shardsolve.load_plan(path)
        except Exception as error:  # noqa: BLE001 - any failure to read back is the finding
            return [f"plan does not load: {str(error).splitlines()[0]}"]
        if (plan.status == "interrupted") != interrupted:
            return [f"plan status {plan.status!r} after a run that was{'' if interrupted else ' not'} interrupted"]
        return []
    if command == "compare":
        return [] if isinstance(data, dict) and data.get("columns") else ["comparison without its columns"]
    from shardsolve.iopddl import read_iopddl

    problem = read_iopddl(INSTANCE)
    assignment = data.get("solution")
    if not isinstance(assignment, list) or len(assignment) != len(problem.nodes):
        return ["solution without a complete assignment"]
    if not problem.evaluate(assignment) < float("inf"):
        return ["solution priced infinite (invalid)"]
    if (data.get("status") == "interrupted") != interrupted:
        return [f"solution status {data.get('status')!r} after a run that was{'' if interrupted else ' not'} "
                "interrupted"]
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="signalled runs per command (default 20)")
    p.add_argument("--commands", default=",".join(COMMANDS), help=f"comma-separated, from {','.join(COMMANDS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "interrupts.md"))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows, findings = [], []
    for command in args.commands.split(","):
        argv_c, _ = COMMANDS[command]
        with tempfile.TemporaryDirectory() as tmp:
            status, output, full, _ = run(argv_c, Path(tmp), None, signal.SIGINT)
            if status != 0:
                print(output, file=sys.stderr)
                raise SystemExit(f"{command} fails without a signal (exit status {status})")
        counts = {"interrupted, file written": 0, "interrupted, nothing written": 0, "finished first": 0,
                  "before the command started": 0, "finished, then killed on the way out": 0}
        broken = 0
        for k in range(args.runs):
            sig = signal.SIGINT if k % 2 == 0 else signal.SIGTERM
            delay = rng.uniform(0.0, full)
            with tempfile.TemporaryDirectory() as tmp:
                workdir = Path(tmp)
                status, output, _, sent = run(argv_c, workdir, delay, sig)
                problems = check(command, workdir, output, status, sig, sent)
                wrote = (workdir / COMMANDS[command][1]).exists()
            if status == 0 and not sent:
                counts["finished first"] += 1
            elif status == -sig:  # the default action: still importing, or on its way out with its result written
                counts["finished, then killed on the way out" if wrote else "before the command started"] += 1
            else:
                counts["interrupted, file written" if wrote else "interrupted, nothing written"] += 1
            verdict = "ok" if not problems else "; ".join(problems)
            broken += bool(problems)
            if problems:
                findings.append(f"{command} run {k} ({signal.Signals(sig).name} at {delay:.1f} s): {verdict}")
            print(f"{command} {k + 1}/{args.runs}: {signal.Signals(sig).name} at {delay:.1f} of {full:.1f} s, "
                  f"exit {status}, {'file' if wrote else 'no file'}: {verdict}", file=sys.stderr, flush=True)
        rows.append((command, full, counts, broken))
    lines = [
        "# Signals at random moments",
        "",
        f"Written by `python experiments/interrupts.py --runs {args.runs} --seed {args.seed}`. Each command ran "
        "once uninterrupted (its duration below), then "
        f"{args.runs} times with SIGINT or SIGTERM (alternately) after a delay drawn uniformly from zero to that "
        "duration. A run is ok when its exit status is 130 / 143 (or 0 if it finished first), its output file "
        "is absent or complete and valid (read back; an IOPDDL assignment priced finitely; status `interrupted` "
        "exactly when interrupted), nothing temporary is left, and it printed no traceback (except where the "
        "process died of the signal, the default action: in Python's start-up before the command started, or "
        "after the command wrote its result, on its way out; a shell reports 130 / 143).",
        "",
        "| command | uninterrupted s | interrupted, file written | interrupted, nothing written | finished first | "
        "before the command started | finished, then killed on the way out | broken |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for command, full, counts, broken in rows:
        lines.append(f"| {command} | {full:.1f} | " + " | ".join(str(v) for v in counts.values()) + f" | {broken} |")
    lines += ["", "Findings: " + ("none." if not findings else ""), *[f"- {f}" for f in findings]]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
