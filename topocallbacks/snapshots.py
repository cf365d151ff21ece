"""Healthy snapshots: what they copy and where they are kept.

What a snapshot copies (`capture_state`: model, optimizers, schedulers, grad scaler, every tensor to host memory;
a sharded model through ``torch.distributed.checkpoint``'s state-dict helpers, each rank its own shard), how it is
put back in place (`restore_state`) and measured (`state_nbytes`, `live_state_nbytes`), and the store of the
healthy snapshots a ``rollback`` goes back to (`SnapshotStore`): kept in host memory or as files, a fixed number of
them.

A snapshot is taken when a check is judged healthy ([`healthy`][topocallbacks.policy.Decision.healthy]) and only while
a rule can roll back: the training state the adapter's [`Actuator`][topocallbacks.interventions.Actuator] captures
(model, optimizers, schedulers, grad scaler) and the check state the next drift compares with. Memory is
predictable: ``snapshots`` copies of the training state, each `Snapshot.nbytes`; the summary and every
rollback's record say how much.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from .distributed import broadcast_object, rank_and_world
from .exceptions import InputError, SnapshotUnsupported

__all__ = [
    "DEEPSPEED_REFUSAL",
    "Snapshot",
    "SnapshotStore",
    "capture_state",
    "has_sharded_state",
    "host_memory_available",
    "live_state_nbytes",
    "restore_state",
    "save_on_rank_zero",
    "size_text",
    "state_nbytes",
]


@dataclasses.dataclass
class Snapshot:
    """One healthy state.

    Attributes:
        step: the training step it was taken at (after that step's update).
        nbytes: the bytes of its tensors.
        diagrams: the check's persistence diagrams at that step (what drift compares with after a rollback).
        payload: the training state in host memory, or None when it lives in `path`.
        path: the file holding it (``snapshot_dir``), or None.
        lr_factor: the monitor's cumulative learning-rate factor when it was taken.
        rollback_cut: the product of the rollbacks' learning-rate cuts already in its rates (a rollback to it cuts
            only by what the rule asks beyond that).
        ready: a CUDA event recorded after the copies of a snapshot taken from a GPU (pinned host memory,
            non-blocking), or None; `load` waits for it.
        loss: the training loss at its check (the mean since the check before), or None (``stop_restores``).
    """

    step: int
    nbytes: int
    diagrams: Any = None
    payload: Any = None
    path: str | None = None
    lr_factor: float = 1.0
    rollback_cut: float = 1.0
    ready: Any = None
    loss: float | None = None

    def load(self) -> Any:
        """The training state (read from `path` when it lives on disk).

        A copy still on its way from the GPU (`ready`, a CUDA event) is waited for first: the one
        synchronisation point of an asynchronous snapshot.
        """
        self.wait()
        if self.path is None:
            return self.payload
        import torch

        return torch.load(self.path, weights_only=True)  # written by this process: tensors and plain values

    def wait(self) -> None:
        """Wait until the copy into host memory is complete (at once for a copy that did not come from a GPU)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class SnapshotStore:
    """The newest ``keep`` healthy snapshots, oldest first.

    Args:
        keep: how many are kept.
        directory: None keeps them in host memory; else each is ``torch.save``-d there as
            ``topo-snapshot-step<S>.pt`` (this rank's file ends in ``-rank<R>`` in distributed training; under
            sharding each rank's file holds its own shards), written whole or not at all, and the dropped ones are
            deleted.

    Examples:
        >>> store = SnapshotStore(keep=2)
        >>> for step in (0, 10, 20):
        ...     _ = store.add(step, {"w": [1.0]}, diagrams=None)
        >>> [s.step for s in store.snapshots], store.newest_before(15).step, store.newest_before(0)
        ([10, 20], 10, None)
    """

    def __init__(self, keep: int, directory: str | None = None) -> None:
        self.keep = keep
        self.directory = directory
        self.snapshots: list[Snapshot] = []
        self._room_checked = False

    def check_room(self, actuator: Any) -> None:
        """Before the first snapshot in host memory: refuse snapshots that would take most of the memory left.

        ``keep + 1`` copies (one more is taken before the oldest is dropped) of every rank's state
        (``actuator.snapshot_nbytes()``, when it has it), on one host in the worst case, must fit in half of the memory
        available; rank 0 decides for every rank (a collective: every rank calls it).

        Raises:
            SnapshotUnsupported: they would not fit (the message says what to do instead).
        """
        if self._room_checked or self.directory is not None:
            return
        self._room_checked = True
        estimate = getattr(actuator, "snapshot_nbytes", None)
        verdict = None
        if estimate is not None:
            size = int(estimate())
            world = rank_and_world()[1]
            need = size * (self.keep + 1) * world
            free = host_memory_available()
            if free is not None and need > free / 2:
                verdict = (
                    f"{self.keep} snapshots of about {size_text(size)} each (plus one in flight"
                    + (f", on each of {world} ranks" if world > 1 else "")
                    + f") need {size_text(need)} of host memory, more than half of the {size_text(free)} available; "
                    "set `interventions.snapshot_dir` to keep them on disk, or fewer `interventions.snapshots`"
                )
        verdict = broadcast_object(verdict)
        if verdict is not None:
            raise SnapshotUnsupported(verdict)

    def add(self, step: int, payload: Any, diagrams: Any) -> Snapshot:
        """Keep a new snapshot (dropping the oldest beyond ``keep``); returns it.

        A payload's ``"ready"`` event (`capture_state` from a GPU) is kept
        beside it, and waited for only when the snapshot is read or written to a file.
        """
        ready = payload.pop("ready", None) if isinstance(payload, dict) else None
        snapshot = Snapshot(step, state_nbytes(payload), diagrams, ready=ready)
        if self.directory is None:
            snapshot.payload = payload
        else:
            import torch

            os.makedirs(self.directory, exist_ok=True)
            rank = rank_and_world()[0]
            suffix = f"-rank{rank}" if rank else ""
            snapshot.path = os.path.join(self.directory, f"topo-snapshot-step{step}{suffix}.pt")
            partial = snapshot.path + ".partial"  # renamed once complete: a file named .pt is never half-written
            snapshot.wait()
            try:
                torch.save(payload, partial)
                os.replace(partial, snapshot.path)
            finally:
                if os.path.exists(partial):
                    os.remove(partial)
        self.snapshots = [s for s in self.snapshots if s.step != step] + [snapshot]
        while len(self.snapshots) > self.keep:
            self._drop(self.snapshots.pop(0))
        return snapshot

    def newest_before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken at a step before ``step``, or None."""
        return next((s for s in reversed(self.snapshots) if s.step < step), None)

    def at(self, step: int) -> Snapshot | None:
        """The snapshot taken at ``step``, or None."""
        return next((s for s in self.snapshots if s.step == step), None)

    def drop_after(self, step: int) -> None:
        """Forget the snapshots taken after ``step`` (after a rollback to it, they belong to an abandoned past)."""
        for snapshot in [s for s in self.snapshots if s.step > step]:
            self._drop(snapshot)
        self.snapshots = [s for s in self.snapshots if s.step <= step]

    @property
    def nbytes(self) -> int:
        """The bytes the kept snapshots hold (in memory or on disk)."""
        return sum(s.nbytes for s in self.snapshots)

    def describe(self) -> str:
        """Where the snapshots live and what they cost, in words."""
        where = "host memory" if self.directory is None else self.directory
        each = self.snapshots[-1].nbytes if self.snapshots else 0
        return f"{len(self.snapshots)} of {self.keep} snapshot(s) of {size_text(each)} each in {where}"

    def clear(self) -> None:
        """Forget every snapshot (and delete their files)."""
        for snapshot in self.snapshots:
            self._drop(snapshot)
        self.snapshots = []

    @staticmethod
    def _drop(snapshot: Snapshot) -> None:
        if snapshot.path is not None and os.path.exists(snapshot.path):
            os.remove(snapshot.path)


def size_text(nbytes: int) -> str:
    """Bytes in words: ``1.5 MiB``, ``12.0 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def live_state_nbytes(model: Any, optimizers: Iterable[Any]) -> int:
    """About the bytes `capture_state` will copy on this rank, read from the live state without copying it.

    The model's ``state_dict`` plus each optimizer's state; an optimizer with no state yet (before its first step)
    counts as twice the trainable parameters (Adam's two moments), so the estimate is not low at step 0. A sharded
    model counts this rank's shards (the parameters' local shards; FSDP1's sharded state dict).
    """
    if has_sharded_state(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model_bytes = state_nbytes(get_model_state_dict(model, options=_dcp_options()))
    else:
        model_bytes = state_nbytes(model.state_dict())
    total = model_bytes
    for optimizer in optimizers:
        held = state_nbytes(optimizer.state_dict()["state"])
        params = sum(state_nbytes(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
        total += max(held, 2 * params)
    return total


def host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def save_on_rank_zero(payload: Any, directory: str | os.PathLike[str], name: str) -> str:
    """``torch.save(payload, <directory>/<name>)`` on rank 0 (the directory made if needed); where, in words.

    Every rank gets the same answer, so the history says the same everywhere.
    """
    path = os.path.join(directory, name)
    if rank_and_world()[0] == 0:
        import torch

        os.makedirs(directory, exist_ok=True)
        torch.save(payload, path)
    return f"saved to {path}"


def _host_copy(tree: Any, pinned: bool = False) -> Any:
    """A deep copy of a state dict with every tensor copied to host memory.

    A sharded tensor stays sharded: a DTensor (FSDP2, tensor parallelism) is copied as its local shard with the same
    mesh and placements, a ``ShardedTensor`` (FSDP1's sharded state dict) shard by shard; no rank gathers anything.
    ``pinned``: GPU tensors go to pinned host memory with non-blocking copies (`_to_host`).
    """
    import torch

    if _is_dtensor(tree):
        from torch.distributed.tensor import DTensor

        local = _to_host(tree.to_local().detach(), pinned)  # `DTensor.to(copy=True)` would alias on the host
        return DTensor.from_local(
            local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape, stride=tree.stride()
        )
    if _is_sharded_tensor(tree):
        return tree.to("cpu") if tree.device.type != "cpu" else copy.deepcopy(tree)
    if isinstance(tree, torch.Tensor):
        return _to_host(tree.detach(), pinned)
    if isinstance(tree, dict):
        return {key: _host_copy(value, pinned) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host_copy(value, pinned) for value in tree)
    return copy.deepcopy(tree)


def _to_host(tensor: Any, pinned: bool) -> Any:
    """A host copy of ``tensor``; from a CUDA device with ``pinned``, a non-blocking copy into pinned memory.

    The copy is queued on the current stream, so the training's later in-place updates on that stream come after it;
    only a reader of the host copy must wait for it (`capture_state`'s ``ready`` event).
    """
    if pinned and tensor.device.type == "cuda":
        import torch

        out = torch.empty_like(tensor, device="cpu", pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out
    return tensor.to("cpu", copy=True)


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def _is_sharded_tensor(value: Any) -> bool:
    return type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards")


def has_sharded_state(model: Any) -> bool:
    """Whether ``model``'s state is sharded across ranks: FSDP1, FSDP2 (``fully_shard``) or DTensor parameters.

    Its state is then read and written through ``torch.distributed.checkpoint``'s state-dict helpers, each rank its
    own shard (`capture_state`).

    Raises:
        SnapshotUnsupported: a DeepSpeed engine (its ZeRO partitions are not read or written exactly here).
    """
    from .probe.hooks import is_sharded

    if any(type(m).__name__ == "DeepSpeedEngine" for m in model.modules()):
        raise SnapshotUnsupported(DEEPSPEED_REFUSAL)
    return is_sharded(model) or any(_is_dtensor(p) for p in model.parameters())


#: Why DeepSpeed gets no rollback, and what to do instead (raised at set-up by the adapters).
DEEPSPEED_REFUSAL = (
    "`rollback` (and the restore before a `stop`) does not support DeepSpeed: its ZeRO partitions of the parameters "
    "and optimizer states have no in-memory state-dict API that restores them exactly in place. Use FSDP "
    "(`fully_shard`, Lightning's FSDPStrategy or ModelParallelStrategy, accelerate's FSDP), where rollback is exact, "
    "or a rule that only warns or cuts the learning rate: policy={'action': 'lower_lr', "
    "'after_max_lr_cuts': 'warn', 'on_diverged': 'lower_lr'}"
)


def _dcp_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)  # each rank its own shard: nothing gathered, nothing broadcast


def capture_state(
    model: Any, optimizers: Iterable[Any], schedulers: Iterable[Any], scaler: Any = None
) -> dict[str, Any]:
    """A copy of the training state in host memory: what ``rollback`` restores.

    The model's ``state_dict`` (parameters and buffers, e.g. batch-norm statistics), each optimizer's and
    scheduler's ``state_dict`` and the grad scaler's, every tensor copied to the host (the training goes on
    changing the originals in place). From a GPU the copies go to pinned host memory without blocking the loop,
    and ``"ready"`` holds a CUDA event recorded after them: wait on it (``ready.synchronize()``) before reading the
    host tensors (`SnapshotStore` does). A sharded model (`has_sharded_state`) is
    read through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` / ``get_optimizer_state_dict``,
    sharded): each rank copies its own shard, with no collective beyond what those helpers need.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sorted(capture_state(model, [optimizer], []))
        ['model', 'optimizers', 'scaler', 'schedulers', 'sharded']
    """
    optimizers = list(optimizers)
    sharded = has_sharded_state(model)
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        options = _dcp_options()
        model_state = get_model_state_dict(model, options=options)
        optimizer_states = [
            get_optimizer_state_dict(model, o, options=options) if o.state else _stateless(o) for o in optimizers
        ]
    else:
        model_state, optimizer_states = model.state_dict(), [o.state_dict() for o in optimizers]
    state = {
        "model": _host_copy(model_state, pinned=True),
        "optimizers": [_host_copy(state, pinned=True) for state in optimizer_states],
        "schedulers": [_host_copy(scheduler.state_dict()) for scheduler in schedulers],
        "scaler": None if scaler is None else _host_copy(scaler.state_dict()),
        "sharded": sharded,
    }
    if _on_cuda(model):
        import torch

        state["ready"] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        state["ready"].record()  # after the queued copies: the one point a reader waits for
    return state


def _on_cuda(model: Any) -> bool:
    return any(p.device.type == "cuda" for p in model.parameters())


def _stateless(optimizer: Any) -> dict[str, Any]:
    """An optimizer without state yet (before its first update), as its hyper-parameters.

    ``get_optimizer_state_dict`` would create the state with a step of zero gradients, which counts as a step
    (Adam's bias correction) and so would change the training it watches.
    """
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return {"stateless": True, "param_groups": copy.deepcopy(groups)}


def restore_state(
    snapshot: dict[str, Any], model: Any, optimizers: Iterable[Any], schedulers: Iterable[Any], scaler: Any = None
) -> None:
    """Load `capture_state`'s copy back in place: the parameters are the same objects afterwards.

    Copies are loaded (``load_state_dict`` keeps a host tensor it is given as the optimizer's state, and the
    snapshot must stay intact for a later rollback). A sharded snapshot goes back through
    ``set_model_state_dict`` / ``set_optimizer_state_dict``, each rank its own shard.

    Raises:
        InputError: the snapshot holds another number of optimizers or schedulers than given, or was taken of a
            sharded model and the model is not (or the other way round).
    """
    optimizers, schedulers = list(optimizers), list(schedulers)
    if len(snapshot["optimizers"]) != len(optimizers) or len(snapshot["schedulers"]) != len(schedulers):
        raise InputError(
            f"the snapshot holds {len(snapshot['optimizers'])} optimizer(s) and {len(snapshot['schedulers'])} "
            f"scheduler(s); the training has {len(optimizers)} and {len(schedulers)}"
        )
    sharded = has_sharded_state(model)
    if bool(snapshot.get("sharded", False)) != sharded:
        raise InputError(
            f"the snapshot was taken of a {'sharded' if snapshot.get('sharded') else 'whole'} model; this model is "
            f"{'sharded' if sharded else 'whole'}"
        )
    if sharded:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        options = _dcp_options()
        set_model_state_dict(model, _host_copy(snapshot["model"]), options=options)
        for optimizer, state in zip(optimizers, snapshot["optimizers"], strict=True):
            if state.get("stateless"):
                optimizer.state.clear()
                for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
                    group.update(copy.deepcopy(saved))
            else:
                set_optimizer_state_dict(model, optimizer, _host_copy(state), options=options)
    else:
        model.load_state_dict(snapshot["model"])
        for optimizer, state in zip(optimizers, snapshot["optimizers"], strict=True):
            optimizer.load_state_dict(_host_copy(state))
    for scheduler, state in zip(schedulers, snapshot["schedulers"], strict=True):
        scheduler.load_state_dict(_host_copy(state))
    if scaler is not None and snapshot.get("scaler") is not None:
        scaler.load_state_dict(_host_copy(snapshot["scaler"]))


def state_nbytes(tree: Any) -> int:
    """Bytes held by the tensors of a (nested) state on this rank (a sharded tensor's local shards only)."""
    if _is_dtensor(tree):
        return state_nbytes(tree.to_local())
    if _is_sharded_tensor(tree):
        return sum(state_nbytes(shard.tensor) for shard in tree.local_shards())
    if hasattr(tree, "element_size") and hasattr(tree, "nelement"):
        return int(tree.element_size() * tree.nelement())
    if isinstance(tree, dict):
        return sum(state_nbytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_nbytes(value) for value in tree)
    return 0
