"""The stateful Collapse Index: ε calibrated on the first cloud and kept, so later checks are comparable."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._validation import as_points, check_seed, check_state
from .exceptions import InputError
from .functional.collapse import CollapseReport, _collapse_index, calibrate_epsilon
from .settings import IndexSettings, resolve_weights

__all__ = ["CollapseIndex"]

_STATE_VERSION = 2


class CollapseIndex:
    """Collapse Index with a scale ε fixed at calibration, for a series of clouds of the same probe.

    The first call (or `calibrate`) sets ``epsilon_`` (the settings' ``epsilon``, else the quantile heuristic,
    [`calibrate_epsilon`][topocallbacks.functional.calibrate_epsilon]); every later call reuses it, so a change of the
    index reflects the features, not a moving scale. Fitted attributes end in ``_``.

    Args:
        settings: an `IndexSettings` (``epsilon``, ``epsilon_quantile``,
            ``epsilon_factor``, ``weights``, ``max_points``); default: the defaults.
        seed: seed of the subsamples (>= 0).
        **overrides: any field of the settings, e.g. ``CollapseIndex(epsilon=0.5)``.

    Raises:
        InputError: a value is out of range.

    Examples:
        >>> import numpy as np
        >>> index = CollapseIndex()
        >>> rng = np.random.default_rng(0)
        >>> first = index(rng.normal(size=(100, 8)))
        >>> index.epsilon_ == first.epsilon
        True
        >>> index(np.zeros((100, 8))).ci  # a collapsed cloud, same ε
        1.0
    """

    def __init__(self, settings: IndexSettings | None = None, /, *, seed: int = 0, **overrides: Any) -> None:
        base = IndexSettings() if settings is None else settings
        self.settings: IndexSettings = base.replace(**overrides) if overrides else base
        self.seed = check_seed(seed)
        self.weights_ = resolve_weights(self.settings.weights)
        self.epsilon_: float | None = self.settings.epsilon

    @property
    def is_calibrated(self) -> bool:
        """Whether ``epsilon_`` is set."""
        return self.epsilon_ is not None

    def calibrate(self, features: Any) -> CollapseIndex:
        """Set ``epsilon_`` from ``features``; returns ``self``."""
        self.epsilon_ = calibrate_epsilon(as_points(features, "features"), self.settings, self.seed)
        return self

    def __call__(self, features: Any) -> CollapseReport:
        """Evaluate the index on ``features``, calibrating ε first if needed."""
        cloud = as_points(features, "features")
        if self.epsilon_ is None:
            self.epsilon_ = calibrate_epsilon(cloud, self.settings, self.seed)
        report, _ = _collapse_index(
            cloud, self.epsilon_, self.weights_, max_points=self.settings.max_points, seed=self.seed, betti=None
        )
        return report

    def reset(self) -> None:
        """Forget the calibration (a given ``epsilon`` is kept)."""
        self.epsilon_ = self.settings.epsilon

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the calibrated ε and the weights it goes with."""
        return {"version": _STATE_VERSION, "epsilon_": self.epsilon_, "weights_": dict(self.weights_)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict`; the weights and ε in the state win over the constructor's.

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
        return self.settings == other.settings and self.seed == other.seed and self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"CollapseIndex({self.settings!r}, seed={self.seed!r})"
