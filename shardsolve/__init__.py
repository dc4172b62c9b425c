"""shardsolve: plan the sharding of a JAX program with one global optimisation.

    import shardsolve
    from jax.sharding import PartitionSpec as P

    plan = shardsolve.plan(step, params, batch, mesh="data=2,model=4",
                           in_shardings=(None, P("data")), memory_limit="16GiB")
    jitted = plan.jit()            # jax.jit with the plan's shardings pinned
    plan.save("plan.json")

See README.md for the pipeline and the command-line tool.
"""

from shardsolve.compare import Comparison, compare
from shardsolve.errors import InfeasibleError, Interrupted, ShardsolveError
from shardsolve.mesh import MeshAxis, MeshSpec
from shardsolve.model import Model, load_model
from shardsolve.plan import Cost, OpPlan, Plan, PredictedCollective, load_plan
from shardsolve.sharding import Sharding
from shardsolve.lower import lower
from shardsolve.verify import VerifyReport, verify
from shardsolve.version import __version__

# Bound last: the function ``shardsolve.plan`` shadows the module ``shardsolve.plan``
# as an attribute (import from the module with ``from shardsolve.plan import ...``).
from shardsolve.planner import plan  # noqa: E402


__all__ = [
    "Comparison",
    "Cost",
    "InfeasibleError",
    "Interrupted",
    "MeshAxis",
    "MeshSpec",
    "Model",
    "OpPlan",
    "Plan",
    "PredictedCollective",
    "Sharding",
    "ShardsolveError",
    "VerifyReport",
    "__version__",
    "compare",
    "load_model",
    "load_plan",
    "lower",
    "plan",
    "verify",
]
