"""Candidate signals evaluated on the recordings, each computed only from what a callback sees at a check.

The indices the package ships (the paper's composite and its components, diagram drift, RankMe) come from the
monitor's own check path: the features go through :class:`topocallbacks.transform.FeatureTransform` with the
monitor's default settings (centred, unit RMS radius) and :func:`topocallbacks.check.measure` at the ε the monitor
would calibrate (:func:`topocallbacks.functional.calibrate_epsilon`), so the suite measures what ships. The other
candidates are built from functions of ``topocallbacks.functional`` on the same normalised cloud and diagrams, or
from the loss and gradient norm logged since the previous check.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from topocallbacks.check import measure
from topocallbacks.functional import betti_numbers, calibrate_epsilon, collapse_index
from topocallbacks.functional._distances import pairwise_distances
from topocallbacks.functional.collapse import betti_term
from topocallbacks.functional.indices import betti_curve, total_persistence
from topocallbacks.settings import IndexSettings
from topocallbacks.transform import FeatureTransform

#: Bump when a signal's definition changes: cached signal files with another version are recomputed.
VERSION = 8  # 8: ε by a mean degree of 8 (the Betti and paper-index signals changed)
#: The monitor's default index settings (diagram drift watched, the paper's composite beside it).
INDEX = IndexSettings()


@dataclasses.dataclass(frozen=True)
class Signal:
    """A candidate: its direction (+1: collapse raises it, -1: lowers it, 0: either way) and what it is."""

    name: str
    direction: int
    family: str  # "paper", "topology", "geometry", "training", "fused"
    description: str
    parts: tuple[str, ...] = ()  # for fused signals: the signals whose scores are combined (max)


SIGNALS: dict[str, Signal] = {
    s.name: s
    for s in [
        Signal("paper_ci_raw", 1, "paper", "paper CI, raw features, eps = 0.5 x median fixed at the first check"),
        Signal("paper_ci", 1, "paper", "paper CI (weights='paper'), normalised features, eps fixed at first check"),
        Signal("betti_term", 1, "paper", "1 - clip(b1/b0) at the fixed eps (normalised features)"),
        Signal("entropy_term", 1, "paper", "1 - normalised persistence entropy (H0+H1, 256-point subsample)"),
        Signal("anisotropy", 1, "geometry", "covariance anisotropy (the paper's third component)"),
        Signal("betti_term_scale_free", 1, "topology", "1 - clip(b1/b0) at eps = 0.5 x the current median"),
        Signal("betti0_area", -1, "topology", "Betti-0 curve area: mean b0/n at the 1,2,5,10,20 % distance quantiles"),
        Signal("betti1_area", 0, "topology", "Betti-1 curve area: mean b1/n at the same quantiles"),
        Signal("h0_total_persistence", -1, "topology", "H0 total persistence in units of the median distance"),
        Signal("h1_total_persistence", 0, "topology", "H1 total persistence in units of the median distance"),
        Signal("diagram_drift", 1, "topology", "Wasserstein-1 distance between consecutive H0 and H1 diagrams"),
        Signal("h0_drift", 1, "topology", "the H0 part of diagram_drift"),
        Signal("h1_drift", 1, "topology", "the H1 part of diagram_drift"),
        Signal("rankme", -1, "geometry", "effective rank (RankMe)"),
        Signal("grad_norm", 0, "training", "mean gradient norm since the previous check"),
        Signal("loss", 1, "training", "mean training loss since the previous check"),
        Signal("betti0_area+grad_norm", 0, "fused", "alarm when either flags", ("betti0_area", "grad_norm")),
        Signal(
            "h0_total_persistence+grad_norm",
            0,
            "fused",
            "alarm when either flags",
            ("h0_total_persistence", "grad_norm"),
        ),
        Signal("rankme+grad_norm", 0, "fused", "alarm when either flags", ("rankme", "grad_norm")),
        Signal("betti0_area+rankme", 0, "fused", "alarm when either flags", ("betti0_area", "rankme")),
    ]
}

FEATURE_SIGNALS = tuple(
    name for name, s in SIGNALS.items() if s.family in ("paper", "topology", "geometry") and name != "paper_ci_raw"
)


def _median_distance(cloud: np.ndarray) -> float:
    distances = pairwise_distances(cloud)[np.triu_indices(cloud.shape[0], 1)]
    return float(np.median(distances))


def feature_signals(frames: np.ndarray, state: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Every feature-based signal at every check of a run segment; ``frames`` is ``(checks, n, dim)``.

    ``state`` carries what later checks need from earlier ones (the fixed ε, the last diagrams), so that a run's
    shared prefix is computed once and each branch continues from it. Returns the signals and the new state.
    A check whose features hold NaN or Inf gets NaN everywhere (the evaluation marks it diverged).
    """
    out: dict[str, list[float]] = {name: [] for name in (*FEATURE_SIGNALS, "paper_ci_raw")}
    state = dict(state or {"eps_fixed": None, "eps_raw": None, "previous": None})
    eps_fixed, eps_raw, previous = state["eps_fixed"], state["eps_raw"], state["previous"]
    transform = FeatureTransform()  # the monitor's default: each check centred and scaled to unit RMS radius
    for frame in frames.astype(np.float64):
        if not np.isfinite(frame).all():
            for values in out.values():
                values.append(math.nan)
            previous = None
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a fully collapsed cloud warns about its scale
            cloud = transform(frame)
            if eps_fixed is None:
                eps_fixed = calibrate_epsilon(cloud, INDEX)
                eps_raw = calibrate_epsilon(frame, INDEX)
            # The monitor's own check: the composite, the drift and RankMe, computed once.
            found = measure(cloud, eps_fixed, INDEX, previous=previous, also=("rankme",))
            report, diagrams = found.report, found.diagrams
            raw = collapse_index(frame, epsilon=eps_raw, weights="paper", max_points=INDEX.max_points)
            median = _median_distance(cloud)
            if median > 0:
                b0, b1 = betti_numbers(cloud, 0.5 * median)
                h0 = total_persistence(diagrams[0], scale=median)
                h1 = total_persistence(diagrams[1], scale=median)
            else:  # most points coincide (median distance 0): the full-collapse values of these scale-free ones
                b0, b1, h0, h1 = 1, 0, 0.0, 0.0
            curve = betti_curve(cloud)
        out["paper_ci_raw"].append(raw.ci)
        out["paper_ci"].append(report.ci)
        out["betti_term"].append(report.betti_term)
        out["entropy_term"].append(report.entropy_term)
        out["anisotropy"].append(report.anisotropy_term)
        out["betti_term_scale_free"].append(betti_term(b0, b1))
        out["betti0_area"].append(curve.component_area)
        out["betti1_area"].append(curve.loop_area)
        out["h0_total_persistence"].append(h0)
        out["h1_total_persistence"].append(h1)
        drifts = (math.nan, math.nan) if found.drift is None else found.drift
        out["h0_drift"].append(drifts[0])
        out["h1_drift"].append(drifts[1])
        drift = found.values["diagram_drift"]
        out["diagram_drift"].append(math.nan if drift is None else drift)
        out["rankme"].append(found.values["rankme"])
        previous = diagrams
    signals = {name: np.asarray(values, dtype=np.float64) for name, values in out.items()}
    return signals, {"eps_fixed": eps_fixed, "eps_raw": eps_raw, "previous": previous}


def training_signals(check_steps: np.ndarray, loss: np.ndarray, grad_norm: np.ndarray) -> dict[str, np.ndarray]:
    """Mean loss and gradient norm over the steps since the previous check (NaN at the first check)."""
    result = {"loss": np.full(check_steps.size, math.nan), "grad_norm": np.full(check_steps.size, math.nan)}
    for i in range(1, check_steps.size):
        window = slice(int(check_steps[i - 1]), int(check_steps[i]))
        result["loss"][i] = float(np.mean(loss[window]))
        result["grad_norm"][i] = float(np.mean(grad_norm[window]))
    return result
