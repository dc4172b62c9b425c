"""Solvers for the strategy-selection problem (imported as ``shardsolve.encodings``).

``solve`` is the one entry point the planner calls; ``explain_infeasible``
names a minimal set of pins (and the memory limit) that cannot hold
together, from z3 unsat cores. The modules, in the order a problem meets them:

==============  ===============================================================
``presolve``    exact reductions of a ``Problem`` (restrict, fold, eliminate,
                dominance), each with a step that lifts assignments back
``tying``       repeated layers tied to one strategy per class, with a
                certified bound of the untied problem
``flat``        the array form every solver reads (``Flat``, ``evaluate``),
                and the sub-problems, pruned and softened forms derived from it
``heuristics``  fast warm starts: least usage, Lagrangian forest DP, repair, ICM
``moves``       vectorised group moves: every node or small component at once,
                two-node moves, a falling price on usage where memory binds
``cpsat``       the CP-SAT encoding and its solve (whole models, neighbourhoods)
``mip``         the LP's polytope with integral strategies, HiGHS's branch and
                cut (where the LP is fractional)
``search``      neighbourhoods, repair of forbidden pairs, component descent,
                large-neighbourhood search, TRW-S warm starts
``bounds``      certified lower bounds: LP with memory, TRW-S, min-sum diffusion
``dive``        branching on the node that holds most of TRW-S's gap: a tighter
                bound, and starts read off the branches of least bound; the
                same block by block around each loose spot (tying's bound)
``lagrange``    the memory constraints priced per byte: TRW-S on the priced
                costs, prices by subgradient steps (a bound and starts)
``kernels``     TRW-S passes and bound checks compiled with numba
``smt``         z3: cross-checks of small problems and unsat cores
``portfolio``   ``solve``: the phases above in order, one deterministic budget
``polish``      least memory among equal costs: a solution's nodes moved to
                strategies of the same cost and less usage (the planner's last step)
==============  ===============================================================

On IOPDDL instances B and G the LP relaxation with the memory constraints is
integral or nearly so: its rounding is optimal and CP-SAT proves it.

Time limits are *deterministic* work budgets in seconds (CP-SAT's
deterministic time, a fixed charge per model term built, per node, edge,
table entry and dominance comparison of the reductions, per LP variable, and
per node and edge visited by a Python pass), so the same problem and options
give the same assignment byte for byte, as long as the budget is spent
before a wall-clock safety net of ``WALL_SLACK`` (1.05) times the limit plus
``WALL_EXTRA`` (1 s) stops the search (see ``portfolio.solve``; a caller
running several solves in one limit, as ``shardsolve.plan`` and tying do,
hands each what is left of its own net as ``wall_limit``).
"""

from __future__ import annotations

from shardsolve.encodings.portfolio import DEFAULT_TIME_LIMIT, explain_infeasible, interruptible, solve

__all__ = ["solve", "interruptible", "explain_infeasible", "DEFAULT_TIME_LIMIT"]
