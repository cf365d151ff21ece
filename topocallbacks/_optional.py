"""The install hint of an optional framework, which ``topocallbacks.hf`` and ``topocallbacks.lightning`` need.

Each entry point imports its framework through `require` before anything of it, so that a missing framework fails
with the extra to install instead of a bare ``ModuleNotFoundError`` deep inside the adapter.
"""

from __future__ import annotations

import importlib


def require(module: str, entry: str, name: str, extra: str) -> None:
    """Import ``module``, or raise an `ImportError` saying that ``entry`` needs ``name`` and how to install it."""
    try:
        importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
        raise ImportError(
            f"{entry} needs {name}, which is not installed: pip install 'topocallbacks[{extra}]'"
        ) from exc
