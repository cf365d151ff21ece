"""The monitor's parts, one by one: each saves and loads its own state, pickles, and the monitor's is their sum."""

import json
import pickle

import numpy as np
import pytest
import torch

from tests.cadence import AT_CADENCE
from topocallbacks import InputError, TopoMonitor
from topocallbacks.check import Plan
from topocallbacks.intake import Intake, OptimizerStep
from topocallbacks.interventions import LoopActuator
from topocallbacks.pipeline import CheckPipeline, CheckRequest
from topocallbacks.probing import ProbePass
from topocallbacks.rescue import Rescuer
from topocallbacks.runner import Runner
from topocallbacks.schedule import Schedule
from topocallbacks.settings import MonitorSettings, ScheduleSettings


def round_trip(part, fresh):
    state = json.loads(json.dumps(part.state_dict()))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == part.state_dict()
    return state


def test_the_schedule_round_trips_and_pickles():
    schedule = Schedule(ScheduleSettings(check_every=5))
    schedule.checked(10)
    schedule.follow(Plan(intervals=2, background=False, probe_size=256, predicted=0.01, met=True, at_step=10))
    schedule.warned_ = True
    fresh = Schedule(ScheduleSettings(check_every=5))
    state = round_trip(schedule, fresh)
    assert state == {
        "version": 2,
        "last_checked_step": 10,
        "plan": {"intervals": 2, "background": False, "probe_size": 256, "predicted": 0.01, "met": True,
                 "lag": None, "at_step": 10, "background_setting": False},
        "warned": True,
    }  # fmt: skip
    assert fresh.plan == schedule.plan
    assert fresh.warned_
    assert not fresh.background
    assert not pickle.loads(pickle.dumps(schedule)).due(10)
    assert not schedule.due(15)
    assert schedule.due(20)  # the plan: a check every 2 intervals
    assert schedule.apply_at(20) == 20  # in the loop: at once
    older = {**state, "plan": {k: v for k, v in state["plan"].items() if k not in ("lag", "at_step")}}  # saved
    resumed = Schedule(ScheduleSettings(check_every=5))  # before plans had a lag, or the step that made them
    resumed.load_state_dict(older)
    assert resumed.plan.at_step is None  # such a plan does not stop the budget from planning once
    with pytest.raises(ValueError, match="version"):
        Schedule(ScheduleSettings()).load_state_dict({"version": 1, "last_checked_step": 10})


def test_the_runner_round_trips_its_pending_checks():
    settings = MonitorSettings().merged({"check_every": 1, "lag": 3})
    pipeline = CheckPipeline(settings)
    runner = Runner(settings.as_dict(), pipeline)
    cloud = np.random.default_rng(0).normal(size=(40, 4))
    runner.submit(CheckRequest("evaluate", 7, cloud), apply_at=10, background=False)
    assert runner.collect(9) == []  # not yet: its step comes at 10
    fresh = Runner(settings.as_dict(), CheckPipeline(settings))
    fresh.pipeline.load_state_dict(pipeline.state_dict())
    state = round_trip(runner, fresh)
    assert [(p["step"], p["apply_at"], p["done"]) for p in state["pending"]] == [(7, 10, True)]
    (record,) = fresh.collect(10)
    assert (record.step, record.applied_step) == (7, 10)
    assert pickle.loads(pickle.dumps(runner)).pending == 1


def test_the_rescuer_round_trips_its_counters_and_not_its_snapshots():
    settings = MonitorSettings()
    rescuer = Rescuer(settings)
    rescuer.lr_factor_, rescuer.last_rollback_step_, rescuer.rollback_cut_ = 0.25, 40, 0.5
    rescuer.pending_skip_, rescuer.recent_losses_ = True, [2.0, 3.5]
    model = torch.nn.Linear(2, 2)
    actuator = LoopActuator(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    rescuer.healthy.keep(
        actuator, 30, None, loss=None, lr_factor=rescuer.lr_factor_, rollback_cut=rescuer.rollback_cut_
    )
    assert [s.step for s in rescuer.healthy.store.snapshots] == [30]
    state = round_trip(rescuer, Rescuer(settings))
    assert state == {"version": 2, "lr_factor": 0.25, "last_rollback_step": 40, "rollback_cut": 0.5,
                     "pending_skip": True, "recent_losses": [2.0, 3.5]}  # fmt: skip
    twin = pickle.loads(pickle.dumps(rescuer))
    assert twin.lr_factor_ == 0.25
    assert twin.healthy.store.snapshots == []  # snapshots stay in their process


def test_the_probe_pass_keeps_the_probe_spec_and_refuses_another_probe():
    settings = MonitorSettings().merged({"layer": "0"})
    probe = torch.arange(24.0).reshape(6, 4)
    probing = ProbePass(settings, probe)
    other = ProbePass(settings)
    other.spec_state = json.loads(json.dumps(probing.spec_state))
    other.set_probe(probe)  # the same contents: accepted
    assert other.spec_state == probing.spec_state
    strict = ProbePass(settings)
    strict.spec_state = probing.spec_state
    with pytest.raises(InputError, match="probe"):
        strict.set_probe(probe + 1)  # other contents than the saved probe's
    assert pickle.loads(pickle.dumps(probing)).probe.spec == probing.probe.spec


def test_a_probe_the_budget_made_smaller_is_cut_to_the_saved_size_on_either_loading_path():
    settings = MonitorSettings().merged({"layer": "0"})
    probe = torch.arange(400.0).reshape(100, 4)
    shrunk = ProbePass(settings, probe)
    shrunk.resize(40)  # the overhead budget's smaller probe: a seeded subset of the same source
    saved = json.loads(json.dumps(shrunk.spec_state))
    assert saved["n_samples"] == 40
    probe_first = ProbePass(settings, probe)  # the probe is given, then the state is loaded
    probe_first.spec_state = saved
    state_first = ProbePass(settings)  # the state is loaded, then the probe is given
    state_first.spec_state = saved
    state_first.set_probe(probe)
    for loaded in (probe_first, state_first):
        assert loaded.size == 40
        assert loaded.probe.spec == shrunk.probe.spec


def test_the_intake_averages_each_check_once_and_says_when_a_watched_channel_is_never_fed():
    intake = Intake(("index", "loss"), 2)
    intake.record(loss=torch.tensor(1.0), grad_norm=2.0)
    intake.record(loss=3.0)
    assert intake.take_dynamics() == {"loss": 2.0, "grad_norm": 2.0}
    assert intake.take_dynamics() is None  # taken once; a check without the loss, said from the second on
    intake.record(grad_norm=1.0)
    with pytest.warns(RuntimeWarning, match=r"the rule watches \['index', 'loss'\].*no loss was passed"):
        intake.take_dynamics()
    step = OptimizerStep()
    step.add_loss(torch.tensor([1.0, 3.0]))  # a per-sample loss: its mean
    step.add_grad_norm(1.0)
    step.skip()
    assert step.take(average=False) == (torch.tensor(2.0), None)  # a skipped step has no norm


def test_the_monitors_state_is_the_sum_of_its_parts():
    monitor = TopoMonitor(check_every=1, policy={"channels": ["index"], "require": 1}, **AT_CADENCE)
    rng = np.random.default_rng(1)
    for step in range(3):
        monitor.process(rng.normal(size=(30, 5)), step)
    state = monitor.state_dict()
    assert set(state) == {"version", "probe_spec", "pipeline", "history", "schedule", "rescuer", "runner"}
    assert state["schedule"] == monitor.schedule.state_dict()
    assert state["rescuer"] == monitor.rescuer.state_dict()
    assert state["runner"] == monitor.runner.state_dict()
    assert state["pipeline"] == monitor.pipeline.state_dict()
    twin = TopoMonitor(check_every=1, policy={"channels": ["index"], "require": 1}, **AT_CADENCE)
    twin.load_state_dict(json.loads(json.dumps(state)))
    assert twin.state_dict() == state
    old = {**state, "version": 6}
    with pytest.raises(InputError, match="version"):
        TopoMonitor(**AT_CADENCE).load_state_dict(old)


def test_a_check_request_evaluates_the_probe_or_a_window_and_refuses_what_it_cannot():
    rng = np.random.default_rng(0)
    probe = CheckRequest("evaluate", 5, rng.normal(size=(40, 4)), {"loss": 1.0, "grad_norm": None})
    record = probe.run(CheckPipeline(MonitorSettings())).record
    assert (record.step, record.loss) == (5, 1.0)
    stream = CheckPipeline(MonitorSettings().merged({"mode": "stream"}))
    window = CheckRequest("window", 9, [(8, rng.normal(size=(32, 4))), (9, rng.normal(size=(32, 4)))])
    assert window.run(stream).record.n_points == 64
    with pytest.raises(InputError, match="'evaluate' or 'window', got 'push'"):
        CheckRequest("push", 1, None).run(stream)
