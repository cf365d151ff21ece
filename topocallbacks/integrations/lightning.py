"""The Lightning callback, a thin adapter around :class:`~topocallbacks.monitor.TopoMonitor`.

It runs the monitor's checks during ``Trainer.fit`` and applies their decisions (warn, cut the learning rate,
save a rescue checkpoint, stop).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ..distributed import rank_and_world
from ..exceptions import InputError
from ..interventions import current_learning_rates, scale_learning_rate
from ..monitor import TopoMonitor
from ..policy import Action, Decision, Policy
from ..presets import monitor_settings, reject_unknown
from ..probe import _first_tensor, _pool, resolve_module
from ..sinks import scalars_of

__all__ = ["TopoCollapseCallback"]


class TopoCollapseCallback(Callback):
    """Watch representational collapse with topology during ``Trainer.fit``, and act on it.

    Every ``check_every`` optimizer steps (and once when training starts) the probe runs through the module
    (no grad, eval mode, modes restored), the Collapse Index and its components are computed and logged with
    ``pl_module.log`` (``topo/ci``, ``topo/betti0``, ...; the same value on every rank, so
    ``EarlyStopping(monitor="topo/ci")`` works), and the policy's decision is applied:

    * ``warn``: a warning (rank 0);
    * ``lower_lr``: every optimizer's param groups *and* every scheduler's base rates are scaled, so the cut
      survives ``LambdaLR``-family, cosine, OneCycle and plateau schedulers;
    * ``stop``: ``trainer.should_stop`` is set (OR-ed, never cleared), after a checkpoint is saved
      (``checkpoint_on_stop``);
    * a rescue checkpoint first when the policy asks for one.

    Every decision that acts, and what was done, goes to the history (``callback.history``, and the JSONL file).

    Args:
        probe: probe inputs (tensor, Dataset or list); required in probe mode.
        layer: the watched module's name in the LightningModule (``pl_module.named_modules()``).
        check_every: optimizer steps between checks (>= 1).
        check_on_validation_end: also check after every validation run (probe mode; sanity checks skipped),
            e.g. with a large ``check_every`` to check once per validation only.
        policy: a :class:`~topocallbacks.policy.Policy`, or a mapping of its arguments merged into the preset's
            policy (default: the preset's, else :func:`~topocallbacks.monitor.default_policy`, which warns only).
        checkpoint_on_stop: save a checkpoint before stopping, so a stop never loses the last state.
        rescue_dir: directory of rescue checkpoints (default: ``trainer.default_root_dir``).
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        mode, pooling, window, points_per_batch, projection, projection_dim, normalize, epsilon, epsilon_quantile,
            epsilon_factor, weights, index, max_points, max_probe_samples, batch_size, history_path, tensorboard_dir,
            diagram_every, seed: :class:`~topocallbacks.monitor.TopoMonitor` arguments; None takes the preset's
            value, else the monitor's default. Explicit (not ``**kwargs``) so that LightningCLI can set them.

    Raises:
        InputError: an argument is out of range (checked here); an unknown layer name is reported in ``setup``
            with the closest module names.

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
        layer: str | list[str] | None = None,
        *,
        preset: str | None = None,
        check_every: int | None = None,
        check_on_validation_end: bool = False,
        # dict first: LightningCLI tries union members in order and would turn a mapping into a whole new Policy
        # instead of merging it into the preset's.
        policy: dict[str, Any] | Policy | None = None,
        checkpoint_on_stop: bool = True,
        rescue_dir: str | None = None,
        mode: str | None = None,
        pooling: str | None = None,
        window: int | None = None,
        points_per_batch: int | None = None,
        projection: str | None = None,
        projection_dim: int | None = None,
        normalize: bool | None = None,
        epsilon: float | None = None,
        epsilon_quantile: float | None = None,
        epsilon_factor: float | None = None,
        weights: str | dict[str, float] | None = None,
        index: str | None = None,
        max_points: int | None = None,
        max_probe_samples: int | None = None,
        batch_size: int | None = None,
        history_path: str | None = None,
        tensorboard_dir: str | None = None,
        diagram_every: int | None = None,
        seed: int | None = None,
    ) -> None:
        settings = monitor_settings(
            preset,
            layer=layer,
            check_every=check_every,
            policy=policy,
            mode=mode,
            pooling=pooling,
            window=window,
            points_per_batch=points_per_batch,
            projection=projection,
            projection_dim=projection_dim,
            normalize=normalize,
            epsilon=epsilon,
            epsilon_quantile=epsilon_quantile,
            epsilon_factor=epsilon_factor,
            weights=weights,
            index=index,
            max_points=max_points,
            max_probe_samples=max_probe_samples,
            batch_size=batch_size,
            history_path=history_path,
            tensorboard_dir=tensorboard_dir,
            diagram_every=diagram_every,
            seed=seed,
        )
        if "layer" not in settings:
            raise InputError("`layer` is required: the name of the module whose output to watch (or a `preset`)")
        self.preset = preset
        self.layer = settings["layer"]
        self.mode = settings.get("mode", "probe")
        self._probe_source = probe if isinstance(probe, str) else None
        if self._probe_source is not None and self._probe_source not in ("train", "val"):
            raise InputError(f"`probe` given as text must be 'train' or 'val' (a dataloader's dataset), got {probe!r}")
        if self.mode == "probe" and probe is None:
            raise InputError("`probe` is required in probe mode: a tensor, Dataset, list of inputs, 'train' or 'val'")
        self.monitor = TopoMonitor(probe=None if self._probe_source else probe, **settings)
        self.checkpoint_on_stop = bool(checkpoint_on_stop)
        self.check_on_validation_end = bool(check_on_validation_end)
        self.rescue_dir = rescue_dir
        self._last_checked_step: int | None = None
        self._captured: list[torch.Tensor] = []
        self._handle: Any = None

    # --- Lightning hooks ------------------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, preset: str, probe: Any = None, **overrides: Any) -> TopoCollapseCallback:
        """A callback configured by a preset (a name from ``topocallbacks.presets.available()`` or a YAML path).

        Every value can be overridden: ``from_preset("gpt", probe=ids, check_every=20, policy={"patience": 5})``
        (a ``policy`` mapping is merged into the preset's policy; a ``Policy`` replaces it).

        Raises:
            ConfigError: an unknown preset, an invalid preset file or an unknown override key.
        """
        reject_unknown(overrides, set(inspect.signature(cls).parameters) - {"probe", "preset"})
        return cls(probe=probe, preset=preset, **overrides)

    @property
    def state_key(self) -> str:
        layer = self.layer if isinstance(self.layer, str) else ",".join(self.layer)
        return self._generate_state_key(layer=layer, mode=self.mode)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The check records and interventions so far (see :class:`~topocallbacks.monitor.TopoMonitor`)."""
        return self.monitor.history

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        module = resolve_module(pl_module, self.layer)  # unknown names fail here, with close matches
        if self.mode == "stream" and self._handle is None:
            self._handle = module.register_forward_hook(self._capture)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.monitor.close()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe_source is not None and self.monitor.probe is None:
            self.monitor.set_probe(_dataloader_dataset(trainer, self._probe_source))
        # A first check before any update calibrates ε and starts the warm-up on the initial features.
        if self.mode == "probe":
            self._check(trainer, pl_module, log=False)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.mode == "stream":
            self._observe(trainer, pl_module)
        elif self.monitor.should_check(step):
            self._check(trainer, pl_module, log=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_on_validation_end and self.mode == "probe" and not trainer.sanity_checking:
            # Logging is not allowed in on_validation_end: the record goes to the history and the sinks.
            self._check(trainer, pl_module, log=False)

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor.state_dict(), "last_checked_step": self._last_checked_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict["monitor"])
        self._last_checked_step = state_dict["last_checked_step"]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None  # hooks are registered again in setup (ddp_spawn pickles callbacks)
        state["_captured"] = []
        return state

    # --- checks ---------------------------------------------------------------------------------------------

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, log: bool) -> None:
        step = trainer.global_step
        if step == self._last_checked_step:
            return  # gradient accumulation, or the step a resumed run was saved at
        self._last_checked_step = step
        self._act(trainer, pl_module, self.monitor.check_everywhere(pl_module, step), log=log)

    def _capture(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """Streaming mode: keep the pooled output of the watched layer during training forwards."""
        if module.training:
            pooling = self.monitor.extractor.pooling if self.monitor.extractor is not None else "auto"
            pooled = _pool(_first_tensor(output).detach(), pooling, None)
            self._captured.append(pooled.reshape(pooled.shape[0], -1).to("cpu", torch.float32))

    def _observe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        rank, _ = rank_and_world()
        captured, self._captured = self._captured, []
        record = None
        if rank == 0 and captured:
            record = self.monitor.observe(torch.cat(captured).numpy(), step)
        if not self.monitor.should_check(step) or step == self._last_checked_step:
            return
        self._last_checked_step = step
        # Every rank reaches this broadcast on the same steps: rank 0 watches its own batches and decides.
        shared = self.monitor.share() if rank == 0 and record is not None else None
        adopted = self.monitor.adopt(shared)
        if adopted is not None:
            self._act(trainer, pl_module, adopted, log=True)

    def _act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: dict[str, Any], *, log: bool) -> None:
        """Log rank 0's record (the same on every rank) and apply its decision on every rank."""
        if log:
            for name, value in scalars_of(record).items():
                pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "topo/ci", batch_size=1)
        decision = Decision.from_dict(record["decision"])
        if decision.fired:
            self._apply(trainer, decision)

    def _apply(self, trainer: pl.Trainer, decision: Decision) -> None:
        rank, _ = rank_and_world()
        step = trainer.global_step
        done: list[str] = []
        if decision.checkpoint or (decision.action is Action.STOP and self.checkpoint_on_stop):
            directory = self.rescue_dir or trainer.default_root_dir
            path = os.path.join(directory, f"topo-{decision.action.value}-step{step}.ckpt")
            trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
            done.append(f"checkpoint saved to {path}")
        if decision.action is Action.WARN:
            if rank == 0:
                warnings.warn(f"topocallbacks at step {step}: {decision.reason}", RuntimeWarning, stacklevel=2)
            done.append("warned")
        elif decision.action is Action.LOWER_LR:
            assert decision.lr_factor is not None
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            scale_learning_rate(trainer.optimizers, schedulers, decision.lr_factor)
            rates = ", ".join(f"{lr:.3g}" for lr in current_learning_rates(trainer.optimizers))
            done.append(
                f"learning rate x {decision.lr_factor} in {len(trainer.optimizers)} optimizer(s) and "
                f"{len(schedulers)} scheduler(s), now {rates}"
            )
        elif decision.action is Action.STOP:
            trainer.should_stop = True
            done.append("trainer.should_stop set")
        self.monitor.record_intervention(step, decision, "; ".join(done))


def _dataloader_dataset(trainer: pl.Trainer, which: str) -> Any:
    """The dataset behind the trainer's training or (first) validation dataloader.

    Lightning loads validation dataloaders lazily (at the sanity check or the first validation), so when they are
    not loaded yet the datamodule, then the source given to ``fit``, is asked for them.
    """
    loaders = trainer.train_dataloader if which == "train" else trainer.val_dataloaders
    if loaders is None and which == "val":
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            loaders = datamodule.val_dataloader()
        else:
            # The validation loop's source of what was passed to fit() (Lightning 2.x; absent elsewhere).
            val_loop = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "val_loop", None)
            source = getattr(val_loop, "_data_source", None)
            loaders = source.dataloader() if source is not None and source.is_defined() else None
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    dataset = getattr(loaders, "dataset", None)
    if dataset is None:
        raise InputError(f"`probe`={which!r} needs a {which} dataloader with a dataset; none was given to fit()")
    return dataset
