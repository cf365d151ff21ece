"""When to act on the watched index: rules over its history that return a :class:`Decision`.

The policy only decides; applying a decision (warning, cutting the learning rate, stopping, saving a rescue
checkpoint) is :func:`topocallbacks.interventions.apply`'s job, so the same policy drives Lightning, Hugging Face
and plain loops. A decision is made in three steps, each its own function:

1. *score*: the index becomes the score the threshold is compared with (:func:`score_value`); the z-score's
   reference (:class:`Reference`) holds the recent checks that stayed below the threshold, so one jump does not
   hide the next;
2. *rule*: the threshold held for ``patience`` checks after the warm-up (:func:`rule_holds` for a whole series),
   or a rising trend;
3. *gate*: the cooldown holds back a *repeat* of the same action unless the score beats the one that started it,
   never a stronger action; ``lower_lr`` escalates once the learning-rate cuts are spent.

The collapse-evidence suite (``benchmarks/collapse/``) evaluates steps 1 and 2 with the same functions
(:func:`rule_scores`, :func:`rule_holds`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from ._validation import check_int
from .exceptions import InputError
from .settings import Action, PolicySettings

__all__ = [
    "Action",
    "Decision",
    "Policy",
    "Reference",
    "rule_holds",
    "rule_scores",
    "score_value",
    "trailing_zscore",
]


@dataclasses.dataclass(frozen=True)
class Decision:
    """A policy's verdict on one check.

    Attributes:
        action: what to do.
        reason: why, in words (goes to the history and the warning).
        step: the training step of the check.
        value: the index value the rule saw, oriented so that higher means more collapsed (None: diverged, or no
            value yet).
        score: the score compared with the threshold (the value, its excess over the baseline, or its z-score).
        rule: the rule that held (``"threshold"``, ``"trend"``, ``"diverged"``), or None.
        lr_factor: the factor to multiply the learning rate by, for ``lower_lr``.
        checkpoint: save a rescue checkpoint with the action.
        held_back: the action the rule asked for when a cooldown held it back (the reason says why), else None.
    """

    action: Action
    reason: str
    step: int
    value: float | None = None
    score: float | None = None
    rule: str | None = None
    lr_factor: float | None = None
    checkpoint: bool = False
    held_back: Action | None = None

    @property
    def fired(self) -> bool:
        """Whether the adapter has anything to do."""
        return self.action is not Action.NONE

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        result = dataclasses.asdict(self)
        result["action"] = self.action.value
        result["held_back"] = None if self.held_back is None else self.held_back.value
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """The inverse of :meth:`as_dict`."""
        held = data.get("held_back")
        return cls(**{**data, "action": Action(data["action"]), "held_back": None if held is None else Action(held)})


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

    Example:
        >>> round(trailing_zscore([1.0, 1.1, 0.9, 1.0, 1.1, 0.9], 2.0), 2)  # median 1.0, |differences| 0.1-0.2
        9.54
        >>> trailing_zscore([1.0, 1.1, 0.9, 1.0, 1.1, 0.9], 2.0, direction=-1) < 0
        True
    """
    if direction not in (-1, 0, 1):
        raise InputError(f"`direction` must be -1, 0 or 1, got {direction!r}")
    check_int(window, "window", minimum=2)
    return _zscore(np.asarray(past, dtype=np.float64), value, direction, window)


def _zscore(values: NDArray[np.float64], value: float, direction: int, window: int) -> float | None:
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
    noise = max(noise / math.sqrt(2), 1e-9 * max(abs(level), 1e-12))  # a constant history: any change is far out
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

    Example:
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


def score_value(
    settings: PolicySettings,
    past: Sequence[float | None] | NDArray[np.float64],
    value: float,
    baseline: float | None = None,
    direction: int = 1,
) -> float | None:
    """The score of ``value`` under ``settings.score`` given the ``past`` reference values (oldest first).

    ``"value"``: the value; ``"baseline"``: its excess over ``baseline`` (None before there is one);
    ``"zscore"``: :func:`trailing_zscore` against the last ``zscore_window`` values, in ``direction`` (+1 rises,
    -1 drops, 0 either). None: no score yet.
    """
    if settings.score == "zscore":
        return _zscore(np.asarray(past, dtype=np.float64), value, direction, settings.zscore_window)
    if settings.score == "baseline":
        return None if baseline is None else value - baseline
    return value


def _flagged(score: float | None, threshold: float) -> bool:
    return score is not None and score >= threshold


def rule_scores(values: Sequence[float], settings: PolicySettings, *, direction: int = 1) -> NDArray[np.float64]:
    """The score of every check of a series, as :class:`Policy` computes it (NaN during the warm-up and where none).

    Non-finite values (diverged checks, or an index with no value yet) get no score and stay out of the
    reference; so do the checks whose score reached ``settings.threshold`` (see :class:`Reference`).

    Example:
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
        reference.add(value, _flagged(score, settings.threshold))
    return scores


def rule_holds(
    scores: Sequence[float], threshold: float, patience: int, warmup: int, diverged: Sequence[bool] | None = None
) -> NDArray[np.bool_]:
    """Where the threshold rule holds over a series of scores (as :class:`Policy` applies it).

    The rule holds at a check after the warm-up whose score and the ``patience - 1`` scores before it are
    ``>= threshold``; a diverged check always holds (its action comes at once).

    Example:
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


class Policy(Stateful):
    """Rules over the index history, with warm-up, patience, cooldown and a cap on learning-rate cuts.

    A check's *rule holds* when, after the warm-up, either

    * threshold: the score (see :class:`~topocallbacks.settings.PolicySettings`: the index, its excess over the
      warm-up mean, or its z-score against the recent checks that stayed below the threshold) is
      ``>= threshold`` for ``patience`` consecutive checks; or
    * trend (when ``trend_window`` is set): the least-squares slope of the last ``trend_window`` values, per
      check, is ``>= trend_slope``.

    It then returns ``action``, escalated to ``after_max_lr_cuts`` once ``max_lr_cuts`` cuts were made. Within
    ``cooldown`` checks of an action, the *same* action is held back (the decision says so) unless the score is
    above the one that started the cooldown; a stronger action (``warn`` < ``lower_lr`` < ``stop``) always goes
    through, so a warning never silences a stop. A diverged check (NaN or Inf features) returns ``on_diverged``
    at once, warm-up or cooldown or not. After an action the patience count starts again.

    Args:
        settings: a :class:`~topocallbacks.settings.PolicySettings` (default: the tuned default rule).
        **overrides: any of its fields, e.g. ``Policy(action="stop", threshold=0.8)``.

    Raises:
        InputError: a value is out of range.
        ConfigError: an unknown field (with the closest one).

    Example:
        >>> policy = Policy(action="stop", score="value", threshold=0.8, patience=2, warmup=1)
        >>> [policy.decide(step, value).action.value for step, value in enumerate([0.5, 0.9, 0.9])]
        ['none', 'none', 'stop']
    """

    _state = StateFields(
        version=4,
        fields={
            "checks": "checks_",
            "warmup_values": "warmup_values_",
            "recent": "recent_",
            "reference": "_reference_values",
            "held_out": "_reference_held",
            "over_threshold": "over_threshold_",
            "last_action_check": "last_action_check_",
            "last_action": "last_action_",
            "last_action_score": "last_action_score_",
            "lr_cuts": "lr_cuts_",
        },
    )

    def __init__(self, settings: PolicySettings | None = None, /, **overrides: Any) -> None:
        if settings is not None and not isinstance(settings, PolicySettings):
            raise InputError(f"`settings` must be a PolicySettings, got {type(settings).__name__}")
        base = PolicySettings() if settings is None else settings
        self.settings: PolicySettings = base.replace(**overrides) if overrides else base
        self.reset()

    def reset(self) -> None:
        """Forget the history, the baseline and the counters."""
        s = self.settings
        self.checks_ = 0
        self.warmup_values_: list[float] = []
        self.recent_: list[float] = []  # the last trend_window values, for the trend rule
        self.reference_ = Reference(2 * s.zscore_window, s.zscore_window)
        self.over_threshold_ = 0
        self.last_action_check_: int | None = None
        self.last_action_: str | None = None
        self.last_action_score_: float | None = None
        self.lr_cuts_ = 0

    @property
    def _reference_values(self) -> list[float]:
        return self.reference_.values

    @_reference_values.setter
    def _reference_values(self, values: list[float]) -> None:
        self.reference_.values = [float(v) for v in values]

    @property
    def _reference_held(self) -> list[float]:
        return self.reference_.held

    @_reference_held.setter
    def _reference_held(self, values: list[float]) -> None:
        self.reference_.held = [float(v) for v in values]

    @property
    def baseline_(self) -> float | None:
        """Mean index over the warm-up checks (None until the warm-up is over or when it is 0 checks)."""
        if self.checks_ <= self.settings.warmup or not self.warmup_values_:
            return None
        return float(np.mean(self.warmup_values_))

    def decide(self, step: int, value: float | None, *, diverged: bool = False) -> Decision:
        """The decision for one check.

        Args:
            step: the training step of the check.
            value: the index value, oriented so that higher means more collapsed; None when the index has no value
                yet (e.g. diagram drift at the first check).
            diverged: the features held NaN or Inf.
        """
        s = self.settings
        self.checks_ += 1
        if diverged or (value is not None and not math.isfinite(value)):
            action, reason = self._escalate(Action(s.on_diverged), "the features diverged (NaN or Inf)")
            return self._act(action, step, None, None, "diverged", reason)
        if self.checks_ <= s.warmup:
            if value is not None:
                self.warmup_values_.append(value)
                self.reference_.add(value, flagged=False)
            return Decision(Action.NONE, f"warm-up check {self.checks_} of {s.warmup}", step, value)
        if value is None:
            self.over_threshold_ = 0
            return Decision(Action.NONE, "no index value at this check", step)
        score = score_value(s, self.reference_.values, value, self.baseline_)
        self.reference_.add(value, _flagged(score, s.threshold))
        rule, reason = self._rule(value, score)
        if rule is None:
            return Decision(Action.NONE, reason, step, value, score)
        action, reason = self._escalate(Action(s.action), reason)
        held = self._held_back(action, score)
        if held is not None:
            return Decision(Action.NONE, f"{reason}; {held}", step, value, score, rule, held_back=action)
        return self._act(action, step, value, score, rule, reason)

    def _describe(self, value: float, score: float | None) -> str:
        s = self.settings
        if s.score == "zscore":
            shown = "none yet" if score is None else f"{score:.2f}"
            return f"index {value:.4g} at z = {shown} against its last {s.zscore_window} checks"
        if s.score == "baseline":
            if score is None:
                return f"index {value:.4f} (no baseline yet)"
            return f"index - baseline {score:.4f} (baseline {value - score:.4f})"
        return f"index {value:.4f}"

    def _rule(self, value: float, score: float | None) -> tuple[str | None, str]:
        """Which rule holds at this check (None: neither), and why, in words."""
        s = self.settings
        what = self._describe(value, score)
        self.over_threshold_ = self.over_threshold_ + 1 if _flagged(score, s.threshold) else 0
        if s.trend_window is not None:
            self.recent_ = [*self.recent_, value][-s.trend_window :]
        if self.over_threshold_ >= s.patience:
            return "threshold", f"{what} >= threshold {s.threshold} for {self.over_threshold_} consecutive checks"
        if s.trend_window is not None and s.trend_slope is not None and len(self.recent_) >= s.trend_window:
            slope = float(np.polyfit(np.arange(s.trend_window), np.asarray(self.recent_), 1)[0])
            if slope >= s.trend_slope:
                return "trend", (
                    f"index rising {slope:.4f} per check over the last {s.trend_window} checks (>= {s.trend_slope})"
                )
        if self.over_threshold_:
            return None, (
                f"{what} >= threshold {s.threshold} for {self.over_threshold_} of {s.patience} required "
                "consecutive checks"
            )
        return None, f"{what} below threshold {s.threshold}"

    def _escalate(self, action: Action, reason: str) -> tuple[Action, str]:
        """``lower_lr`` becomes ``after_max_lr_cuts`` once the cuts are spent."""
        if action is Action.LOWER_LR and self.lr_cuts_ >= self.settings.max_lr_cuts:
            escalated = Action(self.settings.after_max_lr_cuts)
            return escalated, f"{reason}; {self.lr_cuts_} learning-rate cuts made already, so {escalated.value}"
        return action, reason

    def _held_back(self, action: Action, score: float | None) -> str | None:
        """Why a cooldown holds ``action`` back at this check, or None when it goes through."""
        s = self.settings
        if action is Action.NONE or self.last_action_check_ is None or self.last_action_ is None:
            return None
        since = self.checks_ - self.last_action_check_
        if since > s.cooldown:
            return None
        last = Action(self.last_action_)
        if action.level > last.level:
            return None  # a stronger action is never held back
        started = self.last_action_score_
        if action.level == last.level and score is not None and (started is None or score > started):
            return None  # a bigger alarm than the one that started the cooldown
        shown = "none" if started is None else f"{started:.4g}"
        return (
            f"held back: {action.value} again {since} check(s) after the {last.value} at check "
            f"{self.last_action_check_} (cooldown {s.cooldown}), and the score is not above that action's {shown}"
        )

    def _act(
        self, action: Action, step: int, value: float | None, score: float | None, rule: str, reason: str
    ) -> Decision:
        s = self.settings
        if action is Action.NONE:
            return Decision(Action.NONE, f"{reason} (action: none)", step, value, score, rule)
        self.last_action_check_ = self.checks_
        self.last_action_ = action.value
        self.last_action_score_ = score
        self.over_threshold_ = 0
        factor = None
        if action is Action.LOWER_LR:
            self.lr_cuts_ += 1
            factor = s.lr_factor
            reason = f"{reason}: learning rate x {factor} (cut {self.lr_cuts_} of {s.max_lr_cuts})"
        checkpoint = s.checkpoint and action in (Action.LOWER_LR, Action.STOP)
        return Decision(action, reason, step, value, score, rule, factor, checkpoint)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self.settings == other.settings and self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Policy({self.settings!r})"
