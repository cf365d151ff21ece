"""The rollback action and the training channels (loss, gradient norm) through a real ``lightning.pytorch`` fit.

A small MLP on scikit-learn's digits, watched at its 16-dimensional ``encoder`` with the effective rank
(``index="rankme"``, ``score="value"``): healthy training keeps it above 6 for the steps these tests run, and the
injected fault, both encoder layers' weight rows made equal, collapses it below 2.5 for as long as it is left in
place. The threshold of 4 sits between, so every check's verdict is known in advance.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from sklearn.datasets import load_digits

from tests.cadence import AT_CADENCE
from tests.integration.models import OLD_RULE, quiet_trainer
from tests.integration.ranks import run_two_ranks
from topocallbacks.lightning import TopoCollapseCallback

_DIGITS = load_digits()
IMAGES = torch.tensor(_DIGITS.data / 16.0, dtype=torch.float32)  # (1797, 64)
LABELS = torch.tensor(_DIGITS.target)
PROBE = IMAGES[:128]
BATCH = 32

# A check is a rollback (or its escalation) exactly when the probe's effective rank is <= 4: the old default rule
# (the index alone; no learning-rate cut at the first rollback, no skip, at most 2) on the effective rank. The
# injected collapse puts the features on one line, which the absolute sentinels would name first: they are off, so
# that this rule's verdicts are the ones the tests know in advance.
RULE = {**OLD_RULE, "action": "rollback", "score": "value", "threshold": -4.0, "patience": 1, "warmup": 1}
RULE |= {"cooldown": 0, "sentinels": False}


def loader() -> torch.utils.data.DataLoader:
    """Digits in order (no shuffle), each sample with its index: which batches were seen is known exactly."""
    dataset = torch.utils.data.TensorDataset(IMAGES, LABELS, torch.arange(len(IMAGES)))
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)


class CollapsingMLP(pl.LightningModule):
    """64 -> 64 -> 16 (``encoder``, watched) -> 10, Adam with a per-step decaying rate, and faults on demand.

    Each fault is keyed by ``trainer.global_step`` in ``training_step`` (the update of that batch is step + 1):
    ``collapse_at`` makes every weight row of both encoder layers equal to its first (rank-1 features);
    ``loss_scale_at`` multiplies the loss (and so the gradients) by 100; ``nan_loss_at`` makes the loss's value NaN
    while its gradient stays the loss's own; ``grad_scale_at`` multiplies the gradients by 1000 after one backward
    pass (the loss unchanged).
    """

    def __init__(self, collapse_at=(), loss_scale_at=(), nan_loss_at=(), grad_scale_at=()):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        self.head = torch.nn.Linear(16, 10)
        self.collapse_at, self.loss_scale_at = set(collapse_at), set(loss_scale_at)
        self.nan_loss_at, self.grad_scale_at = set(nan_loss_at), set(grad_scale_at)
        self.grads_scaled: set[int] = set()

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        step = self.trainer.global_step
        if step in self.collapse_at:
            with torch.no_grad():
                for weight in (self.encoder[0].weight, self.encoder[2].weight):
                    weight.copy_(weight[:1].expand_as(weight))
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if step in self.loss_scale_at:
            loss = loss * 100.0
        if step in self.nan_loss_at:
            loss = loss + loss.detach() * float("nan")  # the value is NaN; the gradient is the loss's own
        return loss

    def on_after_backward(self):
        step = self.trainer.global_step
        if step in self.grad_scale_at and step not in self.grads_scaled:
            self.grads_scaled.add(step)
            for p in self.parameters():
                p.grad.mul_(1000.0)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.99**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Recorder(pl.Callback):
    """Placed after the topology callback: what it left at every step, and what training saw.

    ``states[s]``: copies of the module's, the optimizer's and the scheduler's state dicts at the end of step ``s``
    (after a rollback at ``s``: the restored ones); ``batches``: ``(global step, batch_idx, first sample)`` of every
    batch; ``losses``: each batch's own loss, in order; ``norms[s]``: the gradient norm before clipping of update
    ``s``; ``clipped[s]``: after clipping; ``pending``: after each batch, how many steps' training values the
    monitor holds since its last check.
    """

    def __init__(self, watched=None):
        self.watched = watched
        self.states, self.batches, self.losses, self.norms, self.clipped, self.pending = {}, [], [], {}, {}, []

    def _keep(self, trainer, pl_module):
        self.states[trainer.global_step] = copy.deepcopy(
            {
                "module": pl_module.state_dict(),
                "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            }
        )

    def on_train_start(self, trainer, pl_module):
        self._keep(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms[trainer.global_step + 1] = _norm(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self._keep(trainer, pl_module)
        self.batches.append((step, batch_idx, int(batch[2][0])))
        # Automatic optimization hands each micro-batch's loss divided by the number of micro-batches.
        self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)
        self.clipped.setdefault(step, _norm(pl_module))  # at the batch that made update `step`
        if self.watched is not None:
            self.pending.append(len(self.watched.monitor.intake._steps))


def _norm(module):
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])))


def watcher(**overrides):
    policy = {**RULE, **overrides.pop("policy", {})}
    return TopoCollapseCallback(
        probe=PROBE,
        layer="encoder",
        check_every=5,
        index="rankme",
        policy=policy,
        summary=False,
        **overrides,
        **AT_CADENCE,
    )


def checks(callback):
    return {r.step: r for r in callback.history if r.kind == "check"}


def interventions(callback):
    return [r for r in callback.history if r.kind == "intervention"]


def assert_same(a, b, where="state"):
    """Equal nested state dicts, every tensor bit for bit (``torch.equal``: same shape, same values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def one_rollback(tmp_path_factory):
    """Collapse at step 12: healthy checks at 0, 5, 10, the check at 15 rolls back to step 10; run to step 25."""
    callback = watcher()
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path_factory.mktemp("one"), [callback, recorder], max_steps=25)
    trainer.fit(CollapsingMLP(collapse_at={12}), loader())
    return trainer, callback, recorder


def test_a_rollback_restores_the_healthy_snapshot_bit_for_bit(one_rollback):
    trainer, callback, recorder = one_rollback
    (rollback,) = interventions(callback)
    assert (rollback.action, rollback.step, rollback.snapshot_step, rollback.steps_lost) == ("rollback", 15, 10, 5)
    assert rollback.lr_factor == 1.0  # the first rollback keeps the rate (rollback_lr_factor None)
    found = checks(callback)
    assert [s for s, r in found.items() if r.decision.flagged] == [15]
    assert found[15].decision.onset == 15
    assert found[15].index_value < 2.5 < 6.0 < min(found[s].index_value for s in (0, 5, 10, 20, 25))
    assert rollback.reason.startswith(f"index {-found[15].index_value:.4f} >= threshold -4.0 for 1 consecutive")
    assert rollback.reason.endswith("roll back to the newest healthy snapshot before step 15 (rollback 1 of 2)")
    assert rollback.detail.startswith("rolled back to the snapshot of step 10")
    assert "module, 1 optimizer(s) and 1 scheduler(s) restored" in rollback.detail
    # Right after the rollback (step 15, seen by the next callback) every tensor is the one of step 10: the
    # module's parameters, Adam's step counts and moments, the param groups' rates, the scheduler's count.
    snapshot, restored = recorder.states[10], recorder.states[15]
    assert_same(restored, snapshot)
    assert restored["scheduler"]["last_epoch"] == 10
    assert set(restored["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(restored["optimizer"]["state"][0]["step"]) == 10.0
    # Before it, the collapsed weights were in place (rows nearly equal: two Adam updates since the fault) and the
    # optimizer 4 steps further.
    weight = recorder.states[14]["module"]["encoder.2.weight"]
    healthy = snapshot["module"]["encoder.2.weight"]
    assert float((weight - weight[:1]).abs().max()) < 0.02 < 0.1 < float((healthy - healthy[:1]).abs().max())
    assert float(recorder.states[14]["optimizer"]["state"][0]["step"]) == 14.0
    # Training goes on from the snapshot: the scheduler counts on from 10, the rate is the step-11 one.
    after = recorder.states[16]
    assert after["scheduler"]["last_epoch"] == 11
    assert after["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-3 * 0.99**11, rel=1e-12)
    assert float(after["optimizer"]["state"][0]["step"]) == 11.0
    assert trainer.global_step == 25  # the trainer's step count is not rewound
    # The snapshots kept afterwards are the restored one and the healthy checks since (keep 2).
    assert [s.step for s in callback.monitor.snapshots.snapshots] == [20, 25]


def test_after_a_rollback_the_data_stream_moves_on_without_repeating_a_batch(one_rollback):
    _, _, recorder = one_rollback
    steps = [step for step, _, _ in recorder.batches]
    indices = [batch_idx for _, batch_idx, _ in recorder.batches]
    firsts = [first for _, _, first in recorder.batches]
    assert steps == list(range(1, 26))
    assert indices == list(range(25))  # batch 15 follows batch 14 (the rollback's), not batch 10
    assert firsts == [BATCH * i for i in range(25)]  # each sample seen once


def test_rollback_skip_skips_the_next_updates_but_runs_their_training_steps(tmp_path):
    callback = watcher(policy={"rollback_skip": 3})
    recorder = Recorder(watched=callback)
    trainer = quiet_trainer(tmp_path, [callback, recorder], max_steps=25)
    trainer.fit(CollapsingMLP(collapse_at={12}), loader())
    (rollback,) = interventions(callback)
    assert (rollback.step, rollback.snapshot_step) == (15, 10)
    assert "the next 3 optimizer update(s) skipped" in rollback.detail
    restored = recorder.states[15]
    assert_same(restored, recorder.states[10])
    for step in (16, 17, 18):  # Lightning counted the steps and stepped the scheduler; nothing else moved
        state = recorder.states[step]
        assert_same(state["module"], restored["module"], f"module at {step}")
        assert_same(state["optimizer"]["state"], restored["optimizer"]["state"], f"optimizer at {step}")
        assert state["scheduler"]["last_epoch"] == 10 + step - 15
    moved = recorder.states[19]["module"]
    assert any(not torch.equal(moved[k], restored["module"][k]) for k in moved)
    assert float(recorder.states[19]["optimizer"]["state"][0]["step"]) == 11.0
    # Their training steps ran (the closure): a loss for every batch, each batch once, the channel fed.
    assert [step for step, _, _ in recorder.batches] == list(range(1, 26))
    assert len(recorder.losses) == 25
    assert not hasattr(trainer.optimizers[0], "_topo_skip")


def test_repeated_faults_roll_back_twice_then_stop_restoring_and_saving_the_last_healthy_state(tmp_path):
    callback = watcher(policy={"lr_factor": 0.5})
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path, [callback, recorder], max_steps=100)
    trainer.fit(CollapsingMLP(collapse_at={12, 27, 42}), loader())
    done = [(r.action, r.step, r.snapshot_step, r.steps_lost, r.lr_factor) for r in interventions(callback)]
    # The stop goes back to the newest healthy snapshot before its alarm (step 40) first, as a rollback would.
    assert done == [("rollback", 15, 10, 5, 1.0), ("rollback", 30, 25, 5, 0.5), ("stop", 45, 40, 5, 0.5)]
    first, second, stop = interventions(callback)
    assert first.reason.endswith("(rollback 1 of 2)")
    assert second.reason.endswith("learning rate x 0.5 (rollback 2 of 2)")
    assert "; 2 rollbacks made already and the alarm came back after them: " in stop.reason
    assert stop.reason.endswith("so stop; the last healthy state (step 40) is restored first")
    # The second rollback restored step 25's state and cut its rate: the rate right after it is step 25's x 0.5,
    # and the scheduler's base rate was cut with it: the next rate is the schedule's x 0.5, the schedule counting
    # on from the snapshot's (step 25 was the scheduler's 20th: the first rollback took it back 5 steps).
    rates = {step: state["optimizer"]["param_groups"][0]["lr"] for step, state in recorder.states.items()}
    assert rates[30] == rates[25] * 0.5
    assert [recorder.states[s]["scheduler"]["last_epoch"] for s in (25, 30, 31)] == [20, 20, 21]
    assert rates[31] == pytest.approx(0.5 * 3e-3 * 0.99**21, rel=1e-12)
    assert recorder.states[30]["scheduler"]["base_lrs"] == [0.5 * 3e-3]
    assert_same(recorder.states[30]["module"], recorder.states[25]["module"])
    assert_same(recorder.states[30]["optimizer"]["state"], recorder.states[25]["optimizer"]["state"])
    assert trainer.should_stop
    assert trainer.global_step == 45
    # The stop restored step 40's state bit for bit (its rate holds the second rollback's cut already: no new cut),
    # so the run does not end on the collapsed weights of step 44.
    assert stop.detail.startswith("restored the last healthy state, the snapshot of step 40 (5 updates undone), ")
    assert "cut kept" not in stop.detail
    assert_same(recorder.states[45], recorder.states[40])
    weight = recorder.states[44]["module"]["encoder.2.weight"]
    assert float((weight - weight[:1]).abs().max()) < 0.02  # the collapsed rows before it
    # The stop kept the newest healthy snapshot (step 40) as a file, and the stop checkpoint holds the history.
    assert f"last healthy state (step 40) saved to {tmp_path / 'topo-last-healthy-step40.pt'}" in stop.detail
    kept = torch.load(tmp_path / "topo-last-healthy-step40.pt", weights_only=True)
    assert_same(kept["model"], recorder.states[40]["module"])
    assert_same(kept["optimizers"][0], recorder.states[40]["optimizer"])
    assert kept["schedulers"][0]["last_epoch"] == recorder.states[40]["scheduler"]["last_epoch"] == 30
    saved = torch.load(tmp_path / "topo-stop-step45.ckpt", weights_only=False)
    assert saved["global_step"] == 45
    assert_same(saved["state_dict"], recorder.states[40]["module"])  # the restored, healthy weights
    (state,) = saved["callbacks"].values()
    assert [r["action"] for r in state["monitor"]["history"] if r["kind"] == "intervention"] == [
        "rollback",
        "rollback",
        "stop",
    ]


def test_a_resumed_run_keeps_its_rollback_and_does_not_make_it_again(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=20, save_top_k=-1)
    first = watcher(policy={"lr_factor": 0.5})
    quiet_trainer(tmp_path, [first, saver], max_steps=20, enable_checkpointing=True).fit(
        CollapsingMLP(collapse_at={12}), loader()
    )
    assert [(r.action, r.step, r.snapshot_step) for r in interventions(first)] == [("rollback", 15, 10)]
    path = next((tmp_path / "ckpt").glob("*step=20*.ckpt"))
    # The same configuration resumed: no fault up to step 30, then one at step 32.
    second = watcher(policy={"lr_factor": 0.5})
    recorder = Recorder()
    quiet_trainer(tmp_path, [second, recorder], max_steps=40).fit(
        CollapsingMLP(collapse_at={12, 32}), loader(), ckpt_path=str(path)
    )
    assert interventions(second)[0] == interventions(first)[0]  # the past rollback came back with the checkpoint
    assert sorted(checks(second)) == [0, 5, 10, 15, 20, 25, 30, 35, 40]  # step 20 not checked twice
    assert [r.step for r in interventions(second) if r.action == "rollback" and r.step <= 30] == [15]
    assert all(not checks(second)[s].decision.flagged for s in (20, 25, 30))
    # The new fault rolls back to a snapshot taken after the resume, as the second of two (the count resumed).
    new = interventions(second)[1:]
    assert [(r.action, r.step, r.snapshot_step, r.lr_factor) for r in new] == [("rollback", 35, 30, 0.5)]
    assert new[0].reason.endswith("learning rate x 0.5 (rollback 2 of 2)")
    assert_same(recorder.states[35]["module"], recorder.states[30]["module"])


def fed(callback, channel):
    """The values a training channel's reference admitted, oldest first: every check's value but a lone flagged one."""
    return callback.monitor.policy.channels_[channel].reference.values


def test_a_loss_spike_is_caught_on_the_loss_channel_with_the_step_losses_averaged(tmp_path):
    # A training channel is scored by its z-score against its earlier checks whatever the index's score: it needs
    # the losses of 4 earlier checks (5-20; the check at 0 has none), so the x 100 loss comes at step 22.
    callback = watcher(policy={"action": "warn", "channels": ["loss"], "score": "zscore", "threshold": 10.0})
    recorder = Recorder()
    warning = r"topocallbacks at step 25: loss \d+\.\d+ at z = \d+\.\d+ against its last 10 checks >= threshold 10.0"
    with pytest.warns(RuntimeWarning, match=warning):
        quiet_trainer(tmp_path, [callback, recorder], max_steps=30).fit(CollapsingMLP(loss_scale_at={22}), loader())
    found = checks(callback)
    assert {s: r.decision.flagged for s, r in found.items()} == {
        0: (), 5: (), 10: (), 15: (), 20: (), 25: ("loss",), 30: ()
    }  # fmt: skip
    assert [(r.action, r.step) for r in interventions(callback)] == [("warn", 25)]
    assert [found[s].decision.scores["loss"] for s in (5, 10, 15, 20)] == [None] * 4  # < 4 earlier values
    assert found[25].decision.scores["loss"] >= 10.0
    # Each check sees the mean loss of the steps since the one before (batch s - 1 made update s).
    means = {step: sum(recorder.losses[step - 5 : step]) / 5 for step in (5, 10, 15, 20, 25, 30)}
    assert fed(callback, "loss") == pytest.approx([means[s] for s in (5, 10, 15, 20, 30)], rel=1e-6)
    assert f"loss {means[25]:.4g} at z = " in found[25].decision.reason  # the spike, held out of the reference
    others = recorder.losses[20:22] + recorder.losses[23:25]
    assert recorder.losses[22] > 50 * max(others)  # the update of step 23 came from the x 100 loss


def test_the_gradient_norm_is_taken_before_clipping_once_per_accumulated_step(tmp_path):
    policy = {"action": "warn", "channels": ["loss", "grad_norm"], "score": "zscore", "threshold": 10.0}
    callback = watcher(policy=policy)
    recorder = Recorder(callback)
    # 25 steps: the 50 micro-batches stay in the first epoch (57 batches: an odd one ends it).
    fit = quiet_trainer(tmp_path, [callback, recorder], max_steps=25, accumulate_grad_batches=2, gradient_clip_val=0.05)
    with pytest.warns(RuntimeWarning, match="topocallbacks at step 25: grad norm"):
        fit.fit(CollapsingMLP(grad_scale_at={22}), loader())
    assert len(recorder.batches) == 50  # two micro-batches per optimizer step
    # The monitor got one value pair per optimizer step, at its second micro-batch (batches 20-29 make updates
    # 11-15; the check at 15 takes them).
    assert recorder.pending[19:30] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0]
    found = checks(callback)
    assert {s: r.decision.flagged for s, r in found.items()} == {
        0: (),
        5: (),
        10: (),
        15: (),
        20: (),
        25: ("grad_norm",),
    }
    losses, norms = {}, {}
    for step in (5, 10, 15, 20, 25):
        window = range(step - 4, step + 1)
        # The loss of an optimizer step is the mean of its two micro-batches' (not their share of it, not twice).
        losses[step] = sum((recorder.losses[2 * s - 2] + recorder.losses[2 * s - 1]) / 2 for s in window) / 5
        norms[step] = sum(recorder.norms[s] for s in window) / 5
    assert fed(callback, "loss") == pytest.approx([losses[s] for s in (5, 10, 15, 20, 25)], rel=1e-6)
    assert fed(callback, "grad_norm") == pytest.approx([norms[s] for s in (5, 10, 15, 20)], rel=1e-6)
    assert f"grad norm {norms[25]:.4g} at z = " in found[25].decision.reason  # the spike, held out of the reference
    assert found[25].decision.scores["grad_norm"] >= 10.0
    # Before clipping: Lightning clipped every update to 0.05; the channel saw the norms above it.
    assert all(recorder.clipped[s] <= 0.05 * (1 + 1e-5) for s in range(1, 26))
    assert min(recorder.norms.values()) > 0.1
    assert norms[25] > 1000 * 0.1 / 5


def test_a_step_the_grad_scaler_skips_has_no_gradient_norm_and_is_no_divergence(tmp_path):
    class InfGradient(CollapsingMLP):
        def on_after_backward(self):
            if self.trainer.global_step == 7:
                self.encoder[0].weight.grad[0, 0] = float("inf")  # an fp16 overflow: the scaler skips update 8

    callback = watcher(policy={"action": "warn", "channels": ["index", "grad_norm"], "threshold": 10.0})
    recorder = Recorder()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    quiet_trainer(tmp_path, [callback, recorder], max_steps=15, plugins=[plugin]).fit(InfGradient(), loader())
    assert recorder.norms[8] == float("inf")  # after unscaling, as the channel sees them
    assert plugin.scaler.get_scale() == 2.0**15  # the scaler skipped it and halved its scale once
    found = checks(callback)
    assert not any(r.decision.flagged for r in found.values())
    assert interventions(callback) == []
    # The check at 10 averages the gradient norms of updates 6, 7, 9 and 10: the skipped one has none.
    expected = [sum(recorder.norms[s] for s in updates) / len(updates) for updates in ((1, 2, 3, 4, 5), (6, 7, 9, 10))]
    assert fed(callback, "grad_norm")[:2] == pytest.approx(expected, rel=1e-6)


def test_a_nan_loss_makes_a_diverged_check_that_takes_the_on_diverged_action(tmp_path):
    # The rule watches the index only: the loss reaches the monitor anyway, and a NaN there is a divergence.
    callback = watcher(policy={"action": "warn", "on_diverged": "rollback"})
    recorder = Recorder()
    quiet_trainer(tmp_path, [callback, recorder], max_steps=15).fit(CollapsingMLP(nan_loss_at={7}), loader())
    found = checks(callback)
    assert [s for s, r in found.items() if r.decision.rule == "diverged"] == [10]
    assert found[10].status == "ok"  # the features were fine (status "diverged" is for NaN or Inf features)
    decision = found[10].decision
    assert (decision.rule, decision.flagged, decision.action.value) == ("diverged", ("diverged",), "rollback")
    assert decision.reason.startswith("the training loss is nan: roll back to the newest healthy snapshot")
    assert all(torch.isfinite(t).all() for t in recorder.states[9]["module"].values())  # only the loss was NaN
    (rollback,) = interventions(callback)
    assert (rollback.action, rollback.step, rollback.snapshot_step, rollback.steps_lost) == ("rollback", 10, 5, 5)
    assert_same(recorder.states[10], recorder.states[5])
    assert not found[15].decision.flagged


@pytest.mark.slow
def test_two_ddp_processes_roll_back_together_to_the_same_state(tmp_path):
    ranks, _ = run_two_ranks("ddp_rollback.py", tmp_path)
    assert [rank["world"] for rank in ranks] == [2, 2]
    assert ranks[0]["history"] == ranks[1]["history"]  # the same checks and decisions on both ranks
    done = [(r["action"], r["step"], r["snapshot_step"]) for r in ranks[0]["history"] if r["kind"] == "intervention"]
    assert done == [("rollback", 15, 10)]
    for rank in ranks:
        hashes = {int(step): digest for step, digest in rank["hashes"].items()}
        assert hashes[15] == hashes[10] != hashes[14]  # each rank restored its own copy of step 10's state
        assert rank["global_step"] == 20
    assert ranks[0]["hashes"] == ranks[1]["hashes"]  # and the ranks' states agree at every step
