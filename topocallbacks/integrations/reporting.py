"""An intervention's text where a logger takes text, for both adapters; a logger that fails never stops training.

TensorBoard: a text summary; MLflow: a text artifact ``<prefix>/interventions/step<S>-<action>.md``; W&B: a table
row (step, action, reason, detail). The marker scalar goes with the other values
([`topocallbacks.sinks`][topocallbacks.sinks]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..check import InterventionRecord
from ..sinks import intervention_text

__all__ = ["Guard", "write_settings", "write_text"]


class Guard:
    """Runs a logger's write; an error becomes one warning per logger and what failed, and training goes on."""

    def __init__(self) -> None:
        self._said: set[tuple[str, str]] = set()

    def __call__(self, logger: Any, what: str, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``write(*args, **kwargs)``, on behalf of ``logger``, writing ``what`` (words for the warning)."""
        try:
            write(*args, **kwargs)
        except Exception as error:
            key = (type(logger).__name__, what)
            if key not in self._said:
                self._said.add(key)
                warnings.warn(
                    f"topocallbacks could not write {what} to {type(logger).__name__} ({type(error).__name__}: "
                    f"{error}); training goes on, and the history keeps every record",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def __getstate__(self) -> dict[str, Any]:
        return {"_said": set()}


def write_text(kind: str, target: Any, record: InterventionRecord, prefix: str, *, run_id: str | None = None) -> None:
    """Write ``record``'s text to ``target``, a logger's own object of ``kind``.

    Args:
        kind: ``"tensorboard"`` (a ``SummaryWriter``), ``"mlflow"`` (an ``MlflowClient`` with ``run_id``, or the
            ``mlflow`` module with an active run) or ``"wandb"`` (a run, or the ``wandb`` module with one).
        target: that object.
        record: the intervention.
        prefix: the metrics' prefix (``topo``).
        run_id: the MLflow run, with a client.
    """
    text = intervention_text(record)
    if kind == "tensorboard":
        target.add_text(f"{prefix}/intervention", text, global_step=record.step)
        target.flush()
    elif kind == "mlflow":
        artifact = f"{prefix}/interventions/step{record.step}-{record.action}.md"
        if run_id is None:
            target.log_text(text, artifact)
        else:
            target.log_text(run_id, text, artifact)
    elif kind == "wandb":
        import wandb

        row = [record.step, record.action, record.reason, record.detail]
        table = wandb.Table(columns=["step", "action", "reason", "detail"], data=[row])
        target.log({f"{prefix}/interventions": table}, commit=False)


def write_settings(kind: str, target: Any, params: dict[str, Any]) -> None:
    """Write the monitor's settings (`topocallbacks.sinks.hyperparameters`) as ``target``'s hyperparameters.

    Args:
        kind: ``"tensorboard"`` (a ``SummaryWriter``: the hparams plugin's summaries, as Lightning writes them),
            ``"mlflow"`` (the ``mlflow`` module with an active run: its params) or ``"wandb"`` (the ``wandb`` module
            with a run: its config).
        target: that object.
        params: the flat hyperparameters.
    """
    if kind == "tensorboard":
        from torch.utils.tensorboard.summary import hparams

        writer = target._get_file_writer()
        for summary in hparams(params, {}):  # type: ignore[no-untyped-call]
            writer.add_summary(summary)
        target.flush()
    elif kind == "mlflow":
        target.log_params(params)
    elif kind == "wandb":
        target.config.update(params, allow_val_change=True)
