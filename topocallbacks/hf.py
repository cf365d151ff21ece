"""``from topocallbacks.hf import TopoCollapseTrainerCallback`` (needs ``pip install topocallbacks[hf]``)."""

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "topocallbacks.hf needs transformers, which is not installed: pip install 'topocallbacks[hf]'"
    ) from exc

from .integrations.hf import TopoCollapseTrainerCallback

__all__ = ["TopoCollapseTrainerCallback"]
