"""Offline analysis: what the monitor would have measured at every saved checkpoint, and more, in a CSV and a report.

:func:`analyze` reads a folder of

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
:class:`~topocallbacks.probe.FeatureExtractor`, one pass per layer. For each checkpoint and layer it then computes
what the monitor computes: the features go through a :class:`~topocallbacks.transform.FeatureTransform` fitted on
the first checkpoint, ε is calibrated on the first checkpoint's transformed cloud
(:func:`~topocallbacks.functional.calibrate_epsilon`) and kept, and :func:`topocallbacks.check.measure` gives the
Collapse Index, its components and the diagram drift to the previous checkpoint; the default policy's decision is
recorded as the monitor would have (its warm-up is 10 checks, so a short series rarely warns). Beside that: H0 and
H1 statistics of the same diagrams (finite bars of the seeded ``max_points`` subsample, filtered up to its longest
minimum-spanning-tree edge: count, total and maximum persistence, normalised persistence entropy), the Wasserstein-1
distance between consecutive diagrams per dimension, and the effective rank, participation ratio and eigenspectrum
decay exponent of the transformed cloud. With ``weights=True`` every ``Linear``, ``Conv`` and Hugging Face
``Conv1D`` weight matrix adds a row (``source`` ``weights``) with its neural persistence (raw and normalised) and
the H0 total persistence of its neurons (:mod:`topocallbacks.functional.weights`).

Written into ``out_dir`` (and nowhere else): ``analysis.csv`` (one row per checkpoint and layer), ``analysis.json``
(the same rows, non-finite values as null, plus the settings, ε per layer, the Spearman correlation of every
quantity with every loss found, and the step where each quantity's change flattens) and the HTML report of
:func:`topocallbacks.report.write_report` with the analysis's own sections.

Checkpoints are read safely: ``torch.load(..., weights_only=True)`` always, safetensors as they are. A file that
needs arbitrary unpickling is refused with the reason, unless ``trust_checkpoints=True``, which loads it with
``weights_only=False`` and warns.

Command line: ``topocallbacks analyze PATH --probe FILE --out DIR [--layer NAME ...] [--factory module:function]
[--weights] [--trust-checkpoints]``.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import json
import math
import os
import pickle
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ._validation import as_points
from .check import ORIENTATION, CheckRecord, measure
from .exceptions import InputError, NonFiniteError
from .functional.collapse import calibrate_epsilon
from .functional.geometry import _effective_rank, participation_ratio
from .functional.spectrum import eigenspectrum_decay
from .functional.topology import _persistence_entropy
from .functional.weights import flattening_step, neural_persistence, weight_h0_total_persistence
from .policy import Policy
from .probe import FeatureExtractor, Probe, resolve_layer
from .report import _Figures, _fmt, _Section, _series_figure, _write
from .settings import MonitorSettings
from .transform import FeatureTransform

__all__ = ["Analysis", "analyze"]

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
_NOT_CORRELATED = ("epsilon", "n_points", "n_features", "weight_rows", "weight_columns")

#: Weight matrices above this many entries get no neural persistence (its spanning tree sorts every entry).
MAX_WEIGHT_ENTRIES = 2**22
#: Weight matrices with more rows than this get no H0 total persistence (it needs rows^2 distances).
MAX_WEIGHT_ROWS = 8192
#: Hugging Face model types with a preset, whose layer is analysed when no layer is named.
_PRESETS = {"gpt2": "gpt", "llama": "llama", "vit": "vit", "resnet": "resnet"}
_PREFIXES = ("model.", "module.", "net.", "_orig_mod.")
_STEP_IN_NAME = re.compile(r"(?:^|[^a-z0-9])step[-_=]?(\d+)(?![0-9])", re.IGNORECASE)
_METRIC_IN_NAME = re.compile(r"([A-Za-z][A-Za-z0-9_/]*)=(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What :func:`analyze` found and wrote.

    Attributes:
        rows: one dict per checkpoint and layer (and per weight matrix with ``weights=True``), as in the CSV.
        correlations: one dict per (source, layer, quantity, loss): ``rho`` and ``p_value`` of Spearman's rank
            correlation over ``n`` checkpoints (None when a series is constant or has fewer than 3 values).
        csv_path: ``analysis.csv``.
        json_path: ``analysis.json``.
        report_path: the report's ``index.html``.
    """

    rows: list[dict[str, Any]]
    correlations: list[dict[str, Any]]
    csv_path: Path
    json_path: Path
    report_path: Path


@dataclasses.dataclass
class _Checkpoint:
    step: int
    path: Path
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Layer:
    """Everything a layer carries from one checkpoint to the next, as a monitor's pipeline does."""

    transform: FeatureTransform
    policy: Policy
    epsilon: float | None = None
    diagrams: list[NDArray[np.float64]] | None = None


# --- safe loading -------------------------------------------------------------------------------------------------


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _torch_load(path: Path, trust: bool, what: str) -> Any:
    """``torch.load`` with ``weights_only=True``; a file needing arbitrary unpickling is refused unless trusted."""

    def load(weights_only: bool) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=weights_only)  # an old, non-zip file

    try:
        return load(True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise InputError(f"cannot read the {what} {str(path)!r}: {_short(exc)}") from exc
        found = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", str(exc), re.DOTALL)
        reason = " ".join(found.group(1).split()) if found else _short(exc)
        if not trust and "global" not in reason.lower():  # not a Python object: a damaged or foreign file
            raise InputError(
                f"cannot read the {what} {str(path)!r}: torch.load(weights_only=True) failed ({reason}); if it is "
                "a checkpoint from a source you trust, trust_checkpoints=True (--trust-checkpoints) loads it "
                "without that restriction"
            ) from exc
        if not trust:
            raise InputError(
                f"refusing to load the {what} {str(path)!r}: torch.load(weights_only=True) failed ({reason}). The "
                "file holds Python objects besides tensors, and unpickling them can run arbitrary code from the "
                "file, so a file from an untrusted source could take over this process. If you made the file or "
                "trust its source, pass trust_checkpoints=True (--trust-checkpoints); otherwise re-save it with "
                "tensors and plain types only, e.g. torch.save({'state_dict': model.state_dict(), 'global_step': "
                "step}, path)."
            ) from exc
        warnings.warn(
            f"loading {str(path)!r} with weights_only=False (trust_checkpoints=True): unpickling may run code from "
            f"the file ({reason})",
            RuntimeWarning,
            stacklevel=4,
        )
        try:
            return load(False)
        except Exception as again:  # torch.load raises assorted types on a damaged file
            raise InputError(f"cannot read the {what} {str(path)!r}: {_short(again)}") from again
    except Exception as exc:  # KeyError, RuntimeError, EOFError, OSError... on a damaged or foreign file
        raise InputError(f"cannot read the {what} {str(path)!r}: {_short(exc)}") from exc


def _numbers(mapping: Any) -> dict[str, float]:
    """The finite-or-not real numbers (and one-element tensors) of a mapping, by name."""
    result = {}
    if isinstance(mapping, Mapping):
        for key, value in mapping.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                result[str(key)] = float(value)
    return result


# --- finding the checkpoints --------------------------------------------------------------------------------------


def _step_in_name(path: Path) -> int | None:
    found = _STEP_IN_NAME.search(path.stem)
    if found:
        return int(found.group(1))
    return int(path.stem) if path.stem.isdigit() else None


def _hf_weights(folder: Path) -> list[Path]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise InputError(f"cannot read the shard index {str(index)!r}: {_short(exc)}") from exc
            return [folder / shard for shard in shards]
    return []


def _discover(root: Path, trust: bool) -> tuple[str, list[_Checkpoint]]:
    """The kind of folder (``"hf"``, ``"lightning"``, ``"features"``) and its checkpoints in step order."""
    if not root.exists():
        raise InputError(f"`path` {str(root)!r} does not exist")
    if not root.is_dir():
        raise InputError(f"`path` must be a folder of checkpoints or feature arrays, got the file {str(root)!r}")
    if (root / "config.json").is_file():
        hf = [root]
    else:
        hf = [d for d in root.iterdir() if d.is_dir() and re.fullmatch(r"checkpoint-\d+", d.name)]
    lightning = sorted(root.rglob("*.ckpt"))
    arrays = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in (".npy", ".npz", ".pt"))
    if hf and lightning:
        raise InputError(
            f"`path` {str(root)!r} holds both Hugging Face checkpoint folders and Lightning .ckpt files; point it "
            "at one kind"
        )
    if hf:
        return "hf", _hf_checkpoints(root, hf)
    if lightning:
        return "lightning", _lightning_checkpoints(lightning, trust)
    if arrays:
        return "features", _feature_files(arrays)
    raise InputError(
        f"`path` {str(root)!r} holds no checkpoints: no checkpoint-N folders with a config.json, no *.ckpt files, "
        "no feature arrays (*.npy, *.npz, *.pt named by step)"
    )


def _hf_checkpoints(root: Path, folders: list[Path]) -> list[_Checkpoint]:
    checkpoints = []
    for folder in folders:
        if not _hf_weights(folder):
            raise InputError(
                f"cannot read the checkpoint {str(folder)!r}: no model.safetensors or pytorch_model.bin (or their "
                "shard index) in it"
            )
        number = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        state = _trainer_state(folder)
        step = int(number.group(1)) if number else int(state.get("global_step", 0))
        checkpoints.append(_Checkpoint(step, folder))
    checkpoints.sort(key=lambda c: c.step)
    # The last trainer_state.json holds the whole log history; each checkpoint takes the last value at its step.
    history: list[Any] = []
    for checkpoint in checkpoints:
        logged = _trainer_state(checkpoint.path).get("log_history")
        if isinstance(logged, list) and len(logged) >= len(history):
            history = logged
    for checkpoint in checkpoints:
        for entry in history:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("step"), int):
                continue
            if entry["step"] > checkpoint.step:
                continue
            for key, value in _numbers(entry).items():
                if key in ("loss", "eval_loss", "train_loss") or "perplexity" in key:
                    checkpoint.metrics[key] = value
    return checkpoints


def _trainer_state(folder: Path) -> dict[str, Any]:
    path = folder / "trainer_state.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {str(path)!r}: {_short(exc)}") from exc
    return data if isinstance(data, dict) else {}


def _lightning_checkpoints(paths: list[Path], trust: bool) -> list[_Checkpoint]:
    by_step: dict[int, _Checkpoint] = {}
    for path in paths:
        raw = _torch_load(path, trust, "checkpoint")
        _state_dict(raw, path)  # fails early on a file without a model state
        step = raw.get("global_step") if isinstance(raw, Mapping) and "state_dict" in raw else None
        if not isinstance(step, int) or isinstance(step, bool):
            step = _step_in_name(path)
        if step is None:
            raise InputError(
                f"cannot tell the step of the checkpoint {str(path)!r}: it has no `global_step` and its name no "
                "`step=N`"
            )
        metrics = _lightning_metrics(raw, path)
        checkpoint = _Checkpoint(step, path, metrics)
        if step in by_step:
            kept, dropped = sorted([by_step[step], checkpoint], key=lambda c: (c.path.stem.startswith("last"), c.path))
            warnings.warn(
                f"{str(dropped.path)!r} is at the same step ({step}) as {str(kept.path)!r}; analysing the latter only",
                stacklevel=4,
            )
            checkpoint = kept
        by_step[step] = checkpoint
        del raw
    return [by_step[step] for step in sorted(by_step)]


def _lightning_metrics(raw: Any, path: Path) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, value in _METRIC_IN_NAME.findall(path.stem):
        if name not in ("step", "epoch"):
            metrics[name] = float(value)
    if isinstance(raw, Mapping):
        callbacks = raw.get("callbacks")
        if isinstance(callbacks, Mapping):
            for state in callbacks.values():
                if isinstance(state, Mapping) and isinstance(state.get("monitor"), str):
                    score = _numbers({"score": state.get("current_score")})
                    if "score" in score:
                        metrics[state["monitor"]] = score["score"]
        metrics.update(_numbers(raw.get("metrics")))
    return metrics


def _state_dict(raw: Any, path: Path) -> Mapping[str, Any]:
    if isinstance(raw, Mapping) and isinstance(raw.get("state_dict"), Mapping):
        state: Mapping[str, Any] = raw["state_dict"]
        return state
    if isinstance(raw, Mapping) and raw and all(isinstance(v, torch.Tensor) for v in raw.values()):
        return raw
    raise InputError(
        f"cannot read the checkpoint {str(path)!r}: it holds no `state_dict` (keys: {sorted(map(str, raw))[:10]})"
        if isinstance(raw, Mapping)
        else f"cannot read the checkpoint {str(path)!r}: it holds a {type(raw).__name__}, not a checkpoint dict"
    )


def _feature_files(paths: list[Path]) -> list[_Checkpoint]:
    checkpoints: dict[int, _Checkpoint] = {}
    for path in paths:
        step = _step_in_name(path)
        if step is None:
            raise InputError(
                f"cannot tell the step of the feature file {str(path)!r}: name it by step, e.g. "
                "features-step120.npy, step_120.pt or 120.npy"
            )
        if step in checkpoints:
            raise InputError(f"two feature files for step {step}: {str(checkpoints[step].path)!r} and {str(path)!r}")
        checkpoints[step] = _Checkpoint(step, path)
    return [checkpoints[step] for step in sorted(checkpoints)]


def _feature_arrays(path: Path, trust: bool) -> dict[str, Any]:
    """The feature arrays of one step by layer name."""
    try:
        if path.suffix == ".npy":
            return {"features": np.load(path, allow_pickle=False)}
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError) as exc:
        raise InputError(f"cannot read the feature file {str(path)!r}: {_short(exc)}") from exc
    loaded = _torch_load(path, trust, "feature file")
    if isinstance(loaded, Mapping):
        return {str(k): v for k, v in loaded.items()}
    return {"features": loaded}


# --- models -------------------------------------------------------------------------------------------------------


def _resolve_factory(factory: Any) -> Callable[[], torch.nn.Module]:
    if callable(factory):
        return factory  # type: ignore[no-any-return]
    if not isinstance(factory, str) or ":" not in factory:
        raise InputError(f"`factory` must be 'module:function', 'file.py:function' or a callable, got {factory!r}")
    where, _, name = factory.rpartition(":")
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # nothing written outside out_dir, not even __pycache__
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if spec is None or spec.loader is None or not Path(where).is_file():
                raise InputError(f"`factory` file {where!r} does not exist")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise InputError(f"`factory` {factory!r}: cannot import {where!r} ({_short(exc)})") from exc
    finally:
        sys.dont_write_bytecode = dont_write
    function = getattr(module, name, None)
    if not callable(function):
        raise InputError(f"`factory` {factory!r}: {where!r} has no callable {name!r}")
    return function  # type: ignore[no-any-return]


def _build(factory: Callable[[], torch.nn.Module], where: str) -> torch.nn.Module:
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"`factory` must return a torch.nn.Module, got {type(model).__name__} ({where})")
    return model


def _hf_model(folder: Path) -> torch.nn.Module:
    """The model a Hugging Face checkpoint folder's config.json describes, built offline with random weights."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"cannot read the model config of {str(folder)!r}: {_short(exc)}") from exc
    architectures = getattr(config, "architectures", None) or []
    kind = getattr(transformers, architectures[0], None) if architectures else None
    auto = transformers.AutoModel.from_config  # transformers leaves it unannotated
    model = kind(config) if isinstance(kind, type) else auto(config)  # type: ignore[no-untyped-call]
    if not isinstance(model, torch.nn.Module):  # pragma: no cover - transformers models are modules
        raise InputError(f"the config of {str(folder)!r} does not describe a torch model")
    return model


def _hf_state(folder: Path, trust: bool) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for file in _hf_weights(folder):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            try:
                state.update(load_file(str(file)))
            except Exception as exc:  # SafetensorError, OSError
                raise InputError(f"cannot read the checkpoint {str(file)!r}: {_short(exc)}") from exc
        else:
            loaded = _torch_load(file, trust, "checkpoint")
            if not isinstance(loaded, Mapping):
                raise InputError(f"cannot read the checkpoint {str(file)!r}: it holds a {type(loaded).__name__}")
            state.update(loaded)
    return state


def _matching_keys(state: Mapping[str, Any], expected: set[str]) -> dict[str, Any]:
    """``state`` with the prefix stripped that makes most of its keys those of the model (none when they match)."""
    best = dict(state)
    for _ in range(3):  # nested wrappers, e.g. "model._orig_mod."
        overlap = len(expected & set(best))
        if overlap == len(expected):
            break
        prefixes = set(_PREFIXES) | {k.split(".", 1)[0] + "." for k in best if "." in k}
        candidates = [{k[len(p) :]: v for k, v in best.items() if k.startswith(p)} for p in sorted(prefixes)]
        better = max(candidates, key=lambda c: len(expected & set(c)), default=best)
        if len(expected & set(better)) <= overlap:
            break
        best = better
    return best


def _load_state(model: torch.nn.Module, state: Mapping[str, Any], where: str) -> None:
    """Load ``state`` into ``model``, or explain exactly how they differ."""
    own = model.state_dict()
    state = _matching_keys(state, set(own))
    owners: dict[int, list[str]] = {}
    for name, tensor in own.items():
        if tensor.numel():
            owners.setdefault(tensor.data_ptr(), []).append(name)

    def tied(name: str) -> bool:  # shares its storage with a parameter the file holds (a tied head)
        tensor = own[name]
        return bool(tensor.numel()) and any(other in state for other in owners[tensor.data_ptr()] if other != name)

    ignore_missing = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    ignore_unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    missing = [k for k in own if k not in state and not tied(k) and not any(re.search(p, k) for p in ignore_missing)]
    unexpected = [k for k in state if k not in own and not any(re.search(p, k) for p in ignore_unexpected)]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and isinstance(state[k], torch.Tensor) and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} key(s) {missing[:5]}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected key(s) {unexpected[:5]}")
        if shapes:
            problems.append(f"{len(shapes)} shape mismatch(es) (checkpoint vs model) {shapes[:5]}")
        raise InputError(
            f"the checkpoint {where!r} does not match the model {type(model).__name__} built for it: "
            + "; ".join(problems)
        )
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


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


def _probe_source(probe: Any, trust: bool) -> Any:
    """Probe inputs from a file (.pt, .npy) or as given; floating inputs in torch's default dtype."""
    value = probe
    if isinstance(probe, (str, os.PathLike)):
        path = Path(probe)
        if not path.is_file():
            raise InputError(f"`probe` {str(path)!r} does not exist")
        if path.suffix == ".npy":
            try:
                value = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise InputError(f"cannot read the probe {str(path)!r}: {_short(exc)}") from exc
        elif path.suffix in (".pt", ".pth"):
            value = _torch_load(path, trust, "probe")
        else:
            raise InputError(f"`probe` must be a .pt or .npy file, got {path.name!r}")

    def tensor(item: Any) -> torch.Tensor:
        result = torch.as_tensor(np.asarray(item) if isinstance(item, np.ndarray) else item)
        return result.to(torch.get_default_dtype()) if result.is_floating_point() else result

    if isinstance(value, Mapping):
        tensors = {str(k): tensor(v) for k, v in value.items()}
        sizes = {int(t.shape[0]) if t.dim() else 0 for t in tensors.values()}
        if len(sizes) != 1:
            raise InputError(f"`probe` mapping entries must have the same number of samples, got {sorted(sizes)}")
        return [{k: t[i] for k, t in tensors.items()} for i in range(sizes.pop())]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return tensor(value)
    return value


# --- measuring ----------------------------------------------------------------------------------------------------


def _bar_statistics(diagram: NDArray[np.float64], prefix: str) -> dict[str, float | int]:
    lengths = diagram[:, 1] - diagram[:, 0]
    return {
        f"{prefix}_count": len(lengths),
        f"{prefix}_total_persistence": float(lengths.sum()),
        f"{prefix}_max_persistence": float(lengths.max()) if lengths.size else 0.0,
        f"{prefix}_entropy": _persistence_entropy(diagram),
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
        return {}, CheckRecord(step, "diverged", index, None, decision, elapsed, layer=name), None
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
    report = found.report
    drift = found.drift
    row = {
        "index_value": value,
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
                stacklevel=3,
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


# --- summaries ----------------------------------------------------------------------------------------------------


def _series(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
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


def _correlations(
    rows: Sequence[Mapping[str, Any]], checkpoints: Sequence[_Checkpoint]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Spearman's rho of every quantity with every loss found, and the losses' names."""
    losses = sorted({name for c in checkpoints for name in c.metrics})
    by_step = {c.step: c.metrics for c in checkpoints}
    results = []
    for (source, layer, quantity), points in _series(rows).items():
        if quantity in _NOT_CORRELATED:
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


def _flattening(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for (source, layer, quantity), points in _series(rows).items():
        if quantity in _NOT_CORRELATED or len(points) < 3:
            continue
        steps, values = zip(*points, strict=True)
        step = flattening_step(list(steps), list(values))
        results.append({"source": source, "layer": layer, "quantity": quantity, "flattening_step": step})
    return results


def _or(value: Any, instead: str) -> Any:
    return instead if value is None else value


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


# --- the report's own sections ------------------------------------------------------------------------------------


def _sections(
    rows: Sequence[Mapping[str, Any]],
    correlations: Sequence[Mapping[str, Any]],
    losses: Sequence[str],
    checkpoints: Sequence[_Checkpoint],
    flattening: Sequence[Mapping[str, Any]],
    summary: Mapping[str, str],
) -> list[_Section]:
    from .report import _e

    series = _series(rows)
    sections = []
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in summary.items())
    links = "<p>The numbers: <a href='analysis.csv'>analysis.csv</a>, <a href='analysis.json'>analysis.json</a>.</p>"
    sections.append(_Section("The offline analysis", f"<table>{table}</table>{links}"))

    loss_figures = _Figures()
    if losses:
        curves = {
            name: (
                [c.step for c in checkpoints if name in c.metrics],
                [c.metrics[name] for c in checkpoints if name in c.metrics],
            )
            for name in losses
        }
        loss_figures.add(
            "losses.png", _series_figure("Loss at each checkpoint", "loss", curves), "The losses the checkpoints carry."
        )
        shown = [c for c in correlations if c["rho"] is not None][:25]
        body = (
            "<p>Spearman's rank correlation of each quantity with each loss across checkpoints (the strongest 25; "
            "all of them are in analysis.json). With few checkpoints, |ρ| must be large to mean anything: read the "
            "p-value (exact over all orderings up to 8 checkpoints) and n. A perplexity, exp(loss), ranks like its "
            "loss.</p><table><tr><th>layer</th>"
            "<th>quantity</th><th>loss</th><th>ρ</th><th>p</th><th>n</th></tr>"
            + "".join(
                f"<tr><td>{_e(c['layer'])}</td><td>{_e(c['quantity'])}</td><td>{_e(c['loss'])}</td>"
                f"<td>{c['rho']:+.2f}</td><td>{_fmt(c['p_value'])}</td><td>{c['n']}</td></tr>"
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
    sections.append(_Section("Correlation with the loss", body, loss_figures))

    geometry = _Figures()
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
            geometry.add(file, _series_figure(title, label, curves), f"{title}, per layer, on the transformed cloud.")
    sections.append(
        _Section(
            "Geometry and persistence statistics",
            "<p>Computed on each checkpoint's transformed cloud (the monitor's view: centred, unit RMS radius) and "
            "on the same diagrams as the drift.</p>",
            geometry,
        )
    )

    weight_layers = list(dict.fromkeys(r["layer"] for r in rows if r["source"] == "weights"))
    if weight_layers:
        weights = _Figures()
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
                weights.add(file, _series_figure(label.capitalize(), label, curves), f"{label} of each weight matrix.")
        flat = [f for f in flattening if f["source"] == "weights" and f["quantity"] == "neural_persistence_normalized"]
        body = (
            "<p>Neural persistence (Rieck et al., ICLR 2019) of every Linear/Conv weight matrix, normalised by "
            "sqrt(rows + columns - 1); H0 total persistence of its rows. The flattening step is the first "
            "checkpoint after which the change per step stays below 10 % of its fastest "
            "(topocallbacks.functional.flattening_step; none: still changing).</p><table><tr><th>matrix</th>"
            "<th>flattening step of the normalised neural persistence</th></tr>"
            + "".join(
                f"<tr><td>{_e(f['layer'])}</td><td>{_e(_or(f['flattening_step'], 'not yet'))}</td></tr>" for f in flat
            )
            + "</table>"
        )
        sections.append(_Section("Weight space", body, weights))
    return sections


def _progress(checkpoints: list[_Checkpoint], show: bool) -> Iterator[_Checkpoint]:
    """The checkpoints, with a tqdm bar on stderr when asked for (and tqdm is installed)."""
    if show:
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information
        except ImportError:  # pragma: no cover - tqdm comes with transformers and huggingface_hub
            warnings.warn("no progress bar: tqdm is not installed (pip install tqdm)", stacklevel=3)
        else:
            yield from tqdm(checkpoints, desc="analyze", unit="checkpoint")
            return
    yield from checkpoints


# --- the analysis -------------------------------------------------------------------------------------------------


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

    See the module's documentation for what is read and computed. The rows of ``analysis.csv`` are ``step``,
    ``layer``, ``source`` (``features``, or ``weights`` for a weight matrix's row), ``status`` (``ok``, or
    ``diverged`` for NaN or Inf), ``checkpoint`` (its path relative to ``path``), one column per loss found, then
    the quantities of :data:`QUANTITIES` (empty where they do not apply).

    Args:
        path: a folder of Lightning ``.ckpt`` files, of Hugging Face ``checkpoint-N`` folders (or one such folder),
            or of feature arrays named by step.
        out_dir: the folder to write into (created if needed); nothing is written elsewhere.
        probe: model checkpoints: the probe inputs, a ``.pt``/``.npy`` file or a tensor, array, list or mapping
            (``input_ids``, ``attention_mask``) of inputs; unused for feature arrays.
        layers: module names or patterns to analyse (one probe pass each); feature files: the layer names in
            them. Default: every layer of feature files; for Hugging Face models of a type with a preset (gpt2,
            llama, vit, resnet), the preset's layer; else required.
        factory: builds the model: ``"module:function"``, ``"path/to/file.py:function"`` or a callable
            returning a ``torch.nn.Module``; required for Lightning checkpoints, optional for Hugging Face ones.
        trust_checkpoints: load files that need arbitrary unpickling (``weights_only=False``, with a warning)
            instead of refusing them.
        weights: add a row per Linear/Conv weight matrix with its weight-space topology (model checkpoints).
        settings: the monitor settings to measure with (transform, index, ε calibration, policy...); default:
            every option at its default (a Hugging Face preset's, when its layer is used).
        title: the report's title.
        progress: show a tqdm progress bar on stderr.
        **overrides: any monitor option by name, merged into ``settings`` (``max_probe_samples``, ``pooling``,
            ``projection``, ``max_points``, ``index``...).

    Returns:
        An :class:`Analysis` with the rows, the correlations and the paths written.

    Raises:
        InputError: ``path`` missing, empty or mixed; a checkpoint that cannot be read, that needs unpickling
            (unless trusted), or whose state does not match the rebuilt model; no probe, layer or factory where
            one is needed; a bad option. Every message names the file it is about.

    Example:
        >>> import tempfile, numpy as np
        >>> rng = np.random.default_rng(0)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     for step in (0, 10, 20):
        ...         np.save(f"{folder}/features-step{step}.npy", rng.normal(size=(64, 8)) * (1 + step))
        ...     result = analyze(folder, out_dir=f"{folder}/out", progress=False)
        ...     [(row["step"], row["layer"]) for row in result.rows], result.report_path.name
        ([(0, 'features'), (10, 'features'), (20, 'features')], 'index.html')
    """
    base = MonitorSettings() if settings is None else settings
    if not isinstance(base, MonitorSettings):
        raise InputError(f"`settings` must be a MonitorSettings, got {type(settings).__name__}")
    if layers is not None:
        if isinstance(layers, str):
            layers = [layers]
        if not layers or not all(isinstance(name, str) and name for name in layers):
            raise InputError(f"`layers` must be a non-empty list of module names, got {layers!r}")
    if title is not None and not isinstance(title, str):
        raise InputError(f"`title` must be a string or None, got {type(title).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"`path` must be a folder path, got {type(path).__name__}")
    root = Path(path)
    trust = bool(trust_checkpoints)
    kind, checkpoints = _discover(root, trust)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"`out_dir` {str(out)!r} exists and is not a folder")

    preset_used = None
    model: torch.nn.Module | None = None
    build: Callable[[], torch.nn.Module] | None = None
    if kind == "features":
        if factory is not None or weights or probe is not None:
            warnings.warn(
                "`probe`, `factory` and `weights` apply to model checkpoints; feature arrays need none of them",
                stacklevel=2,
            )
    else:
        if probe is None:
            raise InputError(
                f"`probe` is required to analyse model checkpoints ({kind} in {str(root)!r}): a .pt or .npy file of "
                "inputs (or a tensor)"
            )
        if factory is not None:
            build = _resolve_factory(factory)
        elif kind == "lightning":
            raise InputError(
                "`factory` is required for Lightning checkpoints: a 'module:function' returning the model (the "
                "LightningModule, or the network it wraps)"
            )
        model = _build(build, "factory") if build is not None else _hf_model(checkpoints[0].path)
        if layers is None and kind == "hf" and build is None:
            preset_used = _PRESETS.get(str(getattr(getattr(model, "config", None), "model_type", "")))
            if preset_used is not None:
                from .presets import load

                preset = load(preset_used).settings
                if settings is None:
                    base = preset
                layers = list(preset.probe.layer or ())
                layers = [resolve_layer(model, tuple(layers))]
        if layers is None:
            names = [n for n, _ in model.named_modules() if n]
            raise InputError(
                f"`layers` is required: name the module(s) of {type(model).__name__} to analyse; some names: "
                f"{names[:12]}"
            )
        layers = list(dict.fromkeys(resolve_layer(model, name) for name in layers))
    resolved = base.merged(overrides) if overrides else base

    probe_set = None
    if model is not None:
        probe_set = Probe(_probe_source(probe, trust), max_samples=resolved.probe.size, seed=resolved.seed)

    state: dict[str, _Layer] = {}
    rows: list[dict[str, Any]] = []
    records: list[CheckRecord] = []
    diagrams: dict[tuple[int, str | None], list[NDArray[np.float64]]] = {}
    skipped: set[str] = set()
    config_text = (checkpoints[0].path / "config.json").read_text(encoding="utf-8") if kind == "hf" else ""
    for checkpoint in _progress(checkpoints, progress):
        where = str(checkpoint.path)
        relative = os.path.relpath(checkpoint.path, root)
        if model is None:
            arrays = _feature_arrays(checkpoint.path, trust)
            wanted = list(arrays) if layers is None else list(layers)
            unknown = [name for name in wanted if name not in arrays]
            if unknown:
                raise InputError(f"the feature file {where!r} has no layer(s) {unknown}; it has {sorted(arrays)}")
            features = {name: arrays[name] for name in wanted}
        else:
            if kind == "hf" and build is None:
                config = (checkpoint.path / "config.json").read_text(encoding="utf-8")
                if config != config_text:  # a checkpoint with another architecture than the previous one
                    model, config_text = _hf_model(checkpoint.path), config
            if kind == "hf":
                _load_state(model, _hf_state(checkpoint.path, trust), where)
            else:
                _load_state(
                    model, _state_dict(_torch_load(checkpoint.path, trust, "checkpoint"), checkpoint.path), where
                )
            features = {}
            for name in layers or ():
                extractor = FeatureExtractor(resolved.probe, layer=(name,))
                try:
                    features[name] = extractor(model, probe_set)  # type: ignore[arg-type]
                except InputError as exc:
                    raise InputError(f"{exc} (checkpoint {where!r}, layer {name!r})") from exc
                except Exception as exc:  # the model's forward on the probe
                    raise InputError(
                        f"the probe pass failed on the checkpoint {where!r} (layer {name!r}): {_short(exc)}; check "
                        "that the probe holds inputs this model accepts"
                    ) from exc
        for name, raw in features.items():
            if name not in state:
                transform = FeatureTransform(resolved.transform, seed=resolved.seed)
                state[name] = _Layer(transform, Policy(resolved.rule))
            values, record, found = _measure(raw, state[name], resolved, checkpoint.step, name)
            row: dict[str, Any] = {
                "step": checkpoint.step,
                "layer": name,
                "source": "features",
                "status": record.status,
            }
            row["checkpoint"] = relative
            row.update(checkpoint.metrics)
            row.update(values)
            rows.append(row)
            records.append(record)
            if found is not None:
                diagrams[(checkpoint.step, name)] = found
        if weights and model is not None:
            for row in _weight_rows(model, checkpoint.step, skipped):
                row["checkpoint"] = relative
                row.update(checkpoint.metrics)
                rows.append(row)

    correlations, losses = _correlations(rows, checkpoints)
    flattening = _flattening(rows)
    leading = ["step", "layer", "source", "status", "checkpoint", *losses]
    present = {k for row in rows for k in row}
    columns = leading + [q for q in QUANTITIES if q in present and q not in leading]
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "analysis.csv"
    _write_csv(csv_path, rows, columns)
    epsilons = {name: layer.epsilon for name, layer in state.items()}
    summary = {
        "folder": str(root),
        "kind": {"hf": "Hugging Face checkpoints", "lightning": "Lightning checkpoints", "features": "feature arrays"}[
            kind
        ],
        "checkpoints": f"{len(checkpoints)} (steps {', '.join(str(c.step) for c in checkpoints[:30])})",
        "layers": ", ".join(state) + (f" (the {preset_used} preset's)" if preset_used else ""),
        "probe": "–" if probe_set is None else f"{len(probe_set)} samples ({probe_set.spec.source})",
        "ε per layer (first checkpoint)": ", ".join(f"{k}: {_fmt(v)}" for k, v in epsilons.items()),
        "losses found": ", ".join(losses) or "none",
    }
    metadata = {
        "version": 1,
        "path": str(root),
        "kind": kind,
        "checkpoints": [
            {"step": c.step, "path": os.path.relpath(c.path, root), "metrics": c.metrics} for c in checkpoints
        ],
        "layers": list(state),
        "preset": preset_used,
        "epsilon": epsilons,
        "probe": None if probe_set is None else probe_set.spec.as_dict(),
        "settings": resolved.as_dict(),
        "columns": columns,
        "quantities": {q: QUANTITIES[q] for q in columns if q in QUANTITIES},
        "losses": losses,
        "correlations": correlations,
        "correlations_note": None if losses else "the checkpoints carry no loss or perplexity",
        "flattening": flattening,
        "rows": rows,
        "files": {"csv": csv_path.name, "report": "index.html"},
    }
    json_path = out / "analysis.json"
    json_path.write_text(json.dumps(_json_ready(metadata), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    sections = _sections(rows, correlations, losses, checkpoints, flattening, summary)
    report_path = _write(
        records,
        out,
        source=f"{summary['kind']} in {root}",
        diagrams=diagrams,
        title=title or f"Offline analysis of {root.name or root}",
        sections=sections[1:],
        lead=sections[:1],
    )
    return Analysis(rows, correlations, csv_path, json_path, report_path)


def _json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
