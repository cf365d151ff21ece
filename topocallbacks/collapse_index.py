"""The stateful Collapse Index: ε calibrated on the first cloud and kept, so later checks are comparable."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._validation import check_int, check_number, check_positive_float, check_seed, check_state
from .exceptions import InputError
from .functional.collapse import CollapseReport, collapse_index, epsilon_heuristic, resolve_weights

__all__ = ["CollapseIndex"]

_STATE_VERSION = 1


class CollapseIndex:
    """Collapse Index with a scale ε fixed at calibration, for a series of clouds of the same probe.

    The first call (or :meth:`calibrate`) sets ``epsilon_`` from :func:`~topocallbacks.functional.epsilon_heuristic`
    unless ``epsilon`` was given; every later call reuses it, so a change of the index reflects the features, not a
    moving scale. Constructor arguments are stored as given; fitted attributes end in ``_``.

    Args:
        epsilon: a fixed scale (finite, > 0), or None to calibrate on the first cloud.
        epsilon_quantile: quantile of pairwise distances used by the calibration, in ``(0, 1]``.
        epsilon_factor: multiplier of that quantile (finite, > 0).
        weights: ``"paper"``/None or a mapping of component weights.
        max_points: subsample size for the persistence diagrams (>= 2).
        seed: seed of the subsamples (>= 0).

    Raises:
        InputError: an argument is out of range.

    Example:
        >>> import numpy as np
        >>> index = CollapseIndex()
        >>> rng = np.random.default_rng(0)
        >>> first = index(rng.normal(size=(100, 8)))
        >>> index.epsilon_ == first.epsilon
        True
        >>> index(np.zeros((100, 8))).ci  # a collapsed cloud, same ε
        1.0
    """

    def __init__(
        self,
        *,
        epsilon: float | None = None,
        epsilon_quantile: float = 0.5,
        epsilon_factor: float = 0.5,
        weights: str | Mapping[str, float] | None = None,
        max_points: int = 256,
        seed: int = 0,
    ) -> None:
        if epsilon is not None:
            check_positive_float(epsilon, "epsilon")
        check_number(epsilon_quantile, "epsilon_quantile", low=0.0, high=1.0, high_open=False)
        check_positive_float(epsilon_factor, "epsilon_factor")
        self.weights_ = resolve_weights(weights)
        check_int(max_points, "max_points", minimum=2)
        check_seed(seed)
        self.epsilon = epsilon
        self.epsilon_quantile = epsilon_quantile
        self.epsilon_factor = epsilon_factor
        self.weights = weights
        self.max_points = max_points
        self.seed = seed
        self.epsilon_: float | None = None if epsilon is None else float(epsilon)

    @property
    def is_calibrated(self) -> bool:
        """Whether ``epsilon_`` is set."""
        return self.epsilon_ is not None

    def calibrate(self, features: Any) -> CollapseIndex:
        """Set ``epsilon_`` from ``features`` (no-op if ``epsilon`` was given); returns ``self``."""
        if self.epsilon is None:
            self.epsilon_ = epsilon_heuristic(
                features, quantile=self.epsilon_quantile, factor=self.epsilon_factor, seed=self.seed
            )
        return self

    def __call__(self, features: Any) -> CollapseReport:
        """Evaluate the index on ``features``, calibrating ε first if needed."""
        if self.epsilon_ is None:
            self.calibrate(features)
        return collapse_index(
            features, epsilon=self.epsilon_, weights=self.weights_, max_points=self.max_points, seed=self.seed
        )

    def reset(self) -> None:
        """Forget the calibration (a given ``epsilon`` is kept)."""
        self.epsilon_ = None if self.epsilon is None else float(self.epsilon)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the calibrated ε and the settings it depends on."""
        return {
            "version": _STATE_VERSION,
            "epsilon_": self.epsilon_,
            "weights_": dict(self.weights_),
            "epsilon_quantile": self.epsilon_quantile,
            "epsilon_factor": self.epsilon_factor,
            "max_points": self.max_points,
            "seed": self.seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the weights and ε in the state win over the constructor's.

        Raises:
            InputError: the state is missing keys, has an unknown version, or holds an invalid ε.
        """
        check_state(state, {"version", "epsilon_", "weights_"}, _STATE_VERSION)
        epsilon = state["epsilon_"]
        if epsilon is not None and not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
            raise InputError(f"`state['epsilon_']` must be None or a finite number > 0, got {epsilon!r}")
        self.weights_ = resolve_weights(state["weights_"])
        self.epsilon_ = None if epsilon is None else float(epsilon)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CollapseIndex):
            return NotImplemented
        return self.state_dict() == other.state_dict() and self.epsilon == other.epsilon

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"CollapseIndex(epsilon={self.epsilon!r}, epsilon_quantile={self.epsilon_quantile!r}, "
            f"epsilon_factor={self.epsilon_factor!r}, weights={self.weights!r}, max_points={self.max_points!r}, "
            f"seed={self.seed!r})"
        )
