"""Applying interventions to a torch optimizer and its schedulers (no training framework involved).

A learning-rate cut must survive the scheduler. ``LambdaLR``-family schedulers recompute the rate from
``base_lrs`` at every step, ``OneCycleLR`` from ``initial_lr``/``max_lr``/``min_lr`` stored in the param groups,
``CyclicLR`` from ``base_lrs``/``max_lrs``, and recursive ones (cosine, ``LinearLR``, ``ExponentialLR``) from the
current rate. Scaling all of these together keeps the cut in effect at every later step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ._validation import check_number

__all__ = ["current_learning_rates", "scale_learning_rate"]

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

    Example:
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
