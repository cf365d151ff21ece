"""The fixed map from a layer's features to the cloud whose topology is measured."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from .exceptions import InputError
from .settings import TransformSettings

__all__ = ["FeatureTransform"]


def _to_list(value: NDArray[np.float64] | None) -> Any:
    return None if value is None else value.tolist()


def _to_array(value: Any) -> NDArray[np.float64] | None:
    return None if value is None else np.asarray(value, dtype=np.float64)


class FeatureTransform(Stateful):
    """An optional projection fitted once, then an optional normalisation, applied to every check's features.

    Projection (``settings.projection``): ``"pca"`` onto the first ``projection_dim`` principal directions of the
    first cloud, ``"random"`` a seeded Gaussian map ``N(0, 1/projection_dim)``, or none. Both are fitted at the first
    call and kept, so that point ``i`` means the same thing at every check.

    Normalisation (``settings.normalize``): in probe mode each cloud is centred and scaled to unit RMS radius, so a
    fixed ε keeps its meaning while the network's feature scale drifts; in streaming mode the centre and radius are
    fitted once, on the first batch, so that the points already in the window keep their coordinates.

    Args:
        settings: a :class:`~topocallbacks.settings.TransformSettings`.
        streaming: whether the clouds are batches entering a streaming window.
        seed: seed of the random projection.

    Example:
        >>> import numpy as np
        >>> transform = FeatureTransform(TransformSettings(projection="random", projection_dim=2))
        >>> cloud = transform(np.random.default_rng(0).normal(size=(50, 8)))
        >>> cloud.shape, round(float(np.sqrt(np.mean(np.sum(cloud**2, axis=1)))), 6)
        ((50, 2), 1.0)
    """

    _state = StateFields(
        version=1,
        fields={
            "input_dim": "input_dim_",
            "mean": "mean_",
            "components": "components_",
            "matrix": "matrix_",
            "centre": "centre_",
            "radius": "radius_",
        },
        encode={"mean": _to_list, "components": _to_list, "matrix": _to_list, "centre": _to_list},
        decode={"mean": _to_array, "components": _to_array, "matrix": _to_array, "centre": _to_array},
    )

    def __init__(self, settings: TransformSettings | None = None, *, streaming: bool = False, seed: int = 0) -> None:
        self.settings = TransformSettings() if settings is None else settings
        self.streaming = bool(streaming)
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """Forget the fit."""
        self.input_dim_: int | None = None
        self.mean_: NDArray[np.float64] | None = None
        self.components_: NDArray[np.float64] | None = None
        self.matrix_: NDArray[np.float64] | None = None
        self.centre_: NDArray[np.float64] | None = None
        self.radius_: float | None = None

    @property
    def fitted(self) -> bool:
        """Whether the first cloud was seen."""
        return self.input_dim_ is not None

    def fit(self, cloud: NDArray[np.float64]) -> FeatureTransform:
        """Fit the projection (and, streaming, the centre and radius) on a validated cloud; returns ``self``."""
        s = self.settings
        self.input_dim_ = int(cloud.shape[1])
        if s.projection == "pca":
            self.mean_ = cloud.mean(axis=0)
            _, _, vt = np.linalg.svd(cloud - self.mean_, full_matrices=False)
            self.components_ = vt[: s.projection_dim]
        elif s.projection == "random":
            rng = np.random.default_rng(self.seed)
            self.matrix_ = rng.normal(size=(cloud.shape[1], s.projection_dim)) / math.sqrt(s.projection_dim)
        if self.streaming and s.normalize:
            projected = self._project(cloud)
            self.centre_ = projected.mean(axis=0)
            radius = float(np.sqrt(np.mean(np.sum((projected - self.centre_) ** 2, axis=1))))
            self.radius_ = radius if radius > 0 else 1.0
        return self

    def __call__(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        """The transformed cloud (fitting first if this is the first one).

        Raises:
            InputError: the feature dimension changed since the fit.
        """
        if not self.fitted:
            self.fit(cloud)
        projected = self._project(cloud)
        if not self.settings.normalize:
            return projected
        if self.streaming and self.centre_ is not None and self.radius_ is not None:  # fitted on the first batch
            result: NDArray[np.float64] = (projected - self.centre_) / self.radius_
            return result
        return _normalise(projected)

    def _project(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        if cloud.shape[1] != self.input_dim_:
            raise InputError(f"`features` must keep dimension {self.input_dim_} between checks, got {cloud.shape[1]}")
        if self.components_ is not None and self.mean_ is not None:
            result: NDArray[np.float64] = (cloud - self.mean_) @ self.components_.T
            return result
        if self.matrix_ is not None:
            projected: NDArray[np.float64] = cloud @ self.matrix_
            return projected
        return cloud


def _normalise(cloud: NDArray[np.float64]) -> NDArray[np.float64]:
    """Centred and scaled to unit RMS radius (unchanged but centred when every point is the same)."""
    centred: NDArray[np.float64] = cloud - cloud.mean(axis=0)
    radius = float(np.sqrt(np.mean(np.sum(centred**2, axis=1))))
    return centred / radius if radius > 0 else centred
