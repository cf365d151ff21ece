"""Streaming capture: a pooled, seeded subset of the watched layer's output during the model's training forwards.

The hook keeps its rows on the device (no copy to the host, no synchronisation on the training step); the monitor
takes them at its own pace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .hooks import register_forward_hook
from .layers import resolve_module
from .pooling import pooled_features

__all__ = ["StreamCapture"]


class StreamCapture:
    """Streaming mode: keeps a pooled subset of the watched layer's output during the model's *training* forwards.

    ``attach`` registers a forward hook on the watched module (forwards in eval mode, such as a probe pass or
    validation, are ignored). Per training forward the hook pools the output on its device, keeps a seeded random
    subset of at most ``points_per_batch`` rows there and nothing more: no copy to the host, no synchronisation.
    `take` returns what was kept since the last call (still on the device) and forgets it.

    Args:
        pooling: how the layer's output becomes one vector per sample (see `ProbeSettings`).
        points_per_batch: rows kept per forward (None: all).
        seed: seed of the subsets (with a per-forward counter).
    """

    def __init__(self, pooling: str = "auto", points_per_batch: int | None = None, seed: int = 0) -> None:
        self.pooling = pooling
        self.points_per_batch = points_per_batch
        self.seed = seed
        self._captured: list[torch.Tensor] = []
        self._handle: Any = None
        self._forwards = 0

    @property
    def attached(self) -> bool:
        """Whether the hook is registered."""
        return self._handle is not None

    def attach(self, model: torch.nn.Module, layer: str | Sequence[str]) -> None:
        """Register the hook on the module ``layer`` designates (once).

        Raises:
            InputError: no such module (with the closest names).
        """
        if self._handle is None:
            self._handle = register_forward_hook(resolve_module(model, layer), self._hook)

    def detach(self) -> None:
        """Remove the hook and drop anything captured."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._captured = []

    def take(self) -> torch.Tensor | None:
        """The ``(n, d)`` float32 rows kept since the last call, on the model's device (None if none)."""
        captured, self._captured = self._captured, []
        if not captured:
            return None
        return captured[0] if len(captured) == 1 else torch.cat(captured)

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not module.training:
            return
        with torch.no_grad():
            pooled = pooled_features(output, self.pooling, None)
            limit = self.points_per_batch
            if limit is not None and pooled.shape[0] > limit:
                generator = torch.Generator(device=pooled.device)
                generator.manual_seed(self.seed * 1_000_003 + self._forwards)
                rows = torch.randperm(pooled.shape[0], device=pooled.device, generator=generator)[:limit]
                pooled = pooled[rows.sort().values]
            self._captured.append(pooled)
        self._forwards += 1

    def __getstate__(self) -> dict[str, Any]:
        # Hooks are registered again by the adapter (ddp_spawn pickles callbacks); captured tensors are transient.
        return {**self.__dict__, "_handle": None, "_captured": []}
