"""What the Lightning callback needs from Lightning beyond its hooks: its means to act, the gradient norm, its data.

The actuator (the trainer's optimizers, schedulers, grad scaler, ``should_stop`` and checkpoints), the norm of the
gradients an optimizer steps with (DTensor and FSDP shards reduced), and a dataloader's dataset as the probe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from ..exceptions import InputError
from ..probe import is_fsdp1_wrapper
from .core import FrameworkActuator, TextSource, TextTarget, optimizer_grad_norm, text_targets

TEXT_SOURCES = {  # the loggers that take text, through their experiment (MLflow: a client, with the run id)
    "TensorBoardLogger": TextSource(kind="tensorboard", target="experiment"),
    "MLFlowLogger": TextSource(kind="mlflow", target="experiment", run_id="run_id"),
    "WandbLogger": TextSource(kind="wandb", target="experiment"),
}


class LightningActuator(FrameworkActuator):
    """Decisions carried out with the trainer's own means."""

    def __init__(self, trainer: pl.Trainer, rescue_dir: str | None) -> None:
        self.trainer = trainer
        self.snapshot_dir = rescue_dir or trainer.default_root_dir
        self.deepspeed = is_deepspeed(trainer)

    def scale_learning_rate(self, factor: float) -> str:
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        rates = self._scale(self.trainer.optimizers, schedulers, factor)
        return (
            f"learning rate x {factor} in {len(self.trainer.optimizers)} optimizer(s) and {len(schedulers)} "
            f"scheduler(s), now {rates}"
        )

    def request_stop(self) -> str:
        self.trainer.should_stop = True  # OR-ed with the other callbacks' requests, never cleared
        return "trainer.should_stop set"

    def checkpoint_location(self, tag: str) -> str:
        return f"saved to {os.path.join(self.snapshot_dir, tag + '.ckpt')}"

    def save_checkpoint(self, tag: str) -> None:
        self.trainer.save_checkpoint(
            os.path.join(self.snapshot_dir, tag + ".ckpt")
        )  # every rank calls it; rank 0 writes

    def _parts(self) -> FrameworkActuator.Parts:
        trainer = self.trainer
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # mixed precision's GradScaler, if any
        # FSDPStrategy wraps the module in its FSDP root: the sharded state is read and written there.
        sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
        model = trainer.strategy.model if sharded else trainer.lightning_module
        return self.Parts(model=model, optimizers=trainer.optimizers, schedulers=schedulers, scaler=scaler)

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"module, {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s) restored"


def set_callback_metrics(trainer: pl.Trainer, values: list[dict[str, float]], index: str) -> None:
    """A check's records' values as the trainer's callback metrics; the deciding record's ``index`` on the bar.

    What EarlyStopping and ModelCheckpoint read (``trainer.callback_metrics``); the values stay until the next check
    replaces them. They are written into the dictionaries Lightning keeps them in, not through
    ``LightningModule.log``, which costs about 0.2 ms a value (some 20 values a check: 4-5 ms, as much as a whole
    check of a small probe).
    """
    metrics = trainer.callback_metrics
    for scalars in values:
        metrics.update({name: torch.tensor(value) for name, value in scalars.items()})
    if index in metrics:
        trainer.progress_bar_metrics[index] = float(metrics[index])


def is_deepspeed(trainer: pl.Trainer) -> bool:
    """Whether the trainer trains with DeepSpeed (which refuses snapshots)."""
    return isinstance(trainer.strategy, DeepSpeedStrategy)


def loggers_taking_text(trainer: pl.Trainer) -> list[TextTarget]:
    """The trainer's loggers that take an intervention's text (rank 0; not CSV, which takes scalars only)."""
    return text_targets(trainer.loggers if trainer.is_global_zero else [], TEXT_SOURCES)


def step_grad_norm(trainer: pl.Trainer, optimizer: torch.optim.Optimizer, *, sharded: bool) -> Any:
    """The gradient norm of an optimizer step (on its device, unscaled), None without gradients, or "skipped".

    A fused optimizer unscales inside its step, so its gradients are still scaled here: the norm is divided by the
    scale. The grad scaler skips a step with Inf or NaN gradients and lowers its scale: routine, not a divergence, so
    that step has no gradient norm ("skipped"); reading it synchronises once per step, as the scaler's step does.
    """
    reduce = trainer.strategy.reduce
    norm = optimizer_grad_norm(optimizer, (lambda t: reduce(t, reduce_op="sum")) if sharded else None)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if norm is None or scaler is None:
        return norm
    if getattr(optimizer, "_step_supports_amp_scaling", False) and isinstance(scaler._scale, torch.Tensor):
        norm = norm / scaler._scale
    return norm if bool(torch.isfinite(norm)) else "skipped"


def dataloader_dataset(trainer: pl.Trainer, which: str) -> Any:
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


def probe_root(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.nn.Module | None:
    """The module the probe must run through instead of the LightningModule, or None.

    FSDPStrategy wraps the LightningModule in an FSDP root: the probe's forward goes through it, which gathers the
    root's own sharded parameters (calling the module itself would see only this rank's shard). DeepSpeed gathers
    through hooks on the modules themselves, a ModelParallelStrategy's fully_shard modules are the LightningModule
    itself, and DDP's wrapper is not needed: those probe the LightningModule.
    """
    root = trainer.strategy.model
    return root if is_fsdp1_wrapper(root) and root is not pl_module else None
