r"""Vectorised group moves: every node, or every small component, moves to its best choice at once.

A *group* is one node, or one small component of forbidden-bearing edges
(``search.forbidden_components``) whose valid joint assignments (*configs*)
were enumerated once: functional edges (one node's strategy fixes
another's) make such a component change all together or not at all, which
one-node moves never manage. A round of ``GroupMoves.descend``::

    ext[i, s]   = c_i[s] + sum_{external edges (i, j)} C_ij[s, x_j]        (two bincounts)
    cost[g, k]  = sum_{m in g} ext[m, k_m] + internal_g[k]                  (one bincount)
    room[g]     = least free capacity over the hull of g's intervals        (a sparse range-minimum table)
    allowed     = configs whose summed usage increases fit room[g]
    gain[g]     = cost[g, current] - min_k allowed cost[g, k]

Groups that gain and beat every gaining neighbour group (larger gain, ties to
the lower index) move together: no two movers share an edge, so the cost
falls by exactly the sum of their gains. Memory is checked exactly on the
moved profile; movers that raise usage in a segment left over capacity move
back (all but the best when none would be left: alone it fits), so every
round keeps the assignment valid. No Python loop runs per node in a round;
the work is charged per entry touched, so the result does not depend on the
clock.

Worked example: nodes ``a`` and ``b`` joined by an edge that allows only
``(0, 0)`` and ``(1, 1)`` form one group with configs ``[[0, 0], [1, 1]]``;
``a`` alone could never leave strategy 0 (every other pair is forbidden),
the group moves both to 1 when that is cheaper.
"""

from __future__ import annotations

import numpy as np

import time
from dataclasses import replace

from shardsolve.encodings.flat import (CHARGE_PER_ITEM, INF, Flat, edge_reads, evaluate, evaluation_charge, profile,
                                       tolerance)

__all__ = ["GroupMoves", "priced_descent", "quotient", "GROUP_MAX_NODES", "GROUP_MAX_CONFIGS", "PRICES"]

#: A component of forbidden-bearing edges becomes one group up to this many nodes ...
GROUP_MAX_NODES = 20_000
#: ... and this many valid joint assignments (else its nodes move one by one).
GROUP_MAX_CONFIGS = 512
#: Deterministic charge (seconds) per strategy, config entry and table-row entry touched by one round.
CHARGE_PER_ENTRY = 1e-8
#: ``priced_descent``: the price on usage where memory binds, as factors of the blocked gain per byte.
PRICES = tuple(2.0 * 0.7**k for k in range(12)) + (0.0,)
#: ``GroupMoves`` is not built when the edge tables hold more entries than this.
MOVES_MAX_ENTRIES = 60_000_000
#: ``GroupMoves.pair_round`` scores about this many pair entries at a time.
PAIR_CHUNK = 1 << 18


def _configs(flat: Flat, members: np.ndarray, internal: list[int]) -> np.ndarray | None:
    """Every valid joint assignment of ``members`` (rows; columns in ``members`` order), or None if too many."""
    by_node: dict[int, list[int]] = {int(m): [] for m in members}
    for e in internal:
        by_node[int(flat.eu[e])].append(e)
        by_node[int(flat.ev[e])].append(e)
    # breadth-first order along the internal edges, so that each node meets its constraints early
    seen, order = {int(members[0])}, [int(members[0])]
    for m in members:
        if int(m) not in seen:
            seen.add(int(m))
            order.append(int(m))
        head = len(order) - 1
        while head < len(order):
            i = order[head]
            head += 1
            for e in by_node[i]:
                j = int(flat.ev[e]) if int(flat.eu[e]) == i else int(flat.eu[e])
                if j not in seen:
                    seen.add(j)
                    order.append(j)
    pos = {m: k for k, m in enumerate(order)}
    rows = np.zeros((1, 0), dtype=np.int64)
    done: list[int] = []
    for m in order:
        options = np.flatnonzero(np.isfinite(flat.costs[m]))
        rows = np.concatenate([np.repeat(rows, len(options), axis=0), np.tile(options, len(rows))[:, None]], axis=1)
        col = len(done)
        done.append(m)
        keep = np.ones(len(rows), dtype=bool)
        for e in by_node[m]:
            u, v = int(flat.eu[e]), int(flat.ev[e])
            other = v if u == m else u
            if other not in pos or pos[other] >= col:
                continue
            a, b = (rows[:, col], rows[:, pos[other]]) if u == m else (rows[:, pos[other]], rows[:, col])
            keep &= np.isfinite(flat.tables[e][a, b])
        rows = rows[keep]
        if len(rows) > GROUP_MAX_CONFIGS or not len(rows):
            return None
    return rows[:, [pos[int(m)] for m in members]]


def _build_charge(items: int, pair_entries: int) -> float:
    """``GroupMoves``' build: a Python pass over nodes and edges (8.5 us a node or edge measured on IOPDDL K, P and
    S, a build with its components' configs), and the pair entries' index arrays (30 to 300 ns an entry)."""
    return CHARGE_PER_ITEM * items + 15 * CHARGE_PER_ENTRY * pair_entries


class GroupMoves:
    """Rounds of simultaneous group moves (see the module docstring), built once per problem."""

    def __init__(self, flat: Flat, comp: np.ndarray | None = None):
        self.flat = flat
        self.extra: np.ndarray | None = None  # a cost added to every strategy during ``descend``
        n = flat.n
        sizes = np.array([len(c) for c in flat.costs], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.costs = np.concatenate(flat.costs) if n else np.zeros(0)
        self.usages = np.concatenate(flat.usages) if n else np.zeros(0)
        eu, ev = flat.eu.astype(np.int64), flat.ev.astype(np.int64)
        # groups: small components with their configs; every other node alone
        group_of = np.arange(n, dtype=np.int64)
        multi: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
        if comp is not None and n:
            counts = np.bincount(comp)
            small = (counts[comp] > 1) & (counts[comp] <= GROUP_MAX_NODES)
            same = small[eu] & (comp[eu] == comp[ev])
            order = np.argsort(comp, kind="stable")
            order = order[small[order]]
            internal_by: dict[int, list[int]] = {}
            for e in np.flatnonzero(same):
                internal_by.setdefault(int(comp[eu[e]]), []).append(int(e))
            if len(order):
                cuts = np.flatnonzero(np.diff(comp[order])) + 1
                for members in np.split(order, cuts):
                    internal = internal_by.get(int(comp[members[0]]), [])
                    rows = _configs(flat, members, internal)
                    if rows is not None and len(rows) > 1:
                        multi.append((members, rows, internal))
        internal_edge = np.zeros(len(eu), dtype=bool)
        # config arrays, group by group: singletons first (one config per strategy), then the components
        grouped = np.zeros(n, dtype=bool)
        for members, _, internal in multi:
            grouped[members] = True
            internal_edge[internal] = True
        singles = np.flatnonzero(~grouped)
        ngroups = len(singles) + len(multi)
        group_of[singles] = np.arange(len(singles))
        cfg_group = [np.repeat(np.arange(len(singles)), sizes[singles])]
        ent_slot = [np.flatnonzero(~grouped[np.repeat(np.arange(n), sizes)])]
        ent_cfg = [np.arange(len(ent_slot[0]))]
        cfg_internal = [np.zeros(len(ent_slot[0]))]
        n_cfg = len(ent_slot[0])
        for g, (members, rows, internal) in enumerate(multi, start=len(singles)):
            group_of[members] = g
            k = len(rows)
            cfg_group.append(np.full(k, g, dtype=np.int64))
            ent_slot.append((self.offsets[members][None, :] + rows).ravel())
            ent_cfg.append(np.repeat(np.arange(n_cfg, n_cfg + k), len(members)))
            col = {int(m): c for c, m in enumerate(members)}
            inside = np.zeros(k)
            for e in internal:
                inside += flat.tables[e][rows[:, col[int(eu[e])]], rows[:, col[int(ev[e])]]]
            cfg_internal.append(inside)
            n_cfg += k
        self.group_of = group_of
        self.ngroups = ngroups
        self.groups_multi = len(multi)
        self.cfg_group = np.concatenate(cfg_group).astype(np.int64)
        self.ent_slot = np.concatenate(ent_slot).astype(np.int64)
        self.ent_cfg = np.concatenate(ent_cfg).astype(np.int64)
        self.cfg_internal = np.concatenate(cfg_internal)
        self.slot_node = np.repeat(np.arange(n), sizes)
        self.ent_node = self.slot_node[self.ent_slot]
        self.cfg_start = np.concatenate([[0], np.flatnonzero(np.diff(self.cfg_group)) + 1]).astype(np.int64)
        self.group_size = np.bincount(group_of, minlength=ngroups)
        self.ent_start = np.concatenate([[0], np.flatnonzero(np.diff(self.ent_cfg)) + 1]).astype(np.int64)
        member_index = np.zeros(n, dtype=np.int64)
        for members, _, _ in multi:
            member_index[members] = np.arange(len(members))
        self.member_index = member_index
        self.ncfg = np.bincount(self.cfg_group, minlength=ngroups)
        # external edges, as in OneNodeMoves: entry (edge, row a) adds table[a, x_v] to strategy a of u
        ext = ~internal_edge
        self.internal_edge = internal_edge
        self.ext_u, self.ext_v = eu[ext], ev[ext]
        self.reads = edge_reads(eu, ev, sizes, self.offsets, flat.tables, np.flatnonzero(ext))
        self.table = self.reads.table
        su, sv = sizes[eu], sizes[ev]
        # memory: the hull of each group's intervals
        s0, s1 = flat.seg_start, flat.seg_end
        has = s1 > s0
        big = np.iinfo(np.int64).max
        lo = np.full(ngroups, big, dtype=np.int64)
        hi = np.full(ngroups, -1, dtype=np.int64)
        np.minimum.at(lo, group_of[has], s0[has])
        np.maximum.at(hi, group_of[has], s1[has])
        self.hull_has = hi > lo
        self.hull_lo, self.hull_hi = np.where(self.hull_has, lo, 0), np.where(self.hull_has, hi, 1)
        self.round_charge = CHARGE_PER_ENTRY * (len(self.costs) + 2 * len(self.ent_slot) + len(self.reads.u_target)
                                                + len(self.reads.v_target)) + CHARGE_PER_ITEM * 0.01 * (n + len(eu))

        # pair moves: edges between two single nodes with a choice each, every entry of their tables
        single = (self.group_size[group_of] == 1) & (sizes > 1)
        pair = np.flatnonzero(ext & single[eu] & single[ev])
        self.pair_edges = pair
        psu, psv = su[pair], sv[pair]
        count = psu * psv
        self.pair_start = np.concatenate([[0], np.cumsum(count)])[:-1].astype(np.int64)
        p_of = np.repeat(np.arange(len(pair)), count)
        local = np.arange(int(count.sum())) - np.repeat(self.pair_start, count)
        self.pe_pair = p_of
        self.pe_a = local // np.repeat(psv, count)
        self.pe_b = local % np.repeat(psv, count)
        self.pe_table = np.repeat(self.reads.start[pair], count) + local
        self.pair_u, self.pair_v = eu[pair], ev[pair]
        self.pair_sv = psv
        plo = np.full(len(pair), big, dtype=np.int64)
        phi = np.full(len(pair), -1, dtype=np.int64)
        for end in (self.pair_u, self.pair_v):
            live = s1[end] > s0[end]
            plo[live] = np.minimum(plo[live], s0[end][live])
            phi[live] = np.maximum(phi[live], s1[end][live])
        self.pair_has = phi > plo
        self.pair_lo, self.pair_hi = np.where(self.pair_has, plo, 0), np.where(self.pair_has, phi, 1)
        # a pair round takes 40 to 60 ns a pair entry (about twenty passes over them, a few edges at a time)
        self.pair_charge = CHARGE_PER_ENTRY * (len(self.costs) + 4 * len(self.pe_table) + len(self.reads.u_target)
                                               + len(self.reads.v_target)) + CHARGE_PER_ITEM * 0.01 * (n + len(eu))
        #: Deterministic charge of building this; ``most_build_charge`` bounds it before building.
        self.build_charge = _build_charge(n + len(eu), len(self.pe_table))

    def strategies_in_configs(self, node: int, group: int) -> np.ndarray:
        """The strategy ``node`` takes in each config of its ``group``."""
        first = self.ent_start[self.cfg_start[group]: self.cfg_start[group] + self.ncfg[group]]
        return self.ent_slot[first + self.member_index[node]] - self.offsets[node]

    def configs_of(self, x: np.ndarray) -> np.ndarray:
        """Per group, the index (within the group) of the config ``x`` takes (-1: none, ``x`` invalid there)."""
        cur_slot = self.offsets[self.ent_node] + x[self.ent_node]
        is_cur = np.bincount(self.ent_cfg, self.ent_slot == cur_slot, minlength=len(self.cfg_group))
        current = np.flatnonzero(is_cur == self.group_size[self.cfg_group])
        out = np.full(self.ngroups, -1, dtype=np.int64)
        out[self.cfg_group[current]] = current - self.cfg_start[self.cfg_group[current]]
        return out

    def lift(self, q: np.ndarray) -> np.ndarray:
        """The assignment of the problem's nodes from one config index per group."""
        chosen = np.zeros(len(self.cfg_group), dtype=bool)
        chosen[self.cfg_start + q] = True
        ents = np.flatnonzero(chosen[self.ent_cfg])
        x = np.zeros(self.flat.n, dtype=np.int64)
        x[self.ent_node[ents]] = self.ent_slot[ents] - self.offsets[self.ent_node[ents]]
        return x

    @staticmethod
    def fits(flat: Flat) -> bool:
        return sum(t.size for t in flat.tables) <= MOVES_MAX_ENTRIES

    @staticmethod
    def most_build_charge(flat: Flat) -> float:
        """An upper bound of ``build_charge`` before building (every table's entries counted as pair entries)."""
        return _build_charge(flat.n + len(flat.tables), sum(t.size for t in flat.tables))

    def external_costs(self, x: np.ndarray) -> np.ndarray:
        """Every strategy's node cost plus its external edges towards the neighbours' strategies in ``x``."""
        out = self.costs.copy() if self.extra is None else self.costs + self.extra
        return self.reads.add(out, x)

    def _range_min(self, free: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``min(free[lo:hi])`` for every pair (``hi > lo``), from a sparse table."""
        levels = [free]
        top = int((hi - lo).max(initial=1))
        while (1 << len(levels)) <= top:
            prev, step = levels[-1], 1 << (len(levels) - 1)
            levels.append(np.minimum(prev[:-step], prev[step:]))
        k = np.floor(np.log2(hi - lo)).astype(np.int64)
        out = np.empty(len(lo))
        for j in np.unique(k):
            sel = k == j
            out[sel] = np.minimum(levels[j][lo[sel]], levels[j][hi[sel] - (1 << j)])
        return out

    def descend(self, x: np.ndarray, rounds: int = 50, *, extra: np.ndarray | None = None,
                memory: bool = True, wall_limit: float | None = None) -> tuple[np.ndarray, int, float]:
        """Rounds of moves from a valid ``x``; returns (new assignment, rounds run, deterministic work).

        ``extra``: a cost added to every strategy (flat over nodes, as ``costs``), e.g. a price on
        usage; ``memory=False`` ignores the memory limit (the result may break it); ``wall_limit``:
        a wall-clock safety net, seconds from now.
        """
        self.extra = extra
        try:
            return self._descend(x, rounds, memory, None if wall_limit is None else time.perf_counter() + wall_limit)
        finally:
            self.extra = None

    def _descend(self, x: np.ndarray, rounds: int, memory: bool,
                 deadline: float | None) -> tuple[np.ndarray, int, float]:
        flat = self.flat
        x = np.asarray(x, dtype=np.int64).copy()
        tol = tolerance(flat)
        memory = memory and len(flat.capacity) > 0
        prof = profile(flat, x) if memory else np.zeros(0)
        spent, done = 0.0, 0
        ncfg = len(self.cfg_group)
        for done in range(1, rounds + 1):
            if deadline is not None and time.perf_counter() > deadline:
                break
            spent += self.round_charge
            ext = self.external_costs(x)
            cost = np.bincount(self.ent_cfg, ext[self.ent_slot], minlength=ncfg) + self.cfg_internal
            cur_slot = self.offsets[self.ent_node] + x[self.ent_node]
            is_cur = np.bincount(self.ent_cfg, self.ent_slot == cur_slot, minlength=ncfg)
            current = is_cur == self.group_size[self.cfg_group]
            allowed = cost
            delta = self.usages[self.ent_slot] - self.usages[cur_slot]
            if memory:
                rise = np.bincount(self.ent_cfg, np.maximum(delta, 0.0), minlength=ncfg)
                room = np.full(self.ngroups, INF)
                h = self.hull_has
                if h.any():
                    room[h] = self._range_min(flat.capacity - prof, self.hull_lo[h], self.hull_hi[h])
                allowed = np.where((rise <= tol) | (rise <= room[self.cfg_group] + tol), cost, INF)
            least = np.minimum.reduceat(allowed, self.cfg_start)
            now = np.full(self.ngroups, INF)
            now[self.cfg_group[current]] = cost[current]
            gain = now - least
            cand = (self.ncfg > 1) & np.isfinite(least) & np.isfinite(now) \
                & (gain > 1e-9 * np.maximum(1.0, np.abs(np.where(np.isfinite(now), now, 0.0))))
            if not cand.any():
                # a local optimum of group moves: two-node moves, then group moves again
                spent += self.pair_charge
                x, prof, moved = self.pair_round(x, prof, memory)
                if moved:
                    continue
                break
            gu, gv = self.group_of[self.ext_u], self.group_of[self.ext_v]
            both = cand[gu] & cand[gv] & (gu != gv)
            gu, gv = gu[both], gv[both]
            u_wins = (gain[gu] > gain[gv]) | ((gain[gu] == gain[gv]) & (gu < gv))
            beaten = np.zeros(self.ngroups, dtype=bool)
            beaten[gv[u_wins]] = True
            beaten[gu[~u_wins]] = True
            mover = cand & ~beaten
            hit = np.flatnonzero((allowed == least[self.cfg_group]) & mover[self.cfg_group])
            groups, first = np.unique(self.cfg_group[hit], return_index=True)
            chosen = np.zeros(ncfg, dtype=bool)
            chosen[hit[first]] = True
            ents = np.flatnonzero(chosen[self.ent_cfg])
            nodes = self.ent_node[ents]
            new = self.ent_slot[ents] - self.offsets[nodes]
            if memory:
                change = delta[ents]
                trial = _shifted_profile(flat, prof, nodes, change)
                over = trial > flat.capacity + tol
                if over.any():
                    count = np.concatenate([[0], np.cumsum(over)])
                    covers = (count[flat.seg_end[nodes]] - count[flat.seg_start[nodes]] > 0) & (change > 0)
                    bad = np.zeros(self.ngroups, dtype=bool)
                    bad[self.group_of[nodes[covers]]] = True
                    keep_group = mover & ~bad
                    if not keep_group.any():  # alone, the best of them fits (its room says so)
                        keep_group[groups[int(np.argmax(gain[groups]))]] = True
                    keep = keep_group[self.group_of[nodes]]
                    nodes, new, change = nodes[keep], new[keep], change[keep]
                    trial = _shifted_profile(flat, prof, nodes, change)
                prof = trial
            if not len(nodes):
                break
            x[nodes] = new
        return x, done, spent


    def pair_round(self, x: np.ndarray, prof: np.ndarray, memory: bool = True) -> tuple[np.ndarray, np.ndarray, bool]:
        """One round of two-node moves along the edges between single nodes; ``x`` and ``prof`` updated in place.

        Per edge ``(u, v)`` the joint cost of every pair ``(a, b)`` (both nodes' external costs without
        this edge, plus its entry), the best pair whose summed usage increase fits the room over both
        intervals; the edges that gain most at both ends and beat every adjacent such edge move.
        Returns (x, profile, whether anything moved).
        """
        flat = self.flat
        if not len(self.pair_edges):
            return x, prof, False
        tol = tolerance(flat)
        memory = memory and len(flat.capacity) > 0
        ext = self.external_costs(x)
        u, v = self.pair_u, self.pair_v
        room = np.full(len(u), INF)
        if memory and self.pair_has.any():
            room[self.pair_has] = self._range_min(flat.capacity - prof, self.pair_lo[self.pair_has],
                                                  self.pair_hi[self.pair_has])
        now, least = np.full(len(u), INF), np.empty(len(u))
        first = np.empty(len(u), dtype=np.int64)  # per edge, its first entry at ``least``
        du_first, dv_first = np.empty(len(u)), np.empty(len(u))
        # a few edges at a time: their entries' temporaries stay small (reused, not fresh memory each round)
        ends = np.concatenate([self.pair_start[1:], [len(self.pe_table)]])
        p0 = 0
        while p0 < len(u):
            p1 = max(p0 + 1, int(np.searchsorted(ends, self.pair_start[p0] + PAIR_CHUNK, side="right")))
            p1 = min(p1, len(u))
            self._pair_scores(x, ext, room, memory, tol, p0, p1, ends, now, least, first, du_first, dv_first)
            p0 = p1
        gain = now - least
        cand = np.flatnonzero(np.isfinite(least) & np.isfinite(now)
                              & (gain > 1e-9 * np.maximum(1.0, np.abs(np.where(np.isfinite(now), now, 0.0)))))
        if not len(cand):
            return x, prof, False
        # rank the candidates (best gain first, ties to the lower edge); each node's claim is its best rank
        order = cand[np.lexsort((cand, -gain[cand]))]
        rank = np.full(len(u), len(u), dtype=np.int64)
        rank[order] = np.arange(len(order))
        claim = np.full(flat.n, len(u), dtype=np.int64)
        np.minimum.at(claim, u[order], rank[order])
        np.minimum.at(claim, v[order], rank[order])
        sel = order[(claim[u[order]] == rank[order]) & (claim[v[order]] == rank[order])]
        # no two chosen edges adjacent: the worse-ranked of two touching ones stays
        owner = np.full(flat.n, -1, dtype=np.int64)
        owner[u[sel]] = rank[sel]
        owner[v[sel]] = rank[sel]
        ou, ov = owner[flat.eu], owner[flat.ev]
        clash = (ou >= 0) & (ov >= 0) & (ou != ov)
        lost = np.zeros(len(order), dtype=bool)
        lost[np.maximum(ou[clash], ov[clash])] = True
        sel = sel[~lost[rank[sel]]]
        pairs = np.sort(sel)
        best = first[pairs]
        nodes = np.concatenate([u[pairs], v[pairs]])
        new = np.concatenate([self.pe_a[best], self.pe_b[best]])
        if memory:
            change = np.concatenate([du_first[pairs], dv_first[pairs]])
            trial = _shifted_profile(flat, prof, nodes, change)
            over = trial > flat.capacity + tol
            if over.any():
                count = np.concatenate([[0], np.cumsum(over)])
                covers = (count[flat.seg_end[nodes]] - count[flat.seg_start[nodes]] > 0) & (change > 0)
                bad = covers[: len(pairs)] | covers[len(pairs):]
                if bad.all():  # alone, the best of them fits (its room says so)
                    bad[int(np.argmax(gain[pairs]))] = False
                keep = np.concatenate([~bad, ~bad])
                nodes, new, change = nodes[keep], new[keep], change[keep]
                trial = _shifted_profile(flat, prof, nodes, change)
            prof = trial
        if not len(nodes):
            return x, prof, False
        x[nodes] = new
        return x, prof, True

    def _pair_scores(self, x, ext, room, memory, tol, p0, p1, ends, now, least, first, du_first, dv_first) -> None:
        """``pair_round``'s scores of pair edges ``p0:p1`` into the per-edge arrays: the current joint cost
        (``now``), the least allowed one, the first entry at it and that entry's usage changes at both ends."""
        e0, e1 = int(self.pair_start[p0]), int(ends[p1 - 1])
        pe_pair = self.pe_pair[e0:e1]
        pe_a, pe_b, pe_table = self.pe_a[e0:e1], self.pe_b[e0:e1], self.pe_table[e0:e1]
        u, v = self.pair_u[pe_pair], self.pair_v[pe_pair]
        sv = self.pair_sv[pe_pair]
        toff_u = pe_table - pe_a * sv - pe_b  # start of each entry's table
        xu, xv = x[u], x[v]
        with np.errstate(invalid="ignore"):
            joint = ext[self.offsets[u] + pe_a] - self.table[toff_u + pe_a * sv + xv] \
                + ext[self.offsets[v] + pe_b] - self.table[toff_u + xu * sv + pe_b] \
                + self.table[pe_table]
        joint[np.isnan(joint)] = INF  # inf - inf: a row or column this edge forbids, never chosen
        is_cur = (pe_a == xu) & (pe_b == xv)
        now[pe_pair[is_cur]] = joint[is_cur]
        allowed = joint
        du = self.usages[self.offsets[u] + pe_a] - self.usages[self.offsets[u] + xu]
        dv = self.usages[self.offsets[v] + pe_b] - self.usages[self.offsets[v] + xv]
        if memory:
            rise = np.maximum(du, 0.0) + np.maximum(dv, 0.0)
            allowed = np.where((rise <= tol) | (rise <= room[pe_pair] + tol), joint, INF)
        starts = self.pair_start[p0:p1] - e0
        least[p0:p1] = np.minimum.reduceat(allowed, starts)
        hit = np.flatnonzero(allowed == least[pe_pair])
        edges, at = np.unique(pe_pair[hit], return_index=True)
        first[edges] = e0 + hit[at]
        du_first[edges], dv_first[edges] = du[hit[at]], dv[hit[at]]


def quotient(moves: GroupMoves, x: np.ndarray) -> tuple[Flat, np.ndarray]:
    """The problem over groups: one node per group, its configs as strategies, memory left out.

    A config's cost is its members' node costs plus its internal edges; the
    edges between two groups become one table over their configs (the sum of
    their entries). The current group configs of ``x`` (valid) come with it;
    ``moves.lift`` maps an assignment back. Without the memory limit, an
    assignment found here must be checked on the problem itself.
    """
    flat = moves.flat
    node_cost = np.bincount(moves.ent_cfg, moves.costs[moves.ent_slot], minlength=len(moves.cfg_group))
    node_cost = node_cost + moves.cfg_internal
    costs = tuple(np.split(node_cost, moves.cfg_start[1:]))
    gu, gv = moves.group_of[moves.ext_u], moves.group_of[moves.ext_v]
    cross = np.flatnonzero(gu != gv)
    tables: dict[tuple[int, int], np.ndarray] = {}
    edge_ids = np.flatnonzero(~moves.internal_edge)
    for k in cross:
        e = int(edge_ids[k])
        a, b = int(gu[k]), int(gv[k])
        rows, cols = moves.strategies_in_configs(int(flat.eu[e]), a), moves.strategies_in_configs(int(flat.ev[e]), b)
        t = flat.tables[e][np.ix_(rows, cols)]
        key = (a, b) if a < b else (b, a)
        t = t if a < b else t.T
        tables[key] = tables[key] + t if key in tables else t
    keys = sorted(tables)
    eu = np.array([a for a, _ in keys], dtype=np.int64)
    ev = np.array([b for _, b in keys], dtype=np.int64)
    adj: list[list[tuple[int, int, bool]]] = [[] for _ in range(moves.ngroups)]
    for k, (a, b) in enumerate(keys):
        adj[a].append((k, b, True))
        adj[b].append((k, a, False))
    zero = np.zeros(moves.ngroups, dtype=np.int64)
    q = Flat(costs, tuple(np.zeros(len(c)) for c in costs), eu, ev, tuple(tables[k] for k in keys),
             tuple(tuple(a) for a in adj), None, zero, zero, np.zeros(0), ())
    return q, moves.configs_of(x)


def priced_descent(moves: GroupMoves, x: np.ndarray, *, rounds: int = 60, cycles: int = 3,
                   prices: tuple[float, ...] = PRICES,
                   wall_limit: float | None = None) -> tuple[np.ndarray, float, int, float]:
    """Group moves under a falling price on usage where memory binds; the best valid assignment seen.

    Moves that ignore the memory limit show where it blocks them: from ``x``
    they reach ``y``, over capacity by ``over_t`` at segment ``t``. The price
    per byte ``mu = (cost(x) - cost(y)) / max_t over_t`` is what the blocked
    gain is worth per byte; node ``i`` pays ``f * mu * w_i`` on its usage,
    ``w_i`` the largest ``over_t / max over`` on its interval, for each factor
    ``f`` of ``prices`` in turn (falling to 0), each followed by moves with
    memory hard. A high price makes nodes on binding segments give memory
    up; as it falls, the moves worth more than it take that memory. Every
    assignment stays valid. Repeats (``cycles``) while a cycle gains.
    ``wall_limit``: a wall-clock safety net, seconds from now. Returns (assignment, cost, rounds,
    deterministic work).
    """
    deadline = None if wall_limit is None else time.perf_counter() + wall_limit

    def left() -> float | None:
        return None if deadline is None else deadline - time.perf_counter()

    flat = moves.flat
    x = np.asarray(x, dtype=np.int64).copy()
    best, best_cost = x, evaluate(flat, x)
    charge = evaluation_charge(flat)
    spent, total = charge, 0
    if not len(flat.capacity) or not np.isfinite(best_cost):
        return best, best_cost, 0, spent
    unlimited = replace(flat, capacity=np.zeros(0), binding=())
    tol = tolerance(flat)
    for _ in range(cycles):
        start_cost = best_cost
        if deadline is not None and left() <= 0:
            break
        y, done, used = moves.descend(best, rounds, memory=False, wall_limit=left())
        spent += used + 2 * charge
        total += done
        over = np.maximum(profile(flat, y) - flat.capacity, 0.0)
        top = float(over.max())
        gain = best_cost - evaluate(unlimited, y)
        if top <= tol or not gain > 0:
            break
        s0, s1 = flat.seg_start, flat.seg_end
        has = s1 > s0
        weight = np.zeros(flat.n)
        if has.any():
            weight[has] = -moves._range_min(-over / top, s0[has], s1[has])
        price = (gain / top) * weight[moves.slot_node] * moves.usages
        cur = best
        for f in prices:
            cur, done, used = moves.descend(cur, rounds, extra=f * price if f else None, wall_limit=left())
            spent += used + charge
            total += done
            c = evaluate(flat, cur)
            if c < best_cost:
                best, best_cost = cur, c
        if best_cost >= start_cost - 1e-4 * abs(start_cost):
            break
    return best, best_cost, total, spent


def _shifted_profile(flat: Flat, prof: np.ndarray, nodes: np.ndarray, change: np.ndarray) -> np.ndarray:
    delta = np.zeros(len(flat.capacity) + 1)
    np.add.at(delta, flat.seg_start[nodes], change)
    np.add.at(delta, flat.seg_end[nodes], -change)
    return prof + np.cumsum(delta)[:-1]
