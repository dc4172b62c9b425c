"""z3 encoding: exact optimisation of small problems and explanations of infeasibility.

One Boolean ``b[i, s]`` per node strategy, exactly one per node; costs are
exact rationals (``z3.RealVal`` of each float), so the optimum is exact::

    minimise  sum_{i,s} c_is * b_is + sum_(u,v) sum_(a,b) C_uv[a,b] * (b_ua & b_vb)
              (as weighted soft constraints "not b_is", "not (b_ua & b_vb)": MaxSMT)
    s.t.      not (b_ua & b_vb)                    where C_uv[a, b] is forbidden
              not b_is                             where c_is is forbidden
              p_k  =>  OR_{s in allowed_k} b_{i_k s}              (pin k, tracked)
              m    =>  sum_{i live at t} usage_is * b_is <= limit  (memory, tracked)

Explanations: the pins ``p_k`` and the memory limit ``m`` are assumption
literals. When ``check(p_1..p_K, m)`` is ``unsat``, z3's unsat core is shrunk
by deletion (drop one assumption; keep it out if the rest is still unsat), so
the result is a *minimal* conflicting set: removing any one of its members
makes the rest satisfiable. For example two pins ``x = 0`` and ``x = 1`` on the
same node give exactly those two labels; a pin forcing a big strategy while
every other node is at its smallest and memory still overflows gives that pin
and ``memory_limit``.
"""

from __future__ import annotations

import math
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import z3

from shardsolve.problem import FORBIDDEN, MEMORY_LIMIT_LABEL, Problem

__all__ = ["SmtModel", "optimise", "explain", "satisfiable"]


def _real(x: float) -> z3.ArithRef:
    f = Fraction(float(x))
    return z3.RealVal(f"{f.numerator}/{f.denominator}")


def _weight(x: float) -> str:
    """Exact decimal text of a float, for ``add_soft`` weights."""
    return format(Decimal(float(x)), "f")


def _live_sets(problem: Problem) -> list[tuple[int, ...]]:
    """Distinct sets of nodes live together, one per change point of the sweep."""
    events = sorted({t for n in problem.nodes if n.interval[1] > n.interval[0] for t in n.interval})
    out = []
    seen = set()
    for t in events:
        live = tuple(i for i, n in enumerate(problem.nodes) if n.interval[0] <= t < n.interval[1])
        if live and live not in seen:
            seen.add(live)
            out.append(live)
    return out


class SmtModel:
    """The z3 encoding of ``problem``; pins and memory as tracked assumption literals."""

    def __init__(self, problem: Problem, optimise: bool):
        self.problem = problem
        self.ctx = z3.Optimize() if optimise else z3.Solver()
        self.b = [[z3.Bool(f"b_{i}_{s}") for s in range(n.num_strategies)] for i, n in enumerate(problem.nodes)]
        self.assumptions: dict[str, z3.BoolRef] = {}
        self.add_one_strategy_per_node()
        self.add_forbidden()
        self.add_pins()
        self.add_memory_limit()

    def add_one_strategy_per_node(self) -> None:
        for bs in self.b:
            self.ctx.add(z3.PbEq([(x, 1) for x in bs], 1))

    def add_forbidden(self) -> None:
        for i, n in enumerate(self.problem.nodes):
            for s in np.flatnonzero(np.asarray(n.costs) >= FORBIDDEN):
                self.ctx.add(z3.Not(self.b[i][s]))
        for e in self.problem.edges:
            for a, bb in zip(*np.nonzero(np.asarray(e.costs) >= FORBIDDEN)):
                self.ctx.add(z3.Or(z3.Not(self.b[e.u][a]), z3.Not(self.b[e.v][bb])))

    def _assumption(self, label: str) -> z3.BoolRef:
        if label not in self.assumptions:
            self.assumptions[label] = z3.Bool(f"assume_{len(self.assumptions)}")
        return self.assumptions[label]

    def add_pins(self) -> None:
        for pin in self.problem.pins:
            p = self._assumption(pin.label)
            self.ctx.add(z3.Implies(p, z3.Or([self.b[pin.node][s] for s in pin.allowed])))

    def add_memory_limit(self) -> None:
        limit = self.problem.usage_limit
        if limit is None:
            return
        m = self._assumption(MEMORY_LIMIT_LABEL)
        usages = [np.asarray(n.usages, dtype=np.float64) for n in self.problem.nodes]
        # whole bytes within a fractional limit (a searched one) are within its floor: the pseudo-Boolean form
        integral = math.isfinite(limit) and all(np.all(u == np.round(u)) for u in usages)
        for live in _live_sets(self.problem):
            if integral:
                terms = [(self.b[i][s], int(u)) for i in live for s, u in enumerate(usages[i]) if u]
                if terms:
                    self.ctx.add(z3.Implies(m, z3.PbLe(terms, math.floor(limit))))
                elif limit < 0:
                    self.ctx.add(z3.Not(m))
                continue
            terms = [
                z3.If(self.b[i][s], _real(u), z3.RealVal(0))
                for i in live
                for s, u in enumerate(self.problem.nodes[i].usages)
                if u
            ]
            if terms:
                self.ctx.add(z3.Implies(m, z3.Sum(terms) <= _real(limit)))

    def add_soft_costs(self):
        """The objective as weighted soft constraints (z3's MaxSMT engine): pay ``c`` unless ``not b``.

        Returns the objective's handle (``None`` when nothing costs anything).
        """
        opt = self.ctx
        handle = None
        for i, n in enumerate(self.problem.nodes):
            for s, c in enumerate(n.costs):
                if 0 < c < FORBIDDEN:
                    handle = opt.add_soft(z3.Not(self.b[i][s]), _weight(c))
        for e in self.problem.edges:
            costs = np.asarray(e.costs)
            for a, bb in zip(*np.nonzero((costs > 0) & (costs < FORBIDDEN))):
                handle = opt.add_soft(z3.Or(z3.Not(self.b[e.u][a]), z3.Not(self.b[e.v][bb])), _weight(costs[a, bb]))
        return handle

    def objective(self) -> z3.ArithRef:
        terms = []
        for i, n in enumerate(self.problem.nodes):
            for s, c in enumerate(n.costs):
                if 0 < c < FORBIDDEN:
                    terms.append(z3.If(self.b[i][s], _real(c), z3.RealVal(0)))
        for e in self.problem.edges:
            for a, bb in zip(*np.nonzero((np.asarray(e.costs) > 0) & (np.asarray(e.costs) < FORBIDDEN))):
                terms.append(z3.If(z3.And(self.b[e.u][a], self.b[e.v][bb]), _real(e.costs[a, bb]), z3.RealVal(0)))
        return z3.Sum(terms) if terms else z3.RealVal(0)

    def decode(self, model: z3.ModelRef) -> tuple[int, ...]:
        out = []
        for bs in self.b:
            out.append(next(s for s, x in enumerate(bs) if z3.is_true(model.eval(x, model_completion=True))))
        return tuple(out)


def optimise(problem: Problem, timeout_ms: int = 60_000) -> tuple[tuple[int, ...] | None, float, str]:
    """Exact optimum: (assignment or None, cost, "optimal" / "infeasible" / "unknown").

    With a timeout set, z3's MaxSMT search can be interrupted and still hand
    back its incumbent: that result is reported "unknown", not "optimal".
    """
    model = SmtModel(problem, optimise=True)
    opt = model.ctx
    opt.set("timeout", int(timeout_ms))
    for p in model.assumptions.values():
        opt.add(p)
    handle = model.add_soft_costs()
    started = time.monotonic()
    result = opt.check()
    elapsed_ms = (time.monotonic() - started) * 1e3
    if result == z3.unsat:
        return None, math.inf, "infeasible"
    if result != z3.sat:
        return None, math.inf, "unknown"
    x = model.decode(opt.model())
    interrupted = (
        elapsed_ms >= 0.9 * timeout_ms
        or "cancel" in opt.reason_unknown()
        or (handle is not None and not z3.is_true(z3.simplify(handle.lower() == handle.upper())))
    )
    return x, problem.evaluate(x), "unknown" if interrupted else "optimal"


def satisfiable(problem: Problem, timeout_ms: int = 60_000) -> bool:
    """Whether ``problem`` (pins and memory limit included) has a valid assignment, as z3 finds in ``timeout_ms``
    (False where it does not know)."""
    model = SmtModel(problem, optimise=False)
    model.ctx.set("timeout", int(timeout_ms))
    return model.ctx.check(*model.assumptions.values()) == z3.sat


def explain(problem: Problem, timeout_ms: int = 60_000) -> tuple[str, ...]:
    """Labels of a minimal set of pins (and ``memory_limit``) that cannot hold together; ``()`` if satisfiable.

    ``timeout_ms`` bounds z3's checks together (building the model is not
    counted): ``()`` where the first checks do not finish in it, z3's core as
    it is (not minimal) where its shrinking does not.
    """
    model = SmtModel(problem, optimise=False)
    solver = model.ctx
    deadline = time.perf_counter() + timeout_ms / 1000

    def check(*assumptions):
        """``solver.check`` within what is left of the deadline (``unknown`` once it has passed)."""
        left = int(1000 * (deadline - time.perf_counter()))
        if left <= 0:
            return z3.unknown
        solver.set("timeout", left)
        return solver.check(*assumptions)

    labels = {str(v): k for k, v in model.assumptions.items()}
    if check(*model.assumptions.values()) != z3.unsat:
        return ()
    core = [c for c in solver.unsat_core()]
    if check() != z3.sat:
        return ()  # infeasible without any pin or the memory limit (nothing the user can drop), or not known
    i = 0
    while i < len(core):
        trial = core[:i] + core[i + 1:]
        verdict = check(*trial)
        if verdict == z3.unknown:
            break  # out of time: the core so far conflicts, though it may not be minimal
        if verdict == z3.unsat:
            core = trial  # still unsat without core[i]: it is not needed
        else:
            i += 1
    order = list(model.assumptions)
    return tuple(sorted((labels[str(c)] for c in core), key=order.index))
