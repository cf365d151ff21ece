"""Compiled kernels, used when numba is installed (``pip install topocallbacks[fast]``); numpy otherwise.

numba is imported on first use, never by ``import topocallbacks``; the kernels are compiled once per machine
(``cache=True``) and give exactly what the numpy code they replace gives (the tests run both).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "Kernels",
    "core_kernel",
    "load",
    "prim_kernel",
    "programme_kernel",
    "rips_edges_kernel",
    "threshold_block_kernel",
    "upper_edges_kernel",
]

#: Set to ``"0"`` to use the numpy code even where numba is installed.
ENVIRONMENT_SWITCH = "TOPOCALLBACKS_NUMBA"


#: The bit index of a power of two ``b`` (a word's lowest set bit) is ``_DE_BRUIJN_INDEX[(b * _DE_BRUIJN) >> 58]``
#: (a de Bruijn sequence: the top six bits of the product differ for each of the 64 powers).
_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DE_BRUIJN_INDEX = np.zeros(64, dtype=np.int64)
for _bit in range(64):
    _DE_BRUIJN_INDEX[((1 << _bit) * 0x03F79D71B4CB0A89 % 2**64) >> 58] = _bit


def _next_bit(bits: Any, word: Any) -> Any:  # pragma: no cover - compiled by numba (registered in `_compiled`)
    """``bits`` without its lowest set bit, and that bit's position in the row (``bits`` is the row's ``word``-th)."""
    low = bits & (~bits + np.uint64(1))
    return bits ^ low, word * 64 + _DE_BRUIJN_INDEX[((low * _DE_BRUIJN) >> np.uint64(58)) & np.uint64(63)]


def _dominated(packed: Any, degree: Any, v: Any) -> bool:  # pragma: no cover - compiled by numba
    """Whether a neighbour ``u`` of ``v`` has ``N[v] ⊆ N[u]`` (``packed``: closed neighbourhoods as bit rows).

    Only neighbours of at least ``v``'s closed degree (``degree``) can hold ``N[v]``; the others are skipped.
    """
    words = packed.shape[1]
    for w in range(words):
        bits = packed[v, w]
        while bits != 0:
            bits, u = _next_bit(bits, w)
            if u == v or degree[u] < degree[v]:
                continue
            inside = True
            for k in range(words):
                if packed[v, k] & ~packed[u, k]:
                    inside = False
                    break
            if inside:
                return True
    return False


def _core_mask(packed: Any, degree: Any, order: Any) -> Any:  # pragma: no cover - compiled by numba
    """The vertices left by strong collapses one vertex at a time, checked from a queue, until none is dominated.

    ``packed`` holds the closed neighbourhoods as bit rows (modified in place: a removed vertex's bit is cleared
    from its neighbours' rows), ``degree`` the closed degrees (modified too), ``order`` the first visiting order.
    A vertex ``v`` goes when an alive neighbour ``u`` has ``N[v] ⊆ N[u]``; its neighbours are queued again (their
    neighbourhoods shrank, so they may be dominated now), and the others need no new check: a neighbourhood that did
    not change is no more contained in one that shrank. The queue empties at a core.
    """
    n, words = packed.shape
    alive = np.ones(n, dtype=np.bool_)
    queued = np.ones(n, dtype=np.bool_)
    queue = np.empty(n, dtype=np.int64)
    queue[:] = order[:n]
    head, size = 0, n
    while size > 0:
        v = queue[head]
        head = (head + 1) % n
        size -= 1
        queued[v] = False
        if not alive[v] or degree[v] == 1 or not _dominated(packed, degree, v):
            continue
        alive[v] = False
        word, bit = v // 64, np.uint64(1) << np.uint64(v % 64)
        for w in range(words):
            bits = packed[v, w]
            while bits != 0:
                bits, x = _next_bit(bits, w)
                if x == v:
                    continue
                packed[x, word] &= ~bit
                degree[x] -= 1
                if not queued[x]:
                    queued[x] = True
                    queue[(head + size) % n] = x
                    size += 1
        packed[v, :] = np.uint64(0)
        degree[v] = 0
    return alive


def _edge_collapse(packed: Any, degree: Any) -> Any:  # pragma: no cover - compiled by numba
    """Remove dominated edges, one at a time, in passes until a pass removes none; returns how many went.

    An edge ``uv`` is dominated when some third vertex ``w`` has ``N[u] ∩ N[v] ⊆ N[w]``; the flag complex of the
    graph without ``uv`` is then a deformation retract of the one with it (Boissonnat and Pritam, "Edge collapse
    and persistence of flag complexes", 2020), so every Betti number is unchanged. ``packed`` (closed
    neighbourhoods as bit rows) and ``degree`` are modified in place.
    """
    n, words = packed.shape
    common = np.empty(words, dtype=np.uint64)
    removed = 0
    # An edge can become dominated only when its ends' common neighbourhood shrank: after the first pass, only the
    # edges at an end of an edge removed in the pass before are looked at again.
    dirty = np.ones(n, dtype=np.bool_)
    changed = True
    while changed:
        changed = False
        touched = np.zeros(n, dtype=np.bool_)
        for u in range(n):
            for wu in range(words):
                bits_u = packed[u, wu]
                while bits_u != 0:
                    bits_u, v = _next_bit(bits_u, wu)
                    if v <= u or not (dirty[u] or dirty[v]):
                        continue
                    for k in range(words):
                        common[k] = packed[u, k] & packed[v, k]
                    dominated = False
                    for wc in range(words):
                        bits = common[wc]
                        while bits != 0 and not dominated:
                            bits, w = _next_bit(bits, wc)
                            if w == u or w == v:  # noqa: SIM109 - plain comparisons, as numba compiles them
                                continue
                            inside = True
                            for k in range(words):
                                if common[k] & ~packed[w, k]:
                                    inside = False
                                    break
                            dominated = inside
                        if dominated:
                            break
                    if dominated:
                        packed[u, v // 64] &= ~(np.uint64(1) << np.uint64(v % 64))
                        packed[v, u // 64] &= ~(np.uint64(1) << np.uint64(u % 64))
                        degree[u] -= 1
                        degree[v] -= 1
                        touched[u] = True
                        touched[v] = True
                        removed += 1
                        changed = True
        dirty = touched
    return removed


def _common_birth_programme(
    x: Any, y: Any, to_diagonal_x: Any, before_y: Any
) -> Any:  # pragma: no cover - compiled by numba
    """The dynamic programme of ``indices._common_birth_cost`` for order 1, one scalar at a time.

    The same floating-point operations in the same order as the vectorised rows (``|x_i - y_j|`` for the power 1,
    which is exact), so the result is the same to the last bit.
    """
    m = y.size
    row = before_y.copy()
    candidates = np.empty(m + 1)
    for i in range(x.size):
        candidates[0] = row[0] + to_diagonal_x[i]
        for j in range(m):
            match = row[j] + abs(x[i] - y[j])
            stay = row[j + 1] + to_diagonal_x[i]
            candidates[j + 1] = stay if stay <= match else match
        running = candidates[0] - before_y[0]
        row[0] = before_y[0] + running
        for j in range(1, m + 1):
            value = candidates[j] - before_y[j]
            if value < running:
                running = value
            row[j] = before_y[j] + running
    return row[m]


def _rips_edges(points: Any, limit: Any) -> Any:  # pragma: no cover - compiled by numba
    """The edges ``i < j`` (row-major) of the Rips graph at ``limit`` and their lengths, as GUDHI measures them.

    ``sqrt(sum_k (p_ik - p_jk)**2)`` accumulated coordinate by coordinate from 0, GUDHI's ``Euclidean_distance``
    (no fast-math: the same operations in the same order, so the same lengths to the last bit), kept when at most
    ``limit``, as ``RipsComplex`` keeps them. Each row's sums are accumulated for all its pairs at once, a
    coordinate at a time, from a transposed copy of the points: the loop over pairs is contiguous and vectorises,
    and each pair's sum still takes its terms in GUDHI's order.
    """
    n, d = points.shape
    pairs = n * (n - 1) // 2
    rows = np.empty(pairs, dtype=np.int32)
    cols = np.empty(pairs, dtype=np.int32)
    lengths = np.empty(pairs, dtype=np.float64)
    columns = np.ascontiguousarray(points.T)  # columns[k, j]: coordinate k of point j
    sums = np.empty(max(n, 1))
    count = 0
    for i in range(n - 1):
        first, m = i + 1, n - i - 1  # the pairs (i, first + t), t < m
        for t in range(m):
            sums[t] = 0.0
        for k in range(d):
            x = points[i, k]
            for t in range(m):
                a = x - columns[k, first + t]
                sums[t] += a * a
        for t in range(m):
            length = np.sqrt(sums[t])
            if length <= limit:
                rows[count] = i
                cols[count] = first + t
                lengths[count] = length
                count += 1
    return rows[:count].copy(), cols[:count].copy(), lengths[:count].copy()


def _prim_lengths(distances: Any) -> Any:  # pragma: no cover - compiled by numba
    """``collapse.mst_edge_lengths`` one scalar at a time: the same order (the first smallest), the same lengths."""
    n = distances.shape[0]
    lengths = np.empty(max(n - 1, 0))
    if n < 2:
        return lengths
    in_tree = np.zeros(n, dtype=np.bool_)
    in_tree[0] = True
    best = distances[0].copy()
    best[0] = np.inf
    for k in range(n - 1):
        j = 0
        for i in range(1, n):
            if best[i] < best[j]:
                j = i
        lengths[k] = best[j]
        in_tree[j] = True
        for i in range(n):
            if in_tree[i]:
                best[i] = np.inf
            elif distances[j, i] < best[i]:
                best[i] = distances[j, i]
    return lengths


def _threshold_block(
    partial: Any, sq_right: Any, low: Any, high: Any, left: Any, right: Any, eps: Any, block: Any
) -> None:  # pragma: no cover - compiled by numba
    """``_distances.epsilon_block``'s decisions from the product ``left @ right.T``, one pass, into ``block``.

    The same operations in the same order as the vectorised code (``-2 x`` product ``+ |right_j|²`` against the
    row's certain bounds, and in between the direct distance, coordinate by coordinate): the same decisions.
    """
    m, n = partial.shape
    d = left.shape[1]
    for i in range(m):
        below, above = low[i], high[i]
        undecided = 0
        for j in range(n):  # branch-free, so that it vectorises: most pairs are decided by the bounds
            value = partial[i, j] * -2.0 + sq_right[j]
            block[i, j] = value <= below
            undecided += (value > below) & (value < above)
        if undecided == 0:
            continue
        for j in range(n):
            value = partial[i, j] * -2.0 + sq_right[j]
            if below < value < above:
                total = 0.0
                for k in range(d):
                    diff = left[i, k] - right[j, k]
                    total += diff * diff
                block[i, j] = np.sqrt(total) <= eps


def _upper_edges(adjacency: Any) -> Any:  # pragma: no cover - compiled by numba
    """The edges ``(rows[k], cols[k])``, ``rows < cols``, of a boolean adjacency, in row-major order."""
    n = adjacency.shape[0]
    count = 0
    for i in range(n):
        for j in range(i + 1, n):
            count += adjacency[i, j]
    rows = np.empty(count, dtype=np.intp)
    cols = np.empty(count, dtype=np.intp)
    k = 0
    for i in range(n):
        for j in range(i + 1, n):
            if adjacency[i, j]:
                rows[k] = i
                cols[k] = j
                k += 1
    return rows, cols


class Kernels(NamedTuple):
    """The compiled kernels."""

    core: Callable[..., NDArray[np.bool_]]
    edges: Callable[..., int]
    programme: Callable[..., float]
    rips_edges: Callable[..., tuple[NDArray[np.int32], NDArray[np.int32], NDArray[np.float64]]]
    prim: Callable[..., NDArray[np.float64]]
    threshold_block: Callable[..., None]
    upper_edges: Callable[..., tuple[NDArray[np.intp], NDArray[np.intp]]]


#: Held while the kernels load: a check that needs them while another thread loads them waits, and they load once.
_LOADING = threading.Lock()
# A fork waits for a load under way (a child would inherit the lock held, and numba half-loaded, and hang).
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_LOADING.acquire, after_in_parent=_LOADING.release, after_in_child=_LOADING.release)


def _compiled() -> Kernels | None:
    with _LOADING:
        return _compile()


@functools.cache
def _compile() -> Kernels | None:
    try:
        import numba  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    for helper in (_next_bit, _dominated):  # the kernels call them: compiled into them
        numba.extending.register_jitable(helper)
    jit = numba.njit(cache=True, nogil=True)
    kernels = Kernels(
        core=jit(_core_mask),
        edges=jit(_edge_collapse),
        programme=jit(_common_birth_programme),
        rips_edges=jit(_rips_edges),
        prim=jit(_prim_lengths),
        threshold_block=jit(_threshold_block),
        upper_edges=jit(_upper_edges),
    )
    # Compile (or load the cached machine code) now, not inside the first timed update.
    kernels.core(np.zeros((2, 1), dtype=np.uint64), np.ones(2, dtype=np.int64), np.arange(2, dtype=np.int64))
    kernels.edges(np.zeros((2, 1), dtype=np.uint64), np.ones(2, dtype=np.int64))
    kernels.programme(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(2))
    kernels.rips_edges(np.zeros((2, 1)), 1.0)
    kernels.prim(np.zeros((2, 2)))
    kernels.upper_edges(np.zeros((2, 2), dtype=np.bool_))
    kernels.threshold_block(*(np.zeros((1, 1)), *(np.zeros(1),) * 3, np.zeros((1, 1)), np.zeros((1, 1)), 1.0),
                            np.zeros((1, 1), dtype=np.bool_))  # fmt: skip
    return kernels


def core_kernel() -> tuple[Callable[..., NDArray[np.bool_]], Callable[..., int]] | None:
    """The compiled strong-collapse and edge-collapse kernels, or None (numba missing, or ``TOPOCALLBACKS_NUMBA=0``)."""
    compiled = _enabled()
    return None if compiled is None else (compiled.core, compiled.edges)


def programme_kernel() -> Callable[..., float] | None:
    """The compiled order-1 programme of the H0 diagram distance, or None."""
    compiled = _enabled()
    return None if compiled is None else compiled.programme


def rips_edges_kernel() -> Callable[..., tuple[NDArray[np.int32], NDArray[np.int32], NDArray[np.float64]]] | None:
    """The compiled Rips graph at a threshold with GUDHI's edge lengths (`_rips_edges`), or None."""
    compiled = _enabled()
    return None if compiled is None else compiled.rips_edges


def prim_kernel() -> Callable[..., NDArray[np.float64]] | None:
    """The compiled dense Prim of ``collapse.mst_edge_lengths`` (float64 distances), or None."""
    compiled = _enabled()
    return None if compiled is None else compiled.prim


def threshold_block_kernel() -> Callable[..., None] | None:
    """The compiled decisions of ``_distances.epsilon_block`` from its matrix product (`_threshold_block`), or None."""
    compiled = _enabled()
    return None if compiled is None else compiled.threshold_block


def upper_edges_kernel() -> Callable[..., tuple[NDArray[np.intp], NDArray[np.intp]]] | None:
    """The compiled edge list of a boolean adjacency (`_upper_edges`), or None."""
    compiled = _enabled()
    return None if compiled is None else compiled.upper_edges


def load() -> bool:
    """Import numba and load (or compile) the kernels now, unless they are switched off; whether they are in use."""
    return _enabled() is not None


def _enabled() -> Kernels | None:
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return None
    return _compiled()
