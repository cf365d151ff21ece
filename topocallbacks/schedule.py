"""The schedule: when a check happens (every ``check_every`` steps, once per step) and when its decision applies.

In the training loop at once, or ``lag`` steps later when a background worker evaluates it (a step every rank knows).
"""

from __future__ import annotations

from typing import Any

import torch

from ._state import StateFields, Stateful
from .settings import ScheduleSettings

__all__ = ["Schedule"]


class Schedule(Stateful):
    """The monitor's schedule: which steps are check steps, which of them are due, and the lag of their decisions.

    Args:
        settings: the schedule settings (``check_every``, ``mode``, ``background``, ``lag``).

    Example:
        >>> schedule = Schedule(ScheduleSettings(check_every=10))
        >>> [step for step in range(25) if schedule.due(step)]
        [0, 10, 20]
        >>> schedule.checked(10)
        >>> schedule.due(10), schedule.due(20)
        (False, True)
    """

    _state = StateFields(version=1, fields={"last_checked_step": "last_checked_step_"})

    def __init__(self, settings: ScheduleSettings) -> None:
        self.settings = settings
        self.last_checked_step_: int | None = None
        self._background: bool | None = settings.background

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
        return step % self.settings.check_every == 0

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

    def apply_at(self, step: int, lag: int | None = None) -> int:
        """The step at which a check of ``step`` is applied: ``lag`` given, else the settings' lag in the background."""
        if lag is None:
            lag = self.settings.apply_lag if self.background else 0
        return step + lag
