"""MMHM: exact Betti numbers of the Rips complex at a fixed ε, maintained under sparse edits.

Modules
    The flag complex splits over the connected components of the ε-graph, and homology splits with it, so the
    engine keeps one *module* per component: its vertices (a label per point) and its β1. β0 is the number of
    modules and β1 the sum of theirs.

Local certificates
    Every edit is a sequence of elementary operations on the graph, and each operation first tries to prove,
    looking only at the neighbourhood it touches, that it changes no Betti number (Mayer-Vietoris on the star
    that is glued in or cut out):

    * inserting or deleting a vertex ``v`` whose link ``L`` (the flag complex on its neighbours) is a cone
      (``v`` is *dominated*: a neighbour adjacent to all the others) changes nothing; nor does one whose link is
      connected with ``H1(L) = 0`` (checked with GUDHI on the link alone);
    * inserting or deleting an edge ``uv`` whose link (the common neighbours) is non-empty and connected changes
      nothing: the star is glued along the suspension of the link, which is then simply connected;
    * inserting an edge between two vertices with no common neighbour adds one loop if they were in the same
      module, and merges the two modules (summing their β1) otherwise.

    An operation that no certificate covers marks its module *dirty*; at the end of the update every dirty module
    is split into its current components and each is recomputed exactly (GUDHI edge collapse on that component
    only). The other modules keep their β1 untouched.

Paths
    ``vertex`` (streaming, or a probe update where few points moved: delete and re-insert them), ``edge`` (a probe
    update where every point moved a little but few edges flipped), and ``rebuild`` (from scratch, per module). An
    online cost model (`topocallbacks.mmhm.cost`) predicts each path's time and picks the cheapest, so the
    engine never does much worse than rebuilding. A probe update whose new graph has no flipped edge takes the edge
    path without asking the model: it has nothing to apply, where a rebuild would recompute the Betti numbers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from .._validation import as_points, check_int, check_positive_float, check_state
from ..exceptions import InputError
from ..functional._distances import epsilon_block, epsilon_graph, power_of_two_scale
from ..functional.topology import BettiNumbers, _betti_numbers_of_adjacency, _upper_edges, degrees
from .cost import PATHS, CostEstimate, CostModel, path_features, predict_module_build_bytes

__all__ = ["MMHM", "UpdateStats"]

_STATE_VERSION = 1
_PATH_CHOICES = ("auto", *PATHS)
# Dominator candidates tried one row at a time before the full neighbour submatrix is gathered.
_QUICK_CANDIDATES = 3
# Path exploration (see MMHM._choose).
_EXPLORE_MIN_SEEN = 1
_EXPLORE_RATIO = 1.25
_REVISIT_EVERY = 50
_REVISIT_RATIO = 1.25
# The rebuild (the exact fallback) is measured again after this many updates when the last incremental update took
# longer than this ratio x the last rebuild: a model misled by a few noisy early measurements recovers within this
# many updates.
_REBUILD_RECHECK_EVERY = 25
_REBUILD_RECHECK_RATIO = 1.25
# An incremental update gives up and rebuilds past this multiple of the predicted rebuild time.
_BAIL_RATIO = 1.5
# How often (in operations) the deadline is checked.
_DEADLINE_CHECK_EVERY = 16
# Updates over which the one-off module build after a rebuild is amortised in path decisions.
_AMORTISE_UPDATES = 10


def _csr_graph(rows: NDArray[np.intp], cols: NDArray[np.intp], n: int) -> csr_matrix:
    """A CSR matrix of the edges; rows arrive sorted (row-major edge lists), so no COO sort is needed."""
    if rows.size and np.any(rows[1:] < rows[:-1]):
        order = np.argsort(rows, kind="stable")
        rows, cols = rows[order], cols[order]
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return csr_matrix((np.ones(rows.size, dtype=np.int8), cols, indptr), shape=(n, n))


def _submatrix(matrix: NDArray[np.bool_], rows: NDArray[np.intp], cols: NDArray[np.intp]) -> NDArray[np.bool_]:
    """``matrix[np.ix_(rows, cols)]``, gathered one axis at a time (several times faster than the joint index)."""
    result: NDArray[np.bool_] = matrix.take(rows, axis=0).take(cols, axis=1)
    return result


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    """What one `MMHM.update` or `MMHM.push` did.

    Attributes:
        path: ``"rebuild"``, ``"vertex"``, ``"edge"`` or ``"noop"`` (nothing moved).
        reason: why that path was taken.
        n_points: points in the complex after the update.
        edges: edges of the ε-graph after the update.
        edges_added: edges that appeared.
        edges_removed: edges that disappeared.
        operations: elementary vertex or edge operations applied (0 for a rebuild).
        certified: operations a local certificate proved harmless.
        modules_touched: modules (components) recomputed with GUDHI.
        modules: modules after the update (β0).
        ms: wall time of the update in milliseconds.
        predicted_ms: the cost model's prediction for the path taken, made before running it.
        predicted_bytes: predicted peak of the new arrays the update allocated (see ``CostEstimate.bytes``).
        predicted_gudhi_bytes: rough estimate of GUDHI's simplex tree (see ``CostEstimate.gudhi_bytes``).
    """

    path: str
    reason: str
    n_points: int
    edges: int
    edges_added: int
    edges_removed: int
    operations: int
    certified: int
    modules_touched: int
    modules: int
    ms: float
    predicted_ms: float
    predicted_bytes: int
    predicted_gudhi_bytes: int

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UpdateStats:
        """The inverse of `as_dict`."""
        return cls(**data)


class MMHM:
    """Modular Morse Homology Maintenance: exact (β0, β1) of the Rips complex at a fixed ε under edits.

    Two ways in, one per engine:

    * probe mode, `update`: the same ``n`` points (a fixed probe, same order) at every call;
    * streaming mode, `push`: a window of the last ``window`` points, a batch at a time, oldest evicted.

    After any sequence of calls, `betti_numbers` equals
    [`topocallbacks.functional.betti_numbers`][topocallbacks.functional.betti_numbers] computed from scratch on the
    same points and ε.

    Args:
        epsilon: the scale, finite and > 0 (an edge joins points at distance ``<= epsilon``).
        window: window size for `push` (>= 2); None for a probe-mode engine.
        path: ``"auto"`` (the cost model chooses), or force ``"rebuild"``, ``"vertex"`` or ``"edge"`` (for tests
            and benchmarks; ``"edge"`` applies to probe updates, ``"vertex"`` to both modes).
        link_certificates: also try the GUDHI link certificate when a vertex is not dominated (more operations
            certified, each a little dearer).
        clock: seconds, monotonic, that times each update for the cost model and the deadlines of the incremental
            paths (``time.perf_counter``, monotonic wall time; a test passes its own, e.g. ``time.thread_time``,
            which a busy machine's pre-emptions do not inflate).

    Raises:
        InputError: an argument is out of range.

    Examples:
        >>> import numpy as np
        >>> angles = np.linspace(0, 2 * np.pi, 40, endpoint=False)
        >>> circle = np.stack([np.cos(angles), np.sin(angles)], axis=1)
        >>> engine = MMHM(epsilon=0.3)
        >>> engine.update(circle)
        BettiNumbers(b0=1, b1=1)
        >>> moved = circle.copy()
        >>> moved[:20] *= 1.5  # half the loop moves out: two arcs, no loop
        >>> engine.update(moved), engine.last_stats.path in {"vertex", "edge", "rebuild"}
        (BettiNumbers(b0=2, b1=0), True)
    """

    _mode: str | None
    _points: NDArray[np.float64]
    _alive: NDArray[np.bool_]
    _adjacency: NDArray[np.bool_]
    _labels: NDArray[np.int64]
    _degree: NDArray[np.int64]
    # Edges of the graph while ``_degree`` is stale (a rebuild defers the degrees to the next incremental path, which
    # is the only one that reads them); None while ``_degree`` is current.
    _stale_edges: int | None
    _n_alive: int
    _module_b1: dict[int, int]
    _totals: BettiNumbers | None
    _dirty: set[int]
    _next_label: int
    _n_pushed: int
    _updates: int
    _setup_seconds: float
    _last_tried: dict[str, int]
    _last_seconds: dict[str, float]
    _ops: int
    _certified: int

    def __init__(
        self,
        *,
        epsilon: float,
        window: int | None = None,
        path: str = "auto",
        link_certificates: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.epsilon = check_positive_float(epsilon, "epsilon")
        self.window = None if window is None else check_int(window, "window", minimum=2)
        if path not in _PATH_CHOICES:
            raise InputError(f"`path` must be one of {sorted(_PATH_CHOICES)}, got {path!r}")
        self.path = path
        self.link_certificates = bool(link_certificates)
        self.clock = clock
        self.cost_model = CostModel()
        self.last_stats: UpdateStats | None = None
        self._reset()

    # --- public API ----------------------------------------------------------------------------------------

    @property
    def mode(self) -> str | None:
        """``"probe"`` after `update`, ``"stream"`` after `push`, None before either."""
        return self._mode

    @property
    def n_points(self) -> int:
        """Points in the complex."""
        return int(self._n_alive)

    @property
    def n_edges(self) -> int:
        """Edges of the current ε-graph."""
        if self._stale_edges is not None:
            return self._stale_edges
        return int(self._degree.sum()) // 2

    @property
    def points(self) -> NDArray[np.float64]:
        """A copy of the points (probe order, or oldest to newest in streaming mode)."""
        result: NDArray[np.float64] = self._points[self._slot_order()].copy()
        return result

    def betti_numbers(self) -> BettiNumbers:
        """The current ``(b0, b1)``.

        Raises:
            InputError: no points were given yet.
        """
        if self._mode is None:
            raise InputError("the engine has no points yet: call update(points) or push(batch) first")
        if self._totals is not None:
            return self._totals
        return BettiNumbers(len(self._module_b1), int(sum(self._module_b1.values())))

    def update(self, points: Any) -> BettiNumbers:
        """Probe mode: replace the points (same ``n``, same order) and return the new ``(b0, b1)``.

        Args:
            points: ``(n, d)`` array-like or torch tensor; ``n`` and ``d`` fixed by the first call.

        Raises:
            InputError: the shape changed, or this engine is streaming.
            NonFiniteError: NaN or Inf.
        """
        return self._update(as_points(points))

    def _update(self, cloud: NDArray[np.float64]) -> BettiNumbers:
        """`update` of a validated cloud."""
        if self._mode == "stream":
            raise InputError("this engine is in streaming mode (push was called): use push(batch), or a new MMHM")
        start = self.clock()
        if self._mode is None:
            self._mode = "probe"
            self._allocate(*cloud.shape)
            self._points[:] = cloud
            self._alive[:] = True
            self._rebuild(start, "first call")
            return self.betti_numbers()
        if cloud.shape != self._points.shape:
            raise InputError(
                f"`points` must keep the shape {self._points.shape} of the first update (a fixed probe), "
                f"got {cloud.shape}"
            )
        # Every row whose first coordinate differs moved; when that is every row (probe mode's usual case), the
        # full comparison is skipped.
        first = cloud[:, 0] != self._points[:, 0]
        if first.all():
            moved = np.arange(first.size)
        else:
            moved = np.flatnonzero(first | np.any(cloud[:, 1:] != self._points[:, 1:], axis=1))
        if moved.size == 0:
            self._record("noop", "no point moved", start, 0, 0, 0, 0, 0, None)
            return self.betti_numbers()
        self._update_probe(cloud, moved, start)
        return self.betti_numbers()

    def push(self, batch: Any) -> BettiNumbers:
        """Streaming mode: add a batch to the window, evicting the oldest points, and return ``(b0, b1)``.

        Args:
            batch: ``(b, d)`` array-like or torch tensor (``b >= 1``); ``d`` fixed by the first call.

        Raises:
            InputError: no window was set, ``d`` changed, or this engine is in probe mode.
            NonFiniteError: NaN or Inf.
        """
        return self._push_batch(as_points(batch, "batch", min_samples=1))

    def _push_batch(self, cloud: NDArray[np.float64]) -> BettiNumbers:
        """`push` of a validated batch."""
        if self.window is None:
            raise InputError("push needs a window: create the engine with MMHM(epsilon=..., window=W)")
        if self._mode == "probe":
            raise InputError("this engine is in probe mode (update was called): use update(points), or a new MMHM")
        start = self.clock()
        if self._mode is None:
            self._mode = "stream"
            self._allocate(self.window, cloud.shape[1])
        elif cloud.shape[1] != self._points.shape[1]:
            raise InputError(
                f"`batch` must have {self._points.shape[1]} features like the earlier batches, got shape {cloud.shape}"
            )
        self._push(cloud, start)
        return self.betti_numbers()

    def predict_cost(
        self, *, moved: int | None = None, n: int | None = None, d: int | None = None
    ) -> dict[str, CostEstimate]:
        """Predicted time and memory of the next update along each path.

        Args:
            moved: points that will move (probe) or arrive (streaming); defaults to all of them.
            n: number of points (defaults to the current one).
            d: dimension (defaults to the current one).

        Returns:
            ``{"rebuild": CostEstimate, "vertex": CostEstimate}`` (the edge path depends on the flips, known
            only once the new distances are computed).

        Raises:
            InputError: the engine has no points yet and ``n`` or ``d`` is missing.
        """
        if (n is None or d is None) and self._mode is None:
            raise InputError("predict_cost needs `n` and `d` before the first update")
        n_ = self.n_points if n is None else check_int(n, "n", minimum=1)
        d_ = self._points.shape[1] if d is None else check_int(d, "d", minimum=1)
        m = n_ if moved is None else check_int(moved, "moved", minimum=0)
        density = self._edge_density()
        edges = int(density * n_ * (n_ - 1) / 2)
        degree = density * max(n_ - 1, 0)
        return {
            "rebuild": self.cost_model.predict("rebuild", n=n_, d=d_, edges=edges),
            "vertex": self.cost_model.predict("vertex", n=n_, d=d_, edges=edges, ops=2 * m, mean_degree=degree),
        }

    def largest_n_within(self, seconds: float, d: int, *, edge_density: float | None = None) -> int:
        """The largest probe size whose predicted rebuild fits in ``seconds`` (a per-check time budget).

        Returns at least 2, even when two points are predicted to exceed the budget.

        Args:
            seconds: the budget, finite and > 0.
            d: dimension of the points.
            edge_density: share of pairs joined at ε (defaults to the current graph's, else 0.15).
        """
        budget = check_positive_float(seconds, "seconds")
        dim = check_int(d, "d", minimum=1)
        density = self._edge_density() if edge_density is None else edge_density
        low, high = 2, 2
        while high < 1 << 20 and self._rebuild_seconds(high * 2, dim, density) <= budget:
            high *= 2
        high *= 2
        while high - low > 1:
            mid = (low + high) // 2
            if self._rebuild_seconds(mid, dim, density) <= budget:
                low = mid
            else:
                high = mid
        return low

    def reset(self) -> None:
        """Forget every point (the cost model keeps what it learned)."""
        self._reset()
        self.last_stats = None

    def state_dict(self, include_points: bool = True) -> dict[str, Any]:
        """State to save: ε, window, mode, the points (or a rebuild marker) and the cost model.

        The complex itself is not saved: `load_state_dict` rebuilds it exactly from the points. With
        ``include_points=False`` the state is small and JSON-ready; after loading it, the next `update`
        starts from scratch and a streaming window starts empty.
        """
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "epsilon": self.epsilon,
            "window": self.window,
            "mode": self._mode,
            "n_pushed": self._n_pushed,
            "cost_model": self.cost_model.state_dict(),
            "rebuild": not include_points,
        }
        if include_points and self._mode is not None:
            state["points"] = self.points
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` (ε and window must match this engine's).

        Raises:
            InputError: missing keys, another version, an unknown mode, or a different ε or window.
        """
        check_state(state, {"version", "epsilon", "window", "mode", "n_pushed", "rebuild"}, _STATE_VERSION)
        if state["mode"] not in (None, "probe", "stream"):
            raise InputError(f"`state['mode']` must be None, 'probe' or 'stream', got {state['mode']!r}")
        if state["epsilon"] != self.epsilon or state["window"] != self.window:
            raise InputError(
                f"`state` was saved with epsilon={state['epsilon']!r}, window={state['window']!r}; this engine has "
                f"epsilon={self.epsilon!r}, window={self.window!r}"
            )
        self.reset()
        if "cost_model" in state:
            self.cost_model.load_state_dict(state["cost_model"])
        points = state.get("points")
        if state["mode"] is None or state["rebuild"] or points is None:
            return
        cloud = as_points(points, "state['points']", min_samples=1)
        start = self.clock()
        self._mode = state["mode"]
        if self._mode == "probe":
            self._allocate(*cloud.shape)
            self._points[:] = cloud
            self._alive[:] = True
        elif self.window is None:
            raise InputError("`state` is a streaming state, but this engine has no window")
        else:
            self._allocate(self.window, cloud.shape[1])
            n_pushed = int(state["n_pushed"])
            slots = (n_pushed - len(cloud) + np.arange(len(cloud))) % self.window
            self._points[slots] = cloud
            self._alive[slots] = True
            self._n_pushed = n_pushed
        self._rebuild(start, "state loaded")

    def __repr__(self) -> str:
        return (
            f"MMHM(epsilon={self.epsilon!r}, window={self.window!r}, path={self.path!r}, "
            f"link_certificates={self.link_certificates!r})"
        )

    # --- storage --------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._mode = None
        self._points = np.zeros((0, 1))
        self._alive = np.zeros(0, dtype=bool)
        self._adjacency = np.zeros((0, 0), dtype=bool)
        self._labels = np.zeros(0, dtype=np.int64)
        self._degree = np.zeros(0, dtype=np.int64)
        self._stale_edges = None
        self._n_alive = 0
        self._module_b1 = {}
        self._totals = None
        self._dirty = set()
        self._next_label = 0
        self._n_pushed = 0
        self._updates = 0
        self._setup_seconds = 0.0
        self._last_tried = {}
        self._last_seconds = {}
        self._ops = 0
        self._certified = 0

    def _allocate(self, capacity: int, dim: int) -> None:
        self._points = np.zeros((capacity, dim))
        self._alive = np.zeros(capacity, dtype=bool)
        self._adjacency = np.zeros((capacity, capacity), dtype=bool)
        self._labels = np.full(capacity, -1, dtype=np.int64)
        self._degree = np.zeros(capacity, dtype=np.int64)
        self._stale_edges = None
        self._n_alive = 0

    def _slot_order(self) -> NDArray[np.intp]:
        if self._mode != "stream":
            return np.flatnonzero(self._alive)
        return (self._n_pushed - self._n_alive + np.arange(self._n_alive)) % self._window_size

    @property
    def _window_size(self) -> int:
        """The streaming window (push checks that there is one before anything is stored)."""
        if self.window is None:
            raise InputError("push needs a window: create the engine with MMHM(epsilon=..., window=W)")
        return self.window

    def _new_label(self) -> int:
        self._next_label += 1
        return self._next_label

    def _edge_density(self) -> float:
        n = self.n_points
        return 0.15 if n < 2 else self.n_edges / (n * (n - 1) / 2)

    def _rebuild_seconds(self, n: int, d: int, density: float) -> float:
        return self.cost_model.predict("rebuild", n=n, d=d, edges=int(density * n * (n - 1) / 2)).seconds

    # --- paths ----------------------------------------------------------------------------------------------

    def _rebuild(
        self,
        start: float,
        reason: str,
        graph: tuple[NDArray[np.bool_], NDArray[np.intp], NDArray[np.intp]] | None = None,
        flipped: int | None = None,
        learn: bool = True,
        rows_done: int | None = None,
        estimate: CostEstimate | None = None,
    ) -> None:
        """From scratch: (β0, β1) of the whole ε-graph, exactly as the from-scratch function computes them.

        Args:
            start: `clock` at the start of the update.
            reason: why the rebuild was chosen.
            graph: the ε-graph of the alive points (adjacency, rows, cols) if the caller already computed it.
            flipped: edges that changed since the last update, if known (probe mode).
            learn: let the cost model learn from this update's time (not after an abandoned incremental path,
                whose time the update includes).
            rows_done: the caller already brought the stored adjacency up to date by recomputing this many rows
                (those of the moved or new points: the graph between the others did not change), so no ε-graph
                pass is needed; ``graph`` is then ignored.
            estimate: the cost model's prediction for this rebuild, if the caller made it already.
        """
        size = self._alive.size
        n, d = int(np.count_nonzero(self._alive)), self._points.shape[1]
        # Every slot holds a point (probe mode, a full window): no index of the alive slots is needed.
        full = n == size
        alive = np.arange(size) if full else np.flatnonzero(self._alive)
        old_edges = self.n_edges
        if estimate is None:
            estimate = self.cost_model.predict(
                "rebuild", n=n, d=d, edges=old_edges, probe=self._mode == "probe", rows=rows_done
            )
        if rows_done is not None:
            adjacency = self._adjacency if full else _submatrix(self._adjacency, alive, alive)
            # The degrees wait for the next incremental path (see _ensure_modules): a count is all a rebuild needs.
            new_edges = int(np.count_nonzero(self._adjacency)) // 2
        else:
            if graph is None:
                graph = epsilon_graph(self._points if full else self._points[alive], self.epsilon)
            adjacency, rows, cols = graph
            new_edges = int(rows.size)
        if flipped is not None:
            # added + removed = flipped and added - removed = new - old.
            added, removed = (flipped + new_edges - old_edges) // 2, (flipped - new_edges + old_edges) // 2
        else:
            # The slots now hold other points (or there were none): everything old went, everything new came.
            added, removed = new_edges, old_edges
        # Totals from the compact graph (indices 0..n-1), as from scratch.
        totals = _betti_numbers_of_adjacency(adjacency)
        if rows_done is not None:
            self._stale_edges = new_edges
        else:
            if full:
                self._adjacency = adjacency
            else:
                self._adjacency[:] = False
                self._adjacency[np.ix_(alive, alive)] = adjacency
                rows, cols = alive[rows], alive[cols]
            self._degree = np.bincount(rows, minlength=size) + np.bincount(cols, minlength=size)
            self._stale_edges = None
        self._n_alive = n
        # Totals only, as from scratch; the modules are built when an incremental path first needs them.
        self._module_b1.clear()
        self._labels[:] = -1
        self._dirty.clear()
        self._totals = totals
        features = path_features("rebuild", n=n, d=d, edges=new_edges, rows=rows_done) if learn else None
        self._record("rebuild", reason, start, added, removed, 0, 0, self._totals.b0, estimate, features)

    def _refresh_rows(self, slots: NDArray[np.intp]) -> int:
        """Recompute the stored adjacency's rows and columns of ``slots`` against every alive point.

        Each decision is the one a from-scratch ε-graph makes (`epsilon_block`), so the stored graph stays
        exactly the from-scratch graph of the alive points; dead slots get empty rows. Returns how many edges
        flipped (appeared or disappeared).
        """
        scale = power_of_two_scale(self._points, self.epsilon)
        block = epsilon_block(self._points[slots], self._points, self.epsilon, scale=scale)
        block &= self._alive[None, :]
        block &= self._alive[slots, None]
        block[np.arange(slots.size), slots] = False
        changed = block ^ self._adjacency[slots]
        # A pair of two refreshed slots appears in two rows.
        flipped = int(np.count_nonzero(changed)) - int(np.count_nonzero(changed[:, slots])) // 2
        self._adjacency[slots] = block
        self._adjacency[:, slots] = block.T
        return flipped

    def _ensure_modules(self) -> None:
        """Split the complex into modules (components with their β1) if a rebuild left only totals."""
        if self._totals is None:
            return
        tick = self.clock()
        if self._stale_edges is not None:
            self._degree = degrees(self._adjacency)
            self._stale_edges = None
        label = self._new_label()
        self._labels[self._alive] = label
        self._dirty = {label}
        self._finalize()
        self._totals = None
        # A one-off cost of the update that follows a rebuild, kept out of that path's learned law.
        self._setup_seconds += self.clock() - tick

    def _with_pending_modules(self, estimate: CostEstimate, edges: int) -> CostEstimate:
        """An incremental path's estimate plus building the modules first, if a rebuild left only totals.

        The build is a one-off that every later incremental update benefits from, so the decision counts it
        amortised over ``_AMORTISE_UPDATES`` updates (counting it whole would keep a rebuilding engine rebuilding
        for ever); its memory peak competes with the path's.
        """
        if self._totals is None:
            return estimate
        coefficients = self.cost_model.coefficients_["rebuild"]
        build = coefficients["const"] + coefficients["edges"] * edges
        return CostEstimate(
            path=estimate.path,
            seconds=estimate.seconds + build / _AMORTISE_UPDATES,
            bytes=max(
                estimate.bytes,
                predict_module_build_bytes(self._alive.size, edges, 0 if self._alive.all() else self._n_alive),
            ),
            gudhi_bytes=estimate.gudhi_bytes,
        )

    def _choose(self, context: str, *estimates: CostEstimate) -> tuple[str, str, CostEstimate]:
        """The path to take among ``estimates``, and why.

        The cheapest prediction wins, except that a path measured fewer than ``_EXPLORE_MIN_SEEN`` times is tried
        when its prediction is within ``_EXPLORE_RATIO`` of the best, and one not tried for ``_REVISIT_EVERY``
        updates is tried again when within ``_REVISIT_RATIO`` of the best, a ratio that doubles with every further
        ``_REVISIT_EVERY`` updates it stays untried: a model that never measures a path never learns it, and
        coefficients learned in another regime (a dense phase early in training, say) would otherwise lock it out
        for ever. A trial is cheap: an incremental path that runs past its deadline rebuilds. And the rebuild, the
        exact fallback, is measured again every ``_REBUILD_RECHECK_EVERY`` updates while the last incremental update
        took ``_REBUILD_RECHECK_RATIO`` times longer than the last rebuild, so a few noisy early measurements cannot
        keep it out.
        """
        ranked = sorted(estimates, key=lambda estimate: estimate.seconds)
        best = ranked[0]
        rebuild = next((estimate for estimate in ranked if estimate.path == "rebuild"), None)
        last = self._last_seconds
        if (
            rebuild is not None
            and best.path != "rebuild"
            and self._updates - self._last_tried.get("rebuild", 0) >= _REBUILD_RECHECK_EVERY
            and last.get(best.path, 0.0) > _REBUILD_RECHECK_RATIO * last.get("rebuild", math.inf)
        ):
            return (
                "rebuild",
                f"{context}: measuring the rebuild again (the last {best.path} update took "
                f"{last[best.path] * 1e3:.2f} ms, the last rebuild {last['rebuild'] * 1e3:.2f} ms)",
                rebuild,
            )
        for other in ranked[1:]:
            seen = self.cost_model.observations_[other.path]
            idle = self._updates - self._last_tried.get(other.path, -_REVISIT_EVERY)
            allowed = _REVISIT_RATIO * 2.0 ** ((idle - _REVISIT_EVERY) / _REVISIT_EVERY)
            if (seen < _EXPLORE_MIN_SEEN and other.seconds <= _EXPLORE_RATIO * best.seconds) or (
                idle >= _REVISIT_EVERY and other.seconds <= allowed * best.seconds
            ):
                return (
                    other.path,
                    f"{context}: measuring the {other.path} path ({seen} measurements so far; predicted "
                    f"{other.seconds * 1e3:.2f} ms against {best.seconds * 1e3:.2f} ms for {best.path})",
                    other,
                )
        return best.path, f"{context}: {best.path} path predicted cheapest ({best.seconds * 1e3:.2f} ms)", best

    def _update_probe(self, cloud: NDArray[np.float64], moved: NDArray[np.intp], start: float) -> None:
        n, d = cloud.shape
        edges = self.n_edges
        degree = 2 * edges / n
        rebuild = self.cost_model.predict("rebuild", n=n, d=d, edges=edges, rows=moved.size)
        common = max(degree * degree / max(n - 1, 1), 1.0)  # expected common neighbours of an edge
        context = f"{moved.size} of {n} points moved"
        vertex = rebuild
        if self.path == "auto" and moved.size == n:
            # Every point moved: the vertex path would delete and insert them all, so the choice is between the
            # edge path and a rebuild, made once the new graph tells how many edges flipped.
            path, reason = "graph", context
        elif self.path == "auto":
            vertex = self.cost_model.predict("vertex", n=n, d=d, edges=edges, ops=2 * moved.size, mean_degree=degree)
            vertex = self._with_pending_modules(vertex, edges)
            # The edge path's floor (no flip at all): if even that loses to the vertex path, skip the new graph.
            edge_floor = self.cost_model.predict(
                "edge", n=n, d=d, edges=edges, ops=0, mean_degree=common, rows=moved.size
            )
            edge_floor = self._with_pending_modules(edge_floor, edges)
            path, reason, _ = self._choose(context, vertex, rebuild, edge_floor)
        else:
            path, reason = ("vertex" if self.path == "vertex" else "graph"), "forced"
            if path == "vertex":
                vertex = self.cost_model.predict(
                    "vertex", n=n, d=d, edges=edges, ops=2 * moved.size, mean_degree=degree
                )
                vertex = self._with_pending_modules(vertex, edges)
        if path == "vertex":
            self._vertex_path(cloud[moved], moved, moved, start, reason, vertex, self._deadline(start, rebuild))
            return
        if self.path == "rebuild":
            self._points[:] = cloud
            self._rebuild(start, "forced")
            return
        # Edge or rebuild: both need the new graph, which also tells how many edges flipped. Only the rows of the
        # moved points are recomputed: the graph between the others did not change.
        previous, self._points[:] = self._adjacency, cloud
        if moved.size == n:
            adjacency = epsilon_graph(cloud, self.epsilon, edges=False)[0]
        else:
            self._adjacency = previous.copy()
            self._refresh_rows(moved)
            adjacency, self._adjacency = self._adjacency, previous
        # The flip mask overwrites the old graph (no new n x n array); the edge path restores it below.
        flips = np.bitwise_xor(previous, adjacency, out=previous)
        n_flips = int(np.count_nonzero(flips)) // 2
        edge = self.cost_model.predict("edge", n=n, d=d, edges=edges, ops=n_flips, mean_degree=common, rows=moved.size)
        if n_flips:  # with no flip the edge path has nothing to apply, and needs no modules
            edge = self._with_pending_modules(edge, edges)
        if self.path != "auto":
            path, reason = "edge", "forced"
        elif n_flips == 0:  # both paths have paid for the new graph; the rebuild would recompute the Betti numbers
            path, reason = "edge", f"{context}, no edge flipped: nothing to apply"
        else:
            path, reason, _ = self._choose(f"{context}, {n_flips} edges flipped", edge, rebuild)
        if path == "edge":
            deadline = self._deadline(start, rebuild)
            flipped = _upper_edges(flips) if n_flips else (np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp))
            self._adjacency = np.bitwise_xor(flips, adjacency, out=flips)  # the old graph again
            self._edge_path(flipped, start, reason, edge, common, deadline, rows_done=moved.size)
        else:
            self._adjacency = adjacency
            self._rebuild(start, reason, flipped=n_flips, rows_done=moved.size, estimate=rebuild)

    def _push(self, cloud: NDArray[np.float64], start: float) -> None:
        window = self._window_size
        if len(cloud) >= window:
            # Only the last `window` points of the batch survive; they fill the window.
            slots = (self._n_pushed + len(cloud) - window + np.arange(window)) % window
            self._n_pushed += len(cloud)
            self._points[slots] = cloud[-window:]
            self._alive[:] = True
            self._rebuild(start, "batch fills the window")
            return
        slots = (self._n_pushed + np.arange(len(cloud))) % window
        n_after = min(self._n_alive + len(cloud), window)
        d = cloud.shape[1]
        edges = self.n_edges
        degree = 2 * edges / max(self.n_points, 1)
        evicted = slots[self._alive[slots]]
        ops = len(cloud) + evicted.size
        vertex = self.cost_model.predict("vertex", n=n_after, d=d, edges=edges, ops=ops, mean_degree=degree)
        vertex = self._with_pending_modules(vertex, edges)
        rebuild = self.cost_model.predict("rebuild", n=n_after, d=d, edges=edges, probe=False, rows=len(cloud))
        self._n_pushed += len(cloud)
        if self.path == "auto":
            path, reason, _ = self._choose(f"{len(cloud)} new points, {evicted.size} evicted", vertex, rebuild)
        else:
            path, reason = ("rebuild" if self.path == "rebuild" else "vertex"), "forced"
        if path == "vertex":
            self._vertex_path(cloud, slots, evicted, start, reason, vertex, self._deadline(start, rebuild))
            return
        self._points[slots] = cloud
        self._alive[slots] = True
        flipped = self._refresh_rows(slots)
        self._rebuild(start, reason, flipped=flipped, rows_done=slots.size)

    def _deadline(self, start: float, rebuild: CostEstimate) -> float | None:
        """When an incremental update should give up and rebuild: ``_BAIL_RATIO`` x the predicted rebuild.

        Forced paths never give up. A model that underestimates a path (its certificates may fall back to the
        GUDHI link check far more often than usual) thus costs at most about ``_BAIL_RATIO + 1`` rebuilds once.
        """
        return None if self.path != "auto" else start + _BAIL_RATIO * rebuild.seconds

    def _bail_out(
        self, path: str, start: float, done: int, total: int, features: Mapping[str, float], reason: str
    ) -> None:
        """Abandon an incremental update past its deadline: teach the model, then rebuild from the final points."""
        elapsed = self.clock() - start
        self.cost_model.observe(path, features, elapsed * total / max(done, 1))
        self._last_tried[path] = self._updates + 1
        self._setup_seconds = 0.0
        self._rebuild(
            start,
            f"{reason}; the {path} path ran past its deadline after {done} of {total} operations, so rebuilt",
            learn=False,
        )

    def _begin_incremental(self, deadline: float | None, operations: int) -> float | None:
        """Reset the operation counters and, if there are ``operations`` to apply, build the modules.

        The modules are built only if a rebuild left only totals, and only for an update that edits the graph: one
        with nothing to apply (an edge update where no edge flipped) leaves the complex, and so the totals, as they
        are. Returns the deadline moved by the build's time: the one-off build does not count against the path.
        """
        self._ops = self._certified = 0
        if operations:
            self._ensure_modules()
        return None if deadline is None else deadline + self._setup_seconds

    def _past(self, deadline: float | None) -> bool:
        """Whether an incremental path ran past ``deadline`` (checked every ``_DEADLINE_CHECK_EVERY`` operations)."""
        return deadline is not None and self._ops % _DEADLINE_CHECK_EVERY == 0 and self.clock() > deadline

    def _vertex_path(
        self,
        new_points: NDArray[np.float64],
        slots: NDArray[np.intp],
        evicted: NDArray[np.intp],
        start: float,
        reason: str,
        estimate: CostEstimate,
        deadline: float | None,
    ) -> None:
        """Delete the ``evicted`` slots, then insert ``new_points`` into ``slots``, one certificate each."""
        total = evicted.size + slots.size
        deadline = self._begin_incremental(deadline, total)
        degree = 2 * self.n_edges / max(self.n_points, 1)
        planned = path_features(
            "vertex", n=self._alive.size, d=self._points.shape[1], edges=self.n_edges, ops=total, mean_degree=degree
        )
        removed = 0
        for slot in evicted:
            if self._past(deadline):
                self._points[slots] = new_points
                self._alive[slots] = True
                self._bail_out("vertex", start, self._ops, total, planned, reason)
                return
            removed += int(self._degree[slot])
            self._delete_vertex(int(slot))
        self._points[slots] = new_points
        # One BLAS block for all rows; a row is masked to the points alive when its point goes in.
        scale = power_of_two_scale(self._points, self.epsilon)
        rows = epsilon_block(new_points, self._points, self.epsilon, scale=scale)
        added = 0
        for k, slot in enumerate(slots):
            if self._past(deadline):
                self._alive[slots] = True
                self._bail_out("vertex", start, self._ops, total, planned, reason)
                return
            row = rows[k] & self._alive
            row[slot] = False
            added += int(row.sum())
            self._insert_vertex(int(slot), row)
        touched = self._finalize()
        edges = self.n_edges
        ops = self._ops
        degree = 2 * edges / max(self.n_points, 1)
        features = path_features(
            "vertex", n=self.n_points, d=self._points.shape[1], edges=edges, ops=ops, mean_degree=degree
        )
        self._record("vertex", reason, start, added, removed, ops, self._certified, touched, estimate, features)

    def _edge_path(
        self,
        flipped: tuple[NDArray[np.intp], NDArray[np.intp]],
        start: float,
        reason: str,
        estimate: CostEstimate,
        common: float,
        deadline: float | None,
        rows_done: int | None = None,
    ) -> None:
        """Apply the exact edge diff ``flipped`` (its edges ``rows < cols``): removals first, then insertions.

        One certificate each. ``rows_done``: rows of the new ε-graph computed for the diff (None: all of them).
        """
        rows, cols = flipped
        deadline = self._begin_incremental(deadline, rows.size)
        present = self._adjacency[rows, cols]
        n, d = self._points.shape
        planned = path_features("edge", n=n, d=d, edges=self.n_edges, ops=rows.size, mean_degree=common, rows=rows_done)
        removals = zip(rows[present], cols[present], strict=True)
        insertions = zip(rows[~present], cols[~present], strict=True)
        for operation, (u, v) in [
            *((self._remove_edge, e) for e in removals),
            *((self._add_edge, e) for e in insertions),
        ]:
            if self._past(deadline):
                self._bail_out("edge", start, self._ops, rows.size, planned, reason)
                return
            operation(int(u), int(v))
        touched = self._finalize()
        features = path_features(
            "edge", n=n, d=d, edges=self.n_edges, ops=self._ops, mean_degree=common, rows=rows_done
        )
        added, removed = int((~present).sum()), int(present.sum())
        self._record("edge", reason, start, added, removed, self._ops, self._certified, touched, estimate, features)

    # --- elementary operations --------------------------------------------------------------------------------

    def _dominator(self, neighbours: NDArray[np.intp]) -> bool:
        """Whether some neighbour is adjacent to all the others (the link is a cone)."""
        size = neighbours.size
        if size <= 2:
            return size == 1 or bool(self._adjacency[neighbours[0], neighbours[1]])
        degrees = self._degree[neighbours]
        # A dominator has degree >= size - 1; try the best-connected candidates first, one row each.
        candidates = neighbours[degrees >= size - 1]
        if candidates.size == 0:
            return False
        if candidates.size > _QUICK_CANDIDATES:
            top = np.argpartition(self._degree[candidates], -_QUICK_CANDIDATES)[-_QUICK_CANDIDATES:]
            quick = candidates[top]
        else:
            quick = candidates
        for w in quick:
            # w is adjacent to every other neighbour: count its edges into the set (w itself is not one of them).
            if np.count_nonzero(self._adjacency[w, neighbours]) == size - 1:
                return True
        if candidates.size <= _QUICK_CANDIDATES:
            return False
        sub = _submatrix(self._adjacency, candidates, neighbours)
        return bool((np.count_nonzero(sub, axis=1) == size - 1).any())

    def _connected(self, vertices: NDArray[np.intp]) -> bool:
        if self._dominator(vertices):
            return True
        sub = _submatrix(self._adjacency, vertices, vertices)
        count, _ = connected_components(csr_matrix(sub), directed=False)
        return bool(count == 1)

    def _link_is_acyclic_and_connected(self, neighbours: NDArray[np.intp]) -> bool:
        """The link (flag complex on ``neighbours``) has β0 = 1 and β1 = 0."""
        if not self.link_certificates:
            return False
        sub = _submatrix(self._adjacency, neighbours, neighbours)
        if np.count_nonzero(sub) < 2 * (neighbours.size - 1):
            return False  # too few edges to connect it
        return _betti_numbers_of_adjacency(sub) == (1, 0)

    def _vertex_certified(self, neighbours: NDArray[np.intp]) -> bool:
        return self._dominator(neighbours) or self._link_is_acyclic_and_connected(neighbours)

    def _insert_vertex(self, slot: int, row: NDArray[np.bool_]) -> None:
        self._ops += 1
        self._adjacency[slot] = row
        self._adjacency[:, slot] = row
        self._alive[slot] = True
        self._n_alive += 1
        neighbours = np.nonzero(row)[0]
        self._degree[neighbours] += 1
        self._degree[slot] = neighbours.size
        if neighbours.size == 0:
            label = self._new_label()
            self._module_b1[label] = 0
            self._certified += 1
        else:
            label = int(self._labels[neighbours[0]])
            if self._vertex_certified(neighbours):
                self._certified += 1
            else:
                self._dirty.update(int(x) for x in np.unique(self._labels[neighbours]))
        self._labels[slot] = label

    def _delete_vertex(self, slot: int) -> None:
        self._ops += 1
        neighbours = np.nonzero(self._adjacency[slot])[0]
        label = int(self._labels[slot])
        if neighbours.size == 0:
            if label not in self._dirty:
                del self._module_b1[label]  # an isolated point was a module of its own
            self._certified += 1
        elif self._vertex_certified(neighbours):
            self._certified += 1
        else:
            self._dirty.add(label)
        self._adjacency[slot] = False
        self._adjacency[:, slot] = False
        self._alive[slot] = False
        self._n_alive -= 1
        self._degree[neighbours] -= 1
        self._degree[slot] = 0
        self._labels[slot] = -1

    def _remove_edge(self, u: int, v: int) -> None:
        self._ops += 1
        common = np.nonzero(self._adjacency[u] & self._adjacency[v])[0]
        if common.size and self._connected(common):
            self._certified += 1
        else:
            self._dirty.update((int(self._labels[u]), int(self._labels[v])))
        self._adjacency[u, v] = self._adjacency[v, u] = False
        self._degree[[u, v]] -= 1

    def _add_edge(self, u: int, v: int) -> None:
        self._ops += 1
        self._adjacency[u, v] = self._adjacency[v, u] = True
        self._degree[[u, v]] += 1
        lu, lv = int(self._labels[u]), int(self._labels[v])
        common = np.nonzero(self._adjacency[u] & self._adjacency[v])[0]
        if lu in self._dirty or lv in self._dirty:
            self._dirty.update((lu, lv))
        elif common.size:
            if lu == lv and self._connected(common):
                self._certified += 1
            else:
                self._dirty.update((lu, lv))
        elif lu == lv:
            self._module_b1[lu] += 1  # a new loop through u and v, which were already connected
            self._certified += 1
        else:
            self._module_b1[lu] += self._module_b1.pop(lv)  # two modules merge
            self._labels[self._labels == lv] = lu
            self._certified += 1

    def _finalize(self) -> int:
        """Recompute every dirty module: split it into its current components, β1 of each with GUDHI.

        Vectorised over components: sizes and edge counts come from one edge list, and GUDHI runs only on the
        components that hold a cycle (more edges than vertices - 1); the others are trees, with β1 = 0.
        """
        if not self._dirty:
            return 0
        dirty = np.fromiter(self._dirty, dtype=np.int64)
        for label in self._dirty:
            self._module_b1.pop(label, None)
        self._dirty.clear()
        if dirty.size == 1:
            members = np.flatnonzero(self._alive & (self._labels == dirty[0]))
        else:
            members = np.flatnonzero(self._alive & np.isin(self._labels, dirty))
        if members.size == 0:
            return 0
        # Every slot a member (a probe's first split into modules): the adjacency itself, which is only read here.
        sub = self._adjacency if members.size == self._alive.size else _submatrix(self._adjacency, members, members)
        rows, cols = _upper_edges(sub)
        count, component = connected_components(_csr_graph(rows, cols, members.size), directed=False)
        sizes = np.bincount(component, minlength=count)
        edge_counts = np.bincount(component[rows], minlength=count)
        base = self._next_label + 1
        self._next_label += int(count)
        self._labels[members] = base + component
        b1 = dict.fromkeys(range(base, base + int(count)), 0)
        cyclic = np.flatnonzero(edge_counts > sizes - 1)
        if cyclic.size:
            for c in cyclic:
                vertices = np.flatnonzero(component == c)
                b1[base + int(c)] = _betti_numbers_of_adjacency(_submatrix(sub, vertices, vertices)).b1
        self._module_b1.update(b1)
        return int(count)

    def _record(
        self,
        path: str,
        reason: str,
        start: float,
        added: int,
        removed: int,
        operations: int,
        certified: int,
        touched: int,
        estimate: CostEstimate | None,
        features: Mapping[str, float] | None = None,
    ) -> None:
        seconds = self.clock() - start
        self._updates += 1
        setup, self._setup_seconds = self._setup_seconds, 0.0
        if features is not None and path in PATHS:
            self.cost_model.observe(path, features, max(seconds - setup, 1e-7))
            self._last_tried[path] = self._updates
            self._last_seconds[path] = seconds - setup
        self.last_stats = UpdateStats(
            path=path,
            reason=reason,
            n_points=self.n_points,
            edges=self.n_edges,
            edges_added=added,
            edges_removed=removed,
            operations=operations,
            certified=certified,
            modules_touched=touched,
            modules=self.betti_numbers().b0,
            ms=seconds * 1e3,
            predicted_ms=math.nan if estimate is None else estimate.seconds * 1e3,
            predicted_bytes=0 if estimate is None else estimate.bytes,
            predicted_gudhi_bytes=0 if estimate is None else estimate.gudhi_bytes,
        )
