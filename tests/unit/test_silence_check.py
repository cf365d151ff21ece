"""The silence check (benchmarks/silent/silence.py) and its re-run on evaluation recordings (silent_evaluate.py)."""

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

silence = benchmark_module("silence", "silent")
evaluate = benchmark_module("silent_evaluate", "silent")


def recording(path, seed, loss_jump=False, harm=True, scenario="vae_kl_bug", harm_at=400):
    """A recording of checks every 10 steps to 600, the fault at 300; the faulted run's metric drops from 400 (the
    5 % point) unless ``harm`` is False; the loss is flat noise, with a jump at 350 when ``loss_jump``."""
    rng = np.random.default_rng(seed)
    steps = np.arange(0, 601, 10)
    twin = np.full(steps.size, 32.0)
    faulted = np.where((steps >= harm_at) & harm, 20.0, 32.0)
    loss = 1.0 + 0.01 * rng.normal(size=601)
    if loss_jump:
        loss[345:355] = 5.0
    name = path / f"{scenario}-seed{seed}.npz"
    np.savez(name, scenario=scenario, seed=seed, fault_step=300, higher_is_better=True,
             **{"collapse/check_steps": steps, "collapse/metric": faulted, "healthy/metric": twin,
                "healthy/check_steps": steps, "collapse/loss": loss})  # fmt: skip
    return name


def test_a_seed_passes_when_the_loss_rule_is_quiet_until_the_harm_and_the_harm_comes(silence, tmp_path):
    found = silence.check(recording(tmp_path, 0))
    assert found["five_percent_point"] == 400
    assert found["checks_before_harm"] == 9  # 310 ... 390: the checks a signal has to warn before the harm
    assert (found["passed"], found["quiet"], found["reached"]) == (True, True, True)
    loud = silence.check(recording(tmp_path, 1, loss_jump=True))
    assert loud["loss_alarms_after_fault"][0] == 350  # the check at 350 averages steps 340-349: the jump begins
    assert (loud["quiet"], loud["passed"]) == (False, False)
    harmless = silence.check(recording(tmp_path, 2, harm=False))
    assert harmless["five_percent_point"] is None
    assert not harmless["passed"]


def test_round_two_scenarios_need_room_three_checks_between_the_fault_and_the_harm(silence, tmp_path):
    for harm_at, room in ((320, False), (330, True)):
        found = silence.check(recording(tmp_path, 0, scenario="classes_dropped", harm_at=harm_at))
        assert (found["five_percent_point"], found["room"], found["passed"]) == (harm_at, room, room)
    early = silence.check(recording(tmp_path, 0, harm_at=320))  # round 1's scenarios keep round 1's rule
    assert (early["room"], early["passed"]) == (False, True)


@pytest.mark.parametrize(("loud", "passes"), [(1, True), (2, False)])
def test_a_scenario_passes_on_five_of_six_evaluation_seeds(evaluate, tmp_path, loud, passes):
    for seed in range(6):
        recording(tmp_path, seed, loss_jump=seed < loud)
    found = evaluate.silence_checks(tmp_path, ["vae_kl_bug", "trap_transfer"], tuple(range(6)))
    assert list(found) == ["vae_kl_bug"]  # a trap has no fault to be silent about
    assert found["vae_kl_bug"]["passed"] == 6 - loud
    assert found["vae_kl_bug"]["passes"] is passes
