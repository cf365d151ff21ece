"""What the Hugging Face callback needs from ``transformers`` beyond its hooks: the Trainer, its means, its data.

The actuator (``TrainerControl`` flags, the optimizer and scheduler), the taps on the loss and gradient norm, the
Trainer that holds a callback, the order before ``report_to``, the saved state to resume, and datasets as probes.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerControl, TrainerState
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_callback import CallbackHandler, PrinterCallback, ProgressCallback

from ..exceptions import ConfigError, InputError, SnapshotUnsupported
from ..intake import OptimizerStep
from ..interventions import StateActuator, current_learning_rates, scale_learning_rate
from ..monitor import TopoMonitor
from ..settings import MonitorSettings
from ..sinks import distinct_prefixes
from ..snapshots import DEEPSPEED_REFUSAL, save_on_rank_zero

_LABEL_KEYS = ("labels", "label", "label_ids")
REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())  # the callbacks `report_to` adds


class TrainerActuator(StateActuator):
    """Decisions carried out through ``TrainerControl`` and the optimizer and scheduler the Trainer hands over."""

    def __init__(
        self,
        state: TrainerState,
        control: TrainerControl,
        kwargs: Mapping[str, Any],
        trainer: Trainer | None,
        output_dir: str | None = None,
    ) -> None:
        self.state, self.control, self.kwargs, self.trainer = state, control, kwargs, trainer
        self.output_dir = output_dir or (None if trainer is None else trainer.args.output_dir) or "."

    def scale_learning_rate(self, factor: float) -> str:
        optimizer = self.kwargs.get("optimizer")
        scheduler = self.kwargs.get("lr_scheduler")
        if optimizer is None:
            raise InputError(f"`lower_lr` at step {self.state.global_step}: the Trainer passed no optimizer")
        # accelerate wraps both; the wrappers expose the torch objects as .optimizer and .scheduler.
        optimizer = getattr(optimizer, "optimizer", optimizer)
        schedulers = [] if scheduler is None else [getattr(scheduler, "scheduler", scheduler)]
        scale_learning_rate([optimizer], schedulers, factor)
        rates = ", ".join(f"{lr:.3g}" for lr in current_learning_rates([optimizer]))
        return f"learning rate x {factor} in the optimizer and its scheduler, now {rates}"

    def request_stop(self) -> str:
        self.control.should_training_stop = True
        return "control.should_training_stop set"

    def checkpoint_location(self, tag: str) -> str:
        return f"control.should_save set (the Trainer saves checkpoint-{self.state.global_step})"

    def save_checkpoint(self, tag: str) -> None:
        self.control.should_save = True  # the Trainer saves after this step's callbacks, the history included

    def _parts(self) -> tuple[Any, list[Any], list[Any], Any]:
        model, optimizer, scheduler = (self.kwargs.get(k) for k in ("model", "optimizer", "lr_scheduler"))
        if model is None or optimizer is None:
            raise InputError(f"`rollback` at step {self.state.global_step}: the Trainer passed no model or optimizer")
        scaler = None if self.trainer is None else getattr(self.trainer.accelerator, "scaler", None)
        # accelerate wraps the optimizer and scheduler; their state lives in the torch objects inside (and a skipped
        # update is the inner optimizer's step(), which accelerate and the scaler call).
        optimizers = [getattr(optimizer, "optimizer", optimizer)]
        schedulers = [] if scheduler is None else [getattr(scheduler, "scheduler", scheduler)]
        if self.trainer is not None and getattr(self.trainer, "is_fsdp_enabled", False):
            model = self.trainer.model_wrapped  # the FSDP root accelerate made: the sharded state is read there
        return model, optimizers, schedulers, scaler

    def _check_snapshots(self) -> None:
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            raise SnapshotUnsupported(DEEPSPEED_REFUSAL)

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"model, optimizer and {len(schedulers)} scheduler(s) restored"

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        return save_on_rank_zero(snapshot, self.output_dir, tag + ".pt")


def refuse_unsupported_rollback(trainer: Trainer | None, keeps_snapshots: bool) -> None:
    """At set-up: a rule that can roll back (or restore before a stop) under DeepSpeed is refused, naming why.

    Raises:
        ConfigError: DeepSpeed and a rule that keeps snapshots.
    """
    if keeps_snapshots and getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError(DEEPSPEED_REFUSAL)


# --- the Trainer that holds a callback ---------------------------------------------------------------------------


def trainer_holding(callback: Any) -> Trainer | None:
    """The Trainer whose callback handler lists this very ``callback`` object, or None.

    ``transformers`` hands a callback no Trainer (its hooks get the arguments, the state, the control flags, the model,
    optimizer, scheduler and dataloaders). The Trainer is found by identity through the garbage collector's record of
    who refers to what: the lists that hold ``callback``, the ``CallbackHandler`` whose ``callbacks`` is one of them,
    the ``Trainer`` whose ``callback_handler`` is that handler. A few walks of the object graph, once per training run;
    ``callback.attach(trainer)`` says it explicitly instead.
    """
    for holder in gc.get_referrers(callback):
        if not isinstance(holder, list):
            continue
        for handler in _objects_holding(holder, CallbackHandler):
            if handler.callbacks is holder:
                trainers = _objects_holding(handler, Trainer)
                return next((t for t in trainers if t.callback_handler is handler), None)
    return None


def _objects_holding(value: Any, kind: type) -> list[Any]:
    """The objects of ``kind`` that hold ``value`` in an attribute (a referrer is the object or its ``__dict__``)."""
    found = []
    for referrer in gc.get_referrers(value):
        if isinstance(referrer, kind):
            found.append(referrer)
        elif isinstance(referrer, dict):
            found += [o for o in gc.get_referrers(referrer) if isinstance(o, kind) and vars(o) is referrer]
    return found


def reporters(trainer: Trainer | None, console: bool = True) -> list[Any]:
    """The Trainer's ``report_to`` callbacks and (``console``) its progress bar or printer, in the handler's order."""
    kinds = (*REPORTERS, *((ProgressCallback, PrinterCallback) if console else ()))
    handler = [] if trainer is None else trainer.callback_handler.callbacks
    return [c for c in handler if isinstance(c, kinds)]


def text_targets(trainer: Trainer | None) -> list[tuple[Any, str, Any]]:
    """The ``report_to`` callbacks that take text, as ``(callback, kind, object)``.

    For `write_text`: TensorBoard's writer, the ``mlflow`` and ``wandb``
    modules with their active runs.
    """
    found = []
    for callback in [] if trainer is None else trainer.callback_handler.callbacks:
        name = type(callback).__name__
        if name == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
            found.append((callback, "tensorboard", callback.tb_writer))
        elif name == "MLflowCallback" and getattr(callback, "_initialized", False):
            found.append((callback, "mlflow", callback._ml_flow))
        elif name == "WandbCallback" and getattr(callback, "_initialized", False):
            found.append((callback, "wandb", callback._wandb))
    return found


def place_before_reporters(callback: Any, handler: CallbackHandler) -> None:
    """Move ``callback`` before the ``report_to`` callbacks of ``handler``, so that its ``on_log`` values reach them."""
    callbacks = handler.callbacks
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, REPORTERS)), None)
    if first is not None and first < callbacks.index(callback):
        callbacks.remove(callback)
        callbacks.insert(first, callback)


def name_metrics(callback: Any, ours: list[Any]) -> None:
    """Beside other callbacks of its class (``ours``), log under ``topo/<layer>`` (unless a prefix was given)."""
    named = [c for c in ours if c.monitor.settings.output.prefix is None]
    if len(ours) > 1 and callback in named:
        names = [",".join(c.layer or c.monitor.settings.probe.layers or ()) for c in named]
        modes = [c.monitor.settings.schedule.mode for c in named]
        callback.monitor.prefix = distinct_prefixes(names, modes)[named.index(callback)]


# --- resuming: binding to the user's callback ----------------------------------------------------------------------

# The callbacks each Trainer was built with (their on_init_end), by the Trainer's id. When
# `restore_callback_states_from_checkpoint` is on, `Trainer._load_callback_state` builds a new callback from the JSON
# `state()` saved and puts it in place of the user's (which leaves the handler): the new one finds the user's
# callback of its own Trainer here when training begins, and becomes another name for it, so that the user's object
# sees the resumed run. Keyed by the Trainer, not by what the callbacks watch: an earlier run's callback in the same
# process (a notebook) belongs to another Trainer and is never taken for this one's.
_BUILT_WITH: dict[int, tuple[weakref.ref[Trainer], list[weakref.ref[Any]]]] = {}


def remember(trainer: Trainer, callback: Any) -> None:
    """Remember ``callback`` as one ``trainer`` was built with."""
    for key, (ref, _) in list(_BUILT_WITH.items()):
        if ref() is None:
            del _BUILT_WITH[key]
    ref, callbacks = _BUILT_WITH.setdefault(id(trainer), (weakref.ref(trainer), []))
    if not any(c() is callback for c in callbacks):
        callbacks.append(weakref.ref(callback))


def built_with(trainer: Trainer | None, settings: MonitorSettings) -> Any:
    """The callback ``trainer`` was built with that watches what ``settings`` watch (layers, mode, prefix), or None."""
    ref, callbacks = _BUILT_WITH.get(id(trainer), (None, []))
    if trainer is None or ref is None or ref() is not trainer:
        return None
    for callback in (c() for c in callbacks):
        if callback is not None and _same_watch(callback.monitor.settings.as_dict(), settings):
            return callback
    return None


def original_of(rebuilt: Any) -> Any:
    """The callback of the Trainer holding ``rebuilt`` (made by it from a checkpoint) that ``rebuilt`` stands for.

    Raises:
        InputError: the Trainer was built with no callback watching what ``rebuilt`` watches.
    """
    settings = rebuilt.monitor.settings
    original = built_with(trainer_holding(rebuilt), settings)
    if original is None:
        raise InputError(
            "cannot restore the callback: the Trainer rebuilt it from its checkpoint, but none of the callbacks it was "
            f"built with watches {list(settings.probe.layer or settings.probe.layers or ())} in "
            f"{settings.schedule.mode} mode; pass the same callback, with the same probe, to the Trainer of the "
            "resumed run"
        )
    return original


def _same_watch(saved: Mapping[str, Any], mine: MonitorSettings) -> bool:
    """Whether settings saved as a dict watch what ``mine`` watch: the layer(s), the mode and the prefix."""
    probe, schedule, output = saved.get("probe", {}), saved.get("schedule", {}), saved.get("output", {})
    layer, layers = probe.get("layer"), probe.get("layers")
    return (
        (layer is not None or layers is not None)
        and tuple(layer or ()) == (mine.probe.layer or ())
        and tuple(layers or ()) == (mine.probe.layers or ())
        and schedule.get("mode", mine.schedule.mode) == mine.schedule.mode
        and output.get("prefix") == mine.output.prefix
    )


def saved_state(state: TrainerState, kind: type, settings: MonitorSettings) -> Mapping[str, Any] | None:
    """The saved state of a callback of class ``kind`` watching what ``settings`` watch, in the checkpoint resumed.

    The checkpoint's newest entry: with several callbacks of the class, transformers appends every save's states to
    one list (the empty ones of the Trainer's start first). Two callbacks on one layer and mode need distinct
    prefixes to resume each its own state.
    """
    stored: Any = state.stateful_callbacks  # a dict by class name once TrainerState is built (typed as a list)
    saved = stored.get(kind.__name__) if isinstance(stored, Mapping) else None
    found: Mapping[str, Any] | None = None
    for entry in saved if isinstance(saved, list) else [] if saved is None else [saved]:
        if _same_watch(entry.get("args", {}).get("settings", {}), settings):
            found = entry["attributes"]["_restored"]  # the last match is the newest save
    return found


# --- data ----------------------------------------------------------------------------------------------------------


def probe_inputs(probe: Any, tokenizer: Any, optional: bool) -> tuple[Any, Any, str | None]:
    """The callback's ``probe`` argument as (inputs for the monitor now, texts to tokenize later, dataset name).

    Raises:
        InputError: a name other than "train" or "eval", or no probe where one is required (``optional`` False).
    """
    source = probe if isinstance(probe, str) else None
    if source is not None and source not in ("train", "eval"):
        raise InputError(f"`probe` given as text must be 'train' or 'eval' (a dataloader's dataset), got {probe!r}")
    if is_foreign_dataset(probe):
        probe = InputsOnly(probe)  # e.g. a `datasets.Dataset` with torch format: items become input tensors
    if probe is None and not optional:
        raise InputError("`probe` is required in probe mode: a tensor, Dataset, list of inputs, 'train' or 'eval'")
    texts = probe if tokenizer is None and is_texts(probe) else None  # tokenized when training begins
    return None if source or texts is not None else probe, texts, source


def is_texts(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of strings (a probe of texts)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


class InputsOnly(torch.utils.data.Dataset[Any]):
    """A view of a Trainer dataset whose items are model inputs: tensors, label columns dropped."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        if isinstance(item, Mapping):
            return {k: torch.as_tensor(v) for k, v in item.items() if k not in _LABEL_KEYS}
        if isinstance(item, (tuple, list)):
            return torch.as_tensor(item[0])
        return torch.as_tensor(item)


def is_foreign_dataset(value: Any) -> bool:
    """An indexable, sized dataset that is not a tensor, a list or a torch Dataset (e.g. ``datasets.Dataset``)."""
    if value is None or isinstance(value, (str, torch.Tensor, list, tuple, Mapping, torch.utils.data.Dataset)):
        return False
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")


# --- the training channels -----------------------------------------------------------------------------------------


class Tap:
    """A method of one object, replaced while training by a call that hands its result to ``sink`` too.

    Installed on the object (``trainer.training_step``, ``trainer.accelerator.clip_grad_norm_``), so the class and
    other objects are untouched; `remove` puts back what was there, or only silences the tap when something
    else has wrapped it since.
    """

    def __init__(self, owner: Any, name: str, original: Any, sink: Any) -> None:
        self.owner, self.name, self.original, self.sink = owner, name, original, sink
        self.shadowed = name in vars(owner)  # the object had its own attribute (someone else's wrapper)

    @classmethod
    def install(cls, owner: Any, name: str, sink: Any) -> Tap | None:
        """Tap ``owner.name`` (None when it is not a method of an object with a ``__dict__``)."""
        original = getattr(owner, name, None)
        if not callable(original) or not hasattr(owner, "__dict__"):
            return None
        tap = cls(owner, name, original, sink)
        setattr(owner, name, tap)
        return tap

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        if self.sink is not None:
            self.sink(result)
        return result

    def remove(self) -> None:
        """Put back what was there (or only silence the tap when another wrapper came after it)."""
        self.sink = None
        if vars(self.owner).get(self.name) is self:
            if self.shadowed:
                setattr(self.owner, self.name, self.original)
            else:
                delattr(self.owner, self.name)


def gradient_norm(model: torch.nn.Module) -> torch.Tensor | None:
    """The 2-norm of all of ``model``'s gradients (plain tensors only; None when there are none or others)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads or any(type(g) is not torch.Tensor for g in grads):
        return None  # sharded (DTensor) gradients: their norm is a collective, the Trainer's business
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def set_probe(monitor: TopoMonitor, texts: Any, source: str | None, kw: Mapping[str, Any]) -> None:
    """A probe of texts (with the Trainer's tokenizer) or of the Trainer's dataset, made when training begins."""
    if texts is not None and monitor.probe is None:
        tokenizer = kw.get("processing_class")
        if tokenizer is None or not callable(tokenizer):
            raise InputError(
                "`probe` holds text: pass `tokenizer=` to the callback or `processing_class=` to the Trainer"
            )
        monitor.set_probe(texts, tokenizer=tokenizer)
    if source is not None and monitor.probe is None:
        dataset = getattr(kw.get(f"{source}_dataloader"), "dataset", None)
        if dataset is None:
            raise InputError(f"`probe`={source!r} needs the Trainer's {source} dataset")
        monitor.set_probe(InputsOnly(dataset))


def tap_trainer(trainer: Trainer | None, step: OptimizerStep, channels: tuple[str, ...], args: Any) -> list[Tap]:
    """Tap the Trainer's loss and (when watched) gradient norm into ``step`` for a run (removed at its end)."""
    watched = {"loss", "grad_norm"} & set(channels)
    if trainer is None:
        reporting = bool(args.report_to) and args.report_to not in ("none", ["none"])
        if watched or reporting:
            warnings.warn(
                f"TopoCollapseTrainerCallback found no Trainer holding it: the policy's {sorted(watched)} channel(s) "
                "get no values (the gradient norm only without clipping), and topo/* values reach state.log_history "
                f"and the console but not report_to ({args.report_to}); call callback.attach(trainer) before train()",
                RuntimeWarning,
                stacklevel=4,
            )
        return []
    taps = [Tap.install(trainer, "training_step", step.add_loss)]
    accelerator = getattr(trainer, "accelerator", None)
    if "grad_norm" in watched and accelerator is not None:
        taps.append(Tap.install(accelerator, "clip_grad_norm_", step.add_grad_norm))
    return [tap for tap in taps if tap is not None]
