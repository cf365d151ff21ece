"""The policy's rules: :class:`Policy` scores the watched channels, applies the rule and gates its action.

Its verdict is a :class:`~topocallbacks.policy.Decision`; the pure scores it uses live in :mod:`.scores`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._state import StateFields, Stateful
from ..exceptions import InputError
from ..settings import Action, PolicySettings
from .decision import Decision
from .scores import Reference, at_threshold, robust_zscore, score_value

#: The training channels the adapters pass beside the probe's index.
_TRAINING = ("loss", "grad_norm")
#: A training channel's noise estimate is at least this fraction of its scale (the largest value it reached at a
#: healthy check): a loss that has fallen to 1e-5 from 3 does not read a blip to 0.04 as thousands of deviations.
TRAINING_NOISE_FLOOR = 0.01

__all__ = ["TRAINING_NOISE_FLOOR", "Policy"]


def _finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)


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
            if at_threshold(self._score(channel, observed[name], step, self._spike, name), self._spike.threshold)
        )
        decision = self._judge(step, value, observed)
        return dataclasses.replace(decision, unsettled=unsettled) if unsettled else decision

    def _judge(self, step: int, value: float | None, observed: Mapping[str, float | None]) -> Decision:
        """The watched channels' decision at a check after the warm-up."""
        s = self.settings
        scores: dict[str, float | None] = {}
        for name, channel in self.channels_.items():
            scores[name] = self._score(channel, observed[name], step, None, name)
        flagged = tuple(name for name, score in scores.items() if at_threshold(score, self._threshold(name)))
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
            score = robust_zscore(np.asarray(reference.values, dtype=np.float64), value, 1, s.zscore_window, floor)
        else:
            score = score_value(s, channel.reference.values, value, self._baseline(channel))
        flagged = at_threshold(score, s.threshold if settings is not None else self._threshold(name))
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
