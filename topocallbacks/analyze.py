"""Offline analysis: what the monitor would have measured at every saved checkpoint, and more, in a CSV and a report.

`analyze` reads a folder of

- **Lightning checkpoints** (``*.ckpt``, searched recursively): a dict with the model's ``state_dict`` (Lightning's
  layout; a bare state dict also works), the step from its ``global_step`` (else ``step=N`` or ``stepN`` in the
  file name), and the loss when it carries one (a ``ModelCheckpoint`` callback's ``monitor`` and
  ``current_score``, a top-level ``metrics`` mapping you can add in ``on_save_checkpoint``, or ``name=value``
  tokens of the file name such as ``step=100-val_loss=0.52.ckpt``). The model comes from ``factory``, a
  ``module:function`` (or ``path/to/file.py:function``) returning the ``torch.nn.Module``: the LightningModule
  itself, or the network it wraps, in which case the state's keys lose the prefix they have in the wrapper
  (``model.``, ``module.``, ``net.``, ``_orig_mod.`` or any leading name that makes them match) and keys outside it
  are ignored;
- **Hugging Face checkpoints** (``checkpoint-N`` folders as ``transformers.Trainer`` saves them, or one such folder):
  ``model.safetensors`` (or sharded ``model.safetensors.index.json``) or ``pytorch_model.bin``, and a
  ``config.json`` from which the model is built offline (the class named in ``architectures``, else ``AutoModel``;
  nothing is downloaded), unless a ``factory`` is given. Tied weights (a language model's head) may be missing
  from the file. The step is ``N``; the loss comes from ``trainer_state.json``'s ``log_history`` (``loss``,
  ``eval_loss`` and any ``*perplexity*``: the last value logged at or before the checkpoint's step);
- **feature arrays**, one file per step: ``.npy`` (an ``(n, d)`` array; its layer is called ``features``),
  ``.npz`` or ``.pt`` (an ``(n, d)`` array, or a mapping of layer name -> ``(n, d)`` array). The step is read from
  the file name: ``features-step120.npy``, ``step_120.pt``, ``120.npy``.

For model checkpoints the probe (a tensor of inputs; for text models a tensor of ``input_ids`` or a mapping with
``input_ids`` and ``attention_mask``) runs through each checkpoint with
`FeatureExtractor`, one pass per layer. For each checkpoint and layer it then computes
what the monitor computes: the features go through a `FeatureTransform` fitted on
the first checkpoint, ε is calibrated on the first checkpoint's transformed cloud
([`calibrate_epsilon`][topocallbacks.functional.calibrate_epsilon]) and kept, and `topocallbacks.check.measure` gives
the Collapse Index, its components and the diagram drift to the previous checkpoint; the default policy's decision is
recorded as the monitor would have (its warm-up is 10 checks, so a short series rarely warns). Beside that: H0 and H1
statistics of the same diagrams (finite bars of the seeded ``max_points`` subsample, filtered up to its longest
minimum-spanning-tree edge: count, total and maximum persistence, normalised persistence entropy), the Wasserstein-1
distance between consecutive diagrams per dimension, and the effective rank, participation ratio and eigenspectrum decay
exponent of the transformed cloud. With ``weights=True`` every ``Linear``, ``Conv`` and Hugging Face ``Conv1D`` weight
matrix adds a row (``source`` ``weights``) with its neural persistence (raw and normalised) and the H0 total persistence
of its neurons (`topocallbacks.functional.weights`).

Written into ``out_dir`` (and nowhere else): ``analysis.csv`` (one row per checkpoint and layer), ``analysis.json``
(the same rows, non-finite values as null, plus the settings, ε per layer, the Spearman correlation of every
quantity with every loss found, and the step where each quantity's change flattens) and the HTML report of
`topocallbacks.report.write_report` with the analysis's own sections.

Checkpoints are read safely: ``torch.load(..., weights_only=True)`` always, safetensors as they are. A file that
needs arbitrary unpickling is refused with the reason, unless ``trust_checkpoints=True``, which loads it with
``weights_only=False`` and warns.

Command line: ``topocallbacks analyze PATH --probe FILE --out DIR [--layer NAME ...] [--factory module:function]
[--weights] [--trust-checkpoints]``.

The work is done in three parts, each a module of `topocallbacks.analysis`: ``loading`` (the arguments, the
checkpoints, the model, the probe, and each checkpoint's features), ``evaluating`` (the measurements, row by row) and
``writing`` (the CSV, the JSON and the report).

Examples:
    >>> import tempfile, numpy as np
    >>> rng = np.random.default_rng(0)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     for step in (0, 10, 20):
    ...         np.save(f"{folder}/features-step{step}.npy", rng.normal(size=(64, 8)) * (1 + step))
    ...     result = analyze(folder, out_dir=f"{folder}/out", progress=False)
    ...     [(row["step"], row["layer"]) for row in result.rows], result.report_path.name
    ([(0, 'features'), (10, 'features'), (20, 'features')], 'index.html')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# The constants keep their place here (`X as X`: re-exported).
from .analysis.evaluating import MAX_WEIGHT_ENTRIES as MAX_WEIGHT_ENTRIES
from .analysis.evaluating import MAX_WEIGHT_ROWS as MAX_WEIGHT_ROWS
from .analysis.evaluating import QUANTITIES as QUANTITIES
from .analysis.evaluating import evaluate
from .analysis.loading import load_source
from .analysis.summaries import EXACT_UP_TO as EXACT_UP_TO
from .analysis.summaries import findings
from .analysis.writing import write_outputs
from .settings import MonitorSettings

__all__ = ["Analysis", "analyze"]


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What `analyze` found and wrote.

    Attributes:
        rows: one dict per checkpoint and layer (and per weight matrix with ``weights=True``), as in the CSV:
            ``step``, ``layer``, ``source`` (``features``, or ``weights`` for a weight matrix's row), ``status``
            (``ok``, or ``diverged`` for NaN or Inf), ``checkpoint`` (its path relative to ``path``), one column
            per loss found, then the quantities of `QUANTITIES` (empty where they do not apply).
        correlations: one dict per (source, layer, quantity, loss): ``rho`` and ``p_value`` of Spearman's rank
            correlation over ``n`` checkpoints (None when a series is constant or has fewer than 3 values).
        csv_path: ``analysis.csv``.
        json_path: ``analysis.json``.
        report_path: the report's ``index.html``.
        findings: what it found, in a few sentences (`findings`), also at
            the top of the report and printed by ``topocallbacks analyze``.
        layers: the modules analysed, as the layer names and patterns given resolved in the model.
    """

    rows: list[dict[str, Any]]
    correlations: list[dict[str, Any]]
    csv_path: Path
    json_path: Path
    report_path: Path
    findings: list[str] = dataclasses.field(default_factory=list)
    layers: list[str] = dataclasses.field(default_factory=list)


def analyze(
    path: str | os.PathLike[str],
    *,
    out_dir: str | os.PathLike[str],
    probe: Any = None,
    layers: Sequence[str] | None = None,
    factory: str | Callable[[], torch.nn.Module] | None = None,
    trust_checkpoints: bool = False,
    weights: bool = False,
    settings: MonitorSettings | None = None,
    title: str | None = None,
    progress: bool = True,
    **overrides: Any,
) -> Analysis:
    """Measure every checkpoint (or feature array) in ``path`` as the monitor would, and more; write CSV, JSON, report.

    What is read and computed: the module's documentation; the CSV's columns: `Analysis`'s ``rows``.

    Args:
        path: a folder of Lightning ``.ckpt`` files, of Hugging Face ``checkpoint-N`` folders (or one such folder),
            or of feature arrays named by step.
        out_dir: the folder to write into (created if needed); nothing is written elsewhere.
        probe: model checkpoints: the probe inputs, a ``.pt``/``.npy`` file or a tensor, array, list or mapping
            (``input_ids``, ``attention_mask``) of inputs; unused for feature arrays.
        layers: module names or patterns to analyse (one probe pass each), or feature files' layer names (default:
            all); for a Hugging Face model type with a preset (gpt2, llama, vit, resnet) the preset's, else required.
        factory: builds the model: ``"module:function"``, ``"path/to/file.py:function"`` or a callable
            returning a ``torch.nn.Module``; required for Lightning checkpoints, optional for Hugging Face ones.
        trust_checkpoints: load files that need arbitrary unpickling, with a warning, instead of refusing them.
        weights: add a row per Linear/Conv weight matrix with its weight-space topology (model checkpoints).
        settings: the monitor settings to measure with (transform, index, ε calibration, policy...); default:
            every option at its default (a Hugging Face preset's, when its layer is used).
        title: the report's title.
        progress: show a tqdm progress bar on stderr.
        **overrides: any monitor option by name, merged into ``settings`` (``max_probe_samples``, ``pooling``,
            ``projection``, ``max_points``, ``index``...).

    Returns:
        An `Analysis` with the rows, the correlations and the paths written.

    Raises:
        InputError: ``path`` missing, empty or mixed; a checkpoint that cannot be read, needs unpickling (unless
            trusted) or does not fit the rebuilt model; no probe, layer or factory where one is needed; a bad option.
            Every message names the file it is about.
    """
    source = load_source(path, out_dir, probe=probe, layers=layers, factory=factory,
                         trust_checkpoints=trust_checkpoints, weights=weights, settings=settings, title=title,
                         overrides=overrides)  # fmt: skip
    measured = evaluate(source, weights=weights, progress=progress)
    correlations, csv_path, json_path, report_path = write_outputs(source, measured, title=title)
    return Analysis(rows=measured.rows, correlations=correlations, csv_path=csv_path, json_path=json_path,
                    report_path=report_path, findings=findings(measured.rows, correlations),
                    layers=list(measured.layers))  # fmt: skip
