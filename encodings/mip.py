"""The whole problem as a mixed-integer program over the local polytope, solved by HiGHS's branch and cut.

The LP of ``bounds.local_polytope`` (one ``x`` per node strategy, one ``y``
per allowed pair of an edge, the memory rows kept) with every ``x``
integral; the ``y`` of an edge then hold the one pair its two nodes chose.
Where the LP is fractional, HiGHS's cuts and branching close gaps that
CP-SAT's search does not: on a GRU training step scanned over its time steps
(57 decisions, 9,000 pairs, dense edge tables of reshards repeated 64 times)
the LP bound lies 9.5% under the best CP-SAT found in a minute, and HiGHS
proves the optimum, 6% below that plan, at its root node in 2 to 4 seconds.

``solve_mip`` runs HiGHS single-threaded (deterministic) with a node limit
as its work limit and the wall clock as a safety net. Costs are normalised
as for the LP; a proof is HiGHS's, to its relative gap ``MIP_GAP``, and a
bound short of one is HiGHS's dual bound less the LP's tolerance margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shardsolve.encodings.bounds import local_polytope
from shardsolve.encodings.flat import Flat, evaluate

__all__ = ["MipResult", "solve_mip", "MIP_GAP"]

#: HiGHS's relative gap at which it calls a solution optimal (its default, 1e-4, is above the planner's reporting).
MIP_GAP = 1e-7


@dataclass
class MipResult:
    assignment: np.ndarray | None  # the best valid assignment HiGHS found, or None
    cost: float  # its exact cost (``flat.evaluate``), ``inf`` without one
    bound: float  # a lower bound on every valid assignment's cost (``-inf`` without one)
    status: str  # "optimal", "feasible" or "unknown"
    nodes: int  # branch-and-bound nodes HiGHS explored
    stats: dict = field(default_factory=dict)


def solve_mip(flat: Flat, *, node_limit: int, time_limit: float) -> MipResult:
    """``flat`` solved as a MIP by HiGHS, within ``node_limit`` nodes and ``time_limit`` wall seconds."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    lp = local_polytope(flat)
    constraints = [LinearConstraint(lp.a_eq, lp.b_eq, lp.b_eq)]
    if lp.a_ub is not None:
        constraints.append(LinearConstraint(lp.a_ub, -np.inf, lp.b_ub))
    integrality = np.zeros(len(lp.cost))
    integrality[:lp.n_x] = 1
    res = milp(lp.cost, integrality=integrality, bounds=Bounds(np.zeros(len(lp.cost)), lp.ub),
               constraints=constraints,
               options={"node_limit": max(0, int(node_limit)), "time_limit": max(0.01, float(time_limit)),
                        "mip_rel_gap": MIP_GAP, "presolve": True})
    nodes = int(getattr(res, "mip_node_count", 0) or 0)
    stats = {"mip_status": int(res.status), "mip_nodes": nodes}
    x, cost = None, math.inf
    if res.x is not None:
        x = lp.assignment(res.x)
        cost = evaluate(flat, x)
        if not math.isfinite(cost):  # rounded off HiGHS's tolerances into a forbidden pair or over memory
            x = None
    bound = -math.inf
    dual = getattr(res, "mip_dual_bound", None)
    if dual is not None and math.isfinite(dual):
        bound = lp.value(dual) - lp.margin(dual)
    if x is not None and res.status == 0:
        return MipResult(x, cost, cost, "optimal", nodes, stats)
    return MipResult(x, cost, min(bound, cost), "feasible" if x is not None else "unknown", nodes, stats)
