"""A self-contained HTML report of a monitor's history: what the index did, where it warned, and hints on why.

`write_report` reads a history (the JSONL file a monitor or callback writes with ``history_path=``, or its
records) and writes ``index.html`` and its PNG figures into one folder: the watched index and the paper's
composite with its components over the steps, warnings and interventions marked, a layer x step heatmap when the
records name several layers, persistence diagrams at a few checks when they are given, and for each warning or
intervention a short diagnosis (which component or layer moved the most against its recent history, what such a
move often means, and what people try). The page has no script and loads nothing from the network; figures are
drawn with matplotlib's Agg renderer and referenced by relative paths.

Command line: ``topocallbacks report HISTORY.jsonl --out DIR``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .check import CheckRecord, InterventionRecord, record_from_dict
from .exceptions import InputError
from .functional.topology import _as_diagram
from .policy import trailing_zscore
from .reporting_kit import (
    Figures,
    Section,
    add_legend,
    escape_html,
    figure_html,
    format_number,
    new_figure,
    output_folder,
    page_html,
    save_figures,
    sections_html,
)
from .settings import COMPONENTS
from .sinks import JsonlSink

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Move", "format_zscore", "layer_moves", "write_report", "write_report_page"]

Record = CheckRecord | InterventionRecord
DiagramKey = tuple[int, str | None]
Diagrams = dict[DiagramKey, list[NDArray[np.float64]]]

#: Checks before an event that its diagnosis compares with (the default policy's z-score window).
RECENT = 10
#: Layers drawn one composite figure each; beyond, the heatmaps carry them.
MAX_COMPOSITE_FIGURES = 6
#: Events given a full diagnosis; the rest are listed in the table only.
MAX_DIAGNOSED = 50
#: Checks listed in the table at the end of the page.
MAX_TABLE_ROWS = 2000
#: A component change below this (the components live in [0, 1]) counts as "did not move".
SMALL_CHANGE = 0.02
#: Another component that moved by at least this much gets its own line (and its remedies) in a diagnosis.
ALSO_CHANGE = 0.1

_ACTION_STYLE: dict[str, tuple[str, str]] = {
    "warn": ("#d99a00", "^"),
    "lower_lr": ("#e0620d", "v"),
    "stop": ("#c0152f", "X"),
    "rollback": ("#7b2cbf", "D"),
}
_OTHER_STYLE = ("#555555", "o")
_COMPONENT_COLOUR = {"betti": "#1f77b4", "entropy": "#2ca02c", "anisotropy": "#9467bd"}
_INDEX_LABEL = {
    "diagram_drift": "diagram drift (W1, H0 + H1)",
    "paper": "the paper's Collapse Index",
    "rankme": "effective rank (RankMe)",
}
_COMPONENT_LABEL = {
    "betti": "Betti term 1 - β1/β0",
    "entropy": "entropy term 1 - persistence entropy",
    "anisotropy": "anisotropy",
}

_MEANING: dict[tuple[str, int], str] = {
    ("anisotropy", 1): (
        "Variance is concentrating in fewer directions: the features span fewer dimensions than before "
        "(dimensional collapse). It also rises, harmlessly, when a classifier's features organise around its few "
        "classes."
    ),
    ("anisotropy", -1): "Variance spread over more directions: the features use more dimensions than before.",
    ("entropy", 1): (
        "The persistence bars became uneven: a few long bars dominate, i.e. the points gather into a few tight "
        "groups separated by gaps (class clusters forming, or points piling onto a few locations)."
    ),
    ("entropy", -1): "The persistence bars became more even: the points spread out more uniformly.",
    ("betti", 1): (
        "Loops at the scale ε disappeared relative to the components (β1/β0 fell). A Betti ratio at one scale "
        "saturates (at 0 or 1) much of the time, so on its own it is weak evidence."
    ),
    ("betti", -1): (
        "Loops appeared at the scale ε relative to the components (β1/β0 rose): at that scale the cloud got "
        "holes, e.g. points spreading onto a ring or a shell, or clusters bridged by thin chains."
    ),
}
_MEANING_DRIFT = (
    "The persistence diagrams changed between consecutive checks while no component of the composite moved much: "
    "the points rearranged without changing their overall shape (fast learning, a schedule change, or the start "
    "of a reorganisation)."
)
_MEANING_DIVERGED = "The features held NaN or Inf: the network diverged numerically at or before this step."

_REMEDIES: dict[str, tuple[str, ...]] = {
    "anisotropy": (
        "lower the learning rate (a cut such as the policy's lower_lr) and see whether the anisotropy comes back down",
        "add or lengthen learning-rate warm-up: large early steps are a common cause of dimensional collapse",
        "use moderate weight decay (too much can itself shrink directions)",
        "normalisation layers (BatchNorm in the projector, LayerNorm) keep the feature scales in check",
    ),
    "entropy": (
        "check the task metric first: clusters forming is what a classifier is meant to do",
        "if the metric got worse: lower the learning rate, or add warm-up",
        "label smoothing or mixup keep class clusters from shrinking to points",
    ),
    "betti": (
        "treat the Betti term as weak evidence: look at the other components and at the loss",
        "if the loss moved too: lower the learning rate, or clip gradients",
    ),
    "drift": (
        "compare with the loss at the same step: a reorganisation during fast, healthy learning looks the same",
        "if the loss spiked as well: lower the learning rate, clip gradients (e.g. max norm 1.0), lengthen warm-up",
        "if it coincides with a schedule change (end of warm-up, a restart), it may be expected",
    ),
    "diverged": (
        "clip gradients (e.g. max norm 1.0)",
        "lower the learning rate, or add warm-up",
        "with fp16: use loss scaling, or train in bf16",
        "look for NaN or Inf in the inputs and the loss (a log of 0, a division by 0)",
        "resume from the last good checkpoint (a stop saves one by default)",
    ),
}

#: Hints for self-supervised and contrastive training, given only where the training loss kept falling while the
#: features concentrated (their collapse lowers their loss; a supervised model's collapse seldom does).
_SELF_SUPERVISED_REMEDIES: tuple[str, ...] = (
    "if this is self-supervised or contrastive training, a falling loss while the features concentrate is the "
    "signature of collapse: keep the stop-gradient and the predictor (SimSiam, BYOL), add a variance/covariance term "
    "(VICReg, Barlow Twins), or check that the negatives and the temperature are what you meant",
)

#: What an absolute sentinel's finding means, and the hints for it (`topocallbacks.functional.sentinels`).
_SENTINEL_MEANING: dict[str, str] = {
    "constant": (
        "An absolute sentinel found the features constant: every probe input gives the same features, so the "
        "watched layer's units are dead (they no longer respond to their input). Common causes: ReLUs that died after "
        "a step too large (every pre-activation pushed below zero), a layer whose weights became zero (weight decay, "
        "a bug, a bad load), or a layer that ignores its input."
    ),
    "one_direction": (
        "An absolute sentinel found the features on one line: every probe input maps to a multiple of one vector, "
        "so the watched layer's output has collapsed to rank one (a weight matrix squeezed to one direction, or "
        "units that all compute the same thing)."
    ),
    "one_point": (
        "An absolute sentinel found every pair of features within ε, the monitor's scale: at that scale the probe "
        "inputs have become one point (they shrank towards one location)."
    ),
}
_SENTINEL_REMEDIES: dict[str, tuple[str, ...]] = {
    "constant": (
        "resume from the last healthy state (the default rule's rollback, or a stop that restores its snapshot)",
        "lower the learning rate or add warm-up: one large step can kill every unit of a layer",
        "use LeakyReLU or GELU, or initialise biases at zero or slightly positive, so units can come back",
        "check that the watched layer is the one you meant (`layer=`) and that its weights are finite and not zero "
        "after loading",
    ),
    "one_direction": (
        "resume from the last healthy state (the default rule's rollback, or a stop that restores its snapshot)",
        "lower the learning rate or add warm-up, and use moderate weight decay",
        "look at the layer's weight matrix: its singular values show whether it was squeezed to rank one",
    ),
    "one_point": (
        "resume from the last healthy state (the default rule's rollback, or a stop that restores its snapshot)",
        "lower the learning rate or add warm-up",
        "check the features' scale over the run: normalisation layers keep it from shrinking to nothing",
    ),
}

#: At most this many hints per diagnosis, the most specific first.
MAX_HINTS = 5

#: Remedies chosen by what the training loss did at the check (its mean since the check before against the median
#: of the checks before): it jumped with the features, or it kept falling (a reorganisation of healthy learning).
_LOSS_REMEDIES: dict[str, tuple[str, ...]] = {
    "loss_jumped": (
        "the loss jumped with the features: a bad batch run or a learning-rate spike looks like this; roll back past "
        "it and skip the batches that caused it (the default rule's rollback with rollback_skip), then lower the "
        "learning rate",
        "clip gradients (e.g. max norm 1.0) so that one bad batch cannot move the weights that far",
    ),
    "loss_fell": (
        "the loss kept falling at this check: a reorganisation during healthy learning looks like this; watch the "
        "task metric before acting (the default rule waits for the loss to confirm)",
    ),
}

#: A loss at this many times the median of the checks before counts as a jump.
LOSS_JUMP = 2.0

_CAVEAT = (
    "These hints say what moved and what such a move often means; they are not a finding about the cause. The "
    "package's own evaluation (README, 'Does it warn early?') found no feature index that warns reliably before "
    "the loss or the accuracy, so read them next to your loss curve."
)

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
.event { border-left: 4px solid #d99a00; padding: 0.2em 1em; margin: 1em 0; background: #fffbf0; }
.event.stop, .event.diverged { border-color: #c0152f; background: #fff4f5; }
.event.lower_lr { border-color: #e0620d; }
.note { color: #555; font-size: 0.95em; }
code { background: #f4f4f4; padding: 0 0.2em; }
"""


# --- reading the history ------------------------------------------------------------------------------------------


def _load_history(history: Any) -> tuple[list[Record], str]:
    """Typed records and a description of where they came from."""
    if isinstance(history, (str, os.PathLike)):
        path = Path(history)
        if not path.is_file():
            raise InputError(f"`history` {str(path)!r} does not exist or is not a file")
        raw: list[Any] = JsonlSink.read(path)
        source = str(path)
        if not raw:
            raise InputError(f"`history` {str(path)!r} holds no records (an empty file, or no complete JSON line)")
    elif isinstance(history, Sequence) and not isinstance(history, (bytes, bytearray)):
        raw = list(history)
        source = f"{len(raw)} records"
        if not raw:
            raise InputError("`history` is an empty list of records: there is nothing to report")
    else:
        raise InputError(
            f"`history` must be the path of a history JSONL file or a list of records, got {type(history).__name__}"
        )
    records: list[Record] = []
    for i, item in enumerate(raw):
        if isinstance(item, (CheckRecord, InterventionRecord)):
            records.append(item)
            continue
        if not isinstance(item, Mapping):
            raise InputError(f"`history[{i}]` must be a record or its dict, got {type(item).__name__}")
        try:
            records.append(record_from_dict(item))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"`history` record {i} of {source} is not a check or an intervention record ({exc!r}); "
                f"keys: {sorted(map(str, item))}"
            ) from exc
    return records, source


def _load_diagrams(diagrams: Any) -> Diagrams:
    """Validated diagrams by ``(step, layer)`` (a plain step key means the one layer, None)."""
    if diagrams is None:
        return {}
    if not isinstance(diagrams, Mapping):
        raise InputError(
            f"`diagrams` must be a mapping of step -> list of (k, 2) arrays, got {type(diagrams).__name__}"
        )
    result: Diagrams = {}
    for key, value in diagrams.items():
        if (
            isinstance(key, tuple)
            and len(key) == 2
            and _is_step(key[0])
            and (key[1] is None or isinstance(key[1], str))
        ):
            normalised: DiagramKey = (int(key[0]), key[1])
        elif _is_step(key):
            normalised = (int(key), None)
        else:
            raise InputError(f"`diagrams` keys must be steps (int) or (step, layer) pairs, got {key!r}")
        if isinstance(value, np.ndarray) or not isinstance(value, Sequence) or not value:
            raise InputError(f"`diagrams[{key!r}]` must be a non-empty list of (k, 2) arrays, one per dimension")
        try:
            result[normalised] = [_as_diagram(d) for d in value]
        except InputError as exc:
            raise InputError(f"`diagrams[{key!r}]`: {exc}") from exc
    return result


def _is_step(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# --- what happened ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Move:
    """How far one quantity moved at an event against its recent history.

    Attributes:
        name: the quantity (a component, a layer, or ``"loss"``).
        before: the median of its recent history (at most `RECENT` finite values; the value itself when none).
        after: its value at the event.
        history: how many values the median was taken over.
        z: the robust z-score of ``after`` against them, or None with fewer than 3.
    """

    name: str
    before: float
    after: float
    history: int
    z: float | None

    @property
    def change(self) -> float:
        """``after - before``."""
        return self.after - self.before


def format_zscore(z: float | None) -> str:
    """A `Move`'s robust z-score in words, e.g. ``"z = +3.2 robust SDs"``.

    None says there was too little history for one; beyond 1000 in size it says the recent history was flat.
    """
    if z is None:
        return "too little history for a z-score"
    if abs(z) > 1000:
        return f"z {'>' if z > 0 else '<'} {'' if z > 0 else '-'}1000: its recent history was flat"
    return f"z = {z:+.1f} robust SDs"


@dataclasses.dataclass(frozen=True)
class _Event:
    """A warning or action decided at a check, an intervention, or a diverged check, with its diagnosis."""

    step: int
    kind: str  # "decision", "intervention" or "diverged"
    action: str
    reason: str
    layer: str | None
    check: CheckRecord | None
    detail: str | None = None
    components: tuple[Move, ...] = ()
    layers: tuple[Move, ...] = ()
    loss: Move | None = None

    @property
    def sentinel(self) -> str | None:
        """The absolute sentinel that held at the event's check, or None.

        One of ``"constant"``, ``"one_direction"`` or ``"one_point"`` (`SentinelValues.holding`).
        """
        found = None if self.check is None else self.check.sentinels
        return found.holding[0] if found is not None and found.holding else None

    @property
    def top(self) -> str:
        """What the diagnosis says moved: a component, ``"drift"`` (no component moved much) or ``"diverged"``."""
        if self.kind == "diverged" or (self.check is not None and not self.check.ok):
            return "diverged"
        if not self.components or abs(self.components[0].change) < SMALL_CHANGE:
            return "drift"
        return self.components[0].name


def _ok(checks: Sequence[CheckRecord]) -> list[CheckRecord]:
    return [c for c in checks if c.ok and c.report is not None]


def _move(name: str, past: Sequence[float], value: float) -> Move:
    recent = [v for v in past if math.isfinite(v)][-RECENT:]
    before = statistics.median(recent) if recent else value
    z = trailing_zscore(recent, value, direction=1, window=RECENT) if len(recent) >= 3 else None
    return Move(name=name, before=float(before), after=float(value), history=len(recent), z=z)


def _component_moves(check: CheckRecord, checks: Sequence[CheckRecord]) -> tuple[Move, ...]:
    """Each component of ``check``'s layer against that layer's checks before it, largest change first."""
    if check.report is None:
        return ()
    past = [c for c in _ok(checks) if c.layer == check.layer and c.step < check.step]
    moves = []
    for name in COMPONENTS:
        history = [c.report.components[name] for c in past if c.report is not None]
        moves.append(_move(name, history, check.report.components[name]))
    return tuple(sorted(moves, key=lambda m: -abs(m.change)))


def layer_moves(step: int, checks: Sequence[CheckRecord]) -> tuple[Move, ...]:
    """Each layer checked at ``step``: its watched index (its CI when the index has no value) against its past.

    Ordered by the robust z-score when every layer has one (indices of different layers have different scales),
    else by the change of the composite (which lives in [0, 1] for every layer).
    """
    at_step = [c for c in _ok(checks) if c.step == step]
    if len({c.layer for c in at_step}) < 2:
        return ()
    moves = []
    for check in at_step:
        past = [c for c in _ok(checks) if c.layer == check.layer and c.step < step]
        if check.index_value is not None:
            history = [c.index_value for c in past if c.index_value is not None]
            moves.append(_move(str(check.layer), history, check.index_value))
        elif check.report is not None:
            moves.append(_move(str(check.layer), [c.report.ci for c in past if c.report is not None], check.report.ci))
    if all(m.z is not None for m in moves):
        return tuple(sorted(moves, key=lambda m: -abs(m.z or 0.0)))
    return tuple(sorted(moves, key=lambda m: -abs(m.change)))


def _related_check(intervention: InterventionRecord, checks: Sequence[CheckRecord]) -> CheckRecord | None:
    """The check an intervention most likely followed.

    A fired check of the same action at its step, else any fired check at its step, else the latest fired check of
    the same action before it, else the latest check before it.
    """
    before = [c for c in checks if c.step <= intervention.step]
    at_step = [c for c in before if c.decision.fired and intervention.step in (c.step, c.applied_step)]
    same = [c for c in at_step if c.decision.action.value == intervention.action]
    earlier = [c for c in before if c.decision.action.value == intervention.action]
    for candidates in (same, at_step, earlier, before):
        if candidates:
            return candidates[-1]
    return None


def _loss_move(check: CheckRecord | None, checks: Sequence[CheckRecord]) -> Move | None:
    """The training loss at ``check`` against the checks of its layer before it, or None (no loss recorded)."""
    if check is None or check.loss is None or not math.isfinite(check.loss):
        return None
    past = [c.loss for c in checks if c.layer == check.layer and c.step < check.step and c.loss is not None]
    return _move("loss", past, check.loss) if past else None


def _events(checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord]) -> list[_Event]:
    """Every fired decision, diverged check and intervention, with its diagnosis, in step order."""
    events: list[_Event] = []
    matched: set[int] = set()
    for check in checks:
        action = check.decision.action.value
        if check.ok and action == "none":
            continue
        detail = None
        for i, intervention in enumerate(interventions):
            same_step = intervention.step in (check.step, check.applied_step)
            if i not in matched and same_step and intervention.action == action:
                matched.add(i)
                detail = intervention.detail
                break
        events.append(
            _Event(
                step=check.step,
                kind="decision" if check.ok else "diverged",
                action=action,
                reason=check.decision.reason,
                layer=check.layer,
                check=check,
                detail=detail,
                components=_component_moves(check, checks),
                layers=layer_moves(check.step, checks),
                loss=_loss_move(check, checks),
            )
        )
    for i, intervention in enumerate(interventions):
        if i in matched:
            continue
        related = _related_check(intervention, checks)
        events.append(
            _Event(
                step=intervention.step,
                kind="intervention",
                action=intervention.action,
                reason=intervention.reason,
                layer=None if related is None else related.layer,
                check=related,
                detail=intervention.detail,
                components=() if related is None else _component_moves(related, checks),
                layers=() if related is None else layer_moves(related.step, checks),
                loss=_loss_move(related, checks),
            )
        )
    return sorted(events, key=lambda e: (e.step, e.kind != "decision"))


# --- figures ------------------------------------------------------------------------------------------------------


def _layers(checks: Sequence[CheckRecord]) -> list[str | None]:
    return list(dict.fromkeys(c.layer for c in checks))


def _layer_name(layer: str | None) -> str:
    return "the watched layer" if layer is None else layer


def _mark_events(
    axes: Axes, checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord], *, layer: Any = ...
) -> None:
    """Interventions as vertical lines, fired decisions as markers on the x axis, diverged checks as crosses."""
    seen: set[str] = set()

    def label(text: str) -> str:
        if text in seen:
            return "_nolegend_"
        seen.add(text)
        return text

    transform = axes.get_xaxis_transform()  # x in data, y in axes coordinates
    for intervention in interventions:
        colour, _ = _ACTION_STYLE.get(intervention.action, _OTHER_STYLE)
        axes.axvline(intervention.step, color=colour, linestyle="--", linewidth=1.2, alpha=0.8,
                     label=label(f"intervention: {intervention.action}"))  # fmt: skip
    for check in checks:
        if layer is not ... and check.layer != layer:
            continue
        if not check.ok:
            axes.plot([check.step], [0.03], transform=transform, marker="x", color="#c0152f", markersize=9,
                      linestyle="none", label=label("diverged (NaN/Inf features)"))  # fmt: skip
        elif check.decision.fired:
            action = check.decision.action.value
            colour, marker = _ACTION_STYLE.get(action, _OTHER_STYLE)
            axes.plot([check.step], [0.03], transform=transform, marker=marker, color=colour, markersize=8,
                      linestyle="none", label=label(f"decision: {action}"))  # fmt: skip


def _index_figure(checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord]) -> Figure:
    figure = new_figure()
    axes = figure.add_subplot()
    names = sorted({c.index for c in checks})
    layers = _layers(checks)
    plotted = False
    for name in names:
        for layer in layers:
            points = [(c.step, c.index_value) for c in _ok(checks) if c.layer == layer and c.index == name]
            points = [(s, v) for s, v in points if v is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            parts = [p for p in (None if len(layers) == 1 else layer, None if len(names) == 1 else name) if p]
            axes.plot(steps, values, marker=".", label=" / ".join(parts) or name)
            plotted = True
    if not plotted:
        axes.text(0.5, 0.5, "no index value in this history", transform=axes.transAxes, ha="center", color="#777")
    _mark_events(axes, checks, interventions)
    axes.set_title(f"Watched index: {', '.join(names)}")
    axes.set_xlabel("step")
    axes.set_ylabel(_INDEX_LABEL.get(names[0], names[0]) if len(names) == 1 else "index value")
    add_legend(axes)
    return figure


def _score_figure(checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord]) -> Figure | None:
    """The rule's view: each watched channel's score at every check, its threshold, and what was done; or None.

    The primary layer's checks only (they carry the decision). None for a history without scores (older records).
    """
    last = _layers(checks)[-1] if checks else None
    primary = [c for c in _ok(checks) if c.layer == last]
    scored: dict[str, list[tuple[int, float]]] = {}
    thresholds: dict[str, float] = {}
    for check in primary:
        decision = check.decision
        scores = decision.scores if decision.scores is not None else {"index": decision.score}
        for channel, score in scores.items():
            if score is not None and math.isfinite(score):
                scored.setdefault(channel, []).append((check.step, score))
        thresholds.update(decision.thresholds or {})
    if not scored:
        return None
    figure = new_figure()
    axes = figure.add_subplot()
    for channel, points in scored.items():
        steps, values = zip(*points, strict=True)
        (line,) = axes.plot(steps, values, marker=".", label=f"score: {channel}")
        if channel in thresholds:
            axes.axhline(thresholds[channel], color=line.get_color(), linestyle=":", linewidth=1.2,
                         label=f"threshold: {channel} ({thresholds[channel]:g})")  # fmt: skip
    _mark_events(axes, primary, interventions)
    axes.set_title("The rule's scores and thresholds (a channel holds where its score reaches its threshold)")
    axes.set_xlabel("step")
    axes.set_ylabel("score")
    add_legend(axes)
    return figure


def _loss_figure(checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord]) -> Figure | None:
    """The training loss the rule saw at each check (its mean since the check before), and what was done; or None."""
    last = _layers(checks)[-1] if checks else None
    points = [(c.step, c.loss) for c in checks if c.layer == last and c.loss is not None and math.isfinite(c.loss)]
    if not points:
        return None
    figure = new_figure()
    axes = figure.add_subplot()
    steps, values = zip(*points, strict=True)
    axes.plot(steps, values, marker=".", color="#444", label="training loss (mean since the check before)")
    if min(values) > 0 and max(values) / min(values) > 100:
        axes.set_yscale("log")
    _mark_events(axes, [c for c in checks if c.layer == last], interventions)
    axes.set_title("The training loss at the checks")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    add_legend(axes)
    return figure


def _composite_figure(
    checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord], layer: str | None
) -> Figure:
    figure = new_figure()
    axes = figure.add_subplot()
    ok = [c for c in _ok(checks) if c.layer == layer]
    steps = [c.step for c in ok]
    axes.plot(steps, [c.report.ci for c in ok if c.report is not None], color="black", linewidth=2.2, marker=".",
              label="Collapse Index (paper's weights)")  # fmt: skip
    for name in COMPONENTS:
        values = [c.report.components[name] for c in ok if c.report is not None]
        axes.plot(steps, values, color=_COMPONENT_COLOUR[name], linewidth=1.2, label=_COMPONENT_LABEL[name])
    _mark_events(axes, checks, interventions, layer=layer)
    axes.set_ylim(-0.03, 1.05)
    axes.set_title(f"Collapse Index and its components ({_layer_name(layer)})")
    axes.set_xlabel("step")
    axes.set_ylabel("value (0 = spread out, 1 = collapsed)")
    add_legend(axes)
    return figure


def _heatmap_figure(checks: Sequence[CheckRecord], *, quantity: str) -> Figure:
    """Layers x steps of the watched index (``quantity="index"``) or of the composite (``"ci"``)."""
    from matplotlib import colormaps

    layers = _layers(checks)
    steps = sorted({c.step for c in checks})
    grid = np.full((len(layers), len(steps)), np.nan)
    row, column = {layer: i for i, layer in enumerate(layers)}, {step: j for j, step in enumerate(steps)}
    for check in _ok(checks):
        value = check.index_value if quantity == "index" else None if check.report is None else check.report.ci
        if value is not None and math.isfinite(value):
            grid[row[check.layer], column[check.step]] = value
    figure = new_figure(width=9.0, height=max(2.6, 0.9 + 0.32 * len(layers)))
    axes = figure.add_subplot()
    colour_map = colormaps["viridis"].with_extremes(bad="#dddddd")
    image = axes.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=colour_map)
    every = max(1, math.ceil(len(steps) / 12))
    axes.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]])
    axes.set_yticks(range(len(layers)), [_layer_name(layer) for layer in layers], fontsize="small")
    names = sorted({c.index for c in checks})
    label = ", ".join(names) if quantity == "index" else "Collapse Index"
    colourbar = figure.colorbar(image, ax=axes)
    colourbar.set_label(label)
    axes.set_title(f"{'Watched index' if quantity == 'index' else 'Collapse Index'} by layer and step (grey: no value)")
    axes.set_xlabel("step")
    axes.set_ylabel("layer")
    return figure


def _chosen_diagrams(diagrams: Diagrams, events: Sequence[_Event]) -> list[DiagramKey]:
    """Up to four checks: the first, the last, and those nearest to the first two events."""
    keys = sorted(diagrams, key=lambda k: (k[0], "" if k[1] is None else k[1]))
    steps = sorted({k[0] for k in keys})
    wanted: list[tuple[int, str | None]] = [(steps[0], None)]
    for event in events[:2]:
        nearest = min(steps, key=lambda s: (abs(s - event.step), s))
        wanted.append((nearest, event.layer))
    wanted.append((steps[-1], None))
    chosen: list[DiagramKey] = []
    for step, layer in wanted:
        at_step = [k for k in keys if k[0] == step]
        key = next((k for k in at_step if k[1] == layer), at_step[0])
        if key not in chosen:
            chosen.append(key)
    return sorted(chosen, key=lambda k: k[0])[:4]


def _diagram_figure(diagrams: Diagrams, chosen: Sequence[DiagramKey]) -> Figure:
    figure = new_figure(width=3.3 * len(chosen) + 0.6, height=3.6)
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, key in enumerate(chosen):
        axes = figure.add_subplot(1, len(chosen), i + 1)
        bars = diagrams[key]
        finite = [d[np.isfinite(d[:, 1])] for d in bars]
        top = max([float(d[:, 1].max()) for d in finite if d.size] + [1e-12])
        for dim, (diagram, full) in enumerate(zip(finite, bars, strict=True)):
            colour = colours[dim % len(colours)]
            axes.scatter(diagram[:, 0], diagram[:, 1], s=10, color=colour, alpha=0.7, label=f"H{dim} ({len(diagram)})")
            essential = full[~np.isfinite(full[:, 1])]
            if essential.size:
                axes.scatter(essential[:, 0], np.full(len(essential), top * 1.08), marker="^", s=24, color=colour,
                             label=f"H{dim} never dies ({len(essential)})")  # fmt: skip
        axes.plot([0, top * 1.1], [0, top * 1.1], color="#888888", linewidth=0.8)
        step, layer = key
        axes.set_title(f"step {step}" + ("" if layer is None else f"\n{layer}"), fontsize="medium")
        axes.set_xlabel("birth")
        axes.set_ylabel("death")
        axes.legend(fontsize="x-small", loc="lower right")
    figure.suptitle("Persistence diagrams at chosen checks")
    return figure


def _figures(
    checks: Sequence[CheckRecord],
    interventions: Sequence[InterventionRecord],
    diagrams: Diagrams,
    events: Sequence[_Event],
) -> Figures:
    """Every figure of the report (each with a title and labelled axes)."""
    figures = Figures()
    figures.add(
        "index.png",
        _index_figure(checks, interventions),
        "The index the policy watches. Markers on the step axis: decisions that fired (warn, lower_lr, rollback, "
        "stop) and diverged checks; dashed lines: what was done (interventions, rollbacks and skips included).",
    )
    optional = {
        "scores.png": (
            _score_figure(checks, interventions),
            "The score of each channel the rule watches (the index; the training loss and gradient norm when "
            "watched), its threshold (dotted), and the decisions and interventions (markers, dashed lines).",
        ),
        "loss.png": (
            _loss_figure(checks, interventions),
            "The training loss the rule saw at each check (the mean of the steps since the check before), with the "
            "decisions and interventions.",
        ),
    }
    for name, (figure, caption) in optional.items():
        if figure is not None:  # None: the history has no scores (older records), or no loss was passed
            figures.add(name, figure, caption)
    layers = _layers(checks)
    for i, layer in enumerate(layers[:MAX_COMPOSITE_FIGURES]):
        figures.add(
            f"composite_{i}.png",
            _composite_figure(checks, interventions, layer),
            f"The paper's composite and its three components for {_layer_name(layer)}; each component lies in "
            "[0, 1] and higher means more collapsed.",
        )
    if len(layers) > 1:
        figures.add(
            "heatmap_index.png",
            _heatmap_figure(checks, quantity="index"),
            "The watched index of every layer at every check (grey: no value: the first check of a drift, a "
            "diverged check, or a layer not checked at that step).",
        )
        figures.add("heatmap_ci.png", _heatmap_figure(checks, quantity="ci"), "The composite by layer and step.")
    if diagrams:
        chosen = _chosen_diagrams(diagrams, events)
        figures.add(
            "diagrams.png",
            _diagram_figure(diagrams, chosen),
            "H0 (components) and H1 (loops) persistence diagrams: each point is a feature born at one scale and "
            "dead at another; points far from the diagonal persist longest.",
        )
    return figures


# --- the page -----------------------------------------------------------------------------------------------------


def _also_moved(event: _Event) -> list[Move]:
    """Components besides the top one that moved by at least `ALSO_CHANGE`."""
    if event.top in ("drift", "diverged"):
        return []
    return [m for m in event.components[1:] if abs(m.change) >= ALSO_CHANGE]


def _remedies(event: _Event) -> list[str]:
    """The hints that fit the finding, at most `MAX_HINTS`, the most specific first.

    A sentinel's own hints; else what the loss did, then the top mover's, then the other movers'. A loss that kept
    falling replaces the generic hints of a drift (nothing points at a fault) and, where the features concentrated,
    adds the self-supervised hint; a loss that jumped puts the hints for a spike first.
    """
    if event.sentinel is not None and event.top != "diverged":
        return list(_SENTINEL_REMEDIES[event.sentinel][:MAX_HINTS])
    keys = list(dict.fromkeys([event.top, *(m.name for m in _also_moved(event))]))
    loss, hints = event.loss, list[str]()
    if loss is not None and event.top != "diverged":
        if loss.before > 0 and loss.after >= LOSS_JUMP * loss.before:
            hints += _LOSS_REMEDIES["loss_jumped"]
        elif loss.after < loss.before:
            hints += _LOSS_REMEDIES["loss_fell"]
            if {"anisotropy", "entropy"} & set(keys):
                hints += _SELF_SUPERVISED_REMEDIES
            keys = [k for k in keys if k != "drift"]
    return list(dict.fromkeys([*hints, *(r for key in keys for r in _REMEDIES[key])]))[:MAX_HINTS]


def _what_moved_html(event: _Event) -> list[str]:
    """What moved at the event's check (a divergence, a sentinel or the components) and what it often means."""
    parts: list[str] = []
    top = event.top
    history = event.components[0].history if event.components else 0
    if top == "diverged":
        parts.append(f"<p><b>What moved:</b> {escape_html(_MEANING_DIVERGED)}</p>")
    elif event.sentinel is not None:
        parts.append(
            f"<p><b>Sentinel ({escape_html(event.sentinel)}):</b> {escape_html(_SENTINEL_MEANING[event.sentinel])}</p>"
        )
    elif event.components and history == 0:
        parts.append("<p><b>What moved:</b> this is the layer's first check: there is nothing to compare with.</p>")
    elif event.components:
        first = event.components[0]
        moves = "; ".join(
            f"{escape_html(_COMPONENT_LABEL[m.name])} {format_number(m.after)} against a median of "
            f"{format_number(m.before)} ({m.change:+.3f}; {escape_html(format_zscore(m.z))})"
            for m in event.components
        )
        if top == "drift":
            lead = f"no component moved by more than {SMALL_CHANGE} against the {history} checks before"
        else:
            lead = (
                f"<b>{escape_html(first.name)}</b> moved the most against the {history} checks before "
                f"({first.change:+.3f})"
            )
        parts.append(f"<p><b>What moved:</b> {lead}. All components: {moves}.</p>")
        meaning = _MEANING_DRIFT if top == "drift" else _MEANING[(first.name, 1 if first.change > 0 else -1)]
        parts.append(f"<p><b>What that often means:</b> {escape_html(meaning)}</p>")
        for other in _also_moved(event):
            text = _MEANING[(other.name, 1 if other.change > 0 else -1)]
            parts.append(f"<p><b>Also {escape_html(other.name)}</b> ({other.change:+.3f}): {escape_html(text)}</p>")
    return parts


def _layers_and_loss_html(event: _Event) -> list[str]:
    """Which layer moved the most at the event's step, and the training loss beside it."""
    parts: list[str] = []
    if event.layers:
        leader = event.layers[0]
        others = ", ".join(
            f"<code>{escape_html(m.name)}</code> ({escape_html(format_zscore(m.z))}, {m.change:+.3g})"
            for m in event.layers[1:]
        )
        parts.append(
            f"<p><b>Which layer:</b> of the {len(event.layers)} layers checked at this step, "
            f"<code>{escape_html(leader.name)}</code> moved the most: {format_number(leader.after)} against a median "
            f"of {format_number(leader.before)} "
            f"({leader.change:+.3g}; {escape_html(format_zscore(leader.z))}). Then {others}.</p>"
        )
    if event.loss is not None:
        loss = event.loss
        parts.append(
            f"<p><b>The training loss:</b> {format_number(loss.after)} against a median of "
            f"{format_number(loss.before)} over the {loss.history} checks before "
            f"({escape_html(format_zscore(loss.z))}).</p>"
        )
    return parts


def _diagnosis_html(event: _Event) -> str:
    parts = []
    where = "" if event.layer is None else f" on layer <code>{escape_html(event.layer)}</code>"
    if event.kind == "intervention":
        head = f"Step {event.step}: intervention <b>{escape_html(event.action)}</b>{where}"
    elif event.kind == "diverged":
        head = f"Step {event.step}: diverged check{where} (decision: <b>{escape_html(event.action)}</b>)"
    else:
        head = f"Step {event.step}: decision <b>{escape_html(event.action)}</b>{where}"
    parts.append(f"<h3>{head}</h3>")
    parts.append(f"<p><b>Why:</b> {escape_html(event.reason)}</p>")
    if event.detail:
        parts.append(f"<p><b>What was done:</b> {escape_html(event.detail)}</p>")
    if event.kind == "intervention" and event.check is not None:
        parts.append(f"<p class='note'>Diagnosed from the check at step {event.check.step}.</p>")
    top = event.top
    history = event.components[0].history if event.components else 0
    parts += _what_moved_html(event)
    parts += _layers_and_loss_html(event)
    if top == "diverged" or history or event.sentinel is not None:
        items = "".join(f"<li>{escape_html(r)}</li>" for r in _remedies(event))
        parts.append(f"<p><b>What people often try</b> (hints, not prescriptions):</p><ul>{items}</ul>")
    css = "diverged" if top == "diverged" else event.action
    return f"<div class='event {escape_html(css)}'>{''.join(parts)}</div>"


def _summary_html(checks: Sequence[CheckRecord], interventions: Sequence[InterventionRecord], source: str) -> str:
    steps = [c.step for c in checks] + [i.step for i in interventions]
    layers = _layers(checks)
    fired = [c for c in checks if c.ok and c.decision.fired]
    rows = [
        ("source", source),
        ("checks", f"{len(checks)} ({sum(not c.ok for c in checks)} diverged)"),
        ("steps", f"{min(steps)} to {max(steps)}" if steps else "–"),
        ("watched index", ", ".join(sorted({c.index for c in checks})) or "–"),
        ("layers", ", ".join(_layer_name(layer) for layer in layers) or "–"),
        ("decisions that fired", ", ".join(f"{c.decision.action.value} at {c.step}" for c in fired[:20]) or "none"),
        ("interventions", ", ".join(f"{i.action} at {i.step}" for i in interventions[:20]) or "none"),
    ]
    body = "".join(f"<tr><th>{escape_html(k)}</th><td>{escape_html(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _checks_table(checks: Sequence[CheckRecord]) -> str:
    header = ["step", "layer", "status", "index", "CI", "betti", "entropy", "anisotropy", "β0", "β1", "decision"]
    rows = []
    for check in checks[:MAX_TABLE_ROWS]:
        report = check.report
        cells = [
            str(check.step),
            _layer_name(check.layer) if check.layer is not None else "–",
            check.status,
            format_number(check.index_value),
            format_number(None if report is None else report.ci),
            *(format_number(None if report is None else report.components[name]) for name in COMPONENTS),
            "–" if report is None else str(report.betti0),
            "–" if report is None else str(report.betti1),
            check.decision.action.value,
        ]
        rows.append("<tr>" + "".join(f"<td>{escape_html(c)}</td>" for c in cells) + "</tr>")
    more = len(checks) - MAX_TABLE_ROWS
    note = f"<p class='note'>{more} more checks are in the history file.</p>" if more > 0 else ""
    head = "".join(f"<th>{escape_html(h)}</th>" for h in header)
    return f"<details><summary>All checks</summary><table><tr>{head}</tr>{''.join(rows)}</table>{note}</details>"


def write_report_page(
    records: Sequence[Record],
    out_dir: Any,
    *,
    source: str,
    diagrams: Diagrams,
    title: str | None,
    sections: Sequence[Section] = (),
    lead: Sequence[Section] = (),
) -> Path:
    """Write the run report of ``records`` into ``out_dir`` with extra sections; the path of ``index.html``.

    `write_report` after reading its arguments; the offline analysis adds its sections with it. ``lead`` goes
    after the summary table, ``sections`` after the persistence diagrams; their figures are saved next to the page.

    Args:
        records: the history's check and intervention records, in any order.
        out_dir: the folder to write into (created if needed).
        source: where the records came from, as the summary table says it.
        diagrams: the persistence diagrams to draw, by ``(step, layer)``.
        title: the page's title (None: "topocallbacks report").
        sections: sections after the report's own.
        lead: sections right after the summary table.

    Raises:
        InputError: ``title`` is not a string, ``out_dir`` is a file, or no record is a check.
    """
    if title is not None and not isinstance(title, str):
        raise InputError(f"`title` must be a string or None, got {type(title).__name__}")
    out = output_folder(out_dir)
    checks, interventions = _checks_and_interventions(records, source)
    events = _events(checks, interventions)
    figures = _figures(checks, interventions, diagrams, events)
    heading = title or "topocallbacks report"
    parts = [
        f"<h1>{escape_html(heading)}</h1>",
        _summary_html(checks, interventions, source),
        *sections_html(lead),
        *_curves_html(checks, figures),
        *_events_html(events),
        *_diagrams_html(diagrams, figures),
        *sections_html(sections),
        "<h2>Checks</h2>",
        _checks_table(checks),
    ]
    page = page_html(heading, _CSS, parts)
    save_figures(figures, out)
    for section in (*lead, *sections):
        save_figures(section.figures, out)
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def _checks_and_interventions(
    records: Sequence[Record], source: str
) -> tuple[list[CheckRecord], list[InterventionRecord]]:
    """The check records and the intervention records, each in step order.

    Raises:
        InputError: no record is a check (``source`` says where the records came from).
    """
    checks = sorted((r for r in records if isinstance(r, CheckRecord)), key=lambda c: c.step)
    interventions = sorted((r for r in records if isinstance(r, InterventionRecord)), key=lambda i: i.step)
    if not checks:
        raise InputError(f"`history` ({source}) holds no check records: there is nothing to plot")
    return checks, interventions


def _curves_html(checks: Sequence[CheckRecord], figures: Figures) -> list[str]:
    """The watched index, the composite of each layer and, with several layers, the heatmaps."""
    parts = [
        "<h2>The watched index</h2>",
        figure_html("index.png", figures.caption("index.png")),
    ]
    for name, title in (("scores.png", "The rule's scores and thresholds"), ("loss.png", "The training loss")):
        if any(name == shown for shown, _, _ in figures.items):
            parts += [f"<h2>{title}</h2>", figure_html(name, figures.caption(name))]
    parts.append("<h2>The Collapse Index and its components</h2>")
    composite = [(name, caption) for name, _, caption in figures.items if name.startswith("composite_")]
    parts.extend(figure_html(name, caption) for name, caption in composite)
    layers = _layers(checks)
    if len(layers) > MAX_COMPOSITE_FIGURES:
        parts.append(
            f"<p class='note'>{len(layers) - MAX_COMPOSITE_FIGURES} more layers are shown in the heatmaps only.</p>"
        )
    if len(layers) > 1:
        parts.append("<h2>Layers x steps</h2>")
        parts.append(figure_html("heatmap_index.png", figures.caption("heatmap_index.png")))
        parts.append(figure_html("heatmap_ci.png", figures.caption("heatmap_ci.png")))
    return parts


def _events_html(events: Sequence[_Event]) -> list[str]:
    """The diagnosis of each event (up to `MAX_DIAGNOSED`), or a line saying that nothing happened."""
    parts = ["<h2>Warnings, interventions and diagnosis</h2>"]
    if events:
        parts.append(f"<p class='note'>{escape_html(_CAVEAT)}</p>")
        parts.extend(_diagnosis_html(event) for event in events[:MAX_DIAGNOSED])
        if len(events) > MAX_DIAGNOSED:
            parts.append(f"<p class='note'>{len(events) - MAX_DIAGNOSED} more events are not diagnosed here.</p>")
    else:
        parts.append("<p>No decision fired, no check diverged and nothing was done in this history.</p>")
    return parts


def _diagrams_html(diagrams: Diagrams, figures: Figures) -> list[str]:
    """The persistence diagrams' figure, or why there is none."""
    parts = ["<h2>Persistence diagrams</h2>"]
    if diagrams:
        parts.append(figure_html("diagrams.png", figures.caption("diagrams.png")))
    else:
        parts.append(
            "<p>"
            + escape_html(
                "No persistence diagrams were given: a history file holds each check's summaries (the composite, "
                "its components, the Betti numbers), not the diagrams themselves, so none are drawn here. Pass "
                "`diagrams=` (a mapping step -> list of (k, 2) arrays) to write_report; `topocallbacks analyze` "
                "computes them from checkpoints."
            )
            + "</p>"
        )
    return parts


def write_report(
    history: str | os.PathLike[str] | Sequence[Mapping[str, Any] | CheckRecord | InterventionRecord],
    out_dir: str | os.PathLike[str],
    *,
    diagrams: Mapping[Any, Sequence[Any]] | None = None,
    title: str | None = None,
) -> Path:
    """Write an HTML report of a monitor's history into ``out_dir``: ``index.html`` and its PNG figures.

    The page shows the watched index (``index_value``) and the paper's composite (``report.ci``) with its three
    components over the steps; decisions that fired, diverged checks and interventions marked; a layer x step
    heatmap when the records name more than one layer; persistence diagrams at up to four checks when
    ``diagrams`` are given (else it says that none were); and for each warning, intervention or diverged check a
    short diagnosis: which component (and which layer) moved the most against its last 10 checks, by how much
    (the change from their median, and a robust z-score), what such a move often means, and what people often
    try. Diverged checks (no report) are listed and marked. Everything is written into ``out_dir`` (created if
    needed); the page loads nothing from the network and has no script.

    Args:
        history: the path of a history JSONL file (``history_path=`` of a monitor or callback; a torn last line is
            skipped), or a list of records (``monitor.history``) or of their dicts.
        out_dir: the folder to write into.
        diagrams: persistence diagrams to draw, ``{step: [h0, h1, ...]}`` with each a ``(k, 2)`` array of
            ``(birth, death)`` rows, or keyed by ``(step, layer)`` when several layers were watched.
        title: the page's title.

    Returns:
        The path of ``index.html``.

    Raises:
        InputError: the history file is missing or empty, a record is neither a check nor an intervention, no
            check record at all, a diagram is not ``(k, 2)``, or ``out_dir`` is a file.

    Examples:
        >>> import tempfile, numpy as np
        >>> from topocallbacks import TopoMonitor
        >>> monitor = TopoMonitor(check_every=1)
        >>> cloud = np.random.default_rng(0).normal(size=(64, 8))
        >>> for step in range(3):
        ...     _ = monitor.process(cloud * (1 + step), step)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = write_report(monitor.history, folder)
        ...     sorted(p.name for p in path.parent.iterdir())
        ['composite_0.png', 'index.html', 'index.png']
    """
    records, source = _load_history(history)
    return write_report_page(records, out_dir, source=source, diagrams=_load_diagrams(diagrams), title=title)
