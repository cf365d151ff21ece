"""Architecture presets: ``load("gpt")``, ``load("my.yaml")``, ``available()``; and the settings a callback runs with.

A preset file has the sections of [`MonitorSettings`][topocallbacks.settings.MonitorSettings] (``probe``, ``schedule``,
``transform``, ``index``, ``policy``, ``interventions``, ``output``) plus ``name`` and ``description``, and states
only what differs from the defaults. Files are read with ``yaml.safe_load``; unknown keys are rejected with the
sorted valid ones and a "did you mean", and a bad value is reported with its key path (``policy.patience``) and the
file. The presets ship inside the wheel (``topocallbacks/configs/*.yaml``); in a source checkout they are read from
the repository's ``configs/`` folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .exceptions import ConfigError
from .settings import MonitorSettings

__all__ = ["Preset", "available", "load", "parse_preset", "preset_dir", "resolve_settings"]

_SECTIONS = ("probe", "schedule", "transform", "index", "policy", "interventions", "output")
_TOP_LEVEL = ("name", "description", "seed", *_SECTIONS)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A validated preset.

    Attributes:
        name: the preset's name.
        description: what it is for.
        settings: the monitor settings it stands for.
        source: the file it was read from.
    """

    name: str
    description: str
    settings: MonitorSettings
    source: str = ""


def preset_dir() -> Path:
    """Where the bundled presets are: inside the installed package, else the checkout's ``configs/``."""
    packaged = Path(__file__).resolve().parent / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[1] / "configs"


def available() -> list[str]:
    """Names of the bundled presets, sorted.

    Examples:
        >>> {"resnet", "vit", "gpt", "llama"} <= set(available())
        True
    """
    return sorted(path.stem for path in preset_dir().glob("*.yaml"))


def parse_preset(data: Any, origin: str = "<dict>") -> Preset:
    """Validate a preset given as a mapping (e.g. ``yaml.safe_load`` of a file).

    Raises:
        ConfigError: unknown keys, wrong types or out-of-range values, naming the key path and ``origin``.

    Examples:
        >>> parse_preset({"probe": {"layer": "encoder"}, "schedule": {"check_every": 7}}).settings.schedule.check_every
        7
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a preset must be a mapping of sections, got {type(data).__name__} in {origin}")
    unknown = sorted(str(key) for key in set(data) - set(_TOP_LEVEL))
    if unknown:
        guess = difflib.get_close_matches(unknown[0], _TOP_LEVEL, n=1)
        hint = f"; did you mean `{guess[0]}`?" if guess else ""
        raise ConfigError(f"unknown key `{unknown[0]}` in {origin}{hint} Valid keys: {sorted(_TOP_LEVEL)}")
    sections = {key: value for key, value in data.items() if key not in ("name", "description")}
    for key in _SECTIONS:
        if key in sections and not isinstance(sections[key], Mapping):
            raise ConfigError(f"`{key}` must be a mapping, got {type(sections[key]).__name__} in {origin}")
    settings = MonitorSettings.from_dict(sections, origin=origin)
    if settings.probe.layer is None:
        raise ConfigError(f"`probe.layer` is required in {origin}: the module whose output a preset watches")
    return Preset(
        name=str(data.get("name", Path(origin).stem)),
        description=str(data.get("description", "")),
        settings=settings,
        source=origin,
    )


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


def load(name_or_path: str | os.PathLike[str]) -> Preset:
    """A validated preset: a bundled name (``"resnet"``, ``"vit"``, ``"gpt"``, ``"llama"``) or a YAML file path.

    Raises:
        ConfigError: unknown name (the message lists the available ones and the closest), or an invalid file.

    Examples:
        >>> load("gpt").settings.probe.pooling
        'mean'
    """
    text = os.fspath(name_or_path)
    path = Path(text)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.exists():
            raise ConfigError(f"preset file {text!r} does not exist")
        return read_preset(path)
    names = available()
    if text not in names:
        guess = difflib.get_close_matches(text, names, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(f"unknown preset {text!r}{hint} Available presets: {names} (or pass a .yaml path)")
    return read_preset(preset_dir() / f"{text}.yaml")


def resolve_settings(
    preset: str | os.PathLike[str] | None = None,
    settings: MonitorSettings | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> MonitorSettings:
    """The settings a callback runs with: a preset's (or the defaults), then ``settings``, then ``overrides``.

    Both training callbacks call this, so a preset configures every framework the same way.

    Args:
        preset: a bundled preset name or a YAML path, or None for the defaults.
        settings: a [`MonitorSettings`][topocallbacks.settings.MonitorSettings] that replaces the preset's, or a
            mapping of options merged into it (the form LightningCLI's YAML gives).
        overrides: options by name, merged last.

    Raises:
        ConfigError: an unknown preset or option (with the closest one).
        InputError: an out-of-range value.

    Examples:
        >>> resolve_settings("gpt", {"check_every": 20}).schedule.check_every
        20
    """
    if isinstance(settings, MonitorSettings):
        if preset is not None:
            raise ConfigError("give a `preset` or a MonitorSettings value as `settings`, not both")
        base = settings
    else:
        base = MonitorSettings() if preset is None else load(preset).settings
        if isinstance(settings, Mapping):
            base = base.merged(settings)
        elif settings is not None:
            raise ConfigError(
                f"`settings` must be a MonitorSettings or a mapping of options, got {type(settings).__name__}"
            )
    return base.merged(overrides) if overrides else base
