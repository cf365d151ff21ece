"""The default rule in real Lightning fits: collapses it must catch at any check, and healthy runs it must leave alone.

Each model is a digits MLP whose watched layer (``fault``) is a real layer of the network that can be made to fail
from a given training step: squeezed towards rank one, zeroed, or replaced by its batch's mean (the failures the
default rule was blind to before its absolute sentinels), or moved once for good in a healthy way.
"""

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch

from tests.cadence import AT_CADENCE
from tests.integration.models import digits, digits_loader
from tests.integration.models import quiet_trainer as trainer
from topocallbacks.functional.sentinels import ONE_DIRECTION_SHARE
from topocallbacks.lightning import TopoCollapseCallback

PROBE = digits(256)[0]


class Fault(torch.nn.Module):
    """Identity until training step ``start``; then ``kind``: "rank_one" (mixed towards the projection on one
    direction over ``ramp`` steps, then exactly rank one), "zero", "mean" (every sample gets its batch's mean),
    "stretch" (a fixed anisotropic stretch, undone before the head: a healthy move of the watched features) or
    None (healthy)."""

    def __init__(self, width=32, kind=None, start=150, ramp=50):
        super().__init__()
        self.kind, self.start, self.ramp = kind, start, ramp
        generator = torch.Generator().manual_seed(7)
        direction = torch.randn(width, generator=generator)
        self.register_buffer("direction", direction / direction.norm())
        self.register_buffer("stretch", 1 + 4 * (torch.arange(width) < width // 2).float())
        self.step = 0  # the training step of the batch going through (set by the model)

    def active(self):
        return self.kind is not None and self.step >= self.start

    def forward(self, x):
        if not self.active():
            return x
        if self.kind == "rank_one":
            mix = min(1.0, (self.step - self.start + 1) / self.ramp)
            return (1 - mix) * x + mix * (x @ self.direction)[:, None] * self.direction
        if self.kind == "zero":
            return x * 0.0
        if self.kind == "mean":
            return x.mean(dim=0, keepdim=True).expand_as(x)
        return x * self.stretch

    def undo(self, y):
        return y / self.stretch if self.kind == "stretch" and self.active() else y


class FaultyMLP(pl.LightningModule):
    def __init__(self, kind=None, start=150, lr=0.05, lr_jump=None):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU()
        )
        self.fault = Fault(kind=kind, start=start)
        self.head = torch.nn.Linear(32, 10)
        self.lr, self.lr_jump = lr, lr_jump

    def forward(self, x):
        return self.head(self.fault.undo(self.fault(self.body(x))))

    def training_step(self, batch, batch_idx):
        self.fault.step = self.global_step
        images, labels = batch
        return torch.nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.lr_jump is None:
            return optimizer
        start, factor = self.lr_jump  # a structural fault keyed to the update count: a rollback replays it
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < start else factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit(tmp_path, model, steps, **options):
    callback = TopoCollapseCallback(**options, **AT_CADENCE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a warn decision is a RuntimeWarning
        trainer(tmp_path, [callback], max_steps=steps).fit(model, digits_loader())
    checks = [r for r in callback.history if r.kind == "check"]
    interventions = [r for r in callback.history if r.kind == "intervention"]
    return callback, checks, interventions


@pytest.mark.slow
def test_a_collapse_inside_the_warm_up_is_flagged_after_its_onset_and_nothing_before(tmp_path):
    # Squeezed towards rank one from step 150 (rank one from 199), checks every 25 steps: the relative rule's
    # 10-check warm-up lasts until step 225, and the collapsed state would then have been its reference.
    _, checks, _ = fit(
        tmp_path, FaultyMLP("rank_one", start=150), 350, probe=PROBE, layer="fault", check_every=25,
        policy={"action": "warn"},
    )  # fmt: skip
    flagged = [r.step for r in checks if r.decision.fired]
    assert len(checks) == 15
    assert flagged
    assert 150 < min(flagged) <= 225
    first = next(r for r in checks if r.decision.fired)
    assert first.decision.rule == "sentinel"
    assert "one line" in first.decision.reason
    assert first.sentinels.top_share >= ONE_DIRECTION_SHARE
    assert all(r.sentinels.top_share < 0.9 for r in checks if r.step <= 150)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero", "mean", "rank_one"])
def test_each_total_collapse_of_a_stream_is_flagged_within_8_checks_and_not_before(tmp_path, kind):
    _, checks, _ = fit(
        tmp_path, FaultyMLP(kind, start=120), 220, layer="fault", mode="stream", check_every=10,
        policy={"action": "warn"},
    )  # fmt: skip
    flagged = [r.step for r in checks if r.decision.fired]
    assert flagged, [r.decision.reason for r in checks]
    assert 120 < min(flagged) <= 120 + 8 * 10  # nothing before the onset, and within 8 checks of it
    first = next(r for r in checks if r.decision.fired)
    assert first.decision.rule == "sentinel"
    expected = {"zero": "constant", "mean": "constant", "rank_one": "one line"}[kind]
    assert expected in first.decision.reason


@pytest.mark.slow
def test_a_healthy_move_that_raised_one_alarm_is_not_acted_on_again(tmp_path):
    # At step 150 the watched features are stretched for good (undone before the head: training is not touched). The
    # index alone (no loss confirmation) warns at the check that sees the move; drift is then measured from the
    # check before or the last unflagged one, whichever is nearer, so the run that moved on is not judged against a
    # frozen past (before, it warned again and again).
    _, checks, interventions = fit(
        tmp_path, FaultyMLP("stretch", start=150), 400, probe=PROBE, layer="fault", check_every=10,
        policy={"channels": ["index"], "require": 1, "action": "warn", "cooldown": 0},
    )  # fmt: skip
    warned = [r.step for r in interventions]
    assert warned == [160]  # the move, once: the cooldown is off, so a repeat would show
    assert all(not r.decision.flagged for r in checks if r.step > 160)


@pytest.mark.slow
def test_a_stop_after_the_last_rollback_restores_the_last_healthy_state_bit_for_bit(tmp_path):
    # A structural fault keyed to the update count (the rate x40 from update 100): it comes back after every
    # rollback; after max_rollbacks the rule stops, and the stop restores the last healthy snapshot first.
    kept = {}

    class Keep(pl.Callback):  # a copy of the state at every check step, after the monitor's own hook
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 10 == 0:
                kept[trainer.global_step] = (
                    copy.deepcopy(pl_module.state_dict()),
                    copy.deepcopy(trainer.optimizers[0].state_dict()),
                )

    callback = TopoCollapseCallback(
        probe=PROBE, layer="fault", check_every=10, policy={"max_rollbacks": 1}, **AT_CADENCE
    )
    model = FaultyMLP(lr=0.05, lr_jump=(100, 40.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fit_trainer = trainer(tmp_path, [callback, Keep()], max_steps=400)
        fit_trainer.fit(model, digits_loader())
    interventions = [r for r in callback.history if r.kind == "intervention"]
    assert [r.action for r in interventions] == ["rollback", "stop"]
    stop = interventions[-1]
    healthy = [r.step for r in callback.history if r.kind == "check" and r.decision.healthy and r.step < stop.step]
    assert stop.snapshot_step == healthy[-1]  # the last healthy state
    assert "restored the last healthy state" in stop.detail
    assert "structural" in stop.reason
    assert fit_trainer.global_step < 400  # stopped
    weights, optimizer = kept[stop.snapshot_step]
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name  # the healthy weights, bit for bit
    moments = fit_trainer.optimizers[0].state_dict()["state"]
    for key, saved in optimizer["state"].items():
        assert torch.equal(moments[key]["momentum_buffer"], saved["momentum_buffer"])
    # The rate is the jumped one (x40) times the rollbacks' cut: none, since the default cuts only at a rollback that
    # fires again within two checks of the previous one, and this was the first.
    assert interventions[0].lr_factor == 1.0
    assert fit_trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 40 * interventions[0].lr_factor)
