"""The collapse-evidence suite (benchmarks/collapse): recording, signals and the evaluation protocol."""

import dataclasses
import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_suite, needs_fashion_mnist

suite = benchmark_suite("collapse", ("scenarios", "record", "signals", "evaluate"))


@needs_fashion_mnist
@pytest.mark.slow
def test_twins_share_everything_before_the_fault_and_differ_after(suite, tmp_path):
    scenario = dataclasses.replace(suite["scenarios"].SCENARIOS["resnet_lr_ramp"], steps=6, fault_step=3, check_every=1)
    path = suite["record"].record(scenario.name, 0, tmp_path, scenario=scenario)
    with np.load(path) as data:
        for kind in ("collapse", "healthy"):
            assert data[f"{kind}/check_steps"].tolist() == [0, 1, 2, 3, 4, 5, 6]
            assert data[f"{kind}/features"].shape == (7, 512, 64)
            assert data[f"{kind}/features"].dtype == np.float16
            assert data[f"{kind}/loss"].shape == data[f"{kind}/grad_norm"].shape == (6,)
            assert np.isfinite(data[f"{kind}/metric"]).all()
        prefix = slice(0, 4)  # checks at steps 0..3 come before any faulty update
        np.testing.assert_array_equal(data["collapse/features"][prefix], data["healthy/features"][prefix])
        np.testing.assert_array_equal(data["collapse/loss"][:3], data["healthy/loss"][:3])
        # The learning rate ramps from step 3 on: the step-3 update already differs.
        assert not np.array_equal(data["collapse/features"][5], data["healthy/features"][5])
        assert int(data["fault_step"]) == 3
        assert str(data["metric_name"]) == "accuracy"


def synthetic_recording(path, checks=14, fault=70):
    rng = np.random.default_rng(0)
    steps = np.arange(checks) * 10
    arrays = {}
    for kind in ("collapse", "healthy"):
        frames = rng.normal(size=(checks, 40, 6))
        if kind == "collapse":
            frames[steps > fault] *= np.array([1, 1, 1e-3, 1e-3, 1e-3, 1e-3])  # rank collapse after the fault
        frames[steps <= fault] = np.random.default_rng(1).normal(size=(int((steps <= fault).sum()), 40, 6))
        arrays[f"{kind}/check_steps"] = steps
        arrays[f"{kind}/features"] = frames.astype(np.float16)
        falls = steps > fault + 20 if kind == "collapse" else np.zeros(checks, dtype=bool)
        arrays[f"{kind}/metric"] = np.where(falls, 0.1, 0.8)
        arrays[f"{kind}/loss"] = np.ones(steps[-1])
        arrays[f"{kind}/grad_norm"] = np.ones(steps[-1])
    np.savez_compressed(
        path, **arrays, scenario="resnet_lr_ramp", seed=0, fault_step=fault, steps=int(steps[-1]), check_every=10,
        metric_name="accuracy", higher_is_better=True, seconds=0.0,
    )  # fmt: skip


def test_signals_are_cached_and_shared_prefix_is_computed_once(suite, tmp_path):
    evaluate = suite["evaluate"]
    synthetic_recording(tmp_path / "resnet_lr_ramp-seed0.npz")
    runs = evaluate.load_runs(tmp_path)
    assert [(r.kind, r.steps.size) for r in runs] == [("collapse", 14), ("healthy", 14)]
    assert list((tmp_path).glob("*.signals-v*.npz"))
    collapse, healthy = runs
    for name in ("rankme", "betti0_area", "paper_ci", "diagram_drift"):
        assert collapse.signals[name].shape == (14,)
        np.testing.assert_array_equal(collapse.signals[name][:8], healthy.signals[name][:8])
    # The rank collapse shows in RankMe after the fault and not before.
    assert collapse.signals["rankme"][9:].max() < 0.5 * collapse.signals["rankme"][:8].min()
    assert math.isnan(collapse.signals["grad_norm"][0])
    assert collapse.signals["grad_norm"][1] == 1.0
    # A second load reads the cache (same values).
    again = evaluate.load_runs(tmp_path)
    np.testing.assert_array_equal(again[0].signals["rankme"], collapse.signals["rankme"])


def make_run(evaluate, values, metric, kind="collapse", fault=100):
    steps = np.arange(len(values)) * 10
    return evaluate.Run(
        scenario="resnet_lr_ramp", kind=kind, seed=0, fault_step=fault, steps=steps, metric=np.asarray(metric),
        metric_name="accuracy", higher_is_better=True, diverged=np.zeros(len(values), dtype=bool),
        signals={"rankme": np.asarray(values)},
    )  # fmt: skip


def test_rule_flags_a_drop_after_the_warm_up_with_patience(suite):
    evaluate = suite["evaluate"]
    noise = np.random.default_rng(0).normal(scale=0.1, size=30)
    values = 10 + noise
    values[20:] -= 3.0  # RankMe drops at step 200
    metric = np.full(30, 0.8)
    metric[24:] = 0.5  # accuracy falls at step 240
    run = make_run(evaluate, values, metric)
    z = evaluate.run_scores(run, "rankme", 5.0)
    assert np.isnan(z[: evaluate.WARMUP]).all()  # no score during the warm-up
    assert z[20] > 10
    assert np.abs(z[evaluate.WARMUP : 20]).max() < 5
    flags = evaluate.flagged(run, z, 5.0, 2)
    assert np.flatnonzero(flags)[0] == 21  # patience 2: the second check of the drop
    result = evaluate.outcome(run, flags)
    assert result.warning_step == 210
    assert result.before_fault == 0
    assert evaluate.standard_warning(run) == 240
    assert evaluate.lead(run, result.warning_step) == 30
    assert evaluate.lead_fraction(run, result.warning_step) == pytest.approx(30 / 140)
    assert evaluate.lead_fraction(run, None) == -1.0
    # A diverged check is flagged even during the warm-up, whatever the patience.
    run.diverged[3] = True
    assert evaluate.flagged(run, evaluate.run_scores(run, "rankme", 5.0), 5.0, 2)[3]


def test_the_suite_scores_with_the_package_rule(suite):
    from topocallbacks.policy import Policy

    evaluate = suite["evaluate"]
    rng = np.random.default_rng(2)
    values = np.concatenate([10 + 0.1 * rng.normal(size=25), [7.0, 10.0]])
    policy = Policy(evaluate.RULE, threshold=5.0)
    decisions = [policy.decide(i, -v) for i, v in enumerate(values)]  # RankMe falls at collapse: oriented
    run = make_run(evaluate, values, np.full(values.size, 0.8))
    z = evaluate.run_scores(run, "rankme", 5.0)
    assert [d.score for d in decisions[evaluate.WARMUP :]] == pytest.approx(z[evaluate.WARMUP :].tolist())
    assert [d.fired for d in decisions] == evaluate.flagged(run, z, 5.0, 1).tolist()


def test_tuning_keeps_the_false_positive_budget_on_the_tuning_runs(suite):
    evaluate = suite["evaluate"]
    rng = np.random.default_rng(1)
    healthy = [make_run(evaluate, 10 + rng.normal(scale=0.1, size=40), np.full(40, 0.8), "healthy") for _ in range(3)]
    values = 10 + rng.normal(scale=0.1, size=40)
    values[25:] -= np.linspace(0.5, 5, 15)
    metric = np.full(40, 0.8)
    metric[32:] = 0.3
    runs = [*healthy, make_run(evaluate, values, metric)]
    k, patience = evaluate.tune(runs, "rankme")
    result = evaluate.evaluate(runs, "rankme", k, patience)
    assert result["fp"] <= evaluate.FP_BUDGET
    assert result["early"] == 1
    # The chosen k is the smallest within budget for that patience.
    smaller = [t for t in evaluate.THRESHOLDS if t < k]
    if smaller:
        assert evaluate.evaluate(runs, "rankme", smaller[-1], patience)["fp"] > evaluate.FP_BUDGET
