"""TopoMonitor: the coordinator that wires a check's parts together, usable from a plain PyTorch loop.

It holds no mechanism of its own: `Schedule` says when,
`ProbePass` takes the features, `Runner` evaluates them
(the pipeline: transform, engine, index, policy), `Rescuer` carries decisions out, and
the sinks keep the records::

    monitor = TopoMonitor(probe=probe_inputs, layer="encoder.pool", check_every=100)
    for step, batch in enumerate(loader):
        ...  # forward, backward, optimizer step
        for record in monitor.on_step(step, model=model, loss=loss):  # checks when due, decisions when their step comes
            monitor.act(record, actuator)  # does what record.decision says (and keeps healthy snapshots)

The Lightning and Hugging Face callbacks are thin adapters around this class: they call
[`TopoMonitor.on_step`][topocallbacks.TopoMonitor.on_step],
log the records, and hand each decision to [`TopoMonitor.act`][topocallbacks.TopoMonitor.act] with their framework's
[`Actuator`][topocallbacks.interventions.Actuator].
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from ._state import StateFields, Stateful
from ._validation import check_int
from .budget import Budget
from .check import CheckRecord, InterventionRecord, Plan, record_from_dict
from .distributed import rank_and_world
from .exceptions import InputError
from .intake import Intake
from .interventions import Actuator
from .pipeline import CheckPipeline, CheckRequest, LayeredPipeline, make_pipeline
from .policy import Policy
from .presets import resolve_settings
from .probe import AutocastFactory, FeatureExtractor, Probe
from .probing import ProbePass
from .rescue import Rescuer
from .runner import Runner
from .schedule import Schedule
from .settings import MonitorSettings
from .sinks import Sinks
from .snapshots import SnapshotStore
from .summary import last_records_of, report_of, summary_text, with_layer_moves

__all__ = ["TopoMonitor"]

Record = CheckRecord | InterventionRecord
P = ParamSpec("P")
R = TypeVar("R")


def _step_validator(method: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], None]:
    """The check of ``method``'s ``step`` argument (given by name or by position), from a call's arguments.

    It raises an InputError naming ``step`` unless it is an integer >= 0; it does nothing for a method without one.
    """
    names = list(inspect.signature(method).parameters)
    if "step" not in names:
        return lambda args, kwargs: None
    position = names.index("step")

    def validate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        check_int(kwargs["step"] if "step" in kwargs else args[position], "step", minimum=0)

    return validate


def _entry_point(method: Callable[P, R]) -> Callable[P, R]:
    """A monitor entry point: its ``step`` checked first (`_step_validator`), then its time counted as its own.

    The monitor's own time is the overhead budget's measure (`Budget.meter`).
    """
    validate = _step_validator(method)

    @functools.wraps(method)
    def entry_point(*args: P.args, **kwargs: P.kwargs) -> R:
        validate(args, kwargs)
        with args[0].budget.meter.own():  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return entry_point


class PartViews:
    """The monitor's parts, as users and adapters know them: what a `TopoMonitor` reads from its parts."""

    settings: MonitorSettings
    probing: ProbePass
    pipeline: CheckPipeline | LayeredPipeline
    schedule: Schedule
    rescuer: Rescuer
    history: list[Record]

    @property
    def extractor(self) -> FeatureExtractor | None:
        """The watched layer(s)' feature extractor (None: no layer, features are given)."""
        return self.probing.extractor

    @property
    def several(self) -> bool:
        """Whether several layers are watched (``layers=``)."""
        return self.probing.several

    @property
    def probe(self) -> Probe | None:
        """The probe (None until one is set)."""
        return self.probing.probe

    def set_probe(self, source: Any, tokenizer: Any = None) -> None:
        """Set the probe (e.g. from a dataloader's dataset), checked against a loaded state's."""
        self.probing.set_probe(source, tokenizer)

    def features(self, model: Any, indices: Any = None) -> Any:
        """The probe's features at the watched layer(s) (`ProbePass.features`)."""
        return self.probing.features(model, indices)

    def resolve_layers(self, model: Any) -> list[str]:
        """The module names this monitor watches in ``model``, the primary first (`ProbePass.resolve`)."""
        return self.probing.resolve(model, self.pipeline if isinstance(self.pipeline, LayeredPipeline) else None)

    @property
    def policy(self) -> Policy:
        """The policy (its counters follow the latest check)."""
        return self.pipeline.policy

    @property
    def epsilon_(self) -> float | None:
        """The calibrated scale ε (None before a check)."""
        return self.pipeline.epsilon_

    @property
    def background(self) -> bool:
        """Whether checks run in the background worker."""
        return self.schedule.background

    def due(self, step: int) -> bool:
        """Whether a check is due at ``step`` (a check step not checked yet; `Schedule.due`)."""
        return self.schedule.due(step)

    @property
    def last_checked_step_(self) -> int | None:
        """The last step checked (None: none yet)."""
        return self.schedule.last_checked_step_

    @property
    def snapshots(self) -> SnapshotStore:
        """The healthy snapshots a rollback goes back to."""
        return self.rescuer.healthy.store

    @property
    def snapshots_off(self) -> str | None:
        """Why no snapshots are kept, or None."""
        return self.rescuer.healthy.off

    @property
    def keeps_snapshots(self) -> bool:
        """Whether the rule in effect keeps snapshots (it can roll back or stop)."""
        return self.rescuer.healthy.wanted

    @property
    def lr_factor_(self) -> float:
        """The interventions' cumulative learning-rate factor."""
        return self.rescuer.lr_factor_

    @property
    def rollback_cut_(self) -> float:
        """The rollbacks' compounded learning-rate cut."""
        return self.rescuer.rollback_cut_

    @property
    def last_records(self) -> list[CheckRecord]:
        """The latest check's records: one, or one per layer when several are watched (the primary layer's last)."""
        return last_records_of(self.history, self.pipeline)


class CheckFeed:
    """How a `TopoMonitor` feeds checks to its runner and takes their records back, following the budget's plan.

    A due check's features (a probe pass, or the streaming window) and the training channels since the last check
    go to the `Runner` with the step its decision is applied at; the records collected carry the budget's plan,
    which the schedule (and, for a smaller probe, a new pipeline) follows, and the other ranks adopt rank 0's
    learning-rate factor with them.
    """

    settings: MonitorSettings
    probing: ProbePass
    pipeline: CheckPipeline | LayeredPipeline
    schedule: Schedule
    runner: Runner
    rescuer: Rescuer
    intake: Intake
    budget: Budget
    history: list[Record]
    autocast: AutocastFactory | None
    emit: Callable[..., None]

    def _stream_batch(self, step: int, features: Any, lag: int | None = None) -> bool:
        """Streaming: add this step's batch to the window (rank 0 keeps it), and check the window when a check is due.

        Returns whether a check was due (then submitted, its decision applied after ``lag`` steps; None: the
        schedule's).
        """
        if features is not None and rank_and_world()[0] == 0:
            self.intake.add_batch(step, features)
        if not self.schedule.due(step):
            return False
        self._submit_window(step, features, lag)
        return True

    def _dynamics(self) -> dict[str, float | None] | None:
        return self.intake.take_dynamics(read=rank_and_world()[0] == 0)

    def _submit_probe(self, model: Any, step: int, lag: int | None = None) -> None:
        self.schedule.settle_background(model)
        layered = self.pipeline if isinstance(self.pipeline, LayeredPipeline) else None
        features, probe_ms = self.probing.take(model, step, layered, self.autocast)
        self.schedule.checked(step)
        self._submit(
            CheckRequest(kind="evaluate", step=step, payload=features, dynamics=self._dynamics()), step, lag, probe_ms
        )

    def _submit_window(self, step: int, features: Any, lag: int | None = None) -> None:
        self.schedule.settle_background(features)
        self.schedule.checked(step)
        t0 = time.perf_counter()
        host = self.intake.take_batches() if rank_and_world()[0] == 0 else []
        self._submit(
            CheckRequest(kind="window", step=step, payload=host, dynamics=self._dynamics()),
            step,
            lag,
            (time.perf_counter() - t0) * 1e3,
        )

    def _submit(self, request: CheckRequest, step: int, lag: int | None, probe_ms: float = 0.0) -> None:
        by_schedule = lag is None  # only the checks the schedule calls are planned for (and start a worker beside)
        self.budget.scheduled(step, by_schedule)
        at, background = self.schedule.apply_at(step, lag), self.schedule.background
        prestart = by_schedule and self.budget.may_move
        self.runner.submit(request, at, background=background, probe_ms=probe_ms, prestart=prestart)

    def _collect(self, step: int) -> list[CheckRecord]:
        records = self.runner.collect(step, annotate=self._annotate, emit=self.emit)
        for record in records:  # the same on every rank: rank 0 measured and planned, the others adopted it
            if record.plan is not None:
                self._follow(record.plan)
        return records

    def _annotate(self, records: list[CheckRecord]) -> CheckRecord:
        """Rank 0: the deciding record with the layers' moves, the interval's cost and the budget's new plan."""
        record = with_layer_moves([r for r in self.history if isinstance(r, CheckRecord)], records)
        return self.budget.measure(record, self.schedule, self.pipeline.policy.checks_decided_, self.runner.worker)

    def _share_extra(self) -> dict[str, Any]:
        return {"lr_factor": self.rescuer.lr_factor_}

    def _adopt_shared(self, shared: Mapping[str, Any]) -> None:
        self.rescuer.lr_factor_ = float(shared["lr_factor"])

    def _follow(self, plan: Plan) -> None:
        """Take the budget's plan; a smaller probe restarts the calibration (a new pipeline, in the same worker)."""
        resized = plan.probe_size not in (None, self.schedule.plan.probe_size)
        self.schedule.follow(plan)
        if resized and plan.probe_size is not None:
            self.probing.resize(plan.probe_size)
            self.pipeline = make_pipeline(self.settings)
            self.runner.reset(self.pipeline)


class TopoMonitor(PartViews, CheckFeed, Stateful):
    """Watches the features of a fixed probe (or of the training batches) and decides when to act.

    Args:
        settings: a [`MonitorSettings`][topocallbacks.settings.MonitorSettings], or a mapping of options merged into the
            preset's; default: every option at its default (or the preset's).
        preset: a preset name (``presets.available()``) or a YAML path whose values are the defaults.
        probe: probe inputs (a tensor, a Dataset, a list of inputs, a mapping of columns such as a tokenizer's
            output, or a list of texts with ``tokenizer``; see `Probe`); needed in
            probe mode to run `check` (`process` takes features directly).
        tokenizer: a Hugging Face tokenizer for a probe of texts (truncated to ``probe.max_length`` tokens).
        **overrides: any option by name (``layer``, ``check_every``, ``index``, ``history_path``, ``policy={...}``
            merged into the rule in effect...), merged and validated by `MonitorSettings.merged`. ``layers=[...]``
            watches several layers in one probe pass: a check gives one record per layer, the primary layer's
            last, which alone carries the decision.

    Raises:
        InputError: an option is out of range, or a probe is given without a layer.
        ConfigError: an unknown option (with the closest one).

    Examples:
        >>> import numpy as np
        >>> monitor = TopoMonitor(check_every=1)
        >>> record = monitor.process(np.random.default_rng(0).normal(size=(64, 8)), step=0)
        >>> record.status, record.index, record.index_value is None  # no drift at the first check
        ('ok', 'diagram_drift', True)
    """

    _state = StateFields(
        version=7,
        fields={"probe_spec": "_probe_spec_state", "pipeline": "pipeline", "history": "history",
                "schedule": "schedule", "rescuer": "rescuer", "runner": "runner"},
        encode={"history": lambda h: [r.as_dict() for r in h]},
        decode={"history": lambda h: [record_from_dict(r) for r in h]},
    )  # fmt: skip

    def __init__(self, settings: MonitorSettings | Mapping[str, Any] | None = None, *, preset: str | os.PathLike[str] |
                 None = None, probe: Any = None, tokenizer: Any = None, **overrides: Any) -> None:  # fmt: skip
        if settings is not None and not isinstance(settings, (MonitorSettings, Mapping)):
            raise InputError(f"`settings` must be a MonitorSettings or a mapping of options, got {settings!r:.80}")
        self.settings = s = resolve_settings(preset, settings, overrides)
        self.preset = preset
        self.probing = ProbePass(s, probe, tokenizer)
        self.pipeline: CheckPipeline | LayeredPipeline = make_pipeline(s)
        self.schedule = Schedule(s.schedule)
        self.rescuer = Rescuer(s)
        self.runner = Runner(
            s.as_dict(), self.pipeline, s.schedule.worker_threads,
            share=self._share_extra, receive=self._adopt_shared, timeout=s.schedule.worker_timeout,
        )  # fmt: skip
        self.intake = Intake(s.rule.channels, s.rule.require)
        self.budget = Budget(s)
        self.sinks = Sinks(s.output)
        self.history: list[Record] = []
        #: The names' prefix in loggers and TensorBoard (an adapter sets ``topo/<layer>`` beside other callbacks).
        self.prefix = s.output.prefix or "topo"
        self.autocast: AutocastFactory | None = None  # set by a training adapter: the trainer's precision

    @classmethod
    def from_preset(cls, preset: str | os.PathLike[str], probe: Any = None, **overrides: Any) -> TopoMonitor:
        """A monitor configured by a preset (a name or a YAML path), then overrides, as the callbacks' are."""
        return cls(preset=preset, probe=probe, **overrides)

    # --- the per-step entry point ---------------------------------------------------------------------------

    @_entry_point
    def on_step(
        self, step: int, *, model: Any = None, features: Any = None, loss: Any = None, grad_norm: Any = None
    ) -> list[CheckRecord]:
        """Check when a check is due, and apply what is due: the entry point for a training loop, every step.

        In probe mode a due check runs the probe through ``model``; in streaming mode ``features`` (this step's
        pooled features) join the window. ``loss`` and ``grad_norm`` (before clipping; floats, or tensors read once
        per check) feed the ``"loss"`` and ``"grad_norm"`` channels. Every rank must call it at every step.

        Returns:
            The checks applied at this step (the same on every rank): in the loop, a check at its own step; in the
            background, ``lag`` steps later.
        """
        self.record_dynamics(loss, grad_norm)
        if self.schedule.streaming:
            self._stream_batch(step, features)
        elif self.schedule.due(step):
            if model is None:
                raise InputError(f"a check is due at step {step}: on_step needs the `model` in probe mode")
            self._submit_probe(model, step)
        return self._collect(step)

    @_entry_point
    def check(self, model: Any, step: int) -> CheckRecord:
        """Probe mode: run the probe through ``model`` and evaluate it now; every rank calls it, gets one record.

        Raises:
            InputError: no probe, no module, or a failed probe pass (naming the model, layer, step and probe).
        """
        self._submit_probe(model, step, lag=0)
        return self._collect(step)[-1]  # submitted with lag 0: applied at once

    @_entry_point
    def process(self, features: Any, step: int, *, loss: Any = None, grad_norm: Any = None) -> CheckRecord:
        """Evaluate one check of features ``(n, d)`` now and return its record.

        NaN or Inf features give a ``"diverged"`` record (``on_diverged``). ``loss`` and ``grad_norm`` join those
        recorded since the last check. With several layers, ``features`` is ``{layer: (n, d_layer)}`` and the record
        returned the primary layer's (``layer`` when it is a key, else the first; the others are in the history).

        Raises:
            InputError: features of the wrong shape or whose dimension changed; a bad step, loss or grad_norm.
        """
        self.schedule.settle_background(features)
        primary = self.settings.probe.layer
        if self.probing.several and isinstance(features, Mapping) and primary and primary[0] in features:
            features = {primary[0]: features[primary[0]], **features}  # the primary layer first
        self.schedule.checked(step)
        self.record_dynamics(loss, grad_norm)
        self._submit(CheckRequest(kind="evaluate", step=step, payload=features, dynamics=self._dynamics()), step, lag=0)
        return self._collect(step)[-1]  # submitted with lag 0: applied at once

    @_entry_point
    def observe(self, features: Any, step: int) -> CheckRecord | None:
        """Streaming mode: add a training batch's features to the window, and check the window now when due.

        Returns:
            The check record when a check was due at ``step`` (the same on every rank), else None.
        """
        if not self.schedule.streaming:
            raise InputError("observe() is for streaming mode; create the monitor with mode='stream'")
        if not self._stream_batch(step, features, lag=0):
            return None
        records = self._collect(step)
        return records[0] if records else None

    def finish(self) -> list[CheckRecord]:
        """End of training: the checks still pending get their records. Every rank must call it.

        Their records go to the history with ``applied_step`` None: their decisions can no longer act.
        """
        return self.runner.finish(annotate=self._annotate, emit=self.emit)

    def record_dynamics(self, loss: Any = None, grad_norm: Any = None) -> None:
        """Record one step's training loss and gradient norm (floats or tensors; None: not known).

        They are read (one device synchronisation) and averaged at the next check, for the policy's ``"loss"``
        and ``"grad_norm"`` channels; a non-finite value makes that check a diverged one.
        """
        self.intake.record(loss, grad_norm)

    @_entry_point
    def act(self, record: CheckRecord, actuator: Actuator) -> InterventionRecord | None:
        """Carry out ``record``'s decision (every rank, at the same step) and write it to the history.

        Call it for every record, healthy ones too: while a rule can roll back or stop, a healthy check's state is
        kept as a snapshot (`snapshots`, through ``actuator.snapshot()``). A rollback restores the newest
        snapshot taken before the warning's onset, in place, and training goes on with the next batch.

        Returns:
            The intervention record, or None when the decision asked for nothing.
        """
        if isinstance(self.pipeline, LayeredPipeline) and record.layer != self.pipeline.primary:
            return None  # a check acts once, on the primary layer's record, whatever the number of layers
        return self.rescuer.act(record, actuator, monitor=self)

    # --- what the rescuer calls on the monitor (rescue.MonitorHooks) ----------------------------------------

    def reference_diagrams(self) -> Any:
        """What drift is measured against now (every layer's, with several)."""
        return self.pipeline.reference_diagrams

    def rewind(self, diagrams: Any) -> None:
        """After a restore: settle pending checks, measure drift against ``diagrams``, forget the undone steps."""
        self.finish()  # checks still pending saw the abandoned steps: they reach the history, they no longer act
        self.pipeline.rewind(diagrams)
        self.runner.close()  # the next check starts a worker from the rewound state
        self.intake.clear()

    def emit(self, record: Record, diagrams: Any = None) -> None:
        """Write a record to the history and, on rank 0, to the JSONL file and TensorBoard."""
        self.history.append(record)
        if rank_and_world()[0] == 0:  # every rank keeps the history; rank 0 writes the files
            self.sinks.write(record, diagrams, prefix=self.prefix)

    # --- reading ----------------------------------------------------------------------------------------------

    def summary(self) -> str:
        """What happened, in a few lines (`topocallbacks.summary.summary_text`)."""
        resolved = getattr(self.probing.extractor, "resolved_layer_", None)  # the name a pattern matched
        layers = self.pipeline.layers if isinstance(self.pipeline, LayeredPipeline) else []
        snapshots = self.snapshots.describe() if self.snapshots.snapshots else None
        layer = (resolved,) if resolved is not None else self.settings.probe.layer
        return summary_text(self.history, self.settings, layer=layer, layers=layers, snapshots=snapshots)

    def report(self, out_dir: str | os.PathLike[str], *, title: str | None = None) -> Path | None:
        """The HTML report of the history in ``out_dir`` (`topocallbacks.write_report`), on rank 0; its path.

        The last diagrams of the primary layer are drawn too. Needs matplotlib (``topocallbacks[report]``).
        """
        if rank_and_world()[0] != 0:
            return None
        return report_of(self.history, self.pipeline, out_dir, title=title)

    # --- internals ----------------------------------------------------------------------------------------------

    @property
    def _probe_spec_state(self) -> dict[str, Any] | None:
        return self.probing.spec_state

    @_probe_spec_state.setter
    def _probe_spec_state(self, value: Mapping[str, Any] | None) -> None:
        self.probing.spec_state = value

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`, the sum of the parts' states (a running worker is stopped first).

        Raises:
            InputError: missing keys, another version, or a probe with other contents than the saved one's.
        """
        self.runner.close()
        super().load_state_dict(state)

    def close(self) -> None:
        """Stop the background worker and close the TensorBoard writer (the JSONL sink keeps no handle open)."""
        self.runner.close()
        self.sinks.close()
