"""The silent suite's candidate signals (``benchmarks/silent/PREREGISTERED.md``), from what a callback sees at a check.

Three families and the sentinels, each computed on a run's probe features check by check, with what later checks
need from earlier ones (the warm-up's scale, the reference embedding and diagrams) carried in a state, so that a
run's shared prefix is computed once and each branch continues from it:

* absolute-scale geometry: ``spread`` (RMS radius of the centred features over the warm-up's mean), ``norm_std``
  (Lightly's std of L2-normalised embeddings), ``anisotropy`` (top covariance eigenvalue share), ``mean_cosine``
  (mean pairwise cosine of the raw features: a cone), ``modes`` (Betti-0 of the centred features over the warm-up's
  radius at the ε of mean degree 32 calibrated at the last warm-up check, counting clusters of >= 1 % of the probe
  only);
* scale-free spectrum: ``rankme`` (effective rank);
* drift against the last warm-up check: ``diagram_drift_ref`` (Wasserstein-1 of the H0 + H1 diagrams of the
  monitor's normalised cloud) and ``cka_drift`` (1 - linear CKA), each divided by the checks elapsed since it;
* sentinels: ``rank_squeeze`` (effective rank <= 1.5), ``cone`` (mean cosine >= 0.95), ``shrink`` (spread <= 0.1),
  as 1.0 (holds) or 0.0.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from topocallbacks.check import measure
from topocallbacks.functional import calibrate_epsilon, effective_rank
from topocallbacks.settings import IndexSettings
from topocallbacks.silent import (  # noqa: F401  (MIN_MODE_SHARE: the library's, here by name)
    MIN_MODE_SHARE,
    MODES_DEGREE,
    linear_cka,
    mean_cosine,
    modes,
    norm_std,
    rms_radius,
)
from topocallbacks.silent import top_eigenvalue_share as anisotropy
from topocallbacks.transform import FeatureTransform

#: The policy's warm-up (checks): the scale and the references are fixed at its last check.
WARMUP = 10
INDEX = IndexSettings()
#: The mode counter's scale: a mean degree of 32 (6 % of a 512-point probe), so that a mode's points connect.
MODES_INDEX = IndexSettings(epsilon_degree=MODES_DEGREE)

FAMILIES: dict[str, tuple[str, ...]] = {
    "geometry": ("spread", "norm_std", "anisotropy", "mean_cosine", "modes"),
    "spectrum": ("rankme",),
    "drift": ("diagram_drift_ref", "cka_drift"),
    "sentinels": ("rank_squeeze", "cone", "shrink"),
}
#: +1: collapse raises the signal; -1: lowers it. Sentinels are 1.0 when they hold.
DIRECTIONS: dict[str, int] = {
    "spread": -1, "norm_std": -1, "anisotropy": 1, "mean_cosine": 1, "modes": -1, "rankme": -1,
    "diagram_drift_ref": 1, "cka_drift": 1, "rank_squeeze": 1, "cone": 1, "shrink": 1, "lidar": -1,
    "coverage": -1, "output_entropy": -1, "knn_churn": 1, "knn_drift_ref": 1,
}  # fmt: skip
#: Round 3's family (ROUND3.md), computed from a classifier's probe logits where they are recorded: kept apart from
#: `FAMILIES`, whose candidates rounds 1 and 2 registered.
OUTPUTS = ("coverage", "output_entropy")
#: A class is covered when the probe's argmax names it for at least this share of the probe (6 of 512 points).
MIN_CLASS_SHARE = 0.01
TOPOLOGICAL = ("modes", "diagram_drift_ref")
#: Round 6's family (ROUND6.md): how the probe's neighbourhoods change, kept apart from `FAMILIES` as `OUTPUTS` is.
NEIGHBOURS = ("knn_churn", "knn_drift_ref")
#: The neighbours each point's neighbourhood holds (cosine of the raw features).
NEIGHBOURHOOD = 10


@functools.cache
def _collapse_signals() -> Any:
    """The collapse suite's ``signals`` module, loaded once from its file (a module name this suite shares)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "collapse" / "signals.py"
    spec = importlib.util.spec_from_file_location("collapse_signals", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the file runs
    spec.loader.exec_module(module)
    return module


def training_signals(check_steps: np.ndarray, loss: np.ndarray, grad_norm: np.ndarray) -> dict[str, np.ndarray]:
    """The collapse suite's training channels (``benchmarks/collapse/signals.py``: the mean loss and gradient norm
    since the previous check)."""
    result: dict[str, np.ndarray] = _collapse_signals().training_signals(check_steps, loss, grad_norm)
    return result


def lidar(views: np.ndarray, delta: float = 1e-4) -> float:
    """LiDAR (Thilak et al., 2023; stable-pretraining's callback): the effective rank of the LDA matrix
    ``S_w^-1/2 S_b S_w^-1/2`` of ``views`` ``(samples, views, dim)``, each sample its own class (``delta`` times the
    identity, relative to the within-class scatter's mean eigenvalue, keeps ``S_w`` invertible)."""
    x = np.asarray(views, dtype=np.float64)
    if not np.isfinite(x).all():
        return math.nan
    means = x.mean(1)
    centred = means - means.mean(0)
    between = centred.T @ centred / x.shape[0]
    within_points = (x - means[:, None, :]).reshape(-1, x.shape[2])
    within = within_points.T @ within_points / within_points.shape[0]
    within += delta * max(float(np.trace(within)) / x.shape[2], 1e-12) * np.eye(x.shape[2])
    values, vectors = np.linalg.eigh(within)
    root = vectors @ np.diag(values**-0.5) @ vectors.T
    eig = np.clip(np.linalg.eigvalsh(root @ between @ root), 0.0, None)
    total = float(eig.sum())
    if total <= 0:
        return 1.0
    share = eig / total + 1e-12
    return float(np.exp(-(share * np.log(share)).sum()))


def coverage(logits: np.ndarray, min_share: float = MIN_CLASS_SHARE) -> int:
    """The classes that the argmax of ``logits`` ``(n, classes)`` names for at least ``min_share`` of the ``n`` points.

    Examples:
        >>> coverage(np.eye(3)[[0] * 95 + [1] * 4 + [2]], min_share=0.05)
        1
    """
    counts = np.bincount(np.asarray(logits).argmax(1), minlength=np.shape(logits)[1])
    return int((counts >= max(1, math.ceil(min_share * len(logits)))).sum())


def output_entropy(logits: np.ndarray) -> float:
    """The entropy (nats) of the histogram of the argmax of ``logits`` ``(n, classes)``: log(classes) when the
    classes are named equally often, 0 when one is named for every point.

    Examples:
        >>> math.isclose(output_entropy(np.eye(4)[[0, 1, 2, 3]]), math.log(4)), output_entropy(np.eye(4)[[2, 2]])
        (True, 0.0)
    """
    counts = np.bincount(np.asarray(logits).argmax(1), minlength=np.shape(logits)[1]).astype(np.float64)
    share = counts[counts > 0] / counts.sum()
    return float(-(share * np.log(share)).sum()) + 0.0


def neighbourhoods(frame: np.ndarray, k: int = NEIGHBOURHOOD) -> np.ndarray:
    """Each point's ``k`` nearest other points by the cosine of the raw features, ``(n, k)`` indices (unordered).

    Examples:
        >>> frame = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> sorted(neighbourhoods(frame, 1)[:, 0].tolist())
        [0, 1, 2, 3]
        >>> int(neighbourhoods(frame, 1)[0, 0])
        1
    """
    unit = frame / np.maximum(np.linalg.norm(frame, axis=1, keepdims=True), 1e-12)
    cosine = unit @ unit.T
    np.fill_diagonal(cosine, -np.inf)
    return np.argpartition(-cosine, k - 1, axis=1)[:, :k]


def kept(now: np.ndarray, before: np.ndarray) -> float:
    """The mean share of each point's neighbourhood ``now`` that was in its neighbourhood ``before`` (``(n, k)``).

    Examples:
        >>> kept(np.array([[1, 2], [0, 2]]), np.array([[2, 1], [3, 2]]))
        0.75
    """
    return float((now[:, :, None] == before[:, None, :]).any(2).mean())


def neighbour_signals(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Round 6's family at every check of a run (``frames``: ``(checks, n, dim)``): ``knn_churn`` (1 - the share of
    the neighbourhoods kept since the check before) and ``knn_drift_ref`` (1 - the share kept since the last warm-up
    check, per check elapsed), and ``knn_drift_ref/warm_rates``, its healthy rate: the churn of warm-up checks 2-10
    (the drift family's, `round2.warm_rates`). A check whose features hold NaN or Inf gets NaN (and has no
    neighbourhoods for the next check's churn)."""
    churn, drift = [], []
    previous = reference = None
    for check, frame in enumerate(np.asarray(frames, dtype=np.float64), start=1):
        found = neighbourhoods(frame) if np.isfinite(frame).all() else None
        churn.append(math.nan if found is None or previous is None else 1.0 - kept(found, previous))
        if check == WARMUP:
            reference = found
        elapsed = check - WARMUP
        drift.append(math.nan if found is None or reference is None or elapsed < 0 else
                     0.0 if elapsed == 0 else (1.0 - kept(found, reference)) / elapsed)  # fmt: skip
        previous = found
    rates = np.asarray(churn[1:WARMUP], dtype=np.float64)
    return {"knn_churn": np.asarray(churn), "knn_drift_ref": np.asarray(drift), "knn_drift_ref/warm_rates": rates}


#: A later round's new family, by name: how its signals are computed from a run's features (``(checks, n, dim)``).
COMPUTED_FAMILIES = {"neighbours": neighbour_signals}


def output_signals(outputs: np.ndarray) -> dict[str, np.ndarray]:
    """The outputs family at every check of a run (``outputs``: the probe's logits, ``(checks, n, classes)``)."""
    frames = np.asarray(outputs, dtype=np.float64)
    return {"coverage": np.array([float(coverage(f)) for f in frames]),
            "output_entropy": np.array([output_entropy(f) for f in frames])}  # fmt: skip


def feature_signals(frames: np.ndarray, state: dict[str, Any] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Every candidate at every check of a run segment (``frames``: ``(checks, n, dim)``), and the state after it.

    The state carries the check count, the warm-up's radii, and from the last warm-up check on the fixed scale,
    ε, reference features and diagrams. Before the warm-up ends the reference-based signals are NaN. A check whose
    features hold NaN or Inf gets NaN everywhere.
    """
    names = [name for family in FAMILIES.values() for name in family]
    out: dict[str, list[float]] = {name: [] for name in names}
    state = dict(state or {"checks": 0, "radii": [], "scale": None, "epsilon": None, "reference": None,
                           "diagrams": None, "reference_check": None})  # fmt: skip
    transform = FeatureTransform()
    for frame in frames.astype(np.float64):
        state["checks"] += 1
        check = state["checks"]
        if not np.isfinite(frame).all():
            for values in out.values():
                values.append(math.nan)
            continue
        radius = rms_radius(frame)
        if check <= WARMUP:
            state["radii"] = [*state["radii"], radius]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cloud = transform(frame)
            if check == WARMUP:  # the reference: the last warm-up check
                state["scale"] = float(np.mean(state["radii"])) or 1.0
                centred = (frame - frame.mean(0)) / state["scale"]
                state["epsilon"] = calibrate_epsilon(centred, MODES_INDEX)
                state["reference"] = frame.copy()
                state["diagrams"] = measure(cloud, calibrate_epsilon(cloud, INDEX), INDEX).diagrams
                state["reference_check"] = check
            rank = effective_rank(frame)
            cosine = mean_cosine(frame)
            spread = radius / state["scale"] if state["scale"] else radius / float(np.mean(state["radii"]) or 1.0)
            out["spread"].append(spread)
            out["norm_std"].append(norm_std(frame))
            out["anisotropy"].append(anisotropy(frame))
            out["mean_cosine"].append(cosine)
            out["rankme"].append(rank)
            out["rank_squeeze"].append(float(rank <= 1.5))
            out["cone"].append(float(cosine >= 0.95))
            out["shrink"].append(float(spread <= 0.1))
            if state["reference"] is None or check == state["reference_check"]:
                for name in ("modes", "diagram_drift_ref", "cka_drift"):
                    out[name].append(math.nan if state["reference"] is None else 0.0)
                if state["reference"] is not None:
                    centred = (frame - frame.mean(0)) / state["scale"]
                    out["modes"][-1] = float(modes(centred, state["epsilon"]))
                continue
            elapsed = check - state["reference_check"]
            centred = (frame - frame.mean(0)) / state["scale"]
            out["modes"].append(float(modes(centred, state["epsilon"])))
            found = measure(cloud, calibrate_epsilon(cloud, INDEX), INDEX, previous=state["diagrams"])
            drift = found.values.get("diagram_drift")
            out["diagram_drift_ref"].append(math.nan if drift is None else float(drift) / elapsed)
            out["cka_drift"].append((1.0 - linear_cka(frame, state["reference"])) / elapsed)
    return {name: np.asarray(values, dtype=np.float64) for name, values in out.items()}, state
