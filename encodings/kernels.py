"""Compiled inner loops of the bounds: TRW-S passes and reparametrised bounds over packed arrays.

TRW-S (``bounds.trws_bound``) is sequential by nature: node ``i``'s
messages depend on the ones its earlier neighbours sent in the same pass, and
a planner problem's nodes form long chains (a 12-layer GPT-2 step: 1,289
nodes in 856 dependency levels), so there is nothing to vectorise across
nodes. A pass in numpy is one Python iteration and about seven array calls
per edge; compiled with numba it is one loop over the table entries, an
order of magnitude faster, so that hundreds of passes fit where tens did.

``Packed`` lays a problem's finite costs and tables out flat (node ``i``'s
strategies at ``noff[i]:noff[i + 1]``, edge ``e``'s table row-major at
``toff[e]``), its messages as two flat arrays (``to_u``: edge ``e``'s
message to its first node at ``uoff[e]``, ``to_v`` to its second at
``voff[e]``), and each node's neighbours after it and before it in index
order (the sends of a forward and of a backward pass) as CSR lists.
The kernels compute what the numpy expressions in ``bounds`` did: every sum
in the same order of floating-point operations, the minima over them in any
order (exact either way). Each table row is read through a view, whose index
the compiler knows is not negative: indexing the flat array at an offset
instead makes it check for negative indices and gather entry by entry (three
times slower). They run without Python's lock (``nogil``), so passes on
another thread (``tying.BoundAhead``) run beside the caller's work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = ["Packed", "pack", "trws_pass", "trws_passes", "reparametrised_value", "hats"]


@dataclass(frozen=True, slots=True, eq=False)
class Packed:
    """A problem's finite costs, tables, edges and send lists as flat arrays (see the module's docstring)."""

    noff: np.ndarray  # [N + 1] node strategy offsets
    costs: np.ndarray  # [noff[N]]
    eu: np.ndarray  # [E]
    ev: np.ndarray  # [E]
    toff: np.ndarray  # [E + 1] table offsets
    tables: np.ndarray  # [toff[E]]
    uoff: np.ndarray  # [E + 1] offsets of the messages to each edge's first node
    voff: np.ndarray  # [E + 1] ... to its second node
    gamma: np.ndarray  # [N] 1 / max(#earlier, #later neighbours)
    ahead_ptr: np.ndarray  # [N + 1] CSR of (edge, node is the edge's u, neighbour) with the neighbour after
    ahead: np.ndarray  # [K, 3]
    behind_ptr: np.ndarray  # [N + 1] ... with the neighbour before
    behind: np.ndarray  # [K', 3]
    buffer: int  # the most strategies of any node (scratch size)

    def messages(self) -> tuple[np.ndarray, np.ndarray]:
        """Zero messages (to_u, to_v)."""
        return np.zeros(int(self.uoff[-1])), np.zeros(int(self.voff[-1]))

    def split(self, flat_messages: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
        """One message array per edge (views) of ``flat_messages`` laid out by ``offsets``."""
        return [flat_messages[offsets[e]:offsets[e + 1]] for e in range(len(offsets) - 1)]


def _offsets(sizes) -> np.ndarray:
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=out[1:])
    return out


def _csr(rows: list[list[tuple[int, int, int]]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = _offsets([len(r) for r in rows])
    items = np.array([item for r in rows for item in r], dtype=np.int64).reshape(-1, 3)
    return ptr, items


def pack(costs: list[np.ndarray], tables: list[np.ndarray], eu, ev, adj, gamma: np.ndarray,
         flat_tables: np.ndarray | None = None) -> Packed:
    """``Packed`` of finite ``costs`` and ``tables`` (``bounds.finite_parts``), edges ``eu``/``ev``, the
    adjacency ``adj`` (per node: (edge, neighbour, node is the edge's u), as ``Flat.adj``) and ``gamma``.
    ``flat_tables``: the tables already raveled one after another into one float64 array (not copied)."""
    n = len(costs)
    noff = _offsets([len(c) for c in costs])
    flat_costs = np.concatenate(costs).astype(np.float64) if n else np.zeros(0)
    toff = _offsets([t.size for t in tables])
    if flat_tables is None:
        flat_tables = (np.concatenate([np.ascontiguousarray(t, dtype=np.float64).ravel() for t in tables])
                       if tables else np.zeros(0))
    eu = np.asarray(eu, dtype=np.int64)
    ev = np.asarray(ev, dtype=np.int64)
    uoff = _offsets([t.shape[0] for t in tables])
    voff = _offsets([t.shape[1] for t in tables])
    ahead_rows: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    behind_rows: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for i in range(n):
        for e, j, is_u in adj[i]:
            (ahead_rows if j > i else behind_rows)[i].append((int(e), int(bool(is_u)), int(j)))
    ahead_ptr, ahead = _csr(ahead_rows)
    behind_ptr, behind = _csr(behind_rows)
    buffer = int(np.max(np.diff(noff))) if n else 0
    return Packed(noff, flat_costs, eu, ev, toff, flat_tables, uoff, voff, np.asarray(gamma, dtype=np.float64),
                  ahead_ptr, ahead, behind_ptr, behind, buffer)


# Compiled when this module is imported, with explicit types (contiguous arrays: ``I`` int64, ``F`` float64),
# so that no solve's clock pays for compiling; numba caches the machine code on disk, after which the import
# only loads it.
_I, _F, _I2 = "int64[::1]", "float64[::1]", "int64[:, ::1]"


@njit(f"{_F}({_I}, {_F}, {_I}, {_I}, {_I}, {_F}, {_I}, {_F})", cache=True, nogil=True)
def _hats(noff, costs, eu, ev, uoff, to_u, voff, to_v):  # pragma: no cover - compiled
    hat = costs.copy()
    for e in range(len(eu)):
        v = ev[e]
        base = noff[v]
        for b in range(voff[e + 1] - voff[e]):
            hat[base + b] += to_v[voff[e] + b]
        u = eu[e]
        base = noff[u]
        for a in range(uoff[e + 1] - uoff[e]):
            hat[base + a] += to_u[uoff[e] + a]
    return hat


def hats(p: Packed, to_u: np.ndarray, to_v: np.ndarray) -> np.ndarray:
    """Each node's cost plus every message into it, flat (``noff``)."""
    return _hats(p.noff, p.costs, p.eu, p.ev, p.uoff, to_u, p.voff, to_v)


@njit(f"float64({_F}, {_F})", cache=True, nogil=True, inline="always")
def _least_sum(row, d):  # pragma: no cover - compiled
    """min over b of ``row[b] + d[b]``, in four running minima (independent chains the compiler overlaps)."""
    n = len(row)
    q = n - n % 4
    b0 = b1 = b2 = b3 = np.inf
    for b in range(0, q, 4):
        x0 = row[b] + d[b]
        x1 = row[b + 1] + d[b + 1]
        x2 = row[b + 2] + d[b + 2]
        x3 = row[b + 3] + d[b + 3]
        b0 = x0 if x0 < b0 else b0
        b1 = x1 if x1 < b1 else b1
        b2 = x2 if x2 < b2 else b2
        b3 = x3 if x3 < b3 else b3
    for b in range(q, n):
        x = row[b] + d[b]
        b0 = x if x < b0 else b0
    b0 = b1 if b1 < b0 else b0
    b2 = b3 if b3 < b2 else b2
    return b2 if b2 < b0 else b0


@njit(f"void(boolean, {_I}, {_F}, {_F}, {_I}, {_I2}, {_I}, {_F}, {_I}, {_F}, {_I}, {_F}, int64)", cache=True, nogil=True)
def _pass(forward, noff, hat, gamma, ptr, sends, toff, tables, uoff, to_u, voff, to_v, buffer):  # pragma: no cover
    n = len(noff) - 1
    share = np.empty(buffer)
    m = np.empty(buffer)
    d = np.empty(buffer)
    for step in range(n):
        i = step if forward else n - 1 - step
        start, end = ptr[i], ptr[i + 1]
        if start == end:
            continue
        si = noff[i + 1] - noff[i]
        g = gamma[i]
        for a in range(si):
            share[a] = g * hat[noff[i] + a]
        for k in range(start, end):
            e, is_u, j = sends[k, 0], sends[k, 1], sends[k, 2]
            sj = noff[j + 1] - noff[j]
            base = toff[e]
            if is_u:  # i's strategies are the table's rows; the message j sent is to_u[e]
                for b in range(sj):
                    m[b] = np.inf
                for a in range(si):
                    s = share[a] - to_u[uoff[e] + a]
                    row = tables[base + a * sj:base + (a + 1) * sj]  # a view: its index is known non-negative
                    for b in range(sj):  # (a select, not a branch: the compiler vectorises it)
                        x = s + row[b]
                        m[b] = x if x < m[b] else m[b]
                out, off = to_v, voff[e]
            else:  # i's strategies are the table's columns; the message j sent is to_v[e]
                for b in range(si):  # what i sends along every column, worked out once
                    d[b] = share[b] - to_v[voff[e] + b]
                ds = d[:si]
                for a in range(sj):
                    m[a] = _least_sum(tables[base + a * si:base + (a + 1) * si], ds)
                out, off = to_u, uoff[e]
            low = np.inf
            for b in range(sj):
                if m[b] < low:
                    low = m[b]
            hj = noff[j]
            for b in range(sj):
                x = m[b] - low
                hat[hj + b] += x - out[off + b]
                out[off + b] = x


def trws_pass(p: Packed, forward: bool, hat: np.ndarray, to_u: np.ndarray, to_v: np.ndarray) -> None:
    """One TRW-S pass (forward: nodes in index order, each sending to its later neighbours; backward: the
    reverse), updating the messages and ``hat`` in place."""
    ptr, sends = (p.ahead_ptr, p.ahead) if forward else (p.behind_ptr, p.behind)
    _pass(forward, p.noff, hat, p.gamma, ptr, sends, p.toff, p.tables, p.uoff, to_u, p.voff, to_v,
          max(p.buffer, 1))


@njit(f"float64(boolean, {_I}, {_F}, {_I}, {_I}, {_F}, {_I}, {_F}, {_I}, {_F}, {_I}, {_F})", cache=True, nogil=True)
def _value(forward, noff, costs, eu, ev, gamma, toff, tables, uoff, to_u, voff, to_v):  # pragma: no cover - compiled
    hat = _hats(noff, costs, eu, ev, uoff, to_u, voff, to_v)
    n = len(noff) - 1
    sends = np.zeros(n)
    value = 0.0
    m = np.empty(max(1, int(np.max(np.diff(voff))) if len(eu) else 1))
    for e in range(len(eu)):
        u, v = eu[e], ev[e]
        su, sv = uoff[e + 1] - uoff[e], voff[e + 1] - voff[e]
        base = toff[e]
        tv = to_v[voff[e]:voff[e + 1]]
        for b in range(sv):
            m[b] = np.inf
        if (u < v) == forward:  # u goes first in this pass
            sends[u] += 1
            for a in range(su):
                s = gamma[u] * hat[noff[u] + a] - to_u[uoff[e] + a]
                row = tables[base + a * sv:base + (a + 1) * sv]  # a view: its index is known non-negative
                for b in range(sv):  # entrywise minima over the rows (vectorised), their least below
                    x = (row[b] + s) - tv[b]
                    m[b] = x if x < m[b] else m[b]
        else:
            sends[v] += 1
            hv = hat[noff[v]:noff[v + 1]]
            for a in range(su):
                row = tables[base + a * sv:base + (a + 1) * sv]
                t = to_u[uoff[e] + a]
                for b in range(sv):
                    x = (row[b] + (gamma[v] * hv[b] - tv[b])) - t
                    m[b] = x if x < m[b] else m[b]
        low = np.inf
        for b in range(sv):
            if m[b] < low:
                low = m[b]
        value += low
    nodes = 0.0
    for i in range(n):
        low = np.inf
        w = 1.0 - gamma[i] * sends[i]
        for a in range(noff[i], noff[i + 1]):
            x = w * hat[a]
            if x < low:
                low = x
        nodes += low
    return value + nodes


def reparametrised_value(p: Packed, forward: bool, to_u: np.ndarray, to_v: np.ndarray) -> float:
    """The bound of the reparametrisation by messages ``to_u``/``to_v`` (``bounds.trws_bound``'s check)."""
    return float(_value(forward, p.noff, p.costs, p.eu, p.ev, p.gamma, p.toff, p.tables, p.uoff, to_u, p.voff,
                        to_v))


@njit(f"float64(int64, int64, boolean, float64, {_I}, {_F}, {_F}, {_F}, {_I}, {_I2}, {_I}, {_I2}, {_I}, {_F}, "
      f"{_I}, {_F}, {_I}, {_F}, {_I}, {_I}, int64, {_F}, {_F})", cache=True, nogil=True)
def _passes(first, count, check, best, noff, costs, hat, gamma, aptr, ahead, bptr, behind, toff, tables, uoff, to_u,
            voff, to_v, eu, ev, buffer, best_u, best_v):  # pragma: no cover - compiled
    for k in range(first, first + count):
        if k % 2 == 0:
            _pass(True, noff, hat, gamma, aptr, ahead, toff, tables, uoff, to_u, voff, to_v, buffer)
        else:
            _pass(False, noff, hat, gamma, bptr, behind, toff, tables, uoff, to_u, voff, to_v, buffer)
    if not check:
        return np.nan
    value = _value((first + count - 1) % 2 == 0, noff, costs, eu, ev, gamma, toff, tables, uoff, to_u, voff, to_v)
    if value > best:
        best_u[:] = to_u
        best_v[:] = to_v
    return value


def trws_passes(p: Packed, first: int, count: int, hat: np.ndarray, to_u: np.ndarray, to_v: np.ndarray,
                check: bool = False, best: float = np.inf, best_u: np.ndarray | None = None,
                best_v: np.ndarray | None = None) -> float:
    """Passes ``first`` to ``first + count - 1`` (even ones forward, odd ones backward) as ``trws_pass`` runs
    them, in one call without Python's lock throughout; with ``check``, then the bound of the last pass's
    reparametrisation (``reparametrised_value``), else nan. Where that bound exceeds ``best``, the messages
    are copied into ``best_u`` and ``best_v`` too (arrays of their sizes)."""
    if best_u is None or best_v is None:
        best, best_u, best_v = np.inf, np.empty(0), np.empty(0)
    return float(_passes(first, count, check, best, p.noff, p.costs, hat, p.gamma, p.ahead_ptr, p.ahead,
                         p.behind_ptr, p.behind, p.toff, p.tables, p.uoff, to_u, p.voff, to_v, p.eu, p.ev,
                         max(p.buffer, 1), best_u, best_v))
