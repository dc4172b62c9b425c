r"""Certified lower bounds for the strategy-selection problem.

Three bounds, all valid for every feasible assignment (never above the optimum):

**Dual (reparametrisation) bound**, cheap on big instances. Any
reparametrisation ``theta`` of the costs (moving ``m(a)`` from edge ``(u, v)``
row ``a`` into node ``u``'s cost keeps every assignment's total unchanged)
gives

    LB(theta) = sum_i min_s theta_i(s) + sum_(u,v) min_(a,b) theta_uv(a, b)

``dual_bound`` improves ``theta`` with star (min-sum diffusion) updates: for
node ``i`` with incident edges ``e``, ``m_e(s) = min_b theta_e(s, b)``,
``total(s) = theta_i(s) + sum_e m_e(s)``; then every edge gets
``theta_e(s, b) - m_e(s) + total(s) / (deg + 1)`` and the node keeps
``total(s) / (deg + 1)``. Each update never lowers ``LB``. Memory is relaxed.

**TRW-S bound** (``trws_bound``, sequential tree-reweighted message passing,
memory relaxed): the same reparametrisation bound, with the reparametrisation
found by passes of messages in node order, alternately forward and backward.
It reaches the LP optimum of the memory-relaxed problem (tight on planner
problems) in tens of passes where min-sum diffusion plateaus below it, and is
exact on trees. A pass reads each edge's table once, in compiled code
(``encodings.kernels``: about a millisecond a pass on a 12-layer GPT-2 step);
``solve`` uses it where the LP is too big. ``trws_decode`` reads an assignment off its messages
(each node, in order, at its best given the nodes before it and the messages
of those after); ``solve`` repairs such decodings into warm starts.

**LP bound** (HiGHS), for moderate sizes: the local marginal polytope with the
memory constraints kept::

    min  sum c_i(s) x_is + sum C_uv(a, b) y_uvab
    s.t. sum_s x_is = 1,   sum_b y_uvab = x_ua,   sum_a y_uvab = x_vb,
         sum_{i live in t} sum_s du_is x_is <= cap_t,   x, y in [0, 1]

Forbidden entries are fixed to 0 in the LP. The bound is certified from the
solver's duals (``dual_certificate``: the Lagrangian of any duals is a valid
bound, whatever the solver's tolerances), less a tiny relative margin for
floating point; ``-inf`` when the LP was not solved.

The LP is built with numpy as one sparse matrix and solved by HiGHS (dual
simplex, through scipy, which JAX already requires; GLOP through ``pywraplp``
took seconds on 200k pairs, one Python call per term). Costs are normalised first (the largest finite entry above
each node's and edge's minimum becomes 1): solver tolerances are absolute, and
planner costs are seconds (1e-11 .. 1e-2), far below them. Margins are
relative to the problem's own cost scale, never to 1.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import numpy as np

from shardsolve.encodings import kernels
from shardsolve.encodings.flat import Flat, evaluate, interval_sums, sweep_charge

__all__ = ["trivial_bound", "dual_bound", "trws_bound", "trws_charge", "trws_pass_charge", "trws_decode_charge",
           "trws_decode", "trws_gamma", "finite_parts", "pruned_above", "LocalPolytope", "local_polytope", "lp_solve",
           "lp_bound", "lagrangian_bound"]

#: LP bounds are only attempted up to this many pair variables.
LP_MAX_PAIRS = 300_000
#: TRW-S passes for the LP's Lagrangian certificate (``lagrangian_bound``), when the duals alone fall short.
LP_TRWS_PASSES = 200


def trivial_bound(flat: Flat) -> float:
    """Sum of each node's and each edge's cheapest entry."""
    total = sum(float(np.min(c)) for c in flat.costs)
    total += sum(float(np.min(t)) for t in flat.tables)
    return total


def finite_parts(flat: Flat) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The costs and tables with every forbidden entry at one finite stand-in (lowering costs keeps a bound
    valid): four times the summed largest magnitudes, plus one (``stand_in``). An array without forbidden
    entries comes back itself, not a copy; each array's extremes are read once."""
    costs, tables, _ = _finite_parts(flat)
    return costs, tables


def _finite_parts(flat: Flat, packed_tables: np.ndarray | None = None
                  ) -> tuple[list[np.ndarray], list[np.ndarray], float]:
    """``finite_parts`` and the stand-in.

    With ``packed_tables`` (as long as all the tables together), the tables are copied into it, one after
    another, their forbidden entries replaced there, and come back as views of it: one copy of each table
    where ``kernels.pack`` would make a second (a planner's untied problem on a three-axis mesh holds
    10^7 to 10^8 entries)."""
    if packed_tables is not None:
        at = 0
        tables = []
        for t in flat.tables:
            view = packed_tables[at:at + t.size].reshape(t.shape)
            view[...] = t
            tables.append(view)
            at += t.size
    else:
        tables = list(flat.tables)
    arrays = (*flat.costs, *tables)
    top, forbidden = 0.0, []
    for a in arrays:
        high, low = (float(a.max()), float(a.min())) if a.size else (0.0, 0.0)
        clean = math.isfinite(high) and math.isfinite(low)
        if not clean:  # forbidden entries: the finite ones only
            f = a[np.isfinite(a)]
            high, low = (float(f.max()), float(f.min())) if len(f) else (0.0, 0.0)
        forbidden.append(not clean)
        top += max(abs(high), abs(low))
    big = 4.0 * top + 1.0
    n = len(flat.costs)
    costs = [np.where(np.isfinite(a), a, big) if bad else a for a, bad in zip(arrays[:n], forbidden[:n])]
    if packed_tables is not None:
        for a, bad in zip(tables, forbidden[n:]):
            if bad:
                a[~np.isfinite(a)] = big
    else:
        tables = [np.where(np.isfinite(a), a, big) if bad else a for a, bad in zip(tables, forbidden[n:])]
    return costs, tables, big


def dual_bound(flat: Flat, iterations: int = 20, wall_limit: float | None = None) -> float:
    """Reparametrisation bound after ``iterations`` sweeps of star updates (memory relaxed).

    ``wall_limit`` (seconds from the call): a safety net, checked after each sweep.
    """
    started = time.perf_counter()
    if flat.n == 0:
        return 0.0
    costs, tables = finite_parts(flat)
    theta_n = [c.astype(np.float64) for c in costs]  # copies: updated in place below
    theta_e = [t.astype(np.float64) for t in tables]

    def value() -> float:
        return sum(float(c.min()) for c in theta_n) + sum(float(t.min()) for t in theta_e)

    best = value()
    for _ in range(iterations):
        for i in range(flat.n):
            inc = flat.adj[i]
            if not inc:
                continue
            mins = []
            total = theta_n[i].copy()
            for e, _, is_u in inc:
                m = theta_e[e].min(axis=1) if is_u else theta_e[e].min(axis=0)
                mins.append(m)
                total += m
            share = total / (len(inc) + 1)
            for (e, _, is_u), m in zip(inc, mins):
                if is_u:
                    theta_e[e] += (share - m)[:, None]
                else:
                    theta_e[e] += (share - m)[None, :]
            theta_n[i] = share
        now = value()
        if now <= best + 1e-12 * max(1.0, abs(best)):
            best = max(best, now)
            break
        best = now
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
    # floating-point safety margin
    return best - 1e-9 * max(1.0, abs(best))


#: ``trws_bound``'s work: a compiled pass (``kernels.trws_pass``) with its share of the bound checks, per node
#: and edge and per table entry (measured on planner problems and the IOPDDL instances: 0.07 to 0.1 us an
#: item where items dominate, 0.45 to 0.9 ns an entry where entries do; the charges sit about twice above
#: both), and the setup in Python sweeps (``flat.sweep_charge``: packing the arrays, the final terms; 0.5 to 1
#: measured).
TRWS_CHARGE_PER_ITEM = 1e-7
TRWS_CHARGE_PER_ENTRY = 1e-9
TRWS_SETUP_SWEEPS = 2.0
#: ... and an assignment read off and evaluated (``decode_every``), in Python sweeps.
TRWS_DECODE_SWEEPS = 2.0


def trws_charge(flat: Flat, passes: int, decodes: int = 0) -> float:
    """Deterministic charge (seconds) of ``trws_bound`` running ``passes`` passes over ``flat`` and reading
    ``decodes`` assignments off them."""
    return passes * trws_pass_charge(flat) + TRWS_SETUP_SWEEPS * sweep_charge(flat) + decodes * trws_decode_charge(flat)


def trws_decode_charge(flat: Flat) -> float:
    """Deterministic charge (seconds) of reading one assignment off the messages and evaluating it."""
    return TRWS_DECODE_SWEEPS * sweep_charge(flat)


def trws_pass_charge(flat: Flat) -> float:
    """Deterministic charge (seconds) of one more TRW-S pass (``trws_charge`` without the setup)."""
    return TRWS_CHARGE_PER_ITEM * (flat.n + len(flat.tables)) + TRWS_CHARGE_PER_ENTRY * sum(
        t.size for t in flat.tables)


def trws_gamma(flat: Flat) -> np.ndarray:
    """TRW-S's node weights ``g_i = 1 / max(#earlier, #later neighbours)`` (at least one of each counted)."""
    lo = np.minimum(flat.eu, flat.ev).astype(np.int64)
    hi = np.maximum(flat.eu, flat.ev).astype(np.int64)
    later = np.bincount(lo, minlength=flat.n)
    earlier = np.bincount(hi, minlength=flat.n)
    return 1.0 / np.maximum(1, np.maximum(earlier, later))


#: ``trws_bound``'s ``stall`` test starts at this many passes (against the bound at half as many).
STALL_FROM = 64
#: ``trws_bound`` checks its bound every this many passes (and after passes 2 and 4) and runs the passes
#: between two checks in one compiled call of at most ``CHUNK_ENTRIES`` table entries' work (its wall net is
#: looked at between calls).
CHECK_EVERY = 4
CHUNK_ENTRIES = 1 << 23


@dataclasses.dataclass(frozen=True)
class TrwsSetup:
    """What ``trws_bound``'s passes read of a ``Flat``: its costs and tables with forbidden entries finite
    (``finite_parts``), its edges, TRW-S's node weights and the packed arrays of the compiled passes."""

    costs: list[np.ndarray]
    tables: list[np.ndarray]
    eu: list[int]
    ev: list[int]
    gamma: np.ndarray
    packed: kernels.Packed
    stand_in: float  # what forbidden entries cost

    @classmethod
    def of(cls, flat: Flat) -> TrwsSetup:
        packed_tables = np.empty(sum(t.size for t in flat.tables))
        costs, tables, stand_in = _finite_parts(flat, packed_tables)  # ``tables``: views of ``packed_tables``
        eu = [int(u) for u in flat.eu]
        ev = [int(v) for v in flat.ev]
        gamma = trws_gamma(flat)
        packed = kernels.pack(costs, tables, eu, ev, flat.adj, gamma, packed_tables)
        return cls(costs, tables, eu, ev, gamma, packed, stand_in)

    def held(self, i: int, s: int) -> TrwsSetup:
        """The setup of the flat with node ``i`` held to strategy ``s`` (``dive.fixed``), sharing this one's
        tables: node ``i``'s other strategies cost the stand-in. Any finite stand-in keeps the bound valid,
        and this one is at least the one ``of`` works out for the held flat (which has fewer finite costs),
        so the LP the passes approach is at least as high; only the node costs are copied."""
        held = np.full(len(self.costs[i]), self.stand_in)
        held[s] = self.costs[i][s]
        costs = list(self.costs)
        costs[i] = held
        flat_costs = self.packed.costs.copy()
        flat_costs[self.packed.noff[i]:self.packed.noff[i + 1]] = held
        return dataclasses.replace(self, costs=costs, packed=dataclasses.replace(self.packed, costs=flat_costs))


class Later:
    """A number settled after a computation that reads it has started: ``trws_bound``'s ``target``,
    ``passes`` and ``wall_limit`` for passes run ahead on another thread (``tying.BoundAhead``).

    ``peek`` is ``default`` until ``settle``; ``get`` waits for the settled value. ``settled_at`` is the
    ``time.perf_counter()`` of the settling (a wall-clock net counts from it).
    """

    def __init__(self, default: float | None):
        self.default = default
        self.value: float | None = None
        self.settled_at = math.inf
        self._known = threading.Event()

    def settle(self, value: float | None) -> None:
        if not self._known.is_set():
            self.value, self.settled_at = value, time.perf_counter()
            self._known.set()

    def known(self) -> bool:
        return self._known.is_set()

    def peek(self) -> float | None:
        return self.value if self._known.is_set() else self.default

    def get(self) -> float | None:
        self._known.wait()
        return self.value


def trws_bound(
    flat, passes: int | Later = 60, target: float | Later = math.inf, decoded: list | None = None, *,
    wall_limit: float | Later | None = None, final_only: bool = False, decode_every: int = 0,
    ran: list | None = None, terms: bool = True, stall: float = 0.0, free_passes: int = 0,
    setup: TrwsSetup | None = None,
) -> tuple[float, list[np.ndarray] | None, list[np.ndarray] | None]:
    """A certified lower bound by sequential tree-reweighted message passing (TRW-S), memory relaxed.

    Passes alternate forward and backward over the nodes in index order;
    node ``i`` sends ``M_ij(b) = min_a (g_i * hat_i(a) - M_ji(a) + C_ij(a, b))``
    to each neighbour ``j`` after it in the pass, where ``hat_i`` is ``i``'s
    cost plus every message into it and ``g_i = 1 / max(#earlier, #later
    neighbours)``. After each pass the costs are reparametrised exactly:
    each edge ``(i, j)`` (``i`` first in the pass) holds ``C_ij + g_i * hat_i
    - M_ji - M_ij``, each node ``(1 - g_i * #later) * hat_i``; every
    assignment costs the same under them, so the sum of their minima is a
    lower bound whatever the messages are. It usually reaches the LP optimum
    (tight on planner problems) in tens of passes, where min-sum diffusion
    (``bounds.dual_bound``) needs hundreds.

    Stops after ``passes`` or once the bound reaches ``target``. Returns the
    best bound and its reparametrised node and edge costs (forbidden entries
    stand in as a large finite cost; None and None with ``terms=False``, which
    spares building them). With a list ``decoded``, appends an
    assignment read off the final messages (each node, in order, at its
    cheapest given the nodes before it and the messages of those after).
    With ``decode_every`` too, an assignment is also read off at every bound
    check that many passes apart; the cheapest valid one (``flat.evaluate``,
    memory included) is appended instead, and the passes stop once the bound
    meets its cost to a part in 1e9 (it is then optimal: planner problems get
    there in tens to a couple of hundred passes, well before an LP would).

    The work is about a sweep over the nodes, edges and table entries a pass
    (``trws_charge``; one pass costs about as much as one bound check, done
    after passes 2, 4, 8 and every fourth; with ``final_only``, only after the
    last, as the bound rarely falls from one pass to the next). ``wall_limit``
    (seconds) is a safety net: once it has passed, the bound is checked and
    the passes stop (only then does the result depend on the machine's speed). The bound carries no
    floating-point margin: callers subtract one relative to their costs.
    With a list ``ran``, the number of passes run is appended (to charge them).
    ``stall`` (with a finite ``target``): the passes also stop once doubling them (from ``STALL_FROM`` passes
    on) closed less than that part of what was left to ``target``: the bound creeps towards an LP optimum
    short of the target, and the passes are better spent by the caller elsewhere.

    ``passes``, ``target`` and ``wall_limit`` may be ``Later``s, settled while the passes run (on another
    thread): the passes wait for ``passes`` from pass ``free_passes`` on (at most that many is known to be
    allowed); the checks made before ``target`` is settled are tested against it once it is, in order, and
    where the stall test would have stopped at one of them, the bound and messages of that check are
    returned (kept for every check the stall test may stop at). Where the target is met, the passes stop
    at the first check that knows it (the bound is then at least the target, as it would have been). The
    wall net counts from its settling. ``setup``: ``TrwsSetup.of(flat)`` made beforehand, or one shared by
    problems that differ in one node's costs (``TrwsSetup.held``).
    """
    started = time.perf_counter()
    n = flat.n
    setup = TrwsSetup.of(flat) if setup is None else setup
    costs, tables, eu, ev, gamma, packed = setup.costs, setup.tables, setup.eu, setup.ev, setup.gamma, setup.packed
    to_u, to_v = packed.messages()  # messages to each edge's first / second node, flat

    def terms_of(forward: bool, tu: np.ndarray, tv: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The node and edge terms of the reparametrisation by messages ``tu``, ``tv`` (what
        ``kernels.reparametrised_value`` sums the minima of)."""
        tu_e, tv_e = packed.split(tu, packed.uoff), packed.split(tv, packed.voff)
        hat = [c.copy() for c in costs]
        for e in range(len(tables)):
            hat[ev[e]] += tv_e[e]
            hat[eu[e]] += tu_e[e]
        sends = np.zeros(n)
        edge_terms = []
        for e, t in enumerate(tables):
            u, v = eu[e], ev[e]
            if (u < v) == forward:  # u goes first in this pass
                sends[u] += 1
                term = t + (gamma[u] * hat[u] - tu_e[e])[:, None]
                term -= tv_e[e][None, :]
            else:
                sends[v] += 1
                term = t + (gamma[v] * hat[v] - tv_e[e])[None, :]
                term -= tu_e[e][:, None]
            edge_terms.append(term)
        return [(1.0 - gamma[i] * sends[i]) * hat[i] for i in range(n)], edge_terms

    def decode() -> np.ndarray:
        return trws_decode(flat, costs, tables, packed.split(to_u, packed.uoff), packed.split(to_v, packed.voff))

    hat = kernels.hats(packed, to_u, to_v)
    # The best bound's messages (copies); its terms are rebuilt from them once, at the end.
    # (``best_u``/``best_v``: the compiled passes copy the messages of a better bound there themselves.)
    best_u, best_v = to_u.copy(), to_v.copy()
    if final_only and (isinstance(passes, Later) or passes > 0):
        best, best_at = -math.inf, None
    else:
        best, best_at = kernels.reparametrised_value(packed, True, to_u, to_v), (True, best_u, best_v)
    found, found_cost = None, math.inf  # the cheapest valid assignment read off so far (``decode_every``)
    at_half: dict[int, float] = {}  # the best bound after each power of two of passes (``stall``)
    snapshots: dict[int, tuple] = {}  # ... with its messages, where the stall test may stop
    checks: list[tuple[int, float]] = []  # (passes, best bound) of the checks not yet tested against the target

    def stalled(d: int, b: float, goal: float) -> bool:
        """Whether the stall test stops the passes at the check after ``d`` passes (best bound ``b``)."""
        return bool(stall) and math.isfinite(goal) and d >= STALL_FROM // 2 and d & (d - 1) == 0 and (
            d // 2 in at_half and b - at_half[d // 2] < stall * (goal - b))

    done = 0
    total = passes if not isinstance(passes, Later) else None  # the passes allowed, once known
    chunk = max(1, min(CHECK_EVERY, CHUNK_ENTRIES // max(1, int(packed.toff[-1]))))
    k = -1
    while True:
        k += 1
        # the passes up to the next check (or ``chunk`` of them) in one call
        last = k + chunk - 1 if final_only else min(j for j in (1, 3, 7, k + (-k - 1) % CHECK_EVERY) if j >= k)
        last = min(last, k + chunk - 1)
        if total is None and last >= free_passes - 1:  # (its last pass may be the last: its check depends on it)
            total = int(passes.get())
        if total is not None:
            if k >= total:
                break
            last = min(last, total - 1)
        often = not final_only and (last in (1, 3, 7) or last % CHECK_EVERY == CHECK_EVERY - 1)
        value = kernels.trws_passes(packed, k, last - k + 1, hat, to_u, to_v,
                                    check=often or last == (total or 0) - 1, best=best, best_u=best_u, best_v=best_v)
        k = last
        done = k + 1
        forward = k % 2 == 0
        late = _late(wall_limit, started)
        if often or k == (total or 0) - 1 or late:  # a bound costs about a pass: check less often
            if value != value:  # (not checked with the passes: the net has passed)
                value = kernels.reparametrised_value(packed, forward, to_u, to_v)
                if value > best:
                    best_u[:], best_v[:] = to_u, to_v
            if value > best:
                best, best_at = value, (forward, best_u, best_v)
            if decode_every and decoded is not None and ((k + 1) % decode_every == 0 or k == (total or 0) - 1 or late):
                x = decode()
                cost = evaluate(flat, x)
                if cost < found_cost:
                    found, found_cost = x, cost
                if best >= found_cost - 1e-9 * abs(found_cost):
                    break
            if stall and done >= STALL_FROM // 2 and done & (done - 1) == 0:
                at_half[done] = best
                snapshots[done] = (best, None if best_at is None else (best_at[0], best_u.copy(), best_v.copy()))
            checks.append((done, best))
            goal = target if not isinstance(target, Later) else target.value if target.known() else None
            if goal is not None:  # the checks since the last one that knew the target, as if it had
                stop = None
                for d, b in checks:
                    stop = "met" if b >= goal else "stall" if stalled(d, b, goal) else None
                    if stop is not None:
                        break
                checks.clear()
                if stop == "stall":  # where the passes would have stopped (met: stop here, the bound is no lower)
                    (best, best_at), done = snapshots[d], d
                if stop is not None:
                    break
            if late:
                break
    if decoded is not None:
        decoded.append(found if found is not None else decode())
    if ran is not None:
        ran.append(done)
    best_nodes = best_edges = None
    if terms and best_at is not None:
        best_nodes, best_edges = terms_of(*best_at)  # the terms whose minima ``best`` sums
    return best, best_nodes, best_edges


def _late(wall_limit: float | Later | None, started: float) -> bool:
    """Whether ``trws_bound``'s wall-clock net has passed (a ``Later`` net counts from its settling)."""
    if isinstance(wall_limit, Later):
        limit = wall_limit.peek()
        return limit is not None and time.perf_counter() - max(started, wall_limit.settled_at) > limit
    return wall_limit is not None and time.perf_counter() - started > wall_limit


def pruned_above(flat: Flat, node_terms: list[np.ndarray], edge_terms: list[np.ndarray], slack: float) -> Flat:
    """``flat`` with every entry forbidden whose reduced cost exceeds ``slack``.

    ``node_terms`` and ``edge_terms`` are ``trws_bound``'s reparametrised
    costs, which write every assignment's cost as the bound plus one
    non-negative term per node and edge (each term less its minimum). An
    entry whose own term exceeds ``slack`` is in no assignment that costs
    less than ``bound + slack``: with ``slack = cost - bound`` for an
    assignment of that ``cost``, the pruned problem keeps every assignment
    no dearer than it (that one included), and its optimum is the problem's
    wherever that lies below ``cost``.
    """
    return dataclasses.replace(
        flat,
        costs=tuple(np.where(t - t.min() > slack, np.inf, c) for c, t in zip(flat.costs, node_terms)),
        tables=tuple(np.where(t - t.min() > slack, np.inf, c) for c, t in zip(flat.tables, edge_terms)),
    )


def trws_decode(flat, costs, tables, to_u, to_v) -> np.ndarray:
    """An assignment from TRW-S messages: nodes in order, each at its best given the ones before it."""
    x = np.full(flat.n, -1, dtype=np.int64)
    for i in range(flat.n):
        score = costs[i].copy()
        for e, j, is_u in flat.adj[i]:
            if x[j] >= 0:
                score += tables[e][:, x[j]] if is_u else tables[e][x[j], :]
            else:
                score += to_u[e] if is_u else to_v[e]
        x[i] = int(np.argmin(score))
    return x


@dataclasses.dataclass(frozen=True)
class LocalPolytope:
    """The local-polytope LP of a ``Flat`` problem as sparse matrices, costs normalised (see the module docstring).

    Variables: every node strategy (``x``, ``n_x`` of them, node ``i``'s from
    ``x_off[i]``), then every allowed pair of every edge (``y``). A solution's
    value in the problem's units is ``offset + unit * (cost . z)``; memory rows
    are divided by ``scale_mem``. ``blocks``: the first variable of each block
    that sums to 1 (a node's strategies, an edge's pairs).
    """

    cost: np.ndarray
    ub: np.ndarray
    a_eq: object  # scipy.sparse.csr_matrix
    b_eq: np.ndarray
    a_ub: object | None
    b_ub: np.ndarray | None
    offset: float
    unit: float
    scale_mem: float
    x_off: np.ndarray
    blocks: np.ndarray

    @property
    def n_x(self) -> int:
        return int(self.x_off[-1])

    def value(self, normalised: float) -> float:
        """A normalised objective in the problem's units."""
        return self.offset + self.unit * float(normalised)

    def margin(self, normalised: float) -> float:
        """What HiGHS's tolerances (1e-7, on the normalised costs) may put a normalised objective off by, in the
        problem's units: that much per node, relative, and a part in 1e12 of the offset."""
        return 1e-7 * self.unit * (abs(float(normalised)) + len(self.x_off) - 1) + 1e-12 * abs(self.offset)

    def assignment(self, z: np.ndarray) -> np.ndarray:
        """The strategy of largest weight of each node."""
        return np.array([int(np.argmax(z[self.x_off[i]:self.x_off[i + 1]])) for i in range(len(self.x_off) - 1)],
                        dtype=np.int64)


def local_polytope(flat: Flat) -> LocalPolytope:
    """``flat``'s local-polytope LP with its memory rows (forbidden entries left out, costs normalised)."""
    import scipy.sparse as sp

    n = flat.n
    sizes = np.array([len(c) for c in flat.costs], dtype=np.int64)
    x_off = np.concatenate([[0], np.cumsum(sizes)])
    nx = int(x_off[-1])
    offset = 0.0
    unit = 0.0
    c_parts, ub_parts = [], []
    for c in flat.costs:
        fin = np.isfinite(c)
        low = float(c[fin].min()) if fin.any() else 0.0
        offset += low
        d = np.where(fin, c - low, 0.0)
        unit = max(unit, float(d.max(initial=0.0)))
        c_parts.append(d)
        ub_parts.append(fin.astype(np.float64))
    rows_i, cols_i, vals = [], [], []
    # one strategy per node
    rows_i.append(np.repeat(np.arange(n), sizes))
    cols_i.append(np.arange(nx))
    vals.append(np.ones(nx))
    n_rows = n
    ny = 0
    pair_counts: list[int] = []  # pair variables per edge (each edge's block sums to 1)
    for k, t in enumerate(flat.tables):
        u, v = int(flat.eu[k]), int(flat.ev[k])
        finite = np.isfinite(t)
        low = float(t[finite].min()) if finite.any() else 0.0
        offset += low
        a, b = np.nonzero(finite)
        m = len(a)
        d = t[a, b] - low
        unit = max(unit, float(d.max(initial=0.0)))
        yid = nx + ny + np.arange(m)
        ny += m
        pair_counts.append(m)
        c_parts.append(d)
        ub_parts.append(np.ones(m))
        sa, sb = t.shape
        # rows: sum_b y_ab - x_ua = 0 ; columns: sum_a y_ab - x_vb = 0
        rows_i += [n_rows + a, n_rows + np.arange(sa), n_rows + sa + b, n_rows + sa + np.arange(sb)]
        cols_i += [yid, x_off[u] + np.arange(sa), yid, x_off[v] + np.arange(sb)]
        vals += [np.ones(m), -np.ones(sa), np.ones(m), -np.ones(sb)]
        n_rows += sa + sb
    unit = unit if unit > 0 else 1.0
    cost = np.concatenate(c_parts) / unit
    ub = np.concatenate(ub_parts)
    a_eq = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows_i), np.concatenate(cols_i))), shape=(n_rows, nx + ny))
    b_eq = np.zeros(n_rows)
    b_eq[:n] = 1.0
    a_ub = b_ub = None
    scale_mem = 1.0
    if flat.binding:
        mr, mc, mv, caps = [], [], [], []
        for j, t in enumerate(flat.binding):
            for i in flat.live(t):
                use = flat.usages[i]
                nz = np.flatnonzero(use)
                mr.append(np.full(len(nz), j))
                mc.append(x_off[i] + nz)
                mv.append(use[nz])
            caps.append(float(flat.capacity[t]))
        scale_mem = max(1.0, max((float(np.max(u)) for u in flat.usages if len(u)), default=1.0))
        a_ub = sp.csr_matrix((np.concatenate(mv) / scale_mem if mv else np.zeros(0),
                              (np.concatenate(mr) if mr else np.zeros(0, int), np.concatenate(mc) if mc else np.zeros(0, int))),
                             shape=(len(flat.binding), nx + ny))
        b_ub = np.array(caps) / scale_mem
    blocks = np.concatenate([x_off[:-1], nx + np.concatenate([[0], np.cumsum(pair_counts)[:-1]])]).astype(np.int64)
    return LocalPolytope(cost, ub, a_eq, b_eq, a_ub, b_ub, offset, unit, scale_mem, x_off, blocks)


def lp_solve(flat: Flat, time_limit: float = 10.0) -> tuple[float, float, list[np.ndarray] | None]:
    """The local-polytope LP with memory (``local_polytope``), solved by HiGHS.

    Returns ``(value, margin, marginals)``: the LP optimum in the problem's
    units, an error margin (``value - margin`` is a certified bound) and the
    node marginals; ``(inf, 0, None)`` when the LP is infeasible and
    ``(-inf, 0, None)`` when it was not solved to optimality.
    """
    from scipy.optimize import linprog

    n = flat.n
    if n == 0:
        return 0.0, 0.0, []
    lp = local_polytope(flat)
    cost, ub, a_eq, b_eq, a_ub, b_ub = lp.cost, lp.ub, lp.a_eq, lp.b_eq, lp.a_ub, lp.b_ub
    offset, unit, scale_mem, x_off = lp.offset, lp.unit, lp.scale_mem, lp.x_off
    # Exact steepest-edge pricing: HiGHS's default starts so and may switch to Devex on measured cost,
    # which makes the returned vertex (of several optimal ones) vary from run to run.
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=np.stack([np.zeros(len(cost)), ub], axis=1),
                  method="highs-ds", options={"time_limit": float(time_limit), "presolve": True,
                                              "simplex_dual_edge_weight_strategy": "steepest"})
    if res.status == 2:
        return math.inf, 0.0, None
    if res.status != 0 or res.x is None:
        return -math.inf, 0.0, None
    value = offset + unit * float(res.fun)
    certified = dual_certificate(res, cost, ub, a_eq, b_eq, a_ub, b_ub, lp.blocks)
    if certified is None:
        margin = lp.margin(res.fun)  # no duals: HiGHS's tolerances
    else:
        margin = value - (offset + unit * certified) + 1e-12 * abs(offset)
    if margin > 1e-10 * max(abs(value), 1e-300):
        # the duals are approximate: keep the memory multipliers and let TRW-S find the edge part exactly
        multipliers = np.zeros(len(flat.binding))
        if a_ub is not None and getattr(res, "ineqlin", None) is not None:
            multipliers = np.maximum(-np.asarray(res.ineqlin.marginals, dtype=np.float64), 0.0) * unit / scale_mem
        lagrangian = lagrangian_bound(flat, multipliers, passes=LP_TRWS_PASSES, target=value)
        margin = min(margin, value - lagrangian)
    marginals = [np.clip(res.x[x_off[i]:x_off[i + 1]], 0.0, 1.0) for i in range(n)]
    return value, margin, marginals


def dual_certificate(res, cost: np.ndarray, ub: np.ndarray, a_eq, b_eq: np.ndarray, a_ub, b_ub,
                     blocks: np.ndarray) -> float | None:
    """A lower bound of the local-polytope LP (hence of the problem) from the LP solver's duals.

    Any duals ``y`` (``y_ub <= 0``) give reduced costs
    ``r = cost - a_eq^T y_eq - a_ub^T y_ub``, and for every feasible ``x``
    ``cost.x = b_eq.y_eq + b_ub.y_ub + r.x - y_ub.(b_ub - a_ub x) >= b_eq.y_eq + b_ub.y_ub + r.x``.
    The variables come in ``blocks`` (a node's strategies, an edge's pairs,
    starting at the given indices) that each sum to 1, so
    ``r.x >= sum over blocks of the least r`` of the block's allowed
    variables. The bound holds whatever the solver's tolerances were; a
    relative ``1e-12`` of the magnitudes summed is taken off for floating
    point. ``None`` without usable duals.
    """
    try:
        y_eq = np.asarray(res.eqlin.marginals, dtype=np.float64)
        y_ub = np.minimum(np.asarray(res.ineqlin.marginals, dtype=np.float64), 0.0) if a_ub is not None else None
    except AttributeError:
        return None
    if y_eq.shape != b_eq.shape or not np.isfinite(y_eq).all():
        return None
    reduced = cost - a_eq.T @ y_eq
    size = np.abs(cost) + abs(a_eq).T @ np.abs(y_eq)  # magnitude of each reduced cost's terms
    total = float(b_eq @ y_eq)
    scale = float(np.abs(b_eq) @ np.abs(y_eq))
    if y_ub is not None:
        if y_ub.shape != b_ub.shape or not np.isfinite(y_ub).all():
            return None
        reduced = reduced - a_ub.T @ y_ub
        size = size + abs(a_ub).T @ np.abs(y_ub)
        total += float(b_ub @ y_ub)
        scale += float(np.abs(b_ub) @ np.abs(y_ub))
    blocks = blocks[np.diff(np.append(blocks, len(cost))) > 0]  # an edge without finite pairs has no block
    if not len(blocks):
        return total - 1e-12 * scale
    allowed = np.where(ub > 0, reduced, np.inf)
    least = np.minimum.reduceat(allowed, blocks)
    if not np.isfinite(least).all():
        return None  # a block with nothing allowed: the LP is infeasible, the solver says so
    total += float(least.sum())
    scale += float(np.maximum.reduceat(size, blocks).sum())
    return total - 1e-12 * scale


def lagrangian_bound(flat: Flat, multipliers: np.ndarray, *, passes: int = 200, target: float = math.inf) -> float:
    """A lower bound with the memory constraints priced: TRW-S on ``cost + mu * usage``, less ``mu . capacity``.

    ``multipliers`` (``mu >= 0``, one per binding segment, cost per unit of
    usage) turn every binding memory constraint into a price: for an
    assignment within memory, ``sum_t mu_t (usage_t - capacity_t) <= 0``, so
    its cost is at least its priced cost less ``mu . capacity``, and TRW-S
    bounds the priced, unconstrained problem. With the LP's own memory duals
    this reaches the LP optimum where the LP is tight (IOPDDL B and G: to a
    part in 1e12), where the duals alone fall short by the solver's
    tolerance. Stops after ``passes`` or at ``target``; a relative ``1e-10``
    is taken off for floating point.
    """
    mu = np.maximum(np.asarray(multipliers, dtype=np.float64), 0.0)
    costs = flat.costs
    constant = 0.0
    if len(flat.binding) and mu.any():
        price = interval_sums(flat, mu, flat.binding)  # sum of mu over the binding segments a node is live in
        costs = tuple(c + w * u for c, w, u in zip(flat.costs, price, flat.usages))
        constant = float(mu @ flat.capacity[np.asarray(flat.binding, dtype=np.int64)])
    priced = dataclasses.replace(flat, costs=costs, capacity=np.zeros(0), binding=())
    value, _, _ = trws_bound(priced, passes=passes, target=target + constant)
    return value - constant - 1e-10 * (abs(value) + abs(constant))


def lp_bound(flat: Flat, time_limit: float = 10.0) -> float:
    """The certified LP bound (``lp_solve``'s value less its margin); ``-inf`` when not solved to optimality
    or above ``LP_MAX_PAIRS`` pair variables, ``inf`` when the LP is infeasible."""
    if sum(int(np.isfinite(t).sum()) for t in flat.tables) > LP_MAX_PAIRS:
        return -math.inf
    value, margin, _ = lp_solve(flat, time_limit)
    return value - margin if math.isfinite(value) else value
