"""The program as a graph of values and operations.

Built from the flat jaxpr of ``shardsolve.trace``: every jaxpr variable is a
``Value`` (an input, a constant, or an operation's result), every equation an
``Op`` whose operands are value ids or literals. Values and ops are numbered in
program order, so op ``k`` runs at time ``k`` of the liveness model.

    >>> import jax, jax.numpy as jnp
    >>> from shardsolve.trace import trace
    >>> g = Graph.from_traced(trace(lambda x, w: jnp.tanh(x @ w),
    ...     jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((4, 2), jnp.float32)))
    >>> [op.primitive for op in g.ops], [g.values[v].name for v in g.inputs]
    (['dot_general', 'tanh'], ['args[0]', 'args[1]'])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from jax.extend import core as jcore

from shardsolve.cost import wire_itemsize
from shardsolve.sharding import Sharding
from shardsolve.trace import Traced, carries_predicate, cond_tag, inline_closed, leaf_names, user_line


@dataclass(frozen=True, slots=True)
class OpView:
    """What a sharding rule sees of one operation (``Graph.view``)."""

    primitive: str
    params: dict = field(hash=False, compare=False)
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[Any, ...] = ()
    out_dtypes: tuple[Any, ...] = ()
    prim: Any = field(default=None, hash=False, compare=False)  # the JAX primitive, for re-binding


@dataclass(frozen=True, slots=True)
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: Any  # numpy dtype
    kind: str  # "input", "const" or "result"
    producer: int | None = None  # op id for results
    result_index: int = 0
    position: int = 0  # input or const position
    name: str = ""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def wire_itemsize(self) -> int:
        """Bytes per element its collectives move on the default backend (``cost.wire_itemsize``)."""
        return wire_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclass(frozen=True, slots=True)
class Lit:
    """A literal operand (a scalar constant written into the equation)."""

    value: Any


@dataclass(frozen=True, slots=True)
class Op:
    id: int
    primitive: str
    inputs: tuple[int | Lit, ...]
    outputs: tuple[int, ...]
    eqn: Any = field(compare=False, repr=False)  # the JaxprEqn, for re-binding
    source: str = ""  # name stack, e.g. "jvp(block_3)/attention"
    # A ``while`` loop planned as a scan (``primitive`` "scan", ``eqn`` its scan form: ``as_scan``): the loop's own
    # equation, which runs it (``trace._predicate_carried``'s form: the condition is the last carry).
    loop: Any = field(default=None, compare=False, repr=False)

    @property
    def params(self) -> dict:
        return self.eqn.params

    @property
    def prim(self) -> Any:
        return self.eqn.primitive

    @property
    def literal_operands(self) -> tuple[int, ...]:
        return tuple(k for k, x in enumerate(self.inputs) if isinstance(x, Lit))

    def name(self) -> str:
        primitive = self.primitive if self.loop is None else "while"
        return f"%{self.id} {primitive}" + (f" [{self.source}]" if self.source else "")

    def where(self) -> str:
        """The user's source line that made the op (``"file:line"``), or "" where JAX kept none."""
        return user_line(self.eqn)


@dataclass
class Graph:
    values: list[Value]
    ops: list[Op]
    inputs: tuple[int, ...]  # value ids of the flattened arguments
    consts: tuple[int, ...]  # value ids of the closed-over constants
    const_values: tuple[Any, ...]
    outputs: tuple[int | Lit, ...]  # value ids (or literals) of the flattened results
    traced: Traced | None = None
    consumers: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # value -> [(op, operand)]
    _bodies: dict[int, Graph] = field(default_factory=dict, repr=False)  # scan op id -> body graph
    closed: Any = field(default=None, repr=False, compare=False)  # the closed jaxpr the graph was built from

    @functools.cached_property
    def memo(self) -> dict:
        """Facts other modules derive from this graph, each worked out once (keyed by the function that works it
        out): a graph does not change once built."""
        return {}

    @functools.cached_property
    def output_ids(self) -> frozenset[int]:
        """The value ids among ``outputs`` (literals left out)."""
        return frozenset(x for x in self.outputs if not isinstance(x, Lit))

    @functools.cached_property
    def post_order(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(per op id, per output position) the place in the post order XLA walks a computation in
        (``HloComputation::MakeInstructionPostOrder``: depth first from the root, a tuple of the outputs in
        order, each instruction's operands in order). An output's place is just after its producer's subtree,
        where the root reaches it; ops no output reads come after every other, in program order."""
        place = [-1.0] * len(self.ops)
        outputs = []
        count = 0
        for out in self.outputs:
            producer = None if isinstance(out, Lit) else self.values[out].producer
            if producer is not None and place[producer] < 0:
                stack = [(producer, 0)]
                while stack:
                    op_id, k = stack[-1]
                    operands = self.ops[op_id].inputs
                    while k < len(operands):
                        x = operands[k]
                        k += 1
                        below = None if isinstance(x, Lit) else self.values[x].producer
                        if below is not None and place[below] < 0:  # (a DAG: never one on the stack)
                            break
                    else:
                        stack.pop()
                        place[op_id] = count
                        count += 1
                        continue
                    stack[-1] = (op_id, k)
                    stack.append((below, 0))
            outputs.append(count - 0.5)
        for op_id in range(len(self.ops)):
            if place[op_id] < 0:
                place[op_id] = count
                count += 1
        return tuple(place), tuple(outputs)

    def reaching(self, values: Sequence[int], *, together: bool = False) -> list[int]:
        """Per op id, which of ``values`` are computed from its results, as a bitset (bit ``k``: ``values[k]``).

        An op's own results count; ``together`` gives every value bit 0 (is any
        computed from it?). What XLA's combiners ask before merging two
        collectives: does one's input depend on the other's reader?
        """
        bit = {}
        for k, v in enumerate(values):
            bit[v] = bit.get(v, 0) | 1 << (0 if together else k)
        below = [0] * len(self.ops)
        for op in reversed(self.ops):
            bits = 0
            for v in op.outputs:
                bits |= bit.get(v, 0)
                for k, _ in self.consumers.get(v, ()):
                    bits |= below[k]
            below[op.id] = bits
        return below

    def body(self, op: Op) -> Graph:
        """The graph of a ``scan`` op's body, nested calls inlined (built once, then cached).

        Its inputs are the body's consts, carry and x-slices (names
        ``const[k]``, ``carry[k]``, ``xs[k]``); its outputs the carry-out and
        y-slices. Op ids are local to the body.
        """
        hit = self._bodies.get(op.id)
        if hit is None:
            p = op.params
            n_consts, n_carry = scan_counts(op)
            n_in = len(p["jaxpr"].jaxpr.invars)
            names = ([f"const[{k}]" for k in range(n_consts)] + [f"carry[{k}]" for k in range(n_carry)]
                     + [f"xs[{k}]" for k in range(n_in - n_consts - n_carry)])
            hit = self._bodies[op.id] = Graph.from_jaxpr(inline_closed(p["jaxpr"]), names)
        return hit

    def nested(self, scope: Sequence[int]) -> Graph:
        """The graph of ``scope`` (scan op ids, outermost first): this program for ``()``, else the body of the
        scan ops it names, each inside the one before."""
        graph = self
        for op_id in scope:
            graph = graph.body(graph.ops[op_id])
        return graph

    @classmethod
    def from_traced(cls, traced: Traced) -> Graph:
        return cls.from_jaxpr(traced.jaxpr, leaf_names(traced.in_tree, "args"), traced)

    @classmethod
    def from_jaxpr(cls, closed: Any, input_names: list[str], traced: Traced | None = None) -> Graph:
        """The graph of a closed jaxpr whose ``k``-th input is called ``input_names[k]``."""
        jaxpr = closed.jaxpr
        values: list[Value] = []
        ids: dict[Any, int] = {}

        def new(var, **kw) -> int:
            aval = var.aval
            vid = len(values)
            values.append(Value(vid, tuple(int(d) for d in aval.shape), np.dtype(aval.dtype), **kw))
            ids[var] = vid
            return vid

        inputs = tuple(new(v, kind="input", position=k, name=input_names[k]) for k, v in enumerate(jaxpr.invars))
        consts = tuple(new(v, kind="const", position=k, name=f"const[{k}]") for k, v in enumerate(jaxpr.constvars))
        ops: list[Op] = []
        for eqn in jaxpr.eqns:
            operands = tuple(Lit(v.val) if isinstance(v, jcore.Literal) else ids[v] for v in eqn.invars)
            op_id = len(ops)
            outs = []
            for r, var in enumerate(eqn.outvars):
                if isinstance(var, jcore.DropVar):
                    # Keep a value for dropped results so results stay positional.
                    vid = len(values)
                    values.append(Value(vid, tuple(int(d) for d in var.aval.shape), np.dtype(var.aval.dtype),
                                        "result", op_id, r, name=f"%{op_id}.{r}"))
                else:
                    vid = new(var, kind="result", producer=op_id, result_index=r, name=f"%{op_id}.{r}" if len(eqn.outvars) > 1 else f"%{op_id}")
                outs.append(vid)
            source = str(eqn.source_info.name_stack) if eqn.source_info is not None else ""
            scan = as_scan(eqn)
            if scan is not None:
                ops.append(Op(op_id, "scan", operands, tuple(outs), scan, source, loop=eqn))
            else:
                ops.append(Op(op_id, eqn.primitive.name, operands, tuple(outs), eqn, source))
        outputs = tuple(Lit(v.val) if isinstance(v, jcore.Literal) else ids[v] for v in jaxpr.outvars)
        graph = cls(values, ops, inputs, consts, tuple(closed.consts), outputs, traced, closed=closed)
        for op in ops:
            for k, x in enumerate(op.inputs):
                if not isinstance(x, Lit):
                    graph.consumers.setdefault(x, []).append((op.id, k))
        return graph

    def view(self, op: Op) -> OpView:
        """What a sharding rule sees of ``op`` (of a ``while`` loop planned as a scan: the loop itself)."""
        ins = [self._aval(x) for x in op.inputs]
        outs = [self.values[v] for v in op.outputs]
        eqn = op.eqn if op.loop is None else op.loop
        return OpView(
            eqn.primitive.name,
            eqn.params,
            tuple(s for s, _ in ins),
            tuple(v.shape for v in outs),
            tuple(d for _, d in ins),
            tuple(v.dtype for v in outs),
            prim=eqn.primitive,
        )

    def _aval(self, x: int | Lit) -> tuple[tuple[int, ...], Any]:
        if isinstance(x, Lit):
            arr = np.asarray(x.value)
            return tuple(arr.shape), arr.dtype
        v = self.values[x]
        return v.shape, v.dtype

    def to_networkx(self):
        """A ``networkx.DiGraph`` of ops (nodes ``("op", k)``, ``("in", v)``, ``("const", v)``)."""
        import networkx as nx

        g = nx.DiGraph()
        for v in self.inputs:
            g.add_node(("in", v))
        for v in self.consts:
            g.add_node(("const", v))
        for op in self.ops:
            g.add_node(("op", op.id), primitive=op.primitive)
            for x in op.inputs:
                if isinstance(x, Lit):
                    continue
                src = self.values[x]
                node = ("op", src.producer) if src.kind == "result" else (("in" if src.kind == "input" else "const"), x)
                g.add_edge(node, ("op", op.id), value=x)
        return g

    def last_use(self) -> dict[int, int]:
        """For each value, the id of the last op that reads it (outputs count as read at the end)."""
        out: dict[int, int] = {}
        for op in self.ops:
            for x in op.inputs:
                if not isinstance(x, Lit):
                    out[x] = op.id
        end = len(self.ops)
        for x in self.outputs:
            if not isinstance(x, Lit):
                out[x] = end
        return out


# -- conditionals --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CondGroup:
    """A ``cond`` of the program that ``trace._selected`` ran as every branch and a select of the taken one's
    results, and that runs as a conditional again: each branch's ops, and the ``select_n`` ops that pick its
    results (operand ``k + 1`` of each is branch ``k``'s; operand 0, the index, is made outside the branches).
    """

    branches: tuple[tuple[int, ...], ...]  # op ids of each branch, in program order (a branch may have none;
    #                                        an op of a branch that reads only literals, or that another branch
    #                                        reads, runs before the conditional)
    selects: tuple[int, ...]  # op ids of the selects, in program order

    @property
    def ops(self) -> frozenset[int]:
        return frozenset(self.selects).union(*self.branches)


def cond_groups(g: Graph) -> tuple[CondGroup, ...]:
    """The conds of ``g`` that run as conditionals (``CondGroup``), in program order.

    A cond qualifies where two of its branches or more do work (with one, as in
    skipping an update whose loss is not finite, a conditional saves nothing and
    XLA copies the values the other branches pass through into its results,
    where the select updates in place), the selects share one index, and no
    branch holds a loop planned with its body (a ``scan``). A branch op whose
    value is read outside its branch (an op that tracing merged between
    branches, or with one after the cond, or a program output) runs before the
    conditional, with the branch ops it reads (``_shared_hoisted``). Any other
    cond stays every branch computed and selected (the trace's form, which runs
    as written).
    """
    known = g.memo.get(cond_groups)
    if known is not None:
        return known
    members: dict[int, dict[int, list[int]]] = {}  # cond number -> branch (-1: selects) -> op ids
    for op in g.ops:
        tag = cond_tag(op.source)
        # An op that reads only literals (zeros a branch starts from, which tracing may share between branches)
        # runs before the conditional, as any op outside it.
        if tag is not None and (tag[1] < 0 or any(not isinstance(x, Lit) for x in op.inputs)):
            members.setdefault(tag[0], {}).setdefault(tag[1], []).append(op.id)
    groups = []
    for parts in members.values():
        selects = parts.get(-1, [])
        if not selects or any(g.ops[k].primitive != "select_n" for k in selects):
            continue
        n = len(g.ops[selects[0]].inputs) - 1
        if any(len(g.ops[k].inputs) != n + 1 for k in selects) or any(b >= n for b in parts if b >= 0):
            continue
        group = _shared_hoisted(g, CondGroup(tuple(tuple(parts.get(b, ())) for b in range(n)), tuple(selects)))
        if sum(1 for ops in group.branches if ops) >= 2 and _runs_apart(g, group):
            groups.append(group)
    found = g.memo[cond_groups] = tuple(groups)
    return found


def _shared_hoisted(g: Graph, group: CondGroup) -> CondGroup:
    """``group`` less the branch ops read from outside their branch (tracing merged equal ops into one: ``x @ w``
    in two branches, or in a branch and after the cond), with the branch ops they read in turn: they run before
    the conditional, for every branch, as ops outside it do."""
    branch_of = {k: b for b, ops in enumerate(group.branches) for k in ops}
    selects = set(group.selects)
    hoisted: set[int] = set()
    stack = [k for k, b in branch_of.items()
             if any(v in g.output_ids for v in g.ops[k].outputs)
             or any(branch_of.get(reader) != b and not (reader in selects and pos == b + 1)
                    for v in g.ops[k].outputs for reader, pos in g.consumers.get(v, ()))]
    while stack:
        k = stack.pop()
        if k in hoisted:
            continue
        hoisted.add(k)
        stack.extend(g.values[x].producer for x in g.ops[k].inputs
                     if not isinstance(x, Lit) and g.values[x].kind == "result" and g.values[x].producer in branch_of)
    if not hoisted:
        return group
    return CondGroup(tuple(tuple(k for k in ops if k not in hoisted) for ops in group.branches), group.selects)


def _runs_apart(g: Graph, group: CondGroup) -> bool:
    """Whether ``group``'s branches (as ``_shared_hoisted`` leaves them: a value a branch makes is read only by
    that branch and, as its case, by the selects) can run as a conditional's: the selects share one index, and
    no branch holds a loop planned with its body."""
    index = g.ops[group.selects[0]].inputs[0]
    if isinstance(index, Lit) or any(g.ops[k].inputs[0] != index for k in group.selects):
        return False
    return all(g.ops[k].primitive != "scan" for ops in group.branches for k in ops)


# -- scans -----------------------------------------------------------------------------------


def as_scan(eqn: Any) -> Any:
    """A ``while`` equation whose condition is its last carry (``trace._predicate_carried``), as a scan's
    equation of length 1 with its body (consts and carry: no xs, no ys); None for any other equation.

    A loop of unknown trip count is counted once, as XLA's ``cost_analysis()``
    counts a while body; the body's consts are its loop invariants and the
    condition is one more carry, computed in the body.
    """
    if eqn.primitive.name != "while" or not carries_predicate(eqn):
        return None
    p = eqn.params
    n_carry = len(eqn.outvars)
    return eqn.replace(params={
        "jaxpr": p["body_jaxpr"], "length": 1, "reverse": False, "unroll": 1, "num_consts": p["body_nconsts"],
        "num_carry": n_carry, "linear": (False,) * len(eqn.invars), "_split_transpose": False,
    })


def scan_counts(op: Op) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` op: its operands are consts, carry, then xs."""
    return int(op.params["num_consts"]), int(op.params["num_carry"])


@dataclass(frozen=True, slots=True)
class ScanBoundary:
    """Where a ``scan`` whose body is planned once meets the enclosing program, in the body's shardings.

    A scan's operands are its consts, its carry and its stacked xs (split by the
    op's ``num_consts`` and ``num_carry``); its results the carry and the stacked
    ys. Consts and carry are the same value inside and out (the carry enters and
    leaves every iteration alike: a fixed point); each iteration reads one slice
    of every x and writes one slice of every y. A stacked sharding is its slice's
    with a leading, unsplit dimension (``stacked``); the slice drops it
    (``sliced``). ``body_consts`` are the shardings of the body's own closed-over
    constants.

        >>> from shardsolve.sharding import Sharding
        >>> c, h = Sharding((("model",), ())), Sharding((("data",), ()))
        >>> b = ScanBoundary(consts=(c,), carry=(h,), xs=(Sharding(((), ("model",))),), ys=(h,))
        >>> [str(s) for s in b.operands], [str(s) for s in b.results]
        (['[{model}, {}]', '[{data}, {}]', '[{}, {}, {model}]'], ['[{data}, {}]', '[{}, {data}, {}]'])
        >>> [str(s) for s in b.body_inputs], [str(s) for s in b.body_outputs]
        (['[{model}, {}]', '[{data}, {}]', '[{}, {model}]'], ['[{data}, {}]', '[{data}, {}]'])
        >>> ScanBoundary.sliced(b.operands[2]) == b.xs[0]
        True
    """

    consts: tuple[Sharding, ...]
    carry: tuple[Sharding, ...]
    xs: tuple[Sharding, ...]  # one slice each, as the body reads it
    ys: tuple[Sharding, ...]  # one slice each, as the body writes it
    body_consts: tuple[Sharding, ...] = ()

    @staticmethod
    def stacked(s: Sharding) -> Sharding:
        """The sharding of a stack of slices sharded as ``s``: the stacking dimension unsplit."""
        return Sharding(((),) + s.dims)

    @staticmethod
    def sliced(s: Sharding) -> Sharding:
        """The sharding of one slice of a stack sharded as ``s``."""
        return Sharding(s.dims[1:])

    @classmethod
    def of(cls, op: Op, operands: Sequence[Sharding], results: Sequence[Sharding],
           body_consts: Sequence[Sharding] = (), body: Graph | None = None) -> ScanBoundary:
        """Decode a scan's operand and result shardings (stacked, as the enclosing program sees them).

        With ``body``, closed-over constants ``body_consts`` does not cover are replicated.
        """
        n_consts, n_carry = scan_counts(op)
        body_consts = tuple(body_consts)
        if body is not None:
            body_consts += tuple(Sharding.replicated(len(body.values[v].shape)) for v in body.consts[len(body_consts):])
        return cls(
            tuple(operands[:n_consts]),
            tuple(operands[n_consts:n_consts + n_carry]),
            tuple(cls.sliced(s) for s in operands[n_consts + n_carry:]),
            tuple(cls.sliced(s) for s in results[n_carry:]),
            body_consts,
        )

    @property
    def operands(self) -> tuple[Sharding, ...]:
        """Consts, carry and stacked xs: the scan's operands as the enclosing program passes them."""
        return self.consts + self.carry + tuple(self.stacked(s) for s in self.xs)

    @property
    def results(self) -> tuple[Sharding, ...]:
        """Carry and stacked ys: the scan's results as the enclosing program receives them."""
        return self.carry + tuple(self.stacked(s) for s in self.ys)

    @property
    def body_inputs(self) -> tuple[Sharding, ...]:
        """The body's inputs (consts, carry, one slice of each x) as the body reads them."""
        return self.consts + self.carry + self.xs

    @property
    def body_outputs(self) -> tuple[Sharding, ...]:
        """The body's outputs (carry, one slice of each y) as the body leaves them."""
        return self.carry + self.ys
