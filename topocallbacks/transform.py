"""The fixed map from a layer's features to the cloud whose topology is measured."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from .exceptions import InputError
from .functional._distances import power_of_two_scale
from .settings import TransformSettings

__all__ = ["FeatureTransform"]


#: Streaming: the factor by which the features' running radius may drift from the window frame's before a reframe.
REFRAME_FACTOR = math.sqrt(2.0)
#: Streaming: how far (in frame radii) the running centre may drift before a reframe.
REFRAME_SHIFT = 0.5


def _to_list(value: NDArray[np.float64] | None) -> Any:
    return None if value is None else value.tolist()


def _to_array(value: Any) -> NDArray[np.float64] | None:
    return None if value is None else np.asarray(value, dtype=np.float64)


class FeatureTransform(Stateful):
    """An optional projection fitted once, then an optional normalisation, applied to every check's features.

    Projection (``settings.projection``): ``"pca"`` onto the first ``projection_dim`` principal directions of the
    first cloud, ``"random"`` a seeded Gaussian map ``N(0, 1/projection_dim)``, or none. Both are fitted at the first
    call and kept, so that point ``i`` means the same thing at every check.

    Every cloud is first multiplied by a power of two that brings its largest coordinate into ``[0.5, 1)`` (exact in
    binary floating point; in streaming mode the first batch's factor is kept, so the window shares one frame), so
    that huge or tiny but finite features (up to the dtype's largest, down to subnormals) are neither overflowed nor
    flushed to zero: a cloud and the same cloud times 1e300 give the same result.

    Normalisation (``settings.normalize``): in probe mode each cloud is centred and scaled to unit RMS radius, so a
    fixed ε keeps its meaning while the network's feature scale drifts. In streaming mode the window's points must
    share one frame: the centre and radius are fitted on the first batch and kept while a running estimate of them
    (an average over about a window's worth of batches, `track`) stays close; once the features' radius has
    moved by more than `REFRAME_FACTOR` either way, or their centre by more than `REFRAME_SHIFT` radii,
    `reframe` adopts the running estimate and gives the map that re-expresses the points already in the
    window, so that a fixed ε keeps its meaning there too.

    Args:
        settings: a `TransformSettings`.
        streaming: whether the clouds are batches entering a streaming window.
        seed: seed of the random projection.

    Examples:
        >>> import numpy as np
        >>> transform = FeatureTransform(TransformSettings(projection="random", projection_dim=2))
        >>> cloud = transform(np.random.default_rng(0).normal(size=(50, 8)))
        >>> cloud.shape, round(float(np.sqrt(np.mean(np.sum(cloud**2, axis=1)))), 6)
        ((50, 2), 1.0)
    """

    _state = StateFields(
        version=2,
        fields={
            "input_dim": "input_dim_",
            "prescale": "prescale_",
            "mean": "mean_",
            "components": "components_",
            "matrix": "matrix_",
            "centre": "centre_",
            "radius": "radius_",
            "running_mean": "running_mean_",
            "running_square": "running_square_",
            "reframes": "reframes_",
        },
        encode={
            "mean": _to_list,
            "components": _to_list,
            "matrix": _to_list,
            "centre": _to_list,
            "running_mean": _to_list,
        },
        decode={
            "mean": _to_array,
            "components": _to_array,
            "matrix": _to_array,
            "centre": _to_array,
            "running_mean": _to_array,
        },
    )

    def __init__(
        self, settings: TransformSettings | None = None, *, streaming: bool = False, seed: int = 0, window: int = 1024
    ) -> None:
        self.settings = TransformSettings() if settings is None else settings
        self.streaming = bool(streaming)
        self.seed = seed
        self.window = window
        self.reset()

    def reset(self) -> None:
        """Forget the fit."""
        self.input_dim_: int | None = None
        self.prescale_: float | None = None  # streaming: the power of two every batch is multiplied by first
        self.mean_: NDArray[np.float64] | None = None
        self.components_: NDArray[np.float64] | None = None
        self.matrix_: NDArray[np.float64] | None = None
        self.centre_: NDArray[np.float64] | None = None
        self.radius_: float | None = None
        self.running_mean_: NDArray[np.float64] | None = None  # streaming: the running centre (projected units)
        self.running_square_: float | None = None  # streaming: the running mean squared norm
        self.reframes_ = 0

    @property
    def fitted(self) -> bool:
        """Whether the first cloud was seen."""
        return self.input_dim_ is not None

    def fit(self, cloud: NDArray[np.float64]) -> FeatureTransform:
        """Fit the projection (and, streaming, the centre and radius) on a validated cloud; returns ``self``."""
        s = self.settings
        self.input_dim_ = int(cloud.shape[1])
        if self.streaming:
            self.prescale_ = power_of_two_scale(cloud)
        cloud = cloud * self._prescale(cloud)
        if s.projection == "pca":
            self.mean_ = cloud.mean(axis=0)
            _, _, vt = np.linalg.svd(cloud - self.mean_, full_matrices=False)
            self.components_ = vt[: s.projection_dim]
        elif s.projection == "random":
            rng = np.random.default_rng(self.seed)
            self.matrix_ = rng.normal(size=(cloud.shape[1], s.projection_dim)) / math.sqrt(s.projection_dim)
        if self.streaming and s.normalize:
            projected = self._linear(cloud)
            self.running_mean_ = projected.mean(axis=0)
            self.running_square_ = float(np.mean(np.sum(projected**2, axis=1)))
            self.centre_, self.radius_ = self._running_frame()
        return self

    def _running_frame(self) -> tuple[NDArray[np.float64], float]:
        if self.running_mean_ is None or self.running_square_ is None:  # pragma: no cover - set by fit
            raise RuntimeError("the streaming transform has no running statistics before its first batch")
        variance = max(self.running_square_ - float(np.sum(self.running_mean_**2)), 0.0)
        radius = math.sqrt(variance)
        return self.running_mean_.copy(), radius if radius > 0 else 1.0

    def track(self, cloud: NDArray[np.float64]) -> bool:
        """Streaming: update the running centre and radius with a batch; whether the window needs a reframe.

        The running statistics are averages with weight ``batch / window`` per batch, so they follow the features
        over about a window's worth of points. A reframe is due when the running radius is more than
        `REFRAME_FACTOR` times larger or smaller than the frame's, or the running centre more than
        `REFRAME_SHIFT` frame radii away from the frame's centre.
        """
        if not self.fitted:
            self.fit(cloud)
            return False
        if self.running_mean_ is None or self.running_square_ is None or self.centre_ is None or self.radius_ is None:
            return False  # not normalising: nothing to track
        projected = self.project(cloud)
        weight = min(1.0, projected.shape[0] / self.window)
        self.running_mean_ = (1 - weight) * self.running_mean_ + weight * projected.mean(axis=0)
        square = float(np.mean(np.sum(projected**2, axis=1)))
        self.running_square_ = (1 - weight) * self.running_square_ + weight * square
        centre, radius = self._running_frame()
        ratio = radius / self.radius_
        shift = float(np.linalg.norm(centre - self.centre_)) / self.radius_
        return not (1 / REFRAME_FACTOR <= ratio <= REFRAME_FACTOR) or shift > REFRAME_SHIFT

    def reframe(self) -> tuple[float, NDArray[np.float64]]:
        """Streaming: adopt the running centre and radius as the frame.

        Returns:
            ``(a, b)``: a point ``x`` of the old frame is ``a * x + b`` in the new one.
        """
        if self.centre_ is None or self.radius_ is None:  # pragma: no cover - only after a fit that normalises
            raise RuntimeError("the streaming transform has no frame to change")
        centre, radius = self._running_frame()
        scale = self.radius_ / radius
        offset = (self.centre_ - centre) / radius
        self.centre_, self.radius_ = centre, radius
        self.reframes_ += 1
        return scale, offset

    def __call__(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        """The transformed cloud (fitting first if this is the first one): `normalise` of `project`.

        Raises:
            InputError: the feature dimension changed since the fit.
        """
        return self.normalise(self.project(cloud))

    def project(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        """The cloud times its power-of-two scale, through the projection (fitting first): not yet normalised.

        Raises:
            InputError: the feature dimension changed since the fit.
        """
        if not self.fitted:
            self.fit(cloud)
        if cloud.shape[1] != self.input_dim_:
            raise InputError(f"`features` must keep dimension {self.input_dim_} between checks, got {cloud.shape[1]}")
        return self._linear(cloud * self._prescale(cloud))

    def normalise(self, projected: NDArray[np.float64]) -> NDArray[np.float64]:
        """A `project`-ed cloud centred and scaled (per cloud, or in the streaming frame), if normalising."""
        if not self.settings.normalize:
            return projected
        if self.streaming and self.centre_ is not None and self.radius_ is not None:  # fitted on the first batch
            result: NDArray[np.float64] = (projected - self.centre_) / self.radius_
            return result
        return _normalise(projected)

    def _prescale(self, cloud: NDArray[np.float64]) -> float:
        """The power of two a cloud is multiplied by first: its own (probe), or the first batch's (streaming)."""
        if self.streaming:
            return 1.0 if self.prescale_ is None else self.prescale_
        return power_of_two_scale(cloud) if self.settings.normalize else 1.0

    def _linear(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        """The fitted projection of an already prescaled cloud."""
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
