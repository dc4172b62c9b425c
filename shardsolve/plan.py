"""A plan: the sharding of every value, the collectives it implies, and what it costs.

A ``Plan`` is data (versioned JSON, never pickled code). It keeps the traced
program beside it while it lives in memory, so ``plan.jit()`` and
``shardsolve.lower(plan)`` can run it; a plan loaded from disk is bound to a
function again with ``load_plan(path, fun, *args)`` (or ``plan.bind``), which
checks that the function's signature matches the file.

    plan = shardsolve.plan(step, params, batch, mesh="data=2,model=4",
                           in_shardings=(None, P("data")))
    plan.in_shardings   # NamedSharding pytree for jax.jit
    plan.cost.total     # estimated seconds per step
    plan.save("plan.json")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardsolve.cost import COMBINED_KINDS, collective_cost, collective_time, combine_groups, wire_type
from shardsolve.errors import ShardsolveError
from shardsolve.export import named_tree, plan_jit
from shardsolve.files import write_atomically
from shardsolve.graph import Graph
from shardsolve.mesh import MeshAxis, MeshSpec
from shardsolve.schedule import ARGUMENT, OUTPUT, Schedule, build_schedule
from shardsolve.sharding import Sharding
from shardsolve.trace import trace
from shardsolve.version import __version__

PLAN_FORMAT = "shardsolve-plan"
PLAN_VERSION = 1


@dataclass(frozen=True, slots=True)
class PredictedCollective:
    """One collective the plan implies: which value, between which shardings, demanded by whom."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    time: float
    value: int  # value id
    value_name: str
    src: Sharding  # the value's sharding before this collective
    dst: Sharding  # ... and after it
    producer: str  # the operation (or argument) that made the value
    consumer: str  # the operation (or output) that demanded the target sharding
    target: Sharding  # the sharding the consumer demanded
    # Runs of it: inside a scan body, the scan's length (times enclosing scans'). ``bytes`` is
    # one run's (a compiled while loop shows its body's collectives once); ``time`` is all runs'.
    repeats: int = 1
    # XLA merges it into an earlier collective of its kind (``combined_latencies``): ``time`` has no latency.
    merged: bool = False

    def to_json(self) -> dict:
        extra = {"repeats": self.repeats} if self.repeats != 1 else {}
        if self.merged:
            extra["merged"] = True
        return {
            **extra,
            "kind": self.kind,
            "axes": list(self.axes),
            "bytes": self.bytes,
            "time": self.time,
            "value": self.value,
            "value_name": self.value_name,
            "src": self.src.to_json(),
            "dst": self.dst.to_json(),
            "producer": self.producer,
            "consumer": self.consumer,
            "target": self.target.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> PredictedCollective:
        return cls(
            d["kind"], tuple(d["axes"]), int(d["bytes"]), float(d["time"]), int(d["value"]), d["value_name"],
            Sharding.from_json(d["src"]), Sharding.from_json(d["dst"]), d["producer"], d["consumer"],
            Sharding.from_json(d["target"]), int(d.get("repeats", 1)), bool(d.get("merged", False)),
        )


def predicted_collectives(schedule: Schedule, mesh: MeshSpec,
                          time: Callable[[str, tuple[str, ...], int, MeshSpec], float] = collective_time,
                          ) -> tuple[PredictedCollective, ...]:
    """The schedule's collective steps, priced: ``time(kind, axes, bytes, mesh)`` per run, times its repeats.

    With the default price, a collective that XLA merges into an earlier one
    (``combined_latencies``) pays no latency of its own: the merged collective
    pays one.
    """
    pairs = list(schedule.collective_steps())
    merged = combined_latencies(schedule, pairs) if time is collective_time and schedule.graph is not None else set()
    out = []
    for k, (d, step) in enumerate(pairs):
        seconds = time(step.kind, step.axes, step.bytes, mesh)
        if k in merged:
            c = collective_cost(step.kind, step.axes, mesh)
            seconds -= c.latency
        out.append(PredictedCollective(
            step.kind, step.axes, step.bytes, seconds * d.repeats, d.anchor, d.value_name, step.src, step.dst,
            d.producer, d.consumer, d.target, d.repeats, k in merged,
        ))
    return tuple(out)


def combined_latencies(schedule: Schedule, pairs: list) -> set[int]:
    """Of the (demand, step) ``pairs`` (``schedule.collective_steps()``), those whose latency an earlier one pays.

    XLA merges independent collectives of ``cost.COMBINED_KINDS`` over the same
    devices and reduction, of one element type (``cost.wire_type``; ``cost.combine_groups``), walking them in the post
    order of the computation (``Graph.post_order``): a collective's place is
    just before its first reader's there. One depends on another when
    its value is computed from a reader of the other's result (``Graph.reaching``)
    or is the same value. A collective's readers are every later read of the
    layout it makes, or of a layout resharded from that one (the reshard cache
    makes each once), not only the read it runs for. Demands in the same scan
    body merge with each other.
    """
    keys = []
    read: dict[tuple, list[int]] = {}  # scope -> the values its mergeable collectives read
    for d, step in pairs:
        mergeable = step.kind in COMBINED_KINDS and d.scope == d.site.scope and d.site.kind != ARGUMENT
        wire = wire_type(schedule.graph_of(d.scope).values[d.value].dtype) if mergeable else None
        # A conditional's branch is a computation of its own: its collectives merge among themselves.
        keys.append((d.site.scope, schedule.branch_of(d.site), step.axes, step.src.reduce_op, wire)
                    if mergeable else None)
        if mergeable:
            read.setdefault(d.site.scope, []).append(d.value)
    below = {scope: (vs, schedule.graph_of(scope).reaching(vs)) for scope, vs in read.items()}
    later: dict[tuple, list] = {}  # (scope, value) -> its demands in program order
    for d in schedule.demands:
        if d.scope == d.site.scope:
            later.setdefault((d.scope, d.value), []).append(d)

    def readers(d, step) -> list[int]:
        """The ops (in ``d``'s scope) that read what ``step`` makes, or a layout made from it."""
        made = {s.dst for s in d.steps[d.steps.index(step):]} | {d.target}
        sites = [d.site]
        demands = later[(d.scope, d.value)]
        for d2 in demands[demands.index(d) + 1:]:
            if d2.source in made:
                sites.append(d2.site)
                made |= {s.dst for s in d2.steps} | {d2.target}
        return [s.index for s in sites if s.kind != OUTPUT]

    reading = {k: readers(d, step) for k, (d, step) in enumerate(pairs) if keys[k] is not None}

    def depends(i: int, j: int) -> bool:
        a, b = pairs[i][0], pairs[j][0]
        if a is b or a.value == b.value:
            return True
        vs, reach = below[a.site.scope]
        bit = vs.index(b.value)
        return any(reach[op] >> bit & 1 for op in reading[i])

    def place(k: int) -> float:  # just before the first reader's place in the post order
        d = pairs[k][0]
        ops, outputs = schedule.graph_of(d.site.scope).post_order
        sites = [ops[i] for i in reading[k]] + ([outputs[d.site.index]] if d.site.kind == OUTPUT else [])
        return min(sites, default=math.inf) - 0.25

    order = sorted(reading, key=lambda k: (place(k), k))
    groups = combine_groups([keys[k] for k in order], lambda i, j: depends(order[i], order[j]))
    return {order[k] for group in groups for k in group[1:]}


@dataclass(frozen=True, slots=True)
class Cost:
    """Step-time estimate (seconds) with its parts, and memory per device (bytes)."""

    total: float
    compute: float
    communication: float
    peak_memory: float  # as ``memory_analysis()`` counts the compiled program (``shardsolve.memory``)
    objective: float  # the solver's objective (counts a reshard once per consumer edge)
    bytes_by_kind: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict:
        return {
            "total": self.total,
            "compute": self.compute,
            "communication": self.communication,
            "peak_memory": self.peak_memory,
            "objective": self.objective,
            "bytes_by_kind": dict(self.bytes_by_kind),
        }

    @classmethod
    def from_json(cls, d: dict) -> Cost:
        return cls(d["total"], d["compute"], d["communication"], d["peak_memory"], d["objective"],
                   tuple(sorted(d.get("bytes_by_kind", {}).items())))


@dataclass(frozen=True, slots=True)
class OpPlan:
    """How one operation runs: the shardings its strategy reads and writes."""

    primitive: str
    operands: tuple[Sharding, ...]
    results: tuple[Sharding, ...]
    strategy: str
    fallback: bool = False
    # A scan whose body is planned once: the body's ops in order (``()`` otherwise). The
    # boundary is in ``operands``/``results``: consts and carry as they are in the body (the
    # carry in == out, a fixed point), xs/ys stacked (leading dimension unsplit; the body's
    # slice drops it). ``length`` iterations; ``body_consts``: the body's closed-over constants.
    body: tuple[OpPlan, ...] = ()
    length: int = 0
    body_consts: tuple[Sharding, ...] = ()

    def to_json(self) -> dict:
        d = {
            "primitive": self.primitive,
            "operands": [s.to_json() for s in self.operands],
            "results": [s.to_json() for s in self.results],
            "strategy": self.strategy,
        }
        if self.fallback:
            d["fallback"] = True
        if self.length:
            d["length"] = self.length
            d["body"] = [o.to_json() for o in self.body]
            if self.body_consts:
                d["body_consts"] = [s.to_json() for s in self.body_consts]
        return d

    @classmethod
    def from_json(cls, d: dict) -> OpPlan:
        return cls(
            d["primitive"],
            tuple(Sharding.from_json(s) for s in d["operands"]),
            tuple(Sharding.from_json(s) for s in d["results"]),
            d["strategy"],
            bool(d.get("fallback", False)),
            tuple(OpPlan.from_json(o) for o in d.get("body", ())),
            int(d.get("length", 0)),
            tuple(Sharding.from_json(s) for s in d.get("body_consts", ())),
        )


@dataclass(frozen=True, slots=True)
class Signature:
    """Shapes and dtypes of the flattened arguments and outputs, and the pytree structures."""

    in_avals: tuple[tuple[tuple[int, ...], str], ...]
    out_avals: tuple[tuple[tuple[int, ...], str], ...]
    in_tree: str
    out_tree: str
    # Per flattened argument and output: the PRNG implementation of a typed key leaf (its avals above are its
    # key data's, as the program takes and gives it: ``trace.key_data_leaves``), or None.
    in_keys: tuple[str | None, ...]
    out_keys: tuple[str | None, ...]

    @classmethod
    def of(cls, traced) -> Signature:
        return cls(
            tuple((tuple(a.shape), str(a.dtype)) for a in traced.in_avals),
            tuple((tuple(a.shape), str(a.dtype)) for a in traced.out_avals),
            str(traced.in_tree),
            str(traced.out_tree),
            tuple(traced.in_keys),
            tuple(traced.out_keys),
        )

    def to_json(self) -> dict:
        d = {
            "in_avals": [[list(s), d] for s, d in self.in_avals],
            "out_avals": [[list(s), d] for s, d in self.out_avals],
            "in_tree": self.in_tree,
            "out_tree": self.out_tree,
        }
        if any(self.in_keys) or any(self.out_keys):  # (a plan file without keys reads as before)
            d["in_keys"], d["out_keys"] = list(self.in_keys), list(self.out_keys)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Signature:
        in_avals = tuple((tuple(s), t) for s, t in d["in_avals"])
        out_avals = tuple((tuple(s), t) for s, t in d["out_avals"])
        return cls(
            in_avals,
            out_avals,
            d["in_tree"],
            d["out_tree"],
            tuple(d.get("in_keys") or (None,) * len(in_avals)),
            tuple(d.get("out_keys") or (None,) * len(out_avals)),
        )

    def mismatch(self, other: Signature) -> str | None:
        """A one-line description of how ``other`` differs, or None."""
        if len(self.in_avals) != len(other.in_avals):
            return f"the plan has {len(self.in_avals)} argument leaves, the function {len(other.in_avals)}"
        for k, (a, b) in enumerate(zip(self.in_avals, other.in_avals)):
            if a != b:
                return f"argument leaf {k} is {b[1]}{list(b[0])} but the plan was made for {a[1]}{list(a[0])}"
        if self.in_tree != other.in_tree:
            return "the arguments' pytree structure differs from the plan's"
        if self.in_keys != other.in_keys:
            return "the function's PRNG key arguments differ from the plan's"
        if self.out_avals != other.out_avals or self.out_keys != other.out_keys:
            return "the function's outputs differ from the plan's"
        return None


@dataclass(frozen=True)
class Plan:
    mesh: MeshSpec
    signature: Signature
    inputs: tuple[Sharding, ...]  # per flattened argument
    outputs: tuple[Sharding, ...]  # per flattened output
    ops: tuple[OpPlan, ...]  # per operation of the flat jaxpr, in program order
    collectives: tuple[PredictedCollective, ...]
    cost: Cost
    status: str  # "optimal" or "feasible"
    gap: float
    lower_bound: float
    solve_time: float
    fallbacks: tuple[tuple[str, int], ...] = ()  # primitive -> number of ops that fell back
    stats: tuple[tuple[str, Any], ...] = ()
    source: str = ""  # e.g. "models/gpt2.py:gpt2 --size small", for the CLI
    consts: tuple[Sharding, ...] = ()  # per closed-over constant of the traced program (lower lays them out)
    input_names: tuple[str, ...] = ()  # per flattened argument: its key path, ``args[0]['w']`` (``trace.leaf_names``)
    # ``shardsolve.plan(..., logical_rules=True)``: (logical axis name, mesh axis | tuple of them | None) pairs,
    # in the form Flax's ``logical_to_mesh_sharding`` and MaxText take; they give every named parameter its sharding.
    logical_axis_rules: tuple[tuple[str, Any], ...] = ()
    # Not serialised: the live program.
    fun: Callable | None = field(default=None, compare=False, repr=False)
    graph: Any = field(default=None, compare=False, repr=False)

    # -- export -------------------------------------------------------------

    @property
    def in_shardings(self) -> Any:
        """Pytree of ``NamedSharding`` matching the arguments (a tuple, one entry per argument).

        JAX lays out no split that does not divide its dimension, so an argument
        the plan splits unevenly (``P("model")`` on 10 rows over 4 devices) is
        given *evened*: that dimension unsplit (``P()``), the others as planned.
        ``plan.jit()`` and ``shardsolve.lower(plan)`` take it so and cut it to the
        planned padded shards inside, without communication.
        """
        return named_tree(self, self.inputs, "in")

    @property
    def out_shardings(self) -> Any:
        """Pytree of ``NamedSharding`` matching the outputs.

        An output the plan splits unevenly is given evened, as ``in_shardings``
        are: the plan reshards its producer's result straight to that layout
        (the reshard is among ``collectives``), so a ``carry`` tie to an
        uneven argument closes the loop.
        """
        return named_tree(self, self.outputs, "out")

    def jit(self, execution: str = "lowered", **jit_kwargs) -> Callable:
        """The plan as a jitted callable with the function's signature, laid out as ``in/out_shardings``.

        ``execution="lowered"`` (the default) runs the rewriter's ``shard_map``
        program (``shardsolve.lower``): exactly the planned collectives.
        ``"pinned"`` is ``jax.jit`` of the function with every non-partial
        intermediate pinned by ``with_sharding_constraint``, leaving JAX's
        partitioner to place the reductions of partial values.
        """
        return plan_jit(self, execution, **jit_kwargs)

    def bind(self, fun: Callable, *args: Any) -> Plan:
        """Attach a function to a loaded plan, checking its signature against the plan's."""
        traced = trace(fun, *args, mesh=self.mesh)
        problem = self.signature.mismatch(Signature.of(traced))
        if problem:
            raise ShardsolveError(f"this plan was made for a different function: {problem}; plan it again")
        graph = Graph.from_traced(traced)
        if len(graph.ops) != len(self.ops) or any(o.primitive != p.primitive for o, p in zip(graph.ops, self.ops)):
            raise ShardsolveError(
                "this plan was made for a different function: its operations differ; plan it again"
            )
        return dataclasses.replace(self, fun=fun, graph=graph)

    def schedule(self) -> Schedule:
        """The plan's reshard schedule (``shardsolve.schedule``): what ``collectives`` price and the rewriter runs."""
        self.require_bound()
        return build_schedule(self.graph, self.mesh, self.inputs, self.consts, self.outputs, self.ops)

    def require_bound(self) -> None:
        """Refuse, in one line, a plan that is not bound to its function (a plan loaded without one)."""
        if self.graph is None or self.fun is None:
            raise ShardsolveError(
                "this plan is not bound to a function; use shardsolve.load_plan(path, fun, *args) or "
                "plan.bind(fun, *args)"
            )

    @property
    def fallback_count(self) -> int:
        return sum(n for _, n in self.fallbacks)

    # -- JSON ---------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "shardsolve": __version__,
            "source": self.source,
            "mesh": {
                "axes": [
                    {"name": a.name, "size": a.size, "bandwidth": a.bandwidth, "latency": a.latency}
                    for a in self.mesh.axes
                ],
                "peak_flops": self.mesh.peak_flops,
                "hbm_bandwidth": None if math.isinf(self.mesh.hbm_bandwidth) else self.mesh.hbm_bandwidth,
            },
            "signature": self.signature.to_json(),
            "status": self.status,
            "gap": self.gap,
            "lower_bound": self.lower_bound,
            "cost": self.cost.to_json(),
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "ops": [o.to_json() for o in self.ops],
            "collectives": [c.to_json() for c in self.collectives],
            "fallbacks": dict(self.fallbacks),
            **({"consts": [s.to_json() for s in self.consts]} if self.consts else {}),
            **({"input_names": list(self.input_names)} if self.input_names else {}),
            **({"logical_axis_rules": [[n, list(a) if isinstance(a, tuple) else a] for n, a in self.logical_axis_rules]}
               if self.logical_axis_rules else {}),
            "stats": {k: v for k, v in self.stats if not _is_timing(k)},
        }

    @classmethod
    def from_json(cls, d: dict, *, where: str = "plan") -> Plan:
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise ShardsolveError(f"{where} is not a shardsolve plan file (no 'format': '{PLAN_FORMAT}')")
        if d.get("version") != PLAN_VERSION:
            raise ShardsolveError(
                f"{where} has plan format version {d.get('version')} (written by shardsolve "
                f"{d.get('shardsolve', '?')}); this is shardsolve {__version__}, which reads version "
                f"{PLAN_VERSION}: plan the model again"
            )
        try:
            m = d["mesh"]
            mesh = MeshSpec(
                tuple(MeshAxis(a["name"], int(a["size"]), float(a["bandwidth"]), float(a["latency"])) for a in m["axes"]),
                peak_flops=float(m["peak_flops"]),
                hbm_bandwidth=math.inf if m.get("hbm_bandwidth") is None else float(m["hbm_bandwidth"]),
            )
            return cls(
                mesh=mesh,
                signature=Signature.from_json(d["signature"]),
                inputs=tuple(Sharding.from_json(s) for s in d["inputs"]),
                outputs=tuple(Sharding.from_json(s) for s in d["outputs"]),
                ops=tuple(OpPlan.from_json(o) for o in d["ops"]),
                collectives=tuple(PredictedCollective.from_json(c) for c in d["collectives"]),
                cost=Cost.from_json(d["cost"]),
                status=d["status"],
                gap=float(d["gap"]),
                lower_bound=float(d["lower_bound"]),
                solve_time=float(d.get("solve_time", 0.0)),
                fallbacks=tuple(sorted(d.get("fallbacks", {}).items())),
                consts=tuple(Sharding.from_json(s) for s in d.get("consts", ())),
                input_names=tuple(str(n) for n in d.get("input_names", ())),
                logical_axis_rules=tuple((str(n), tuple(a) if isinstance(a, list) else a)
                                         for n, a in d.get("logical_axis_rules", ())),
                stats=tuple(sorted(d.get("stats", {}).items())),
                source=d.get("source", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ShardsolveError):
                raise
            raise ShardsolveError(f"{where} is malformed ({type(e).__name__}: {e}); plan the model again") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (no half-written file on failure)."""
        path = Path(path)
        text = self.dumps()
        directory = path.parent if str(path.parent) else Path(".")
        if not directory.is_dir():
            raise ShardsolveError(f"cannot write {path}: directory {directory} does not exist")
        write_atomically(path, (text + "\n").encode())


def _is_timing(key: str) -> bool:
    """Wall-clock figures differ run to run; plan files leave them out to stay byte-for-byte deterministic."""
    return "time" in key or (key.endswith("_s") and "deterministic" not in key)


def load_plan(path: str | os.PathLike, fun: Callable | None = None, *args: Any) -> Plan:
    """Read a plan file; with ``fun`` and example ``args``, bind it to that function (signature checked)."""
    path = Path(path)
    if not path.is_file():
        raise ShardsolveError(f"plan file {path} does not exist; write one with `shardsolve plan ... -o {path}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardsolveError(f"{path} is not valid JSON ({e}); plan the model again") from None
    plan = Plan.from_json(data, where=str(path))
    if fun is not None:
        plan = plan.bind(fun, *args)
    return plan
