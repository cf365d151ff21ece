"""The Collapse Index: topology and geometry of a feature cloud folded into one number in ``[0, 1]``.

Reference: "Monitoring Neural Training with Topology: A Footprint-Predictable Collapse Index" (arXiv 2604.26984).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._validation import as_points, check_int, check_number, check_positive_float, check_seed
from ..exceptions import InputError
from ..settings import COMPONENTS, PAPER_WEIGHTS, IndexSettings, resolve_weights
from ._distances import _centred_gram_distances, pairwise_distances, power_of_two_scale
from ._jit import prim_kernel
from .geometry import _anisotropy
from .topology import _betti_numbers, _persistence_diagrams, _persistence_entropy, _subsample

__all__ = [
    "COMPONENTS",
    "DEGREE_BAND",
    "PAPER_WEIGHTS",
    "CollapseReport",
    "betti_term",
    "calibrate_epsilon",
    "collapse_index",
    "entropy_term",
    "epsilon_heuristic",
    "longest_mst_edge",
    "mean_degree",
    "mst_edge_lengths",
    "resolve_weights",
]

#: Points of the seeded subsample whose pairwise distances the ε heuristic takes its quantile of.
EPSILON_SAMPLE = 2048
#: The mean ε-degrees between which a cloud's ε-graph is informative: from about 65 % of the points isolated (a mean
#: degree of 1) to about 2 % (32), on the real clouds measured for ``IndexSettings.epsilon_degree``. A streaming
#: window outside this band at a check that is not flagged gets a new ε.
DEGREE_BAND = (1.0, 32.0)


def epsilon_heuristic(
    points: Any,
    quantile: float | None = IndexSettings.epsilon_quantile,
    factor: float = IndexSettings.epsilon_factor,
    max_points: int = EPSILON_SAMPLE,
    seed: int = 0,
    *,
    degree: float = IndexSettings.epsilon_degree,
) -> float:
    """The default scale: the distance at which the points have ``degree`` ε-neighbours on average.

    That is the ``degree / (n - 1)`` quantile of the pairwise distances of ``n`` points, times ``factor``; a fixed
    ``quantile`` replaces ``degree / (n - 1)`` (``quantile=0.5, factor=0.5`` is the paper's 0.5 x median).
    Distances are taken over distinct pairs of a seeded subsample of at most ``max_points`` rows (the degree is
    the whole cloud's: the quantile is the same). When that quantile is 0 (most points coincide), the smallest
    positive distance is used instead; when every point is the same, any ε gives the same topology and 1.0 is
    returned with a warning.

    Args:
        points: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.
        quantile: which quantile of the pairwise distances, in ``(0, 1]``, or None to follow ``degree``.
        factor: multiplier applied to that quantile, finite and > 0.
        max_points: subsample size cap for the distance computation, an integer >= 2.
        seed: seed of the subsample.
        degree: the mean number of ε-neighbours aimed at, > 0 (at most ``n - 1``: every pair).

    Returns:
        ε, a finite float > 0.

    Raises:
        InputError: bad shape, dtype or argument value.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> line = np.arange(5.0)[:, None]  # distances 1 (4 pairs), 2 (3), 3 (2), 4 (1)
        >>> epsilon_heuristic(line, degree=1.2)  # the 0.3 quantile of the 10 distances
        1.0
        >>> epsilon_heuristic(np.array([[0.0], [1.0], [3.0]]), quantile=0.5, factor=0.5)  # the paper's: 0.5 x 2
        1.0
    """
    cloud = as_points(points)
    q = None if quantile is None else check_number(quantile, "quantile", low=0.0, high=1.0, high_open=False)
    scale = check_positive_float(factor, "factor")
    target = check_positive_float(degree, "degree")
    cap = check_int(max_points, "max_points", minimum=2)
    return _epsilon_heuristic(cloud, q, scale, cap, check_seed(seed), target)


def calibrate_epsilon(
    cloud: NDArray[np.float64], settings: IndexSettings, seed: int = 0, *, size: int | None = None
) -> float:
    """The scale a monitor keeps: ``settings.epsilon``, or `epsilon_heuristic` of a validated ``cloud``.

    The heuristic follows ``settings.epsilon_degree``, or ``settings.epsilon_quantile`` when it is set, times
    ``settings.epsilon_factor``. ``size``: the number of points the degree is aimed at, when the cloud is a sample of
    them (a streaming window not yet full); None: the cloud's.
    """
    if settings.epsilon is not None:
        return settings.epsilon
    s = settings
    return _epsilon_heuristic(cloud, s.epsilon_quantile, s.epsilon_factor, EPSILON_SAMPLE, seed, s.epsilon_degree, size)


def mean_degree(edges: int, n_points: int) -> float:
    """The mean number of ε-neighbours of ``n_points`` joined by ``edges`` edges (0 for fewer than 2 points)."""
    return 2.0 * edges / n_points if n_points > 1 else 0.0


def _epsilon_heuristic(
    cloud: NDArray[np.float64],
    quantile: float | None,
    factor: float,
    max_points: int,
    seed: int,
    degree: float,
    size: int | None = None,
) -> float:
    """`epsilon_heuristic` on a validated cloud (the degree aimed at for ``size`` points, default the cloud's)."""
    sample = _subsample(cloud, max_points, seed)
    distances = pairwise_distances(sample)[np.triu_indices(sample.shape[0], 1)]
    n = max(cloud.shape[0] if size is None else size, 2)
    q = min(degree / (n - 1), 1.0) if quantile is None else quantile
    value = float(np.quantile(distances, q))
    if value == 0.0:
        positive = distances[distances > 0]
        if positive.size == 0:
            warnings.warn(
                "all points are identical: the epsilon heuristic has no scale to follow and returns 1.0",
                RuntimeWarning,
                stacklevel=2,
            )
            return 1.0
        value = float(positive.min())
    return value * factor


def longest_mst_edge(points: Any) -> float | None:
    """Length of the longest edge of a Euclidean minimum spanning tree of ``points`` (None if all coincide).

    Used as the Rips threshold of the persistence diagrams in `collapse_index`: every H0 bar dies by then,
    so H0 is complete, while the costly long edges that only fill H1 in late are never built. The value is
    raised by one part in 10^9 so that rounding never leaves the last merge out.
    """
    return _longest_mst_edge(as_points(points))


def _longest_mst_edge(cloud: NDArray[np.float64]) -> float | None:
    """`longest_mst_edge` on a validated cloud.

    The tree is spanned over the squared distances of `pairwise_distances` (before its square root and unscaling):
    ``x -> sqrt(x) / scale`` is non-decreasing, so a minimum spanning tree of the squared distances is one of the
    distances, and its longest edge, mapped, is bit for bit the longest edge of a tree spanned over the distances.
    """
    scale = power_of_two_scale(cloud)
    squared, _, _ = _centred_gram_distances(cloud * scale)
    longest = float(np.sqrt(mst_edge_lengths(squared).max(initial=0.0)) / scale)
    if longest == 0.0:
        return None
    return longest * (1.0 + 1e-9)


def mst_edge_lengths(distances: NDArray[np.float64]) -> NDArray[np.float64]:
    """The edge lengths of a minimum spanning tree of the complete graph with these distances (Prim, dense).

    ``n - 1`` lengths for ``n`` points, in the order Prim adds them. Every minimum spanning tree has the same
    lengths, so this is the multiset of the finite H0 deaths of the Rips filtration. O(n^2) time with one
    vectorised pass per vertex; coincident points give zero-length edges.

    Examples:
        >>> import numpy as np
        >>> points = np.array([0.0, 1.0, 5.0, 5.5])
        >>> sorted(mst_edge_lengths(np.abs(points[:, None] - points[None, :])).tolist())
        [0.5, 1.0, 4.0]
    """
    n = distances.shape[0]
    kernel = prim_kernel()
    if kernel is not None:  # the same steps compiled (numba installed): the same lengths in the same order
        compiled: NDArray[np.float64] = kernel(np.ascontiguousarray(distances, dtype=np.float64))
        return compiled
    lengths = np.empty(max(n - 1, 0))
    if n < 2:
        return lengths
    in_tree = np.zeros(n, dtype=bool)
    in_tree[0] = True
    best = distances[0].astype(np.float64, copy=True)
    best[0] = np.inf
    for k in range(n - 1):
        j = int(np.argmin(best))
        lengths[k] = best[j]
        in_tree[j] = True
        np.minimum(best, distances[j], out=best)
        best[in_tree] = np.inf
    return lengths


def betti_term(b0: int, b1: int) -> float:
    r"""Betti-ratio component $1 - \mathrm{clip}(\beta_1 / \beta_0, 0, 1)$, in ``[0, 1]``.

    1 when the complex has no loops (full collapse: β = (1, 0)), lower as loops outnumber components.
    Isotropic Gaussian (``n = 512``, ``d = 32``) at the default ε (mean degree 8): 0 (β1 ≈ 190 > β0 ≈ 95); at the
    paper's 0.5 × median distance: 1 (β1 = 0). A single-ε Betti ratio saturates at one end or the other.

    Examples:
        >>> betti_term(1, 0), betti_term(4, 1), betti_term(1, 3)
        (1.0, 0.75, 0.0)
    """
    if b0 < 1:
        raise InputError(f"`b0` must be >= 1 (a non-empty complex has a component), got {b0!r}")
    if b1 < 0:
        raise InputError(f"`b1` must be >= 0, got {b1!r}")
    return 1.0 - min(max(b1 / b0, 0.0), 1.0)


def entropy_term(normalized_entropy: float) -> float:
    """Persistence-entropy component ``1 - PE_normalised``, in ``[0, 1]``.

    1 under full collapse (no finite bars), near 0 for an isotropic Gaussian (bars of similar length).

    Examples:
        >>> entropy_term(0.25)
        0.75
    """
    if not 0.0 <= normalized_entropy <= 1.0:
        raise InputError(f"`normalized_entropy` must be in [0, 1], got {normalized_entropy!r}")
    return 1.0 - normalized_entropy


@dataclasses.dataclass(frozen=True)
class CollapseReport:
    """Everything one Collapse Index evaluation measured.

    Attributes:
        ci: the composite index, ``sum(weights[c] * component[c])``, in ``[0, 1]``; higher means more collapsed.
        betti_term: ``1 - clip(b1 / b0, 0, 1)``.
        entropy_term: ``1 - persistence_entropy``.
        anisotropy_term: the covariance anisotropy, in ``[0, 1]``.
        betti0: β0 of the Rips complex at ``epsilon`` (all points).
        betti1: β1 of the Rips complex at ``epsilon`` (all points).
        persistence_entropy: normalised persistence entropy of the finite H0 and H1 bars of the subsample.
        epsilon: the scale used for the Betti numbers.
        n_samples: number of points.
        n_features: dimension of the points.
        n_diagram_points: size of the subsample used for the persistence diagrams.
        weights: the normalised weights of the composite.
        timings_ms: wall time of each part (``betti``, ``persistence``, ``anisotropy``, ``total``).
    """

    ci: float
    betti_term: float
    entropy_term: float
    anisotropy_term: float
    betti0: int
    betti1: int
    persistence_entropy: float
    epsilon: float
    n_samples: int
    n_features: int
    n_diagram_points: int
    weights: Mapping[str, float]
    timings_ms: Mapping[str, float]

    @property
    def components(self) -> dict[str, float]:
        """The normalised components, keyed like ``weights``."""
        return {"betti": self.betti_term, "entropy": self.entropy_term, "anisotropy": self.anisotropy_term}

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready flat copy (nested mappings become dicts)."""
        result = dataclasses.asdict(self)
        result["weights"] = dict(self.weights)
        result["timings_ms"] = dict(self.timings_ms)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CollapseReport:
        """The inverse of `as_dict`."""
        return cls(**data)


def collapse_index(
    features: Any,
    epsilon: float | None = None,
    weights: str | Mapping[str, float] | None = None,
    *,
    max_points: int = IndexSettings.max_points,
    seed: int = 0,
    betti: tuple[int, int] | None = None,
) -> CollapseReport:
    r"""The Collapse Index of a feature cloud and all its components.

    .. math:: CI = w_b \,(1 - \mathrm{clip}(\beta_1/\beta_0, 0, 1)) + w_e\,(1 - PE) + w_a\,A

    with β0, β1 the Betti numbers of the Rips complex at ``epsilon`` (`betti_numbers`, all points), PE the
    normalised persistence entropy (`persistence_entropy`) of the finite H0 and H1 bars of a seeded subsample
    of ``max_points`` points (`persistence_diagrams`, thresholded at the subsample's longest
    minimum-spanning-tree edge, `longest_mst_edge`, so H0 is complete and H1 loops still open there are
    dropped), and A the covariance anisotropy (`anisotropy`). The paper's weights are ``(0.4, 0.3, 0.3)``;
    weights are normalised to sum to 1, so ``CI`` lies in ``[0, 1]``.

    Full collapse (all points equal): every component is 1, so ``CI = 1``. Isotropic Gaussian (``n = 512``,
    ``d = 32``, paper weights): about 0.04 at the default ε (the Betti term is 0: loops outnumber components);
    about 0.43 at the paper's 0.5 × median distance, nearly all of it from the Betti term, which is 1 whenever the
    complex at ε has no loop. That saturation is why the index's components are reported beside it.

    Args:
        features: ``(n_samples, dim)`` array-like or torch tensor (any device), ``n_samples >= 2``.
        epsilon: the scale of the Betti numbers, finite and > 0; None uses `epsilon_heuristic` (the
            distance at which the points have 8 ε-neighbours on average).
        weights: ``"paper"``/None or a mapping of component weights (see `resolve_weights`).
        max_points: subsample size for the persistence diagrams, an integer >= 2.
        seed: seed of the subsamples.
        betti: ``(b0, b1)`` already computed at ``epsilon`` (e.g. by an `MMHM` engine);
            requires ``epsilon``.

    Returns:
        A [`CollapseReport`][topocallbacks.CollapseReport].

    Raises:
        InputError: bad shape, dtype or argument value.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> collapse_index(np.ones((32, 4)), epsilon=0.1).ci
        1.0
        >>> report = collapse_index(np.random.default_rng(0).normal(size=(200, 16)), weights="paper")
        >>> 0.0 <= report.ci <= 1.0, report.betti0 >= 1, sorted(report.components)
        (True, True, ['anisotropy', 'betti', 'entropy'])
    """
    cloud, resolved, cap, rng_seed = _checked_arguments(features, weights, max_points, seed)
    eps = _betti_scale(cloud, epsilon, betti, rng_seed)
    report, _ = _collapse_index(cloud, eps, resolved, max_points=cap, seed=rng_seed, betti=betti)
    return report


def _checked_arguments(
    features: Any, weights: str | Mapping[str, float] | None, max_points: int, seed: int
) -> tuple[NDArray[np.float64], dict[str, float], int, int]:
    """`collapse_index`'s cloud, weights (resolved), subsample size and seed, validated in that order.

    Raises:
        InputError: bad shape, dtype or argument value.
        NonFiniteError: NaN or Inf entries.
    """
    cloud = as_points(features, "features")
    resolved = resolve_weights(weights)
    return cloud, resolved, check_int(max_points, "max_points", minimum=2), check_seed(seed)


def _betti_scale(cloud: NDArray[np.float64], epsilon: float | None, betti: tuple[int, int] | None, seed: int) -> float:
    """The scale ε of the Betti numbers: ``epsilon`` validated, or calibrated on ``cloud`` (`calibrate_epsilon`).

    Raises:
        InputError: ``epsilon`` not finite and > 0, or ``betti`` given without the ``epsilon`` it was computed at.
    """
    if betti is not None and epsilon is None:
        raise InputError("`betti` was given without the `epsilon` it was computed at")
    if epsilon is None:
        return calibrate_epsilon(cloud, IndexSettings(), seed)
    return check_positive_float(epsilon, "epsilon")


def _collapse_index(
    cloud: NDArray[np.float64],
    epsilon: float,
    weights: Mapping[str, float],
    *,
    max_points: int,
    seed: int,
    betti: tuple[int, int] | None,
) -> tuple[CollapseReport, list[NDArray[np.float64]]]:
    """`collapse_index` on a validated cloud with resolved weights, and the H0, H1 diagrams it computed."""
    start = time.perf_counter()
    tick = time.perf_counter()
    b0, b1 = _betti_numbers(cloud, epsilon) if betti is None else (int(betti[0]), int(betti[1]))
    betti_ms = (time.perf_counter() - tick) * 1e3

    tick = time.perf_counter()
    sample = _subsample(cloud, max_points, seed)
    h0, h1 = _persistence_diagrams(sample, max_dimension=1, threshold=_longest_mst_edge(sample))
    entropy = _persistence_entropy(np.vstack([h0, h1]))
    persistence_ms = (time.perf_counter() - tick) * 1e3

    tick = time.perf_counter()
    aniso = _anisotropy(cloud)
    anisotropy_ms = (time.perf_counter() - tick) * 1e3

    terms = {"betti": betti_term(b0, b1), "entropy": entropy_term(entropy), "anisotropy": aniso}
    ci = float(min(max(sum(weights[name] * terms[name] for name in COMPONENTS), 0.0), 1.0))
    report = CollapseReport(
        ci=ci,
        betti_term=terms["betti"],
        entropy_term=terms["entropy"],
        anisotropy_term=aniso,
        betti0=b0,
        betti1=b1,
        persistence_entropy=entropy,
        epsilon=epsilon,
        n_samples=cloud.shape[0],
        n_features=cloud.shape[1],
        n_diagram_points=min(max_points, cloud.shape[0]),
        weights=dict(weights),
        timings_ms={
            "betti": betti_ms,
            "persistence": persistence_ms,
            "anisotropy": anisotropy_ms,
            "total": (time.perf_counter() - start) * 1e3,
        },
    )
    return report, [h0, h1]
