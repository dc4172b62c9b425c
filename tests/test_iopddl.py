"""IOPDDL contest format: round trips, one error per malformed field, atomic output, the CLI entry."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from shardsolve.errors import ShardsolveError
from shardsolve.cli.iopddl import solve_instance
from shardsolve.iopddl import problem_from_json, read_iopddl, solution_to_json, write_iopddl
from shardsolve.problem import FORBIDDEN, Edge, Node, Pin, Problem, Solution

IOPDDL_DIR = Path(__file__).resolve().parents[2] / "shared" / "iopddl"


def example() -> dict:
    return {
        "problem": {
            "name": "example",
            "nodes": {
                "intervals": [[0, 2], [1, 3], [0, 0]],
                "costs": [[1, 5], [2, 2, 7], [3]],
                "usages": [[4, 1], [4, 1, 0], [0]],
            },
            "edges": {"nodes": [[0, 1], [1, 2]], "costs": [[0, 3, 1e18, 3, 0, 1], [1, 2, 3]]},
            "usage_limit": 5,
        }
    }


def write_json(tmp_path: Path, data, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_read_example(tmp_path):
    p = read_iopddl(write_json(tmp_path, example()))
    assert len(p.nodes) == 3 and len(p.edges) == 2 and p.usage_limit == 5.0
    assert p.edges[0].costs.shape == (2, 3)
    assert p.edges[0].costs[0, 2] == FORBIDDEN
    assert p.evaluate((0, 1, 0)) == 1 + 2 + 3 + 3 + 2  # t=1: 4 + 1 fits the limit
    assert p.evaluate((0, 0, 0)) == math.inf  # t=1: 4 + 4 > 5


def test_round_trip_gz(tmp_path):
    p = read_iopddl(write_json(tmp_path, example()))
    out = tmp_path / "again.json.gz"
    write_iopddl(p, out)
    q = read_iopddl(out)
    assert [n.interval for n in q.nodes] == [n.interval for n in p.nodes]
    for a, b in zip(p.nodes, q.nodes, strict=True):
        assert np.array_equal(a.costs, b.costs) and np.array_equal(a.usages, b.usages)
    for a, b in zip(p.edges, q.edges, strict=True):
        assert (a.u, a.v) == (b.u, b.v) and np.array_equal(a.costs, b.costs)
    assert q.usage_limit == p.usage_limit


def test_pins_are_folded_into_forbidden_costs(tmp_path):
    p = read_iopddl(write_json(tmp_path, example()))
    pinned = Problem(p.nodes, p.edges, p.usage_limit, (Pin(1, (2,), "pin"),), p.name)
    out = tmp_path / "pinned.json"
    write_iopddl(pinned, out)
    q = read_iopddl(out)
    assert list(q.nodes[1].costs) == [FORBIDDEN, FORBIDDEN, 7.0]


def test_round_trip_instance_b(tmp_path):
    path = IOPDDL_DIR / "asplos-2025-iopddl-B.json.gz"
    if not path.exists():
        pytest.skip("IOPDDL instances not available")
    p = read_iopddl(path)
    assert len(p.nodes) == 816 and len(p.edges) == 1096
    out = tmp_path / "B.json.gz"
    write_iopddl(p, out)
    q = read_iopddl(out)
    # Every number survives: node costs, usages and intervals, edge endpoints and tables, the limit.
    assert len(q.nodes) == len(p.nodes) and len(q.edges) == len(p.edges)
    for a, b in zip(p.nodes, q.nodes, strict=True):
        np.testing.assert_array_equal(a.costs, b.costs)
        np.testing.assert_array_equal(a.usages, b.usages)
        assert tuple(a.interval) == tuple(b.interval)
    for a, b in zip(p.edges, q.edges, strict=True):
        assert (a.u, a.v) == (b.u, b.v)
        np.testing.assert_array_equal(a.costs, b.costs)
    assert q.usage_limit == p.usage_limit
    assert json.loads(gzip.decompress(out.read_bytes()))["problem"]["usage_limit"] == 14392528


def mutate(path_fn):
    data = example()
    path_fn(data["problem"])
    return data


BAD = {
    "negative usage": (lambda p: p["nodes"]["usages"].__setitem__(0, [4, -1]), "problem.nodes.usages[0]"),
    "negative cost": (lambda p: p["nodes"]["costs"].__setitem__(1, [2, -2, 7]), "problem.nodes.costs[1]"),
    "usages length": (lambda p: p["nodes"]["usages"].__setitem__(1, [4, 1]), "problem.nodes.usages[1] has 2 entries, expected 3"),
    "empty costs": (lambda p: p["nodes"]["costs"].__setitem__(2, []), "problem.nodes.costs[2] is empty"),
    "interval count": (lambda p: p["nodes"]["intervals"].pop(), "problem.nodes.intervals has 2 entries, expected 3"),
    "usage count": (lambda p: p["nodes"]["usages"].pop(), "problem.nodes.usages has 2 entries, expected 3"),
    "negative interval": (lambda p: p["nodes"]["intervals"].__setitem__(0, [-1, 2]), "problem.nodes.intervals[0]"),
    "bad interval": (lambda p: p["nodes"]["intervals"].__setitem__(0, [1]), "problem.nodes.intervals[0] must be [start, end]"),
    "edge names missing node": (lambda p: p["edges"]["nodes"].__setitem__(1, [1, 7]), "problem.edges.nodes[1] names node 7"),
    "edge table length": (lambda p: p["edges"]["costs"].__setitem__(0, [0, 1, 2]), "problem.edges.costs[0] has 3 entries, expected 2*3=6"),
    "edge table count": (lambda p: p["edges"]["costs"].pop(), "problem.edges.costs has 1 entries, expected 2"),
    "edge cost not a number": (lambda p: p["edges"]["costs"].__setitem__(1, [1, "x", 3]), "problem.edges.costs[1]"),
    "negative limit": (lambda p: p.__setitem__("usage_limit", -5), "problem.usage_limit"),
    "limit not a number": (lambda p: p.__setitem__("usage_limit", "lots"), "problem.usage_limit"),
    "missing nodes": (lambda p: p.pop("nodes"), "missing field problem.nodes"),
    "missing costs": (lambda p: p["nodes"].pop("costs"), "missing field problem.nodes.costs"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_field_is_named(tmp_path, case):
    change, message = BAD[case]
    path = write_json(tmp_path, mutate(change), "bad.json")
    with pytest.raises(ShardsolveError) as info:
        read_iopddl(path)
    text = str(info.value)
    assert text.startswith("bad.json: ")
    assert message in text
    assert "\n" not in text


def test_truncated_gzip(tmp_path):
    payload = gzip.compress(json.dumps(example()).encode())
    path = tmp_path / "cut.json.gz"
    path.write_bytes(payload[: len(payload) // 2])
    with pytest.raises(ShardsolveError, match=r"cut\.json\.gz: .*truncated"):
        read_iopddl(path)


def test_truncated_json(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(example())[:-20])
    with pytest.raises(ShardsolveError, match=r"cut\.json: malformed JSON"):
        read_iopddl(path)


def test_missing_problem_object(tmp_path):
    with pytest.raises(ShardsolveError, match="missing field problem"):
        read_iopddl(write_json(tmp_path, {"nodes": []}))


def test_missing_file(tmp_path):
    with pytest.raises(ShardsolveError, match="cannot read"):
        read_iopddl(tmp_path / "nope.json")


def test_solution_json():
    p = problem_from_json(example())
    sol = Solution((0, 1, 0), 11.0, 10.0, "feasible")
    out = solution_to_json(p, sol)
    assert out == {"solution": [0, 1, 0], "cost": 11, "lower_bound": 10, "status": "feasible"}


def test_run_writes_answer_atomically(tmp_path):
    from rich.console import Console

    src = write_json(tmp_path, example())
    out = tmp_path / "answer.json"
    console = Console(file=open(tmp_path / "log.txt", "w"), width=100)
    assert solve_instance(src, time_limit=1.0, out=out, console=console) == 0
    answer = json.loads(out.read_text())
    assert answer["status"] == "optimal"
    p = read_iopddl(src)
    assert answer["cost"] == p.evaluate(answer["solution"]) == 11
    assert sorted(x.name for x in tmp_path.iterdir()) == ["answer.json", "log.txt", "p.json"]


def test_run_reports_infeasible(tmp_path):
    data = example()
    data["problem"]["usage_limit"] = 0.5  # node 0 needs at least 1
    from rich.console import Console

    console = Console(file=open(tmp_path / "log.txt", "w"), width=100)
    out = tmp_path / "answer.json"
    assert solve_instance(write_json(tmp_path, data), time_limit=1.0, out=out, console=console) == 2
    assert json.loads(out.read_text())["status"] == "infeasible"


def test_answer_says_where_the_time_went(tmp_path):
    from rich.console import Console

    src = write_json(tmp_path, example())
    out = tmp_path / "answer.json"
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        assert solve_instance(src, time_limit=1.0, out=out, console=Console(file=f, width=100), verbose=True) == 0
    seconds = json.loads(out.read_text())["seconds"]
    assert {"read", "reduce"} <= set(seconds) and all(v >= 0 for v in seconds.values())
    assert "where the time went" in log.read_text()
