"""Architecture presets: ``load("gpt")``, ``load("my.yaml")``, ``available()``.

The presets ship inside the wheel (``topocallbacks/configs/*.yaml``); in a source checkout they are read from the
repository's ``configs/`` folder.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .config import Preset, read_preset
from .exceptions import ConfigError
from .policy import Policy

__all__ = ["available", "load", "monitor_settings", "preset_dir"]


def preset_dir() -> Path:
    """Where the bundled presets are: inside the installed package, else the checkout's ``configs/``."""
    packaged = Path(__file__).resolve().parent / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[1] / "configs"


def available() -> list[str]:
    """Names of the bundled presets, sorted.

    Example:
        >>> {"resnet", "vit", "gpt", "llama"} <= set(available())
        True
    """
    return sorted(path.stem for path in preset_dir().glob("*.yaml"))


def load(name_or_path: str | os.PathLike[str]) -> Preset:
    """A validated preset: a bundled name (``"resnet"``, ``"vit"``, ``"gpt"``, ``"llama"``) or a YAML file path.

    Raises:
        ConfigError: unknown name (the message lists the available ones and the closest), or an invalid file.

    Example:
        >>> load("gpt").probe.pooling
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


def monitor_settings(preset: str | None, **explicit: Any) -> dict[str, Any]:
    """TopoMonitor arguments: the preset's values (if any), then the explicitly given ones (None means unset).

    The training adapters call this, so a preset configures every framework the same way. A ``policy`` mapping
    is merged into the preset's policy; a :class:`~topocallbacks.policy.Policy` replaces it.

    Raises:
        ConfigError: an unknown preset or argument name (with the valid names and a "did you mean").
    """
    settings: dict[str, Any] = {} if preset is None else load(preset).monitor_kwargs()
    policy = explicit.pop("policy", None)
    for key, value in explicit.items():
        if value is not None:
            settings[key] = value
    from .monitor import TopoMonitor  # torch, imported only when a monitor is being configured

    reject_unknown(settings, set(inspect.signature(TopoMonitor).parameters) - {"probe"})
    if isinstance(policy, Mapping):
        from .monitor import DEFAULT_INDEX, default_policy

        base = settings.get("policy") or default_policy(settings.get("index", DEFAULT_INDEX))
        merged = {**base.arguments(), **policy}
        try:
            policy = Policy(**merged)
        except TypeError as exc:
            raise ConfigError(f"`policy` override: {exc}") from exc
    if policy is not None:
        settings["policy"] = policy
    return settings


def reject_unknown(given: Iterable[str], valid: Iterable[str]) -> None:
    """Raise for the first name in ``given`` that is not in ``valid``, with a "did you mean" and the valid names.

    Raises:
        ConfigError: an unknown name.

    Example:
        >>> reject_unknown(["check_evry"], ["check_every", "layer"])
        Traceback (most recent call last):
        ...
        topocallbacks.exceptions.ConfigError: unknown argument `check_evry`; did you mean `check_every`? Valid \
arguments: ['check_every', 'layer']
    """
    names = sorted(set(valid))
    unknown = sorted(set(given) - set(names))
    if unknown:
        guess = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"; did you mean `{guess[0]}`?" if guess else ""
        raise ConfigError(f"unknown argument `{unknown[0]}`{hint} Valid arguments: {names}")
