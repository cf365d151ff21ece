"""Architecture presets: ``load("gpt")``, ``load("my.yaml")``, ``available()``.

The presets ship inside the wheel (``topocallbacks/configs/*.yaml``); in a source checkout they are read from the
repository's ``configs/`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import Preset, read_preset
from .exceptions import ConfigError

__all__ = ["available", "load", "preset_dir"]


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
        import difflib

        guess = difflib.get_close_matches(text, names, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(f"unknown preset {text!r}{hint} Available presets: {names} (or pass a .yaml path)")
    return read_preset(preset_dir() / f"{text}.yaml")
