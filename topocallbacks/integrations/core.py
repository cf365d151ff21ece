"""The adapter core: the work the Lightning and Hugging Face callbacks share, so that each only translates its hooks.

`AdapterCore` is both callbacks' base: the settings and their layer check, the monitor, the stream capture, the
optimizer step's channels, a check's values and an intervention's marker and text for the loggers, the settings as
hyperparameters, the metrics' names beside other callbacks, the precision and the summary. `FrameworkActuator` is
both actuators' base (learning-rate cuts in words, snapshots saved, DeepSpeed refused). The rest is framework-free
machinery an adapter uses: the probe argument, taps on a trainer's methods, a model's gradient norm, the objects that
hold another, and the callbacks a trainer was built with. Nothing here imports a training framework.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ..check import CheckRecord, InterventionRecord
from ..exceptions import ConfigError, InputError, SnapshotUnsupported
from ..intake import OptimizerStep
from ..interventions import Actuator, StateActuator, current_learning_rates, scale_learning_rate
from ..monitor import TopoMonitor
from ..presets import resolve_settings
from ..probe import StreamCapture, autocast_for
from ..settings import MonitorSettings
from ..sinks import distinct_prefixes, hyperparameters, intervention_scalars, prefix_of, scalars_of
from ..snapshots import DEEPSPEED_REFUSAL, save_on_rank_zero
from .reporting import Guard, write_settings, write_text

__all__ = [
    "AdapterCore",
    "CallbackRegistry",
    "FrameworkActuator",
    "InputsOnly",
    "ProbeArgument",
    "Tap",
    "TextSource",
    "TextTarget",
    "callback_settings",
    "gradient_norm",
    "holder_of",
    "holders",
    "is_foreign_dataset",
    "is_texts",
    "optimizer_grad_norm",
    "probe_argument",
    "probe_source",
    "saved_state",
    "text_targets",
    "watches_the_same",
]

LABEL_KEYS = ("labels", "label", "label_ids")  # the columns of a dataset that are no model input


def callback_settings(
    preset: str | None, settings: Mapping[str, Any] | MonitorSettings | None, overrides: Mapping[str, Any]
) -> MonitorSettings:
    """A callback's settings (`resolve_settings`: the preset's, then ``settings``, then ``overrides``).

    Raises:
        InputError: no layer is named.
    """
    resolved = resolve_settings(preset, settings, overrides)
    if resolved.probe.layer is None and resolved.probe.layers is None:
        raise InputError("`layer` is required: the name of the module whose output to watch (or a `preset`)")
    return resolved


def probe_source(probe: Any, names: tuple[str, str], *, required: bool) -> str | None:
    """The dataset a ``probe`` given by name designates (one of ``names``: training, held out), else None.

    Raises:
        InputError: another name, or no probe where one is ``required`` (probe mode).
    """
    source = probe if isinstance(probe, str) else None
    choice = f"'{names[0]}' or '{names[1]}'"
    if source is not None and source not in names:
        raise InputError(f"`probe` given as text must be {choice} (a dataloader's dataset), got {probe!r}")
    if required and probe is None:
        raise InputError(f"`probe` is required in probe mode: a tensor, Dataset, list of inputs, {choice}")
    return source


@dataclass(frozen=True)
class TextSource:
    """Where a class of logger keeps the object that takes an intervention's text (see `write_text`)."""

    kind: str  # "tensorboard", "mlflow" or "wandb"
    target: str  # the attribute holding the object written to
    ready: str | None = None  # an attribute true once it can write (None: always)
    run_id: str | None = None  # the attribute holding MLflow's run id, with a client


@dataclass(frozen=True)
class TextTarget:
    """A logger that takes an intervention's text: its ``kind`` and the object written to (see `write_text`)."""

    logger: Any  # the framework's logger (or reporting callback), named in a warning if a write fails
    kind: str  # "tensorboard", "mlflow" or "wandb"
    target: Any  # the object written to
    run_id: str | None = None  # MLflow's run, with a client


def text_targets(loggers: list[Any], sources: Mapping[str, TextSource]) -> list[TextTarget]:
    """The ``loggers`` that take an intervention's text, by their class's name in ``sources``."""
    found = []
    for logger in loggers:
        source = sources.get(type(logger).__name__)
        if source is not None and (source.ready is None or getattr(logger, source.ready, None)):
            run_id = None if source.run_id is None else getattr(logger, source.run_id, None)
            found.append(
                TextTarget(logger=logger, kind=source.kind, target=getattr(logger, source.target), run_id=run_id)
            )
    return found


class Log(Protocol):
    """How a framework logs values at a step; ``what`` names them for a warning when a logger fails."""

    def __call__(self, what: str, values: dict[str, float], step: int) -> None: ...


C = TypeVar("C", bound="AdapterCore")
T = TypeVar("T")


class AdapterCore:
    """The base of both training callbacks: the monitor and what they do with it, whatever the framework.

    A subclass calls `_start` in its ``__init__`` and translates its framework's hooks into the methods below and
    the monitor's; it writes the values where its framework logs and acts through a `FrameworkActuator`.
    """

    monitor: TopoMonitor
    capture: StreamCapture
    streaming: bool
    preset: str | None

    @classmethod
    def from_preset(cls: type[C], preset: str, probe: Any = None, **overrides: Any) -> C:
        """A callback configured by a preset (a name from ``presets.available()`` or a YAML path), then overrides."""
        make: Callable[..., C] = cls
        return make(probe=probe, preset=preset, **overrides)

    @property
    def layer(self) -> tuple[str, ...]:
        """The watched layer's name(s)."""
        return self.monitor.settings.probe.layer or ()

    @property
    def history(self) -> list[CheckRecord | InterventionRecord]:
        """The check records and interventions so far."""
        return self.monitor.history

    @property
    def prefix(self) -> str:
        """The metrics' prefix (``topo``, or ``topo/<layer>``)."""
        return self.monitor.prefix

    def report(self, out_dir: str | os.PathLike[str], *, title: str | None = None) -> Path | None:
        """The HTML report of the history so far, in ``out_dir`` (rank 0 writes).

        See [`TopoMonitor.report`][topocallbacks.TopoMonitor.report].
        """
        return self.monitor.report(out_dir, title=title)

    def _start(self, settings: MonitorSettings, *, preset: str | None, probe: Any, tokenizer: Any) -> None:
        """The monitor, the stream capture, the optimizer step under way and the loggers' guard."""
        self.preset = preset
        self.streaming = settings.schedule.mode == "stream"
        self.monitor = TopoMonitor(settings, probe=probe, tokenizer=tokenizer)
        self.capture = StreamCapture(settings.probe.pooling, settings.schedule.points_per_batch, settings.seed)
        self._guard = Guard()  # a logger that fails is said once and never stops training
        self._step = OptimizerStep()  # the training channels of the optimizer step under way

    def _checks(self, step: int, model: Any, *, stepped: bool = False, average: bool = False) -> list[CheckRecord]:
        """`TopoMonitor.on_step`, given what the training gave since the last step.

        The features streamed (streaming mode) and, when an optimizer step ended (``stepped``), its loss (``average``:
        its micro-batches' mean) and gradient norm.
        """
        features = self.capture.take() if self.streaming else None
        loss, norm = self._step.take(average=average) if stepped else (None, None)
        return self.monitor.on_step(step, model=model, features=features, loss=loss, grad_norm=norm)

    def _follow_precision(self, forward_context: Any = None, *, precision: str = "32", model: Any = None) -> None:
        """With ``precision="auto"`` the probe runs in the trainer's: its ``forward_context``, or autocast as named."""
        if self.monitor.settings.probe.precision == "auto":
            if forward_context is None:  # the trainer's precision, as named, on the model's device
                forward_context = autocast_for(precision, next(model.parameters()).device)
            self.monitor.autocast = forward_context

    def _carry_out(
        self, record: CheckRecord, actuator: Actuator, log: Log, texts: Callable[[], list[TextTarget]]
    ) -> None:
        """Log a check's values, carry its decision out through ``actuator``, and log what was done.

        An intervention's marker goes where the values go and, where a logger takes text (``texts``, asked only
        then), its reason.
        """
        log("a check's values", self._values(record), record.step)
        done = self.monitor.act(record, actuator)
        if done is not None:
            log("an intervention", self._marker(done), done.step)
            for target in texts():
                self._write_text(target, done)

    def _values(self, record: CheckRecord) -> dict[str, float]:
        """A check's values under the metrics' prefix (`scalars_of`)."""
        return scalars_of(record, self.monitor.prefix)

    def _index_name(self, record: CheckRecord) -> str:
        """The name of a record's index value (``topo/index``; ``topo/<layer>/index`` for a layer of several)."""
        return f"{prefix_of(record, self.monitor.prefix)}/index"

    def _marker(self, record: InterventionRecord) -> dict[str, float]:
        """An intervention's marker (`intervention_scalars`)."""
        return intervention_scalars(record, self.monitor.prefix)

    def _hyperparameters(self) -> dict[str, str | int | float | bool]:
        """The settings as flat hyperparameters (`hyperparameters`)."""
        return hyperparameters(self.monitor.settings, self.monitor.prefix)

    def _write_text(self, target: TextTarget, record: InterventionRecord) -> None:
        """An intervention's text to a logger that takes text (a failure is said once)."""
        self._guard(
            target.logger, "an intervention's text", write_text, target.kind, target.target, record,
            self.monitor.prefix, run_id=target.run_id,
        )  # fmt: skip

    def _write_settings_to(self, targets: list[TextTarget]) -> None:
        """The settings as the hyperparameters of loggers written through their own objects (`write_settings`)."""
        params = self._hyperparameters()
        for target in targets:
            self._guard(target.logger, "the settings", write_settings, target.kind, target.target, params)

    def _name_metrics(self, ours: list[Any], name_of: Callable[[Any], str]) -> None:
        """Beside other callbacks of its class (``ours``), log under ``topo/<layer>`` (unless a prefix was given)."""
        named = [c for c in ours if c.monitor.settings.output.prefix is None]
        if len(ours) > 1 and self in named:
            modes = [c.monitor.settings.schedule.mode for c in named]
            self.monitor.prefix = distinct_prefixes([name_of(c) for c in named], modes)[named.index(self)]

    def _refuse_rollback(self, deepspeed: bool) -> None:
        """At set-up: a rule that can roll back (or restore before a stop) under DeepSpeed is refused, naming why.

        Raises:
            ConfigError: DeepSpeed and a rule that keeps snapshots.
        """
        if self.monitor.keeps_snapshots and deepspeed:
            raise ConfigError(DEEPSPEED_REFUSAL)

    def _finish(self, log: Log) -> None:
        """Checks still pending reach the history and ``log``; their decisions can no longer act."""
        for record in self.monitor.finish():
            log("a check's values", self._values(record), record.step)

    def _summary(self) -> str | None:
        """The summary of the run, unless ``summary=False``."""
        return self.monitor.summary() if self.monitor.settings.output.summary else None


class FrameworkActuator(StateActuator):
    """The base of the frameworks' actuators: a subclass sets ``snapshot_dir`` and ``deepspeed`` and gives `_parts`."""

    snapshot_dir: str  # where a snapshot is saved (rank 0)
    deepspeed: bool  # DeepSpeed: snapshots refused

    def _check_snapshots(self) -> None:
        if self.deepspeed:
            raise SnapshotUnsupported(DEEPSPEED_REFUSAL)

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        return save_on_rank_zero(snapshot, self.snapshot_dir, tag + ".pt")

    @staticmethod
    def _scale(optimizers: list[Any], schedulers: list[Any], factor: float) -> str:
        """`scale_learning_rate`; the rates now, in words."""
        scale_learning_rate(optimizers, schedulers, factor)
        return ", ".join(f"{lr:.3g}" for lr in current_learning_rates(optimizers))


# --- probes from a trainer's data ----------------------------------------------------------------------------------


def is_texts(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of strings (a probe of texts)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


def is_foreign_dataset(value: Any) -> bool:
    """An indexable, sized dataset that is not a tensor, a list or a torch Dataset (e.g. ``datasets.Dataset``)."""
    if value is None or isinstance(value, (str, torch.Tensor, list, tuple, Mapping, torch.utils.data.Dataset)):
        return False
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")


class InputsOnly(torch.utils.data.Dataset[Any]):
    """A view of a trainer's dataset whose items are model inputs: tensors, label columns dropped."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        if isinstance(item, Mapping):
            return {k: torch.as_tensor(v) for k, v in item.items() if k not in LABEL_KEYS}
        if isinstance(item, (tuple, list)):
            return torch.as_tensor(item[0])
        return torch.as_tensor(item)


@dataclass(frozen=True)
class ProbeArgument:
    """A callback's ``probe`` argument: inputs for the monitor now, texts to tokenize later, or a dataset's name."""

    given: Any
    texts: Any
    source: str | None


def probe_argument(probe: Any, tokenizer: Any, names: tuple[str, str], *, optional: bool) -> ProbeArgument:
    """A ``probe`` argument checked (`probe_source`), a foreign dataset's items as inputs, texts set aside.

    Raises:
        InputError: a name not in ``names``, or no probe where one is required (``optional`` False).
    """
    source = probe_source(probe, names, required=not optional)
    if is_foreign_dataset(probe):
        probe = InputsOnly(probe)  # e.g. a `datasets.Dataset` with torch format: items become input tensors
    texts = probe if tokenizer is None and is_texts(probe) else None  # tokenized when training begins
    return ProbeArgument(given=None if source or texts is not None else probe, texts=texts, source=source)


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
        tap = cls(owner=owner, name=name, original=original, sink=sink)
        setattr(owner, name, tap)
        return tap

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        if self.sink is not None:
            self.sink(result)
        return result

    @staticmethod
    def remove_all(taps: list[Tap]) -> list[Tap]:
        """Remove ``taps``, the last installed first; no taps left."""
        for tap in reversed(taps):
            tap.remove()
        return []

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
        return None  # sharded (DTensor) gradients: their norm is a collective, the trainer's business
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def optimizer_grad_norm(optimizer: torch.optim.Optimizer, sum_across_ranks: Any = None) -> torch.Tensor | None:
    """The total L2 norm of the gradients ``optimizer`` steps with, on their device (None: no gradients).

    DTensor gradients (FSDP2, tensor parallelism) are reduced as their placements say; flat sharded gradients (FSDP1:
    each rank's shard) have their squared norms summed across ranks by ``sum_across_ranks`` (a tensor's sum).
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    norm: torch.Tensor
    if total_norm is not None:
        norm = total_norm(grads)
    else:  # pragma: no cover - older torch
        norms = torch._foreach_norm(grads)
        norm = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    full_tensor = getattr(norm, "full_tensor", None)
    if full_tensor is not None:  # a DTensor
        norm = full_tensor()
    elif sum_across_ranks is not None:
        norm = sum_across_ranks(norm.square()).sqrt()
    return norm.detach()


# --- the objects around a callback ---------------------------------------------------------------------------------


def holder_of(
    item: Any, handler_kind: type, owner_kind: type[T], via: tuple[str, str] = ("callbacks", "callback_handler")
) -> T | None:
    """The ``owner_kind`` object whose ``via[1]`` is the ``handler_kind`` whose ``via[0]`` list holds ``item``, or None.

    A Trainer's ``callback_handler.callbacks``, by default; found by identity through the garbage collector's record
    of who refers to what.
    """
    items_at, handler_at = via
    for held in gc.get_referrers(item):
        if not isinstance(held, list):
            continue
        for handler in holders(held, handler_kind):
            if getattr(handler, items_at, None) is held:
                owners: list[T] = holders(handler, owner_kind)
                return next((o for o in owners if getattr(o, handler_at, None) is handler), None)
    return None


def holders(value: Any, kind: type) -> list[Any]:
    """The objects of ``kind`` that hold ``value`` in an attribute (a referrer is the object or its ``__dict__``)."""
    found = []
    for referrer in gc.get_referrers(value):
        if isinstance(referrer, kind):
            found.append(referrer)
        elif isinstance(referrer, dict):
            found += [o for o in gc.get_referrers(referrer) if isinstance(o, kind) and vars(o) is referrer]
    return found


def watches_the_same(saved: Mapping[str, Any], mine: MonitorSettings) -> bool:
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


class CallbackRegistry:
    """The callbacks each trainer was built with, by the trainer's id; weak, so neither is kept alive.

    Keyed by the trainer, not by what the callbacks watch: an earlier run's callback in the same process (a
    notebook) belongs to another trainer and is never taken for this one's.
    """

    def __init__(self) -> None:
        self.built: dict[int, tuple[weakref.ref[Any], list[weakref.ref[Any]]]] = {}

    def remember(self, trainer: Any, callback: Any) -> None:
        """Remember ``callback`` as one ``trainer`` was built with."""
        for key, (ref, _) in list(self.built.items()):
            if ref() is None:
                del self.built[key]
        ref, callbacks = self.built.setdefault(id(trainer), (weakref.ref(trainer), []))
        if not any(c() is callback for c in callbacks):
            callbacks.append(weakref.ref(callback))

    def built_with(self, trainer: Any, settings: MonitorSettings) -> Any:
        """The callback ``trainer`` was built with that watches what ``settings`` watch, or None."""
        ref, callbacks = self.built.get(id(trainer), (None, []))
        if trainer is None or ref is None or ref() is not trainer:
            return None
        for callback in (c() for c in callbacks):
            if callback is not None and watches_the_same(callback.monitor.settings.as_dict(), settings):
                return callback
        return None

    def original_of(self, trainer: Any, rebuilt: Any) -> Any:
        """The callback of ``trainer`` that ``rebuilt`` (made by the trainer from a checkpoint) stands for.

        Raises:
            InputError: the trainer was built with no callback watching what ``rebuilt`` watches.
        """
        settings = rebuilt.monitor.settings
        original = self.built_with(trainer, settings)
        if original is None:
            raise InputError(
                "cannot restore the callback: the Trainer rebuilt it from its checkpoint, but none of the callbacks it "
                f"was built with watches {list(settings.probe.layer or settings.probe.layers or ())} in "
                f"{settings.schedule.mode} mode; pass the same callback, with the same probe, to the Trainer of the "
                "resumed run"
            )
        return original


def saved_state(stored: Any, kind: type, settings: MonitorSettings) -> Mapping[str, Any] | None:
    """The saved state of a callback of class ``kind`` watching what ``settings`` watch, among a checkpoint's.

    ``stored``: the saved callbacks' ``{"args": ..., "attributes": ...}`` by class name (``transformers``'
    ``ExportableState``). The newest entry: with several callbacks of the class, transformers appends every save's
    states to one list (the empty ones of the trainer's start first). Two callbacks on one layer and mode need
    distinct prefixes to resume each its own state.
    """
    saved = stored.get(kind.__name__) if isinstance(stored, Mapping) else None
    found: Mapping[str, Any] | None = None
    for entry in saved if isinstance(saved, list) else [] if saved is None else [saved]:
        if watches_the_same(entry.get("args", {}).get("settings", {}), settings):
            found = entry["attributes"]["_restored"]  # the last match is the newest save
    return found
