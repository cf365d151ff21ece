"""``from topocallbacks.lightning import TopoCollapseCallback`` (needs ``pip install topocallbacks[lightning]``)."""

from ._optional import require

require("lightning.pytorch", "topocallbacks.lightning", "Lightning", "lightning")

from .integrations.lightning import TopoCollapseCallback  # noqa: E402 - after the install hint

__all__ = ["TopoCollapseCallback"]
