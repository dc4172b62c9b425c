"""Tie repeated layers: solve one strategy per class of corresponding nodes.

An unrolled model (a transformer's blocks written as a Python loop) repeats
the same operations, on the same shapes, with the same strategies, once per
layer. Its planning problem repeats too, and the solver spends most of its
time re-deciding the same thing for every layer. Tying asks every node of a
*class* of corresponding nodes (the query projection of layers 2 to 9, say)
to take the same strategy, which shrinks the search to about one layer.

**Finding the classes** (``layer_classes``) has two parts. Colour refinement
(Weisfeiler-Lehman, ``colours``) on the problem's own graph gives each node a
colour: first its strategy labels, node costs, memory use and pins, then, for
``rounds`` rounds, its colour plus the sorted (edge table, neighbour colour)
pairs of its outgoing and incoming edges. Planner problems list nodes in
program order, so an unrolled stack is a *tandem repeat* of colours whose
period is one layer's nodes: ``colour[i] == colour[i + p]`` over a run at
least half a period long ties node ``i`` with node ``i + p``. The radius is
kept small (2) on purpose: a residual stream links every layer to the next
within two edges, so colours alone, refined further, would tell every layer
from every other by its distance to the embedding or the loss. A node whose
neighbourhood differs (the first layer reads the embedding) breaks the run
and stays free. Only nodes with identical strategy lists are ever tied.

**Tying** (``tie``) is done after the exact reductions of the *untied*
problem (``encodings.presolve.reduce``): every surviving node of a class
gets an equality edge to the class's first surviving member (cost 0 where the
two take the same original strategy, forbidden elsewhere). The solver's own
``fold_followers`` reduction then folds each member into its representative,
so the tied problem is about one layer's size. Nodes the reductions
eliminated are chosen optimally given their neighbours when the assignment is
lifted, untied.

**Exactness.** Tying is a restriction: the tied optimum is an upper bound of
the untied optimum, and it may be above it (a first layer may prefer another
strategy). The plan is only called optimal when a certified lower bound of
the *untied* problem meets the tied solution's cost (``untied_bound``:
TRW-S message passing, ``encodings.bounds.trws_bound``, blocks around the loose spots where it leaves a wide
gap, ``encodings.dive.block_bound``, then reduced-cost pruning); otherwise it is
``feasible`` with the true gap, and the plan's stats say that tying
restricted the search (``tying = "restricted"``). The pruned untied search
that closes the gap also finds untied plans that beat the tied one; the
cheaper plan is kept.

The tied problem itself is solved by TRW-S and decoding when that proves
its optimum (planner problems have a tight LP), else by ``encodings.solve``.

    >>> import numpy as np
    >>> from shardsolve.problem import Edge, Node, Problem
    >>> chain = Problem(tuple(Node(f"n{i}", np.array([1.0, 2.0]), np.zeros(2)) for i in range(8)),
    ...                 tuple(Edge(i, i + 1, np.array([[0.0, 1.0], [1.0, 0.0]])) for i in range(7)))
    >>> layer_classes(chain, rounds=1)  # the two ends (one neighbour each) differ from the middle
    [(1, 2, 3, 4, 5, 6)]
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

# ``solve`` is called through the package so that a stand-in for it (tests/lower_cases.py) also plans tied problems
from shardsolve import encodings
from shardsolve.encodings import portfolio
from shardsolve.encodings.bounds import (Later, TrwsSetup, pruned_above, trws_bound, trws_charge,
                                          trws_pass_charge)
from shardsolve.encodings.dive import block_bound
from shardsolve.encodings.flat import Flat, evaluate, flatten
from shardsolve.encodings.presolve import ENTRY_CHARGE, Reduced, component_labels, reduce
from shardsolve.errors import InfeasibleError, Interrupted
from shardsolve.problem import FORBIDDEN, Edge, Node, Problem, Solution

__all__ = ["DEFAULT_ROUNDS", "colours", "layer_classes", "origins", "tie", "Tied", "merge", "trws_bound", "untied_bound",
           "solve_tied", "certify"]

#: Colour refinement rounds: the radius (in edges) within which corresponding nodes look alike.
DEFAULT_ROUNDS = 2
#: Shortest run of matching colours that ties nodes (and at least half a period).
MIN_RUN = 4
#: Candidate periods tried.
MAX_PERIODS = 8
#: With a time limit: the tied solve gets this share of it, the untied bound the rest (without a limit,
#: ``BOUND_SECONDS``) and what the tied solve left of its share, each at least ``MIN_SECONDS``, so that
#: ``solve_tied`` ends within about the limit (the solver's wall-clock net adds 5% and a second).
TIED_SHARE = 0.7
BOUND_SECONDS = 10.0
MIN_SECONDS = 0.5
#: The untied bound's TRW-S passes take at most this share of its time (and of its wall-clock net).
BOUND_PASS_SHARE = 0.8
#: ``dive.block_bound`` between the passes and the pruned search: this share of what the passes leave, where
#: the passes' bound is more than ``BLOCK_MIN_GAP`` below the tied plan. Pruning at a gap that wide keeps most
#: entries, and the pruned search moves the bound little (the pod-mesh GPT-2, 9.7%: not at all; blocks: to 4.1%);
#: nearer, the pruned search bounds better and finds untied plans, and keeps its whole time (the pod-mesh
#: Llama, 4.1%: an untied plan 2% below the tied one, missed when the blocks took 0.6 s of its 10).
BLOCK_SHARE = 0.3
BLOCK_MIN_GAP = 0.05
#: The passes stop early once doubling them closes less than this part of the gap to the tied plan
#: (``bounds.trws_bound``'s ``stall``): an LP bound short of it, whose time the pruned search uses better.
BOUND_STALL = 0.05
#: Wall seconds an entry of the untied tables takes to start the pruned search (reducing, flattening, its
#: first phases, none of which stop on the clock): Llama large on ``data=2,fsdp=2,model=2``, 70M entries,
#: 7.4 s. With less of the net left the bound stays TRW-S's (the search overran the net by 4 s).
PRUNED_SETUP_WALL = 1e-7
#: Classes smaller than this are not worth an edge.
MIN_CLASS = 2
#: The untied bound's passes start on a second thread once the untied problem is reduced (``BoundAhead``);
#: False runs them after the tied solve, on the caller's (the same bound).
AHEAD = True


class BoundAhead:
    """``untied_bound``'s TRW-S passes over the untied reduced problem, started on a second thread as soon as
    the problem is reduced, while the tied problem is solved and its plan priced (which need one core; the
    passes run compiled, without Python's lock, after their setup, which copies the tables on the same
    thread: 2.5 s of Llama's 70M entries over ``data=2,fsdp=2,model=2`` that the tied solve's net had paid).

    The passes wait for what they need of the tied plan (``untied_bound`` settles the target, the passes and
    the wall net) wherever it changes their course (``bounds.trws_bound`` with ``Later``s), so the bound is
    the one ``untied_bound`` computes alone. ``least_seconds``: the least budget ``untied_bound`` may get
    (the passes it allows are run without waiting). ``cancel`` stops passes not wanted any more.
    """

    def __init__(self, reduced: Reduced, least_seconds: float):
        self.reduced = reduced
        self.flat = flatten(reduced.problem)
        self.free_passes = _bound_passes(self.flat, least_seconds)
        self.target, self.passes, self.wall = Later(math.inf), Later(None), Later(None)
        self.ran: list = []
        self._result = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardsolve-untied-bound", daemon=True)
        _quick_switches(+1)
        self._thread.start()

    def _run(self) -> None:
        try:  # the setup copies whole tables (numpy, mostly without Python's lock): beside the tied solve too
            self._result = trws_bound(self.flat, self.passes, target=self.target, wall_limit=self.wall,
                                      ran=self.ran, stall=BOUND_STALL, free_passes=self.free_passes,
                                      setup=TrwsSetup.of(self.flat))
        except BaseException as e:  # handed to the caller of ``result``
            self._error = e
        finally:
            _quick_switches(-1)

    def result(self, passes: int, target: float, wall: float):
        """``trws_bound``'s result for these settings, or None where the passes may already have run past
        ``passes`` (``untied_bound`` then runs them itself)."""
        if passes < self.free_passes:
            self.cancel()
            return None
        self.target.settle(target)
        self.wall.settle(wall)
        self.passes.settle(passes)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop the passes at their next check (their result is not wanted)."""
        self.target.settle(-math.inf)
        self.wall.settle(0.0)
        self.passes.settle(0)


#: While passes run ahead, Python hands its lock between threads at most this many seconds apart (the
#: passes' thread takes it once per check, between compiled calls; at the default 5 ms it waits about as
#: long as a check's passes run).
AHEAD_SWITCH_INTERVAL = 5e-4
_SWITCHES = [0, 0.0]  # passes' threads running ahead, and the switch interval before the first
_SWITCHES_LOCK = threading.Lock()


def _quick_switches(change: int) -> None:
    """Count a thread of passes in (+1) or out (-1): the first sets ``AHEAD_SWITCH_INTERVAL``, the last puts
    the interval back."""
    with _SWITCHES_LOCK:
        if change > 0 and _SWITCHES[0] == 0:
            _SWITCHES[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_SWITCHES[1], AHEAD_SWITCH_INTERVAL))
        _SWITCHES[0] += change
        if change < 0 and _SWITCHES[0] == 0:
            sys.setswitchinterval(_SWITCHES[1])


def _bound_passes(flat: Flat, time_limit: float, passes: int = 2000) -> int:
    """The TRW-S passes ``untied_bound`` allows itself in ``time_limit`` seconds of work."""
    work = portfolio.WORK_PER_SECOND * time_limit  # the passes' share in work units, as ``encodings.solve`` counts
    return int(max(2, min(passes, BOUND_PASS_SHARE * work / trws_pass_charge(flat))))


class _Dense:
    """Map hashable signatures to dense integers in first-seen order (deterministic, collision-free)."""

    def __init__(self) -> None:
        self.ids: dict = {}

    def __call__(self, sig) -> int:
        got = self.ids.get(sig)
        if got is None:
            got = self.ids[sig] = len(self.ids)
        return got


def _array_key(a: np.ndarray) -> tuple:
    a = np.ascontiguousarray(a, dtype=np.float64)
    return (a.shape, a.tobytes())


def colours(problem: Problem, rounds: int = DEFAULT_ROUNDS, exclude: Sequence[int] = ()) -> np.ndarray:
    """Colour refinement: equal colours = the problem looks the same from both nodes up to ``rounds`` edges away.

    A node's first colour is its strategy labels, node costs, usages and pins;
    each round adds the sorted (edge table, neighbour colour) pairs of its
    outgoing and incoming edges. ``exclude``d nodes get colours of their own.
    """
    n = len(problem.nodes)
    pins: dict[int, tuple] = {}
    for pin in problem.pins:
        pins[pin.node] = pins.get(pin.node, ()) + (tuple(sorted(pin.allowed)),)
    excluded = set(int(i) for i in exclude)
    dense = _Dense()
    colour = np.empty(n, dtype=np.int64)
    for i, node in enumerate(problem.nodes):
        if i in excluded:
            colour[i] = dense(("excluded", i))
        else:
            colour[i] = dense((node.labels, _array_key(node.costs), _array_key(node.usages), pins.get(i, ())))
    table_ids = _Dense()
    by_object: dict[int, int] = {}
    out_adj: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (edge signature, neighbour)
    in_adj: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for e in problem.edges:
        sig = by_object.get(id(e.costs))
        if sig is None:  # tables are often shared objects: key each distinct one once
            sig = by_object[id(e.costs)] = table_ids(_array_key(e.costs))
        out_adj[e.u].append((sig, e.v))
        in_adj[e.v].append((sig, e.u))
    for _ in range(rounds):
        dense = _Dense()
        c = colour.tolist()
        colour = np.array([
            dense((c[i], tuple(sorted((s, c[j]) for s, j in out_adj[i])),
                   tuple(sorted((s, c[j]) for s, j in in_adj[i]))))
            for i in range(n)
        ], dtype=np.int64)
    return colour


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of every run of True in ``mask``."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    d = np.diff(padded)
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def layer_classes(
    problem: Problem,
    rounds: int = DEFAULT_ROUNDS,
    exclude: Sequence[int] = (),
    max_periods: int = MAX_PERIODS,
) -> list[tuple[int, ...]]:
    """Classes (sorted tuples of node indices, at least two each) of nodes that correspond.

    Nodes are taken in problem order, which for planner problems is program
    order: an unrolled stack of layers is then a *tandem repeat* of colours
    (``colours``) with a period of one layer's nodes. For each candidate
    period ``p`` (the commonest distances between equal colours) the runs
    where ``colour[i] == colour[i + p]`` for at least half a period tie ``i``
    with ``i + p``; periods are taken by coverage, each node by the first that
    covers it. Short lookalikes (the two layer norms of one block) repeat at
    a distance much longer than themselves and are left alone.
    """
    n = len(problem.nodes)
    if n < 2 * MIN_RUN:
        return []
    colour = colours(problem, rounds, exclude)
    excluded = np.zeros(n, dtype=bool)
    excluded[list(exclude)] = True
    # Candidate periods: distances between consecutive equal colours.
    last: dict[int, int] = {}
    gaps: dict[int, int] = {}
    for i, c in enumerate(colour.tolist()):
        j = last.get(c)
        if j is not None:
            gaps[i - j] = gaps.get(i - j, 0) + 1
        last[c] = i
    candidates = sorted(gaps, key=lambda p: (-gaps[p], p))[:max_periods]
    scored = []
    for p in candidates:
        same = (colour[:-p] == colour[p:]) & ~excluded[:-p] & ~excluded[p:]
        runs = [(s, k) for s, k in _runs(same) if k >= max(MIN_RUN, p // 2)]
        cover = sum(k for _, k in runs)
        if cover:
            scored.append((-cover, p, runs))
    covered = np.zeros(n, dtype=bool)
    tie_u: list[np.ndarray] = []
    tie_v: list[np.ndarray] = []
    for _, p, runs in sorted(scored):
        fresh = []
        for s, k in runs:
            idx = np.arange(s, s + k)
            idx = idx[~covered[idx] | ~covered[idx + p]]
            fresh.append(idx)
        for idx in fresh:
            tie_u.append(idx)
            tie_v.append(idx + p)
            covered[idx] = True
            covered[idx + p] = True
    empty = np.zeros(0, dtype=np.int64)
    labels = component_labels(n, np.concatenate(tie_u or [empty]), np.concatenate(tie_v or [empty]))
    members: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        members.setdefault(label, []).append(i)
    return sorted(tuple(m) for m in members.values() if len(m) >= MIN_CLASS)


def origins(reduced: Reduced) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """For each node of the reduced problem: its original node, and its strategies' original indices."""
    return reduced.origins()


@dataclass(frozen=True, slots=True, eq=False)
class Tied:
    """The reduced problem with tie edges, and what it took."""

    problem: Problem  # the reduced untied problem plus one equality edge per tied node
    classes: int  # classes with at least two surviving members
    tied_nodes: int  # surviving nodes tied to a representative
    stats: dict = field(default_factory=dict)
    # (representative, member, f): the member takes strategy f[a] when the representative takes a (-1: none)
    pairs: tuple[tuple[int, int, np.ndarray], ...] = ()


def tie(reduced: Reduced, classes: Sequence[Sequence[int]]) -> Tied:
    """Add an equality edge from every surviving member of each class to its first surviving member."""
    problem = reduced.problem
    orig, smaps = origins(reduced)
    where = {int(o): j for j, o in enumerate(orig.tolist())}
    edges = list(problem.edges)
    pairs = []
    used = 0
    tied = 0
    for cls in classes:
        alive = [where[i] for i in cls if i in where and problem.nodes[where[i]].num_strategies > 1]
        if len(alive) < 2:
            continue
        used += 1
        rep = alive[0]
        for j in alive[1:]:
            same = smaps[rep][:, None] == smaps[j][None, :]
            if not same.any(axis=1).any():
                continue  # no strategy in common after the reductions: leave it free
            edges.append(Edge(rep, j, np.where(same, 0.0, FORBIDDEN)))
            pairs.append((rep, j, np.where(same.any(axis=1), np.argmax(same, axis=1), -1).astype(np.int64)))
            tied += 1
    tied_problem = Problem(problem.nodes, tuple(edges), problem.usage_limit, problem.pins, problem.name)
    return Tied(tied_problem, used, tied, {"tie_classes": used, "tied_nodes": tied}, tuple(pairs))


def merge(problem: Problem, pairs: Sequence[tuple[int, int, np.ndarray]]) -> tuple[Problem, Callable]:
    """Fold every tied member into its representative: the tie edges' effect, without them.

    ``problem`` is the reduced untied problem (no tie edges) and ``pairs`` the
    ``Tied.pairs``. A representative's node costs gain its members' costs
    (forbidden where a member lacks the strategy), members' edges move onto
    the representatives of both ends, and an edge inside one class becomes
    node cost (its diagonal under the correspondence). Memory is not merged:
    only for problems without a usage limit. Returns the merged problem and
    a function lifting its assignments to ``problem``'s.
    """
    n = len(problem.nodes)
    leader = np.arange(n)
    fmap: list[np.ndarray | None] = [None] * n
    for rep, j, f in pairs:
        leader[j] = rep
        fmap[j] = f
    reps = [i for i in range(n) if leader[i] == i]
    index = np.full(n, -1, dtype=np.int64)
    index[reps] = np.arange(len(reps))
    costs = [np.asarray(problem.nodes[i].costs, dtype=np.float64).copy() for i in reps]

    def rows(i: int, table: np.ndarray) -> np.ndarray:
        """``table`` with ``i``'s strategies as rows, re-indexed by its representative's strategies."""
        f = fmap[i]
        if f is None:
            return table
        return np.where((f >= 0)[:, None], table[np.maximum(f, 0)], FORBIDDEN)

    for j in range(n):
        f = fmap[j]
        if f is not None:
            c = problem.nodes[j].costs
            costs[index[leader[j]]] += np.where(f >= 0, c[np.maximum(f, 0)], FORBIDDEN)
    edges: dict[tuple[int, int], np.ndarray] = {}
    # Repeated layers repeat their tables, and corresponding members map their strategies alike: each
    # (table, maps) re-indexed once.
    reindexed: dict[tuple, np.ndarray] = {}
    for e in problem.edges:
        fu, fv = fmap[e.u], fmap[e.v]
        key = (e.costs.shape, e.costs.tobytes(), None if fu is None else fu.tobytes(),
               None if fv is None else fv.tobytes())
        t = reindexed.get(key)
        if t is None:
            t = reindexed[key] = rows(e.v, rows(e.u, e.costs).T).T  # rows by u's representative, columns by v's
        a, b = int(index[leader[e.u]]), int(index[leader[e.v]])
        if a == b:
            costs[a] += np.diag(t)
            continue
        if a > b:
            a, b, t = b, a, t.T
        edges[(a, b)] = edges[(a, b)] + t if (a, b) in edges else t
    nodes = tuple(
        Node(problem.nodes[i].name, np.minimum(c, FORBIDDEN), problem.nodes[i].usages, problem.nodes[i].interval,
             problem.nodes[i].labels)
        for i, c in zip(reps, costs)
    )
    merged = Problem(nodes, tuple(Edge(a, b, np.minimum(t, FORBIDDEN)) for (a, b), t in sorted(edges.items())),
                     None, (), problem.name)

    def lift(assignment: Sequence[int]) -> tuple[int, ...]:
        x = np.asarray(assignment, dtype=np.int64)[index[leader]]
        for j in range(n):
            if fmap[j] is not None:
                x[j] = fmap[j][x[j]]
        return tuple(int(s) for s in x)

    return merged, lift


def untied_bound(
    reduced: Reduced, upper: float, *, passes: int = 2000, time_limit: float = 10.0, seed: int = 0,
    wall_limit: float | None = None, start: Sequence[int] | None = None, ahead: BoundAhead | None = None,
) -> tuple[float, str, tuple[int, ...] | None]:
    """A certified lower bound of the untied problem, given the cost ``upper`` of one of its assignments.

    1. ``trws_bound`` on the untied reduced problem (memory relaxed), stopping
       once it meets ``upper``.
    2. If it falls short, reduced-cost pruning: the reparametrised costs
       write every assignment's cost as the bound plus non-negative terms, so
       an entry whose term alone exceeds ``upper - bound`` is in no
       assignment cheaper than ``upper`` and is forbidden (``bounds.pruned_above``). The pruned problem
       (memory kept) is solved; its certified bound, capped at ``upper``,
       bounds the untied optimum. Near the optimum most entries go, so this
       is quick.

    ``start``: the reduced problem's assignment of cost ``upper`` (the tied plan), where the pruned search
    starts (it keeps every entry of an assignment of that cost). ``ahead``: the passes, started earlier
    (``BoundAhead`` of ``reduced``), the same bound sooner.

    ``time_limit`` covers both: the passes are at most ``BOUND_PASS_SHARE`` of
    it (``bounds.trws_pass_charge`` a pass), the pruned solve gets the
    rest (less ``bounds.trws_charge`` of the passes run), where that covers reducing its tables
    (``presolve.ENTRY_CHARGE`` an entry; else the TRW-S bound is returned). ``wall_limit``: the wall-clock
    net in seconds from the call, shared the same way (default the solver's, ``1.05 * time_limit + 1``);
    where the passes leave less of it than reducing the tables takes, the TRW-S bound is returned as it stands.

    Between the two, where ``start`` is given and the passes leave more than ``BLOCK_MIN_GAP``: the nodes that
    hold the tied plan's gap under the same terms, bounded block by block (``dive.block_bound``,
    ``BLOCK_SHARE`` of what the passes leave): the untied LP mixes strategies at each layer's copy of a node
    on its own, which one branching does not reach.

    Returns (bound, how, better): how is ``"trws"``, ``"trws+blocks"``, or either with ``"+pruned"``
    where the pruned search's bound is the larger;
    ``better`` is an assignment of the reduced problem cheaper than ``upper``
    that the pruned search found (an untied plan that beats the tied one), or
    None.
    """
    started = time.perf_counter()
    if ahead is not None and ahead.reduced is not reduced:
        ahead.cancel()
        ahead = None
    flat = flatten(reduced.problem) if ahead is None else ahead.flat
    offset = reduced.offset
    if flat.n == 0:
        if ahead is not None:
            ahead.cancel()
        return offset, "trws", None
    wall = portfolio.wall_net(time_limit) if wall_limit is None else wall_limit
    passes = _bound_passes(flat, time_limit, passes)
    ub = upper - offset
    tol = 1e-9 * max(abs(ub), 1e-300)  # "meets": as ``encodings.solve`` calls a bound optimal
    margin = 1e-10 * max(abs(ub), 1e-300)  # floating-point error of the reparametrised sums
    target = ub - tol + margin
    found = None if ahead is None else ahead.result(passes, target, BOUND_PASS_SHARE * wall)
    if found is not None:
        (lb, node_terms, edge_terms), ran = found, ahead.ran
    else:
        ran = []
        lb, node_terms, edge_terms = trws_bound(flat, passes, target=target, wall_limit=BOUND_PASS_SHARE * wall,
                                                ran=ran, stall=BOUND_STALL)
    lb -= margin
    if lb >= ub - tol:
        return upper, "trws", None
    left = time_limit - trws_charge(flat, ran[0]) / portfolio.WORK_PER_SECOND  # seconds, for ``encodings.solve``
    how, blocks = "trws", -math.inf
    at = None if start is None else np.asarray(start, dtype=np.int64)
    if at is not None and (at >= 0).all() and ub - lb > BLOCK_MIN_GAP * abs(ub):  # ``dive.block_bound``
        share = BLOCK_SHARE * max(0.0, left)
        blocks, used, _ = block_bound(flat, node_terms, edge_terms, at, portfolio.WORK_PER_SECOND * share,
                                      wall_limit=BLOCK_SHARE * (wall - (time.perf_counter() - started)))
        blocks -= margin
        left -= used / portfolio.WORK_PER_SECOND
        if blocks > lb:
            how = "trws+blocks"
        if blocks >= ub - tol:
            return upper, how, None
    wall_left = wall - (time.perf_counter() - started)
    entries = sum(t.size for t in flat.tables)
    reducing = ENTRY_CHARGE * entries
    if min(portfolio.WORK_PER_SECOND * left, wall_left) < reducing or wall_left < PRUNED_SETUP_WALL * entries:
        return max(lb, blocks) + offset, how, None  # less time left than reducing and starting the pruned search
    kept = pruned_above(flat, node_terms, edge_terms, (ub - lb) + 1e-7 * abs(ub))  # in the problem's order
    problem = reduced.problem
    nodes = tuple(
        type(node)(node.name, np.where(np.isfinite(c), node.costs, FORBIDDEN), node.usages, node.interval,
                   node.labels)
        for node, c in zip(problem.nodes, kept.costs)
    )
    edges = tuple(Edge(e.u, e.v, np.where(np.isfinite(t), e.costs, FORBIDDEN))
                  for e, t in zip(problem.edges, kept.tables))
    pruned = Problem(nodes, edges, problem.usage_limit, problem.pins, problem.name)
    try:
        sol = encodings.solve(pruned, time_limit=left, seed=seed, wall_limit=wall_left, explain=False, start=start)
    except InfeasibleError:
        return upper, how + "+pruned", None  # no assignment is cheaper than ``upper``
    if sol.status == "infeasible":
        return upper, how + "+pruned", None
    better = sol.assignment if sol.assignment and sol.cost < ub - tol else None
    if not math.isfinite(sol.lower_bound) or sol.lower_bound <= max(lb, blocks):
        return max(lb, blocks) + offset, how, better
    return min(upper, sol.lower_bound + offset), how + "+pruned", better


def solve_tied_problem(problem: Problem, time_limit, seed: int, progress,
                       wall_limit: float | None = None, start: Sequence[int] | None = None) -> Solution | None:
    """The tied (merged) problem, solved by ``encodings.solve``; None when it finds no valid assignment.

    Planner problems have a tight LP: the solver's TRW-S probe usually proves
    the tied optimum before any LP (``Portfolio.trws_probe``).
    """
    inner = encodings.solve(problem, time_limit=time_limit, seed=seed, progress=progress, wall_limit=wall_limit,
                            start=start, explain=False)
    if inner.status not in ("optimal", "feasible") or not inner.assignment:
        return None
    return inner


def _interrupted(problem: Problem, assignment, started: float) -> Interrupted:
    """``Interrupted`` carrying ``assignment`` (of the untied problem) where it is valid, else nothing.

    No bound of the untied problem is known yet, so the solution's is the
    trivial one (0 where every cost is non-negative, as a plan's times are).
    """
    if assignment is None:
        return Interrupted(None)
    cost = problem.evaluate(assignment)
    if not math.isfinite(cost):
        return Interrupted(None)
    return Interrupted(Solution(tuple(int(s) for s in assignment), cost, _trivial_bound(problem, cost), "interrupted",
                                time.perf_counter() - started, (), {"tying": "interrupted"}))


def solve_tied(
    problem: Problem,
    *,
    time_limit: float | None = None,
    seed: int = 0,
    progress=None,
    rounds: int = DEFAULT_ROUNDS,
    wall_limit: float | None = None,
    certify: bool = True,
    start: Sequence[int] | None = None,
) -> Solution | None:
    """Solve ``problem`` with its repeated layers tied; ``None`` when there is nothing to tie.

    The returned assignment is one of the *untied* problem, its ``cost`` is
    ``problem.evaluate`` of it, and its ``lower_bound`` a certified bound of
    the untied problem: ``status`` is ``"optimal"`` only when the two meet.
    ``stats`` gain ``tie_classes``, ``tied_nodes``, ``tied_decisions`` (decision
    nodes of the tied problem after the solver's reductions), ``tie_bound``
    (how the untied bound was obtained), ``tied_cost`` and ``tying``:
    ``"exact"`` when the bound proves the tied plan optimal, else
    ``"restricted"``: either the untied search around the bound found a
    cheaper, untied plan (returned instead, with its own status), or the
    search stayed restricted to tied plans and the gap is the true,
    certified one.
    ``None`` also when the tied problem has no solution (say a memory limit
    that only an untied plan meets): the caller then solves untied.
    ``wall_limit``: the wall-clock net of both solves, in seconds from the call
    (default: each solve's own); the tied solve's net is ``TIED_SHARE`` of it.

    ``start``: an assignment of ``problem`` the tied search starts from (``encodings.solve``'s ``start``; a
    tied member that differs from its representative is repaired like any other forbidden pair).

    ``certify=False`` stops after the tied solve: the solution is
    ``"feasible"`` with the sum of the reduced problem's least costs as its bound (``tie_bound``
    ``"deferred"``), and
    ``stats["bound_reserve_s"]`` is the work budget the untied bound would have
    had. ``certify`` (the function) bounds it later, with that reserve or more:
    a caller that solves several problems bounds only the plan it keeps.
    """
    started = time.perf_counter()
    deadline = None if wall_limit is None else started + wall_limit

    def wall(part: float) -> float | None:
        """The net left, less what the later solves keep (``1 - part`` of the whole); None without one."""
        if deadline is None:
            return None
        return max(0.0, deadline - time.perf_counter() - (1.0 - part) * wall_limit)

    classes = layer_classes(problem, rounds)
    if not classes:
        return None
    find_s = time.perf_counter() - started
    try:
        reduced = reduce(problem)
    except InfeasibleError:
        return None
    reduce_s = time.perf_counter() - started - find_s
    tied = tie(reduced, classes)
    if tied.tied_nodes == 0:
        return None
    reduce_work = reduced.stats.get("reduce_deterministic_s", 0.0) / portfolio.WORK_PER_SECOND  # in seconds

    def share(part: float) -> float | None:
        """``part`` of ``time_limit`` less the reduction's work (a fixed split keeps the run deterministic); None
        without a limit."""
        return None if time_limit is None else max(MIN_SECONDS, part * (float(time_limit) - reduce_work))

    ahead = _start_ahead(reduced, BOUND_SECONDS if time_limit is None else share(1.0 - TIED_SHARE))

    if problem.usage_limit is None:  # fold the ties directly (the solver's reductions would, more slowly)
        merged, lift_merged = merge(reduced.problem, tied.pairs)

        def lift(x):
            return reduced.lift(lift_merged(x))

        inner_problem = merged
    else:  # memory differs between layers: keep the tie edges, the solver folds what memory allows
        lift, inner_problem = reduced.lift, tied.problem
    inner_start = None
    if start is not None:  # on the reduced problem; merged: the representatives' strategies (members follow them)
        inner_start = reduced.project(start)
        if problem.usage_limit is None:
            members = {j for _, j, _ in tied.pairs}
            inner_start = inner_start[[i for i in range(len(inner_start)) if i not in members]]
    try:
        inner = solve_tied_problem(inner_problem, share(TIED_SHARE), seed, progress, wall(TIED_SHARE), inner_start)
    except KeyboardInterrupt as interrupt:  # the tied search's best (``Interrupted``), as one of the untied problem
        cancel_ahead()
        best = getattr(interrupt, "solution", None)
        raise _interrupted(problem, lift(best.assignment) if best is not None and best.assignment else None,
                           started) from None
    except BaseException:
        cancel_ahead()
        raise
    if inner is None:
        cancel_ahead()
        return None
    assignment = lift(inner.assignment)
    cost = problem.evaluate(assignment)
    if not math.isfinite(cost):
        cancel_ahead()
        return None
    inner_stats = dict(inner.stats or {})
    stats = dict(reduced.stats)  # the untied problem's sizes before and after the exact reductions
    stats["reduce_s"] = round(reduce_s, 3)
    stats.update({f"tied_{k}": v for k, v in inner_stats.items() if not k.endswith("_before")})
    stats.update(tied.stats)
    # the bound's share, and what the tied solve left of its own (deterministic work, not the clock)
    left = float(inner_stats.get("budget_left_s", 0.0))
    reserve = BOUND_SECONDS if time_limit is None else share(1.0 - TIED_SHARE) + left
    stats.update(
        {
            "tied_decisions": int(inner_stats.get("decisions_after", 0)),
            "tied_status": inner.status,
            "tied_cost": cost,
            "tie_find_s": round(find_s, 3),
            "tie_bound": "deferred",
            "tying": "restricted",
            "bound_reserve_s": reserve,
        }
    )
    solution = Solution(tuple(int(s) for s in assignment), cost, _minima_bound(reduced, cost), "feasible",
                        time.perf_counter() - started, (), stats)
    if not certify:
        _REDUCED.append((problem, reduced))
        del _REDUCED[:-_REDUCED_KEPT]
        return solution
    _AHEAD[:] = []
    return _certified(problem, reduced, solution, reserve, seed, wall(1.0), started, ahead)


#: ``solve_tied(certify=False)`` keeps the reductions of its last few problems for ``certify`` (which clears them).
_REDUCED: list[tuple[Problem, Reduced]] = []
_REDUCED_KEPT = 3
#: The one ``BoundAhead`` running (of the last problem ``solve_tied`` reduced), or none.
_AHEAD: list[BoundAhead] = []


def _start_ahead(reduced: Reduced, least_seconds: float) -> BoundAhead | None:
    """The untied bound's passes over ``reduced`` started ahead (``BoundAhead``), in place of any running; None
    where there is nothing to bound."""
    cancel_ahead()
    if not AHEAD or not reduced.problem.nodes:
        return None
    ahead = BoundAhead(reduced, least_seconds)
    _AHEAD.append(ahead)
    return ahead


def cancel_ahead() -> None:
    """Stop the untied bound's passes started ahead (``BoundAhead``) that no ``certify`` has taken."""
    for ahead in _AHEAD:
        ahead.cancel()
    _AHEAD.clear()


def certify(problem: Problem, solution: Solution, *, time_limit: float | None = None, seed: int = 0,
            wall_limit: float | None = None) -> Solution:
    """``solution`` of ``solve_tied(problem, certify=False)`` with a certified bound of the untied problem.

    ``time_limit``: the bound's work budget (default the solution's ``bound_reserve_s``); ``wall_limit`` its
    wall-clock net. A solution that is not deferred is returned as it is.
    """
    stats = dict(solution.stats or {})
    if stats.get("tie_bound") != "deferred":
        return solution
    started = time.perf_counter()
    reduced = next((r for p, r in reversed(_REDUCED) if p is problem), None)
    _REDUCED.clear()  # the caller bounds the one plan it keeps: the other problems' reductions are not needed
    ahead = next((a for a in _AHEAD if reduced is not None and a.reduced is reduced), None)
    if ahead is not None:
        _AHEAD.remove(ahead)
    cancel_ahead()
    if reduced is None:
        reduced = reduce(problem)
    limit = float(stats["bound_reserve_s"]) if time_limit is None else float(time_limit)
    return _certified(problem, reduced, solution, limit, seed, wall_limit, started, ahead)


def _trivial_bound(problem: Problem, cost: float) -> float:
    """A bound of ``problem`` known without search: 0 where every cost is non-negative (as a plan's times are)."""
    nonnegative = all(float(np.min(n.costs, initial=0.0)) >= 0 for n in problem.nodes) and all(
        float(np.min(e.costs, initial=0.0)) >= 0 for e in problem.edges)
    return min(0.0, cost) if nonnegative else -math.inf


def _minima_bound(reduced: Reduced, cost: float) -> float:
    """A bound of the problem ``reduced`` comes from, known without search: the least entry of each of its
    reduced problem's costs and tables, summed (at most ``cost``). Cheaper than ``_trivial_bound``: the
    reduced problem's entries are a fraction of the problem's."""
    problem = reduced.problem
    total = reduced.offset + sum(float(np.min(n.costs)) for n in problem.nodes) + sum(
        float(np.min(e.costs)) for e in problem.edges)
    return min(cost, total)


def _certified(problem: Problem, reduced: Reduced, solution: Solution, time_limit: float, seed: int,
               wall_limit: float | None, started: float, ahead: BoundAhead | None = None) -> Solution:
    """``solution`` (the tied plan, lifted) with the untied bound of ``untied_bound`` and its outcome."""
    assignment, cost = solution.assignment, solution.cost
    tied_cost = float(solution.stats["tied_cost"])
    bound_started = time.perf_counter()
    try:
        bound, how, better = untied_bound(reduced, cost, seed=seed, time_limit=time_limit, wall_limit=wall_limit,
                                          start=reduced.project(assignment), ahead=ahead)
    except KeyboardInterrupt:  # the tied plan is complete: it is the best so far
        if ahead is not None:
            ahead.cancel()
        raise _interrupted(problem, assignment, started) from None
    improved = cost < tied_cost
    if better is not None:  # the pruned untied search beat the tied plan: tying was a restriction
        candidate = reduced.lift(better)
        c = problem.evaluate(candidate)
        if c < cost:
            assignment, cost, improved = candidate, c, True
    bound = min(bound, cost)
    exact = bound >= cost - 1e-9 * abs(cost)
    stats = dict(solution.stats)
    stats.pop("bound_reserve_s", None)
    stats.update(
        {
            "tie_bound": how,
            "tying": "restricted" if improved or not exact else "exact",
            "tie_bound_s": round(time.perf_counter() - bound_started, 3),
        }
    )
    return Solution(
        tuple(int(s) for s in assignment),
        cost,
        cost if exact else bound,
        "optimal" if exact else "feasible",
        solution.wall_time + (time.perf_counter() - bound_started),
        (),
        stats,
    )
