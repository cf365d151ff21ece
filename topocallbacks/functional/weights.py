"""Weight-space topology: neural persistence of a layer, the H0 persistence of its neurons, and when a curve flattens.

Unlike the rest of [`topocallbacks.functional`][topocallbacks.functional], these functions read a layer's *weights*,
not the features a probe produces: no data is needed. A weight matrix has one row per output neuron
(``torch.nn.Linear.weight`` is ``(out_features, in_features)``); a convolution kernel ``(out, in, k1, k2, ...)`` is read
as the matrix ``(out, in * k1 * k2 * ...)`` (each output channel's kernel as one row).
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._validation import as_points, check_number, check_positive_float
from ..exceptions import InputError
from ._distances import _direct_distances, pairwise_distances

__all__ = ["flattening_step", "neural_persistence", "weight_h0_total_persistence"]


def _as_weight(weight: Any, name: str = "weight") -> NDArray[np.float64]:
    """A validated float64 matrix ``(rows, columns)``: a kernel of 3 or more dimensions becomes ``(shape[0], -1)``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(weight, torch.Tensor):
        if weight.is_complex() or weight.dtype == torch.bool:
            raise InputError(f"`{name}` must have a real numeric dtype, got torch dtype {weight.dtype}")
        array: NDArray[Any] = weight.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        try:
            array = np.asarray(weight)
        except (TypeError, ValueError) as exc:
            raise InputError(f"`{name}` must be a weight matrix, got {type(weight).__name__}: {exc}") from exc
    if array.ndim < 2:
        raise InputError(
            f"`{name}` must be a weight matrix (out, in) or a kernel (out, in, ...), got a {array.ndim}-D array of "
            f"shape {array.shape}"
        )
    if array.ndim > 2:
        array = array.reshape(array.shape[0], -1)
    return as_points(array, name, min_samples=1)


def _maximum_spanning_tree_weights(normalised: NDArray[np.float64]) -> NDArray[np.float64]:
    """The edge weights of a maximum spanning tree of the complete bipartite graph with weights ``normalised``.

    Rows and columns are the two vertex sets; the tree has ``rows + columns - 1`` edges. The multiset of tree
    weights is the same for every maximum spanning tree. The edges are ranked by weight (ties share a rank) and
    scipy's minimum spanning tree runs on the ranks, so no weight is rounded on the way.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import minimum_spanning_tree

    n, m = normalised.shape
    unique, inverse = np.unique(normalised, return_inverse=True)
    # The heaviest edge costs 1, the lightest len(unique); csgraph reads 0 as "no edge", so no cost is 0.
    cost = (unique.size - inverse.reshape(-1)).astype(np.float64)
    indptr = np.concatenate([np.arange(n + 1) * m, np.full(m, n * m)])
    indices = np.tile(np.arange(n, n + m), n)
    tree = minimum_spanning_tree(csr_matrix((cost, indices, indptr), shape=(n + m, n + m))).tocoo()
    rows = np.minimum(tree.row, tree.col)
    cols = np.maximum(tree.row, tree.col) - n
    result: NDArray[np.float64] = normalised[rows, cols]
    return result


def neural_persistence(
    weight: Any, *, order: float = 2.0, normalize: bool = False, max_weight: float | None = None
) -> float:
    r"""Neural persistence of one layer (Rieck et al., ICLR 2019).

    The layer is the complete bipartite graph between its ``n`` input and ``m`` output neurons, edge ``(i, j)``
    weighted by $w'_{ij} = |w_{ij}| / w_{\max}$ with $w_{\max}$ the largest ``|w|`` (of the layer, or ``max_weight``,
    e.g. the whole network's as in the paper's Algorithm 1). The filtration is *descending*: every vertex is present
    at 1 and an edge enters at $w'$, heaviest first. Its 0-dimensional persistence diagram has one point $(1, w'_e)$
    per edge ``e`` of a maximum spanning tree (``n + m - 1`` merges, found by Kruskal's algorithm), and the one
    component that never dies is paired with 0, i.e. the point ``(1, 0)``, as in the authors' implementation
    (``BorgwardtLab/Neural-Persistence``, ``src/tda.py``: ``unpairedData=0``). With persistence $c - d$ of $(c, d)$,

    .. math:: NP = \Big(1 + \sum_{e \in \mathrm{MST}} (1 - w'_e)^p\Big)^{1/p}.

    Range: $[1, (n + m - 1)^{1/p}]$ with the layer's own maximum (normalised: ``(0, 1]``), a little beyond with a
    larger ``max_weight``. Invariant to permuting rows or columns, to transposing, to signs and to scaling the weights
    by a positive constant. Constant matrix (every ``|w|`` equal): every merge happens at 1, so ``NP = 1`` (normalised:
    $1 / (n + m - 1)^{1/p}$). Random Gaussian matrix of 64 x 64: about 4.1 (normalised about 0.37; 4.0-4.4 over seeds).

    Args:
        weight: a ``(out, in)`` weight matrix, or a kernel ``(out, in, ...)`` read as ``(out, in * ...)``; array-like
            or torch tensor (any device).
        order: the norm's exponent ``p`` (``>= 1``; the paper uses 2).
        normalize: divide by $(n + m - 1)^{1/p}$, the paper's upper bound (Theorem 1) with $\max w' - \min w' = 1$,
            as the authors' implementation does (``tp / sqrt(n - 1)`` with ``p = 2`` and ``n = rows + columns``).
        max_weight: the $w_{\max}$ to divide by (``>=`` the layer's largest ``|w|``), or None for the layer's own.

    Returns:
        The neural persistence, a float.

    Raises:
        InputError: not a matrix, non-numeric, all weights zero, ``order < 1``, or ``max_weight < max |w|``.
        NonFiniteError: NaN or Inf weights.

    Examples:
        >>> import numpy as np
        >>> weight = np.array([[4.0, 2.0], [1.0, 0.0]])  # w' = [[1, .5], [.25, 0]]: tree at 1, .5, .25
        >>> round(neural_persistence(weight), 6)  # sqrt(1 + 0**2 + .5**2 + .75**2)
        1.346291
        >>> round(neural_persistence(weight, normalize=True), 6)  # / sqrt(2 + 2 - 1)
        0.777282
        >>> neural_persistence(np.full((3, 5), -0.2))  # constant |w|: every merge at 1
        1.0
    """
    matrix = _as_weight(weight)
    p = check_number(order, "order", low=1.0, low_open=False)
    merges = _maximum_spanning_tree_weights(_scaled_magnitudes(matrix, max_weight))
    value = float((1.0 + np.sum((1.0 - merges) ** p)) ** (1.0 / p))
    if normalize:
        value /= (sum(matrix.shape) - 1) ** (1.0 / p)
    return value


def _scaled_magnitudes(matrix: NDArray[np.float64], max_weight: float | None) -> NDArray[np.float64]:
    """The layer's ``|w|`` divided by ``max_weight`` (validated), or by its own largest ``|w|``.

    Raises:
        InputError: all weights zero (with no ``max_weight``), or ``max_weight`` not > 0 or below the largest ``|w|``.
    """
    magnitudes = np.abs(matrix)
    largest = float(magnitudes.max())
    if max_weight is None:
        if largest == 0.0:
            raise InputError(
                "`weight` is all zeros: neural persistence divides by the largest |w|, so it has no value here"
            )
        return magnitudes / largest
    scale = check_positive_float(max_weight, "max_weight")
    if scale < largest:
        raise InputError(f"`max_weight` must be >= the layer's largest |w| ({largest!r}), got {max_weight!r}")
    return magnitudes / scale


def weight_h0_total_persistence(weight: Any) -> float:
    r"""H0 total persistence of a layer's neurons: the length of a Euclidean minimum spanning tree of its rows.

    Each output neuron is a point, its row of weights (a kernel's output channel, flattened). In the Rips
    filtration of these points (an edge enters at its Euclidean length) every point is born at 0 and the H0 bars
    die at the lengths of the edges of a minimum spanning tree, so

    .. math:: \mathrm{TP}_0 = \sum_{e \in \mathrm{MST}(\text{rows})} \lVert w_i - w_j \rVert_2 ,

    the essential bar left out. Computed with Prim's algorithm on the full distance matrix (``O(rows^2)`` memory
    and time; the matrix comes from one BLAS pass, and the tree's edges are then measured again with direct
    differences, so the total is as exact as the tree).

    Range: ``[0, inf)``; it scales with the weights (degree 1) and is invariant to permuting rows, to permuting
    columns and to rotating the rows. Constant matrix (every row the same): 0. Random Gaussian ``N(0, 1)`` matrix
    of 64 x 64: about 590 (63 edges of about 9.3 each, shorter than the typical distance ``sqrt(2 * 64)``).

    Args:
        weight: a ``(out, in)`` weight matrix, or a kernel ``(out, in, ...)`` read as ``(out, in * ...)``; array-like
            or torch tensor (any device).

    Returns:
        The total persistence, a float ``>= 0`` (0 for a single row).

    Raises:
        InputError: not a matrix, or non-numeric.
        NonFiniteError: NaN or Inf weights.

    Examples:
        >>> import numpy as np
        >>> weight_h0_total_persistence(np.array([[0.0, 0.0], [3.0, 4.0], [3.0, 5.0]]))  # edges 5 and 1
        6.0
        >>> weight_h0_total_persistence(np.ones((4, 3)))  # every row the same
        0.0
    """
    rows = _as_weight(weight)
    n = rows.shape[0]
    if n < 2:
        return 0.0
    distances = pairwise_distances(rows)  # one BLAS pass picks the tree; its edges are then measured exactly
    in_tree = np.zeros(n, dtype=bool)
    in_tree[0] = True
    nearest = distances[0].copy()
    parent = np.zeros(n, dtype=np.intp)
    children = np.empty(n - 1, dtype=np.intp)
    for k in range(n - 1):
        j = int(np.argmin(np.where(in_tree, np.inf, nearest)))
        children[k] = j
        in_tree[j] = True
        closer = (distances[j] < nearest) & ~in_tree
        parent[closer] = j
        nearest[closer] = distances[j][closer]
    return float(np.sum(_direct_distances(rows, rows, parent[children], children)))


def flattening_step(steps: Sequence[float], values: Sequence[float], *, fraction: float = 0.1) -> float | None:
    r"""The step from which a quantity's rate of change over checkpoints stays small: where its curve flattens.

    With checkpoints at steps $s_0 < s_1 < \dots < s_{N-1}$ and values $v_k$, the rate over each interval
    is $r_k = |v_k - v_{k-1}| / (s_k - s_{k-1})$ (``k = 1 .. N-1``) and the threshold is
    $\tau = \mathrm{fraction} \cdot \max_k r_k$. The flattening step is $s_{K-1}$ for the smallest
    ``K`` such that $r_k \le \tau$ for every $k \ge K$: the first checkpoint after which every later
    interval changes at most ``fraction`` of the fastest change seen. A curve that never changes is flat from its
    first step ($s_0$); a curve whose last interval is still above the threshold has not flattened yet
    (None). With the peak rate above the threshold, ``K`` comes after the peak, so the result is never before the
    steepest interval.

    Range: one of ``steps[:-1]``, or None. Invariant to scaling ``values`` by a non-zero constant and to adding a
    constant. For a constant series: ``steps[0]``. For random (Gaussian) noise the rate never settles, so the
    answer is usually None or late.

    Args:
        steps: checkpoint steps, strictly increasing, at least 2.
        values: the quantity at each step (finite).
        fraction: the share of the peak rate below which the curve counts as flat, in ``(0, 1)``.

    Returns:
        The step (an element of ``steps``), or None when the curve has not flattened by its last interval.

    Raises:
        InputError: lengths differ, fewer than 2 points, steps not strictly increasing, non-finite values, or
            ``fraction`` outside ``(0, 1)``.

    Examples:
        >>> flattening_step([0, 10, 20, 30, 40], [0.0, 5.0, 5.2, 5.25, 5.25])  # fast, then nearly flat from 10
        10
        >>> flattening_step([0, 10, 20], [0.0, 1.0, 3.0]) is None  # still speeding up
        True
        >>> flattening_step([0, 1, 2], [2.0, 2.0, 2.0])  # never changed: flat from the start
        0
    """
    share = check_number(fraction, "fraction", low=0.0, high=1.0)
    given, at, series = _checkpoint_series(steps, values)
    rates = np.abs(np.diff(series)) / np.diff(at)
    threshold = share * float(rates.max())
    above = np.flatnonzero(rates > threshold)  # indices k - 1 of the rates r_k above the threshold
    if above.size == 0:
        return given[0]
    last = int(above[-1]) + 1  # the last k with r_k above the threshold
    if last == at.size - 1:
        return None
    result: float = given[last]
    return result


def _checkpoint_series(
    steps: Sequence[float], values: Sequence[float]
) -> tuple[list[float], NDArray[np.float64], NDArray[np.float64]]:
    """The steps as given, and the steps and values as float arrays, validated (see `flattening_step`).

    Raises:
        InputError: lengths differ, fewer than 2 points, steps not strictly increasing, or non-finite values.
    """
    given = list(steps)
    if any(isinstance(s, bool) or not isinstance(s, numbers.Real) for s in given):
        raise InputError(f"`steps` must be numbers, got {given!r}")
    at = np.asarray(given, dtype=np.float64)
    try:
        series = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InputError(f"`values` must be a sequence of numbers: {exc}") from exc
    if at.ndim != 1 or series.ndim != 1 or at.size != series.size:
        raise InputError(
            f"`steps` and `values` must be 1-D sequences of the same length, got {at.size} steps and "
            f"{series.size} values"
        )
    if at.size < 2:
        raise InputError(f"`steps` must hold at least 2 checkpoints, got {at.size}")
    if not np.isfinite(at).all() or np.any(np.diff(at) <= 0):
        raise InputError(f"`steps` must be finite and strictly increasing, got {given!r}")
    if not np.isfinite(series).all():
        raise InputError(f"`values` must be finite, got {list(series)!r}")
    return given, at, series
