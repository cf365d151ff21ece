"""Applying decisions, and learning-rate cuts that survive the scheduler.

`apply` carries out a [`Decision`][topocallbacks.policy.Decision] through an `Actuator`, the small
interface each training adapter implements with its framework's own means (save a checkpoint, scale the learning
rate, request a stop). No training framework is imported here.

A learning-rate cut must survive the scheduler. ``LambdaLR``-family schedulers recompute the rate from
``base_lrs`` at every step, ``OneCycleLR`` from ``initial_lr``/``max_lr``/``min_lr`` stored in the param groups,
``CyclicLR`` from ``base_lrs``/``max_lrs``, and recursive ones (cosine, ``LinearLR``, ``ExponentialLR``) from the
current rate. Scaling all of these together keeps the cut in effect at every later step.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from ._validation import check_int, check_number
from .distributed import rank_and_world
from .exceptions import InputError, SnapshotUnsupported
from .policy import Decision
from .settings import Action, InterventionSettings

__all__ = [
    "Actuator",
    "LoopActuator",
    "StateActuator",
    "apply",
    "capture_state",
    "current_learning_rates",
    "has_sharded_state",
    "host_memory_available",
    "live_state_nbytes",
    "restore_state",
    "save_on_rank_zero",
    "scale_learning_rate",
    "skip_updates",
    "state_nbytes",
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


class StateActuator:
    """The rollback half of an `Actuator`, from the training's parts (a framework adapter's base).

    A subclass gives `_parts` (model, optimizers, schedulers, grad scaler) and may refuse snapshots of a
    training it cannot put back in place (`_check_snapshots`, e.g. sharded strategies) and word its restore
    (`_restored`); ``snapshot_nbytes``, ``snapshot``, ``restore`` and ``skip_updates`` follow.
    """

    def _parts(self) -> tuple[Any, list[Any], list[Any], Any]:
        raise NotImplementedError

    def _check_snapshots(self) -> None:
        """Raise `SnapshotUnsupported` where a snapshot cannot be restored."""

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"model, {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s) restored"

    def snapshot_nbytes(self) -> int:
        """`live_state_nbytes` of the model and optimizers."""
        self._check_snapshots()
        model, optimizers, _, _ = self._parts()
        return live_state_nbytes(model, optimizers)

    def snapshot(self) -> dict[str, Any]:
        """`capture_state` of the parts."""
        self._check_snapshots()
        return capture_state(*self._parts())

    def restore(self, snapshot: Any) -> str:
        """`restore_state` in place."""
        model, optimizers, schedulers, scaler = self._parts()
        restore_state(snapshot, model, optimizers, schedulers, scaler)
        return self._restored(model, optimizers, schedulers)

    def skip_updates(self, count: int) -> str:
        """`skip_updates` of the optimizers."""
        return skip_updates(self._parts()[1], count)


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


def apply(
    decision: Decision,
    actuator: Actuator,
    settings: InterventionSettings,
    record: Callable[[str], None],
    *,
    step: int | None = None,
    rollback: Callable[[], str] | None = None,
    keep: Callable[[], str] | None = None,
) -> str:
    """Carry out ``decision`` through ``actuator`` and return what was done, in words.

    The order keeps nothing lost: the action is applied (a warning on rank 0, the learning-rate cut, the rollback
    and its cut, the stop request), then ``record(detail)`` writes the intervention to the history, and only then
    is the rescue checkpoint saved (when the decision asks for one, or before a stop with ``checkpoint_on_stop``),
    so the checkpoint holds the cut learning rate, the intervention and its reason.

    Args:
        decision: a decision that fired.
        actuator: the framework's means.
        settings: the intervention settings (``checkpoint_on_stop``).
        record: called once with the detail, before the checkpoint is saved.
        step: the step at which it is carried out (default: the decision's, that of the check's features).
        rollback: restores the snapshot a ``rollback`` goes back to and says what it did (the monitor's, which
            holds the snapshots); required for ``rollback``. Given with a ``stop``, it restores the last healthy
            state before the stop is requested.
        keep: for a stop, writes the newest healthy snapshot to a file and says where (the monitor's, when it
            keeps snapshots), so a stop never drops the last good state.
    """
    step = decision.step if step is None else step
    done: list[str] = []
    if decision.action is Action.WARN:
        if rank_and_world()[0] == 0:
            checked = "" if step == decision.step else f" (a check of step {decision.step}'s features)"
            message = f"topocallbacks at step {step}{checked}: {decision.reason}"
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        done.append("warned")
    elif decision.action is Action.LOWER_LR and decision.lr_factor is not None:
        done.append(actuator.scale_learning_rate(decision.lr_factor))
    elif decision.action is Action.ROLLBACK:
        if rollback is None:
            raise InputError("a rollback decision needs `rollback`: the monitor's snapshot restore")
        done.append(rollback())
        if decision.lr_factor is not None:
            done.append(actuator.scale_learning_rate(decision.lr_factor))
    elif decision.action is Action.STOP:
        if rollback is not None:  # the last healthy state first: a stop never leaves the weights of the fault
            done.append(rollback())
        done.append(actuator.request_stop())
        if keep is not None:
            done.append(keep())
    save = decision.checkpoint or (decision.action is Action.STOP and settings.checkpoint_on_stop)
    tag = f"topo-{decision.action.value}-step{step}"
    if save:
        done.append(f"checkpoint {actuator.checkpoint_location(tag)}")
    detail = "; ".join(done)
    record(detail)
    if save:
        actuator.save_checkpoint(tag)
    return detail


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
