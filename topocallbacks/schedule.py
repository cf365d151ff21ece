"""The schedule: when a check happens (every ``check_every`` steps, once per step) and when its decision applies.

In the training loop at once, or ``lag`` steps later when a background worker evaluates it (a step every rank knows).
"""

from __future__ import annotations

from typing import Any

import torch

from ._state import StateFields, Stateful
from .check import Plan
from .settings import ScheduleSettings

__all__ = ["Schedule"]


class Schedule(Stateful):
    """The monitor's schedule: which steps are check steps, which of them are due, and the lag of their decisions.

    Args:
        settings: the schedule settings (``check_every``, ``mode``, ``background``, ``lag``).

    Examples:
        >>> schedule = Schedule(ScheduleSettings(check_every=10))
        >>> [step for step in range(25) if schedule.due(step)]
        [0, 10, 20]
        >>> schedule.checked(10)
        >>> schedule.due(10), schedule.due(20)
        (False, True)
        >>> schedule.follow(Plan(intervals=3))  # the overhead budget asks for a check every 3 intervals
        >>> checked = []
        >>> for step in range(11, 80):
        ...     if schedule.due(step):
        ...         schedule.checked(step)
        ...         checked.append(step)
        >>> checked
        [40, 70]
    """

    _state = StateFields(
        version=2,
        fields={"last_checked_step": "last_checked_step_", "plan": "_plan_state", "warned": "warned_"},
    )

    def __init__(self, settings: ScheduleSettings) -> None:
        self.settings = settings
        self.last_checked_step_: int | None = None
        self._background: bool | None = settings.background
        #: The overhead budget's plan in force (see `topocallbacks.budget`): intervals, where, probe size.
        self.plan = Plan(background=bool(settings.background))
        self.warned_ = False  # the one warning that the budget cannot be met was given

    @property
    def streaming(self) -> bool:
        """Whether the training batches' own features are watched (``mode="stream"``)."""
        return self.settings.mode == "stream"

    def should_check(self, step: int) -> bool:
        """Whether ``step`` is a check step.

        Every ``check_every`` steps: from step 0 in probe mode, from step ``check_every`` on in streaming mode (the
        window of step 0 would hold a single batch).
        """
        if step == 0 and self.streaming:
            return False
        every = self.settings.check_every
        last = self.last_checked_step_
        return step % every == 0 and (last is None or step - last >= self.plan.intervals * every or step < last)

    def due(self, step: int) -> bool:
        """Whether a check is due at ``step``: a check step not checked yet.

        Gradient accumulation and a resumed run reach the same step more than once; it is checked once.
        """
        return self.should_check(step) and step != self.last_checked_step_

    def checked(self, step: int) -> None:
        """Remember that ``step`` was checked."""
        self.last_checked_step_ = step

    @property
    def background(self) -> bool:
        """Whether checks run in the background worker (decided at the first check when the setting is None)."""
        return bool(self._background)

    def settle_background(self, sample: Any) -> None:
        """Settle ``background`` at the first check: on when the model or features live on an accelerator."""
        if self._background is None:
            device = None
            if isinstance(sample, torch.nn.Module):
                device = next((p.device for p in sample.parameters()), None)
            elif isinstance(sample, torch.Tensor):
                device = sample.device
            self._background = device is not None and device.type != "cpu"

    def follow(self, plan: Plan) -> None:
        """Take the overhead budget's ``plan`` (its cadence, and where checks are evaluated)."""
        self.plan = plan
        self._background = plan.background

    @property
    def _plan_state(self) -> dict[str, Any]:
        return {**self.plan.as_dict(), "background_setting": self._background}

    @_plan_state.setter
    def _plan_state(self, value: dict[str, Any]) -> None:
        fields = {k: v for k, v in value.items() if k != "background_setting"}
        self.plan = Plan(**fields)
        self._background = value["background_setting"]

    def apply_at(self, step: int, lag: int | None = None) -> int:
        """The step a check of ``step`` is applied at: ``lag``, else in the background the plan's or settings' lag."""
        if lag is None:
            planned = self.plan.lag if self.plan.lag is not None else self.settings.apply_lag
            lag = planned if self.background else 0
        return step + lag
