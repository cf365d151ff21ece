"""Modular Morse Homology Maintenance: exact Betti numbers at a fixed ε under sparse edits.

Depends on numpy, scipy and GUDHI only (never on torch).
"""

from .cost import CostEstimate, CostModel
from .engine import MMHM, UpdateStats

__all__ = ["MMHM", "CostEstimate", "CostModel", "UpdateStats"]
