"""The stateful evaluation of checks: features -> transform -> ε -> MMHM -> measure -> policy -> a record.

`CheckPipeline` imports no torch and pickles, so the same object runs in the training process (synchronous
mode) or in the background worker (`topocallbacks._worker`); [`TopoMonitor`][topocallbacks.TopoMonitor] keeps a
mirror of its state from what each result carries (`CheckPipeline.share`), exactly as a distributed rank
adopts rank 0's state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from ._validation import as_points
from .check import (
    ORIENTATION,
    CheckRecord,
    diagrams_from_lists,
    diagrams_to_lists,
    measure,
    prepare_in_background,
)
from .exceptions import InputError, NonFiniteError
from .functional.collapse import DEGREE_BAND, calibrate_epsilon, mean_degree
from .functional.sentinels import SentinelValues, sentinel_values
from .functional.topology import _persistence_diagrams, _subsample
from .mmhm import MMHM
from .policy import Decision, Policy
from .settings import Action, MonitorSettings
from .silent import watch_for
from .transform import FeatureTransform

__all__ = ["CheckPipeline", "CheckRequest", "Evaluation", "LayeredPipeline", "make_pipeline"]

Diagrams = list[NDArray[np.float64]]


def _channels(dynamics: Mapping[str, float | None] | None) -> tuple[float | None, float | None]:
    """The training channels' values (loss, gradient norm) since the last check, or None each."""
    dynamics = dynamics or {}
    return dynamics.get("loss"), dynamics.get("grad_norm")


def _density(edges: int, n: int) -> float:
    return edges / (n * (n - 1) / 2) if n > 1 else 0.0


#: Streaming: the sentinels look at the newest this many points pushed since the last check.
RECENT_POINTS = 512


def _as_cloud(features: Any, min_samples: int = 2) -> NDArray[np.float64] | None:
    """Validated features, or None when they hold NaN or Inf (a diverged check)."""
    try:
        return as_points(features, "features", min_samples=min_samples)
    except NonFiniteError:
        return None


def _stream_window(settings: MonitorSettings, dim: int) -> int | None:
    """Streaming: the window, capped so that a check of it fits ``check_budget_ms`` (None in probe mode)."""
    schedule = settings.schedule
    if schedule.mode != "stream":
        return None
    affordable = MMHM(epsilon=1.0).largest_n_within(schedule.check_budget_ms / 1e3, dim)
    return max(2, min(schedule.window, affordable))


def _rebuilt(engine: MMHM, epsilon: float, points: NDArray[np.float64]) -> MMHM:
    """A streaming engine at ``epsilon`` over ``points``, keeping what ``engine`` learned about this machine."""
    rebuilt = MMHM(epsilon=epsilon, window=engine.window)
    rebuilt.cost_model = engine.cost_model
    rebuilt._push_batch(points)
    return rebuilt


class RecentBatches:
    """Streaming: the projected batches pushed since the last check, whose sentinels the next check reports.

    At most the newest batches holding `RECENT_POINTS` points are kept (past the oldest one).
    """

    def __init__(self) -> None:
        self.batches: list[NDArray[np.float64]] = []

    def add(self, projected: NDArray[np.float64]) -> None:
        self.batches.append(projected)

    def trim(self) -> None:
        """Drop the oldest batches while the newer ones hold `RECENT_POINTS` points."""
        while len(self.batches) > 1 and sum(len(c) for c in self.batches[1:]) >= RECENT_POINTS:
            self.batches.pop(0)

    def clear(self) -> None:
        self.batches = []

    def take_sentinels(self, epsilon: float | None, transform: FeatureTransform) -> SentinelValues | None:
        """The sentinels of the batches since the last check (None: none were, or ε is not known yet); emptied."""
        recent, self.batches = self.batches, []
        if not recent or epsilon is None:
            return None
        pooled = np.concatenate(recent)[-RECENT_POINTS:]
        if pooled.shape[0] < 2:
            return None
        return sentinel_values(recent, pooled, transform.normalise(pooled), epsilon)


def _batch_rows(cloud: NDArray[np.float64], settings: MonitorSettings, step: int) -> NDArray[np.float64]:
    """Streaming: a seeded subset of at most ``points_per_batch`` rows of step ``step``'s batch, in order."""
    limit = settings.schedule.points_per_batch
    if limit is None or cloud.shape[0] <= limit:
        return cloud
    rows = np.random.default_rng((settings.seed, step)).choice(cloud.shape[0], limit, replace=False)
    return cloud[np.sort(rows)]


def _engine_fields(engine: MMHM, n_points: int) -> dict[str, Any]:
    """A record's fields about the engine's complex: its last update's statistics, the points, window, density."""
    density = _density(engine.n_edges, n_points)
    return {"engine": engine.last_stats, "n_points": n_points, "window": engine.window, "density": density}


def _degree_left_band(engine: MMHM) -> bool:
    """Whether the engine's complex has a mean degree outside `DEGREE_BAND` (its ε no longer fits the window)."""
    low, high = DEGREE_BAND
    return not low <= mean_degree(engine.n_edges, engine.n_points) <= high


def _due_figures(settings: MonitorSettings, cloud: NDArray[np.float64], checks: int) -> Diagrams | None:
    """The full (unthresholded) diagrams of a TensorBoard figure, when the ``checks``-th check draws one."""
    output = settings.output
    if output.tensorboard_dir is None or not output.diagram_every or checks % output.diagram_every != 0:
        return None
    return _persistence_diagrams(_subsample(cloud, settings.index.max_points, settings.seed), 1, None)


class Evaluation:
    """What one evaluation produced.

    The record (None: a streaming window too small to check) and the diagrams of a TensorBoard figure when one is
    due. With several layers (`LayeredPipeline`) ``record`` is the primary layer's, which carries the check's
    decision, and ``others`` the other layers' records. The pipeline's state after it is not part of it: only a
    worker sends it (`CheckPipeline.share`), so a check in the training loop does not copy it.
    """

    __slots__ = ("figures", "others", "record")

    def __init__(
        self,
        record: CheckRecord | None,
        figures: Diagrams | None = None,
        others: Sequence[CheckRecord] = (),
    ) -> None:
        self.record = record
        self.figures = figures
        self.others = list(others)


@dataclasses.dataclass(frozen=True)
class CheckRequest:
    """What a check asks of a pipeline, in the training process or the background worker.

    Attributes:
        kind: ``"evaluate"`` (the probe's features, ``(n, d)``, or ``{layer: (n, d)}`` for several layers) or
            ``"window"`` (streaming: ``[(step, (b, d)), ...]`` batches to push, then the window is checked).
        step: the training step of the check.
        payload: the features or the batches.
        dynamics: the training channels since the last check (``{"loss": ..., "grad_norm": ...}``), or None.
    """

    kind: str
    step: int
    payload: Any
    dynamics: Mapping[str, float | None] | None = None

    def run(self, pipeline: CheckPipeline | LayeredPipeline) -> Evaluation:
        """Evaluate this check on ``pipeline``.

        Raises:
            InputError: a streaming window for several layers (streaming watches one), or an unknown ``kind``.
        """
        if self.kind == "evaluate":
            return pipeline.evaluate(self.payload, self.step, self.dynamics)
        if self.kind != "window":
            raise InputError(f"a check request's `kind` must be 'evaluate' or 'window', got {self.kind!r}")
        if isinstance(pipeline, LayeredPipeline):
            raise InputError("streaming watches one layer: `layers` works in probe mode only")
        pipeline.push(self.payload)
        return pipeline.evaluate_window(self.step, self.dynamics)


class StreamingWindow:
    """Streaming mode's window, a base of `CheckPipeline`: the training batches on their way into the engine.

    Each batch keeps at most ``points_per_batch`` seeded rows and joins the window in the transform's frame (the
    window is re-expressed when the frame moves); the newest batches wait for the next check's sentinels, and a
    window whose mean degree left `DEGREE_BAND` gets a new ε. The state it works on is the pipeline's (saved there).
    """

    settings: MonitorSettings
    streaming: bool
    transform: FeatureTransform
    epsilon_: float | None
    engine_: MMHM | None
    stream_diverged_: bool
    rescales_: int
    _recent: RecentBatches
    _engine: Callable[[NDArray[np.float64]], MMHM]  # the pipeline's engine, created at the first check

    def push(self, batches: Sequence[tuple[int, Any]]) -> None:
        """Streaming mode: add training batches' features ``[(step, (b, d)), ...]`` to the window, oldest first.

        Each batch keeps a seeded subset of at most ``points_per_batch`` rows (the training adapters' capture keeps
        it already); a batch with NaN or Inf is left out and makes the next check a diverged one. The batches go
        into the window in one push: the window ends up with the same points as after one push per batch.
        """
        clouds: list[NDArray[np.float64]] = []
        for step, features in batches:
            cloud = _as_cloud(features, min_samples=1)
            if cloud is None:
                self.stream_diverged_ = True
                continue
            cloud = _batch_rows(cloud, self.settings, step)
            if self.transform.track(cloud):  # the features drifted out of the frame: re-express the window
                self._push_clouds(clouds)
                clouds = []
                self._reframe()
            projected = self.transform.project(cloud)
            self._recent.add(projected)
            clouds.append(self.transform.normalise(projected))
        self._push_clouds(clouds)
        self._recent.trim()

    def _push_clouds(self, clouds: list[NDArray[np.float64]]) -> None:
        if clouds:
            joined = np.concatenate(clouds) if len(clouds) > 1 else clouds[0]
            self._engine(joined)._push_batch(joined)

    def _reframe(self) -> None:
        """Adopt the transform's new frame and re-express the window in it (the engine rebuilds from the points)."""
        scale, offset = self.transform.reframe()
        old = self.engine_
        if old is None or old.n_points == 0:
            return
        self.engine_ = _rebuilt(old, old.epsilon, old.points * scale + offset)

    def _rescaled(self, engine: MMHM) -> MMHM:
        """Streaming: the engine at a new ε when the window's mean degree left `DEGREE_BAND` (else as is).

        Only for a calibrated ε (not a fixed ``index.epsilon``) and a check whose newest points are not collapsed:
        a collapse keeps the scale it is measured at.
        """
        if self.settings.index.epsilon is not None or not _degree_left_band(engine):
            return engine
        epsilon = calibrate_epsilon(engine.points, self.settings.index, self.settings.seed, size=engine.window)
        self.epsilon_, self.engine_ = epsilon, _rebuilt(engine, epsilon, engine.points)
        self.rescales_ += 1
        return self.engine_

    def _empty_window(self) -> None:
        """Forget the batches since the last check and, streaming, the window's points (ε and the window's size stay).

        After a rollback: they came from the abandoned steps.
        """
        self._recent.clear()
        if self.streaming and self.engine_ is not None:
            self.engine_ = MMHM(epsilon=self.engine_.epsilon, window=self.engine_.window)


class CheckPipeline(StreamingWindow, Stateful):
    """Everything a check depends on from one check to the next, and the evaluation itself.

    Args:
        settings: the monitor's settings.

    Examples:
        >>> import numpy as np
        >>> pipeline = CheckPipeline(MonitorSettings())
        >>> pipeline.evaluate(np.random.default_rng(0).normal(size=(64, 8)), step=0).record.status
        'ok'
    """

    _state = StateFields(
        version=4,
        fields={
            "epsilon": "epsilon_",
            "transform": "transform",
            "policy": "policy",
            "diagrams": "last_diagrams",
            "reference_diagrams": "reference_diagrams",
            "engine": "_engine_state",
            "checks": "checks_evaluated_",
            "stream_diverged": "stream_diverged_",
            "rescales": "rescales_",
            "silent": "silent",
        },
        encode={"diagrams": diagrams_to_lists, "reference_diagrams": diagrams_to_lists},
        decode={"diagrams": diagrams_from_lists, "reference_diagrams": diagrams_from_lists},
    )

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        self.streaming = settings.schedule.mode == "stream"  #: whether the pipeline watches a streaming window
        self.policy = Policy(settings.rule)
        self.transform = FeatureTransform(
            settings.transform, streaming=self.streaming, seed=settings.seed, window=settings.schedule.window
        )
        self.epsilon_: float | None = settings.index.epsilon
        self.engine_: MMHM | None = None
        self._engine_saved: dict[str, Any] | None = None  # a loaded engine state, until the engine exists again
        #: The last check's persistence diagrams (H0, H1; those diagram drift compares), or None before it.
        self.last_diagrams: Diagrams | None = None
        #: What the next check's drift is measured against: the diagrams of the last check that was not flagged
        #: (index, collapse or divergence). Diagram drift is the smaller of the distances to the last check's diagrams
        #: and to these: a one-off excursion is not flagged again when the features come back, and a run that moved
        #: on after a marginal alarm is not measured against a frozen past.
        self.reference_diagrams: Diagrams | None = None
        self.checks_evaluated_ = 0
        self.stream_diverged_ = False  # streaming: a batch with NaN or Inf arrived since the last check
        #: Streaming: how many times ε was recalibrated because a healthy window left DEGREE_BAND.
        self.rescales_ = 0
        self._recent = RecentBatches()  # streaming: the projected batches since the last check
        #: The silent path (probe mode, when on): its family's watch (`silent.watch_for`).
        self.silent = watch_for(settings.silent) if settings.silent.enabled and not self.streaming else None

    # --- evaluation ---------------------------------------------------------------------------------------

    def rewind(self, diagrams: Diagrams | None) -> None:
        """After a rollback: measure drift against ``diagrams`` (the snapshot's) and empty a streaming window.

        The window's points came from the abandoned steps.
        """
        self.reference_diagrams = self.last_diagrams = diagrams
        self._empty_window()

    def evaluate(self, features: Any, step: int, dynamics: Mapping[str, float | None] | None = None) -> Evaluation:
        """Probe mode: evaluate one check of features ``(n, d)``.

        NaN or Inf features give a ``"diverged"`` record and the policy's ``on_diverged`` action. ``dynamics``
        holds the training channels since the last check (``{"loss": ..., "grad_norm": ...}``).

        Raises:
            InputError: features of the wrong shape, or whose dimension changed since the first check.
        """
        start = time.perf_counter()
        raw = _as_cloud(features)
        if raw is None:
            return self._diverged(step, start, dynamics)
        projected = self.transform.project(raw)
        cloud = self.transform.normalise(projected)
        engine = self._engine(cloud)
        betti = engine._update(cloud)
        sentinels = sentinel_values([projected], projected, cloud, self.epsilon_)
        return self._measure(cloud, (betti.b0, betti.b1), step, start, engine, dynamics, sentinels, raw)

    def evaluate_window(self, step: int, dynamics: Mapping[str, float | None] | None = None) -> Evaluation:
        """Streaming mode: evaluate the window (the record is None while it holds fewer than 2 points)."""
        start = time.perf_counter()
        if self.stream_diverged_:
            self.stream_diverged_ = False
            return self._diverged(step, start, dynamics)
        engine = self.engine_
        if engine is None or engine.n_points < 2:
            return Evaluation(None)
        sentinels = self._recent.take_sentinels(self.epsilon_, self.transform)
        if sentinels is None or not sentinels.holding:
            engine = self._rescaled(engine)
        betti = engine.betti_numbers()
        return self._measure(engine.points, (betti.b0, betti.b1), step, start, engine, dynamics, sentinels)

    # --- internals ----------------------------------------------------------------------------------------

    def _engine(self, cloud: NDArray[np.float64]) -> MMHM:
        """The engine, created at the first check once ε is calibrated on its (transformed) cloud."""
        if self.engine_ is None:
            window = _stream_window(self.settings, cloud.shape[1])
            if self.epsilon_ is None:
                if cloud.shape[0] < 2:
                    raise InputError("ε calibration needs at least 2 points in the first check or batch")
                # Streaming: the points that will fill the window, the degree aimed at for a full window.
                sample = cloud if window is None else cloud[-window:]
                self.epsilon_ = calibrate_epsilon(sample, self.settings.index, self.settings.seed, size=window)
            self.engine_ = MMHM(epsilon=self.epsilon_, window=window)
            if self._engine_saved is not None:
                self.engine_.load_state_dict(self._engine_saved)
                self._engine_saved = None
        return self.engine_

    def _measure(
        self,
        cloud: NDArray[np.float64],
        betti: tuple[int, int],
        step: int,
        start: float,
        engine: MMHM,
        dynamics: Mapping[str, float | None] | None,
        sentinels: SentinelValues | None = None,
        raw: NDArray[np.float64] | None = None,
    ) -> Evaluation:
        s = self.settings
        if self.epsilon_ is None:  # pragma: no cover - the engine exists, so ε was calibrated
            raise RuntimeError("the pipeline evaluated a cloud before calibrating ε")
        alternative = None if self.reference_diagrams is self.last_diagrams else self.reference_diagrams
        found = measure(
            cloud,
            self.epsilon_,
            s.index,
            previous=self.last_diagrams,
            alternative=alternative,
            betti=betti,
            seed=s.seed,
        )
        self.last_diagrams = found.diagrams
        value = found.index_value
        loss, grad_norm = _channels(dynamics)
        oriented = None if value is None else ORIENTATION[s.index.name] * value
        collapsed = None if sentinels is None else sentinels.describe() or None
        decision = self.policy.decide(step, oriented, loss=loss, grad_norm=grad_norm, collapsed=collapsed)
        if not {"index", "diverged", "collapse"} & set(decision.flagged):  # a loss alarm leaves it as it is
            self.reference_diagrams = found.diagrams
        decision = self.silent.judge(decision, raw, found.diagrams) if self.silent else decision
        self.checks_evaluated_ += 1
        record = CheckRecord(
            step=step,
            status="ok",
            index=s.index.name,
            index_value=value,
            decision=decision,
            check_ms=(time.perf_counter() - start) * 1e3,
            report=found.report,
            sentinels=sentinels,
            loss=loss,
            grad_norm=grad_norm,
            **_engine_fields(engine, int(cloud.shape[0])),
        )
        return Evaluation(record, _due_figures(s, cloud, self.checks_evaluated_))

    def _diverged(self, step: int, start: float, dynamics: Mapping[str, float | None] | None) -> Evaluation:
        loss, grad_norm = _channels(dynamics)
        decision = self.policy.decide(step, None, diverged=True, loss=loss, grad_norm=grad_norm)
        decision = self.silent.judge(decision, None, None) if self.silent else decision
        self.checks_evaluated_ += 1
        elapsed = (time.perf_counter() - start) * 1e3
        record = CheckRecord(step=step, status="diverged", index=self.settings.index.name, index_value=None,
                             decision=decision, check_ms=elapsed, loss=loss, grad_norm=grad_norm)  # fmt: skip
        return Evaluation(record)

    # --- state --------------------------------------------------------------------------------------------

    def share(self) -> dict[str, Any]:
        """The state another copy needs to continue from this one (all of it but the engine's points)."""
        return self.state_dict()

    def receive(self, shared: Mapping[str, Any]) -> None:
        """Adopt `share` from another copy (the worker's, or rank 0's)."""
        self.load_state_dict(shared)

    @property
    def _engine_state(self) -> dict[str, Any] | None:
        # The complex is rebuilt exactly from the next check's points: a marker and the cost model, not the points.
        return self._engine_saved if self.engine_ is None else self.engine_.state_dict(include_points=False)

    @_engine_state.setter
    def _engine_state(self, value: Mapping[str, Any] | None) -> None:
        self.engine_ = None
        self._engine_saved = None if value is None else dict(value)


class LayeredPipeline(Stateful):
    """Several watched layers: one `CheckPipeline` per layer, and the policy's rule over them.

    Each layer has its own ε, transform, index and history; its records name it (``CheckRecord.layer``). The
    first layer of the first check is the *primary* one (the monitor puts the preset's or the user's ``layer``
    first). With ``policy.layer_rule`` ``"primary"`` the policy is the primary layer's own, exactly as if it were
    watched alone, and the other layers are judged by the same rule without acting (their decisions say whether it
    held). With ``"any"``, ``"all"`` or a number k, every layer is judged by the rule on its own history, and one
    policy decides on the number of layers where it holds (at least k: cooldown, escalation and the learning-rate
    cut budget are counted once per check, not per layer). The check's decision is on the primary layer's record.

    Args:
        settings: the monitor's settings (``probe.layers`` set).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> pipeline = LayeredPipeline(MonitorSettings().merged({"layers": ["a", "b"]}))
        >>> evaluation = pipeline.evaluate({"a": rng.normal(size=(40, 4)), "b": rng.normal(size=(40, 6))}, step=0)
        >>> evaluation.record.layer, [record.layer for record in evaluation.others]
        ('a', ['b'])
    """

    _state = StateFields(version=1, fields={"layers": "_layer_state", "policy": "policy"})

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        rule = settings.rule
        self.layer_rule = rule.layer_rule
        #: The layers' pipelines, the primary layer first (created at the first check, or by a loaded state).
        self.pipelines: dict[str, CheckPipeline] = {}
        counting = rule.replace(
            score="value", threshold=1.0, patience=1, warmup=0, trend_window=None, trend_slope=None,
            channels=("index",), require=1,
        )  # fmt: skip
        #: The policy that decides: the primary layer's own, or one over the number of layers where the rule holds.
        self.policy = Policy(rule if self.layer_rule == "primary" else counting)

    @property
    def layers(self) -> list[str]:
        """The watched layers' names, the primary one first (empty before the first check)."""
        return list(self.pipelines)

    @property
    def primary(self) -> str | None:
        """The primary layer's name (None before the first check)."""
        return next(iter(self.pipelines), None)

    def required(self, n_layers: int) -> int:
        """How many layers the rule must hold on for the check to act (``layer_rule`` "any": 1, "all": all).

        Raises:
            InputError: a number of layers larger than the number watched.
        """
        rule = self.layer_rule
        if rule == "all":
            return n_layers
        k = 1 if rule in ("any", "primary") else int(rule)
        if k > n_layers:
            raise InputError(
                f"`policy.layer_rule` is {k}, but {n_layers} layers are watched; it must be at most {n_layers}"
            )
        return k

    def _create(self, names: Sequence[str]) -> None:
        rule = self.settings.rule
        observing = rule.replace(action="none", on_diverged="none")
        quiet = dataclasses.replace(self.settings.silent, enabled=False)
        for i, name in enumerate(names):
            acting = i == 0 and self.layer_rule == "primary"
            # The silent path watches the primary layer only (its warning is the check's, like the decision).
            silent = self.settings.silent if i == 0 else quiet
            pipeline = CheckPipeline(dataclasses.replace(self.settings, policy=rule if acting else observing,
                                                         silent=silent))  # fmt: skip
            if acting:
                pipeline.policy = self.policy  # the primary layer's policy is the one that decides
            self.pipelines[name] = pipeline
        self.required(len(names))

    def _cloud_of(self, features: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(features, Mapping) or not features:
            raise InputError(
                f"several layers are watched: pass the features as a mapping {{layer: (n, d) array}}, got "
                f"{type(features).__name__}"
            )
        names = [str(name) for name in features]
        if not self.pipelines:
            if len(names) < 2:
                raise InputError(f"`layers` must resolve to at least 2 layers to watch several, got {names}")
            self._create(names)
        elif set(names) != set(self.pipelines):
            raise InputError(f"the features are of layers {names}, but this monitor watches {self.layers}")
        return {name: features[name] for name in self.pipelines}

    # --- evaluation ---------------------------------------------------------------------------------------

    def evaluate(
        self, features: Mapping[str, Any], step: int, dynamics: Mapping[str, float | None] | None = None
    ) -> Evaluation:
        """Evaluate one check of every layer's features ``{layer: (n, d_layer)}``; the primary layer's first.

        Raises:
            InputError: not a mapping, other layers than the first check's, or features of the wrong shape.
        """
        clouds = self._cloud_of(features)
        evaluations = {name: self.pipelines[name].evaluate(cloud, step, dynamics) for name, cloud in clouds.items()}
        records = {}
        for name, evaluation in evaluations.items():
            if evaluation.record is None:  # pragma: no cover - a probe check always has a record
                raise RuntimeError(f"layer {name!r} gave no record at step {step}")
            records[name] = dataclasses.replace(evaluation.record, layer=name)
        primary = next(iter(records))
        if self.layer_rule != "primary":
            own, combined = records[primary].decision, self._decide(records, step, dynamics)
            silent = own.rule == "silent" and combined.action is Action.NONE  # the rule is quiet, the silent path not
            records[primary] = dataclasses.replace(records[primary], decision=own if silent else combined)
        first = records.pop(primary)
        figures = evaluations[primary].figures
        return Evaluation(record=first, figures=figures, others=list(records.values()))

    def _decide(self, records: Mapping[str, CheckRecord], step: int, dynamics: Any) -> Decision:
        """The check's decision under ``layer_rule`` "any", "all" or k, from each layer's own verdict."""
        holding = {name: r.decision for name, r in records.items() if r.decision.rule not in (None, "silent")}
        k = self.required(len(records))
        diverged = any(d.rule == "diverged" for d in holding.values())
        loss, grad_norm = _channels(dynamics)
        counted = self.policy.decide(step, float(len(holding)) / k, diverged=diverged, loss=loss, grad_norm=grad_norm)
        flagged = tuple(sorted({f for d in (counted, *holding.values()) for f in d.flagged}))
        which = ", ".join(holding) or "none"
        head = f"the rule holds on {len(holding)} of {len(records)} layers ({which}; layer_rule {self.layer_rule!r})"
        if not holding:
            return dataclasses.replace(counted, reason=head, flagged=flagged, value=None, score=None)
        first = next(iter(holding.values()))
        why = "; ".join(f"{name}: {d.reason.removesuffix(' (action: none)')}" for name, d in holding.items())
        # The counting policy's own words end with what it did (a cut, an escalation, a cooldown): keep those.
        tail = counted.reason.split("consecutive checks", 1)[1] if "consecutive checks" in counted.reason else ""
        if counted.rule == "diverged":
            tail = f"; {counted.reason}"
        if len(holding) < k:
            tail = f" ({k} required)"
        onsets = [d.onset for d in holding.values() if d.onset is not None]
        return dataclasses.replace(
            counted,
            reason=f"{head}: {why}{tail}",
            value=first.value,
            score=first.score,
            rule=counted.rule if counted.rule is None or counted.rule == "diverged" else first.rule,
            flagged=flagged,
            onset=min(onsets) if onsets and counted.fired else counted.onset,
        )

    # --- what the monitor asks of a pipeline -------------------------------------------------------------

    @property
    def epsilon_(self) -> float | None:
        """The primary layer's ε (None before the first check)."""
        primary = self.primary
        return None if primary is None else self.pipelines[primary].epsilon_

    @property
    def last_diagrams(self) -> Diagrams | None:
        """The primary layer's last diagrams."""
        primary = self.primary
        return None if primary is None else self.pipelines[primary].last_diagrams

    @property
    def reference_diagrams(self) -> dict[str, Diagrams | None]:
        """Each layer's reference diagrams (a rollback snapshot keeps them all)."""
        return {name: pipeline.reference_diagrams for name, pipeline in self.pipelines.items()}

    def rewind(self, diagrams: Mapping[str, Diagrams | None] | None) -> None:
        """After a rollback: every layer measures drift against its diagrams of the snapshot."""
        for name, pipeline in self.pipelines.items():
            pipeline.rewind(None if diagrams is None else diagrams.get(name))

    def share(self) -> dict[str, Any]:
        """The state another copy needs to continue from this one."""
        return self.state_dict()

    def receive(self, shared: Mapping[str, Any]) -> None:
        """Adopt `share` from another copy."""
        self.load_state_dict(shared)

    @property
    def _layer_state(self) -> dict[str, Any]:
        return {"names": self.layers, "states": {name: p.state_dict() for name, p in self.pipelines.items()}}

    @_layer_state.setter
    def _layer_state(self, value: Mapping[str, Any]) -> None:
        names = list(value["names"])
        if self.pipelines and names and names != self.layers:
            raise InputError(f"the saved state watched layers {names}, this monitor watches {self.layers}")
        if not self.pipelines and names:
            self._create(names)
        for name in names:
            self.pipelines[name].load_state_dict(value["states"][name])


def make_pipeline(settings: MonitorSettings) -> CheckPipeline | LayeredPipeline:
    """The pipeline ``settings`` call for: one layer's, or several layers' (``probe.layers``).

    The checks' one-off costs start being paid in the background (`check.prepare_in_background`).
    """
    prepare_in_background()
    return CheckPipeline(settings) if settings.probe.layers is None else LayeredPipeline(settings)
