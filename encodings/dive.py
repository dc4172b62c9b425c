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

``block_bound`` does the same block by block, for a bound: where the gap is
spread over many copies of one loose spot (each layer's split, in a problem
whose layers are not tied), one branching moves the bound by one copy's
share. The spots are grown into disjoint blocks, each block's own terms
bounded by branching on its centre, every term outside the blocks at its
least; it is part of the untied bound of tying (``tying.untied_bound``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from shardsolve.encodings import bounds, heuristics
from shardsolve.encodings.flat import Flat, evaluate, evaluation_charge

__all__ = ["Dive", "dive", "gap_node", "gap_shares", "fixed", "reparametrised", "held_bounds", "blocks_around",
           "block_flat", "block_bound"]

#: Passes that rank every branch by its bound, and passes for each of at most ``DEEP_BRANCHES`` branches of
#: least bound, an assignment read off every ``DECODE_EVERY`` passes (on the pod-mesh GPT-2 problem the branch of
#: least bound reads off an assignment 10% below the incumbent after 800 passes; after 400, the best read off in
#: two branches is 2% below it).
RANK_PASSES = 16
DEEP_PASSES = 800
DEEP_BRANCHES = 3
DECODE_EVERY = 16
#: ICM sweeps over each assignment read off (as ``portfolio.Portfolio.trws_probe`` polishes its own).
ICM_SWEEPS = 3


@dataclass
class Dive:
    """What one dive found: a bound of the problem (TRW-S's own where not every branch was bounded), the best
    valid assignment read off (None: none valid) and its cost, the deterministic work spent, and stats."""

    bound: float = -math.inf
    x: np.ndarray | None = None
    cost: float = math.inf
    work: float = 0.0
    stats: dict = field(default_factory=dict)


def gap_shares(flat: Flat, node_terms, edge_terms, x: np.ndarray) -> np.ndarray:
    """Each node's share of ``x``'s gap under TRW-S's reparametrised terms: its own term above its least, and
    half of each incident edge's (0 for a node with one allowed strategy, which no branching splits)."""
    choice = np.array([int(np.isfinite(c).sum()) > 1 for c in flat.costs])
    share = np.zeros(flat.n)
    for i in np.flatnonzero(choice):
        share[i] = node_terms[i][x[i]] - node_terms[i].min()
    for e, t in enumerate(edge_terms):
        u, v = int(flat.eu[e]), int(flat.ev[e])
        half = 0.5 * (t[x[u], x[v]] - t.min())
        share[u] += half
        share[v] += half
    share[~choice] = 0.0
    return share


def gap_node(flat: Flat, node_terms, edge_terms, x: np.ndarray) -> int | None:
    """The node with a choice that holds the largest share of ``x``'s gap (``gap_shares``); None where none
    holds any."""
    share = gap_shares(flat, node_terms, edge_terms, x)
    i = int(np.argmax(share))
    return i if share[i] > 0 else None


def reparametrised(flat: Flat, node_terms, edge_terms) -> Flat:
    """``flat`` with TRW-S's reparametrised terms as its costs (forbidden entries kept forbidden): every valid
    assignment costs the same, and TRW-S's passes over it start where the ones that made the terms ended."""
    return dataclasses.replace(
        flat,
        costs=tuple(np.where(np.isfinite(c), t, np.inf) for c, t in zip(flat.costs, node_terms)),
        tables=tuple(np.where(np.isfinite(c), t, np.inf) for c, t in zip(flat.tables, edge_terms)),
    )


def fixed(flat: Flat, i: int, s: int) -> Flat:
    """``flat`` with node ``i`` held to strategy ``s`` (its other strategies forbidden)."""
    costs = list(flat.costs)
    c = np.full_like(costs[i], np.inf)
    c[s] = costs[i][s]
    costs[i] = c
    return dataclasses.replace(flat, costs=tuple(costs))


def held_bounds(flat: Flat, setup: bounds.TrwsSetup, i: int, strategies, passes: int, target: float,
                left: Callable[[], float | None] = lambda: None) -> tuple[dict[int, float], int]:
    """TRW-S's bound of ``flat`` with node ``i`` held to each of ``strategies`` in turn: ``passes`` passes each
    over ``setup`` (``TrwsSetup.held``; ``setup`` is ``flat``'s), stopping once a bound reaches ``target``.
    ``left()``: the wall-clock seconds left (None: no net); once it is 0 the strategies after are left out.
    Returns the bounds of those run and the passes run in all."""
    found: dict[int, float] = {}
    ran: list = []
    for s in strategies:
        if left() == 0.0:
            break
        found[s], _, _ = bounds.trws_bound(fixed(flat, i, s), passes, target=target, wall_limit=left(), ran=ran,
                                           terms=False, setup=setup.held(i, s))
    return found, sum(ran)


def dive(flat: Flat, node_terms, edge_terms, lower: float, x: np.ndarray, cost: float, budget: float,
         wall_limit: float | None = None) -> Dive | None:
    """Branch on ``gap_node`` of the incumbent ``x`` (of cost ``cost``), given TRW-S's ``lower`` bound and terms.

    Every branch that may hold a cheaper assignment gets ``RANK_PASSES`` passes over the terms, where the passes
    that made them left off (stopping once its bound reaches ``cost``: no cheaper assignment there); then the
    branches of least bound get ``DEEP_PASSES`` passes each, from scratch, with assignments read off, each
    polished by ICM on the whole problem: the first whatever the budget leaves, up to ``DEEP_BRANCHES`` in all
    while it covers their full passes. (Deep passes from the terms read off assignments near the incumbent: the
    pod-mesh GPT-2 planned 4.02 ms so, 3.86 ms with them from scratch.)
    None where there is no gap node or the ranking passes alone would charge more than ``budget``.
    ``wall_limit`` (seconds from the call) is a safety net: past it the passes stop, and where a branch was
    left unbounded the bound is ``lower``.
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
    # The ranking passes start from the terms (``reparametrised``; from scratch, 16 passes bound a branch far
    # below ``lower``: the pod-mesh Llama's 38 branches then bounded nothing), over one setup whose node costs
    # are copied for each branch (``TrwsSetup.held``); a branch has the problem's sizes, which the charges read.
    setup_charge, rank = bounds.trws_charge(flat, 0), RANK_PASSES * bounds.trws_pass_charge(flat)
    if not branches or setup_charge + rank * len(branches) > budget:
        return None
    out = Dive(stats={"dive_node": i, "dive_branches": len(branches)})
    warm = reparametrised(flat, node_terms, edge_terms)
    setup = bounds.TrwsSetup.of(warm)
    out.work += setup_charge
    found, ran = held_bounds(warm, setup, i, branches, RANK_PASSES, cost, left)
    out.work += ran * bounds.trws_pass_charge(flat)
    found = {s: lb - 1e-10 * abs(lb) for s, lb in found.items()}  # floating-point margin, as the probe's
    open_ = sorted((b, s) for s, b in found.items() if b < cost)
    polish = ICM_SWEEPS * evaluation_charge(flat)
    per_pass = bounds.trws_pass_charge(flat) + bounds.trws_decode_charge(flat) / DECODE_EVERY
    cold = None  # the deep branches' setup, of the problem itself: their passes start from scratch
    for k, (b, s) in enumerate(open_[:DEEP_BRANCHES]):
        passes = int(min(DEEP_PASSES, (budget - out.work - polish - (setup_charge if cold is None else 0.0))
                         / per_pass))
        if passes < (DECODE_EVERY if k == 0 else DEEP_PASSES) or left() == 0.0:
            break  # the first branch takes what is left; a further one only its full passes
        if cold is None:
            cold = bounds.TrwsSetup.of(flat)
            out.work += setup_charge
        decoded: list = []
        ran = []
        lb, _, _ = bounds.trws_bound(fixed(flat, i, s), passes, target=cost, decoded=decoded,
                                     decode_every=DECODE_EVERY, wall_limit=left(), ran=ran, terms=False,
                                     setup=cold.held(i, s))
        out.work += ran[0] * per_pass + polish  # (``per_pass`` holds its share of the assignments read off)
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


#: ``block_bound``: blocks grow this many hops around each centre, to at most this many nodes; each branch of a
#: centre gets this many passes; a centre holds at least this share of the gap. On the pod-mesh GPT-2's untied
#: problem (1,343 nodes, TRW-S 3.655 ms against a plan of 4.047): 13 blocks around the query/key/value splits;
#: radius 2 bounds 3.743 ms, 3 3.811, 5 3.881 (CP-SAT finds each block's own least value equal to its branches'
#: bound); 16 passes a branch bound as much as 100, at half the work; contiguous windows of 40 nodes 3.862.
BLOCK_RADIUS = 5
BLOCK_NODES = 120
BLOCK_PASSES = 16
BLOCK_LEAST_SHARE = 1e-3


def blocks_around(flat: Flat, share: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Disjoint blocks, each grown ``BLOCK_RADIUS`` hops (at most ``BLOCK_NODES`` nodes) around a centre, centres
    taken by decreasing ``share`` while it is at least ``BLOCK_LEAST_SHARE`` of the whole: each node's block
    (-1: none) and the centres in block order."""
    block = np.full(flat.n, -1, dtype=np.int64)
    centres: list[int] = []
    least = BLOCK_LEAST_SHARE * float(share.sum())
    for i in np.argsort(-share, kind="stable"):
        if share[i] <= least or share[i] <= 0:
            break
        if block[i] >= 0:
            continue
        b = len(centres)
        block[i] = b
        members, frontier = 1, [int(i)]
        for _ in range(BLOCK_RADIUS):
            grown = []
            for j in frontier:
                for _, k, _ in flat.adj[j]:
                    if block[k] < 0 and members < BLOCK_NODES:
                        block[k] = b
                        members += 1
                        grown.append(k)
            frontier = grown
        centres.append(int(i))
    return block, centres


def block_flat(flat: Flat, idx: np.ndarray, edges: list[int], node_terms, edge_terms) -> Flat:
    """The nodes ``idx`` and the ``edges`` between them, as a problem of their own over the reparametrised
    terms (memory left out)."""
    pos = {int(i): k for k, i in enumerate(idx)}
    eu = np.array([pos[int(flat.eu[e])] for e in edges], dtype=np.int64)
    ev = np.array([pos[int(flat.ev[e])] for e in edges], dtype=np.int64)
    adj: list[list[tuple[int, int, bool]]] = [[] for _ in idx]
    for k in range(len(edges)):
        adj[eu[k]].append((k, int(ev[k]), True))
        adj[ev[k]].append((k, int(eu[k]), False))
    costs = tuple(np.asarray(node_terms[int(i)], dtype=float) for i in idx)
    none = np.zeros(len(idx), dtype=np.int64)
    return Flat(costs, tuple(np.zeros(len(c)) for c in costs), eu, ev, tuple(edge_terms[e] for e in edges),
                tuple(tuple(a) for a in adj), None, none, none.copy(), np.zeros(0), ())


def block_bound(flat: Flat, node_terms, edge_terms, x: np.ndarray, budget: float,
                wall_limit: float | None = None) -> tuple[float, float, dict]:
    """A bound of ``flat`` from TRW-S's reparametrised terms, at least the sum of their least values.

    Every assignment costs the sum of the terms. The nodes holding ``x``'s gap (``gap_shares``) are grown into
    disjoint blocks (``blocks_around``); a block's own terms (its nodes and the edges inside it) are bounded
    by holding its centre to each strategy in turn, ``BLOCK_PASSES`` passes each (as ``dive`` branches the
    whole problem), the least of those, and at most their value at ``x``; every other term at its least.
    Blocks run in order while ``budget`` covers their branches; those left count their terms' least values, so
    the bound is valid wherever it stops. ``wall_limit``: seconds from the call, a safety net.

    Returns (bound, work, stats).
    """
    started = time.perf_counter()
    block, centres = blocks_around(flat, gap_shares(flat, node_terms, edge_terms, x))
    inside: list[list[int]] = [[] for _ in centres]
    bound = 0.0
    for e, t in enumerate(edge_terms):
        b = block[flat.eu[e]]
        if b >= 0 and b == block[flat.ev[e]]:
            inside[b].append(e)
        else:
            bound += float(t.min())
    bound += sum(float(node_terms[i].min()) for i in np.flatnonzero(block < 0))
    work, done = 0.0, 0
    for b, centre in enumerate(centres):
        idx = np.flatnonzero(block == b)
        sub = block_flat(flat, idx, inside[b], node_terms, edge_terms)
        least = sum(float(c.min()) for c in sub.costs) + sum(float(t.min()) for t in sub.tables)
        k = int(np.searchsorted(idx, centre))
        at_x = evaluate(sub, x[idx])
        # a branch whose centre's own term lifts the block's least values to its value at ``x`` is not run
        slack = sub.costs[k] - sub.costs[k].min()
        branches = [s for s in range(len(sub.costs[k])) if least + slack[s] < at_x]
        late = wall_limit is not None and time.perf_counter() - started > wall_limit
        setup_charge, per_branch = bounds.trws_charge(sub, 0), BLOCK_PASSES * bounds.trws_pass_charge(sub)
        if late or work + setup_charge + len(branches) * per_branch > budget:
            bound += least
            continue
        setup = bounds.TrwsSetup.of(sub)  # once a block, its node costs copied a branch (``TrwsSetup.held``)
        found, ran = held_bounds(sub, setup, k, branches, BLOCK_PASSES, at_x)
        work += setup_charge + ran * bounds.trws_pass_charge(sub)
        bound += max(least, min(min(found.values(), default=math.inf), at_x))
        done += 1
    return bound, work, {"block_count": len(centres), "blocks_bounded": done}
