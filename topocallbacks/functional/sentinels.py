"""Absolute collapse sentinels: levels that mean a collapse whatever came before, so they need no baseline.

A relative rule (a z-score against recent checks) is blind at the first checks, during its warm-up, and once a
collapsed state has become the reference. The sentinels look at one cloud alone:

* **constant**: `relative_spread` (RMS distance to the centre over the RMS norm) at most
  `CONSTANT_SPREAD`: every point is the same, up to rounding (a zeroed layer, or one replaced by its batch
  mean; a streaming check looks at each batch since the last check);
* **one direction**: `top_direction_share` (the largest principal variance over the total) at least
  `ONE_DIRECTION_SHARE`: the points lie on a line (a layer squeezed to rank one), unless they sit in two
  tight clusters on it (`two_cluster_share` at least `TWO_CLUSTER_SHARE`: a binary classifier's
  terminal phase);
* **one point at the scale**: every pair of points within ε, where ε applies (a streaming window: the points since
  the last check, in the window's frame): at the monitor's scale every point is the same point, β0 = 1 in one
  clique;
* non-finite features are caught before (a diverged check).

The thresholds sit far from every healthy value measured: ``benchmarks/sentinels.py`` (results in
``benchmarks/results/sentinels.md``) reads them off the healthy twins of the collapse-evidence suite, every check of
every seed, and off classifiers trained into their neural-collapse terminal phase (healthy: no action there).
Every value is scale-free: a cloud and the same cloud times 1e300 give the same values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.linalg
from numpy.typing import NDArray

from .._validation import as_points
from ._distances import pairwise_distances, power_of_two_scale

__all__ = [
    "CONSTANT_SPREAD",
    "ONE_DIRECTION_SHARE",
    "TWO_CLUSTER_SHARE",
    "SentinelValues",
    "relative_spread",
    "sentinel_values",
    "top_direction_share",
    "two_cluster_share",
]

#: A cloud whose spread is at most this fraction of its RMS norm is constant. Float32 features that are the same
#: up to rounding have a relative spread of about 1e-7; the smallest healthy value measured is many orders above.
CONSTANT_SPREAD = 1e-4
#: A cloud whose largest principal direction holds at least this share of the variance lies on one line (healthy
#: features measured up to 0.982: a GPT's mean-pooled hidden states, whose variance one direction dominates)...
ONE_DIRECTION_SHARE = 0.999
#: ...unless two groups along that line explain at least this share of its variance: two clusters, the terminal
#: phase of a binary classifier (measured at 0.88 and above; a layer squeezed to rank one reads like a Gaussian,
#: 0.64, or a uniform spread, 0.75).
TWO_CLUSTER_SHARE = 0.8


def relative_spread(points: Any) -> float:
    r"""How far the points are from all being the same, relative to their size.

    .. math:: s = \sqrt{\tfrac1n \sum_i |x_i - \bar x|^2} \;/\; \sqrt{\tfrac1n \sum_i |x_i|^2}

    0 when every point is the same (and for an all-zero cloud), at most 1 (a cloud centred at the origin);
    scale-free. Under full collapse: 0; an isotropic Gaussian centred at 0: 1.

    Examples:
        >>> import numpy as np
        >>> relative_spread(np.ones((5, 3)) * 7.0)
        0.0
        >>> round(relative_spread(np.array([[1.0, 0.0], [-1.0, 0.0]])), 6)
        1.0
    """
    return _relative_spread(as_points(points))


def _relative_spread(cloud: NDArray[np.float64]) -> float:
    scaled = cloud * power_of_two_scale(cloud)
    norm = float(np.sqrt(np.mean(np.einsum("ij,ij->i", scaled, scaled))))
    if norm == 0.0:
        return 0.0
    centred = scaled - scaled.mean(axis=0)
    return float(np.sqrt(np.mean(np.einsum("ij,ij->i", centred, centred)))) / norm


def top_direction_share(points: Any) -> float:
    r"""The share of the variance along the cloud's first principal direction, $\lambda_1 / \sum_k \lambda_k$.

    1 when the points lie on a line; ``1 / d`` for an isotropic cloud in ``d`` dimensions; 1 too for a cloud
    with no variance (every point the same). Scale-free.

    Examples:
        >>> import numpy as np
        >>> t = np.linspace(0.0, 1.0, 20)[:, None]
        >>> round(top_direction_share(t * np.array([[1.0, 2.0, 3.0]])), 12)  # a line in 3-D
        1.0
        >>> round(top_direction_share(np.random.default_rng(0).normal(size=(2000, 4))), 1)  # isotropic: about 1/4
        0.3
    """
    return _top_direction_share(as_points(points))


def _top_direction_share(cloud: NDArray[np.float64]) -> float:
    return _line(cloud)[0]


def _line(cloud: NDArray[np.float64]) -> tuple[float, NDArray[np.float64]]:
    """The first principal direction's share of the variance, and the points' coordinates along it."""
    scaled = cloud * power_of_two_scale(cloud)
    centred = scaled - scaled.mean(axis=0)
    total = float(np.einsum("ij,ij->", centred, centred))
    if total == 0.0 or not math.isfinite(total):
        return 1.0, np.zeros(cloud.shape[0])
    rows = centred.shape[0] <= centred.shape[1]  # the smaller Gram matrix has the same nonzero eigenvalues
    gram = centred @ centred.T if rows else centred.T @ centred
    # Only the top eigenpair: LAPACK's MRRR (syevr) on one index costs the tridiagonal reduction and one vector,
    # a third of a full decomposition at 512 x 512 (7 ms against 26); the same value to rounding.
    top = gram.shape[0] - 1
    values, vectors = scipy.linalg.eigh(gram, subset_by_index=[top, top], driver="evr", check_finite=False)
    value = max(float(values[0]), 0.0)
    coordinates = vectors[:, 0] * math.sqrt(value) if rows else centred @ vectors[:, 0]
    return float(min(value / total, 1.0)), coordinates


def two_cluster_share(coordinates: Any) -> float:
    r"""How much of the variance of 1-D ``coordinates`` the best split into two groups explains (Otsu's criterion).

    .. math:: \eta = \max_t \frac{n_1 n_2 (\bar x_1 - \bar x_2)^2 / n^2}{\operatorname{Var}(x)}

    1 for two points; about 0.64 for a Gaussian, 0.75 for a uniform spread; 1 also for a constant (no variance).
    A line holding two tight clusters is the terminal phase of a binary classifier (neural collapse), not a
    collapse: the one-direction sentinel leaves it alone.

    Examples:
        >>> import numpy as np
        >>> round(two_cluster_share(np.array([0.0, 0.1, 5.0, 5.1])), 4)
        0.9996
        >>> round(two_cluster_share(np.random.default_rng(0).normal(size=10000)), 2)
        0.64
    """
    x = np.sort(np.asarray(coordinates, dtype=np.float64).ravel())
    n = x.size
    total = float(np.sum((x - x.mean()) ** 2))
    if n < 2 or total == 0.0:
        return 1.0
    sums = np.cumsum(x)[:-1]
    left = np.arange(1, n)
    between = (sums - left * x.mean()) ** 2 * n / (left * (n - left))
    return float(min(between.max() / total, 1.0))


def _one_point(cloud: NDArray[np.float64], epsilon: float) -> tuple[float, bool]:
    """The largest distance to the centre in units of ε, and whether every pair of points is within ε.

    A point farther than ε from the centre is farther than ε from some point (the centre is their mean), and two
    points within ε/2 of it are within ε of each other: distances are computed only in between.
    """
    scale = power_of_two_scale(cloud, epsilon)
    centred = cloud * scale - (cloud * scale).mean(axis=0)
    extent = float(np.sqrt(np.max(np.einsum("ij,ij->i", centred, centred)))) / (epsilon * scale)
    if extent > 1.0:
        return extent, False
    if extent <= 0.5:
        return extent, True
    return extent, bool(pairwise_distances(cloud).max() <= epsilon)


@dataclasses.dataclass(frozen=True)
class SentinelValues:
    """The sentinels' values at one check, and which of them hold.

    Attributes:
        spread: `relative_spread` of the cloud (a streaming check: the median over the batches since the
            last check).
        constant_share: the share of the clouds (the probe: 1 cloud; streaming: the batches since the last check)
            whose spread is at most `CONSTANT_SPREAD`.
        top_share: `top_direction_share` of the cloud (streaming: of the points since the last check).
        two_clusters: `two_cluster_share` of the points' coordinates along that direction.
        extent: the largest distance from the cloud's centre in units of ε, where ε applies (None: no ε yet).
        one_point: every pair of points is within ε (then the ε-graph is one clique: one point at the scale).
    """

    spread: float
    constant_share: float
    top_share: float
    two_clusters: float = 0.0
    extent: float | None = None
    one_point: bool = False

    @property
    def holding(self) -> tuple[str, ...]:
        """The sentinels that hold: ``"constant"``, ``"one_direction"`` or ``"one_point"`` (the first that does)."""
        if self.constant_share > 0.5:
            return ("constant",)
        if self.top_share >= ONE_DIRECTION_SHARE and self.two_clusters < TWO_CLUSTER_SHARE:
            return ("one_direction",)
        if self.one_point:
            return ("one_point",)
        return ()

    def describe(self) -> str:
        """Why the features count as collapsed, in words (empty when no sentinel holds)."""
        if not self.holding:
            return ""
        name = self.holding[0]
        if name == "constant":
            where = "" if self.constant_share >= 1.0 else f" in {self.constant_share:.0%} of the batches"
            return (
                f"the features are constant{where} (spread {self.spread:.2g} of their size, at most "
                f"{CONSTANT_SPREAD:g})"
            )
        if name == "one_direction":
            return (
                f"the features lie on one line ({self.top_share:.4f} of their variance along one direction, at "
                f"least {ONE_DIRECTION_SHARE}; not two clusters on it: {self.two_clusters:.2f} < {TWO_CLUSTER_SHARE})"
            )
        return f"the features collapsed to one point at the scale (every pair within ε; extent {self.extent:.3g} ε)"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> SentinelValues:
        """The inverse of `as_dict`."""
        return cls(**data)


def sentinel_values(
    clouds: Sequence[NDArray[np.float64]],
    pooled: NDArray[np.float64],
    scaled: NDArray[np.float64] | None = None,
    epsilon: float | None = None,
) -> SentinelValues:
    """The sentinels of validated clouds.

    Args:
        clouds: the clouds judged one by one for constancy (a probe: one; streaming: each batch since the last
            check; clouds of fewer than 2 points are left out).
        pooled: all their points together (at least 2), for the direction share.
        scaled: the same points where ε applies (the transformed cloud), for one point at the scale, or None.
        epsilon: the scale, or None.

    Examples:
        >>> import numpy as np
        >>> cloud = np.random.default_rng(0).normal(size=(64, 8))
        >>> sentinel_values([cloud], cloud).holding
        ()
        >>> sentinel_values([cloud * 0.0 + 3.0], cloud * 0.0 + 3.0).holding
        ('constant',)
    """
    spreads = [_relative_spread(cloud) for cloud in clouds if cloud.shape[0] >= 2]
    spread = float(np.median(spreads)) if spreads else 1.0
    constant = float(np.mean([s <= CONSTANT_SPREAD for s in spreads])) if spreads else 0.0
    extent, one_point = None, False
    if scaled is not None and epsilon is not None and scaled.shape[0] >= 2:
        extent, one_point = _one_point(scaled, epsilon)
    share, coordinates = _line(pooled)
    return SentinelValues(
        spread=spread,
        constant_share=constant,
        top_share=share,
        two_clusters=two_cluster_share(coordinates),
        extent=extent,
        one_point=one_point,
    )
