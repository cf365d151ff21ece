"""A background worker that dies (kill -9) or stops answering (kill -STOP) never takes a real training run down.

The fit reaches its last step, the checks after the fault still run (in a new worker), and one warning says what
happened. The worker is struck once it has said it is ready, however long it took to start (`worker_timeout`
counts only from then on), so that the tests strike a worker that exists on a busy machine too.
"""

import os
import signal
import warnings

import lightning.pytorch as pl
import pytest
from transformers import Trainer, TrainerCallback

from tests.cadence import AT_CADENCE
from tests.integration.models import TinyCNN, digits, digits_loader
from tests.integration.models import quiet_trainer as trainer
from tests.integration.test_hf import PROBE as FLAT_PROBE
from tests.integration.test_hf import DigitsNet, arguments, digits_dataset
from tests.waiting import HANG_SECONDS, wait_until
from topocallbacks.hf import TopoCollapseTrainerCallback
from topocallbacks.lightning import TopoCollapseCallback

FAULT_STEP = 13  # after the check of step 10 was answered (applied at 12), before the check of step 15
SIGNALS = {"kill -9": signal.SIGKILL, "kill -STOP": signal.SIGSTOP}
# A dead worker is found at once (its pipe closes); a stopped one by the timeout, short enough for a test and still
# some 1,000 times a healthy check of this probe (about 10 ms), so that a busy machine's checks never reach it.
TIMEOUTS = {"kill -9": 60.0, "kill -STOP": 10.0}


def options(how):
    return {"check_every": 5, "background": True, "worker_timeout": TIMEOUTS[how], "policy": {"action": "warn"}}


def strike(monitor, how):
    """Kill or stop the running worker, once it has said it is ready (waited for, however busy the machine)."""
    worker = monitor.runner._worker
    assert worker is not None, "no background worker at the fault step: the checks fell back into the loop"
    assert wait_until(lambda: worker.ready), f"the worker did not say it was ready in {HANG_SECONDS:g} s"
    assert worker.process.poll() is None
    os.kill(worker.process.pid, SIGNALS[how])
    return worker.process


def worker_warnings(caught):
    return [str(w.message) for w in caught if "background check worker" in str(w.message)]


@pytest.mark.slow
@pytest.mark.parametrize("how", list(SIGNALS))
def test_a_lightning_fit_survives_its_worker(tmp_path, how):
    callback = TopoCollapseCallback(probe=digits(64)[0], layer="avgpool", **options(how), **AT_CADENCE)
    struck = []

    class Strike(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == FAULT_STEP:
                struck.append(strike(callback.monitor, how))

    fit = trainer(tmp_path, [callback, Strike()], max_steps=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(TinyCNN(), digits_loader())
    assert fit.global_step == 40
    assert [r.step for r in callback.history if r.kind == "check"] == list(range(0, 41, 5))
    (message,) = worker_warnings(caught)
    assert ("died" if how == "kill -9" else "did not answer within 10 s") in message
    assert "a new worker starts" in message
    assert struck[0].poll() is not None  # the struck worker was killed and reaped
    assert callback.monitor.runner.failures == 1


@pytest.mark.slow
@pytest.mark.parametrize("how", list(SIGNALS))
def test_a_trainer_run_survives_its_worker(tmp_path, how):
    callback = TopoCollapseTrainerCallback(probe=FLAT_PROBE, layer="encoder", **options(how), **AT_CADENCE)

    class Strike(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == FAULT_STEP:
                strike(callback.monitor, how)

    run = Trainer(
        model=DigitsNet(),
        args=arguments(tmp_path, max_steps=40),
        train_dataset=digits_dataset(),
        callbacks=[callback, Strike()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train()
    assert run.state.global_step == 40
    assert [r.step for r in callback.history if r.kind == "check"] == list(range(0, 41, 5))
    (message,) = worker_warnings(caught)
    assert ("died" if how == "kill -9" else "did not answer within 10 s") in message


@pytest.mark.slow
def test_a_second_failure_moves_the_checks_into_the_loop(tmp_path):
    callback = TopoCollapseCallback(probe=digits(64)[0], layer="avgpool", **options("kill -9"), **AT_CADENCE)

    class StrikeTwice(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in (FAULT_STEP, FAULT_STEP + 10):
                strike(callback.monitor, "kill -9")

    fit = trainer(tmp_path, [callback, StrikeTwice()], max_steps=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(TinyCNN(), digits_loader())
    assert fit.global_step == 40
    assert [r.step for r in callback.history if r.kind == "check"] == list(range(0, 41, 5))
    first, second = worker_warnings(caught)
    assert "a new worker starts" in first
    assert "the checks run in the training loop from now on" in second
    assert callback.monitor.runner.in_loop
    assert callback.monitor.runner._worker is None
