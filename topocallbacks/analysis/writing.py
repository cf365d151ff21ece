"""Writing an offline analysis: ``analysis.csv``, ``analysis.json`` and the HTML report with the analysis's sections.

Everything goes into the output folder and nowhere else; the JSON has no NaN or Inf (they become null).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..report import write_report_page
from ..reporting_kit import Figures, Section, escape_html, format_number, series_figure
from .checkpoints import Checkpoint
from .evaluating import QUANTITIES, Measured
from .loading import Source
from .summaries import findings, flattening_steps, loss_correlations, quantity_series

__all__ = ["analysis_sections", "write_outputs"]

_KINDS = {"hf": "Hugging Face checkpoints", "lightning": "Lightning checkpoints", "features": "feature arrays"}


def write_outputs(
    source: Source, measured: Measured, *, title: str | None
) -> tuple[list[dict[str, Any]], Path, Path, Path]:
    """Write ``analysis.csv``, ``analysis.json`` and the report into ``source.out`` (created if needed).

    Args:
        source: what `load_source` found.
        measured: what `evaluate` measured.
        title: the report's title (default: "Offline analysis of" the folder).

    Returns:
        The correlations (as in ``analysis.json``), and the paths of the CSV, the JSON and the report's
        ``index.html``.
    """
    rows, checkpoints, out = measured.rows, source.checkpoints, source.out
    correlations, losses = loss_correlations(rows, checkpoints)
    flattening = flattening_steps(rows)
    columns = _columns(rows, losses)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "analysis.csv"
    _write_csv(csv_path, rows, columns)
    epsilons = {name: layer.epsilon for name, layer in measured.layers.items()}
    summary = _summary(source, measured, epsilons, losses)
    metadata = _metadata(
        source,
        measured,
        epsilons=epsilons,
        columns=columns,
        losses=losses,
        correlations=correlations,
        flattening=flattening,
        csv_name=csv_path.name,
    )
    json_path = out / "analysis.json"
    json_path.write_text(json.dumps(_json_ready(metadata), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    sections = analysis_sections(rows, correlations, losses, checkpoints, flattening, summary)
    report_path = write_report_page(
        measured.records,
        out,
        source=f"{summary['kind']} in {source.root}",
        diagrams=measured.diagrams,
        title=title or f"Offline analysis of {source.root.name or source.root}",
        sections=sections[1:],
        lead=sections[:1],
    )
    return correlations, csv_path, json_path, report_path


def _summary(
    source: Source, measured: Measured, epsilons: Mapping[str, float | None], losses: Sequence[str]
) -> dict[str, str]:
    """The table at the top of the report's analysis section."""
    root, checkpoints, probe = source.root, source.checkpoints, source.probe
    return {
        "folder": str(root),
        "kind": _KINDS[source.kind],
        "checkpoints": f"{len(checkpoints)} (steps {', '.join(str(c.step) for c in checkpoints[:30])})",
        "layers": ", ".join(measured.layers) + (f" (the {source.preset} preset's)" if source.preset else ""),
        "probe": "–" if probe is None else f"{len(probe)} samples ({probe.spec.source})",
        "ε per layer (first checkpoint)": ", ".join(f"{k}: {format_number(v)}" for k, v in epsilons.items()),
        "losses found": ", ".join(losses) or "none",
    }


def _columns(rows: Sequence[Mapping[str, Any]], losses: Sequence[str]) -> list[str]:
    """The CSV's columns: step, layer, source, status, checkpoint and the losses, then the quantities measured."""
    leading = ["step", "layer", "source", "status", "checkpoint", *losses]
    present = {k for row in rows for k in row}
    return leading + [q for q in QUANTITIES if q in present and q not in leading]


def _metadata(
    source: Source,
    measured: Measured,
    *,
    epsilons: Mapping[str, Any],
    columns: list[str],
    losses: list[str],
    correlations: list[dict[str, Any]],
    flattening: list[dict[str, Any]],
    csv_name: str,
) -> dict[str, Any]:
    """What ``analysis.json`` holds: the source, the settings, the columns, the correlations and the rows."""
    return {
        "version": 1,
        "path": str(source.root),
        "kind": source.kind,
        "checkpoints": [
            {"step": c.step, "path": os.path.relpath(c.path, source.root), "metrics": c.metrics}
            for c in source.checkpoints
        ],
        "layers": list(measured.layers),
        "preset": source.preset,
        "epsilon": epsilons,
        "probe": None if source.probe is None else source.probe.spec.as_dict(),
        "settings": source.settings.as_dict(),
        "columns": columns,
        "quantities": {q: QUANTITIES[q] for q in columns if q in QUANTITIES},
        "losses": losses,
        "correlations": correlations,
        "correlations_note": None if losses else "the checkpoints carry no loss or perplexity",
        "flattening": flattening,
        "rows": measured.rows,
        "files": {"csv": csv_name, "report": "index.html"},
    }


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


def _json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _or(value: Any, instead: str) -> Any:
    return instead if value is None else value


# --- the report's own sections ------------------------------------------------------------------------------------

_Series = dict[tuple[str, str, str], list[tuple[int, float]]]


def analysis_sections(
    rows: Sequence[Mapping[str, Any]],
    correlations: Sequence[Mapping[str, Any]],
    losses: Sequence[str],
    checkpoints: Sequence[Checkpoint],
    flattening: Sequence[Mapping[str, Any]],
    summary: Mapping[str, str],
) -> list[Section]:
    """The analysis's sections of the report: the overview (which goes first), the losses, geometry, weights."""
    series = quantity_series(rows)
    sections = [
        _overview_section(summary, findings(rows, correlations)),
        _loss_section(correlations, losses, checkpoints),
        _geometry_section(rows, series),
    ]
    weights = _weights_section(rows, series, flattening)
    if weights is not None:
        sections.append(weights)
    return sections


def _overview_section(summary: Mapping[str, str], found: Sequence[str]) -> Section:
    said = "".join(f"<p>{escape_html(sentence)}</p>" for sentence in found)
    table = "".join(f"<tr><th>{escape_html(k)}</th><td>{escape_html(v)}</td></tr>" for k, v in summary.items())
    links = "<p>The numbers: <a href='analysis.csv'>analysis.csv</a>, <a href='analysis.json'>analysis.json</a>.</p>"
    return Section("The offline analysis", f"{said}<table>{table}</table>{links}")


def _loss_section(
    correlations: Sequence[Mapping[str, Any]], losses: Sequence[str], checkpoints: Sequence[Checkpoint]
) -> Section:
    """The losses the checkpoints carry, and the strongest correlations with them (or why there are none)."""
    loss_figures = Figures()
    if losses:
        curves = {
            name: (
                [c.step for c in checkpoints if name in c.metrics],
                [c.metrics[name] for c in checkpoints if name in c.metrics],
            )
            for name in losses
        }
        loss_figures.add(
            "losses.png", series_figure("Loss at each checkpoint", "loss", curves), "The losses the checkpoints carry."
        )
        shown = [c for c in correlations if c["rho"] is not None][:25]
        body = (
            "<p>Spearman's rank correlation of each quantity with each loss across checkpoints (the strongest 25; "
            "all of them are in analysis.json). With few checkpoints, |ρ| must be large to mean anything: read the "
            "p-value (exact over all orderings up to 8 checkpoints) and n. A perplexity, exp(loss), ranks like its "
            "loss.</p><table><tr><th>layer</th>"
            "<th>quantity</th><th>loss</th><th>ρ</th><th>p</th><th>n</th></tr>"
            + "".join(
                f"<tr><td>{escape_html(c['layer'])}</td><td>{escape_html(c['quantity'])}</td>"
                f"<td>{escape_html(c['loss'])}</td><td>{c['rho']:+.2f}</td><td>{format_number(c['p_value'])}</td>"
                f"<td>{c['n']}</td></tr>"
                for c in shown
            )
            + "</table>"
        )
        if not shown:
            body += "<p>No correlation could be computed (every series is constant or too short).</p>"
    else:
        body = (
            "<p>The checkpoints carry no loss or perplexity, so no correlation was computed. Lightning checkpoints "
            "carry one when a ModelCheckpoint monitors a metric (its current_score), when they hold a top-level "
            "`metrics` mapping, or when the file name has name=value tokens; Hugging Face checkpoints when "
            "trainer_state.json logged `loss` or `eval_loss`; feature arrays never do.</p>"
        )
    return Section("Correlation with the loss", body, loss_figures)


def _geometry_section(rows: Sequence[Mapping[str, Any]], series: _Series) -> Section:
    """Effective rank, spectrum decay, total persistence and Wasserstein distances of each feature layer."""
    geometry = Figures()
    feature_layers = list(dict.fromkeys(r["layer"] for r in rows if r["source"] == "features"))
    groups = [
        ("geometry_rank.png", "Effective rank and participation ratio", "dimensions",
         ("effective_rank", "participation_ratio")),
        ("geometry_decay.png", "Eigenspectrum decay exponent α", "α (log eigenvalue ~ -α log rank)",
         ("eigenspectrum_decay",)),
        ("persistence_total.png", "Total persistence of the diagrams", "sum of bar lengths",
         ("h0_total_persistence", "h1_total_persistence")),
        ("persistence_wasserstein.png", "Wasserstein distance to the previous checkpoint", "W1 distance",
         ("wasserstein_h0", "wasserstein_h1")),
    ]  # fmt: skip
    for file, title, label, quantities in groups:
        curves = {}
        for layer in feature_layers:
            for quantity in quantities:
                points = series.get(("features", layer, quantity), [])
                if points:
                    name = quantity if len(feature_layers) == 1 else f"{layer}: {quantity}"
                    curves[name] = ([p[0] for p in points], [p[1] for p in points])
        if curves:
            geometry.add(file, series_figure(title, label, curves), f"{title}, per layer, on the transformed cloud.")
    return Section(
        "Geometry and persistence statistics",
        "<p>Computed on each checkpoint's transformed cloud (the monitor's view: centred, unit RMS radius) and "
        "on the same diagrams as the drift.</p>",
        geometry,
    )


def _weights_section(
    rows: Sequence[Mapping[str, Any]], series: _Series, flattening: Sequence[Mapping[str, Any]]
) -> Section | None:
    """Neural persistence and H0 total persistence of each weight matrix (None without weight rows)."""
    weight_layers = list(dict.fromkeys(r["layer"] for r in rows if r["source"] == "weights"))
    if not weight_layers:
        return None
    weights = Figures()
    for file, quantity, label in (
        ("weights_np.png", "neural_persistence_normalized", "normalised neural persistence"),
        ("weights_tp.png", "weight_h0_total_persistence", "H0 total persistence of the rows"),
    ):
        curves = {
            layer: ([p[0] for p in series[key]], [p[1] for p in series[key]])
            for layer in weight_layers
            if (key := ("weights", layer, quantity)) in series
        }
        if curves:
            weights.add(file, series_figure(label.capitalize(), label, curves), f"{label} of each weight matrix.")
    flat = [f for f in flattening if f["source"] == "weights" and f["quantity"] == "neural_persistence_normalized"]
    body = (
        "<p>Neural persistence (Rieck et al., ICLR 2019) of every Linear/Conv weight matrix, normalised by "
        "sqrt(rows + columns - 1); H0 total persistence of its rows. The flattening step is the first "
        "checkpoint after which the change per step stays below 10 % of its fastest "
        "(topocallbacks.functional.flattening_step; none: still changing).</p><table><tr><th>matrix</th>"
        "<th>flattening step of the normalised neural persistence</th></tr>"
        + "".join(
            f"<tr><td>{escape_html(f['layer'])}</td><td>{escape_html(_or(f['flattening_step'], 'not yet'))}</td></tr>"
            for f in flat
        )
        + "</table>"
    )
    return Section("Weight space", body, weights)
