"""The policy's coordinator: `Policy` wires its parts and takes the short-cuts of a diverged or collapsed check.

The parts are the channels' scores, the rule across channels and the escalation; its state is the sum of theirs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from .._state import StateFields, Stateful
from ..exceptions import InputError
from ..settings import Action, PolicySettings
from .channels import TRAINING_CHANNELS, Channel, ChannelScores
from .decision import Alarm, Decision
from .escalation import Escalation
from .rule import ChannelRule
from .scores import Reference

__all__ = ["Policy"]


def _delegated(part: str, name: str, doc: str) -> Any:
    """A read-write attribute that lives on the policy's part ``part`` as ``name``."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
        doc=doc,
    )


def _channels_state(save: str, load: str, doc: str) -> Any:
    """A read-write attribute that the channel scores keep: read by their method ``save``, set by their ``load``."""
    return property(
        lambda self: getattr(self._channels, save)(),
        lambda self, state: getattr(self._channels, load)(state),
        doc=doc,
    )


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

    Each of these jobs is a part: the scores and references of the channels
    (`ChannelScores`), the rule across them
    (`ChannelRule`) and the escalation with its cooldown and counters
    (`Escalation`).

    Args:
        settings: a [`PolicySettings`][topocallbacks.settings.PolicySettings] (default: the library's default rule).
        **overrides: any of its fields, e.g. ``Policy(action="stop", threshold=0.8)``.

    Raises:
        InputError: a value is out of range.
        ConfigError: an unknown field (with the closest one).

    Examples:
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
            "checks": "checks_decided_",
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
        self.checks_decided_ = 0  # the checks decided so far (`decide` calls)
        self._channels = ChannelScores(self.settings)
        self._rule = ChannelRule(self.settings, self._channels)
        self._escalation = Escalation(self.settings)

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
                (`SentinelValues.describe`), or
                None. With ``settings.sentinels`` such a check acts at once (warm-up or not) and, whatever the
                setting, none of its values enters a reference: a collapsed state is never learned as healthy.
        """
        decision = self._decide(step, value, diverged, loss, grad_norm, collapsed)
        thresholds = {name: self._channels.threshold(name) for name in self._channels.watched}
        return dataclasses.replace(decision, thresholds=thresholds)

    def _decide(
        self,
        step: int,
        value: float | None,
        diverged: bool,
        loss: float | None,
        grad_norm: float | None,
        collapsed: str | None,
    ) -> Decision:
        s = self.settings
        self.checks_decided_ += 1
        observed = {"index": value, "loss": loss, "grad_norm": grad_norm}
        short_cut = _short_cut(s, step, value, observed, diverged, collapsed)
        if short_cut is not None:
            action, alarm = short_cut
            return self._respond(action, alarm)
        if self.checks_decided_ <= s.warmup:
            self._channels.warm_up(observed)
            return Decision(
                action=Action.NONE, reason=f"warm-up check {self.checks_decided_} of {s.warmup}", step=step, value=value
            )
        unsettled = self._channels.unsettled(observed, step)
        if s.snapshot_health == "watched":  # only the watched channels decide whether a check is healthy
            unsettled = ()
        verdict = self._rule.judge(step, value, observed, self.checks_decided_)
        decision = verdict if isinstance(verdict, Decision) else self._respond(Action(s.action), verdict)
        return dataclasses.replace(decision, unsettled=unsettled) if unsettled else decision

    def _respond(self, action: Action, alarm: Alarm) -> Decision:
        decision = self._escalation.respond(action, alarm, self.checks_decided_)
        if decision.fired:
            self._channels.restart()  # after an action the patience count starts again
        return decision

    @property
    def checks_(self) -> int:
        """The old name of `checks_decided_` (the checks decided so far), kept working."""
        return self.checks_decided_

    @checks_.setter
    def checks_(self, value: int) -> None:
        self.checks_decided_ = value

    @property
    def channels_(self) -> dict[str, Channel]:
        """The watched channels, by name (their references, warm-up values and flagged runs)."""
        return self._channels.watched

    @property
    def unwatched_(self) -> dict[str, Channel]:
        """The training channels the rule does not watch, scored only to tell a healthy check.

        See `ChannelScores`.
        """
        return self._channels.unwatched

    @property
    def reference_(self) -> Reference:
        """The watched index's z-score reference (see `Reference`)."""
        return self._channels.index.reference

    @property
    def over_threshold_(self) -> int:
        """Consecutive checks whose index score reached the threshold."""
        return self._channels.index.over

    @property
    def baseline_(self) -> float | None:
        """Mean index over the warm-up checks (None until the warm-up is over or when it is 0 checks)."""
        return None if self.checks_decided_ <= self.settings.warmup else self._channels.baseline(self._channels.index)

    # The saved state keeps its flat layout (version 7): each key reads and sets the part that owns it.
    _channel_state = _channels_state("state", "load", "The watched channels' states, by name.")
    _unwatched_state = _channels_state("unwatched_state", "load_unwatched", "The unwatched channels' states, by name.")

    # The rule's and the escalation's counters, under the policy's public names (read and set by the saved state).
    recent_ = _delegated("_rule", "recent", "The last ``trend_window`` index values, for the trend rule.")
    last_action_check_ = _delegated(
        "_escalation", "last_action_check_", "The check number of the last action (None: none yet)."
    )
    last_action_ = _delegated(
        "_escalation", "last_action_", 'The last action (``"warn"``, ``"lower_lr"``, ...), or None.'
    )
    last_action_score_ = _delegated(
        "_escalation",
        "last_action_score_",
        "The score that started the last action (the cooldown compares with it), or None.",
    )
    lr_cuts_ = _delegated("_escalation", "lr_cuts_", "Learning-rate cuts made.")
    rollbacks_ = _delegated("_escalation", "rollbacks_", "Rollbacks made.")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self.settings == other.settings and self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Policy({self.settings!r})"


def _short_cut(
    settings: PolicySettings,
    step: int,
    value: float | None,
    observed: Mapping[str, float | None],
    diverged: bool,
    collapsed: str | None,
) -> tuple[Action, Alarm] | None:
    """The action a check asks for at once, warm-up or not, and its alarm; None: the check goes to the rule.

    A diverged check (NaN or Inf features, loss or gradient norm) asks for ``on_diverged``, which no cooldown holds
    back (see `Escalation`); with ``settings.sentinels``, a check whose
    features an absolute sentinel finds collapsed asks for ``action``. Neither enters any reference.
    """
    broken = [name for name in TRAINING_CHANNELS if not _finite_or_none(observed[name])]
    if diverged or (value is not None and not math.isfinite(value)) or broken:
        what = (
            f"the training {broken[0].replace('_', ' ')} is {observed[broken[0]]}"
            if broken and not diverged
            else "the features diverged (NaN or Inf)"
        )
        alarm = Alarm(
            step=step, value=None, score=None, rule="diverged", reason=what, flagged=("diverged",), onset=step
        )
        return Action(settings.on_diverged), alarm
    if collapsed and settings.sentinels:
        alarm = Alarm(
            step=step, value=value, score=None, rule="sentinel", reason=collapsed, flagged=("collapse",), onset=step
        )
        return Action(settings.action), alarm
    return None


def _finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)
