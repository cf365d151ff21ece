"""The Hugging Face ``transformers.Trainer`` callback, a thin adapter around :class:`~topocallbacks.TopoMonitor`.

It runs the monitor's checks during ``Trainer.train`` and steers the loop only through ``TrainerControl`` flags
and the optimizer and scheduler the Trainer hands to its callbacks; its state goes to ``trainer_state.json``
through ``ExportableState``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..distributed import rank_and_world
from ..exceptions import InputError
from ..interventions import current_learning_rates, scale_learning_rate
from ..monitor import TopoMonitor
from ..policy import Action, Decision, Policy
from ..presets import monitor_settings, reject_unknown
from ..probe import Probe, resolve_module
from ..sinks import scalars_of

__all__ = ["TopoCollapseTrainerCallback"]

# Probes of the callbacks alive in this process, by content hash. ``Trainer`` restores a callback from a
# checkpoint by calling the class with the JSON arguments saved by ``state()``, which cannot hold the probe's
# tensors; the restored callback finds them here, in the callback the user created for the resumed run.
_PROBES: weakref.WeakValueDictionary[str, Probe] = weakref.WeakValueDictionary()
_LABEL_KEYS = ("labels", "label", "label_ids")


class TopoCollapseTrainerCallback(TrainerCallback, ExportableState):
    """Watch representational collapse with topology during ``transformers.Trainer.train``, and act on it.

    Every ``check_every`` optimizer steps (and once when training starts) the probe runs through the model (no
    grad, eval mode, modes restored), the index and its components are computed, added to ``state.log_history``
    (``topo/index``, ``topo/ci``, ...) and to the monitor's own sinks (``history_path``, ``tensorboard_dir``, e.g.
    ``args.logging_dir``), and the policy's decision is applied:

    * ``warn``: a warning (rank 0);
    * ``lower_lr``: the optimizer's param groups *and* the scheduler's base rates are scaled, so the cut survives
      the Trainer's ``LambdaLR`` schedules (linear, cosine, with warm-up);
    * ``stop``: ``control.should_training_stop``, with ``control.should_save`` first (``checkpoint_on_stop``), so
      the Trainer saves a checkpoint of that step before it stops;
    * ``control.should_save`` too when the policy asks for a rescue checkpoint.

    Args:
        probe: the probe inputs (a tensor, a ``torch`` Dataset, a list of tensors or of mappings such as
            tokenizer output, or a ``datasets.Dataset`` in torch format, label columns dropped), or
            ``"train"``/``"eval"`` for the Trainer's dataset (label columns dropped).
            Required in probe mode.
        layer: the watched module's name (or patterns, e.g. ``"*.ln_f"``) in the model.
        preset: a preset name (``topocallbacks.presets.available()``) or YAML path whose values are the defaults.
        check_every: optimizer steps between checks.
        policy: a :class:`~topocallbacks.policy.Policy`, or a mapping of its arguments merged into the preset's
            policy (default: the preset's, else :func:`~topocallbacks.monitor.default_policy`).
        checkpoint_on_stop: let the Trainer save a checkpoint before stopping.
        probe_hash: set by a restore from ``trainer_state.json`` (the saved probe's content hash); not for users.
        **monitor_kwargs: any other :class:`~topocallbacks.monitor.TopoMonitor` argument (``index``, ``mode``,
            ``max_probe_samples``, ``history_path``, ...); None takes the preset's value.

    Raises:
        InputError: an argument is out of range; an unknown layer is reported at ``on_train_begin`` with the closest
            module names.
        ConfigError: an unknown preset or argument name.

    Example:
        >>> import torch
        >>> from topocallbacks.hf import TopoCollapseTrainerCallback
        >>> callback = TopoCollapseTrainerCallback(probe=torch.randn(64, 8), layer="encoder", check_every=50)
        >>> callback.monitor.check_every, callback.monitor.index
        (50, 'diagram_drift')
    """

    def __init__(
        self,
        probe: Any = None,
        layer: str | list[str] | None = None,
        *,
        preset: str | None = None,
        check_every: int | None = None,
        policy: Mapping[str, Any] | Policy | None = None,
        checkpoint_on_stop: bool = True,
        probe_hash: str | None = None,
        **monitor_kwargs: Any,
    ) -> None:
        if "mode" in monitor_kwargs and monitor_kwargs["mode"] not in (None, "probe"):
            raise InputError(
                f"`mode` must be 'probe' for the Hugging Face callback (streaming needs a training-forward hook "
                f"it does not install yet), got {monitor_kwargs['mode']!r}"
            )
        settings = monitor_settings(preset, layer=layer, check_every=check_every, policy=policy, **monitor_kwargs)
        if "layer" not in settings:
            raise InputError("`layer` is required: the name of the module whose output to watch (or a `preset`)")
        settings["mode"] = "probe"
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
        elif probe is None:
            raise InputError("`probe` is required: a tensor, Dataset, list of inputs, 'train' or 'eval'")
        self.monitor = TopoMonitor(probe=None if self._probe_source or known else probe, **settings)
        if known is not None:
            self.monitor.probe = known
        if self.monitor.probe is not None:
            _PROBES[self.monitor.probe.spec.content_hash] = self.monitor.probe
        self.preset = preset
        self.layer = settings["layer"]
        self.checkpoint_on_stop = bool(checkpoint_on_stop)
        # The JSON arguments state() saves: what the user passed, minus the probe's tensors.
        self._arguments: dict[str, Any] = {
            "probe": self._probe_source,
            "layer": layer,
            "preset": preset,
            "check_every": check_every,
            "policy": policy.arguments() if isinstance(policy, Policy) else None if policy is None else dict(policy),
            "checkpoint_on_stop": self.checkpoint_on_stop,
            **{key: value for key, value in monitor_kwargs.items() if _is_json(value)},
        }
        self._last_checked_step: int | None = None
        self._restored: Mapping[str, Any] | None = None

    @classmethod
    def from_preset(cls, preset: str, probe: Any = None, **overrides: Any) -> TopoCollapseTrainerCallback:
        """A callback configured by a preset (a name from ``topocallbacks.presets.available()`` or a YAML path).

        Every value can be overridden: ``from_preset("gpt", probe=ids, check_every=20, policy={"patience": 5})``.

        Raises:
            ConfigError: an unknown preset, an invalid preset file or an unknown override key.
        """
        reject_unknown(
            overrides,
            (set(inspect.signature(cls).parameters) | set(inspect.signature(TopoMonitor).parameters))
            - {"probe", "preset", "probe_hash", "monitor_kwargs"},
        )
        return cls(probe=probe, preset=preset, **overrides)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The check records and interventions so far (see :class:`~topocallbacks.monitor.TopoMonitor`)."""
        return self.monitor.history

    # --- ExportableState ------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``Trainer`` saves in ``trainer_state.json``: the JSON arguments and the monitor's state."""
        probe = self.monitor.probe
        return {
            "args": {**self._arguments, "probe_hash": None if probe is None else probe.spec.content_hash},
            "attributes": {
                "_restored": {"monitor": self.monitor.state_dict(), "last_checked_step": self._last_checked_step}
            },
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
            self._last_checked_step = restored["last_checked_step"]
            self._restored = None
        if self._probe_source is not None and self.monitor.probe is None:
            loader = kwargs.get(f"{self._probe_source}_dataloader")
            dataset = getattr(loader, "dataset", None)
            if dataset is None:
                raise InputError(f"`probe`={self._probe_source!r} needs the Trainer's {self._probe_source} dataset")
            self.monitor.set_probe(_InputsOnly(dataset))
        # A first check before any update calibrates ε and starts the warm-up on the initial features.
        self._check(args, state, control, model, kwargs)
        return control

    def _saved_state(self, state: TrainerState) -> Mapping[str, Any] | None:
        """This callback's state in a checkpoint being resumed from (None on a fresh run)."""
        if self.monitor.history or not state.global_step:
            return None  # already running, or nothing was trained before this run
        stored: Any = state.stateful_callbacks  # a dict by class name once TrainerState is built (typed as a list)
        saved = stored.get(type(self).__name__) if isinstance(stored, Mapping) else None
        for entry in saved if isinstance(saved, list) else [] if saved is None else [saved]:
            if entry.get("args", {}).get("layer") == self._arguments["layer"]:
                restored: Mapping[str, Any] = entry["attributes"]["_restored"]
                return restored
        return None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self.monitor.should_check(state.global_step):
            self._check(args, state, control, kwargs["model"], kwargs)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self.monitor.close()
        return control

    # --- checks ---------------------------------------------------------------------------------------------

    def _check(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module,
        kwargs: Mapping[str, Any],
    ) -> None:
        step = state.global_step
        if step == self._last_checked_step:
            return  # the step a resumed run was saved at
        self._last_checked_step = step
        record = self.monitor.check_everywhere(model, step)
        state.log_history.append({**scalars_of(record), "step": step})
        decision = Decision.from_dict(record["decision"])
        if decision.fired:
            self._apply(state, control, decision, kwargs)

    def _apply(
        self, state: TrainerState, control: TrainerControl, decision: Decision, kwargs: Mapping[str, Any]
    ) -> None:
        rank, _ = rank_and_world()
        step = state.global_step
        done: list[str] = []
        if decision.checkpoint or (decision.action is Action.STOP and self.checkpoint_on_stop):
            control.should_save = True
            done.append(f"control.should_save set (the Trainer saves checkpoint-{step})")
        if decision.action is Action.WARN:
            if rank == 0:
                warnings.warn(f"topocallbacks at step {step}: {decision.reason}", RuntimeWarning, stacklevel=2)
            done.append("warned")
        elif decision.action is Action.LOWER_LR:
            assert decision.lr_factor is not None
            optimizer = kwargs.get("optimizer")
            scheduler = kwargs.get("lr_scheduler")
            if optimizer is None:
                raise InputError(f"`lower_lr` at step {step}: the Trainer passed no optimizer to the callback")
            # accelerate wraps both; the wrappers expose the torch objects as .optimizer and .scheduler.
            optimizer = getattr(optimizer, "optimizer", optimizer)
            schedulers = [] if scheduler is None else [getattr(scheduler, "scheduler", scheduler)]
            scale_learning_rate([optimizer], schedulers, decision.lr_factor)
            rates = ", ".join(f"{lr:.3g}" for lr in current_learning_rates([optimizer]))
            done.append(f"learning rate x {decision.lr_factor} in the optimizer and its scheduler, now {rates}")
        elif decision.action is Action.STOP:
            control.should_training_stop = True
            done.append("control.should_training_stop set")
        self.monitor.record_intervention(step, decision, "; ".join(done))


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


def _is_json(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))
