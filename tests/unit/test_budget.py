"""The overhead budget (topocallbacks.budget): the footprint model, the planner's order, the meter's accounting,
and a monitor that measures every interval and, with a budget, follows the plan."""

import dataclasses
import itertools
import os
import warnings

import numpy as np
import pytest
import torch

from tests.cadence import AT_CADENCE
from tests.unit.test_background import without_timing
from tests.waiting import wait_until
from topocallbacks import TopoMonitor
from topocallbacks.budget import (
    FLOOR_INTERVALS,
    LAG_MARGIN,
    MIN_PROBE,
    Budget,
    Costs,
    Footprint,
    Meter,
    plan,
    replan,
)  # fmt: skip
from topocallbacks.check import CheckRecord, Decision, Plan
from topocallbacks.schedule import Schedule
from topocallbacks.settings import MonitorSettings, ScheduleSettings
from topocallbacks.summary import cost_line


def costs(**changes):
    base = {"step_ms": 1.0, "probe_ms": 2.0, "eval_ms": 40.0, "other_ms": 0.5, "n": 512}
    return Costs(**{**base, **changes})


def test_footprint_predicts_the_share_from_its_formula():
    footprint = Footprint(costs(), check_every=10)
    # In the loop: (probe 2 + other 0.5 + eval 40) / (1 interval x 10 steps x 1 ms)
    assert footprint.share(512, background=False, intervals=1) == pytest.approx(42.5 / 10)
    assert footprint.share(512, background=False, intervals=4) == pytest.approx(42.5 / 40)
    # Beside the loop, the loop waits only for what the evaluation takes beyond the lag (1 step by default here).
    assert footprint.share(512, background=True, intervals=1) == pytest.approx((2.5 + 39) / 10)
    assert footprint.share(512, background=True, intervals=4) == pytest.approx((2.5 + 39) / 40)
    lagged = Footprint(costs(), check_every=10, lag=5)  # the decision applied 5 steps (5 ms) later
    assert lagged.share(512, background=True, intervals=1) == pytest.approx((2.5 + 35) / 10)
    assert Footprint(costs(step_ms=10.0), check_every=10, lag=5).share(512, True, 1) == pytest.approx(2.5 / 100)
    # Smaller probes: the pass linear, the evaluation as n^1.5.
    assert footprint.probe_ms(256) == pytest.approx(1.0)
    assert footprint.eval_ms(128) == pytest.approx(40.0 / 8)


def test_the_planner_moves_first_then_slows_down_then_shrinks_the_probe():
    footprint = Footprint(costs(eval_ms=40.0, probe_ms=0.1, other_ms=0.1, step_ms=10.0), check_every=10, lag=5)
    # The evaluation alone is 40 % of an interval in the loop; beside the loop, in the 5 steps' 50 ms of lag, it is
    # hidden: moving is enough.
    moved = plan(footprint, 0.02, can_move=True, can_shrink=True, current=Plan())
    assert (moved.background, moved.intervals, moved.probe_size, moved.met) == (True, 1, None, True)
    # Not allowed to move: the cadence goes down as far as needed (40.2 / (k x 100) <= 0.2 from k = 3 on).
    slower = plan(footprint, 0.15, can_move=False, can_shrink=True, current=Plan())
    assert (slower.background, slower.intervals, slower.probe_size, slower.met) == (False, 3, None, True)
    # The floor is not enough at 512 points: the probe shrinks, and the cadence is chosen again at each size.
    shrunk = plan(footprint, 0.05, can_move=False, can_shrink=True, current=Plan())
    assert shrunk.met
    assert shrunk.probe_size == 256
    assert shrunk.intervals == 3  # 14.1 ms / 300 ms = 4.7 %
    assert shrunk.predicted == pytest.approx(footprint.share(256, False, 3))


def test_in_the_background_the_lag_grows_until_it_hides_the_evaluation_and_never_past_the_next_check():
    # 1 ms steps, a 40 ms evaluation, decisions 5 steps after their check: the loop would wait 35 ms a check.
    footprint = Footprint(costs(step_ms=1.0, eval_ms=40.0, probe_ms=0.1, other_ms=0.1), check_every=10, lag=5)
    assert footprint.hiding_lag(512, intervals=1) == 10  # 1.5 x 40 = 60 steps wanted, the next check is 10 away
    assert footprint.hiding_lag(512, intervals=4) == 40
    lagged = plan(footprint, 0.05, can_move=True, can_shrink=False, current=Plan(), can_lag=True)
    # At 1-3 intervals the lag cannot reach 60 steps and the loop still waits (e.g. 30 ms of 10); at 4 it hides all.
    assert (lagged.background, lagged.intervals, lagged.lag, lagged.met) == (True, FLOOR_INTERVALS, 40, True)
    assert lagged.predicted == pytest.approx(0.2 / 40)
    fixed = plan(footprint, 0.05, can_move=True, can_shrink=False, current=Plan())  # an explicit `lag` is kept
    assert (fixed.intervals, fixed.lag, fixed.met) == (FLOOR_INTERVALS, None, False)
    assert fixed.predicted == pytest.approx((0.2 + 35.0) / 40)
    # Slower steps: the configured cadence stays and the lag covers the evaluation with its margin.
    slow = plan(Footprint(costs(step_ms=4.0, eval_ms=40.0), 10, lag=5), 0.2, can_move=True, can_shrink=False,
                current=Plan(), can_lag=True)  # fmt: skip
    assert (slow.intervals, slow.lag) == (1, 10)  # 1.5 x 40 / 4 = 15 steps wanted, 10 to the next check
    assert (Footprint(costs(step_ms=8.0), 10, lag=5).hiding_lag(512, 1), LAG_MARGIN) == (8, 1.5)  # ceil(7.5)
    # In the loop there is no lag to plan.
    loop = plan(footprint, 0.05, can_move=False, can_shrink=False, current=Plan(), can_lag=True)
    assert (loop.background, loop.lag) == (False, None)


def test_the_schedule_applies_a_background_decision_after_the_plans_lag():
    schedule = Schedule(ScheduleSettings(check_every=10, background=True))
    assert schedule.apply_at(20) == 25  # the settings' lag: half the interval
    schedule.follow(Plan(background=True, lag=7))
    assert schedule.apply_at(20) == 27
    assert schedule.apply_at(20, lag=0) == 20  # an explicit check is applied at once
    schedule.follow(Plan(background=False, lag=7))
    assert schedule.apply_at(20) == 20  # in the loop: at once


def test_the_planner_never_goes_past_the_floor_and_says_when_the_budget_is_missed():
    footprint = Footprint(costs(step_ms=0.01), check_every=10)  # a 10 us step: nothing can meet 2 %
    chosen = plan(footprint, 0.02, can_move=False, can_shrink=True, current=Plan())
    assert not chosen.met
    assert chosen.intervals == FLOOR_INTERVALS
    assert chosen.probe_size == MIN_PROBE
    chosen, why = replan(costs(step_ms=0.01), 10, 0.02, Plan(), can_move=False, can_shrink=False)
    assert not chosen.met
    assert chosen.intervals == FLOOR_INTERVALS
    assert chosen.probe_size is None
    assert "2.0%" in why
    assert f"every {FLOOR_INTERVALS} x check_every" in why
    assert "`background` is set" in why
    assert replan(costs(step_ms=1e3), 10, 0.02, Plan(), can_move=False, can_shrink=False) == (
        Plan(1, False, None, pytest.approx((2.0 + 0.5 + 40.0) / 1e4), True),
        None,
    )


def test_a_plan_never_grows_the_probe_back():
    cheap = Footprint(costs(step_ms=1e4), check_every=10)  # anything meets the budget now
    chosen = plan(cheap, 0.02, can_move=False, can_shrink=True, current=Plan(probe_size=256))
    assert chosen.probe_size == 256
    assert chosen.intervals == 1


def test_the_meter_counts_nested_calls_once_and_the_rest_of_the_interval_as_training():
    now = [0.0]
    meter = Meter(clock=lambda: now[0])
    assert meter.interval(0) == (None, None, 0.0)  # the first check only starts the clock
    for _ in range(10):  # 10 steps: 9 ms of training and 1 ms of monitor (0.5 of it nested) each
        now[0] += 0.009
        with meter.own():
            now[0] += 0.0005
            with meter.own():
                now[0] += 0.0005
    share, step_ms, own_ms = meter.interval(10)
    assert share == pytest.approx(10 / 90)
    assert step_ms == pytest.approx(9.0)
    assert own_ms == pytest.approx(10.0)


def test_a_check_inside_the_monitors_own_call_splits_that_call_between_the_intervals():
    now = [0.0]
    meter = Meter(clock=lambda: now[0])
    meter.interval(0)
    now[0] += 0.010  # 10 ms of training
    with meter.own():
        now[0] += 0.002
        share, _, own_ms = meter.interval(1)  # the check happens inside the call
        assert own_ms == pytest.approx(2.0)
        assert share == pytest.approx(0.2)
        now[0] += 0.003
    now[0] += 0.010
    share, _, own_ms = meter.interval(2)
    assert own_ms == pytest.approx(3.0)
    assert share == pytest.approx(0.3)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


def fixed_costs(monkeypatch, step_ms, eval_ms, probe_ms=0.5, other_ms=0.3):
    """Let the budget plan on these costs (at 256 probe points; the pass linear, the evaluation as n^1.5), not on
    the wall-clock ones: a plan then follows from the costs alone, however busy the machine is."""

    def measured(record, step_ms_, own_ms):
        scale = record.n_points / 256
        return Costs(step_ms=step_ms, probe_ms=probe_ms * scale, eval_ms=eval_ms * scale**1.5, other_ms=other_ms,
                     n=record.n_points)  # fmt: skip

    monkeypatch.setattr("topocallbacks.budget.measured_costs", measured)


def run(budget, steps=61, check_every=5, probe_size=256):
    torch.manual_seed(0)
    model = Net()
    probe = torch.randn(probe_size, 16)
    monitor = TopoMonitor(probe=probe, layer="body", check_every=check_every, background=False,
                          overhead_budget=budget, policy={"action": "warn"})  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            monitor.on_step(step, model=model, loss=1.0)
    monitor.close()
    checks = [r for r in monitor.history if r.kind == "check"]
    budget_warnings = [w for w in caught if "overhead budget" in str(w.message)]
    return monitor, checks, budget_warnings


def test_every_check_after_the_first_reports_its_intervals_overhead_whatever_the_budget():
    _, checks, budget_warnings = run(None, steps=21)
    assert [r.step for r in checks] == [0, 5, 10, 15, 20]  # no budget: the cadence is the configured one
    assert checks[0].overhead is None
    assert checks[0].step_ms is None
    assert all(r.overhead is not None and r.overhead > 0 and r.step_ms >= 0 for r in checks[1:])
    assert all(r.plan is None for r in checks)
    assert not budget_warnings


def test_a_check_that_costs_far_more_than_the_budget_slows_the_cadence_to_the_floor_and_warns_once(monkeypatch):
    # Steps of 10 us against checks of 40 ms: no plan can meet 2 % (warned at the second plan that misses).
    fixed_costs(monkeypatch, step_ms=0.01, eval_ms=40.0)
    monitor, checks, budget_warnings = run(0.02, steps=121)
    assert len(budget_warnings) == 1
    assert "cannot be met" in str(budget_warnings[0].message)
    planned = [r.plan for r in checks if r.plan is not None]
    assert planned
    assert planned[-1].intervals == FLOOR_INTERVALS
    assert not planned[-1].met
    gaps = [b.step - a.step for a, b in itertools.pairwise(checks)]
    assert gaps[-1] == FLOOR_INTERVALS * 5  # the floor: never fewer checks than one every 4 intervals
    assert max(gaps) == FLOOR_INTERVALS * 5
    assert monitor.schedule.plan.intervals == FLOOR_INTERVALS


def test_a_cheap_check_keeps_the_configured_cadence(monkeypatch):
    # 50 ms steps: an interval of 500 ms against a check of 20 ms on a 128-point probe.
    fixed_costs(monkeypatch, step_ms=50.0, eval_ms=20.0 * 2**1.5)
    monitor, checks, budget_warnings = run(1.0, steps=51, check_every=10, probe_size=128)
    assert [r.step for r in checks] == [0, 10, 20, 30, 40, 50]
    assert not budget_warnings
    assert monitor.schedule.plan.intervals == 1
    # One plan, made at the third check on the two intervals before it and kept: the configured cadence, in the loop.
    plans = [r.plan for r in checks if r.plan is not None]
    assert [(p.at_step, p.intervals, p.background, p.probe_size, p.met) for p in plans] == [(20, 1, False, None, True)]
    assert monitor.schedule.plan == plans[0]


def test_the_budget_must_be_a_positive_share():
    with pytest.raises(ValueError, match="overhead_budget"):
        TopoMonitor(probe=torch.randn(8, 16), layer="body", overhead_budget=-0.1)


def test_a_background_monitor_takes_the_planned_lag_and_probe_size_in_the_same_worker(monkeypatch):
    # Steps of 1 ms against a worker's evaluation of 30 ms (the costs planned on are fixed): decisions 2 steps after
    # their check (the lag of a 5-step interval) would make the loop wait at each; the budget lengthens the lag up to
    # the next check. 1 % cannot be met at 256 points: the probe is halved too, and the worker that runs starts the
    # new pipeline, no new process.
    fixed_costs(monkeypatch, step_ms=1.0, eval_ms=30.0, probe_ms=0.7)
    torch.manual_seed(0)
    model, probe = Net(), torch.randn(256, 16)
    monitor = TopoMonitor(probe=probe, layer="body", check_every=5, background=True, overhead_budget=0.01,
                          policy={"action": "warn"})  # fmt: skip
    workers = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(121):
            monitor.on_step(step, model=model, loss=1.0)
            if monitor.runner._worker is not None:
                workers.add(monitor.runner._worker.process.pid)
        monitor.finish()
    monitor.close()
    assert len(workers) == 1
    checks = [r for r in monitor.history if r.kind == "check"]
    resized = [r for r in checks if r.plan is not None and r.plan.probe_size is not None]
    assert resized[0].plan.probe_size == MIN_PROBE
    later = [r for r in checks if r.step > resized[0].applied_step]  # submitted after the new size took effect
    assert later
    assert all(r.n_points == MIN_PROBE for r in later)
    lags = [r.plan.lag for r in checks if r.plan is not None]
    assert lags
    assert lags[0] > monitor.settings.schedule.apply_lag  # longer than the configured lag, to hide the evaluation
    configured = monitor.settings.schedule.apply_lag
    # A plan is followed from the step its record is applied at, for the checks submitted after it (a check of that
    # very step was submitted before it).
    plans = [(r.applied_step, r.plan) for r in checks if r.plan is not None]
    assert all(p.lag <= p.intervals * 5 for _, p in plans)  # never past the next check
    applied = [r for r in checks if r.applied_step is not None]
    assert len(applied) >= 6
    for record in applied:
        in_force = [p for at, p in plans if at < record.step]
        lag = in_force[-1].lag if in_force and in_force[-1].lag is not None else configured
        assert record.applied_step - record.step == lag


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the budget moves checks to a worker only where a core is free")
def test_a_budget_that_may_move_the_checks_starts_the_worker_at_the_first_check_and_moves_them_to_it(monkeypatch):
    # On a CPU with a free core, `background` automatic: the checks start in the loop and the budget moves them to
    # the worker, which starts beside the loop at the first check (it takes a second, or many on a busy machine: the
    # test waits for it to say it is ready). 40 ms checks every 2 steps of 1 ms miss 50 % in the loop at any
    # cadence down to the floor, and meet it beside the loop.
    fixed_costs(monkeypatch, step_ms=1.0, eval_ms=40.0)
    torch.manual_seed(0)
    model, probe = Net(), torch.randn(256, 16)
    monitor = TopoMonitor(probe=probe, layer="body", check_every=2, overhead_budget=0.5, policy={"action": "warn"})
    assert monitor.budget.may_move
    pids, status_at_move = set(), None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(200):
            records = monitor.on_step(step, model=model, loss=1.0)
            if step == 0:  # the first check ran in the loop, and a worker started beside it
                assert not monitor.schedule.background
                assert [r.step for r in records] == [0]
                assert wait_until(lambda: monitor.runner.worker == "ready"), "the worker did not start"
            pids.add(monitor.runner._worker.process.pid)
            if any(r.plan is not None and r.plan.background for r in records):
                status_at_move = monitor.runner.worker
                break
        monitor.finish()
    monitor.close()
    assert status_at_move == "ready"
    # The model trains on the CPU: the worker takes at most the cores the training's threads leave (2 configured).
    assert monitor.runner.threads == min(2, max(1, (os.cpu_count() or 1) - torch.get_num_threads()))
    assert len(pids) == 1  # the worker that started at the first check is the one the checks moved to
    assert monitor.schedule.background


def test_checks_the_caller_runs_itself_start_no_worker_beside_the_loop():
    # `process` (and `check_now`) checks are measured, never planned: the budget could never move them, so no worker
    # starts for them, whatever the budget (it is on by default).
    rng = np.random.default_rng(0)
    monitor = TopoMonitor(overhead_budget=0.05, policy={"action": "warn"})
    assert monitor.budget.may_move == ((os.cpu_count() or 1) > torch.get_num_threads())
    try:
        for step in range(3):
            monitor.process(rng.normal(size=(64, 8)), step)
        assert monitor.runner._worker is None
    finally:
        monitor.close()


def record_at(step, check_ms):
    decision = Decision(action="none", reason="", step=step)
    return CheckRecord(step=step, status="ok", index="diagram_drift", index_value=0.0, n_points=512,
                       decision=decision, check_ms=check_ms, probe_ms=0.1)  # fmt: skip


def plans_of(worker, intervals=6, on_accelerator=False):
    """What a budget of 2 % makes of checks of 40 ms in the loop every ~10 ms of training, the worker as given."""
    budget = Budget(MonitorSettings.from_dict({"overhead_budget": 0.02, "check_every": 10}))
    now = [0.0]
    budget.meter = Meter(clock=lambda: now[0])  # the interval's time is the test's, not the machine's
    schedule = Schedule(budget.settings.schedule)
    schedule.settle_background(torch.empty(1, device="meta" if on_accelerator else "cpu"))
    made = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(intervals + 1):
            now[0] += 0.01  # the interval's training: 10 steps of 1 ms
            budget.scheduled(10 * k, True)
            plan = budget.measure(record_at(10 * k, 40.0), schedule, checks=k, worker=worker).plan
            if plan is not None:
                schedule.follow(plan)
                made.append(plan)
    return schedule.plan, made, [str(w.message) for w in caught if "overhead budget" in str(w.message)]


def test_the_budget_plans_once_moves_the_checks_to_a_started_worker_and_warns_once_when_it_misses():
    # In the loop a 40 ms check every ~10 ms of training misses 2 % at any cadence up to the floor, at any size.
    for worker in ("ready", "starting"):  # a worker still starting is planned for: the loop waits for it once
        final, made, warned = plans_of(worker)
        assert len(made) == 1  # one plan, at the third check, kept for the rest of the run
        assert made[0].at_step == 20
        assert (final.background, final.met, warned) == (True, True, [])  # the lag hides the evaluation
    final, made, warned = plans_of("failed")
    assert len(made) == 1
    assert (final.background, final.intervals, final.probe_size, final.met) == (
        False,
        FLOOR_INTERVALS,
        MIN_PROBE,
        False,
    )
    assert len(warned) == 1  # at the plan, which missed
    assert "the background worker did not start" in warned[0]
    # Checks already in the background (`background` automatic, a model on an accelerator) stay there while their
    # worker restarts (after a rollback) or starts.
    for worker in ("failed", "starting"):
        final, made, _ = plans_of(worker, on_accelerator=True)
        assert len(made) == 1
        assert final.background


def test_a_given_plan_is_taken_at_its_step_without_measuring_and_the_checks_are_those_of_the_planned_run(monkeypatch):
    # A run planned on fixed costs, then the same run told its plan: the same check steps, sizes and applied steps,
    # whatever the second run measures (it has no budget at all).
    fixed_costs(monkeypatch, step_ms=0.01, eval_ms=40.0)
    _, planned_checks, _ = run(0.02, steps=121)
    (made,) = [r.plan for r in planned_checks if r.plan is not None]
    assert made.intervals > 1  # the cadence moved: the rerun must follow it to match
    monkeypatch.undo()
    torch.manual_seed(0)
    model, probe = Net(), torch.randn(256, 16)
    rerun = TopoMonitor(probe=probe, layer="body", check_every=5, background=False, plan=made.settings,
                        policy={"action": "warn"}, **AT_CADENCE)  # fmt: skip
    assert rerun.settings.schedule.overhead_budget is None
    for step in range(121):
        rerun.on_step(step, model=model, loss=1.0)
    rerun.close()
    again = [r for r in rerun.history if r.kind == "check"]
    assert [(r.step, r.n_points, r.applied_step) for r in again] == [
        (r.step, r.n_points, r.applied_step) for r in planned_checks
    ]
    assert [r.plan.settings for r in again if r.plan is not None] == [made.settings]


def test_checks_evaluated_in_the_loop_beside_a_started_worker_reach_it_before_it_evaluates_the_next():
    rng = np.random.default_rng(0)
    clouds = [rng.normal(size=(120, 8)) + 0.05 * i for i in range(3)]
    inline = TopoMonitor(check_every=1, background=False, policy={"action": "warn"}, **AT_CADENCE)
    expected = [inline.process(cloud, step, loss=1.0) for step, cloud in enumerate(clouds)]
    monitor = TopoMonitor(check_every=1, background=False, policy={"action": "warn"}, **AT_CADENCE)
    try:
        monitor.runner.prestart()  # a worker starts from the empty pipeline
        first = [monitor.process(cloud, step, loss=1.0) for step, cloud in enumerate(clouds[:2])]  # in the loop
        monitor.schedule.follow(Plan(background=True))
        last = monitor.process(clouds[2], 2, loss=1.0)  # evaluated by the worker, which must have the loop's state
        assert monitor.runner.worker == "ready"
    finally:
        monitor.close()
    assert [without_timing(r) for r in [*first, last]] == [without_timing(r) for r in expected]


def checks_with(plan, shares):
    """Check records of intervals costing ``shares`` of 100 ms each, ``plan`` made at the second."""
    records = [record_at(0, 40.0)]
    for k, share in enumerate(shares, start=1):
        record = dataclasses.replace(record_at(10 * k, 40.0), overhead=share, step_ms=10.0)
        records.append(dataclasses.replace(record, plan=plan) if k == 1 else record)
    return records


def test_the_summary_gives_the_plan_the_rerun_and_says_when_the_budget_was_not_kept():
    floor = Plan(intervals=FLOOR_INTERVALS, background=True, probe_size=MIN_PROBE, predicted=0.31, met=False, lag=9,
                 at_step=10)  # fmt: skip
    line = cost_line(checks_with(floor, [0.4, 0.3, 0.3]), 0.05)
    rerun = {"at_step": 10, "intervals": FLOOR_INTERVALS, "background": True, "lag": 9, "probe_size": MIN_PROBE}
    assert line.endswith(
        f"plan at step 10: a check every {FLOOR_INTERVALS} x check_every, in the background worker with decisions 9 "
        f"steps later, on {MIN_PROBE} probe samples; rerun with plan={rerun}\n"
        "  budget not kept: even this plan was predicted to cost 31.0 %"
    )
    assert MonitorSettings().merged({"plan": floor.settings}).schedule.plan == rerun  # the rerun is a valid option
    kept_in_plan = Plan(intervals=2, background=False, predicted=0.04, met=True, at_step=10)
    line = cost_line(checks_with(kept_in_plan, [0.3, 0.08, 0.07]), 0.05)  # planned within, measured above it
    assert line.endswith("in the training loop, on the whole probe; rerun with plan={'at_step': 10, 'intervals': 2, "
                         "'background': False, 'lag': None, 'probe_size': None}\n  budget not kept: the plan was "
                         "predicted to cost 4.0 %; the median interval measured more")  # fmt: skip
    assert "budget not kept" not in cost_line(checks_with(kept_in_plan, [0.3, 0.04, 0.03]), 0.05)
    assert "budget not kept" not in cost_line(checks_with(floor, [0.4, 0.3, 0.3]), None)  # no budget, none to keep


def test_a_plan_must_be_a_valid_mapping_with_its_step():
    with pytest.raises(ValueError, match=r"`plan` has unknown key 'interval'; did you mean `intervals`"):
        MonitorSettings().merged({"plan": {"at_step": 3, "interval": 2}})
    with pytest.raises(ValueError, match="`plan` needs `at_step`"):
        MonitorSettings().merged({"plan": {"intervals": 2}})
    with pytest.raises(ValueError, match=r"`plan.intervals` must be an integer >= 1, got 0"):
        MonitorSettings().merged({"plan": {"at_step": 3, "intervals": 0}})
    with pytest.raises(ValueError, match="`plan` must be a mapping"):
        MonitorSettings().merged({"plan": "every 2"})
