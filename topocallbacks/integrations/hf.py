"""The Hugging Face ``transformers.Trainer`` callback, a thin adapter around :class:`~topocallbacks.TopoMonitor`.

It runs the monitor's checks during ``Trainer.train`` and gives the monitor an
:class:`~topocallbacks.interventions.Actuator` that steers the loop only through ``TrainerControl`` flags and the
optimizer and scheduler the Trainer hands to its callbacks; its state goes to ``trainer_state.json`` through
``ExportableState``. It holds no decision logic.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..check import CheckRecord
from ..exceptions import InputError
from ..interventions import current_learning_rates, scale_learning_rate
from ..monitor import TopoMonitor
from ..presets import resolve_settings
from ..probe import Probe, StreamCapture, autocast_for, resolve_module
from ..settings import MonitorSettings
from ..sinks import scalars_of

__all__ = ["TopoCollapseTrainerCallback"]

# Probes of the callbacks alive in this process, by content hash. ``Trainer`` restores a callback from a
# checkpoint by calling the class with the JSON arguments saved by ``state()``, which cannot hold the probe's
# tensors; the restored callback finds them here, in the callback the user created for the resumed run.
_PROBES: weakref.WeakValueDictionary[str, Probe] = weakref.WeakValueDictionary()
_LABEL_KEYS = ("labels", "label", "label_ids")


class _TrainerActuator:
    """Decisions carried out through ``TrainerControl`` and the optimizer and scheduler the Trainer hands over."""

    def __init__(self, state: TrainerState, control: TrainerControl, kwargs: Mapping[str, Any]) -> None:
        self.state, self.control, self.kwargs = state, control, kwargs

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


class TopoCollapseTrainerCallback(TrainerCallback, ExportableState):
    """Watch representational collapse with topology during ``transformers.Trainer.train``, and act on it.

    Every ``check_every`` optimizer steps (and once when training starts) the probe runs through the model (no
    grad, eval mode, modes restored), the index and its components are computed, added to ``state.log_history``
    (``topo/index``, ``topo/ci``, ...) and to the monitor's own sinks (``history_path``, ``tensorboard_dir``), and
    the policy's decision is carried out (:func:`topocallbacks.interventions.apply`):

    * ``warn``: a warning (rank 0);
    * ``lower_lr``: the optimizer's param groups *and* the scheduler's base rates are scaled, so the cut survives
      the Trainer's ``LambdaLR`` schedules (linear, cosine, with warm-up);
    * ``stop``: ``control.should_training_stop``, with ``control.should_save`` (``checkpoint_on_stop``), so the
      Trainer saves a checkpoint of that step, the intervention in its history, before it stops;
    * ``control.should_save`` too when the policy asks for a rescue checkpoint.

    In streaming mode (``mode="stream"``) a forward hook keeps the watched layer's pooled output during training
    forwards, and the window is pushed once per optimizer step (all micro-batches of gradient accumulation).

    Args:
        probe: the probe inputs (a tensor, a ``torch`` Dataset, a list of tensors or of mappings such as
            tokenizer output, or a ``datasets.Dataset`` in torch format, label columns dropped), or
            ``"train"``/``"eval"`` for the Trainer's dataset (label columns dropped). Required in probe mode.
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        settings: a :class:`~topocallbacks.settings.MonitorSettings` (instead of a preset), or a mapping of options
            merged into the preset's.
        probe_hash: set by a restore from ``trainer_state.json`` (the saved probe's content hash); not for users.
        **overrides: any monitor option by name, merged last: ``layer``, ``check_every``, ``index``, ``mode``,
            ``policy={...}``, ``max_probe_samples``, ``history_path``, ``checkpoint_on_stop``... (see
            :class:`~topocallbacks.settings.MonitorSettings`).

    Raises:
        InputError: a value is out of range, or no layer is named; an unknown layer is reported at
            ``on_train_begin`` with the closest module names.
        ConfigError: an unknown preset or option (with the closest one).

    Example:
        >>> import torch
        >>> from topocallbacks.hf import TopoCollapseTrainerCallback
        >>> callback = TopoCollapseTrainerCallback(probe=torch.randn(64, 8), layer="encoder", check_every=50)
        >>> callback.monitor.settings.schedule.check_every, callback.monitor.settings.index.name
        (50, 'diagram_drift')
    """

    def __init__(
        self,
        probe: Any = None,
        *,
        preset: str | None = None,
        settings: Mapping[str, Any] | MonitorSettings | None = None,
        probe_hash: str | None = None,
        **overrides: Any,
    ) -> None:
        resolved = resolve_settings(preset, settings, overrides)
        if resolved.probe.layer is None:
            raise InputError("`layer` is required: the name of the module whose output to watch (or a `preset`)")
        self.streaming = resolved.schedule.mode == "stream"
        self._probe_source = probe if isinstance(probe, str) else None
        if self._probe_source is not None and self._probe_source not in ("train", "eval"):
            raise InputError(f"`probe` given as text must be 'train' or 'eval' (a dataloader's dataset), got {probe!r}")
        if _is_foreign_dataset(probe):
            probe = _InputsOnly(probe)  # e.g. a `datasets.Dataset` with torch format: items become input tensors
        known: Probe | None = None
        if probe is None and probe_hash is not None:
            known = _PROBES.get(probe_hash)
            if known is None:
                raise InputError(
                    f"cannot restore the callback: no callback in this process holds the probe it was saved with "
                    f"(hash {probe_hash[:12]}); pass the same probe to the callback of the resumed run"
                )
        elif probe is None and not self.streaming:
            raise InputError("`probe` is required in probe mode: a tensor, Dataset, list of inputs, 'train' or 'eval'")
        self.monitor = TopoMonitor(resolved, probe=None if self._probe_source or known else probe)
        if known is not None:
            self.monitor.probe = known
        if self.monitor.probe is not None:
            _PROBES[self.monitor.probe.spec.content_hash] = self.monitor.probe
        self.preset = preset
        self.capture = StreamCapture(resolved.probe.pooling, resolved.schedule.points_per_batch, resolved.seed)
        self._restored: Mapping[str, Any] | None = None

    @classmethod
    def from_preset(cls, preset: str, probe: Any = None, **overrides: Any) -> TopoCollapseTrainerCallback:
        """A callback configured by a preset (a name from ``topocallbacks.presets.available()`` or a YAML path).

        Every value can be overridden: ``from_preset("gpt", probe=ids, check_every=20, policy={"patience": 5})``.

        Raises:
            ConfigError: an unknown preset, an invalid preset file or an unknown override key.
        """
        return cls(probe=probe, preset=preset, **overrides)

    @property
    def layer(self) -> tuple[str, ...]:
        """The watched layer's name or patterns."""
        return self.monitor.settings.probe.layer or ()

    @property
    def history(self) -> list[Any]:
        """The check records and interventions so far (see :class:`~topocallbacks.monitor.TopoMonitor`)."""
        return self.monitor.history

    # --- ExportableState ------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``Trainer`` saves in ``trainer_state.json``: the settings, the probe's hash and the monitor's state."""
        probe = self.monitor.probe
        return {
            "args": {
                "probe": self._probe_source,
                "settings": self.monitor.settings.as_dict(),
                "probe_hash": None if probe is None else probe.spec.content_hash,
            },
            "attributes": {"_restored": {"monitor": self.monitor.state_dict()}},
        }

    # --- Trainer hooks --------------------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        model = kwargs["model"]
        resolve_module(model, self.layer)  # unknown names fail here, with close matches
        # Resuming: Trainer rebuilds the callback from state() and sets `_restored` when
        # `args.restore_callback_states_from_checkpoint` is on; otherwise the saved state is read here from the
        # checkpoint's trainer_state.json (state.stateful_callbacks), so that a resume never re-fires an action.
        restored = self._restored or self._saved_state(state)
        if restored is not None:
            self.monitor.load_state_dict(restored["monitor"])
            self._restored = None
        if self._probe_source is not None and self.monitor.probe is None:
            loader = kwargs.get(f"{self._probe_source}_dataloader")
            dataset = getattr(loader, "dataset", None)
            if dataset is None:
                raise InputError(f"`probe`={self._probe_source!r} needs the Trainer's {self._probe_source} dataset")
            self.monitor.set_probe(_InputsOnly(dataset))
        if self.monitor.settings.probe.precision == "auto":
            precision = "bf16" if args.bf16 else "16" if args.fp16 else "32"
            self.monitor.autocast = autocast_for(precision, next(model.parameters()).device)  # the Trainer's
        if self.streaming:
            self.capture.attach(model, self.layer)
        else:
            # A first check before any update calibrates ε and starts the warm-up on the initial features.
            for record in self.monitor.on_step(state.global_step, model=model):
                self._act(state, control, record, kwargs)
        return control

    def _saved_state(self, state: TrainerState) -> Mapping[str, Any] | None:
        """This callback's state in a checkpoint being resumed from (None on a fresh run)."""
        if self.monitor.history or not state.global_step:
            return None  # already running, or nothing was trained before this run
        stored: Any = state.stateful_callbacks  # a dict by class name once TrainerState is built (typed as a list)
        saved = stored.get(type(self).__name__) if isinstance(stored, Mapping) else None
        for entry in saved if isinstance(saved, list) else [] if saved is None else [saved]:
            layer = entry.get("args", {}).get("settings", {}).get("probe", {}).get("layer")
            if layer is not None and tuple(layer) == self.layer:
                restored: Mapping[str, Any] = entry["attributes"]["_restored"]
                return restored
        return None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        features = self.capture.take() if self.streaming else None
        for record in self.monitor.on_step(state.global_step, model=kwargs["model"], features=features):
            self._act(state, control, record, kwargs)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self.capture.detach()
        self.monitor.finish()  # checks still pending reach the history; their decisions can no longer act
        self.monitor.close()
        return control

    def _act(
        self, state: TrainerState, control: TrainerControl, record: CheckRecord, kwargs: Mapping[str, Any]
    ) -> None:
        state.log_history.append({**scalars_of(record), "step": record.step})
        self.monitor.act(record, _TrainerActuator(state, control, kwargs))


class _InputsOnly(torch.utils.data.Dataset[Any]):
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


def _is_foreign_dataset(value: Any) -> bool:
    """An indexable, sized dataset that is not a tensor, a list or a torch Dataset (e.g. ``datasets.Dataset``)."""
    if value is None or isinstance(value, (str, torch.Tensor, list, tuple, torch.utils.data.Dataset)):
        return False
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")
