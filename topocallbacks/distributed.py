"""torch.distributed helpers shared by the training adapters (no training framework involved).

The probe can be split across ranks: rank ``r`` runs samples ``r, r + world, r + 2 * world, ...``, its share padded
to the same length on every rank by repeating a sample (as a DistributedSampler would), so that every rank runs the
same number of forward passes of the same sizes (a sharded model, FSDP, needs every rank in every forward); the
shares are all-gathered and the padding dropped while putting the samples back in probe order, so no sample is
counted twice. One rank then decides,
and the decision is broadcast so that every rank acts at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import NDArray

__all__ = [
    "all_gather_object",
    "broadcast_object",
    "gather_probe_features",
    "is_distributed",
    "rank_and_world",
    "shard",
]

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a torch.distributed process group with more than one rank is active."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)``, ``(0, 1)`` outside distributed training."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shard(n: int, rank: int, world: int) -> list[int]:
    """The probe indices rank ``rank`` runs: ``rank, rank + world, ...`` (possibly empty)."""
    return list(range(rank, n, world))


def gather_probe_features(compute: Callable[[Sequence[int]], NDArray[np.float32]], n: int) -> NDArray[np.float32]:
    """Features of all ``n`` probe samples, each rank computing its shard with ``compute(indices)``.

    Outside distributed training, ``compute(range(n))``. Inside, every rank computes ``ceil(n / world)`` rows (its
    shard, padded by repeating its last sample, or sample 0 for a rank with none), the shares are all-gathered and
    reassembled in probe order without the padding.
    """
    rank, world = rank_and_world()
    if world == 1:
        return compute(list(range(n)))
    per_rank = math.ceil(n / world)
    indices = shard(n, rank, world)
    indices += [indices[-1] if indices else 0] * (per_rank - len(indices))
    local = compute(indices)
    tensor = torch.from_numpy(np.ascontiguousarray(local, dtype=np.float32))
    if dist.get_backend() == "nccl":  # pragma: no cover - GPU only
        tensor = tensor.cuda()
    shares = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shares, tensor)
    gathered = np.stack([share.cpu().numpy() for share in shares])  # (world, per_rank, d)
    # Sample i was computed by rank i % world as its (i // world)-th row.
    order = np.arange(n)
    result: NDArray[np.float32] = gathered[order % world, order // world]
    return result


def broadcast_object(value: T, src: int = 0) -> T:
    """``value`` from rank ``src`` on every rank (itself outside distributed training)."""
    if not is_distributed():
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=src)
    result: T = box[0]
    return result


def all_gather_object(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (``[value]`` outside distributed training)."""
    if not is_distributed():
        return [value]
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, value)
    return box
