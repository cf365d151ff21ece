import math

import pytest
import torch

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
