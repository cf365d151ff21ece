"""Rollback in a plain PyTorch loop, the snapshot store, the training channels and the rule that cannot look away."""

from __future__ import annotations

import copy
import math
import os
import warnings

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from tests.cadence import AT_CADENCE
from tests.unit.rules import old_policy, old_rule
from topocallbacks import TopoMonitor
from topocallbacks.check import CheckRecord, InterventionRecord
from topocallbacks.exceptions import InputError, SnapshotUnsupported
from topocallbacks.functional.indices import diagram_distance
from topocallbacks.interventions import LoopActuator, current_learning_rates, skip_updates
from topocallbacks.policy import Action, Decision, Policy
from topocallbacks.snapshots import SnapshotStore, capture_state, live_state_nbytes, state_nbytes

DIGITS = load_digits()
X = torch.tensor(DIGITS.data / 16.0, dtype=torch.float32)
Y = torch.tensor(DIGITS.target)
CHECK_EVERY = 5


def healthy_features(step: int) -> np.ndarray:
    """Real digits pixels with a little per-check jitter: a healthy, slowly moving cloud."""
    rng = np.random.default_rng(step)
    return DIGITS.data[:200] / 16.0 + 0.05 * rng.normal(size=(200, 64))


def collapsed_features(step: int) -> np.ndarray:
    """Every sample onto one point (plus a trace of noise): a total collapse."""
    rng = np.random.default_rng(step)
    return np.tile(DIGITS.data[:1] / 16.0, (200, 1)) + 1e-4 * rng.normal(size=(200, 64))


class Loop:
    """A real training loop (MLP on digits, SGD with momentum and a LambdaLR) whose checks see chosen features."""

    def __init__(self, monitor: TopoMonitor, directory: str | None = None) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + 0.01 * s))
        self.monitor = monitor
        self.actuator = LoopActuator(
            self.optimizer,
            self.scheduler,
            model=self.model,
            directory=directory,
            state=None if directory is None else (lambda: {"model": self.model.state_dict()}),
        )
        self.states: dict[int, dict] = {}  # our own copy of the state after each step
        self.batches: list[int] = []
        self.losses: dict[int, float] | None = None  # set to {} to pass each check's training loss to the monitor

    def run(self, steps: range, features) -> list:
        done = []
        for step in steps:
            batch = step % 20  # the data position moves on whatever happens to the weights
            index = torch.arange(batch * 64, batch * 64 + 64) % len(X)
            self.batches.append(batch)
            loss = torch.nn.functional.cross_entropy(self.model(X[index]), Y[index])
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.states[step] = copy.deepcopy(capture_state(self.model, [self.optimizer], [self.scheduler]))
            if step % CHECK_EVERY == 0:
                if self.losses is None:
                    record = self.monitor.process(features(step), step)
                else:
                    self.losses[step] = loss.item()
                    record = self.monitor.process(features(step), step, loss=self.losses[step])
                done.append(self.monitor.act(record, self.actuator))
                if self.actuator.stop_requested:
                    break
        return [d for d in done if d is not None]


def assert_state_equal(model, optimizer, scheduler, saved) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["model"][name]), name
    state = optimizer.state_dict()
    for key, entry in state["state"].items():
        for name, value in entry.items():
            expected = saved["optimizers"][0]["state"][key][name]
            assert torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected
    assert state["param_groups"] == saved["optimizers"][0]["param_groups"]
    assert scheduler.state_dict() == saved["schedulers"][0]


def rollback_monitor(**policy) -> TopoMonitor:
    rule = old_rule(action="rollback", warmup=3, **policy)
    return TopoMonitor(check_every=CHECK_EVERY, policy=rule, summary=False, **AT_CADENCE)


def fault_at(start: int, stop: int = 10**9):
    return lambda step: collapsed_features(step) if start <= step < stop else healthy_features(step)


def test_a_rollback_restores_the_newest_healthy_snapshot_bit_for_bit():
    loop = Loop(rollback_monitor())
    done = loop.run(range(0, 61), fault_at(50, 51))  # one collapsed check at step 50
    assert [(d.step, d.action, d.snapshot_step, d.steps_lost) for d in done] == [(50, "rollback", 45, 5)]
    assert "roll back to the newest healthy snapshot before step 50" in done[0].reason
    assert "rolled back to the snapshot of step 45: 5 updates undone" in done[0].detail
    # Right after the rollback (step 50) the state was step 45's; check it against our own copy by replaying.
    loop2 = Loop(rollback_monitor())
    loop2.run(range(0, 50), fault_at(50, 51))
    # Step 50 trains, then the check rolls back: the state equals the state after step 45.
    record = None
    step = 50
    index = torch.arange(step % 20 * 64, step % 20 * 64 + 64) % len(X)
    loss = torch.nn.functional.cross_entropy(loop2.model(X[index]), Y[index])
    loop2.optimizer.zero_grad()
    loss.backward()
    loop2.optimizer.step()
    loop2.scheduler.step()
    record = loop2.monitor.process(collapsed_features(step), step)
    intervention = loop2.monitor.act(record, loop2.actuator)
    assert intervention is not None
    assert intervention.snapshot_step == 45
    assert_state_equal(loop2.model, loop2.optimizer, loop2.scheduler, loop2.states[45])
    assert current_learning_rates([loop2.optimizer]) == [
        g["lr"] for g in loop2.states[45]["optimizers"][0]["param_groups"]
    ]


def test_the_snapshot_stays_intact_for_a_second_rollback_and_the_data_moves_on():
    loop = Loop(rollback_monitor(max_rollbacks=5))  # the default cooldown never holds a rollback back
    done = loop.run(range(0, 71), lambda s: collapsed_features(s) if s in (50, 60) else healthy_features(s))
    assert [(d.step, d.snapshot_step) for d in done] == [(50, 45), (60, 55)]
    # The batches are those of steps 0..70 in order: a rollback never replays data.
    assert loop.batches == [s % 20 for s in range(71)]
    # The snapshots after the first rollback were taken again from the restored run.
    assert [s.step for s in loop.monitor.snapshots.snapshots] == [65, 70]


STRUCTURAL = (
    "rollbacks made already and the alarm came back after them: its cause outlives a rollback (structural: the "
    "model, the data or the learning-rate schedule, not a passing burst), so stop"
)


def assert_restored_with_cut(loop, saved, cut) -> None:
    """The loop's state is ``saved``'s bit for bit, but for the learning rates: the snapshot's times ``cut``."""
    for name, tensor in loop.model.state_dict().items():
        assert torch.equal(tensor, saved["model"][name]), name
    state = loop.optimizer.state_dict()
    expected = saved["optimizers"][0]
    assert state["state"].keys() == expected["state"].keys()
    for key, entry in state["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, expected["state"][key][name]), (key, name)
    for group, before in zip(state["param_groups"], expected["param_groups"], strict=True):
        assert group["lr"] == pytest.approx(before["lr"] * cut)
        assert {k: v for k, v in group.items() if k not in ("lr", "initial_lr")} == {
            k: v for k, v in before.items() if k not in ("lr", "initial_lr")
        }
    scheduler = loop.scheduler.state_dict()
    assert scheduler["last_epoch"] == saved["schedulers"][0]["last_epoch"]
    assert scheduler["base_lrs"] == pytest.approx([lr * cut for lr in saved["schedulers"][0]["base_lrs"]])


def test_repeated_rollbacks_cut_the_rate_then_stop_at_the_last_healthy_state(tmp_path):
    loop = Loop(rollback_monitor(cooldown=0, max_rollbacks=2), directory=tmp_path)
    done = loop.run(range(0, 100), fault_at(50))  # the collapse persists after every rollback
    assert [(d.step, d.action) for d in done] == [(50, "rollback"), (55, "rollback"), (60, "stop")]
    # The second rollback undoes only the 5 updates since the first one (the state was step 45's at step 50).
    assert [(d.snapshot_step, d.steps_lost) for d in done] == [(45, 5), (45, 5), (45, 5)]
    assert done[0].lr_factor == 1.0  # the first rollback keeps the rate
    assert done[1].lr_factor == 0.5  # the second cuts it by lr_factor
    assert done[2].reason.endswith(f"; 2 {STRUCTURAL}; the last healthy state (step 45) is restored first")
    # The stop does not leave the weights of the fault: step 45's state is restored first, the cut kept.
    assert done[2].detail.startswith(
        "restored the last healthy state, the snapshot of step 45 (5 updates undone), before stopping; model, "
        "optimizer and scheduler state restored; the rollbacks' cut kept: learning rate x 0.5; stop requested"
    )
    assert done[2].lr_factor == 0.5
    assert loop.actuator.stop_requested
    assert_restored_with_cut(loop, loop.states[45], 0.5)
    kept = tmp_path / "topo-last-healthy-step45.pt"
    assert f"last healthy state (step 45) saved to {kept}" in done[2].detail
    saved = torch.load(kept, weights_only=True)
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor, loop.states[45]["model"][name])
    # The stop checkpoint of checkpoint_on_stop is saved after the restore: it holds the healthy weights too.
    stopped = torch.load(tmp_path / "topo-stop-step60.pt", weights_only=True)
    for name, tensor in stopped["model"].items():
        assert torch.equal(tensor, loop.states[45]["model"][name])


def test_a_rollback_with_nothing_to_go_back_to_warns_and_says_why():
    monitor = rollback_monitor()
    loop = Loop(monitor)
    for step in range(0, 40, CHECK_EVERY):
        monitor.act(monitor.process(healthy_features(step), step), loop.actuator)
    assert monitor.snapshots.snapshots
    monitor.snapshots.clear()  # e.g. a run resumed from a checkpoint: the snapshots in memory are gone
    with pytest.warns(RuntimeWarning, match="no healthy snapshot before step 40, so warn"):
        done = monitor.act(monitor.process(collapsed_features(40), 40), loop.actuator)
    assert done is not None
    assert done.action == "warn"
    assert "no healthy snapshot before step 40, so warn" in done.reason


def test_diverged_features_roll_back_when_asked():
    loop = Loop(rollback_monitor(on_diverged="rollback"))
    nan = healthy_features(0)
    nan[0, 0] = math.nan
    done = loop.run(range(0, 31), lambda s: nan if s == 30 else healthy_features(s))
    assert [(d.step, d.action, d.snapshot_step) for d in done] == [(30, "rollback", 25)]
    assert "the features diverged" in done[0].reason


@pytest.mark.parametrize(
    ("rule", "keeps"),
    [
        ({"action": "warn", "on_diverged": "warn"}, False),
        ({"action": "none", "on_diverged": "lower_lr"}, True),  # its cuts escalate to a stop (after_max_lr_cuts)
        ({"action": "none", "on_diverged": "lower_lr", "after_max_lr_cuts": "warn"}, False),
        ({"action": "lower_lr", "on_diverged": "warn", "after_max_lr_cuts": "warn"}, False),
        ({"action": "rollback", "on_diverged": "warn", "after_max_rollbacks": "warn"}, True),
        ({"action": "warn", "on_diverged": "rollback"}, True),
        ({"action": "warn", "on_diverged": "stop"}, True),  # the old default: a stop restores a snapshot first
        ({"action": "stop", "on_diverged": "warn"}, True),
        ({"action": "lower_lr", "on_diverged": "warn", "after_max_lr_cuts": "stop"}, True),
    ],
)
def test_snapshots_are_taken_only_when_the_rule_can_roll_back_or_stop(rule, keeps):
    loop = Loop(TopoMonitor(check_every=CHECK_EVERY, policy=old_rule(warmup=3, **rule), summary=False, **AT_CADENCE))
    assert loop.monitor.keeps_snapshots is keeps
    loop.run(range(0, 30), healthy_features)
    assert [s.step for s in loop.monitor.snapshots.snapshots] == ([20, 25] if keeps else [])


class Plain:
    """An actuator with none of the optional means (no snapshots)."""


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda: LoopActuator(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)),
            "`rollback` needs the model: LoopActuator(optimizer, scheduler, model=model)",
        ),
        (
            Plain,
            "Plain takes no snapshots: give it `snapshot()` and `restore()` (LoopActuator(..., model=model) has them)",
        ),
    ],
)
def test_an_actuator_without_snapshots_is_said_once_and_a_rollback_warns_instead(make, why):
    monitor = rollback_monitor()
    actuator = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(0, 40, CHECK_EVERY):
            assert monitor.act(monitor.process(healthy_features(step), step), actuator) is None
    assert [str(w.message) for w in caught] == [
        f"topocallbacks keeps no rollback snapshots: {why}. A rollback decision warns instead."
    ]  # said once, at the first healthy check, not at every one
    assert all(w.category is RuntimeWarning for w in caught)
    assert monitor.snapshots_off == why
    assert monitor.snapshots.snapshots == []
    record = monitor.process(collapsed_features(40), 40)
    assert record.decision.action.value == "rollback"  # the rule asks for a rollback...
    with pytest.warns(RuntimeWarning, match="so warn$"):
        done = monitor.act(record, actuator)
    assert done is not None
    assert (done.action, done.snapshot_step, done.detail) == ("warn", None, "warned")  # ...which becomes a warning
    assert done.reason.endswith(f"; no healthy snapshot before step 40 (no snapshots are kept: {why}), so warn")


def test_snapshots_on_disk_are_kept_to_their_number_and_summarised(tmp_path):
    monitor = TopoMonitor(
        check_every=CHECK_EVERY,
        policy=old_rule(action="rollback", warmup=3),
        snapshots=2,
        snapshot_dir=str(tmp_path / "snaps"),
        summary=False,
        **AT_CADENCE,
    )
    loop = Loop(monitor)
    loop.run(range(0, 21), healthy_features)
    assert sorted(os.listdir(tmp_path / "snaps")) == ["topo-snapshot-step15.pt", "topo-snapshot-step20.pt"]
    nbytes = monitor.snapshots.snapshots[-1].nbytes
    parameters = sum(p.numel() for p in loop.model.parameters())
    assert nbytes == 4 * 2 * parameters  # the float32 weights and SGD's momentum buffers
    assert f"2 of 2 snapshot(s) of {nbytes / 2**10:.1f} KiB each in {tmp_path / 'snaps'}" in monitor.summary()


def test_snapshot_store_keeps_the_newest_and_finds_the_one_before_an_onset():
    store = SnapshotStore(keep=3)
    for step in (0, 10, 20, 30):
        store.add(step, {"w": torch.zeros(4)}, diagrams=None)
    assert [s.step for s in store.snapshots] == [10, 20, 30]
    assert store.newest_before(30).step == 20
    assert store.newest_before(10) is None
    store.drop_after(10)
    assert [s.step for s in store.snapshots] == [10]
    assert store.nbytes == 16


# --- the rule that cannot look away ------------------------------------------------------------------------


def constant_features(step: int) -> np.ndarray:
    """Every sample the same point, up to float32 rounding (relative noise 1e-7): a collapse the sentinels see."""
    rng = np.random.default_rng(step)
    return np.tile(DIGITS.data[:1] / 16.0, (200, 1)) * (1 + 1e-7 * rng.normal(size=(200, 64)))


@pytest.mark.parametrize("patience", [1, 3, 5, 12])
def test_a_collapse_that_persists_is_flagged_at_every_check_whatever_the_patience(patience):
    monitor = TopoMonitor(check_every=1, policy=old_rule(patience=patience, warmup=5), summary=False, **AT_CADENCE)
    records = []
    for step in range(40):
        features = constant_features(step) if step >= 20 else healthy_features(step)
        records.append(monitor.process(features, step))
        if step == 19:
            healthy_reference = list(monitor.policy.reference_.values)
            healthy_diagrams = monitor.pipeline.reference_diagrams
    assert all(not r.decision.flagged and not r.decision.fired for r in records[:20])
    collapsed = [r.decision for r in records[20:]]
    # The sentinels flag every collapsed check and act at once, whatever the patience: the index's drift no longer
    # has to stay high for a collapse to stay flagged.
    assert all((d.rule, d.flagged) == ("sentinel", ("collapse",)) for d in collapsed)
    assert all(d.reason.startswith("the features are constant (spread ") for d in collapsed)
    fired = [r.step for r in records if r.decision.fired]
    assert fired == [20, 26, 32, 38]  # a repeated warning waits out the cooldown of 5 checks...
    assert all(d.held_back is Action.WARN for d in collapsed if not d.fired)  # ...and says so in between
    # The collapsed state never becomes the reference: neither the index's values nor the features' diagrams.
    assert monitor.policy.reference_.values == healthy_reference
    assert monitor.policy.reference_.held == []
    assert monitor.pipeline.reference_diagrams is healthy_diagrams


def diagram_drift(first, second) -> float:
    return sum(diagram_distance(a, b) for a, b in zip(first, second, strict=True))


def test_drift_is_the_smaller_distance_to_the_previous_check_or_the_last_unflagged_one():
    # Collapsed onto one point up to a noise (relative spread 2.3e-4) that no sentinel reads as a collapse: the
    # index alone sees it, at its onset; then the cloud is measured against its previous check, not a frozen past.
    monitor = TopoMonitor(check_every=1, policy=old_rule(warmup=5), summary=False, **AT_CADENCE)
    values, expected, to_healthy = [], [], []
    for step in range(30):
        previous, reference = monitor.pipeline.last_diagrams, monitor.pipeline.reference_diagrams
        record = monitor.process(collapsed_features(step) if step >= 20 else healthy_features(step), step)
        diagrams = monitor.pipeline.last_diagrams
        values.append(record.index_value)
        if previous is not None:
            expected.append(min(diagram_drift(previous, diagrams), diagram_drift(reference, diagrams)))
        if step == 19:
            last_healthy = diagrams
        if step >= 20:
            assert record.sentinels.holding == ()
            to_healthy.append(diagram_drift(last_healthy, diagrams))
            if record.decision.flagged:
                assert monitor.pipeline.reference_diagrams is last_healthy  # a flagged check is no reference
    assert values[1:] == pytest.approx(expected, rel=1e-12)
    assert values[20] == pytest.approx(to_healthy[0], rel=1e-12)  # the onset: far from the last healthy check
    assert values[20] > 30 * max(values[1:20])
    # Once collapsed, each check is near the one before it: the drift falls back (against the last healthy check
    # it would stay about as high as at the onset: the job of flagging a collapse that persists is the sentinels').
    assert max(values[21:]) < 0.1 * values[20]
    assert min(to_healthy[1:]) > 0.9 * values[20]


def test_a_marginal_alarm_does_not_freeze_the_reference():
    def moved(step):  # from step 20 on, half the features are twice as large: a marginal jump, then a new level
        features = healthy_features(step)
        if step >= 20:
            features[:, :32] *= 2.0
        return features

    # The loud path's reference is under test: the silent path (which warns at step 21 on the new level, a lasting
    # move from its warm-up reference) is off here and tested in test_silent_path.py.
    monitor = TopoMonitor(check_every=1, policy=old_rule(warmup=5), summary=False, silent_path=False, **AT_CADENCE)
    records, diagrams = [], []
    for step in range(30):
        records.append(monitor.process(moved(step), step))
        diagrams.append(monitor.pipeline.last_diagrams)
    assert [(r.step, r.decision.action.value) for r in records if r.decision.flagged] == [(20, "warn")]
    assert 4.5 <= records[20].decision.score < 10  # a marginal alarm
    # The checks after it are measured against their previous check (the nearer), and each becomes the reference
    # in turn; against step 19's diagrams, frozen, the moved run would stay farther at every check.
    assert monitor.pipeline.reference_diagrams is diagrams[-1]
    for step in range(21, 30):
        assert records[step].index_value == pytest.approx(diagram_drift(diagrams[step - 1], diagrams[step]))
        assert records[step].index_value < diagram_drift(diagrams[19], diagrams[step])


@pytest.mark.parametrize("schedule", ["warmup", "restarts"])
def test_ordinary_schedule_changes_stay_quiet(schedule):
    """A healthy run with a LambdaLR warm-up, or cosine warm restarts, raises no alarm under the default rule."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if schedule == "warmup":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200))
    else:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=100)
    monitor = TopoMonitor(probe=X[:128], layer="1", check_every=10, summary=False, **AT_CADENCE)
    generator = torch.Generator().manual_seed(0)
    flagged = []
    for step in range(400):
        index = torch.randint(0, len(X), (64,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(X[index]), Y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        for record in monitor.on_step(step, model=model, loss=loss.detach()):
            if record.decision.flagged or record.decision.fired:
                flagged.append((record.step, record.decision.reason))
    assert flagged == []
    assert len([r for r in monitor.history if isinstance(r, CheckRecord)]) == 40


# --- training channels -----------------------------------------------------------------------------------------


def feed(policy: Policy, losses, grads=None):
    grads = grads if grads is not None else [None] * len(losses)
    return [
        policy.decide(i, 1.0, loss=loss, grad_norm=grad)
        for i, (loss, grad) in enumerate(zip(losses, grads, strict=False))
    ]


def test_a_loss_spike_is_flagged_on_the_loss_channel():
    policy = old_policy(channels=["index", "loss"], warmup=5, action="warn")
    losses = [2.0 - 0.01 * i + 0.01 * (-1) ** i for i in range(20)] + [6.0]
    decisions = feed(policy, losses)
    assert [d.step for d in decisions if d.fired] == [20]
    assert decisions[-1].flagged == ("loss",)
    assert decisions[-1].scores is not None
    assert decisions[-1].scores["loss"] > 4.5
    assert "loss 6 at z = " in decisions[-1].reason


def test_require_two_channels_needs_both_to_hold():
    base = [2.0 - 0.01 * i + 0.01 * (-1) ** i for i in range(20)]
    grads = [1.0 + 0.02 * (-1) ** i for i in range(20)]
    policy = old_policy(channels=["loss", "grad_norm"], require=2, warmup=5)
    decisions = feed(policy, [*base, 6.0], [*grads, 1.0])
    assert not decisions[-1].fired
    assert decisions[-1].flagged == ("loss",)
    assert "(1 of the 2 channels required)" in decisions[-1].reason
    policy = old_policy(channels=["loss", "grad_norm"], require=2, warmup=5)
    decisions = feed(policy, [*base, 6.0], [*grads, 9.0])
    assert decisions[-1].fired
    assert decisions[-1].flagged == ("loss", "grad_norm")


def test_a_nan_loss_is_a_diverged_check():
    policy = old_policy(channels=["index", "loss"], warmup=5)
    decision = policy.decide(0, 1.0, loss=math.nan)
    assert decision.action.value == "stop"
    assert decision.rule == "diverged"
    assert "the training loss is nan" in decision.reason


def test_the_monitor_averages_the_steps_dynamics_and_reads_tensors_once():
    monitor = TopoMonitor(
        check_every=5, policy=old_rule(channels=["index", "loss"], warmup=0), summary=False, **AT_CADENCE
    )
    for step in range(4):
        monitor.record_dynamics(torch.tensor(float(step)), None)
    monitor.process(healthy_features(0), 5, loss=4.0)  # this step's own value joins the four before it
    assert monitor.policy.channels_["loss"].reference.values == [2.0]  # (0 + 1 + 2 + 3 + 4) / 5
    assert monitor.intake._steps == []


def test_channel_settings_are_validated():
    with pytest.raises(InputError, match=r"`channels` has 'los'; did you mean `loss`\?"):
        Policy(channels=["los"])
    with pytest.raises(InputError, match=r"`require` must be at most the number of `channels` \(1"):
        Policy(channels=["index"], require=2)
    with pytest.raises(InputError, match="names a channel twice"):
        Policy(channels=["loss", "loss"])


def test_rollback_policy_state_round_trips():
    policy = old_policy(action="rollback", channels=["index", "grad_norm"], warmup=2)
    for step in range(6):
        policy.decide(step, 1.0 + 0.1 * step, grad_norm=2.0)
    copy_ = old_policy(action="rollback", channels=["index", "grad_norm"], warmup=2)
    copy_.load_state_dict(policy.state_dict())
    assert copy_ == policy
    other = old_policy(action="rollback")
    with pytest.raises(InputError, match="watched channels"):
        other.load_state_dict(policy.state_dict())
    assert isinstance(InterventionRecord.from_dict({"kind": "intervention", "step": 1, "action": "warn", "reason": "r",
                                                    "detail": "d", "lr_factor": 1.0}), InterventionRecord)  # fmt: skip


def test_a_nan_loss_with_nothing_to_roll_back_to_escalates_like_diverged_features():
    monitor = TopoMonitor(check_every=1, policy=old_rule(on_diverged="rollback"), summary=False, **AT_CADENCE)
    loop = Loop(monitor)
    done = monitor.act(monitor.process(healthy_features(0), 0, loss=math.nan), loop.actuator)
    assert done is not None
    assert done.action == "stop"
    assert "no healthy snapshot before step 0, so stop" in done.reason


def test_a_rollback_undoes_the_cuts_made_since_its_snapshot_in_the_lr_factor():
    loop = Loop(rollback_monitor(max_rollbacks=5))
    loop.run(range(0, 46), healthy_features)
    monitor = loop.monitor
    monitor.rescuer.lr_factor_ = 0.25  # as if two cuts had been made since the snapshot of step 45
    done = monitor.act(monitor.process(collapsed_features(50), 50), loop.actuator)
    assert done is not None
    assert (done.snapshot_step, done.lr_factor) == (45, 1.0)


# --- what the rescue suite asked for: clean snapshots, compounding cuts, skipping past a burst ---------------------


def test_a_spiking_training_loss_the_rule_does_not_watch_keeps_the_check_from_being_healthy():
    policy = old_policy(channels=["index"], warmup=5, action="rollback")
    losses = [2.0 - 0.01 * i + 0.01 * (-1) ** i for i in range(20)] + [6.0, 1.78]
    decisions = feed(policy, losses)
    assert [d.fired for d in decisions] == [False] * 22  # nothing acts on an unwatched channel
    assert decisions[20].unsettled == ("loss",)
    assert not decisions[20].healthy
    assert all(d.healthy and d.unsettled == () for d in decisions[:20])
    assert decisions[21].healthy  # the spike entered no reference: the next ordinary loss is quiet again
    assert Decision.from_dict(decisions[20].as_dict()) == decisions[20]
    copy_ = old_policy(channels=["index"], warmup=5, action="rollback")
    copy_.load_state_dict(policy.state_dict())
    assert copy_ == policy
    assert copy_.unwatched_["loss"].reference.values == policy.unwatched_["loss"].reference.values
    assert set(policy.unwatched_) == {"loss", "grad_norm"}
    assert set(old_policy(channels=["index", "grad_norm"]).unwatched_) == {"loss"}


def test_no_snapshot_is_taken_while_the_training_loss_spikes_so_a_rollback_goes_to_the_one_before():
    monitor = rollback_monitor()
    loop = Loop(monitor)
    loss = [2.0 - 0.01 * i + 0.01 * (-1) ** i for i in range(12)]
    for i, step in enumerate(range(0, 60, CHECK_EVERY)):
        monitor.act(monitor.process(healthy_features(step), step, loss=loss[i]), loop.actuator)
    assert [s.step for s in monitor.snapshots.snapshots] == [50, 55]
    spiking = monitor.process(healthy_features(60), 60, loss=9.0)  # the index is quiet, the loss is not
    assert spiking.decision.unsettled == ("loss",)
    assert not spiking.decision.fired
    assert monitor.act(spiking, loop.actuator) is None
    assert [s.step for s in monitor.snapshots.snapshots] == [50, 55]  # step 60's state is not kept
    done = monitor.act(monitor.process(collapsed_features(65), 65, loss=2.0), loop.actuator)
    assert done is not None
    assert (done.action, done.snapshot_step) == ("rollback", 55)


def test_the_cuts_of_repeated_rollbacks_compound_on_the_snapshots_rates():
    loop = Loop(rollback_monitor(max_rollbacks=4, rollback_lr_factor=0.5))
    done = loop.run(range(0, 81), fault_at(50, 66))  # the checks of steps 50-65 see a collapse
    assert [(d.step, d.action, d.snapshot_step) for d in done] == [(s, "rollback", 45) for s in (50, 55, 60, 65)]
    assert [d.lr_factor for d in done] == [0.5, 0.25, 0.125, 0.0625]
    assert done[0].reason.endswith("(rollback 1 of 4)")  # nothing earlier to compound with
    assert done[3].reason.endswith(
        "(rollback 4 of 4); with the earlier rollbacks' cuts, x 0.0625 of the rate before the first rollback "
        "(x 0.0625 of the snapshot's)"
    )  # every rollback went back to step 45's snapshot, taken before any cut
    # Every restore put back the snapshot's rates; the rates in effect are theirs times the product of the cuts.
    assert loop.scheduler.base_lrs == [0.1 * 0.0625]
    snapshot_lr = loop.states[45]["optimizers"][0]["param_groups"][0]["lr"]
    after = loop.states[66]["optimizers"][0]["param_groups"][0]["lr"]
    assert after == pytest.approx(0.1 * 0.0625 / (1 + 0.01 * 47))  # step 45 was the 46th scheduler step
    assert after < snapshot_lr
    assert loop.monitor.rollback_cut_ == 0.0625
    restored = rollback_monitor(max_rollbacks=4, rollback_lr_factor=0.5)
    restored.load_state_dict(loop.monitor.state_dict())
    assert restored.rollback_cut_ == 0.0625


def test_rollback_skip_drops_the_next_updates_while_the_data_moves_on():
    loop = Loop(rollback_monitor(rollback_skip=3))
    done = loop.run(range(0, 61), fault_at(50, 51))
    assert [(d.step, d.action, d.snapshot_step) for d in done] == [(50, "rollback", 45)]
    assert "; the next 3 optimizer update(s) skipped;" in done[0].detail
    assert loop.batches == [s % 20 for s in range(61)]  # the batches of the skipped steps went by
    restored = loop.states[45]
    for step in (51, 52, 53):  # no parameter and no optimizer state moved; the scheduler stepped
        assert_state_equal_but_schedule(loop.states[step], restored, last_epoch=46 + step - 50)
    moved = loop.states[54]["model"]
    assert any(not torch.equal(moved[name], restored["model"][name]) for name in moved)
    assert "step" not in vars(loop.optimizer) or getattr(loop.optimizer.step, "_wrapped_by_lr_sched", False)
    assert not hasattr(loop.optimizer, "_topo_skip")


def assert_state_equal_but_schedule(state, expected, last_epoch):
    for name, tensor in expected["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    for key, entry in expected["optimizers"][0]["state"].items():
        for name, value in entry.items():
            assert torch.equal(state["optimizers"][0]["state"][key][name], value)
    assert state["schedulers"][0]["last_epoch"] == last_epoch


def test_an_actuator_that_cannot_skip_is_refused_clearly_and_counts_are_checked():
    class NoSkip:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "skip_updates":
                raise AttributeError(name)
            return getattr(self.inner, name)

    monitor = rollback_monitor(rollback_skip=2)
    loop = Loop(monitor)
    for step in range(0, 50, CHECK_EVERY):
        monitor.act(monitor.process(healthy_features(step), step), loop.actuator)
    with pytest.raises(InputError, match=r"`rollback_skip` is 2, but NoSkip cannot skip updates"):
        monitor.act(monitor.process(collapsed_features(50), 50), NoSkip(loop.actuator))
    with pytest.raises(InputError, match=r"`count` must be an integer >= 1, got 0"):
        skip_updates([loop.optimizer], 0)
    with pytest.raises(InputError, match="rollback_skip"):
        Policy(rollback_skip=-1)


def test_the_default_rule_stops_after_its_rollbacks_at_the_last_healthy_state_bit_for_bit(tmp_path):
    # The default rule (no policy given), the loss passed: a total collapse from step 30 on, inside the warm-up of
    # 10 checks, whose cause outlives every rollback.
    loop = Loop(TopoMonitor(check_every=CHECK_EVERY, summary=False, **AT_CADENCE), directory=tmp_path)
    loop.losses = {}
    done = loop.run(range(0, 100), lambda s: constant_features(s) if s >= 30 else healthy_features(s))
    assert loop.monitor.settings.rule.warmup == 10  # the checks of steps 0-45
    # The sentinels act in the warm-up: four rollbacks to step 25's snapshot; the first does not cut, each later one
    # fires at the next check (within two of the last rollback) and cuts, compounding.
    assert [(d.step, d.action, d.snapshot_step, d.steps_lost, d.lr_factor) for d in done] == [
        (30, "rollback", 25, 5, 1.0),
        (35, "rollback", 25, 5, 0.5),
        (40, "rollback", 25, 5, 0.25),
        (45, "rollback", 25, 5, 0.125),
        (50, "stop", 25, 5, 0.125),
    ]
    assert all(d.reason.startswith("the features are constant (spread ") for d in done)
    assert all("the next 10 optimizer update(s) skipped" in d.detail for d in done[:4])  # 2 x check_every
    assert done[4].reason.endswith(f"; 4 {STRUCTURAL}; the last healthy state (step 25) is restored first")
    assert done[4].detail.startswith(
        "restored the last healthy state, the snapshot of step 25 (5 updates undone), before stopping; model, "
        "optimizer and scheduler state restored; the rollbacks' cut kept: learning rate x 0.125; stop requested; "
        f"last healthy state (step 25) saved to {tmp_path / 'topo-last-healthy-step25.pt'}"
    )
    assert loop.actuator.stop_requested
    # The state the run stops with is the snapshot's, bit for bit, at the compounded cut rate.
    snapshot = loop.monitor.snapshots.snapshots[-1]
    assert snapshot.step == 25
    assert_restored_with_cut(loop, snapshot.load(), 0.125)
    assert_restored_with_cut(loop, loop.states[25], 0.125)
    assert loop.monitor.lr_factor_ == loop.monitor.rollback_cut_ == 0.125
    assert loop.scheduler.base_lrs == [0.1 * 0.125]
    # None of the collapsed checks' values entered a reference: the index's and the loss's are the healthy ones.
    history = [r for r in loop.monitor.history if isinstance(r, CheckRecord)]
    assert loop.monitor.policy.channels_["index"].reference.values == [r.index_value for r in history[1:6]]
    assert loop.monitor.policy.channels_["loss"].reference.values == [loop.losses[s] for s in range(0, 30, 5)]
    assert [r.decision.rule for r in history[6:]] == ["sentinel"] * 5


def test_a_stop_without_a_directory_keeps_the_last_healthy_state_in_memory():
    loop = Loop(rollback_monitor(cooldown=0, max_rollbacks=1))
    done = loop.run(range(0, 100), fault_at(50))
    assert [(d.step, d.action) for d in done] == [(50, "rollback"), (55, "stop")]
    assert "kept in memory as LoopActuator.last_healthy" in done[1].detail
    for name, tensor in loop.actuator.last_healthy["model"].items():
        assert torch.equal(tensor, loop.states[45]["model"][name])
    # The stop restored step 45's state first; the one rollback cut nothing (old rule), so no cut is kept.
    assert "before stopping" in done[1].detail
    assert "cut kept" not in done[1].detail
    assert_restored_with_cut(loop, loop.states[45], 1.0)


# --- where snapshots cannot be kept, the rule warns instead of failing the run -----------------------------------


def test_live_state_nbytes_reads_the_state_without_copying_and_is_not_low_before_the_first_step():
    model = torch.nn.Linear(64, 32)  # 64 * 32 + 32 = 2,080 float32 = 8,320 bytes
    adam = torch.optim.Adam(model.parameters())
    assert live_state_nbytes(model, [adam]) == 8320 + 2 * 8320  # no state yet: counted as Adam's two moments
    model(torch.ones(1, 64)).sum().backward()
    adam.step()
    held = sum(v.numel() * v.element_size() for s in adam.state.values() for v in s.values())
    assert held == 2 * 8320 + 2 * 4  # two moments and a float32 step count per parameter tensor
    assert live_state_nbytes(model, [adam]) == 8320 + held
    assert state_nbytes(capture_state(model, [adam], [])) == 8320 + held  # what a snapshot then holds
    assert LoopActuator(adam, model=model).snapshot_nbytes() == 8320 + held


def test_snapshots_too_big_for_host_memory_are_refused_once_and_a_rollback_warns_why(monkeypatch):
    monkeypatch.setattr("topocallbacks.snapshots.host_memory_available", lambda: 2**16)  # 64 KiB left
    monitor = rollback_monitor()
    loop = Loop(monitor)  # the digits MLP: 2,410 floats, with SGD's momentum counted as two moments: 28.2 KiB
    with pytest.warns(RuntimeWarning, match="keeps no rollback snapshots: 2 snapshots of about") as caught:
        done = loop.run(range(0, 61), fault_at(50, 51))
    assert len([w for w in caught if "keeps no rollback snapshots" in str(w.message)]) == 1  # said once
    assert monitor.snapshots.snapshots == []
    assert monitor.snapshots_off.startswith("2 snapshots of about 28.2 KiB each (plus one in flight) need 84.7 KiB")
    assert "more than half of the 64.0 KiB available; set `interventions.snapshot_dir`" in monitor.snapshots_off
    assert [(d.step, d.action) for d in done] == [(50, "warn")]
    assert "no healthy snapshot before step 50 (no snapshots are kept: 2 snapshots of about" in done[0].reason


def test_a_training_setup_that_cannot_snapshot_degrades_to_warnings(tmp_path):
    class Sharded(LoopActuator):
        def snapshot(self):
            raise SnapshotUnsupported("`rollback` does not support ShardedStrategy (sharded parameters)")

    monitor = rollback_monitor()
    loop = Loop(monitor)
    loop.actuator = Sharded(loop.optimizer, loop.scheduler, model=loop.model)
    with pytest.warns(RuntimeWarning, match="does not support ShardedStrategy"):
        done = loop.run(range(0, 61), fault_at(50, 51))
    assert [(d.step, d.action) for d in done] == [(50, "warn")]
    assert "(no snapshots are kept: `rollback` does not support ShardedStrategy" in done[0].reason


def test_snapshots_on_disk_skip_the_memory_check(monkeypatch, tmp_path):
    monkeypatch.setattr("topocallbacks.snapshots.host_memory_available", lambda: 2**16)
    monitor = TopoMonitor(
        check_every=CHECK_EVERY,
        policy=old_rule(action="rollback", warmup=3),
        snapshot_dir=str(tmp_path),
        summary=False,
        **AT_CADENCE,
    )
    loop = Loop(monitor)
    done = loop.run(range(0, 61), fault_at(50, 51))
    assert [(d.step, d.action, d.snapshot_step) for d in done] == [(50, "rollback", 45)]
    assert monitor.snapshots_off is None


def test_a_snapshot_copy_that_fails_is_skipped_with_a_warning_and_training_goes_on():
    loop = Loop(rollback_monitor())
    take, failed = loop.actuator.snapshot, []

    def failing():
        if len(loop.batches) - 1 == 40 and not failed:  # the step being acted on
            failed.append(40)
            raise MemoryError("no room")
        return take()

    loop.actuator.snapshot = failing
    with pytest.warns(RuntimeWarning, match=r"could not keep the snapshot of step 40 on rank 0 \(MemoryError: no room"):
        done = loop.run(range(0, 51), fault_at(45, 46))
    # The rollback goes back past the missing copy, to step 35's.
    assert [(d.step, d.action, d.snapshot_step) for d in done] == [(45, "rollback", 35)]


def test_a_snapshot_file_is_written_whole_or_not_at_all(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("the disk is full")

    store = SnapshotStore(keep=2, directory=str(tmp_path))
    store.add(10, {"w": torch.ones(3)}, diagrams=None)
    with pytest.raises(RuntimeError, match="the disk is full"):
        store.add(20, {"w": torch.ones(3), "bad": Unpicklable()}, diagrams=None)
    assert sorted(os.listdir(tmp_path)) == ["topo-snapshot-step10.pt"]  # no partial file of step 20
    assert [s.step for s in store.snapshots] == [10]


class CopyDone:
    """Stands in for the CUDA event of a snapshot copied from a GPU (no GPU here): counts the waits on it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


@pytest.mark.parametrize("on_disk", [False, True])
def test_an_asynchronous_snapshot_is_waited_for_once_and_only_when_read_or_written(tmp_path, on_disk):
    store = SnapshotStore(keep=2, directory=str(tmp_path) if on_disk else None)
    done = CopyDone()
    snapshot = store.add(10, {"w": torch.ones(3), "ready": done}, diagrams=None)
    assert done.waits == (1 if on_disk else 0)  # a file is written from complete host copies; memory waits
    assert snapshot.nbytes == 12
    payload = snapshot.load()
    assert sorted(payload) == ["w"]  # the event is not part of the state
    assert torch.equal(payload["w"], torch.ones(3))
    snapshot.load()
    assert done.waits == 1  # one synchronisation point
