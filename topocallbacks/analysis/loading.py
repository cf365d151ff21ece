"""Loading for an offline analysis: the arguments checked, the checkpoints found, the model built, the probe read.

Then, checkpoint by checkpoint, the features of each layer: from a feature file, or the probe run through the model.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..exceptions import InputError
from ..probe import FeatureExtractor, Probe, resolve_layer, resolve_layers
from ..settings import MonitorSettings
from .checkpoints import (
    Checkpoint,
    checkpoint_state_dict,
    discover_checkpoints,
    load_feature_arrays,
    load_torch_file,
    short_error,
)
from .models import build_model, hf_model_from_config, hf_state_dict, load_state_into, resolve_factory

__all__ = ["Source", "checkpoint_features", "load_source"]

#: Hugging Face model types with a preset, whose layer is analysed when no layer is named.
_PRESETS = {"gpt2": "gpt", "llama": "llama", "vit": "vit", "resnet": "resnet"}


@dataclasses.dataclass
class Source:
    """What an analysis reads, and how: found and checked by `load_source`.

    Attributes:
        root: the folder given (or the one Hugging Face checkpoint folder).
        out: the folder to write into (not created yet).
        kind: ``"hf"``, ``"lightning"`` or ``"features"``.
        checkpoints: in step order.
        trust: load files that need arbitrary unpickling.
        settings: the monitor settings to measure with, overrides merged.
        layers: the resolved module names (model checkpoints), the names asked for in feature files, or None (every
            layer of the feature files).
        model: the model the checkpoints are loaded into (None for feature arrays); a Hugging Face checkpoint whose
            config differs from the previous one's gets a model of its own.
        build: the factory, when one was given.
        preset: the name of the preset whose layer and settings are used, if any.
        probe: the probe set (model checkpoints).
        config_text: the Hugging Face config the current model was built from.
    """

    root: Path
    out: Path
    kind: str
    checkpoints: list[Checkpoint]
    trust: bool
    settings: MonitorSettings
    layers: Sequence[str] | None
    model: torch.nn.Module | None = None
    build: Callable[[], torch.nn.Module] | None = None
    preset: str | None = None
    probe: Probe | None = None
    config_text: str = ""


def load_source(
    path: Any,
    out_dir: Any,
    *,
    probe: Any,
    layers: Sequence[str] | None,
    factory: Any,
    trust_checkpoints: bool,
    weights: bool,
    settings: MonitorSettings | None,
    title: Any,
    overrides: Mapping[str, Any],
) -> Source:
    """Check `analyze`'s arguments, find the checkpoints, build the model, read the probe.

    Args:
        path: the folder of checkpoints or feature arrays.
        out_dir: the folder to write into; only checked here.
        probe: the probe inputs (model checkpoints), as a file or as given.
        layers: module names or patterns (model checkpoints), layer names (feature files), or None.
        factory: ``"module:function"``, ``"path/to/file.py:function"``, a callable returning the model, or None.
        trust_checkpoints: load files that need arbitrary unpickling, with a warning.
        weights: whether weight-space rows were asked for (only warned about for feature arrays).
        settings: the monitor settings, or None for the defaults (a Hugging Face preset's, when its layer is used).
        title: the report's title; only checked here, with the other arguments, before anything is read.
        overrides: monitor options by name, merged into the settings.

    Returns:
        The `Source`, its model loaded with nothing yet.

    Raises:
        InputError: a bad argument; ``path`` missing, empty or mixed; an unreadable checkpoint or probe; no probe,
            layer or factory where one is needed.
    """
    base, layers, trust = _arguments(path, settings, layers, title, trust_checkpoints)
    root, out, kind, checkpoints = _folder(path, out_dir, trust)
    model, build = _model(kind, checkpoints, root, probe=probe, factory=factory, weights=weights)
    layers, resolved, preset = _layers_and_settings(model, kind, build, layers, settings, base, overrides)
    return Source(
        root=root,
        out=out,
        kind=kind,
        checkpoints=checkpoints,
        trust=trust,
        settings=resolved,
        layers=layers,
        model=model,
        build=build,
        preset=preset,
        probe=None if model is None else _probe_set(probe, trust, resolved),
        config_text=(checkpoints[0].path / "config.json").read_text(encoding="utf-8") if kind == "hf" else "",
    )


def _arguments(
    path: Any, settings: Any, layers: Sequence[str] | None, title: Any, trust: Any
) -> tuple[MonitorSettings, Sequence[str] | None, bool]:
    """The settings to start from, the layers as a list and ``trust`` as a bool, or an error naming the bad argument."""
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
    return base, layers, bool(trust)


def _folder(path: Any, out_dir: Any, trust: bool) -> tuple[Path, Path, str, list[Checkpoint]]:
    """The folder read, the folder to write, the kind of checkpoints and the checkpoints in step order."""
    root = Path(path)
    kind, checkpoints = discover_checkpoints(root, trust)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"`out_dir` {str(out)!r} exists and is not a folder")
    return root, out, kind, checkpoints


def _model(
    kind: str, checkpoints: list[Checkpoint], root: Path, *, probe: Any, factory: Any, weights: bool
) -> tuple[torch.nn.Module | None, Callable[[], torch.nn.Module] | None]:
    """The model to load the checkpoints into and the factory that built it (neither for feature arrays)."""
    if kind == "features":
        if factory is not None or weights or probe is not None:
            warnings.warn(
                "`probe`, `factory` and `weights` apply to model checkpoints; feature arrays need none of them",
                stacklevel=4,  # analyze()'s caller: load_source <- analyze
            )
        return None, None
    if probe is None:
        raise InputError(
            f"`probe` is required to analyse model checkpoints ({kind} in {str(root)!r}): a .pt or .npy file of "
            "inputs (or a tensor)"
        )
    build = None
    if factory is not None:
        build = resolve_factory(factory)
    elif kind == "lightning":
        raise InputError(
            "`factory` is required for Lightning checkpoints: a 'module:function' returning the model (the "
            "LightningModule, or the network it wraps)"
        )
    model = build_model(build, "factory") if build is not None else hf_model_from_config(checkpoints[0].path)
    return model, build


def _layers_and_settings(
    model: torch.nn.Module | None,
    kind: str,
    build: Callable[[], torch.nn.Module] | None,
    layers: Sequence[str] | None,
    settings: MonitorSettings | None,
    base: MonitorSettings,
    overrides: Mapping[str, Any],
) -> tuple[Sequence[str] | None, MonitorSettings, str | None]:
    """The layers to analyse, the settings to measure with (``overrides`` merged last) and the preset used, if any.

    A model's layers are resolved; a Hugging Face model with no layer named uses its preset's layer (and settings,
    when none were given). Without a model (feature arrays) the layers are given back as they are.
    """
    preset_used = None
    if model is not None:
        if layers is None and kind == "hf" and build is None:
            preset_used = _PRESETS.get(str(getattr(getattr(model, "config", None), "model_type", "")))
            if preset_used is not None:
                from ..presets import load

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
        # As `layers=[...]` everywhere: a pattern stands for every module it matches that is not inside another
        # match ("transformer.h.*": the blocks), a name for its module.
        layers = resolve_layers(model, layers)
    return layers, base.merged(overrides) if overrides else base, preset_used


def _probe_set(probe: Any, trust: bool, settings: MonitorSettings) -> Probe:
    """The fixed probe set the model checkpoints are run on."""
    return Probe(_probe_source(probe, trust), max_samples=settings.probe.size, seed=settings.seed)


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
                raise InputError(f"cannot read the probe {str(path)!r}: {short_error(exc)}") from exc
        elif path.suffix in (".pt", ".pth"):
            value = load_torch_file(path, trust, "probe")
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


def checkpoint_features(source: Source, checkpoint: Checkpoint) -> dict[str, Any]:
    """One checkpoint's features by layer: read from its feature file, or the probe run through the loaded model.

    A Hugging Face checkpoint whose ``config.json`` differs from the previous one's (another architecture) gets a
    model of its own: ``source.model`` and ``source.config_text`` are replaced.

    Args:
        source: what `load_source` found.
        checkpoint: one of ``source.checkpoints``.

    Returns:
        An ``(n, d)`` array-like per layer name, in the order of ``source.layers`` (else of the file).

    Raises:
        InputError: the file cannot be read or lacks a layer; the state does not fit the model; the probe pass
            fails. Every message names the checkpoint.
    """
    where = str(checkpoint.path)
    if source.model is None:
        arrays = load_feature_arrays(checkpoint.path, source.trust)
        wanted = list(arrays) if source.layers is None else list(source.layers)
        unknown = [name for name in wanted if name not in arrays]
        if unknown:
            raise InputError(f"the feature file {where!r} has no layer(s) {unknown}; it has {sorted(arrays)}")
        return {name: arrays[name] for name in wanted}
    if source.kind == "hf" and source.build is None:
        config = (checkpoint.path / "config.json").read_text(encoding="utf-8")
        if config != source.config_text:  # a checkpoint with another architecture than the previous one
            source.model, source.config_text = hf_model_from_config(checkpoint.path), config
    if source.kind == "hf":
        load_state_into(source.model, hf_state_dict(checkpoint.path, source.trust), where)
    else:
        load_state_into(
            source.model,
            checkpoint_state_dict(load_torch_file(checkpoint.path, source.trust, "checkpoint"), checkpoint.path),
            where,
        )
    return _probe_pass(source.model, source, where)


def _probe_pass(model: torch.nn.Module, source: Source, where: str) -> dict[str, Any]:
    """The probe's features at each layer of ``model``, one pass per layer."""
    features = {}
    for name in source.layers or ():
        extractor = FeatureExtractor(source.settings.probe, layer=(name,))
        try:
            features[name] = extractor(model, source.probe)  # type: ignore[arg-type]
        except InputError as exc:
            raise InputError(f"{exc} (checkpoint {where!r}, layer {name!r})") from exc
        except Exception as exc:  # the model's forward on the probe
            raise InputError(
                f"the probe pass failed on the checkpoint {where!r} (layer {name!r}): {short_error(exc)}; check "
                "that the probe holds inputs this model accepts"
            ) from exc
    return features
