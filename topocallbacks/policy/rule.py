"""The rule across the policy's channels: ``require`` of them must hold, one at the check before counting too.

A channel holds when its score stayed at its threshold for ``patience`` checks, or when the index rises on trend.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..settings import Action, PolicySettings
from .channels import Channel, ChannelScores
from .decision import Alarm, Decision
from .scores import at_threshold

__all__ = ["ChannelRule"]

#: A channel that holds: (its name, the rule that held, why in words).
_Hold = tuple[str, str, str]


class ChannelRule:
    """Whether the rule holds across the watched channels at a check after the warm-up.

    A channel *holds* when either

    * threshold: its score is ``>= threshold`` for ``patience`` consecutive checks; or
    * trend (the index only, when ``trend_window`` is set): the least-squares slope of its last ``trend_window``
      values, per check, is ``>= trend_slope``.

    The rule holds when ``require`` channels hold at once; when it requires several, a channel whose rule held at
    the check just before counts too (the training loss is the mean since the last check, so a jump in the index at
    one check is often confirmed by the loss at the next), as long as one channel holds at this check.

    Args:
        settings: the policy's settings.
        channels: the channels it scores (`ChannelScores`).
    """

    def __init__(self, settings: PolicySettings, channels: ChannelScores) -> None:
        self.settings = settings
        self.channels = channels
        self.recent: list[float] = []  # the last trend_window index values, for the trend rule

    def judge(
        self, step: int, value: float | None, observed: Mapping[str, float | None], check: int
    ) -> Decision | Alarm:
        """Score the watched channels at check number ``check``: an `Alarm` when the rule holds.

        Else the decision to do nothing, whose reason says how far each channel is from holding.
        """
        s = self.settings
        scores = {name: self.channels.score(name, observed[name], step) for name in self.channels.watched}
        flagged = tuple(name for name, score in scores.items() if at_threshold(score, self.channels.threshold(name)))
        shown = None if list(self.channels.watched) == ["index"] else scores
        if "index" in self.channels.watched and value is not None and s.trend_window is not None:
            self.recent = [*self.recent, value][-s.trend_window :]
        holding, carried, onsets, waiting = self._holds(step, observed, scores, check)
        score = (
            scores.get("index")
            if "index" in scores
            else max((v for v in scores.values() if v is not None), default=None)
        )
        if not holding and all(observed[name] is None for name in self.channels.watched):
            return Decision(Action.NONE, "no index value at this check", step)
        if not holding or len(holding) + len(carried) < s.require:
            reason = "; ".join([r for _, _, r in holding] + waiting)
            if holding:
                reason += f" ({len(holding)} of the {s.require} channels required)"
            return Decision(
                action=Action.NONE, reason=reason, step=step, value=value, score=score, flagged=flagged, scores=shown
            )
        held_scores = [v for name, _, _ in holding if (v := scores[name]) is not None]
        if "index" not in [name for name, _, _ in holding]:  # the cooldown compares the strongest channel's score
            score = max(held_scores, default=score)
        holding = holding + carried
        onset = min((o for o in onsets.values() if o is not None), default=step)
        rule = holding[0][1] if len({r for _, r, _ in holding}) == 1 else "+".join(r for _, r, _ in holding)
        reason = "; ".join(r for _, _, r in holding)
        return Alarm(
            step=step, value=value, score=score, rule=rule, reason=reason, flagged=flagged, onset=onset, scores=shown
        )

    def _holds(
        self, step: int, observed: Mapping[str, float | None], scores: Mapping[str, float | None], check: int
    ) -> tuple[list[_Hold], list[_Hold], dict[str, int | None], list[str]]:
        """The channels that hold at this check, and those that held at the check before.

        The second count when the rule requires several; also each one's onset, and why the others do not hold.
        """
        holding: list[_Hold] = []
        carried: list[_Hold] = []
        onsets: dict[str, int | None] = {}
        waiting: list[str] = []
        for name, channel in self.channels.watched.items():
            hold = channel.last_hold
            before = hold if hold is not None and hold["check"] == check - 1 else None
            seen = observed[name]
            rule, reason = (None, "") if seen is None else self._rule(name, channel, seen, scores[name])
            if rule is not None:
                holding.append((name, rule, reason))
                onsets[name] = channel.onset
                channel.last_hold = {"check": check, "step": step, "onset": channel.onset, "rule": rule,
                                     "reason": reason}  # fmt: skip
            elif before is not None and self.settings.require > 1:
                carried.append(
                    (name, before["rule"], f"{before['reason']} at the check before (step {before['step']})")
                )
                onsets[name] = before["onset"]
            elif reason:
                waiting.append(reason)
        return holding, carried, onsets, waiting

    def _rule(self, name: str, channel: Channel, value: float, score: float | None) -> tuple[str | None, str]:
        """Which rule holds for a channel at this check (None: neither), and why, in words."""
        s = self.settings
        what = self.channels.describe(name, value, score)
        threshold = self.channels.threshold(name)
        if channel.over >= s.patience:
            return "threshold", f"{what} >= threshold {threshold} for {channel.over} consecutive checks"
        trend = name == "index" and s.trend_window is not None and s.trend_slope is not None
        if trend and len(self.recent) >= s.trend_window:  # type: ignore[operator]
            slope = float(np.polyfit(np.arange(s.trend_window), np.asarray(self.recent), 1)[0])  # type: ignore[arg-type]
            if slope >= s.trend_slope:  # type: ignore[operator]
                return "trend", (
                    f"index rising {slope:.4f} per check over the last {s.trend_window} checks (>= {s.trend_slope})"
                )
        if channel.over:
            return None, (
                f"{what} >= threshold {threshold} for {channel.over} of {s.patience} required consecutive checks"
            )
        return None, f"{what} below threshold {threshold}"
