"""``from topocallbacks.hf import TopoCollapseTrainerCallback`` (needs ``pip install topocallbacks[hf]``)."""

from ._optional import require

require("transformers", "topocallbacks.hf", "transformers", "hf")

from .integrations.hf import TopoCollapseTrainerCallback  # noqa: E402 - after the install hint

__all__ = ["TopoCollapseTrainerCallback"]
