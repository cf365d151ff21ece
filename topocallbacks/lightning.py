"""``from topocallbacks.lightning import TopoCollapseCallback`` (needs ``pip install topocallbacks[lightning]``)."""

try:
    import lightning.pytorch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "topocallbacks.lightning needs Lightning, which is not installed: pip install 'topocallbacks[lightning]'"
    ) from exc

from .integrations.lightning import TopoCollapseCallback

__all__ = ["TopoCollapseCallback"]
