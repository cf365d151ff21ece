"""How fast a feature cloud's covariance spectrum decays: the exponent of a power-law fit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._validation import as_points, check_number
from .geometry import _singular_values

__all__ = ["eigenspectrum_decay"]


#: Singular values below ``max(n, d)`` times this relative to the largest count as null (float32's machine epsilon:
#: features come from float32 networks, whose rounding leaves a floor of tiny, meaningless directions).
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def eigenspectrum_decay(features: Any, *, rtol: float | None = None) -> float:
    r"""Decay exponent α of the covariance eigenspectrum, from a least-squares fit of log eigenvalue on log rank.

    With $\lambda_1 \ge \lambda_2 \ge \dots \ge \lambda_r > 0$ the eigenvalues of the sample covariance that
    are not null (the squared singular values $\sigma_k$ of the centred cloud with
    $\sigma_k > \mathrm{rtol} \cdot \sigma_1$), α is the slope of the ordinary least-squares line

    .. math:: \log \lambda_k \approx c - \alpha \log k, \qquad k = 1, \dots, r,

    i.e. $\alpha = -\mathrm{cov}(\log k, \log \lambda_k) / \mathrm{var}(\log k)$, fitted over the whole
    non-null spectrum with equal weights. A power law $\lambda_k \propto k^{-\alpha}$ gives α exactly.
    Larger α: the variance sits in fewer directions (α near 1 is the value Stringer et al., Nature 2019, found in
    visual cortex; Agrawal et al., NeurIPS 2022, "α-ReQ", relate it to the quality of self-supervised features).

    The default ``rtol`` is numpy's ``matrix_rank`` rule at float32 precision, ``max(n, d) * 1.19e-7``: features
    computed in float32 have rounding noise at about that level in directions they do not use (dead units, a
    rank below the width), and a fit that included those would measure the noise floor, not the spectrum.

    Range: any real, usually ``[0, 5]``; invariant to scaling, translating and rotating the cloud. Full collapse
    (no variance), or a cloud on a line (one non-null eigenvalue): ``inf``, the spectrum drops to nothing at once.
    Isotropic Gaussian: near 0, only the sampling spread of the eigenvalues (about 0.15 for ``n = 1000, d = 10``,
    0.28 for ``n = 512, d = 32``).

    Args:
        features: ``(n_samples, dim)`` array-like or torch tensor, ``n_samples >= 2``.
        rtol: singular values at or below ``rtol`` times the largest are left out, in ``[0, 1)``; None for
            ``max(n, d) * float32 eps``.

    Returns:
        α, a float (``inf`` with fewer than two non-null eigenvalues).

    Raises:
        InputError: bad shape or dtype, or ``rtol`` outside ``[0, 1)``.
        NonFiniteError: NaN or Inf entries.

    Examples:
        >>> import numpy as np
        >>> basis = np.linalg.qr(np.random.default_rng(0).normal(size=(40, 6)))[0]  # orthonormal columns
        >>> basis -= basis.mean(axis=0)  # centred: the singular values below are the covariance's (up to n - 1)
        >>> basis = np.linalg.qr(basis)[0]
        >>> cloud = basis * np.arange(1, 7) ** -1.0  # singular values k^-1: eigenvalues k^-2
        >>> round(eigenspectrum_decay(cloud), 6)
        2.0
        >>> eigenspectrum_decay(np.ones((5, 3)))  # full collapse
        inf
    """
    cloud = as_points(features, "features")
    tolerance = _null_tolerance(rtol, cloud.shape)
    values = _singular_values(cloud, center=True)
    if values.size:
        values = values[values > tolerance * values[0]]
    return math.inf if values.size < 2 else _power_law_exponent(values)


def _null_tolerance(rtol: float | None, shape: tuple[int, ...]) -> float:
    """The share of the largest singular value at or below which one counts as null (``rtol``, or the default).

    The default, for ``rtol=None``, is ``max(n, d) * float32 eps`` for a cloud of ``shape`` ``(n, d)``.

    Raises:
        InputError: ``rtol`` outside ``[0, 1)``.
    """
    if rtol is None:
        return max(shape) * FLOAT32_EPS
    return check_number(rtol, "rtol", low=0.0, high=1.0, low_open=False)


def _power_law_exponent(values: NDArray[np.float64]) -> float:
    """α of the least-squares line ``log λ_k ≈ c - α log k`` through the eigenvalues ``λ_k = values[k-1] ** 2``.

    ``values``: at least two singular values > 0, in decreasing order.
    """
    log_rank = np.log(np.arange(1, values.size + 1, dtype=np.float64))
    log_eigen = 2.0 * np.log(values)
    centred_rank = log_rank - log_rank.mean()
    slope = float(np.dot(centred_rank, log_eigen - log_eigen.mean()) / np.dot(centred_rank, centred_rank))
    return -slope
