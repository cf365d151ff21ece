"""What the training loop hands the monitor between checks: each step's loss and gradient norm, streamed features.

Kept as given (device tensors are not read on the training step) and taken once per check: one synchronisation.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .exceptions import InputError

__all__ = ["Intake", "OptimizerStep", "host_batches", "mean_of"]


def mean_of(values: list[Any]) -> float | None:
    """The mean of floats and tensors (the tensors are summed on their device and read once); None if none."""
    tensors = [v.detach().float().reshape(-1) for v in values if isinstance(v, torch.Tensor)]
    plain = [float(v) for v in values if v is not None and not isinstance(v, torch.Tensor)]
    count = sum(t.numel() for t in tensors) + len(plain)
    if not count:
        return None
    total = float(torch.cat(tensors).sum().item()) if tensors else 0.0
    return (total + sum(plain)) / count


def host_batches(batches: list[tuple[int, Any]]) -> list[tuple[int, NDArray[np.float32]]]:
    """Streaming batches (device tensors or arrays) on the host, with one device synchronisation for all of them."""
    tensors = [(step, b) for step, b in batches if isinstance(b, torch.Tensor)]
    if not tensors:
        return [(step, np.asarray(b)) for step, b in batches]
    joined = torch.cat([t.reshape(t.shape[0], -1).float() for _, t in tensors]).cpu().numpy()  # one copy
    sizes = np.cumsum([t.shape[0] for _, t in tensors])[:-1]
    host = dict(zip((id(t) for _, t in tensors), np.split(joined, sizes), strict=True))
    return [(step, host[id(b)] if isinstance(b, torch.Tensor) else np.asarray(b)) for step, b in batches]


def _check_channel(value: Any, name: str) -> bool:
    """Whether ``value`` is a plain number; None and tensors pass; anything else is an InputError naming it."""
    if value is None or isinstance(value, torch.Tensor):
        return False
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"`{name}` must be a number or a tensor, got {value!r:.80} of type {type(value).__name__}")
    return True


class Intake:
    """The training channels of the steps since the last check, and (streaming) their batches' features.

    Args:
        channels: the channels the rule watches (a watched training channel that is never fed is said once).
        require: how many channels the rule requires (for the message).

    Examples:
        >>> intake = Intake(("index", "loss"), 2)
        >>> intake.record(loss=2.0)
        >>> intake.record(loss=torch.tensor(1.0))
        >>> intake.take_dynamics()
        {'loss': 1.5, 'grad_norm': None}
    """

    def __init__(self, channels: tuple[str, ...], require: int) -> None:
        self.channels, self.require = channels, require
        self._steps: list[tuple[Any, Any]] = []  # (loss, gradient norm) of each step since the last check
        self._batches: list[tuple[int, Any]] = []  # streaming: the training batches since the last check
        self._unfed = 0  # checks at which a watched training channel had no value (said at the second)

    def record(self, loss: Any = None, grad_norm: Any = None) -> None:
        """One step's loss and gradient norm (floats or tensors; None: not known).

        Raises:
            InputError: a value that is not a number or a tensor, or a negative gradient norm (NaN and Inf are
                data: they make the next check a diverged one).
        """
        _check_channel(loss, "loss")
        if _check_channel(grad_norm, "grad_norm") and grad_norm < 0:
            raise InputError(f"`grad_norm` must be >= 0 (a norm), got {grad_norm!r}")
        if loss is not None or grad_norm is not None:
            self._steps.append((loss, grad_norm))

    def add_batch(self, step: int, features: Any) -> None:
        """A training batch's features (streaming mode)."""
        self._batches.append((step, features))

    def take_batches(self) -> list[tuple[int, NDArray[np.float32]]]:
        """The batches since the last check, on the host (one device synchronisation); then forgotten."""
        batches, self._batches = self._batches, []
        return host_batches(batches)

    def take_dynamics(self, *, read: bool = True) -> dict[str, float | None] | None:
        """The mean loss and gradient norm since the last check (one read of the device tensors); then forgotten.

        None when no step was recorded, or when ``read`` is False (a rank that does not evaluate checks). A watched
        training channel with no value is said once (from the second check on: the first may come before any
        training step).
        """
        taken, self._steps = self._steps, []
        if not read:
            return None
        dynamics = {name: mean_of([step[i] for step in taken]) for i, name in enumerate(("loss", "grad_norm"))}
        self._warn_unfed([name for name in self.channels if name in dynamics and dynamics[name] is None])
        return dynamics if taken else None

    def clear(self) -> None:
        """Forget what came since the last check (after a rollback, those steps were undone)."""
        self._steps, self._batches = [], []

    def _warn_unfed(self, missing: list[str]) -> None:
        if not missing:
            return
        self._unfed += 1
        if self._unfed == 2:
            warnings.warn(
                f"topocallbacks: the rule watches {list(self.channels)} (require {self.require}), but no "
                f"{' or '.join(missing)} was passed since the last check: pass loss= (and grad_norm=) to on_step(), "
                "process() or record_dynamics() (the Lightning and Hugging Face callbacks do it for you), or set "
                "policy={'channels': ['index'], 'require': 1}; until then only the collapse sentinels and a "
                "diverged check act",
                RuntimeWarning,
                stacklevel=5,
            )

    def __getstate__(self) -> dict[str, Any]:
        # Device tensors do not pickle (ddp_spawn pickles callbacks): what came since the last check is dropped.
        return {**self.__dict__, "_steps": [], "_batches": []}


class OptimizerStep:
    """One optimizer step's training channels, gathered from its micro-batches by a training adapter.

    The micro-batches' losses are summed on their device (``take(average=True)`` divides by their number); the
    gradient norms of the optimizer steps taken in one batch (several optimizers) are combined into one total norm;
    a step the grad scaler skipped (Inf or NaN gradients under mixed precision, its routine) has no norm.

    Examples:
        >>> step = OptimizerStep()
        >>> step.add_loss(torch.tensor(1.0)); step.add_loss(torch.tensor(3.0))
        >>> step.add_grad_norm(torch.tensor(3.0)); step.add_grad_norm(torch.tensor(4.0))
        >>> loss, norm = step.take(average=True)
        >>> float(loss), float(norm)
        (2.0, 5.0)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the step under way."""
        self._loss: Any = None
        self._count = 0
        self._norms: list[Any] = []
        self._skipped = False

    def add_loss(self, loss: Any) -> None:
        """A micro-batch's loss (a one-element tensor, detached here, or a float; anything else is ignored)."""
        if isinstance(loss, torch.Tensor) and loss.numel() >= 1:
            loss = loss.detach()
            loss = loss if loss.numel() == 1 else loss.float().mean()
        elif not isinstance(loss, (int, float)) or isinstance(loss, bool):
            return
        self._loss = loss if self._loss is None else self._loss + loss
        self._count += 1

    def add_grad_norm(self, norm: Any) -> None:
        """The gradient norm of one optimizer step of this batch (a tensor or a float)."""
        if isinstance(norm, torch.Tensor) and norm.numel() == 1:
            self._norms.append(norm.detach())
        elif isinstance(norm, (int, float)) and not isinstance(norm, bool):
            self._norms.append(float(norm))

    @property
    def has_grad_norm(self) -> bool:
        """Whether a gradient norm of this step was given."""
        return bool(self._norms)

    def skip(self, *_: Any) -> None:
        """The grad scaler skipped this step: it has no gradient norm (no divergence either)."""
        self._skipped = True

    def take(self, *, average: bool) -> tuple[Any, Any]:
        """This step's loss (the sum of its micro-batches', or their mean) and gradient norm; then forgotten."""
        loss = self._loss
        if loss is not None and average and self._count > 1:
            loss = loss / self._count
        norms = [] if self._skipped else self._norms
        norm: Any = None
        if len(norms) == 1:
            norm = norms[0]
        elif norms:
            norm = torch.linalg.vector_norm(torch.stack([torch.as_tensor(n, dtype=torch.float32) for n in norms]))
        self.reset()
        return loss, norm
