"""Layer resolution: the module names that a layer name, an ``fnmatch`` pattern or a shortcut designates in a model.

Names are compared without the segments wrappers insert (FSDP, checkpointing, compile); a name that designates no
module raises an error listing the closest ones.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence

import torch

from ..exceptions import InputError

__all__ = ["WRAPPER_SEGMENTS", "resolve_layer", "resolve_layers", "resolve_module"]

#: Name segments that wrappers insert between a module and its children (FSDP1, activation checkpointing,
#: ``torch.compile``); layer names are matched without them.
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def resolve_layer(model: torch.nn.Module, layer: str | Sequence[str]) -> str:
    """The module name ``layer`` designates in ``model``.

    ``layer`` is a module name, or one or more ``fnmatch`` patterns (``"*.ln_f"``) tried in order; the first pattern
    that matches wins, and among several matches of one pattern the last module (in ``named_modules`` order).
    Presets use patterns so that one preset fits a bare model and one wrapped in a LightningModule. Names are
    compared without the segments wrappers insert (`WRAPPER_SEGMENTS`: FSDP, activation checkpointing,
    ``torch.compile``), so ``"encoder"`` designates the FSDP unit wrapping the encoder; the outermost module of a
    name is returned.

    Raises:
        InputError: nothing matches; the message lists the patterns and the closest module names.
    """
    patterns: list[str] = [layer] if isinstance(layer, str) else [str(p) for p in layer]
    full = _plain_names(model)
    names = list(full)
    for pattern in patterns:
        if pattern in full:
            return full[pattern]
        matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if matches:
            return full[matches[-1]]
    shown = patterns[0] if len(patterns) == 1 else patterns
    hint = _closest(patterns[0].replace("*", ""), names)
    raise InputError(f"`layer` {shown!r} is not a module of {type(model).__name__}{hint}")


def resolve_layers(
    model: torch.nn.Module,
    layers: Sequence[str],
    *,
    primary: str | Sequence[str] | None = None,
    shortcuts: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """The module names several watched layers designate in ``model``, the primary one first.

    Each entry of ``layers`` is a shortcut of ``shortcuts`` (name patterns tried in order: the first that matches
    any module gives all its matches), a module name, or an ``fnmatch`` pattern that stands for every module it
    matches that is not inside another match (``"h.*"``: the blocks ``h.0``, ``h.1``..., not their sublayers).
    Names are compared without wrapper segments, as in `resolve_layer`. ``primary`` (a name or patterns,
    resolved by `resolve_layer`) comes first, whether ``layers`` names it or not; without it the first layer
    found is the primary one.

    Raises:
        InputError: an empty list, an entry that designates no module (with the closest names and the shortcuts),
            or two entries that designate one module.

    Examples:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> resolve_layers(model, ["all_linear"], primary="1", shortcuts={"all_linear": ["[02]"]})
        ['1', '0', '2']
    """
    if isinstance(layers, str) or not layers:
        raise InputError(f"`layers` must be a non-empty list of module names, patterns or shortcuts, got {layers!r}")
    shortcuts = shortcuts or {}
    full = _plain_names(model)
    resolved: list[str] = []
    origin: dict[str, str] = {}  # module -> the entry that designated it
    if primary is not None:
        first = resolve_layer(model, primary)
        resolved.append(first)
        origin[first] = "`layer`"
    for entry in layers:
        for plain in _designated(model, entry, full, shortcuts):
            name = full[plain]
            if name in origin:
                if origin[name] == "`layer`":
                    continue  # the primary layer listed again
                raise InputError(
                    f"`layers` entries {origin[name]!r} and {entry!r} both designate module {name!r}; name each "
                    "layer once"
                )
            origin[name] = entry
            resolved.append(name)
    return resolved


def resolve_module(model: torch.nn.Module, name: str | Sequence[str]) -> torch.nn.Module:
    """The submodule ``name`` designates (a name or patterns, see `resolve_layer`).

    Raises:
        InputError: no module has that name; the message lists the closest names.
    """
    modules: dict[str, torch.nn.Module] = dict(model.named_modules())
    return modules[resolve_layer(model, name)]


def _designated(
    model: torch.nn.Module, entry: str, full: Mapping[str, str], shortcuts: Mapping[str, Sequence[str]]
) -> list[str]:
    """The plain names one entry of ``layers`` designates: a shortcut's, a module name, or a pattern's matches."""
    names = list(full)
    if entry in shortcuts:
        patterns = list(shortcuts[entry])
        found = next((m for m in (_outermost(names, p) for p in patterns) if m), [])
        if not found:
            raise InputError(
                f"`layers` shortcut {entry!r} (patterns {patterns}) matches no module of {type(model).__name__}"
            )
        return found
    if entry in full:
        return [entry]
    if any(char in entry for char in "*?["):
        found = _outermost(names, entry)
        if not found:
            raise InputError(
                f"`layers` pattern {entry!r} matches no module of {type(model).__name__}"
                + _closest(entry.replace("*", ""), names)
            )
        return found
    known = f"; shortcuts: {sorted(shortcuts)}" if shortcuts else ""
    raise InputError(
        f"`layers` entry {entry!r} is not a module of {type(model).__name__}" + _closest(entry, names) + known
    )


def _closest(query: str, names: list[str]) -> str:
    """The end of a no-such-module message: the names closest to ``query``, or the first few names."""
    close = difflib.get_close_matches(query, names, n=5, cutoff=0.4)
    return f"; closest: {close}" if close else f"; some names: {names[:8]}"


def _plain_names(model: torch.nn.Module) -> dict[str, str]:
    """Each module's name without wrapper segments -> the outermost module's name (``named_modules`` order)."""
    full: dict[str, str] = {}
    for name, _ in model.named_modules():
        plain = ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
        if plain:
            full.setdefault(plain, name)
    return full


def _outermost(names: Sequence[str], pattern: str) -> list[str]:
    """The names ``pattern`` matches that are not inside another match (``"h.*"``: ``h.0``, not ``h.0.attn``)."""
    matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    return [n for n in matches if not any(n.startswith(m + ".") for m in matches)]
