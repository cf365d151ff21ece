"""The ``transformers.Trainer`` callback: the Trainer's hooks as [`TopoMonitor`][topocallbacks.TopoMonitor] calls.

Values go to the Trainer's logging, decisions through ``TrainerControl``; what it needs besides: `hf_glue`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..check import CheckRecord
from ..exceptions import InputError
from ..intake import OptimizerStep
from ..monitor import TopoMonitor
from ..presets import resolve_settings
from ..probe import StreamCapture, autocast_for
from ..settings import MonitorSettings
from ..sinks import hyperparameters, intervention_scalars, scalars_of
from . import hf_glue as glue
from .reporting import Guard, write_settings, write_text

__all__ = ["TopoCollapseTrainerCallback"]


class TopoCollapseTrainerCallback(TrainerCallback, ExportableState):
    """Watch representational collapse with topology during ``transformers.Trainer.train``, and act on it.

    Every ``check_every`` optimizer steps (and once when training starts) the probe runs through the model; the
    values (``topo/index``, ``topo/ci``, ...) go to ``state.log_history`` and, at once and at that step (the start
    check at step 0), to the ``report_to`` callbacks and the console, without making the Trainer log its loss at
    check steps; the policy's decision is carried out through ``TrainerControl`` and the
    optimizer and scheduler the Trainer hands over (a cut survives its schedules; a rollback restores the model,
    optimizer, scheduler and grad scaler in place; a stop restores the last healthy state first). Each optimizer
    step's loss (its micro-batches' summed, as the Trainer logs it) and gradient norm before clipping feed the
    ``"loss"`` and ``"grad_norm"`` channels. ``transformers`` hands callbacks no Trainer: the callback finds the one
    whose callback handler holds it (`trainer_holding`), or
    ``attach(trainer)`` says it. Its state goes to ``trainer_state.json`` (``ExportableState``) and is read back
    when a run resumes; with ``restore_callback_states_from_checkpoint`` the object the Trainer rebuilds from it
    becomes another name for the resumed Trainer's callback, so ``callback.history`` sees the whole run.

    Args:
        probe: the probe inputs (a tensor, a ``torch`` Dataset, a list of tensors or of mappings such as tokenizer
            output, a ``BatchEncoding`` or mapping of columns, a list of texts, or a ``datasets.Dataset`` in torch
            format, label columns dropped), or ``"train"``/``"eval"`` for the Trainer's dataset. Required in probe
            mode.
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        settings: a [`MonitorSettings`][topocallbacks.settings.MonitorSettings] (instead of a preset), or a mapping of
            options merged into the preset's.
        tokenizer: a Hugging Face tokenizer, for a probe of texts (default: the Trainer's ``processing_class``).
        probe_hash: set by a restore from ``trainer_state.json`` (the saved probe's hash); not for users.
        restoring: set by a restore from ``trainer_state.json``; not for users.
        **overrides: any monitor option by name, merged last: ``layer``, ``check_every``, ``index``, ``mode``,
            ``policy={...}``, ``history_path``, ``layers=[...]``... (see
            [`MonitorSettings`][topocallbacks.MonitorSettings]).

    Raises:
        InputError: a value is out of range, or no layer is named; an unknown layer is reported at
            ``on_train_begin`` with the closest module names.
        ConfigError: an unknown preset or option (with the closest one).

    Examples:
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
        self._standing_in = restoring or probe_hash is not None  # rebuilt by the Trainer from state(): see _bind
        self.streaming = resolved.schedule.mode == "stream"
        given, self._texts, self._probe_source = glue.probe_inputs(
            probe, tokenizer, self.streaming or self._standing_in
        )
        self.monitor = TopoMonitor(resolved, probe=given, tokenizer=tokenizer)
        self.preset = preset
        self.capture = StreamCapture(resolved.probe.pooling, resolved.schedule.points_per_batch, resolved.seed)
        self._restored: Mapping[str, Any] | None = None  # set by the Trainer on a rebuilt callback
        self._guard = Guard()  # a reporter that fails is said once and never stops training
        self._unreported: dict[str, float] = {}  # values for report_to and the console, at their step
        self._settings_written = False  # the settings, as the report_to loggers' hyperparameters (once)
        self._trainer: Trainer | None = None  # found at on_init_end, or attach()'s
        self._taps: list[glue.Tap] = []  # on the Trainer while it trains: its loss and gradient norm come here
        self._step = OptimizerStep()

    @classmethod
    def from_preset(cls, preset: str, probe: Any = None, **overrides: Any) -> TopoCollapseTrainerCallback:
        """A callback configured by a preset (a name from ``presets.available()`` or a YAML path), then overrides."""
        return cls(probe=probe, preset=preset, **overrides)

    layer = property(lambda self: self.monitor.settings.probe.layer or (), doc="The watched layer's name(s).")
    prefix = property(lambda self: self.monitor.prefix, doc="The metrics' prefix (``topo``, or ``topo/<layer>``).")
    history = property(lambda self: self.monitor.history, doc="The check records and interventions so far.")

    def attach(self, trainer: Trainer) -> TopoCollapseTrainerCallback:
        """Add this callback to ``trainer`` (if it is not there) before the ``report_to`` callbacks; returns it."""
        if self not in trainer.callback_handler.callbacks:
            trainer.callback_handler.callbacks.append(self)
        self._found(trainer)
        return self

    def report(self, out_dir: str | os.PathLike[str], *, title: str | None = None) -> Path | None:
        """The HTML report of the history so far, in ``out_dir`` (rank 0 writes).

        See [`TopoMonitor.report`][topocallbacks.TopoMonitor.report].
        """
        return self.monitor.report(out_dir, title=title)

    def state(self) -> dict[str, Any]:
        """What ``Trainer`` saves in ``trainer_state.json``: the settings, the probe's hash and the monitor's state."""
        probe = self.monitor.probe
        args = {"probe": self._probe_source, "settings": self.monitor.settings.as_dict(), "restoring": True}
        args["probe_hash"] = None if probe is None else probe.spec.content_hash
        return {"args": args, "attributes": {"_restored": {"monitor": self.monitor.state_dict()}}}

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._found(self._trainer or glue.trainer_holding(self))
        if self._trainer is not None and not self._standing_in:
            glue.remember(self._trainer, self)
        return control

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._bind(args)
        model = kw["model"]
        self.monitor.resolve_layers(model)  # unknown names fail here, with close matches
        self._found(self._trainer or glue.trainer_holding(self))
        glue.refuse_unsupported_rollback(self._trainer, self.monitor.keeps_snapshots)
        # Resuming: the checkpoint's saved state (or the Trainer's rebuild's), so that no action fires twice.
        fresh = self.monitor.history or not state.global_step
        restored = (None if fresh else glue.saved_state(state, type(self), self.monitor.settings)) or self._restored
        if restored is not None:
            self.monitor.load_state_dict(restored["monitor"])
            self._restored = None
        glue.set_probe(self.monitor, self._texts, self._probe_source, kw)
        if self.monitor.settings.probe.precision == "auto":
            precision = "bf16" if args.bf16 else "16" if args.fp16 else "32"
            self.monitor.autocast = autocast_for(precision, next(model.parameters()).device)  # the Trainer's
        if self.streaming:
            self.capture.attach(model, self.layer)
        else:  # a first check before any update calibrates ε and starts the warm-up on the initial features
            for record in self.monitor.on_step(state.global_step, model=model):
                self._act(args, state, control, record, kw)
        self._step.reset()
        self._taps = glue.tap_trainer(self._trainer, self._step, self.monitor.settings.rule.channels, args)
        return control

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: Any, **kw: Any) -> Any:
        # Without clipping the gradients are still those of the backward pass: when the Trainer computed no norm
        # (transformers 4 without `max_grad_norm`, or no Trainer found), it is computed from them here.
        watched = "grad_norm" in self.monitor.settings.rule.channels
        if watched and not args.max_grad_norm and not self._step.has_grad_norm:
            self._step.add_grad_norm(glue.gradient_norm(kw["model"]))
        return control

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        features = self.capture.take() if self.streaming else None
        accelerator = getattr(self._trainer, "accelerator", None)
        if getattr(accelerator, "optimizer_step_was_skipped", False):
            self._step.skip()  # mixed precision skipped the step on overflow: no norm, and no divergence
        loss, norm = self._step.take(average=False)
        for record in self.monitor.on_step(state.global_step, model=kw["model"], features=features, loss=loss,
                                           grad_norm=norm):  # fmt: skip
            self._act(args, state, control, record, kw)
        self._report(args, state, control, kw)
        return control

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._report(args, state, control, kw)  # the start check's values, at step 0
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self.capture.detach()
        for tap in reversed(self._taps):
            tap.remove()
        self._taps = []
        for record in self.monitor.finish():  # pending checks reach the history; their decisions can no longer act
            state.log_history.append({**scalars_of(record, self.prefix), "step": record.step})
        self.monitor.close()
        if self.monitor.settings.output.summary and state.is_world_process_zero:
            print(self.monitor.summary(), flush=True)
        return control

    def _act(self, args: Any, state: TrainerState, control: Any, record: CheckRecord, kw: Mapping[str, Any]) -> None:
        scalars = scalars_of(record, self.prefix)
        state.log_history.append({**scalars, "step": record.step})  # at the step of the check
        actuator = glue.TrainerActuator(state, control, kw, self._trainer, getattr(args, "output_dir", None))
        done = self.monitor.act(record, actuator)
        if done is not None:  # its marker with the values, its text where a reporter takes text (rank 0)
            marker = intervention_scalars(done, self.prefix)
            state.log_history.append({**marker, "step": done.step})
            scalars = {**scalars, **marker}
            for reporter, kind, target in glue.text_targets(self._trainer) if state.is_world_process_zero else []:
                self._guard(reporter, "an intervention's text", write_text, kind, target, done, self.prefix)
        self._unreported.update(scalars)

    def _report(self, args: Any, state: TrainerState, control: Any, kw: Mapping[str, Any]) -> None:
        """The values not yet reported go to ``report_to`` and the console, as a Trainer log of them alone would.

        At the end of the step of their check, or, for the start check, at the first step's beginning, once the
        reporters have started (their step is still 0 then): never through a Trainer log of the loss.
        """
        if not self._settings_written and state.is_world_process_zero:
            self._write_settings()
        logs, self._unreported = self._unreported, {}
        console = self.monitor.settings.output.console
        for reporter in glue.reporters(self._trainer, console=console) if logs else []:
            self._guard(reporter, "a check's values", reporter.on_log, args, state, control, logs=dict(logs), **kw)

    def _write_settings(self) -> None:
        """The settings as hyperparameters of the ``report_to`` loggers, once.

        Tried at the first report, which comes after every callback's ``on_train_begin``, where those loggers start.
        """
        self._settings_written = True
        targets = glue.text_targets(self._trainer)
        params = hyperparameters(self.monitor.settings, self.prefix)
        for reporter, kind, target in targets:
            self._guard(reporter, "the settings", write_settings, kind, target, params)

    def _bind(self, args: TrainingArguments) -> None:
        """A callback the Trainer rebuilt from ``state()`` becomes another name for the resumed Trainer's own."""
        if self._standing_in:
            original = glue.original_of(self)
            original._restored = self._restored
            self.__dict__ = original.__dict__

    def _found(self, trainer: Trainer | None) -> None:
        """Remember the Trainer, stand before its ``report_to`` callbacks and name the metrics beside others."""
        if trainer is not None:
            self._trainer = trainer
            glue.place_before_reporters(self, trainer.callback_handler)
            glue.name_metrics(self, [c for c in trainer.callback_handler.callbacks if isinstance(c, type(self))])

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer does not pickle (nor do the taps on it); a run starts by finding its Trainer again.
        return {**self.__dict__, "_trainer": None, "_taps": [], "_step": OptimizerStep()}
