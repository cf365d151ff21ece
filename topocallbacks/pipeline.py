"""The stateful evaluation of checks: features -> transform -> ε -> MMHM -> measure -> policy -> a record.

:class:`CheckPipeline` imports no torch and pickles, so the same object runs in the training process (synchronous
mode) or in the background worker (:mod:`topocallbacks._worker`); :class:`~topocallbacks.TopoMonitor` keeps a
mirror of its state from what each result carries (:meth:`CheckPipeline.share`), exactly as a distributed rank
adopts rank 0's state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from ._validation import as_points
from .check import ORIENTATION, CheckRecord, measure
from .exceptions import InputError, NonFiniteError
from .functional.collapse import calibrate_epsilon
from .functional.topology import _persistence_diagrams, _subsample
from .mmhm import MMHM
from .policy import Policy
from .settings import MonitorSettings
from .transform import FeatureTransform

__all__ = ["CheckPipeline", "Evaluation"]

Diagrams = list[NDArray[np.float64]]


def _diagrams_to_lists(diagrams: Diagrams | None) -> Any:
    return None if diagrams is None else [d.tolist() for d in diagrams]


def _diagrams_from_lists(saved: Any) -> Diagrams | None:
    return None if saved is None else [np.asarray(d, dtype=np.float64).reshape(-1, 2) for d in saved]


def _channels(dynamics: Mapping[str, float | None] | None) -> tuple[float | None, float | None]:
    """The training channels' values (loss, gradient norm) since the last check, or None each."""
    dynamics = dynamics or {}
    return dynamics.get("loss"), dynamics.get("grad_norm")


def _density(edges: int, n: int) -> float:
    return edges / (n * (n - 1) / 2) if n > 1 else 0.0


class Evaluation:
    """What one evaluation produced.

    The record (None: a streaming window too small to check), the pipeline's state after it
    (:meth:`CheckPipeline.share`), and the diagrams of a TensorBoard figure when one is due.
    """

    __slots__ = ("figures", "record", "shared")

    def __init__(self, record: CheckRecord | None, shared: dict[str, Any], figures: Diagrams | None = None) -> None:
        self.record = record
        self.shared = shared
        self.figures = figures


class CheckPipeline(Stateful):
    """Everything a check depends on from one check to the next, and the evaluation itself.

    Args:
        settings: the monitor's settings.

    Example:
        >>> import numpy as np
        >>> pipeline = CheckPipeline(MonitorSettings())
        >>> pipeline.evaluate(np.random.default_rng(0).normal(size=(64, 8)), step=0).record.status
        'ok'
    """

    _state = StateFields(
        version=2,
        fields={
            "epsilon": "epsilon_",
            "transform": "transform",
            "policy": "policy",
            "diagrams": "_diagrams",
            "reference_diagrams": "_reference",
            "engine": "_engine_state",
            "checks": "checks_",
            "stream_diverged": "stream_diverged_",
        },
        encode={"diagrams": _diagrams_to_lists, "reference_diagrams": _diagrams_to_lists},
        decode={"diagrams": _diagrams_from_lists, "reference_diagrams": _diagrams_from_lists},
    )

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        self.policy = Policy(settings.rule)
        self.transform = FeatureTransform(
            settings.transform, streaming=self.streaming, seed=settings.seed, window=settings.schedule.window
        )
        self.epsilon_: float | None = settings.index.epsilon
        self.engine_: MMHM | None = None
        self._engine_saved: dict[str, Any] | None = None  # a loaded engine state, until the engine exists again
        self._diagrams: Diagrams | None = None  # the last check's
        # The last check whose index stayed below its threshold: diagram drift is measured against them, so a
        # collapse that persists keeps its drift high instead of reading 0 once the features stop moving.
        self._reference: Diagrams | None = None
        self.checks_ = 0
        self.stream_diverged_ = False  # streaming: a batch with NaN or Inf arrived since the last check

    @property
    def streaming(self) -> bool:
        """Whether the pipeline watches a streaming window."""
        return self.settings.schedule.mode == "stream"

    # --- evaluation ---------------------------------------------------------------------------------------

    @property
    def last_diagrams(self) -> Diagrams | None:
        """The last check's persistence diagrams (H0, H1; those diagram drift compares), or None before it."""
        return self._diagrams

    @property
    def reference_diagrams(self) -> Diagrams | None:
        """What the next check's drift is measured against: the last check's whose index was not flagged."""
        return self._reference

    def rewind(self, diagrams: Diagrams | None) -> None:
        """After a rollback: measure drift against ``diagrams`` (the snapshot's) and empty a streaming window.

        The window's points came from the abandoned steps.
        """
        self._reference = diagrams
        if self.streaming and self.engine_ is not None:
            self.engine_ = MMHM(epsilon=self.engine_.epsilon, window=self.engine_.window)

    def evaluate(self, features: Any, step: int, dynamics: Mapping[str, float | None] | None = None) -> Evaluation:
        """Probe mode: evaluate one check of features ``(n, d)``.

        NaN or Inf features give a ``"diverged"`` record and the policy's ``on_diverged`` action. ``dynamics``
        holds the training channels since the last check (``{"loss": ..., "grad_norm": ...}``).

        Raises:
            InputError: features of the wrong shape, or whose dimension changed since the first check.
        """
        start = time.perf_counter()
        cloud = self._as_cloud(features)
        if cloud is None:
            return self._diverged(step, start, dynamics)
        cloud = self.transform(cloud)
        engine = self._engine(cloud)
        betti = engine._update(cloud)
        return self._measure(cloud, (betti.b0, betti.b1), step, start, engine, dynamics)

    def push(self, batches: Sequence[tuple[int, Any]]) -> None:
        """Streaming mode: add training batches' features ``[(step, (b, d)), ...]`` to the window, oldest first.

        Each batch keeps a seeded subset of at most ``points_per_batch`` rows (the training adapters' capture keeps
        it already); a batch with NaN or Inf is left out and makes the next check a diverged one. The batches go
        into the window in one push: the window ends up with the same points as after one push per batch.
        """
        clouds: list[NDArray[np.float64]] = []
        limit = self.settings.schedule.points_per_batch
        for step, features in batches:
            cloud = self._as_cloud(features, min_samples=1)
            if cloud is None:
                self.stream_diverged_ = True
                continue
            if limit is not None and cloud.shape[0] > limit:
                rows = np.random.default_rng((self.settings.seed, step)).choice(cloud.shape[0], limit, replace=False)
                cloud = cloud[np.sort(rows)]
            if self.transform.track(cloud):  # the features drifted out of the frame: re-express the window
                self._push_clouds(clouds)
                clouds = []
                self._reframe()
            clouds.append(self.transform(cloud))
        self._push_clouds(clouds)

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
        engine = MMHM(epsilon=old.epsilon, window=old.window)
        engine.cost_model = old.cost_model  # what it learned about this machine carries over
        engine._push_batch(old.points * scale + offset)
        self.engine_ = engine

    def evaluate_window(self, step: int, dynamics: Mapping[str, float | None] | None = None) -> Evaluation:
        """Streaming mode: evaluate the window (the record is None while it holds fewer than 2 points)."""
        start = time.perf_counter()
        if self.stream_diverged_:
            self.stream_diverged_ = False
            return self._diverged(step, start, dynamics)
        engine = self.engine_
        if engine is None or engine.n_points < 2:
            return Evaluation(None, self.share())
        betti = engine.betti_numbers()
        return self._measure(engine.points, (betti.b0, betti.b1), step, start, engine, dynamics)

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
            self.engine_ = MMHM(epsilon=self.epsilon_, window=self._window(cloud.shape[1]))
            if self._engine_saved is not None:
                self.engine_.load_state_dict(self._engine_saved)
                self._engine_saved = None
        return self.engine_

    def _window(self, dim: int) -> int | None:
        """Streaming: the window, capped so that a check of it fits ``check_budget_ms`` (None in probe mode)."""
        if not self.streaming:
            return None
        schedule = self.settings.schedule
        affordable = MMHM(epsilon=1.0).largest_n_within(schedule.check_budget_ms / 1e3, dim)
        return max(2, min(schedule.window, affordable))

    def _measure(
        self,
        cloud: NDArray[np.float64],
        betti: tuple[int, int],
        step: int,
        start: float,
        engine: MMHM,
        dynamics: Mapping[str, float | None] | None,
    ) -> Evaluation:
        s = self.settings
        if self.epsilon_ is None:  # pragma: no cover - the engine exists, so ε was calibrated
            raise RuntimeError("the pipeline evaluated a cloud before calibrating ε")
        found = measure(cloud, self.epsilon_, s.index, previous=self._reference, betti=betti, seed=s.seed)
        self._diagrams = found.diagrams
        value = found.index_value
        loss, grad_norm = _channels(dynamics)
        oriented = None if value is None else ORIENTATION[s.index.name] * value
        decision = self.policy.decide(step, oriented, loss=loss, grad_norm=grad_norm)
        if not {"index", "diverged"} & set(decision.flagged):  # a loss or gradient alarm leaves the features' reference
            self._reference = found.diagrams
        self.checks_ += 1
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
            window=engine.window,
            density=_density(engine.n_edges, int(cloud.shape[0])),
        )
        figures = None  # full (unthresholded) diagrams for a TensorBoard figure, when one is due
        output = s.output
        if output.tensorboard_dir is not None and output.diagram_every and self.checks_ % output.diagram_every == 0:
            figures = _persistence_diagrams(_subsample(cloud, s.index.max_points, s.seed), 1, None)
        return Evaluation(record, self.share(), figures)

    def _diverged(self, step: int, start: float, dynamics: Mapping[str, float | None] | None) -> Evaluation:
        loss, grad_norm = _channels(dynamics)
        decision = self.policy.decide(step, None, diverged=True, loss=loss, grad_norm=grad_norm)
        self.checks_ += 1
        elapsed = (time.perf_counter() - start) * 1e3
        record = CheckRecord(step, "diverged", self.settings.index.name, None, decision, elapsed)
        return Evaluation(record, self.share())

    # --- state --------------------------------------------------------------------------------------------

    def share(self) -> dict[str, Any]:
        """The state another copy needs to continue from this one (all of it but the engine's points)."""
        return self.state_dict()

    def receive(self, shared: Mapping[str, Any]) -> None:
        """Adopt :meth:`share` from another copy (the worker's, or rank 0's)."""
        self.load_state_dict(shared)

    @property
    def _engine_state(self) -> dict[str, Any] | None:
        # The complex is rebuilt exactly from the next check's points: a marker and the cost model, not the points.
        return self._engine_saved if self.engine_ is None else self.engine_.state_dict(include_points=False)

    @_engine_state.setter
    def _engine_state(self, value: Mapping[str, Any] | None) -> None:
        self.engine_ = None
        self._engine_saved = None if value is None else dict(value)
