"""The end-of-run summary: what the checks found and what was done about it, in a few lines.

Printed once on rank 0 at the end of training (``output.summary``);
[`TopoMonitor.summary`][topocallbacks.TopoMonitor.summary] gives it any time.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .check import CheckRecord, InterventionRecord
from .pipeline import CheckPipeline, LayeredPipeline
from .settings import MonitorSettings

__all__ = ["cost_line", "last_records_of", "overhead_of", "report_of", "summary_text", "with_layer_moves"]


def summary_text(
    history: Sequence[CheckRecord | InterventionRecord],
    settings: MonitorSettings,
    *,
    layer: tuple[str, ...] | None = None,
    layers: Sequence[str] = (),
    snapshots: str | None = None,
) -> str:
    """The checks, the warnings and interventions with their reasons, and where the outputs went.

    Args:
        history: the monitor's records.
        settings: the monitor's settings.
        layer: the watched layer (the module name its pattern resolved to, when known).
        layers: several watched layers, the primary one first (empty: one layer).
        snapshots: the rollback snapshots kept, described (None: none).

    Examples:
        >>> print(summary_text([], MonitorSettings()))
        topocallbacks: no check ran; no warning and no intervention.
    """
    checks = [r for r in history if isinstance(r, CheckRecord)]
    done = [r for r in history if isinstance(r, InterventionRecord)]
    watched = f" at layer {layer[0] if len(layer) == 1 else list(layer)}" if layer else ""
    if layers:
        watched = f" at {len(layers)} layers ({', '.join(layers)}; primary {layers[0]})"
        checks = [r for r in checks if r.layer == layers[0]]
    if not checks:
        head = f"topocallbacks: no check ran{watched}"
    else:
        span = f"step {checks[0].step}" if len(checks) == 1 else f"steps {checks[0].step}-{checks[-1].step}"
        plural = "check" if len(checks) == 1 else "checks"
        head = f"topocallbacks: {len(checks)} {plural} ({span}){watched} of {settings.index.name}"
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
    cost = cost_line(checks, settings.schedule.overhead_budget)
    if cost:
        lines.append(cost)
    output = settings.output
    if output.history_path is not None:
        lines.append(f"  history: {output.history_path}")
    if output.tensorboard_dir is not None:
        lines.append(f"  TensorBoard: {output.tensorboard_dir}")
    if snapshots is not None:
        lines.append(f"  rollback snapshots: {snapshots}")
    return "\n".join(lines)


def overhead_of(checks: Sequence[CheckRecord]) -> tuple[float, list[float]] | None:
    """The monitor's time over the training's own time summed over the measured intervals, and each one's share.

    The first check of the run (no interval before it) counts too: its probe pass and its evaluation or wait in the
    loop are the monitor's time.
    """
    shares: list[float] = []
    train: list[float] = []  # each interval's training time (ms)
    for previous, r in itertools.pairwise(checks):
        if r.overhead is not None and r.step_ms is not None:
            shares.append(r.overhead)
            train.append(r.step_ms * (r.step - previous.step))
    if not shares:
        return None
    first = checks[0].probe_ms + checks[0].wait_ms if checks[0].overhead is None else 0.0
    return (first + sum(share * t for share, t in zip(shares, train, strict=True))) / max(sum(train), 1e-12), shares


def cost_line(checks: Sequence[CheckRecord], budget: float | None) -> str | None:
    """What the monitor cost the training loop: the median interval's share first, then in all.

    The median interval is the headline: in a short run the first check (a worker starting, numba's kernels, the
    first probe pass) can outweigh every later one. In all: the monitor's time over the training's own time, summed
    over the intervals between checks, with the first check's time in the loop (the callback's set-up before it is
    not in it), which is said in milliseconds.

    Examples:
        >>> from topocallbacks.check import Decision
        >>> checks = [CheckRecord(step=s, status="ok", index="diagram_drift", index_value=0.0, n_points=512,
        ...                       decision=Decision(action="none", reason="", step=s), check_ms=40.0, wait_ms=40.0,
        ...                       probe_ms=3.0, overhead=share, step_ms=ms)
        ...           for s, share, ms in [(0, None, None), (10, 0.03, 100.0), (20, 0.01, 300.0)]]
        >>> print(cost_line(checks, 0.02))
          monitor cost: 2.0 % of the training time in the median interval (last 1.0 %, 2 intervals; budget 2.0 %)
          in all: 2.6 % of the training time, the first check's 43 ms included
          per check (medians): probe 3 ms, evaluation 40 ms, the loop waited 40 ms
    """
    measured = overhead_of(checks)
    if measured is None:
        return None
    total, shares = measured
    median = statistics.median
    goal = "no budget" if budget is None else f"budget {100 * budget:.1f} %"
    first = checks[0].probe_ms + checks[0].wait_ms if checks[0].overhead is None else 0.0
    return (
        f"  monitor cost: {100 * median(shares):.1f} % of the training time in the median interval (last "
        f"{100 * shares[-1]:.1f} %, {len(shares)} intervals; {goal})\n  in all: {100 * total:.1f} % of the training "
        f"time, the first check's {first:.0f} ms included\n  per check (medians): probe "
        f"{median(r.probe_ms for r in checks):.0f} ms, evaluation {median(r.check_ms for r in checks):.0f} ms, "
        f"the loop waited {median(r.wait_ms for r in checks):.0f} ms" + _plan_lines(checks, budget, median(shares))
    )


def _plan_lines(checks: Sequence[CheckRecord], budget: float | None, median_share: float) -> str:
    """The budget's plan (what it chose, and the ``plan=`` that reruns it), and a line when it was not kept."""
    plans = [r.plan for r in checks if r.plan is not None]
    if not plans:
        return ""
    last = plans[-1]
    text = f"\n  plan at step {last.at_step}: {last.describe()}; rerun with plan={last.settings}"
    if budget is None:
        return text
    if not last.met:
        return text + f"\n  budget not kept: even this plan was predicted to cost {100 * last.predicted:.1f} %"
    if median_share > budget:
        return text + (
            f"\n  budget not kept: the plan was predicted to cost {100 * last.predicted:.1f} %; the median interval "
            "measured more"
        )
    return text


def with_layer_moves(past: Sequence[CheckRecord], records: list[CheckRecord]) -> CheckRecord:
    """The deciding record (the last of a check's), its reason completed with the layers' moves.

    When several layers are watched and the check acted or was held back: which layer moved first and by how much,
    each layer's watched index against its own past checks (the report's diagnosis), the one that moved most first.
    """
    decision = records[-1]
    if len(records) < 2 or not (decision.decision.fired or decision.decision.held_back is not None):
        return decision
    from .report import format_zscore, layer_moves  # the report's diagnosis, not a second copy of it

    moves = layer_moves(decision.step, [*past, *records])
    if not moves:
        return decision

    def described(move: Any) -> str:
        z = "" if move.z is None else f", {format_zscore(move.z)}"
        return f"{move.name} {move.before:.4g} -> {move.after:.4g} ({move.change:+.4g}{z})"

    text = f"; layer that moved first: {described(moves[0])}"
    if len(moves) > 1:
        text += "; then " + ", ".join(described(move) for move in moves[1:])
    return dataclasses.replace(
        decision, decision=dataclasses.replace(decision.decision, reason=decision.decision.reason + text)
    )


def report_of(
    history: Sequence[CheckRecord | InterventionRecord],
    pipeline: CheckPipeline | LayeredPipeline,
    out_dir: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> Path:
    """The HTML report of ``history`` with the last diagrams of ``pipeline`` (the primary layer's); its path."""
    from .report import write_report

    primary = pipeline.primary if isinstance(pipeline, LayeredPipeline) else None
    ok = (r for r in reversed(history) if isinstance(r, CheckRecord) and r.ok and r.layer == primary)
    last = next(ok, None)  # the diagrams drawn are the primary layer's
    diagrams = pipeline.last_diagrams  # those of the last check that was not diverged
    key: Any = None if last is None else last.step if last.layer is None else (last.step, last.layer)
    drawn = None if last is None or diagrams is None else {key: diagrams}
    return write_report(list(history), out_dir, diagrams=drawn, title=title)


def last_records_of(history: Sequence[CheckRecord | InterventionRecord], pipeline: Any) -> list[CheckRecord]:
    """The latest check's records: one, or one per layer when several are watched (the primary layer's last)."""
    checks = [r for r in history if isinstance(r, CheckRecord)]
    same = [r for r in checks if r.step == checks[-1].step] if checks else []
    return same[-len(pipeline.layers) :] if isinstance(pipeline, LayeredPipeline) else same[-1:]
