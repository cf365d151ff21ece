"""The silent path: a warning when the probe's representation drifts or degenerates while the loss says nothing.

The loud path (the policy) acts when the index and the training loss jump together; a collapse the loss does not
show (issue 36: a fine-tune that destroys general features, contrastive pairs gone wrong) never reaches it. This
part watches the probe's features themselves, as the silent suite's round 2 chose on its design split
(``benchmarks/silent/ROUND2.md``, stage 2; `SilentSettings` holds the settings):

* two drifts against the reference, the last warm-up check: the diagram drift (the H0 + H1 Wasserstein distances
  the index measures) and 1 - linear CKA of the raw features, each divided by the checks elapsed since the
  reference, each scored against its own trailing checks (`TrailingRule`: the rule's robust z-score, as
  `rule_scores` gives it) and alarming at ``threshold`` for ``patience`` consecutive checks;
* three absolute sentinels on the raw features: a rank squeeze (effective rank <= `RANK_SQUEEZE`), a cone (mean
  pairwise cosine >= `CONE`) and a shrinkage (RMS radius <= `SHRINK` x the warm-up's mean).

The geometry family, as rounds 4 and 5 chose it (``benchmarks/silent/ROUND5.md``, stage 2; `GeometryWatch`): the
embedding's spread, `norm_std`, top eigenvalue share, mean cosine and `modes`, each scored against the warm-up checks
(frozen there) in the direction a collapse moves it.

Both are judged after the warm-up only. An alarm turns a check the policy left alone into ``settings.silent.action``
(a warning by default) with a reason naming the signal and how far it moved; it is raised again only after a check
without one. The benchmark's replay (``benchmarks/silent/silent_signals.py``, ``round2.py``, ``round5.py``) computes
the same values with these functions; ``tests/unit/test_silent_path.py`` compares them check by check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._state import StateFields, Stateful
from .check import Diagrams, diagram_drift, diagrams_from_lists, diagrams_to_lists
from .functional import calibrate_epsilon, effective_rank
from .functional._distances import pairwise_distances
from .policy import Decision
from .policy.scores import Reference, at_threshold, rule_holds, score_value
from .settings import Action, IndexSettings, PolicySettings, SilentSettings

__all__ = [
    "CONE", "DRIFTS", "GEOMETRY", "MIN_MODE_SHARE", "MODES_DEGREE", "RANK_SQUEEZE", "SHRINK", "GeometryWatch",
    "SilentWatch", "TrailingRule", "frozen_scores", "linear_cka", "mean_cosine", "modes", "norm_std", "rms_radius",
    "top_eigenvalue_share", "watch_for",
]  # fmt: skip

#: The sentinels' limits (the silent suite's pre-registered values): effective rank, mean cosine, radius share.
RANK_SQUEEZE = 1.5
CONE = 0.95
SHRINK = 0.1
#: The drifts, by the names the history and the loggers give them.
DRIFTS = ("diagram_drift_ref", "cka_drift")
#: The geometry family's signals and the way a collapse moves each (+1: up, -1: down).
GEOMETRY: dict[str, int] = {"spread": -1, "norm_std": -1, "anisotropy": 1, "mean_cosine": 1, "modes": -1}
#: The mode counter's scale: the ε of a mean degree of 32 at the last warm-up check (6 % of a 512-point probe, so
#: that a mode's points connect); clusters holding less than `MIN_MODE_SHARE` of the probe are not modes.
MODES_DEGREE = 32.0
MIN_MODE_SHARE = 0.01


def rms_radius(frame: NDArray[np.float64]) -> float:
    """The root-mean-square distance of the rows from their mean."""
    centred = frame - frame.mean(0)
    return float(np.sqrt((centred**2).sum(1).mean()))


def mean_cosine(frame: NDArray[np.float64]) -> float:
    """The mean cosine over distinct pairs of rows (near 1: a cone)."""
    unit = frame / np.maximum(np.linalg.norm(frame, axis=1, keepdims=True), 1e-12)
    n = unit.shape[0]
    total = float(np.square(unit.sum(0)).sum())
    return float((total - float(np.square(unit).sum())) / (n * (n - 1)))


def norm_std(frame: NDArray[np.float64]) -> float:
    """Lightly's collapse level: the mean per-dimension std of the L2-normalised rows, times sqrt(dim).

    1: spread over the sphere; 0: one direction.
    """
    norms = np.linalg.norm(frame, axis=1, keepdims=True)
    unit = frame / np.maximum(norms, 1e-12)
    return float(unit.std(0).mean() * math.sqrt(frame.shape[1]))


def top_eigenvalue_share(frame: NDArray[np.float64]) -> float:
    """The covariance's top eigenvalue over its trace.

    The geometry family's ``anisotropy`` signal (not `topocallbacks.functional.anisotropy`, which is scaled from the
    effective rank).
    """
    values = np.linalg.eigvalsh(np.cov(frame, rowvar=False).reshape(frame.shape[1], frame.shape[1]))
    total = float(values.sum())
    return float(values[-1] / total) if total > 0 else 1.0


def modes(cloud: NDArray[np.float64], epsilon: float, min_share: float = MIN_MODE_SHARE) -> int:
    """Connected components of the ε-neighbourhood graph holding at least ``min_share`` of the points.

    Betti-0 at ε, clusters too small to be a mode left out.

    Examples:
        >>> import numpy as np
        >>> two = np.r_[np.zeros((100, 2)), np.ones((99, 2)) * 10, [[50.0, 50.0]]]  # two modes, one stray point
        >>> modes(two, epsilon=1.0)
        2
    """
    from scipy.sparse.csgraph import connected_components

    adjacency = pairwise_distances(cloud) <= epsilon
    _, labels = connected_components(adjacency, directed=False)
    sizes = np.bincount(labels)
    return int((sizes >= max(1, math.ceil(min_share * cloud.shape[0]))).sum())


def frozen_scores(values: NDArray[np.float64], direction: int, warmup: int) -> NDArray[np.float64]:
    """The robust z-score of each value against the first ``warmup`` values, frozen there.

    In ``direction`` (+1: a rise counts, -1: a fall): ``(value - median) / max(1.4826 MAD, 1 % of the largest,
    1e-12)``; NaN during the warm-up and where the warm-up has no finite value.

    Examples:
        >>> frozen_scores(np.array([1.0, 1.1, 0.9, 1.0, 0.5]), direction=-1, warmup=4).round(2).tolist()
        [nan, nan, nan, nan, 6.74]
    """
    oriented = direction * np.asarray(values, dtype=np.float64)
    warm = oriented[:warmup][np.isfinite(oriented[:warmup])]
    scores = np.full(oriented.size, math.nan)
    if warm.size == 0:
        return scores
    centre = float(np.median(warm))
    spread = 1.4826 * float(np.median(np.abs(warm - centre)))
    floor = 0.01 * float(np.max(np.abs(warm)))
    scale = max(spread, floor, 1e-12)
    scores[warmup:] = (oriented[warmup:] - centre) / scale
    return scores


def linear_cka(a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
    """Linear centred kernel alignment of two embeddings of the same inputs (1: the same up to rotation and scale)."""
    a, b = a - a.mean(0), b - b.mean(0)
    cross = float(np.square(a.T @ b).sum())
    norm = math.sqrt(float(np.square(a.T @ a).sum()) * float(np.square(b.T @ b).sum()))
    return cross / norm if norm > 0 else 0.0


def _array_to_list(value: NDArray[np.float64] | None) -> Any:
    return None if value is None else value.tolist()


def _array_from_list(value: Any) -> NDArray[np.float64] | None:
    return None if value is None else np.asarray(value, dtype=np.float64)


def _series_to_lists(series: dict[str, list[float]]) -> dict[str, list[float | None]]:
    return {name: [None if math.isnan(v) else v for v in values] for name, values in series.items()}


def _series_from_lists(saved: dict[str, list[float | None]]) -> dict[str, list[float]]:
    return {name: [math.nan if v is None else float(v) for v in values] for name, values in saved.items()}


class TrailingRule:
    """One drift's trailing robust z-score and patience, check by check.

    At every check, the score and the hold that `rule_scores` and `rule_holds` give the series so far (the same
    reference, warm-up and patience), without scoring the whole series again.

    Args:
        settings: the silent path's settings (threshold, patience, warm-up).
    """

    def __init__(self, settings: SilentSettings) -> None:
        threshold, self.patience, _ = settings.rule
        self.rule = PolicySettings(threshold=threshold, warmup=settings.warmup)
        self.reference = Reference(2 * self.rule.zscore_window, self.rule.zscore_window)
        self.warm: list[float] = []  # the finite values of the warm-up checks (the rule's baseline)
        self.checks = 0
        self.run = 0  # consecutive checks at or above the threshold

    def add(self, value: float) -> float | None:
        """Score the next check's ``value`` (None: no score: the warm-up, or not finite); `holds` after it."""
        score = None
        if math.isfinite(value):
            if self.checks < self.rule.warmup:
                self.warm.append(value)
            else:
                baseline = float(np.mean(self.warm)) if self.warm else None
                score = score_value(self.rule, self.reference.values, value, baseline, 1)
            self.reference.add(value, at_threshold(score, self.rule.threshold))
        self.checks += 1
        self.run = self.run + 1 if score is not None and score >= self.rule.threshold else 0
        return score

    @property
    def holds(self) -> bool:
        """Whether the rule holds at the last check (``patience`` consecutive scores at or above the threshold)."""
        return self.run >= self.patience


def _path_state(fields: Mapping[str, str], encode: Mapping[str, Any], decode: Mapping[str, Any]) -> StateFields:
    """A silent path's saved state: ``fields`` of its own beside what both families keep.

    Both keep the checks, the warm-up radii and their scale, each signal's series and whether the last check alarmed.
    """
    return StateFields(
        version=1,
        fields={"checks": "checks_", "radii": "radii_", "scale": "scale_", **fields, "series": "series_",
                "alarming": "alarming_"},
        encode={**encode, "series": _series_to_lists},
        decode={**decode, "series": _series_from_lists},
    )  # fmt: skip


class _SilentPath(Stateful):
    """What both families share: the warm-up's scale, a check judged after the loud path, one alarm an episode."""

    def __init__(self, settings: SilentSettings, signals: Iterable[str]) -> None:
        self.settings = settings
        self.checks_ = 0  # the checks observed (a diverged one counts)
        self.radii_: list[float] = []  # the warm-up checks' RMS radii
        self.scale_: float | None = None  # their mean, from the last warm-up check on
        #: Each signal's value at every check (NaN where it has none: a diverged check, before its reference).
        self.series_: dict[str, list[float]] = {name: [] for name in signals}
        self.alarming_ = False  # the last check alarmed (an alarm is raised again after a quiet check)

    def _ends_warm_up(self, radius: float) -> bool:
        """Whether this check ends the warm-up (it then fixes the scale: the mean of the warm-up RMS radii kept)."""
        if self.checks_ <= self.settings.warmup:
            self.radii_.append(radius)
        if self.checks_ != self.settings.warmup:
            return False
        self.scale_ = float(np.mean(self.radii_)) or 1.0
        return True

    def observe(self, frame: NDArray[np.float64] | None, diagrams: Diagrams | None) -> SilentAlarm | None:
        raise NotImplementedError

    def _raised(self, found: list[tuple[str, str]]) -> SilentAlarm | None:
        """The alarm for this check's ``found`` (signal, why) pairs, when it is raised now (not while one holds on)."""
        alarm = SilentAlarm(signals=tuple(name for name, _ in found), why="; ".join(why for _, why in found))
        raise_now = bool(found) and not self.alarming_
        self.alarming_ = bool(found)
        return alarm if raise_now else None

    def judge(self, decision: Decision, frame: NDArray[np.float64] | None, diagrams: Diagrams | None) -> Decision:
        """Observe one check and return the loud path's ``decision`` with its alarm acted on (`observe`, `applied`)."""
        return self.applied(decision, self.observe(frame, diagrams))

    def applied(self, decision: Decision, alarm: SilentAlarm | None) -> Decision:
        """``decision`` with this check's alarm acted on.

        The silent action where the policy asked for nothing, else the policy's decision as it is (the loud path
        decides first).
        """
        if alarm is None or decision.action is not Action.NONE:
            return decision
        action = Action(self.settings.action)
        reason = (f"silent path: the probe's representation moved while the loss rule stayed quiet ({alarm.why}); "
                  f"{action.value}")  # fmt: skip
        return dataclasses.replace(decision, action=action, reason=reason, rule="silent",
                                   flagged=(*decision.flagged, "silent"), checkpoint=action is Action.STOP)  # fmt: skip


class SilentWatch(_SilentPath):
    """The drift family's state from check to check, and its judgement of each check (see the module).

    Args:
        settings: the silent path's settings.

    Examples:
        >>> import numpy as np
        >>> from topocallbacks.settings import SilentSettings
        >>> watch = SilentWatch(SilentSettings(warmup=2))
        >>> rng = np.random.default_rng(0)
        >>> [watch.observe(rng.normal(size=(64, 8)), None) for _ in range(3)]  # healthy: no alarm
        [None, None, None]
        >>> watch.observe(np.ones((64, 8)) + 1e-3 * rng.normal(size=(64, 8)), None).signals  # one point
        ('rank_squeeze', 'cone', 'shrink')
    """

    _state = _path_state(
        {"reference": "_reference", "reference_diagrams": "_reference_diagrams", "reference_check": "reference_check_"},
        encode={"reference": _array_to_list, "reference_diagrams": diagrams_to_lists},
        decode={"reference": _array_from_list, "reference_diagrams": diagrams_from_lists},
    )

    def __init__(self, settings: SilentSettings) -> None:
        super().__init__(settings, DRIFTS)  # each drift's series: NaN before the reference and at a diverged check
        self._reference: NDArray[np.float64] | None = None  # the raw features of the last warm-up check
        self._reference_diagrams: Diagrams | None = None
        self.reference_check_: int | None = None
        self._rules = {name: TrailingRule(settings) for name in DRIFTS}  # derived from series_ (see load_state_dict)
        self._scores: dict[str, float | None] = dict.fromkeys(DRIFTS)  # the last check's

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`; each drift's trailing rule is replayed from its saved series.

        Raises:
            InputError: missing keys or another version.
        """
        super().load_state_dict(state)
        self._rules = {name: TrailingRule(self.settings) for name in DRIFTS}
        for name, values in self.series_.items():
            for value in values:
                self._scores[name] = self._rules[name].add(value)

    def observe(self, frame: NDArray[np.float64] | None, diagrams: Diagrams | None) -> SilentAlarm | None:
        """Take one check; the alarm, when one is raised at this check.

        Args:
            frame: the check's raw features ``(n, d)`` (None: a diverged check).
            diagrams: the persistence diagrams the index measured on them (None: none).
        """
        self.checks_ += 1
        if frame is None:
            self._extend(math.nan, math.nan)
            self.alarming_ = False
            return None
        radius = rms_radius(frame)
        if self._ends_warm_up(radius):
            self._reference, self._reference_diagrams = frame.copy(), diagrams
            self.reference_check_ = self.checks_
        if self._reference is None or self.checks_ == self.reference_check_ or self.reference_check_ is None:
            self._extend(math.nan if self._reference is None else 0.0, math.nan if self._reference is None else 0.0)
            return None
        elapsed = self.checks_ - self.reference_check_
        drift = math.nan
        if diagrams is not None and self._reference_diagrams is not None:
            drift = diagram_drift(self._reference_diagrams, diagrams) / elapsed
        self._extend(drift, (1.0 - linear_cka(frame, self._reference)) / elapsed)
        found = self._drifts_holding() + (self._sentinels(frame, radius) if self.settings.rule[2] else [])
        return self._raised(found)

    def _extend(self, diagram: float, cka: float) -> None:
        for name, value in zip(DRIFTS, (diagram, cka), strict=True):
            self.series_[name].append(value)
            self._scores[name] = self._rules[name].add(value)

    def _drifts_holding(self) -> list[tuple[str, str]]:
        threshold, patience, _ = self.settings.rule
        found = []
        for name in DRIFTS:
            if self._rules[name].holds:
                value = self.series_[name][-1]
                why = (f"{name} {value:.3g} per check since the reference check, robust z {self._scores[name]:.1f} >= "
                       f"{threshold:g} for {patience} checks")  # fmt: skip
                found.append((name, why))
        return found

    def _sentinels(self, frame: NDArray[np.float64], radius: float) -> list[tuple[str, str]]:
        rank, cosine = effective_rank(frame), mean_cosine(frame)
        spread = radius / self.scale_ if self.scale_ else math.inf
        found = []
        if rank <= RANK_SQUEEZE:
            found.append(("rank_squeeze", f"effective rank {rank:.2f} <= {RANK_SQUEEZE}"))
        if cosine >= CONE:
            found.append(("cone", f"mean pairwise cosine {cosine:.3f} >= {CONE}"))
        if spread <= SHRINK:
            found.append(("shrink", f"RMS radius {spread:.3f} x the warm-up's <= {SHRINK}"))
        return found


class GeometryWatch(_SilentPath):
    """The geometry family's state from check to check, and its judgement of each check (see the module).

    At each check the five `GEOMETRY` signals of the raw features: ``spread`` (the RMS radius over the warm-up
    checks' mean, the mean so far during the warm-up), `norm_std`, ``anisotropy`` (`top_eigenvalue_share`),
    `mean_cosine` and `modes` (of the centred features over the warm-up's radius, at the ε of a mean degree of
    `MODES_DEGREE` calibrated at the last warm-up check; NaN before it). After the warm-up each is scored in the
    direction a collapse moves it against the warm-up checks, frozen there: ``(value - median) / max(1.4826 MAD, 1 %
    of the largest, 1e-12)``; for ``modes``, the modes lost since the last warm-up check. A signal holds when its
    score is ``>= threshold`` at ``patience`` consecutive checks.

    Args:
        settings: the silent path's settings (``family="geometry"``).

    Examples:
        >>> import numpy as np
        >>> from topocallbacks.settings import SilentSettings
        >>> watch = GeometryWatch(SilentSettings(family="geometry", warmup=3, patience=2))
        >>> rng = np.random.default_rng(0)
        >>> [watch.observe(rng.normal(size=(64, 8)), None) for _ in range(4)]  # healthy: no alarm
        [None, None, None, None]
        >>> cone = rng.normal(size=(64, 8)) + 5.0
        >>> watch.observe(cone, None), watch.observe(cone, None).signals  # two checks in a cone
        (None, ('norm_std', 'anisotropy', 'mean_cosine'))
    """

    _state = _path_state({"epsilon": "epsilon_"}, encode={}, decode={})

    def __init__(self, settings: SilentSettings) -> None:
        super().__init__(settings, GEOMETRY)  # each signal's series: NaN at a diverged check, `modes` before its scale
        self.epsilon_: float | None = None  # the mode counter's scale, from the last warm-up check on

    def observe(self, frame: NDArray[np.float64] | None, diagrams: Diagrams | None = None) -> SilentAlarm | None:
        """Take one check; the alarm, when one is raised at this check.

        Args:
            frame: the check's raw features ``(n, d)`` (None: a diverged check).
            diagrams: not used (the drift family's).
        """
        self.checks_ += 1
        warmup = self.settings.warmup
        if frame is None or not np.isfinite(frame).all():
            for values in self.series_.values():
                values.append(math.nan)
            self.alarming_ = False
            return None
        frame = np.asarray(frame, dtype=np.float64)
        radius = rms_radius(frame)
        if self._ends_warm_up(radius):  # the reference: the last warm-up check
            centred = (frame - frame.mean(0)) / self.scale_
            self.epsilon_ = calibrate_epsilon(centred, IndexSettings(epsilon_degree=MODES_DEGREE))
        scale = self.scale_ if self.scale_ else float(np.mean(self.radii_)) or 1.0
        found = {"spread": radius / scale, "norm_std": norm_std(frame), "anisotropy": top_eigenvalue_share(frame),
                 "mean_cosine": mean_cosine(frame), "modes": math.nan}  # fmt: skip
        if self.epsilon_ is not None and self.scale_:
            found["modes"] = float(modes((frame - frame.mean(0)) / self.scale_, self.epsilon_))
        for name, value in found.items():
            self.series_[name].append(value)
        return self._raised(self._holding()) if self.checks_ > warmup else None

    def scores(self, name: str) -> NDArray[np.float64]:
        """One signal's score at every check (NaN during the warm-up and where it has no value)."""
        warmup, values = self.settings.warmup, np.asarray(self.series_[name], dtype=np.float64)
        if name != "modes":
            return frozen_scores(values, GEOMETRY[name], warmup)
        scores = np.full(values.size, math.nan)  # modes lost since the reference check
        if values.size > warmup:
            scores[warmup:] = values[warmup - 1] - values[warmup:]
        return scores

    def _holding(self) -> list[tuple[str, str]]:
        threshold, patience, _ = self.settings.rule
        found = []
        for name in GEOMETRY:
            scores = self.scores(name)
            if rule_holds(np.nan_to_num(scores, nan=-math.inf).tolist(), threshold, patience, self.settings.warmup)[-1]:
                value, score = self.series_[name][-1], float(scores[-1])
                moved = (f"{score:.0f} modes lost since the reference check" if name == "modes" else
                         f"{value:.3g}, robust z {score:.1f} against the warm-up")  # fmt: skip
                found.append((name, f"{name} {moved} (>= {threshold:g} for {patience} checks)"))
        return found


def watch_for(settings: SilentSettings) -> SilentWatch | GeometryWatch:
    """The silent path of ``settings.family``."""
    return GeometryWatch(settings) if settings.family == "geometry" else SilentWatch(settings)


@dataclasses.dataclass(frozen=True)
class SilentAlarm:
    """A silent alarm: which signals hold and why, in words.

    The signals are among ``"diagram_drift_ref"``, ``"cka_drift"``, ``"rank_squeeze"``, ``"cone"`` and ``"shrink"``.
    """

    signals: tuple[str, ...]
    why: str
