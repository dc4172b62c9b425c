"""The solver-agnostic strategy-selection problem.

This is the problem XLA's auto-sharding pass builds and the IOPDDL contest
published (see ``shardsolve.iopddl``): pick one strategy ``s_i`` per node so as to

    minimise   sum_i  node_cost[i][s_i]  +  sum_(u,v) edge_cost[(u,v)][s_u, s_v]
    subject to s_i in pins[i]                                  (hard constraints)
               sum_{i live at t} usage[i][s_i] <= usage_limit  for every time t

A node is live at every integer time ``t`` with ``start <= t < end`` (its
half-open ``interval``). A cost of ``FORBIDDEN`` (1e18) or more, or ``inf``,
marks a forbidden choice.

The planner builds one ``Problem`` per JAX program (node = operation, strategy
= one way to shard it, edge = resharding between producer and consumer, usage
= bytes per device); solvers in ``shardsolve.encodings`` take any ``Problem``.

    >>> import numpy as np
    >>> p = Problem(
    ...     nodes=(Node("a", np.array([1.0, 5.0]), np.array([4.0, 1.0]), (0, 2)),
    ...            Node("b", np.array([2.0, 2.0]), np.array([4.0, 1.0]), (1, 3))),
    ...     edges=(Edge(0, 1, np.array([[0.0, 3.0], [3.0, 0.0]])),),
    ...     usage_limit=5.0)
    >>> p.evaluate((0, 0))  # both use 4 bytes at t=1: over the limit
    inf
    >>> p.evaluate((1, 1))
    7.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

FORBIDDEN = 1e18


def is_forbidden(cost) -> np.ndarray | bool:
    """True where a cost marks a forbidden choice."""
    return np.asarray(cost, dtype=np.float64) >= FORBIDDEN


@dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One decision: which of ``len(costs)`` strategies to use."""

    name: str
    costs: np.ndarray  # float64 [S]
    usages: np.ndarray  # float64 [S], memory per device while live
    interval: tuple[int, int] = (0, 0)  # half-open liveness [start, end)
    labels: tuple[str, ...] = ()  # optional human-readable strategy names

    @property
    def num_strategies(self) -> int:
        return int(len(self.costs))


@dataclass(frozen=True, slots=True, eq=False)
class Edge:
    """Pairwise cost between the strategies of nodes ``u`` and ``v``."""

    u: int
    v: int
    costs: np.ndarray  # float64 [S_u, S_v]


@dataclass(frozen=True, slots=True)
class Pin:
    """Hard constraint: node ``node`` must use one of ``allowed``.

    ``label`` says, in the user's terms, where it came from
    (``"in_shardings[0]['w1'] = P(None, 'model')"``); unsat cores are
    reported with these labels.
    """

    node: int
    allowed: tuple[int, ...]
    label: str


MEMORY_LIMIT_LABEL = "memory_limit"


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    usage_limit: float | None = None
    pins: tuple[Pin, ...] = ()
    name: str = ""

    # -- checks -----------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first malformed field."""
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            if node.costs.ndim != 1 or len(node.costs) == 0:
                raise ValueError(f"nodes[{i}] ({node.name}): costs must be a non-empty list")
            if node.usages.shape != node.costs.shape:
                raise ValueError(
                    f"nodes[{i}] ({node.name}): {len(node.usages)} usages for {len(node.costs)} strategies"
                )
            if np.any(node.usages < 0):
                raise ValueError(f"nodes[{i}] ({node.name}): negative usage")
            s, e = node.interval
            if s < 0 or e < 0:
                raise ValueError(f"nodes[{i}] ({node.name}): negative interval {node.interval}")
        for k, edge in enumerate(self.edges):
            if not (0 <= edge.u < n and 0 <= edge.v < n):
                raise ValueError(f"edges[{k}] names node {edge.u if not 0 <= edge.u < n else edge.v}, but there are {n} nodes")
            want = (self.nodes[edge.u].num_strategies, self.nodes[edge.v].num_strategies)
            if edge.costs.shape != want:
                raise ValueError(f"edges[{k}] ({edge.u}->{edge.v}): cost table {edge.costs.shape}, expected {want}")
        for pin in self.pins:
            if not 0 <= pin.node < n:
                raise ValueError(f"pin {pin.label!r} names node {pin.node}, but there are {n} nodes")
            bad = [a for a in pin.allowed if not 0 <= a < self.nodes[pin.node].num_strategies]
            if bad or not pin.allowed:
                raise ValueError(f"pin {pin.label!r}: allowed strategies {pin.allowed} out of range")

    # -- evaluation -------------------------------------------------------

    def evaluate(self, solution) -> float:
        """Total cost of ``solution``, or ``inf`` if it breaks any hard constraint."""
        if len(solution) != len(self.nodes):
            return math.inf
        total = 0.0
        for node, s in zip(self.nodes, solution):
            if not 0 <= s < node.num_strategies:
                return math.inf
            c = float(node.costs[s])
            if c >= FORBIDDEN:
                return math.inf
            total += c
        for edge in self.edges:
            c = float(edge.costs[solution[edge.u], solution[edge.v]])
            if c >= FORBIDDEN:
                return math.inf
            total += c
        for pin in self.pins:
            if solution[pin.node] not in pin.allowed:
                return math.inf
        if self.usage_limit is not None and self.peak_usage(solution) > self.usage_limit:
            return math.inf
        return total

    def usage_profile(self, solution) -> np.ndarray:
        """Memory in use at every time step under ``solution``."""
        horizon = max((n.interval[1] for n in self.nodes), default=0)
        delta = np.zeros(horizon + 1, dtype=np.float64)
        for node, s in zip(self.nodes, solution):
            start, end = node.interval
            if end > start:
                delta[start] += node.usages[s]
                delta[end] -= node.usages[s]
        return np.cumsum(delta)[:horizon]

    def peak_usage(self, solution) -> float:
        profile = self.usage_profile(solution)
        return float(profile.max()) if len(profile) else 0.0

    @property
    def num_strategies(self) -> int:
        return sum(n.num_strategies for n in self.nodes)


@dataclass(frozen=True, slots=True)
class Solution:
    """What a solver returns: never nothing while a feasible assignment was found.

    ``status`` is ``"optimal"``, ``"feasible"`` (with ``lower_bound`` certifying
    the gap), ``"infeasible"`` (with ``conflict``, the labels of a minimal set of
    hard constraints that cannot hold together, where known) or ``"unknown"``.
    """

    assignment: tuple[int, ...]
    cost: float
    lower_bound: float
    status: str
    wall_time: float = 0.0
    conflict: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def gap(self) -> float:
        """Relative gap ``(cost - lower_bound) / cost``; 0 when proven optimal."""
        if self.status == "optimal":
            return 0.0
        if not math.isfinite(self.cost):
            return math.inf
        if self.cost <= 0:
            return 0.0 if self.lower_bound >= self.cost else math.inf
        return max(0.0, (self.cost - self.lower_bound) / abs(self.cost))
