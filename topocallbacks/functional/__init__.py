"""Pure functions on feature clouds and weights: topology, geometry, the Collapse Index, weight-space topology.

The functions on clouds take a ``(n_samples, dim)`` array (numpy, a nested list, or a torch tensor on any
device), those on weights (`neural_persistence`, `weight_h0_total_persistence`) a layer's weight
matrix; all return plain Python numbers or numpy arrays. None of them keeps state;
`topocallbacks.CollapseIndex` is the stateful counterpart that calibrates ε once and keeps it.
"""

from .collapse import (
    COMPONENTS,
    PAPER_WEIGHTS,
    CollapseReport,
    betti_term,
    calibrate_epsilon,
    collapse_index,
    entropy_term,
    epsilon_heuristic,
    longest_mst_edge,
    resolve_weights,
)
from .geometry import anisotropy, effective_rank, participation_ratio
from .indices import BettiCurve, betti_curve, diagram_distance, total_persistence
from .spectrum import eigenspectrum_decay
from .topology import BettiNumbers, betti_numbers, persistence_diagrams, persistence_entropy
from .training import gradient_norm
from .weights import flattening_step, neural_persistence, weight_h0_total_persistence

__all__ = [
    "COMPONENTS",
    "PAPER_WEIGHTS",
    "BettiCurve",
    "BettiNumbers",
    "CollapseReport",
    "anisotropy",
    "betti_curve",
    "betti_numbers",
    "betti_term",
    "calibrate_epsilon",
    "collapse_index",
    "diagram_distance",
    "effective_rank",
    "eigenspectrum_decay",
    "entropy_term",
    "epsilon_heuristic",
    "flattening_step",
    "gradient_norm",
    "longest_mst_edge",
    "neural_persistence",
    "participation_ratio",
    "persistence_diagrams",
    "persistence_entropy",
    "resolve_weights",
    "total_persistence",
    "weight_h0_total_persistence",
]
