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

#: The training channels the adapters pass beside the probe's index.
_TRAINING = ("loss", "grad_norm")
#: A training channel's noise estimate is at least this fraction of its scale (the largest value it reached at a
#: healthy check): a loss that has fallen to 1e-5 from 3 does not read a blip to 0.04 as thousands of deviations.
TRAINING_NOISE_FLOOR = 0.01

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
        flagged: the channels whose score reached the threshold at this check (``"diverged"`` for a diverged
            check); a check with none is *healthy*: ``rollback`` keeps snapshots of healthy checks only.
        onset: the step of the first check of the run of flagged checks that made the rule hold (a rollback goes
            to the newest snapshot before it), or None.
        scores: each watched channel's score when the rule watches more than the index, else None.
        unsettled: the training channels (``"loss"``, ``"grad_norm"``) the rule does not watch that spiked at this
            check (a z-score against their recent checks at the default rule's threshold, whatever the index's
            score). Nothing acts on them, but the check is not healthy: a rollback snapshot is never taken while
            the training loss or gradient norm is spiking, whatever the rule watches.
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
    flagged: tuple[str, ...] = ()
    onset: int | None = None
    scores: dict[str, float | None] | None = None
    unsettled: tuple[str, ...] = ()

    @property
    def fired(self) -> bool:
        """Whether the adapter has anything to do."""
        return self.action is not Action.NONE

    @property
    def healthy(self) -> bool:
        """No action and no channel at its threshold, watched or not: a state worth a rollback snapshot."""
        return self.action is Action.NONE and not self.flagged and not self.unsettled and self.held_back is None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        result = dataclasses.asdict(self)
        result["action"] = self.action.value
        result["held_back"] = None if self.held_back is None else self.held_back.value
        result["flagged"] = list(self.flagged)
        result["unsettled"] = list(self.unsettled)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """The inverse of :meth:`as_dict`."""
        held = data.get("held_back")
        return cls(
            **{
                **data,
                "action": Action(data["action"]),
                "held_back": None if held is None else Action(held),
                "flagged": tuple(data.get("flagged", ())),
                "unsettled": tuple(data.get("unsettled", ())),
            }
        )


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


def _zscore(values: NDArray[np.float64], value: float, direction: int, window: int, floor: float = 0.0) -> float | None:
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
    ``"zscore"``: :func:`trailing_zscore` against the last ``zscore_window`` values, in ``direction`` (+1 rises,
    -1 drops, 0 either). None: no score yet.
    """
    if settings.score == "zscore":
        return _zscore(np.asarray(past, dtype=np.float64), value, direction, settings.zscore_window)
    if settings.score == "baseline":
        return None if baseline is None else value - baseline
    return value


def _finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)


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


class _Channel:
    """What the policy keeps about one watched channel: its reference, warm-up values and flagged run."""

    def __init__(self, settings: PolicySettings) -> None:
        self.reference = Reference(2 * settings.zscore_window, max(settings.zscore_window, settings.patience))
        self.warmup: list[float] = []
        self.over = 0  # consecutive checks at or above the threshold
        self.onset: int | None = None  # the step of the first of them
        #: The last check at which the channel's rule held: {"check", "step", "onset", "rule", "reason"} (a rule that
        #: requires several channels counts a channel that held at the check before, see Policy).
        self.last_hold: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        return {
            "last_hold": self.last_hold,
            "reference": list(self.reference.values),
            "held": list(self.reference.held),
            "scale": self.reference.scale,
            "warmup": list(self.warmup),
            "over": self.over,
            "onset": self.onset,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        self.reference.values = [float(v) for v in state["reference"]]
        self.reference.held = [float(v) for v in state["held"]]
        self.reference.scale = float(state["scale"])
        self.warmup = [float(v) for v in state["warmup"]]
        self.over = int(state["over"])
        self.onset = None if state["onset"] is None else int(state["onset"])
        self.last_hold = None if state["last_hold"] is None else dict(state["last_hold"])


class Policy(Stateful):
    """Rules over the watched channels' history, with warm-up, patience, cooldown and escalation.

    The channels (``settings.channels``) are the probe's index and, when the training adapter passes them, the
    training loss and gradient norm (averaged over the steps since the last check). Each is scored on its own
    (the value, its excess over the warm-up mean, or its z-score against its recent checks that stayed below the
    threshold) and a channel *holds* at a check after the warm-up when either

    * threshold: its score is ``>= threshold`` for ``patience`` consecutive checks; or
    * trend (the index only, when ``trend_window`` is set): the least-squares slope of its last ``trend_window``
      values, per check, is ``>= trend_slope``.

    The rule holds when ``require`` channels hold at once; when it requires several, a channel whose rule held at
    the check just before counts too (the training loss is the mean since the last check, so a jump in the index at
    one check is often confirmed by the loss at the next), as long as one channel holds at this check. It then
    returns ``action``, escalated once its budget is spent: ``lower_lr`` to ``after_max_lr_cuts`` after
    ``max_lr_cuts`` cuts, ``rollback`` to ``after_max_rollbacks`` after ``max_rollbacks`` rollbacks. Within
    ``cooldown`` checks of an action, the *same* action is held back (the decision says so) unless the score is
    above the one that started the cooldown; a stronger action (``warn`` < ``lower_lr`` < ``rollback`` < ``stop``)
    always goes through, so a warning never silences a stop, and so does a rollback (after one, the state is the
    snapshot's: a new alarm is a new fault). A diverged check (NaN or Inf features, loss or gradient norm) returns
    ``on_diverged`` at once, and a check whose features an absolute sentinel finds collapsed (``collapsed``)
    returns ``action`` at once, warm-up or not; neither enters any reference. After an action the patience count
    starts again.

    Args:
        settings: a :class:`~topocallbacks.settings.PolicySettings` (default: the library's default rule).
        **overrides: any of its fields, e.g. ``Policy(action="stop", threshold=0.8)``.

    Raises:
        InputError: a value is out of range.
        ConfigError: an unknown field (with the closest one).

    Example:
        >>> policy = Policy(action="stop", score="value", threshold=0.8, patience=2, warmup=1, channels=["index"],
        ...                 require=1)
        >>> [policy.decide(step, value).action.value for step, value in enumerate([0.5, 0.9, 0.9])]
        ['none', 'none', 'stop']
        >>> policy = Policy()  # the default rule: the index and the loss jump together (or at consecutive checks)
        >>> decisions = [policy.decide(step, 1.0 + 0.01 * (step % 3), loss=2.0 - 0.01 * step) for step in range(12)]
        >>> policy.decide(12, 9.0, loss=1.9).action.value, policy.decide(13, 1.0, loss=5.0).action.value
        ('none', 'rollback')
    """

    _state = StateFields(
        version=7,
        fields={
            "checks": "checks_",
            "channels": "_channel_state",
            "unwatched": "_unwatched_state",
            "recent": "recent_",
            "last_action_check": "last_action_check_",
            "last_action": "last_action_",
            "last_action_score": "last_action_score_",
            "lr_cuts": "lr_cuts_",
            "rollbacks": "rollbacks_",
        },
    )

    def __init__(self, settings: PolicySettings | None = None, /, **overrides: Any) -> None:
        if settings is not None and not isinstance(settings, PolicySettings):
            raise InputError(f"`settings` must be a PolicySettings, got {type(settings).__name__}")
        base = PolicySettings() if settings is None else settings
        self.settings: PolicySettings = base.replace(**overrides) if overrides else base
        self.reset()

    def reset(self) -> None:
        """Forget the history, the baselines and the counters."""
        self.checks_ = 0
        self.channels_ = {name: _Channel(self.settings) for name in self.settings.channels}
        # The training channels the rule does not watch are still scored, by the default rule's z-score (whatever
        # the index's score): a check where one of them spikes is not healthy (no rollback snapshot), though nothing
        # acts on it (Decision.unsettled).
        self._spike = PolicySettings(zscore_window=self.settings.zscore_window, patience=self.settings.patience)
        self.unwatched_ = {name: _Channel(self._spike) for name in _TRAINING if name not in self.channels_}
        self.recent_: list[float] = []  # the last trend_window index values, for the trend rule
        self.last_action_check_: int | None = None
        self.last_action_: str | None = None
        self.last_action_score_: float | None = None
        self.lr_cuts_ = 0
        self.rollbacks_ = 0

    @property
    def _channel_state(self) -> dict[str, dict[str, Any]]:
        return {name: channel.state() for name, channel in self.channels_.items()}

    @_channel_state.setter
    def _channel_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        if set(state) != set(self.channels_):
            raise InputError(
                f"the saved policy watched channels {sorted(state)}, this one watches {sorted(self.channels_)}"
            )
        for name, saved in state.items():
            self.channels_[name].load(saved)

    @property
    def _unwatched_state(self) -> dict[str, dict[str, Any]]:
        return {name: channel.state() for name, channel in self.unwatched_.items()}

    @_unwatched_state.setter
    def _unwatched_state(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, saved in state.items():
            if name in self.unwatched_:
                self.unwatched_[name].load(saved)

    @property
    def reference_(self) -> Reference:
        """The watched index's z-score reference (see :class:`Reference`)."""
        return self._index_channel().reference

    @property
    def over_threshold_(self) -> int:
        """Consecutive checks whose index score reached the threshold."""
        return self._index_channel().over

    @property
    def baseline_(self) -> float | None:
        """Mean index over the warm-up checks (None until the warm-up is over or when it is 0 checks)."""
        return self._baseline(self._index_channel())

    def _index_channel(self) -> _Channel:
        return self.channels_.get("index") or next(iter(self.channels_.values()))

    def _baseline(self, channel: _Channel) -> float | None:
        if self.checks_ <= self.settings.warmup or not channel.warmup:
            return None
        return float(np.mean(channel.warmup))

    def decide(
        self,
        step: int,
        value: float | None,
        *,
        diverged: bool = False,
        loss: float | None = None,
        grad_norm: float | None = None,
        collapsed: str | None = None,
    ) -> Decision:
        """The decision for one check.

        Args:
            step: the training step of the check.
            value: the index value, oriented so that higher means more collapsed; None when the index has no value
                yet (e.g. diagram drift at the first check).
            diverged: the features held NaN or Inf.
            loss: the mean training loss since the last check (the ``"loss"`` channel), or None.
            grad_norm: the mean gradient norm (before clipping) since the last check, or None.
            collapsed: why the features count as totally collapsed by an absolute sentinel
                (:meth:`SentinelValues.describe <topocallbacks.functional.sentinels.SentinelValues.describe>`), or
                None. With ``settings.sentinels`` such a check acts at once (warm-up or not) and, whatever the
                setting, none of its values enters a reference: a collapsed state is never learned as healthy.
        """
        s = self.settings
        self.checks_ += 1
        observed = {"index": value, "loss": loss, "grad_norm": grad_norm}
        broken = [name for name in _TRAINING if not _finite_or_none(observed[name])]
        if diverged or (value is not None and not math.isfinite(value)) or broken:
            what = (
                f"the training {broken[0].replace('_', ' ')} is {observed[broken[0]]}"
                if broken and not diverged
                else "the features diverged (NaN or Inf)"
            )
            action, reason = self._escalate(Action(s.on_diverged), what)
            return self._act(action, step, None, None, "diverged", reason, ("diverged",), step, None)
        if collapsed and not s.sentinels:
            collapsed = None  # judged like any other check: the user counts such features as healthy
        if collapsed:
            action, reason = self._escalate(Action(s.action), collapsed)
            held = self._held_back(action, None)
            if held is not None:
                return Decision(
                    Action.NONE, f"{reason}; {held}", step, value, None, "sentinel", held_back=action,
                    flagged=("collapse",), onset=step,
                )  # fmt: skip
            return self._act(action, step, value, None, "sentinel", reason, ("collapse",), step, None)
        if self.checks_ <= s.warmup:
            for name, channel in [*self.channels_.items(), *self.unwatched_.items()]:
                seen = observed[name]
                if seen is not None:
                    channel.warmup.append(seen)
                    channel.reference.add(seen, flagged=False)
            return Decision(Action.NONE, f"warm-up check {self.checks_} of {s.warmup}", step, value)
        unsettled = tuple(
            name
            for name, channel in self.unwatched_.items()
            if _flagged(self._score(channel, observed[name], step, self._spike, name), self._spike.threshold)
        )
        decision = self._judge(step, value, observed)
        return dataclasses.replace(decision, unsettled=unsettled) if unsettled else decision

    def _judge(self, step: int, value: float | None, observed: Mapping[str, float | None]) -> Decision:
        """The watched channels' decision at a check after the warm-up."""
        s = self.settings
        scores: dict[str, float | None] = {}
        for name, channel in self.channels_.items():
            scores[name] = self._score(channel, observed[name], step, None, name)
        flagged = tuple(name for name, score in scores.items() if _flagged(score, self._threshold(name)))
        shown = None if list(self.channels_) == ["index"] else scores
        if "index" in self.channels_ and value is not None and s.trend_window is not None:
            self.recent_ = [*self.recent_, value][-s.trend_window :]
        holding: list[tuple[str, str, str]] = []  # (channel, rule, reason)
        carried: list[tuple[str, str, str]] = []  # channels that held at the check before (see the class docstring)
        onsets: dict[str, int | None] = {}
        waiting: list[str] = []
        for name, channel in self.channels_.items():
            hold = channel.last_hold
            before = hold if hold is not None and hold["check"] == self.checks_ - 1 else None
            if observed[name] is None:
                rule, reason = None, ""
            else:
                rule, reason = self._rule(name, channel, observed[name], scores[name])  # type: ignore[arg-type]
            if rule is not None:
                holding.append((name, rule, reason))
                onsets[name] = channel.onset
                channel.last_hold = {"check": self.checks_, "step": step, "onset": channel.onset, "rule": rule,
                                "reason": reason}  # fmt: skip
            elif before is not None and s.require > 1:
                carried.append(
                    (name, before["rule"], f"{before['reason']} at the check before (step {before['step']})")
                )
                onsets[name] = before["onset"]
            elif reason:
                waiting.append(reason)
        score = (
            scores.get("index")
            if "index" in scores
            else max((v for v in scores.values() if v is not None), default=None)
        )
        if not holding and all(observed[name] is None for name in self.channels_):
            return Decision(Action.NONE, "no index value at this check", step)
        if not holding or len(holding) + len(carried) < s.require:
            reason = "; ".join([r for _, _, r in holding] + waiting)
            if holding:
                reason += f" ({len(holding)} of the {s.require} channels required)"
            return Decision(Action.NONE, reason, step, value, score, flagged=flagged, scores=shown)
        held_scores = [v for name, _, _ in holding if (v := scores[name]) is not None]
        if "index" not in [name for name, _, _ in holding]:  # the cooldown compares the strongest channel's score
            score = max(held_scores, default=score)
        holding = holding + carried
        onset = min((o for o in onsets.values() if o is not None), default=step)
        rule = holding[0][1] if len({r for _, r, _ in holding}) == 1 else "+".join(r for _, r, _ in holding)
        action, reason = self._escalate(Action(s.action), "; ".join(r for _, _, r in holding))
        held = self._held_back(action, score)
        if held is not None:
            return Decision(
                Action.NONE, f"{reason}; {held}", step, value, score, rule, held_back=action, flagged=flagged,
                onset=onset, scores=shown,
            )  # fmt: skip
        return self._act(action, step, value, score, rule, reason, flagged, onset, shown)

    def _score(
        self,
        channel: _Channel,
        value: float | None,
        step: int,
        settings: PolicySettings | None = None,
        name: str = "index",
    ) -> float | None:
        """A channel's score at this check (None: no value or no score yet); updates its reference and run.

        The index is scored by ``settings.score``; a training channel by the z-score with its noise floored at
        :data:`TRAINING_NOISE_FLOOR` of its scale.
        """
        s = self.settings if settings is None else settings
        if value is None:
            channel.over, channel.onset = 0, None
            return None
        if name in _TRAINING:
            reference = channel.reference
            floor = TRAINING_NOISE_FLOOR * reference.scale
            score = _zscore(np.asarray(reference.values, dtype=np.float64), value, 1, s.zscore_window, floor)
        else:
            score = score_value(s, channel.reference.values, value, self._baseline(channel))
        flagged = _flagged(score, s.threshold if settings is not None else self._threshold(name))
        channel.reference.add(value, flagged)
        if flagged:
            channel.over += 1
            if channel.over == 1:
                channel.onset = step
        else:
            channel.over, channel.onset = 0, None
        return score

    def _threshold(self, name: str) -> float:
        """A channel's threshold: ``threshold``, but for a training channel under a value or baseline score.

        Training channels are always z-scored: under ``score="value"`` or ``"baseline"`` their threshold is the
        default rule's z-score threshold, not the index's.
        """
        s = self.settings
        return s.threshold if name not in _TRAINING or s.score == "zscore" else self._spike.threshold

    def _describe(self, name: str, value: float, score: float | None) -> str:
        s = self.settings
        what = "index" if name == "index" else name.replace("_", " ")
        if s.score == "zscore" or name in _TRAINING:
            shown = "none yet" if score is None else f"{score:.2f}"
            return f"{what} {value:.4g} at z = {shown} against its last {s.zscore_window} checks"
        if s.score == "baseline":
            if score is None:
                return f"{what} {value:.4f} (no baseline yet)"
            return f"{what} - baseline {score:.4f} (baseline {value - score:.4f})"
        return f"{what} {value:.4f}"

    def _rule(self, name: str, channel: _Channel, value: float, score: float | None) -> tuple[str | None, str]:
        """Which rule holds for a channel at this check (None: neither), and why, in words."""
        s = self.settings
        what = self._describe(name, value, score)
        if channel.over >= s.patience:
            return "threshold", f"{what} >= threshold {self._threshold(name)} for {channel.over} consecutive checks"
        trend = name == "index" and s.trend_window is not None and s.trend_slope is not None
        if trend and len(self.recent_) >= s.trend_window:  # type: ignore[operator]
            slope = float(np.polyfit(np.arange(s.trend_window), np.asarray(self.recent_), 1)[0])  # type: ignore[arg-type]
            if slope >= s.trend_slope:  # type: ignore[operator]
                return "trend", (
                    f"index rising {slope:.4f} per check over the last {s.trend_window} checks (>= {s.trend_slope})"
                )
        if channel.over:
            return None, (
                f"{what} >= threshold {self._threshold(name)} for {channel.over} of {s.patience} required "
                "consecutive checks"
            )
        return None, f"{what} below threshold {self._threshold(name)}"

    def _escalate(self, action: Action, reason: str) -> tuple[Action, str]:
        """``lower_lr`` and ``rollback`` become ``after_max_lr_cuts``/``after_max_rollbacks`` once spent."""
        s = self.settings
        if action is Action.LOWER_LR and self.lr_cuts_ >= s.max_lr_cuts:
            escalated = Action(s.after_max_lr_cuts)
            return escalated, f"{reason}; {self.lr_cuts_} learning-rate cuts made already, so {escalated.value}"
        if action is Action.ROLLBACK and self.rollbacks_ >= s.max_rollbacks:
            escalated = Action(s.after_max_rollbacks)
            cause = (
                f"{self.rollbacks_} rollbacks made already and the alarm came back after them: its cause outlives a "
                "rollback (structural: the model, the data or the learning-rate schedule, not a passing burst)"
                if self.rollbacks_
                else "no rollbacks allowed (max_rollbacks 0)"
            )
            return escalated, f"{reason}; {cause}, so {escalated.value}"
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
        if action.level > last.level or action is Action.ROLLBACK:
            # A stronger action is never held back; nor is a rollback: after one the state is the snapshot's, so a
            # new alarm is a new fault (max_rollbacks bounds them).
            return None
        started = self.last_action_score_
        if action.level == last.level and score is not None and (started is None or score > started):
            return None  # a bigger alarm than the one that started the cooldown
        shown = "none" if started is None else f"{started:.4g}"
        return (
            f"held back: {action.value} again {since} check(s) after the {last.value} at check "
            f"{self.last_action_check_} (cooldown {s.cooldown}), and the score is not above that action's {shown}"
        )

    def _act(
        self,
        action: Action,
        step: int,
        value: float | None,
        score: float | None,
        rule: str,
        reason: str,
        flagged: tuple[str, ...],
        onset: int | None,
        scores: dict[str, float | None] | None,
    ) -> Decision:
        s = self.settings
        if action is Action.NONE:
            return Decision(
                Action.NONE, f"{reason} (action: none)", step, value, score, rule, flagged=flagged, onset=onset,
                scores=scores,
            )  # fmt: skip
        self.last_action_check_ = self.checks_
        self.last_action_ = action.value
        self.last_action_score_ = score
        for channel in self.channels_.values():
            channel.over, channel.onset, channel.last_hold = 0, None, None
        factor = None
        if action is Action.LOWER_LR:
            self.lr_cuts_ += 1
            factor = s.lr_factor
            reason = f"{reason}: learning rate x {factor} (cut {self.lr_cuts_} of {s.max_lr_cuts})"
        elif action is Action.ROLLBACK:
            self.rollbacks_ += 1
            factor = s.rollback_lr_factor if self.rollbacks_ == 1 else (s.rollback_lr_factor or s.lr_factor)
            cut = "" if factor is None else f", learning rate x {factor}"
            reason = (
                f"{reason}: roll back to the newest healthy snapshot before step {onset}{cut} "
                f"(rollback {self.rollbacks_} of {s.max_rollbacks})"
            )
        checkpoint = s.checkpoint and action in (Action.LOWER_LR, Action.ROLLBACK, Action.STOP)
        return Decision(action, reason, step, value, score, rule, factor, checkpoint, None, flagged, onset, scores)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self.settings == other.settings and self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Policy({self.settings!r})"
