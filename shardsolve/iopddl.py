"""Read and write IOPDDL contest instances and their answers.

The ASPLOS 2025 IOPDDL contest published real strategy-selection problems from
XLA's auto-sharding pass in this (optionally gzip-compressed) JSON format::

    {"problem": {"name": "example",
      "nodes": {"intervals": [[0, 2], [1, 3]],        # half-open liveness
                "costs":     [[1, 5], [2, 2]],        # per strategy
                "usages":    [[4, 1], [4, 1]]},       # memory per strategy
      "edges": {"nodes": [[0, 1]],
                "costs": [[0, 3, 3, 0]]},             # row-major |S_u| x |S_v|
      "usage_limit": 5}}

``read_iopddl`` turns it into a :class:`~shardsolve.problem.Problem` (the same
problem the planner builds), ``write_iopddl`` writes one back (pins folded into
``1e18`` costs, the contest's marker for a forbidden choice), and
``solution_to_json`` gives the contest's answer format.
``shardsolve iopddl FILE [--time-limit S] [--out solution.json]``
(``shardsolve.cli.iopddl``) reads an instance, solves it and writes that answer.

Malformed input raises :class:`~shardsolve.errors.ShardsolveError` with one line
naming the file and the field, e.g.
``B.json.gz: problem.edges.costs[17] has 12 entries, expected 39*4=156``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from shardsolve.errors import ShardsolveError
from shardsolve.files import write_atomically
from shardsolve.problem import FORBIDDEN, Edge, Node, Problem, Solution

__all__ = ["read_iopddl", "write_iopddl", "solution_to_json", "time_spent", "problem_from_json", "problem_to_json"]


# -- reading ------------------------------------------------------------------


def _load_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ShardsolveError(f"{path.name}: cannot read ({exc.strerror or exc})") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ShardsolveError(f"{path.name}: not a readable gzip file ({exc}); is it truncated?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardsolveError(f"{path.name}: malformed JSON ({exc}); is the file truncated?") from None


def _field(obj: Any, key: str, where: str, source: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ShardsolveError(f"{source}: missing field {where + '.' if where else ''}{key}")
    return obj[key]


def _number_list(value: Any, where: str, source: str) -> np.ndarray:
    if not isinstance(value, list):
        raise ShardsolveError(f"{source}: {where} must be a list of numbers")
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ShardsolveError(f"{source}: {where} must be a list of numbers") from None
    if arr.ndim != 1:
        raise ShardsolveError(f"{source}: {where} must be a flat list of numbers")
    if np.isnan(arr).any():
        raise ShardsolveError(f"{source}: {where} contains NaN")
    return arr


def _list_of(value: Any, where: str, source: str) -> list:
    if not isinstance(value, list):
        raise ShardsolveError(f"{source}: {where} must be a list")
    return value


def problem_from_json(data: Any, source: str = "<json>") -> Problem:
    """Build a Problem from the parsed contest JSON; ``source`` prefixes error messages."""
    prob = _field(data, "problem", "", source) if isinstance(data, dict) else None
    if not isinstance(prob, dict):
        raise ShardsolveError(f"{source}: missing field problem (expected an object)")
    name = str(prob.get("name", Path(source).name))
    nodes_json = _field(prob, "nodes", "problem", source)
    intervals = _list_of(_field(nodes_json, "intervals", "problem.nodes", source), "problem.nodes.intervals", source)
    costs = _list_of(_field(nodes_json, "costs", "problem.nodes", source), "problem.nodes.costs", source)
    usages = _list_of(_field(nodes_json, "usages", "problem.nodes", source), "problem.nodes.usages", source)
    n = len(costs)
    if len(intervals) != n:
        raise ShardsolveError(f"{source}: problem.nodes.intervals has {len(intervals)} entries, expected {n} (one per node)")
    if len(usages) != n:
        raise ShardsolveError(f"{source}: problem.nodes.usages has {len(usages)} entries, expected {n} (one per node)")
    nodes = []
    for i in range(n):
        c = _number_list(costs[i], f"problem.nodes.costs[{i}]", source)
        u = _number_list(usages[i], f"problem.nodes.usages[{i}]", source)
        if len(c) == 0:
            raise ShardsolveError(f"{source}: problem.nodes.costs[{i}] is empty (a node needs at least one strategy)")
        if len(u) != len(c):
            raise ShardsolveError(f"{source}: problem.nodes.usages[{i}] has {len(u)} entries, expected {len(c)} (one per strategy)")
        if (c < 0).any():
            raise ShardsolveError(f"{source}: problem.nodes.costs[{i}] has a negative cost")
        if (u < 0).any():
            raise ShardsolveError(f"{source}: problem.nodes.usages[{i}] has a negative usage")
        iv = intervals[i]
        if not (isinstance(iv, list) and len(iv) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in iv)):
            raise ShardsolveError(f"{source}: problem.nodes.intervals[{i}] must be [start, end]")
        start, end = int(iv[0]), int(iv[1])
        if start < 0 or end < 0:
            raise ShardsolveError(f"{source}: problem.nodes.intervals[{i}] = [{start}, {end}] is negative")
        nodes.append(Node(str(i), np.minimum(c, FORBIDDEN), u, (start, end)))
    edges_json = prob.get("edges", {"nodes": [], "costs": []})
    pairs = _list_of(_field(edges_json, "nodes", "problem.edges", source), "problem.edges.nodes", source)
    tables = _list_of(_field(edges_json, "costs", "problem.edges", source), "problem.edges.costs", source)
    if len(pairs) != len(tables):
        raise ShardsolveError(f"{source}: problem.edges.costs has {len(tables)} entries, expected {len(pairs)} (one per edge)")
    edges = []
    for k, (pair, table) in enumerate(zip(pairs, tables)):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise ShardsolveError(f"{source}: problem.edges.nodes[{k}] must be [u, v] node indices")
        u, v = pair
        for x in (u, v):
            if not 0 <= x < n:
                raise ShardsolveError(f"{source}: problem.edges.nodes[{k}] names node {x}, but there are {n} nodes")
        su, sv = len(nodes[u].costs), len(nodes[v].costs)
        c = _number_list(table, f"problem.edges.costs[{k}]", source)
        if len(c) != su * sv:
            raise ShardsolveError(f"{source}: problem.edges.costs[{k}] has {len(c)} entries, expected {su}*{sv}={su * sv}")
        if (c < 0).any():
            raise ShardsolveError(f"{source}: problem.edges.costs[{k}] has a negative cost")
        edges.append(Edge(u, v, np.minimum(c, FORBIDDEN).reshape(su, sv)))
    limit = prob.get("usage_limit")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or math.isnan(limit):
            raise ShardsolveError(f"{source}: problem.usage_limit must be a number")
        if limit < 0:
            raise ShardsolveError(f"{source}: problem.usage_limit = {limit} is negative")
        limit = float(limit)
    return Problem(tuple(nodes), tuple(edges), limit, (), name)


def read_iopddl(path: str | os.PathLike) -> Problem:
    """Read a contest instance (``.json`` or ``.json.gz``)."""
    path = Path(path)
    return problem_from_json(_load_json(path), path.name)


# -- writing ------------------------------------------------------------------


def _number(x: float) -> int | float:
    """Integers stay integers in the JSON (the contest's instances are integral)."""
    x = float(x)
    if x >= FORBIDDEN or math.isinf(x):
        return int(FORBIDDEN)
    return int(x) if x.is_integer() and abs(x) < 2**63 else x


def problem_to_json(problem: Problem) -> dict:
    """The contest JSON of ``problem``; pins become forbidden (1e18) node costs."""
    allowed: dict[int, set[int]] = {}
    for pin in problem.pins:
        allowed[pin.node] = allowed.get(pin.node, set(pin.allowed)) & set(pin.allowed)
    costs = []
    for i, node in enumerate(problem.nodes):
        c = [_number(x) for x in node.costs]
        if i in allowed:
            c = [x if s in allowed[i] else int(FORBIDDEN) for s, x in enumerate(c)]
        costs.append(c)
    out: dict = {
        "name": problem.name,
        "nodes": {
            "intervals": [[int(n.interval[0]), int(n.interval[1])] for n in problem.nodes],
            "costs": costs,
            "usages": [[_number(x) for x in n.usages] for n in problem.nodes],
        },
        "edges": {
            "nodes": [[int(e.u), int(e.v)] for e in problem.edges],
            "costs": [[_number(x) for x in e.costs.ravel()] for e in problem.edges],
        },
    }
    if problem.usage_limit is not None:
        out["usage_limit"] = _number(problem.usage_limit)
    return {"problem": out}


def write_iopddl(problem: Problem, path: str | os.PathLike) -> None:
    """Write ``problem`` in the contest format (gzip-compressed when the name ends in ``.gz``)."""
    path = Path(path)
    payload = json.dumps(problem_to_json(problem), separators=(",", ":")).encode()
    if path.suffix == ".gz":
        payload = gzip.compress(payload, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, payload)


def solution_to_json(problem: Problem, solution: Solution, seconds: dict[str, float] | None = None) -> dict:
    """The contest's answer: one strategy index per node, plus cost, bound and status.

    ``seconds`` (e.g. ``{"read": 4.1, "reduce": 5.0, "search": 80.2}``, see
    ``time_spent``) adds where the time went, as ``"seconds"``.
    """
    cost = problem.evaluate(solution.assignment) if solution.assignment else math.inf
    out = {
        "solution": [int(s) for s in solution.assignment],
        "cost": _number(cost) if math.isfinite(cost) else None,
        "lower_bound": _number(solution.lower_bound) if math.isfinite(solution.lower_bound) else None,
        "status": solution.status,
    }
    if seconds is not None:
        out["seconds"] = {k: round(float(v), 3) for k, v in seconds.items()}
    return out


def time_spent(solution: Solution, read_s: float | None = None) -> dict[str, float]:
    """Wall seconds per stage: reading the file (``read_s``), the reductions, then each phase of ``solve``."""
    stats = solution.stats or {}
    out = {} if read_s is None else {"read": read_s}
    if "reduce_s" in stats:
        out["reduce"] = stats["reduce_s"]
    out.update({name: spent["wall_s"] for name, spent in stats.get("phases", {}).items()})
    return out
