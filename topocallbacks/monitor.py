"""TopoMonitor: the schedule of checks, the probe pass, the evaluation beside training, and what follows a decision.

Framework-free orchestration, usable from a plain PyTorch loop::

    monitor = TopoMonitor(probe=probe_inputs, layer="encoder.pool", check_every=100)
    for step, batch in enumerate(loader):
        ...  # forward, backward, optimizer step
        for record in monitor.on_step(step, model=model):  # checks when due; decisions when their step comes
            ...  # record.decision says what to do (or monitor.act(record, actuator) does it)

A check is evaluated by a :class:`~topocallbacks.pipeline.CheckPipeline`, in the training loop or, in the
background (``schedule.background``), in a worker process (:mod:`topocallbacks._worker`) while training goes on:
its decision is then applied ``lag`` steps after the check, a step every rank knows in advance, and the loop waits
there only if the worker is late (the record says how long). The Lightning and Hugging Face callbacks are thin
adapters around this class: they call :meth:`TopoMonitor.on_step`, log the records, and hand each decision to
:meth:`TopoMonitor.act` with their framework's :class:`~topocallbacks.interventions.Actuator`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from ._worker import WorkerProcess
from .check import CheckRecord, InterventionRecord, record_from_dict
from .distributed import broadcast_object, gather_probe_features, rank_and_world
from .exceptions import InputError, SnapshotUnsupported
from .interventions import Actuator, apply, host_memory_available
from .pipeline import CheckPipeline, Evaluation, LayeredPipeline, make_pipeline
from .policy import Decision, Policy
from .probe import AutocastFactory, FeatureExtractor, Probe, ProbeSpec
from .rollback import Snapshot, SnapshotStore, _size
from .settings import Action, MonitorSettings
from .sinks import JsonlSink, TensorBoardSink

__all__ = ["TopoMonitor"]

Record = CheckRecord | InterventionRecord


@dataclasses.dataclass
class _Pending:
    """A check whose decision is applied at ``apply_at`` (evaluated at once, or by the worker meanwhile)."""

    step: int
    apply_at: int
    probe_ms: float = 0.0
    evaluation: Evaluation | None = None
    eval_ms: float = 0.0  # the training loop's own time on an inline evaluation

    def as_dict(self) -> dict[str, Any]:
        evaluation = self.evaluation
        return {
            "step": self.step,
            "apply_at": self.apply_at,
            "probe_ms": self.probe_ms,
            "record": None if evaluation is None or evaluation.record is None else evaluation.record.as_dict(),
            "others": [] if evaluation is None else [r.as_dict() for r in evaluation.others],
            "done": evaluation is not None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], shared: dict[str, Any]) -> _Pending:
        record = None if data["record"] is None else CheckRecord.from_dict(data["record"])
        others = [CheckRecord.from_dict(r) for r in data.get("others", [])]
        evaluation = Evaluation(record, shared, None, others)
        return cls(int(data["step"]), int(data["apply_at"]), float(data["probe_ms"]), evaluation)


def _host_batches(batches: list[tuple[int, Any]]) -> list[tuple[int, NDArray[np.float32]]]:
    """Streaming batches (device tensors or arrays) on the host, with one device synchronisation for all of them."""
    tensors = [(step, b) for step, b in batches if isinstance(b, torch.Tensor)]
    if not tensors:
        return [(step, np.asarray(b)) for step, b in batches]
    joined = torch.cat([t.reshape(t.shape[0], -1).float() for _, t in tensors]).cpu().numpy()  # one copy
    sizes = np.cumsum([t.shape[0] for _, t in tensors])[:-1]
    host = dict(zip((id(t) for _, t in tensors), np.split(joined, sizes), strict=True))
    return [(step, host[id(b)] if isinstance(b, torch.Tensor) else np.asarray(b)) for step, b in batches]


class TopoMonitor(Stateful):
    """Watches the features of a fixed probe (or of the training batches) and decides when to act.

    Args:
        settings: a :class:`~topocallbacks.settings.MonitorSettings` (a preset's ``settings``, say); default: every
            option at its default.
        probe: probe inputs (a tensor, a Dataset, a list of inputs, a mapping of columns such as a tokenizer's
            output, or a list of texts with ``tokenizer``; see :class:`~topocallbacks.probe.Probe`); needed in
            probe mode to run :meth:`check` (:meth:`process` takes features directly).
        tokenizer: a Hugging Face tokenizer for a probe of texts (truncated to ``probe.max_length`` tokens).
        **overrides: any option by name, merged into ``settings`` and validated
            (:meth:`MonitorSettings.merged <topocallbacks.settings.MonitorSettings.merged>`): ``layer``,
            ``check_every``, ``index``, ``max_probe_samples``, ``history_path``, ``background``, ``policy={...}``
            (a mapping merged into the policy in effect, a :class:`~topocallbacks.settings.PolicySettings`, or a
            :class:`~topocallbacks.policy.Policy` whose settings are used)... ``layers=[...]`` watches several
            layers in one probe pass (:class:`~topocallbacks.pipeline.LayeredPipeline`): a check then gives one
            record per layer, the primary layer's last, which alone carries the decision :meth:`act` carries out.

    Raises:
        InputError: an option is out of range, or a probe is given without a layer.
        ConfigError: an unknown option (with the closest one).

    Example:
        >>> import numpy as np
        >>> monitor = TopoMonitor(check_every=1)
        >>> record = monitor.process(np.random.default_rng(0).normal(size=(64, 8)), step=0)
        >>> record.status, record.index, record.index_value is None  # no drift at the first check
        ('ok', 'diagram_drift', True)
    """

    _state = StateFields(
        version=6,
        fields={
            "probe_spec": "_probe_spec_state",
            "pipeline": "pipeline",
            "history": "history",
            "lr_factor": "lr_factor_",
            "last_checked_step": "last_checked_step_",
            "last_rollback_step": "last_rollback_step_",
            "rollback_cut": "rollback_cut_",
            "pending": "_pending_state",
        },
        encode={"history": lambda h: [r.as_dict() for r in h]},
        decode={"history": lambda h: [record_from_dict(r) for r in h]},
    )

    def __init__(
        self, settings: MonitorSettings | None = None, *, probe: Any = None, tokenizer: Any = None, **overrides: Any
    ) -> None:
        if settings is not None and not isinstance(settings, MonitorSettings):
            raise InputError(f"`settings` must be a MonitorSettings, got {type(settings).__name__}")
        base = MonitorSettings() if settings is None else settings
        self.settings = base.merged(overrides) if overrides else base
        s = self.settings
        several = s.probe.layers is not None
        self.extractor = None if s.probe.layer is None and not several else FeatureExtractor(s.probe)
        self._loaded_probe_spec: ProbeSpec | None = None
        self.probe: Probe | None = None
        if probe is not None:
            self.probe = self._new_probe(probe, tokenizer)
        elif tokenizer is not None:
            raise InputError("`tokenizer` is for a probe of texts; pass the texts as `probe`")
        if self.probe is not None and self.extractor is None:
            raise InputError("`layer` is required with a `probe`: name the module whose output to watch")
        # The pipeline evaluates checks here, or mirrors the background worker's after each result.
        self.pipeline: CheckPipeline | LayeredPipeline = make_pipeline(s)
        self._history_sink = None if s.output.history_path is None else JsonlSink(s.output.history_path)
        self._tensorboard: TensorBoardSink | None = None  # created at the first check (writers do not pickle)
        self.history: list[Record] = []
        self.lr_factor_ = 1.0
        self.last_checked_step_: int | None = None
        self._pending: collections.deque[_Pending] = collections.deque()
        self._batches: list[tuple[int, Any]] = []  # streaming: the training batches since the last check
        self._dynamics: list[tuple[Any, Any]] = []  # (loss, gradient norm) of each step since the last check
        self._unfed_checks = 0  # checks at which a watched training channel had no value (warned at the second)
        #: The healthy snapshots a ``rollback`` goes back to (kept only while a rule can roll back).
        self.snapshots = SnapshotStore(s.interventions.snapshots, s.interventions.snapshot_dir)
        self.last_rollback_step_: int | None = None  # the latest rollback's step (the next one undoes updates since)
        self.rollback_cut_ = 1.0  # the product of the rollbacks' learning-rate cuts (they compound)
        #: Why no snapshots are kept although the rule can roll back (a sharded strategy, too little host memory),
        #: or None. Its rollback decisions then warn, and say why.
        self.snapshots_off: str | None = None
        self._room_checked = False
        self._worker: WorkerProcess | None = None
        self._background: bool | None = s.schedule.background
        self.autocast: AutocastFactory | None = None  # set by a training adapter: the trainer's precision
        #: The names' prefix in loggers and TensorBoard (an adapter sets ``topo/<layer>`` beside other callbacks).
        self.prefix = s.output.prefix or "topo"

    # --- schedule -----------------------------------------------------------------------------------------

    def should_check(self, step: int) -> bool:
        """Whether ``step`` is a check step.

        Every ``check_every`` steps: from step 0 in probe mode, from step ``check_every`` on in streaming mode (the
        window of step 0 would hold a single batch).
        """
        if step == 0 and self.settings.schedule.mode == "stream":
            return False
        return step % self.settings.schedule.check_every == 0

    def due(self, step: int) -> bool:
        """Whether a check is due at ``step``: a check step not checked yet.

        Gradient accumulation and a resumed run reach the same step more than once; it is checked once.
        """
        return self.should_check(step) and step != self.last_checked_step_

    @property
    def policy(self) -> Policy:
        """The policy (its counters follow the latest evaluated check)."""
        return self.pipeline.policy

    @property
    def epsilon_(self) -> float | None:
        """The calibrated scale ε (None before the first check)."""
        return self.pipeline.epsilon_

    @property
    def background(self) -> bool:
        """Whether checks run in the background worker (decided at the first check when the setting is None)."""
        return bool(self._background)

    # --- the per-step entry point ---------------------------------------------------------------------------

    def on_step(
        self, step: int, *, model: Any = None, features: Any = None, loss: Any = None, grad_norm: Any = None
    ) -> list[CheckRecord]:
        """Check when a check is due, and apply what is due: the entry point for a training loop, every step.

        In probe mode a due check runs the probe through ``model``; in streaming mode ``features`` (this step's
        pooled training features, or None) join the window, which is checked when due. ``loss`` and
        ``grad_norm`` (this step's training loss and gradient norm before clipping: floats, or tensors that are
        read once per check) feed the policy's ``"loss"`` and ``"grad_norm"`` channels. Every rank of a
        distributed job must call it at every step (rank 0's values are the ones checked).

        Returns:
            The checks whose decisions are applied at this step (the same on every rank): in the training loop, a
            check at its own step; in the background, ``lag`` steps later.
        """
        self.record_dynamics(loss, grad_norm)
        if self.settings.schedule.mode == "stream":
            if features is not None and rank_and_world()[0] == 0:
                self._batches.append((step, features))
            if self.due(step):
                self._submit_window(step, features)
        elif self.due(step):
            if model is None:
                raise InputError(f"a check is due at step {step}: on_step needs the `model` in probe mode")
            self._submit_probe(model, step)
        return self._collect(step)

    # --- synchronous conveniences -------------------------------------------------------------------------

    def check(self, model: Any, step: int) -> CheckRecord:
        """Probe mode: run the probe through ``model`` and evaluate it now; the same record on every rank.

        In distributed training every rank must call it at the same step: each runs its shard of the probe, rank 0
        evaluates and decides, and every rank adopts rank 0's record.

        Raises:
            InputError: no probe, or the probe pass failed (the message names the model, layer and step).
        """
        self._submit_probe(model, step, lag=0)
        return self._only(self._collect(step), step)

    def process(self, features: Any, step: int, *, loss: Any = None, grad_norm: Any = None) -> CheckRecord:
        """Evaluate one check of features ``(n, d)`` now and return its record.

        NaN or Inf features give a ``"diverged"`` record and the policy's ``on_diverged`` action; they never reach
        GUDHI. ``loss`` and ``grad_norm`` join the steps' values recorded since the last check
        (:meth:`record_dynamics`) for the training channels. With several layers, ``features`` is a mapping
        ``{layer: (n, d_layer)}`` (the primary layer: ``layer`` when it is a key, else the first), and the record
        returned is the primary layer's (the others are in :attr:`history`).

        Raises:
            InputError: features of the wrong shape, or whose dimension changed since the first check.
        """
        self._decide_background(features)
        primary = self.settings.probe.layer
        if self.several and isinstance(features, Mapping) and primary and primary[0] in features:
            features = {primary[0]: features[primary[0]], **features}  # the primary layer first
        self.last_checked_step_ = step
        self.record_dynamics(loss, grad_norm)
        self._submit(("evaluate", step, features, self._take_dynamics()), step, lag=0)
        return self._only(self._collect(step), step)

    def observe(self, features: Any, step: int) -> CheckRecord | None:
        """Streaming mode: add a training batch's features to the window, and check the window now when due.

        Returns:
            The check record when a check was due at ``step`` (the same on every rank), else None.
        """
        if self.settings.schedule.mode != "stream":
            raise InputError("observe() is for streaming mode; create the monitor with mode='stream'")
        if features is not None and rank_and_world()[0] == 0:
            self._batches.append((step, features))
        if not self.due(step):
            return None
        self._submit_window(step, features, lag=0)
        records = self._collect(step)
        return records[0] if records else None

    def finish(self) -> list[CheckRecord]:
        """End of training: the checks still pending get their records. Every rank must call it.

        Their records go to the history with ``applied_step`` None: their decisions can no longer act.
        """
        records = []
        while self._pending:
            records.extend(self._collect(self._pending[-1].apply_at, final=True))
        return records

    def record_dynamics(self, loss: Any = None, grad_norm: Any = None) -> None:
        """Record one step's training loss and gradient norm (floats or tensors; None: not known).

        They are read (one device synchronisation) and averaged at the next check, for the policy's ``"loss"``
        and ``"grad_norm"`` channels; a non-finite value makes that check a diverged one.
        """
        if loss is not None or grad_norm is not None:
            self._dynamics.append((loss, grad_norm))

    def act(self, record: CheckRecord, actuator: Actuator) -> InterventionRecord | None:
        """Carry out ``record``'s decision (every rank, at the same step) and write it to the history.

        Call it for every record, healthy ones too: while a rule can roll back, a healthy check's state is kept
        as a snapshot (:attr:`snapshots`, through ``actuator.snapshot()``). A rollback restores the newest
        snapshot taken before the warning's onset, in place, and training goes on with the next batch.

        Returns:
            The intervention record, or None when the decision asked for nothing.
        """
        decision = record.decision
        if record.applied_step is None:
            return None
        if isinstance(self.pipeline, LayeredPipeline) and record.layer != self.pipeline.primary:
            return None  # a check acts once, on the primary layer's record, whatever the number of layers
        step = record.applied_step
        if not decision.fired:
            if record.ok and decision.healthy and self.keeps_snapshots and self.snapshots_off is None:
                self._keep_snapshot(actuator, step)
            return None
        target: Snapshot | None = None
        if decision.action in (Action.ROLLBACK, Action.STOP):
            target = self._target(decision, record, step)
        if decision.action is Action.ROLLBACK:
            if target is None:
                diverged = decision.rule == "diverged"  # the features, or a NaN loss or gradient norm
                decision = _no_snapshot(
                    decision, self.settings.rule.after_max_rollbacks if diverged else "warn", self.snapshots_off
                )
            elif decision.lr_factor is not None or self.rollback_cut_ != target.rollback_cut:
                decision = self._compound(decision, target)
        if decision.action is Action.STOP and target is not None:
            decision = dataclasses.replace(
                decision, reason=f"{decision.reason}; the last healthy state (step {target.step}) is restored first"
            )
        elif decision.action is not Action.ROLLBACK:
            target = None
        undone = None if target is None else self._undone(target, step)
        intervention: list[InterventionRecord] = []

        def write(detail: str) -> None:
            if decision.lr_factor is not None and decision.action in (Action.LOWER_LR, Action.ROLLBACK):
                self.lr_factor_ *= decision.lr_factor
            since = None if target is None else target.step
            action = decision.action.value
            entry = InterventionRecord(step, action, decision.reason, detail, self.lr_factor_, since, undone)
            intervention.append(entry)
            self._emit(entry)

        # What a stop writes to a file: the state it restored (the last healthy one before the onset), else the newest.
        newest = target if target is not None else (self.snapshots.snapshots[-1] if self.snapshots.snapshots else None)
        apply(
            decision,
            actuator,
            self.settings.interventions,
            write,
            step=step,
            rollback=None if target is None else lambda: self._roll_back(actuator, target, step, decision.action),
            keep=None
            if newest is None
            else lambda: (
                f"last healthy state (step {newest.step}) "
                + actuator.save_snapshot(newest.load(), f"topo-last-healthy-step{newest.step}")
            ),
        )
        return intervention[0]

    @property
    def keeps_snapshots(self) -> bool:
        """Whether the rule in effect can roll back or stop (then healthy checks keep snapshots).

        A rollback goes back to one; a stop restores one first, so that it never leaves the weights of the fault.
        """
        rule = self.settings.rule
        reachable = {rule.action, rule.on_diverged}
        if Action.LOWER_LR.value in reachable:
            reachable.add(rule.after_max_lr_cuts)
        if Action.ROLLBACK.value in reachable:
            reachable.add(rule.after_max_rollbacks)
        return bool(reachable & {Action.ROLLBACK.value, Action.STOP.value})

    def _target(self, decision: Decision, record: CheckRecord, step: int) -> Snapshot | None:
        """The snapshot a rollback (or a stop) goes back to: the newest one taken before the alarm's onset."""
        onset = decision.step if decision.onset is None else decision.onset
        if step > record.step:
            # In the background a healthy check's snapshot is taken when its decision is applied, `lag` steps
            # after the check: go back to one taken before the last check before the onset, which that check
            # saw healthy.
            onset -= self.settings.schedule.check_every - 1
        return self.snapshots.newest_before(onset)

    def _keep_snapshot(self, actuator: Actuator, step: int) -> None:
        """Keep this healthy state as a snapshot, unless it cannot be kept here (then say so once, and keep none)."""
        try:
            self._check_room(actuator)
            payload = _snapshot(actuator)
        except SnapshotUnsupported as error:
            self.snapshots_off = str(error)
            if rank_and_world()[0] == 0:
                warnings.warn(
                    f"topocallbacks keeps no rollback snapshots: {error}. A rollback decision warns instead.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        kept = self.snapshots.add(step, payload, self.pipeline.reference_diagrams)
        kept.lr_factor = self.lr_factor_
        kept.rollback_cut = self.rollback_cut_

    def _check_room(self, actuator: Actuator) -> None:
        """Before the first snapshot in host memory: refuse snapshots that would take most of the memory left.

        ``snapshots + 1`` copies (one more is taken before the oldest is dropped) of every rank's state, on one
        host in the worst case, must fit in half of the memory available; rank 0 decides for every rank.
        """
        if self._room_checked or self.snapshots.directory is not None:
            return
        self._room_checked = True
        estimate = getattr(actuator, "snapshot_nbytes", None)
        verdict = None
        if estimate is not None:
            size = int(estimate())
            world = rank_and_world()[1]
            need = size * (self.snapshots.keep + 1) * world
            free = host_memory_available()
            if free is not None and need > free / 2:
                verdict = (
                    f"{self.snapshots.keep} snapshots of about {_size(size)} each (plus one in flight"
                    + (f", on each of {world} ranks" if world > 1 else "")
                    + f") need {_size(need)} of host memory, more than half of the {_size(free)} available; set "
                    "`interventions.snapshot_dir` to keep them on disk, or fewer `interventions.snapshots`"
                )
        verdict = broadcast_object(verdict)
        if verdict is not None:
            raise SnapshotUnsupported(verdict)

    def _compound(self, decision: Decision, target: Snapshot) -> Decision:
        """A rollback's cut times the earlier rollbacks', relative to the cuts already in ``target``'s rates."""
        total = self.rollback_cut_ * (1.0 if decision.lr_factor is None else decision.lr_factor)
        factor = total / target.rollback_cut
        reason = decision.reason
        if factor != decision.lr_factor:
            reason += (
                f"; with the earlier rollbacks' cuts, x {total:.4g} of the rate before the first rollback "
                f"(x {factor:.4g} of the snapshot's)"
            )
        self.rollback_cut_ = total
        return dataclasses.replace(decision, lr_factor=factor, reason=reason)

    def _undone(self, target: Snapshot, step: int) -> int:
        """The updates a rollback to ``target`` at ``step`` undoes (since the snapshot, or since the last rollback)."""
        last = self.last_rollback_step_
        return step - (target.step if last is None or last < target.step else last)

    def _roll_back(self, actuator: Actuator, target: Snapshot, step: int, action: Action = Action.ROLLBACK) -> str:
        """Restore ``target`` in place (every rank) and rewind the checks to it; what was done, in words.

        Before a stop (``action`` stop) the earlier rollbacks' compounded learning-rate cut is applied to the
        restored rates, so a run resumed from the stop's checkpoint goes on at the cut rate; no update is skipped.
        """
        undone = self._undone(target, step)
        # Checks still pending saw the abandoned steps: they reach the history, their decisions no longer act.
        self.finish()
        detail = actuator.restore(target.load())
        self.pipeline.rewind(target.diagrams)
        self._stop_worker()  # the next check starts a worker from the rewound state
        self._dynamics, self._batches = [], []
        self.snapshots.drop_after(target.step)
        self.last_rollback_step_ = step
        self.lr_factor_ = target.lr_factor  # the rates are the snapshot's again (cuts since then are undone)
        if action is Action.STOP:
            cut = ""
            if self.rollback_cut_ != target.rollback_cut:
                factor = self.rollback_cut_ / target.rollback_cut
                cut = f"; the rollbacks' cut kept: {actuator.scale_learning_rate(factor)}"
                self.lr_factor_ *= self.rollback_cut_ / target.rollback_cut
            return (
                f"restored the last healthy state, the snapshot of step {target.step} ({undone} updates undone), "
                f"before stopping; {detail}{cut}"
            )
        skip = self.settings.rollback_skip
        skipped = "" if not skip else f"; {_skip_updates(actuator, skip)}"
        return (
            f"rolled back to the snapshot of step {target.step}: {undone} updates undone and their batches not seen "
            f"again (training goes on with the next batch); {detail}{skipped}; {self.snapshots.describe()}"
        )

    def summary(self) -> str:
        """What happened, in a few lines.

        The checks, the warnings and interventions with their reasons, and where the history and the TensorBoard
        figures went.

        Example:
            >>> import numpy as np
            >>> monitor = TopoMonitor(check_every=1)
            >>> _ = monitor.process(np.random.default_rng(0).normal(size=(40, 3)), step=0)
            >>> print(monitor.summary().splitlines()[0])
            topocallbacks: 1 check (step 0) of diagram_drift; no warning and no intervention.
        """
        checks = [r for r in self.history if isinstance(r, CheckRecord)]
        done = [r for r in self.history if isinstance(r, InterventionRecord)]
        layer = self.settings.probe.layer
        resolved = getattr(self.extractor, "resolved_layer_", None)  # the name a pattern matched
        if resolved is not None:
            layer = (resolved,)
        watched = f" at layer {layer[0] if len(layer) == 1 else list(layer)}" if layer else ""
        if isinstance(self.pipeline, LayeredPipeline) and self.pipeline.layers:
            names = self.pipeline.layers
            watched = f" at {len(names)} layers ({', '.join(names)}; primary {names[0]})"
            checks = [r for r in checks if r.layer == names[0]]
        if not checks:
            head = f"topocallbacks: no check ran{watched}"
        else:
            span = f"step {checks[0].step}" if len(checks) == 1 else f"steps {checks[0].step}-{checks[-1].step}"
            plural = "check" if len(checks) == 1 else "checks"
            head = f"topocallbacks: {len(checks)} {plural} ({span}){watched} of {self.settings.index.name}"
        diverged = sum(1 for r in checks if not r.ok or r.decision.rule == "diverged")
        if diverged:
            head += f", {diverged} diverged"
        warned = [r for r in done if r.action == "warn"]
        acted = [r for r in done if r.action != "warn"]
        if not done:
            lines = [f"{head}; no warning and no intervention."]
        else:
            lines = [f"{head}; {len(warned)} warning(s), {len(acted)} intervention(s):"]
            lines += [f"  step {r.step}: {r.action} ({r.detail}), because {r.reason}" for r in done]
        output = self.settings.output
        if output.history_path is not None:
            lines.append(f"  history: {output.history_path}")
        if output.tensorboard_dir is not None:
            lines.append(f"  TensorBoard: {output.tensorboard_dir}")
        if self.snapshots.snapshots:
            lines.append(f"  rollback snapshots: {self.snapshots.describe()}")
        return "\n".join(lines)

    def report(self, out_dir: str | os.PathLike[str], *, title: str | None = None) -> Path | None:
        """Write the HTML report of this monitor's history into ``out_dir`` (:func:`topocallbacks.write_report`).

        The persistence diagrams of the last check that did not diverge are drawn too. In distributed training
        only rank 0 writes, as for the other sinks (the history is the same on every rank). Needs matplotlib
        (``topocallbacks[report]``).

        Returns:
            The path of ``index.html`` (None on the other ranks).
        """
        if rank_and_world()[0] != 0:
            return None
        from .report import write_report

        primary = self.pipeline.primary if isinstance(self.pipeline, LayeredPipeline) else None
        ok = (r for r in reversed(self.history) if isinstance(r, CheckRecord) and r.ok and r.layer == primary)
        last = next(ok, None)  # the diagrams drawn are the primary layer's
        diagrams = self.pipeline.last_diagrams  # those of the last check that was not diverged
        key: Any = None if last is None else last.step if last.layer is None else (last.step, last.layer)
        drawn = None if last is None or diagrams is None else {key: diagrams}
        return write_report(self.history, out_dir, diagrams=drawn, title=title)

    @property
    def last_records(self) -> list[CheckRecord]:
        """The latest check's records: one, or one per layer when several are watched (the primary layer's last)."""
        last = self.last_record
        if last is None:
            return []
        same = [r for r in self.history if isinstance(r, CheckRecord) and r.step == last.step]
        return same[-len(self.pipeline.layers) :] if isinstance(self.pipeline, LayeredPipeline) else [last]

    @property
    def last_record(self) -> CheckRecord | None:
        """The latest check record."""
        return next((r for r in reversed(self.history) if isinstance(r, CheckRecord)), None)

    # --- probe --------------------------------------------------------------------------------------------

    def set_probe(self, source: Any, tokenizer: Any = None) -> None:
        """Set the probe after construction (e.g. from a dataloader's dataset), checked against a loaded state.

        Raises:
            InputError: a bad source, or one whose contents differ from the probe a loaded state was saved with.
        """
        probe = self._new_probe(source, tokenizer)
        if self._loaded_probe_spec is not None:
            probe.verify(self._loaded_probe_spec)
        self.probe = probe

    def _new_probe(self, source: Any, tokenizer: Any) -> Probe:
        s = self.settings
        return Probe(source, tokenizer=tokenizer, max_length=s.probe.max_length, max_samples=s.probe.size, seed=s.seed)

    @property
    def several(self) -> bool:
        """Whether several layers are watched (``layers=[...]``)."""
        return isinstance(self.pipeline, LayeredPipeline)

    def resolve_layers(self, model: Any) -> list[str]:
        """The module names this monitor watches in ``model`` (the primary layer first).

        Raises:
            InputError: no layer, a name that designates no module (with the closest ones), an empty list or two
                entries for one module, a number of layers for ``policy.layer_rule`` larger than those watched, or
                other layers than a loaded state's.
        """
        if self.extractor is None:
            raise InputError("this monitor has no layer: pass `layer=` (or `layers=[...]`)")
        names = self.extractor.resolve(model)
        if isinstance(self.pipeline, LayeredPipeline):
            if len(names) < 2:
                raise InputError(f"`layers` must designate at least 2 layers to watch several, got {names}")
            self.pipeline.required(len(names))
            known = self.pipeline.layers
            if known and known != names:
                raise InputError(f"the layers {names} of {type(model).__name__} differ from the watched {known}")
        return names

    def features(self, model: Any, indices: Any = None) -> Any:
        """The probe's features at the watched layer (all samples, or ``indices``): an ``(n, d)`` array.

        With several layers, a dict of them by layer name (the primary layer first), from one probe pass.

        Raises:
            InputError: no probe or no layer was given.
        """
        if self.probe is None or self.extractor is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        if self.several:
            return self.extractor.extract(model, self.probe, indices, autocast=self.autocast)
        return self.extractor(model, self.probe, indices, autocast=self.autocast)

    def _gathered(self, model: Any) -> Any:
        """Every rank's share of the probe's features, reassembled (several layers travel as one array)."""
        if self.probe is None:  # pragma: no cover - checked by the caller
            raise InputError("this monitor has no probe")
        if not self.several:
            return gather_probe_features(lambda idx: self.features(model, idx), len(self.probe))
        widths: dict[str, int] = {}

        def joined(indices: Any) -> NDArray[np.float32]:
            parts = self.features(model, indices)
            widths.clear()
            widths.update({name: part.shape[1] for name, part in parts.items()})
            return np.concatenate(list(parts.values()), axis=1)

        together = gather_probe_features(joined, len(self.probe))
        bounds = np.cumsum(list(widths.values()))[:-1]
        return dict(zip(widths, np.split(together, bounds, axis=1), strict=True))

    # --- internals: submitting ------------------------------------------------------------------------------

    def _decide_background(self, sample: Any) -> None:
        """Settle ``background`` at the first check: on when the model or features live on an accelerator."""
        if self._background is None:
            device = None
            if isinstance(sample, torch.nn.Module):
                device = next((p.device for p in sample.parameters()), None)
            elif isinstance(sample, torch.Tensor):
                device = sample.device
            self._background = device is not None and device.type != "cpu"

    def _lag(self, lag: int | None) -> int:
        if lag is not None:
            return lag
        return self.settings.schedule.apply_lag if self.background else 0

    def _submit_probe(self, model: Any, step: int, lag: int | None = None) -> None:
        if self.probe is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        self._decide_background(model)
        start = time.perf_counter()
        try:
            if self.several:
                self.resolve_layers(model)
            features = self._gathered(model)
        except InputError as exc:
            layer = None if self.extractor is None else list(self.extractor.settings.layers or self.extractor.layer)
            raise InputError(f"{exc} (model {type(model).__name__}, layer {layer!r}, step {step})") from exc
        self.last_checked_step_ = step
        request = ("evaluate", step, features, self._take_dynamics())
        self._submit(request, step, lag, probe_ms=(time.perf_counter() - start) * 1e3)

    def _submit_window(self, step: int, features: Any, lag: int | None = None) -> None:
        self._decide_background(features)
        self.last_checked_step_ = step
        start = time.perf_counter()
        batches, self._batches = self._batches, []
        host = _host_batches(batches) if rank_and_world()[0] == 0 else []
        request = ("window", step, host, self._take_dynamics())
        self._submit(request, step, lag, probe_ms=(time.perf_counter() - start) * 1e3)

    def _take_dynamics(self) -> dict[str, float | None] | None:
        """The mean loss and gradient norm since the last check (rank 0; one read of the device tensors)."""
        taken, self._dynamics = self._dynamics, []
        if rank_and_world()[0] != 0:
            return None
        dynamics = {name: _mean([step[i] for step in taken]) for i, name in enumerate(("loss", "grad_norm"))}
        self._warn_unfed([name for name in self.settings.rule.channels if name in dynamics and dynamics[name] is None])
        return dynamics if taken else None

    def _warn_unfed(self, missing: list[str]) -> None:
        """Say once when the rule watches a training channel that nobody passes (from the second check on)."""
        if not missing:
            return
        self._unfed_checks += 1
        if self._unfed_checks == 2:  # the first check may come before any training step
            channels = list(self.settings.rule.channels)
            warnings.warn(
                f"topocallbacks: the rule watches {channels} (require {self.settings.rule.require}), but no "
                f"{' or '.join(missing)} was passed since the last check: pass loss= (and grad_norm=) to on_step(), "
                "process() or record_dynamics() (the Lightning and Hugging Face callbacks do it for you), or set "
                "policy={'channels': ['index'], 'require': 1}; until then only the collapse sentinels and a "
                "diverged check act",
                RuntimeWarning,
                stacklevel=4,
            )

    def _submit(self, request: tuple[Any, ...], step: int, lag: int | None, probe_ms: float = 0.0) -> None:
        """Queue a check (every rank); rank 0 evaluates it now or hands it to the worker."""
        pending = _Pending(step, step + self._lag(lag), probe_ms)
        if rank_and_world()[0] == 0:
            if self.background:
                self._start_worker().request(request)
            else:
                start = time.perf_counter()
                kind, _, payload, dynamics = request
                if kind == "evaluate":
                    pending.evaluation = self.pipeline.evaluate(payload, step, dynamics)
                elif isinstance(self.pipeline, LayeredPipeline):  # pragma: no cover - settings refuse it
                    raise InputError("streaming watches one layer: `layers` works in probe mode only")
                else:
                    self.pipeline.push(payload)
                    pending.evaluation = self.pipeline.evaluate_window(step, dynamics)
                pending.eval_ms = (time.perf_counter() - start) * 1e3
        self._pending.append(pending)

    def _start_worker(self) -> WorkerProcess:
        if self._worker is None:
            self._worker = WorkerProcess(
                self.settings.as_dict(), self.pipeline.state_dict(), threads=self.settings.schedule.worker_threads
            )
        return self._worker

    # --- internals: applying --------------------------------------------------------------------------------

    def _receive(self, pending: _Pending) -> float:
        """Rank 0: wait for the worker's evaluations up to ``pending``'s; the seconds waited for it."""
        waited = 0.0
        for item in self._pending:
            if item.evaluation is not None:
                continue
            if self._worker is None:  # pragma: no cover - a background check always has a worker
                raise RuntimeError("a background check is pending without a worker")
            record, shared, figures, seconds, others = self._worker.reply()
            self.pipeline.receive(shared)  # the mirror follows the worker at once
            item.evaluation = Evaluation(
                None if record is None else CheckRecord.from_dict(record),
                shared,
                figures,
                [CheckRecord.from_dict(r) for r in others],
            )
            if item is pending:
                waited = seconds
                break
        return waited

    def _collect(self, step: int, *, final: bool = False) -> list[CheckRecord]:
        """Apply every pending check whose step has come (all ranks, in order); their records."""
        records = []
        rank = rank_and_world()[0]
        while self._pending and self._pending[0].apply_at <= step:
            pending = self._pending[0]
            waited_ms = self._receive(pending) * 1e3 + pending.eval_ms if rank == 0 else 0.0
            self._pending.popleft()
            found: list[CheckRecord] = []
            figures = None
            if rank == 0:
                evaluation = pending.evaluation
                if evaluation is not None and evaluation.record is not None:
                    # The other layers' records first, then the primary layer's, which carries the decision.
                    found = [
                        dataclasses.replace(
                            record, applied_step=None if final else step, wait_ms=waited_ms, probe_ms=pending.probe_ms
                        )
                        for record in [*evaluation.others, evaluation.record]
                    ]
                    found[-1] = self._moved_first(found)
                    figures = evaluation.figures
            adopted = self._adopt(found)
            for i, record in enumerate(adopted):
                self._emit(record, figures if i == len(adopted) - 1 else None)
                records.append(record)
        return records

    def _moved_first(self, records: list[CheckRecord]) -> CheckRecord:
        """The deciding record (the last), its reason completed with the layers' moves when several are watched.

        Each layer's watched index against its own past checks (:mod:`topocallbacks.report`'s diagnosis), the one
        that moved most first: which layer moved first, and by how much.
        """
        decision = records[-1]
        if len(records) < 2 or not (decision.decision.fired or decision.decision.held_back is not None):
            return decision
        from .report import _fmt_z, _layer_moves  # the report's diagnosis, not a second copy of it

        past = [r for r in self.history if isinstance(r, CheckRecord)]
        moves = _layer_moves(decision.step, [*past, *records])
        if not moves:
            return decision

        def described(move: Any) -> str:
            z = "" if move.z is None else f", {_fmt_z(move.z)}"
            return f"{move.name} {move.before:.4g} -> {move.after:.4g} ({move.change:+.4g}{z})"

        text = f"; layer that moved first: {described(moves[0])}"
        if len(moves) > 1:
            text += "; then " + ", ".join(described(move) for move in moves[1:])
        return dataclasses.replace(
            decision, decision=dataclasses.replace(decision.decision, reason=decision.decision.reason + text)
        )

    def _adopt(self, records: list[CheckRecord]) -> list[CheckRecord]:
        """Broadcast rank 0's records and pipeline state (none: nothing) and adopt them on the other ranks."""
        rank, world = rank_and_world()
        if world == 1:
            return records
        payload = None
        if rank == 0 and records:
            payload = {
                "records": [r.as_dict() for r in records],
                "pipeline": self.pipeline.share(),
                "lr_factor": self.lr_factor_,
            }
        shared: dict[str, Any] | None = broadcast_object(payload)
        if shared is None or rank == 0:
            return records
        self.pipeline.receive(shared["pipeline"])
        self.lr_factor_ = float(shared["lr_factor"])
        return [CheckRecord.from_dict(r) for r in shared["records"]]

    @staticmethod
    def _only(records: list[CheckRecord], step: int) -> CheckRecord:
        if not records:  # pragma: no cover - a check submitted with lag 0 is applied at once
            raise RuntimeError(f"no record came back for the check at step {step}")
        return records[-1]

    def _emit(self, record: Record, diagrams: list[NDArray[np.float64]] | None = None) -> None:
        self.history.append(record)
        if rank_and_world()[0] != 0:
            return  # in distributed training every rank keeps the history; only rank 0 writes files
        if self._history_sink is not None:
            self._history_sink.write(record.as_dict())
        output = self.settings.output
        if output.tensorboard_dir is not None and isinstance(record, CheckRecord):
            if self._tensorboard is None:
                self._tensorboard = TensorBoardSink(output.tensorboard_dir, prefix=self.prefix)
            self._tensorboard.write(record, diagrams)

    # --- state --------------------------------------------------------------------------------------------

    @property
    def _probe_spec_state(self) -> dict[str, Any] | None:
        spec = self.probe.spec if self.probe is not None else self._loaded_probe_spec
        return None if spec is None else spec.as_dict()

    @_probe_spec_state.setter
    def _probe_spec_state(self, value: Mapping[str, Any] | None) -> None:
        spec = None if value is None else ProbeSpec.from_dict(value)
        if self.probe is not None and spec is not None:
            self.probe.verify(spec)
        self._loaded_probe_spec = spec

    @property
    def _pending_state(self) -> list[dict[str, Any]]:
        if rank_and_world()[0] == 0 and self._pending:
            self._receive(self._pending[-1])  # a checkpoint holds every pending check's finished evaluation
        return [pending.as_dict() for pending in self._pending]

    @_pending_state.setter
    def _pending_state(self, value: list[Mapping[str, Any]]) -> None:
        shared = self.pipeline.share()
        self._pending = collections.deque(_Pending.from_dict(item, shared) for item in value)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state.

        The probe spec, the pipeline's state (ε, transform, policy counters, last diagrams, an engine marker: the
        engine is rebuilt exactly from the next check's points), the history, the learning-rate factor, the last
        checked step, and the checks whose decisions are still to be applied (their evaluations finished first).
        """
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (a running background worker is stopped; the next check starts a new one).

        Raises:
            InputError: missing keys, another version, or a probe with other contents than the saved one's.
        """
        self._stop_worker()
        super().load_state_dict(state)

    def close(self) -> None:
        """Stop the background worker and close the TensorBoard writer (the JSONL sink keeps no handle open)."""
        self._stop_worker()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __getstate__(self) -> dict[str, Any]:
        # An open writer, a worker process and device tensors do not pickle (ddp_spawn pickles callbacks); the
        # writer and the worker are started again on use.
        state = {**self.__dict__, "_tensorboard": None, "_worker": None, "_batches": [], "autocast": None}
        state["_dynamics"] = []
        state["snapshots"] = SnapshotStore(self.snapshots.keep, self.snapshots.directory)
        return state


def _mean(values: list[Any]) -> float | None:
    """The mean of floats and tensors (the tensors are summed on their device and read once); None if none."""
    tensors = [v.detach().float().reshape(-1) for v in values if isinstance(v, torch.Tensor)]
    plain = [float(v) for v in values if v is not None and not isinstance(v, torch.Tensor)]
    count = sum(t.numel() for t in tensors) + len(plain)
    if not count:
        return None
    total = float(torch.cat(tensors).sum().item()) if tensors else 0.0
    return (total + sum(plain)) / count


def _snapshot(actuator: Actuator) -> Any:
    """``actuator.snapshot()``; SnapshotUnsupported for an actuator that takes none (snapshots are then off)."""
    take = getattr(actuator, "snapshot", None)
    if take is None:
        raise SnapshotUnsupported(
            f"{type(actuator).__name__} takes no snapshots: give it `snapshot()` and `restore()` "
            "(LoopActuator(..., model=model) has them)"
        )
    return take()


def _skip_updates(actuator: Actuator, count: int) -> str:
    """``actuator.skip_updates(count)``, with a clear error for an actuator that cannot skip."""
    skip = getattr(actuator, "skip_updates", None)
    if skip is None:
        raise InputError(
            f"`rollback_skip` is {count}, but {type(actuator).__name__} cannot skip updates: give it "
            "`skip_updates(count)` (LoopActuator has it: topocallbacks.interventions.skip_updates)"
        )
    return str(skip(count))


def _no_snapshot(decision: Decision, instead: str, off: str | None = None) -> Decision:
    """A rollback with nothing to go back to becomes ``instead`` (a warning; for a diverged check, the escalation)."""
    onset = decision.step if decision.onset is None else decision.onset
    why = "" if off is None else f" (no snapshots are kept: {off})"
    return dataclasses.replace(
        decision,
        action=Action(instead),
        lr_factor=None,
        reason=f"{decision.reason}; no healthy snapshot before step {onset}{why}, so {instead}",
    )
