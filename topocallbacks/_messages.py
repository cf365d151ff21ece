"""The messages between the training process and the background check worker, pickled over its pipes.

The training process sends a `Start` (answered with `Ready`), then one
[`CheckRequest`][topocallbacks.pipeline.CheckRequest] per check, each answered in order with an `Answer` or a
`Failure`; closing the pipes stops the worker. They live in a module of their own, which imports nothing, so that
both processes unpickle them as the same classes (the worker runs as ``__main__``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Answer", "Failure", "Ready", "Start"]


@dataclasses.dataclass(frozen=True)
class Start:
    """Create the worker's pipeline from ``settings`` (`MonitorSettings.as_dict`), from ``state`` when resuming."""

    settings: dict[str, Any]
    state: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Ready:
    """The worker's pipeline is set up."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """One check's evaluation.

    Attributes:
        record: its record as a dict (None: a streaming window too small to check).
        shared: the pipeline's state after it (`CheckPipeline.share`).
        figures: the diagrams of a TensorBoard figure when one is due.
        others: the other layers' records, when several layers are watched.
    """

    record: dict[str, Any] | None
    shared: dict[str, Any]
    figures: Any = None
    others: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Failure:
    """The request failed in the worker: its traceback."""

    traceback: str
