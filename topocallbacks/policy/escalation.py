"""What the policy does once a rule holds: escalate the action, hold it back in a cooldown, or carry it out.

An action is escalated once its budget of cuts or rollbacks is spent; the cuts, rollbacks and last action are counted.
"""

from __future__ import annotations

from ..settings import Action, PolicySettings
from .decision import Alarm, Decision

__all__ = ["Escalation"]


class Escalation:
    """Turns an `Alarm` into a [`Decision`][topocallbacks.policy.Decision].

    The action is escalated once its budget is spent: ``lower_lr`` to ``after_max_lr_cuts`` after ``max_lr_cuts``
    cuts, ``rollback`` to ``after_max_rollbacks`` after ``max_rollbacks`` rollbacks. Within ``cooldown`` checks of
    an action, the *same* action is held back (the decision says so) unless the score is above the one that started
    the cooldown; a stronger action (``warn`` < ``lower_lr`` < ``rollback`` < ``stop``) always goes through, so a
    warning never silences a stop, and so does a rollback (after one, the state is the snapshot's: a new alarm is a
    new fault).

    Args:
        settings: the policy's settings.

    Attributes:
        lr_cuts_: learning-rate cuts made.
        rollbacks_: rollbacks made.
        last_action_check_: the check number of the last action (None: none yet).
        last_action_: the last action's value (``"warn"``, ...), or None.
        last_action_score_: the score that started the last action (the cooldown compares with it), or None.
    """

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.last_action_check_: int | None = None
        self.last_action_: str | None = None
        self.last_action_score_: float | None = None
        self.lr_cuts_ = 0
        self.rollbacks_ = 0

    def respond(self, action: Action, alarm: Alarm, check: int) -> Decision:
        """The decision on ``alarm`` at check number ``check``: ``action``, escalated, held back or carried out.

        A diverged check's action is never held back.

        Args:
            action: the action the rule asks for.
            alarm: what held.
            check: the check's number (the cooldown counts checks).
        """
        action, reason = self.escalate(action, alarm.reason)
        held = None if alarm.rule == "diverged" else self.held_back(action, alarm.score, check)
        if held is not None:
            return Decision(
                action=Action.NONE, reason=f"{reason}; {held}", step=alarm.step, value=alarm.value,
                score=alarm.score, rule=alarm.rule, held_back=action, flagged=alarm.flagged, onset=alarm.onset,
                scores=alarm.scores,
            )  # fmt: skip
        return self.act(action, alarm, reason, check)

    def escalate(self, action: Action, reason: str) -> tuple[Action, str]:
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

    def held_back(self, action: Action, score: float | None, check: int) -> str | None:
        """Why a cooldown holds ``action`` back at check number ``check``, or None when it goes through."""
        s = self.settings
        if action is Action.NONE or self.last_action_check_ is None or self.last_action_ is None:
            return None
        since = check - self.last_action_check_
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

    def act(self, action: Action, alarm: Alarm, reason: str, check: int) -> Decision:
        """Carry out ``action`` at check number ``check``: count it and say what it does (its factor, its budget)."""
        s = self.settings
        if action is Action.NONE:
            return Decision(
                action=Action.NONE, reason=f"{reason} (action: none)", step=alarm.step, value=alarm.value,
                score=alarm.score, rule=alarm.rule, flagged=alarm.flagged, onset=alarm.onset, scores=alarm.scores,
            )  # fmt: skip
        refired = self.last_action_ == Action.ROLLBACK.value and check - (self.last_action_check_ or 0) <= 2
        self.last_action_check_ = check
        self.last_action_ = action.value
        self.last_action_score_ = alarm.score
        factor, skip = None, "now"
        if action is Action.LOWER_LR:
            self.lr_cuts_ += 1
            factor = s.lr_factor
            reason = f"{reason}: learning rate x {factor} (cut {self.lr_cuts_} of {s.max_lr_cuts})"
        elif action is Action.ROLLBACK:
            self.rollbacks_ += 1
            factor, skip, how = rollback_plan(s, self.rollbacks_, refired)
            cut = "" if factor is None else f", learning rate x {factor}"
            reason = (
                f"{reason}: roll back to the newest healthy snapshot before step {alarm.onset}{cut}{how} "
                f"(rollback {self.rollbacks_} of {s.max_rollbacks})"
            )
        checkpoint = s.checkpoint and action in (Action.LOWER_LR, Action.ROLLBACK, Action.STOP)
        return Decision(
            action=action, reason=reason, step=alarm.step, value=alarm.value, score=alarm.score, rule=alarm.rule,
            lr_factor=factor, checkpoint=checkpoint, held_back=None, flagged=alarm.flagged, onset=alarm.onset,
            scores=alarm.scores, skip=skip,
        )  # fmt: skip


def rollback_plan(settings: PolicySettings, number: int, refired: bool) -> tuple[float | None, str, str]:
    """The ``number``-th rollback's rate cut (None: none), its skip and what ``rollback_order`` made of them.

    The skip is ``"now"`` (the rescuer skips ``rollback_skip`` updates after the restore), ``"later"`` (only if the
    training loss flags again at the next check) or ``"none"``. ``refired``: the previous action was a rollback
    within two checks of this one.
    """
    s = settings
    asked = s.rollback_lr_factor if number == 1 else (s.rollback_lr_factor or s.lr_factor)
    cut = s.rollback_lr_factor or s.lr_factor
    if s.rollback_order == "skip_if_confirmed":
        return asked, "later", ", the skip only if the loss flags again at the next check"
    if s.rollback_order == "from_second":
        if number == 1:
            return None, "none", ", no skip and no cut at the first rollback"
        return cut, "now", ""
    if s.rollback_order == "cut_if_refired":
        if refired:
            return cut, "now", " as it fired again within two checks of the last rollback"
        return None, "now", ", no cut (no rollback in the two checks before)"
    return asked, "now", ""
