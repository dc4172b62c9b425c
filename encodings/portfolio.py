"""``solve``: the phases that take a problem to its best assignment and a certified bound.

::

    problem --presolve.reduce--> reduced problem --flat.flatten--> arrays
    lp_relaxation      up to 5,000 nodes: first a TRW-S probe (memory relaxed) that reads off an assignment
                       every 16 passes, optimal where the bound meets it (planner problems, in about a
                       hundred passes); else, where they fit, the LP with memory (HiGHS) over the entries
                       the probe's reduced costs leave an assignment cheaper than its own, a certified
                       bound and a guide; an integral LP whose rounding costs its value is optimal
    solve_mip          the LP solved and fractional: the same polytope with integral strategies, HiGHS's
                       branch and cut (``mip``) for ``MIP_SHARE`` of the budget; optimal where it proves it,
                       else its plan and bound go on
    solve_tiny         <= 60 decisions: CP-SAT on the whole model, exactly (milliseconds)
    warm_starts        heuristics (least usage, Lagrangian forest DP, repair, ICM); where the LP is
                       skipped (up to 5,000 nodes) TRW-S decodings, repaired; the LP rounded, its
                       fractional nodes solved exactly
    find_feasible      nothing valid yet (large problems): least usage, ICM on the softened problem,
                       an exact repair of every component of forbidden-bearing edges that still holds
                       a forbidden pair, LNS on the softened problem for what is left, and last CP-SAT
                       on feasibility alone over pruned domains (which may prove there is none)
    solve_whole        <= 400 decisions and 5,000 strategies (or nothing valid yet): the whole model,
                       hinted, for a share of the budget (may prove optimality)
    dive               no memory constraint binds and the probe's bound is more than ``DIVE_MIN_GAP`` below
                       the incumbent (a loose LP): every strategy of the node holding most of the gap
                       bounded by a few TRW-S passes with that node held, the least of them a bound; the
                       branches of least bound searched by TRW-S alone, an assignment read off at each
                       check (a change of many nodes at once: the pod-mesh GPT-2's attention moved from
                       one mesh axis to another, 10% faster)
    lagrangian         no LP and memory binds: the memory constraints priced (``lagrange.dual_ascent``,
                       ``LAGRANGE_SHARE`` of the budget): TRW-S on the priced costs, a certified bound;
                       each step's decoding, repaired and polished by group moves, a start; the decoding
                       at the best bound guides the LNS where no LP rounding does
    certify            no LP and no prices: TRW-S message passing, memory relaxed, for a share of the budget
                       (unless the probe ran as many passes), and min-sum diffusion; the larger
    improve            vectorised group moves (``moves``: every node or small component of forbidden-bearing
                       edges at once, two-node moves, a falling price on usage where memory binds); where
                       few groups have a choice, all of them at once in one CP-SAT model, memory exact
                       (``grouped``, memory rows added as its answers overfill segments); above
                       400 decisions two sweeps of component descent; then large-neighbourhood search in
                       three chunks, each going on at the neighbourhood size and step limit the one before
                       reached; group moves again after each
    --lift--> assignment of the original problem, cost from ``Problem.evaluate``

Each phase is one method of :class:`Portfolio`, which holds the incumbent,
the bound and the budget left. Time limits are *deterministic* work budgets
in seconds (CP-SAT's deterministic time, a fixed charge per model term built,
per node, edge, table entry and dominance comparison of the reductions
(``presolve.reduce``), per LP variable, per node, edge and table entry visited by a
pass (``flat.sweep_charge``), per entry touched by the vectorised moves): every phase charges what it
did (``stats["phases"]``: wall seconds and work per phase), a phase whose
charge the budget left cannot cover is skipped (the LP, the Lagrangian rounds
of the warm start, the whole model, TRW-S, diffusion, the descent), and the
wall clock is only a safety net at ``WALL_SLACK * time_limit + WALL_EXTRA``
seconds (or the caller's ``wall_limit``). Only a valid answer comes before
both: with nothing valid yet, the forbidden-pair repair and CP-SAT's search
for one run past them. A solve keeps Python's cyclic collector off the
objects alive when it starts (``frozen_heap``), so that its wall time does
not grow with its caller's heap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from shardsolve.encodings import bounds, cpsat, dive, grouped, heuristics, lagrange, mip, moves, search
from shardsolve.encodings.flat import (CHARGE_PER_ITEM, Flat, evaluate, evaluation_charge, flatten, softened,
                                       subproblem, sweep_charge)
from shardsolve.encodings.presolve import Reduced, reduce
from shardsolve.errors import InfeasibleError, Interrupted, ShardsolveError
from shardsolve.problem import MEMORY_LIMIT_LABEL, Problem, Solution

__all__ = ["solve", "explain_infeasible", "Portfolio", "DEFAULT_TIME_LIMIT"]

#: Budget when ``time_limit`` is None.
DEFAULT_TIME_LIMIT = 30.0
#: Problems with at most this many decision nodes (after reduction) are solved whole, exactly.
TINY_NODES = 60
#: Up to this many decision nodes the whole model also gets a share of the budget after the warm start.
EXACT_NODES = 400
#: ... and at most this many strategies in all (IOPDDL V, 10k strategies on 294 nodes, gains nothing from it).
EXACT_STRATEGIES = 5000
#: ... once a valid start is in hand, only where a tenth of the budget left is at least this many seconds (the
#: model's CP-SAT deterministic time is charged ``cpsat.NEIGHBOURHOOD_FACTOR`` times over: wall time runs at
#: about twice it on planner problems).
WHOLE_MIN = 0.25
#: The TRW-S probe runs up to this many nodes, and the LP relaxation after it (over the entries the probe
#: leaves, where they are at most ``bounds.LP_MAX_PAIRS`` pair variables).
LP_MAX_NODES = 5000
#: Above this many nodes (after reduction) the Python heuristics are skipped.
LARGE_NODES = 5000
#: Deterministic charge (seconds) per LP variable (node strategy or allowed pair): HiGHS's dual simplex took
#: 3e-5 to 7e-5 s a variable on planner problems of 9k to 255k variables (twice as long on one run as on
#: another). The LP runs only where this charge is within ``LP_SHARE`` of the budget left: its bound, and
#: where it is integral its proof, are what a pruned problem (tying's untied bound) is solved for.
LP_CHARGE = 6e-5
LP_SHARE = 0.8
#: The MIP over the LP's polytope (``mip.solve_mip``, where the LP is fractional): its root (presolve, the LP,
#: cuts) charged this many LP charges (a GRU step's 9k variables: LP 0.23 s, MIP root 1.5 to 3.3 s), each
#: branch-and-bound node this many; it runs where its root fits in ``MIP_SHARE`` of the budget left, with a node
#: limit that keeps it there.
MIP_ROOT_CHARGES = 10.0
MIP_NODE_CHARGES = 0.5
MIP_SHARE = 0.5
#: TRW-S before the LP (``Portfolio.trws_probe``): at most this many passes and this share of the budget,
#: an assignment read off every ``PROBE_DECODE_EVERY`` passes.
PROBE_PASSES = 800
PROBE_SHARE = 0.5
PROBE_DECODE_EVERY = 16
#: ... where at least this share of the pair entries is allowed: over a problem already pruned (tying's untied
#: bound prunes before it solves), the LP over the few allowed entries costs less than TRW-S's passes over whole
#: tables (planner problems and IOPDDL B, G, V allow 76% to 89%; pruned ones 22% to 27%).
PROBE_MIN_DENSITY = 0.5
#: Share of the budget left that ``dive`` (branching on the node that holds most of the probe's gap) may spend.
DIVE_SHARE = 0.5
#: ... where the probe's bound is further below the incumbent than this share of its cost (a loose LP: on planner
#: problems with a tight one the probe proves the optimum, or leaves a fraction of a percent to the search).
DIVE_MIN_GAP = 0.01
#: Share of the remaining budget for ``search.component_descent`` (sweeps) before the LNS.
DESCENT_SHARE = 0.6
#: The descent's share is spent in this many sweeps, each followed by group moves; the LNS in this many chunks.
DESCENT_SWEEPS = 2
LNS_CHUNKS = 3
#: ``grouped.solve_grouped`` (the whole problem over groups, memory exact, where functional edges leave at most
#: ``grouped.GROUPED_MAX_CONFIGS`` configs to choose from): CP-SAT's deterministic time per round of memory
#: rows, and the share of the budget left its rounds may use (IOPDDL P: three rounds, 19 s of work of the 26 s
#: this share leaves; with 0.3 of it the third round did not fit).
GROUPED_STEP = 2.0
GROUPED_SHARE = 0.5
#: Vectorised one-node moves before and after the component descent: at most this many rounds, and this share
#: of the budget left.
MOVE_ROUNDS = 200
MOVE_SHARE = 0.05
#: Wall seconds the forbidden-pair repair of ``find_feasible`` may take even where the solver's own safety net
#: is spent (a caller's ``wall_limit`` is held): with nothing valid yet, a valid answer comes first (CP-SAT's
#: feasibility model, the next resort, takes minutes to build on the large instances).
FEASIBILITY_WALL = 60.0
#: With nothing valid after the starts, the LP left out for the budget runs past it where it charges at most
#: ``FEASIBILITY_LP`` seconds of work (a small problem under a tight memory limit, solved in a share of a
#: second), for at most that many wall seconds past the safety net, and its rounding gets at least
#: ``FEASIBILITY_ROUNDING`` seconds of CP-SAT's deterministic time, and as many wall seconds past the net.
FEASIBILITY_LP = 5.0
FEASIBILITY_ROUNDING = 3.0
#: ``heuristics.warm_start``: at most this many rounds, within this share of the budget left, a round
#: charged as this many Python passes over nodes and edges (1 to 5.5 measured on planner problems).
WARM_ROUNDS = 12
WARM_SHARE = 0.2
WARM_ROUND_PASSES = 5
#: TRW-S warm starts (where no LP guides): further usage penalties are tried while their work is within this
#: share of the budget left (``search.trws_starts``).
TRWS_START_SHARE = 0.5
#: The caller's start: its repair of forbidden pairs stops past this share of the budget left where a valid
#: assignment is in hand already (``Portfolio.from_start``).
START_REPAIR_SHARE = 0.5
#: The memory constraints' Lagrangian dual (``lagrange.dual_ascent``, where memory binds and no LP guides): this
#: share of the budget left, its starts polished by group moves within it.
LAGRANGE_SHARE = 0.4
#: Min-sum diffusion (``bounds.dual_bound``) after the TRW-S bound, where the LP is skipped: this many sweeps.
DIFFUSION_SWEEPS = 50
#: TRW-S bound (where the LP is skipped): at most this many passes, and this share of the budget.
TRWS_PASSES = 1000
TRWS_SHARE = 0.12
#: ... and above ``LARGE_NODES`` nodes (where the search gains more from the time).
TRWS_SHARE_LARGE = 0.03
#: Wall-clock safety net: ``WALL_SLACK * time_limit + WALL_EXTRA`` seconds, after which every stage
#: stops at its next check (the final lift and evaluation still run).
WALL_SLACK = 1.05
WALL_EXTRA = 1.0
#: Work units a second of ``time_limit`` buys. The charges (CP-SAT's deterministic time, per-entry and per-pass
#: charges) run ahead of the wall clock on the reference machine (2 cores): the search stopped at about half
#: its limit. Scaled, it works for about the limit while the wall-clock net above still holds.
WORK_PER_SECOND = 1.5


def wall_net(time_limit: float) -> float:
    """The wall-clock safety net, in seconds, of a work budget of ``time_limit`` seconds."""
    return WALL_SLACK * time_limit + WALL_EXTRA


_FROZEN = [0]  # depth of nested ``frozen_heap`` blocks


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive on entry to any such block left out of Python's cyclic collector until the outermost
    block ends.

    A full collection walks every tracked object; in a planner process, which
    holds the traced program and the built problem (millions of objects),
    one such pass during a solve took 6 s of its wall-clock net (and 0.17 s
    of pricing a 12-layer GPT-2 plan). Frozen (``gc.freeze``), they are not
    walked; the solve's own garbage still is. ``freeze_alive`` freezes more
    inside a block.
    """
    _FROZEN[0] += 1
    gc.freeze()
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if _FROZEN[0] == 0:
            gc.unfreeze()


def freeze_alive() -> None:
    """Inside ``frozen_heap``, the objects alive now left out of the collector too (until the outermost block
    ends); outside, nothing."""
    if _FROZEN[0]:
        gc.freeze()


#: Largest problem ``explain_infeasible`` hands to z3 (node strategies).
EXPLAIN_MAX_STRATEGIES = 20_000
#: z3's checks for the conflict of an infeasible answer take at most the wall-clock net the solve has left, and
#: at least this many seconds (a short net still names a conflict found in a second or two);
#: ``explain_infeasible`` called on its own, at most ``EXPLAIN_S``.
EXPLAIN_MIN_S = 2.0
EXPLAIN_S = 60.0

Progress = Callable[[str, float, float], None]


def _quiet(message: str, best: float, bound: float) -> None:
    return None


def interruptible(search: Callable[..., Solution]) -> Callable[..., Solution]:
    """Turn a ``KeyboardInterrupt`` during ``search`` into ``errors.Interrupted`` carrying the best so far.

    ``search`` gets one more keyword, ``incumbent``: a dict it keeps holding
    ``"solution"``, a function returning the best complete assignment found so far
    as a ``Solution`` of the original problem with status ``"interrupted"``.
    """

    def run(problem: Problem, **options) -> Solution:
        incumbent: dict = {}
        try:
            return search(problem, incumbent=incumbent, **options)
        except Interrupted:
            raise
        except KeyboardInterrupt:
            best = incumbent.get("solution")
            raise Interrupted(best() if best is not None else None) from None

    run.__doc__, run.__name__, run.__wrapped__ = search.__doc__, search.__name__, search
    return run


@interruptible
def solve(
    problem: Problem,
    *,
    time_limit: float | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: Progress | None = None,
    incumbent: dict | None = None,
    wall_limit: float | None = None,
    start: Sequence[int] | None = None,
    explain: bool = True,
) -> Solution:
    """Pick one strategy per node, minimising cost under pins and the memory limit.

    ``time_limit``: seconds (default 30), bought as a deterministic work budget of ``WORK_PER_SECOND``
    units each (the solver's charges, so that the same input gives the same answer); ``wall_limit``:
    the wall-clock safety net in seconds from the call (default
    ``1.05 * time_limit + 1``; a caller running several solves in one limit
    passes what is left of its own net). With nothing valid found, the
    default net gives way to a first valid answer (``FEASIBILITY_WALL``,
    ``FEASIBILITY_LP``, ``FEASIBILITY_ROUNDING`` seconds past it); a
    ``wall_limit`` passed is held (its caller has other answers, or time
    to share). ``seed``:
    the random seed of every randomised step; ``workers``: CP-SAT threads for
    whole-model solves (default 1; results stay deterministic either way);
    ``progress(message, best_cost, lower_bound)`` is called as the search improves.
    ``start``: an assignment of ``problem`` to search from (a plan solved
    without the memory limit, say): made valid where it is not (memory first,
    then forbidden pairs, as the solver's own starts are) and kept as a
    start, so a valid ``start`` is never beaten by the answer.
    ``explain=False``: an infeasible answer comes without its ``conflict``
    (z3's search for it, within the net left, is skipped), for callers that
    do not report it.

    Determinism and wall time trade off. The budget is calibrated so that an
    idle machine spends it in about ``time_limit`` seconds; a run that does
    so is deterministic. The wall clock is only a safety net, at
    ``1.05 * time_limit + 1`` seconds (then every stage stops at its next
    check, and the final lift and evaluation take a few seconds more on the
    largest problems): on a loaded machine the net ends the search first, so
    the run takes about the limit in wall time, but where it stops, and so
    the result, depends on the load. A larger net would keep such runs
    deterministic at the price of overrunning the limit (by 1.5 times with a
    net at 1.5 times); callers who want determinism on a loaded machine
    should pass a smaller ``time_limit``.

    Returns a :class:`Solution` whose ``cost`` is ``problem.evaluate(assignment)``
    and whose ``lower_bound`` is certified. ``status``: ``"optimal"``,
    ``"feasible"``, ``"infeasible"`` (with ``conflict`` when it could be
    explained) or ``"unknown"`` (nothing feasible found in the budget).
    Ctrl-C raises ``errors.Interrupted`` with the best complete solution so
    far (status ``"interrupted"``), or none.
    """
    started = time.perf_counter()
    try:
        problem.validate()
    except ValueError as exc:
        raise ShardsolveError(f"invalid problem {problem.name!r}: {exc}") from None
    seconds = DEFAULT_TIME_LIMIT if time_limit is None else max(0.0, float(time_limit))
    budget = WORK_PER_SECOND * seconds
    if start is not None and len(start) != len(problem.nodes):
        raise ShardsolveError(f"start has {len(start)} strategies, but problem {problem.name!r} has "
                              f"{len(problem.nodes)} nodes; pass one strategy index per node")
    try:
        reduced = reduce(problem)
    except InfeasibleError:
        net = wall_net(seconds) if wall_limit is None else wall_limit
        return infeasible_solution(problem, started, {"reduced": False}, net - (time.perf_counter() - started)
                                   if explain else None)
    with frozen_heap():
        return Portfolio(problem, reduced, budget, started, seed=seed, workers=workers, progress=progress,
                         incumbent=incumbent, wall_limit=wall_limit, start=start, explain=explain).run()


def infeasible_solution(problem: Problem, started: float, stats: dict, explain_s: float | None) -> Solution:
    """``status="infeasible"``, with the conflicting constraints where z3 names them in ``explain_s`` seconds
    (at least ``EXPLAIN_MIN_S``; None: not looked for)."""
    conflict = () if explain_s is None else explain_infeasible(problem, max(EXPLAIN_MIN_S, explain_s))
    return Solution((), math.inf, math.inf, "infeasible", time.perf_counter() - started, tuple(conflict), stats)


def explain_infeasible(problem: Problem, seconds: float = EXPLAIN_S) -> tuple[str, ...]:
    """Labels of a minimal set of pins, plus ``MEMORY_LIMIT_LABEL`` when the memory limit is part of it.

    Empty when the problem is feasible, infeasible without any pin or the
    memory limit (its forbidden costs alone conflict), larger than
    ``EXPLAIN_MAX_STRATEGIES``, or where z3's checks take more than
    ``seconds`` (a set that conflicts but may not be minimal where only
    their shrinking does).
    """
    if problem.num_strategies > EXPLAIN_MAX_STRATEGIES:
        return ()
    # z3 (0.3 s to load) is loaded only when a conflict is to be explained.
    from shardsolve.encodings import smt

    if problem.usage_limit is not None:
        # The common case at once: the reductions prove the limit too tight with no pin at all (every node at
        # its least usage already over it), so the memory limit alone conflicts where the rest is satisfiable.
        try:
            reduce(dataclasses.replace(problem, pins=()))
        except InfeasibleError:
            bare = dataclasses.replace(problem, pins=(), usage_limit=None)
            return (MEMORY_LIMIT_LABEL,) if smt.satisfiable(bare, timeout_ms=int(1000 * seconds)) else ()
    return smt.explain(problem, timeout_ms=int(1000 * seconds))


class Portfolio:
    """One run of ``solve`` on a reduced problem: the incumbent, the bound and the budget, phase by phase.

    ``run`` calls the phases in order; each returns a finished ``Solution``
    when it settles the problem (a proof of optimality or infeasibility) and
    ``None`` to go on. Costs inside are those of the reduced problem; ``finish``
    adds the reductions' offset and lifts the assignment.
    """

    def __init__(self, problem: Problem, reduced: Reduced, budget: float, started: float, *, seed: int = 0,
                 workers: int | None = None, progress: Progress | None = None, incumbent: dict | None = None,
                 wall_limit: float | None = None, start: Sequence[int] | None = None, explain: bool = True):
        self.problem = problem
        self.explain = explain  # an infeasible answer looks for its conflict
        self.start = None if start is None else reduced.project(start)  # -1: a strategy the reductions dropped
        self.incumbent = incumbent  # "solution": the best so far as an interrupted Solution (see interruptible)
        self.reduced = reduced
        self.started = started
        self.seed = seed
        self.threads = 1 if workers is None else max(1, int(workers))
        self.report = progress or _quiet
        self.total_budget = budget
        self.wall_limit = wall_net(budget / WORK_PER_SECOND) if wall_limit is None else max(0.0, float(wall_limit))
        self.held = wall_limit is not None  # a caller's net: no step runs past it (``past_net``)
        self.stats: dict = dict(reduced.stats)
        self.stats["reduce_s"] = round(time.perf_counter() - started, 3)
        self.budget = budget - reduced.stats.get("reduce_deterministic_s", 0.0)  # checking and reducing the input
        self.offset = reduced.offset
        self.flat: Flat = flatten(reduced.problem)
        self.decision = sum(1 for c in self.flat.costs if len(c) > 1)
        self.bound = bounds.trivial_bound(self.flat) if self.decision else -math.inf
        self.best_x: np.ndarray | None = None
        self.best_cost = math.inf
        self.guide: np.ndarray | None = None  # the LP relaxation rounded, where it was solved
        self.marginals: list[np.ndarray] | None = None
        self.probe: tuple | None = None  # (cost, bound, node terms, edge terms) of ``trws_probe``, without a proof
        self.root_terms: tuple | None = None  # (bound, node terms, edge terms) of the probe, for ``dive``
        self.lp_target: Flat | None = None  # the problem the LP solved (pruned by the probe), for the MIP
        self.lp_size = 0  # its LP's variables: node strategies and allowed pairs
        self.probe_passes = 0  # TRW-S passes the probe ran (its bound is in ``bound``)
        self.moves: moves.GroupMoves | None = None  # built on first use
        self.quotient_moves: moves.GroupMoves | None = None  # moves on the problem over groups (memory left out)
        # the assignment read off at the best priced bound of ``lagrangian`` (set where that bound is the bound)
        self.priced_guide: np.ndarray | None = None

    # -- bookkeeping -------------------------------------------------------------------------------

    def wall_left(self) -> float:
        return max(0.0, self.wall_limit - (time.perf_counter() - self.started))

    def past_net(self, seconds: float) -> float:
        """The wall seconds of a step that looks for a first valid answer: at least ``seconds``, past the net,
        where the net is the solver's own; a caller's ``wall_limit`` is held."""
        return self.wall_left() if self.held else max(self.wall_left(), seconds)

    def shifted(self, message: str, best: float, bound: float) -> None:
        """``progress`` in the original problem's units."""
        self.report(message, best + self.offset, bound + self.offset)

    def consider(self, x: np.ndarray | None, cost: float) -> None:
        if x is not None and cost < self.best_cost:
            self.best_x, self.best_cost = np.array(x, dtype=np.int64), cost  # a copy, never a caller's array
            if self.incumbent is not None:
                self.incumbent["solution"] = lambda x=self.best_x: self.interrupted(x)

    def interrupted(self, x: np.ndarray) -> Solution | None:
        """The ``Solution`` an interrupted search hands back: ``x`` lifted, its cost and the bound so far."""
        assignment = self.reduced.lift(x)
        cost = self.problem.evaluate(assignment)
        if not math.isfinite(cost):
            return None
        return Solution(tuple(int(s) for s in assignment), cost, min(self.bound + self.offset, cost), "interrupted",
                        time.perf_counter() - self.started, (), dict(self.stats))

    def finish(self, assignment, status: str, bound: float) -> Solution:
        """The ``Solution`` of the original problem (``bound`` in its units); never an invalid assignment."""
        started, stats = self.started, self.stats
        if assignment is None:
            return Solution((), math.inf, bound, status, time.perf_counter() - started, (), stats)
        cost = self.problem.evaluate(assignment)
        if not math.isfinite(cost):  # defensive: never report an invalid assignment as a solution
            return Solution((), math.inf, bound, "unknown", time.perf_counter() - started, (), stats)
        bound = min(bound, cost)
        if status != "optimal" and bound >= cost - 1e-9 * abs(cost):
            status = "optimal"
        if status == "optimal":
            bound = cost
        stats["wall_s"] = round(time.perf_counter() - started, 3)
        # deterministic, in seconds of ``time_limit``: a caller may hand it on
        stats["budget_left_s"] = round(max(0.0, self.budget) / WORK_PER_SECOND, 6)
        return Solution(tuple(int(s) for s in assignment), cost, bound, status, time.perf_counter() - started, (),
                        stats)

    def infeasible(self) -> Solution:
        return infeasible_solution(self.problem, self.started, self.stats, self.wall_left() if self.explain else None)

    # -- the phases --------------------------------------------------------------------------------

    def run(self) -> Solution:
        flat = self.flat
        if self.decision == 0:
            x = np.zeros(flat.n, dtype=np.int64)
            if not math.isfinite(evaluate(flat, x)):
                return self.infeasible()
            return self.finish(self.reduced.lift(x), "optimal", -math.inf)
        done = self.phase("lp", self.lp_relaxation)
        if self.probe is not None and not len(flat.binding):  # the probe's terms (a copy of every table) serve
            self.root_terms = self.probe[1:]  # the LP, and the dive where memory does not bind
        self.probe = None
        if done is None:
            done = self.phase("mip", self.solve_mip)
        self.lp_target = None
        if done is not None:
            return done
        if self.decision <= TINY_NODES:
            return self.phase("whole model", self.solve_tiny)
        self.phase("starts", self.warm_starts)
        skipped = self.stats.get("lp_skipped_charge_s", math.inf)
        if self.best_x is None and self.guide is None and skipped <= FEASIBILITY_LP:
            # nothing valid yet and the LP was left out for the budget: its rounding is the likeliest valid start
            done = self.phase("lp", lambda: self.lp_relaxation(force=True))
            if done is not None:
                return done
            if self.guide is not None:
                self.round_lp(least=FEASIBILITY_ROUNDING, wall=FEASIBILITY_ROUNDING)
        if self.best_x is None:
            done = self.phase("feasibility", self.find_feasible)
            if done is not None:
                return done
        done = self.phase("whole model", self.solve_whole)
        if done is not None:
            return done
        if self.best_x is None:
            return self.finish(None, "unknown", self.bound + self.offset)
        self.phase("dive", self.dive)
        self.root_terms = None
        if self.guide is None:
            self.phase("lagrangian", self.lagrangian)
            if self.priced_guide is None:  # memory not priced: the memory-relaxed bound
                self.phase("bounds", self.certify)
        self.phase("search", self.improve)
        return self.finish(self.reduced.lift(self.best_x), "feasible", self.bound + self.offset)

    def phase(self, name: str, step: Callable[[], Solution | None]) -> Solution | None:
        """Run one phase; its wall time and deterministic work go to ``stats["phases"]``, progress is reported."""
        wall, work = time.perf_counter(), self.budget
        done = step()
        spent = self.stats.setdefault("phases", {}).setdefault(name, {"wall_s": 0.0, "work_s": 0.0})
        spent["wall_s"] = round(spent["wall_s"] + time.perf_counter() - wall, 3)
        spent["work_s"] = round(spent["work_s"] + max(0.0, work - self.budget), 3)
        if done is None:
            self.report(name, self.best_cost + self.offset, self.bound + self.offset)
        return done

    def lp_relaxation(self, force: bool = False) -> Solution | None:
        """Moderate sizes: the LP with memory, a bound and a guide for the search; optimal when integral.

        Planner problems and IOPDDL B/G have an integral LP: its rounding is optimal. ``force``: run it past
        the budget (a valid answer first: when the starts found none, the LP's rounding usually is one).
        """
        flat, stats = self.flat, self.stats
        if flat.n > LP_MAX_NODES:
            return None
        pairs = sum(int(np.isfinite(t).sum()) for t in flat.tables)
        if pairs >= PROBE_MIN_DENSITY * sum(t.size for t in flat.tables) and not force:
            done = self.trws_probe()
            if done is not None:
                return done
        pruned = self.pruned_by_probe()
        target = pruned or flat
        allowed = pairs if pruned is None else sum(int(np.isfinite(t).sum()) for t in pruned.tables)
        if allowed > bounds.LP_MAX_PAIRS:  # too large for the LP, even pruned
            return None
        size = sum(len(c) for c in target.costs) + allowed
        charge = LP_CHARGE * size
        if charge > LP_SHARE * self.budget and not force:  # deterministic: the size decides, never the clock
            stats["lp_skipped_charge_s"] = round(charge, 3)
            return None
        lp_started = time.perf_counter()
        wall = self.past_net(FEASIBILITY_LP) if force else max(0.1, self.wall_left())
        self.lp_target, self.lp_size = target, size
        lp_value, lp_margin, marginals = bounds.lp_solve(target, time_limit=wall)
        stats["lp_s"] = round(time.perf_counter() - lp_started, 3)
        self.budget -= charge
        if lp_value == math.inf:
            # The pruned LP holds the probe's valid assignment: infeasible only by the solver's tolerances.
            return None if pruned is not None else self.infeasible()
        if math.isfinite(lp_value):
            # The pruned LP bounds every assignment cheaper than the probe's, so the least of the two is a bound.
            lp_bound = lp_value - lp_margin if pruned is None else min(lp_value - lp_margin, self.probe[0])
            stats["lp_bound"] = lp_bound + self.offset
            self.bound = max(self.bound, lp_bound)
        if marginals is None:
            return None
        self.marginals = marginals
        self.guide = guide = np.array([int(np.argmax(m)) for m in marginals], dtype=np.int64)
        integral = all(float(np.max(m)) >= 1.0 - 1e-6 for m in marginals)
        if integral:
            c_guide = evaluate(flat, guide)
            # An integral LP solution whose exact cost meets the certified bound: optimal.
            if c_guide <= lp_value - lp_margin + 1e-9 * abs(c_guide):
                stats["proof"] = "integral LP"
                return self.finish(self.reduced.lift(guide), "optimal", self.bound + self.offset)
        return None

    def solve_mip(self) -> Solution | None:
        """The LP fractional: the same polytope with integral strategies (``mip.solve_mip``), within
        ``MIP_SHARE`` of the budget; optimal where HiGHS proves it, else its plan and bound go on.

        The polytope is the LP's, pruned by the probe where it ran: it keeps every assignment no dearer than
        the probe's, which is the incumbent, so its optimum, or the incumbent, is the problem's.
        """
        target, stats = self.lp_target, self.stats
        if self.marginals is None or target is None or self.wall_left() <= 0:
            return None
        per_node = MIP_NODE_CHARGES * LP_CHARGE * self.lp_size
        root = MIP_ROOT_CHARGES * LP_CHARGE * self.lp_size
        share = MIP_SHARE * self.budget
        if root > share:  # deterministic: the size decides, never the clock
            stats["mip_skipped_charge_s"] = round(root, 3)
            return None
        started = time.perf_counter()
        result = mip.solve_mip(target, node_limit=int((share - root) // per_node),
                               time_limit=min(self.wall_left(), share))
        stats.update(result.stats)
        stats["mip_s"] = round(time.perf_counter() - started, 3)
        self.budget -= root + result.nodes * per_node
        if result.assignment is not None:
            self.consider(result.assignment, result.cost)
        # A pruned polytope's bound holds for the assignments below the probe's cost; the incumbent is one of them.
        self.bound = max(self.bound, result.bound if target is self.flat else min(result.bound, self.best_cost))
        if result.status == "optimal":  # its plan, now the incumbent or beaten by it, is optimal
            stats["proof"] = "MIP"
            return self.finish(self.reduced.lift(self.best_x), "optimal", self.bound + self.offset)
        return None

    def trws_probe(self) -> Solution | None:
        """TRW-S before the LP, reading off an assignment every ``PROBE_DECODE_EVERY`` passes.

        On planner problems its bound meets the cost of an assignment it reads
        off (proving it optimal) in about a hundred passes, a fraction of the
        LP's time; that ends the solve. Otherwise the best valid assignment is
        the incumbent, and ``self.probe`` keeps (its cost, the bound, the
        reparametrised costs) for ``pruned_by_probe``.
        """
        flat, stats = self.flat, self.stats
        # a pass, and its share of the assignments read off
        per_pass = bounds.trws_pass_charge(flat) + bounds.trws_decode_charge(flat) / PROBE_DECODE_EVERY
        passes = int(min(PROBE_PASSES, PROBE_SHARE * self.budget / per_pass))
        if passes < PROBE_DECODE_EVERY:
            return None
        decoded: list = []
        ran: list = []
        lb, node_terms, edge_terms = bounds.trws_bound(flat, passes, decoded=decoded, wall_limit=self.wall_left(),
                                                       decode_every=PROBE_DECODE_EVERY, ran=ran)
        self.budget -= bounds.trws_charge(flat, ran[0], -(-ran[0] // PROBE_DECODE_EVERY))
        self.probe_passes = ran[0]
        lb -= 1e-10 * abs(lb)  # floating-point margin of the reparametrised sums (as ``tying.untied_bound``'s)
        x = decoded[0]
        cost = evaluate(flat, x)
        if math.isfinite(cost):
            x = heuristics.icm(flat, x, sweeps=3)
            cost = evaluate(flat, x)
            self.consider(x, cost)
        self.bound = max(self.bound, lb)
        stats["probe_bound"] = lb + self.offset
        stats["probe_passes"] = ran[0]
        stats["probe_cost"] = cost + self.offset if math.isfinite(cost) else None
        if math.isfinite(self.best_cost) and self.bound >= self.best_cost - 1e-9 * abs(self.best_cost):
            stats["proof"] = "TRW-S"
            return self.finish(self.reduced.lift(self.best_x), "optimal", self.bound + self.offset)
        if math.isfinite(cost):
            self.probe = (cost, lb, node_terms, edge_terms)
        return None

    def pruned_by_probe(self) -> Flat | None:
        """The problem less every entry no assignment cheaper than the probe's can use (None: no probe)."""
        if self.probe is None:
            return None
        cost, lb, node_terms, edge_terms = self.probe
        return bounds.pruned_above(self.flat, node_terms, edge_terms, (cost - lb) + 1e-7 * abs(cost))

    def solve_tiny(self) -> Solution:
        """Few decisions: the whole model, exactly, hinted with the incumbent (else the LP's rounding)."""
        flat, guide = self.flat, self.guide
        if guide is not None:
            self.consider(guide, evaluate(flat, guide))
        found = self.best_x is not None  # else a valid answer first, past the budget and the net if need be
        result = cpsat.solve_cpsat(flat, hint=self.best_x, time_limit=self.budget if found else max(self.budget, 0.5),
                                   seed=self.seed, workers=self.threads, progress=self.shifted,
                                   wall_limit=self.wall_left() if found else self.past_net(FEASIBILITY_WALL))
        self.stats.update(result.stats)
        if result.status == "infeasible":
            return self.infeasible()
        self.bound = max(self.bound, result.lower_bound)
        if result.assignment is not None:
            self.consider(result.assignment, result.cost)
        if self.best_x is None:
            return self.finish(None, "unknown", self.bound + self.offset)
        status = "optimal" if result.status == "optimal" else "feasible"
        return self.finish(self.reduced.lift(self.best_x), status, self.bound + self.offset)

    def warm_starts(self) -> None:
        """Heuristic starts (up to ``LARGE_NODES``), TRW-S decodings where no LP guides, the LP rounded, then the
        caller's start (after the others, which run as they would without it)."""
        flat, stats = self.flat, self.stats
        if flat.n <= LARGE_NODES:
            per_round = WARM_ROUND_PASSES * CHARGE_PER_ITEM * (flat.n + len(flat.tables))
            rounds = int(min(WARM_ROUNDS, max(0.0, WARM_SHARE * self.budget) // per_round))
            x0, c0 = heuristics.warm_start(flat, seed=self.seed, rounds=rounds, wall_limit=self.wall_left())
            self.budget -= (rounds + 2) * per_round
            self.consider(x0, c0)
            stats["warm_start_cost"] = c0 + self.offset if math.isfinite(c0) else None
            if self.guide is None:
                # no LP to round: TRW-S decodings (memory penalised, then repaired) as further starts
                # the reference is the best valid cost so far (the probe's, where the heuristic found none)
                x_t, c_t, used = search.trws_starts(flat, min(c0, self.best_cost), self.seed, self.wall_left(),
                                                    budget=TRWS_START_SHARE * self.budget)
                self.budget -= used
                self.consider(x_t, c_t)
                stats["trws_start_cost"] = c_t + self.offset if math.isfinite(c_t) else None
        if self.guide is not None:
            self.round_lp()
        if self.start is not None:
            self.from_start()

    def from_start(self) -> None:
        """``solve``'s ``start`` on the reduced problem, made valid: each strategy the reductions dropped replaced
        by the node's cheapest, then memory repaired and ICM on the softened problem (forbidden pairs at a
        finite penalty), then the forbidden pairs left repaired (``search.made_valid``, as the TRW-S starts
        are): within ``START_REPAIR_SHARE`` of the budget where a valid assignment is in hand (the work decides
        where the repair stops, not the clock), every pair where none is."""
        flat = self.flat
        x = self.start.copy()
        for i in np.flatnonzero(x < 0):
            x[i] = int(np.argmin(flat.costs[i]))
        cost = evaluate(flat, x)
        if not math.isfinite(cost):
            budget = max(0.0, START_REPAIR_SHARE * self.budget) if self.best_x is not None else None
            x, used = search.made_valid(flat, softened(flat)[0], x, self.seed, self.wall_left(), budget=budget)
            self.budget -= used + 5 * sweep_charge(flat)
            cost = evaluate(flat, x)
        self.budget -= evaluation_charge(flat)
        self.consider(x, cost)
        self.stats["start_cost"] = cost + self.offset if math.isfinite(cost) else None

    def round_lp(self, least: float = 0.5, wall: float = 0.0) -> None:
        """The LP's rounding, its fractional nodes and their neighbours solved exactly with the rest held (for at
        least ``least`` seconds of CP-SAT's deterministic time, and ``wall`` seconds past the safety net)."""
        flat, guide = self.flat, self.guide
        frac = np.array([len(m) > 1 and float(np.max(m)) < 1.0 - 1e-6 for m in self.marginals])
        free = set(np.flatnonzero(frac).tolist())
        for i in list(free):
            free.update(j for _, j, _ in flat.adj[i] if len(flat.costs[j]) > 1)
        free_idx = np.array(sorted(free), dtype=np.int64)
        if len(free_idx):
            sub = subproblem(flat, free_idx, guide)
            y, _, _, used = cpsat.solve_neighbourhood(sub, guide[free_idx], min(max(0.2 * self.budget, least), 20.0),
                                                      self.seed, self.past_net(wall))
            self.budget -= used
            if y is not None:
                x_r = guide.copy()
                x_r[free_idx] = y
                self.consider(x_r, evaluate(flat, x_r))
        else:
            self.consider(guide, evaluate(flat, guide))
        self.stats["lp_rounding_free_nodes"] = int(len(free_idx))

    def find_feasible(self) -> Solution | None:
        """A valid start when no start is: least usage, then the forbidden pairs removed.

        Least usage always fits memory but may break forbidden pairs. ICM on the
        softened problem (forbidden pairs at a finite penalty) removes most of them;
        forbidden pairs only couple nodes within a component of forbidden-bearing
        edges, so each component still holding one is then solved exactly on its own,
        and LNS on the softened problem takes what is left. When even that leaves
        a forbidden pair, CP-SAT searches for any valid assignment (no objective,
        pruned domains) from there, and may prove there is none.
        """
        flat, stats, seed = self.flat, self.stats, self.seed
        soft, penalty = softened(flat)
        start = heuristics.icm(soft, heuristics.least_usage(flat), sweeps=3)
        self.budget -= 3 * CHARGE_PER_ITEM * (flat.n + len(flat.tables))
        start, used, repair_stats = search.repair_forbidden(  # a valid answer first: past the net if need be
            flat, start, budget=0.5 * self.budget, seed=seed, wall_limit=self.past_net(FEASIBILITY_WALL),
        )
        self.budget -= used
        stats.update(repair_stats)
        if repair_stats["repair_left"]:
            # what is left (memory too tight around a component): search the softened problem
            x_soft, c_soft, soft_stats = search.lns(
                soft, start, budget=0.5 * self.budget, seed=seed, stop_below=penalty, wall_limit=self.wall_left(),
            )
            self.budget -= soft_stats.get("lns_deterministic_s", 0.0)
            stats["repair_steps"] = soft_stats.get("lns_steps", 0)
            start = x_soft
        if not math.isfinite(evaluate(flat, start)):
            x, status, used = cpsat.solve_feasibility(flat, start, max(1.0, 0.5 * self.budget), seed, self.wall_left())
            self.budget -= used
            stats["feasibility_status"] = status
            if status == "INFEASIBLE":
                return self.infeasible()
            if x is not None:
                start = x
        self.consider(start, evaluate(flat, start))
        return None

    def solve_whole(self) -> Solution | None:
        """Medium sizes (or nothing valid yet): the whole model, hinted, for a share of the budget (``WHOLE_MIN``)."""
        flat = self.flat
        strategies = sum(len(c) for c in flat.costs)
        medium = self.decision <= EXACT_NODES and strategies <= EXACT_STRATEGIES
        if not (medium or (self.best_x is None and flat.n <= LARGE_NODES)) or self.wall_left() <= 0:
            return None  # (with the net spent, CP-SAT would stop as soon as the model is built)
        found = self.best_x is not None
        share = 0.1 * self.budget if found else max(1.0, 0.5 * self.budget)
        if found and share < WHOLE_MIN:  # a start is in hand and the budget has no room for the model
            return None
        result = cpsat.solve_cpsat(flat, hint=self.best_x, time_limit=share / cpsat.NEIGHBOURHOOD_FACTOR,
                                   seed=self.seed, workers=self.threads, progress=self.shifted,
                                   wall_limit=self.wall_left())
        self.stats.update(result.stats)
        self.budget -= cpsat.NEIGHBOURHOOD_FACTOR * result.stats.get("cpsat_deterministic_s", 0.0) + cpsat.CHARGE_PER_STEP
        self.bound = max(self.bound, result.lower_bound)
        if result.status == "infeasible":
            return self.infeasible()
        self.consider(result.assignment, result.cost)
        if result.status == "optimal":
            return self.finish(self.reduced.lift(self.best_x), "optimal", self.bound + self.offset)
        return None

    def dive(self) -> None:
        """The probe's bound short of the incumbent: branch on the node holding most of the gap
        (``dive.dive``, within ``DIVE_SHARE`` of the budget): a bound of the problem, and starts read off the
        branches of least bound."""
        if self.root_terms is None or self.best_x is None or self.budget <= 0 or self.wall_left() <= 0:
            return  # (none kept where memory binds: the memory-relaxed passes read off plans that overfill it)
        lower, node_terms, edge_terms = self.root_terms
        if self.bound >= self.best_cost - DIVE_MIN_GAP * abs(self.best_cost):
            return
        found = dive.dive(self.flat, node_terms, edge_terms, lower, self.best_x, self.best_cost,
                          DIVE_SHARE * self.budget, wall_limit=DIVE_SHARE * self.wall_left())
        if found is None:
            return
        self.budget -= found.work
        self.stats.update(found.stats)
        self.bound = max(self.bound, found.bound)
        self.consider(found.x, found.cost)

    def certify(self) -> None:
        """Where the LP was too big: TRW-S (memory relaxed; unless the probe ran as many passes), and min-sum
        diffusion where cheap; the larger."""
        flat, stats = self.flat, self.stats
        if self.budget < 2 * bounds.trws_pass_charge(flat):  # not even two passes left: the trivial bound stands
            return
        passes = trws_passes(flat, min(self.total_budget, 2.0 * max(0.0, self.budget)))
        if passes > self.probe_passes:
            trws_started = time.perf_counter()
            ran: list = []
            value, _, _ = bounds.trws_bound(flat, passes=passes, wall_limit=0.5 * self.wall_left(), final_only=True,
                                            ran=ran, terms=False)
            value -= 1e-9 * max(1.0, abs(value))  # floating-point margin, as ``dual_bound``'s
            stats["trws_passes"] = ran[0]
            stats["trws_s"] = round(time.perf_counter() - trws_started, 3)
            stats["trws_bound"] = value + self.offset
            self.bound = max(self.bound, value)
            self.budget -= bounds.trws_charge(flat, ran[0])
        diffusion = 2 * DIFFUSION_SWEEPS * sweep_charge(flat)  # a sweep of star updates reads each table twice
        if flat.n <= LARGE_NODES and self.budget > diffusion and self.wall_left() > 0:
            # min-sum diffusion, where the budget has room for it
            self.bound = max(self.bound, bounds.dual_bound(flat, iterations=DIFFUSION_SWEEPS,
                                                           wall_limit=self.wall_left()))
            self.budget -= diffusion

    def lagrangian(self) -> None:
        """Where memory binds and no LP guides: the memory constraints priced (``lagrange.dual_ascent``).

        Its bound replaces the memory-relaxed one of ``certify``; each repaired
        decoding, polished by group moves, is a start.
        """
        flat, stats = self.flat, self.stats
        if not len(flat.binding) or self.best_x is None or self.budget <= 0:
            return
        if (self.moves is None and moves.GroupMoves.fits(flat)
                and moves.GroupMoves.most_build_charge(flat) <= LAGRANGE_SHARE * self.budget):
            self.moves = moves.GroupMoves(flat, search.forbidden_components(flat))
            self.budget -= self.moves.build_charge
        evaluation = evaluation_charge(flat)
        polished = [0.0]

        def consider(y: np.ndarray) -> float:
            cost = evaluate(flat, y)
            polished[0] += evaluation
            if math.isfinite(cost) and self.moves is not None and self.wall_left() > 0:
                y, _, used = self.moves.descend(y, rounds=MOVE_ROUNDS, wall_limit=self.wall_left())
                cost = evaluate(flat, y)
                polished[0] += used + evaluation
            self.consider(y, cost)
            return self.best_cost

        started = time.perf_counter()
        value, used, more = lagrange.dual_ascent(flat, self.best_cost, budget=LAGRANGE_SHARE * self.budget,
                                                 consider=consider, wall_limit=LAGRANGE_SHARE * self.wall_left(),
                                                 charged=lambda: polished[0],
                                                 on_step=lambda bound: self.report(
                                                     "memory priced", self.best_cost + self.offset,
                                                     max(self.bound, bound) + self.offset))
        self.budget -= used + polished[0]
        decoded = more.pop("decoded", None)
        stats.update(more)
        stats["lagrangian_polish_work_s"] = round(polished[0], 3)
        stats["lagrangian_s"] = round(time.perf_counter() - started, 3)
        if math.isfinite(value):
            stats["lagrangian_bound"] = value + self.offset
            self.bound = max(self.bound, value)
            self.priced_guide = decoded

    def group_moves(self) -> None:
        """Rounds of vectorised group moves (``moves.GroupMoves``: nodes and small components) from the incumbent.

        Its wall seconds and work add up in ``stats["moves_s"]`` and ``stats["moves_work_s"]``.
        """
        if not moves.GroupMoves.fits(self.flat) or self.budget <= 0 or self.wall_left() <= 0:
            return
        if self.moves is None and moves.GroupMoves.most_build_charge(self.flat) > min(self.budget, self.wall_left()):
            return  # building the moves' index arrays alone would take longer than what is left
        wall, work = time.perf_counter(), self.budget
        self._group_moves()
        self.stats["moves_s"] = round(self.stats.get("moves_s", 0.0) + time.perf_counter() - wall, 3)
        self.stats["moves_work_s"] = round(self.stats.get("moves_work_s", 0.0) + work - self.budget, 3)

    def _group_moves(self) -> None:
        if self.moves is None:
            self.moves = moves.GroupMoves(self.flat, search.forbidden_components(self.flat))
            self.budget -= self.moves.build_charge
        rounds = int(min(MOVE_ROUNDS, max(1.0, MOVE_SHARE * self.budget / self.moves.round_charge)))
        x, done, used = self.moves.descend(self.best_x, rounds=rounds, wall_limit=self.wall_left())
        self.budget -= used
        self.stats["move_rounds"] = self.stats.get("move_rounds", 0) + done
        self.consider(x, evaluate(self.flat, x))
        if len(self.flat.capacity) and self.budget > 0:
            x, cost, done, used = moves.priced_descent(self.moves, self.best_x, rounds=rounds,
                                                       wall_limit=self.wall_left())
            self.budget -= used
            self.stats["priced_rounds"] = self.stats.get("priced_rounds", 0) + done
            self.consider(x, cost)
        if self.moves.groups_multi and self.budget > 0:
            # two groups at once: pair moves on the problem over groups, memory checked on the way back
            if self.quotient_moves is None:
                quotient, _ = moves.quotient(self.moves, self.best_x)
                self.quotient_moves = moves.GroupMoves(quotient)
                self.budget -= self.quotient_moves.build_charge + 5 * CHARGE_PER_ITEM * len(self.flat.tables)
            q, done, used = self.quotient_moves.descend(self.moves.configs_of(self.best_x), rounds=rounds,
                                                        wall_limit=self.wall_left())
            self.budget -= used + CHARGE_PER_ITEM * (self.flat.n + len(self.flat.tables))
            x = self.moves.lift(q)
            self.consider(x, evaluate(self.flat, x))

    def over_groups(self) -> None:
        """The whole problem over groups with memory exact (``grouped.solve_grouped``), where functional edges
        leave few choices (IOPDDL P: 190 groups with a choice, 718 configs); group moves after a gain. Its
        model is the whole problem, so CP-SAT's bound on it (memory rows partly relaxed) is certified."""
        if self.moves is None or not self.moves.groups_multi or self.budget <= 0 or self.wall_left() <= 0:
            return
        wall = time.perf_counter()
        x, cost, bound, used = grouped.solve_grouped(self.moves, self.best_x, limit=GROUPED_STEP,
                                                     budget=GROUPED_SHARE * self.budget, seed=self.seed,
                                                     wall_limit=GROUPED_SHARE * self.wall_left())
        self.budget -= used
        self.stats["grouped_s"] = round(time.perf_counter() - wall, 3)
        self.stats["grouped_work_s"] = round(used, 3)
        if math.isfinite(bound):
            self.stats["grouped_bound"] = bound + self.offset
            self.bound = max(self.bound, bound)
        gained = cost < self.best_cost
        self.consider(x, cost)
        if gained:
            self.report("over groups", self.best_cost + self.offset, self.bound + self.offset)
            self.group_moves()

    def improve(self) -> None:
        """Group moves, component descent sweeps (above ``EXACT_NODES``), LNS chunks; group moves after each.

        Group moves (``group_moves``: nodes and small components at once, pairs, the priced descent where
        memory binds) are fast and vectorised; the CP-SAT searches between them find what they cannot.
        The wall-clock shares (half the time left for the TRW-S bound, ``DESCENT_SHARE`` for the descent)
        only bind on a machine too loaded to do the work in the time: then they leave the LNS its turn.
        """
        flat = self.flat
        self.group_moves()
        self.over_groups()
        if self.decision > EXACT_NODES:
            for _ in range(DESCENT_SWEEPS):
                if self.budget <= 0 or self.wall_left() <= 0:
                    break
                wall = time.perf_counter()
                x, cost, used, descent_stats = search.component_descent(
                    flat, self.best_x, budget=DESCENT_SHARE / DESCENT_SWEEPS * max(0.0, self.budget), seed=self.seed,
                    max_sweeps=1, wall_limit=DESCENT_SHARE / DESCENT_SWEEPS * self.wall_left(),
                )
                self.budget -= used
                descent_stats["descent_s"] = round(time.perf_counter() - wall, 3)
                self.add_stats(descent_stats)
                self.consider(x, cost)
                self.report("component descent", self.best_cost + self.offset, self.bound + self.offset)
                self.group_moves()
        carried: dict = {}  # the neighbourhood size and step limit, from one chunk to the next
        for chunk in range(LNS_CHUNKS):
            if self.budget <= 0 or self.wall_left() <= 0:
                break
            last = chunk == LNS_CHUNKS - 1
            wall = time.perf_counter()
            x, cost, lns_stats = search.lns(
                flat, self.best_x, budget=max(0.0, self.budget if last else self.budget / (LNS_CHUNKS - chunk)),
                seed=self.seed + 1000 * chunk, progress=self.shifted, lower_bound=self.bound,
                wall_limit=self.wall_left(), guide=self.guide if self.guide is not None else self.priced_guide,
                size=carried.get("lns_final_size"), step_limit=carried.get("lns_step_limit"),
            )
            carried = dict(lns_stats)
            lns_stats["lns_s"] = round(time.perf_counter() - wall, 3)
            self.add_stats(lns_stats)
            self.budget -= lns_stats.get("lns_deterministic_s", 0.0)
            self.consider(x, cost)
            if last:
                break
            self.group_moves()

    def add_stats(self, more: dict) -> None:
        """``more`` into ``stats``: counts and work add up over repeated calls, the rest is replaced."""
        for key, value in more.items():
            summed = key.endswith(("_steps", "_improvements", "_sweeps", "_deterministic_s", "_s"))
            self.stats[key] = self.stats.get(key, 0) + value if summed else value


def trws_passes(flat: Flat, budget: float) -> int:
    """TRW-S passes that fit ``TRWS_SHARE`` (``TRWS_SHARE_LARGE``) of ``budget`` (``bounds.trws_pass_charge`` a pass)."""
    per_pass = bounds.trws_pass_charge(flat)
    share = TRWS_SHARE_LARGE if flat.n > LARGE_NODES else TRWS_SHARE
    return int(max(2, min(TRWS_PASSES, share * budget / per_pass)))
