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
(``add_edge_costs``): one integer ``cost_uv`` per edge and, for every
strategy ``a`` of the endpoint with fewer strategies,
``x[u, a] => cost_uv >= sum_b R[a, b] x[v, b]``. (One Boolean per positive
residual, ``y[a, b] >= x[u, a] + x[v, b] - 1``, is the textbook alternative;
it made every IOPDDL and planner model larger and slower, so it is not built.)

Memory (``add_memory_limit``): usages are measured above each node's least
usage (``du``), single-usage nodes move into ``cap_t`` (the limit minus their
usage), time steps are grouped into segments where the live set does not
change, and a segment's constraint is dropped when a neighbouring segment's
implies it or when it cannot bind (see ``flat.flatten``).

Costs become integers: ``floor(c * scale)`` with ``scale`` chosen so that the
reference cost (the warm start, or a crude upper bound) maps to about
``1e9``; entries above ``16x`` that reference are capped there (a solution
paying one is worse than the reference, so the optimum is unchanged). Flooring
keeps CP-SAT's objective bound a valid lower bound in the problem's units.

Solving (``solve_cpsat`` for a whole model, ``solve_neighbourhood`` for the
sub-problems of the searches in ``search``): the warm start is a complete
hint; ``interleave_search`` with a fixed ``random_seed`` makes the run
deterministic, and the limit is CP-SAT's deterministic time, so the same
problem and options give the same answer byte for byte
(``max_time_in_seconds`` is a wall-clock safety net at a multiple of it).
CP-SAT's own LNS workers take part in the interleaved portfolio.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from shardsolve.encodings.flat import Flat, evaluate, prune

__all__ = ["CpSatResult", "CpSatEncoding", "solve_cpsat", "solve_neighbourhood", "solve_with_rows", "solve_feasibility",
           "reduce_table"]

#: The reference cost maps to about this many integer units. Larger scales (1e12)
#: made CP-SAT 9.15's presolve return a wrong "optimal" on small random models
#: (tests/test_solver.py::test_cpsat_and_z3_agree found it); 1e9 keeps flooring
#: error below one part in 1e9 per term.
TARGET_UNITS = 1e9
#: Wall-clock safety net: this multiple of the deterministic limit, plus a few seconds.
WALL_FACTOR = 3.0
#: Deterministic charge (seconds) per model variable or term built, covering Python and presolve work.
#: With the two below, fitted to the wall time of 500 neighbourhood solves on IOPDDL K and S (2 cores,
#: light load): wall ~ 2.2 deterministic + 9.6e-6 per term + 0.029 s; a little above that, for IOPDDL V.
CHARGE_PER_TERM = 1e-5
#: A neighbourhood's CP-SAT deterministic time is charged this many times over: on models with
#: long memory constraints (IOPDDL K, P, S) CP-SAT's wall time runs several times its deterministic time.
NEIGHBOURHOOD_FACTOR = 2.5
#: Deterministic charge (seconds) per neighbourhood, whatever its size.
CHARGE_PER_STEP = 0.03
#: A neighbourhood solve's own wall-clock net: this multiple of its deterministic limit plus a few
#: seconds (capped by the caller's net). Generous, so that load on the machine does not cut a solve
#: (which would make the search depend on the load).
NEIGHBOURHOOD_WALL_FACTOR = 10.0
NEIGHBOURHOOD_WALL_EXTRA = 5.0


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

    def __init__(self, flat: Flat, reference_cost: float, *, objective: bool = True):
        self.flat = flat
        self.model = cp_model.CpModel()
        self.x: list[list[cp_model.IntVar]] = []
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
        if objective:  # else a feasibility model: forbidden pairs and memory only
            self.add_edge_costs()
        self.add_memory_limit()
        if objective:
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
        """Positive residuals: one cost variable per edge, bounded below by a conditional sum per row."""
        for k, r in enumerate(self.residuals):
            u, v = int(self.flat.eu[k]), int(self.flat.ev[k])
            w = self.units(r)
            positive = np.isfinite(r) & (w > 0)
            count = int(positive.sum())
            if count == 0:
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
        """A complete hint: node choices and edge cost variables."""
        for i, xs in enumerate(self.x):
            for s, var in enumerate(xs):
                self.model.add_hint(var, int(s == assignment[i]))
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


def _neighbourhood_solver(limit: float, seed: int, wall_limit: float | None) -> cp_model.CpSolver:
    """One worker, a deterministic limit, and a wall-clock net (``wall_limit`` caps it: the caller's net)."""
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.catch_sigint_signal = False  # as in solve_cpsat
    params.random_seed = int(seed)
    params.num_workers = 1
    params.max_deterministic_time = float(limit)
    net = NEIGHBOURHOOD_WALL_FACTOR * float(limit) + NEIGHBOURHOOD_WALL_EXTRA
    params.max_time_in_seconds = net if wall_limit is None else max(0.05, min(net, float(wall_limit)))
    params.symmetry_level = 0
    params.linearization_level = 0  # the LP relaxation costs more wall time than it saves on small neighbourhoods
    return solver


def _pruned_hint(flat: Flat, maps: tuple[np.ndarray, ...], hint: np.ndarray) -> np.ndarray:
    """``hint`` in the pruned strategy indices (a pruned-away choice becomes the node's cheapest)."""
    return np.array([int(np.flatnonzero(m == h)[0]) if (m == h).any() else int(np.argmin(flat.costs[i]))
                     for i, (m, h) in enumerate(zip(maps, hint))], dtype=np.int64)


def solve_neighbourhood(flat: Flat, hint: np.ndarray, limit: float, seed: int,
                        wall_limit: float | None = None) -> tuple[np.ndarray | None, float, bool, float]:
    """Solve a (sub)problem from a hint, which may be infeasible.

    ``limit`` is CP-SAT's deterministic time; ``wall_limit`` the caller's
    wall-clock net (seconds left), when it has one. Returns (assignment or
    None, its cost, proven optimal, deterministic work charged).
    """
    full = flat
    flat, maps = prune(flat)
    hint = _pruned_hint(flat, maps, hint)
    hint_cost = evaluate(flat, hint)
    encoding = CpSatEncoding(flat, hint_cost)
    encoding.add_hint(hint)
    solver = _neighbourhood_solver(limit, seed, wall_limit)
    status = solver.solve(encoding.model)
    used = NEIGHBOURHOOD_FACTOR * solver.deterministic_time + CHARGE_PER_STEP + CHARGE_PER_TERM * encoding.size
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = encoding.decode(solver)
        x = np.array([m[s] for m, s in zip(maps, x)], dtype=np.int64)
        return x, evaluate(full, x), status == cp_model.OPTIMAL, used
    return None, math.inf, False, used


def solve_with_rows(flat: Flat, hint: np.ndarray, rows: np.ndarray, rhs: np.ndarray, limit: float, seed: int,
                    wall_limit: float | None = None) -> tuple[np.ndarray | None, float, bool, float, float]:
    """``solve_neighbourhood`` (without its pruning) with extra linear constraints ``rows @ b <= rhs``; returns
    (assignment or None, its cost, proven optimal, work, CP-SAT's certified lower bound or -inf).

    ``b`` is every node's strategy indicator, node after node (``rows`` has one column per strategy of
    ``flat``, integers). The memory limit over groups (``grouped``) comes in this way: a group's usage
    at a segment is not one interval's, so it does not fit ``Flat``'s memory model.
    """
    encoding = CpSatEncoding(flat, evaluate(flat, hint))
    encoding.add_hint(hint)
    flat_vars = [v for xs in encoding.x for v in xs]
    for row, bound in zip(rows, rhs):
        nz = np.flatnonzero(row)
        encoding.size += len(nz)
        if len(nz):
            encoding.model.add(cp_model.LinearExpr.weighted_sum([flat_vars[k] for k in nz],
                                                                 [int(row[k]) for k in nz]) <= int(bound))
        elif bound < 0:
            encoding.model.add_bool_or([])
    solver = _neighbourhood_solver(limit, seed, wall_limit)
    status = solver.solve(encoding.model)
    used = NEIGHBOURHOOD_FACTOR * solver.deterministic_time + CHARGE_PER_STEP + CHARGE_PER_TERM * encoding.size
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = encoding.decode(solver)
        return x, evaluate(flat, x), status == cp_model.OPTIMAL, used, encoding.bound(solver.best_objective_bound)
    return None, math.inf, False, used, -math.inf


def solve_feasibility(flat: Flat, hint: np.ndarray, limit: float, seed: int,
                      wall_limit: float | None = None) -> tuple[np.ndarray | None, str, float]:
    """Any assignment that satisfies forbidden pairs and memory: CP-SAT without objective, pruned domains.

    ``hint`` (e.g. least usage after a repair that left some forbidden
    pairs) guides the search and is repaired (``repair_hint``). Returns
    (assignment or None, CP-SAT's status name, deterministic work charged):
    ``"INFEASIBLE"`` is a proof that no valid assignment exists.
    """
    full = flat
    flat, maps = prune(flat)
    encoding = CpSatEncoding(flat, math.inf, objective=False)
    encoding.add_hint(_pruned_hint(flat, maps, hint))
    solver = _neighbourhood_solver(limit, seed, wall_limit)
    solver.parameters.repair_hint = True
    status = solver.solve(encoding.model)
    used = solver.deterministic_time + CHARGE_PER_STEP + CHARGE_PER_TERM * encoding.size
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = np.array([m[s] for m, s in zip(maps, encoding.decode(solver))], dtype=np.int64)
        if math.isfinite(evaluate(full, x)):
            return x, solver.status_name(status), used
    return None, solver.status_name(status), used
