"""Rules as golden strings, one or more per primitive family, and the
printed form's round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax._src.lax import lax as lax_internal  # the total-order comparisons have no public name

from shardsolve.graph import OpView
from shardsolve.hlo import loop_adjustment
from shardsolve.mesh import MeshSpec
from shardsolve.rules import RULES, fallback_rule, rule_for
from shardsolve.rules.base import Rule
from shardsolve.rules.structural import factorize_reshape
from shardsolve.rules.validate import find_equation, op_view
from shardsolve.trace import trace
from rule_cases import prng_counters

F32 = jnp.float32


def view(primitive: str, ins, outs, params=None, in_dtypes=None, out_dtypes=None) -> OpView:
    ins, outs = tuple(map(tuple, ins)), tuple(map(tuple, outs))
    return OpView(
        primitive,
        params or {},
        ins,
        outs,
        tuple(in_dtypes or [F32] * len(ins)),
        tuple(out_dtypes or [F32] * len(outs)),
    )


def golden(op: OpView) -> str:
    rule = rule_for(op)
    assert rule is not None, f"{op.primitive} has no rule"
    assert tuple(rule.operand_shape(k) for k in range(len(op.in_shapes))) == op.in_shapes
    assert tuple(rule.result_shape(k) for k in range(len(op.out_shapes))) == op.out_shapes
    return str(rule)


def traced(fn, *args, primitive: str) -> str:
    return golden(op_view(find_equation(fn, *args, primitive=primitive)))


# -- elementwise -------------------------------------------------------------


def test_binary_linear_together():
    assert golden(view("add", [(8, 4), (8, 4)], [(8, 4)])) == "([i, j], [i, j])->([i, j]) {i=8, j=4} linear={(0, 1)}"


def test_mul_linear_in_each_operand_with_rank0_operand():
    assert golden(view("mul", [(8, 4), ()], [(8, 4)])) == "([i, j], [])->([i, j]) {i=8, j=4} linear={(0), (1)}"


def test_size1_operand_dims_broadcast():
    out = golden(view("mul", [(8, 4), (1, 1)], [(8, 4)]))
    assert out == "([i, j], [k, l])->([i, j]) {i=8, j=4, k=1, l=1} linear={(0), (1)}"


def test_rank0_everything():
    assert golden(view("sub", [(), ()], [()])) == "([], [])->([]) {} linear={(0, 1)}"


def test_size0_dims():
    assert golden(view("exp", [(0, 4)], [(0, 4)])) == "([i, j])->([i, j]) {i=0, j=4}"


@pytest.mark.parametrize("fn", [
    lambda x: x + x, jnp.exp, jnp.tanh, jax.nn.sigmoid, lax.erf_inv, lax.lgamma, jnp.sinh,
    lambda x: lax.clamp(0.2, x, 0.5), lambda x: x**3, lambda x: x**-2, lambda x: x**8,
    lambda x: lax.nextafter(x, lax.rev(x, (0,))), lambda x: jax.random.bits(jax.random.key(0), x.shape),
    lambda x: jnp.argmax(x.reshape(64, 64), 1), lambda x: jnp.argmin(x.reshape(64, 64).astype(jnp.int32), 0),
    lambda x: lax_internal.le_to_p.bind(x, lax.rev(x, (0,))),
], ids=["add", "exp", "tanh", "logistic", "erf_inv", "lgamma", "sinh", "clamp", "pow3", "pow-2", "pow8",
        "nextafter", "threefry", "argmax", "argmin-int", "total-order"])
def test_pointwise_flops_are_xla_cost_analysis_flops(fn):
    """A small program's FLOPs priced by the rules of its traced ops are those XLA counts for it compiled (a
    transcendental HLO op none, an expanded one its expansion's, every trip of a loop XLA makes of it:
    ``cost_analysis()`` plus ``hlo.loop_adjustment``)."""
    x = jnp.linspace(0.1, 0.9, 4096, dtype=F32)
    ours = sum(rule_for(op_view(eqn)).flops for eqn in trace(fn, x).jaxpr.eqns)
    compiled = jax.jit(fn).lower(x).compile()
    ca = compiled.cost_analysis()
    xla = float((ca[0] if isinstance(ca, (list, tuple)) else ca).get("flops", 0.0)) + loop_adjustment(compiled.as_text())[0]
    assert ours == pytest.approx(xla, rel=0.05, abs=16), (ours, xla)


def test_div_linear_in_numerator_only():
    assert golden(view("div", [(8,), (8,)], [(8,)])).endswith("linear={(0)}")


def test_nonlinear_pointwise_has_no_groups():
    for name in ("max", "tanh", "integer_pow", "eq", "clamp"):
        ins = [(), (4,), ()] if name == "clamp" else [(4,), (4,)] if name in ("max", "eq") else [(4,)]
        assert "linear" not in golden(view(name, ins, [(4,)]))


def test_select_n_linear_in_cases_with_scalar_predicate():
    out = golden(view("select_n", [(), (8, 4), (8, 4)], [(8, 4)], in_dtypes=[jnp.bool_, F32, F32]))
    assert out == "([], [i, j], [i, j])->([i, j]) {i=8, j=4} linear={(1, 2)}"


def test_convert_linear_only_between_floats():
    f2b = view("convert_element_type", [(8,)], [(8,)], in_dtypes=[F32], out_dtypes=[jnp.bfloat16])
    f2i = view("convert_element_type", [(8,)], [(8,)], in_dtypes=[F32], out_dtypes=[jnp.int32])
    assert golden(f2b) == "([i])->([i]) {i=8} linear={(0)}"
    assert golden(f2i) == "([i])->([i]) {i=8}"


def test_integer_pow_from_jaxpr():
    assert traced(lambda x: x**3, jnp.ones((8, 4)), primitive="integer_pow") == "([i, j])->([i, j]) {i=8, j=4}"


# -- structural --------------------------------------------------------------


def test_broadcast_in_dim():
    op = view("broadcast_in_dim", [(8, 1)], [(8, 2, 4)], {"shape": (8, 2, 4), "broadcast_dimensions": (0, 2)})
    assert golden(op) == "([i, j])->([i, k, l]) {i=8, j=1, k=2, l=4} linear={(0)}"
    scalar = view("broadcast_in_dim", [()], [(8, 4)], {"shape": (8, 4), "broadcast_dimensions": ()})
    assert golden(scalar) == "([])->([i, j]) {i=8, j=4} linear={(0)}"


def test_reshape_split_and_merge():
    split = view("reshape", [(32,)], [(4, 8)], {"new_sizes": (4, 8), "dimensions": None})
    merge = view("reshape", [(4, 8)], [(32,)], {"new_sizes": (32,), "dimensions": None})
    assert golden(split) == "([ij])->([i, j]) {i=4, j=8} linear={(0)}"
    assert golden(merge) == "([i, j])->([ij]) {i=4, j=8} linear={(0)}"


def test_reshape_attention_heads():
    op = view("reshape", [(2, 8, 64)], [(2, 8, 4, 16)], {"new_sizes": (2, 8, 4, 16), "dimensions": None})
    assert golden(op) == "([i, j, kl])->([i, j, k, l]) {i=2, j=8, k=4, l=16} linear={(0)}"


def test_reshape_general_greedy():
    op = view("reshape", [(6, 4)], [(2, 12)], {"new_sizes": (2, 12), "dimensions": None})
    assert golden(op) == "([ij, k])->([i, jk]) {i=2, j=3, k=4} linear={(0)}"


def test_reshape_unmatched_dims_need_replication():
    op = view("reshape", [(2, 3)], [(3, 2)], {"new_sizes": (3, 2), "dimensions": None})
    assert golden(op) == "([i, j])->([k, l]) {i=2, j=3, k=3, l=2} need_replication={i, j, k, l} linear={(0)}"


def test_reshape_size1_and_size0_dims():
    op = view("reshape", [(8, 1, 4)], [(1, 32)], {"new_sizes": (1, 32), "dimensions": None})
    assert golden(op) == "([i, j, k])->([l, ik]) {i=8, j=1, k=4, l=1} linear={(0)}"
    empty = view("reshape", [(0, 4)], [(4, 0)], {"new_sizes": (4, 0), "dimensions": None})
    assert golden(empty) == "([i, j])->([k, l]) {i=0, j=4, k=4, l=0} need_replication={j, k}"


def test_transpose_squeeze_expand():
    assert golden(view("transpose", [(2, 8, 4)], [(4, 2, 8)], {"permutation": (2, 0, 1)})) == (
        "([i, j, k])->([k, i, j]) {i=2, j=8, k=4} linear={(0)}"
    )
    assert golden(view("squeeze", [(8, 1, 4)], [(8, 4)], {"dimensions": (1,)})) == (
        "([i, j, k])->([i, k]) {i=8, j=1, k=4} linear={(0)}"
    )
    assert traced(lambda x: jnp.expand_dims(x, 1), jnp.ones((8, 4)), primitive="broadcast_in_dim") == (
        "([i, j])->([i, k, j]) {i=8, j=4, k=1} linear={(0)}"
    )


def test_concatenate_and_slice():
    cat = view("concatenate", [(8, 4), (8, 2)], [(8, 6)], {"dimension": 1})
    assert golden(cat) == "([i, j], [i, k])->([i, l]) {i=8, j=4, k=2, l=6} need_replication={j, k, l} linear={(0, 1)}"
    sl = view("slice", [(8, 4)], [(8, 2)], {"start_indices": (0, 1), "limit_indices": (8, 3), "strides": None})
    # the sliced dimension, narrower: a masked lookup there, summed over the devices splitting it
    assert golden(sl) == "([i, j])->([i, k]) {i=8, j=4, k=2} reduction={j} need_replication={k} linear={(0)}"


def test_pad_rev_split_dynamic_slices():
    assert traced(lambda x: jnp.pad(x, ((0, 0), (1, 2))), jnp.ones((8, 4)), primitive="pad") == (
        "([i, j], [])->([i, k]) {i=8, j=4, k=7} need_replication={j, k} linear={(0, 1)}"
    )
    assert traced(lambda x: x[:, ::-1], jnp.ones((8, 4)), primitive="rev") == (
        "([i, j])->([i, j]) {i=8, j=4} need_replication={j} linear={(0)}"
    )
    assert traced(lambda x: jnp.split(x, 2, axis=1), jnp.ones((8, 4)), primitive="split") == (
        "([i, j])->([i, k], [i, l]) {i=8, j=4, k=2, l=2} need_replication={j, k, l} linear={(0)}"
    )
    assert traced(lambda x, y: jnp.stack([x, y], axis=1), jnp.ones((8, 4)), jnp.ones((8, 4)), primitive="stack") == (
        "([i, j], [i, j])->([i, k, j]) {i=8, j=4, k=2} need_replication={k} linear={(0, 1)}"
    )
    assert traced(lambda x: lax.unstack(x, axis=1), jnp.ones((8, 2, 4)), primitive="unstack") == (
        "([i, j, k])->([i, k], [i, k]) {i=8, j=2, k=4} need_replication={j} linear={(0)}"
    )
    assert traced(lambda x, i: lax.dynamic_slice(x, (0, i), (8, 2)), jnp.ones((8, 4)), 1, primitive="dynamic_slice") == (
        "([i, j], [], [])->([i, k]) {i=8, j=4, k=2} reduction={j} need_replication={k} linear={(0)}"
    )  # a window narrower than its dimension: a masked lookup there, summed over the devices splitting it
    dus = traced(
        lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
        jnp.ones((8, 4)),
        jnp.ones((8, 2)),
        1,
        primitive="dynamic_update_slice",
    )
    # the operand splits where the update is narrower: each device writes what lands in its stretch
    assert dus == "([i, j], [i, k], [], [])->([i, j]) {i=8, j=4, k=2} need_replication={k} linear={(0, 1)}"


def test_iota_has_result_only_factors():
    op = view("iota", [], [(8, 4)], {"dtype": jnp.int32, "shape": (8, 4), "dimension": 0, "sharding": None})
    assert golden(op) == "()->([i, j]) {i=8, j=4}"


# -- contraction -------------------------------------------------------------


def test_matmul():
    op = view("dot_general", [(8, 4), (4, 16)], [(8, 16)], {"dimension_numbers": (((1,), (0,)), ((), ()))})
    rule = rule_for(op)
    assert str(rule) == "([i, j], [j, k])->([i, k]) {i=8, j=4, k=16} reduction={j} linear={(0), (1)}"
    assert rule.flops == 2 * 8 * 4 * 16


def test_dot_general_batch_contracting_free():
    op = view(
        "dot_general", [(2, 8, 4, 3), (2, 4, 5)], [(2, 8, 3, 5)], {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))}
    )
    assert golden(op) == "([i, j, k, l], [i, k, m])->([i, j, l, m]) {i=2, j=8, k=4, l=3, m=5} reduction={k} linear={(0), (1)}"


# -- reductions --------------------------------------------------------------


def test_reductions():
    s = view("reduce_sum", [(8, 16)], [(8,)], {"axes": (1,), "out_sharding": None})
    m = view("reduce_max", [(8, 16)], [(16,)], {"axes": (0,)})
    a = view("argmax", [(8, 16)], [(8,)], {"axes": (1,), "index_dtype": jnp.int32}, out_dtypes=[jnp.int32])
    assert golden(s) == "([i, j])->([i]) {i=8, j=16} reduction={j} linear={(0)}"
    assert golden(m) == "([i, j])->([j]) {i=8, j=16} reduction={i}(max)"
    assert golden(a) == "([i, j])->([i]) {i=8, j=16} need_replication={j}"
    assert rule_for(s).flops == 128


def test_reduce_to_scalar_and_min():
    assert golden(view("reduce_min", [(4, 8)], [()], {"axes": (0, 1)})) == "([i, j])->([]) {i=4, j=8} reduction={i, j}(min)"


def test_scans_and_sorts():
    assert traced(lambda x: jnp.cumsum(x, 1), jnp.ones((8, 4)), primitive="cumsum") == (
        "([i, j])->([i, j]) {i=8, j=4} need_replication={j} linear={(0)}"
    )
    assert traced(lambda x: lax.top_k(x, 2), jnp.ones((8, 4)), primitive="top_k") == (
        "([i, j])->([i, k], [i, k]) {i=8, j=4, k=2} need_replication={j, k}"
    )


# -- indexing ----------------------------------------------------------------


def test_embedding_lookup_is_vocab_parallel():
    out = traced(lambda w, t: w[t], jnp.ones((64, 16)), jnp.ones((4, 8), jnp.int32), primitive="gather")
    assert out == "([i, j], [k, l, m])->([k, l, j]) {i=64, j=16, k=4, l=8, m=1} reduction={i} linear={(0)}"


def test_embedding_gradient_scatter_add():
    grad = jax.grad(lambda w, t: w[t].sum())
    out = traced(grad, jnp.ones((64, 16)), jnp.ones((4, 8), jnp.int32), primitive="scatter-add")
    assert out == "([i, j], [k, l, m], [k, l, j])->([i, j]) {i=64, j=16, k=4, l=8, m=1} reduction={k, l} linear={(0, 2)}"


def test_take_along_axis_batching_dims():
    fn = lambda x, i: jnp.take_along_axis(x, i, axis=-1)  # noqa: E731
    out = traced(fn, jnp.ones((4, 8, 50)), jnp.ones((4, 8, 1), jnp.int32), primitive="gather")
    assert out == "([i, j, k], [i, j, l, m])->([i, j, l]) {i=4, j=8, k=50, l=1, m=1} reduction={k} linear={(0)}"


def test_gather_of_a_row_window_needs_replication():
    fn = lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, axis=0)  # noqa: E731
    vmapped = jax.vmap(fn, in_axes=(None, 0))
    out = traced(vmapped, jnp.ones((16, 8)), jnp.ones((4,), jnp.int32), primitive="gather")
    # rows: a 2-wide window needs replication; columns: a full-width window passes through
    assert out == "([i, j], [k, l])->([k, m, j]) {i=16, j=8, k=4, l=2, m=2} need_replication={i, l, m} linear={(0)}"


# -- registry, fallback, printed form ---------------------------------------


def test_fallback_replicates_everything():
    op = view("while", [(8, 4)], [(8, 4)], {})
    assert rule_for(op) is None
    assert str(fallback_rule(op)) == "([i, j])->([k, l]) {i=8, j=4, k=8, l=4} need_replication={i, j, k, l}"
    assert fallback_rule(op).strategies(MeshSpec.parse("a=2,b=4"))[0].work_split == 1
    assert len(fallback_rule(op).strategies(MeshSpec.parse("a=2,b=4"))) == 1


def test_rule_for_unknown_params_falls_back():
    assert rule_for(view("reshape", [(4, 8)], [(32,)], {"new_sizes": (32,), "dimensions": (1, 0)})) is None
    assert rule_for(view("transpose", [(4, 8)], [(8, 4)], {})) is None


def test_gpt2_primitives_have_rules():
    needed = {
        "dot_general", "add", "sub", "mul", "div", "neg", "max", "exp", "log", "tanh", "logistic", "rsqrt",
        "integer_pow", "broadcast_in_dim", "reshape", "transpose", "reduce_sum", "reduce_max", "gather",
        "scatter-add", "iota", "select_n", "convert_element_type", "concatenate", "slice", "squeeze",
        "argmax", "stop_gradient", "eq", "lt", "ge", "add_any", "copy", "square", "sqrt", "erf", "pow",
    }  # fmt: skip
    assert needed <= set(RULES)


def test_strategies_of_a_rule_on_a_mesh():
    op = view("dot_general", [(8, 4), (4, 8)], [(8, 8)], {"dimension_numbers": (((1,), (0,)), ((), ()))})
    got = [s.describe() for s in rule_for(op).strategies(MeshSpec.parse("x=2"))]
    assert got == ["replicated", "i:x", "j:x", "k:x", "partial[x]<-g0", "partial[x]<-g1"]
    fixed = [s.describe() for s in rule_for(op).strategies(MeshSpec.parse("x=2"), fixed_operands=(1,))]
    assert "partial[x]<-g1" not in fixed


def _factor_lists(draw, factors: list[str]) -> list[list[str]]:
    dims = []
    for _ in range(draw(st.integers(0, 3))):
        dims.append(draw(st.lists(st.sampled_from(factors), min_size=1, max_size=2, unique=True)))
    return dims


@st.composite
def rules(draw) -> Rule:
    n = draw(st.integers(1, 6))
    factors = [f"f{k}" for k in range(n)]
    sizes = {f: draw(st.sampled_from([0, 1, 2, 3, 4, 8])) for f in factors}
    operands = [_factor_lists(draw, factors) for _ in range(draw(st.integers(0, 3)))]
    results = [_factor_lists(draw, factors) for _ in range(draw(st.integers(1, 2)))]
    used = {f for group in operands + results for d in group for f in d}
    in_results = {f for group in results for d in group for f in d}
    reducible = sorted(used - in_results)
    reduction = draw(st.lists(st.sampled_from(reducible), unique=True)) if reducible else []
    need = draw(st.lists(st.sampled_from(sorted(used)), unique=True)) if used else []
    linear = draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), max_size=2))
    reduce_op = draw(st.sampled_from(["sum", "max", "min"])) if reduction else "sum"
    return Rule.build(
        operands, results, sizes, reduction=reduction, need_replication=need, reduce_op=reduce_op, linear=linear
    )


@settings(max_examples=200, deadline=None)
@given(rules())
def test_printed_form_round_trips(rule: Rule):
    text = str(rule)
    parsed = Rule.parse(text)
    assert parsed == rule
    assert str(parsed) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=0, max_size=4), st.randoms(use_true_random=False))
def test_reshape_factorization_covers_both_shapes(in_shape, rnd):
    total = 1
    for n in in_shape:
        total *= n
    out_shape = []
    rest = total
    while rest > 1:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        d = rnd.choice(divisors)
        out_shape.append(d)
        rest //= d
    if rnd.random() < 0.3:
        out_shape.insert(rnd.randrange(len(out_shape) + 1), 1)
    ins, outs, replicate = factorize_reshape(in_shape, out_shape)
    for shape, dims in ((in_shape, ins), (out_shape, outs)):
        for n, d in zip(shape, dims, strict=True):
            prod = 1
            for _, size in d:
                prod *= size
            assert prod == n
    shared_in = [f for d in ins for f, _ in d if f not in replicate]
    shared_out = [f for d in outs for f, _ in d if f not in replicate]
    # shared factors appear in the same (major to minor) order on both sides
    assert [f for f in shared_in if f in shared_out] == [f for f in shared_out if f in shared_in]
    op = view("reshape", [in_shape], [out_shape], {"new_sizes": tuple(out_shape), "dimensions": None})
    golden(op)


def _f32(*s):
    return jax.ShapeDtypeStruct(s, jnp.float32)


def _i32(*s):
    return jax.ShapeDtypeStruct(s, jnp.int32)


def _u32(*s):
    return jax.ShapeDtypeStruct(s, jnp.uint32)


def _c64(*s):
    return jax.ShapeDtypeStruct(s, jnp.complex64)


def _b1(*s):
    return jax.ShapeDtypeStruct(s, jnp.bool_)


_UNARY_FLOAT = ("abs acos acosh asin asinh atan atanh bessel_i0e bessel_i1e cbrt ceil cos cosh digamma erf erf_inv "
                "erfc exp exp2 expm1 floor is_finite lgamma log log1p logistic neg round rsqrt sign sin sinh sqrt "
                "square tan tanh stop_gradient").split()
_BINARY_FLOAT = "add sub mul div max min pow atan2 nextafter rem igamma igammac eq ne lt le gt ge".split()
_BINARY_INT = {"shift_left": lax.shift_left, "shift_right_logical": lax.shift_right_logical,
               "shift_right_arithmetic": lax.shift_right_arithmetic, "and": lax.bitwise_and, "or": lax.bitwise_or,
               "xor": lax.bitwise_xor}
_UNARY_INT = {"population_count": lax.population_count, "clz": lax.clz, "not": lax.bitwise_not}

# One program per registered primitive whose jaxpr holds an equation of it.
from jax._src.lax import lax as _lax_core  # noqa: E402  (total-order comparisons, which jnp.searchsorted binds)
from jax._src.lax import linalg as _lax_linalg  # noqa: E402  (the parts jax.lax.linalg binds)

# ``jax.lax.linalg``'s parts and relatives on a stack of 4x4 matrices (each binds its own primitive)
LINALG_PARTS = {
    "eig": lambda a: lax.linalg.eig(a, compute_left_eigenvectors=False),
    "schur": lambda a: _lax_linalg.schur(a),
    "hessenberg": lambda a: _lax_linalg.hessenberg(a),
    "tridiagonal": lambda a: _lax_linalg.tridiagonal(a),
    "geqrf": lambda a: _lax_linalg.geqrf(a),
    "geqp3": lambda a: _lax_linalg.geqp3(a, jnp.zeros(a.shape[:-1], jnp.int32)),
    "householder_product": lambda a: _lax_linalg.householder_product(a, a[..., 0]),
    "ormqr": lambda a: _lax_linalg.ormqr(a, a[..., 0], a),
    "symmetric_product": lambda a: _lax_linalg.symmetric_product(a, a),
    "tridiagonal_solve": lambda a: _lax_linalg.tridiagonal_solve(a[..., 0], a[..., 1], a[..., 2], a),
    "lu_pivots_to_permutation": lambda a: _lax_linalg.lu_pivots_to_permutation(
        jnp.zeros(a.shape[:-1], jnp.int32), a.shape[-1]),
}
SAMPLE_PROGRAMS = {
    **{n: (getattr(lax, n), (_f32(8, 4),)) for n in _UNARY_FLOAT},
    **{n: (getattr(lax, n), (_f32(8, 4), _f32(8, 4))) for n in _BINARY_FLOAT},
    **{n: (f, (_i32(8, 4), _i32(8, 4))) for n, f in _BINARY_INT.items()},
    **{n: (f, (_i32(8, 4),)) for n, f in _UNARY_INT.items()},
    "real": (lax.real, (_c64(8, 4),)),
    "imag": (lax.imag, (_c64(8, 4),)),
    "conj": (lax.conj, (_c64(8, 4),)),
    "complex": (lax.complex, (_f32(8, 4), _f32(8, 4))),
    "integer_pow": (lambda a: a**3, (_f32(8, 4),)),
    **{n: (getattr(_lax_core, f"{n}_p").bind, (_f32(8, 4), _f32(8, 4))) for n in ("eq_to", "le_to", "lt_to")},
    "reduce_precision": (lambda a: lax.reduce_precision(a, 5, 10), (_f32(8, 4),)),
    "clamp": (lambda a: lax.clamp(0.0, a, 1.0), (_f32(8, 4),)),
    "bitcast_convert_type": (lambda a: lax.bitcast_convert_type(a, jnp.int32), (_f32(8, 4),)),
    "copy": (lambda a: jnp.array(a, copy=True), (_f32(8, 4),)),
    "add_any": (jax.grad(lambda a: (jnp.sin(a) * a).sum()), (_f32(8, 4),)),
    "threefry2x32": (lambda k, x: jax.extend.random.threefry_2x32(k, x), (_u32(2), _u32(8))),
    "select_n": (lambda p, a, b: lax.select(p, a, b), (_b1(8, 4), _f32(8, 4), _f32(8, 4))),
    "convert_element_type": (lambda a: a.astype(jnp.int32), (_f32(8, 4),)),
    "broadcast_in_dim": (lambda a: jnp.broadcast_to(a, (2, 8, 4)), (_f32(8, 4),)),
    "reshape": (lambda a: a.reshape(4, 8), (_f32(8, 4),)),
    "transpose": (lambda a: a.T, (_f32(8, 4),)),
    "squeeze": (lambda a: a[:, 0], (_f32(8, 1),)),
    "concatenate": (lambda a, b: jnp.concatenate([a, b], axis=1), (_f32(8, 4), _f32(8, 4))),
    "split": (lambda a: jnp.split(a, 2, axis=1), (_f32(8, 4),)),
    "stack": (lambda a, b: jnp.stack([a, b], axis=1), (_f32(8, 4), _f32(8, 4))),
    "unstack": (lambda a: lax.unstack(a, axis=1), (_f32(8, 2),)),
    "slice": (lambda a: a[2:6], (_f32(8, 4),)),
    "pad": (lambda a: jnp.pad(a, ((1, 1), (0, 0))), (_f32(8, 4),)),
    "rev": (lambda a: a[::-1], (_f32(8, 4),)),
    "iota": (lambda: lax.iota(jnp.int32, 8), ()),
    "iota_2x32_shape": (lambda: prng_counters((8, 4)), ()),
    "dynamic_slice": (lambda a, i: lax.dynamic_slice_in_dim(a, i, 2), (_f32(8, 4), _i32())),
    "dynamic_update_slice": (lambda a, u, i: lax.dynamic_update_slice_in_dim(a, u, i, 0),
                             (_f32(8, 4), _f32(2, 4), _i32())),
    "dot_general": (lambda a, b: a @ b, (_f32(8, 4), _f32(4, 8))),
    "reduce_sum": (lambda a: a.sum(0), (_f32(8, 4),)),
    "reduce_max": (lambda a: a.max(0), (_f32(8, 4),)),
    "reduce_min": (lambda a: a.min(0), (_f32(8, 4),)),
    "reduce_prod": (lambda a: a.prod(0), (_f32(8, 4),)),
    "reduce_and": (lambda a: a.all(0), (_b1(8, 4),)),
    "reduce_or": (lambda a: a.any(0), (_b1(8, 4),)),
    "reduce_xor": (lambda a: lax.reduce_xor(a, (0,)), (_i32(8, 4),)),
    "argmax": (lambda a: jnp.argmax(a, 1), (_f32(8, 4),)),
    "argmin": (lambda a: jnp.argmin(a, 1), (_f32(8, 4),)),
    "cumsum": (lambda a: jnp.cumsum(a, 1), (_f32(8, 4),)),
    "cumprod": (lambda a: jnp.cumprod(a, 1), (_f32(8, 4),)),
    "cummax": (lambda a: lax.cummax(a, 1), (_f32(8, 4),)),
    "cummin": (lambda a: lax.cummin(a, 1), (_f32(8, 4),)),
    "cumlogsumexp": (lambda a: lax.cumlogsumexp(a, 1), (_f32(8, 4),)),
    "sort": (lambda a: jnp.sort(a, 1), (_f32(8, 4),)),
    "top_k": (lambda a: lax.top_k(a, 2), (_f32(8, 4),)),
    "gather": (lambda w, t: w[t], (_f32(16, 8), _i32(4))),
    "scatter-add": (lambda w, t, u: w.at[t].add(u), (_f32(16, 8), _i32(4), _f32(4, 8))),
    "scatter": (lambda w, t, u: w.at[t].set(u), (_f32(16, 8), _i32(4), _f32(4, 8))),
    "cholesky": (jnp.linalg.cholesky, (_f32(8, 4, 4),)),
    "eigh": (jnp.linalg.eigh, (_f32(8, 4, 4),)),
    "qr": (jnp.linalg.qr, (_f32(8, 6, 4),)),
    "svd": (jnp.linalg.svd, (_f32(8, 4, 6),)),
    "lu": (lax.linalg.lu, (_f32(8, 4, 4),)),
    "triangular_solve": (lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
                         (_f32(8, 4, 4), _f32(8, 4, 2))),
    **{name: (fn, (_f32(8, 4, 4),)) for name, fn in LINALG_PARTS.items()},
    "approx_top_k": (lambda a: lax.approx_max_k(a, 2), (_f32(8, 16),)),
    "fft": (jnp.fft.rfft2, (_f32(8, 4, 8, 8),)),
    "ragged_dot_general": (lax.ragged_dot, (_f32(16, 8), _f32(4, 8, 8), jnp.full((4,), 4, jnp.int32))),
    "reduce": (lambda a: lax.reduce((a, a), (0.0, 0.0), lambda x, y: (x[0] + y[0], jnp.maximum(x[1], y[1])), (1,)),
               (_f32(8, 4),)),
    "polygamma": (lambda a: jax.scipy.special.polygamma(1, a), (_f32(8, 4),)),
    "zeta": (lambda a: jax.scipy.special.zeta(a + 2, a), (_f32(8, 4),)),
    "regularized_incomplete_beta": (lambda a: jax.scipy.special.betainc(a, a, a), (_f32(8, 4),)),
    "igamma_grad_a": (jax.grad(lambda a: jax.scipy.special.gammainc(a, a).sum()), (_f32(8, 4),)),
    "scatter-sub": (lambda w, t, u: w.at[t].subtract(u), (_f32(16, 8), _i32(4), _f32(4, 8))),
    "scatter-mul": (lambda w, t, u: w.at[t].multiply(u), (_f32(16, 8), _i32(4), _f32(4, 8))),
    "scatter-min": (lambda w, t, u: w.at[t].min(u), (_f32(16, 8), _i32(4), _f32(4, 8))),
    "scatter-max": (lambda w, t, u: w.at[t].max(u), (_f32(16, 8), _i32(4), _f32(4, 8))),
    "optimization_barrier": (lax.optimization_barrier, (_f32(8, 4),)),
    "device_put": (lambda a: jax.device_put(a), (_f32(8, 4),)),
    "conv_general_dilated": (lambda x, w: lax.conv(x, w, (1, 1), "SAME"), (_f32(8, 4, 6, 6), _f32(8, 4, 3, 3))),
    "reduce_window_sum": (lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 2), "VALID"), (_f32(8, 8),)),
    "reduce_window_max": (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID"), (_f32(8, 8),)),
    "reduce_window_min": (lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 2), (1, 2), "VALID"), (_f32(8, 8),)),
    "select_and_scatter_add": (
        jax.grad(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID").sum()),
        (_f32(8, 8),),
    ),
}
# Names this JAX does not emit (older or newer spellings): an operation written by hand.
SAMPLE_VIEWS = {
    "copy_p": lambda: view("copy_p", [(8, 4)], [(8, 4)]),
    "mulhi": lambda: view("mulhi", [(8, 4), (8, 4)], [(8, 4)], in_dtypes=[jnp.uint32] * 2, out_dtypes=[jnp.uint32]),
    "expand_dims": lambda: view("expand_dims", [(8, 4)], [(1, 8, 4)], {"dimensions": (0,)}),
    "scatter_add": lambda: op_view(find_equation(*SAMPLE_PROGRAMS["scatter-add"][:1], *SAMPLE_PROGRAMS["scatter-add"][1],
                                                 primitive="scatter-add")),
    **{f"scatter_{kind}": (lambda kind=kind: op_view(find_equation(
        *SAMPLE_PROGRAMS[f"scatter-{kind}"][:1], *SAMPLE_PROGRAMS[f"scatter-{kind}"][1], primitive=f"scatter-{kind}")))
       for kind in ("sub", "mul", "min", "max")},
    "sharding_constraint": lambda: view("sharding_constraint", [(8, 4)], [(8, 4)]),
}


def _sample(name: str) -> OpView:
    if name in SAMPLE_VIEWS:
        return SAMPLE_VIEWS[name]()
    fn, args = SAMPLE_PROGRAMS[name]
    return op_view(find_equation(fn, *args, primitive=name))


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_registered_rule_builds_valid_strategies_on_a_sample(name):
    """Each rule, on a real equation of its primitive: shapes match, and its strategies are well formed.

    Replicated comes first; every strategy gives each operand and result a
    sharding of its rank, never uses a mesh axis twice in one sharding, and
    leaves a result partial only through a reduction factor or a linear group.
    """
    assert name in SAMPLE_PROGRAMS or name in SAMPLE_VIEWS, f"add a sample program for {name!r}"
    op = _sample(name)
    assert op.primitive == name or RULES[op.primitive] is RULES[name]  # a spelling of the same primitive
    golden(op)  # a rule, whose operand and result shapes are the equation's
    rule = rule_for(op)
    mesh = MeshSpec.parse("a=2,b=4")
    strategies = rule.strategies(mesh)
    assert strategies and not any(s.axes or s.partial for s in strategies[0].operands + strategies[0].results)
    for s in strategies:
        assert [x.ndim for x in s.operands] == [len(shape) for shape in op.in_shapes], s.describe()
        assert [x.ndim for x in s.results] == [len(shape) for shape in op.out_shapes], s.describe()
        for x in s.operands + s.results:
            assert len(set(x.axes + x.partial)) == len(x.axes + x.partial), s.describe()
        partial = {a for r in s.results for a in r.partial}
        reduced = {a for f in rule.reduction for a in s.axes_of(f)}
        assert partial <= reduced | {a for a, _ in s.partial_via}, s.describe()
    # What the rule declares, it offers: a reduction factor that the mesh can split leaves partial results,
    # a linear group passes partial operands through.
    if any(rule.size(f) % 2 == 0 and f not in rule.need_replication for f in rule.reduction):
        assert any(r.partial for s in strategies for r in s.results), str(rule)
    if rule.linear and rule.reduce_op == "sum":
        assert any(s.partial_via for s in strategies), str(rule)


def test_linear_groups_respect_dtypes():
    i32, b = jnp.int32, jnp.bool_
    assert "linear" not in golden(view("div", [(4,), (4,)], [(4,)], in_dtypes=[i32, i32], out_dtypes=[i32]))
    assert "linear" not in golden(view("select_n", [(4,), (4,), (4,)], [(4,)], in_dtypes=[b, b, b], out_dtypes=[b]))
    assert golden(view("add", [(4,), (4,)], [(4,)], in_dtypes=[i32, i32], out_dtypes=[i32])).endswith("linear={(0, 1)}")


def test_rule_for_reuses_rules_of_repeated_equations():
    op = view("dot_general", [(8, 4), (4, 8)], [(8, 8)], {"dimension_numbers": (((1,), (0,)), ((), ()))})
    again = view("dot_general", [(8, 4), (4, 8)], [(8, 8)], {"dimension_numbers": (((1,), (0,)), ((), ()))})
    assert rule_for(op) is rule_for(again)


# -- windows -----------------------------------------------------------------

_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv(stride: int, padding: str, groups: int = 1):
    return lambda x, w: lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=_NHWC,
                                                 feature_group_count=groups)


def test_conv_splits_batch_and_features_and_replicates_halo_dims():
    got = traced(_conv(1, "SAME"), jnp.ones((16, 8, 8, 4)), jnp.ones((3, 3, 4, 8)), primitive="conv_general_dilated")
    assert got == (
        "([i, j, k, l], [m, n, l, o])->([i, p, q, o]) {i=16, j=8, k=8, l=4, m=3, n=3, o=8, p=8, q=8} "
        "reduction={l} need_replication={j, k, m, n, p, q} linear={(0), (1)}"
    )


def test_conv_whose_windows_tile_splits_spatial_dims():
    # a patch embedding: 2x2 windows of stride 2, no padding; the input's spatial dims are [patch, offset]
    got = traced(_conv(2, "VALID"), jnp.ones((2, 8, 8, 3)), jnp.ones((2, 2, 3, 16)), primitive="conv_general_dilated")
    assert got == (
        "([i, jk, lm, n], [k, m, n, o])->([i, j, l, o]) {i=2, j=4, k=2, l=4, m=2, n=3, o=16} "
        "reduction={k, m, n} need_replication={k, m} linear={(0), (1)}"
    )


def test_grouped_conv_shares_the_group_factor():
    got = traced(_conv(1, "SAME", groups=4), jnp.ones((8, 4, 4, 8)), jnp.ones((3, 3, 2, 12)),
                 primitive="conv_general_dilated")
    assert got == (
        "([i, j, k, lm], [n, o, m, lp])->([i, q, r, lp]) {i=8, j=4, k=4, l=4, m=2, n=3, o=3, p=3, q=4, r=4} "
        "reduction={m} need_replication={j, k, n, o, q, r} linear={(0), (1)}"
    )


def test_conv_kernel_gradient_contracts_the_batch():
    fn = jax.grad(lambda w, x: _conv(1, "SAME")(x, w).sum())
    eqn = find_equation(fn, jnp.ones((3, 3, 4, 8)), jnp.ones((16, 8, 8, 4)), primitive="conv_general_dilated",
                        index=1)
    rule = rule_for(op_view(eqn))
    (batch,) = rule.reduction
    assert rule.size(batch) == 16 and batch not in rule.need_replication


def test_batch_grouped_conv_splits_its_contraction():
    """A depthwise convolution's kernel gradient (``batch_group_count``): the forward pass's batch is its
    contraction (summed over devices, as GSPMD plans it); the groups stay whole. FLOPs as XLA counts them."""
    x, w = jnp.ones((8, 4, 4, 4)), jnp.ones((3, 3, 1, 4))
    depthwise = lambda w, x: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_NHWC,  # noqa: E731
                                                      feature_group_count=4)
    grad = jax.grad(lambda w, x: depthwise(w, x).sum())
    ops = [op_view(e) for e in jax.make_jaxpr(grad)(w, x).jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    (op,) = [o for o in ops if o.params["batch_group_count"] > 1]
    rule = rule_for(op)
    dn = op.params["dimension_numbers"]
    (contracted,) = rule.reduction
    assert rule.operands[0][dn.lhs_spec[1]] == (contracted,) and rule.size(contracted) == 8  # the batch
    assert all(f in rule.need_replication for f in rule.operands[0][dn.lhs_spec[0]] + rule.results[0][dn.out_spec[1]])
    alone = jax.jit(lambda a, b: lax.conv_general_dilated_p.bind(a, b, **op.params))
    compiled = alone.lower(jnp.ones(op.in_shapes[0]), jnp.ones(op.in_shapes[1])).compile().cost_analysis()
    compiled = compiled[0] if isinstance(compiled, (list, tuple)) else compiled
    assert rule.flops == pytest.approx(compiled["flops"], rel=0.02)  # the groups expanded, as XLA's CPU runs them


def test_conv_flops_count_only_taps_on_real_input():
    # 3x3 SAME over 4x4: per spatial dim 4*3 - 2 border taps read padding
    x, w = jnp.ones((2, 4, 4, 3)), jnp.ones((3, 3, 3, 5))
    rule = rule_for(op_view(find_equation(_conv(1, "SAME"), x, w, primitive="conv_general_dilated")))
    compiled = jax.jit(_conv(1, "SAME")).lower(x, w).compile().cost_analysis()
    compiled = compiled[0] if isinstance(compiled, (list, tuple)) else compiled
    assert rule.flops == 2 * 2 * 5 * 3 * 10 * 10 == compiled["flops"]


def test_pools_tile_or_replicate():
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # noqa: E731
    assert traced(pool, jnp.ones((4, 8, 8, 2)), primitive="reduce_window_max") == (
        "([i, jk, lm, n])->([i, j, l, n]) {i=4, j=4, k=2, l=4, m=2, n=2} need_replication={k, m}"
    )
    overlapping = lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")  # noqa: E731
    assert traced(overlapping, jnp.ones((4, 8, 8, 2)), primitive="reduce_window_sum") == (
        "([i, j, k, l])->([i, m, n, l]) {i=4, j=8, k=8, l=2, m=8, n=8} need_replication={j, k, m, n} linear={(0)}"
    )
    grad = jax.grad(lambda x: pool(x).sum())
    assert traced(grad, jnp.ones((4, 8, 8, 2)), primitive="select_and_scatter_add") == (
        "([i, j, k, l], [i, jm, kn, l])->([i, jm, kn, l]) {i=4, j=4, k=4, l=2, m=2, n=2} need_replication={m, n} "
        "linear={(0)}"
    )
