"""A plan's peak memory per device, as ``memory_analysis()`` of the compiled program counts it.

XLA's measure is argument + output + temp - alias bytes: every argument and
every output allocated for the whole program, and a heap of temporaries at
its peak. The solver holds a memory limit on the problem's node usages
(``Problem.usage_profile``), which count the same arguments and outputs, but
count an op's operand layouts (``build.ProblemBuilder.add_operands``) once
more during its step, reshard or not, because the solver decides both ends
of an edge apart. That bound errs high. Once the plan is fixed, the reshard
schedule (``shardsolve.schedule``) says which reads do reshard, and this
module counts the compiled program's buffers from it (``peak_memory``):

* an argument, a constant and an output for the whole program; a scan's
  boundary as the problem counts it; its body, which the problem counts all
  live during the scan's step, as one iteration's peak: each body result
  from its op through its last reader in the body (``_iteration_peaks``, a
  nested loop's own peak at its op); and its carries: XLA's
  while loop keeps each carry in one buffer, updated in place, so a body
  result that is a carry's next value in the carry's layout is written into
  that buffer (the carry node's bytes, ``_carry_outs_in_state``), and a
  carry's initial value read there for the last time in that layout, or a
  reshard made for it that nothing else reads, is the buffer's first value
  (handed to the scan's result, ``_carried_into``);
* each op result in its strategy's layout (a result fused into its readers,
  ``build.memory_traffic``, has none), from its op's step through its last
  read, where a read by a fused op is done where that op's work is
  (``build.runs_in``: inside its reader, maybe much later, so what it reads
  lives until then); an output's result is that output's allocation;
* a reshard's result where the schedule runs steps, from the read's step
  through the last read of that layout (the reshard cache serves later
  reads): the result of its last collective, the local cuts after it fused
  into the readers, and the largest of its steps' results during the step; a reshard that only cuts a result smaller, with no collective, runs
  where the result is made (XLA's scheduler hoists it so the whole buffer can
  go: a forward activation read split by the backward pass's matmul is kept
  as the split), and then ends the result's own life, but for an elementwise
  reader of a result that no loop fusion makes (a matmul's, a gather's): XLA
  fuses that cut into its reader, and the whole result lives until the
  reader runs, which XLA's scheduler moves up to where the reader's other
  operands are made (an elementwise result is computed again inside the
  reader instead); any other local cut (of an argument, or of a result that
  stays) is made at each read, fused into an elementwise reader, a buffer of
  that step for any other;
* a result read for the last time, in the layout it was made in, by an
  in-place update (as its operand 0) or an elementwise op of its shape
  (``build.updated_in_place``), or by a fused op whose loop fusion is rooted
  in an elementwise or layout op of its bytes (a gradient transposed and
  scaled into the parameter update), hands its buffer to that op's result,
  one buffer a result (and a buffer handed on to an output is that output's
  allocation);
* a ``scatter-add`` into zeros that only a sum of two arrays reads
  (``A + scatter-add(0, i, u)``, an embedding's gradient from its gather
  and its matmul) has no buffer: XLA scatters into ``A`` where the sum is
  (``_scattered_into_sum``);
* a reshape (or a broadcast adding only dimensions of one) of a buffer read
  in the layout it was made in, with as many local bytes, is a bitcast in
  XLA: a view of that buffer, no buffer of its own, and the buffer lives as
  long as the view is read (``_bitcasts``);
* an array filled from a scalar (a ``broadcast_in_dim`` of one, an
  ``iota``) in the largest layout a reader reads it in: XLA's simplifier
  moves the readers' cuts into it (``_fills``; in a loop body
  ``_filled_as_read``);
* an op's scratch (``shardsolve.workspace``) during its step.

The temporaries then go where XLA's buffer assignment puts them
(``_unpacked``): largest first, each into the smallest output allocation
that is large enough and not in use over its life (an output's allocation is
free until its value is first written), else onto the heap. The peak is the
arguments, the outputs and the heap's largest total.

The problem counts every other buffer counted here, over an interval no
shorter, except a reshard's intermediate results (an all-gather over more
axes than its target needs, then a cut, keeps the whole gathered value),
which an edge rather than a node decides, and a layout the reshard cache
keeps for later reads of an op's result. Such a layout of an argument (an
FSDP weight gathered for the forward pass and kept for the backward) is
counted under a memory limit where ``build.BuildOptions.kept_layouts`` asks
for it (``build.ProblemBuilder.add_kept_layouts``, up to the argument's next
read; off by default). So ``peak_memory`` is at most the problem's
peak but where one of those buffers is at the peak: there a plan solved
under a limit can compile over it.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from shardsolve.build import FUSED_CONSUMERS, FUSED_PRODUCERS, Built, fused, memory_traffic, runs_in, updated_in_place
from shardsolve.graph import Graph, Lit, ScanBoundary
from shardsolve.mesh import MeshSpec
from shardsolve.schedule import CASES, LOOP_INVARIANTS, OPERANDS, Schedule
from shardsolve.sharding import Sharding
from shardsolve.workspace import scratch_bytes, workspace_ratio


def peak_memory(graph: Graph, built: Built, assignment: Sequence[int], schedule: Schedule, mesh: MeshSpec) -> float:
    """The plan's peak bytes per device (see the module docstring)."""
    profile = memory_profile(graph, built, assignment, schedule, mesh)
    return float(profile.max()) if len(profile) else 0.0


def memory_profile(graph: Graph, built: Built, assignment: Sequence[int], schedule: Schedule,
                   mesh: MeshSpec) -> np.ndarray:
    """Bytes per device allocated at each time step of the problem (t = 0 arguments, t = k + 1 op k): the
    arguments, every output, and the temporaries live then that no output's allocation holds."""
    problem = built.problem
    horizon = max((n.interval[1] for n in problem.nodes), default=0)
    temps: list[tuple[int, int, float, str]] = []  # (start, end, bytes, what)

    made: dict[int, tuple[int, Sharding, int]] = {}  # result value -> (step, layout, end as the problem has it)
    scan_result: dict[int, int] = {}  # an expanded scan's result -> its boundary node (which holds its bytes)
    for op in graph.ops:
        idx = built.op_node.get(op.id)
        if idx is None:  # an expanded scan: its results are its carry and ys nodes
            sn = built.scans.get((op.id,))
            n_carry = len(sn.carry) if sn is not None else 0
            for r, v in enumerate(op.outputs if sn is not None else ()):
                node = sn.carry[r] if r < n_carry else sn.ys[r - n_carry]
                layout = built.nodes[node].shardings[assignment[node]]
                start, end = problem.nodes[node].interval
                made[v] = (start, layout if r < n_carry else ScanBoundary.stacked(layout), end)
                scan_result[v] = node
            continue
        info = built.nodes[idx]
        strategy = info.strategies[assignment[idx]]
        start, end = problem.nodes[idx].interval
        written = memory_traffic(graph, op)[len(op.inputs):]
        for r, v in enumerate(op.outputs):
            made[v] = (start, strategy.results[r], end if written[r] else start)
        ratio = workspace_ratio(graph, op)
        if ratio:
            view = graph.view(op)
            itemsizes = [np.dtype(d).itemsize for d in view.in_dtypes]
            temps.append((start, start + 1, scratch_bytes(ratio, strategy, view.in_shapes, itemsizes,
                                                          op.literal_operands, mesh), f"{op.name()} scratch"))

    # The reads of each result and each reshard's buffer, from the schedule's operand demands.
    last_read: dict[int, int] = {}  # result value -> the step after its last read in its own layout
    buffers: dict[tuple[int, Sharding], list] = {}  # (value, layout) -> [start, end, bytes]
    sliced: set[tuple[int, Sharding]] = set()  # layouts cut locally from the value's own buffer, read by read
    aliased: set[tuple[int, int]] = set()  # (value, op) read in the layout it was made in
    state_from: dict[tuple[int, Sharding], int] = {}  # reshards made for a loop's carry -> their step
    arrived = {v: built.sharding(built.value_node[v], assignment) for v in (*graph.inputs, *graph.consts)
               if v in built.value_node}
    runs = runs_in(graph)  # a read by a fused op is done where that op's work is
    read_bytes: dict[int, float] = {}  # value -> the largest layout it is read in (``_fills``)
    for d in schedule.demands:
        if d.site.kind not in (OPERANDS, LOOP_INVARIANTS, CASES) or d.site.scope != () or d.scope != ():
            continue
        step = runs[d.site.index] + 1
        v = graph.values[d.value]
        own = made.get(d.value)
        produced = own[1] if own is not None else arrived.get(d.value)
        nbytes = d.target.local_bytes(v.shape, v.itemsize, mesh)
        read_bytes[d.value] = max(read_bytes.get(d.value, 0.0), nbytes)
        # A local cut of a buffer that stays (no collective) is made where it is read: fused into an
        # elementwise reader, a buffer of the read's step for any other.
        fused_read = d.site.kind == OPERANDS and graph.ops[d.site.index].primitive in FUSED_CONSUMERS
        transient = (0.0 if fused_read else nbytes, f"{v.name} in {d.target}")
        if d.steps:
            local = d.source == produced and not any(s.is_collective for s in d.steps)
            # A cut for an elementwise reader is fused into it. An elementwise result is computed again inside
            # the reader; the whole of a matmul's (any unfused op's) result lives until the reader runs, which
            # XLA's scheduler moves up to where its other operands are all made.
            fused_cut = fused_read and own is not None and graph.ops[v.producer].primitive not in FUSED_PRODUCERS
            hoisted = (own is not None and local and not fused_cut
                       and nbytes < produced.local_bytes(v.shape, v.itemsize, mesh))
            if local and not hoisted:
                sliced.add((d.value, d.target))
                if nbytes < produced.local_bytes(v.shape, v.itemsize, mesh):  # (else it cuts nothing: a mesh
                    temps.append((step, step + 1, *transient))  # axis of one device; the buffer is read as it is)
                at = min(step, max(own[0] + 1, _ready(graph, made, runs, runs[d.site.index]))) if fused_cut else step
                last_read[d.value] = max(last_read.get(d.value, 0), at + 1)
                continue
            # Each step's result is a buffer of its own; XLA fuses the local cuts after the last collective
            # into the readers, so that collective's result is the buffer kept (an all-gather over more axes
            # than the target needs keeps the whole gathered value), and the largest lives during the step.
            made_bytes = [st.dst.local_bytes(v.shape, v.itemsize, mesh) for st in d.steps]
            last = max((i for i, st in enumerate(d.steps) if st.is_collective), default=len(d.steps) - 1)
            kept = nbytes if hoisted else made_bytes[last]
            # A local cut made into another is one slice (XLA fuses them): only a collective's result, a cut a
            # collective reads and the last step's result are buffers.
            made_bytes = [b for i, b in enumerate(made_bytes) if d.steps[i].is_collective or i == len(d.steps) - 1
                          or d.steps[i + 1].is_collective]
            if max(made_bytes) > kept:
                temps.append((step, step + 1, max(made_bytes) - kept, f"{v.name} reshard to {d.target}"))
            buffers[(d.value, d.target)] = [own[0] if hoisted else step, step + 1, kept]
            if not hoisted and d.site.kind == OPERANDS and \
                    _carried_into(graph, built, d.value, d.site.index) is not None:
                state_from[(d.value, d.target)] = step  # a reshard made for a loop's carry: its state's first buffer
            if d.source != produced:  # made from a layout made before: that buffer lives to here
                _extend(buffers, (d.value, d.source), step)
            elif not hoisted:
                last_read[d.value] = max(last_read.get(d.value, 0), step + 1)
        elif (d.value, d.target) in sliced:  # cut again
            temps.append((step, step + 1, *transient))
            last_read[d.value] = max(last_read.get(d.value, 0), step + 1)
        elif d.target != produced:  # a layout made before, read again
            _extend(buffers, (d.value, d.target), step)
        else:
            last_read[d.value] = max(last_read.get(d.value, 0), step + 1)
            if d.site.kind == OPERANDS:
                aliased.add((d.value, d.site.index))
    for key, step in state_from.items():
        if buffers[key][1] == step + 1:  # read by no later op: the loop's state takes the buffer
            buffers[key][1] = step
    temps.extend((*b, f"{graph.values[v].name} in {layout}") for (v, layout), b in buffers.items())

    views, viewed_until = _bitcasts(graph, built, assignment, made, arrived, last_read, mesh)
    last_use = graph.last_use()
    lives: dict[int, tuple[int, int, float]] = {}
    hands: dict[int, int] = {}  # value -> the result its buffer becomes
    taken: set[int] = set()  # results that took a buffer over
    for vid, (start, layout, end) in made.items():
        if end <= start or vid in graph.output_ids or vid in views:  # fused (never written), an output's own
            continue  # allocation, or a view of another buffer
        v = graph.values[vid]
        nbytes = layout.local_bytes(v.shape, v.itemsize, mesh)
        if _fills(graph, v.producer) and vid in read_bytes:  # made as its readers cut it
            nbytes = min(nbytes, read_bytes[vid])
        read_until = last_read.get(vid, start + 1)
        k = last_use.get(vid)
        if k is not None and (vid, k) in aliased and _scattered_into_sum(graph, vid, k):
            continue  # XLA scatters into the sum's other addend: no buffer of its own
        if vid in viewed_until:  # read through a view until then
            read_until = end = max(read_until, viewed_until[vid])
        elif (vid, k) in aliased and read_until == runs[k] + 2:
            carried = _carried_into(graph, built, vid, k)
            if carried is not None:  # the loop's state starts in this buffer
                if carried not in taken:
                    read_until -= 1
                    hands[vid] = carried
                    taken.add(carried)
            else:
                taker = k if updated_in_place(graph, vid, last_use) else _fusion_root(graph, vid, k, runs)
                if taker is not None and graph.ops[taker].outputs[0] not in taken \
                        and _same_bytes(graph, made, taker, nbytes, mesh):
                    read_until -= 1
                    hands[vid] = graph.ops[taker].outputs[0]
                    taken.add(hands[vid])
        lives[vid] = (start, min(end, read_until), nbytes)
    written_from: dict[int, int] = {}  # an output -> the first step its allocation holds one of its values
    skip = {scan_result[v] for v in graph.output_ids if v in scan_result}  # the output node counts it
    for vid, (start, end, nbytes) in lives.items():
        root = _handed_to(hands, vid)
        if root in graph.output_ids:  # a buffer handed on to an output is that output's allocation
            written_from[root] = min(written_from.get(root, start), start)
            if vid in scan_result:
                skip.add(scan_result[vid])
        elif vid not in scan_result:  # a scan's result is its boundary node's, counted below
            temps.append((start, end, nbytes, graph.ops[graph.values[vid].producer].name()))

    delta = np.zeros(horizon + 2, dtype=np.float64)
    allocations: list[tuple[float, int]] = []  # (bytes, the first step the output's allocation is in use)
    in_state = _carry_outs_in_state(graph, built, assignment)
    body_results: dict[tuple, list[tuple[int, float, bool]]] = {}  # loop body scope -> ``_iteration_peaks``' results
    body_step: dict[tuple, tuple[int, int]] = {}  # loop body scope -> the program's time step it runs in
    for k, (node, info) in enumerate(zip(problem.nodes, built.nodes)):
        if (info.kind in ("op", "operands", "kept") and not info.scope) or info.kind == "hub" or k in skip:
            continue  # counted above, from the schedule (a hub holds nothing)
        usage = max(0.0, float(node.usages[assignment[k]]) - in_state.get(k, 0.0))
        if info.kind == "op":  # a loop body's result: one iteration's buffers, below
            usage = min(usage, _filled_as_read(built, info.scope, info.ref, assignment, mesh))
            body_results.setdefault(info.scope, []).append((info.ref, usage, True))
            body_step[info.scope] = node.interval
        elif info.kind == "output":
            x = graph.outputs[info.ref]
            first = made[x][0] if x in made else 0
            allocations.append((usage, min(first, written_from.get(x, first))))
        elif info.kind in ("input", "const"):
            delta[node.interval[0]] += usage
            delta[min(node.interval[1], horizon + 1)] -= usage
        else:
            temps.append((*node.interval, usage, node.name))
    temps.extend(_iteration_peaks(built, body_results, body_step))
    fixed = sum(b for b, _ in allocations)
    for start, end, nbytes, _ in _unpacked(temps, allocations):
        delta[start] += nbytes
        delta[min(end, horizon + 1)] -= nbytes
    return np.cumsum(delta)[:horizon] + fixed


#: Primitives that XLA compiles to a bitcast of their operand where they keep its bytes: a new shape, no copy.
BITCASTS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "bitcast_convert_type"})


def _bitcasts(graph: Graph, built: Built, assignment: Sequence[int], made: dict, arrived: dict,
              last_read: dict[int, int], mesh: MeshSpec) -> tuple[dict[int, int], dict[int, int]]:
    """The written results that are views of their operand's buffer, and how long each viewed buffer is read.

    A reshape (or a broadcast that only adds dimensions of size one) whose
    operand is a buffer read in the layout it was made in, with as many
    local bytes as its result, is a bitcast in XLA: its result is no buffer
    of its own, and the operand's buffer lives as long as the result is read.
    Returns (result -> operand, operand -> the step after the last read
    through its views).
    """
    views: dict[int, int] = {}
    until: dict[int, int] = {}
    for op in reversed(graph.ops):  # a view of a view extends the first buffer
        if op.primitive not in BITCASTS or len(op.outputs) != 1 or isinstance(op.inputs[0], Lit):
            continue
        v, u = op.outputs[0], op.inputs[0]
        idx, own = built.op_node.get(op.id), made.get(v)
        if idx is None or own is None or own[2] <= own[0] or v in graph.output_ids:
            continue
        source = made[u][1] if u in made and made[u][2] > made[u][0] else arrived.get(u)
        if source is None or built.nodes[idx].strategies[assignment[idx]].operands[0] != source:
            continue
        rv, uv = graph.values[v], graph.values[u]
        if own[1].local_bytes(rv.shape, rv.itemsize, mesh) != source.local_bytes(uv.shape, uv.itemsize, mesh):
            continue
        views[v] = u
        if u in made:
            until[u] = max(until.get(u, 0), until.get(v, 0), last_read.get(v, own[0] + 1))
    return views, until


def _fills(g: Graph, k: int) -> bool:
    """Whether op ``k`` of ``g`` fills an array from a scalar (a ``broadcast_in_dim`` of one, an ``iota``):
    XLA's simplifier moves its readers' cuts into it, so it is made in the largest layout a reader reads it in."""
    op = g.ops[k]
    return op.primitive in _FILLS and len(op.outputs) == 1 and all(
        isinstance(x, Lit) or not g.values[x].shape for x in op.inputs)


def _scattered_into_sum(g: Graph, vid: int, k: int) -> bool:
    """Whether ``vid`` is a ``scatter-add`` into zeros that only op ``k``, a sum of two arrays of its shape,
    reads: XLA's simplifier rewrites ``A + scatter-add(0, i, u)`` as ``scatter-add(A, i, u)``, run in ``A``'s
    buffer where the sum is (the gradient of an embedding that a gather and a matmul both read)."""
    v = g.values[vid]
    op, reader = g.ops[v.producer], g.ops[k]
    if op.primitive != "scatter-add" or reader.primitive not in ("add", "add_any") or len(g.consumers.get(vid, ())) != 1:
        return False
    base = op.inputs[0]
    if isinstance(base, Lit) or g.values[base].kind != "result":
        return False
    fill = g.ops[g.values[base].producer]
    if not _fills(g, fill.id) or fill.primitive != "broadcast_in_dim" or not all(
            isinstance(x, Lit) and x.value == 0 for x in fill.inputs):
        return False
    other = [x for x in reader.inputs if x != vid]
    return len(other) == 1 and not isinstance(other[0], Lit) and g.values[other[0]].shape == v.shape \
        and g.values[other[0]].dtype == v.dtype


def _filled_as_read(built: Built, scope: tuple, k: int, assignment: Sequence[int], mesh: MeshSpec) -> float:
    """The bytes of loop body op ``k``'s result where it fills an array from a scalar (``_fills``): the
    largest layout a reader in the body reads it in (``inf`` for any other op: its own layout counts)."""
    sn = built.scans[scope]
    op = sn.body.ops[k]
    if not _fills(sn.body, k):
        return math.inf
    v = sn.body.values[op.outputs[0]]
    if v.id in sn.body.output_ids:
        return math.inf
    largest = 0.0
    for reader, position in sn.body.consumers.get(v.id, []):
        idx = sn.op_node.get(reader)
        if idx is None:
            return math.inf
        layout = built.nodes[idx].strategies[assignment[idx]].operands[position]
        largest = max(largest, layout.local_bytes(v.shape, v.itemsize, mesh))
    return largest if largest else math.inf


_FILLS = frozenset({"broadcast_in_dim", "iota"})


def _iteration_peaks(built: Built, results: dict[tuple, list[tuple[int, float, bool]]],
                     steps: dict[tuple, tuple[int, int]]) -> list[tuple[int, int, float, str]]:
    """One temporary per outermost loop body planned op by op: the most bytes one iteration holds at once.

    ``results[scope]`` lists (body op id, bytes, True) for each body op's
    results (a nested loop's own peak is added as (its op id, peak, False)).
    A result lives from its op through its last reader in the body (a body
    output to the iteration's end), as XLA's buffer assignment of the loop
    body has it; a nested loop's peak counts at its op's position in the
    enclosing body. The loop's state, its stacked results and its invariants
    are nodes of their own, live over the whole step.
    """
    out = []
    results, steps = {scope: list(r) for scope, r in results.items()}, dict(steps)  # (the caller's stay as given)
    scopes = {scope[:n] for scope in results for n in range(1, len(scope) + 1)}
    for scope in sorted(scopes, key=len, reverse=True):
        body = built.scans[scope].body
        last = body.last_use()
        delta = np.zeros(len(body.ops) + 2)
        for k, nbytes, own in results.get(scope, ()):
            end = max((last.get(v, k) for v in body.ops[k].outputs), default=k) + 1 if own else k + 1
            delta[k] += nbytes
            delta[end] -= nbytes
        peak = float(np.cumsum(delta).max())
        if len(scope) > 1:
            results.setdefault(scope[:-1], []).append((scope[-1], peak, False))
            steps.setdefault(scope[:-1], steps.get(scope, (0, 0)))
        elif peak > 0 and scope in steps:
            out.append((*steps[scope], peak, f"one iteration of loop op {scope[0]}"))
    return out


def _carried_into(graph: Graph, built: Built, vid: int, k: int) -> int | None:
    """The carry result of scan op ``k`` (planned with its body) whose loop state starts in ``vid``'s buffer, or
    None: ``vid`` is read there once, as a carry's initial value (XLA's while loop takes a dead operand's
    buffer as its state, and updates it in place)."""
    op = graph.ops[k]
    if op.primitive != "scan" or (k,) not in built.scans or op.inputs.count(vid) != 1:
        return None
    n_consts, n_carry = len(built.scans[(k,)].const), len(built.scans[(k,)].carry)
    r = op.inputs.index(vid) - n_consts
    return op.outputs[r] if 0 <= r < n_carry else None


def _carry_outs_in_state(graph: Graph, built: Built, assignment: Sequence[int]) -> dict[int, float]:
    """Body op node -> the bytes of its result that are a carry's next value, made in the carry's layout: that
    result is written into the loop's state (the carry node's bytes), not a buffer of its own.

    A ``while`` loop's body keeps its new carry by a select (``trace._predicate_carried``) that the rewriter
    leaves out (``lower._Rewriter._while``): the value selected is the next value written into the state.
    """
    out: dict[int, float] = {}
    for scope, sn in built.scans.items():
        body, loop = sn.body, graph.nested(scope[:-1]).ops[scope[-1]].loop is not None
        for r, bx in enumerate(body.outputs[:len(sn.carry)]):
            carry = sn.carry[r]
            layout = built.nodes[carry].shardings[assignment[carry]]
            nbytes = float(built.problem.nodes[carry].usages[assignment[carry]])
            if not isinstance(bx, int) or body.outputs.count(bx) != 1:
                continue
            while isinstance(bx, int) and body.values[bx].kind == "result":
                producer = body.values[bx].producer
                idx = sn.op_node.get(producer)
                if idx is None:
                    break
                op = body.ops[producer]
                if built.nodes[idx].strategies[assignment[idx]].results[op.outputs.index(bx)] != layout:
                    break
                out[idx] = out.get(idx, 0.0) + nbytes
                if not (loop and op.primitive == "select_n" and len(op.inputs) == 3):
                    break
                bx = op.inputs[2]  # select(go, new, old): the new carry, made into the state
    return out


def _unpacked(temps: list[tuple[int, int, float, str]],
              allocations: list[tuple[float, int]]) -> list[tuple[int, int, float, str]]:
    """The temporaries no output's allocation holds, XLA's buffer assignment imitated.

    XLA assigns buffers largest first; a temporary may reuse an output's
    allocation as large as it or larger (the smallest that will do) while
    nothing else in it is live: before the output's value is first written
    and apart from the temporaries already placed there. What is left goes to
    the temporary heap.
    """
    slots = sorted(((size, first, []) for size, first in allocations if size > 0), key=lambda s: s[0])
    sizes = [s[0] for s in slots]
    left = []
    for temp in sorted((t for t in temps if t[1] > t[0] and t[2] > 0), key=lambda t: (-t[2], t[0])):
        start, end, nbytes = temp[:3]
        for size, first, held in slots[bisect.bisect_left(sizes, nbytes):]:
            if end <= first and all(end <= s or e <= start for s, e in held):
                held.append((start, end))
                break
        else:
            left.append(temp)
    return left


def _ready(graph: Graph, made: dict, runs: Sequence[int], k: int) -> int:
    """The first step op ``k``'s work could run at: after every operand made by an op outside its fusion
    (arguments are there from the start; the ops fused into it, ``build.runs_in``, are looked through)."""
    step, todo, seen = 0, [k], {k}
    while todo:
        for u in graph.ops[todo.pop()].inputs:
            if not isinstance(u, int):
                continue
            p = graph.values[u].producer
            if p is not None and runs[p] == runs[k]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
            elif u in made:
                step = max(step, made[u][0] + 1)
    return step


def _extend(buffers: dict, key: tuple, step: int) -> None:
    if key in buffers:
        buffers[key][1] = max(buffers[key][1], step + 1)


def _same_bytes(graph: Graph, made: dict, k: int, nbytes: float, mesh: MeshSpec) -> bool:
    """Whether op ``k``'s result is a buffer of ``nbytes`` (one an operand's buffer can become)."""
    out = graph.ops[k].outputs[0]
    if out not in made:
        return False
    v = graph.values[out]
    return made[out][1].local_bytes(v.shape, v.itemsize, mesh) == nbytes


def _handed_to(hands: dict[int, int], vid: int) -> int:
    """The value whose buffer ``vid``'s becomes, through results that take it over (``vid`` itself if none)."""
    while vid in hands:
        vid = hands[vid]
    return vid


def _fusion_root(graph: Graph, vid: int, k: int, runs: Sequence[int]) -> int | None:
    """The op whose result can take ``vid``'s buffer where ``vid``'s last reader ``k`` is fused into a later op
    (``build.runs_in``): that op, where it is elementwise or a layout change (the root of a loop fusion) of
    one result, written out, of ``vid``'s bytes; else None."""
    root = runs[k]
    if root == k or fused(graph, vid) or graph.values[vid].kind != "result":
        return None
    op = graph.ops[root]
    if op.primitive not in FUSED_PRODUCERS or len(op.outputs) != 1 or fused(graph, op.outputs[0]):
        return None
    out, v = graph.values[op.outputs[0]], graph.values[vid]
    return root if math.prod(out.shape) * out.itemsize == math.prod(v.shape) * v.itemsize else None
