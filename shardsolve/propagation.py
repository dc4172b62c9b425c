"""The sharding JAX's own propagation gives every value of a program, as an assignment of the planner's problem.

Propagation (Shardy) is what a user gets from the same annotations without
shardsolve; its program is a plan too, and the planner's search may start from
it (``planner.search_plan`` does under a memory limit: propagation's program
there is often the fastest one known to fit, and the limited search far from
the optimum on its own). Shardy decides every intermediate's sharding inside
XLA's compiler and keeps none of them in the compiled program, so this module
compiles the program once more with every value of the traced jaxpr added as
an output left to propagation: an output takes its value's sharding, and
``compiled.output_shardings`` reads them back (``propagated_shardings``).
A scan's body is propagated the same way on its own, from the shardings its
operands take outside (its carry leaving as it entered: ``propagated_scopes``).

An operation's strategy is then the one whose results have exactly those
shardings (a pending sum as the strategy's partial result, its reduction on
the edge, as XLA's dot partitioning makes it), and of those the one whose
operands match the most (``propagated_assignment``); a node with no match
(a sharding outside the candidates, the node holding an operation's operands'
memory, a hub, a scan body that does not compile alone) is left free for
``encodings.heuristics.complete``. A dimension Shardy splits over part of a
mesh axis (sub-axes: GPT-2 small's 4 heads over 4 of ``model``'s 8 devices)
reads back replicated; the planner's shardings hold whole axes only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from shardsolve.build import Built, Scope
from shardsolve.graph import Graph, Lit, scan_counts
from shardsolve.mesh import MeshSpec
from shardsolve.sharding import Sharding

#: Compiler options of the extra compile: only its propagation is read, so the backend's optimisations are off
#: (GPT-2 small on 2x4: 6.0 s to 3.1 s), and the CPU backend emits its fusions by the older elemental emitters,
#: which compile a program with every value an output several times faster (a 635-operation ranking loss on
#: 2x4: 6.7 s to 1.1 s, the same shardings read). Options this XLA does not know are left out.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_cpu_use_fusion_emitters": False}


def compile_fast(lowered: Any) -> Any:
    """``lowered.compile`` with ``FAST_COMPILE``, less each option the compiler refuses as unknown."""
    options = dict(FAST_COMPILE)
    while True:
        try:
            return lowered.compile(options)
        except Exception as e:  # noqa: BLE001 - XLA raises its own error type for an unknown option
            unknown = next((k for k in options if f"No such compile option: '{k}'" in str(e)), None)
            if unknown is None:
                raise
            del options[unknown]


@contextlib.contextmanager
def shardy_propagation() -> Iterator[None]:
    """Select Shardy propagation for the block (restored afterwards, even on error)."""
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", True)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def concrete_mesh(mesh: Any, spec: MeshSpec):
    """A ``jax.sharding.Mesh`` with real devices for ``spec`` (or the user's own ``Mesh``).

    The default backend's devices where there are enough, else the CPU's
    (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` makes N of them).
    """
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    devices = jax.devices()
    if len(devices) < spec.size:
        try:
            cpus = jax.devices("cpu")
        except RuntimeError:
            cpus = []
        devices = cpus if len(cpus) >= spec.size else devices
    return spec.devices_mesh("compare", devices)


def propagated_shardings(graph: Graph, mesh: MeshSpec, inputs: Sequence[Sharding | None],
                         outputs: Sequence[Sharding | None]) -> dict[int, Sharding]:
    """Value id -> the sharding Shardy propagates to it from ``inputs`` / ``outputs`` (one per input and
    output of ``graph``'s jaxpr; None: left to propagation), for the inputs and every operation's results. A
    value whose propagated sharding is not a ``NamedSharding`` is left out."""
    closed = graph.closed
    jaxpr = closed.jaxpr
    results = [(op, r) for op in graph.ops for r, var in enumerate(op.eqn.outvars)
               if not isinstance(var, jcore.DropVar)]
    every = jaxpr.replace(outvars=list(jaxpr.outvars) + [op.eqn.outvars[r] for op, r in results])
    fun = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(every, closed.consts))
    jmesh = concrete_mesh(mesh, mesh)

    def named(s: Sharding | None):
        return None if s is None else NamedSharding(jmesh, s.to_spec())

    in_shardings = [named(s) for s in inputs]
    out_shardings = [named(s) for s in outputs] + [None] * len(results)
    with shardy_propagation():
        lowered = jax.jit(fun, in_shardings=in_shardings, out_shardings=out_shardings).lower(
            *(v.aval for v in jaxpr.invars))
        compiled = compile_fast(lowered)
    out: dict[int, Sharding] = {}

    def read(vid: int, s: Any) -> None:
        if isinstance(s, NamedSharding):
            out[vid] = Sharding.from_spec(s.spec, len(graph.values[vid].shape), mesh)

    for vid, s in zip(graph.inputs, compiled.input_shardings[0]):
        read(vid, s)
    for (op, r), s in zip(results, compiled.output_shardings[len(jaxpr.outvars):]):
        read(op.outputs[r], s)
    return out


def propagated_scopes(graph: Graph, built: Built, mesh: MeshSpec, inputs: Sequence[Sharding | None],
                      outputs: Sequence[Sharding | None]) -> dict[Scope, dict[int, Sharding]]:
    """``propagated_shardings`` of the program (scope ``()``) and of every scan body ``built`` plans once: a
    body from the shardings propagated to its scan's operands (an x-slice's without the stacked dimension,
    none where that is split), its carry-out pinned to its carry-in's. A body whose program does not
    compile is left out."""
    out = {(): propagated_shardings(graph, mesh, inputs, outputs)}
    for scope in sorted(built.scans, key=len):
        outer = out.get(scope[:-1])
        if outer is None:
            continue
        op = graph.nested(scope[:-1]).ops[scope[-1]]
        body = built.scans[scope].body
        n_consts, n_carry = scan_counts(op)
        ins: list[Sharding | None] = []
        for k, x in enumerate(op.inputs):
            s = None if isinstance(x, Lit) else outer.get(x)
            if s is not None and k >= n_consts + n_carry:  # an x-slice: the stacked dimension goes
                s = None if s.dims[0] else Sharding(s.dims[1:])
            ins.append(s)
        outs = ins[n_consts:n_consts + n_carry] + [None] * (len(body.outputs) - n_carry)
        try:
            out[scope] = propagated_shardings(body, mesh, ins, outs)
        except Exception:  # noqa: BLE001 - a body propagation cannot compile alone is completed by the solver
            continue
    return out


_MISSING = object()  # a value whose sharding propagation's program does not give


def propagated_assignment(graph: Graph, built: Built,
                          scoped: dict[Scope, dict[int, Sharding]]) -> tuple[np.ndarray, np.ndarray]:
    """``scoped`` (``propagated_scopes``) as an assignment of ``built``'s problem: (strategy per node,
    whether the node was matched); an unmatched node's strategy is 0."""
    nodes = built.problem.nodes
    x = np.zeros(len(nodes), dtype=np.int64)
    matched = np.zeros(len(nodes), dtype=bool)

    def choose(k: int, want: Sharding | None, candidates: Sequence[Sharding]) -> None:
        if want is not None and want in candidates:
            x[k], matched[k] = candidates.index(want), True

    top = scoped.get((), {})
    for k, info in enumerate(built.nodes):
        if info.kind in ("input", "const"):
            choose(k, top.get(info.ref), info.shardings)
        elif info.kind == "output":
            out = graph.outputs[info.ref]
            choose(k, None if isinstance(out, Lit) else top.get(out), info.shardings)
        elif info.kind == "op" and info.scope in scoped:
            shardings = scoped[info.scope]
            g = graph.nested(info.scope)
            op = g.ops[info.ref]
            # An empty result (a split's zero-width part) holds no data: any layout of it matches.
            wants = [None if 0 in g.values[v].shape else shardings.get(v, _MISSING) for v in op.outputs]
            if any(w is _MISSING for w in wants):
                continue
            best = None
            for s, strategy in enumerate(info.strategies):
                if any(w is not None and Sharding(r.dims) != w for r, w in zip(strategy.results, wants)):
                    continue
                score = sum(not isinstance(v, Lit) and shardings.get(v) == o for v, o in zip(op.inputs, strategy.operands))
                score -= 0.5 * sum(bool(r.partial) for r in strategy.results)  # an exact result before a pending sum
                if best is None or score > best[0]:
                    best = (score, s)
            if best is not None:
                x[k], matched[k] = best[1], True
    for scope, sn in built.scans.items():
        inner = scoped.get(scope)
        if inner is None:
            continue
        body = sn.body
        boundary = [*zip(sn.const + sn.carry + sn.xs, body.inputs)]
        boundary += [*zip(sn.ys, body.outputs[len(sn.carry):])]
        for k, v in boundary:
            choose(k, None if isinstance(v, Lit) else inner.get(v), built.nodes[k].shardings)
    return x, matched
