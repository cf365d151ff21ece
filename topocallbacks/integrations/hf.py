"""The ``transformers.Trainer`` callback: the Trainer's hooks as [`TopoMonitor`][topocallbacks.TopoMonitor] calls.

Values go to the Trainer's logging, decisions through ``TrainerControl``; what it needs besides: `hf_glue`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..check import CheckRecord
from ..settings import MonitorSettings
from . import hf_glue as glue
from .core import AdapterCore, Tap, callback_settings, probe_argument, saved_state

__all__ = ["TopoCollapseTrainerCallback"]


class TopoCollapseTrainerCallback(AdapterCore, TrainerCallback, ExportableState):
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
        resolved = callback_settings(preset, settings, overrides)
        self._rebuilt_from_state = restoring or probe_hash is not None  # see _merge_into_original
        optional = resolved.schedule.mode == "stream" or self._rebuilt_from_state  # no probe needed
        argument = probe_argument(probe, tokenizer, ("train", "eval"), optional=optional)
        self._texts, self._probe_source = argument.texts, argument.source
        self._start(resolved, preset=preset, probe=argument.given, tokenizer=tokenizer)
        self._restored: Mapping[str, Any] | None = None  # set by the Trainer on a rebuilt callback
        self._unreported: dict[str, float] = {}  # values for report_to and the console, at their step
        self._settings_written = False  # the settings, as the report_to loggers' hyperparameters (once)
        self._trainer: Trainer | None = None  # found at on_init_end, or attach()'s
        self._taps: list[Tap] = []  # on the Trainer while it trains: its loss and gradient norm come here

    def attach(self, trainer: Trainer) -> TopoCollapseTrainerCallback:
        """Add this callback to ``trainer`` (if it is not there) before the ``report_to`` callbacks; returns it."""
        if self not in trainer.callback_handler.callbacks:
            trainer.callback_handler.callbacks.append(self)
        self._adopt_trainer(trainer)
        return self

    def state(self) -> dict[str, Any]:
        """What ``Trainer`` saves in ``trainer_state.json``: the settings, the probe's hash and the monitor's state."""
        probe = self.monitor.probe
        args = {"probe": self._probe_source, "settings": self.monitor.settings.as_dict(), "restoring": True}
        args["probe_hash"] = None if probe is None else probe.spec.content_hash
        return {"args": args, "attributes": {"_restored": {"monitor": self.monitor.state_dict()}}}

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._adopt_trainer(self._trainer or glue.trainer_holding(self))
        if self._trainer is not None and not self._rebuilt_from_state:
            glue.BUILT_WITH.remember(self._trainer, self)
        return control

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._merge_into_original(args)
        model = kw["model"]
        self.monitor.resolve_layers(model)  # unknown names fail here, with close matches
        self._adopt_trainer(self._trainer or glue.trainer_holding(self))
        self._refuse_rollback(getattr(self._trainer, "is_deepspeed_enabled", False))
        # Resuming: the checkpoint's saved state (or the Trainer's rebuild's), so that no action fires twice.
        stored = None if self.monitor.history or not state.global_step else state.stateful_callbacks
        restored = saved_state(stored, type(self), self.monitor.settings) or self._restored
        if restored is not None:
            self.monitor.load_state_dict(restored["monitor"])
            self._restored = None
        glue.set_probe(self.monitor, self._texts, self._probe_source, kw)
        self._follow_precision(precision="bf16" if args.bf16 else "16" if args.fp16 else "32", model=model)
        if self.streaming:
            self.capture.attach(model, self.layer)
        else:  # a first check before any update calibrates ε and starts the warm-up on the initial features
            for record in self._checks(state.global_step, model):
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
        accelerator = getattr(self._trainer, "accelerator", None)
        if getattr(accelerator, "optimizer_step_was_skipped", False):
            self._step.skip()  # mixed precision skipped the step on overflow: no norm, and no divergence
        for record in self._checks(state.global_step, kw["model"], stepped=True):
            self._act(args, state, control, record, kw)
        self._report(args, state, control, kw)
        return control

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self._report(args, state, control, kw)  # the start check's values, at step 0
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        self.capture.detach()
        self._taps = Tap.remove_all(self._taps)
        self._finish(lambda what, values, step: state.log_history.append({**values, "step": step}))
        self.monitor.close()
        if state.is_world_process_zero and (summary := self._summary()) is not None:
            print(summary, flush=True)
        return control

    def _act(self, args: Any, state: TrainerState, control: Any, record: CheckRecord, kw: Mapping[str, Any]) -> None:
        """Values to ``state.log_history`` and, at the next report, the reporters; the decision through the Trainer."""

        def log(what: str, values: dict[str, float], step: int) -> None:
            state.log_history.append({**values, "step": step})
            self._unreported.update(values)

        actuator = glue.TrainerActuator(state, control, kw, self._trainer, getattr(args, "output_dir", None))
        texts = partial(glue.reporters_taking_text, self._trainer, state.is_world_process_zero)  # asked on an action
        self._carry_out(record, actuator, log, texts)

    def _report(self, args: Any, state: TrainerState, control: Any, kw: Mapping[str, Any]) -> None:
        """The values not yet reported go to ``report_to`` and the console, as a Trainer log of them alone would.

        At the end of the step of their check, or, for the start check, at the first step's beginning, once the
        reporters have started (their step is still 0 then): never through a Trainer log of the loss.
        """
        if not self._settings_written and state.is_world_process_zero:
            # The settings as hyperparameters, once: after every callback's on_train_begin, where the loggers start.
            self._settings_written = True
            self._write_settings_to(glue.reporters_taking_text(self._trainer))
        logs, self._unreported = self._unreported, {}
        console = self.monitor.settings.output.console
        for reporter in glue.reporters(self._trainer, console=console) if logs else []:
            self._guard(reporter, "a check's values", reporter.on_log, args, state, control, logs=dict(logs), **kw)

    def _merge_into_original(self, args: TrainingArguments) -> None:
        """A callback the Trainer rebuilt from ``state()`` becomes another name for the resumed Trainer's own."""
        if self._rebuilt_from_state:
            original = glue.BUILT_WITH.original_of(glue.trainer_holding(self), self)
            original._restored = self._restored
            self.__dict__ = original.__dict__

    def _adopt_trainer(self, trainer: Trainer | None) -> None:
        """Remember the Trainer, stand before its ``report_to`` callbacks and name the metrics beside others."""
        if trainer is not None:
            self._trainer = trainer
            glue.place_before_reporters(self, trainer.callback_handler)
            ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, type(self))]
            self._name_metrics(ours, lambda c: ",".join(c.layer or c.monitor.settings.probe.layers or ()))

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer does not pickle (nor do the taps on it); a run starts by finding its Trainer again.
        return {**self.__dict__, "_trainer": None, "_taps": [], "_step": type(self._step)()}
