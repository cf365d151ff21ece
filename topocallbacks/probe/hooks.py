"""Forward hooks on a model's modules, and the wrappers that constrain a pass through them.

A hook is registered under an id no hook of its module holds (spawned processes restart torch's counter); FSDP and
DeepSpeed models gather parameters collectively, so a pass through them is never stopped early.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["is_fsdp1_wrapper", "is_sharded", "register_forward_hook"]


def register_forward_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> torch.utils.hooks.RemovableHandle:
    """``module.register_forward_hook(hook)`` under an id that no hook of ``module`` holds.

    torch numbers hooks with one counter per process. A process started by ``spawn`` (``ddp_spawn``, ``mp.spawn``)
    starts it at 0 while the modules it unpickled keep their hooks' ids, so a new hook could take the id of a
    user's hook, replace it in the module's table, and remove it with its own removal. The counter is moved past
    every id the module's hook tables hold first.
    """
    tables = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    used = [key for table in tables for key in table if isinstance(key, int)]
    if used:
        counter = torch.utils.hooks.RemovableHandle
        counter.next_id = max(counter.next_id, max(used) + 1)
    return module.register_forward_hook(hook)


def _fsdp_classes() -> tuple[type, ...]:
    """``(FSDPModule, FullyShardedDataParallel)`` (FSDP2, FSDP1), or () for a torch built without distributed."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return ()
    return (FSDPModule, FullyShardedDataParallel)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP-sharded modules (FSDP1 or ``fully_shard``) or is a DeepSpeed engine.

    Their forward gathers parameters with collectives that every rank must reach in the same order, so a probe pass
    is never stopped early there.
    """
    sharded = _fsdp_classes()
    return any(isinstance(m, sharded) or type(m).__name__ == "DeepSpeedEngine" for m in model.modules())


def is_fsdp1_wrapper(module: Any) -> bool:
    """Whether ``module`` is an FSDP1 wrapper (``FullyShardedDataParallel``), e.g. Lightning's FSDPStrategy root."""
    classes = _fsdp_classes()
    return bool(classes) and isinstance(module, classes[1])
