"""The baselines, each with its natural action, implemented here from their published rules (none is imported).

Per-step detectors see each step's training loss and gradient norm (before clipping) and return a
:class:`~faults.StepChange` for that step; the standard-metric detector sees the held-out metric at every check and
acts through the same :class:`~topocallbacks.interventions.Actuator` as the library's monitor.
"""

from __future__ import annotations

import collections
import copy
import math
from typing import Any

import numpy as np
from faults import StepChange

from topocallbacks.policy import Reference, trailing_zscore
from topocallbacks.snapshots import SnapshotStore


class StepDetector:
    """A detector that judges every training step (no probe, no check)."""

    needs_checks = False

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        raise NotImplementedError

    def on_check(self, position: int, observation: Any, actuator: Any) -> list[dict[str, Any]]:
        return []

    def clone(self) -> StepDetector:
        return copy.deepcopy(self)


class LightningSpikeDetection(StepDetector):
    """Lightning's ``SpikeDetection`` (``lightning.fabric.utilities.spike``) at its defaults: it stops training.

    Rule (``mode="min"``, ``window=10``, ``warmup=1``, ``atol=None``, ``rtol=2.0``, ``finite_only=True``): from the
    second batch on, a loss is a spike when it is non-finite, or when it is not below the previous loss and
    ``|loss - running mean| >= 2 * running mean`` (loss >= 3x the mean of the last 10 finite losses); the callback
    then raises ``TrainingSpikeException`` after the step (and writes the batches to skip on a restart, which this
    suite does not do: the run ends, with the state at the stop).
    """

    def __init__(self, window: int = 10, warmup: int = 1, rtol: float = 2.0) -> None:
        self.window, self.warmup, self.rtol = window, warmup, rtol
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.last = 0.0
        self.batches = 0

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        batch, self.batches = self.batches, self.batches + 1
        if batch >= self.warmup and self._is_spike(loss):
            return StepChange("stop", stop=True)
        if math.isfinite(loss):
            self.losses.append(loss)
            self.last = loss
        return None

    def _is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        if loss - self.last <= 0.0:
            return False
        mean = float(np.mean(self.losses)) if self.losses else 0.0
        return abs(loss - mean) >= abs(self.rtol * mean)


class OlmoSkipStep(StepDetector):
    """OLMo-core's skip step (``olmo_core.optim.SkipStepOptimizer``, e.g. ``SkipStepAdamW``) at its defaults.

    Rule (``rolling_interval_length=128``, ``sigma_factor=6``): once at least 64 losses were seen, the optimiser
    step is skipped when the loss, or the gradient norm, is above the mean + 6 standard deviations (unbiased) of the
    previous ones in the rolling window of the last 128 steps (non-finite values excluded; a non-finite loss or norm is
    always skipped); every step's values enter the window, skipped or not.
    A skipped step leaves the weights and the optimiser state as they were; the schedule still advances (OLMo-core's
    trainer sets the rate from its global step).
    """

    def __init__(self, interval: int = 128, sigma: float = 6.0) -> None:
        self.interval, self.sigma = interval, sigma
        self.losses: collections.deque[float] = collections.deque(maxlen=interval + 1)
        self.norms: collections.deque[float] = collections.deque(maxlen=interval + 1)

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        self.losses.append(loss)
        self.norms.append(grad_norm)
        if len(self.losses) < max(2, self.interval // 2):
            return None
        keep = self._passes(self.losses) and self._passes(self.norms)
        return None if keep else StepChange("skip", skip=True)

    def _passes(self, window: collections.deque[float]) -> bool:
        history = np.asarray(list(window)[:-1], dtype=np.float64)
        history = history[np.isfinite(history)]  # non-finite values stay out of the statistics
        latest = window[-1]
        if not math.isfinite(latest) or history.size < 2:
            return False
        return latest <= float(history.mean()) + self.sigma * float(history.std(ddof=1))


class RecomputeStep(OlmoSkipStep):
    """Recompute the last step: the fault-tolerance practice of redoing a step whose loss or gradient is suspect.

    A step flagged by OLMo-core's rule above (6 sigma over the last 128 steps, loss or gradient norm) has its
    gradients discarded and computed again on the same batch before the update. This is what guards against a
    transient hardware fault (a bit flip in one step's compute); it cannot help against a bad batch or a bad
    learning rate, which compute the same gradients again. It is here as the control the rescue issue asked for.
    """

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        change = super().on_step(position, loss, grad_norm)
        return None if change is None else StepChange("recompute", recompute=True)


class FoundryKillLossSpike(StepDetector):
    """llm-foundry's ``KillLossSpike`` callback (``llmfoundry.callbacks.kill_loss_spike``), enabled (it stops).

    Rule at its defaults (``patience=4``, ``outlier_multiplier=2``, ``window_size=100``, ``loss_cap=10``), with
    ``log_only=False`` so that it raises ``LossSpikeError``: once the window holds 100 losses, a loss ``>= 2x`` the
    window's mean is an outlier, and more than 4 consecutive outliers stop the run; after ``2 x window`` steps, the
    run also stops when half of the window is above the loss cap (the largest loss of the first window, at most 10).
    The window grows to 5 % of the run when that is more than 100 steps (never here).
    """

    def __init__(self, patience: int = 4, multiplier: float = 2.0, window: int = 100, cap: float = 10.0) -> None:
        self.patience, self.multiplier, self.window, self.cap = patience, multiplier, window, cap
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.outliers = 0
        self.cap_set = False
        self.batches = 0

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        step, self.batches = self.batches, self.batches + 1
        stop = False
        if len(self.losses) == self.window:
            if not self.cap_set and step == self.window:
                self.cap, self.cap_set = min(max(self.losses), self.cap), True
            mean = float(np.mean(self.losses))
            if loss >= mean * self.multiplier:
                self.outliers += 1
                stop = self.outliers > self.patience
            else:
                self.outliers = 0
                if step >= 2 * self.window:
                    stop = sum(1 for value in self.losses if value > self.cap) >= self.window / 2
        self.losses.append(loss)
        return StepChange("stop", stop=True) if stop else None


class ZClip(StepDetector):
    """ZClip (Kumar et al., 2025, arXiv:2504.02507; ``bluorion-com/ZClip``), always on, ``z_thresh=2.5``.

    The first ``warmup=25`` gradient norms initialise an EMA of their mean and variance (``alpha=0.97``); then a
    norm whose z-score ``(g - mean) / std`` exceeds 2.5 is clipped. ``mode="zscore"`` with the paper's default
    ``clip_option="adaptive_scaling"`` clips to ``mean + 2.5 std / (z / 2.5)`` (the larger the outlier, the harder);
    ``clip_option="mean_std"`` clips to ``mean + 2.5 std``. The EMA is updated with the clipped norm. No fixed
    ``max_grad_norm`` is added (the trainee's own clipping, GPT-2's at 1.0, still applies after it).
    """

    def __init__(
        self, z: float = 2.5, alpha: float = 0.97, warmup: int = 25, clip_option: str = "adaptive_scaling"
    ) -> None:
        self.z, self.alpha, self.warmup, self.clip_option = z, alpha, warmup, clip_option
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        if self.mean is None:
            self.buffer.append(grad_norm)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.buffer = []
            return None
        std = self.var**0.5
        z = (grad_norm - self.mean) / (std + 1e-6)
        clip = None
        if z > self.z:
            scale = self.z / z if self.clip_option == "adaptive_scaling" else 1.0  # harder for larger outliers
            clip = self.mean + self.z * std * scale
        effective = grad_norm if clip is None else clip
        self.mean = self.alpha * self.mean + (1 - self.alpha) * effective
        self.var = self.alpha * self.var + (1 - self.alpha) * (effective - self.mean) ** 2
        return None if clip is None else StepChange("clip", clip_to=clip)


class MetricDetector:
    """The standard metric itself as a detector: rollback and a learning-rate cut when it degrades.

    At every check (the cadence the probe's compute buys) the metric is measured on the probe's held-out samples
    (images: accuracy on the probe's 512 images; text: the loss on the 512 probe windows). After a warm-up of
    ``warmup`` checks a check is *flagged* when the metric is worse than the median of its recent unflagged checks
    by ``threshold`` robust standard deviations (the library's ``trailing_zscore``, window 10), or worse than its
    best so far by more than ``margin`` (relative). A flagged check rolls back to the newest unflagged snapshot
    before it (two kept, as the library keeps) and multiplies the learning rate by ``lr_factor``; after
    ``max_rollbacks`` rollbacks the next alarm stops the run, keeping the newest unflagged snapshot. The same action
    within ``cooldown`` checks of the last one is held back, as the library's policy does.
    """

    needs_checks = True

    def __init__(
        self,
        higher_is_better: bool,
        threshold: float = 4.5,
        margin: float = 0.10,
        warmup: int = 10,
        window: int = 10,
        lr_factor: float = 0.5,
        max_rollbacks: int = 2,
        keep: int = 2,
        cooldown: int = 5,
    ) -> None:
        self.direction = -1 if higher_is_better else 1  # the z-score direction of "worse"
        self.threshold, self.margin, self.warmup, self.window = threshold, margin, warmup, window
        self.lr_factor, self.max_rollbacks, self.cooldown = lr_factor, max_rollbacks, cooldown
        self.reference = Reference(2 * window, window)
        self.snapshots = SnapshotStore(keep)
        self.best: float | None = None
        self.checks = 0
        self.rollbacks = 0
        self.last_action: int | None = None

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshots.nbytes

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        return None

    def _worse_than_best(self, value: float) -> bool:
        if self.best is None:
            return False
        if self.direction < 0:
            return value < self.best * (1 - self.margin)
        return value > self.best * (1 + self.margin)

    def on_check(self, position: int, observation: Any, actuator: Any) -> list[dict[str, Any]]:
        value = float(observation.probe_metric)
        self.checks += 1
        flagged = not math.isfinite(value)
        if not flagged and self.checks > self.warmup:
            z = trailing_zscore(self.reference.values, value, direction=self.direction, window=self.window)
            flagged = (z is not None and z >= self.threshold) or self._worse_than_best(value)
        if math.isfinite(value):
            self.reference.add(value, flagged)
        if not flagged:
            if self.best is None or (value > self.best if self.direction < 0 else value < self.best):
                self.best = value
            self.snapshots.add(position, actuator.snapshot(), None)
            return []
        if self.last_action is not None and self.checks - self.last_action <= self.cooldown:
            return []
        self.last_action = self.checks
        target = self.snapshots.newest_before(position)
        if self.rollbacks >= self.max_rollbacks or target is None:
            actuator.request_stop()
            newest = self.snapshots.snapshots[-1] if self.snapshots.snapshots else None
            if newest is not None:
                actuator.save_snapshot(newest.load(), f"metric-last-healthy-step{newest.step}")
            return [{"position": position, "action": "stop", "snapshot_step": None, "steps_lost": None}]
        self.rollbacks += 1
        actuator.restore(target.load())
        self.snapshots.drop_after(target.step)
        actuator.scale_learning_rate(self.lr_factor)
        return [
            {"position": position, "action": "rollback", "snapshot_step": target.step,
             "steps_lost": position - target.step}
        ]  # fmt: skip

    def clone(self) -> MetricDetector:
        twin = copy.copy(self)
        twin.reference = copy.deepcopy(self.reference)
        twin.snapshots = SnapshotStore(self.snapshots.keep)
        twin.snapshots.snapshots = [copy.copy(s) for s in self.snapshots.snapshots]
        return twin
