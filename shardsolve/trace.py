"""Trace a function to one flat jaxpr, without allocating its arguments.

Nested calls (``jit``/``pjit``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat``/``checkpoint``, ``closed_call``) are inlined: the jaxpr is evaluated
by a small interpreter that steps into their bodies, and the interpreter is
traced again with ``jax.make_jaxpr``. Control flow (``scan``, ``while``,
``cond``) stays as one structured equation each; a ``while`` loop carries its
condition (``_predicate_carried``), so that its body and condition are one
program, and a ``cond`` whose branches hold no loop and no effect is traced
as every branch and a select of the taken one's results (``_selected``; the
rewriter runs it as a conditional again where its branches stayed apart).

PRNG keys (``jax.random.key``, and the keys ``jax.random.PRNGKey`` data is
wrapped into inside ``jax.random`` calls) become their key data: the
interpreter runs ``random_bits``, ``random_split``, ``random_fold_in`` and
``random_seed`` as the key implementation's own computation on ``uint32``
data (``threefry2x32`` and bit operations), and slices, reshapes and
broadcasts of key arrays on that data with its trailing key dimensions; a
``scan``, a ``while`` loop or a ``cond`` that carries keys runs its body on
their data too. Typed key arguments and results are the program's key data
(``Traced.in_keys``, ``out_keys``; ``key_data_leaves`` and ``wrapped_keys``
cross that boundary). The traced program then holds ordinary arrays only, and
computes the same bits.

    >>> import jax, jax.numpy as jnp
    >>> t = trace(lambda x: jax.jit(jnp.sin)(x) * 2, jax.ShapeDtypeStruct((4,), jnp.float32))
    >>> [e.primitive.name for e in t.jaxpr.eqns]
    ['sin', 'mul']
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from shardsolve.errors import ShardsolveError

INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
                     "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})


@dataclass(frozen=True)
class Traced:
    """A flat closed jaxpr with the pytree structure of its inputs and outputs."""

    jaxpr: Any  # jax.extend.core.ClosedJaxpr, nested calls inlined
    in_tree: Any  # PyTreeDef of the positional arguments tuple
    out_tree: Any  # PyTreeDef of the result
    in_avals: tuple  # ShapedArray per flattened input
    out_avals: tuple  # ShapedArray per flattened output
    # Per flattened input and output: the PRNG implementation's name (``"threefry2x32"``) of a typed key
    # leaf, which the program takes or gives as its key data (``key_data_leaves``), or None.
    in_keys: tuple
    out_keys: tuple
    needs_mesh: bool = False  # traced only with the plan's mesh as JAX's context mesh (``trace``)


def leaf_names(tree_def: Any, prefix: str = "") -> list[str]:
    """The name of every leaf of ``tree_def``: ``prefix`` and its key path (``jax.tree_util.keystr``).

    These are the names tables, ``explain``, conflict labels and plan files use,
    for any pytree: ``args[0]['blocks'][1]['w']``, ``args[1].mu['wte']``. A
    trailing ``.value`` (the one child of a box such as Flax's ``nnx.Variable``
    or Linen's ``LogicallyPartitioned``) is left out, so a parameter is named by
    its path, ``args[0]['lin']['kernel']``:

        >>> import jax
        >>> leaf_names(jax.tree_util.tree_structure(({"w": 1, "b": [2, 3]},)), "args")
        ["args[0]['b'][0]", "args[0]['b'][1]", "args[0]['w']"]
    """
    numbered = jax.tree_util.tree_unflatten(tree_def, list(range(tree_def.num_leaves)))
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(numbered)[0]:
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
            path = path[:-1]
        names.append(prefix + jax.tree_util.keystr(tuple(path)))
    return names


def abstractify(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of an array-like argument (arrays are never copied)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    try:
        import numpy as np

        arr = np.asarray(x)
    except Exception as e:
        raise ShardsolveError(f"argument of type {type(x).__name__} is not an array; pass arrays or jax.ShapeDtypeStruct") from e
    return jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype))


def _inner(eqn) -> tuple[Any, Sequence[Any]]:
    """The body of an inlinable equation as (open jaxpr, its consts)."""
    params = eqn.params
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params:
            body = params[key]
            if hasattr(body, "consts"):  # ClosedJaxpr
                return body.jaxpr, body.consts
            return body, ()
    raise ShardsolveError(f"cannot inline {eqn.primitive.name}: no body found in its params {sorted(params)}")


def _source_context(eqn):
    """Keep each equation's name stack, so compiled HLO ``op_name``s still point at the source."""
    try:
        from jax._src import source_info_util

        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        return source_info_util.user_context(eqn.source_info.traceback, name_stack=stack)
    except Exception:  # private API moved: lose the names, keep working
        return contextlib.nullcontext()


#: PRNG primitives ``trace`` runs on key data (see the module doc); slices, reshapes and the like of key arrays too.
KEY_DATA = frozenset({"random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap",
                      "random_unwrap", "random_clone"})


def key_impl(aval: Any) -> Any:
    """The PRNG implementation of a key-typed aval (``key<fry>[...]``), or None for any other."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return dtype._impl


def key_name(leaf: Any) -> str | None:
    """The PRNG implementation's name (``"threefry2x32"``) of a typed key leaf, or None for any other."""
    impl = key_impl(leaf)
    return None if impl is None else impl.name


@functools.lru_cache(maxsize=None)
def key_dims(name: str | None) -> int:
    """How many trailing dimensions the data of a key of implementation ``name`` adds (0 for None)."""
    return 0 if name is None else len(key_impl(jax.eval_shape(lambda: jax.random.key(0, impl=name))).key_shape)


def key_data_leaves(leaves: Sequence[Any], keys: Sequence[str | None]) -> list[Any]:
    """``leaves`` with each typed key (``keys[i]`` its implementation's name, else None) as its key data:
    arrays and tracers by ``jax.random.key_data``, ``ShapeDtypeStruct``s by their data's shape and dtype.

    The planned program takes key arguments, and gives key results, as their data; ``wrapped_keys`` undoes it.
    """
    if not any(keys):
        return list(leaves)
    out = list(leaves)
    for i, name in enumerate(keys):
        if name is None:
            continue
        x = out[i]
        if key_impl(x) is None:
            continue  # the data already (e.g. a flat program's own argument)
        if isinstance(x, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            out[i] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_data_sharding(x.sharding, name))
        else:
            out[i] = jax.random.key_data(x)
    return out


def _data_sharding(sharding: Any, name: str) -> Any:
    """A key leaf's ``NamedSharding`` as its data's: the key data's trailing dimensions whole."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * key_dims(name)
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def wrapped_keys(leaves: Sequence[Any], keys: Sequence[str | None]) -> list[Any]:
    """``leaves`` with each key result (``keys[i]`` its implementation's name) given back as a typed key from its
    data (``jax.random.wrap_key_data``)."""
    if not any(keys):
        return list(leaves)
    return [x if name is None or key_impl(x) is not None else jax.random.wrap_key_data(x, impl=name)
            for x, name in zip(leaves, keys)]


def _prng():
    try:
        from jax._src.random import prng
    except ImportError:  # private API moved
        try:
            from jax._src import prng
        except ImportError:
            raise ShardsolveError("this JAX release keeps its PRNG implementation where shardsolve cannot reach "
                                  "it: pass random bits (or masks) to the function instead of keys") from None
    return prng


def _inlined_call(fn: Callable, args: list) -> list:
    """``fn(*args)`` with the nested calls it makes (the key implementation jits its own) inlined too."""
    closed = jax.make_jaxpr(fn)(*args)
    return eval_inlined(closed.jaxpr, closed.consts, *args)


def _on_key_data(eqn, invals: list) -> list | None:
    """``eqn`` run on key data (see the module doc), or None when it touches no key array."""
    in_impls = [key_impl(v.aval) for v in eqn.invars]
    out_impls = [key_impl(v.aval) for v in eqn.outvars]
    name, params = eqn.primitive.name, eqn.params
    if name in ("random_wrap", "random_unwrap", "random_clone"):  # key data either way
        return [invals[0]]
    if not any(in_impls) and not any(out_impls):
        return None
    if name.startswith("random_") and name not in KEY_DATA:
        raise ShardsolveError(
            f"{name} draws from a PRNG key inside the function, which shardsolve cannot plan (jax.random.gamma, "
            "beta and dirichlet loop over their keys): draw the samples outside the function and pass them in")
    prng = _prng()
    impl = next(i for i in in_impls + out_impls if i is not None)
    keys = next(v.aval for v in eqn.invars if key_impl(v.aval) is not None) if any(in_impls) else eqn.invars[0].aval
    if name == "random_bits":
        return _inlined_call(lambda k: prng.random_bits_impl_base(impl, k, keys.ndim, bit_width=params["bit_width"],
                                                                  shape=params["shape"]), invals)
    if name == "random_split":
        return _inlined_call(lambda k: prng.random_split_impl_base(impl, k, keys.ndim, shape=params["shape"]), invals)
    if name == "random_fold_in":
        return _inlined_call(lambda k, m: prng.random_fold_in_impl_base(impl, k, m, keys.shape), invals)
    if name == "random_seed":
        return _inlined_call(lambda s: prng.random_seed_impl_base(s, impl=params["impl"]), invals)
    trailing = tuple(impl.key_shape)
    k = len(trailing)
    x = invals[0]
    if name in ("copy", "copy_p", "optimization_barrier") and len(invals) == 1:
        return [x]
    if name == "slice":
        strides = params["strides"] or (1,) * keys.ndim
        return [jax.lax.slice(x, tuple(params["start_indices"]) + (0,) * k,
                              tuple(params["limit_indices"]) + trailing, tuple(strides) + (1,) * k)]
    if name == "squeeze":
        return [jax.lax.squeeze(x, params["dimensions"])]
    if name == "reshape" and params.get("dimensions") is None:
        return [jax.lax.reshape(x, tuple(params["new_sizes"]) + trailing)]
    if name == "broadcast_in_dim" and len(invals) == 1:
        out = eqn.outvars[0].aval
        dims = tuple(params["broadcast_dimensions"]) + tuple(range(out.ndim, out.ndim + k))
        return [jax.lax.broadcast_in_dim(x, tuple(out.shape) + trailing, dims)]
    if name == "transpose":
        perm = tuple(params["permutation"])
        return [jax.lax.transpose(x, perm + tuple(range(len(perm), len(perm) + k)))]
    if name == "concatenate":
        return [jax.lax.concatenate(invals, params["dimension"])]
    if name == "select_n" and not in_impls[0]:  # keys chosen by a predicate: it picks whole keys
        which = invals[0]
        which = jax.lax.broadcast_in_dim(which, tuple(which.shape) + trailing, tuple(range(which.ndim)))
        return [jax.lax.select_n(which, *invals[1:])]
    if name == "dynamic_slice":
        sizes = tuple(params["slice_sizes"]) + trailing
        return [jax.lax.dynamic_slice(x, list(invals[1:]) + [0] * k, sizes)]
    raise ShardsolveError(
        f"{name} on a PRNG key array ({keys.str_short() if eqn.invars else 'key'}) is not supported: "
        "pass the keys' data (jax.random.key_data) or the random bits themselves into this part of the program"
    )


def _explicitly_sharded(jaxpr: Any) -> str:
    """Where ``jaxpr`` (a flat program's) carries a sharding in a type, over mesh axes that are not automatic:
    ``"reshard at file:line"``, ``"an argument f32[64@data]"``; "" where nowhere."""
    def typed(aval: Any) -> bool:
        sharding = getattr(aval, "sharding", None)
        spec = getattr(sharding, "spec", None)
        return spec is not None and any(entry is not None for entry in spec) and not _auto_only(sharding)

    for v in jaxpr.invars:
        if typed(v.aval):
            return f"an argument {v.aval.str_short()}"
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reshard" or any(typed(v.aval) for v in eqn.outvars):
            where = user_line(eqn)
            return f"{eqn.primitive.name} at {where}" if where else eqn.primitive.name
    return ""


def user_line(eqn: Any) -> str:
    """The user's source line that made equation ``eqn`` (``"file:line"``), or "" where JAX kept none."""
    from jax._src import source_info_util

    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001 - source info is best effort
        return ""
    return "" if frame is None else f"{frame.file_name}:{frame.start_line}"


def _auto_only(sharding: Any) -> bool:
    """Whether ``sharding`` (a type's, a ``reshard``'s destination) lies on a mesh of automatic axes alone: with
    the plan's mesh as context mesh, JAX adds ``reshard``s onto such (an ``.at[...].add``'s updates) that change
    nothing."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", None)
    return types is not None and all(t == jax.sharding.AxisType.Auto for t in types)


def _empty_results(eqn: Any) -> list[Any] | None:
    """Constants for an equation whose every result has no elements (``jnp.pad(mode="edge")`` slices a row of
    its operand and broadcasts it to an empty piece), where it has no effects; else None."""
    import numpy as np

    if not eqn.outvars or eqn.effects or eqn.primitive.name in INLINED:
        return None
    avals = [v.aval for v in eqn.outvars]
    if not all(hasattr(a, "shape") and 0 in a.shape and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
               for a in avals):
        return None
    return [np.zeros(a.shape, a.dtype) for a in avals]


def _linear_solve(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``custom_linear_solve`` as its ``solve`` jaxpr evaluated: the operands hold the constants of its four
    jaxprs (``const_lengths``: matvec, vecmat, solve, transpose_solve) and then the right-hand sides."""
    lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
    start = lengths.matvec + lengths.vecmat
    solve_consts = list(invals[start:start + lengths.solve])
    rhs = list(invals[sum(lengths):])
    return eval_inlined(jaxprs.solve.jaxpr, jaxprs.solve.consts, *solve_consts, *rhs)


def _subjaxprs(params: dict) -> Iterator[Any]:
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def _loops(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` holds a ``while`` loop, at any depth."""
    return any(e.primitive.name == "while" or any(_loops(j) for j in _subjaxprs(e.params)) for e in jaxpr.eqns)


def selectable(eqn: Any) -> bool:
    """Whether a ``cond`` equation may run as its every branch and a select of the taken one's results: no
    effects, and no ``while`` loop in any branch (a loop the index does not take might not end)."""
    return not eqn.effects and not any(_loops(b.jaxpr) or b.jaxpr.effects for b in eqn.params["branches"])


def _selected(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """A ``cond`` as every branch computed, then ``select_n`` of the taken branch's results.

    The planner then plans the branches' ops like any others (a ``cond`` kept
    whole replicates its operands: a branch's elementwise work on split
    activations or parameters would gather them). Each branch's ops are traced
    under the name scope ``cond{n}:branch{k}`` and the selects under
    ``cond{n}:select`` (``cond_tag``): where the branches stay apart
    (``graph.cond_groups``), the rewriter runs them as a ``lax.switch`` again
    and the plan prices the dearest branch alone. An index out of range takes
    the last branch, as XLA's conditional does. A platform-dependent ``cond``
    (``lax.platform_dependent``: ``jnp.diagonal``'s for Pallas kernels) is the
    branch this backend lowers.
    """
    branches = eqn.params["branches"]
    index, operands = invals[0], invals[1:]
    platforms = eqn.params.get("branches_platforms")
    if platforms:  # ``lax.platform_dependent``: the branch this backend's lowering takes, alone
        here = {jax.default_backend(), *(("cuda", "rocm") if jax.default_backend() == "gpu" else ())}
        taken = next((k for k, names in enumerate(platforms) if names is not None and here & set(names)),
                     next(k for k, names in enumerate(platforms) if names is None))
        return eval_inlined(branches[taken].jaxpr, branches[taken].consts, *operands)
    if len(branches) == 1:
        return eval_inlined(branches[0].jaxpr, branches[0].consts, *operands)
    tag = next(_CONDS)
    outs = []
    for k, b in enumerate(branches):  # each branch's ops under a name the rewriter finds them by (``cond_tag``)
        with jax.named_scope(f"cond{tag}:branch{k}"):
            outs.append(eval_inlined(b.jaxpr, b.consts, *operands))
    last = len(branches) - 1
    index = jax.lax.select((index < 0) | (index > last), jax.lax.full_like(index, last), index)
    with jax.named_scope(f"cond{tag}:select"):
        return [jax.lax.select_n(index, *(o[k] for o in outs)) for k in range(len(outs[0]))]


#: Numbers the ``cond`` equations ``_selected`` runs, for their name scopes.
_CONDS = itertools.count()
_COND_TAG = re.compile(r"cond(\d+):(branch(\d+)|select)")


def cond_tag(source: str) -> tuple[int, int] | None:
    """(the cond's number, its branch; -1 for the select of its results) of the outermost ``cond`` that
    ``_selected`` ran an op in, from the op's name stack; None for an op in none."""
    m = _COND_TAG.search(source)
    if m is None:
        return None
    return int(m.group(1)), -1 if m.group(3) is None else int(m.group(3))


def _touches_keys(eqn: Any) -> bool:
    """Whether ``eqn`` reads or makes a PRNG key array."""
    return any(key_impl(v.aval) is not None for v in (*eqn.invars, *eqn.outvars))


def _scan_on_key_data(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """A ``scan`` that carries or slices PRNG keys (a dropout key split layer by layer), its body run on the
    keys' data like the rest of the program (see the module doc)."""
    p = eqn.params
    body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:n_consts], list(invals[n_consts:n_consts + n_carry]), list(invals[n_consts + n_carry:])

    def step(carry, x):
        out = eval_inlined(body.jaxpr, body.consts, *consts, *carry, *x)
        return out[:n_carry], out[n_carry:]

    carry, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return list(carry) + list(ys)


def _literal(x: Any) -> int | None:
    """The integer a jaxpr literal holds (None for a traced value or anything else)."""
    if isinstance(x, jcore.Literal):
        x = x.val
    if isinstance(x, jax.core.Tracer) or np.ndim(x) != 0 or not np.issubdtype(np.asarray(x).dtype, np.integer):
        return None
    return int(x)


def _recast(eqn: Any) -> bool:
    """Whether ``eqn`` only changes a value's weak type (``convert_element_type`` to its own dtype)."""
    return (eqn.primitive.name == "convert_element_type" and len(eqn.invars) == 1
            and not isinstance(eqn.invars[0], jcore.Literal)
            and eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype)


def _uncast(var: Any, eqns: Sequence[Any]) -> Any:
    """``var``, or the value it recasts (``_recast``), followed back."""
    while not isinstance(var, jcore.Literal):
        made = next((e for e in eqns if any(v is var for v in e.outvars)), None)
        if made is None or not _recast(made):
            break
        var = made.invars[0]
    return var


def static_trips(eqn: Any, invals: Sequence[Any]) -> int | None:
    """The trip count of a ``while`` loop that counts a carry from a constant to a constant bound by a
    constant step (``while i < n: i += step``, or ``<=``; ``i`` changed by nothing else; each a literal or
    a value known while tracing), which XLA infers too; None otherwise."""
    p = eqn.params
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    init = invals[nc + nb:]
    tests = [e for e in cond.eqns if not _recast(e)]
    if len(tests) != 1 or cond.outvars[0] is not tests[0].outvars[0] or p["cond_jaxpr"].consts:
        return None

    def position(var: Any, invars: Sequence[Any]) -> int | None:
        return next((j for j, v in enumerate(invars) if v is var), None)

    def constant(var: Any, invars: Sequence[Any], values: Sequence[Any]) -> int | None:
        if isinstance(var, jcore.Literal):
            return _literal(var)
        j = position(var, invars)
        return None if j is None or j >= len(values) else _literal(values[j])

    test = tests[0]
    a, b = (_uncast(v, cond.eqns) for v in test.invars)
    name = test.primitive.name
    counter, bound = (a, b) if name in ("lt", "le") else (b, a) if name in ("gt", "ge") else (None, None)
    j = None if counter is None else position(counter, cond.invars)
    if j is None or j < nc:
        return None
    k = j - nc  # the counter's carry
    limit = constant(bound, cond.invars, invals[:nc])
    start = _literal(init[k])
    out = _uncast(body.outvars[k], body.eqns)
    made = [e for e in body.eqns if any(v is out for v in e.outvars)]
    if limit is None or start is None or len(made) != 1 or made[0].primitive.name != "add":
        return None
    limit += name in ("le", "ge")  # i <= n: i < n + 1
    inside = body.invars[nb + k]
    x, y = (_uncast(v, body.eqns) for v in made[0].invars)
    other = y if x is inside else x if y is inside else None
    step = None if other is None else constant(other, body.invars, invals[nc:nc + nb])
    if step is None or step <= 0:
        return None
    return max(0, -(-(limit - start) // step))


def carries_predicate(eqn: Any) -> bool:
    """Whether a ``while`` equation's condition only reads its last carry (``_predicate_carried``'s form)."""
    p = eqn.params
    cond = p["cond_jaxpr"].jaxpr
    return (p["cond_nconsts"] == 0 and not cond.eqns and len(cond.outvars) == 1
            and cond.outvars[0] is cond.invars[-1] and not p["cond_jaxpr"].consts)


def _predicate_carried(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """A ``while`` loop as one whose condition is its last carry, so that the condition is part of the body;
    a loop that counts from a constant to a constant (``static_trips``) as a scan of its trip count.

    The carry gains a flag, true at first; each iteration computes the
    condition of the carry it is given, the body's new carry, and keeps the
    new carry where the condition held (``select``), the old one where it did
    not, the flag set to the condition: the same results. Its body, condition
    included, is one program the planner plans like a scan's
    (``graph.Graph.from_jaxpr``): the carries keep their layouts from one
    iteration to the next and the condition's reductions are among the body's
    collectives. The rewriter runs it as the loop it was
    (``lower._Rewriter._while``): the condition's part of the body in the
    loop's condition, the rest in its body, the selects and the flag left out.
    """
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], list(invals[nc + nb:])
    trips = static_trips(eqn, invals)
    if trips == 0:
        return init
    if trips is not None:  # a counted loop: a scan of that length, which XLA counts as many times
        def counted(carry, _):
            return eval_inlined(body.jaxpr, body.consts, *body_consts, *carry), None

        return list(jax.lax.scan(counted, init, None, length=trips)[0])

    def step(state):
        carry = state[:-1]
        (go,) = eval_inlined(cond.jaxpr, cond.consts, *cond_consts, *carry)
        new = eval_inlined(body.jaxpr, body.consts, *body_consts, *carry)
        return (*(jax.lax.select(go, n, c) for n, c in zip(new, carry)), go)

    return list(jax.lax.while_loop(lambda state: state[-1], step, (*init, np.bool_(True))))[:-1]


def eval_inlined(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate an open jaxpr, stepping into nested calls instead of binding them.

    Key arrays are carried as their key data (see the module doc).
    """
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _source_context(eqn):
            if eqn.primitive.name in INLINED:
                # For custom_jvp/vjp calls, ``num_consts`` leading arguments are
                # ordinary arguments of the body: nothing to split off.
                body, body_consts = _inner(eqn)
                outvals = eval_inlined(body, body_consts, *invals)
            elif eqn.primitive.name == "cond" and selectable(eqn):
                outvals = _selected(eqn, invals)  # every branch, then the taken one's results
            elif eqn.primitive.name == "while" and not carries_predicate(eqn):
                outvals = _predicate_carried(eqn, invals)  # its body planned once, as a scan's
            elif eqn.primitive.name == "scan" and _touches_keys(eqn):
                outvals = _scan_on_key_data(eqn, invals)  # its body run on key data, as the program is
            elif (on_data := _on_key_data(eqn, invals)) is not None:
                outvals = on_data
            elif eqn.primitive.name == "reshard" and _auto_only(eqn.params.get("dst_sharding")):
                outvals = invals  # a no-op under automatic axes (JAX lowers it to nothing): the value itself
            elif eqn.primitive.name == "name":
                outvals = invals  # ``checkpoint_name``: an identity, for the remat policies inlined above it
            elif eqn.primitive.name == "custom_linear_solve":
                outvals = _linear_solve(eqn, invals)  # its forward solve (``jnp.linalg.solve``: LU, two triangles)
            elif eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
                # a transpose, then the reshape (a grouped convolution's kernel gradient): two ops with rules
                x = jax.lax.transpose(invals[0], tuple(eqn.params["dimensions"]))
                params = eqn.primitive.get_bind_params({**eqn.params, "dimensions": None})
                outvals = [eqn.primitive.bind(x, **params)]
            elif (empty := _empty_results(eqn)) is not None:
                outvals = empty  # no elements to compute: what it reads may go dead (``drop_dead_code``)
            elif eqn.primitive.name in ("empty", "empty2"):  # contents undefined: zeros are as good, and have a rule
                outvals = [jax.lax.full(v.aval.shape, 0, v.aval.dtype) for v in eqn.outvars]
            else:
                outvals = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outvals = [outvals]
        for var, val in zip(eqn.outvars, outvals):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _freeze(x: Any) -> Any:
    """A hashable stand-in for an equation parameter or literal (TypeError if there is none)."""
    import numpy as np

    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_freeze(y) for y in x)
    if isinstance(x, dict):
        return ("dict",) + tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (np.ndarray, np.generic)):
        return ("array", x.dtype.str, x.shape, np.asarray(x).tobytes())
    hash(x)
    return x


def merge_duplicates(closed: Any) -> Any:
    """Common-subexpression elimination: an equation that repeats an earlier one reads its results.

    XLA merges such equations (a causal mask rebuilt in every layer is one
    computation in the compiled program), so the plan must see them as one value.
    """
    jaxpr = closed.jaxpr
    rename: dict[Any, Any] = {}
    seen: dict[Any, Any] = {}
    kept = []

    def sub(v):
        return v if isinstance(v, jcore.Literal) else rename.get(v, v)

    def operand_key(v):
        if isinstance(v, jcore.Literal):
            return ("literal", str(v.aval), _freeze(__import__("numpy").asarray(v.val)))
        return v

    for eqn in jaxpr.eqns:
        invars = [sub(v) for v in eqn.invars]
        if any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars)
        key = None
        if not eqn.effects:
            try:
                key = (eqn.primitive, tuple(operand_key(v) for v in invars), _freeze(dict(eqn.params)))
                hash(key)
            except TypeError:
                key = None
        prev = seen.get(key) if key is not None else None
        if prev is not None and not any(isinstance(v, jcore.DropVar) for v in prev.outvars):
            for a, b in zip(eqn.outvars, prev.outvars):
                if not isinstance(a, jcore.DropVar):
                    rename[a] = b
            continue
        if key is not None:
            seen[key] = eqn
        kept.append(eqn)
    if len(kept) == len(jaxpr.eqns):
        return closed
    outvars = [sub(v) for v in jaxpr.outvars]
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=kept, outvars=outvars), closed.consts)


def drop_dead_code(closed: Any) -> Any:
    """Remove equations whose results nothing reads (and that have no effects), inside control flow too.

    XLA removes them from every compiled program, so a plan that priced them
    would predict collectives that never run. JAX's own dead-code pass
    (``dce_jaxpr_consts``) also drops a ``scan``'s unread ``ys`` and carries
    with the body work that makes only them (``lax.scan(body, h, ws)[0]`` of a
    body that also returns ``jnp.sum(c, axis=0)``), and unread ``cond``
    results; every input is kept, unread constants are dropped. Where that
    private pass is missing, top-level equations are still dropped.
    """
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr_consts
    except ImportError:  # private API moved: drop top-level equations only
        return _drop_dead_equations(closed)
    jaxpr = closed.jaxpr
    kept, used_consts, _ = dce_jaxpr_consts(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    if kept is jaxpr:
        return closed
    return jcore.ClosedJaxpr(kept, [c for c, used in zip(closed.consts, used_consts, strict=True) if used])


def _drop_dead_equations(closed: Any) -> Any:
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(not isinstance(v, jcore.DropVar) and v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    if len(kept) == len(jaxpr.eqns):
        return closed
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=kept[::-1]), closed.consts)


def in_mesh(mesh: Any):
    """A context in which ``mesh`` (a ``MeshSpec`` or a JAX mesh) is JAX's abstract mesh, so that a
    ``with_sharding_constraint(x, PartitionSpec(...))`` inside the traced function names its axes; a context
    mesh the caller set already is kept (nothing is entered). No-op without a mesh."""
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    abstract = mesh.abstract_mesh  # a MeshSpec's method, a JAX mesh's property
    return jax.sharding.use_abstract_mesh(abstract() if callable(abstract) else abstract)


def trace(fun: Callable, *args: Any, mesh: Any = None) -> Traced:
    """Trace ``fun(*args)`` to a flat closed jaxpr; ``args`` may be ``ShapeDtypeStruct``s.

    A function that does not trace as it is is traced again with ``mesh`` (a ``MeshSpec``), where given, as
    JAX's context mesh (``in_mesh``): a ``with_sharding_constraint(x, PartitionSpec(...))`` inside it needs one.
    (Not first: a context mesh keys JAX's caches, so a program JAX has just compiled without one traces
    again from scratch, 0.3 s of a 12-layer GPT-2's.)
    """
    if not callable(fun):
        raise ShardsolveError(f"expected a function to plan, got {type(fun).__name__}")
    abstract = jax.tree_util.tree_map(abstractify, args)
    leaves, in_tree = jax.tree_util.tree_flatten(abstract)
    needs_mesh = False
    try:
        nested, out_shape = jax.make_jaxpr(fun, return_shape=True)(*abstract)
    except ShardsolveError:
        raise
    except Exception as plain:
        if isinstance(in_mesh(mesh), contextlib.nullcontext):  # no mesh to try, or the caller's already set
            raise ShardsolveError(f"tracing the function failed: {type(plain).__name__}: "
                                  f"{str(plain).splitlines()[0]}") from plain
        needs_mesh = True
        try:
            with in_mesh(mesh):
                nested, out_shape = jax.make_jaxpr(fun, return_shape=True)(*abstract)
        except ShardsolveError:
            raise
        except Exception as e:
            raise ShardsolveError(f"tracing the function failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    out_tree = jax.tree_util.tree_structure(out_shape)
    in_keys = tuple(key_name(leaf) for leaf in leaves)
    out_keys = tuple(key_name(leaf) for leaf in jax.tree_util.tree_leaves(out_shape))

    def flat(*flat_args):  # key arguments arrive, and key results leave, as their data (see ``_on_key_data``)
        return eval_inlined(nested.jaxpr, nested.consts, *flat_args)

    with in_mesh(mesh) if needs_mesh else contextlib.nullcontext():
        closed = drop_dead_code(merge_duplicates(jax.make_jaxpr(flat)(*key_data_leaves(leaves, in_keys))))
    explicit = _explicitly_sharded(closed.jaxpr)
    if explicit:
        raise ShardsolveError(
            f"the function shards values in their types ({explicit}: a mesh of Explicit axes, jax.make_mesh's "
            "default, with jax.sharding.reshard or sharded arguments); shardsolve plans programs over automatic "
            "axes: build the mesh with axis_types=(AxisType.Auto,) * n and pin values with with_sharding_constraint"
        )
    return Traced(
        jaxpr=closed,
        in_tree=in_tree,
        out_tree=out_tree,
        in_avals=tuple(v.aval for v in closed.jaxpr.invars),
        out_avals=tuple(v.aval for v in closed.jaxpr.outvars),
        in_keys=in_keys,
        out_keys=out_keys,
        needs_mesh=needs_mesh,
    )


def _rewritten(eqn: Any) -> bool:
    """Whether ``eval_inlined`` runs ``eqn`` other than by binding it as it is (a body holding none is kept)."""
    name = eqn.primitive.name
    return (name in INLINED or name in ("reshard", "name", "custom_linear_solve", "empty", "empty2")
            or (name == "reshape" and eqn.params.get("dimensions") is not None)
            or (name == "while" and not carries_predicate(eqn)) or (name == "cond" and selectable(eqn))
            or _touches_keys(eqn) or _empty_results(eqn) is not None)


def inline_closed(closed: Any) -> Any:
    """A control-flow body (closed jaxpr) with nested calls inlined, duplicates merged, dead code dropped.

    Used for ``scan`` bodies, which ``trace`` keeps as one structured equation. Every equation the program's
    interpreter rewrites is rewritten in them too (``_rewritten``): a ``while`` loop carries its condition, a
    ``cond`` runs as a select, ``checkpoint_name`` is the identity it is, keys run on their data.
    """
    jaxpr = closed.jaxpr
    if not any(_rewritten(e) for e in jaxpr.eqns):
        return drop_dead_code(merge_duplicates(closed))
    avals = [v.aval for v in jaxpr.invars]

    def flat(*args):
        return eval_inlined(jaxpr, closed.consts, *args)

    return drop_dead_code(merge_duplicates(jax.make_jaxpr(flat)(*avals)))
