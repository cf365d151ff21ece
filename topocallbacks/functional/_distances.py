"""Pairwise distances and the ε-neighbour graph, decided the way GUDHI decides them.

The fast path is one BLAS pass over centred points (``|x|² + |y|² - 2 x·y``). Its rounding error is bounded, so
only pairs inside that error band around ε are decided again with direct differences,
``sqrt(Σ (x_i - x_j)²) <= ε`` in float64, the formula GUDHI's ``RipsComplex`` uses. Points and ε are first scaled
by the same power of two, which is exact in binary floating point, so huge or tiny coordinates neither overflow nor
change any decision.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._jit import threshold_block_kernel

__all__ = [
    "epsilon_adjacency",
    "epsilon_block",
    "epsilon_edges",
    "epsilon_graph",
    "pairwise_distances",
    "power_of_two_scale",
]

_UNIT_ROUNDOFF = 2.0**-53
# The error bounds below are first-order estimates; this factor keeps them safely conservative.
_SAFETY = 8.0
#: Rows per block in `epsilon_adjacency`: the float64 temporaries hold about 4 x this x n numbers.
ADJACENCY_BLOCK_ROWS = 256


def power_of_two_scale(points: NDArray[np.float64], *lengths: float) -> float:
    """Return ``2**-k`` that maps the largest of ``|points|`` and ``lengths`` into ``[0.5, 1)``.

    Multiplying by a power of two is exact (barring subnormals), so distances compare exactly as before scaling.
    """
    largest = max([float(np.max(np.abs(points), initial=0.0)), *lengths])
    if largest == 0.0 or not math.isfinite(largest):
        return 1.0
    _, exponent = math.frexp(largest)
    # Subnormal inputs would ask for more than 2**1023; 2**1000 already lifts them into normal range.
    return math.ldexp(1.0, min(-exponent, 1000))


def _centred_gram_distances(
    scaled: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Squared distances by the Gram trick on centred points, with the centred squared norms and norms."""
    centred = scaled - scaled.mean(axis=0)
    sq_norms = np.einsum("ij,ij->i", centred, centred)
    sq_dists = sq_norms[:, None] + sq_norms[None, :] - 2.0 * (centred @ centred.T)
    np.maximum(sq_dists, 0.0, out=sq_dists)
    np.fill_diagonal(sq_dists, 0.0)
    return sq_dists, sq_norms, np.sqrt(sq_norms)


def pairwise_distances(points: NDArray[np.float64]) -> NDArray[np.float64]:
    """Euclidean distance matrix of a validated ``(n, d)`` float64 array (one BLAS pass, overflow-safe)."""
    scale = power_of_two_scale(points)
    sq_dists, _, _ = _centred_gram_distances(points * scale)
    result: NDArray[np.float64] = np.sqrt(sq_dists) / scale
    return result


def _direct_distances(
    left: NDArray[np.float64], right: NDArray[np.float64], rows: NDArray[np.intp], cols: NDArray[np.intp]
) -> NDArray[np.float64]:
    """``sqrt(sum_k (x_ik - x_jk)**2)`` accumulated coordinate by coordinate, GUDHI's and scipy's order.

    The order matters only in the last bit, which is exactly what decides a pair at distance ε.
    """
    total = np.zeros(rows.size)
    for k in range(left.shape[1]):
        diff = left[rows, k] - right[cols, k]
        total += diff * diff
    result: NDArray[np.float64] = np.sqrt(total)
    return result


def epsilon_block(
    left: NDArray[np.float64], right: NDArray[np.float64], epsilon: float, *, scale: float | None = None
) -> NDArray[np.bool_]:
    """``B[i, j]`` iff ``||left_i - right_j|| <= epsilon``, decided exactly as `epsilon_adjacency` decides it.

    The decision for every pair equals GUDHI's ``sqrt(sum_k (x_ik - y_jk)**2) <= epsilon`` in float64, whatever
    the centring and the power-of-two ``scale`` used internally (pass ``scale`` to reuse one computed over a larger
    cloud), so rows computed here for new points agree bit for bit with a from-scratch adjacency.
    """
    if scale is None:
        scale = power_of_two_scale(np.vstack([left, right]), epsilon)
    scaled_left, scaled_right = left * scale, right * scale
    # Centre on the right block's first row (exact for identical rows), then on its mean.
    centre = scaled_right[0] + (scaled_right - scaled_right[0]).mean(axis=0)
    centred_right = scaled_right - centre
    sq_right = np.einsum("ij,ij->i", centred_right, centred_right)
    right_side = _Side(scaled=scaled_right, centred=centred_right, sq=sq_right, sq_max=float(sq_right.max()))
    return _decided(scaled_left, scaled_left - centre, right_side, epsilon * scale)


class _Side(NamedTuple):
    """The right-hand points of `epsilon_block`, scaled and centred once for every block of rows against them."""

    scaled: NDArray[np.float64]
    centred: NDArray[np.float64]
    sq: NDArray[np.float64]
    sq_max: float


def _decided(
    scaled_left: NDArray[np.float64], centred_left: NDArray[np.float64], right: _Side, eps: float
) -> NDArray[np.bool_]:
    """`epsilon_block`'s decisions for scaled and centred points, ``eps`` in their units."""
    dim = scaled_left.shape[1]
    sq_left = np.einsum("ij,ij->i", centred_left, centred_left)
    sq_right = right.sq
    # Rounding error of |a|^2 + |b|^2 - 2 a.b (dot products of length d, then two additions), plus the error that
    # centring adds to each difference vector (at most u * (|a| + |b|) in norm) near a distance of ε. Bounded per
    # row with the largest right-hand norm: a slightly wider band, one number per row.
    tolerance = (
        _SAFETY
        * _UNIT_ROUNDOFF
        * ((dim + 4) * (sq_left + right.sq_max) + 2.0 * eps * (np.sqrt(sq_left) + np.sqrt(right.sq_max)) + eps * eps)
    )
    eps_sq = eps * eps
    # partial[i, j] = |b_j|^2 - 2 a_i.b_j, compared with per-row thresholds: no n x m tolerance matrix.
    partial = centred_left @ right.centred.T
    kernel = threshold_block_kernel()
    if kernel is not None:  # the same operations compiled into one pass (numba installed): the same decisions
        decided = np.empty(partial.shape, dtype=bool)
        low, high = eps_sq - tolerance - sq_left, eps_sq + tolerance - sq_left
        kernel(partial, sq_right, low, high, scaled_left, right.scaled, eps, decided)
        return decided
    partial *= -2.0
    partial += sq_right
    certain_below = (eps_sq - tolerance - sq_left)[:, None]
    block = partial <= certain_below
    rows, cols = np.nonzero((partial > certain_below) & (partial < (eps_sq + tolerance - sq_left)[:, None]))
    if rows.size:
        block[rows, cols] = _direct_distances(scaled_left, right.scaled, rows, cols) <= eps
    result: NDArray[np.bool_] = block
    return result


def epsilon_graph(
    points: NDArray[np.float64], epsilon: float, *, edges: bool = True
) -> tuple[NDArray[np.bool_], NDArray[np.intp], NDArray[np.intp]]:
    """The ε-graph as a symmetric boolean adjacency and its edges ``(rows[k], cols[k])``, ``rows < cols``.

    Computed in row blocks that bound the float64 temporaries to ``ADJACENCY_BLOCK_ROWS x n``; each block is
    decided against the columns from its first row on only (the rest is mirrored from the blocks before it), and its
    edges are read from that part, so no n x n triangle copy is made. With ``edges=False`` the edge
    lists are not made (returned empty): listing them costs about a third of the pass.
    """
    n = points.shape[0]
    scale = power_of_two_scale(points, epsilon)
    adjacency = np.empty((n, n), dtype=bool)
    row_parts, col_parts = [np.zeros(0, dtype=np.intp)], [np.zeros(0, dtype=np.intp)]
    # The points are scaled and centred once, as epsilon_block would for all of them on the right (the same centre),
    # so the decisions are epsilon_block's.
    scaled = points * scale
    centre = scaled[0] + (scaled - scaled[0]).mean(axis=0)
    centred = scaled - centre
    sq = np.einsum("ij,ij->i", centred, centred)
    sq_max = float(sq.max())
    for start in range(0, n, ADJACENCY_BLOCK_ROWS):
        stop = min(start + ADJACENCY_BLOCK_ROWS, n)
        # Each block of rows against the columns from its first row on (the upper part): the lower part is the
        # transpose of blocks already decided. A pair's decision does not depend on which of its points is the row
        # (outside the error band a rigorous bound decides it, inside it the same sum of squared differences in
        # either order), and the band is the same: ``sq_max`` stays the whole cloud's.
        upper = _Side(scaled=scaled[start:], centred=centred[start:], sq=sq[start:], sq_max=sq_max)
        block = _decided(scaled[start:stop], centred[start:stop], upper, epsilon * scale)
        adjacency[start:stop, start:] = block
        adjacency[start:stop, :start] = adjacency[:start, start:stop].T
        if edges:
            # Strictly above the diagonal: local triu(k=1) of the block.
            rows, cols = np.nonzero(np.triu(block, 1))
            row_parts.append(rows + start)
            col_parts.append(cols + start)
    np.fill_diagonal(adjacency, False)
    return adjacency, np.concatenate(row_parts), np.concatenate(col_parts)


def epsilon_adjacency(points: NDArray[np.float64], epsilon: float) -> NDArray[np.bool_]:
    """Boolean adjacency of the ε-graph: ``A[i, j]`` iff ``i != j`` and ``||x_i - x_j|| <= epsilon``.

    Args:
        points: validated ``(n, d)`` float64 array (see ``topocallbacks._validation.as_points``).
        epsilon: finite scale > 0.

    Returns:
        A symmetric ``(n, n)`` boolean matrix with a false diagonal.
    """
    return epsilon_graph(points, epsilon, edges=False)[0]


def epsilon_edges(points: NDArray[np.float64], epsilon: float) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """Edges ``(i, j)`` with ``i < j`` of the ε-graph, as two index arrays in row-major order."""
    _, rows, cols = epsilon_graph(points, epsilon)
    return rows, cols
