"""When to act on the Collapse Index: rules over its history that return a :class:`Decision`.

The policy only decides; applying a decision (warning, cutting the learning rate, stopping, saving a rescue
checkpoint) is the training adapter's job, so the same policy drives Lightning, Hugging Face and plain loops.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._validation import check_int, check_number, check_state
from .exceptions import InputError

__all__ = ["TUNED_RULE", "Action", "Decision", "Policy", "trailing_zscore"]

_STATE_VERSION = 2
_SCORES = ("value", "baseline", "zscore")

#: The warning rule the collapse-evidence suite (``benchmarks/collapse/``) tuned for the default index, diagram
#: drift, on its 18 healthy runs (<= 2 % flagged checks): a jump of 4.5 robust standard deviations above the last
#: 10 checks, after a warm-up of 10 checks. The monitor's default policy and the presets' defaults use it.
TUNED_RULE: Mapping[str, Any] = types.MappingProxyType(
    {"score": "zscore", "threshold": 4.5, "patience": 1, "warmup": 10, "zscore_window": 10}
)


class Action(str, enum.Enum):
    """What a decision asks the adapter to do."""

    NONE = "none"
    WARN = "warn"
    LOWER_LR = "lower_lr"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class Decision:
    """A policy's verdict on one check.

    Attributes:
        action: what to do.
        reason: why, in words (goes to the history and the warning).
        step: the training step of the check.
        ci: the index value the rule saw (None for a diverged check).
        rule: the rule that fired (``"threshold"``, ``"trend"``, ``"diverged"``), or None.
        lr_factor: the factor to multiply the learning rate by, for ``lower_lr``.
        checkpoint: save a rescue checkpoint before acting.
    """

    action: Action
    reason: str
    step: int
    ci: float | None = None
    rule: str | None = None
    lr_factor: float | None = None
    checkpoint: bool = False

    @property
    def fired(self) -> bool:
        """Whether the adapter has anything to do."""
        return self.action is not Action.NONE

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        result = dataclasses.asdict(self)
        result["action"] = self.action.value
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """The inverse of :meth:`as_dict`."""
        return cls(**{**data, "action": Action(data["action"])})


def trailing_zscore(past: Sequence[float], value: float, *, direction: int = 1, window: int = 10) -> float | None:
    r"""How unusual ``value`` is against the recent past, in robust standard deviations.

    .. math:: z = \mathrm{dir} \cdot \frac{v - \mathrm{median}(\text{last } w \text{ values})}
              {1.4826\,\mathrm{median}(|\text{last } 2w \text{ differences}|) / \sqrt 2}

    The level is the median of the last ``window`` values, so slow healthy drift is followed; the noise is the
    robust spread of the check-to-check differences over the last ``2 * window`` values, divided by sqrt(2) (a
    difference of two noisy values has twice the variance); when most differences are exactly 0 (a quantised
    value such as a Betti ratio), 1.2533 x their mean absolute value stands in. ``direction`` +1 scores rises,
    -1 drops, 0 either (``|z|``). This is the warning rule of the collapse-evidence suite
    (``benchmarks/collapse/``).

    Args:
        past: earlier values, oldest first (non-finite ones are skipped).
        value: the new value.
        direction: +1, -1 or 0.
        window: values in the level estimate (>= 2).

    Returns:
        The score, or None when fewer than 3 past values (or differences) are available or ``value`` is not finite.

    Example:
        >>> round(trailing_zscore([1.0, 1.1, 0.9, 1.0, 1.1, 0.9], 2.0), 2)  # median 1.0, |differences| 0.1-0.2
        9.54
        >>> trailing_zscore([1.0, 1.1, 0.9, 1.0, 1.1, 0.9], 2.0, direction=-1) < 0
        True
    """
    if direction not in (-1, 0, 1):
        raise InputError(f"`direction` must be -1, 0 or 1, got {direction!r}")
    check_int(window, "window", minimum=2)
    if not math.isfinite(value):
        return None
    values = np.asarray(past, dtype=np.float64)
    recent = values[-window:]
    recent = recent[np.isfinite(recent)]
    diffs = np.diff(values[-2 * window :])
    diffs = diffs[np.isfinite(diffs)]
    if recent.size < 3 or diffs.size < 3:
        return None
    level = float(np.median(recent))
    spread = np.abs(diffs)
    noise = 1.4826 * float(np.median(spread)) or 1.2533 * float(np.mean(spread))
    noise = max(noise / math.sqrt(2), 1e-9 * max(abs(level), 1e-12))  # a constant history: any change is far out
    deviation = (value - level) / noise
    return abs(deviation) if direction == 0 else direction * deviation


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> Action:
    text = value.value if isinstance(value, Action) else value
    if text not in choices:
        raise InputError(f"`{name}` must be one of {sorted(choices)}, got {value!r}")
    return Action(text)


class Policy:
    """Rules over the index history, with warm-up, patience, cooldown and a cap on learning-rate cuts.

    A check *fires* when either rule holds after the warm-up:

    * threshold: the score is ``>= threshold`` for ``patience`` consecutive checks. The score is the index itself
      (``score="value"``), its excess over the warm-up mean (``score="baseline"``, or ``relative_to_baseline``),
      or :func:`trailing_zscore` of the index against its last ``zscore_window`` values (``score="zscore"``: how
      many robust standard deviations it jumped; the rule the collapse-evidence suite tuned);
    * trend (when ``trend_window`` is set): the least-squares slope of the last ``trend_window`` index values,
      per check, is ``>= trend_slope``.

    A fired check returns ``action`` unless the last action was fewer than ``cooldown`` checks ago. Once
    ``max_lr_cuts`` cuts were made, ``lower_lr`` escalates to ``after_max_lr_cuts``. A diverged check (NaN or Inf
    features) returns ``on_diverged`` at once, warm-up or not. After an action the patience count starts again.

    Args:
        action: ``"warn"``, ``"lower_lr"``, ``"stop"`` or ``"none"`` (log only).
        threshold: the score a check must reach (finite).
        patience: consecutive checks at or above the threshold (>= 1).
        warmup: checks that only build the baseline (>= 0).
        cooldown: checks after an action during which nothing more fires (>= 0).
        trend_window: checks in the trend fit (>= 2), or None for no trend rule.
        trend_slope: the slope per check that fires the trend rule (finite, > 0); required with ``trend_window``.
        lr_factor: learning-rate multiplier of ``lower_lr``, in ``(0, 1)``.
        max_lr_cuts: cuts before escalating (>= 0).
        after_max_lr_cuts: ``"warn"``, ``"stop"`` or ``"none"``.
        relative_to_baseline: same as ``score="baseline"`` (kept for existing configurations).
        score: ``"value"``, ``"baseline"`` or ``"zscore"`` (see above).
        zscore_window: values in the z-score's level (>= 2); the noise uses twice as many.
        checkpoint: ask for a rescue checkpoint before ``lower_lr`` and ``stop``.
        on_diverged: the action for a diverged check (``"stop"`` by default).

    Raises:
        InputError: an argument is out of range.

    Example:
        >>> policy = Policy(action="stop", threshold=0.8, patience=2, warmup=1)
        >>> [policy.decide(step, ci).action.value for step, ci in enumerate([0.5, 0.9, 0.9])]
        ['none', 'none', 'stop']
    """

    def __init__(
        self,
        *,
        action: str = "warn",
        threshold: float = 0.7,
        patience: int = 3,
        warmup: int = 3,
        cooldown: int = 5,
        trend_window: int | None = None,
        trend_slope: float | None = None,
        lr_factor: float = 0.5,
        max_lr_cuts: int = 3,
        after_max_lr_cuts: str = "stop",
        relative_to_baseline: bool = False,
        checkpoint: bool = False,
        on_diverged: str = "stop",
        score: str = "value",
        zscore_window: int = 10,
    ) -> None:
        actions = [a.value for a in Action]
        self.action_ = _check_choice(action, "action", actions)
        check_number(threshold, "threshold")
        check_int(patience, "patience", minimum=1)
        check_int(warmup, "warmup", minimum=0)
        check_int(cooldown, "cooldown", minimum=0)
        if (trend_window is None) != (trend_slope is None):
            raise InputError(
                f"`trend_window` and `trend_slope` go together, got trend_window={trend_window!r}, "
                f"trend_slope={trend_slope!r}"
            )
        if trend_window is not None:
            check_int(trend_window, "trend_window", minimum=2)
            check_number(trend_slope, "trend_slope", low=0.0)
        check_number(lr_factor, "lr_factor", low=0.0, high=1.0)
        check_int(max_lr_cuts, "max_lr_cuts", minimum=0)
        self.after_max_lr_cuts_ = _check_choice(after_max_lr_cuts, "after_max_lr_cuts", ["warn", "stop", "none"])
        self.on_diverged_ = _check_choice(on_diverged, "on_diverged", actions)
        if score not in _SCORES:
            raise InputError(f"`score` must be one of {list(_SCORES)}, got {score!r}")
        if relative_to_baseline and score == "zscore":
            raise InputError('`relative_to_baseline=True` contradicts `score="zscore"`; give one of them')
        check_int(zscore_window, "zscore_window", minimum=2)
        self.action = action
        self.threshold = float(threshold)
        self.patience = int(patience)
        self.warmup = int(warmup)
        self.cooldown = int(cooldown)
        self.trend_window = trend_window
        self.trend_slope = None if trend_slope is None else float(trend_slope)
        self.lr_factor = float(lr_factor)
        self.max_lr_cuts = int(max_lr_cuts)
        self.after_max_lr_cuts = after_max_lr_cuts
        self.relative_to_baseline = bool(relative_to_baseline)
        self.checkpoint = bool(checkpoint)
        self.on_diverged = on_diverged
        self.score = score
        self.zscore_window = int(zscore_window)
        self.score_ = "baseline" if self.relative_to_baseline else score
        self.reset()

    def reset(self) -> None:
        """Forget the history, the baseline and the counters."""
        self.checks_ = 0
        self.warmup_values_: list[float] = []
        self.recent_: list[float] = []
        self.values_: list[float] = []  # the last 2 * zscore_window values, for score="zscore"
        self.over_threshold_ = 0
        self.last_action_check_: int | None = None
        self.lr_cuts_ = 0

    @property
    def baseline_(self) -> float | None:
        """Mean index over the warm-up checks (None until the warm-up is over or when it is 0 checks)."""
        if self.checks_ <= self.warmup or not self.warmup_values_:
            return None
        return float(np.mean(self.warmup_values_))

    def decide(self, step: int, ci: float | None, *, diverged: bool = False) -> Decision:
        """The decision for one check.

        Args:
            step: the training step of the check.
            ci: the index value (ignored when ``diverged``).
            diverged: the features held NaN or Inf.
        """
        self.checks_ += 1
        if diverged or ci is None or not math.isfinite(ci):
            return self._act(self.on_diverged_, step, None, "diverged", "the probe features diverged (NaN or Inf)")
        past = self.values_
        self.values_ = [*past, ci][-2 * self.zscore_window :]
        if self.checks_ <= self.warmup:
            self.warmup_values_.append(ci)
            return Decision(Action.NONE, f"warm-up check {self.checks_} of {self.warmup}", step, ci)
        window = self.trend_window or 0
        self.recent_ = [*self.recent_, ci][-max(window, 1) :]
        baseline = self.baseline_ if self.score_ == "baseline" else None
        if self.score_ == "zscore":
            z = trailing_zscore(past, ci, window=self.zscore_window)
            score = -math.inf if z is None else z
            what = f"index {ci:.4g} at z = {score:.2f} against its last {self.zscore_window} checks"
        elif baseline is not None:
            score = ci - baseline
            what = f"index - baseline {score:.4f} (baseline {baseline:.4f})"
        else:
            score, what = ci, f"index {ci:.4f}"
        self.over_threshold_ = self.over_threshold_ + 1 if score >= self.threshold else 0
        if self.over_threshold_:
            reason = (
                f"{what} >= threshold {self.threshold} for {self.over_threshold_} of {self.patience} required "
                "consecutive checks"
            )
        else:
            reason = f"{what} below threshold {self.threshold}"
        rule = None
        if self.over_threshold_ >= self.patience:
            rule = "threshold"
            reason = f"{what} >= threshold {self.threshold} for {self.over_threshold_} consecutive checks"
        elif window and len(self.recent_) >= window:
            slope = float(np.polyfit(np.arange(window), np.asarray(self.recent_), 1)[0])
            if slope >= (self.trend_slope or math.inf):
                rule = "trend"
                reason = f"index rising {slope:.4f} per check over the last {window} checks (>= {self.trend_slope})"
        if rule is None:
            return Decision(Action.NONE, reason, step, ci)
        if self.last_action_check_ is not None and self.checks_ - self.last_action_check_ <= self.cooldown:
            return Decision(
                Action.NONE,
                f"{reason}; in cooldown after the action at check {self.last_action_check_}",
                step,
                ci,
                rule,
            )
        return self._act(self.action_, step, ci, rule, reason)

    def _act(self, action: Action, step: int, ci: float | None, rule: str, reason: str) -> Decision:
        if action is Action.LOWER_LR and self.lr_cuts_ >= self.max_lr_cuts:
            reason = f"{reason}; {self.lr_cuts_} learning-rate cuts made already, so {self.after_max_lr_cuts_.value}"
            action = self.after_max_lr_cuts_
        if action is Action.NONE:
            return Decision(Action.NONE, f"{reason} (action: none)", step, ci, rule)
        self.last_action_check_ = self.checks_
        self.over_threshold_ = 0
        factor = None
        if action is Action.LOWER_LR:
            self.lr_cuts_ += 1
            factor = self.lr_factor
            reason = f"{reason}: learning rate x {factor} (cut {self.lr_cuts_} of {self.max_lr_cuts})"
        checkpoint = self.checkpoint and action in (Action.LOWER_LR, Action.STOP)
        return Decision(action, reason, step, ci, rule, factor, checkpoint)

    def arguments(self) -> dict[str, Any]:
        """The constructor's arguments as given, so that ``Policy(**policy.arguments()) == policy`` (when fresh).

        Example:
            >>> Policy(action="stop", threshold=0.8).arguments()["threshold"]
            0.8
        """
        return {name: getattr(self, name) for name in inspect.signature(Policy).parameters}

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready counters and history (the settings are the constructor's)."""
        return {
            "version": _STATE_VERSION,
            "checks": self.checks_,
            "warmup_values": list(self.warmup_values_),
            "recent": list(self.recent_),
            "values": list(self.values_),
            "over_threshold": self.over_threshold_,
            "last_action_check": self.last_action_check_,
            "lr_cuts": self.lr_cuts_,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            InputError: missing keys or another version.
        """
        keys = {
            "version",
            "checks",
            "warmup_values",
            "recent",
            "values",
            "over_threshold",
            "last_action_check",
            "lr_cuts",
        }
        check_state(state, keys, _STATE_VERSION)
        self.checks_ = int(state["checks"])
        self.warmup_values_ = [float(v) for v in state["warmup_values"]]
        self.recent_ = [float(v) for v in state["recent"]]
        self.values_ = [float(v) for v in state["values"]]
        self.over_threshold_ = int(state["over_threshold"])
        self.last_action_check_ = None if state["last_action_check"] is None else int(state["last_action_check"])
        self.lr_cuts_ = int(state["lr_cuts"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"Policy(action={self.action!r}, threshold={self.threshold!r}, patience={self.patience!r}, "
            f"warmup={self.warmup!r}, cooldown={self.cooldown!r}, trend_window={self.trend_window!r}, "
            f"trend_slope={self.trend_slope!r}, lr_factor={self.lr_factor!r}, max_lr_cuts={self.max_lr_cuts!r}, "
            f"after_max_lr_cuts={self.after_max_lr_cuts!r}, relative_to_baseline={self.relative_to_baseline!r}, "
            f"checkpoint={self.checkpoint!r}, on_diverged={self.on_diverged!r}, score={self.score!r}, "
            f"zscore_window={self.zscore_window!r})"
        )
