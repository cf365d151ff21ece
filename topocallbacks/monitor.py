"""TopoMonitor: probe -> features -> fixed transform -> MMHM + Collapse Index -> policy -> sinks.

Framework-free orchestration, usable from a plain PyTorch loop::

    monitor = TopoMonitor(probe=probe_inputs, layer="encoder.pool", check_every=100)
    for step, batch in enumerate(loader):
        ...  # forward, backward, optimizer step
        if monitor.should_check(step):
            record = monitor.check(model, step)  # record["decision"] says what to do

The Lightning and Hugging Face callbacks are thin adapters around it: they call :meth:`check` (or
:meth:`observe` in streaming mode) and apply the decision.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._validation import as_points, check_int, check_number, check_positive_float, check_state
from .distributed import broadcast_object, gather_probe_features, rank_and_world
from .exceptions import InputError, NonFiniteError
from .functional.collapse import _collapse_index, epsilon_heuristic, resolve_weights
from .functional.geometry import effective_rank
from .functional.indices import diagram_distance
from .functional.topology import _subsample, persistence_diagrams
from .mmhm import MMHM
from .policy import TUNED_RULE, Action, Decision, Policy
from .probe import FeatureExtractor, Probe, ProbeSpec
from .sinks import JsonlSink, TensorBoardSink

__all__ = ["DEFAULT_INDEX", "INDICES", "TopoMonitor", "default_policy"]

_STATE_VERSION = 2

#: The indices a monitor can hand to its policy, each with its orientation (+1: higher means more collapsed).
#: ``"diagram_drift"``: Wasserstein-1 distance between this check's H0/H1 diagrams and the previous check's
#: (0 at the first check); ``"paper"``: the paper's composite Collapse Index; ``"rankme"``: effective rank,
#: handed to the policy negated (collapse lowers it).
INDICES = {"diagram_drift": 1, "paper": 1, "rankme": -1}

#: The default index, chosen by the collapse-evidence suite (``benchmarks/collapse/``, README "Does it warn
#: early?"): among the indices computed from the probe features, the one with the best held-out lead at <= 2 %
#: false positives on healthy twins. Its lead is still small (it ties the standard metric in the median scenario).
DEFAULT_INDEX = "diagram_drift"


def default_policy(index: str = DEFAULT_INDEX, action: str = "warn") -> Policy:
    """The policy a monitor uses when none is given: the suite's z-score rule, or a 0.7 threshold for ``"paper"``.

    Example:
        >>> default_policy().score, default_policy().threshold, default_policy("paper").threshold
        ('zscore', 4.5, 0.7)
    """
    if index not in INDICES:
        raise InputError(f"`index` must be one of {sorted(INDICES)}, got {index!r}")
    if index == "paper":
        return Policy(action=action)
    return Policy(action=action, **TUNED_RULE)


_MODES = ("probe", "stream")
_PROJECTIONS = (None, "pca", "random")


class TopoMonitor:
    """Watches the features of a fixed probe (or of the training batches) and decides when to act.

    Args:
        probe: probe inputs (a tensor, a Dataset or a list; see :class:`~topocallbacks.probe.Probe`); required in
            probe mode unless features are passed to :meth:`process` directly.
        layer: name of the module whose output is watched (``model.named_modules()``).
        pooling: how that output becomes one vector per sample (see :class:`~topocallbacks.probe.FeatureExtractor`).
        mode: ``"probe"`` (run the probe every ``check_every`` steps) or ``"stream"`` (watch the training batches'
            own features through :meth:`observe`, a window of the last ``window`` points).
        check_every: steps between checks (>= 1).
        window: streaming window size (>= 2).
        points_per_batch: streaming mode: push a seeded random subset of at most this many of each batch's
            points (>= 1; None: all). 32 refreshes a 1,024-point window every 32 steps at a small fraction of
            the cost of pushing whole batches.
        projection: None, ``"pca"`` (fitted at the first check and kept) or ``"random"`` (a seeded Gaussian
            projection): a fixed map to ``projection_dim`` dimensions, so points stay comparable across checks.
        projection_dim: target dimension of the projection (>= 1).
        normalize: centre each check's cloud and scale it to unit RMS radius, so that a fixed ε keeps its meaning
            while the network's feature scale drifts (in streaming mode the centre and scale are fitted once, on
            the first batch, to keep the window's coordinates fixed).
        epsilon: a fixed ε, or None to calibrate at the first check with ``epsilon_quantile`` x ``epsilon_factor``.
        epsilon_quantile: quantile of pairwise distances for the calibration, in ``(0, 1]``.
        epsilon_factor: multiplier of that quantile (> 0).
        weights: Collapse Index weights (``"paper"``/None, or a mapping).
        index: what the policy watches: ``"diagram_drift"`` (the default, see :data:`DEFAULT_INDEX`),
            ``"paper"`` (the composite Collapse Index) or ``"rankme"``. The composite and its components are
            computed and logged either way. The suite measured probe mode; in streaming mode the drift also
            reflects the window's turnover between checks.
        max_points: subsample size for the persistence diagrams (>= 2).
        policy: a :class:`~topocallbacks.policy.Policy` (default: :func:`default_policy` for ``index``, which
            warns only).
        history_path: a JSONL file that receives one line per check and per intervention.
        tensorboard_dir: a TensorBoard log directory for ``topo/*`` scalars.
        diagram_every: checks between persistence-diagram figures in TensorBoard (0: never).
        batch_size: probe samples per forward pass.
        max_probe_samples: keep at most this many probe samples (seeded subset).
        seed: seed of every random choice (subsets, random projection, diagram subsample).

    Raises:
        InputError: an argument is out of range.
    """

    def __init__(
        self,
        *,
        probe: Any = None,
        layer: str | None = None,
        pooling: str = "auto",
        mode: str = "probe",
        check_every: int = 100,
        window: int = 1024,
        points_per_batch: int | None = 32,
        projection: str | None = None,
        projection_dim: int = 64,
        normalize: bool = True,
        epsilon: float | None = None,
        epsilon_quantile: float = 0.5,
        epsilon_factor: float = 0.5,
        weights: str | Mapping[str, float] | None = None,
        index: str = DEFAULT_INDEX,
        max_points: int = 256,
        policy: Policy | None = None,
        history_path: str | None = None,
        tensorboard_dir: str | None = None,
        diagram_every: int = 0,
        batch_size: int = 256,
        max_probe_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        if mode not in _MODES:
            raise InputError(f"`mode` must be one of {list(_MODES)}, got {mode!r}")
        self.check_every = check_int(check_every, "check_every", minimum=1)
        self.window = check_int(window, "window", minimum=2)
        self.points_per_batch = (
            None if points_per_batch is None else check_int(points_per_batch, "points_per_batch", minimum=1)
        )
        if projection not in _PROJECTIONS:
            raise InputError(f"`projection` must be one of {list(_PROJECTIONS)}, got {projection!r}")
        self.projection_dim = check_int(projection_dim, "projection_dim", minimum=1)
        if epsilon is not None:
            check_positive_float(epsilon, "epsilon")
        check_number(epsilon_quantile, "epsilon_quantile", low=0.0, high=1.0, high_open=False)
        check_positive_float(epsilon_factor, "epsilon_factor")
        self.weights_ = resolve_weights(weights)
        if index not in INDICES:
            raise InputError(f"`index` must be one of {sorted(INDICES)}, got {index!r}")
        self.index = index
        self.max_points = check_int(max_points, "max_points", minimum=2)
        self.diagram_every = check_int(diagram_every, "diagram_every", minimum=0)
        if policy is not None and not isinstance(policy, Policy):
            raise InputError(f"`policy` must be a topocallbacks.policy.Policy, got {type(policy).__name__}")
        self.mode = mode
        self.projection = projection
        self.normalize = bool(normalize)
        self.epsilon = epsilon
        self.epsilon_quantile = float(epsilon_quantile)
        self.epsilon_factor = float(epsilon_factor)
        self.seed = check_int(seed, "seed", minimum=0)
        self.policy = policy if policy is not None else default_policy(index)
        self.extractor = None if layer is None else FeatureExtractor(layer, pooling=pooling, batch_size=batch_size)
        self.max_probe_samples = max_probe_samples
        self._loaded_probe_spec: ProbeSpec | None = None
        self.probe = None if probe is None else Probe(probe, max_samples=max_probe_samples, seed=self.seed)
        if mode == "probe" and self.probe is not None and self.extractor is None:
            raise InputError("`layer` is required with a `probe`: name the module whose output to watch")
        self.history_path = history_path
        self._history_sink = None if history_path is None else JsonlSink(history_path)
        self.tensorboard_dir = tensorboard_dir
        self._tensorboard: TensorBoardSink | None = None  # created at the first check (writers do not pickle)
        self.history: list[dict[str, Any]] = []
        self.lr_factor_ = 1.0
        self.epsilon_: float | None = None if epsilon is None else float(epsilon)
        self._transform: dict[str, Any] | None = None
        self._engine: MMHM | None = None
        self._diagrams: list[NDArray[np.float64]] | None = None  # the last check's, for diagram drift

    # --- checks -------------------------------------------------------------------------------------------

    def should_check(self, step: int) -> bool:
        """Whether ``step`` is a check step (every ``check_every`` steps, from step 0)."""
        return step % self.check_every == 0

    def set_probe(self, source: Any) -> None:
        """Set the probe after construction (e.g. from a dataloader's dataset), checked against a loaded state.

        Raises:
            InputError: a bad source, or one whose contents differ from the probe a loaded state was saved with.
        """
        probe = Probe(source, max_samples=self.max_probe_samples, seed=self.seed)
        if self._loaded_probe_spec is not None:
            probe.verify(self._loaded_probe_spec)
        self.probe = probe

    def features(self, model: Any, indices: Any = None) -> NDArray[np.float32]:
        """The probe's features at ``layer`` (all samples, or ``indices``).

        Raises:
            InputError: no probe or no layer was given.
        """
        if self.probe is None or self.extractor is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        return self.extractor(model, self.probe, indices)

    def check(self, model: Any, step: int) -> dict[str, Any]:
        """Probe mode: run the probe through ``model`` and evaluate it (see :meth:`process`)."""
        start = time.perf_counter()
        return self.process(self.features(model), step, start=start)

    def check_everywhere(self, model: Any, step: int) -> dict[str, Any]:
        """:meth:`check` on every rank of a distributed job (outside one, just :meth:`check`).

        Every rank computes its shard of the probe, rank 0 evaluates and decides, every rank adopts rank 0's record.
        Every rank must call it at the same step. Returns the record, the same on every rank.

        Raises:
            InputError: no probe, or the probe pass failed (the message names the model, layer and step).
        """
        if self.probe is None:
            raise InputError("this monitor has no probe (and layer): pass features to process() instead")
        probe = self.probe
        try:
            features = gather_probe_features(lambda idx: self.features(model, idx), len(probe))
        except InputError as exc:
            layer = None if self.extractor is None else self.extractor.layer
            raise InputError(f"{exc} (model {type(model).__name__}, layer {layer!r}, step {step})") from exc
        shared = None
        if rank_and_world()[0] == 0:
            self.process(features, step)
            shared = self.share()
        record = self.adopt(shared)
        assert record is not None  # rank 0 always evaluated this check
        return record

    def adopt(self, shared: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """Broadcast rank 0's :meth:`share` (or None: nothing new) and adopt it on the other ranks.

        Every rank must call it at the same step. Returns the latest record, or None when rank 0 had nothing.
        """
        shared = broadcast_object(shared)
        if shared is None:
            return None
        if rank_and_world()[0] != 0:
            self.receive(shared)
        return self.last_record

    def process(self, features: Any, step: int, *, start: float | None = None) -> dict[str, Any]:
        """Evaluate one check of probe features ``(n, d)`` and return its record (the decision included).

        NaN or Inf features give a ``"diverged"`` record and the policy's ``on_diverged`` action; they never
        reach GUDHI.
        """
        start = time.perf_counter() if start is None else start
        cloud = self._as_cloud(features)
        if cloud is None:
            return self._diverged(step, start)
        cloud = self._apply_transform(cloud)
        if self._engine is None:
            self._calibrate(cloud)
        assert self._engine is not None
        betti = self._engine.update(cloud)
        return self._evaluate(cloud, tuple(betti), step, start, self._engine.last_stats)

    def observe(self, features: Any, step: int) -> dict[str, Any] | None:
        """Streaming mode: add a training batch's features to the window; evaluate it on check steps.

        Returns:
            The check record on a check step, else None.
        """
        if self.mode != "stream":
            raise InputError("observe() is for streaming mode; create the monitor with mode='stream'")
        start = time.perf_counter()
        cloud = self._as_cloud(features, min_samples=1)
        if cloud is None:
            return self._diverged(step, start)
        if self.points_per_batch is not None and cloud.shape[0] > self.points_per_batch:
            rows = np.random.default_rng((self.seed, step)).choice(cloud.shape[0], self.points_per_batch, replace=False)
            cloud = cloud[np.sort(rows)]
        cloud = self._apply_transform(cloud)
        if self._engine is None:
            self._calibrate(cloud)
        assert self._engine is not None
        self._engine.push(cloud)
        if not self.should_check(step) or self._engine.n_points < 2:
            return None
        window = self._engine.points
        return self._evaluate(window, tuple(self._engine.betti_numbers()), step, start, self._engine.last_stats)

    def record_intervention(self, step: int, decision: Decision, detail: str) -> dict[str, Any]:
        """Write what an adapter did about a decision (and why) to the history."""
        if decision.action is Action.LOWER_LR and decision.lr_factor is not None:
            self.lr_factor_ *= decision.lr_factor
        record = {
            "kind": "intervention",
            "step": int(step),
            "action": decision.action.value,
            "reason": decision.reason,
            "detail": detail,
            "lr_factor": self.lr_factor_,
        }
        self._emit(record)
        return record

    def share(self) -> dict[str, Any]:
        """What another rank needs to adopt this rank's latest check (distributed training).

        The record, and the state the next decisions depend on (ε, transform, policy counters, learning-rate
        factor).
        """
        return {
            "record": self.last_record,
            "epsilon": self.epsilon_,
            "transform": self._transform,
            "policy": self.policy.state_dict(),
            "lr_factor": self.lr_factor_,
            "diagrams": None if self._diagrams is None else [d.tolist() for d in self._diagrams],
        }

    def receive(self, shared: Mapping[str, Any]) -> None:
        """Adopt another rank's :meth:`share` (no file or TensorBoard output is written here)."""
        self.epsilon_ = shared["epsilon"]
        self._transform = shared["transform"]
        self.policy.load_state_dict(shared["policy"])
        self.lr_factor_ = float(shared["lr_factor"])
        self._diagrams = _as_diagrams(shared["diagrams"])
        self.history.append(dict(shared["record"]))

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The latest check record."""
        checks = [r for r in self.history if r["kind"] == "check"]
        return checks[-1] if checks else None

    # --- internals -----------------------------------------------------------------------------------------

    @staticmethod
    def _as_cloud(features: Any, min_samples: int = 2) -> NDArray[np.float64] | None:
        """Validated features, or None when they hold NaN or Inf (a diverged check)."""
        try:
            return as_points(features, "features", min_samples=min_samples)
        except NonFiniteError:
            return None

    def _fit_transform(self, cloud: NDArray[np.float64]) -> None:
        transform: dict[str, Any] = {"projection": self.projection}
        if self.projection == "pca":
            mean = cloud.mean(axis=0)
            _, _, vt = np.linalg.svd(cloud - mean, full_matrices=False)
            transform["mean"] = mean.tolist()
            transform["components"] = vt[: self.projection_dim].tolist()
        elif self.projection == "random":
            rng = np.random.default_rng(self.seed)
            matrix = rng.normal(size=(cloud.shape[1], self.projection_dim)) / math.sqrt(self.projection_dim)
            transform["matrix"] = matrix.tolist()
        transform["input_dim"] = int(cloud.shape[1])
        self._transform = transform
        if self.mode == "stream" and self.normalize:
            projected = self._project(cloud)
            centre = projected.mean(axis=0)
            radius = float(np.sqrt(np.mean(np.sum((projected - centre) ** 2, axis=1))))
            transform["centre"] = centre.tolist()
            transform["radius"] = radius if radius > 0 else 1.0

    def _project(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        assert self._transform is not None
        if cloud.shape[1] != self._transform["input_dim"]:
            raise InputError(
                f"`features` must keep dimension {self._transform['input_dim']} between checks, got {cloud.shape[1]}"
            )
        if self.projection == "pca":
            result: NDArray[np.float64] = (cloud - np.asarray(self._transform["mean"])) @ np.asarray(
                self._transform["components"]
            ).T
            return result
        if self.projection == "random":
            projected: NDArray[np.float64] = cloud @ np.asarray(self._transform["matrix"])
            return projected
        return cloud

    def _apply_transform(self, cloud: NDArray[np.float64]) -> NDArray[np.float64]:
        if self._transform is None:
            self._fit_transform(cloud)
        assert self._transform is not None
        projected = self._project(cloud)
        if not self.normalize:
            return projected
        if self.mode == "stream":
            result: NDArray[np.float64] = (projected - np.asarray(self._transform["centre"])) / self._transform[
                "radius"
            ]
            return result
        centred: NDArray[np.float64] = projected - projected.mean(axis=0)
        radius = float(np.sqrt(np.mean(np.sum(centred**2, axis=1))))
        return centred / radius if radius > 0 else centred

    def _calibrate(self, cloud: NDArray[np.float64]) -> None:
        if self.epsilon_ is None:
            if cloud.shape[0] < 2:
                raise InputError("ε calibration needs at least 2 points in the first check or batch")
            self.epsilon_ = epsilon_heuristic(
                cloud, quantile=self.epsilon_quantile, factor=self.epsilon_factor, seed=self.seed
            )
        self._engine = MMHM(epsilon=self.epsilon_, window=self.window if self.mode == "stream" else None)

    def _evaluate(
        self, cloud: NDArray[np.float64], betti: tuple[int, ...], step: int, start: float, stats: Any
    ) -> dict[str, Any]:
        report, diagrams = _collapse_index(
            cloud,
            self.epsilon_,
            self.weights_,
            max_points=self.max_points,
            seed=self.seed,
            betti=(int(betti[0]), int(betti[1])),
        )
        value = self._index_value(cloud, report.ci, diagrams)
        self._diagrams = [d[np.isfinite(d[:, 1])] for d in diagrams]  # drift ignores the essential bars
        decision = self.policy.decide(step, INDICES[self.index] * value)
        record = {
            "kind": "check",
            "step": int(step),
            "status": "ok",
            "ci": report.ci,
            "index": self.index,
            "index_value": value,
            "components": report.components,
            "betti0": report.betti0,
            "betti1": report.betti1,
            "persistence_entropy": report.persistence_entropy,
            "anisotropy": report.anisotropy_term,
            "epsilon": report.epsilon,
            "n_points": report.n_samples,
            "check_ms": (time.perf_counter() - start) * 1e3,
            "engine_path": None if stats is None else stats.path,
            "decision": decision.as_dict(),
        }
        figures = None  # full (unthresholded) diagrams for the TensorBoard figures
        if self.tensorboard_dir is not None and self.diagram_every:
            figures = persistence_diagrams(_subsample(cloud, self.max_points, self.seed), max_points=self.max_points)
        self._emit(record, figures)
        return record

    def _index_value(self, cloud: NDArray[np.float64], ci: float, diagrams: list[NDArray[np.float64]]) -> float:
        if self.index == "paper":
            return ci
        if self.index == "rankme":
            return effective_rank(cloud)
        if self._diagrams is None:
            return 0.0
        return float(sum(diagram_distance(a, b) for a, b in zip(self._diagrams, diagrams, strict=True)))

    def _diverged(self, step: int, start: float) -> dict[str, Any]:
        decision = self.policy.decide(step, None, diverged=True)
        record = {
            "kind": "check",
            "step": int(step),
            "status": "diverged",
            "ci": None,
            "index": self.index,
            "index_value": None,
            "check_ms": (time.perf_counter() - start) * 1e3,
            "decision": decision.as_dict(),
        }
        self._emit(record)
        return record

    def _emit(self, record: dict[str, Any], diagrams: list[NDArray[np.float64]] | None = None) -> None:
        self.history.append(record)
        if rank_and_world()[0] != 0:
            return  # in distributed training every rank keeps the history; only rank 0 writes files
        if self._history_sink is not None:
            self._history_sink.write(record)
        if self.tensorboard_dir is not None and record["kind"] == "check":
            if self._tensorboard is None:
                self._tensorboard = TensorBoardSink(self.tensorboard_dir, diagram_every=self.diagram_every)
            self._tensorboard.write(record, diagrams)

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: probe spec, ε, transform, history, policy counters, LR factor, engine marker."""
        return {
            "version": _STATE_VERSION,
            "probe_spec": None if self.probe is None else self.probe.spec.as_dict(),
            "epsilon": self.epsilon_,
            "transform": self._transform,
            "history": list(self.history),
            "policy": self.policy.state_dict(),
            "lr_factor": self.lr_factor_,
            "diagrams": None if self._diagrams is None else [d.tolist() for d in self._diagrams],
            # The engine is rebuilt from the next check's points (exact either way): a marker, not the points.
            "engine": None if self._engine is None else self._engine.state_dict(include_points=False),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, verify_probe: bool = True) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            InputError: missing keys, another version, or (with ``verify_probe``) a probe with other contents.
        """
        keys = {"version", "probe_spec", "epsilon", "transform", "history", "policy", "lr_factor", "engine", "diagrams"}
        check_state(state, keys, _STATE_VERSION)
        spec = None if state["probe_spec"] is None else ProbeSpec.from_dict(state["probe_spec"])
        if verify_probe and self.probe is not None and spec is not None:
            self.probe.verify(spec)
        self._loaded_probe_spec = spec
        self.epsilon_ = state["epsilon"]
        self._transform = state["transform"]
        self.history = [dict(r) for r in state["history"]]
        self.policy.load_state_dict(state["policy"])
        self.lr_factor_ = float(state["lr_factor"])
        self._diagrams = _as_diagrams(state["diagrams"])
        self._engine = None
        if state["engine"] is not None and self.epsilon_ is not None:
            self._engine = MMHM(epsilon=self.epsilon_, window=self.window if self.mode == "stream" else None)
            self._engine.load_state_dict(state["engine"])

    def close(self) -> None:
        """Close the TensorBoard writer (the JSONL sink keeps no handle open)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __getstate__(self) -> dict[str, Any]:
        # An open TensorBoard writer cannot be pickled (ddp_spawn pickles callbacks); it is reopened on use.
        state = self.__dict__.copy()
        state["_tensorboard"] = None
        return state


def _as_diagrams(saved: Any) -> list[NDArray[np.float64]] | None:
    if saved is None:
        return None
    return [np.asarray(d, dtype=np.float64).reshape(-1, 2) for d in saved]
