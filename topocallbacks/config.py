"""Presets: YAML files validated into typed, frozen dataclasses.

A preset has four sections (``probe``, ``schedule``, ``index``, ``policy``) plus ``name`` and ``description``.
Unknown keys are rejected with the sorted list of valid ones and a "did you mean"; a value of the wrong type or
out of range is reported with its key path (``policy.patience``) and the file it came from. Ranges are checked by
the objects the values configure (:class:`~topocallbacks.policy.Policy`, the monitor), so the rules live in one
place.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .exceptions import ConfigError, InputError
from .policy import TUNED_RULE

__all__ = ["IndexConfig", "PolicyConfig", "Preset", "ProbeConfig", "ScheduleConfig", "parse_preset"]


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """Which layer is watched and how the probe is run.

    Attributes:
        layer: module name patterns tried in order (see :func:`topocallbacks.probe.resolve_layer`).
        pooling: how the layer's output becomes one vector per sample.
        size: probe samples kept (a seeded subset of what the user passes).
        batch_size: probe samples per forward pass.
    """

    layer: tuple[str, ...]
    pooling: str = "auto"
    size: int = 512
    batch_size: int = 256


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """When checks happen.

    Attributes:
        mode: ``"probe"`` or ``"stream"``.
        check_every: optimizer steps between checks.
        window: streaming window size.
        points_per_batch: streaming points pushed per training batch.
    """

    mode: str = "probe"
    check_every: int = 100
    window: int = 1024
    points_per_batch: int = 32


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    """How the features become the index.

    Attributes:
        normalize: centre and scale each check's cloud to unit RMS radius.
        projection: None, ``"pca"`` or ``"random"``.
        projection_dim: dimension after projection.
        epsilon_quantile: ε heuristic: which quantile of pairwise distances...
        epsilon_factor: ...times this factor.
        max_points: subsample size of the persistence diagrams.
        weights: ``"paper"`` or a mapping of component weights.
        name: what the policy watches (``TopoMonitor(index=...)``): ``"diagram_drift"``, ``"paper"``, ``"rankme"``.
    """

    normalize: bool = True
    projection: str | None = None
    projection_dim: int = 64
    epsilon_quantile: float = 0.5
    epsilon_factor: float = 0.5
    max_points: int = 256
    weights: str | dict[str, float] = "paper"
    name: str = "diagram_drift"


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy's arguments (see :class:`~topocallbacks.policy.Policy`).

    The defaults are the collapse suite's tuned rule, :data:`~topocallbacks.policy.TUNED_RULE`.
    """

    action: str = "warn"
    threshold: float = TUNED_RULE["threshold"]
    relative_to_baseline: bool = False
    patience: int = TUNED_RULE["patience"]
    warmup: int = TUNED_RULE["warmup"]
    cooldown: int = 5
    trend_window: int | None = None
    trend_slope: float | None = None
    lr_factor: float = 0.5
    max_lr_cuts: int = 3
    after_max_lr_cuts: str = "stop"
    checkpoint: bool = False
    on_diverged: str = "stop"
    score: str = TUNED_RULE["score"]
    zscore_window: int = TUNED_RULE["zscore_window"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A validated preset.

    Attributes:
        name: the preset's name.
        description: what it is for.
        probe: see :class:`ProbeConfig`.
        schedule: see :class:`ScheduleConfig`.
        index: see :class:`IndexConfig`.
        policy: see :class:`PolicyConfig`.
        source: the file it was read from.
    """

    name: str
    description: str
    probe: ProbeConfig
    schedule: ScheduleConfig
    index: IndexConfig
    policy: PolicyConfig
    source: str = ""

    def monitor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~topocallbacks.monitor.TopoMonitor` (and the training callbacks)."""
        from .policy import Policy

        return {
            "layer": list(self.probe.layer),
            "pooling": self.probe.pooling,
            "max_probe_samples": self.probe.size,
            "batch_size": self.probe.batch_size,
            "mode": self.schedule.mode,
            "check_every": self.schedule.check_every,
            "window": self.schedule.window,
            "points_per_batch": self.schedule.points_per_batch,
            "normalize": self.index.normalize,
            "projection": self.index.projection,
            "projection_dim": self.index.projection_dim,
            "epsilon_quantile": self.index.epsilon_quantile,
            "epsilon_factor": self.index.epsilon_factor,
            "max_points": self.index.max_points,
            "weights": self.index.weights,
            "index": self.index.name,
            "policy": Policy(**dataclasses.asdict(self.policy)),
        }


_SECTIONS: dict[str, type] = {
    "probe": ProbeConfig,
    "schedule": ScheduleConfig,
    "index": IndexConfig,
    "policy": PolicyConfig,
}
_TOP_LEVEL = ("name", "description", *_SECTIONS)


def _unknown(keys: Any, valid: Any, where: str, origin: str) -> None:
    unknown = sorted(set(keys) - set(valid))
    if not unknown:
        return
    key = unknown[0]
    guess = difflib.get_close_matches(str(key), list(valid), n=1)
    hint = f"; did you mean `{where}{guess[0]}`?" if guess else ""
    section = f" of {where[:-1]}" if where else ""
    raise ConfigError(f"unknown key `{where}{key}` in {origin}{hint} Valid keys{section}: {sorted(valid)}")


def _check_type(value: Any, annotation: Any, path: str, origin: str) -> Any:
    """``value`` converted to the field's type, or a ConfigError naming the key path."""
    expected = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None and type(None) in expected:
        return None
    for kind in expected:
        origin_kind = typing.get_origin(kind) or kind
        if origin_kind is bool and isinstance(value, bool):
            return value
        if origin_kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin_kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin_kind is str and isinstance(value, str):
            return value
        if origin_kind is tuple and isinstance(value, (list, tuple, str)):
            items = [value] if isinstance(value, str) else list(value)
            if items and all(isinstance(item, str) and item for item in items):
                return tuple(items)
        if origin_kind is dict and isinstance(value, Mapping):
            return dict(value)
    names = " or ".join(getattr(k, "__name__", str(k)).replace("NoneType", "null") for k in expected)
    raise ConfigError(f"`{path}` must be {names}, got {value!r} ({type(value).__name__}) in {origin}")


def _section(data: Any, kind: type, name: str, origin: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"`{name}` must be a mapping, got {type(data).__name__} in {origin}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    _unknown(data, fields, f"{name}.", origin)
    hints = typing.get_type_hints(kind)
    values = {key: _check_type(value, hints[key], f"{name}.{key}", origin) for key, value in data.items()}
    missing = [f.name for f in fields.values() if f.default is dataclasses.MISSING and f.name not in values]
    if missing:
        raise ConfigError(f"`{name}.{missing[0]}` is required in {origin}")
    return kind(**values)


def parse_preset(data: Any, origin: str = "<dict>") -> Preset:
    """Validate a preset given as a mapping (e.g. ``yaml.safe_load`` of a file).

    Raises:
        ConfigError: unknown keys, wrong types or out-of-range values, naming the key path and ``origin``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a preset must be a mapping of sections, got {type(data).__name__} in {origin}")
    _unknown(data, _TOP_LEVEL, "", origin)
    sections = {name: _section(data.get(name), kind, name, origin) for name, kind in _SECTIONS.items()}
    preset = Preset(
        name=str(data.get("name", Path(origin).stem)),
        description=str(data.get("description", "")),
        source=origin,
        **sections,
    )
    _check_ranges(preset, origin)
    return preset


def _check_ranges(preset: Preset, origin: str) -> None:
    """Build what the values configure; an out-of-range value raises there, named with its key path here."""
    from .monitor import TopoMonitor
    from .policy import Policy

    try:
        Policy(**dataclasses.asdict(preset.policy))
    except InputError as exc:
        raise ConfigError(_with_section(str(exc), "policy") + f" in {origin}") from exc
    kwargs = preset.monitor_kwargs()
    kwargs.pop("policy")
    kwargs.pop("layer")
    if preset.probe.size < 2:
        raise ConfigError(f"`probe.size` must be an integer >= 2, got {preset.probe.size!r} in {origin}")
    try:
        TopoMonitor(**kwargs)
    except InputError as exc:
        section = {f.name: s for s, kind in _SECTIONS.items() for f in dataclasses.fields(kind)}
        message = str(exc)
        key = message.split("`")[1] if message.count("`") >= 2 else ""
        renamed = {"max_probe_samples": "probe.size", "index": "index.name"}.get(
            key, f"{section.get(key, 'index')}.{key}"
        )
        raise ConfigError(message.replace(f"`{key}`", f"`{renamed}`", 1) + f" in {origin}") from exc


def _with_section(message: str, section: str) -> str:
    if message.count("`") >= 2:
        key = message.split("`")[1]
        return message.replace(f"`{key}`", f"`{section}.{key}`", 1)
    return message


def read_preset(path: str | os.PathLike[str]) -> Preset:
    """Read and validate a YAML preset file (``yaml.safe_load`` only).

    Raises:
        ConfigError: the file is not valid YAML or not a valid preset.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    return parse_preset(data, origin=str(path))
