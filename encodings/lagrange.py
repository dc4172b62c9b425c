r"""The memory constraints' Lagrangian dual: TRW-S on costs priced per byte, prices by subgradient steps.

TRW-S (``bounds.trws_bound``) bounds the problem with memory relaxed, and on
problems where memory binds that bound is far below the optimum (IOPDDL K:
its memory-free decodings use eighteen times the capacity). Pricing memory
closes most of it. For prices ``mu_t >= 0`` on the binding segments,

    L(mu) = min_x [ cost(x) + sum_t mu_t (use_t(x) - cap_t) ]

is at most the cost of every assignment within memory, and the inner
problem is the plain one with each strategy's cost raised by its usage times
the prices over its node's interval: TRW-S bounds it from below at any
messages, so ``TRW-S value - mu . cap`` is a certified bound. Only node
costs change with the prices, so the messages carry from one price to the
next (``PricedTRWS``), and each step runs a few passes, not a cold start.

``dual_ascent`` moves the prices by Polyak subgradient steps towards a
target (the best valid cost): ``g_t = use_t(x) - cap_t`` at the assignment
``x`` read off the messages, ``mu <- max(0, mu + theta (target - L) / |g|^2 g)``;
after ``PATIENCE`` steps without a better bound, ``theta`` halves and the
step starts again from the best prices, along their subgradient (on IOPDDL
S a step overshot from 0.77 to 0.33 of the best known cost, and without the
return the bound never got back above 0.77; with it, 0.83). Each
assignment read off is close to fitting where the prices are right: repaired
for memory (``heuristics.repair`` on the softened problem, forbidden pairs at
a finite penalty) and cleared of forbidden pairs by ICM on the softened
problem (on IOPDDL P, 227 of them, where the exact repair of components
took 19 s and left 98), it is a start for the search, handed to the
caller's ``consider``. On K (120 s) the search from these starts ends at
1.015 times the best known cost, where from the memory-relaxed starts it
ended at 2.0, and the bound rises from 0.27 to 0.84 of it.

Work is charged deterministically: TRW-S passes as ``bounds`` charges
them, decodings and ICM sweeps in Python sweeps, a repair per live node it
weighs.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from shardsolve.encodings import bounds, heuristics, kernels
from shardsolve.encodings.flat import Flat, interval_sums, profile, softened, sweep_charge, tolerance

__all__ = ["PricedTRWS", "dual_ascent"]

#: TRW-S passes between price steps.
STEP_PASSES = 30
#: Steps without a better bound after which the step length halves and the prices return to the best ones
#: (lengthening it after better bounds, by 1.1 up to twice, raised V's bound from 0.65 to 0.67 of the best known
#: cost but took K's cost from 1.02 to 1.16 of it: its decodings moved further from fitting, and each repair
#: took longer; returning after 2 steps rather than 4 raised P's bound from 0.82 to 0.90 but took S's cost from
#: 1.03 to 1.05).
PATIENCE = 4
#: Decodings over capacity by more than this share of the largest capacity are not repaired (the repair moves
#: one node at a time: from the memory-free decoding of K, eighteen times over, it took 90 s).
REPAIR_MAX_OVER = 0.25
#: Deterministic charges: the repair per live node it weighs (a Python visit reading the node's edges: 6.5 us
#: measured on IOPDDL K), a decoding and an ICM sweep in Python sweeps (``flat.sweep_charge``; 0.15 and 0.4
#: measured on K and P).
REPAIR_CHARGE_PER_VISIT = 1e-5
DECODE_SWEEPS = 0.3
ICM_SWEEPS = 2
ICM_SWEEP_CHARGE = 0.6


class PricedTRWS:
    """TRW-S messages over ``flat`` with node costs priced per byte of usage on the binding segments."""

    def __init__(self, flat: Flat):
        self.flat = flat
        setup = bounds.TrwsSetup.of(flat)  # (its packed costs are a copy of their own, priced in place below)
        self.tables, self.packed = setup.tables, setup.packed
        self.base = self.packed.costs.copy()
        self.sizes = np.diff(self.packed.noff)
        self.usage = (np.concatenate([np.asarray(u, dtype=np.float64) for u in flat.usages])
                      if flat.n else np.zeros(0))
        self.binding = np.asarray(flat.binding, dtype=np.int64)
        self.capacity = flat.capacity[self.binding]
        self.to_u, self.to_v = self.packed.messages()
        self.mu = np.zeros(len(self.binding))
        self.forward = True  # the direction of the next pass

    def set_prices(self, mu: np.ndarray) -> None:
        """Node costs become cost + usage * (sum of ``mu`` over the binding segments the node is live in)."""
        self.mu = np.maximum(np.asarray(mu, dtype=np.float64), 0.0)
        price = interval_sums(self.flat, self.mu, self.binding)
        self.packed.costs[:] = self.base + np.repeat(price, self.sizes) * self.usage

    def run(self, passes: int) -> float:
        """``passes`` more passes at the current prices; the certified bound ``L(mu)`` their messages give."""
        hat = kernels.hats(self.packed, self.to_u, self.to_v)
        for _ in range(passes):
            kernels.trws_pass(self.packed, self.forward, hat, self.to_u, self.to_v)
            self.forward = not self.forward
        value = kernels.reparametrised_value(self.packed, not self.forward, self.to_u, self.to_v)
        constant = float(self.mu @ self.capacity)
        return value - constant - 1e-10 * (abs(value) + abs(constant))

    def decode(self) -> np.ndarray:
        """An assignment read off the messages at the current prices (``bounds.trws_decode``)."""
        p = self.packed
        costs = [p.costs[p.noff[i]:p.noff[i + 1]] for i in range(self.flat.n)]
        return bounds.trws_decode(self.flat, costs, self.tables, p.split(self.to_u, p.uoff), p.split(self.to_v, p.voff))

    def overuse(self, x: np.ndarray) -> np.ndarray:
        """``use_t(x) - cap_t`` on the binding segments (the subgradient of ``L`` at ``x``)."""
        return profile(self.flat, x)[self.binding] - self.capacity


def _most_live(flat: Flat) -> int:
    """The most nodes live at any one memory segment."""
    delta = np.zeros(len(flat.capacity) + 1, dtype=np.int64)
    np.add.at(delta, flat.seg_start, 1)
    np.add.at(delta, flat.seg_end, -1)
    return int(np.cumsum(delta)[:-1].max()) if len(flat.capacity) else 0


def step_charge(flat: Flat, passes: int = STEP_PASSES) -> float:
    """Deterministic charge of one price step: its passes, a bound, a decoding and the prices."""
    return (passes + 1) * bounds.trws_pass_charge(flat) + DECODE_SWEEPS * sweep_charge(flat)


def dual_ascent(flat: Flat, target: float, *, budget: float, consider: Callable[[np.ndarray], float],
                wall_limit: float | None = None, passes: int = STEP_PASSES,
                on_step: Callable[[float], None] | None = None,
                charged: Callable[[], float] | None = None) -> tuple[float, float, dict]:
    """Price steps while ``budget`` (deterministic seconds) lasts; returns (best bound, work, stats).

    ``stats["decoded"]`` is the assignment read off at the best bound (None without a step): the
    caller's large-neighbourhood search grows neighbourhoods where its incumbent differs from it.

    ``target``: a valid cost (the incumbent's, finite) that the steps aim the bound at;
    ``consider(x)`` receives each repaired decoding (within memory; it may
    still break a forbidden pair: the caller evaluates it) and returns the
    best valid cost so far, which becomes the target. ``wall_limit``: a wall-clock safety net,
    seconds from now. ``on_step(bound)``, when given, is called after every step with the best bound so far
    (for progress reports). ``charged()``: the work ``consider`` has done so far (the caller's, not in the
    returned work), which the budget covers too.
    """
    started = time.perf_counter()
    if not len(flat.binding) or not flat.n:
        return -math.inf, 0.0, {}
    priced = PricedTRWS(flat)
    soft, _ = softened(flat)
    per_step = step_charge(flat, passes)
    spent = bounds.TRWS_SETUP_SWEEPS * sweep_charge(flat)
    limit = REPAIR_MAX_OVER * float(np.abs(flat.capacity).max())
    icm = ICM_SWEEPS * ICM_SWEEP_CHARGE * sweep_charge(flat)
    # a repair round weighs the nodes live at one segment: at most this charge (its rounds fit the budget left)
    repair_round = REPAIR_CHARGE_PER_VISIT * max(1, _most_live(flat))
    best, theta, stale, steps, repairs, repaired = -math.inf, 1.0, 0, 0, 0, 0.0
    best_mu, best_g, best_x = priced.mu, np.zeros(0), None
    extra = charged or (lambda: 0.0)
    while spent + extra() + per_step <= budget and (wall_limit is None or time.perf_counter() - started < wall_limit):
        steps += 1
        value = priced.run(passes)
        x = priced.decode()
        spent += per_step
        g = priced.overuse(x)
        improved = not math.isfinite(best) or value > best + 1e-9 * abs(best)
        if improved:
            best, stale = max(best, value), 0
            best_mu, best_g, best_x = priced.mu.copy(), g, x
        else:
            stale += 1
        left = budget - spent - extra()
        rounds = int((left - icm) / repair_round) if left > icm else 0
        if float(g.max()) <= limit and rounds > 0:
            visits: list = []
            y = heuristics.repair(soft, x, rounds=rounds, work=visits)
            work = REPAIR_CHARGE_PER_VISIT * sum(visits)
            if float(priced.overuse(y).max()) <= tolerance(flat):  # the repair's rounds sufficed
                y = heuristics.icm(soft, y, sweeps=ICM_SWEEPS)
                work += icm
                repairs += 1
                target = min(target, consider(y))
            spent += work
            repaired += work
        if on_step is not None:
            on_step(best)
        if stale >= PATIENCE:  # back to the best prices, half the step along their subgradient
            theta, stale, value, g = 0.5 * theta, 0, best, best_g
            priced.mu = best_mu
        norm, gap = float(g @ g), target - value
        if norm <= 0 or not gap > 0:
            break  # nothing to step along, or the bound meets the best cost
        priced.set_prices(priced.mu + theta * gap / norm * g)
    return best, spent, {"lagrangian_steps": steps, "lagrangian_repairs": repairs,
                         "lagrangian_repair_work_s": round(repaired, 3), "lagrangian_theta": theta,
                         "decoded": best_x}
