"""Trunks, replay and branching: a detector's closed-loop run at the cost of the steps after its first action.

Per (architecture, seed) the unprotected runs are trained once (:func:`train_trunks`): the healthy twin from
position 0, and each faulted run from the healthy twin's state at the check at or before its fault's start
(``Setup.branch``; that check is shared: the first faulty update comes after it). A trunk keeps each step's loss
and gradient norm, and at every check the standard metric, the probe metric, the probe features and the training
state (the library's ``capture_state``).

A detector's :class:`Run` starts in *replay*: it is fed the trunk's recorded observations exactly as a live loop
would feed them (our detectors: ``record_dynamics`` per step, ``process`` + ``act`` at each check), and its
actuator answers ``snapshot()`` with the trunk's recorded state. The first call that would change the training
(a restore, a learning-rate cut, a stop, a skipped or clipped step) *materialises* the live trainee at that exact
point (the trunk state at the latest check, plus the plain steps since) and the run goes on live from there with
the detector still active. A detector that never acts costs nothing: its outcome is the trunk's. Runs are split at
the earliest branch of the faulted kinds (``Setup.split``, :meth:`Run.split`): the healthy prefix is replayed (or
trained) once for the three kinds.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from faults import KINDS, Architecture, RescueTrainee, Setup, StepChange

from topocallbacks import TopoMonitor
from topocallbacks.interventions import LoopActuator, skip_updates, updates_left_to_skip

#: Detectors that need no check (per-step baselines) are evaluated live every this many positions (for the curves)
#: and at the end, not at every check.
CURVE_EVERY = 50


@dataclasses.dataclass
class Observation:
    """What a check sees: the standard metric, the metric on the probe's samples, the probe features."""

    metric: float
    probe_metric: float
    features: np.ndarray


@dataclasses.dataclass
class Trunk:
    """An unprotected run's recording: per position (loss, gradient norm), per check (metrics, features, state)."""

    kind: str
    loss: np.ndarray
    grad_norm: np.ndarray
    metric: dict[int, float] = dataclasses.field(default_factory=dict)
    probe_metric: dict[int, float] = dataclasses.field(default_factory=dict)
    features: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    states: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    lr: np.ndarray | None = None
    seconds: float = 0.0

    def observation(self, position: int) -> Observation:
        return Observation(self.metric[position], self.probe_metric[position], self.features[position])

    @property
    def curve(self) -> list[tuple[int, float]]:
        return sorted(self.metric.items())


def _record_check(trainee: RescueTrainee, trunk: Trunk, position: int) -> None:
    metric, probe_metric, features = trainee.evaluate()
    trunk.metric[position] = metric
    trunk.probe_metric[position] = probe_metric
    trunk.features[position] = np.asarray(features, dtype=np.float32)
    trunk.states[position] = trainee.state()


def _train(trainee: RescueTrainee, trunk: Trunk, start: int, setup: Setup, progress: Callable | None) -> None:
    assert trunk.lr is not None
    for position in range(start, setup.steps):
        trunk.lr[position] = trainee.learning_rate() * setup.spike_at(trunk.kind, position)
        trunk.loss[position], trunk.grad_norm[position], _ = trainee.step(position)
        if (position + 1) % setup.check_every == 0:
            _record_check(trainee, trunk, position + 1)
        if progress is not None:
            progress()


def train_trunks(arch: Architecture, seed: int, setup: Setup, progress: Callable | None = None) -> dict[str, Trunk]:
    """The three unprotected runs of (architecture, seed): healthy from 0, the faulted ones from the fault."""
    n = setup.steps
    trunks: dict[str, Trunk] = {}
    started = time.perf_counter()
    healthy = Trunk("healthy", np.full(n, np.nan), np.full(n, np.nan), lr=np.full(n, np.nan))
    trainee = RescueTrainee(arch, seed, "healthy", setup)
    _record_check(trainee, healthy, 0)
    _train(trainee, healthy, 0, setup, progress)
    healthy.seconds = time.perf_counter() - started
    trunks["healthy"] = healthy
    for kind in KINDS[1:]:
        fault = setup.branch(kind)  # the check at or before the kind's first difference from the healthy twin
        started = time.perf_counter()
        trunk = Trunk(kind, healthy.loss.copy(), healthy.grad_norm.copy(), lr=healthy.lr.copy())  # type: ignore[union-attr]
        trunk.loss[fault:] = trunk.grad_norm[fault:] = trunk.lr[fault:] = np.nan  # type: ignore[index]
        for field in ("metric", "probe_metric", "features", "states"):
            getattr(trunk, field).update({q: v for q, v in getattr(healthy, field).items() if q <= fault})
        trainee = RescueTrainee(arch, seed, kind, setup)
        trainee.restore(healthy.states[fault])
        _train(trainee, trunk, fault, setup, progress)
        trunk.seconds = time.perf_counter() - started
        trunks[kind] = trunk
    return trunks


# --- our detectors ------------------------------------------------------------------------------------------------


def copied(monitor: TopoMonitor) -> TopoMonitor:
    """A copy of ``monitor`` for a branch: its pickling state drops the snapshots, so the copy shares them back."""
    twin = copy.deepcopy(monitor)
    twin.snapshots.snapshots = [copy.copy(s) for s in monitor.snapshots.snapshots]
    return twin


def intervention(position: int, done: Any) -> list[dict[str, Any]]:
    """The run's event for what ``monitor.act`` did at ``position`` (an `InterventionRecord`, or None: nothing)."""
    if done is None:
        return []
    return [{"position": position, "action": done.action, "snapshot_step": done.snapshot_step,
             "steps_lost": done.steps_lost, "reason": done.reason}]  # fmt: skip


class TopoDetector:
    """The library's monitor as a detector: ``record_dynamics`` every step, ``process`` and ``act`` at each check."""

    needs_checks = True

    def __init__(self, policy: dict[str, Any], check_every: int, replay_data: bool = False) -> None:
        self.monitor = TopoMonitor(check_every=check_every, policy=policy)
        # Plain replay: after a rollback the data go back with the state, and the rate is never cut (the policy's
        # ``rollback_lr_factor=None`` still cuts from the second rollback on; the actuator ignores those cuts).
        self.replay_data = replay_data

    @property
    def snapshot_bytes(self) -> int:
        return self.monitor.snapshots.nbytes

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        self.monitor.record_dynamics(loss, grad_norm)
        return None

    def on_check(self, position: int, observation: Observation, actuator: Any) -> list[dict[str, Any]]:
        record = self.monitor.process(observation.features, step=position)
        return intervention(position, self.monitor.act(record, actuator))

    def clone(self) -> TopoDetector:
        twin = copy.copy(self)
        twin.monitor = copied(self.monitor)
        return twin


class RecordedProbe(torch.nn.Module):
    """The model a planned detector's monitor runs its probe through: probe sample ``i`` (its index, a tensor
    ``[i]``) comes out of the watched layer ``features`` as row ``i`` of the check's recorded probe features
    (``table``), so the library's own probe pass, its seeded subset of a smaller probe included, reads the features
    the trainee gave."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Identity()
        self.table = torch.empty(0)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.features(self.table[index[:, 0]])


class PlannedTopoDetector:
    """The library's monitor as its schedule drives it: ``on_step`` at every step, following a budget's ``plan``.

    The shipped default plans once, at the third check, from the machine's timings (`topocallbacks.budget`); this
    detector follows a plan measured beforehand (``plans.py``), through the library's ``plan=`` option, so that its
    runs do not depend on the load of the machine that replays them. What the plan changes is the library's doing:
    from its step the checks the schedule calls (every ``intervals`` x ``check_every`` steps), the probe (a seeded
    subset of ``probe_size`` samples, which restarts the calibration) and the step each decision is applied at
    (``lag`` steps after its check). The checks are evaluated in this process (the runner's in-loop path, which
    applies a background check's decision at the same step as a worker would: `Runner._still_starting`), so no
    worker process is started per run.
    """

    needs_checks = False

    def __init__(self, policy: dict[str, Any], check_every: int, plan: dict[str, Any], probe_size: int) -> None:
        self.lookup = RecordedProbe()
        self.monitor = TopoMonitor(probe=torch.arange(probe_size)[:, None], layer="features", check_every=check_every,
                                   policy=policy, plan=plan)  # fmt: skip
        self.monitor.runner.failures = 2  # the checks run here (WorkerLife.in_loop), their steps unchanged
        self._dynamics: tuple[float | None, float | None] = (None, None)

    @property
    def snapshot_bytes(self) -> int:
        return self.monitor.snapshots.nbytes

    def on_step(self, position: int, loss: float, grad_norm: float) -> StepChange | None:
        self._dynamics = (loss, grad_norm)  # given to the monitor with the step's on_step, after the step
        return None

    def on_clock(self, clock: int, observe: Callable[[], Observation], actuator: Any) -> list[dict[str, Any]]:
        """The loop's ``monitor.on_step`` after step ``clock``: a check when the schedule calls one (``observe``
        gives its features), and the decisions due at this step applied through ``actuator``."""
        if self.monitor.due(clock):
            self.lookup.table = torch.from_numpy(observe().features)
        loss, grad_norm = self._dynamics
        self._dynamics = (None, None)
        records = self.monitor.on_step(clock, model=self.lookup, loss=loss, grad_norm=grad_norm)
        return [event for record in records for event in intervention(clock, self.monitor.act(record, actuator))]

    def clone(self) -> PlannedTopoDetector:
        twin = copy.copy(self)
        twin.lookup = RecordedProbe()
        twin.monitor = copied(self.monitor)
        return twin


# --- runs ---------------------------------------------------------------------------------------------------------


class BranchActuator:
    """The :class:`~topocallbacks.interventions.Actuator` of a run at one check.

    In replay, ``snapshot()`` is the trunk's recorded state; anything that changes the training materialises the
    live trainee first, then goes through the library's ``LoopActuator(optimizer, scheduler, model=model)``. A stop
    keeps the snapshot the monitor hands over (``save_snapshot``) in memory: the run's outcome is that state's.
    """

    def __init__(self, run: Run, position: int) -> None:
        self.run, self.position = run, position

    def _live(self) -> LoopActuator:
        self.run.materialise(self.position)
        trainee = self.run.trainee
        assert trainee is not None
        return LoopActuator(trainee.optimizer, trainee.scheduler, model=trainee.model)

    def snapshot(self) -> dict[str, Any]:
        self.run.snapshots_taken += 1
        if self.run.trainee is None:  # the trunk's copy: the cost model adds a measured copy (``timing_job``)
            return self.run.trunk_state(self.position)
        started = time.perf_counter()
        try:
            return self._live().snapshot()
        finally:
            self.run.snapshot_seconds += time.perf_counter() - started

    def restore(self, snapshot: Any) -> str:
        live = self._live()
        trainee = self.run.trainee
        assert trainee is not None
        before = trainee.updates
        detail = live.restore(snapshot)
        undone = before - trainee.updates
        self.run.updates_undone += undone
        self.run.last_undone = undone
        return f"{detail} ({undone} updates undone)"

    def scale_learning_rate(self, factor: float) -> str:
        if getattr(self.run.detector, "replay_data", False):  # plain replay never changes the rate
            return "rate left as it was (plain replay)"
        return self._live().scale_learning_rate(factor)

    def skip_updates(self, count: int) -> str:
        return self._live().skip_updates(count)  # the library's skip: the trainee's optimizer.step() does nothing

    def request_stop(self) -> str:
        self._live()
        self.run.stopped_at = self.position
        return "stop requested"

    def checkpoint_location(self, tag: str) -> str:
        return "not saved (the benchmark keeps the state in memory)"

    def save_checkpoint(self, tag: str) -> None:
        return None

    def save_snapshot(self, snapshot: Any, tag: str) -> str:
        self.run.saved = snapshot
        return "kept in memory"


class Run:
    """One detector's run on one kind of (architecture, seed): replayed from the trunk until it acts, then live.

    ``trunks`` None: a live run from scratch (the reference the branching is checked against).
    """

    def __init__(
        self,
        arch: Architecture,
        seed: int,
        setup: Setup,
        kind: str,
        trunks: dict[str, Trunk] | None,
        detector: Any,
    ) -> None:
        self.arch, self.seed, self.setup, self.kind = arch, seed, setup, kind
        self.trunks = trunks
        self.detector = detector
        self.position = 0  # the next training position
        self.trainee: RescueTrainee | None = None if trunks is not None else RescueTrainee(arch, seed, kind, setup)
        self.curve: list[tuple[int, float]] = []
        self.events: list[dict[str, Any]] = []
        self.warnings = 0
        self.saved: Any = None
        self.stopped_at: int | None = None
        self.updates_undone = 0
        self.last_undone = 0
        self.branched_at: int | None = None if trunks is not None else 0
        self.final: float | None = None
        self.final_updates: int | None = None
        self.live_steps = 0
        self.live_evaluations = 0
        # The monitor's step is the count of training steps taken (``clock``): it equals the data position
        # unless a plain-replay rollback sent the data back; ``positions`` maps a check's clock to its position.
        self.clock = 0
        self.positions: dict[int, int] = {}
        self.replayed = 0  # positions trained again after a plain-replay rollback
        self.detector_seconds = 0.0  # in the detector's calls, its actions included (snapshots, restores)
        self.probe_passes = 0  # checks at which the detector needed the probe's features
        self.snapshot_bytes = 0  # the most the detector's snapshots held at once
        self.snapshots_taken = 0
        self.snapshot_seconds = 0.0  # live copies (the cost model counts a measured copy per snapshot instead)
        self.branch_seconds = 0.0  # materialising from the trunk (the benchmark's, not the detector's)
        self.observe_seconds = 0.0  # live probe evaluations a planned detector asked for (priced as probe passes)

    @property
    def trunk(self) -> Trunk:
        assert self.trunks is not None
        return self.trunks[self.kind]

    def _trainee_at(self, position: int) -> RescueTrainee:
        """A trainee in the trunk's state at ``position``: the state of the check at or before it, plus the plain
        steps since (the steps are the benchmark's: ``branch_seconds``)."""
        started = time.perf_counter()
        check = position - position % self.setup.check_every
        trainee = RescueTrainee(self.arch, self.seed, self.kind, self.setup)
        trainee.restore(self.trunk.states[check])
        for p in range(check, position):
            trainee.step(p)
        self.branch_seconds += time.perf_counter() - started
        return trainee

    def materialise(self, position: int) -> None:
        """Go live at ``position`` (before its training step, after its check): the trunk's state there."""
        if self.trainee is not None:
            return
        self.trainee = self._trainee_at(position)
        self.live_steps += position % self.setup.check_every
        self.branched_at = position

    def trunk_state(self, position: int) -> dict[str, Any]:
        """The trunk's training state at ``position``: recorded at each check, rebuilt (and kept) between them."""
        states = self.trunk.states
        if position not in states:  # a decision applied between checks (a background check's lag)
            states[position] = self._trainee_at(position).state()
        return states[position]

    # --- the loop -------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._check(0)
        self._on_clock(0)

    def advance(self, until: int) -> None:
        """Train positions ``[position, until)``, with the checks that fall after them."""
        while self.position < until and self.stopped_at is None:
            p = self.position
            self._step(p)
            self.position = p + 1
            self.clock += 1
            if self.stopped_at is None and self.position % self.setup.check_every == 0:
                self._check(self.position)
            if self.stopped_at is None:
                self._on_clock(self.position)

    def _log_change(self, position: int, change: StepChange) -> None:
        self.events.append({"position": position, "action": change.action, "clip_to": change.clip_to})

    def _timed(self, call: Callable[[], Any]) -> Any:
        """``call()``, its seconds added to ``detector_seconds`` less any branching, live snapshot or live probe
        evaluation inside it (the cost model prices the probe passes apart)."""
        aside = self.branch_seconds + self.snapshot_seconds + self.observe_seconds
        started = time.perf_counter()
        try:
            return call()
        finally:
            inside = self.branch_seconds + self.snapshot_seconds + self.observe_seconds - aside
            self.detector_seconds += time.perf_counter() - started - inside

    def _judge(self, p: int, loss: float, norm: float) -> StepChange | None:
        return self._timed(lambda: self.detector.on_step(p, loss, norm))

    def _step(self, p: int) -> None:
        if self.trainee is None:
            loss, norm = float(self.trunk.loss[p]), float(self.trunk.grad_norm[p])
            change = self._judge(p, loss, norm)
            if change is None:
                return
            self._log_change(p, change)
            if change.stop:  # after this step's update: the trunk's state before the next position
                self.materialise(p + 1)
                self.stopped_at = p + 1
                return
            self.materialise(p)
            assert self.trainee is not None
            live_loss, _, _ = self.trainee.step(p, decide=lambda _loss, _norm: change)
            self.live_steps += 1
            if live_loss != loss:  # pragma: no cover - the replay and the live step must agree bit for bit
                raise RuntimeError(f"position {p}: the live loss {live_loss!r} is not the trunk's {loss!r}")
            return
        _, _, change = self.trainee.step(p, decide=lambda loss, norm: self._judge(p, loss, norm))
        self.live_steps += 1
        if change is not None:
            self._log_change(p, change)
            if change.stop:
                self.stopped_at = p + 1

    def _evaluate(self) -> Observation:
        assert self.trainee is not None
        self.live_evaluations += 1
        return Observation(*self.trainee.evaluate())

    def _check(self, q: int) -> None:
        if q >= self.setup.steps:  # the end of the data budget: the outcome, no detector
            self.final = self.trunk.metric[q] if self.trainee is None else self._evaluate().metric
            self.final_updates = self.setup.steps if self.trainee is None else self.trainee.updates
            self.curve.append((q, self.final))
            return
        if self.trainee is None:
            observation: Observation | None = self.trunk.observation(q)
        elif self.detector.needs_checks or q % CURVE_EVERY == 0:
            observation = self._evaluate()
        else:
            observation = None
        if observation is not None:
            self.curve.append((q, observation.metric))
        if self.detector.needs_checks:
            assert observation is not None
            self.probe_passes += 1
            self.positions[self.clock] = q
            self._take(q, self._timed(lambda: self.detector.on_check(self.clock, observation, BranchActuator(self, q))))

    def _on_clock(self, q: int) -> None:
        """A planned detector's call after each step (``on_clock``): the library's schedule decides what it does."""
        if not hasattr(self.detector, "on_clock") or q >= self.setup.steps:  # no detector acts at the outcome
            return
        self.positions[self.clock] = q

        def observe() -> Observation:
            self.probe_passes += 1
            if self.trainee is None:
                return self.trunk.observation(q)
            started = time.perf_counter()
            try:
                return self._evaluate()
            finally:
                self.observe_seconds += time.perf_counter() - started

        self._take(q, self._timed(lambda: self.detector.on_clock(self.clock, observe, BranchActuator(self, q))))

    def _take(self, q: int, events: list[dict[str, Any]]) -> None:
        """Log the detector's interventions at position ``q`` (a rollback's snapshot step as a position)."""
        self.snapshot_bytes = max(self.snapshot_bytes, getattr(self.detector, "snapshot_bytes", 0))
        for event in events:
            event["position"] = q
            if event.get("snapshot_step") is not None:
                event["snapshot_step"] = self.positions[event["snapshot_step"]]
            if event["action"] == "warn":
                self.warnings += 1
                continue
            if event["action"] == "rollback":
                event["updates_undone"] = self.last_undone
                if getattr(self.detector, "replay_data", False):  # the same data again, from the snapshot
                    self.replayed += q - event["snapshot_step"]
                    self.position = event["snapshot_step"]
            self.events.append(event)

    def finish(self) -> float:
        """Run to the end of the data budget (or to the stop) and return the final standard metric."""
        if self.stopped_at is None:
            self.advance(self.setup.steps)
        if self.stopped_at is not None and self.final is None:
            assert self.trainee is not None
            # The outcome is what the library leaves in the model: the last healthy state when the stop restored it,
            # else the weights it stopped with (a snapshot the stop only wrote to a file is not the model's).
            self.final = self._evaluate().metric
            self.final_updates = self.trainee.updates
            self.curve.append((self.stopped_at, self.final))
        assert self.final is not None
        return self.final

    def split(self, kinds: tuple[str, ...] = KINDS) -> dict[str, Run]:
        """One copy per kind at ``setup.split`` (everything before it is the same for every kind)."""
        assert self.position == self.setup.split or self.stopped_at is not None
        twins = {}
        for kind in kinds:
            twin = copy.copy(self)
            twin.kind = kind
            twin.detector = self.detector.clone()
            twin.curve = list(self.curve)
            twin.events = [dict(event) for event in self.events]
            twin.positions = dict(self.positions)
            if self.trainee is not None:
                twin.trainee = RescueTrainee(self.arch, self.seed, kind, self.setup)
                twin.trainee.restore(self.trainee.state())
                left = updates_left_to_skip(self.trainee.optimizer)  # a rollback's skip still under way
                if left:
                    skip_updates([twin.trainee.optimizer], left)
            twins[kind] = twin
        return twins

    def summary(self) -> dict[str, Any]:
        """The run's outcome, JSON-ready."""
        return {
            "kind": self.kind,
            "final_metric": self.final,
            "final_updates": self.final_updates,
            "stopped_at": self.stopped_at,
            "branched_at": self.branched_at,
            "updates_undone": self.updates_undone,
            "events": self.events,
            "warnings": self.warnings,
            "curve": self.curve,
            "live_steps": self.live_steps,
            "live_evaluations": self.live_evaluations,
            "cost": {
                "detector_seconds": self.detector_seconds,
                "snapshots": self.snapshots_taken,
                "probe_passes": self.probe_passes,
                "steps_trained": self.clock,  # positions trained, replayed ones included, up to the end or stop
                "positions_replayed": self.replayed,
                "steps_recomputed": sum(e["action"] == "recompute" for e in self.events),
                "snapshot_bytes": self.snapshot_bytes,
            },
        }


def run_detector(
    arch: Architecture, seed: int, setup: Setup, trunks: dict[str, Trunk], make: Callable[[], Any]
) -> dict[str, Run]:
    """A detector's three runs (healthy, transient, structural), branched from the trunks."""
    run = Run(arch, seed, setup, "healthy", trunks, make())
    run.start()
    run.advance(setup.split)
    runs = run.split()
    for twin in runs.values():
        twin.finish()
    return runs


def measure_costs(arch: Architecture, setup: Setup, repeats: int = 7) -> dict[str, float]:
    """Seconds of one training step, one probe pass and one snapshot copy of a setting (medians, seed 0).

    The rescue suite's cost model (``outputs.wall_clock_ratio``) prices a run with these: branched runs are not
    timed end to end (most of a run is replayed from its trunk), so a run's training steps, the probe passes and
    snapshots its detector needed are counted, and only the detector's own calls are timed.
    """
    trainee = RescueTrainee(arch, 0, "healthy", setup)
    for p in range(3):  # warm-up
        trainee.step(p)

    def median(call: Callable[[int], Any]) -> float:
        times = []
        for i in range(repeats):
            started = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - started)
        return float(np.median(times))

    return {
        "step_seconds": median(lambda i: trainee.step(3 + i)),
        "probe_seconds": median(lambda i: trainee.probe()),
        "copy_seconds": median(lambda i: trainee.state()),
    }


def run_live(arch: Architecture, seed: int, setup: Setup, kind: str, make: Callable[[], Any]) -> Run:
    """A detector's run trained live from scratch (no trunk): what a branched run must equal."""
    run = Run(arch, seed, setup, kind, None, make())
    run.start()
    run.finish()
    return run
