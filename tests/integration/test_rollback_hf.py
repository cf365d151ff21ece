"""Rollback and the training channels (loss, gradient norm) in real ``transformers.Trainer.train`` runs on CPU.

The faults are deterministic: a callback placed before ours scales the encoder's first layer by 50 at the end of a
chosen step, so the next step's loss (about 10 against 2.3) and gradient norm (about 30 against 0.5) jump; the
rules watch those channels, each scored by its z-score against its earlier checks (a threshold of 10, far below the
jump and far above the healthy checks), so the step of every decision is known in advance. A channel is scored from
its fifth value on (the checks at 2, 4, 6 and 8 at ``check_every=2``; the check at 0 has none): the faults come at
step 9 or later.
"""

import copy
import math

import pytest
import torch
from transformers import Trainer, TrainerCallback

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE
from tests.integration.test_hf import PROBE, arguments, flat_digits
from topocallbacks.hf import TopoCollapseTrainerCallback
from topocallbacks.settings import Action

BATCH = 32


class Net(torch.nn.Module):
    """The digits MLP; it records the sample ids of every training batch and adds ``poison`` to the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 10)
        self.seen: list[list[int]] = []  # the sample ids of each training forward, in order
        self.poison = 0.0  # added to the next training loss only (no gradient: the weights stay finite)

    def forward(self, x, labels=None, idx=None):
        logits = self.head(self.encoder(x))
        if labels is None:
            return {"logits": logits}
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if self.training and torch.is_grad_enabled():
            self.seen.append(idx.tolist())
            loss, self.poison = loss + self.poison, 0.0
        return {"loss": loss, "logits": logits}


def dataset(n=512):
    x, y = flat_digits()
    return [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(n)]


class Fault(TrainerCallback):
    """At the end of the steps in ``scale_at``, the first layer x 50; in ``nan_at``, the next loss is NaN."""

    def __init__(self, scale_at=(), nan_at=()):
        self.scale_at, self.nan_at = set(scale_at), set(nan_at)
        self.before: dict[int, dict] = {}  # the state at the end of each step before our callback acted

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step in self.scale_at:
            with torch.no_grad():
                model.encoder[0].weight.mul_(50.0)
                model.encoder[0].bias.mul_(50.0)
        if state.global_step in self.nan_at:
            model.poison = math.nan
        self.before[state.global_step] = training_state(model, optimizer, lr_scheduler)


class Recorder(TrainerCallback):
    """After our callback: the training state, the control flags and the learning rate at the end of each step."""

    def __init__(self):
        self.after: dict[int, dict] = {}
        self.flags: dict[int, tuple[bool, bool]] = {}
        self.taps: dict[int, tuple[bool, bool]] = {}
        self.trainer = None

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self.after[state.global_step] = training_state(model, optimizer, lr_scheduler)
        self.flags[state.global_step] = (control.should_training_stop, control.should_save)
        if self.trainer is not None:
            tapped = "training_step" in vars(self.trainer), "clip_grad_norm_" in vars(self.trainer.accelerator)
            self.taps[state.global_step] = tapped


def training_state(model, optimizer, scheduler):
    """Copies of the model's tensors, the torch optimizer's state dict and the torch scheduler's."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(getattr(optimizer, "optimizer", optimizer).state_dict()),  # inside accelerate's
        "scheduler": copy.deepcopy(lr_scheduler_state(scheduler)),
        "lr": optimizer.param_groups[0]["lr"],
    }


def lr_scheduler_state(scheduler):
    state = getattr(scheduler, "scheduler", scheduler).state_dict()
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def assert_same_state(actual, expected):
    assert actual["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), name
    got, want = actual["optimizer"], expected["optimizer"]
    assert got["state"].keys() == want["state"].keys()
    assert len(want["state"]) == 4  # 2 weights, 2 biases
    for index, slots in want["state"].items():
        assert set(slots) == {"step", "exp_avg", "exp_avg_sq"}
        for slot, value in slots.items():
            assert torch.equal(got["state"][index][slot], value), (index, slot)
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]
    assert actual["scheduler"] == expected["scheduler"]
    assert actual["lr"] == expected["lr"]


def differs(actual, expected):
    return any(not torch.equal(actual["model"][k], v) for k, v in expected["model"].items())


def rule(**overrides):
    """Roll back when the mean training loss since the last check jumps (z >= 10; about 6 against 2.3 after the
    fault): the old default rule's rollbacks (no learning-rate cut at the first, no skip, at most 2) on the loss."""
    policy = {"action": "rollback", "channels": ["loss"], "score": "zscore", "threshold": 10.0, "warmup": 0}
    return {**OLD_RULE, **policy, **overrides}


def callback(policy, **overrides):
    return TopoCollapseTrainerCallback(
        probe=PROBE, layer="encoder", check_every=2, policy=policy, summary=False, **overrides, **AT_CADENCE
    )


def train(tmp_path, topo, fault, *, resume=None, model=None, **overrides):
    recorder = Recorder()
    settings = {"learning_rate": 1e-3, "lr_scheduler_type": "linear", "max_steps": 14, **overrides}
    trainer = Trainer(
        model=model or Net(),
        args=arguments(tmp_path, **settings),
        train_dataset=dataset(),
        callbacks=[fault, topo, recorder],
    )
    recorder.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder


def checks(topo):
    return {r.step: r for r in topo.history if r.kind == "check"}


def interventions(topo):
    return [r for r in topo.history if r.kind == "intervention"]


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """One run: the fault after step 9, the loss of step 10 about 10, a rollback at the check of step 10."""
    topo, fault = callback(rule()), Fault(scale_at=[9])
    trainer, recorder = train(
        tmp_path_factory.mktemp("rollback"), topo, fault, logging_strategy="steps", logging_steps=1
    )
    return trainer, recorder, topo, fault


def test_a_rollback_restores_the_healthy_snapshot_bit_for_bit(rolled_back):
    trainer, recorder, topo, fault = rolled_back
    (rollback,) = interventions(topo)
    assert (rollback.step, rollback.action, rollback.snapshot_step, rollback.steps_lost) == (10, "rollback", 8, 2)
    assert rollback.reason.startswith("loss ")
    assert "roll back to the newest healthy snapshot before step 10" in rollback.reason
    assert "rolled back to the snapshot of step 8" in rollback.detail
    assert "model, optimizer and 1 scheduler(s) restored" in rollback.detail
    decision = checks(topo)[10].decision
    assert (decision.action, decision.flagged, decision.onset) == (Action.ROLLBACK, ("loss",), 10)
    assert decision.scores["loss"] >= 10.0
    assert all(checks(topo)[step].decision.healthy for step in (0, 2, 4, 6, 8))
    # Before our callback acted at step 10 the state was the faulted one; right after, the snapshot of step 8's.
    assert differs(fault.before[10], recorder.after[8])
    assert_same_state(recorder.after[10], recorder.after[8])
    assert recorder.after[10]["scheduler"]["last_epoch"] == 8
    assert recorder.after[10]["lr"] > recorder.after[9]["lr"]  # the linear decay went back two steps
    # Training went on from there: the global step kept counting and the next updates are healthy ones.
    assert trainer.state.global_step == 14
    assert recorder.after[14]["scheduler"]["last_epoch"] == 12
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert logged[10] > 5.0
    assert max(logged[11], logged[12], logged[13], logged[14]) < 2.6
    assert [checks(topo)[s].decision.action for s in (12, 14)] == [Action.NONE, Action.NONE]
    assert len(topo.monitor.snapshots.snapshots) == 2
    assert [s.step for s in topo.monitor.snapshots.snapshots] == [12, 14]  # the abandoned past is gone


def test_the_data_stream_moves_on_after_a_rollback(rolled_back, tmp_path):
    trainer, _, _, _ = rolled_back
    seen = trainer.model.seen
    assert [len(batch) for batch in seen] == [BATCH] * 14
    ids = [i for batch in seen for i in batch]
    assert len(set(ids)) == len(ids) == 14 * BATCH  # no batch is seen twice
    # The same batches, in the same order, as a run without fault and without the callback.
    plain = Trainer(model=Net(), args=arguments(tmp_path, max_steps=14, learning_rate=1e-3), train_dataset=dataset())
    plain.train()
    assert seen == plain.model.seen


def test_rollback_skip_skips_the_next_updates_while_the_data_moves_on(tmp_path):
    topo = callback(rule(rollback_skip=2))
    trainer, recorder = train(tmp_path, topo, Fault(scale_at=[9]))
    (rollback,) = interventions(topo)
    assert (rollback.step, rollback.snapshot_step) == (10, 8)
    assert "the next 2 optimizer update(s) skipped" in rollback.detail
    restored = recorder.after[10]
    assert_same_state(restored, recorder.after[8])
    for step in (11, 12):  # the Trainer counted the steps and its scheduler stepped; nothing else moved
        after = recorder.after[step]
        for name, tensor in restored["model"].items():
            assert torch.equal(after["model"][name], tensor), (step, name)
        assert after["optimizer"]["state"].keys() == restored["optimizer"]["state"].keys()
        for index, slots in restored["optimizer"]["state"].items():
            for slot, value in slots.items():
                assert torch.equal(after["optimizer"]["state"][index][slot], value), (step, index, slot)
        assert after["scheduler"]["last_epoch"] == 8 + step - 10
    assert differs(recorder.after[13], restored)
    assert float(recorder.after[13]["optimizer"]["state"][0]["step"]) == 9.0
    ids = [i for batch in trainer.model.seen for i in batch]
    assert len(ids) == len(set(ids)) == 14 * BATCH  # every batch went by once, the skipped ones too
    assert not hasattr(trainer.optimizer.optimizer, "_topo_skip")


def test_once_the_rollbacks_are_spent_the_run_stops_restoring_and_saving_the_last_healthy_state(tmp_path):
    topo, fault = callback(rule(max_rollbacks=1, after_max_rollbacks="stop")), Fault(scale_at=[9, 13])
    trainer, recorder = train(tmp_path, topo, fault, max_steps=20)
    done = [(r.step, r.action, r.snapshot_step) for r in interventions(topo)]
    assert done == [(10, "rollback", 8), (14, "stop", 12)]
    stop = interventions(topo)[-1]
    assert "; 1 rollbacks made already and the alarm came back after them: " in stop.reason
    assert stop.reason.endswith("so stop; the last healthy state (step 12) is restored first")
    # The stop restores the newest healthy snapshot (step 12) first: the run never ends on the faulted weights.
    assert stop.detail.startswith("restored the last healthy state, the snapshot of step 12 (2 updates undone)")
    assert differs(fault.before[14], recorder.after[12])
    assert_same_state(recorder.after[14], recorder.after[12])
    assert "control.should_training_stop set" in stop.detail
    assert f"last healthy state (step 12) saved to {tmp_path / 'topo-last-healthy-step12.pt'}" in stop.detail
    assert recorder.flags[14] == (True, True)  # stop, after the Trainer saves this step's checkpoint
    assert trainer.state.global_step == 14
    assert max(recorder.after) == 14
    assert (tmp_path / "checkpoint-14" / "trainer_state.json").is_file()
    saved = torch.load(tmp_path / "topo-last-healthy-step12.pt", weights_only=True)
    assert saved["model"].keys() == recorder.after[12]["model"].keys()
    for name, tensor in recorder.after[12]["model"].items():
        assert torch.equal(saved["model"][name], tensor), name
    assert saved["schedulers"][0]["last_epoch"] == recorder.after[12]["scheduler"]["last_epoch"] == 10


def test_a_resumed_run_keeps_its_one_rollback_and_its_count(tmp_path):
    policy = rule(max_rollbacks=1, after_max_rollbacks="stop", rollback_lr_factor=0.5)
    common = {"lr_scheduler_type": "constant", "max_steps": 18, "save_strategy": "steps", "save_steps": 12}
    first = callback(policy)
    _, recorder = train(tmp_path, first, Fault(scale_at=[9]), **common)
    assert [(r.step, r.action, r.lr_factor) for r in interventions(first)] == [(10, "rollback", 0.5)]
    assert recorder.after[10]["lr"] == recorder.after[18]["lr"] == pytest.approx(5e-4)  # the cut holds
    assert (tmp_path / "checkpoint-12").is_dir()

    # The resumed run faults again after step 13: its one rollback spent (the saved count), the rule stops.
    resumed = callback(policy)
    trainer, recorder = train(tmp_path, resumed, Fault(scale_at=[13]), resume=str(tmp_path / "checkpoint-12"), **common)
    assert min(recorder.after) == 13  # training went on from step 12
    assert recorder.after[13]["lr"] == pytest.approx(5e-4)  # the checkpoint holds the cut rate
    rollbacks = [r for r in interventions(resumed) if r.action == "rollback"]
    assert [(r.step, r.snapshot_step) for r in rollbacks] == [(10, 8)]  # once, from the restored history
    assert [(r.step, r.action) for r in interventions(resumed)] == [(10, "rollback"), (14, "stop")]
    assert "; 1 rollbacks made already and the alarm came back after them: " in interventions(resumed)[-1].reason
    assert resumed.monitor.lr_factor_ == 0.5
    assert trainer.state.global_step == 14


@pytest.mark.parametrize("channels", [["loss"], ["grad_norm"], ["loss", "grad_norm"]])
def test_a_spike_is_flagged_on_the_watched_channels(tmp_path, channels):
    topo = callback({**rule(channels=channels), "action": "warn"})
    with pytest.warns(RuntimeWarning, match="topocallbacks at step 10: "):
        _, recorder = train(tmp_path, topo, Fault(scale_at=[9]), max_steps=10)
    records = checks(topo)
    assert [records[s].decision.flagged for s in (2, 4, 6, 8)] == [(), (), (), ()]
    decision = records[10].decision
    assert decision.flagged == tuple(channels)
    assert decision.action is Action.WARN
    assert set(decision.scores) == set(channels)
    assert all(decision.scores[name] >= 10.0 for name in channels)
    assert interventions(topo)[0].action == "warn"
    # The Trainer's own loss is tapped in every run; its gradient norm only when watched; nothing after training.
    assert recorder.taps[10] == (True, "grad_norm" in channels)
    assert "training_step" not in vars(recorder.trainer)
    assert "clip_grad_norm_" not in vars(recorder.trainer.accelerator)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_the_channels_get_the_trainers_own_loss_and_gradient_norm(tmp_path, max_grad_norm):
    """With 2 micro-batches per step: the mean since the last check of the values the Trainer logs every step."""
    topo = callback(rule(channels=["loss", "grad_norm"], threshold=1e9, action="warn"))
    trainer, _ = train(
        tmp_path,
        topo,
        Fault(scale_at=[7]),
        max_steps=10,
        gradient_accumulation_steps=2,
        max_grad_norm=max_grad_norm,
        logging_strategy="steps",
        logging_steps=1,
    )
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    records = checks(topo)
    assert records[0].decision.scores is None  # nothing trained before the first check
    # Nothing reaches the threshold: every check's value entered its channel's reference, in order.
    assert not any(r.decision.flagged for r in records.values())
    for name in ("loss", "grad_norm"):
        fed = topo.monitor.policy.channels_[name].reference.values
        expected = [(logged[step - 1][name] + logged[step][name]) / 2 for step in (2, 4, 6, 8, 10)]
        assert fed == pytest.approx(expected, rel=1e-6), name
    # The norm is the one before clipping: far above max_grad_norm after the fault.
    assert topo.monitor.policy.channels_["grad_norm"].reference.values[3] > 10.0  # the check of step 8
    assert [len(batch) for batch in trainer.model.seen] == [BATCH] * 20  # 2 micro-batches per step


@pytest.mark.parametrize("on_diverged", ["stop", "rollback"])
def test_a_nan_loss_is_a_diverged_check_and_gets_the_on_diverged_action(tmp_path, on_diverged):
    # The old default rule (the index channel only, in its 10-check warm-up): a NaN loss still acts at once.
    topo = callback({**OLD_RULE, "on_diverged": on_diverged})
    trainer, recorder = train(tmp_path, topo, Fault(nan_at=[7]), max_steps=12)
    logged_nan = [e["step"] for e in trainer.state.log_history if "loss" in e and math.isnan(e["loss"])]
    assert logged_nan == []  # the Trainer's own logging filters NaN losses out (logging_nan_inf_filter)
    record = checks(topo)[8]
    assert record.status == "ok"  # the features are finite: the loss alone diverged
    assert (record.decision.rule, record.decision.flagged) == ("diverged", ("diverged",))
    assert "the training loss is nan" in record.decision.reason
    assert all(checks(topo)[s].decision.rule is None for s in (2, 4, 6))
    (action,) = interventions(topo)
    assert (action.step, action.action) == (8, on_diverged)
    # Either way the state goes back to the newest healthy snapshot (a stop restores it before stopping).
    assert action.snapshot_step == 6
    assert_same_state(recorder.after[8], recorder.after[6])
    if on_diverged == "stop":
        assert action.detail.startswith("restored the last healthy state, the snapshot of step 6 (2 updates undone)")
        assert trainer.state.global_step == 8
        assert recorder.flags[8] == (True, True)
    else:
        assert trainer.state.global_step == 12
        assert all(checks(topo)[s].decision.action is Action.NONE for s in (10, 12))


def test_without_a_trainer_norm_the_gradient_norm_is_that_of_all_gradients():
    # The fallback of on_pre_optimizer_step (transformers 4 computes no norm without clipping).
    from topocallbacks.integrations.hf_glue import gradient_norm as _gradient_norm

    model = Net()
    assert _gradient_norm(model) is None  # no gradients yet
    x, y = flat_digits()
    model(x[:BATCH], labels=y[:BATCH], idx=torch.arange(BATCH))["loss"].backward()
    grads = [p.grad for p in model.parameters()]
    expected = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert float(_gradient_norm(model)) == pytest.approx(expected, rel=1e-6)
