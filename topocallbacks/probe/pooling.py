"""Pooling: how a layer's output becomes one float32 vector per sample, on the output's device.

``auto`` picks by shape (global average over an image's positions, mean over a sequence's tokens); ``mean`` and
``last`` respect the attention mask (padding is never pooled); ``cls``, ``flatten`` and ``none`` as named.
"""

from __future__ import annotations

from typing import Any

import torch

from ..exceptions import InputError

__all__ = ["pool", "pooled_features"]


def pooled_features(output: Any, pooling: str, mask: torch.Tensor | None) -> torch.Tensor:
    """The ``(batch, d)`` float32 features of a layer's output, pooled on the output's device.

    Args:
        output: what the layer returned: a tensor, a model output with ``last_hidden_state``, or a tuple or list
            that starts with a tensor.
        pooling: ``"auto"``, ``"mean"``, ``"last"``, ``"cls"``, ``"flatten"`` or ``"none"`` (see `pool`).
        mask: the batch's attention mask ``(batch, tokens)`` (1 for a real token), or None (every token counts).

    Raises:
        InputError: the output holds no tensor, or a token pooling of an output that is not ``(batch, tokens,
            features)``.

    Examples:
        >>> import torch
        >>> hidden = torch.arange(12.0).reshape(2, 3, 2)
        >>> pooled_features((hidden,), "last", torch.tensor([[1, 1, 0], [1, 1, 1]])).tolist()
        [[2.0, 3.0], [10.0, 11.0]]
    """
    pooled = pool(_first_tensor(output).detach(), pooling, mask)
    return pooled.reshape(pooled.shape[0], -1)


def pool(output: torch.Tensor, pooling: str, mask: torch.Tensor | None) -> torch.Tensor:
    """One float32 vector per sample, computed on the output's device (accumulated in float32 under autocast).

    ``"auto"``: a 2-d output as it is, a 4-d ``(batch, channels, height, width)`` one averaged over its positions,
    a 3-d ``(batch, tokens, features)`` one as ``"mean"``, any other flattened. ``"mean"``: the mean over the
    tokens the mask keeps; ``"last"``: the last token the mask keeps; ``"cls"``: the first token; ``"flatten"``:
    all values of a sample in one row; ``"none"``: the output as it is.

    Raises:
        InputError: ``mean``, ``last`` or ``cls`` of an output that is not ``(batch, tokens, features)``.
    """
    if pooling == "none":
        return output.float()
    if pooling == "flatten":
        return output.reshape(output.shape[0], -1).float()
    if pooling == "auto":
        if output.dim() == 2:
            return output.float()
        if output.dim() == 4:  # (batch, channels, height, width): global average pooling
            return output.mean(dim=(2, 3), dtype=torch.float32)
        if output.dim() == 3:  # (batch, tokens, features)
            pooling = "mean"
        else:
            return output.reshape(output.shape[0], -1).float()
    if output.dim() != 3:
        raise InputError(
            f"`pooling` {pooling!r} needs a (batch, tokens, features) output, got shape {tuple(output.shape)}"
        )
    if pooling == "cls":
        return output[:, 0].float()
    if mask is None:
        mask = torch.ones(output.shape[:2], dtype=torch.bool, device=output.device)
    mask = mask.to(output.device).bool()
    if pooling == "last":
        last = mask.long().cumsum(dim=1).argmax(dim=1)  # position of the last non-padding token
        return output[torch.arange(output.shape[0], device=output.device), last].float()
    weights = mask.unsqueeze(-1).to(torch.float32)
    return (output * weights).sum(dim=1, dtype=torch.float32) / weights.sum(dim=1).clamp(min=1.0)


def _first_tensor(output: Any) -> torch.Tensor:
    """The tensor in a layer's output: itself, a model output's ``last_hidden_state``, or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InputError(f"the probed layer returned {type(output).__name__}, not a tensor (or a tuple starting with one)")
