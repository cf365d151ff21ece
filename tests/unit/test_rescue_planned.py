"""The rescue suite's planned detector: the library's monitor driven by its schedule (``on_step`` every step) while
following a budget's plan, in the suite's replay (benchmarks/rescue/engine.py, ``PlannedTopoDetector``)."""

import json

import pytest

from tests.benchmarks import benchmark_suite, needs_fashion_mnist

MODULES = ("faults", "engine", "detectors", "cache", "run", "plans", "at_default")


suite = benchmark_suite("rescue", MODULES)


@pytest.fixture(scope="module")
def trunks(suite, tmp_path_factory):
    """The quick grid's trunks (tiny ViT, seed 0, 80 positions, fault at 50, checks every 5), trained once."""
    directory = tmp_path_factory.mktemp("trunks")
    suite["run"].trunk_job("vit", 0, suite["faults"].QUICK, directory)
    return suite["run"].load_trunks(directory, "vit", 0)


def _planned(suite, **plan):
    setup = suite["faults"].QUICK
    full = {"at_step": suite["plans"].plan_step(setup.check_every), "intervals": 1, "background": False,
            "lag": None, "probe_size": None}  # fmt: skip
    return lambda: suite["engine"].PlannedTopoDetector({}, setup.check_every, {**full, **plan}, 512)


def _run(suite, trunks, make):
    arch = suite["faults"].ARCHITECTURES["vit"]
    return suite["engine"].run_detector(arch, 0, suite["faults"].QUICK, trunks, make)


def _events(run):
    return [(e["position"], e["action"], e["snapshot_step"]) for e in run.events]


@pytest.mark.slow
@needs_fashion_mnist
def test_a_plan_that_changes_nothing_decides_as_the_checks_the_caller_runs(suite, trunks):
    setup = suite["faults"].QUICK
    planned = _run(suite, trunks, _planned(suite))
    called = _run(suite, trunks, lambda: suite["engine"].TopoDetector({}, setup.check_every))
    assert any(_events(run) for run in called.values()), "the quick faults make the default act"
    for kind in suite["faults"].KINDS:
        assert _events(planned[kind]) == _events(called[kind])
        assert planned[kind].final == called[kind].final
        assert planned[kind].final_updates == called[kind].final_updates


@pytest.mark.slow
@needs_fashion_mnist
def test_a_lagged_decision_is_applied_lag_steps_after_its_check_and_branching_equals_a_live_run(suite, trunks):
    setup, lag = suite["faults"].QUICK, 3
    make = _planned(suite, background=True, lag=lag)
    runs = _run(suite, trunks, make)
    acted = [(kind, e) for kind, run in runs.items() for e in run.events]
    at_step = 2 * setup.check_every
    assert any(e["action"] == "rollback" and e["position"] > at_step for _, e in acted)
    for _, event in acted:
        # Checks before the plan's step are applied at once; from it on, lag steps after their check.
        late = event["position"] > at_step
        assert event["position"] % setup.check_every == (lag if late else 0)
        if event["snapshot_step"] is not None and event["snapshot_step"] > at_step:
            assert event["snapshot_step"] % setup.check_every == lag  # taken when a healthy check was applied
    for kind in ("transient", "structural"):
        live = suite["engine"].run_live(suite["faults"].ARCHITECTURES["vit"], 0, setup, kind, make)
        assert live.final == runs[kind].final  # bit for bit: a snapshot between checks is the trunk's state there
        assert _events(live) == _events(runs[kind])


@pytest.mark.slow
@needs_fashion_mnist
def test_the_plan_sets_the_cadence_and_a_smaller_probe_restarts_the_calibration(suite, trunks):
    setup = suite["faults"].QUICK
    runs = _run(suite, trunks, _planned(suite, intervals=2, probe_size=128))
    history = runs["healthy"].detector.monitor.history
    checks = [(r.step, r.n_points) for r in history if hasattr(r, "n_points")]
    at_step = 2 * setup.check_every
    # The check at the plan's step takes the plan; the checks after it follow its cadence, on its probe.
    assert checks[:3] == [(0, 512), (5, 512), (at_step, 512)]
    assert [step for step, _ in checks[2:]] == list(range(at_step, setup.steps, 2 * setup.check_every))
    assert {n for _, n in checks[3:]} == {128}
    assert runs["healthy"].probe_passes == len(checks)


def test_the_stored_plans_are_the_planners_on_the_stored_costs(suite):
    """Each setting's stored plan is what the library's planner makes of its stored costs (one home: `plan_of`)."""
    plans, budget = suite["plans"], suite["plans"].MonitorSettings().schedule.overhead_budget
    stored = json.loads(suite["detectors"].PLANS.read_text())
    assert stored["budget"] == budget
    assert set(stored["settings"]) == set(plans.DESIGN)
    for found in stored["settings"].values():
        costs = plans.Costs(**found["costs"])
        assert found["plan"] == plans.plan_of(costs, suite["faults"].FULL)
        assert found["plan"]["at_step"] == plans.plan_step(stored["check_every"]) == 20


def _row(transient, structural, healthy_acted=0, healthy_change=0.0, healthy_rate=0.0):
    settings = {"vit": {"transient": f"{transient}/7", "structural": f"{structural}/7"}}
    return {"rescued_transient_count": f"{transient}/7", "rescued_structural_count": f"{structural}/7",
            "rescued": transient + structural, "healthy_change": healthy_change, "healthy_rate": healthy_rate,
            "healthy_acted": healthy_acted, "healthy_runs": 7, "settings": settings}  # fmt: skip


SETUP = {"fault": 200, "steps": 400}


def _plans(met=False):
    plan = {"at_step": 20, "intervals": 4, "background": True, "lag": 5, "probe_size": 128, "predicted": 0.043,
            "met": met}  # fmt: skip
    return {"budget": 0.02, "check_every": 10, "settings": {"vit": {"costs": {"n": 512}, "plan": plan}}}


def test_the_at_default_paragraph_says_fewer_when_the_plans_rescue_fewer(suite):
    at_default = suite["at_default"]
    payload = {"summary": {at_default.OURS: _row(4, 1), at_default.PLANNED: _row(1, 0)}, "setup": SETUP,
               "paired": {at_default.PLANNED: {"both": 1, "default_only": 4, "other_only": 0, "p": 0.125}}}  # fmt: skip
    assert not at_default.holds(payload)
    text = at_default.summary(payload, _plans())
    assert "a check every 4 intervals of 10 steps on 128 probe samples (which restarts the rule's warm-up)" in text
    assert "decisions applied 5 steps after their check; 1 of 1 settings miss the 2 % even so" in text
    assert "So the rule judges its first check at step 460, after the faults begin (position 200; the runs" in text
    assert "the default rule rescued 1/7 (14 %; 3-51) transient and 0/7 (0 %; 0-35) structural faults" in text
    assert "against 4/7 (57 %; 25-84) and 1/7 (14 %; 3-51) when the same rule checks every 10 steps" in text
    assert "(4 runs rescued only there, 0 only at the plans; McNemar p = 0.12)" in text
    assert text.endswith("those figures are `overhead_budget=None`'s** (stage 9 of `benchmarks/DEFAULT_BUDGET.md`).")
    table = at_default.rows_table(payload, _plans())
    assert table[2] == "| vit | 4 x 10 steps, 128, 5; 4.3 % (missed) | 4/7 / 1/7 | 1/7 / 0/7 |"


def test_the_at_default_paragraph_says_the_figures_hold_only_by_the_registered_rule(suite):
    at_default = suite["at_default"]
    paired = {"both": 5, "default_only": 0, "other_only": 0, "p": 1.0}
    payload = {"summary": {at_default.OURS: _row(4, 1), at_default.PLANNED: _row(4, 1)},
               "paired": {at_default.PLANNED: paired}, "setup": SETUP}  # fmt: skip
    assert at_default.holds(payload)
    assert at_default.summary(payload, _plans(met=True)).endswith("hold at the shipped default on these settings.")
    payload["summary"][at_default.PLANNED] = _row(4, 1, healthy_acted=3, healthy_rate=2.0)  # healthy twins pay
    assert not at_default.holds(payload)
    assert at_default.summary(payload, _plans()).endswith("there the rule misses the suite's healthy targets.")
    payload["summary"][at_default.PLANNED] = _row(7, 6)  # significantly more: the figures do not hold either
    payload["paired"][at_default.PLANNED] = {"both": 5, "default_only": 0, "other_only": 8, "p": 0.008}
    assert not at_default.holds(payload)
    assert at_default.summary(payload, _plans()).endswith("there the rule rescues more (the figures understate it).")


@pytest.mark.parametrize("probe_size", [128, None])
def test_the_first_judged_check_is_the_librarys(suite, probe_size):
    """`first_judged` (the pages' step) against the library: a planned detector fed healthy features every step."""
    import numpy as np
    import torch

    from topocallbacks.interventions import LoopActuator
    from topocallbacks.settings import MonitorSettings

    plan = {"at_step": 20, "intervals": 4, "background": True, "lag": 5, "probe_size": probe_size}
    detector = suite["engine"].PlannedTopoDetector({}, 10, plan, 512)
    model = torch.nn.Linear(2, 2)
    actuator = LoopActuator(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    rng = np.random.default_rng(0)
    for clock in range(0, 500):
        features = rng.normal(size=(512, 8)).astype(np.float32)
        detector.on_step(clock, 1.0 + 0.01 * rng.normal(), 1.0)
        observation = suite["engine"].Observation(0.0, 0.0, features)
        assert detector.on_clock(clock, lambda seen=observation: seen, actuator) == []  # healthy: nothing to act on
    records = [r for r in detector.monitor.history if r.decision is not None]
    judged = next(r.step for r in records if not r.decision.reason.startswith("warm-up"))
    warmup = MonitorSettings().rule.warmup
    assert judged == suite["at_default"].first_judged(plan, 10, warmup) == (460 if probe_size else 340)
