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

from ..check import CheckRecord
from ..exceptions import ConfigError, InputError, SnapshotUnsupported
from ..interventions import StateActuator, current_learning_rates, scale_learning_rate
from ..probe import is_fsdp1_wrapper, resolve_layer
from ..sinks import distinct_prefixes, prefix_of, scalars_of
from ..snapshots import DEEPSPEED_REFUSAL, save_on_rank_zero


class LightningActuator(StateActuator):
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
        # FSDPStrategy wraps the module in its FSDP root: the sharded state is read and written there.
        sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
        model = trainer.strategy.model if sharded else trainer.lightning_module
        return model, trainer.optimizers, schedulers, scaler

    def _check_snapshots(self) -> None:
        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            raise SnapshotUnsupported(DEEPSPEED_REFUSAL)

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"module, {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s) restored"

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        return save_on_rank_zero(snapshot, self.rescue_dir, tag + ".pt")


def set_callback_metrics(trainer: pl.Trainer, records: list[CheckRecord], prefix: str) -> None:
    """The records' values as the trainer's callback metrics, the deciding (last) record's index on the progress bar.

    What EarlyStopping and ModelCheckpoint read (``trainer.callback_metrics``); the values stay until the next check
    replaces them. They are written into the dictionaries Lightning keeps them in, not through
    ``LightningModule.log``, which costs about 0.2 ms a value (some 20 values a check: 4-5 ms, as much as a whole
    check of a small probe).
    """
    metrics = trainer.callback_metrics
    for record in records:
        metrics.update({name: torch.tensor(value) for name, value in scalars_of(record, prefix).items()})
    index = f"{prefix_of(records[-1], prefix)}/index"
    if index in metrics:
        trainer.progress_bar_metrics[index] = float(metrics[index])


def refuse_unsupported_rollback(trainer: pl.Trainer, keeps_snapshots: bool) -> None:
    """At set-up: a rule that can roll back (or restore before a stop) under DeepSpeed is refused, naming why.

    Raises:
        ConfigError: DeepSpeedStrategy and a rule that keeps snapshots.
    """
    if keeps_snapshots and isinstance(trainer.strategy, DeepSpeedStrategy):
        raise ConfigError(DEEPSPEED_REFUSAL)


def text_target(logger: Any) -> tuple[str, Any, str | None] | None:
    """Where ``logger`` takes an intervention's text, or None (scalars only, e.g. CSV).

    ``(kind, object, MLflow run id)`` for `write_text`.
    """
    kind = {"TensorBoardLogger": "tensorboard", "MLFlowLogger": "mlflow", "WandbLogger": "wandb"}.get(
        type(logger).__name__
    )
    if kind is None:
        return None
    return kind, logger.experiment, getattr(logger, "run_id", None) if kind == "mlflow" else None


def step_grad_norm(trainer: pl.Trainer, optimizer: torch.optim.Optimizer, *, sharded: bool) -> Any:
    """The gradient norm of an optimizer step (on its device, unscaled), None without gradients, or "skipped".

    A fused optimizer unscales inside its step, so its gradients are still scaled here: the norm is divided by the
    scale. The grad scaler skips a step with Inf or NaN gradients and lowers its scale: routine, not a divergence, so
    that step has no gradient norm ("skipped"); reading it synchronises once per step, as the scaler's step does.
    """
    norm = grad_norm(optimizer, sharded=sharded, strategy=trainer.strategy)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if norm is None or scaler is None:
        return norm
    if getattr(optimizer, "_step_supports_amp_scaling", False) and isinstance(scaler._scale, torch.Tensor):
        norm = norm / scaler._scale
    return norm if bool(torch.isfinite(norm)) else "skipped"


def grad_norm(optimizer: torch.optim.Optimizer, *, sharded: bool, strategy: Any) -> torch.Tensor | None:
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


def probe_source(probe: Any, *, required: bool) -> str | None:
    """The dataloader a ``probe`` given by name designates ("train", "val"), else None; checks the argument.

    Raises:
        InputError: another name, or no probe where one is ``required`` (probe mode).
    """
    source = probe if isinstance(probe, str) else None
    if source is not None and source not in ("train", "val"):
        raise InputError(f"`probe` given as text must be 'train' or 'val' (a dataloader's dataset), got {probe!r}")
    if required and probe is None:
        raise InputError("`probe` is required in probe mode: a tensor, Dataset, list of inputs, 'train' or 'val'")
    return source


def probe_root(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.nn.Module | None:
    """The module the probe must run through instead of the LightningModule, or None.

    FSDPStrategy wraps the LightningModule in an FSDP root: the probe's forward goes through it, which gathers the
    root's own sharded parameters (calling the module itself would see only this rank's shard). DeepSpeed gathers
    through hooks on the modules themselves, a ModelParallelStrategy's fully_shard modules are the LightningModule
    itself, and DDP's wrapper is not needed: those probe the LightningModule.
    """
    root = trainer.strategy.model
    return root if is_fsdp1_wrapper(root) and root is not pl_module else None


def name_metrics(callback: Any, pl_module: pl.LightningModule, ours: list[Any]) -> None:
    """Beside other callbacks of its class (``ours``), log under ``topo/<layer>`` (unless a prefix was given)."""
    named = [c for c in ours if c.monitor.settings.output.prefix is None]
    if callback.monitor.settings.output.prefix is None and len(ours) > 1:
        names = [resolve_layer(pl_module, c.layer) if c.layer else ",".join(c.layers) for c in named]
        modes = [c.monitor.settings.schedule.mode for c in named]
        callback.monitor.prefix = distinct_prefixes(names, modes)[named.index(callback)]
