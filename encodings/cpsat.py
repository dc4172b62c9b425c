r"""OR-tools CP-SAT encoding of the strategy-selection problem.

Formulation (one Boolean per node strategy, ``N`` nodes, ``E`` edges, ``T`` segments)::

    x[i, s] in {0, 1}                                  node i uses strategy s
    sum_s x[i, s] = 1                                  for every node i            (add_one_strategy_per_node)
    x[u, a] => OR_{b : C_uv[a, b] < inf} x[v, b]       for every edge, row a       (add_forbidden_pairs)
    x[v, b] => OR_{a : C_uv[a, b] < inf} x[u, a]       for every edge, column b
    sum_{i live in t} sum_s du[i, s] x[i, s] <= cap_t  for every binding segment t (add_memory_limit)

    minimise  sum_{i, s} c'[i, s] x[i, s]  +  sum_{(u,v)} cost_uv                   (add_objective)

Edge costs are reduced first (``reduce_table``): subtract each row's minimum
``r_a`` and then each column's minimum ``k_b`` of the finite entries,
``C[a, b] = r_a + k_b + R[a, b]`` with ``R >= 0``; ``r`` and ``k`` move into the
node costs ``c'``. Only the positive residuals ``R[a, b] > 0`` need a term
(``add_edge_costs``):

* few of them: one Boolean ``y[a, b] >= x[u, a] + x[v, b] - 1`` each, with
  objective weight ``R[a, b]``;
* many: one integer ``cost_uv`` and, for every strategy ``a`` of the endpoint
  with fewer strategies, ``x[u, a] => cost_uv >= sum_b R[a, b] x[v, b]``.

Memory (``add_memory_limit``): usages are measured above each node's least
usage (``du``), single-usage nodes move into ``cap_t`` (the limit minus their
usage), time steps are grouped into segments where the live set does not
change, and a segment's constraint is dropped when a neighbouring segment's
implies it or when it cannot bind (see ``heuristics.flatten``).

Costs become integers: ``floor(c * scale)`` with ``scale`` chosen so that the
reference cost (the warm start, or a crude upper bound) maps to about
``1e9``; entries above ``16x`` that reference are capped there (a solution
paying one is worse than the reference, so the optimum is unchanged). Flooring
keeps CP-SAT's objective bound a valid lower bound in the problem's units.

Search: the warm start is a complete hint; ``interleave_search`` with a fixed
``random_seed`` makes the run deterministic, and the limit is CP-SAT's
deterministic time, so the same problem and options give the same answer byte
for byte (``max_time_in_seconds`` is a wall-clock safety net at a multiple of
it). LNS workers take part in the interleaved portfolio.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from shardsolve.encodings.heuristics import CHARGE_PER_ITEM, Flat, evaluate, excess_costs, neighbourhood, profile, prune, subproblem
from shardsolve.reductions import component_labels

__all__ = ["CpSatResult", "CpSatEncoding", "solve_cpsat", "solve_neighbourhood", "reduce_table", "lns",
           "forbidden_components", "violated_edges", "repair_forbidden", "component_descent"]

#: Edges with at most this many positive residual entries get one Boolean per entry.
PAIR_VARIABLE_LIMIT = 0
#: The reference cost maps to about this many integer units. Larger scales (1e12)
#: made CP-SAT 9.15's presolve return a wrong "optimal" on small random models
#: (tests/test_solver.py::test_cpsat_and_z3_agree found it); 1e9 keeps flooring
#: error below one part in 1e9 per term.
TARGET_UNITS = 1e9
#: Wall-clock safety net: this multiple of the deterministic limit, plus a few seconds.
WALL_FACTOR = 3.0
#: Deterministic charge (seconds) per model variable or term built, covering Python and presolve work.
CHARGE_PER_TERM = 5e-6
#: A neighbourhood's CP-SAT deterministic time is charged this many times over: on models with
#: long memory constraints (IOPDDL K, P, S) CP-SAT's wall time runs several times its deterministic time.
NEIGHBOURHOOD_FACTOR = 3.0
#: Deterministic charge (seconds) per neighbourhood, whatever its size.
CHARGE_PER_STEP = 0.005
#: Largest neighbourhood ``repair_forbidden`` frees at once (a ball inside a bigger component).
REPAIR_MAX_NODES = 400
#: ``component_descent``: largest neighbourhood, and the nodes around a small component freed with it.
DESCENT_MAX_NODES = 600
DESCENT_GROW = 100


@dataclass(frozen=True, slots=True)
class CpSatResult:
    assignment: np.ndarray | None  # best feasible assignment found (flat node order)
    cost: float  # its cost in the problem's units (inf if none)
    lower_bound: float  # certified, in the problem's units
    status: str  # "optimal", "feasible", "infeasible", "unknown"
    stats: dict = field(default_factory=dict, compare=False)


def reduce_table(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split finite entries into row part, column part and a non-negative residual.

    ``table[a, b] = rows[a] + cols[b] + residual[a, b]`` wherever finite; rows or
    columns with no finite entry get 0.
    """
    finite = np.isfinite(table)
    t = np.where(finite, table, np.inf)
    rows = t.min(axis=1)
    rows = np.where(np.isfinite(rows), rows, 0.0)
    t = t - rows[:, None]
    cols = t.min(axis=0)
    cols = np.where(np.isfinite(cols), cols, 0.0)
    t = t - cols[None, :]
    residual = np.where(finite, np.maximum(t, 0.0), np.inf)
    return rows, cols, residual


def _integral_usage(flat: Flat) -> tuple[list[np.ndarray], np.ndarray]:
    """Usages and capacities as integers: exact when integral, else rounded conservatively."""
    used = [u for u in flat.usages]
    integral = all(np.all(u == np.round(u)) for u in used) and np.all(flat.capacity == np.floor(flat.capacity))
    factor = 1.0 if integral else 1024.0
    ints = [np.ceil(u * factor - 1e-9).astype(np.int64) for u in used]
    cap = np.floor(flat.capacity * factor + 1e-9).astype(np.int64)
    return ints, cap


class CpSatEncoding:
    """Builds the CP-SAT model for a :class:`Flat` problem, one method per constraint family."""

    def __init__(self, flat: Flat, reference_cost: float):
        self.flat = flat
        self.model = cp_model.CpModel()
        self.x: list[list[cp_model.IntVar]] = []
        self.pairs: list[tuple[int, int, int, cp_model.IntVar]] = []  # (edge, a, b, y)
        self.edge_cost_vars: list[tuple[int, cp_model.IntVar, np.ndarray, bool]] = []
        self.node_costs = [c.copy() for c in flat.costs]
        self.residuals: list[np.ndarray] = []
        self.offset = 0.0  # cost units, moved out of the integer objective
        self.scale = 1.0
        self.terms: list[tuple[cp_model.IntVar, int]] = []
        self.size = 0  # variables plus constraint terms: the model-building work, for budgets
        self._reference = reference_cost
        self.add_one_strategy_per_node()
        self.split_edge_tables()
        self.choose_scale()
        self.add_forbidden_pairs()
        self.add_edge_costs()
        self.add_memory_limit()
        self.add_objective()

    # -- variables -------------------------------------------------------------------

    def add_one_strategy_per_node(self) -> None:
        """``sum_s x[i, s] = 1``; forbidden strategies are fixed to 0."""
        for i, c in enumerate(self.flat.costs):
            xs = [self.model.new_bool_var("") for s in range(len(c))]
            self.size += 2 * len(c)
            self.model.add_exactly_one(xs)
            for s in np.flatnonzero(~np.isfinite(c)):
                self.model.add(xs[s] == 0)
            self.x.append(xs)

    # -- costs -------------------------------------------------------------------------

    def split_edge_tables(self) -> None:
        """Move row and column minima of every edge into node costs."""
        for k, t in enumerate(self.flat.tables):
            rows, cols, residual = reduce_table(t)
            u, v = int(self.flat.eu[k]), int(self.flat.ev[k])
            self.node_costs[u] = self.node_costs[u] + rows
            self.node_costs[v] = self.node_costs[v] + cols
            self.residuals.append(residual)
        for i, c in enumerate(self.node_costs):
            finite = np.isfinite(c)
            low = float(c[finite].min()) if finite.any() else 0.0
            self.offset += low
            self.node_costs[i] = c - low

    def choose_scale(self) -> None:
        """Integer units: the reference cost (above the offset) maps to about ``TARGET_UNITS``."""
        ref = self._reference - self.offset if math.isfinite(self._reference) else math.inf
        if not math.isfinite(ref) or ref <= 1e-12 * max(1.0, abs(self.offset)):
            ref = sum(float(c[np.isfinite(c)].max(initial=0.0)) for c in self.node_costs)
            ref += sum(float(r[np.isfinite(r)].max(initial=0.0)) for r in self.residuals)
        if not ref > 1e-12 * max(1.0, abs(self.offset)):
            ref = max(1.0, abs(self.offset))  # nothing left to optimise: any unit will do
        self.scale = TARGET_UNITS / ref
        self.cap = 16.0 * ref  # entries above this are capped (never part of a better solution)
        n_terms = len(self.node_costs) + len(self.residuals)
        self.cap_units = int(min(self.cap * self.scale, 2**62 / max(n_terms, 1) / 4))

    def units(self, values: np.ndarray) -> np.ndarray:
        v = np.where(np.isfinite(values), values, 0.0)
        return np.minimum(np.floor(v * self.scale), self.cap_units).astype(np.int64)

    def add_forbidden_pairs(self) -> None:
        """``x[u, a] => OR`` of the ``x[v, b]`` with a finite entry (and symmetrically)."""
        for k, t in enumerate(self.flat.tables):
            finite = np.isfinite(t)
            if finite.all():
                continue
            u, v = int(self.flat.eu[k]), int(self.flat.ev[k])
            for a in range(t.shape[0]):
                if not finite[a].all():
                    self.size += 1 + int(finite[a].sum())
                    self.model.add_bool_or([self.x[u][a].Not()] + [self.x[v][b] for b in np.flatnonzero(finite[a])])
            for b in range(t.shape[1]):
                if not finite[:, b].all():
                    self.size += 1 + int(finite[:, b].sum())
                    self.model.add_bool_or([self.x[v][b].Not()] + [self.x[u][a] for a in np.flatnonzero(finite[:, b])])

    def add_edge_costs(self) -> None:
        """Positive residuals: pair Booleans when few, else one conditional sum per row."""
        for k, r in enumerate(self.residuals):
            u, v = int(self.flat.eu[k]), int(self.flat.ev[k])
            w = self.units(r)
            positive = np.isfinite(r) & (w > 0)
            count = int(positive.sum())
            if count == 0:
                continue
            if count <= PAIR_VARIABLE_LIMIT:
                for a, b in zip(*np.nonzero(positive)):
                    y = self.model.new_bool_var("")
                    self.model.add_bool_or([self.x[u][a].Not(), self.x[v][b].Not(), y])
                    self.pairs.append((k, int(a), int(b), y))
                    self.terms.append((y, int(w[a, b])))
                continue
            rows_are_u = r.shape[0] <= r.shape[1]
            wt = w if rows_are_u else w.T
            pt = positive if rows_are_u else positive.T
            row_node, col_node = (u, v) if rows_are_u else (v, u)
            top = int(wt[pt].max())
            ce = self.model.new_int_var(0, top, "")
            for a in range(wt.shape[0]):
                if not pt[a].any():
                    continue
                cols = np.flatnonzero(pt[a])
                self.size += 2 + len(cols)
                self.model.add(sum(int(wt[a, b]) * self.x[col_node][b] for b in cols) <= ce).only_enforce_if(
                    self.x[row_node][a]
                )
            self.edge_cost_vars.append((k, ce, wt, rows_are_u))
            self.terms.append((ce, 1))

    def add_memory_limit(self) -> None:
        """One linear constraint per binding segment of the live-set sweep."""
        flat = self.flat
        if not flat.binding:
            return
        usage, cap = _integral_usage(flat)
        node_vars: list[list[cp_model.IntVar]] = []
        node_coeffs: list[list[int]] = []
        for i, u in enumerate(usage):
            nz = np.flatnonzero(u > 0)
            node_vars.append([self.x[i][s] for s in nz])
            node_coeffs.append([int(u[s]) for s in nz])
        binding = np.asarray(flat.binding, dtype=np.int64)
        # live nodes of every binding segment: nodes sorted by start, those not yet ended
        order = np.argsort(flat.seg_start, kind="stable")
        for t in binding:
            live = order[: np.searchsorted(flat.seg_start[order], t, side="right")]
            live = np.sort(live[flat.seg_end[live] > t])
            vs: list[cp_model.IntVar] = []
            cs: list[int] = []
            for i in live:
                vs.extend(node_vars[i])
                cs.extend(node_coeffs[i])
            self.size += len(vs)
            if vs:
                self.model.add(cp_model.LinearExpr.weighted_sum(vs, cs) <= int(cap[t]))
            elif cap[t] < 0:
                self.model.add_bool_or([])  # infeasible: even the least usages do not fit

    def add_objective(self) -> None:
        terms = list(self.terms)
        for i, c in enumerate(self.node_costs):
            w = self.units(c)
            for s in np.flatnonzero((w > 0) & np.isfinite(c)):
                terms.append((self.x[i][s], int(w[s])))
        self.size += len(terms)
        self.model.minimize(sum(c * v for v, c in terms))

    # -- hints and decoding --------------------------------------------------------------

    def add_hint(self, assignment: np.ndarray) -> None:
        """A complete hint: node choices, pair Booleans and edge cost variables."""
        for i, xs in enumerate(self.x):
            for s, var in enumerate(xs):
                self.model.add_hint(var, int(s == assignment[i]))
        for k, a, b, y in self.pairs:
            u, v = int(self.flat.eu[k]), int(self.flat.ev[k])
            self.model.add_hint(y, int(assignment[u] == a and assignment[v] == b))
        for k, ce, wt, rows_are_u in self.edge_cost_vars:
            u, v = int(self.flat.eu[k]), int(self.flat.ev[k])
            a, b = (assignment[u], assignment[v]) if rows_are_u else (assignment[v], assignment[u])
            val = int(wt[a, b]) if np.isfinite(self.residuals[k][(assignment[u], assignment[v])]) else 0
            self.model.add_hint(ce, max(0, val))

    def decode(self, solver: cp_model.CpSolver) -> np.ndarray:
        return np.array([next(s for s, var in enumerate(xs) if solver.boolean_value(var)) for xs in self.x], dtype=np.int64)

    def bound(self, objective_bound: float) -> float:
        """CP-SAT's objective bound in the problem's units (valid: costs were floored)."""
        return self.offset + objective_bound / self.scale


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, encoding: CpSatEncoding, report: Callable[[str, float, float], None] | None):
        super().__init__()
        self.encoding = encoding
        self.report = report
        self.best = math.inf

    def on_solution_callback(self) -> None:
        if self.report is None:
            return
        value = self.encoding.offset + self.objective_value / self.encoding.scale
        bound = self.encoding.bound(self.best_objective_bound)
        self.report("CP-SAT", value, bound)


def solve_cpsat(
    flat: Flat,
    *,
    hint: np.ndarray | None = None,
    time_limit: float = 10.0,
    seed: int = 0,
    workers: int = 2,
    progress: Callable[[str, float, float], None] | None = None,
    log: bool = False,
    wall_limit: float | None = None,
) -> CpSatResult:
    """Solve ``flat`` with CP-SAT; never worse than a feasible ``hint``.

    ``time_limit`` is CP-SAT's deterministic time; the wall clock is capped at
    a multiple of it, and at ``wall_limit`` seconds when given.
    """
    started = time.perf_counter()
    hint_cost = evaluate(flat, hint) if hint is not None else math.inf
    encoding = CpSatEncoding(flat, hint_cost)
    if hint is not None:
        encoding.add_hint(hint)
    built = time.perf_counter() - started
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.catch_sigint_signal = False  # Ctrl-C stays Python's: it would reset SIGINT to the default after solving
    params.random_seed = int(seed)
    params.num_workers = max(1, int(workers))
    params.interleave_search = params.num_workers > 1  # deterministic with several workers
    params.max_deterministic_time = float(time_limit)
    params.max_time_in_seconds = WALL_FACTOR * float(time_limit) + 5.0
    if wall_limit is not None:
        params.max_time_in_seconds = max(0.5, min(params.max_time_in_seconds, float(wall_limit)))
    params.log_search_progress = log
    callback = _Progress(encoding, progress)
    status = solver.solve(encoding.model, callback)
    stats = {
        "cpsat_status": solver.status_name(status),
        "cpsat_build_s": round(built, 3),
        "cpsat_wall_s": round(solver.wall_time, 3),
        "cpsat_deterministic_s": round(solver.deterministic_time, 3),
        "cpsat_variables": len(encoding.model.proto.variables),
        "cpsat_constraints": len(encoding.model.proto.constraints),
    }
    if status == cp_model.INFEASIBLE:
        return CpSatResult(None, math.inf, math.inf, "infeasible", stats)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = encoding.decode(solver)
        cost = evaluate(flat, x)
        bound = encoding.bound(solver.best_objective_bound)
        if math.isfinite(hint_cost) and hint_cost < cost:
            x, cost = np.asarray(hint), hint_cost
        if status == cp_model.OPTIMAL:
            return CpSatResult(x, cost, min(bound, cost), "optimal", stats)
        return CpSatResult(x, cost, min(bound, cost), "feasible", stats)
    bound = encoding.bound(solver.best_objective_bound) if status != cp_model.MODEL_INVALID else -math.inf
    if math.isfinite(hint_cost):
        return CpSatResult(np.asarray(hint), hint_cost, min(bound, hint_cost), "feasible", stats)
    return CpSatResult(None, math.inf, bound, "unknown", stats)


def solve_neighbourhood(flat: Flat, hint: np.ndarray, limit: float, seed: int) -> tuple[np.ndarray | None, float, bool, float]:
    """Solve a (sub)problem from a hint, which may be infeasible.

    Returns (assignment or None, its cost, proven optimal, deterministic work charged).
    """
    full = flat
    flat, maps = prune(flat)
    hint = np.array([int(np.flatnonzero(m == h)[0]) if (m == h).any() else int(np.argmin(flat.costs[i]))
                     for i, (m, h) in enumerate(zip(maps, hint))], dtype=np.int64)
    hint_cost = evaluate(flat, hint)
    encoding = CpSatEncoding(flat, hint_cost)
    encoding.add_hint(hint)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.catch_sigint_signal = False  # as in solve_cpsat
    params.random_seed = int(seed)
    params.num_workers = 1
    params.max_deterministic_time = float(limit)
    params.max_time_in_seconds = WALL_FACTOR * float(limit) + 1.0
    params.symmetry_level = 0
    params.linearization_level = 0  # the LP relaxation costs more wall time than it saves on small neighbourhoods
    status = solver.solve(encoding.model)
    used = NEIGHBOURHOOD_FACTOR * solver.deterministic_time + CHARGE_PER_STEP + CHARGE_PER_TERM * encoding.size
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = encoding.decode(solver)
        x = np.array([m[s] for m, s in zip(maps, x)], dtype=np.int64)
        return x, evaluate(full, x), status == cp_model.OPTIMAL, used
    return None, math.inf, False, used


def _moved_profile(flat: Flat, prof: np.ndarray, free: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The memory profile after nodes ``free`` move from strategies ``old`` to ``new``."""
    delta = np.zeros(len(flat.capacity) + 1)
    change = np.array([flat.usages[i][b] - flat.usages[i][a] for i, a, b in zip(free, old, new)])
    np.add.at(delta, flat.seg_start[free], change)
    np.add.at(delta, flat.seg_end[free], -change)
    return prof + np.cumsum(delta)[:-1]


def lns(
    flat: Flat,
    x: np.ndarray,
    *,
    budget: float,
    seed: int = 0,
    progress: Callable[[str, float, float], None] | None = None,
    lower_bound: float = -math.inf,
    offset: float = 0.0,
    wall_limit: float | None = None,
    guide: np.ndarray | None = None,
    stop_below: float = -math.inf,
    log: list | None = None,
) -> tuple[np.ndarray, float, dict]:
    """Large-neighbourhood search from a feasible ``x``: free a neighbourhood, solve it exactly, keep improvements.

    Neighbourhoods alternate between graph balls and time windows (nodes live
    around a binding memory segment, grown along edges). Their size adapts:
    it grows after a neighbourhood is solved to optimality and shrinks after
    a time-out. With ``guide`` (e.g. the rounded LP relaxation), one
    neighbourhood in each round grows from nodes where ``x`` disagrees with it.
    When forbidden pairs tie nodes into components (functional edges: one
    node's strategy fixes another's), one neighbourhood per round is a whole
    component, drawn by its excess cost, and the nodes around it: such
    nodes can only change together. ``budget`` is deterministic work (CP-SAT deterministic time
    plus a fixed charge per neighbourhood), so runs are reproducible;
    ``wall_limit`` is a wall-clock safety net.
    """
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.int64).copy()
    cost = evaluate(flat, x)
    decision = np.array([len(c) > 1 for c in flat.costs])
    n_dec = int(decision.sum())
    stats = {"lns_steps": 0, "lns_improvements": 0}
    if n_dec == 0 or not math.isfinite(cost):
        return x, cost, stats
    started = time.perf_counter()
    size = float(min(n_dec, 60))
    step_limit = 0.5
    spent = 0.0
    prof = profile(flat, x) if len(flat.capacity) else None
    step = 0
    excess, excess_step = None, 0
    kinds = [0, 1, 2] + ([3] if guide is not None else [])
    comp = forbidden_components(flat)
    spent += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    if np.bincount(comp).max(initial=0) > 1:
        kinds.append(4)
    while spent < budget and cost >= stop_below:
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
        kind = kinds[step % len(kinds)]
        if kind in (2, 4):
            if excess is None or step - excess_step >= 3 * len(kinds):  # a full pass: refreshed every third use
                excess, excess_step = excess_costs(flat, x), step
                spent += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
            weights = excess
        elif kind == 3:  # nodes where the incumbent and the LP relaxation disagree
            weights = (x != guide).astype(np.float64)
            kind = 2
        else:
            weights = None
        if kind == 4:
            free = _component_neighbourhood(flat, int(size), rng, decision, comp, weights)
        else:
            free = neighbourhood(flat, int(size), rng, decision, kind, weights)
        sub = subproblem(flat, free, x, prof)
        before = evaluate(sub, x[free])
        y, after, optimal, used = solve_neighbourhood(sub, x[free], min(step_limit, budget - spent + 1e-3), seed + step)
        spent += used
        step += 1
        if log is not None:
            log.append((kind, len(free), optimal, before - after if y is not None else 0.0, used))
        if y is not None and after < before - 1e-9 * max(1.0, abs(before)):
            if prof is not None:
                prof = _moved_profile(flat, prof, free, x[free], y)
            x[free] = y
            cost += after - before
            stats["lns_improvements"] += 1
            if progress is not None:
                progress("LNS", cost + offset, lower_bound)
        if optimal:
            size = min(float(n_dec), size * 1.15 + 1)
        else:
            size = max(8.0, size * 0.85)
    cost = evaluate(flat, x)  # exact, without the rounding of the running sum
    stats["lns_steps"] = step
    stats["lns_final_size"] = int(size)
    stats["lns_deterministic_s"] = round(spent, 3)
    return x, cost, stats


# -- repairing forbidden pairs ------------------------------------------------------------


def forbidden_components(flat: Flat) -> np.ndarray:
    """Per node, its component in the graph of edges that have a forbidden entry.

    Forbidden pairs only couple nodes within one such component, so a
    component can be made consistent on its own with every other node held.
    """
    forb = np.array([not np.isfinite(t).all() for t in flat.tables], dtype=bool)
    return component_labels(flat.n, flat.eu[forb], flat.ev[forb])


def violated_edges(flat: Flat, x: np.ndarray) -> np.ndarray:
    """Indices of the edges whose chosen pair is forbidden in ``x``."""
    return np.array([k for k, t in enumerate(flat.tables) if not np.isfinite(t[x[flat.eu[k]], x[flat.ev[k]]])],
                    dtype=np.int64)


def _ball(flat: Flat, seeds: list[int], allowed: np.ndarray, size: int) -> np.ndarray:
    """Breadth-first ball of at most ``size`` nodes from ``seeds`` along edges, within ``allowed``."""
    seen = np.zeros(flat.n, dtype=bool)
    order = []
    for s in seeds:
        if not seen[s]:
            seen[s] = True
            order.append(s)
    head = 0
    while head < len(order) and len(order) < size:
        i = order[head]
        head += 1
        for _, j, _ in flat.adj[i]:
            if allowed[j] and not seen[j]:
                seen[j] = True
                order.append(j)
                if len(order) >= size:
                    break
    return np.array(sorted(order), dtype=np.int64)


def _component_neighbourhood(flat: Flat, size: int, rng: np.random.Generator, decision: np.ndarray,
                             comp: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The component (of forbidden-bearing edges) of a node drawn by ``weights``, grown along edges to ``size``.

    A component larger than ``size`` gives a ball of ``size`` nodes inside it.
    """
    w = np.where(decision, weights, 0.0)
    if float(w.sum()) <= 0:
        w = decision.astype(np.float64)
    seed = int(rng.choice(flat.n, p=w / w.sum()))
    members = np.flatnonzero((comp == comp[seed]) & decision)
    if len(members) >= size:
        return _ball(flat, [seed], (comp == comp[seed]) & decision, size)
    return _ball(flat, [seed] + [int(i) for i in members if i != seed], decision, size)


def repair_forbidden(flat: Flat, x: np.ndarray, *, budget: float, seed: int = 0,
                     wall_limit: float | None = None) -> tuple[np.ndarray, float, dict]:
    """Make ``x`` free of forbidden pairs, one component of forbidden-bearing edges at a time.

    ``x`` must respect memory (e.g. least usage, then ICM on the softened
    problem). For every component holding a forbidden pair (in the order of
    the edges that break one), its nodes (a ball around the pair when the component has more
    than ``REPAIR_MAX_NODES``) are freed and solved exactly by CP-SAT with
    everything else held, forbidden pairs and memory hard, the true costs as
    objective. Every such component is visited whatever ``budget`` says
    (it only sets how long each solve may take, at least 0.05 s): a valid
    assignment matters more than the time limit. Returns the new assignment,
    the deterministic work spent and stats (``repair_left``: forbidden pairs
    still present).
    """
    started = time.perf_counter()
    x = np.asarray(x, dtype=np.int64).copy()
    stats = {"repair_components": 0, "repair_left": 0}
    bad = violated_edges(flat, x)
    if not len(bad):
        return x, 0.0, stats
    comp = forbidden_components(flat)
    decision = np.array([len(c) > 1 for c in flat.costs])
    prof = profile(flat, x) if len(flat.capacity) else None
    spent = 0.0
    done: set[int] = set()
    for k in bad:
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break  # only the wall-clock safety net stops it: the budget shapes each solve, not their number
        u, v = int(flat.eu[k]), int(flat.ev[k])
        if np.isfinite(flat.tables[k][x[u], x[v]]):
            continue  # an earlier repair fixed it
        c = int(comp[u])
        members = (comp == c) & decision
        if c in done or members.sum() > REPAIR_MAX_NODES:
            free = _ball(flat, [u, v], decision, REPAIR_MAX_NODES)
        else:
            free = np.flatnonzero(members)
        done.add(c)
        if not len(free):
            continue
        sub = subproblem(flat, free, x, prof)
        limit = min(1.0 + 0.01 * len(free), max(0.05, budget - spent))
        y, _, _, used = solve_neighbourhood(sub, x[free], limit, seed + len(done))
        spent += used
        stats["repair_components"] += 1
        if y is None:
            continue
        if prof is not None:
            prof = _moved_profile(flat, prof, free, x[free], y)
        x[free] = y
    stats["repair_left"] = int(len(violated_edges(flat, x)))
    stats["repair_deterministic_s"] = round(spent, 3)
    return x, spent, stats


def component_descent(flat: Flat, x: np.ndarray, *, budget: float, seed: int = 0, max_sweeps: int = 4,
                      wall_limit: float | None = None) -> tuple[np.ndarray, float, float, dict]:
    """Block coordinate descent over the components of forbidden-bearing edges.

    Components are visited by decreasing excess cost (``excess_costs``); each
    is freed with about ``DESCENT_GROW`` nodes around it (a ball of
    ``DESCENT_MAX_NODES`` around its costliest node when bigger) and solved by
    CP-SAT, everything else held. Functional edges make a component's nodes
    change together, which single-node moves and random balls rarely manage:
    on IOPDDL P one sweep halves the cost of the least-usage start. Sweeps
    repeat (up to ``max_sweeps``) while one gains at least 0.1% and budget is left.
    ``x`` must be feasible. Returns (assignment, cost, deterministic work, stats).
    """
    started = time.perf_counter()
    x = np.asarray(x, dtype=np.int64).copy()
    cost = evaluate(flat, x)
    stats = {"descent_steps": 0, "descent_improvements": 0}
    if not math.isfinite(cost):
        return x, cost, 0.0, stats
    comp = forbidden_components(flat)
    decision = np.array([len(c) > 1 for c in flat.costs])
    spent = CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    prof = profile(flat, x) if len(flat.capacity) else None
    for sweep in range(max_sweeps):
        swept = cost
        x, cost, spent = _descent_sweep(flat, x, cost, comp, decision, prof, budget, spent, seed, stats, started, wall_limit)
        if len(flat.capacity):
            prof = profile(flat, x)
        stats["descent_sweeps"] = sweep + 1
        if spent >= budget or cost >= swept - 1e-3 * abs(swept):
            break
    cost = evaluate(flat, x)
    stats["descent_deterministic_s"] = round(spent, 3)
    return x, cost, spent, stats


def _descent_sweep(flat: Flat, x: np.ndarray, cost: float, comp: np.ndarray, decision: np.ndarray,
                   prof: np.ndarray | None, budget: float, spent: float, seed: int, stats: dict, started: float,
                   wall_limit: float | None) -> tuple[np.ndarray, float, float]:
    """One pass of ``component_descent`` (``x`` is updated in place); returns (x, cost, work spent so far)."""
    excess = excess_costs(flat, x)
    spent += CHARGE_PER_ITEM * (flat.n + len(flat.tables))
    total = np.bincount(comp, weights=excess)
    for c in np.argsort(-total, kind="stable"):
        if total[c] <= 0 or spent >= budget:
            break
        if wall_limit is not None and time.perf_counter() - started > wall_limit:
            break
        inside = (comp == c) & decision
        members = np.flatnonzero(inside)
        if not len(members):
            continue
        if len(members) > DESCENT_MAX_NODES:
            free = _ball(flat, [int(members[np.argmax(excess[members])])], inside, DESCENT_MAX_NODES)
        else:
            free = _ball(flat, [int(i) for i in members], decision, max(len(members), DESCENT_GROW))
        sub = subproblem(flat, free, x, prof)
        before = evaluate(sub, x[free])
        limit = min(1.0, max(0.05, budget - spent))
        y, after, _, used = solve_neighbourhood(sub, x[free], limit, seed + stats["descent_steps"])
        spent += used
        stats["descent_steps"] += 1
        if y is not None and after < before - 1e-9 * max(1.0, abs(before)):
            if prof is not None:
                prof = _moved_profile(flat, prof, free, x[free], y)
            x[free] = y
            cost += after - before
            stats["descent_improvements"] += 1
    return x, cost, spent
