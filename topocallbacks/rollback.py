"""The healthy snapshots a ``rollback`` goes back to: kept in host memory or as files, a fixed number of them.

A snapshot is taken when a check is judged healthy ([`healthy`][topocallbacks.policy.Decision.healthy]) and only while
a rule can roll back: the training state the adapter's [`Actuator`][topocallbacks.interventions.Actuator] captures
(model, optimizers, schedulers, grad scaler) and the check state the next drift compares with. Memory is
predictable: ``snapshots`` copies of the training state, each `Snapshot.nbytes`; the summary and every
rollback's record say how much.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .distributed import rank_and_world
from .interventions import state_nbytes

__all__ = ["Snapshot", "SnapshotStore"]


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

    def add(self, step: int, payload: Any, diagrams: Any) -> Snapshot:
        """Keep a new snapshot (dropping the oldest beyond ``keep``); returns it.

        A payload's ``"ready"`` event ([`capture_state`][topocallbacks.interventions.capture_state] from a GPU) is kept
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
        return f"{len(self.snapshots)} of {self.keep} snapshot(s) of {_size(each)} each in {where}"

    def clear(self) -> None:
        """Forget every snapshot (and delete their files)."""
        for snapshot in self.snapshots:
            self._drop(snapshot)
        self.snapshots = []

    @staticmethod
    def _drop(snapshot: Snapshot) -> None:
        if snapshot.path is not None and os.path.exists(snapshot.path):
            os.remove(snapshot.path)


def _size(nbytes: int) -> str:
    """Bytes in words: ``1.5 MiB``, ``12.0 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
