"""Geometry of a feature cloud from its spectrum: anisotropy, effective rank (RankMe), participation ratio.

All three are scale-invariant and finite for ``n < d``, for rank-deficient clouds, for constant input and for
huge values (the cloud is rescaled by a power of two before its spectrum is taken).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._validation import as_points
from ._distances import power_of_two_scale

__all__ = ["anisotropy", "effective_rank", "participation_ratio"]


def _centred(cloud: NDArray[np.float64]) -> NDArray[np.float64]:
    """``cloud`` rescaled by a power of two and centred by column (a new array)."""
    scaled = cloud * power_of_two_scale(cloud)
    # Subtracting a row first is exact for identical rows (a collapsed cloud centres to exact zeros, not to rounding
    # residue) and keeps digits for clouds far from the origin; the mean then finishes the centring.
    centred: NDArray[np.float64] = scaled - scaled[0]
    centred -= centred.mean(axis=0)
    return centred


def _singular_values(cloud: NDArray[np.float64], *, center: bool) -> NDArray[np.float64]:
    """Non-null singular values of ``cloud`` (centred by column if asked), in descending order.

    A singular value counts as null below ``s_max * max(n, d) * machine epsilon``, numpy's ``matrix_rank`` rule.
    """
    scaled = _centred(cloud) if center else cloud * power_of_two_scale(cloud)
    if not np.any(scaled):
        return np.zeros(0)
    values = np.linalg.svd(scaled, compute_uv=False)
    cutoff = values[0] * max(scaled.shape) * np.finfo(np.float64).eps
    result: NDArray[np.float64] = values[values > cutoff]
    return result


def _covariance_eigenvalues(cloud: NDArray[np.float64]) -> NDArray[np.float64]:
    """Non-null eigenvalues of the centred cloud's scatter matrix: the squares of `_singular_values` (centred).

    Taken from the smaller Gram matrix (``d x d``, or ``n x n`` when ``n < d``) by the symmetric eigensolver, a
    fraction of the cost of an SVD of the cloud. The centred cloud is rescaled by a power of two first (exact), so
    that its squares neither overflow nor underflow. An eigenvalue counts as null below ``λ_max * max(n, d) *
    machine epsilon``, the Gram matrix's rounding floor: the squared singular values the SVD's rule keeps and this
    one drops are below about 1e-13 x the largest, and move the anisotropy by about 1e-14 at most.
    """
    centred = _centred(cloud)
    if not np.any(centred):
        return np.zeros(0)
    centred *= power_of_two_scale(centred)
    n, dim = centred.shape
    gram = centred.T @ centred if n >= dim else centred @ centred.T
    values = np.linalg.eigvalsh(gram)[::-1]
    result: NDArray[np.float64] = values[values > values[0] * max(n, dim) * np.finfo(np.float64).eps]
    return result


def _entropy_exp(weights: NDArray[np.float64]) -> float:
    """``exp`` of the Shannon entropy of ``weights / weights.sum()`` (all weights > 0)."""
    p = weights / weights.sum()
    return float(np.exp(-np.sum(p * np.log(p))))


def anisotropy(features: Any) -> float:
    r"""Anisotropy of the covariance spectrum, in ``[0, 1]``.

    With $\lambda_k$ the non-null eigenvalues of the sample covariance, $p_k = \lambda_k / \sum \lambda$,
    the effective rank $e = \exp(-\sum_k p_k \log p_k)$ and $r = \min(n - 1, d)$ the largest rank a
    sample of ``n`` points in ``d`` dimensions can have,

    .. math:: A = \frac{r - e}{r - 1} \quad (r > 1), \qquad A = 0 \quad (r = 1).

    A is 0 when variance is spread evenly over all ``r`` directions and 1 when it lies on a single line.
    Full collapse (all points equal, no variance at all): 1.0 by convention (a collapsed cloud is maximally
    degenerate). Isotropic Gaussian with ``n >> d``: close to 0 (about 0.007 for ``n = 1000, d = 10``).

    Args:
        features: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.

    Returns:
        A float in ``[0, 1]``.

    Raises:
        InputError: bad shape or dtype.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> anisotropy(np.ones((5, 3)))  # full collapse
        1.0
        >>> anisotropy(np.outer(np.arange(6.0), [1.0, 2.0, 3.0]))  # points on a line
        1.0
        >>> round(anisotropy(np.vstack([np.eye(3), -np.eye(3)])), 12)  # variance spread evenly
        0.0
    """
    return _anisotropy(as_points(features, "features"))


def _anisotropy(cloud: NDArray[np.float64]) -> float:
    """`anisotropy` of a validated cloud."""
    n, dim = cloud.shape
    rank_cap = min(n - 1, dim)
    eigenvalues = _covariance_eigenvalues(cloud)
    if eigenvalues.size == 0:
        return 1.0
    if rank_cap == 1:
        return 0.0
    effective = _entropy_exp(eigenvalues)
    return float(min(max((rank_cap - effective) / (rank_cap - 1), 0.0), 1.0))


def effective_rank(features: Any, center: bool = False) -> float:
    r"""RankMe effective rank of a feature matrix (Garrido et al., ICML 2023; Roy & Vetterli, 2007).

    With $\sigma_k$ the non-null singular values of the ``(n, d)`` matrix and
    $p_k = \sigma_k / \sum \sigma$, $\mathrm{RankMe} = \exp(-\sum_k p_k \log p_k)$.
    RankMe uses the raw (uncentred) embeddings; pass ``center=True`` to centre columns first.

    Range: ``[1, min(n, d)]``, or 0.0 when the matrix is all zeros (centred: when all rows are equal).
    Full collapse (all rows equal and non-zero): 1.0 (0.0 with ``center=True``). Isotropic Gaussian with
    ``n >> d``: close to ``d`` (about 9.98 for ``n = 1000, d = 10``).

    Args:
        features: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.
        center: subtract the column means first.

    Returns:
        The effective rank, a float.

    Raises:
        InputError: bad shape or dtype.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> round(effective_rank(np.eye(4)), 12)
        4.0
        >>> effective_rank(np.ones((10, 4)))  # full collapse
        1.0
    """
    return _effective_rank(as_points(features, "features"), center=center)


def _effective_rank(cloud: NDArray[np.float64], center: bool = False) -> float:
    """`effective_rank` of a validated cloud."""
    values = _singular_values(cloud, center=center)
    if values.size == 0:
        return 0.0
    return _entropy_exp(values)


def participation_ratio(features: Any) -> float:
    r"""Participation ratio of the covariance spectrum, $(\sum_k \lambda_k)^2 / \sum_k \lambda_k^2$.

    A linear estimate of the number of dimensions the variance occupies (Gao et al., 2017).

    Range: ``[1, min(n - 1, d)]``, or 0.0 when there is no variance. Full collapse (all points equal): 0.0.
    Isotropic Gaussian with ``n >> d``: close to ``d`` (about 9.88 for ``n = 1000, d = 10``).

    Args:
        features: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.

    Returns:
        The participation ratio, a float.

    Raises:
        InputError: bad shape or dtype.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> round(participation_ratio(np.vstack([np.eye(3), -np.eye(3)])), 12)
        3.0
        >>> participation_ratio(np.full((4, 2), 7.0))  # full collapse
        0.0
    """
    cloud = as_points(features, "features")
    values = _singular_values(cloud, center=True)
    if values.size == 0:
        return 0.0
    eigen = values**2
    return float(eigen.sum() ** 2 / np.sum(eigen**2))
