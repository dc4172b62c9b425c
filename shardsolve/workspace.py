"""Scratch memory an operation needs while it runs, as the backend compiles it.

Most operations read their operands and write their results and nothing
else, but some are compiled into several steps whose intermediate buffers
live while the operation runs. On the CPU backend, measured with JAX 0.10:
``select_and_scatter_add`` (a max-pool's gradient) is expanded into a window
reduction over (value, index) pairs and a scatter, with scratch of 5.5 to 7.4
times its operand's bytes; a convolution's weight gradient transposes both
operands (about their bytes again); ``cumsum`` about its operand's bytes.
None of this is visible in the jaxpr.

``workspace_ratio`` measures it instead of tabulating it: the operation is
compiled alone, at its global shapes, on the default backend, and the
compiled program's temporary bytes (``memory_analysis().temp_size_in_bytes``)
divided by its operands' bytes is the ratio (cached per primitive, shapes and
parameters). A strategy's scratch is that ratio times the bytes of its local
operands (``scratch_bytes``): scratch grows with the shard, as the buffers
it is made of do. A matmul whose operands are not in the order the backend's
kernel reads them needs scratch too (its transposed copies: about its
operands' bytes where the batch dimensions are not leading); for float32
matmuls on the CPU backend that is worked out without a compile
(``matmul_copies``, checked against the compiles), the rest are measured.
Primitives known to need none (elementwise, layout, reductions, gathers,
sorts) are not compiled; neither is one that carries a sub-program (a scan, a
loop), whose body the planner sees op by op. Where the compile fails the ratio
is 0.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import numpy as np

from shardsolve.cost import fusion_classes
from shardsolve.graph import Graph, Lit, Op
from shardsolve.mesh import MeshSpec
from shardsolve.rules.base import Strategy
from shardsolve.rules.elementwise import POINTWISE

#: Primitives that need no scratch (measured: gathers, sorts, in-place updates and XLA's loop fusions).
NO_SCRATCH = (fusion_classes(POINTWISE)[1]
              | frozenset({"gather", "dynamic_update_slice", "sort", "copy", "copy_p", "pjit",
                           "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "optimization_barrier",
                           "reduce_precision", "clamp", "split"}))


def workspace_ratio(graph: Graph, op: Op) -> float:
    """``op``'s scratch bytes per byte of its operands, as the default backend compiles it alone (0 where it
    needs none or cannot be compiled alone)."""
    found = _keyed(graph, op)
    if found is None:
        return 0.0
    key, avals = found
    known = matmul_copies(op.primitive, avals, op.params)
    if known is not None:
        return known
    if key is None:  # parameters without a stable text: measured per op, uncached
        return _measure(op, avals)
    return _cached(key, op, avals)


#: The smallest contracted dimension ``matmul_copies`` answers for, and the smallest other one unless both
#: operands hold ``MIN_KNOWN_BYTES`` (the backend contracts a few elements as products and a sum, drops a
#: dimension of one, and pads small operands by a few bytes).
MIN_KNOWN_DIM = 8
MIN_KNOWN_BYTES = 1 << 16

#: Scratch below this share of an operation's operand bytes counts as none: a few bytes of bookkeeping (a
#: scalar, a small index table) are no scratch worth planning for.
LEAST_RATIO = 0.01


def matmul_copies(primitive: str, avals: Sequence[tuple | None], params: dict) -> float | None:
    """The scratch ratio ``workspace_ratio`` would measure for a float32 matmul on XLA's CPU backend, worked
    out without compiling; None where this does not answer (measure it).

    XLA brings each operand of a ``dot_general`` to the order its kernel reads: the batch dimensions first,
    then, for the left operand, its free dimensions and then the contracted ones (the right operand the
    contracted ones, then its free ones); an operand with one free and one contracted dimension is read in
    either order. An operand in any other order is copied into that one first: the scratch is the bytes of
    the operands copied. Answered where that is all the backend does (checked against its compiles of
    random matmuls, ``tests/test_memory.py``): both operands float32, every contracted dimension at least
    ``MIN_KNOWN_DIM`` and every other at least 2 (at least ``MIN_KNOWN_DIM`` too where an operand is smaller
    than ``MIN_KNOWN_BYTES``), some contracted dimension and a free one on each side, and the batch and
    contracted dimensions of each operand in increasing order.
    """
    if primitive != "dot_general" or len(avals) != 2 or any(a is None or a[1] != "float32" for a in avals):
        return None
    preferred = params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) != np.float32:
        return None
    (ls, _), (rs, _) = avals
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lbytes, rbytes = 4.0 * math.prod(ls), 4.0 * math.prod(rs)
    if min((ls[d] for d in lc), default=0) < MIN_KNOWN_DIM or min((*ls, *rs), default=0) < 2:
        return None
    if min((*ls, *rs)) < MIN_KNOWN_DIM and min(lbytes, rbytes) < MIN_KNOWN_BYTES:
        return None
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    if not lc or not lfree or not rfree or any(list(d) != sorted(d) for d in (lc, rc, lb, rb)):
        return None
    if _backend() != "cpu":
        return None

    def copied(rank: int, batch: Sequence[int], free: list[int], contracted: Sequence[int], left: bool) -> bool:
        order = list(range(rank))
        if order[:len(batch)] != list(batch):
            return True
        if len(free) == 1 and len(contracted) == 1:
            return False
        return order[len(batch):] != ([*free, *contracted] if left else [*contracted, *free])

    copies = lbytes * copied(len(ls), lb, lfree, lc, True) + rbytes * copied(len(rs), rb, rfree, rc, False)
    ratio = copies / (lbytes + rbytes)
    return ratio if ratio > LEAST_RATIO else 0.0


@functools.lru_cache(maxsize=1)
def _backend() -> str:
    import jax

    return jax.default_backend()


def prefetch(graphs: Iterable[Graph]) -> None:
    """Start measuring, on background threads, the ratio of every op of ``graphs`` not known yet, so that the
    compiles (which release the interpreter) run beside the caller's own work; ``workspace_ratio`` then
    waits for the one it asks for. The ratios are the ones ``workspace_ratio`` measures itself."""
    for graph in graphs:
        for op in graph.ops:
            found = _keyed(graph, op)
            if found is None or found[0] is None:
                continue
            key, avals = found
            if matmul_copies(op.primitive, avals, op.params) is not None:
                continue
            if key not in _RATIOS and key not in _PENDING:
                _PENDING[key] = _pool().submit(_measure, op, avals)


def may_need_scratch(graph: Graph, op: Op) -> bool:
    """Whether ``workspace_ratio`` measures ``op`` (it is 0 for every other op)."""
    return _keyed(graph, op) is not None


def _keyed(graph: Graph, op: Op) -> tuple[tuple | None, tuple] | None:
    """``op``'s cache key (None where its parameters have no stable text) and operand shapes; None where it
    needs no scratch."""
    if op.primitive in NO_SCRATCH or any(_is_program(p) for p in op.params.values()):
        return None
    avals, literals = [], []
    for x in op.inputs:
        if isinstance(x, Lit):
            literals.append(x)
            avals.append(None)
        else:
            v = graph.values[x]
            avals.append((tuple(v.shape), str(np.dtype(v.dtype))))
    try:
        key = (op.primitive, tuple(avals), repr(sorted(op.params.items())), repr([lit.value for lit in literals]))
    except Exception:  # noqa: BLE001
        key = None
    return key, tuple(avals)


def scratch_bytes(ratio: float, strategy: Strategy, operand_shapes: Sequence[tuple[int, ...]],
                  itemsizes: Sequence[int], literal: Sequence[int], mesh: MeshSpec) -> float:
    """A strategy's scratch: ``ratio`` times the bytes of its local operands."""
    if not ratio:
        return 0.0
    return ratio * sum(o.local_bytes(operand_shapes[k], itemsizes[k], mesh)
                       for k, o in enumerate(strategy.operands) if k not in literal)


_RATIOS: dict[tuple, float] = {}
_PENDING: dict[tuple, Future] = {}  # measurements ``prefetch`` started, by key
_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="workspace"))
    return _POOL[0]


def _cached(key: tuple, op: Op, avals: tuple) -> float:
    if key not in _RATIOS:
        pending = _PENDING.pop(key, None)
        _RATIOS[key] = _measure(op, avals) if pending is None else pending.result()
    return _RATIOS[key]


def _measure(op: Op, avals: tuple) -> float:
    import jax

    specs = [jax.ShapeDtypeStruct(a[0], a[1]) for a in avals if a is not None]
    operand_bytes = sum(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize for s in specs)
    if operand_bytes <= 0:
        return 0.0

    def alone(*xs: Any) -> Any:
        it = iter(xs)
        args = [x.value if isinstance(x, Lit) else next(it) for x in op.inputs]
        return op.prim.bind(*args, **op.params)

    try:
        memory = jax.jit(alone).lower(*specs).compile().memory_analysis()
        temp = float(getattr(memory, "temp_size_in_bytes", 0) or 0)
    except Exception:  # noqa: BLE001 - a primitive that cannot run alone needs no scratch as far as we know
        return 0.0
    return temp / operand_bytes if temp > LEAST_RATIO * operand_bytes else 0.0


def _is_program(p: Any) -> bool:
    from jax.extend import core

    return isinstance(p, (core.Jaxpr, core.ClosedJaxpr)) or (isinstance(p, (tuple, list)) and any(
        isinstance(q, (core.Jaxpr, core.ClosedJaxpr)) for q in p))

