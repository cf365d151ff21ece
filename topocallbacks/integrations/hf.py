"""The Hugging Face ``transformers.Trainer`` callback, a thin adapter around :class:`~topocallbacks.TopoMonitor`.

It runs the monitor's checks during ``Trainer.train``, hands their values to the Trainer's own logging (the next
``on_log`` carries them to ``report_to`` and the console), and gives the monitor an
:class:`~topocallbacks.interventions.Actuator` that steers the loop only through ``TrainerControl`` flags and the
optimizer and scheduler the Trainer hands to its callbacks; its state goes to ``trainer_state.json`` through
``ExportableState``. It holds no decision logic.

The training channels (``policy={"channels": [...]}``) get each optimizer step's loss and gradient norm as the
Trainer computes them, as device tensors read once per check: while training, the callback taps the return value
of ``trainer.training_step`` (the loss of each micro-batch, already divided for gradient accumulation: their sum
is the step's loss, the value the Trainer logs) and, when ``"grad_norm"`` is watched, of
``trainer.accelerator.clip_grad_norm_`` (the norm before clipping, which the Trainer computes at every step; a
step that mixed precision skipped on overflow gives none). Callback hooks alone cannot see them: the Trainer
clips before ``on_pre_optimizer_step`` and keeps the loss in locals.
"""

from __future__ import annotations

import itertools
import os
import sys
import types
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_callback import CallbackHandler, ExportableState

from ..check import CheckRecord
from ..exceptions import InputError, SnapshotUnsupported
from ..interventions import StateActuator, current_learning_rates, save_on_rank_zero, scale_learning_rate
from ..monitor import TopoMonitor
from ..presets import resolve_settings
from ..probe import StreamCapture, autocast_for
from ..settings import MonitorSettings
from ..sinks import scalars_of

__all__ = ["TopoCollapseTrainerCallback"]

# The callbacks alive in this process. ``Trainer`` restores a callback from a checkpoint by calling the class with
# the JSON arguments saved by ``state()`` (``restore_callback_states_from_checkpoint``), which cannot hold the probe's
# tensors, and puts the new object in place of the user's; the restored callback finds the user's callback for the
# resumed run here and becomes another name for it, so that the user's object sees the live state.
_LIVE: weakref.WeakSet[TopoCollapseTrainerCallback] = weakref.WeakSet()
_LABEL_KEYS = ("labels", "label", "label_ids")
_CREATED = itertools.count()
_REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())  # the callbacks `report_to` adds


class _TrainerActuator(StateActuator):
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
        return model, optimizers, schedulers, scaler

    def _check_snapshots(self) -> None:
        trainer = self.trainer
        if trainer is not None and (
            getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False)
        ):
            # Sharded parameters and optimizer states: a state_dict is not a copy load_state_dict puts back in place.
            raise SnapshotUnsupported(
                f"`rollback` does not support {'FSDP' if getattr(trainer, 'is_fsdp_enabled', False) else 'DeepSpeed'} "
                "(sharded parameters and optimizer states); it runs on one device and with DDP. Use `stop` with "
                "`checkpoint_on_stop` and resume instead"
            )

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"model, optimizer and {len(schedulers)} scheduler(s) restored"

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        return save_on_rank_zero(snapshot, self.output_dir, tag + ".pt")


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
      Trainer saves a checkpoint of that step, the intervention in its history, before it stops; while the rule
      can roll back, the newest healthy snapshot is written to ``output_dir/topo-last-healthy-step<S>.pt`` too;
    * ``rollback``: the model, the optimizer, the scheduler and the grad scaler are restored in place from the
      newest snapshot taken at a healthy check before the warning's onset, and training goes on with the next
      batch (``state.global_step`` goes on counting; the batches since the snapshot are not seen again);
    * ``control.should_save`` too when the policy asks for a rescue checkpoint.

    Each optimizer step's training loss (the sum of its micro-batches' ``training_step`` losses, as the Trainer
    logs it) goes to the monitor, and so does the gradient norm before clipping when the policy watches
    ``"grad_norm"``: the ``"loss"`` and ``"grad_norm"`` channels, and a non-finite loss makes a check diverged.

    In streaming mode (``mode="stream"``) a forward hook keeps the watched layer's pooled output during training
    forwards, and the window is pushed once per optimizer step (all micro-batches of gradient accumulation).

    Args:
        probe: the probe inputs (a tensor, a ``torch`` Dataset, a list of tensors or of mappings such as
            tokenizer output, a ``BatchEncoding`` or mapping of columns, a list of texts, or a
            ``datasets.Dataset`` in torch format, label columns dropped), or
            ``"train"``/``"eval"`` for the Trainer's dataset (label columns dropped). Required in probe mode.
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        settings: a :class:`~topocallbacks.settings.MonitorSettings` (instead of a preset), or a mapping of options
            merged into the preset's.
        tokenizer: a Hugging Face tokenizer, for a probe given as a list of texts (default: the Trainer's
            ``processing_class``, taken at ``on_train_begin``); truncated at ``probe.max_length``, padded, with an
            attention mask the pooling respects.
        probe_hash: set by a restore from ``trainer_state.json`` (the saved probe's content hash); not for users.
        restoring: set by a restore from ``trainer_state.json``; not for users.
        **overrides: any monitor option by name, merged last: ``layer``, ``check_every``, ``index``, ``mode``,
            ``policy={...}``, ``max_probe_samples``, ``history_path``, ``checkpoint_on_stop``... (see
            :class:`~topocallbacks.settings.MonitorSettings`). ``layers=[...]`` watches several layers in one probe
            pass, each logged as ``topo/<layer>/...`` (names, patterns or a preset's shortcut such as
            ``"all_blocks"``; ``policy={"layer_rule": "any"}`` acts on any of them, once per check).

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
        tokenizer: Any = None,
        probe_hash: str | None = None,
        restoring: bool = False,
        **overrides: Any,
    ) -> None:
        resolved = resolve_settings(preset, settings, overrides)
        if resolved.probe.layer is None and resolved.probe.layers is None:
            raise InputError("`layer` is required: the name of the module whose output to watch (or a `preset`)")
        if restoring or probe_hash is not None:
            live = _live_callback(resolved, probe_hash)
            if live is not None:
                # Another name for the user's callback of the resumed run: its settings, its state (loaded at
                # on_train_begin from `_restored`, which the Trainer sets on this object after construction).
                self.__dict__ = live.__dict__
                return
            if probe_hash is not None and probe is None:
                raise InputError(
                    f"cannot restore the callback: no callback in this process holds the probe it was saved with "
                    f"(hash {probe_hash[:12]}); pass the same probe to the callback of the resumed run"
                )
        self.streaming = resolved.schedule.mode == "stream"
        self._probe_source = probe if isinstance(probe, str) else None
        if self._probe_source is not None and self._probe_source not in ("train", "eval"):
            raise InputError(f"`probe` given as text must be 'train' or 'eval' (a dataloader's dataset), got {probe!r}")
        if _is_foreign_dataset(probe):
            probe = _InputsOnly(probe)  # e.g. a `datasets.Dataset` with torch format: items become input tensors
        if probe is None and not self.streaming:
            raise InputError("`probe` is required in probe mode: a tensor, Dataset, list of inputs, 'train' or 'eval'")
        # Texts without a tokenizer wait for the Trainer's `processing_class` (at on_train_begin).
        self._texts = probe if tokenizer is None and _is_texts(probe) else None
        given = None if self._probe_source or self._texts is not None else probe
        self.monitor = TopoMonitor(resolved, probe=given, tokenizer=tokenizer)
        self.preset = preset
        self.capture = StreamCapture(resolved.probe.pooling, resolved.schedule.points_per_batch, resolved.seed)
        self._restored: Mapping[str, Any] | None = None
        self._to_log: dict[str, float] = {}  # values for the next on_log
        self._placed = False  # before the `report_to` callbacks, so that on_log reaches them
        self._trainer: Trainer | None = None  # found when training begins (rollback needs its grad scaler)
        self._taps: list[_Tap] = []  # on the Trainer while it trains: its loss and gradient norm come here
        self._losses: list[Any] = []  # this optimizer step's micro-batch losses (device tensors)
        self._grad_norm: Any = None  # this optimizer step's gradient norm before clipping
        self._created = next(_CREATED)
        _LIVE.add(self)

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
    def prefix(self) -> str:
        """The metrics' prefix: ``topo``, or ``topo/<layer>`` beside other callbacks of this class."""
        return self.monitor.prefix

    def attach(self, trainer: Trainer) -> TopoCollapseTrainerCallback:
        """Add this callback to ``trainer`` (if it is not there) before the ``report_to`` callbacks.

        The callback places itself there when the Trainer first calls it; this does it explicitly, e.g. for a
        Trainer whose callback list is managed by other code.

        Returns:
            The callback.
        """
        if self not in trainer.callback_handler.callbacks:
            trainer.callback_handler.callbacks.append(self)
        self._place(trainer.callback_handler)
        self._trainer = trainer
        return self

    @property
    def history(self) -> list[Any]:
        """The check records and interventions so far (see :class:`~topocallbacks.monitor.TopoMonitor`)."""
        return self.monitor.history

    def report(self, out_dir: str | os.PathLike[str], *, title: str | None = None) -> Path | None:
        """The HTML report of the history so far, in ``out_dir`` (:meth:`TopoMonitor.report`; rank 0 writes)."""
        return self.monitor.report(out_dir, title=title)

    # --- ExportableState ------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``Trainer`` saves in ``trainer_state.json``: the settings, the probe's hash and the monitor's state."""
        probe = self.monitor.probe
        return {
            "args": {
                "probe": self._probe_source,
                "settings": self.monitor.settings.as_dict(),
                "probe_hash": None if probe is None else probe.spec.content_hash,
                "restoring": True,
            },
            "attributes": {"_restored": {"monitor": self.monitor.state_dict()}},
        }

    # --- Trainer hooks --------------------------------------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._place(_calling_handler())
        return control

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        model = kwargs["model"]
        self.monitor.resolve_layers(model)  # unknown names fail here, with close matches
        self._trainer = _caller(Trainer, depth=6) or self._trainer  # the Trainer training now, else attach()'s
        self._place(_calling_handler())
        self._warn_if_unplaced(args)
        # Resuming: Trainer rebuilds the callback from state() and sets `_restored` when
        # `args.restore_callback_states_from_checkpoint` is on; otherwise the saved state is read here from the
        # checkpoint's trainer_state.json (state.stateful_callbacks), so that a resume never re-fires an action.
        # The checkpoint's newest entry first: with several callbacks of this class, transformers appends every
        # save's states to one list (the empty ones of the Trainer's start first) and a rebuild pairs the first.
        restored = self._saved_state(state) or self._restored
        if restored is not None:
            self.monitor.load_state_dict(restored["monitor"])
            self._restored = None
        if self._texts is not None and self.monitor.probe is None:
            tokenizer = kwargs.get("processing_class")
            if tokenizer is None or not callable(tokenizer):
                raise InputError(
                    "`probe` holds text: pass `tokenizer=` to the callback or `processing_class=` to the Trainer"
                )
            self.monitor.set_probe(self._texts, tokenizer=tokenizer)
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
                self._act(args, state, control, record, kwargs)
        self._tap_trainer()
        return control

    def _saved_state(self, state: TrainerState) -> Mapping[str, Any] | None:
        """This callback's state in a checkpoint being resumed from (None on a fresh run).

        Matched by layer, mode and ``prefix``: two callbacks on one layer and mode need distinct prefixes to resume
        each its own state.
        """
        if self.monitor.history or not state.global_step:
            return None  # already running, or nothing was trained before this run
        stored: Any = state.stateful_callbacks  # a dict by class name once TrainerState is built (typed as a list)
        saved = stored.get(type(self).__name__) if isinstance(stored, Mapping) else None
        mine = self.monitor.settings
        found: Mapping[str, Any] | None = None
        for entry in saved if isinstance(saved, list) else [] if saved is None else [saved]:
            settings = entry.get("args", {}).get("settings", {})
            layer = settings.get("probe", {}).get("layer")
            layers = settings.get("probe", {}).get("layers")
            mode = settings.get("schedule", {}).get("mode", mine.schedule.mode)
            prefix = settings.get("output", {}).get("prefix")
            if (
                (layer is not None or layers is not None)
                and tuple(layer or ()) == self.layer
                and tuple(layers or ()) == (mine.probe.layers or ())
                and (mode, prefix)
                == (
                    mine.schedule.mode,
                    mine.output.prefix,
                )
            ):
                found = entry["attributes"]["_restored"]  # the last match is the newest save
        return found

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        # Without clipping the gradients are still those of the backward pass: when the Trainer computed no norm
        # (transformers 4 without `max_grad_norm`, or no Trainer found), it is computed from them here. With
        # clipping only the Trainer's own value is the norm before clipping.
        if self._grad_norm is None and not args.max_grad_norm and self._watches_grad_norm:
            model = kwargs.get("model")
            self._grad_norm = None if model is None else _gradient_norm(model)
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        features = self.capture.take() if self.streaming else None
        loss, grad_norm = self._take_step_dynamics()
        records = self.monitor.on_step(
            state.global_step, model=kwargs["model"], features=features, loss=loss, grad_norm=grad_norm
        )
        for record in records:
            self._act(args, state, control, record, kwargs)
        if self._to_log:
            control.should_log = True  # the Trainer logs this step: on_log carries the values to report_to
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        if self._to_log and logs is not None:
            logs.update(self._to_log)  # the callbacks after this one (report_to, the console) see them
            self._to_log = {}
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self.capture.detach()
        self._untap_trainer()
        for record in self.monitor.finish():  # pending checks reach the history; their decisions can no longer act
            state.log_history.append({**scalars_of(record, self.prefix), "step": record.step})
        self.monitor.close()
        if self.monitor.settings.output.summary and state.is_world_process_zero:
            print(self.monitor.summary(), flush=True)
        return control

    def _act(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        record: CheckRecord,
        kwargs: Mapping[str, Any],
    ) -> None:
        scalars = scalars_of(record, self.prefix)
        state.log_history.append({**scalars, "step": record.step})  # at the step of the check
        self._to_log.update(scalars)
        output_dir = getattr(args, "output_dir", None)
        self.monitor.act(record, _TrainerActuator(state, control, kwargs, self._trainer, output_dir))

    # --- the training channels ------------------------------------------------------------------------------

    @property
    def _watches_grad_norm(self) -> bool:
        return "grad_norm" in self.monitor.settings.rule.channels

    def _tap_trainer(self) -> None:
        """Tap the Trainer's loss and (when watched) gradient norm for this run (undone at ``on_train_end``)."""
        self._untap_trainer()  # a run that raised left its taps; a new run taps its own Trainer
        self._losses, self._grad_norm = [], None
        trainer = self._trainer
        if trainer is None:
            watched = {"loss", "grad_norm"} & set(self.monitor.settings.rule.channels)
            if watched:
                warnings.warn(
                    f"TopoCollapseTrainerCallback found no Trainer calling it: the policy's {sorted(watched)} "
                    "channel(s) get no values (the gradient norm only without clipping); call "
                    "callback.attach(trainer) before train()",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        self._tap(trainer, "training_step", self._on_loss)
        accelerator = getattr(trainer, "accelerator", None)
        if self._watches_grad_norm and accelerator is not None:
            self._tap(accelerator, "clip_grad_norm_", self._on_grad_norm)

    def _tap(self, owner: Any, name: str, sink: Any) -> None:
        original = getattr(owner, name, None)
        if not callable(original) or not hasattr(owner, "__dict__"):
            return
        tap = _Tap(owner, name, original, sink)
        setattr(owner, name, tap)
        self._taps.append(tap)

    def _untap_trainer(self) -> None:
        for tap in reversed(self._taps):
            tap.remove()
        self._taps = []

    def _on_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())
        elif isinstance(loss, (int, float)):
            self._losses.append(float(loss))

    def _on_grad_norm(self, norm: Any) -> None:
        if isinstance(norm, torch.Tensor) and norm.numel() == 1:
            self._grad_norm = norm.detach()
        elif isinstance(norm, (int, float)):
            self._grad_norm = float(norm)

    def _take_step_dynamics(self) -> tuple[Any, Any]:
        """This optimizer step's loss (its micro-batches' sum) and gradient norm, or None each; then forgotten."""
        losses, grad_norm = self._losses, self._grad_norm
        self._losses, self._grad_norm = [], None
        loss = None if not losses else losses[0] if len(losses) == 1 else sum(losses[1:], losses[0])
        # Mixed precision skips a step whose gradients overflowed (and lowers the loss scale): a normal event,
        # whose inf or NaN norm is no divergence.
        accelerator = getattr(self._trainer, "accelerator", None)
        if grad_norm is not None and getattr(accelerator, "optimizer_step_was_skipped", False):
            grad_norm = None
        return loss, grad_norm

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer does not pickle (nor do the taps on it); a run starts by finding its Trainer again.
        return {**self.__dict__, "_trainer": None, "_taps": [], "_losses": [], "_grad_norm": None}

    def _place(self, handler: CallbackHandler | None) -> None:
        """Move this callback before the ``report_to`` callbacks of ``handler``, and name its metrics."""
        if handler is None or self not in handler.callbacks:
            return
        callbacks = handler.callbacks
        first = next((i for i, c in enumerate(callbacks) if isinstance(c, _REPORTERS)), None)
        if first is not None and first < callbacks.index(self):
            callbacks.remove(self)
            callbacks.insert(first, self)
        self._placed = True
        ours = [c for c in callbacks if isinstance(c, TopoCollapseTrainerCallback)]
        if len(ours) > 1 and self.monitor.settings.output.prefix is None:
            named = [c for c in ours if c.monitor.settings.output.prefix is None]
            self.monitor.prefix = _prefix(self, named)

    def _warn_if_unplaced(self, args: TrainingArguments) -> None:
        if self._placed or not args.report_to or args.report_to in ("none", ["none"]):
            return
        warnings.warn(
            "TopoCollapseTrainerCallback could not place itself before the report_to callbacks "
            f"({args.report_to}): topo/* values reach state.log_history and the console but not them; call "
            "callback.attach(trainer) before train()",
            RuntimeWarning,
            stacklevel=3,
        )


class _Tap:
    """A method of one object, replaced while training by a call that hands its result to ``sink`` too.

    Installed on the object (``trainer.training_step``, ``trainer.accelerator.clip_grad_norm_``), so the class and
    other objects are untouched; :meth:`remove` puts back what was there, or only silences the tap when something
    else has wrapped it since.
    """

    def __init__(self, owner: Any, name: str, original: Any, sink: Any) -> None:
        self.owner, self.name, self.original, self.sink = owner, name, original, sink
        self.shadowed = name in vars(owner)  # the object had its own attribute (someone else's wrapper)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        if self.sink is not None:
            self.sink(result)
        return result

    def remove(self) -> None:
        self.sink = None
        if vars(self.owner).get(self.name) is self:
            if self.shadowed:
                setattr(self.owner, self.name, self.original)
            else:
                delattr(self.owner, self.name)


def _gradient_norm(model: torch.nn.Module) -> torch.Tensor | None:
    """The 2-norm of all of ``model``'s gradients (plain tensors only; None when there are none or others)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads or any(type(g) is not torch.Tensor for g in grads):
        return None  # sharded (DTensor) gradients: their norm is a collective, the Trainer's business
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def _frames(skip: int, depth: int) -> list[types.FrameType]:
    """Up to ``depth`` frames of the call stack, from ``skip`` frames above the function calling this one."""
    frames: list[types.FrameType] = []
    frame: types.FrameType | None = sys._getframe(skip + 1)
    while frame is not None and len(frames) < depth:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _caller(kind: type, depth: int = 4) -> Any:
    """The nearest ``self`` of type ``kind`` among the callers of the caller's caller (within ``depth`` frames)."""
    return next((f.f_locals["self"] for f in _frames(2, depth) if isinstance(f.f_locals.get("self"), kind)), None)


def _calling_handler() -> CallbackHandler | None:
    """The Trainer's ``CallbackHandler`` calling the current hook (found on the call stack), or None."""
    handler: CallbackHandler | None = _caller(CallbackHandler)
    return handler


def _replaced_callback(depth: int = 6) -> TopoCollapseTrainerCallback | None:
    """The user's callback whose saved state ``Trainer._load_callback_state`` is restoring now (its loop variable)."""
    for frame in _frames(1, depth):
        if frame.f_code.co_name == "_load_callback_state":
            callback = frame.f_locals.get("callback")
            return callback if isinstance(callback, TopoCollapseTrainerCallback) else None
    return None


def _live_callback(settings: MonitorSettings, probe_hash: str | None) -> TopoCollapseTrainerCallback | None:
    """The user's callback that a callback saved with ``settings`` and ``probe_hash`` resumes.

    First the callback that ``Trainer._load_callback_state`` is replacing (it pairs the i-th callback of the class
    with the i-th saved state, so two callbacks on one layer each get their own), then the others of that Trainer,
    else the newest one alive in this process.
    """
    trainer = _caller(Trainer, depth=6)
    ours = (
        [c for c in trainer.callback_handler.callbacks if isinstance(c, TopoCollapseTrainerCallback)] if trainer else []
    )
    replaced = _replaced_callback()
    first = [] if replaced is None else [replaced]
    for callback in first + ours + sorted(_LIVE, key=lambda c: -c._created):
        mine = callback.monitor.settings
        if (mine.probe.layer, mine.probe.layers, mine.schedule.mode) != (
            settings.probe.layer,
            settings.probe.layers,
            settings.schedule.mode,
        ):
            continue
        probe = callback.monitor.probe
        if probe_hash is None or (probe is not None and probe.spec.content_hash == probe_hash):
            return callback
        if probe is None and (callback._texts is not None or callback._probe_source is not None):
            return callback  # its probe is made at on_train_begin, where the saved state checks it
    return None


def _prefix(callback: TopoCollapseTrainerCallback, callbacks: list[TopoCollapseTrainerCallback]) -> str:
    """``topo/<layer>`` of ``callback`` among ``callbacks`` (then the mode, then a number if shared)."""
    names = [",".join(c.layer or c.monitor.settings.probe.layers or ()) for c in callbacks]
    modes = [c.monitor.settings.schedule.mode for c in callbacks]
    named = [f"{n}/{m}" if names.count(n) > 1 else n for n, m in zip(names, modes, strict=True)]
    named = [f"{n}/{i}" if named.count(n) > 1 else n for i, n in enumerate(named)]
    return f"topo/{named[next(i for i, c in enumerate(callbacks) if c is callback)]}"


def _is_texts(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


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
    if value is None or isinstance(value, (str, torch.Tensor, list, tuple, Mapping, torch.utils.data.Dataset)):
        return False
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")
