"""Training-side signals, the baselines a topological index is compared with: the gradient norm."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["gradient_norm"]


def gradient_norm(parameters: Iterable[Any]) -> float:
    r"""Total L2 norm of the gradients of ``parameters``: $\sqrt{\sum_p \|\nabla p\|_2^2}$.

    The value ``torch.nn.utils.clip_grad_norm_`` computes before clipping; parameters without a gradient are
    skipped. The collapse-evidence suite (``benchmarks/collapse/``) uses its mean between checks as the
    gradient-norm baseline. torch is imported only when this is called.

    Args:
        parameters: torch parameters (e.g. ``model.parameters()``), after ``backward()``.

    Returns:
        The norm, a float ``>= 0`` (NaN or Inf when a gradient holds them); 0.0 when no parameter has a gradient.

    Raises:
        InputError: ``parameters`` is not an iterable of tensors (e.g. ``[None]``, ``[3]``), naming the first bad item.

    Examples:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> weight.grad = torch.tensor([3.0, 4.0])
        >>> gradient_norm([weight])
        5.0
    """
    import torch

    from ..exceptions import InputError

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    try:
        items = list(parameters)
    except TypeError as exc:
        raise InputError(f"`parameters` must be an iterable of tensors, got {type(parameters).__name__}") from exc
    for index, p in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise InputError(
                f"`parameters` must hold tensors (e.g. model.parameters()), got {type(p).__name__} {p!r:.40} at "
                f"position {index}"
            )
    norms = [torch.linalg.vector_norm(p.grad.detach()) for p in items if p.grad is not None]
    if not norms:
        return 0.0
    value = float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))
    return value
