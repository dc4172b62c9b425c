"""shardsolve: plan the sharding of a JAX program with one global optimisation.

    import shardsolve
    from jax.sharding import PartitionSpec as P

    plan = shardsolve.plan(step, params, batch, mesh="data=2,model=4",
                           in_shardings=(None, P("data")), memory_limit="16GiB")
    jitted = plan.jit()            # jax.jit with the plan's shardings pinned
    plan.save("plan.json")

See README.md for the pipeline and the command-line tool.

The names below are bound on first use (PEP 562), so that ``import shardsolve``
does not import JAX: the ``shardsolve`` command sets up its signal handling
before JAX starts (a Ctrl-C while JAX imports would otherwise be lost in one
of its callbacks, or turn into an ``ImportError``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from shardsolve.version import __version__

# Public name -> the module that defines it.
_EXPORTS = {
    "Comparison": "shardsolve.compare",
    "compare": "shardsolve.compare",
    "InfeasibleError": "shardsolve.errors",
    "Interrupted": "shardsolve.errors",
    "ShardsolveError": "shardsolve.errors",
    "MeshAxis": "shardsolve.mesh",
    "MeshSpec": "shardsolve.mesh",
    "Model": "shardsolve.model",
    "load_model": "shardsolve.model",
    "Cost": "shardsolve.plan",
    "OpPlan": "shardsolve.plan",
    "Plan": "shardsolve.plan",
    "PredictedCollective": "shardsolve.plan",
    "load_plan": "shardsolve.plan",
    "Sharding": "shardsolve.sharding",
    "lower": "shardsolve.lower",
    "VerifyReport": "shardsolve.verify",
    "verify": "shardsolve.verify",
}

__all__ = sorted([*_EXPORTS, "__version__", "plan"])

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from shardsolve.compare import Comparison, compare
    from shardsolve.errors import InfeasibleError, Interrupted, ShardsolveError
    from shardsolve.lower import lower
    from shardsolve.mesh import MeshAxis, MeshSpec
    from shardsolve.model import Model, load_model
    from shardsolve.plan import Cost, OpPlan, Plan, PredictedCollective, load_plan
    from shardsolve.planner import plan
    from shardsolve.sharding import Sharding
    from shardsolve.verify import VerifyReport, verify


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardsolve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package's module type: ``shardsolve.plan`` is the function ``shardsolve.planner.plan``.

    Importing the submodule ``shardsolve.plan`` binds it as an attribute of the
    package; the property keeps the name for the function (take the module's
    names with ``from shardsolve.plan import ...``).
    """

    @property
    def plan(self) -> Any:
        return importlib.import_module("shardsolve.planner").plan

    @plan.setter
    def plan(self, value: Any) -> None:  # the import system binding the submodule: the function keeps the name
        pass


sys.modules[__name__].__class__ = _Package
