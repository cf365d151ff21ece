"""Across checkpoints: each quantity's series, its rank correlation with every loss, the step where it flattens.

Spearman's p-value is exact (over all orderings) for a few checkpoints, where scipy's approximation is not.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..functional.weights import flattening_step
from .checkpoints import Checkpoint
from .evaluating import NOT_CORRELATED, QUANTITIES

__all__ = ["EXACT_UP_TO", "MOVED", "findings", "flattening_steps", "loss_correlations", "quantity_series"]


def quantity_series(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
    """``(source, layer, quantity) -> [(step, value)]`` of the finite values."""
    result: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for row in rows:
        for quantity in QUANTITIES:
            value = row.get(quantity)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                result.setdefault((row["source"], row["layer"], quantity), []).append((row["step"], float(value)))
    return result


#: Up to this many checkpoints, a correlation's p-value comes from all permutations (exact) instead of scipy's
#: large-sample approximation, which gives p = 0 for a perfect rank correlation of 3 points (exactly: 1/3).
EXACT_UP_TO = 8


@functools.lru_cache(maxsize=EXACT_UP_TO)
def _permutations(n: int) -> NDArray[np.intp]:
    """Every ordering of ``range(n)``, one per row."""
    return np.array(list(itertools.permutations(range(n))), dtype=np.intp)


def _spearman(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Spearman's rho and its two-sided p-value (exact over all permutations for a few points)."""
    from scipy.stats import rankdata, spearmanr

    result = spearmanr(xs, ys)
    rho, p_value = float(result[0]), float(result[1])
    n = len(xs)
    if n <= EXACT_UP_TO:
        x, y = rankdata(xs), rankdata(ys)
        x, y = x - x.mean(), y - y.mean()
        orders = _permutations(n)
        rhos = (y[orders] @ x) / math.sqrt(float(np.dot(x, x) * np.dot(y, y)))
        p_value = float(np.mean(np.abs(rhos) >= abs(rho) - 1e-12))
    return rho, p_value


def loss_correlations(
    rows: Sequence[Mapping[str, Any]], checkpoints: Sequence[Checkpoint]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Spearman's rho of every quantity with every loss found, and the losses' names."""
    losses = sorted({name for c in checkpoints for name in c.metrics})
    by_step = {c.step: c.metrics for c in checkpoints}
    results = []
    for (source, layer, quantity), points in quantity_series(rows).items():
        if quantity in NOT_CORRELATED:
            continue
        for loss in losses:
            pairs = [(v, by_step[s][loss]) for s, v in points if math.isfinite(by_step.get(s, {}).get(loss, math.nan))]
            entry: dict[str, Any] = {"source": source, "layer": layer, "quantity": quantity, "loss": loss}
            entry["n"] = len(pairs)
            entry["rho"] = entry["p_value"] = None
            xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
            if len(pairs) < 3:
                entry["note"] = "fewer than 3 checkpoints"
            elif len(set(xs)) < 2 or len(set(ys)) < 2:
                entry["note"] = "constant"
            else:
                entry["rho"], entry["p_value"] = _spearman(xs, ys)
                entry["note"] = "exact permutation p-value" if len(pairs) <= EXACT_UP_TO else None
            results.append(entry)
    results.sort(key=lambda e: -abs(e["rho"]) if e["rho"] is not None else 1.0)
    return results, losses


def flattening_steps(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The step where each series of 3 or more values flattens (`flattening_step`; None: still changing)."""
    results = []
    for (source, layer, quantity), points in quantity_series(rows).items():
        if quantity in NOT_CORRELATED or len(points) < 3:
            continue
        steps, values = zip(*points, strict=True)
        step = flattening_step(list(steps), list(values))
        results.append({"source": source, "layer": layer, "quantity": quantity, "flattening_step": step})
    return results


#: A layer "moved" at a checkpoint where its diagram drift reached this many times the median drift of the
#: checkpoints before it (at least `BEFORE` of them): a change that lasts is found where it starts.
MOVED = 3.0
BEFORE = 2
#: The quantities that follow a loss named one by one (the others counted).
NAMED = 3


def _moves(series: Mapping[Any, Any], layers: Sequence[str]) -> list[str]:
    """The layer that moved first (diagram drift >= `MOVED` x the median before it), the next ones, or none."""
    moves = []
    for layer in layers:
        drift = series.get(("features", layer, "diagram_drift"), [])
        if len(drift) < 2:
            continue
        for i in range(BEFORE, len(drift)):
            median = float(np.median([v for _, v in drift[:i]]))
            step, value = drift[i]
            if median > 0 and value >= MOVED * median:
                moves.append((step, layer, value, median))
                break
    moves.sort()
    if moves:
        step, layer, value, median = moves[0]
        text = f"{layer} moved{' first' if len(moves) > 1 else ''} at step {step}: its diagram drift reached "
        text += f"{value:.3g}, {value / median:.1f}x the median of the checkpoints before it ({median:.3g})."
        if len(moves) > 1:
            text += " Then " + ", ".join(f"{m[1]} at step {m[0]}" for m in moves[1:4]) + "."
        return [text]
    if layers:
        return [
            f"No layer's diagram drift reached {MOVED:g}x the median of the checkpoints before it: no checkpoint "
            "stands out."
        ]
    return []


def _following(correlations: Sequence[Mapping[str, Any]]) -> str:
    """Every quantity that follows a loss (Spearman, p < 0.05; the strongest `NAMED` named), or that none does."""
    found = [c for c in correlations if c.get("rho") is not None and c.get("p_value") is not None]
    following = sorted((c for c in found if c["p_value"] < 0.05), key=lambda c: (c["p_value"], -abs(c["rho"])))
    if not correlations:
        return "No loss was found in the checkpoints, so nothing is compared with one."
    if following:
        named = "; ".join(
            f"{c['quantity'].replace('_', ' ')} at {c['layer']} ({c['loss']}, Spearman rho = {c['rho']:+.2f}, "
            f"p = {c['p_value']:.2g}, {c['n']} checkpoints)"
            for c in following[:NAMED]
        )
        more = f"; and {len(following) - NAMED} more (analysis.json)" if len(following) > NAMED else ""
        count = "1 quantity follows" if len(following) == 1 else f"{len(following)} quantities follow"
        return f"{count} a loss at p < 0.05: {named}{more}."
    n = max((c.get("n", 0) for c in correlations), default=0)
    return f"No quantity follows a loss at p < 0.05 over {n} checkpoints."


def findings(rows: Sequence[Mapping[str, Any]], correlations: Sequence[Mapping[str, Any]]) -> list[str]:
    r"""What the analysis found, in a few sentences with their numbers.

    Which layer moved first (its diagram drift at least `MOVED` times the median of the checkpoints before
    it, so that a change that lasts is found where it starts) and when, how far its effective rank went from the
    first checkpoint to the last, and every quantity that follows a loss (Spearman, p < 0.05; the strongest
    `NAMED` named, by p), or that none does.

    Examples:
        >>> rows = [{"source": "features", "layer": "h.0", "step": s, "diagram_drift": d, "effective_rank": r}
        ...         for s, d, r in [(0, None, 30.0), (10, 0.1, 29.0), (20, 0.1, 28.0), (30, 0.9, 5.0)]]
        >>> print("\n".join(findings(rows, [])))
        h.0 moved at step 30: its diagram drift reached 0.9, 9.0x the median of the checkpoints before it (0.1).
        The effective rank of h.0 went from 30 at step 0 to 5 at step 30 (-83 %).
        No loss was found in the checkpoints, so nothing is compared with one.
    """
    series = quantity_series(rows)
    layers = list(dict.fromkeys(layer for source, layer, _ in series if source == "features"))
    said: list[str] = []
    said += _moves(series, layers)
    for layer in layers[:3]:
        rank = series.get(("features", layer, "effective_rank"), [])
        if len(rank) >= 2 and rank[0][1] > 0:
            (s0, r0), (s1, r1) = rank[0], rank[-1]
            said.append(
                f"The effective rank of {layer} went from {r0:.3g} at step {s0} to {r1:.3g} at step {s1} "
                f"({100 * (r1 - r0) / r0:+.0f} %)."
            )
    said.append(_following(correlations))
    return said
