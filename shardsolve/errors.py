"""The one exception type users see.

Every message is one line that names the culprit and the way out; the CLI
prints it and exits with status 2, never with a traceback.
"""

from __future__ import annotations


class ShardsolveError(ValueError):
    """Bad input or an impossible request, explained in one line."""


class InfeasibleError(ShardsolveError):
    """No plan satisfies the hard constraints (annotations, memory limit).

    ``conflict`` lists the constraints, in the user's terms, that cannot hold
    together (a minimal unsatisfiable core where one could be computed).
    """

    def __init__(self, message: str, conflict: tuple[str, ...] = ()):
        super().__init__(message)
        self.conflict = tuple(conflict)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, where the CLI turns it into this) stopped a search before its end.

    A ``KeyboardInterrupt``, so ``except KeyboardInterrupt`` still catches it.
    ``solution`` is the best complete assignment found so far (a
    ``problem.Solution`` with status ``"interrupted"`` and its certified
    bound), ``plan`` the ``Plan`` made from it by ``shardsolve.plan``; both
    ``None`` when the search had nothing complete yet.
    """

    def __init__(self, solution=None, plan=None):
        super().__init__("interrupted" + ("" if solution is None else ", with the best solution so far"))
        self.solution = solution
        self.plan = plan
