"""The Lightning callback: translates Lightning's hooks into [`TopoMonitor`][topocallbacks.monitor.TopoMonitor] calls.

Records go to the trainer's loggers and callback metrics, decisions through `lightning_glue`'s actuator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from ..check import CheckRecord
from ..probe import resolve_layer
from ..settings import MonitorSettings
from . import lightning_glue as glue
from .core import AdapterCore, callback_settings, probe_source

__all__ = ["TopoCollapseCallback"]


class TopoCollapseCallback(AdapterCore, Callback):
    """Watch representational collapse with topology during ``Trainer.fit``, and act on it.

    Every ``check_every`` optimizer steps (and once when training starts) the probe runs through the module; the
    values (``topo/index``, ``topo/ci``, ``topo/betti0``, ...; the same on every rank) go to the trainer's loggers at
    the step of the check and are callback metrics from the next batch on, so ``EarlyStopping`` and
    ``ModelCheckpoint`` can monitor them (``topo/index`` is on the progress bar; several callbacks on one trainer log
    under ``topo/<layer>/``). The policy's decision is carried out with the trainer's own means: a warning, a
    learning-rate cut (the schedulers' base rates too), a rollback of the module, optimizers, schedulers and grad
    scaler to the newest healthy snapshot (in place, on every rank; one device and DDP), a stop
    (``trainer.should_stop``, a checkpoint, the last healthy state restored first). Each optimizer step's training
    loss (``outputs["loss"]``; with gradient accumulation the micro-batches' mean) and gradient norm (after AMP's
    unscaling, before clipping; none for a step the grad scaler skips) feed the ``"loss"`` and ``"grad_norm"``
    channels, read once per check. A summary is printed at the end of training (``summary=False`` to turn it off).

    Args:
        probe: probe inputs (a tensor, Dataset, list of inputs, mapping of columns, or list of texts with
            ``tokenizer``), or ``"train"``/``"val"`` for that dataloader's dataset; required in probe mode.
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        settings: a [`MonitorSettings`][topocallbacks.settings.MonitorSettings] (instead of a preset), or a mapping of
            options merged into the preset's (the form for LightningCLI's YAML: ``settings: {check_every: 200}``).
        tokenizer: a Hugging Face tokenizer, for a probe given as a list of texts.
        check_on_validation_end: also check after every validation run (probe mode; sanity checks skipped).
        **overrides: any monitor option by name, merged last: ``layer``, ``check_every``, ``index``, ``mode``,
            ``policy={...}``, ``history_path``, ``rescue_dir``, ``layers=[...]``... (see
            [`MonitorSettings`][topocallbacks.settings.MonitorSettings]).

    Raises:
        InputError: a value is out of range, or no layer is named; an unknown layer name is reported in ``setup``
            with the closest module names.
        ConfigError: an unknown preset or option (with the closest one).

    Examples:
        >>> import torch
        >>> from topocallbacks.lightning import TopoCollapseCallback
        >>> callback = TopoCollapseCallback(probe=torch.randn(64, 8), layer="encoder", check_every=50)
        >>> callback.state_key
        "TopoCollapseCallback{'layer': 'encoder', 'mode': 'probe'}"
    """

    def __init__(
        self,
        probe: Any = None,
        *,
        preset: str | None = None,
        # dict first: LightningCLI tries union members in order and would turn a mapping into whole new settings
        # instead of merging it into the preset's.
        settings: dict[str, Any] | MonitorSettings | None = None,
        tokenizer: Any = None,
        check_on_validation_end: bool = False,
        **overrides: Any,
    ) -> None:
        resolved = callback_settings(preset, settings, overrides)
        self._probe_source = probe_source(probe, ("train", "val"), required=resolved.schedule.mode != "stream")
        self._start(resolved, preset=preset, probe=None if self._probe_source else probe, tokenizer=tokenizer)
        self.check_on_validation_end = bool(check_on_validation_end)
        self._unlogged: list[CheckRecord] = []  # the latest check's records, until they are callback metrics
        self._sharded_root: torch.nn.Module | None = None  # the strategy's FSDP root the probe runs through, if any
        self._seen_step: int | None = None  # the global step last seen (no new one: gradients still accumulate)
        self._state_key = self._key_of(resolved)  # Lightning asks for it several times a step: made once

    @property
    def layers(self) -> tuple[str, ...]:
        """Several watched layers, if any."""
        return self.monitor.settings.probe.layers or ()

    @property
    def state_key(self) -> str:
        """Unique per watched layer(s) and mode (and ``prefix`` when given, to watch one layer twice)."""
        return self._state_key

    def _key_of(self, settings: MonitorSettings) -> str:
        key: dict[str, str] = {"layer": ",".join(settings.probe.layer or ()), "mode": settings.schedule.mode}
        if settings.probe.layers:
            key["layers"] = ",".join(settings.probe.layers)
        if settings.output.prefix is not None:
            key["prefix"] = settings.output.prefix
        return self._generate_state_key(**key)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.monitor.resolve_layers(pl_module)  # unknown names fail here, with close matches
        self._refuse_rollback(glue.is_deepspeed(trainer))
        ours = [c for c in trainer.callbacks if isinstance(c, TopoCollapseCallback)]  # type: ignore[attr-defined]
        self._name_metrics(ours, lambda c: resolve_layer(pl_module, c.layer) if c.layer else ",".join(c.layers))
        if self.streaming:
            self.capture.attach(pl_module, self.layer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.capture.detach()
        self.monitor.close()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe_source is not None and self.monitor.probe is None:
            self.monitor.set_probe(glue.dataloader_dataset(trainer, self._probe_source))
        self._follow_precision(trainer.strategy.precision_plugin.forward_context)
        self._sharded_root = glue.probe_root(trainer, pl_module)
        params = self._hyperparameters()
        for logger in trainer.loggers if trainer.is_global_zero else []:  # the settings, as hyperparameters
            self._guard(logger, "the settings", logger.log_hyperparams, params)
        self._step.reset()
        self._seen_step = trainer.global_step
        # A first check before any update calibrates ε and starts the warm-up on the initial features.
        if not self.streaming:
            for record in self._checks(trainer.global_step, self._sharded_root or pl_module):
                self._act(trainer, record)
        if not self._unlogged:  # resumed: the latest values are callback metrics again
            self._unlogged = self.monitor.last_records

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = self._add_loss(trainer, outputs)
        model = self._sharded_root or pl_module
        for record in self._checks(trainer.global_step, model, stepped=stepped, average=True):
            self._act(trainer, record)
        unlogged, self._unlogged = self._unlogged, []
        if unlogged:  # the loggers got the records at their own step already
            glue.set_callback_metrics(trainer, [self._values(r) for r in unlogged], self._index_name(unlogged[-1]))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Lightning calls it after the backward pass (and AMP's unscaling) and before it clips the gradients.
        if "grad_norm" in self.monitor.settings.rule.channels:
            norm = glue.step_grad_norm(trainer, optimizer, sharded=self._sharded_root is not None)
            (self._step.skip if isinstance(norm, str) else self._step.add_grad_norm)(norm)  # "skipped": no norm

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Checks still pending reach the history and the loggers; their decisions can no longer act.
        self._finish(lambda what, values, step: self._log(trainer, what, values, step))
        summary = self._summary()
        if summary is not None:
            rank_zero_info(summary)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        wanted = self.check_on_validation_end and not self.streaming and not trainer.sanity_checking
        if wanted and step != self.monitor.last_checked_step_:
            # The loggers get the record now; it becomes a callback metric at the next training batch.
            self._act(trainer, self.monitor.check((self._sharded_root or pl_module), step))

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict["monitor"])

    def _add_loss(self, trainer: pl.Trainer, outputs: Any) -> bool:
        """This batch's loss joins its optimizer step's; whether that step ended (no new global step: it goes on).

        With ``accumulate_grad_batches`` the micro-batches' own losses (automatic optimization divides them by their
        number) are averaged; the norms of the optimizer steps of one batch (several optimizers) are combined.
        """
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and trainer.lightning_module.automatic_optimization:
            loss = loss.detach() * trainer.accumulate_grad_batches if trainer.accumulate_grad_batches > 1 else loss
        self._step.add_loss(loss)
        stepped, self._seen_step = trainer.global_step != self._seen_step, trainer.global_step
        return stepped

    def _act(self, trainer: pl.Trainer, record: CheckRecord) -> None:
        """Log a record (the same on every rank) and carry out its decision on every rank."""
        if self._unlogged and self._unlogged[-1].step != record.step:
            self._unlogged = []  # an older check's records: this one's replace them
        self._unlogged.append(record)
        actuator = glue.LightningActuator(trainer, self.monitor.settings.interventions.rescue_dir)
        log = lambda what, values, step: self._log(trainer, what, values, step)  # noqa: E731
        self._carry_out(record, actuator, log, lambda: glue.loggers_taking_text(trainer))

    def _log(self, trainer: pl.Trainer, what: str, values: dict[str, float], step: int) -> None:
        """Values to every logger of the trainer (rank 0), at ``step``."""
        for logger in trainer.loggers if trainer.is_global_zero else []:
            self._guard(logger, what, logger.log_metrics, values, step=step)
