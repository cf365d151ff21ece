"""Footprint model of the MMHM engine: predicted time and memory of an update, learned online.

Each path's time is modelled as a non-negative linear function of a few work counts (the features below), with
coefficients started from priors measured on a 2-core x86 machine and refitted by least squares on the last
observations of that path. Memory is counted analytically from the arrays an update allocates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..functional._distances import ADJACENCY_BLOCK_ROWS
from ..functional._jit import core_kernel
from ..functional.topology import DOMINATION_CHUNK

__all__ = [
    "PATHS",
    "CostEstimate",
    "CostModel",
    "path_features",
    "predict_bytes",
    "predict_gudhi_bytes",
    "predict_module_build_bytes",
]

#: The ways an update can be carried out.
PATHS = ("rebuild", "vertex", "edge")

# Work counts per path; the fitted time is sum(coefficient * count).
_FEATURES: Mapping[str, tuple[str, ...]] = {
    # Full adjacency (n^2 d multiply-adds), then GUDHI on the edges of every component with a cycle.
    "rebuild": ("const", "pair_dims", "edges"),
    # Rows of the moved/new points (m n d), then one certificate per vertex op (about degree^2 work).
    "vertex": ("const", "row_dims", "ops", "ops_degree_sq"),
    # The same full adjacency as a rebuild (priced by the rebuild's learned pair_dims coefficient, see
    # _SHARED_GRAPH_PASS), then one certificate per flipped edge (about common-degree^2 work).
    "edge": ("const", "ops", "ops_degree_sq"),
}
# Paths whose time includes the rebuild's ε-graph pass; that part is priced and subtracted with the rebuild's
# coefficient, so a path is never preferred for a pass it shares with the rebuild.
_SHARED_GRAPH_PASS = frozenset({"edge"})

# Seconds per unit of work, learned by this model on the development machine (2 cores, one thread, clustered
# clouds n = 1024, d = 64); refitted online wherever it runs.
_PRIORS: Mapping[str, Mapping[str, float]] = {
    "rebuild": {"const": 2e-4, "pair_dims": 1.3e-10, "edges": 5e-7},
    "vertex": {"const": 2e-4, "row_dims": 2e-10, "ops": 5e-6, "ops_degree_sq": 7e-10},
    "edge": {"const": 5e-4, "ops": 2.3e-5, "ops_degree_sq": 2e-9},
}
# Seconds per edge of a rebuild with the compiled strong collapse (same machine, real CNN features, n = 512-4,096).
_COMPILED_EDGE_PRIOR = 1e-7
_PRIOR_LISTS = {path: [_PRIORS[path][name] for name in _FEATURES[path]] for path in PATHS}
# After this many observations of a path, its coefficients are re-solved every _REFIT_EVERY observations.
_SETTLED = 8
_REFIT_EVERY = 4
# Weight kept by past observations at each new one (about the last 30 count).
_FORGET = 0.97
# Strength of the pull towards the current coefficients, relative to the data.
_RIDGE = 0.02


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """Predicted footprint of one update along one path.

    Attributes:
        path: ``"rebuild"``, ``"vertex"`` or ``"edge"``.
        seconds: predicted wall time.
        bytes: predicted peak of the new arrays the update allocates (the new adjacency, float64 blocks, edge
            lists), what ``tracemalloc`` measures; never anything proportional to the triangles.
        gudhi_bytes: a rough upper bound (80 bytes per edge) of the simplex tree GUDHI builds in C++, which
            ``tracemalloc`` cannot see; GUDHI only receives the graph's strong-collapse core, usually a few
            vertices, so the real figure is far lower; 0 for paths that do not call GUDHI on the whole graph.
    """

    path: str
    seconds: float
    bytes: int
    gudhi_bytes: int = 0


def path_features(
    path: str, *, n: int, d: int, edges: int, ops: int = 0, mean_degree: float = 0.0, rows: int | None = None
) -> dict[str, float]:
    """Work counts of ``path`` for a cloud of ``n`` points in ``d`` dimensions.

    Args:
        path: one of `PATHS`.
        n: number of points.
        d: dimension.
        edges: number of edges of the ε-graph (current or expected).
        ops: vertex operations (vertex path: 2 per moved point) or flipped edges (edge path).
        mean_degree: average degree of the vertices (or common degree of the edges) involved.
        rows: rows of the ε-graph computed anew (the moved or new points; all ``n`` by default): the graph of
            the points that did not move is kept.
    """
    new_rows = ops / 2 if path == "vertex" else 0
    graph_pass = ("pair_dims",) if path in _SHARED_GRAPH_PASS else ()
    counts = {
        "const": 1.0,
        "pair_dims": float(n if rows is None else rows) * n * d,
        "edges": float(edges),
        "row_dims": new_rows * n * d,
        "ops": float(ops),
        "ops_degree_sq": ops * mean_degree * mean_degree,
    }
    return {name: counts[name] for name in (*_FEATURES[path], *graph_pass)}


def predict_bytes(path: str, *, n: int, d: int, edges: int, ops: int = 0, probe: bool = True) -> int:
    """Peak bytes of the new arrays an update along ``path`` allocates (what ``tracemalloc`` sees).

    Derived from the code: the ε-graph pass allocates the new n x n boolean adjacency, a float64 block of
    ``ADJACENCY_BLOCK_ROWS`` rows against the columns from its first row on (`_graph_pass_block_bytes`) and 16 bytes
    per edge (twice while the block parts are joined); a rebuild's strong collapse the packed rows of the adjacency
    (compiled kernels) or a reduced copy of it and 48 bytes per edge (numpy); an edge update holds the masks of
    flipped edges.

    Args:
        path: one of `PATHS`.
        n: number of points.
        d: dimension.
        edges: edges of the ε-graph (the current count stands in for the next one).
        ops: vertex operations (2 per moved point) for the vertex path.
        probe: whether the update is a probe update (it holds the flip mask) rather than a streaming one.
    """
    pairs = n * n
    points = n * d * 8
    # While the blocks are computed: the adjacency being filled, scaled and centred copies of the points, and the
    # largest of one block's float64 products and masks with the edges found before it, or the joined edge lists.
    graph_pass = pairs + 4 * points + max(_graph_pass_block_bytes(n, edges), 32 * edges)
    if path == "vertex":
        moved = max(ops // 2, 1)
        # The new rows' float64 products and masks, scaled and centred copies of the points (the scale's |x| copy
        # is freed before they exist), and the new points' own copies.
        return moved * n * 11 + 2 * points + 2 * moved * d * 8
    if path == "rebuild":
        words = (n + 63) // 64
        if core_kernel() is not None:
            # The compiled strong collapse works on the adjacency's packed closed rows: the adjacency, the rows
            # and the unpacked rows of the core it keeps (measured: at most 2.2 x the packed rows, n = 600-2,000).
            return max(graph_pass, pairs + 3 * n * words * 8)
        # The adjacency and, in numpy's strong collapse (topocallbacks.functional.topology), a reduced copy of it,
        # the edge list and the edges' two ends by rank (48 bytes per edge), and the bit rows of a chunk of edges
        # being compared (four uint64 temporaries of a row each); measured, the flip mask of a probe update and the
        # graph pass's joined edge lists are gone by then.
        return max(graph_pass, 2 * pairs + 48 * edges + 4 * min(edges, DOMINATION_CHUNK) * words * 8)
    # After the pass: the new adjacency, the old one overwritten by the flip mask, and the joined edge lists (32
    # bytes per edge); the flipped edges are listed from the mask without a triangle copy.
    return max(graph_pass, pairs * 2 + 32 * edges)


def _graph_pass_block_bytes(n: int, edges: int) -> int:
    """Bytes of the ε-graph pass's largest block while it is decided.

    11 bytes per pair of its rows against the columns from its first row on, and 16 bytes per edge listed by the
    blocks before it (the edges taken as spread evenly over the pairs).
    """
    total = max(n * (n - 1) // 2, 1)
    peak, before = 0, 0
    for start in range(0, n, ADJACENCY_BLOCK_ROWS):
        rows = min(ADJACENCY_BLOCK_ROWS, n - start)
        width = n - start
        peak = max(peak, rows * width * 11 + 16 * edges * before // total)
        before += rows * width - rows * (rows + 1) // 2
    return peak


def predict_module_build_bytes(n: int, edges: int, copied: int = 0) -> int:
    """Peak bytes of splitting a rebuilt complex of ``n`` slots into modules.

    The degrees' bit rows (n x n / 8 bytes), 45 bytes per edge (the edge list, the components and the sparse graph
    they are found on), and, when some slots are empty (a streaming window not yet full), the adjacency of the
    ``copied`` points alive (the rows gathered on the way are freed before the edges are listed); otherwise the
    adjacency is read in place.
    """
    return n * n // 8 + 45 * edges + copied * copied


def predict_gudhi_bytes(path: str, edges: int) -> int:
    """Rough size of GUDHI's simplex tree before its edge collapse (80 bytes per edge), rebuilds only."""
    return 80 * edges if path == "rebuild" else 0


class CostModel:
    """Online least-squares time model per path, started from priors.

    Each observation adds to running sums (relative-error weighted, with exponential forgetting so the model
    follows a drifting machine load), and the coefficients are re-solved from them: a few microseconds per
    update, whatever the history length.

    Examples:
        >>> model = CostModel()
        >>> model.predict("rebuild", n=1024, d=64, edges=50_000).seconds > 0
        True
    """

    def __init__(self) -> None:
        self.coefficients_: dict[str, dict[str, float]] = {path: dict(_PRIORS[path]) for path in PATHS}
        if core_kernel() is not None:  # the compiled strong collapse: a rebuild's graph work is far cheaper
            self.coefficients_["rebuild"]["edges"] = _COMPILED_EDGE_PRIOR
        self.observations_: dict[str, int] = dict.fromkeys(PATHS, 0)
        # Running sums (Gram matrix and moment) per path, as Python lists: a path has 3-4 features, and plain
        # float arithmetic on them costs a few microseconds where numpy's small-array calls cost ~100 (cold).
        self._sums: dict[str, tuple[list[list[float]], list[float]]] = {
            path: ([[0.0] * len(_FEATURES[path]) for _ in _FEATURES[path]], [0.0] * len(_FEATURES[path]))
            for path in PATHS
        }

    def predict(
        self,
        path: str,
        *,
        n: int,
        d: int,
        edges: int,
        ops: int = 0,
        mean_degree: float = 0.0,
        probe: bool = True,
        rows: int | None = None,
    ) -> CostEstimate:
        """Predicted time and memory of ``path`` (``rows``: see `path_features`)."""
        features = path_features(path, n=n, d=d, edges=edges, ops=ops, mean_degree=mean_degree, rows=rows)
        seconds = self._shared_seconds(path, features) + sum(
            self.coefficients_[path][name] * features[name] for name in _FEATURES[path]
        )
        return CostEstimate(
            path=path,
            seconds=seconds,
            bytes=predict_bytes(path, n=n, d=d, edges=edges, ops=ops, probe=probe),
            gudhi_bytes=predict_gudhi_bytes(path, edges),
        )

    def _shared_seconds(self, path: str, features: Mapping[str, float]) -> float:
        """The ε-graph pass a path shares with the rebuild, priced by the rebuild's coefficient."""
        if path not in _SHARED_GRAPH_PASS:
            return 0.0
        return self.coefficients_["rebuild"]["pair_dims"] * features["pair_dims"]

    def observe(self, path: str, features: Mapping[str, float], seconds: float) -> None:
        """Record a measured update and refit that path's coefficients (non-negative, relative errors)."""
        names = _FEATURES[path]
        prior = _PRIOR_LISTS[path]
        # Fit only what the path adds to the shared graph pass (never below a tenth of the measurement).
        seconds = max(seconds - self._shared_seconds(path, features), 0.1 * seconds)
        # Work in units where each prior term is the feature's share of a typical update: well conditioned.
        x = [features[name] * scale for name, scale in zip(names, prior, strict=True)]
        weight = 1.0 / max(seconds, 1e-6) ** 2  # squared relative error
        gram, moment = self._sums[path]
        target = weight * seconds
        for i, xi in enumerate(x):
            row = gram[i]
            for j, xj in enumerate(x):
                row[j] = row[j] * _FORGET + weight * (xi * xj)
            moment[i] = moment[i] * _FORGET + target * xi
        self.observations_[path] += 1
        count = self.observations_[path]
        if count > _SETTLED and count % _REFIT_EVERY:
            return  # the sums keep every observation; re-solving each time buys little once settled
        # A ridge towards the current coefficients keeps features that never varied where they were.
        coefficients = self.coefficients_[path]
        ridge = _RIDGE * max(sum(gram[i][i] for i in range(len(names))), 1e-12) / len(names)
        system = [
            [*(value + ridge if i == j else value for j, value in enumerate(gram[i])), moment[i] + ridge * current]
            for i, current in enumerate(coefficients[name] / scale for name, scale in zip(names, prior, strict=True))
        ]
        solution = _solve(system)
        if solution is None:
            return
        self.coefficients_[path] = {
            name: max(value, 0.0) * scale for name, value, scale in zip(names, solution, prior, strict=True)
        }

    def state_dict(self) -> dict[str, dict[str, float]]:
        """The fitted coefficients (the running sums are not kept)."""
        return {path: dict(values) for path, values in self.coefficients_.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, float]]) -> None:
        """Restore fitted coefficients."""
        for path in PATHS:
            if path in state:
                self.coefficients_[path] = {name: float(state[path][name]) for name in _FEATURES[path]}


def _solve(system: list[list[float]]) -> list[float] | None:
    """The solution of a small augmented system ``[A | b]`` (Gaussian elimination, partial pivoting), or None.

    None when ``A`` is singular or the solution is not finite. In place; for the 3-4 unknowns of a path's law this
    is a few microseconds, where ``numpy.linalg.solve`` costs tens.
    """
    size = len(system)
    for k in range(size):
        pivot = max(range(k, size), key=lambda i: abs(system[i][k]))
        if system[pivot][k] == 0.0:
            return None
        system[k], system[pivot] = system[pivot], system[k]
        head = system[k]
        for i in range(k + 1, size):
            row = system[i]
            factor = row[k] / head[k]
            if factor:
                for j in range(k, size + 1):
                    row[j] -= factor * head[j]
    solution = [0.0] * size
    for k in range(size - 1, -1, -1):
        row = system[k]
        solution[k] = (row[size] - sum(row[j] * solution[j] for j in range(k + 1, size))) / row[k]
    if not all(math.isfinite(value) for value in solution):
        return None
    return solution
