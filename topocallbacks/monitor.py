"""TopoMonitor: probe -> features -> fixed transform -> MMHM + index -> policy -> sinks, in a plain loop or a callback.

Framework-free orchestration, usable from a plain PyTorch loop::

    monitor = TopoMonitor(probe=probe_inputs, layer="encoder.pool", check_every=100)
    for step, batch in enumerate(loader):
        ...  # forward, backward, optimizer step
        if monitor.due(step):
            record = monitor.check(model, step)  # record.decision says what to do

The Lightning and Hugging Face callbacks are thin adapters around it: they call :meth:`TopoMonitor.check` (or
:meth:`TopoMonitor.observe` in streaming mode), log the record, and hand the decision to :meth:`TopoMonitor.act`
with their framework's :class:`~topocallbacks.interventions.Actuator`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from ._validation import as_points
from .check import ORIENTATION, CheckRecord, InterventionRecord, measure, record_from_dict
from .distributed import broadcast_object, gather_probe_features, rank_and_world
from .exceptions import InputError, NonFiniteError
from .functional.collapse import calibrate_epsilon
from .functional.topology import _persistence_diagrams, _subsample
from .interventions import Actuator, apply
from .mmhm import MMHM
from .policy import Policy
from .probe import FeatureExtractor, Probe, ProbeSpec
from .settings import Action, MonitorSettings
from .sinks import JsonlSink, TensorBoardSink
from .transform import FeatureTransform

__all__ = ["TopoMonitor"]

Record = CheckRecord | InterventionRecord


def _diagrams_to_lists(diagrams: list[NDArray[np.float64]] | None) -> Any:
    return None if diagrams is None else [d.tolist() for d in diagrams]


def _diagrams_from_lists(saved: Any) -> list[NDArray[np.float64]] | None:
    return None if saved is None else [np.asarray(d, dtype=np.float64).reshape(-1, 2) for d in saved]


class TopoMonitor(Stateful):
    """Watches the features of a fixed probe (or of the training batches) and decides when to act.

    Args:
        settings: a :class:`~topocallbacks.settings.MonitorSettings` (a preset's ``settings``, say); default: every
            option at its default.
        probe: probe inputs (a tensor, a Dataset or a list; see :class:`~topocallbacks.probe.Probe`); needed in
            probe mode to run :meth:`check` (:meth:`process` takes features directly).
        **overrides: any option by name, merged into ``settings`` and validated
            (:meth:`MonitorSettings.merged <topocallbacks.settings.MonitorSettings.merged>`): ``layer``,
            ``check_every``, ``index``, ``max_probe_samples``, ``history_path``, ``policy={...}`` (a mapping merged
            into the policy in effect, a :class:`~topocallbacks.settings.PolicySettings`, or a
            :class:`~topocallbacks.policy.Policy` whose settings are used)...

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
        version=3,
        fields={
            "probe_spec": "_probe_spec_state",
            "epsilon": "epsilon_",
            "transform": "transform",
            "history": "history",
            "policy": "policy",
            "lr_factor": "lr_factor_",
            "diagrams": "_diagrams",
            "engine": "_engine_state",
            "last_checked_step": "last_checked_step_",
        },
        encode={"history": lambda h: [r.as_dict() for r in h], "diagrams": _diagrams_to_lists},
        decode={"history": lambda h: [record_from_dict(r) for r in h], "diagrams": _diagrams_from_lists},
    )
    #: What another rank needs to continue from rank 0's latest check (see :meth:`share`).
    _SHARED = frozenset({"epsilon", "transform", "policy", "lr_factor", "diagrams", "last_checked_step"})

    def __init__(self, settings: MonitorSettings | None = None, *, probe: Any = None, **overrides: Any) -> None:
        if settings is not None and not isinstance(settings, MonitorSettings):
            raise InputError(f"`settings` must be a MonitorSettings, got {type(settings).__name__}")
        base = MonitorSettings() if settings is None else settings
        self.settings = base.merged(overrides) if overrides else base
        s = self.settings
        self.extractor = None if s.probe.layer is None else FeatureExtractor(s.probe)
        self._loaded_probe_spec: ProbeSpec | None = None
        self.probe = None if probe is None else Probe(probe, max_samples=s.probe.size, seed=s.seed)
        if self.probe is not None and self.extractor is None:
            raise InputError("`layer` is required with a `probe`: name the module whose output to watch")
        self.policy = Policy(s.rule)
        self.transform = FeatureTransform(s.transform, streaming=s.schedule.mode == "stream", seed=s.seed)
        self._history_sink = None if s.output.history_path is None else JsonlSink(s.output.history_path)
        self._tensorboard: TensorBoardSink | None = None  # created at the first check (writers do not pickle)
        self.history: list[Record] = []
        self.lr_factor_ = 1.0
        self.epsilon_: float | None = s.index.epsilon
        self.last_checked_step_: int | None = None
        self.engine_: MMHM | None = None
        self._engine_saved: dict[str, Any] | None = None  # a loaded engine state, until the engine exists again
        self._diagrams: list[NDArray[np.float64]] | None = None  # the last check's, for diagram drift
        self._stream_diverged = False  # streaming: a batch with NaN or Inf arrived since the last check

    # --- schedule -----------------------------------------------------------------------------------------

    def should_check(self, step: int) -> bool:
        """Whether ``step`` is a check step (every ``check_every`` steps, from step 0)."""
        return step % self.settings.schedule.check_every == 0

    def due(self, step: int) -> bool:
        """Whether a check is due at ``step``: a check step not checked yet.

        Gradient accumulation and a resumed run reach the same step more than once; it is checked once.
        """
        return self.should_check(step) and step != self.last_checked_step_

    # --- checks -------------------------------------------------------------------------------------------

    def set_probe(self, source: Any) -> None:
        """Set the probe after construction (e.g. from a dataloader's dataset), checked against a loaded state.

        Raises:
            InputError: a bad source, or one whose contents differ from the probe a loaded state was saved with.
        """
        probe = Probe(source, max_samples=self.settings.probe.size, seed=self.settings.seed)
        if self._loaded_probe_spec is not None:
            probe.verify(self._loaded_probe_spec)
        self.probe = probe

    def features(self, model: Any, indices: Any = None) -> NDArray[np.float32]:
        """The probe's features at the watched layer (all samples, or ``indices``).

        Raises:
            InputError: no probe or no layer was given.
        """
        if self.probe is None or self.extractor is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        return self.extractor(model, self.probe, indices)

    def check(self, model: Any, step: int) -> CheckRecord:
        """Probe mode: run the probe through ``model`` and evaluate it; the same record on every rank.

        In distributed training every rank must call it at the same step: each runs its shard of the probe, rank 0
        evaluates and decides, and every rank adopts rank 0's record.

        Raises:
            InputError: no probe, or the probe pass failed (the message names the model, layer and step).
        """
        if self.probe is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        try:
            features = gather_probe_features(lambda idx: self.features(model, idx), len(self.probe))
        except InputError as exc:
            layer = None if self.extractor is None else list(self.extractor.layer)
            raise InputError(f"{exc} (model {type(model).__name__}, layer {layer!r}, step {step})") from exc
        self.last_checked_step_ = step
        record = self.process(features, step) if rank_and_world()[0] == 0 else None
        adopted = self._adopt(record)
        if adopted is None:  # pragma: no cover - rank 0 always evaluates a probe check
            raise RuntimeError(f"rank 0 shared no record for the check at step {step}")
        return adopted

    def process(self, features: Any, step: int) -> CheckRecord:
        """Evaluate one check of features ``(n, d)`` on this process and return its record.

        NaN or Inf features give a ``"diverged"`` record and the policy's ``on_diverged`` action; they never reach
        GUDHI.

        Raises:
            InputError: features of the wrong shape, or whose dimension changed since the first check.
        """
        start = time.perf_counter()
        self.last_checked_step_ = step
        cloud = self._as_cloud(features)
        if cloud is None:
            return self._diverged(step, start)
        cloud = self.transform(cloud)
        engine = self._engine(cloud)
        betti = engine._update(cloud)
        return self._evaluate(cloud, (betti.b0, betti.b1), step, start, engine)

    def observe(self, features: Any, step: int) -> CheckRecord | None:
        """Streaming mode: add a training batch's features to the window, and check the window when due.

        In distributed training every rank calls it at every step (rank 0 keeps the window; at a due step the
        other ranks receive rank 0's record).

        Returns:
            The check record when a check was due at ``step`` (the same on every rank), else None.
        """
        if self.settings.schedule.mode != "stream":
            raise InputError("observe() is for streaming mode; create the monitor with mode='stream'")
        start = time.perf_counter()
        if rank_and_world()[0] == 0 and features is not None:
            self._push(features, step)
        if not self.due(step):
            return None
        self.last_checked_step_ = step
        record = self._check_window(step, start) if rank_and_world()[0] == 0 else None
        return self._adopt(record)

    def act(self, record: CheckRecord, actuator: Actuator) -> InterventionRecord | None:
        """Carry out ``record``'s decision (every rank, at the same step) and write it to the history.

        Returns:
            The intervention record, or None when the decision asked for nothing.
        """
        decision = record.decision
        if not decision.fired:
            return None
        intervention: list[InterventionRecord] = []

        def write(detail: str) -> None:
            if decision.action is Action.LOWER_LR and decision.lr_factor is not None:
                self.lr_factor_ *= decision.lr_factor
            entry = InterventionRecord(decision.step, decision.action.value, decision.reason, detail, self.lr_factor_)
            intervention.append(entry)
            self._emit(entry)

        apply(decision, actuator, self.settings.interventions, write)
        return intervention[0]

    @property
    def last_record(self) -> CheckRecord | None:
        """The latest check record."""
        return next((r for r in reversed(self.history) if isinstance(r, CheckRecord)), None)

    # --- internals ----------------------------------------------------------------------------------------

    @staticmethod
    def _as_cloud(features: Any, min_samples: int = 2) -> NDArray[np.float64] | None:
        """Validated features, or None when they hold NaN or Inf (a diverged check)."""
        try:
            return as_points(features, "features", min_samples=min_samples)
        except NonFiniteError:
            return None

    def _engine(self, cloud: NDArray[np.float64]) -> MMHM:
        """The engine, created at the first check once ε is calibrated on its (transformed) cloud."""
        if self.engine_ is None:
            if self.epsilon_ is None:
                if cloud.shape[0] < 2:
                    raise InputError("ε calibration needs at least 2 points in the first check or batch")
                self.epsilon_ = calibrate_epsilon(cloud, self.settings.index, self.settings.seed)
            stream = self.settings.schedule.mode == "stream"
            self.engine_ = MMHM(epsilon=self.epsilon_, window=self.settings.schedule.window if stream else None)
            if self._engine_saved is not None:
                self.engine_.load_state_dict(self._engine_saved)
                self._engine_saved = None
        return self.engine_

    def _push(self, features: Any, step: int) -> None:
        cloud = self._as_cloud(features, min_samples=1)
        if cloud is None:
            self._stream_diverged = True
            return
        limit = self.settings.schedule.points_per_batch
        if limit is not None and cloud.shape[0] > limit:
            rows = np.random.default_rng((self.settings.seed, step)).choice(cloud.shape[0], limit, replace=False)
            cloud = cloud[np.sort(rows)]
        cloud = self.transform(cloud)
        self._engine(cloud)._push_batch(cloud)

    def _check_window(self, step: int, start: float) -> CheckRecord | None:
        if self._stream_diverged:
            self._stream_diverged = False
            return self._diverged(step, start)
        engine = self.engine_
        if engine is None or engine.n_points < 2:
            return None
        betti = engine.betti_numbers()
        return self._evaluate(engine.points, (betti.b0, betti.b1), step, start, engine)

    def _evaluate(
        self, cloud: NDArray[np.float64], betti: tuple[int, int], step: int, start: float, engine: MMHM
    ) -> CheckRecord:
        s = self.settings
        if self.epsilon_ is None:  # pragma: no cover - the engine exists, so ε was calibrated
            raise RuntimeError("the monitor evaluated a cloud before calibrating ε")
        found = measure(cloud, self.epsilon_, s.index, previous=self._diagrams, betti=betti, seed=s.seed)
        self._diagrams = found.diagrams
        value = found.index_value
        decision = self.policy.decide(step, None if value is None else ORIENTATION[s.index.name] * value)
        record = CheckRecord(
            step=step,
            status="ok",
            index=s.index.name,
            index_value=value,
            decision=decision,
            check_ms=(time.perf_counter() - start) * 1e3,
            report=found.report,
            engine=engine.last_stats,
            n_points=int(cloud.shape[0]),
        )
        figures = None  # full (unthresholded) diagrams for the TensorBoard figures
        if s.output.tensorboard_dir is not None and s.output.diagram_every:
            figures = _persistence_diagrams(_subsample(cloud, s.index.max_points, s.seed), 1, None)
        self._emit(record, figures)
        return record

    def _diverged(self, step: int, start: float) -> CheckRecord:
        decision = self.policy.decide(step, None, diverged=True)
        record = CheckRecord(
            step, "diverged", self.settings.index.name, None, decision, (time.perf_counter() - start) * 1e3
        )
        self._emit(record)
        return record

    def _emit(self, record: Record, diagrams: list[NDArray[np.float64]] | None = None) -> None:
        self.history.append(record)
        if rank_and_world()[0] != 0:
            return  # in distributed training every rank keeps the history; only rank 0 writes files
        if self._history_sink is not None:
            self._history_sink.write(record.as_dict())
        output = self.settings.output
        if output.tensorboard_dir is not None and isinstance(record, CheckRecord):
            if self._tensorboard is None:
                self._tensorboard = TensorBoardSink(output.tensorboard_dir, diagram_every=output.diagram_every)
            self._tensorboard.write(record, diagrams)

    # --- distributed --------------------------------------------------------------------------------------

    def share(self) -> dict[str, Any]:
        """What another rank needs to adopt this rank's latest check.

        The record, and the state the next decisions depend on (ε, transform, policy counters, learning-rate
        factor, last diagrams, last checked step).
        """
        last = self.last_record
        return {**self._state.save(self, only=set(self._SHARED)), "record": None if last is None else last.as_dict()}

    def receive(self, shared: Mapping[str, Any]) -> CheckRecord:
        """Adopt another rank's :meth:`share` (no file or TensorBoard output is written here)."""
        self._state.load(self, shared, only=set(self._SHARED))
        record = CheckRecord.from_dict(shared["record"])
        self.history.append(record)
        return record

    def _adopt(self, record: CheckRecord | None) -> CheckRecord | None:
        """Broadcast rank 0's check (or None: nothing was checked) and adopt it on the other ranks.

        Every rank must call it at the same step.
        """
        rank, world = rank_and_world()
        if world == 1:
            return record
        shared = broadcast_object(self.share() if rank == 0 and record is not None else None)
        if shared is None:
            return None
        return record if rank == 0 else self.receive(shared)

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
    def _engine_state(self) -> dict[str, Any] | None:
        # The complex is rebuilt exactly from the next check's points: a marker and the cost model, not the points.
        return self._engine_saved if self.engine_ is None else self.engine_.state_dict(include_points=False)

    @_engine_state.setter
    def _engine_state(self, value: Mapping[str, Any] | None) -> None:
        self.engine_ = None
        self._engine_saved = None if value is None else dict(value)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state.

        The probe spec, ε, transform, history, policy counters, learning-rate factor, last diagrams, an engine marker
        (the engine is rebuilt exactly from the next check's points) and the last checked step.
        """
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            InputError: missing keys, another version, or a probe with other contents than the saved one's.
        """
        super().load_state_dict(state)

    def close(self) -> None:
        """Close the TensorBoard writer (the JSONL sink keeps no handle open)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __getstate__(self) -> dict[str, Any]:
        # An open TensorBoard writer cannot be pickled (ddp_spawn pickles callbacks); it is reopened on use.
        return {**self.__dict__, "_tensorboard": None}
