r"""The whole problem over groups, memory exact: one CP-SAT model where functional edges leave few choices.

Functional edges (one node's strategy fixes another's) tie nodes into
components that change together (``moves.GroupMoves``: a group and its
valid joint assignments, *configs*). On IOPDDL P, 116 such components cover
almost all of its 42,898 decisions: the problem over groups
(``moves.quotient``) has 190 nodes with a choice, 718 configs among them,
and 338 edges. Its memory-free optimum is far over the limit, and every
neighbourhood of up to 25 whole groups around the costliest is already
optimal at the incumbent; yet over all the groups at once, memory exact,
one solve moves 68 groups together (about 22,000 nodes) and gains 1.6%.

The model: a boolean ``b[g, k]`` per config of each group with a choice,
exactly one per group; the costs of ``quotient`` (held groups folded in);
and per binding memory segment ``t``

    sum_{g, k} (use_{g,k}(t) - use_{g,cur}(t)) b[g, k] <= cap_t - use(x)(t)

where ``use_{g,k}(t)`` sums the usage of ``g``'s members live at ``t`` in
config ``k``. These rows come in lazily (on P every one of the 35,070
binding segments could be overfilled, 22,936 of them with distinct rows):
the first round solves without them, and each round adds the rows of the
segments its answer overfills, until an answer fits. The model is the whole
problem, so with usages in whole bytes CP-SAT's bound on any round is a
certified bound (on P, 2e-8 below the cost it finds).
"""

from __future__ import annotations

import math
import time

import numpy as np

from shardsolve.encodings import cpsat, moves
from shardsolve.encodings.flat import CHARGE_PER_ITEM, Flat, evaluate, profile, subproblem, tolerance

__all__ = ["solve_grouped", "GROUPED_MAX_CONFIGS", "GROUPED_ROUNDS", "GROUPED_ROWS_PER_ROUND"]

#: The model is built only with at most this many configs over the groups with a choice ...
GROUPED_MAX_CONFIGS = 5000
#: Rounds of lazily added memory rows, and the rows a round adds at most.
GROUPED_ROUNDS = 40
GROUPED_ROWS_PER_ROUND = 50


def _usage_changes(gm: moves.GroupMoves, x: np.ndarray, free: np.ndarray) -> tuple[list[np.ndarray], float]:
    """Per group of ``free``: its usage change from ``x`` at each binding segment in each of its configs
    ([configs, binding segments], whole bytes), and the work."""
    flat = gm.flat
    horizon = len(flat.capacity)
    binding = np.asarray(flat.binding, dtype=np.int64)
    usage = np.ceil(gm.usages - 1e-9)  # integral bytes (the limit is checked exactly on the way back)
    current = usage[gm.offsets + x]
    work = CHARGE_PER_ITEM * (flat.n + len(gm.ent_cfg))
    out: list[np.ndarray] = []
    for g in free:
        first, count = int(gm.cfg_start[g]), int(gm.ncfg[g])
        if gm.group_size[g] > 1:
            ents = np.flatnonzero((gm.ent_cfg >= first) & (gm.ent_cfg < first + count))
            cfg, nodes, slots = gm.ent_cfg[ents] - first, gm.ent_node[ents], gm.ent_slot[ents]
        else:  # a single node: its strategies are its configs
            node = int(np.flatnonzero(gm.group_of == g)[0])
            cfg, nodes = np.arange(count), np.full(count, node)
            slots = gm.offsets[node] + cfg
        change = usage[slots] - current[nodes]
        keep = (change != 0) & (flat.seg_end[nodes] > flat.seg_start[nodes])
        delta = np.zeros((count, horizon + 1))
        np.add.at(delta, (cfg[keep], flat.seg_start[nodes[keep]]), change[keep])
        np.add.at(delta, (cfg[keep], flat.seg_end[nodes[keep]]), -change[keep])
        out.append(np.cumsum(delta, axis=1)[:, binding])
        work += 3 * moves.CHARGE_PER_ENTRY * count * horizon  # vectorised: the add, the sum, the gather
    return out, work


def solve_grouped(gm: moves.GroupMoves, x: np.ndarray, *, limit: float, budget: float, seed: int = 0,
                  wall_limit: float | None = None) -> tuple[np.ndarray, float, float, float]:
    """CP-SAT over every group with a choice at once, memory exact, from ``x`` (valid); returns (assignment,
    cost, certified lower bound of the whole problem or -inf, work). Each round's model relaxes the memory
    rows left out, so CP-SAT's bound on it bounds the problem, where usages are whole bytes (else the rows,
    rounded up, are tighter than the limit and no bound is claimed). ``limit``: CP-SAT's deterministic time of each round. Where the model is
    too large (``GROUPED_MAX_CONFIGS``) or nothing better is found, ``x`` comes back. ``budget``: the work
    after which no further round starts.

    Memory rows are added lazily: each round solves the model with the rows so far, and the segments its
    answer overfills add their rows (``GROUPED_ROWS_PER_ROUND`` at most, the most overfilled first), until an
    answer fits, a round proves nothing fitting beats ``x``, or ``GROUPED_ROUNDS`` rounds are done.
    """
    flat = gm.flat
    started = time.perf_counter()
    cost = evaluate(flat, x)
    choice = gm.ncfg[gm.ncfg > 1]
    if not len(choice) or int(choice.sum()) > GROUPED_MAX_CONFIGS:
        return x, cost, -math.inf, 0.0
    q_flat, q = moves.quotient(gm, x)
    work = CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    counts = np.array([len(c) for c in q_flat.costs], dtype=np.int64)
    free = np.flatnonzero(counts > 1)
    if (q < 0).any():
        return x, cost, -math.inf, work
    changes, more = _usage_changes(gm, x, free) if len(flat.capacity) else ([], 0.0)
    work += more
    binding = np.asarray(flat.binding, dtype=np.int64)
    slack = flat.capacity[binding] - profile(flat, x)[binding] if len(flat.capacity) else np.zeros(0)
    tol = tolerance(flat)
    sub: Flat = subproblem(q_flat, free, q)
    work += CHARGE_PER_ITEM * (len(q_flat.tables) + len(free))
    rows: list[int] = []  # binding segment indices whose rows are in the model
    have = np.zeros(len(binding), dtype=bool)
    hint = q[free]
    hint_cost = evaluate(sub, hint)
    held = cost - hint_cost  # the held groups' cost, outside the model
    exact = bool(np.all(gm.usages == np.round(gm.usages)))
    bound = -math.inf
    for round_ in range(GROUPED_ROUNDS):
        if work + limit > budget:
            break
        if rows:
            idx = np.array(rows)
            coef = np.concatenate([c[:, idx] for c in changes], axis=0).T
            rhs = np.floor(slack[idx] + tol)
        else:
            coef, rhs = np.zeros((0, int(counts[free].sum()))), np.zeros(0)
        left = None if wall_limit is None else max(0.0, wall_limit - (time.perf_counter() - started))
        y, after, optimal, used, low = cpsat.solve_with_rows(sub, hint, coef.astype(np.int64),
                                                             rhs.astype(np.int64), limit, seed + round_, left)
        work += used + CHARGE_PER_ITEM * (len(binding) + coef.size)
        if exact and math.isfinite(low):
            bound = max(bound, low + held - 1e-12 * abs(cost))
        if y is None or (optimal and after >= hint_cost - 1e-9 * max(1.0, abs(after))):
            break  # nothing beats x, even with memory partly relaxed
        change = sum(c[k] for c, k in zip(changes, y)) if changes else np.zeros(0)
        over = change - slack - tol
        bad = np.flatnonzero((over > 0) & ~have)
        if not len(bad):  # it fits
            qq = q.copy()
            qq[free] = y
            z = gm.lift(qq)
            found = evaluate(flat, z)  # checked exactly
            work += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
            if math.isfinite(found) and found < cost:
                return z, found, bound, work
            break
        bad = bad[np.argsort(-over[bad], kind="stable")[:GROUPED_ROWS_PER_ROUND]]
        have[bad] = True
        rows.extend(int(b) for b in bad)
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
    return x, cost, bound, work
