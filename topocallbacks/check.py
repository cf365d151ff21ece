"""One check: a transformed cloud becomes the Collapse Index, the watched index, and a typed record.

`measure` is the one function that computes what a check measures; [`TopoMonitor`][topocallbacks.TopoMonitor] and
the collapse-evidence suite (``benchmarks/collapse/signals.py``) both call it, so the suite measures what ships.
Records are typed (`CheckRecord`, `InterventionRecord`); ``as_dict`` turns them into the JSON the
history file, the loggers and the distributed broadcast carry.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from .functional import _jit
from .functional.collapse import CollapseReport, _collapse_index
from .functional.geometry import _effective_rank
from .functional.indices import _diagram_distance
from .functional.sentinels import SentinelValues
from .mmhm import UpdateStats
from .policy import Decision
from .settings import INDEX_NAMES, PLAN_KEYS, IndexSettings, resolve_weights

__all__ = [
    "ORIENTATION",
    "CheckRecord",
    "InterventionRecord",
    "Measurement",
    "Plan",
    "diagram_drift",
    "diagrams_from_lists",
    "diagrams_to_lists",
    "measure",
    "prepare",
    "prepare_in_background",
    "record_from_dict",
]

_log = logging.getLogger(__name__)
_preparing: threading.Thread | None = None

Diagrams = list[NDArray[np.float64]]

#: Each index's orientation: +1 when collapse raises it, -1 when it lowers it (the policy sees ``orientation x
#: value``, so that higher always means more collapsed).
ORIENTATION: Mapping[str, int] = {"diagram_drift": 1, "paper": 1, "rankme": -1}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What `measure` found in one cloud.

    Attributes:
        report: the Collapse Index and its components.
        index_value: the watched index (None for diagram drift at the first check: nothing to drift from).
        diagrams: the finite H0 and H1 bars of the diagram subsample, for the next check's drift.
        values: every index computed (the watched one and those asked for with ``also``), by name.
        drift: the Wasserstein-1 distance to the previous diagrams, per dimension (None at the first check, or
            when the drift was not computed).
    """

    report: CollapseReport
    index_value: float | None
    diagrams: Diagrams
    values: Mapping[str, float | None]
    drift: tuple[float, ...] | None = None


def _drift(
    previous: Diagrams | None, diagrams: Diagrams, alternative: Diagrams | None = None
) -> tuple[float, ...] | None:
    """The per-dimension distances to ``previous``, or to ``alternative`` when their total is smaller."""
    drifts = [
        tuple(_diagram_distance(a, b) for a, b in zip(reference, diagrams, strict=True))
        for reference in (previous, alternative)
        if reference is not None
    ]
    return min(drifts, key=sum) if drifts else None


def diagrams_to_lists(diagrams: Diagrams | None) -> Any:
    """Diagrams as nested lists, for a saved state (None stays None)."""
    return None if diagrams is None else [d.tolist() for d in diagrams]


def diagrams_from_lists(saved: Any) -> Diagrams | None:
    """`diagrams_to_lists` undone: ``(k, 2)`` float64 arrays (None stays None)."""
    return None if saved is None else [np.asarray(d, dtype=np.float64).reshape(-1, 2) for d in saved]


def diagram_drift(reference: Diagrams, diagrams: Diagrams) -> float:
    """The diagram drift from ``reference`` to ``diagrams``, as the ``diagram_drift`` index measures it.

    Both are finite H0 and H1 diagrams (`Measurement.diagrams`); the drift is the sum of the per-dimension
    Wasserstein-1 distances.
    """
    found = _drift(reference, diagrams)
    return math.nan if found is None else float(sum(found))


_VALUES: dict[str, Callable[[NDArray[np.float64], CollapseReport, tuple[float, ...] | None], float | None]] = {
    "diagram_drift": lambda cloud, report, drift: None if drift is None else float(sum(drift)),
    "paper": lambda cloud, report, drift: report.ci,
    "rankme": lambda cloud, report, drift: _effective_rank(cloud),
}
if set(_VALUES) != set(INDEX_NAMES) or set(ORIENTATION) != set(INDEX_NAMES):  # pragma: no cover
    raise RuntimeError("every index named in topocallbacks.settings.INDEX_NAMES needs a value and an orientation")


def measure(
    cloud: NDArray[np.float64],
    epsilon: float,
    settings: IndexSettings,
    *,
    previous: Diagrams | None = None,
    alternative: Diagrams | None = None,
    betti: tuple[int, int] | None = None,
    seed: int = 0,
    also: tuple[str, ...] = (),
) -> Measurement:
    """The Collapse Index of a transformed, validated cloud at ``epsilon``, and the index ``settings.name``.

    Args:
        cloud: ``(n, d)`` float64 points, finite (the monitor validates and transforms them first).
        epsilon: the calibrated scale.
        settings: the index settings (weights, diagram subsample size, which index).
        previous: the previous check's `Measurement.diagrams` (for diagram drift), or None.
        alternative: other diagrams to measure the drift from (the monitor's last check that was not flagged): the
            drift is the smaller of the two.
        betti: ``(b0, b1)`` at ``epsilon`` if already known (the MMHM engine's), else computed from scratch.
        seed: seed of the diagram subsample.
        also: other indices to compute beside the watched one (by name, see
            `INDEX_NAMES`).
    """
    weights = resolve_weights(settings.weights)
    report, diagrams = _collapse_index(cloud, epsilon, weights, max_points=settings.max_points, seed=seed, betti=betti)
    finite = [d[np.isfinite(d[:, 1])] for d in diagrams]  # drift ignores the essential bars
    names = dict.fromkeys((settings.name, *also))
    drift = _drift(previous, finite, alternative) if "diagram_drift" in names else None
    values = {name: _VALUES[name](cloud, report, drift) for name in names}
    return Measurement(report=report, index_value=values[settings.name], diagrams=finite, values=values, drift=drift)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where and how often to check, and on how many probe samples.

    Attributes:
        intervals: configured intervals (``check_every`` steps) between checks, 1 to the budget's safety floor
            (`topocallbacks.budget.FLOOR_INTERVALS`).
        background: evaluate in the background worker.
        lag: steps between a background check and the step its decision is applied at (None: the settings'
            ``lag``); never more than the steps to the next check.
        probe_size: probe samples (None: the probe as given).
        predicted: the predicted share of the step time the monitor costs under this plan.
        met: whether the prediction is within the budget.
        at_step: the step of the check whose record made this plan (None: the configured schedule, no plan made).
            The budget plans once: from then on the run's checks, where their decisions apply and on how many
            samples do not depend on the machine's speed, and ``plan=`` with this plan's `settings` reruns them.
    """

    intervals: int = 1
    background: bool = False
    probe_size: int | None = None
    predicted: float = 0.0
    met: bool = True
    lag: int | None = None
    at_step: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)

    @property
    def settings(self) -> dict[str, Any]:
        """What ``plan=`` takes to follow this plan again (from the check of the same step, without measuring)."""
        return {k: getattr(self, k) for k in PLAN_KEYS}

    def describe(self) -> str:
        """The plan in words: "a check every 2 x check_every, in the background with decisions 15 steps later...".

        Examples:
            >>> print(Plan(intervals=2, background=True, lag=15, probe_size=128).describe())
            a check every 2 x check_every, in the background worker with decisions 15 steps later, on 128 probe samples
        """
        where = "in the training loop"
        if self.background:
            where = "in the background worker" + (f" with decisions {self.lag} steps later" if self.lag else "")
        size = f"{self.probe_size} probe samples" if self.probe_size else "the whole probe"
        return f"a check every {self.intervals} x check_every, {where}, on {size}"


@dataclasses.dataclass(frozen=True)
class CheckRecord:
    """Everything one check found and decided.

    Attributes:
        step: the training step whose features were checked.
        status: ``"ok"``, or ``"diverged"`` (NaN or Inf features: no index, the policy's ``on_diverged``).
        index: the watched index's name.
        index_value: its value (None: diverged, or no value yet).
        decision: the policy's decision.
        check_ms: wall time of the check, features given.
        report: the Collapse Index and its components (None when diverged).
        engine: what the MMHM engine did (None when diverged).
        n_points: points in the checked cloud (the probe, or the streaming window).
        applied_step: the step at which the decision was applied (``step`` in the training loop, ``step + lag`` in
            the background; None when training ended first).
        wait_ms: how long the training loop waited for this check's evaluation at ``applied_step`` (the whole
            evaluation in the training loop; only a late worker's remainder in the background).
        probe_ms: the training loop's time to take the features (the probe pass, or the streaming copy).
        window: streaming mode: the window's capacity (None in probe mode).
        layer: the watched layer's name when several layers are watched (None: the one layer).
        density: the share of point pairs joined at ε (0: every point isolated; 1: one clique).
        sentinels: the absolute collapse sentinels' values (None: a check without features, or a streaming check
            with no new batch).
        overhead: the share of the training step time the monitor cost the loop since the check before (None at
            the first check, before any step was timed).
        step_ms: a training step's own time over that interval (the monitor's time left out).
        plan: the overhead budget's plan from this check on (a `Plan`), when
            it changed at this check.
        loss: the mean training loss since the check before, as the rule saw it (None: none was passed).
        grad_norm: the mean gradient norm (before clipping) since the check before (None: none was passed).
    """

    kind: ClassVar[str] = "check"

    step: int
    status: str
    index: str
    index_value: float | None
    decision: Decision
    check_ms: float
    report: CollapseReport | None = None
    engine: UpdateStats | None = None
    n_points: int = 0
    applied_step: int | None = None
    wait_ms: float = 0.0
    probe_ms: float = 0.0
    window: int | None = None
    layer: str | None = None
    density: float | None = None
    sentinels: SentinelValues | None = None
    overhead: float | None = None
    step_ms: float | None = None
    plan: Plan | None = None
    loss: float | None = None
    grad_norm: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the features were finite and the index was computed."""
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (what the history file holds)."""
        return {
            "kind": self.kind,
            "step": self.step,
            "status": self.status,
            "index": self.index,
            "index_value": self.index_value,
            "check_ms": self.check_ms,
            "n_points": self.n_points,
            "applied_step": self.applied_step,
            "wait_ms": self.wait_ms,
            "probe_ms": self.probe_ms,
            "window": self.window,
            "layer": self.layer,
            "density": self.density,
            "sentinels": None if self.sentinels is None else self.sentinels.as_dict(),
            "overhead": self.overhead,
            "step_ms": self.step_ms,
            "plan": None if self.plan is None else self.plan.as_dict(),
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "decision": self.decision.as_dict(),
            "report": None if self.report is None else self.report.as_dict(),
            "engine": None if self.engine is None else self.engine.as_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckRecord:
        """The inverse of `as_dict`."""
        fields = {k: v for k, v in data.items() if k != "kind"}
        fields.setdefault("layer", None)
        fields.setdefault("density", None)
        fields.setdefault("overhead", None)
        fields.setdefault("step_ms", None)
        saved_plan = fields.get("plan")
        fields["plan"] = None if saved_plan is None else Plan(**saved_plan)
        fields.setdefault("loss", None)  # files written before the history kept the training channels
        fields.setdefault("grad_norm", None)
        saved = fields.get("sentinels")
        fields["sentinels"] = None if saved is None else SentinelValues.from_dict(saved)
        fields["decision"] = Decision.from_dict(data["decision"])
        fields["report"] = None if data["report"] is None else CollapseReport.from_dict(data["report"])
        fields["engine"] = None if data["engine"] is None else UpdateStats.from_dict(data["engine"])
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class InterventionRecord:
    """What was done about a decision, and why.

    Attributes:
        step: the training step at which it was done.
        action: the action taken (``"warn"``, ``"lower_lr"``, ``"stop"``).
        reason: the decision's reason.
        detail: what the adapter did (rates after a cut, where a checkpoint went, which snapshot a rollback
            restored and what it cost).
        lr_factor: the cumulative learning-rate factor after this intervention.
        snapshot_step: for a rollback, the step of the snapshot restored (None otherwise).
        steps_lost: for a rollback, the updates undone (``step - snapshot_step``; their batches are not seen
            again: training goes on with the next batch).
    """

    kind: ClassVar[str] = "intervention"

    step: int
    action: str
    reason: str
    detail: str
    lr_factor: float
    snapshot_step: int | None = None
    steps_lost: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InterventionRecord:
        """The inverse of `as_dict`."""
        return cls(**{k: v for k, v in data.items() if k != "kind"})


Record = CheckRecord | InterventionRecord


def record_from_dict(data: Mapping[str, Any]) -> Record:
    """A typed record from its JSON form (a line of the history file)."""
    kinds: dict[str, type[CheckRecord] | type[InterventionRecord]] = {
        "check": CheckRecord,
        "intervention": InterventionRecord,
    }
    return kinds[data["kind"]].from_dict(data)


def prepare() -> None:
    """Pay a check's one-off costs now, instead of in the first check.

    They are numba's import and the compiled kernels (loaded from numba's cache, or compiled on a machine's first
    run; skipped with ``TOPOCALLBACKS_NUMBA=0``) and the drift's assignment solver (`scipy.optimize`).
    """
    from scipy.optimize import linear_sum_assignment  # noqa: F401  (imported for its one-off cost)

    _jit.load()


def prepare_in_background() -> threading.Thread:
    """Run `prepare` in a daemon thread, once per process (later calls return the same thread).

    A monitor starts it when it is built, so that the one-off costs overlap the user's own set-up instead of the
    first check. A failure is logged at debug level and left to the first check, which meets it as before.
    """
    global _preparing
    if _preparing is None:
        _preparing = threading.Thread(target=_prepare_quietly, name="topocallbacks-prepare", daemon=True)
        _preparing.start()
    return _preparing


def _prepare_quietly() -> None:
    try:
        prepare()
    except Exception as error:  # a helper never takes training down: the first check meets the same error
        _log.debug("topocallbacks: preparing the checks in the background failed: %r", error)
