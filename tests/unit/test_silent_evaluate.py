"""The silent suite's replay of candidates on runs whose signals are known (benchmarks/silent/silent_evaluate.py)."""

import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

evaluate = benchmark_module("silent_evaluate", "silent")


def series(n=40, level=10.0, drop_at=None, drop_to=2.0, seed=0):
    rng = np.random.default_rng(seed)
    values = level + 0.1 * rng.normal(size=n)
    if drop_at is not None:
        values[drop_at:] = drop_to + 0.1 * rng.normal(size=n - drop_at)
    return values


def run(evaluate, kind, rankme, fault=200, point=None, scenario="vae_kl_bug", seed=0):
    steps = np.arange(rankme.size) * 10
    names = [s for family in evaluate.FAMILIES.values() for s in family]
    values = {name: np.full(rankme.size, math.nan) for name in names}
    values.update({name: np.zeros(rankme.size) for name in evaluate.SENTINELS})
    values["rankme"] = rankme
    return evaluate.Run(scenario, seed, kind, steps, values, fault, point)


def test_the_frozen_score_is_a_robust_z_against_the_warm_up(evaluate):
    values = np.array([10.0, 11.0, 9.0, 10.0, 12.0, 8.0, 10.0, 13.0, 7.0, 11.0, 10.0, 4.0])
    scores = evaluate.frozen_scores(values, direction=-1)
    assert all(math.isnan(s) for s in scores[:10])
    mad = 1.4826 * np.median(np.abs(values[:10] - 10.0))  # median 10, MAD 1
    assert scores[11] == pytest.approx(6.0 / mad)
    assert scores[10] == pytest.approx(0.0)
    flat = evaluate.frozen_scores(np.full(12, 5.0), direction=1)  # no spread: the floor (1 % of the level)
    assert flat[11] == 0.0


def test_a_drop_after_the_fault_is_caught_before_the_harm_and_healthy_runs_stay_quiet(evaluate):
    faulted = run(evaluate, "collapse", series(drop_at=25), point=300)  # harm from step 300, the drop at 250
    twin = run(evaluate, "healthy", series(seed=1))
    alarm, _ = evaluate.first_alarm(faulted, ("rankme",), "trailing", 4.5, 2)
    assert alarm == 260  # two consecutive checks: 250 and 260
    assert evaluate.first_alarm(twin, ("rankme",), "trailing", 4.5, 2) == (None, False)
    late = run(evaluate, "collapse", series(drop_at=35), point=300)
    assert evaluate.first_alarm(late, ("rankme",), "frozen", 4.5, 2)[0] == 360  # after the 5 % point: not caught


def test_the_choice_needs_no_healthy_alarm_and_counts_classes_with_five_of_six_seeds(evaluate):
    runs = []
    for seed in range(6):
        drop = 25 if seed < 5 else None  # five of six seeds collapse in rankme
        runs.append(run(evaluate, "collapse", series(drop_at=drop, seed=seed), point=300, seed=seed))
        runs.append(run(evaluate, "healthy", series(seed=10 + seed), seed=seed))
    results = evaluate.evaluate(runs, ("S5",))
    spectrum = [r for r in results if r["combination"] == "spectrum" and r["score"] == "trailing" and r["k"] == 4.5
                and r["p"] == 2]  # fmt: skip
    assert spectrum[0]["by_class"] == {"S5": True}
    assert spectrum[0]["runs_caught"] == 5
    assert spectrum[0]["healthy_alarmed"] == 0
    chosen = evaluate.choose(results)
    assert chosen["classes_caught"] == 1
    assert chosen["healthy_alarmed"] == 0
    assert chosen["signals"] == 1  # the spectrum alone: fewest signals among the ties
    assert len(results) == len(evaluate.combinations()) * 2 * 5 * 3


def test_the_report_gives_the_choice_each_family_and_anchor_the_loss_rule_and_exact_intervals(evaluate):
    runs = []
    for seed in range(6):
        faulted = run(evaluate, "collapse", series(drop_at=25 if seed < 5 else None, seed=seed), point=300, seed=seed)
        faulted.values["loss"] = series(level=2.0, drop_at=25, drop_to=1.0, seed=seed)  # the loss falls: silent
        healthy = run(evaluate, "healthy", series(seed=10 + seed), seed=seed)
        healthy.values["loss"] = series(level=2.0, seed=20 + seed)
        for r in (faulted, healthy):
            r.values["norm_std"] = series(seed=30 + seed)
            r.values["grad_norm"] = series(seed=40 + seed)
        runs += [faulted, healthy]
    found = evaluate.report(runs, ("S5",))
    assert found["chosen"]["combination"] == "spectrum"
    assert found["per_scenario"]["vae_kl_bug"]["caught"] == 5
    low, high = found["per_scenario"]["vae_kl_bug"]["interval"]
    assert low == pytest.approx(0.3588, abs=1e-3)  # Clopper-Pearson for 5 of 6
    assert high == pytest.approx(0.9958, abs=1e-3)
    assert found["loss_rule"]["classes_caught"] == 0  # a falling loss never alarms the rising-loss rule
    two_sided = found["anchors"]["loss_two_sided"]
    assert two_sided is not None
    assert two_sided["classes_caught"] == 1  # scored both ways, the drop is seen
    assert found["anchors"]["lidar"] is None  # no views recorded here: LiDAR cannot be judged
    assert found["families"]["spectrum"]["combination"] in ("spectrum", "spectrum+sentinels")
