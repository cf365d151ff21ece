import math

import pytest
import torch

from tests.cadence import AT_CADENCE
from tests.unit.rules import old_policy
from topocallbacks import InputError
from topocallbacks.interventions import current_learning_rates, scale_learning_rate

STEPS_BEFORE, STEPS_AFTER = 3, 6


def linear_warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))


SCHEDULERS = {
    "lambda_warmup": linear_warmup,
    "linear_lr": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=8),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20),
    "cosine_restarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=4),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=30),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
    "cyclic": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=3),
    "warmup_then_cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=4),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20),
        ],
        milestones=[4],
    ),
    "chained": lambda opt: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ExponentialLR(opt, 0.95), linear_warmup(opt)]
    ),
}


def make(kind, optimizer_class=torch.optim.SGD):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    kwargs = {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}
    optimizer = optimizer_class([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.05}], **kwargs)
    scheduler = (
        SCHEDULERS[kind](optimizer)
        if kind != "plateau"
        else torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1, factor=0.5)
    )
    return optimizer, scheduler


def advance(optimizer, scheduler, metric):
    optimizer.step()
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(metric)
    else:
        scheduler.step()


@pytest.mark.parametrize("kind", [*SCHEDULERS, "plateau"])
def test_a_cut_survives_the_scheduler(kind):
    reference_opt, reference_sched = make(kind)
    cut_opt, cut_sched = make(kind)
    metrics = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]  # plateaus make ReduceLROnPlateau act too
    for step in range(STEPS_BEFORE):
        advance(reference_opt, reference_sched, metrics[step])
        advance(cut_opt, cut_sched, metrics[step])
    scale_learning_rate([cut_opt], [cut_sched], 0.5)
    assert current_learning_rates([cut_opt]) == pytest.approx(
        [0.5 * lr for lr in current_learning_rates([reference_opt])]
    )
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        advance(reference_opt, reference_sched, metrics[step])
        advance(cut_opt, cut_sched, metrics[step])
        expected = [0.5 * lr for lr in current_learning_rates([reference_opt])]
        # Still halved at every later step, i.e. the scheduler did not recompute it back from stale state.
        assert current_learning_rates([cut_opt]) == pytest.approx(expected, rel=1e-9), step
    if hasattr(cut_sched, "get_last_lr"):
        assert cut_sched.get_last_lr() == pytest.approx(current_learning_rates([cut_opt]))


def test_repeated_cuts_multiply():
    optimizer, scheduler = make("cosine", torch.optim.AdamW)
    scale_learning_rate([optimizer], [scheduler], 0.5)
    scale_learning_rate([optimizer], [scheduler], 0.5)
    assert current_learning_rates([optimizer]) == pytest.approx([0.025, 0.0125])
    assert scheduler.base_lrs == pytest.approx([0.025, 0.0125])


def test_tensor_learning_rates_are_scaled_in_place():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    lr = optimizer.param_groups[0]["lr"]
    scale_learning_rate([optimizer], [], 0.1)
    assert optimizer.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(0.001)


@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, -0.5, math.nan, "half"])
def test_factor_must_lower_the_rate(factor):
    optimizer, scheduler = make("cosine")
    with pytest.raises(InputError, match="`factor` must be a finite number in \\(0, 1\\), got"):
        scale_learning_rate([optimizer], [scheduler], factor)


# --- LoopActuator: the plain loop's means ----------------------------------------------------------------------


def test_loop_actuator_cuts_then_stops_a_plain_loop_and_its_rescue_checkpoint_holds_why(tmp_path):
    from sklearn.datasets import load_digits

    from topocallbacks import TopoMonitor
    from topocallbacks.interventions import LoopActuator

    data = load_digits()
    x, y = torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    # Every check after the first fires: two cuts, then the escalation to stop.
    policy = old_policy(
        action="lower_lr", score="value", threshold=-1.0, patience=1, warmup=1, cooldown=0, max_lr_cuts=2
    )
    monitor = TopoMonitor(probe=x[:64], layer="1", check_every=3, policy=policy, background=False, **AT_CADENCE)
    actuator = LoopActuator(
        optimizer,
        scheduler,
        directory=tmp_path / "rescue",
        state=lambda: {"model": model.state_dict(), "monitor": monitor.state_dict()},
    )
    rates = {}
    # The rule can stop (after its cuts), so it would keep snapshots to restore first; without `model=` the actuator
    # takes none: said once, and the stop stops where it is.

    def train() -> int:
        for step in range(30):
            batch = torch.arange(step * 32, step * 32 + 32) % len(x)
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            for record in monitor.on_step(step, model=model):
                monitor.act(record, actuator)
            rates[step] = optimizer.param_groups[0]["lr"]
            if actuator.stop_requested:
                break
        return step

    with pytest.warns(RuntimeWarning, match=r"keeps no rollback snapshots: `rollback` needs the model") as caught:
        step = train()
    assert len(caught) == 1
    done = [(r.step, r.action) for r in monitor.history if r.kind == "intervention"]
    assert done == [(3, "lower_lr"), (6, "lower_lr"), (9, "stop")]
    stop = monitor.history[-1]
    assert stop.detail.startswith("stop requested;")  # nothing to restore first
    assert "restored" not in stop.reason + stop.detail
    assert step == 9
    # Each cut is in effect at every later scheduler step: 0.1 / (1 + s) x 0.5 per cut so far.
    for s, rate in rates.items():
        cuts = (s >= 3) + (s >= 6)
        assert rate == pytest.approx(0.1 / (2 + s) * 0.5**cuts)
    saved = torch.load(tmp_path / "rescue" / "topo-stop-step9.pt", weights_only=True)
    last = saved["monitor"]["history"][-1]
    assert (last["kind"], last["step"], last["action"]) == ("intervention", 9, "stop")
    torch.testing.assert_close(saved["model"]["0.weight"], model[0].weight)


def test_loop_actuator_refuses_bad_arguments_and_says_where_nothing_was_saved():
    from topocallbacks.interventions import LoopActuator

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(InputError, match="`optimizers` must be a torch optimizer"):
        LoopActuator("sgd")
    with pytest.raises(InputError, match="`state` is required with `directory`"):
        LoopActuator(optimizer, directory="rescue")
    assert LoopActuator(optimizer).checkpoint_location("topo-stop-step3") == (
        "not saved (LoopActuator has no `directory`)"
    )
