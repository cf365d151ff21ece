"""What the Hugging Face callback needs from ``transformers`` beyond its hooks: the Trainer, its means, its data.

The actuator (``TrainerControl`` flags, the optimizer and scheduler), the Trainer that holds a callback, its
reporters and the order before them, the callbacks it was built with, its datasets as probes, and the taps on it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from transformers import Trainer, TrainerControl, TrainerState
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_callback import CallbackHandler, PrinterCallback, ProgressCallback

from ..exceptions import InputError
from .core import CallbackRegistry, FrameworkActuator, InputsOnly, Tap, TextSource, TextTarget, holder_of, text_targets
from .core import gradient_norm as gradient_norm  # the fallback norm, importable here

REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())  # the callbacks `report_to` adds
TEXT_SOURCES = {  # the reporters that take text: TensorBoard's writer, the `mlflow` and `wandb` modules
    "TensorBoardCallback": TextSource(kind="tensorboard", target="tb_writer", ready="tb_writer"),
    "MLflowCallback": TextSource(kind="mlflow", target="_ml_flow", ready="_initialized"),
    "WandbCallback": TextSource(kind="wandb", target="_wandb", ready="_initialized"),
}


class TrainerActuator(FrameworkActuator):
    """Decisions carried out through ``TrainerControl`` and the optimizer and scheduler the Trainer hands over."""

    def __init__(self, state: TrainerState, control: TrainerControl, kwargs: Mapping[str, Any],
                 trainer: Trainer | None, output_dir: str | None = None) -> None:  # fmt: skip
        self.state, self.control, self.kwargs, self.trainer = state, control, kwargs, trainer
        self.snapshot_dir = output_dir or (None if trainer is None else trainer.args.output_dir) or "."
        self.deepspeed = getattr(trainer, "is_deepspeed_enabled", False)

    def scale_learning_rate(self, factor: float) -> str:
        optimizer, scheduler = self.kwargs.get("optimizer"), self.kwargs.get("lr_scheduler")
        if optimizer is None:
            raise InputError(f"`lower_lr` at step {self.state.global_step}: the Trainer passed no optimizer")
        optimizer = getattr(optimizer, "optimizer", optimizer)
        schedulers = [] if scheduler is None else [getattr(scheduler, "scheduler", scheduler)]
        rates = self._scale([optimizer], schedulers, factor)
        return f"learning rate x {factor} in the optimizer and its scheduler, now {rates}"

    def request_stop(self) -> str:
        self.control.should_training_stop = True
        return "control.should_training_stop set"

    def checkpoint_location(self, tag: str) -> str:
        return f"control.should_save set (the Trainer saves checkpoint-{self.state.global_step})"

    def save_checkpoint(self, tag: str) -> None:
        self.control.should_save = True  # the Trainer saves after this step's callbacks, the history included

    def _parts(self) -> FrameworkActuator.Parts:
        model, optimizer, scheduler = (self.kwargs.get(k) for k in ("model", "optimizer", "lr_scheduler"))
        if model is None or optimizer is None:
            raise InputError(f"`rollback` at step {self.state.global_step}: the Trainer passed no model or optimizer")
        scaler = None if self.trainer is None else getattr(self.trainer.accelerator, "scaler", None)
        # accelerate wraps the optimizer and scheduler (as .optimizer, .scheduler); their state lives in the torch
        # objects inside (and a skipped update is the inner optimizer's step(), which accelerate and the scaler call).
        optimizers = [getattr(optimizer, "optimizer", optimizer)]
        schedulers = [] if scheduler is None else [getattr(scheduler, "scheduler", scheduler)]
        if self.trainer is not None and getattr(self.trainer, "is_fsdp_enabled", False):
            model = self.trainer.model_wrapped  # the FSDP root accelerate made: the sharded state is read there
        return self.Parts(model=model, optimizers=optimizers, schedulers=schedulers, scaler=scaler)

    def _restored(self, model: Any, optimizers: list[Any], schedulers: list[Any]) -> str:
        return f"model, optimizer and {len(schedulers)} scheduler(s) restored"


def trainer_holding(callback: Any) -> Trainer | None:
    """The Trainer whose callback handler lists this very ``callback`` object, or None.

    ``transformers`` hands a callback no Trainer (its hooks get the arguments, the state, the control flags, the model,
    optimizer, scheduler and dataloaders): it is found by identity (`holder_of`), a few walks of the object graph once
    per training run; ``callback.attach(trainer)`` says it explicitly instead.
    """
    return holder_of(callback, CallbackHandler, Trainer)


def reporters(trainer: Trainer | None, console: bool = True) -> list[Any]:
    """The Trainer's ``report_to`` callbacks and (``console``) its progress bar or printer, in the handler's order."""
    kinds = (*REPORTERS, *((ProgressCallback, PrinterCallback) if console else ()))
    handler = [] if trainer is None else trainer.callback_handler.callbacks
    return [c for c in handler if isinstance(c, kinds)]


def reporters_taking_text(trainer: Trainer | None, rank_zero: bool = True) -> list[TextTarget]:
    """The ``report_to`` callbacks that take an intervention's text (none off rank 0)."""
    return text_targets([] if trainer is None or not rank_zero else trainer.callback_handler.callbacks, TEXT_SOURCES)


def place_before_reporters(callback: Any, handler: CallbackHandler) -> None:
    """Move ``callback`` before the ``report_to`` callbacks of ``handler``, so that its ``on_log`` values reach them."""
    callbacks = handler.callbacks
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, REPORTERS)), None)
    if first is not None and first < callbacks.index(callback):
        callbacks.remove(callback)
        callbacks.insert(first, callback)


# The callbacks each Trainer was built with (their on_init_end): one the Trainer rebuilds from the JSON `state()` saved
# (`restore_callback_states_from_checkpoint`) finds the user's here when training begins, and becomes its other name.
BUILT_WITH = CallbackRegistry()


def set_probe(monitor: Any, texts: Any, source: str | None, kw: Mapping[str, Any]) -> None:
    """A probe of texts (with the Trainer's tokenizer) or of the Trainer's dataset, made when training begins."""
    if texts is not None and monitor.probe is None:
        tokenizer = kw.get("processing_class")
        if tokenizer is None or not callable(tokenizer):
            raise InputError(
                "`probe` holds text: pass `tokenizer=` to the callback or `processing_class=` to the Trainer"
            )
        monitor.set_probe(texts, tokenizer=tokenizer)
    if source is not None and monitor.probe is None:
        dataset = getattr(kw.get(f"{source}_dataloader"), "dataset", None)
        if dataset is None:
            raise InputError(f"`probe`={source!r} needs the Trainer's {source} dataset")
        monitor.set_probe(InputsOnly(dataset))


def tap_trainer(trainer: Trainer | None, step: Any, channels: tuple[str, ...], args: Any) -> list[Tap]:
    """Tap the Trainer's loss and (when watched) gradient norm into ``step`` for a run (removed at its end)."""
    watched = {"loss", "grad_norm"} & set(channels)
    if trainer is None:
        reporting = bool(args.report_to) and args.report_to not in ("none", ["none"])
        if watched or reporting:
            warnings.warn(
                f"TopoCollapseTrainerCallback found no Trainer holding it: the policy's {sorted(watched)} channel(s) "
                "get no values (the gradient norm only without clipping), and topo/* values reach state.log_history "
                f"and the console but not report_to ({args.report_to}); call callback.attach(trainer) before train()",
                RuntimeWarning,
                stacklevel=4,
            )
        return []
    taps = [Tap.install(trainer, "training_step", step.add_loss)]
    accelerator = getattr(trainer, "accelerator", None)
    if "grad_norm" in watched and accelerator is not None:
        taps.append(Tap.install(accelerator, "clip_grad_norm_", step.add_grad_norm))
    return [tap for tap in taps if tap is not None]
