"""Evaluating an offline analysis: each checkpoint's features measured as the monitor would, and more, row by row.

Each layer keeps its transform, ε, diagrams and policy from one checkpoint to the next, as a monitor's pipeline does.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .._validation import as_points
from ..check import ORIENTATION, CheckRecord, Measurement, measure
from ..exceptions import InputError, NonFiniteError
from ..functional.collapse import calibrate_epsilon
from ..functional.geometry import _effective_rank, participation_ratio
from ..functional.spectrum import eigenspectrum_decay
from ..functional.topology import _persistence_entropy
from ..functional.weights import neural_persistence, weight_h0_total_persistence
from ..policy import Policy
from ..settings import MonitorSettings
from ..transform import FeatureTransform
from .checkpoints import Checkpoint
from .loading import Source, checkpoint_features

__all__ = ["MAX_WEIGHT_ENTRIES", "MAX_WEIGHT_ROWS", "NOT_CORRELATED", "QUANTITIES", "Measured", "evaluate"]

#: What each column of ``analysis.csv`` holds (the quantities; ``step``, ``layer``, ``source``, ``status``,
#: ``checkpoint`` and one column per loss found come first).
QUANTITIES: Mapping[str, str] = {
    "index_value": "the watched index (settings.index.name; diagram drift by default, none at the first checkpoint)",
    "ci": "the paper's Collapse Index",
    "betti_term": "1 - clip(b1 / b0)",
    "entropy_term": "1 - normalised persistence entropy (H0 and H1)",
    "anisotropy_term": "anisotropy of the covariance spectrum",
    "betti0": "b0 of the Rips complex at epsilon",
    "betti1": "b1 of the Rips complex at epsilon",
    "persistence_entropy": "normalised persistence entropy of the H0 and H1 bars",
    "epsilon": "the scale, calibrated on the first checkpoint",
    "diagram_drift": "W1 distance between this checkpoint's diagrams and the previous one's (H0 + H1)",
    "wasserstein_h0": "W1 distance between consecutive H0 diagrams",
    "wasserstein_h1": "W1 distance between consecutive H1 diagrams",
    "h0_count": "finite H0 bars",
    "h0_total_persistence": "sum of finite H0 bar lengths",
    "h0_max_persistence": "longest finite H0 bar",
    "h0_entropy": "normalised persistence entropy of the H0 bars",
    "h1_count": "finite H1 bars",
    "h1_total_persistence": "sum of finite H1 bar lengths",
    "h1_max_persistence": "longest finite H1 bar",
    "h1_entropy": "normalised persistence entropy of the H1 bars",
    "effective_rank": "RankMe of the transformed (centred, unit RMS radius) cloud",
    "participation_ratio": "(sum of covariance eigenvalues)^2 / sum of their squares",
    "eigenspectrum_decay": "alpha of the power-law fit log(eigenvalue) ~ c - alpha log(rank)",
    "n_points": "probe samples",
    "n_features": "feature dimension",
    "neural_persistence": "neural persistence of a weight matrix (p = 2)",
    "neural_persistence_normalized": "neural persistence / sqrt(rows + columns - 1)",
    "weight_h0_total_persistence": "length of the minimum spanning tree of the matrix's rows (neurons)",
    "weight_rows": "rows (output neurons) of the weight matrix",
    "weight_columns": "columns of the weight matrix",
}
_FEATURE_QUANTITIES = tuple(QUANTITIES)[:25]
_WEIGHT_QUANTITIES = tuple(QUANTITIES)[25:]
#: Quantities left out of the correlations (they do not change between checkpoints, or only count).
NOT_CORRELATED = ("epsilon", "n_points", "n_features", "weight_rows", "weight_columns")

#: Weight matrices above this many entries get no neural persistence (its spanning tree sorts every entry).
MAX_WEIGHT_ENTRIES = 2**22
#: Weight matrices with more rows than this get no H0 total persistence (it needs rows^2 distances).
MAX_WEIGHT_ROWS = 8192


@dataclasses.dataclass
class _Layer:
    """Everything a layer carries from one checkpoint to the next, as a monitor's pipeline does."""

    transform: FeatureTransform
    policy: Policy
    epsilon: float | None = None
    diagrams: list[NDArray[np.float64]] | None = None


@dataclasses.dataclass
class Measured:
    """What `evaluate` measured: the rows, the check records and diagrams for the report, each layer's state."""

    layers: dict[str, _Layer] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    records: list[CheckRecord] = dataclasses.field(default_factory=list)
    diagrams: dict[tuple[int, str | None], list[NDArray[np.float64]]] = dataclasses.field(default_factory=dict)


def evaluate(source: Source, *, weights: bool, progress: bool) -> Measured:
    """Measure every checkpoint of ``source`` in step order: a row per layer, and per weight matrix if asked for.

    Args:
        source: what `load_source` found.
        weights: add a row per Linear/Conv weight matrix (model checkpoints).
        progress: show a tqdm progress bar on stderr.

    Returns:
        The rows (as in ``analysis.csv``), the check records, the diagrams by ``(step, layer)`` and each layer's
        state (its ε among it).

    Raises:
        InputError: a checkpoint that cannot be read or run (see
            `checkpoint_features`), or features that are not ``(n, d)``.
    """
    measured = Measured()
    settings = source.settings
    skipped: set[str] = set()
    for checkpoint in _progress(source.checkpoints, progress):
        relative = os.path.relpath(checkpoint.path, source.root)
        features = checkpoint_features(source, checkpoint)
        for name, raw in features.items():
            if name not in measured.layers:
                transform = FeatureTransform(settings.transform, seed=settings.seed)
                measured.layers[name] = _Layer(transform, Policy(settings.rule))
            values, record, found = _measure(raw, measured.layers[name], settings, checkpoint.step, name)
            row: dict[str, Any] = {
                "step": checkpoint.step,
                "layer": name,
                "source": "features",
                "status": record.status,
            }
            row["checkpoint"] = relative
            row.update(checkpoint.metrics)
            row.update(values)
            measured.rows.append(row)
            measured.records.append(record)
            if found is not None:
                measured.diagrams[(checkpoint.step, name)] = found
        if weights and source.model is not None:
            for row in _weight_rows(source.model, checkpoint.step, skipped):
                row["checkpoint"] = relative
                row.update(checkpoint.metrics)
                measured.rows.append(row)
    return measured


def _progress(checkpoints: list[Checkpoint], show: bool) -> Iterator[Checkpoint]:
    """The checkpoints, with a tqdm bar on stderr when asked for (and tqdm is installed)."""
    if show:
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information
        except ImportError:  # pragma: no cover - tqdm comes with transformers and huggingface_hub
            warnings.warn("no progress bar: tqdm is not installed (pip install tqdm)", stacklevel=4)  # analyze's caller
        else:
            yield from tqdm(checkpoints, desc="analyze", unit="checkpoint")
            return
    yield from checkpoints


def _bar_statistics(diagram: NDArray[np.float64], prefix: str) -> dict[str, float | int]:
    lengths = diagram[:, 1] - diagram[:, 0]
    return {
        f"{prefix}_count": len(lengths),
        f"{prefix}_total_persistence": float(lengths.sum()),
        f"{prefix}_max_persistence": float(lengths.max()) if lengths.size else 0.0,
        f"{prefix}_entropy": _persistence_entropy(diagram),
    }


def _row(found: Measurement, cloud: NDArray[np.float64]) -> dict[str, float | None]:
    """A checkpoint's row of quantities: the index and its terms, the diagrams' statistics and drift, the spectrum."""
    report, drift = found.report, found.drift
    return {
        "index_value": found.index_value,
        "ci": report.ci,
        "betti_term": report.betti_term,
        "entropy_term": report.entropy_term,
        "anisotropy_term": report.anisotropy_term,
        "betti0": report.betti0,
        "betti1": report.betti1,
        "persistence_entropy": report.persistence_entropy,
        "epsilon": report.epsilon,
        "diagram_drift": None if drift is None else float(sum(drift)),
        "wasserstein_h0": None if drift is None else drift[0],
        "wasserstein_h1": None if drift is None else drift[1],
        **_bar_statistics(found.diagrams[0], "h0"),
        **_bar_statistics(found.diagrams[1], "h1"),
        "effective_rank": _effective_rank(cloud),
        "participation_ratio": participation_ratio(cloud),
        "eigenspectrum_decay": eigenspectrum_decay(cloud),
        "n_points": int(cloud.shape[0]),
        "n_features": int(cloud.shape[1]),
    }


def _measure(
    features: Any, layer: _Layer, settings: MonitorSettings, step: int, name: str
) -> tuple[dict[str, float | None], CheckRecord, list[NDArray[np.float64]] | None]:
    """One checkpoint and layer: the row's quantities, the check record, and the diagrams (None when diverged)."""
    start = time.perf_counter()
    index = settings.index.name
    try:
        cloud = as_points(features, "features")
    except NonFiniteError:
        decision = layer.policy.decide(step, None, diverged=True)
        elapsed = (time.perf_counter() - start) * 1e3
        record = CheckRecord(
            step=step, status="diverged", index=index, index_value=None, decision=decision, check_ms=elapsed, layer=name
        )
        return {}, record, None
    except InputError as exc:
        raise InputError(f"{exc} (layer {name!r}, step {step})") from exc
    try:
        cloud = layer.transform(cloud)
    except InputError as exc:
        raise InputError(f"{exc} (layer {name!r}, step {step})") from exc
    if layer.epsilon is None:
        layer.epsilon = calibrate_epsilon(cloud, settings.index, settings.seed)
    found = measure(
        cloud, layer.epsilon, settings.index, previous=layer.diagrams, seed=settings.seed, also=tuple(ORIENTATION)
    )
    layer.diagrams = found.diagrams
    value = found.index_value
    decision = layer.policy.decide(step, None if value is None else ORIENTATION[index] * value)
    row = _row(found, cloud)
    report = found.report
    record = CheckRecord(
        step=step,
        status="ok",
        index=index,
        index_value=value,
        decision=decision,
        check_ms=(time.perf_counter() - start) * 1e3,
        report=report,
        n_points=int(cloud.shape[0]),
        layer=name,
    )
    return row, record, found.diagrams


def _weight_rows(model: torch.nn.Module, step: int, skipped: set[str]) -> list[dict[str, Any]]:
    rows = []
    for name, weight in _weight_matrices(model):
        matrix = weight.reshape(weight.shape[0], -1)
        row: dict[str, Any] = {"step": step, "layer": name, "source": "weights", "status": "ok"}
        row["weight_rows"], row["weight_columns"] = int(matrix.shape[0]), int(matrix.shape[1])
        big = matrix.numel() > MAX_WEIGHT_ENTRIES
        tall = matrix.shape[0] > MAX_WEIGHT_ROWS
        if (big or tall) and name not in skipped:
            skipped.add(name)
            warnings.warn(
                f"weight matrix {name!r} {tuple(matrix.shape)} is too large for "
                f"{'neural persistence' if big else ''}{' and ' if big and tall else ''}"
                f"{'its H0 total persistence' if tall else ''} (limits: {MAX_WEIGHT_ENTRIES} entries, "
                f"{MAX_WEIGHT_ROWS} rows); those columns are left empty",
                stacklevel=4,  # analyze()'s caller: evaluate <- analyze
            )
        if not torch.isfinite(matrix).all():
            row["status"] = "diverged"
            rows.append(row)
            continue
        if not big and bool(matrix.abs().max() > 0):
            row["neural_persistence"] = neural_persistence(matrix)
            row["neural_persistence_normalized"] = neural_persistence(matrix, normalize=True)
        if not tall:
            row["weight_h0_total_persistence"] = weight_h0_total_persistence(matrix)
        rows.append(row)
    return rows


def _weight_matrices(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, (out, in...))`` of every Linear, Conv and Hugging Face Conv1D (stored ``(in, out)``) weight."""
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            continue
        if isinstance(module, kinds):
            yield name, weight.detach()
        elif type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D: x @ W with W (in, out)
            yield name, weight.detach().T
