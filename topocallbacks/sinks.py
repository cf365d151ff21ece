"""Where check records go: a JSONL history file and TensorBoard scalars (and persistence-diagram figures).

Both are optional and framework-free. TensorBoard is imported only when a `TensorBoardSink` is created.

The names every logger receives (the callbacks' loggers too), under ``topo`` (or the callback's prefix):

- each check: ``topo/index``, ``topo/ci`` and its components, ``topo/betti0`` ..., the costs (``topo/check_ms``,
  ``topo/overhead`` ...), and the rule's view of it: ``topo/score/<channel>`` (the score of each watched channel,
  ``index``, ``loss`` or ``grad_norm``, once it has one) and ``topo/threshold/<channel>`` (what that score is
  compared with; the rule holds on a channel when its score reaches its threshold), and the absolute sentinels'
  values (``topo/sentinel/spread``, ``topo/sentinel/top_share``) with ``topo/sentinel/holds``: 1 at a check where one
  holds (so a sentinel's action has a curve at its step, as a score's has), else 0;
- once, when training starts: the monitor's settings as hyperparameters (`hyperparameters`: ``topo/<section>/
  <field>``, the rule in effect under ``topo/policy``): Lightning's ``log_hyperparams`` of every logger (TensorBoard
  hparams, MLflow params, W&B config), and the Hugging Face ``report_to`` loggers' own;
- each intervention, at its step: ``topo/intervention``, the action's code (`ACTION_CODES`: 1 warn,
  2 lower_lr, 3 rollback, 4 stop), and where the logger takes text, the reason and what was done
  (`intervention_text`) under ``topo/intervention``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .check import CheckRecord, InterventionRecord
from .settings import MonitorSettings, OutputSettings

__all__ = [
    "ACTION_CODES",
    "JsonlSink",
    "Sinks",
    "TensorBoardSink",
    "distinct_prefixes",
    "hyperparameters",
    "intervention_scalars",
    "intervention_text",
    "prefix_of",
    "scalars_of",
]

#: ``topo/intervention``'s value for each action (a marker a dashboard can plot against the other curves).
ACTION_CODES = {"warn": 1.0, "lower_lr": 2.0, "rollback": 3.0, "stop": 4.0}


def scalars_of(record: CheckRecord, prefix: str = "topo") -> dict[str, float]:
    """The ``topo/*`` scalars of a check record (what loggers and TensorBoard receive).

    ``topo/index`` is the value the policy watches (``TopoMonitor(index=...)``, diagram drift by default; logged as
    0 at the first check, where the drift has nothing to drift from and the record holds None), ``topo/ci`` the
    paper's composite, logged beside its components. ``prefix`` replaces ``topo`` (e.g. ``topo/encoder`` when
    several callbacks are attached to one trainer). A record of one of several layers watched together
    (``record.layer`` set) is logged under ``<prefix>/<layer>/...``.

    Examples:
        >>> import numpy as np
        >>> from topocallbacks import TopoMonitor
        >>> record = TopoMonitor().process(np.random.default_rng(0).normal(size=(40, 3)), step=0)
        >>> scalars_of(record, prefix="topo/encoder")["topo/encoder/index"]
        0.0
        >>> import dataclasses
        >>> sorted(scalars_of(dataclasses.replace(record, layer="h.0")))[0]
        'topo/h.0/anisotropy'
    """
    prefix = prefix_of(record, prefix)
    if not record.ok or record.report is None:
        return {f"{prefix}/diverged": 1.0}
    report = record.report
    scalars = {
        "ci": report.ci,
        "index": 0.0 if record.index_value is None else record.index_value,
        "betti0": report.betti0,
        "betti1": report.betti1,
        "persistence_entropy": report.persistence_entropy,
        "anisotropy": report.anisotropy_term,
        "epsilon": report.epsilon,
        "check_ms": record.check_ms,
        "wait_ms": record.wait_ms,
        "probe_ms": record.probe_ms,
        "diverged": 0.0,
    }
    if record.density is not None:
        scalars["density"] = record.density
    if record.overhead is not None:
        scalars["overhead"] = record.overhead
    for name, value in report.components.items():
        scalars[f"{name}_term"] = value
    decision = record.decision
    scores = decision.scores if decision.scores is not None else {"index": decision.score}
    scalars |= {f"score/{name}": value for name, value in scores.items() if value is not None}
    scalars |= {f"threshold/{name}": value for name, value in (decision.thresholds or {}).items()}
    if record.sentinels is not None:
        scalars |= {"sentinel/spread": record.sentinels.spread, "sentinel/top_share": record.sentinels.top_share,
                    "sentinel/holds": float(bool(record.sentinels.holding))}  # fmt: skip
    return {f"{prefix}/{key}": float(value) for key, value in scalars.items()}


def hyperparameters(settings: MonitorSettings, prefix: str = "topo") -> dict[str, str | int | float | bool]:
    """The monitor's settings as flat hyperparameters, ``{"<prefix>/<section>/<field>": value}``.

    Under ``<prefix>/policy`` the rule in effect (`MonitorSettings.rule`: the index's default rule when ``policy`` is
    None). None becomes ``"None"``, a list or tuple its JSON, so every value is one a logger takes as a
    hyperparameter (TensorBoard hparams, MLflow params, W&B config).

    Examples:
        >>> params = hyperparameters(MonitorSettings())
        >>> params["topo/policy/rollback_order"], params["topo/policy/channels"]
        ('cut_if_refired', '["index", "loss"]')
    """
    nested = settings.as_dict()
    nested["policy"] = dataclasses.asdict(settings.rule)
    flat: dict[str, str | int | float | bool] = {}

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, inner in value.items():
                walk(f"{path}/{key}", inner)
        elif value is None:
            flat[path] = "None"
        elif isinstance(value, (bool, int, float, str)):
            flat[path] = value
        else:
            flat[path] = json.dumps(value, default=list)

    for section, value in nested.items():
        walk(f"{prefix}/{section}", value)
    return flat


def intervention_scalars(record: InterventionRecord, prefix: str = "topo") -> dict[str, float]:
    """``{<prefix>/intervention: code}`` (`ACTION_CODES`), logged at the intervention's step.

    Examples:
        >>> from topocallbacks.check import InterventionRecord
        >>> intervention_scalars(InterventionRecord(40, "rollback", "index and loss", "rolled back", 0.5))
        {'topo/intervention': 3.0}
    """
    return {f"{prefix}/intervention": ACTION_CODES.get(record.action, 0.0)}


def intervention_text(record: InterventionRecord) -> str:
    """An intervention in a few lines of text (Markdown): the action and step, why, and what was done."""
    return f"**{record.action}** at step {record.step}\n\nWhy: {record.reason}\n\nDone: {record.detail}"


def prefix_of(record: CheckRecord, prefix: str = "topo") -> str:
    """Where a record's values are logged: ``prefix``, or ``prefix/<layer>`` for one of several layers."""
    return prefix if record.layer is None else f"{prefix}/{record.layer}"


class JsonlSink:
    """Appends one JSON line per record to ``path``.

    Each line is written with a single ``write`` call and flushed (and fsynced), so a crash mid-write loses at
    most that line; `read` skips a torn last line.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record``."""
        line = json.dumps(record, allow_nan=True, separators=(",", ":")) + "\n"
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """All complete records of a history file (a torn last line is skipped)."""
        records = []
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


class TensorBoardSink:
    """Writes ``topo/*`` scalars per check, and a persistence-diagram figure when a check brings its diagrams.

    Args:
        log_dir: TensorBoard log directory.

    Raises:
        ImportError: tensorboard is not installed (``pip install topocallbacks[tensorboard]``).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, prefix: str = "topo") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("TensorBoardSink needs tensorboard: pip install 'topocallbacks[tensorboard]'") from exc
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.prefix = prefix
        self._warned = False

    def write(self, record: CheckRecord | InterventionRecord, diagrams: list[np.ndarray] | None = None) -> None:
        """Log a check record's scalars at its step (that of its features); a figure of ``diagrams`` if given.

        An intervention: its marker (`intervention_scalars`) and its text (`intervention_text`).
        """
        step = record.step
        if isinstance(record, InterventionRecord):
            for name, value in intervention_scalars(record, self.prefix).items():
                self.writer.add_scalar(name, value, global_step=step)
            self.writer.add_text(f"{self.prefix}/intervention", intervention_text(record), global_step=step)
            self.writer.flush()
            return
        for name, value in scalars_of(record, self.prefix).items():
            self.writer.add_scalar(name, value, global_step=step)
        if diagrams is not None:
            self._figure(diagrams, step, prefix_of(record, self.prefix))
        self.writer.flush()

    def _figure(self, diagrams: list[np.ndarray], step: int, prefix: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            if not self._warned:
                warnings.warn("persistence-diagram figures need matplotlib; skipping them", stacklevel=2)
                self._warned = True
            return
        figure, axis = plt.subplots(figsize=(4, 4))
        finite = [d[np.isfinite(d[:, 1])] for d in diagrams]
        top = max([float(d[:, 1].max()) for d in finite if len(d)] + [1e-12])
        for dim, bars in enumerate(finite):
            axis.scatter(bars[:, 0], bars[:, 1], s=8, label=f"H{dim}")
        axis.plot([0, top], [0, top], color="grey", linewidth=0.8)
        axis.set_xlabel("birth")
        axis.set_ylabel("death")
        axis.legend(loc="lower right")
        self.writer.add_figure(f"{prefix}/persistence_diagram", figure, global_step=step, close=True)

    def close(self) -> None:
        """Flush and close the writer."""
        self.writer.close()


class Sinks:
    """Where a monitor's records are written besides its history: the JSONL file and TensorBoard (rank 0 only).

    Args:
        output: the output settings (``history_path``, ``tensorboard_dir``).
    """

    def __init__(self, output: OutputSettings) -> None:
        self.output = output
        self._jsonl = None if output.history_path is None else JsonlSink(output.history_path)
        self._tensorboard: TensorBoardSink | None = None  # created at the first check (writers do not pickle)

    def write(self, record: Any, diagrams: list[np.ndarray] | None = None, *, prefix: str = "topo") -> None:
        """Write ``record`` (a check or an intervention) to the JSONL file and to TensorBoard."""
        if self._jsonl is not None:
            self._jsonl.write(record.as_dict())
        if self.output.tensorboard_dir is not None and isinstance(record, (CheckRecord, InterventionRecord)):
            if self._tensorboard is None:
                self._tensorboard = TensorBoardSink(self.output.tensorboard_dir, prefix=prefix)
            self._tensorboard.write(record, diagrams)

    def close(self) -> None:
        """Close the TensorBoard writer (the JSONL sink keeps no handle open)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __getstate__(self) -> dict[str, Any]:
        # An open writer does not pickle (ddp_spawn pickles callbacks): it is opened again on use.
        return {**self.__dict__, "_tensorboard": None}


def distinct_prefixes(names: list[str], modes: list[str]) -> list[str]:
    """``topo/<layer>`` for each of several callbacks on one trainer (then the mode, then a number if still shared).

    Examples:
        >>> distinct_prefixes(["enc", "enc", "head"], ["probe", "stream", "probe"])
        ['topo/enc/probe', 'topo/enc/stream', 'topo/head']
    """
    named = [f"{n}/{m}" if names.count(n) > 1 else n for n, m in zip(names, modes, strict=True)]
    return [f"topo/{n}/{i}" if named.count(n) > 1 else f"topo/{n}" for i, n in enumerate(named)]
