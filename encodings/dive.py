"""Branching on the node the LP relaxation leaves least decided: a bound and starts the search does not reach.

TRW-S (``bounds.trws_bound``) writes every assignment's cost as its bound plus
non-negative node and edge terms. At the incumbent those terms add up to the
gap, and on a problem whose LP is loose they gather at a few nodes: a planner
problem on a three-axis pod mesh (GPT-2, 2,048 devices) puts 45% of a 19% gap
on the two edges out of the reshape that splits attention's fused
query/key/value projection, where the LP mixes strategies that no single plan
can take at once.

Fixing that node to each of its strategies in turn gives sub-problems whose
LPs are much tighter. Every assignment lies in one branch, so the least of
the branches' bounds bounds the problem (a strategy whose own term exceeds the
gap is in no cheaper assignment, and its branch is not run). The branches
with the least bounds are then searched further by TRW-S alone, an assignment
read off its messages at each bound check: a change of many nodes at once (all
of attention moved from one mesh axis to another), which one-node moves and
small neighbourhoods do not find from the incumbent.

``dive`` spends a deterministic budget (``bounds.trws_charge`` of each
branch's passes); it is ``portfolio.Portfolio.dive``'s phase.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from shardsolve.encodings import bounds, heuristics
from shardsolve.encodings.flat import Flat, evaluate, evaluation_charge

__all__ = ["Dive", "dive", "gap_node", "fixed"]

#: Passes that rank every branch by its bound, and passes for each of at most ``DEEP_BRANCHES`` branches of
#: least bound, an assignment read off every ``DECODE_EVERY`` passes (on the pod-mesh GPT-2 problem the branch of
#: least bound reads off an assignment 10% below the incumbent after 800 passes, none better after 400).
RANK_PASSES = 16
DEEP_PASSES = 800
DEEP_BRANCHES = 3
DECODE_EVERY = 16
#: ICM sweeps over each assignment read off (as ``portfolio.Portfolio.trws_probe`` polishes its own).
ICM_SWEEPS = 3


@dataclass
class Dive:
    """What one dive found: a bound of the problem (``-inf`` where not every branch was bounded), the best valid
    assignment read off (None: none valid) and its cost, the deterministic work spent, and stats."""

    bound: float = -math.inf
    x: np.ndarray | None = None
    cost: float = math.inf
    work: float = 0.0
    stats: dict = field(default_factory=dict)


def gap_node(flat: Flat, node_terms, edge_terms, x: np.ndarray) -> int | None:
    """The node with a choice that holds the largest share of ``x``'s gap under TRW-S's reparametrised terms
    (its own term above its least, and half of each incident edge's); None where no node holds any."""
    share = np.zeros(flat.n)
    for i in range(flat.n):
        if len(flat.costs[i]) > 1:
            share[i] = node_terms[i][x[i]] - node_terms[i].min()
    for e, t in enumerate(edge_terms):
        u, v = int(flat.eu[e]), int(flat.ev[e])
        half = 0.5 * (t[x[u], x[v]] - t.min())
        if len(flat.costs[u]) > 1:
            share[u] += half
        if len(flat.costs[v]) > 1:
            share[v] += half
    i = int(np.argmax(share))
    return i if share[i] > 0 else None


def fixed(flat: Flat, i: int, s: int) -> Flat:
    """``flat`` with node ``i`` held to strategy ``s`` (its other strategies forbidden)."""
    costs = list(flat.costs)
    c = np.full_like(costs[i], np.inf)
    c[s] = costs[i][s]
    costs[i] = c
    return dataclasses.replace(flat, costs=tuple(costs))


def dive(flat: Flat, node_terms, edge_terms, lower: float, x: np.ndarray, cost: float, budget: float,
         wall_limit: float | None = None) -> Dive | None:
    """Branch on ``gap_node`` of the incumbent ``x`` (of cost ``cost``), given TRW-S's ``lower`` bound and terms.

    Every branch that may hold a cheaper assignment gets ``RANK_PASSES`` passes (stopping once its bound
    reaches ``cost``: no cheaper assignment there); then the branches of least bound get ``DEEP_PASSES``
    passes each, from scratch, with assignments read off, each polished by ICM on the whole problem: the
    first whatever the budget leaves, up to ``DEEP_BRANCHES`` in all while it covers their full passes.
    None where there is no gap node or the ranking passes alone would charge more than ``budget``. ``wall_limit`` (seconds from the call) is a safety net: past it the
    passes stop, and where a branch was left unbounded the bound is ``lower``.
    """
    started = time.perf_counter()

    def left() -> float | None:
        return None if wall_limit is None else max(0.0, wall_limit - (time.perf_counter() - started))

    i = gap_node(flat, node_terms, edge_terms, x)
    if i is None:
        return None
    gap = cost - lower
    slack = node_terms[i] - node_terms[i].min()
    branches = [s for s in range(len(flat.costs[i]))
                if math.isfinite(flat.costs[i][s]) and slack[s] <= gap + 1e-9 * abs(cost)]
    sample = fixed(flat, i, branches[0]) if branches else flat
    rank = bounds.trws_charge(sample, RANK_PASSES)
    if not branches or rank * len(branches) > budget:
        return None
    out = Dive(stats={"dive_node": i, "dive_branches": len(branches)})
    found: dict[int, float] = {}
    for s in branches:
        if left() == 0.0:
            break
        ran: list = []
        lb, _, _ = bounds.trws_bound(fixed(flat, i, s), RANK_PASSES, target=cost, wall_limit=left(), ran=ran,
                                     terms=False)
        out.work += bounds.trws_charge(sample, ran[0])
        found[s] = lb - 1e-10 * abs(lb)  # floating-point margin, as the probe's
    open_ = sorted((b, s) for s, b in found.items() if b < cost)
    polish = ICM_SWEEPS * evaluation_charge(flat)
    per_pass = bounds.trws_pass_charge(sample) + bounds.trws_decode_charge(sample) / DECODE_EVERY
    for k, (b, s) in enumerate(open_[:DEEP_BRANCHES]):
        passes = int(min(DEEP_PASSES, (budget - out.work - polish) / per_pass))
        if passes < (DECODE_EVERY if k == 0 else DEEP_PASSES) or left() == 0.0:
            break  # the first branch takes what is left; a further one only its full passes
        decoded: list = []
        ran = []
        lb, _, _ = bounds.trws_bound(fixed(flat, i, s), passes, target=cost, decoded=decoded,
                                     decode_every=DECODE_EVERY, wall_limit=left(), ran=ran, terms=False)
        out.work += bounds.trws_charge(sample, ran[0], -(-ran[0] // DECODE_EVERY)) + polish
        found[s] = max(found[s], lb - 1e-10 * abs(lb))
        y = decoded[0]
        c = evaluate(flat, y)
        if math.isfinite(c):
            y = heuristics.icm(flat, y, sweeps=ICM_SWEEPS)
            c = evaluate(flat, y)
            if c < out.cost:
                out.x, out.cost = y, c
    # every assignment cheaper than ``cost`` lies in a branch run: the least of their bounds bounds the problem
    out.bound = max(lower, min(min(found.values()), cost)) if len(found) == len(branches) else lower
    out.stats["dive_bound"] = out.bound
    return out
