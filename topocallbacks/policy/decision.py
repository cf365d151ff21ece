"""What the policy hands on: a [`Decision`][topocallbacks.Decision], the action asked of the training adapter and why.

Between its parts, an `Alarm` is a rule or short-cut that held, before the escalation makes it a decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..settings import Action

__all__ = ["Alarm", "Decision"]


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
        thresholds: each watched channel's threshold (what its score is compared with), or None.
        skip: for a rollback, when its updates are skipped (``PolicySettings.rollback_order``): ``"now"`` (after
            the restore), ``"later"`` (only if the training loss flags again at the next check) or ``"none"``.
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
    thresholds: dict[str, float] | None = None
    skip: str = "now"

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
        """The inverse of `as_dict`."""
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


@dataclasses.dataclass(frozen=True)
class Alarm:
    """A rule that held (or a diverged or collapsed check) before it becomes a [`Decision`][topocallbacks.Decision].

    The escalation (`Escalation`) turns it into one: the action, escalated
    once its budget is spent, held back by a cooldown or carried out. The fields are the decision's.

    Attributes:
        step: the training step of the check.
        value: the index value the rule saw (None: diverged).
        score: the score the cooldown compares (None: a short-cut, which has no score).
        rule: ``"threshold"``, ``"trend"`` (joined by ``+`` when several channels held by different rules),
            ``"sentinel"`` or ``"diverged"``.
        reason: why, in words (the escalation appends what it does).
        flagged: the channels at their threshold (``("collapse",)``, ``("diverged",)`` for a short-cut).
        onset: the step of the first check of the run of flagged checks.
        scores: each watched channel's score when the rule watches more than the index, else None.
    """

    step: int
    value: float | None
    score: float | None
    rule: str
    reason: str
    flagged: tuple[str, ...]
    onset: int | None
    scores: dict[str, float | None] | None = None
