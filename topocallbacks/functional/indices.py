"""Scale-free topological indices: Betti curves, total persistence and diagram drift.

These are the candidate collapse indices that the collapse-evidence suite (``benchmarks/collapse/``) compares with
the paper's composite. Unlike a Betti ratio at one fixed ε, none of them depends on the absolute feature scale:
Betti curves take their scales from the quantiles of the current pairwise distances, total persistence is
measured in units of the current median distance, and diagram drift is taken between clouds that
[`TopoMonitor`][topocallbacks.TopoMonitor] has normalised to unit RMS radius.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .._validation import as_points, check_int, check_number, check_seed
from ..exceptions import InputError
from ._distances import pairwise_distances
from ._jit import programme_kernel
from .topology import _as_diagram, _betti_numbers, _subsample

__all__ = ["DEFAULT_QUANTILES", "BettiCurve", "betti_curve", "diagram_distance", "total_persistence"]

#: The largest Wasserstein order `diagram_distance` takes (beyond it, powers of bar lengths lose all but the
#: longest bars to underflow; the distance is then the bottleneck distance to within rounding).
MAX_ORDER = 100.0

#: Quantiles of the pairwise distances at which `betti_curve` counts components and loops.
DEFAULT_QUANTILES = (0.01, 0.02, 0.05, 0.1, 0.2)


class BettiCurve(NamedTuple):
    """Betti numbers of the Rips complex at several scales of one cloud.

    Attributes:
        quantiles: the distance quantiles the scales were taken at.
        epsilons: the scales (the quantiles of the cloud's own pairwise distances).
        betti0: β0 at each scale.
        betti1: β1 at each scale.
        n_samples: the number of points.
    """

    quantiles: tuple[float, ...]
    epsilons: NDArray[np.float64]
    betti0: NDArray[np.int64]
    betti1: NDArray[np.int64]
    n_samples: int

    @property
    def component_area(self) -> float:
        r"""Mean of $\beta_0(\varepsilon_q) / n$ over the quantiles, in ``(0, 1]``.

        Higher when many points are still isolated at the low quantiles, lower when points merge early. Full
        collapse onto one point: ``1 / n``. Isotropic Gaussian (``n = 512``, ``d = 32``): about 0.09.
        """
        return float(np.mean(self.betti0) / self.n_samples)

    @property
    def loop_area(self) -> float:
        r"""Mean of $\beta_1(\varepsilon_q) / n$ over the quantiles, ``>= 0``."""
        return float(np.mean(self.betti1) / self.n_samples)


def betti_curve(
    points: Any, quantiles: tuple[float, ...] = DEFAULT_QUANTILES, *, max_points: int = 2048, seed: int = 0
) -> BettiCurve:
    r"""β0 and β1 of the Rips complex at scales set by the cloud's own distance quantiles.

    For each ``q`` in ``quantiles``, $\varepsilon_q$ is the ``q``-quantile of the pairwise distances between
    distinct points (a zero quantile is replaced by the smallest positive distance), and the Betti numbers are the
    exact ones of [`betti_numbers`][topocallbacks.functional.betti_numbers] at that scale. Because every scale follows
    the current distance distribution, the curve is invariant to rescaling the cloud (a fixed ε is not: as the feature
    scale shrinks during a collapse, a fixed ε ends up larger than every distance and the Betti numbers saturate at
    ``(1, 0)``).

    Full collapse onto one point: every distance is 0, the scales are reported as 0, and β = (1, 0) at each.
    Isotropic Gaussian (``n = 512``, ``d = 32``) at the default quantiles: β0 = 133, 75, 18, 4, 2.

    Args:
        points: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.
        quantiles: increasing quantiles in ``(0, 1]``.
        max_points: subsample cap for the distance quantiles (the Betti numbers always use every point).
        seed: seed of that subsample.

    Returns:
        A `BettiCurve`.

    Raises:
        InputError: bad shape, dtype or argument value.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> clusters = np.concatenate([rng.normal(size=(50, 3)) * 0.01, rng.normal(size=(50, 3)) * 0.01 + 10])
        >>> curve = betti_curve(clusters, quantiles=(0.2, 0.45))
        >>> curve.betti0.tolist()  # within-cluster scales, then still below the gap between the clusters
        [2, 2]
        >>> betti_curve(clusters * 1000, quantiles=(0.2, 0.45)).betti0.tolist()  # scale-free
        [2, 2]
    """
    cloud = as_points(points)
    qs = tuple(check_number(q, "quantiles", low=0.0, high=1.0, high_open=False) for q in quantiles)
    if not qs or any(b <= a for a, b in itertools.pairwise(qs)):
        raise InputError(f"`quantiles` must be a non-empty increasing sequence, got {quantiles!r}")
    sample = _subsample(cloud, check_int(max_points, "max_points", minimum=2), check_seed(seed))
    distances = pairwise_distances(sample)[np.triu_indices(sample.shape[0], 1)]
    positive = distances[distances > 0]
    if positive.size == 0:
        ones = np.ones(len(qs), dtype=np.int64)
        zeros = np.zeros(len(qs), dtype=np.int64)
        return BettiCurve(quantiles=qs, epsilons=np.zeros(len(qs)), betti0=ones, betti1=zeros, n_samples=cloud.shape[0])
    epsilons = np.quantile(distances, qs)
    epsilons = np.where(epsilons > 0, epsilons, positive.min())
    numbers = [_betti_numbers(cloud, float(eps)) for eps in epsilons]
    betti0, betti1 = (np.array([b[k] for b in numbers], dtype=np.int64) for k in (0, 1))
    return BettiCurve(quantiles=qs, epsilons=epsilons, betti0=betti0, betti1=betti1, n_samples=cloud.shape[0])


def total_persistence(diagram: Any, order: float = 1.0, scale: float | None = None) -> float:
    r"""Total persistence $\sum_i (d_i - b_i)^p$ of the finite bars, optionally in units of ``scale``.

    Essential (infinite) bars are left out. With ``scale`` (e.g. the median pairwise distance of the cloud), the
    lengths are divided by it first, which makes the value scale-free.

    Full collapse: no finite bars, 0. Isotropic Gaussian H0: about ``n`` bars of similar length, so the value
    grows linearly with the number of points.

    Args:
        diagram: ``(n_bars, 2)`` array of ``(birth, death)`` rows.
        order: the exponent ``p``, finite and > 0.
        scale: unit of length, finite and > 0, or None.

    Returns:
        A float ``>= 0``.

    Raises:
        InputError: bad diagram or argument, or a result beyond float64 (long bars at a high order: use ``scale``).

    Examples:
        >>> total_persistence([[0.0, 1.0], [0.0, 3.0], [0.5, float("inf")]])
        4.0
        >>> total_persistence([[0.0, 1.0], [0.0, 3.0]], order=2, scale=2.0)
        2.5
    """
    bars = _as_diagram(diagram)
    p = check_number(order, "order", low=0.0)
    lengths = bars[:, 1] - bars[:, 0]
    lengths = lengths[np.isfinite(lengths)]
    if scale is not None:
        lengths = lengths / check_number(scale, "scale", low=0.0)
    with np.errstate(over="ignore"):
        total = float(np.sum(lengths**p))
    if np.isinf(total):
        longest = float(lengths.max())
        raise InputError(
            f"total persistence overflows float64: the longest bar is {longest:.3g} at `order`={p:g}; pass "
            f"`scale` (e.g. the cloud's median distance) or a lower `order`"
        )
    return total


def diagram_distance(first: Any, second: Any, order: float = 1.0) -> float:
    r"""Wasserstein distance of order ``order`` between the finite parts of two persistence diagrams.

    The usual definition with the L-infinity ground metric: the cheapest matching of the bars of one diagram to
    the bars of the other or to the diagonal, $W_p = (\min \sum \|x - y\|_\infty^p)^{1/p}$, where a bar
    ``(b, d)`` costs ``(d - b) / 2`` to send to the diagonal. Solved exactly: when every bar of both diagrams is
    born at the same value (H0 of a Rips filtration) by a dynamic programme over the sorted bar lengths, else as
    an assignment problem on the ``(n + m) x (n + m)`` augmented cost matrix
    (`scipy.optimize.linear_sum_assignment`). GUDHI's Hera can loop forever on diagrams that are equal up to
    rounding, which consecutive checks produce. Infinite bars are left
    out of both, as their number and birth carry no information for a Rips filtration (one essential H0 bar).
    Used as *diagram drift*: the distance between the diagrams of consecutive checks.

    Args:
        first: ``(n_bars, 2)`` diagram.
        second: ``(n_bars, 2)`` diagram.
        order: the Wasserstein exponent, in ``[1, 100]`` (`MAX_ORDER`).

    Returns:
        A float ``>= 0``; 0 for equal diagrams.

    Raises:
        InputError: bad diagram or argument.

    Examples:
        >>> diagram_distance([[0.0, 1.0]], [[0.0, 1.0]])
        0.0
        >>> diagram_distance([[0.0, 1.0]], [[0.0, 2.0]])  # move the bar's death by 1
        1.0
        >>> diagram_distance([[0.0, 4.0]], [[0.0, 1.0]])  # both to the diagonal (2 + 0.5) beats one move (3)
        2.5
    """
    p = check_number(order, "order", low=1.0, high=MAX_ORDER, low_open=False, high_open=False)
    return _diagram_distance(_as_diagram(first), _as_diagram(second), p)


def _diagram_distance(a: NDArray[np.float64], b: NDArray[np.float64], p: float = 1.0) -> float:
    """`diagram_distance` of two validated diagrams."""
    a, b = (d[np.isfinite(d[:, 1])] for d in (a, b))
    n, m = a.shape[0], b.shape[0]
    if n == 0 and m == 0:
        return 0.0
    unit = 1.0
    if p > 1:  # lengths scaled into [0, 1] before the power, so that a large order neither overflows nor underflows
        unit = float(max(np.max(np.abs(a), initial=0.0), np.max(np.abs(b), initial=0.0))) or 1.0
        a, b = a / unit, b / unit
    births = np.concatenate([a[:, 0], b[:, 0]])
    if np.all(births == births[0]):
        total = _common_birth_cost(np.sort(a[:, 1] - a[:, 0]), np.sort(b[:, 1] - b[:, 0]), p)
    else:
        total = _assignment_cost(a, b, p)
    return float(total ** (1.0 / p)) * unit


def _assignment_cost(a: NDArray[np.float64], b: NDArray[np.float64], p: float) -> float:
    """The optimal matching's cost by a linear assignment on the augmented cost matrix."""
    from scipy.optimize import linear_sum_assignment

    n, m = a.shape[0], b.shape[0]
    cost = np.zeros((n + m, n + m))
    # The L-infinity distance of two bars: the larger of the two coordinates' gaps (no reduction over a short axis).
    cost[:n, :m] = np.maximum(np.abs(a[:, None, 0] - b[None, :, 0]), np.abs(a[:, None, 1] - b[None, :, 1])) ** p
    cost[:n, m:] = np.inf
    cost[np.arange(n), m + np.arange(n)] = ((a[:, 1] - a[:, 0]) / 2) ** p
    cost[n:, :m] = np.inf
    cost[n + np.arange(m), np.arange(m)] = ((b[:, 1] - b[:, 0]) / 2) ** p
    rows, cols = linear_sum_assignment(cost)
    return float(np.sum(cost[rows, cols]))


def _common_birth_cost(x: NDArray[np.float64], y: NDArray[np.float64], p: float) -> float:
    """The optimal matching's cost when every bar of both diagrams is born at the same value (an H0 diagram).

    The bars are then points on a line, ``x`` and ``y`` their sorted lengths: matching two costs ``|x - y|^p``
    (the L-infinity distance of the two points), sending one to the diagonal ``(x / 2)^p``. The cost of a match
    is a convex function of ``x - y``, so crossing matches can be uncrossed at no extra cost and an optimal
    matching pairs the bars in order: a dynamic programme over the two sorted sequences finds it exactly in
    ``O(n m)``, one vectorised row at a time (a running minimum resolves the row's left-to-right dependency).
    """
    to_diagonal_x, to_diagonal_y = (x / 2) ** p, (y / 2) ** p
    before_y = np.concatenate([[0.0], np.cumsum(to_diagonal_y)])  # cost of sending y[:j] to the diagonal
    kernel = programme_kernel() if p == 1.0 else None
    if kernel is not None:  # the same operations compiled (numba installed): bit for bit the same cost
        return float(kernel(x, y, to_diagonal_x, before_y))
    row = before_y.copy()  # the best cost of x[:0] against y[:j]
    for i in range(x.size):
        match = row[:-1] + np.abs(x[i] - y) ** p
        candidates = np.empty_like(row)
        candidates[0] = row[0] + to_diagonal_x[i]
        candidates[1:] = np.minimum(row[1:] + to_diagonal_x[i], match)
        row = before_y + np.minimum.accumulate(candidates - before_y)
    return float(row[-1])
