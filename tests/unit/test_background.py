"""Checks evaluated in the background worker process, beside a (CPU) training loop."""

import dataclasses
import json
import os
import pickle
import signal
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from tests.cadence import AT_CADENCE
from tests.waiting import HANG_SECONDS, wait_until
from topocallbacks import InputError, TopoMonitor
from topocallbacks._worker import WorkerFailed, WorkerProcess
from topocallbacks.check import CheckRecord
from topocallbacks.probe import FeatureExtractor, Probe

TIMING_FIELDS = ("check_ms", "wait_ms", "probe_ms", "applied_step", "overhead", "step_ms")


def digits_mlp():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10))
    return model, x, y


class Cuts:
    """An actuator that records at which step each decision was carried out."""

    def __init__(self):
        self.done = []

    def scale_learning_rate(self, factor):
        return f"x {factor}"

    def request_stop(self):
        return "stop"

    def checkpoint_location(self, tag):
        return tag

    def save_checkpoint(self, tag):
        pass


def train(monitor, steps=22, stop_at=None):
    """A plain loop calling monitor.on_step every step; returns the records and the interventions."""
    model, x, y = digits_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(0)
    records, done = [], []
    for step in range(steps):
        batch = torch.randint(0, len(x), (64,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for record in monitor.on_step(step, model=model):
            records.append(record)
            intervention = monitor.act(record, Cuts())
            if intervention is not None:
                done.append(intervention)
        if stop_at is not None and step == stop_at:
            break
    return records, done


def without_timing(record):
    """A record's values without what depends on timing (durations, the engine's timed choice of path)."""
    data = record.as_dict()
    for name in (*TIMING_FIELDS, "engine"):
        data.pop(name)
    data["report"].pop("timings_ms")
    return json.dumps(data)


def settings(**extra):
    policy = {"action": "lower_lr", "score": "value", "threshold": 0.0, "warmup": 2, "patience": 1, "cooldown": 0}
    return {"layer": "1", "check_every": 4, "index": "paper", "policy": policy, **extra}


@pytest.fixture(scope="module")
def probe():
    return digits_mlp()[1][:200]


def test_background_checks_give_the_training_loops_records_at_the_announced_step(probe):
    inline = TopoMonitor(probe=probe, background=False, **settings(), **AT_CADENCE)
    inline_records, inline_done = train(inline)
    background = TopoMonitor(probe=probe, background=True, lag=3, **settings(), **AT_CADENCE)
    try:
        records, done = train(background)
        assert background.background
        assert background.runner._worker is not None
        assert background.runner._worker.process.poll() is None  # a worker process, alive
        (last,) = background.finish()
    finally:
        background.close()
    assert [r.step for r in inline_records] == [0, 4, 8, 12, 16, 20]
    assert [r.applied_step for r in inline_records] == [0, 4, 8, 12, 16, 20]
    # The same checks and decisions, each applied 3 steps after its features were taken.
    assert [r.step for r in records] == [0, 4, 8, 12, 16]  # the check at 20 is still pending at step 21
    assert [r.applied_step for r in records] == [3, 7, 11, 15, 19]
    assert [without_timing(r) for r in records] == [without_timing(r) for r in inline_records[:5]]
    assert [d.step for d in done] == [11, 15, 19]  # lower_lr from the first check after the 2-check warm-up
    assert [d.step for d in inline_done] == [8, 12, 16, 20]
    assert all(r.check_ms > 0 and r.probe_ms > 0 for r in records)
    # The pending check reaches the history at the end of training, with no step to act at.
    assert last.step == 20
    assert last.applied_step is None
    assert background.act(last, Cuts()) is None
    assert [r.step for r in background.history if isinstance(r, CheckRecord)] == [0, 4, 8, 12, 16, 20]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a plan moves checks to a worker only where a core is free")
def test_a_plan_that_moves_the_checks_decides_the_same_whether_the_worker_is_still_starting_or_ready(probe):
    # A recorded plan (checks to the worker from the check of step 8, decisions 3 steps later), on a CPU where
    # `background` is automatic: a worker starts beside the loop at the first check. How soon it is ready depends on
    # the machine; a check it cannot take yet is evaluated in the loop. Either way, the same records, applied at the
    # steps the plan says.
    inline = TopoMonitor(probe=probe, background=False, **settings(), **AT_CADENCE)
    inline_records, _ = train(inline)
    planned = TopoMonitor(probe=probe, plan={"at_step": 8, "background": True, "lag": 3}, **settings())
    try:
        records, _ = train(planned)
        assert planned.runner.worker in ("starting", "ready")  # started at the first check, whatever it took
    finally:
        planned.close()
    assert [r.step for r in records] == [0, 4, 8, 12, 16]  # the check at 20 is still pending at step 21
    assert [r.applied_step for r in records] == [0, 4, 8, 15, 19]
    assert [r.plan.at_step for r in records if r.plan is not None] == [8]
    unplanned = [dataclasses.replace(r, plan=None) for r in records]  # the plan is what the inline run lacks
    assert [without_timing(r) for r in unplanned] == [without_timing(r) for r in inline_records[:5]]


def waiting_for_the_worker(thread):
    """Whether ``thread`` is blocked waiting for the worker's next answer (its stack is in ``WorkerProcess._next``)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "_next" and frame.f_code.co_filename.endswith("_worker.py"):
            return True
        frame = frame.f_back
    return False


def resume_once_waited_for(process, thread):
    """Resume a stopped worker once ``thread`` waits for it (an event, polled), or after a hang's time regardless."""

    def resume():
        wait_until(lambda: waiting_for_the_worker(thread))
        os.kill(process.pid, signal.SIGCONT)

    resumer = threading.Thread(target=resume, daemon=True)
    resumer.start()
    return resumer


@pytest.mark.slow
def test_a_late_worker_makes_the_loop_wait_and_the_record_says_so():
    # The worker is made late by construction, not by the machine's speed: it is stopped (SIGSTOP) before a check is
    # submitted and resumed only once the loop waits for it at the applied step. Its evaluation then lies inside the
    # loop's wait, on the one monotonic clock of both processes: the wait is longer than the check, however busy the
    # machine. A worker in time (its answer already there, waited for as an event) is applied at its step too.
    rng = np.random.default_rng(0)
    frames = {step: rng.normal(size=(300, 24)) for step in range(0, 12, 2)}
    monitor = TopoMonitor(
        check_every=2,
        background=True,
        lag=1,
        mode="stream",
        window=600,
        points_per_batch=None,
        check_budget_ms=1e4,
        **AT_CADENCE,
    )
    main = threading.current_thread()
    try:
        waited, resumers = [], []
        for step in range(12):
            worker = monitor.runner._worker
            if step in frames and worker is not None:  # a worker that answered the check before: stop it now
                os.kill(worker.process.pid, signal.SIGSTOP)
                resumers.append(resume_once_waited_for(worker.process, main))
            waited += monitor.on_step(step, features=frames.get(step))  # odd steps: the loop waits, the worker resumes
        for resumer in resumers:
            resumer.join()
        rested = []
        for step in range(12, 18):
            rested += monitor.on_step(step, features=rng.normal(size=(300, 24)) if step % 2 == 0 else None)
            if monitor.runner.pending:  # the answer is in the pipe before the applied step: nothing to wait for
                assert monitor.runner._worker.receive.poll(HANG_SECONDS), "the worker did not answer"
    finally:
        monitor.close()
    # Streaming checks start at step 2 (the window of step 0 would hold a single batch).
    assert [r.step for r in waited + rested] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [r.applied_step - r.step for r in waited + rested] == [1] * 8
    late = waited[1:]  # the check at 2 started the worker; those at 4-10 were stopped and waited for
    assert len(late) == 4
    assert all(r.wait_ms > r.check_ms > 0 for r in late)  # the loop waited for the whole evaluation
    assert all(r.n_points == r.window == 600 for r in waited[1:] + rested)


@pytest.mark.slow
def test_a_worker_slow_to_start_is_waited_for_and_the_timeout_counts_for_its_checks():
    # A busy machine can take longer than `worker_timeout` to start a worker (an interpreter, scipy, numba): that is
    # no stuck check. Here the start is made slower than the timeout by construction (stopped before it could say it
    # was ready, resumed after twice the timeout); a check of the ready worker that does not answer still times out.
    timeout = 3.0
    monitor = TopoMonitor(check_every=1, background=True, lag=0, worker_timeout=timeout, **AT_CADENCE)
    rng = np.random.default_rng(3)
    main = threading.current_thread()

    def resume(process):  # once the loop waits for the stopped worker, after twice its timeout
        wait_until(lambda: waiting_for_the_worker(main))
        time.sleep(2 * timeout)
        os.kill(process.pid, signal.SIGCONT)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            monitor.runner.prestart()
            worker = monitor.runner._worker
            os.kill(worker.process.pid, signal.SIGSTOP)
            assert not worker.ready  # stopped before its first answer (it takes about a second to start)
            resumer = threading.Thread(target=resume, args=(worker.process,))
            resumer.start()
            first = monitor.process(rng.normal(size=(30, 4)), 0)
            resumer.join()
            assert first is not None
            assert first.step == 0
            assert first.wait_ms > timeout * 1e3  # the loop did wait past the timeout for the worker's start
            assert monitor.runner.failures == 0
            assert monitor.runner._worker is worker  # the same worker, not replaced
            os.kill(worker.process.pid, signal.SIGSTOP)  # ready, then stuck in a check
            second = monitor.process(rng.normal(size=(30, 4)), 1)  # evaluated again by a new worker
            assert second is not None
            assert second.step == 1
        finally:
            monitor.close()
    assert monitor.runner.failures == 1
    (message,) = [str(w.message) for w in caught if "background check worker" in str(w.message)]
    assert "did not answer within 3 s" in message


def test_a_worker_that_never_starts_is_reported_as_such(monkeypatch):
    monkeypatch.setattr("topocallbacks._worker.START_TIMEOUT", 1.0)
    worker = WorkerProcess(TopoMonitor(**AT_CADENCE).settings.as_dict(), None, threads=1)
    try:
        os.kill(worker.process.pid, signal.SIGSTOP)  # never resumed: it can never say it is ready
        with pytest.raises(WorkerFailed, match=r"did not start within 1 s"):
            worker.reply(timeout=0.5)
    finally:
        worker.kill()


@pytest.mark.slow
def test_a_pending_check_survives_a_checkpoint_and_is_applied_after_the_resume(probe):
    uninterrupted = TopoMonitor(probe=probe, background=True, lag=3, **settings(), **AT_CADENCE)
    try:
        full, full_done = train(uninterrupted, steps=14)
    finally:
        uninterrupted.close()
    first = TopoMonitor(probe=probe, background=True, lag=3, **settings(), **AT_CADENCE)
    try:
        head, _ = train(first, stop_at=9)  # the check at step 8 is pending (applied at 11)
        assert [p.step for p in first.runner._pending] == [8]
        state = json.loads(json.dumps(first.state_dict()))  # waits for the worker's evaluation
    finally:
        first.close()
    assert state["runner"]["pending"][0]["done"]
    assert state["runner"]["pending"][0]["apply_at"] == 11
    resumed = TopoMonitor(probe=probe, background=True, lag=3, **settings(), **AT_CADENCE)
    try:
        resumed.load_state_dict(state)
        model = digits_mlp()[0]
        tail = []
        for step in range(10, 14):  # no training needed to apply the pending decision
            tail += resumed.on_step(step, model=model)
    finally:
        resumed.close()
    assert [r.step for r in head] == [0, 4]
    assert tail[0].step == 8
    assert tail[0].applied_step == 11
    assert without_timing(tail[0]) == without_timing(full[2])
    assert full_done[0].step == 11


@pytest.mark.slow
def test_a_check_that_fails_in_the_worker_raises_in_the_loop_as_it_would_there():
    # The check itself raised in the worker (bad input): it is run again in the loop, where its own error comes,
    # exactly as without a worker; the worker that ran it is gone.
    monitor = TopoMonitor(check_every=1, background=True, lag=0, **AT_CADENCE)
    rng = np.random.default_rng(1)
    try:
        monitor.process(rng.normal(size=(30, 4)), 0)
        with pytest.raises(InputError, match="`features` must keep dimension 4 between checks, got 5"):
            monitor.process(rng.normal(size=(30, 5)), 1)
        assert monitor.runner._worker is None
    finally:
        monitor.close()


def test_a_monitor_with_a_running_worker_pickles_and_closing_ends_the_process(monkeypatch):
    # The worker gets all the time it needs to exit (a busy machine may take longer than the usual grace to end
    # an interpreter): the test asserts that it exits by itself, not how fast.
    monkeypatch.setattr("topocallbacks._worker._STOP_GRACE", HANG_SECONDS)
    monitor = TopoMonitor(check_every=1, background=True, **AT_CADENCE)
    monitor.process(np.random.default_rng(2).normal(size=(30, 4)), 0)
    process = monitor.runner._worker.process
    twin = pickle.loads(pickle.dumps(monitor))
    assert twin.runner._worker is None
    assert twin.state_dict() == monitor.state_dict()
    monitor.close()  # the loop does not wait for the exit: a reaper thread does
    assert process.wait(timeout=HANG_SECONDS) == 0  # it ends by itself at the end of its requests, not killed


class Headed(torch.nn.Module):
    """A body, the watched layer, then a head that must never run during a probe pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3)
        self.head_calls = 0

    def forward(self, x):
        hidden = self.body(x)
        self.head_calls += 1
        return self.head(hidden)


def test_the_probe_pass_stops_at_the_watched_layer_and_restores_everything():
    model = Headed().train()
    probe = Probe(torch.randn(20, 6))
    features = FeatureExtractor(layer="body", batch_size=8)(model, probe)
    assert model.head_calls == 0  # three batches, none reached the head
    np.testing.assert_allclose(features, model.body(torch.stack(probe.items)).detach().numpy(), rtol=1e-6)
    assert model.training
    assert not model.body._forward_hooks
    FeatureExtractor(layer="body", stop_at_layer=False)(model, probe)
    assert model.head_calls == 1


def test_the_probe_pass_runs_in_the_precision_asked_for():
    model = Headed()
    probe = Probe(torch.randn(10, 6))
    bf16 = FeatureExtractor(layer="body", precision="bf16")(model, probe)
    assert bf16.dtype == np.float32  # pooled and returned in float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.body(torch.stack(probe.items)).float().numpy()
    np.testing.assert_array_equal(bf16, expected)
    full = FeatureExtractor(layer="body")(model, probe)
    assert not np.array_equal(bf16, full)


def test_probe_batches_are_built_once_and_kept():
    model = Headed()
    probe = Probe(torch.randn(10, 6))
    extractor = FeatureExtractor(layer="body", batch_size=4)
    first = extractor(model, probe)
    cached = [id(batch) for batch in next(iter(extractor._cache.values()))]
    second = extractor(model, probe)
    assert [id(batch) for batch in next(iter(extractor._cache.values()))] == cached
    np.testing.assert_array_equal(first, second)
    assert len(extractor._cache) == 1
