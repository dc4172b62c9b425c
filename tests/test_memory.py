"""The plan's peak memory counts the compiled program's buffers (``shardsolve.memory``, ``shardsolve.workspace``).

Each program here has buffers the problem's bound miscounts: the scratch of
an operation compiled into several steps, an in-place update, an output
allocated for the whole program, a gradient that becomes its updated
parameter's buffer, a parameter cut locally where each reader reads it, a
matmul's result cut by an elementwise reader late in the program, a scan's
carry updated in place in the buffer its initial value was made in.
``plan.cost.peak_memory`` must agree with ``memory_analysis()`` of the compiled ``plan.jit()`` within 10%
(the fidelity goal), and never exceed the bound the solver held.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardsolve
from shardsolve import planner
from shardsolve.build import BuildOptions, build_problem
from shardsolve.graph import Graph
from shardsolve.hlo import compiled_memory
from shardsolve.mesh import MeshSpec
from shardsolve.problem import FORBIDDEN
from shardsolve.trace import trace
from shardsolve.workspace import matmul_copies, prefetch, workspace_ratio

MESH = "data=2,model=4"
F32 = jnp.float32


def _pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _pool_grad(x, g):
    return jnp.tanh(jax.vjp(_pool, x)[1](g)[0])


def _scatter_into_zeros(ids, g):
    return jnp.zeros((4096, 256), F32).at[ids].add(g) * 2.0


def _output_made_last(x, w):
    r = jnp.sort(x @ w, axis=0)[-1]  # a big temporary (sorted: written out), gone before the output is made
    return jnp.outer(r, r)


def _sgd_step(params, x):
    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    grads = jax.grad(loss)(params)  # each gradient becomes its updated parameter's buffer
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def _two_layer_loss(x, w1, w2):
    h = jax.nn.relu(x @ w1)
    return jnp.mean((h @ w2) ** 2)


_two_layer_grad = jax.grad(_two_layer_loss, argnums=(1, 2))  # w2 is read forward, and backward for h's gradient


def _matmul_cut_late(x, w):
    y = x @ w  # read whole, then cut by an elementwise reader that must wait for `late`: XLA fuses the cut
    late = jnp.sort(jnp.tanh(y) @ w, axis=0)  # into that reader, so the whole of y lives until then
    return jnp.sin(y) * late


def _accumulated_in_a_scan(w, xs):
    def body(acc, x):  # the carry is the loop's state, updated in place; its zeros are that state's first value
        return acc + x.T @ jnp.tanh(x @ w), None

    return lax.scan(body, jnp.zeros_like(w), xs)[0]


def _read_through_a_reshape(x, w):
    y = x @ w  # a buffer; its reshape is a view of it (a bitcast), no buffer of its own
    flat = y.reshape(-1)
    return jnp.dot(flat, flat) * jnp.sort(y, axis=0)


def _block_attention(w, x):
    def loss(w):
        q, k = x @ w, x @ w.T

        def body(i, c):  # its gradient adds each block into zeros of k's whole shape, filled as the update reads them
            total, acc = c
            kb = lax.dynamic_slice_in_dim(k, i * 128, 128, 1)
            s = jnp.exp(jnp.einsum("bqd,bkd->bqk", q, kb))
            return total + s.sum(-1), acc + jnp.einsum("bqk,bkd->bqd", s, kb)

        total, acc = lax.fori_loop(0, 4, body, (jnp.zeros(x.shape[:2]), jnp.zeros(x.shape)))
        return jnp.mean(acc / total[..., None])

    return jax.grad(loss)(w)


def _chain_in_a_loop(w, x):
    def body(_, h):  # each matmul's result is a buffer that dies at the next: one iteration holds two at once
        for _ in range(4):
            h = jnp.sort(h @ w, axis=-1)
        return h

    return lax.fori_loop(0, 3, body, x)


POOL_ARGS = (jax.ShapeDtypeStruct((16, 64, 64, 32), F32), jax.ShapeDtypeStruct((16, 32, 32, 32), F32))
SCATTER_ARGS = (jax.ShapeDtypeStruct((2048,), jnp.int32), jax.ShapeDtypeStruct((2048, 256), F32))
SGD_ARGS = ({"w1": jax.ShapeDtypeStruct((1024, 4096), F32), "w2": jax.ShapeDtypeStruct((4096, 1024), F32)},
            jax.ShapeDtypeStruct((64, 1024), F32))
LAST_ARGS = (jax.ShapeDtypeStruct((1024, 64), F32), jax.ShapeDtypeStruct((64, 1024), F32))
SQUARE = jax.ShapeDtypeStruct((1024, 1024), F32)
SCAN_ARGS = (jax.ShapeDtypeStruct((2048, 2048), F32), jax.ShapeDtypeStruct((4, 64, 2048), F32))
TWO_LAYER_ARGS = (jax.ShapeDtypeStruct((256, 512), F32), jax.ShapeDtypeStruct((512, 1024), F32),
                  jax.ShapeDtypeStruct((1024, 512), F32))


def _graph(fun, *args) -> Graph:
    return Graph.from_traced(trace(fun, *args))


def _compiled_peak(plan, args) -> int:
    return compiled_memory(plan.jit().lower(*args).compile()).peak


def test_scratch_is_measured_where_the_backend_needs_it():
    g = _graph(_pool_grad, *POOL_ARGS)
    ratios = {op.primitive: workspace_ratio(g, op) for op in g.ops}
    assert ratios["select_and_scatter_add"] > 1.0  # expanded into a window reduction and a scatter
    assert ratios["tanh"] == 0.0


def _weight_gradient(x, g):
    # contracts the leading dimensions: the backend first copies the left operand (in bfloat16 both, as float32)
    # into the order its kernel reads
    return lax.dot_general(x, g, (((0, 1), (0, 1)), ((), ())))


def test_scratch_measured_in_the_background_is_the_compiled_scratch():
    # bfloat16: a matmul ``matmul_copies`` leaves to the backend's compile
    x, g = jax.ShapeDtypeStruct((24, 40, 56), jnp.bfloat16), jax.ShapeDtypeStruct((24, 40, 72), jnp.bfloat16)
    graph = _graph(_weight_gradient, x, g)
    prefetch([graph])  # the problem builder's way: compiled on background threads, asked for later
    (dot,) = [op for op in graph.ops if op.primitive == "dot_general"]
    assert matmul_copies(dot.primitive, [(v.shape, str(v.dtype)) for v in (x, g)], dot.params) is None
    temp = jax.jit(_weight_gradient).lower(x, g).compile().memory_analysis().temp_size_in_bytes
    assert temp > 0
    assert workspace_ratio(graph, dot) == pytest.approx(temp / (2 * 24 * 40 * (56 + 72)))


def _random_matmuls(count: int, seed: int, sizes=(8, 12, 16, 24, 64, 96), contracted=None, least_bytes=0):
    """Shapes and dimension numbers of float32 matmuls with their batch, contracted and free dimensions placed
    at random in each operand (each kind's dimensions in increasing order): ``count`` of them whose operands
    both hold at least ``least_bytes``, sizes from ``sizes`` (the contracted ones from ``contracted``)."""
    rng = np.random.default_rng(seed)
    found = 0
    while found < count:
        sizes_of = {k: [int(rng.choice(contracted if k == "c" and contracted else sizes))
                        for _ in range(int(rng.integers(low, 3)))]
                    for k, low in (("b", 0), ("c", 1), ("l", 1), ("r", 1))}
        places = []  # per operand: (its shape, the position of each (kind, index) dimension)
        for free in ("l", "r"):
            kinds = [(k, i) for k in ("b", "c", free) for i in range(len(sizes_of[k]))]
            slots = [int(p) for p in rng.permutation(len(kinds))]
            at = {}
            for k in ("b", "c", free):
                mine = sorted(slots[j] for j, (kk, _) in enumerate(kinds) if kk == k)
                at.update({(k, i): d for i, d in enumerate(mine)})
            shape = [0] * len(kinds)
            for (k, i), d in at.items():
                shape[d] = sizes_of[k][i]
            places.append((tuple(shape), at))
        (ls, la), (rs, ra) = places
        if 4 * min(np.prod(ls), np.prod(rs)) < least_bytes:
            continue
        found += 1
        nb, nc = len(sizes_of["b"]), len(sizes_of["c"])
        yield ls, rs, ((tuple(la[("c", i)] for i in range(nc)), tuple(ra[("c", i)] for i in range(nc))),
                       (tuple(la[("b", i)] for i in range(nb)), tuple(ra[("b", i)] for i in range(nb))))


MATMULS = [  # (left, right, dimension numbers): the training step's matmuls of a transformer
    ((16, 64, 96), (96, 24), (((2,), (0,)), ((), ()))),  # x @ w: read as they are
    ((16, 64, 96), (24, 96), (((2,), (1,)), ((), ()))),  # x @ w.T: a matrix read transposed
    ((16, 64, 96), (16, 64, 24), (((0, 1), (0, 1)), ((), ()))),  # a weight's gradient: the left one copied
    ((8, 64, 12, 16), (8, 64, 12, 16), (((3,), (3,)), ((0, 2), (0, 2)))),  # q @ k: heads inside, both copied
    ((8, 12, 64, 64), (8, 64, 12, 16), (((3,), (1,)), ((0, 1), (0, 2)))),  # weights @ v: the right one copied
    ((8, 12, 16, 64), (8, 12, 64, 64), (((3,), (2,)), ((0, 1), (0, 1)))),  # batch first: read as they are
]


# ... and matmuls placed at random: every dimension from 8, or, for operands of 64 KiB and more, the ones
# not contracted from 2 (four key-value heads of a grouped-query attention)
@pytest.mark.parametrize("lhs, rhs, dims", MATMULS + list(_random_matmuls(20, seed=0)) + list(
    _random_matmuls(12, seed=1, sizes=(2, 3, 4, 6, 16, 64, 300), contracted=(8, 16, 32, 128), least_bytes=1 << 16)))
def test_matmul_copies_are_the_compiled_scratch(lhs, rhs, dims):
    """The copies ``matmul_copies`` works out are the scratch the backend's compile of the matmul holds."""
    avals = [(lhs, "float32"), (rhs, "float32")]
    predicted = matmul_copies("dot_general", avals, {"dimension_numbers": dims, "preferred_element_type": None})
    assert predicted is not None
    memory = jax.jit(lambda a, b: lax.dot_general(a, b, dims)).lower(
        jax.ShapeDtypeStruct(lhs, F32), jax.ShapeDtypeStruct(rhs, F32)).compile().memory_analysis()
    operands = 4 * (np.prod(lhs) + np.prod(rhs))
    measured = memory.temp_size_in_bytes / operands
    assert predicted == pytest.approx(measured if measured > 0.01 else 0.0, abs=1e-9)


@pytest.mark.parametrize("fun, args, pins, outs", [
    (_pool_grad, POOL_ARGS, (P("data"), P("data")), None),
    (_scatter_into_zeros, SCATTER_ARGS, (P(), P()), None),
    (_output_made_last, LAST_ARGS, (P(), P()), None),
    (_sgd_step, SGD_ARGS, ({"w1": P(None, "model"), "w2": P("model", None)}, P("data")), None),
    (_matmul_cut_late, (SQUARE, SQUARE), (P(), P()), P(("data", "model"))),
    (_accumulated_in_a_scan, SCAN_ARGS, (P(), P()), None),
    (_chain_in_a_loop, (SQUARE, SQUARE), (P(), P()), None),
    (_read_through_a_reshape, LAST_ARGS, (P(), P()), None),
    (_block_attention, (jax.ShapeDtypeStruct((256, 256), F32), jax.ShapeDtypeStruct((16, 512, 256), F32)),
     (P(), P("data")), None),
], ids=["max-pool gradient", "scatter-add into zeros", "output made last", "SGD step", "matmul cut late",
        "carry accumulated in a scan", "chain of buffers in a loop body",
        "read through a reshape", "zeros filled as a loop body reads them"])
def test_planned_peak_is_the_compiled_peak(fun, args, pins, outs):
    plan = shardsolve.plan(fun, *args, mesh=MESH, in_shardings=pins, out_shardings=outs)
    compiled = _compiled_peak(plan, args)
    assert 0.9 <= compiled / plan.cost.peak_memory <= 1.1, (plan.cost.peak_memory, compiled)


def test_peak_is_within_the_bound_the_solver_holds(monkeypatch):
    step, args = _two_layer_grad, TWO_LAYER_ARGS
    solved = []
    to_plan = planner.to_plan

    def keep(graph, built, solution, *rest, **kw):
        plan = to_plan(graph, built, solution, *rest, **kw)
        solved.append((plan, built.problem.peak_usage(solution.assignment)))
        return plan

    monkeypatch.setattr(planner, "to_plan", keep)
    for pins in [(P("data"), None, None), (P("data"), P(None, "model"), P("model", None)), (P(), P(), P())]:
        shardsolve.plan(step, *args, mesh=MESH, in_shardings=pins)
    assert len(solved) >= 3
    for plan, bound in solved:
        assert 0 < plan.cost.peak_memory <= bound * (1 + 1e-9)
    assert any(plan.cost.peak_memory < bound for plan, bound in solved)  # the bound counts reads twice


def test_layouts_the_reshard_cache_keeps_are_in_the_bound():
    """Under a memory limit, an argument read in another layout than its own, and read next in that layout
    too, keeps that layout until then (the reshard cache keeps it, and so does the compiled program): the
    problem charges exactly its bytes for every (argument, reader, next reader) choice of strategies."""
    mesh = MeshSpec.parse(MESH)
    graph = _graph(_two_layer_grad, *TWO_LAYER_ARGS)
    pins_in, pins_out = [(None, "")] * len(graph.inputs), [(None, "")] * len(graph.outputs)
    kept_layouts = BuildOptions(kept_layouts=True)
    built = build_problem(graph, mesh, pins_in, pins_out, float(1 << 30), options=kept_layouts)
    unlimited = build_problem(graph, mesh, pins_in, pins_out, None, options=kept_layouts)
    default = build_problem(graph, mesh, pins_in, pins_out, float(1 << 30))
    assert not any(info.kind == "kept" for info in default.nodes)  # an option (see ``BuildOptions``)
    assert not any(info.kind == "kept" for info in unlimited.nodes)  # nothing to hold without a limit
    problem = built.problem
    edges = {(e.u, e.v): e.costs for e in problem.edges}
    kept = [k for k, info in enumerate(built.nodes) if info.kind == "kept"]
    w2 = graph.inputs[2]
    assert any(built.nodes[k].ref == w2 for k in kept)  # read forward, and backward for h's gradient
    checked = 0
    for k in kept:
        x = built.nodes[k].ref
        value = graph.values[x]
        producer = built.value_node[x]  # an argument's node
        (reader, later) = sorted(v for (u, v) in edges if u == k and v != producer)  # one next read here
        operand = graph.ops[built.nodes[reader].ref].inputs.index(x)
        following = graph.ops[built.nodes[later].ref].inputs.index(x)
        for p, source in enumerate(built.nodes[producer].shardings):
            for r, strategy in enumerate(built.nodes[reader].strategies):
                layout = strategy.operands[operand]
                nbytes = layout.local_bytes(value.shape, value.itemsize, mesh)
                made = layout != source and nbytes >= source.local_bytes(value.shape, value.itemsize, mesh)
                for q, next_strategy in enumerate(built.nodes[later].strategies):
                    allowed = ((edges[(k, producer)][:, p] < FORBIDDEN) & (edges[(k, reader)][:, r] < FORBIDDEN)
                               & (edges[(k, later)][:, q] < FORBIDDEN))
                    charged = made and next_strategy.operands[following] == layout
                    # the least the solver can hold for it is exact: the layout's bytes where it is kept
                    assert problem.nodes[k].usages[allowed].min() == (nbytes if charged else 0.0)
                    checked += charged
    assert checked > 0
