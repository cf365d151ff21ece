"""The means of acting: the `Actuator` interface, its actuators, rate cuts that survive the scheduler, the skip.

An `Actuator` is the small interface each training adapter implements with its framework's own means (save a
checkpoint, scale the learning rate, request a stop, take and restore a snapshot, skip updates); the rescuer
(`topocallbacks.rescue.Rescuer`, not on the API page) carries a [`Decision`][topocallbacks.policy.Decision] out
through it. What a snapshot copies lives in [`topocallbacks.snapshots`][topocallbacks.snapshots]. No training
framework is imported here.

A learning-rate cut must survive the scheduler. ``LambdaLR``-family schedulers recompute the rate from
``base_lrs`` at every step, ``OneCycleLR`` from ``initial_lr``/``max_lr``/``min_lr`` stored in the param groups,
``CyclicLR`` from ``base_lrs``/``max_lrs``, and recursive ones (cosine, ``LinearLR``, ``ExponentialLR``) from the
current rate. Scaling all of these together keeps the cut in effect at every later step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeAlias

from ._validation import check_int, check_number
from .exceptions import InputError, SnapshotUnsupported
from .snapshots import capture_state, live_state_nbytes, restore_state, save_on_rank_zero

__all__ = [
    "Actuator",
    "LoopActuator",
    "StateActuator",
    "current_learning_rates",
    "scale_learning_rate",
    "skip_updates",
    "updates_left_to_skip",
]


class Actuator(Protocol):
    """What a training framework must offer for decisions to be carried out (one per adapter).

    Every method is called on every rank at the same step; each returns what it did, in words, for the history.
    """

    def scale_learning_rate(self, factor: float) -> str:
        """Multiply the learning rate by ``factor`` now and at every later scheduler step."""

    def request_stop(self) -> str:
        """Ask the training loop to stop after this step."""

    def checkpoint_location(self, tag: str) -> str:
        """Where `save_checkpoint` will write the checkpoint named by ``tag``, in words."""

    def save_checkpoint(self, tag: str) -> None:
        """Save (or ask the framework to save) a checkpoint of the current state, named by ``tag``."""

    def snapshot(self) -> Any:
        """A copy of this rank's training state in host memory (`capture_state`), for ``rollback``."""

    def restore(self, snapshot: Any) -> str:
        """Load `snapshot`'s copy back in place, on this rank (`restore_state`)."""

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        """Write a snapshot to a file named by ``tag`` (rank 0) and say where, so a stop keeps the last good state."""

    def skip_updates(self, count: int) -> str:
        """Skip the next ``count`` optimizer updates (`skip_updates`), for ``rollback_skip``."""

    def snapshot_nbytes(self) -> int:
        """About the bytes one `snapshot` will take (`live_state_nbytes`), before taking it (optional)."""


class LoopActuator:
    """The `Actuator` of a plain PyTorch loop: ``monitor.act(record, LoopActuator(optimizer, scheduler))``.

    A learning-rate cut scales the optimizers and schedulers together (`scale_learning_rate`); a stop sets
    `stop_requested`, which the loop reads to break; a rescue checkpoint is ``torch.save(state(), path)`` in
    ``directory`` (``<tag>.pt``, the tag naming the action and the step), written on rank 0 only. A rollback
    restores ``model``, the optimizers, the schedulers and ``scaler`` in place from a snapshot
    (`capture_state`), and the loop goes on with its next batch.

    Args:
        optimizers: a torch optimizer or a list of them.
        schedulers: their learning-rate schedulers (one, a list, or None).
        model: the model, required for ``rollback``.
        scaler: a ``torch.amp.GradScaler``, restored with the rest (None: none).
        directory: where rescue checkpoints go (None: none are saved, and the history says so).
        state: returns what a rescue checkpoint holds, e.g. ``lambda: {"model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "monitor": monitor.state_dict()}``; required with ``directory``.

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> actuator = LoopActuator(optimizer)
        >>> actuator.scale_learning_rate(0.5), current_learning_rates([optimizer])
        ('learning rate x 0.5', [0.05])
        >>> actuator.request_stop(), actuator.stop_requested
        ('stop requested', True)
    """

    def __init__(
        self,
        optimizers: Any,
        schedulers: Any = None,
        *,
        model: Any = None,
        scaler: Any = None,
        directory: str | os.PathLike[str] | None = None,
        state: Callable[[], Any] | None = None,
    ) -> None:
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not self.optimizers or not all(hasattr(o, "param_groups") for o in self.optimizers):
            raise InputError(f"`optimizers` must be a torch optimizer or a list of them, got {optimizers!r}")
        self.schedulers = (
            [] if schedulers is None else list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
        )
        if directory is not None and state is None:
            raise InputError("`state` is required with `directory`: a function returning what a checkpoint holds")
        if state is not None and not callable(state):
            raise InputError(f"`state` must be a function returning what a checkpoint holds, got {state!r}")
        if model is not None and not hasattr(model, "load_state_dict"):
            raise InputError(f"`model` must be a torch module, got {type(model).__name__}")
        self.model = model
        self.scaler = scaler
        self.directory = None if directory is None else os.fspath(directory)
        self.state = state
        #: Set by a stop decision; the loop breaks on it.
        self.stop_requested = False
        #: The last healthy snapshot a stop handed over, when there is no ``directory`` to save it to.
        self.last_healthy: Any = None

    def scale_learning_rate(self, factor: float) -> str:
        """Cut the rate of every optimizer and scheduler by ``factor``."""
        scale_learning_rate(self.optimizers, self.schedulers, factor)
        return f"learning rate x {factor}"

    def request_stop(self) -> str:
        """Set `stop_requested`."""
        self.stop_requested = True
        return "stop requested"

    def checkpoint_location(self, tag: str) -> str:
        """``<directory>/<tag>.pt``."""
        if self.directory is None:
            return "not saved (LoopActuator has no `directory`)"
        return os.path.join(self.directory, f"{tag}.pt")

    def save_checkpoint(self, tag: str) -> None:
        """``torch.save(state(), <directory>/<tag>.pt)``.

        ``state()`` runs on every rank (a sharded model's ``state_dict`` is a collective); rank 0 writes.
        """
        if self.directory is None or self.state is None:
            return
        save_on_rank_zero(self.state(), self.directory, f"{tag}.pt")

    def snapshot(self) -> dict[str, Any]:
        """`capture_state` of the model, optimizers, schedulers and scaler.

        Raises:
            SnapshotUnsupported: no ``model`` was given.
        """
        if self.model is None:
            raise SnapshotUnsupported("`rollback` needs the model: LoopActuator(optimizer, scheduler, model=model)")
        return capture_state(self.model, self.optimizers, self.schedulers, self.scaler)

    def restore(self, snapshot: Any) -> str:
        """`restore_state` in place."""
        if self.model is None:  # pragma: no cover - snapshot() refused already
            raise InputError("`rollback` needs the model: LoopActuator(optimizer, scheduler, model=model)")
        restore_state(snapshot, self.model, self.optimizers, self.schedulers, self.scaler)
        return "model, optimizer and scheduler state restored"

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        """``torch.save`` it as ``<directory>/<tag>.pt`` (rank 0); without a directory, keep it in memory.

        Nothing is dropped: without ``directory`` the snapshot stays in `last_healthy`.
        """
        if self.directory is None:
            self.last_healthy = snapshot
            return "kept in memory as LoopActuator.last_healthy (no `directory` to save it to)"
        return save_on_rank_zero(snapshot, self.directory, f"{tag}.pt")

    def skip_updates(self, count: int) -> str:
        """`skip_updates` of the optimizers."""
        return skip_updates(self.optimizers, count)

    def snapshot_nbytes(self) -> int:
        """`live_state_nbytes` of the model and optimizers (0 without a model)."""
        return 0 if self.model is None else live_state_nbytes(self.model, self.optimizers)


def skip_updates(optimizers: Iterable[Any], count: int) -> str:
    """Make each optimizer's next ``count`` ``step()`` calls skip the update; what was done, in words.

    A skipped ``step(closure)`` still runs the closure it is given (Lightning's forward and backward) and returns
    its loss; no parameter and no optimizer state changes. The training loop is unaware: the grad scaler and the
    schedulers step as usual, and the gradients are zeroed by the next ``zero_grad``. The optimizer's own ``step``
    is back after the count. Asking again while skipping starts the count again. The count lives on the optimizer
    object (a checkpoint does not hold it).

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> skip_updates([optimizer], 1)
        'the next 1 optimizer update(s) skipped'
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> before = model.weight.detach().clone()
        >>> optimizer.step(); torch.equal(model.weight, before), updates_left_to_skip(optimizer)
        (True, 0)
        >>> optimizer.step(); torch.equal(model.weight, before)
        False
    """
    count = check_int(count, "count", minimum=1)
    for optimizer in optimizers:
        _skip(optimizer, count)
    return f"the next {count} optimizer update(s) skipped"


def updates_left_to_skip(optimizer: Any) -> int:
    """How many more of ``optimizer``'s updates `skip_updates` will skip."""
    pending = optimizer.__dict__.get("_topo_skip")
    return 0 if pending is None else int(pending["left"])


def _skip(optimizer: Any, count: int) -> None:
    pending = optimizer.__dict__.get("_topo_skip")
    if pending is not None:
        pending["left"] = count
        return
    had_own = "step" in optimizer.__dict__  # e.g. an LR scheduler's or accelerate's wrapper of the class method
    own = optimizer.__dict__.get("step")
    pending = {"left": count}

    def step(closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        pending["left"] -= 1
        if pending["left"] <= 0:
            del optimizer._topo_skip
            if had_own:
                optimizer.step = own
            else:
                del optimizer.step
        if closure is None:
            return None
        import torch

        with torch.enable_grad():
            return closure()

    # A scheduler whose count was restored to its first step checks that the step it sees is its own wrapper.
    step._wrapped_by_lr_sched = getattr(optimizer.step, "_wrapped_by_lr_sched", False)  # type: ignore[attr-defined]
    optimizer._topo_skip = pending
    optimizer.step = step


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """What a snapshot copies and a rollback restores: the model, its optimizers and schedulers, the grad scaler."""

    model: Any
    optimizers: list[Any]
    schedulers: list[Any]
    scaler: Any = None


class StateActuator:
    """The rollback half of an `Actuator`, from the training's parts (a framework adapter's base).

    A subclass gives `_parts` (a `TrainingParts`, built as ``self.Parts(...)``) and may refuse snapshots of a
    training it cannot put back in place (`_check_snapshots`, e.g. sharded strategies) and word its restore
    (`_restored`); ``snapshot_nbytes``, ``snapshot``, ``restore`` and ``skip_updates`` follow.
    """

    Parts: TypeAlias = TrainingParts

    def _parts(self) -> TrainingParts:
        raise NotImplementedError

    def _check_snapshots(self) -> None:
        """Raise `SnapshotUnsupported` where a snapshot cannot be restored."""

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"model, {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s) restored"

    def snapshot_nbytes(self) -> int:
        """`live_state_nbytes` of the model and optimizers."""
        self._check_snapshots()
        parts = self._parts()
        return live_state_nbytes(parts.model, parts.optimizers)

    def snapshot(self) -> dict[str, Any]:
        """`capture_state` of the parts."""
        self._check_snapshots()
        parts = self._parts()
        return capture_state(parts.model, parts.optimizers, parts.schedulers, parts.scaler)

    def restore(self, snapshot: Any) -> str:
        """`restore_state` in place."""
        parts = self._parts()
        restore_state(snapshot, parts.model, parts.optimizers, parts.schedulers, parts.scaler)
        return self._restored(parts.model, parts.optimizers, parts.schedulers)

    def skip_updates(self, count: int) -> str:
        """`skip_updates` of the optimizers."""
        return skip_updates(self._parts().optimizers, count)


# Param-group keys that schedulers read learning rates back from (OneCycleLR, and LRScheduler's initial_lr).
_GROUP_RATE_KEYS = ("initial_lr", "max_lr", "min_lr")
# Scheduler attributes holding one learning rate per param group.
_SCHEDULER_RATE_LISTS = ("base_lrs", "max_lrs", "_last_lr")


def _scale(value: Any, factor: float) -> Any:
    """``value * factor``, in place for a tensor (an optimizer may hold its lr as a tensor)."""
    if hasattr(value, "mul_"):
        value.mul_(factor)
        return value
    return value * factor


def _leaf_schedulers(schedulers: Iterable[Any]) -> Iterator[Any]:
    for scheduler in schedulers:
        children = getattr(scheduler, "_schedulers", None)
        if children:  # SequentialLR, ChainedScheduler
            yield from _leaf_schedulers(children)
        yield scheduler


def scale_learning_rate(optimizers: Iterable[Any], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply the learning rate by ``factor`` now and for every later scheduler step.

    Scales each param group's ``lr`` (and ``initial_lr``, ``max_lr``, ``min_lr`` where present) and each
    scheduler's ``base_lrs``, ``max_lrs`` and last rates, recursing into ``SequentialLR`` and
    ``ChainedScheduler``. Absolute floors (``eta_min``, ``ReduceLROnPlateau.min_lrs``) are left as they are.

    Args:
        optimizers: torch optimizers.
        schedulers: their learning-rate schedulers (any ``torch.optim.lr_scheduler`` class).
        factor: a number in ``(0, 1)``.

    Raises:
        InputError: ``factor`` is not in ``(0, 1)``.

    Examples:
        >>> import torch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        >>> scale_learning_rate([optimizer], [scheduler], 0.5)
        >>> optimizer.step(); scheduler.step()
        >>> current_learning_rates([optimizer])
        [0.05]
    """
    factor = check_number(factor, "factor", low=0.0, high=1.0)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = _scale(group["lr"], factor)
            for key in _GROUP_RATE_KEYS:
                if key in group:
                    group[key] = _scale(group[key], factor)
    for scheduler in _leaf_schedulers(schedulers):
        for name in _SCHEDULER_RATE_LISTS:
            rates = getattr(scheduler, name, None)
            if isinstance(rates, list):
                setattr(scheduler, name, [_scale(rate, factor) for rate in rates])


def current_learning_rates(optimizers: Iterable[Any]) -> list[float]:
    """The learning rate of every param group, as floats, in order."""
    return [float(group["lr"]) for optimizer in optimizers for group in optimizer.param_groups]
