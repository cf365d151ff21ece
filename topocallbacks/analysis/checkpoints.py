"""The files an offline analysis reads: the checkpoints or feature arrays in a folder, found and read safely.

``torch.load(weights_only=True)`` unless trusted; each step and loss from a file's name, content or trainer state.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..exceptions import InputError

_STEP_IN_NAME = re.compile(r"(?:^|[^a-z0-9])step[-_=]?(\d+)(?![0-9])", re.IGNORECASE)
_METRIC_IN_NAME = re.compile(r"([A-Za-z][A-Za-z0-9_/]*)=(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


@dataclasses.dataclass
class Checkpoint:
    """One checkpoint (or feature file) of the folder: its step, its path, and the losses found for it by name."""

    step: int
    path: Path
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


# --- safe loading -------------------------------------------------------------------------------------------------


def short_error(exc: BaseException) -> str:
    """An exception in one line for an error message: its type and the first line of its text (300 characters)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def load_torch_file(path: Path, trust: bool, what: str) -> Any:
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
            raise InputError(f"cannot read the {what} {str(path)!r}: {short_error(exc)}") from exc
        found = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", str(exc), re.DOTALL)
        reason = " ".join(found.group(1).split()) if found else short_error(exc)
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
        # Six frames up: on every path, the frame four frames up before analyze() was split into parts (two fewer).
        warnings.warn(
            f"loading {str(path)!r} with weights_only=False (trust_checkpoints=True): unpickling may run code from "
            f"the file ({reason})",
            RuntimeWarning,
            stacklevel=6,
        )
        try:
            return load(False)
        except Exception as again:  # torch.load raises assorted types on a damaged file
            raise InputError(f"cannot read the {what} {str(path)!r}: {short_error(again)}") from again
    except Exception as exc:  # KeyError, RuntimeError, EOFError, OSError... on a damaged or foreign file
        raise InputError(f"cannot read the {what} {str(path)!r}: {short_error(exc)}") from exc


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


def hf_weight_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face checkpoint folder (safetensors first, the shards of an index), or none."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise InputError(f"cannot read the shard index {str(index)!r}: {short_error(exc)}") from exc
            return [folder / shard for shard in shards]
    return []


def discover_checkpoints(root: Path, trust: bool) -> tuple[str, list[Checkpoint]]:
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


def _hf_checkpoints(root: Path, folders: list[Path]) -> list[Checkpoint]:
    checkpoints = []
    for folder in folders:
        if not hf_weight_files(folder):
            raise InputError(
                f"cannot read the checkpoint {str(folder)!r}: no model.safetensors or pytorch_model.bin (or their "
                "shard index) in it"
            )
        number = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        state = _trainer_state(folder)
        step = int(number.group(1)) if number else int(state.get("global_step", 0))
        checkpoints.append(Checkpoint(step, folder))
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
        raise InputError(f"cannot read {str(path)!r}: {short_error(exc)}") from exc
    return data if isinstance(data, dict) else {}


def _lightning_checkpoints(paths: list[Path], trust: bool) -> list[Checkpoint]:
    by_step: dict[int, Checkpoint] = {}
    for path in paths:
        raw = load_torch_file(path, trust, "checkpoint")
        checkpoint_state_dict(raw, path)  # fails early on a file without a model state
        step = raw.get("global_step") if isinstance(raw, Mapping) and "state_dict" in raw else None
        if not isinstance(step, int) or isinstance(step, bool):
            step = _step_in_name(path)
        if step is None:
            raise InputError(
                f"cannot tell the step of the checkpoint {str(path)!r}: it has no `global_step` and its name no "
                "`step=N`"
            )
        metrics = _lightning_metrics(raw, path)
        checkpoint = Checkpoint(step, path, metrics)
        if step in by_step:
            kept, dropped = sorted([by_step[step], checkpoint], key=lambda c: (c.path.stem.startswith("last"), c.path))
            warnings.warn(
                f"{str(dropped.path)!r} is at the same step ({step}) as {str(kept.path)!r}; analysing the latter only",
                stacklevel=6,  # analyze()'s caller: discover_checkpoints <- _folder <- load_source <- analyze
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


def checkpoint_state_dict(raw: Any, path: Path) -> Mapping[str, Any]:
    """The model state of a loaded Lightning checkpoint (its ``state_dict``, or the whole dict of tensors)."""
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


def _feature_files(paths: list[Path]) -> list[Checkpoint]:
    checkpoints: dict[int, Checkpoint] = {}
    for path in paths:
        step = _step_in_name(path)
        if step is None:
            raise InputError(
                f"cannot tell the step of the feature file {str(path)!r}: name it by step, e.g. "
                "features-step120.npy, step_120.pt or 120.npy"
            )
        if step in checkpoints:
            raise InputError(f"two feature files for step {step}: {str(checkpoints[step].path)!r} and {str(path)!r}")
        checkpoints[step] = Checkpoint(step, path)
    return [checkpoints[step] for step in sorted(checkpoints)]


def load_feature_arrays(path: Path, trust: bool) -> dict[str, Any]:
    """The feature arrays of one step by layer name."""
    try:
        if path.suffix == ".npy":
            return {"features": np.load(path, allow_pickle=False)}
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError) as exc:
        raise InputError(f"cannot read the feature file {str(path)!r}: {short_error(exc)}") from exc
    loaded = load_torch_file(path, trust, "feature file")
    if isinstance(loaded, Mapping):
        return {str(k): v for k, v in loaded.items()}
    return {"features": loaded}
