"""Topology of a point cloud: Betti numbers at a scale ε, persistence diagrams, persistence entropy.

All complexes are Vietoris-Rips (flag) complexes: an edge joins two points whose Euclidean distance is at most ε,
and a simplex is present when all its edges are. Homology is taken with Z/2 coefficients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import gudhi
import numpy as np
from numpy.typing import NDArray

from .._validation import as_points, check_int, check_positive_float, check_seed
from ..exceptions import InputError
from ._distances import epsilon_graph, power_of_two_scale
from ._jit import core_kernel, rips_edges_kernel, upper_edges_kernel

try:  # GUDHI's Ripser (GUDHI >= 3.9; what its RipsPersistence runs): the simplex tree's bars otherwise
    from gudhi._ripser_ext import _sparse as _RIPSER
except ImportError:  # pragma: no cover - older GUDHI
    _RIPSER = None

__all__ = [
    "BettiNumbers",
    "betti_numbers",
    "betti_numbers_of_graph",
    "persistence_diagrams",
    "persistence_entropy",
    "strong_collapse_core",
]


class BettiNumbers(NamedTuple):
    """Betti numbers β0 (connected components) and β1 (independent loops) of a complex.

    A tuple subclass: ``b0, b1 = betti_numbers(...)`` and ``betti_numbers(...) == (1, 0)`` both work.
    """

    b0: int
    b1: int


def _collapse_until_stable(tree: Any) -> None:
    """Edge-collapse a 1-dimensional simplex tree until a pass removes nothing; homology is preserved."""
    size = tree.num_simplices()
    while True:
        tree.collapse_edges()
        new_size = tree.num_simplices()
        if new_size == size:
            return
        size = new_size


#: Edges whose two closed neighbourhoods are compared at once in `strong_collapse_core` (bounds the
#: temporaries to about this x n / 4 bytes).
DOMINATION_CHUNK = 4096


#: Rows per block when the edges of an adjacency are listed (bounds the temporaries to this x n bytes).
_EDGE_BLOCK_ROWS = 256


def _upper_edges(adjacency: NDArray[np.bool_]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """The edges ``(rows[k], cols[k])``, ``rows < cols``, of a symmetric adjacency, in row-major order."""
    n = adjacency.shape[0]
    kernel = upper_edges_kernel()
    if kernel is not None and adjacency.dtype == np.bool_:  # the same edges in the same order, one pass
        listed: tuple[NDArray[np.intp], NDArray[np.intp]] = kernel(np.ascontiguousarray(adjacency))
        return listed
    row_parts, col_parts = [], []
    for start in range(0, n, _EDGE_BLOCK_ROWS):
        rows, cols = np.nonzero(np.triu(adjacency[start : start + _EDGE_BLOCK_ROWS, start:], 1))
        row_parts.append(rows + start)
        col_parts.append(cols + start)
    if not row_parts:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    return np.concatenate(row_parts).astype(np.intp), np.concatenate(col_parts).astype(np.intp)


def _packed_closed_rows(adjacency: NDArray[np.bool_]) -> NDArray[np.uint64]:
    """The closed neighbourhoods ``N[v]`` as bit rows, 64 vertices per word."""
    n = adjacency.shape[0]
    words = max((n + 63) // 64, 1)
    packed = np.zeros((n, words * 8), dtype=np.uint8)
    packed[:, : (n + 7) // 8] = np.packbits(adjacency, axis=1, bitorder="little")
    vertices = np.arange(n)
    packed[vertices, vertices // 8] |= (1 << (vertices % 8)).astype(np.uint8)
    return packed.view(np.uint64)


#: Words of the bit rows compared first: most pairs fail there, and only the rest are compared in full.
_PREFILTER_WORDS = 4


def _dominated_set(adjacency: NDArray[np.bool_], changed: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    """Vertices ``v`` with a neighbour ``u`` such that ``N[v] ⊆ N[u]`` and ``(deg u, u) > (deg v, v)``.

    All of them can go at once: following such dominators upwards ends at a vertex with none, which dominates
    every vertex of the chain (``N[v] ⊆ N[u] ⊆ N[w]``) and stays, so the set is removable one vertex at a time.
    ``N[v] ⊆ N[u]`` needs ``deg v <= deg u``, so each edge is tested one way only: its lower-ranked end in the
    higher-ranked one's. With ``changed`` (the vertices whose neighbourhood shrank since the last round, when no
    vertex was left dominated), only edges at a changed vertex are tested: the others cannot have become
    dominated.
    """
    n = adjacency.shape[0]
    rows, cols = _upper_edges(adjacency)
    if changed is not None:
        touched = changed[rows] | changed[cols]
        rows, cols = rows[touched], cols[touched]
    dominated = np.zeros(n, dtype=bool)
    if rows.size == 0:
        return dominated
    degree = np.count_nonzero(adjacency, axis=1)
    # rows < cols, so the row ranks above the column exactly when its degree is larger.
    swap = degree[rows] > degree[cols]
    low, high = np.where(swap, cols, rows), np.where(swap, rows, cols)
    packed = _packed_closed_rows(adjacency)
    words = packed.shape[1]
    first = min(_PREFILTER_WORDS, words)
    for begin in range(0, low.size, DOMINATION_CHUNK):
        lo, hi = low[begin : begin + DOMINATION_CHUNK], high[begin : begin + DOMINATION_CHUNK]
        head_lo, head_hi = packed[lo, :first], packed[hi, :first]
        alive = ~(head_lo & ~head_hi).any(axis=1)
        lo, hi = lo[alive], hi[alive]
        if lo.size and words > first:
            rest_lo, rest_hi = packed[lo, first:], packed[hi, first:]
            lo = lo[~(rest_lo & ~rest_hi).any(axis=1)]
        dominated[lo] = True
    return dominated


def strong_collapse_core(
    n_vertices: int, rows: NDArray[np.intp], cols: NDArray[np.intp]
) -> tuple[int, NDArray[np.intp], NDArray[np.intp]]:
    """The core of a graph under strong collapses: dominated vertices removed until none is left.

    A vertex ``v`` is dominated by a neighbour ``u`` when its closed neighbourhood lies in ``u``'s
    (``N[v] ⊆ N[u]``); the flag complex then deformation-retracts onto the graph without ``v`` (a strong
    collapse, Barmak and Minian 2012; Boissonnat and Pritam 2020), so every Betti number and the components are
    unchanged. Each round removes every dominated vertex whose dominator outranks it (by degree, then index: the
    highest-ranked vertex of a chain stays and dominates the rest), found for all edges at once with bit-packed
    neighbourhoods; rounds go on until none is left. A complete graph becomes one vertex, a tree one vertex per
    component, a clustered cloud's ε-graph a handful of vertices; a chordless cycle stays as it is.

    Returns:
        The remaining vertex count and the edges between the remaining vertices, relabelled ``0..n'-1`` in their
        original order, ``rows < cols``.

    Examples:
        >>> import numpy as np
        >>> rows, cols = np.triu_indices(5, 1)  # a complete graph on 5 vertices
        >>> strong_collapse_core(5, rows, cols)[0]
        1
    """
    adjacency = np.zeros((n_vertices, n_vertices), dtype=bool)
    adjacency[rows, cols] = True
    adjacency[cols, rows] = True
    core = _strong_collapse(adjacency)
    kept_rows, kept_cols = _upper_edges(core)
    return int(core.shape[0]), kept_rows, kept_cols


#: Highest-degree vertices whose dominated neighbours are removed in one sweep before the rounds (see
#: `_sweep_from_hubs`).
_HUBS = 64


def _sweep_from_hubs(adjacency: NDArray[np.bool_], hubs: int = _HUBS) -> NDArray[np.bool_]:
    """Remove, for each of the highest-degree vertices ``u`` in turn, every neighbour that ``u`` dominates.

    At most ``hubs`` of them, and one per 32 vertices (each sweep is a Python step: a small graph, such as a
    vertex's link, is left to the vectorised rounds).

    ``u`` stays, so each removed neighbour is still dominated when it goes (strong collapses one at a time). The
    bit rows are packed once: a test against rows that still hold removed vertices is conservative
    (``N[v] ⊆ N[u]`` stays true once the same vertices leave both). A near-complete graph (a collapsed cloud's)
    loses all but a vertex per clique in the first few sweeps. Returns the vertices kept.
    """
    n = adjacency.shape[0]
    alive = np.ones(n, dtype=bool)
    if n < 3:
        return alive
    packed = _packed_closed_rows(adjacency)
    degree = np.count_nonzero(adjacency, axis=1)
    for u in np.argsort(-degree, kind="stable")[: min(hubs, max(n // 32, 2))]:
        if not alive[u]:
            continue
        neighbours = np.flatnonzero(adjacency[u] & alive)
        if neighbours.size == 0:
            continue
        inside = ~(packed[neighbours] & ~packed[u]).any(axis=1)
        alive[neighbours[inside]] = False
    return alive


def _strong_collapse(adjacency: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """`strong_collapse_core` of a symmetric boolean adjacency (false diagonal): the core's adjacency.

    With numba installed, a compiled kernel removes one dominated vertex at a time from a queue
    (`topocallbacks.functional._jit`); otherwise vectorised rounds remove every dominated vertex at once.
    Both stop at a core: a graph with no dominated vertex, of the same homotopy type.
    """
    kernels = core_kernel()
    if kernels is not None and adjacency.shape[0] > 1:
        degree = np.count_nonzero(adjacency, axis=1).astype(np.int64) + 1
        order = np.argsort(degree, kind="stable").astype(np.int64)
        keep = np.flatnonzero(kernels[0](_packed_closed_rows(adjacency), degree, order))
        return adjacency[np.ix_(keep, keep)] if keep.size < adjacency.shape[0] else adjacency
    keep = np.flatnonzero(_sweep_from_hubs(adjacency))
    if keep.size < adjacency.shape[0]:
        adjacency = adjacency[np.ix_(keep, keep)]
    changed: NDArray[np.bool_] | None = None
    while adjacency.shape[0] > 1:
        dominated = _dominated_set(adjacency, changed)
        if not dominated.any():
            break
        keep = np.flatnonzero(~dominated)
        changed = np.asarray(adjacency[np.ix_(keep, np.flatnonzero(dominated))].any(axis=1))
        adjacency = adjacency[np.ix_(keep, keep)]
    return adjacency


#: Vertices below which `_betti_numbers_of_adjacency` skips the numpy strong collapse (measured: GUDHI alone
#: is faster on graphs this small; the compiled kernel is not).
SMALL_GRAPH = 64


def _gudhi_betti(n_vertices: int, rows: NDArray[np.intp], cols: NDArray[np.intp]) -> BettiNumbers:
    """β0, β1 by GUDHI: edge collapse until stable, expansion to the 2-skeleton, persistence."""
    tree = gudhi.SimplexTree()
    tree.insert_batch(np.arange(n_vertices, dtype=np.int64)[None, :], np.zeros(n_vertices))
    if rows.size:
        tree.insert_batch(np.vstack([rows, cols]).astype(np.int64), np.zeros(rows.size))
        _collapse_until_stable(tree)
        tree.expansion(2)
    # persistence_dim_max=True: a graph's top dimension is 1 and its loops must be counted too.
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    betti = tree.betti_numbers()
    return BettiNumbers(int(betti[0]), int(betti[1]) if len(betti) > 1 else 0)


def betti_numbers_of_graph(n_vertices: int, rows: NDArray[np.intp], cols: NDArray[np.intp]) -> BettiNumbers:
    """β0 and β1 of the flag complex of a graph on ``n_vertices`` vertices with edges ``(rows[k], cols[k])``.

    The graph is first reduced to its strong-collapse core (`strong_collapse_core`: dominated vertices
    removed until none is left, which keeps the homotopy type), then GUDHI edge-collapses the core and expands
    it to dimension 2. The core of a feature cloud's ε-graph is a few vertices per component, so the triangles
    of a dense graph are never enumerated and GUDHI's edge collapse, cubic on dense graphs, runs on almost
    nothing; a collapsed cloud's near-complete graph becomes a point.
    """
    adjacency = np.zeros((n_vertices, n_vertices), dtype=bool)
    adjacency[rows, cols] = True
    adjacency[cols, rows] = True
    return _betti_numbers_of_adjacency(adjacency)


def _betti_numbers_of_adjacency(adjacency: NDArray[np.bool_], degree: NDArray[np.int64] | None = None) -> BettiNumbers:
    """`betti_numbers_of_graph` of a symmetric boolean adjacency with a false diagonal.

    ``degree``: the vertices' degrees, if the caller has them already.
    """
    if adjacency.shape[0] == 0:
        return BettiNumbers(0, 0)
    # Without the compiled kernel, a small graph (a vertex's link, a small module) goes to GUDHI directly: the
    # rounds' fixed cost is more than they save there.
    kernels = core_kernel()
    if kernels is not None:
        core = _collapsed_by_kernels(adjacency, *kernels, degree=degree)
    else:
        core = adjacency if adjacency.shape[0] < SMALL_GRAPH else _strong_collapse(adjacency)
    return _gudhi_betti(core.shape[0], *_upper_edges(core))


def _row_counts(packed: NDArray[np.uint64] | NDArray[np.uint8]) -> NDArray[np.int64]:
    """The set bits of each bit row (numpy >= 2.0)."""
    counts: NDArray[np.int64] = np.bitwise_count(packed).sum(axis=1, dtype=np.int64)
    return counts


def degrees(adjacency: NDArray[np.bool_]) -> NDArray[np.int64]:
    """Each vertex's degree in a boolean adjacency with a false diagonal (bit counts: about twice as fast)."""
    if not hasattr(np, "bitwise_count"):  # numpy < 2.0
        counts: NDArray[np.int64] = np.count_nonzero(adjacency, axis=1).astype(np.int64)
        return counts
    return _row_counts(np.packbits(adjacency, axis=1))


def _collapsed_by_kernels(
    adjacency: NDArray[np.bool_],
    vertex_kernel: Callable[..., Any],
    edge_kernel: Callable[..., Any],
    degree: NDArray[np.int64] | None = None,
) -> NDArray[np.bool_]:
    """A smaller graph with the same homotopy type: strong collapses and edge collapses until neither applies.

    Dominated vertices go first (cheap, and most of a feature cloud's graph goes with them), then dominated edges
    (a sparse graph with loops keeps most of its vertices under strong collapses alone), then vertices again,
    which the removed edges may have left dominated.
    """
    n = adjacency.shape[0]
    packed = _packed_closed_rows(adjacency)
    # Closed degrees (the kernels change them in place).
    if degree is None:
        closed = _row_counts(packed) if hasattr(np, "bitwise_count") else np.count_nonzero(adjacency, axis=1) + 1
    else:
        closed = degree + 1
    degree = closed.astype(np.int64)
    alive = vertex_kernel(packed, degree, np.argsort(degree, kind="stable").astype(np.int64))
    while alive.sum() > 1 and edge_kernel(packed, degree):
        alive &= vertex_kernel(packed, degree, np.argsort(degree, kind="stable").astype(np.int64))
    keep = np.flatnonzero(alive)
    bits = np.unpackbits(packed[keep].view(np.uint8), axis=1, bitorder="little")[:, :n]
    core: NDArray[np.bool_] = bits[:, keep].astype(bool)
    np.fill_diagonal(core, False)
    return core


def betti_numbers(points: Any, epsilon: float) -> BettiNumbers:
    r"""Exact Betti numbers β0, β1 of the Vietoris-Rips complex of ``points`` at scale ``epsilon``.

    An edge joins points at Euclidean distance $\le \varepsilon$; β0 counts connected components and β1
    counts independent loops, $\beta_1 = \dim H_1(\mathrm{VR}_\varepsilon; \mathbb{Z}/2)$. Computed with
    GUDHI: the ε-graph is edge-collapsed first, then expanded to dimension 2.

    Range: $1 \le \beta_0 \le n$, $\beta_1 \ge 0$. Full collapse (all points equal): ``(1, 0)`` for any
    ε. Isotropic Gaussian: ``(1, 0)`` once ε exceeds the largest gap; for ε near the median distance a few loops
    may appear in low dimension, and β1 is almost always 0 in high dimension.

    Args:
        points: ``(n_samples, dim)`` array-like or torch tensor (any device), ``n_samples >= 2``.
        epsilon: the scale, a finite number > 0.

    Returns:
        ``BettiNumbers(b0, b1)``.

    Raises:
        InputError: bad shape or dtype, or ``epsilon`` not a finite number > 0.
        NonFiniteError: ``points`` holds NaN or Inf.

    Examples:
        >>> import numpy as np
        >>> angles = np.linspace(0, 2 * np.pi, 24, endpoint=False)
        >>> circle = np.stack([np.cos(angles), np.sin(angles)], axis=1)
        >>> betti_numbers(circle, epsilon=0.5)
        BettiNumbers(b0=1, b1=1)
        >>> betti_numbers(np.vstack([circle, circle + 10.0]), epsilon=0.5)
        BettiNumbers(b0=2, b1=2)
        >>> betti_numbers(circle, epsilon=2.5)  # every pair joined: a filled simplex
        BettiNumbers(b0=1, b1=0)
    """
    return _betti_numbers(as_points(points), check_positive_float(epsilon, "epsilon"))


def _betti_numbers(cloud: NDArray[np.float64], epsilon: float) -> BettiNumbers:
    """`betti_numbers` on a validated cloud and ε."""
    return _betti_numbers_of_adjacency(epsilon_graph(cloud, epsilon, edges=False)[0])


def _subsample(cloud: NDArray[np.float64], max_points: int, seed: int) -> NDArray[np.float64]:
    if cloud.shape[0] <= max_points:
        return cloud
    return cloud[_subsample_rows(cloud.shape[0], max_points, seed)]


@functools.lru_cache(maxsize=32)
def _subsample_rows(n: int, max_points: int, seed: int) -> NDArray[np.intp]:
    """The sorted rows `_subsample` keeps of ``n``: the same at every check of a probe, so drawn once (read-only)."""
    rng = np.random.default_rng(seed)
    index = np.sort(rng.choice(n, size=max_points, replace=False))
    index.flags.writeable = False
    return index


def persistence_diagrams(
    points: Any,
    max_dimension: int = 1,
    max_points: int = 256,
    threshold: float | None = None,
    seed: int = 0,
) -> list[NDArray[np.float64]]:
    r"""Persistence diagrams H0..H\ :sub:`max_dimension` of the Rips filtration of ``points``.

    Uses GUDHI's ``RipsComplex`` (edges up to ``threshold``), edge collapse, expansion to ``max_dimension + 1``,
    and persistence over Z/2; for ``max_dimension <= 1`` with numba installed, GUDHI's Ripser on the same
    filtration instead (the same bars, to the last bit, in a fraction of the time). When ``n_samples >
    max_points`` a seeded uniform subsample of ``max_points`` rows is used: full H1 persistence is cubic in the
    worst case, and a 1,000-point cloud can take minutes.

    Bars of zero length are not reported. Essential bars (never dying, e.g. the one H0 bar of a connected cloud,
    or bars still alive at ``threshold``) have death ``inf``.

    Full collapse (all points equal): H0 holds the single essential bar ``[0, inf)``, H1 is empty.

    Args:
        points: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.
        max_dimension: highest homology dimension, an integer >= 0 (1 by default).
        max_points: subsample size cap, an integer >= 2.
        threshold: largest edge length in the filtration (finite, > 0), or None for no limit.
        seed: seed of the subsample.

    Returns:
        A list of ``max_dimension + 1`` arrays of shape ``(k, 2)`` holding ``(birth, death)`` rows, sorted by
        birth then death.

    Raises:
        InputError: bad shape, dtype or argument value.
        NonFiniteError: ``points`` holds NaN or Inf.

    Examples:
        >>> import numpy as np
        >>> angles = np.linspace(0, 2 * np.pi, 24, endpoint=False)
        >>> h0, h1 = persistence_diagrams(np.stack([np.cos(angles), np.sin(angles)], axis=1))
        >>> len(h0), int(np.isinf(h0[:, 1]).sum())  # 23 finite merges, one essential component
        (24, 1)
        >>> len(h1), bool(h1[0, 0] < 0.27 < 1.7 < h1[0, 1])  # one loop, born at the side length
        (1, True)
    """
    cloud = as_points(points)
    dims = check_int(max_dimension, "max_dimension", minimum=0)
    cap = check_int(max_points, "max_points", minimum=2)
    limit = None if threshold is None else check_positive_float(threshold, "threshold")
    return _persistence_diagrams(_subsample(cloud, cap, check_seed(seed)), dims, limit)


def _persistence_diagrams(
    sample: NDArray[np.float64], max_dimension: int, threshold: float | None
) -> list[NDArray[np.float64]]:
    """`persistence_diagrams` of every point of a validated cloud."""
    dims, limit = max_dimension, threshold
    scale = power_of_two_scale(sample, *(() if limit is None else (limit,)))
    scaled_limit = np.inf if limit is None else limit * scale
    found = _ripser_bars(sample * scale, dims, scaled_limit)
    if found is None:
        found = _simplex_tree_bars(sample * scale, dims, scaled_limit)
    diagrams = []
    for bars in found:
        bars = bars / scale
        order = np.lexsort((bars[:, 1], bars[:, 0]))
        diagrams.append(bars[order])
    return diagrams


def _simplex_tree_bars(points: NDArray[np.float64], dims: int, limit: float) -> list[NDArray[np.float64]]:
    """The bars H0..H``dims`` of the Rips filtration up to ``limit``, by GUDHI's simplex tree (any dimension)."""
    rips = gudhi.RipsComplex(points=points, max_edge_length=limit)
    tree = rips.create_simplex_tree(max_dimension=1)
    # One pass: it removes most edges, and any number of passes leaves the persistence diagrams as they are.
    tree.collapse_edges()
    tree.expansion(dims + 1)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=True)
    return [
        np.asarray(tree.persistence_intervals_in_dimension(dim), dtype=np.float64).reshape(-1, 2)
        for dim in range(dims + 1)
    ]


def _ripser_bars(points: NDArray[np.float64], dims: int, limit: float) -> list[NDArray[np.float64]] | None:
    """The bars of `_simplex_tree_bars` by GUDHI's Ripser, H0 and H1 only (None: not available here).

    The same filtration (the Rips graph with GUDHI's edge lengths, `rips_edges_kernel`) and exact Z/2 persistence:
    the barcode of a filtration is unique, so the bars are the same numbers; Ripser needs no edge collapse first,
    which on a dense graph (a collapsed cloud's clusters) cost GUDHI most of the time.
    """
    kernel = rips_edges_kernel()
    if dims > 1 or kernel is None or _RIPSER is None:
        return None
    n = points.shape[0]
    rows, cols, lengths = kernel(points, limit)
    # GUDHI's own Rips persistence caps the dimension so for tiny clouds (no loop fits in 3 points anyway).
    top = min(dims, max(0, n - 3))
    try:
        found = _RIPSER(rows, cols, lengths, n, max_dimension=top, max_edge_length=limit, homology_coeff_field=2)
    except TypeError:  # pragma: no cover - a GUDHI whose private Ripser binding takes other arguments
        return None
    return [
        np.asarray(found[dim], dtype=np.float64).reshape(-1, 2) if dim < len(found) else np.zeros((0, 2))
        for dim in range(dims + 1)
    ]


def _as_diagram(diagram: Any) -> NDArray[np.float64]:
    if isinstance(diagram, (str, bytes)):
        raise InputError(
            f"`diagram` must be an array of (birth, death) rows, got a {type(diagram).__name__}: {diagram!r:.40}"
        )
    try:
        array = diagram if isinstance(diagram, np.ndarray) else np.asarray(diagram, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InputError(
            f"`diagram` must be an array of (birth, death) rows of numbers, got {diagram!r:.60}: {exc}"
        ) from exc
    if array.dtype.kind not in "iuf":
        raise InputError(f"`diagram` must have a real numeric dtype, got dtype {array.dtype}")
    if array.size == 0:
        return np.zeros((0, 2))
    if array.ndim != 2 or array.shape[1] != 2:
        raise InputError(f"`diagram` must have shape (n_bars, 2) of (birth, death) rows, got shape {array.shape}")
    array = array.astype(np.float64, copy=False)
    if np.isnan(array).any() or np.isinf(array[:, 0]).any():
        raise InputError("`diagram` must have finite births and non-NaN deaths")
    if (array[:, 1] < array[:, 0]).any():
        row = int(np.flatnonzero(array[:, 1] < array[:, 0])[0])
        raise InputError(f"`diagram` has a bar that dies before it is born: row {row} = {array[row].tolist()}")
    return array


def persistence_entropy(diagram: Any, normalize: bool = True, max_death: float | None = None) -> float:
    r"""Shannon entropy of the bar lengths of a persistence diagram.

    With lengths $\ell_i = d_i - b_i > 0$ and $p_i = \ell_i / \sum_j \ell_j$,
    $PE = -\sum_i p_i \log p_i$ (natural log, $0 \log 0 = 0$). With ``normalize=True`` it is divided by
    $\log m$, the largest value ``m`` bars can reach, so the result lies in ``[0, 1]``: 1 when all bars are
    equally long, near 0 when one bar dominates (Atienza et al., "Persistent entropy for separating topological
    features from noise", 2020).

    Infinite (essential) bars are dropped, or capped at ``max_death`` when it is given. Zero-length bars carry
    no persistence and are dropped. Fewer than two remaining bars give ``0.0`` (no spread to measure), and an empty
    diagram gives ``0.0``.

    Full collapse (all points equal): no finite bars, ``0.0``. Isotropic Gaussian: the H0 bars (minimum spanning
    tree edges) have similar lengths, so the normalised value is high, typically 0.95-0.99.

    Args:
        diagram: ``(n_bars, 2)`` array of ``(birth, death)`` rows; deaths may be ``inf``.
        normalize: divide by ``log(number of bars)``.
        max_death: cap for infinite deaths (finite, > 0), or None to drop infinite bars.

    Returns:
        The entropy, a float (in ``[0, 1]`` when normalised).

    Raises:
        InputError: wrong shape, NaN, infinite births, or a bar with death < birth.

    Examples:
        >>> persistence_entropy([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
        1.0
        >>> round(persistence_entropy([[0.0, 1.0], [0.0, 1.0]], normalize=False), 6)  # log 2
        0.693147
        >>> persistence_entropy([[0.0, 1.0], [0.0, float("inf")]])  # the essential bar is dropped
        0.0
    """
    bars = _as_diagram(diagram)
    cap = None if max_death is None else check_positive_float(max_death, "max_death")
    return _persistence_entropy(bars, normalize=normalize, max_death=cap)


def _persistence_entropy(bars: NDArray[np.float64], normalize: bool = True, max_death: float | None = None) -> float:
    """`persistence_entropy` of a validated diagram."""
    deaths = bars[:, 1]
    if max_death is not None:
        deaths = np.where(np.isinf(deaths), max_death, deaths)
    lengths = deaths - bars[:, 0]
    lengths = lengths[np.isfinite(lengths) & (lengths > 0)]
    if lengths.size < 2:
        return 0.0
    probabilities = lengths / lengths.sum()
    # A bar many orders of magnitude shorter than the rest can underflow to p = 0; its term is 0 * log 0 = 0.
    positive = probabilities[probabilities > 0]
    entropy = float(-np.sum(positive * np.log(positive)))
    if not normalize:
        return entropy
    return float(min(max(entropy / np.log(lengths.size), 0.0), 1.0))
