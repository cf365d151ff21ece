"""The Lightning callback, a thin adapter around :class:`~topocallbacks.monitor.TopoMonitor`.

It translates Lightning's hooks into monitor calls, writes each record to the trainer's loggers at the step of its
features and makes its values callback metrics (``pl_module.log``, for ``EarlyStopping``, ``ModelCheckpoint`` and
the progress bar), passes each optimizer step's training loss and gradient norm to the monitor (the policy's
``"loss"`` and ``"grad_norm"`` channels), and gives the monitor an :class:`~topocallbacks.interventions.Actuator`
made of Lightning's own means (``trainer.save_checkpoint``, the trainer's optimizers, schedulers and grad scaler,
``trainer.should_stop``). It holds no decision logic.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info

from ..check import CheckRecord
from ..exceptions import InputError, SnapshotUnsupported
from ..interventions import StateActuator, current_learning_rates, save_on_rank_zero, scale_learning_rate
from ..monitor import TopoMonitor
from ..presets import resolve_settings
from ..probe import StreamCapture, is_fsdp1_wrapper, resolve_layer
from ..settings import MonitorSettings
from ..sinks import prefix_of, scalars_of

__all__ = ["TopoCollapseCallback"]


class _LightningActuator(StateActuator):
    """Decisions carried out with the trainer's own means."""

    def __init__(self, trainer: pl.Trainer, rescue_dir: str | None) -> None:
        self.trainer = trainer
        self.rescue_dir = rescue_dir or trainer.default_root_dir

    def scale_learning_rate(self, factor: float) -> str:
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        scale_learning_rate(self.trainer.optimizers, schedulers, factor)
        rates = ", ".join(f"{lr:.3g}" for lr in current_learning_rates(self.trainer.optimizers))
        return (
            f"learning rate x {factor} in {len(self.trainer.optimizers)} optimizer(s) and {len(schedulers)} "
            f"scheduler(s), now {rates}"
        )

    def request_stop(self) -> str:
        self.trainer.should_stop = True  # OR-ed with the other callbacks' requests, never cleared
        return "trainer.should_stop set"

    def checkpoint_location(self, tag: str) -> str:
        return f"saved to {os.path.join(self.rescue_dir, tag + '.ckpt')}"

    def save_checkpoint(self, tag: str) -> None:
        self.trainer.save_checkpoint(os.path.join(self.rescue_dir, tag + ".ckpt"))  # every rank calls it; rank 0 writes

    def _parts(self) -> tuple[Any, list[Any], list[Any], Any]:
        trainer = self.trainer
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # mixed precision's GradScaler, if any
        return trainer.lightning_module, trainer.optimizers, schedulers, scaler

    def _check_snapshots(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy)):
            # Their parameters and optimizer states are sharded (flat parameters, DTensors, ZeRO partitions): a
            # state_dict of the LightningModule is not a copy that load_state_dict can put back in place.
            raise SnapshotUnsupported(
                f"`rollback` does not support {type(strategy).__name__} (sharded parameters and optimizer states); "
                "it runs on one device and with DDP. Use `stop` with `checkpoint_on_stop` and resume instead"
            )

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"module, {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s) restored"

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        return save_on_rank_zero(snapshot, self.rescue_dir, tag + ".pt")


class TopoCollapseCallback(Callback):
    """Watch representational collapse with topology during ``Trainer.fit``, and act on it.

    Every ``check_every`` optimizer steps (and once when training starts) the probe runs through the module
    (no grad, eval mode, modes restored), the watched index, the Collapse Index and its components are computed,
    and the policy's decision is carried out (:func:`topocallbacks.interventions.apply`). The values
    (``topo/index``, ``topo/ci``, ``topo/betti0``, ...; the same on every rank) go to the trainer's loggers at the
    step of the check, whatever ``log_every_n_steps``, and are callback metrics from the first training batch on,
    so ``EarlyStopping(monitor="topo/index")`` and ``ModelCheckpoint(monitor="topo/index")`` find them at every
    epoch end; ``topo/index`` is on the progress bar. With several of these callbacks on one trainer each logs
    under ``topo/<layer>/`` (``prefix`` to choose). At the end of training a summary is printed on rank 0
    (``summary=False`` to turn it off).

    * ``warn``: a warning (rank 0);
    * ``lower_lr``: every optimizer's param groups *and* every scheduler's base rates are scaled, so the cut
      survives ``LambdaLR``-family, cosine, OneCycle and plateau schedulers;
    * ``rollback``: the module, optimizers, schedulers and grad scaler go back, in place and on every rank, to the
      newest healthy snapshot (taken at the checks judged healthy while the policy can roll back); training goes
      on with the next batch, so the batches since the snapshot are not seen again (one device and DDP only);
    * ``stop``: ``trainer.should_stop`` is set (OR-ed, never cleared), then a checkpoint is saved
      (``checkpoint_on_stop``), and with snapshots kept the last healthy one as ``topo-last-healthy-step<S>.pt``;
    * a rescue checkpoint when the policy asks for one, saved after the intervention is in the history.

    Every decision that acts, and what was done, goes to the history (``callback.history``, and the JSONL file).

    Each optimizer step's training loss (``outputs["loss"]`` of ``training_step``, or the tensor it returned; with
    gradient accumulation the mean over the step's micro-batches) reaches the monitor for the policy's ``"loss"``
    channel, and, when the policy watches ``"grad_norm"``, the total L2 norm of the gradients the optimizer steps
    with, taken in ``on_before_optimizer_step``: after AMP unscaling and before Lightning's gradient clipping. Both
    stay on the device (no synchronisation); the monitor reads them once per check. A step the grad scaler skips
    (Inf or NaN gradients under 16-bit mixed precision) gives no gradient norm: that is the scaler's routine, not a
    divergence.

    Args:
        probe: probe inputs (a tensor, Dataset, list of inputs, mapping of columns, or list of texts with
            ``tokenizer``), or ``"train"``/``"val"`` for that dataloader's dataset; required in probe mode.
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        settings: a :class:`~topocallbacks.settings.MonitorSettings` (instead of a preset), or a mapping of options
            merged into the preset's: the form to use from LightningCLI's YAML
            (``settings: {check_every: 200, policy: {action: lower_lr}}``).
        tokenizer: a Hugging Face tokenizer, for a probe given as a list of texts (truncated at
            ``probe.max_length``, padded, with an attention mask the pooling respects).
        check_on_validation_end: also check after every validation run (probe mode; sanity checks skipped),
            e.g. with a large ``check_every`` to check once per validation only.
        **overrides: any monitor option by name, merged last: ``layer``, ``check_every``, ``index``, ``mode``,
            ``policy={...}``, ``history_path``, ``checkpoint_on_stop``, ``rescue_dir``... (see
            :class:`~topocallbacks.settings.MonitorSettings`). ``layers=[...]`` watches several layers in one probe
            pass, each logged as ``topo/<layer>/...`` (names, patterns or a preset's shortcut such as
            ``"all_blocks"``; ``policy={"layer_rule": "any"}`` acts on any of them, once per check).

    Raises:
        InputError: a value is out of range, or no layer is named; an unknown layer name is reported in ``setup``
            with the closest module names.
        ConfigError: an unknown preset or option (with the closest one).

    Example:
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
        resolved = resolve_settings(preset, settings, overrides)
        if resolved.probe.layer is None and resolved.probe.layers is None:
            raise InputError("`layer` is required: the name of the module whose output to watch (or a `preset`)")
        self.preset = preset
        self._probe_source = probe if isinstance(probe, str) else None
        if self._probe_source is not None and self._probe_source not in ("train", "val"):
            raise InputError(f"`probe` given as text must be 'train' or 'val' (a dataloader's dataset), got {probe!r}")
        self.streaming = resolved.schedule.mode == "stream"
        if not self.streaming and probe is None:
            raise InputError("`probe` is required in probe mode: a tensor, Dataset, list of inputs, 'train' or 'val'")
        self.monitor = TopoMonitor(resolved, probe=None if self._probe_source else probe, tokenizer=tokenizer)
        self.check_on_validation_end = bool(check_on_validation_end)
        self.capture = StreamCapture(resolved.probe.pooling, resolved.schedule.points_per_batch, resolved.seed)
        self._unlogged: list[CheckRecord] = []  # the latest check's records, until they are callback metrics
        self._sharded_root: torch.nn.Module | None = None  # the strategy's FSDP/DeepSpeed root, if any
        # The training channels of the optimizer step under way: the micro-batches' losses (summed on the device)
        # and the gradient norm of each optimizer step since the last batch end; the global step last seen.
        self._loss_sum: Any = None
        self._loss_count = 0
        self._grad_norms: list[torch.Tensor] = []
        self._grad_skipped = False  # the grad scaler skipped an optimizer step of this batch
        self._seen_step: int | None = None

    @classmethod
    def from_preset(cls, preset: str, probe: Any = None, **overrides: Any) -> TopoCollapseCallback:
        """A callback configured by a preset (a name from ``topocallbacks.presets.available()`` or a YAML path).

        Every value can be overridden: ``from_preset("gpt", probe=ids, check_every=20, policy={"patience": 5})``
        (a ``policy`` mapping is merged into the preset's policy; a ``Policy`` replaces it).

        Raises:
            ConfigError: an unknown preset, an invalid preset file or an unknown override key.
        """
        return cls(probe=probe, preset=preset, **overrides)

    @property
    def layer(self) -> tuple[str, ...]:
        """The watched layer's name or patterns."""
        return self.monitor.settings.probe.layer or ()

    @property
    def layers(self) -> tuple[str, ...]:
        """The several watched layers' names, patterns or shortcuts (empty: ``layer`` alone)."""
        return self.monitor.settings.probe.layers or ()

    @property
    def state_key(self) -> str:
        """Unique per watched layer(s) and mode (and ``prefix`` when given, to watch one layer twice)."""
        key: dict[str, str] = {"layer": ",".join(self.layer), "mode": self.monitor.settings.schedule.mode}
        if self.layers:
            key["layers"] = ",".join(self.layers)
        if self.monitor.settings.output.prefix is not None:
            key["prefix"] = self.monitor.settings.output.prefix
        return self._generate_state_key(**key)

    @property
    def history(self) -> list[Any]:
        """The check records and interventions so far (see :class:`~topocallbacks.monitor.TopoMonitor`)."""
        return self.monitor.history

    def report(self, out_dir: str | os.PathLike[str], *, title: str | None = None) -> Path | None:
        """The HTML report of the history so far, in ``out_dir`` (:meth:`TopoMonitor.report`; rank 0 writes)."""
        return self.monitor.report(out_dir, title=title)

    # --- Lightning hooks ------------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """The metrics' prefix: ``topo``, or ``topo/<layer>`` beside other callbacks of this class (set in setup)."""
        return self.monitor.prefix

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.monitor.resolve_layers(pl_module)  # unknown names fail here, with close matches
        if self.monitor.settings.output.prefix is None:
            ours = [c for c in trainer.callbacks if isinstance(c, TopoCollapseCallback)]  # type: ignore[attr-defined]
            if len(ours) > 1:  # beside others: each under its layer (those with their own prefix left out)
                named = [c for c in ours if c.monitor.settings.output.prefix is None]
                self.monitor.prefix = _prefix(self, pl_module, named)
        if self.streaming:
            self.capture.attach(pl_module, self.layer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.capture.detach()
        self.monitor.close()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe_source is not None and self.monitor.probe is None:
            self.monitor.set_probe(_dataloader_dataset(trainer, self._probe_source))
        if self.monitor.settings.probe.precision == "auto":
            self.monitor.autocast = trainer.strategy.precision_plugin.forward_context  # the trainer's precision
        root = trainer.strategy.model
        # FSDPStrategy wraps the LightningModule in an FSDP root: the probe's forward goes through it, which gathers
        # the root's own sharded parameters (calling the module itself would see only this rank's shard). DeepSpeed
        # gathers through hooks on the modules themselves, a ModelParallelStrategy's fully_shard modules are the
        # LightningModule itself, and DDP's wrapper is not needed: those probe the LightningModule.
        self._sharded_root = root if is_fsdp1_wrapper(root) and root is not pl_module else None
        self._loss_sum, self._loss_count, self._grad_norms, self._grad_skipped = None, 0, [], False
        self._seen_step = trainer.global_step
        # A first check before any update calibrates ε and starts the warm-up on the initial features.
        if not self.streaming:
            for record in self.monitor.on_step(trainer.global_step, model=self._probed(pl_module)):
                self._act(trainer, record)
        if not self._unlogged:  # resumed: the latest values are callback metrics again
            self._unlogged = self.monitor.last_records

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        features = self.capture.take() if self.streaming else None
        loss, grad_norm = self._dynamics(trainer, outputs)
        step = trainer.global_step
        model = self._probed(pl_module)
        for record in self.monitor.on_step(step, model=model, features=features, loss=loss, grad_norm=grad_norm):
            self._act(trainer, record)
        unlogged, self._unlogged = self._unlogged, []
        for record in unlogged:
            index = f"{prefix_of(unlogged[-1], self.prefix)}/index"  # the deciding (primary) layer's, on the bar
            for name, value in scalars_of(record, self.prefix).items():
                # Callback metrics (EarlyStopping, ModelCheckpoint, the progress bar): they stay until logged
                # again. The loggers got the record at its own step already.
                pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == index, logger=False,
                              batch_size=1)  # fmt: skip

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # Lightning calls it after the backward pass (and AMP's unscaling) and before it clips the gradients.
        if "grad_norm" not in self.monitor.settings.rule.channels:
            return
        norm = _grad_norm(optimizer, sharded=self._sharded_root is not None, strategy=trainer.strategy)
        if norm is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            if getattr(optimizer, "_step_supports_amp_scaling", False) and isinstance(scaler._scale, torch.Tensor):
                norm = norm / scaler._scale  # a fused optimizer unscales inside its step: these are still scaled
            # The scaler skips a step with Inf or NaN gradients and lowers its scale: routine, not a divergence, so
            # that step has no gradient norm. Reading it synchronises once per step, as the scaler's step does.
            if not bool(torch.isfinite(norm)):
                self._grad_skipped = True
                return
        self._grad_norms.append(norm)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Checks still pending reach the history and the loggers; their decisions can no longer act.
        for record in self.monitor.finish():
            self._write_to_loggers(trainer, record)
        if self.monitor.settings.output.summary:
            rank_zero_info(self.monitor.summary())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        wanted = self.check_on_validation_end and not self.streaming and not trainer.sanity_checking
        if wanted and step != self.monitor.last_checked_step_:
            # The loggers get the record now; it becomes a callback metric at the next training batch.
            self._act(trainer, self.monitor.check(self._probed(pl_module), step))

    def _probed(self, pl_module: pl.LightningModule) -> torch.nn.Module:
        """The module the probe runs through: the strategy's sharded root when there is one (see on_train_start)."""
        return self._sharded_root if self._sharded_root is not None else pl_module

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict["monitor"])

    # --- checks ---------------------------------------------------------------------------------------------

    def _dynamics(self, trainer: pl.Trainer, outputs: Any) -> tuple[Any, Any]:
        """This batch's share of the training channels: its optimizer step's loss and gradient norm, or ``None``s.

        ``(None, None)`` while gradients are still being accumulated (the batch's loss joins the step's). Detached
        tensors, combined on their device: with ``accumulate_grad_batches`` the micro-batches' losses (which
        automatic optimization divides by the number of micro-batches) are averaged, and the norms of the optimizer
        steps taken in one batch (several optimizers) are combined into one total norm.
        """
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            loss = loss if loss.numel() == 1 else loss.float().mean()
            if trainer.lightning_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
                loss = loss * trainer.accumulate_grad_batches  # the micro-batch's own loss
        elif not isinstance(loss, (int, float)) or isinstance(loss, bool):
            loss = None
        if loss is not None:
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1
        if trainer.global_step == self._seen_step:
            return None, None  # no optimizer step in this batch: its loss joins the next step's
        self._seen_step = trainer.global_step
        step_loss = None
        if self._loss_sum is not None:
            step_loss = self._loss_sum if self._loss_count == 1 else self._loss_sum / self._loss_count
        norms, self._grad_norms = self._grad_norms, []
        grad_norm = None
        if self._grad_skipped:
            self._grad_skipped = False
        elif len(norms) == 1:
            grad_norm = norms[0]
        elif norms:
            grad_norm = torch.linalg.vector_norm(torch.stack(norms))
        self._loss_sum, self._loss_count = None, 0
        return step_loss, grad_norm

    def _act(self, trainer: pl.Trainer, record: CheckRecord) -> None:
        """Log a record (the same on every rank) and carry out its decision on every rank."""
        self._write_to_loggers(trainer, record)
        if self._unlogged and self._unlogged[-1].step != record.step:
            self._unlogged = []  # an older check's records: this one's replace them
        self._unlogged.append(record)
        self.monitor.act(record, _LightningActuator(trainer, self.monitor.settings.interventions.rescue_dir))

    def _write_to_loggers(self, trainer: pl.Trainer, record: CheckRecord) -> None:
        """The record's values to every logger of the trainer (rank 0), at the step of the check."""
        if trainer.is_global_zero and trainer.loggers:
            scalars = scalars_of(record, self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=record.step)


def _grad_norm(optimizer: torch.optim.Optimizer, *, sharded: bool, strategy: Any) -> torch.Tensor | None:
    """The total L2 norm of the gradients ``optimizer`` steps with, on their device (None: no gradients).

    DTensor gradients (FSDP2, tensor parallelism) are reduced as their placements say; FSDP1's flat gradients
    (``sharded``) are each rank's shard, whose squared norms are summed across ranks.
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
    elif sharded:
        norm = strategy.reduce(norm.square(), reduce_op="sum").sqrt()
    return norm.detach()


def _prefix(callback: TopoCollapseCallback, model: pl.LightningModule, callbacks: list[Any]) -> str:
    """``topo/<watched module>`` of ``callback`` among ``callbacks`` (then the mode, then a number if shared)."""
    names = [resolve_layer(model, c.layer) if c.layer else ",".join(c.layers) for c in callbacks]
    named = [
        f"{n}/{c.monitor.settings.schedule.mode}" if names.count(n) > 1 else n
        for n, c in zip(names, callbacks, strict=True)
    ]
    named = [f"{n}/{i}" if named.count(n) > 1 else n for i, n in enumerate(named)]
    return f"topo/{named[next(i for i, c in enumerate(callbacks) if c is callback)]}"


def _dataloader_dataset(trainer: pl.Trainer, which: str) -> Any:
    """The dataset behind the trainer's training or (first) validation dataloader.

    Lightning loads validation dataloaders lazily (at the sanity check or the first validation), so when they are
    not loaded yet the fit loop's validation loop is asked to load them now (it does not when validation is off).
    """
    if which == "val" and trainer.val_dataloaders is None:
        trainer.fit_loop.epoch_loop.val_loop.setup_data()
    loaders: Any = trainer.train_dataloader if which == "train" else trainer.val_dataloaders
    if loaders is None and which == "val" and trainer.limit_val_batches == 0:
        raise InputError(
            "`probe`='val' needs the validation dataloader, which Lightning does not load with limit_val_batches=0; "
            "pass the probe inputs (e.g. the validation dataset) instead"
        )
    if isinstance(loaders, Mapping):
        loaders = next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    dataset = getattr(loaders, "dataset", None)
    if dataset is None:
        raise InputError(f"`probe`={which!r} needs a {which} dataloader with a dataset; none was given to fit()")
    return dataset
