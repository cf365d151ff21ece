"""The policy's channels, each scored on its own, each with its reference, warm-up values and run of flagged checks.

The index is scored by ``settings.score``; the training loss and gradient norm by a z-score with a noise floor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..exceptions import InputError
from ..settings import PolicySettings
from .scores import Reference, at_threshold, robust_zscore, score_value

__all__ = ["TRAINING_CHANNELS", "TRAINING_NOISE_FLOOR", "Channel", "ChannelScores"]

#: The training channels the adapters pass beside the probe's index.
TRAINING_CHANNELS = ("loss", "grad_norm")
#: A training channel's noise estimate is at least this fraction of its scale (the largest value it reached at a
#: healthy check): a loss that has fallen to 1e-5 from 3 does not read a blip to 0.04 as thousands of deviations.
TRAINING_NOISE_FLOOR = 0.01


class Channel:
    """What the policy keeps about one channel: its reference, warm-up values and flagged run."""

    def __init__(self, settings: PolicySettings) -> None:
        self.reference = Reference(2 * settings.zscore_window, max(settings.zscore_window, settings.patience))
        self.warmup: list[float] = []
        self.over = 0  # consecutive checks at or above the threshold
        self.onset: int | None = None  # the step of the first of them
        #: The last check at which the channel's rule held: {"check", "step", "onset", "rule", "reason"} (a rule that
        #: requires several channels counts a channel that held at the check before, see ChannelRule).
        self.last_hold: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        """A JSON-ready copy of what the channel keeps."""
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
        """Restore `state`."""
        self.reference.values = [float(v) for v in state["reference"]]
        self.reference.held = [float(v) for v in state["held"]]
        self.reference.scale = float(state["scale"])
        self.warmup = [float(v) for v in state["warmup"]]
        self.over = int(state["over"])
        self.onset = None if state["onset"] is None else int(state["onset"])
        self.last_hold = None if state["last_hold"] is None else dict(state["last_hold"])


class ChannelScores:
    """The channels the rule watches, and the training channels it does not, each scored at every check.

    A watched channel is scored by ``settings.score`` (the value, its excess over its warm-up mean, or its z-score
    against its recent checks that stayed below the threshold, see `Reference`); a
    training channel is always z-scored, its noise floored at `TRAINING_NOISE_FLOOR` of its scale. The
    training channels the rule does not watch are still scored, by the default rule's z-score (whatever the index's
    score): a check where one of them spikes is not healthy (no rollback snapshot), though nothing acts on it
    (`Decision.unsettled`).

    Args:
        settings: the policy's settings.
    """

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.watched = {name: Channel(settings) for name in settings.channels}
        self.spike = PolicySettings(zscore_window=settings.zscore_window, patience=settings.patience)
        self.unwatched = {name: Channel(self.spike) for name in TRAINING_CHANNELS if name not in self.watched}

    @property
    def index(self) -> Channel:
        """The watched index (or, when the rule does not watch it, the first watched channel)."""
        return self.watched.get("index") or next(iter(self.watched.values()))

    def warm_up(self, observed: Mapping[str, float | None]) -> None:
        """Add a warm-up check's values to every channel's warm-up values and reference."""
        for name, channel in [*self.watched.items(), *self.unwatched.items()]:
            seen = observed[name]
            if seen is not None:
                channel.warmup.append(seen)
                channel.reference.add(seen, flagged=False)

    def score(self, name: str, value: float | None, step: int) -> float | None:
        """A watched channel's score at a check after the warm-up (None: no value or no score yet).

        Updates the channel's reference and its run of flagged checks.
        """
        return self._score(self.watched[name], name, value, step, self.threshold(name))

    def unsettled(self, observed: Mapping[str, float | None], step: int) -> tuple[str, ...]:
        """The unwatched training channels that spiked at a check after the warm-up (scores them all)."""
        threshold = self.spike.threshold
        return tuple(
            name
            for name, channel in self.unwatched.items()
            if at_threshold(self._score(channel, name, observed[name], step, threshold), threshold)
        )

    def _score(self, channel: Channel, name: str, value: float | None, step: int, threshold: float) -> float | None:
        if value is None:
            channel.over, channel.onset = 0, None
            return None
        if name in TRAINING_CHANNELS:
            reference = channel.reference
            floor = TRAINING_NOISE_FLOOR * reference.scale
            values = np.asarray(reference.values, dtype=np.float64)
            score = robust_zscore(values, value, 1, self.settings.zscore_window, floor)
        else:
            score = score_value(self.settings, channel.reference.values, value, self.baseline(channel))
        flagged = at_threshold(score, threshold)
        channel.reference.add(value, flagged)
        if flagged:
            channel.over += 1
            if channel.over == 1:
                channel.onset = step
        else:
            channel.over, channel.onset = 0, None
        return score

    def baseline(self, channel: Channel) -> float | None:
        """The mean of a channel's warm-up values, once the warm-up is over (None: it had none)."""
        return float(np.mean(channel.warmup)) if channel.warmup else None

    def threshold(self, name: str) -> float:
        """A channel's threshold: ``threshold``, but for a training channel under a value or baseline score.

        Training channels are always z-scored: under ``score="value"`` or ``"baseline"`` their threshold is the
        default rule's z-score threshold, not the index's.
        """
        s = self.settings
        return s.threshold if name not in TRAINING_CHANNELS or s.score == "zscore" else self.spike.threshold

    def describe(self, name: str, value: float, score: float | None) -> str:
        """A channel's value and score, in words."""
        s = self.settings
        what = "index" if name == "index" else name.replace("_", " ")
        if s.score == "zscore" or name in TRAINING_CHANNELS:
            shown = "none yet" if score is None else f"{score:.2f}"
            return f"{what} {value:.4g} at z = {shown} against its last {s.zscore_window} checks"
        if s.score == "baseline":
            if score is None:
                return f"{what} {value:.4f} (no baseline yet)"
            return f"{what} - baseline {score:.4f} (baseline {value - score:.4f})"
        return f"{what} {value:.4f}"

    def restart(self) -> None:
        """After an action, every watched channel's patience count starts again."""
        for channel in self.watched.values():
            channel.over, channel.onset, channel.last_hold = 0, None, None

    def state(self) -> dict[str, dict[str, Any]]:
        """The watched channels' states, by name."""
        return {name: channel.state() for name, channel in self.watched.items()}

    def load(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore `state`.

        Raises:
            InputError: the saved policy watched other channels.
        """
        if set(state) != set(self.watched):
            raise InputError(
                f"the saved policy watched channels {sorted(state)}, this one watches {sorted(self.watched)}"
            )
        for name, saved in state.items():
            self.watched[name].load(saved)

    def unwatched_state(self) -> dict[str, dict[str, Any]]:
        """The unwatched training channels' states, by name."""
        return {name: channel.state() for name, channel in self.unwatched.items()}

    def load_unwatched(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore `unwatched_state` (a channel this policy watches, or that the state lacks, is skipped)."""
        for name, saved in state.items():
            if name in self.unwatched:
                self.unwatched[name].load(saved)
