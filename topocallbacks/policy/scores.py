"""The policy's pure scores: the robust z-score, its reference, and the threshold rule over a whole series.

The collapse-evidence suite (``benchmarks/collapse/``) evaluates the warning rule with these same functions
(`rule_scores`, `rule_holds`), and `Policy` scores each check with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from .._validation import check_int
from ..exceptions import InputError
from ..settings import PolicySettings

__all__ = [
    "Reference",
    "at_threshold",
    "robust_zscore",
    "rule_holds",
    "rule_scores",
    "score_value",
    "trailing_zscore",
]


def trailing_zscore(
    past: Sequence[float | None], value: float, *, direction: int = 1, window: int = 10
) -> float | None:
    r"""How unusual ``value`` is against the recent past, in robust standard deviations.

    .. math:: z = \mathrm{dir} \cdot \frac{v - \mathrm{median}(\text{last } w \text{ values})}
              {1.4826\,\mathrm{median}(|\text{last } 2w \text{ differences}|) / \sqrt 2}

    The level is the median of the last ``window`` values, so slow healthy drift is followed; the noise is the
    robust spread of the check-to-check differences over the last ``2 * window`` values, divided by sqrt(2) (a
    difference of two noisy values has twice the variance); when most differences are exactly 0 (a quantised
    value such as a Betti ratio), 1.2533 x their mean absolute value stands in. ``direction`` +1 scores rises,
    -1 drops, 0 either (``|z|``). This is the default policy's score (``score="zscore"``).

    Args:
        past: earlier values, oldest first (None or non-finite ones are gaps: skipped, and so are the differences
            across them).
        value: the new value.
        direction: +1, -1 or 0.
        window: values in the level estimate (>= 2).

    Returns:
        The score, or None when fewer than 3 past values (or differences) are available or ``value`` is not finite.

    Examples:
        >>> round(trailing_zscore([1.0, 1.1, 0.9, 1.0, 1.1, 0.9], 2.0), 2)  # median 1.0, |differences| 0.1-0.2
        9.54
        >>> trailing_zscore([1.0, 1.1, 0.9, 1.0, 1.1, 0.9], 2.0, direction=-1) < 0
        True
    """
    if direction not in (-1, 0, 1):
        raise InputError(f"`direction` must be -1, 0 or 1, got {direction!r}")
    check_int(window, "window", minimum=2)
    return robust_zscore(np.asarray(past, dtype=np.float64), value, direction, window)


def robust_zscore(
    values: NDArray[np.float64], value: float, direction: int, window: int, floor: float = 0.0
) -> float | None:
    """`trailing_zscore` without the checks, with the noise estimate at least ``floor``."""
    if not math.isfinite(value):
        return None
    recent = values[-window:]
    recent = recent[np.isfinite(recent)]
    diffs = np.diff(values[-2 * window :])
    diffs = diffs[np.isfinite(diffs)]
    if recent.size < 3 or diffs.size < 3:
        return None
    level = float(np.median(recent))
    spread = np.abs(diffs)
    noise = 1.4826 * float(np.median(spread)) or 1.2533 * float(np.mean(spread))
    noise = max(noise / math.sqrt(2), 1e-9 * max(abs(level), 1e-12), floor)  # constant history: any change is far
    deviation = (value - level) / noise
    return abs(deviation) if direction == 0 else direction * deviation


class Reference:
    """The values a new z-score is measured against: the recent checks that stayed below the threshold.

    A check whose score reached the threshold is held out, so a first jump does not raise the level and the noise
    the next check is compared with (which would make the rule blind for ``window`` checks after every alarm). A
    level that persists is not an outlier for ever: once ``rebase_after`` consecutive checks were held out, they
    enter the reference together (the index has moved to a new level; the alarm was given while it moved).

    Args:
        size: values kept (the z-score's ``2 * zscore_window``).
        rebase_after: consecutive held-out checks after which they are admitted.

    Examples:
        >>> reference = Reference(size=4, rebase_after=2)
        >>> for value, flagged in [(1.0, False), (9.0, True), (1.1, False), (8.0, True), (8.2, True)]:
        ...     reference.add(value, flagged)
        >>> reference.values  # the lone 9.0 never entered; 8.0 and 8.2 did once two in a row were held out
        [1.0, 1.1, 8.0, 8.2]
    """

    def __init__(self, size: int, rebase_after: int) -> None:
        self.size = size
        self.rebase_after = rebase_after
        self.values: list[float] = []
        self.held: list[float] = []
        #: The largest value ever admitted: a training channel's scale, whose 1 % floors its noise estimate.
        self.scale = 0.0

    def add(self, value: float, flagged: bool) -> None:
        """Admit ``value`` (or hold it out when its check reached the threshold)."""
        if flagged:
            self.held.append(value)
            if len(self.held) < self.rebase_after:
                return
            admitted, self.held = self.held, []
        else:
            admitted, self.held = [value], []
        self.values = [*self.values, *admitted][-self.size :]
        self.scale = max(self.scale, *(abs(v) for v in admitted))


def score_value(
    settings: PolicySettings,
    past: Sequence[float | None] | NDArray[np.float64],
    value: float,
    baseline: float | None = None,
    direction: int = 1,
) -> float | None:
    """The score of ``value`` under ``settings.score`` given the ``past`` reference values (oldest first).

    ``"value"``: the value; ``"baseline"``: its excess over ``baseline`` (None before there is one);
    ``"zscore"``: `trailing_zscore` against the last ``zscore_window`` values, in ``direction`` (+1 rises,
    -1 drops, 0 either). None: no score yet.
    """
    if settings.score == "zscore":
        return robust_zscore(np.asarray(past, dtype=np.float64), value, direction, settings.zscore_window)
    if settings.score == "baseline":
        return None if baseline is None else value - baseline
    return value


def at_threshold(score: float | None, threshold: float) -> bool:
    """Whether a check with ``score`` counts as flagged (no score: never)."""
    return score is not None and score >= threshold


def rule_scores(values: Sequence[float], settings: PolicySettings, *, direction: int = 1) -> NDArray[np.float64]:
    """The score of every check of a series, as `Policy` computes it (NaN during the warm-up and where none).

    Non-finite values (diverged checks, or an index with no value yet) get no score and stay out of the
    reference; so do the checks whose score reached ``settings.threshold`` (see `Reference`).

    Examples:
        >>> rule_scores([1.0, 1.0, 5.0], PolicySettings(score="value", warmup=1)).tolist()
        [nan, 1.0, 5.0]
    """
    series = np.asarray(values, dtype=np.float64)
    if settings.score != "zscore":
        if direction not in (-1, 1):
            raise InputError(f"`direction` must be -1 or 1 for score={settings.score!r}, got {direction!r}")
        series = direction * series  # oriented: higher means more collapsed
    scores = np.full(series.size, math.nan)
    reference = Reference(2 * settings.zscore_window, settings.zscore_window)
    warm = [float(v) for v in series[: settings.warmup] if math.isfinite(v)]
    baseline = float(np.mean(warm)) if warm else None
    for i, value in enumerate(series.tolist()):
        if not math.isfinite(value):
            continue
        score = None
        if i >= settings.warmup:
            score = score_value(settings, reference.values, value, baseline, direction)
            scores[i] = math.nan if score is None else score
        reference.add(value, at_threshold(score, settings.threshold))
    return scores


def rule_holds(
    scores: Sequence[float], threshold: float, patience: int, warmup: int, diverged: Sequence[bool] | None = None
) -> NDArray[np.bool_]:
    """Where the threshold rule holds over a series of scores (as `Policy` applies it).

    The rule holds at a check after the warm-up whose score and the ``patience - 1`` scores before it are
    ``>= threshold``; a diverged check always holds (its action comes at once).

    Examples:
        >>> rule_holds([0.0, 2.0, 2.0, 0.0, 2.0], threshold=1.0, patience=2, warmup=0).tolist()
        [False, False, True, False, False]
    """
    above = np.asarray(scores, dtype=np.float64) >= threshold
    holds = above.copy()
    for lag in range(1, patience):
        holds[lag:] &= above[:-lag]
        holds[:lag] = False
    holds[:warmup] = False
    if diverged is not None:
        holds |= np.asarray(diverged, dtype=bool)
    result: NDArray[np.bool_] = holds
    return result
