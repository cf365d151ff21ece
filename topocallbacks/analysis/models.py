"""The model an offline analysis measures: built by a factory or from a Hugging Face config, a checkpoint loaded in.

A checkpoint's state loses the prefix a wrapper gave its keys; where it does not fit, the error says how exactly.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..exceptions import InputError
from .checkpoints import hf_weight_files, load_torch_file, short_error

_PREFIXES = ("model.", "module.", "net.", "_orig_mod.")


def resolve_factory(factory: Any) -> Callable[[], torch.nn.Module]:
    """The model factory a callable, ``"module:function"`` or ``"file.py:function"`` names (no bytecode written)."""
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
        raise InputError(f"`factory` {factory!r}: cannot import {where!r} ({short_error(exc)})") from exc
    finally:
        sys.dont_write_bytecode = dont_write
    function = getattr(module, name, None)
    if not callable(function):
        raise InputError(f"`factory` {factory!r}: {where!r} has no callable {name!r}")
    return function  # type: ignore[no-any-return]


def build_model(factory: Callable[[], torch.nn.Module], where: str) -> torch.nn.Module:
    """The model ``factory`` returns, checked to be a torch module (``where`` names the factory in the error)."""
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"`factory` must return a torch.nn.Module, got {type(model).__name__} ({where})")
    return model


def hf_model_from_config(folder: Path) -> torch.nn.Module:
    """The model a Hugging Face checkpoint folder's config.json describes, built offline with random weights."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"cannot read the model config of {str(folder)!r}: {short_error(exc)}") from exc
    architectures = getattr(config, "architectures", None) or []
    kind = getattr(transformers, architectures[0], None) if architectures else None
    auto = transformers.AutoModel.from_config  # transformers leaves it unannotated
    model = kind(config) if isinstance(kind, type) else auto(config)  # type: ignore[no-untyped-call]
    if not isinstance(model, torch.nn.Module):  # pragma: no cover - transformers models are modules
        raise InputError(f"the config of {str(folder)!r} does not describe a torch model")
    return model


def hf_state_dict(folder: Path, trust: bool) -> dict[str, Any]:
    """The weights of a Hugging Face checkpoint folder, every shard merged into one state dict."""
    state: dict[str, Any] = {}
    for file in hf_weight_files(folder):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            try:
                state.update(load_file(str(file)))
            except Exception as exc:  # SafetensorError, OSError
                raise InputError(f"cannot read the checkpoint {str(file)!r}: {short_error(exc)}") from exc
        else:
            loaded = load_torch_file(file, trust, "checkpoint")
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


def load_state_into(model: torch.nn.Module, state: Mapping[str, Any], where: str) -> None:
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
