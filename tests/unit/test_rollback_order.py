"""The rule's options for the two known holes of issue 35: when a rollback skips and cuts (``rollback_order``), when
a stop restores (``stop_restores``) and which channels make a check healthy (``snapshot_health``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cadence import AT_CADENCE
from tests.unit.rules import old_rule
from tests.unit.test_rollback import CHECK_EVERY, Loop, collapsed_features, fault_at, healthy_features
from topocallbacks import TopoMonitor
from topocallbacks.exceptions import InputError
from topocallbacks.interventions import LoopActuator, updates_left_to_skip
from topocallbacks.policy import Policy
from topocallbacks.policy.escalation import rollback_plan
from topocallbacks.settings import PolicySettings


@pytest.mark.parametrize(
    ("order", "first", "second", "refired"),
    [
        ("skip_and_cut", (0.5, "now"), (0.5, "now"), (0.5, "now")),
        ("skip_if_confirmed", (0.5, "later"), (0.5, "later"), (0.5, "later")),
        ("from_second", (None, "none"), (0.5, "now"), (0.5, "now")),
        ("cut_if_refired", (None, "now"), (None, "now"), (0.5, "now")),
    ],
)
def test_each_rollback_order_plans_the_cut_and_the_skip(order, first, second, refired):
    settings = PolicySettings(rollback_order=order)
    assert rollback_plan(settings, 1, refired=False)[:2] == first
    assert rollback_plan(settings, 2, refired=False)[:2] == second
    assert rollback_plan(settings, 2, refired=True)[:2] == refired


def test_skip_and_cut_keeps_the_previous_rules_first_rollback_factor():
    # rollback_lr_factor None: the first rollback keeps the rate, every later one cuts by lr_factor (as before).
    assert PolicySettings().rollback_order == "cut_if_refired"  # the default since the pre-registered choice
    settings = PolicySettings(rollback_lr_factor=None, lr_factor=0.25, rollback_order="skip_and_cut")
    assert rollback_plan(settings, 1, refired=False)[0] is None
    assert rollback_plan(settings, 2, refired=False)[0] == 0.25
    assert rollback_plan(PolicySettings(rollback_lr_factor=None, rollback_order="from_second"), 2, False)[0] == 0.5


def test_bad_orders_and_orders_without_the_loss_are_refused_by_name():
    with pytest.raises(InputError, match="rollback_order"):
        PolicySettings(rollback_order="sometimes")
    with pytest.raises(InputError, match=r"`rollback_order` 'skip_if_confirmed'.*must include 'loss'.*\['index'\]"):
        PolicySettings(rollback_order="skip_if_confirmed", channels=("index",), require=1)
    with pytest.raises(InputError, match="stop_restores"):
        PolicySettings(stop_restores="never")
    with pytest.raises(InputError, match="snapshot_health"):
        PolicySettings(snapshot_health="some")


def ordered_loop(order: str, **policy) -> Loop:
    rule = old_rule(action="rollback", warmup=3, max_rollbacks=4, rollback_skip=3, rollback_order=order, **policy)
    return Loop(TopoMonitor(check_every=CHECK_EVERY, policy=rule, summary=False, **AT_CADENCE))


def test_from_second_neither_skips_nor_cuts_at_the_first_rollback_and_does_both_from_the_second():
    loop = ordered_loop("from_second", rollback_lr_factor=0.5)
    done = loop.run(range(0, 71), fault_at(50, 56))  # collapsed checks at steps 50 and 55
    assert [(d.step, d.action) for d in done] == [(50, "rollback"), (55, "rollback")]
    assert "no skip and no cut at the first rollback" in done[0].reason
    assert "skipped" not in done[0].detail
    assert done[0].lr_factor == 1.0
    assert "the next 3 optimizer update(s) skipped" in done[1].detail
    assert done[1].lr_factor == 0.5


def test_cut_if_refired_skips_every_time_and_cuts_only_a_rollback_within_two_checks_of_the_last():
    loop = ordered_loop("cut_if_refired", rollback_lr_factor=0.5, cooldown=0)
    features = lambda s: collapsed_features(s) if s in (50, 55, 80) else healthy_features(s)  # noqa: E731
    done = loop.run(range(0, 91), features)
    assert [(d.step, d.action) for d in done] == [(50, "rollback"), (55, "rollback"), (80, "rollback")]
    assert all("the next 3 optimizer update(s) skipped" in d.detail for d in done)
    assert [d.lr_factor for d in done] == [1.0, 0.5, 0.5]  # 55 refired (one check later): cut; 80 did not
    assert "x 0.5 as it fired again within two checks of the last rollback" in done[1].reason
    assert ", no cut (no rollback in the two checks before)" in done[2].reason


def loss_monitor(order: str, **policy) -> tuple[TopoMonitor, LoopActuator, torch.nn.Module]:
    """A monitor on the index and the loss (both required) and a real optimiser to act on; checks are fed by hand."""
    base = {"action": "rollback", "warmup": 3, "max_rollbacks": 4, "rollback_skip": 3, "channels": ("index", "loss"),
            "require": 2, "rollback_order": order}  # fmt: skip
    rule = old_rule(**{**base, **policy})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return (
        TopoMonitor(check_every=CHECK_EVERY, policy=rule, summary=False, **AT_CADENCE),
        LoopActuator(optimizer, model=model),
        model,
    )


def feed(monitor, actuator, steps, loss, features=healthy_features):
    return [monitor.act(monitor.process(features(s), s, loss=loss(s)), actuator) for s in steps]


def healthy_loss(step: int) -> float:
    return 2.0 - 0.001 * step + 0.01 * np.sin(step)


@pytest.mark.parametrize("confirmed", [True, False])
def test_skip_if_confirmed_skips_only_when_the_loss_flags_again_at_the_next_check(confirmed):
    monitor, actuator, _ = loss_monitor("skip_if_confirmed")
    feed(monitor, actuator, range(0, 50, CHECK_EVERY), healthy_loss)
    burst = lambda s: 50.0 if s == 50 or (confirmed and s == 55) else healthy_loss(s)  # noqa: E731
    rollback = feed(monitor, actuator, [50], burst, collapsed_features)[0]
    assert rollback.action == "rollback"
    assert "will be skipped if the training loss flags again" in rollback.detail
    assert monitor.rescuer.pending_skip_
    assert updates_left_to_skip(actuator.optimizers[0]) == 0
    after = feed(monitor, actuator, [55], burst)[0]
    assert not monitor.rescuer.pending_skip_
    if confirmed:
        assert after.action == "skip"
        assert "the training loss flagged again" in after.reason
        assert updates_left_to_skip(actuator.optimizers[0]) == 3
        assert any(getattr(r, "action", None) == "skip" for r in monitor.history)
    else:
        assert after is None
        assert updates_left_to_skip(actuator.optimizers[0]) == 0


@pytest.mark.parametrize(("late_loss", "restores"), [(5.0, True), (1.0, False)])
def test_a_stop_restores_the_snapshot_only_when_the_recent_loss_is_worse_with_if_better(late_loss, restores):
    # The index alone decides (the loss is passed and recorded, not watched): the stop comes whatever the loss does.
    monitor, actuator, model = loss_monitor(
        "skip_and_cut", stop_restores="if_better", max_rollbacks=0, channels=("index",), require=1
    )
    feed(monitor, actuator, range(0, 50, CHECK_EVERY), lambda s: 2.0 + 0.01 * np.sin(s))
    snapshot = monitor.snapshots.snapshots[-1]
    assert snapshot.loss == pytest.approx(2.0 + 0.01 * np.sin(45))
    with torch.no_grad():
        model.weight.add_(1.0)  # training moved on since the snapshot
    moved = model.weight.detach().clone()
    stop = feed(monitor, actuator, [50], lambda s: late_loss, collapsed_features)[0]
    assert stop.action == "stop"
    kept = model.state_dict()
    if restores:
        assert "is restored first" in stop.reason
        assert torch.equal(kept["weight"], snapshot.load()["model"]["weight"])
    else:
        assert "the weights are kept, not the last healthy state" in stop.reason
        assert torch.equal(kept["weight"], moved)


def test_snapshot_health_watched_lets_an_unwatched_channel_spike_without_making_the_check_unhealthy():
    def last(policy):
        decision = None
        for step in range(14):  # warm-up 10, then a gradient-norm spike at the last check
            decision = policy.decide(step, 1.0 + 0.01 * (step % 3), loss=2.0, grad_norm=1000.0 if step == 13 else 1.0)
        return decision

    spiking = last(Policy(channels=("index", "loss")))
    assert spiking.unsettled == ("grad_norm",)
    assert not spiking.healthy
    watched = last(Policy(channels=("index", "loss"), snapshot_health="watched"))
    assert watched.unsettled == ()
    assert watched.healthy
