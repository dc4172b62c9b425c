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

# Public name -> the module that defines it (the four functions named like a submodule: ``_Package``).
_EXPORTS = {
    "Comparison": "shardsolve.compare",
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
    "VerifyReport": "shardsolve.verify",
}

__all__ = sorted([*_EXPORTS, "__version__", "compare", "lower", "plan", "verify"])

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


def _function_over_submodule(name: str, module: str) -> property:
    """The function ``module.name`` as the package's ``name``, whatever the import system binds there."""

    def get(package: types.ModuleType) -> Any:
        return getattr(importlib.import_module(module), name)

    def ignore(package: types.ModuleType, value: Any) -> None:  # the submodule of that name being bound
        pass

    return property(get, ignore)


class _Package(types.ModuleType):
    """The package's module type: ``shardsolve.plan``, ``compare``, ``lower`` and ``verify`` are functions.

    Importing a submodule binds it as an attribute of the package, and four
    functions share their name with one (``shardsolve.plan`` the module and
    ``shardsolve.planner.plan`` the function, ``shardsolve.compare`` and its
    function ``compare``, ...): these properties keep the names for the
    functions (take a module's names with ``from shardsolve.plan import ...``).
    """

    plan = _function_over_submodule("plan", "shardsolve.planner")
    compare = _function_over_submodule("compare", "shardsolve.compare")
    lower = _function_over_submodule("lower", "shardsolve.lower")
    verify = _function_over_submodule("verify", "shardsolve.verify")


sys.modules[__name__].__class__ = _Package
