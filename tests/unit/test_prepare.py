"""A monitor pays the checks' one-off costs (numba's kernels, scipy's assignment solver) in a background thread from
the moment it is built, once per process, and a failure there never reaches the training loop (issue 37)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from topocallbacks import check

SCRIPT = """
import json, sys
from topocallbacks import TopoMonitor, check
from topocallbacks.functional import _jit
before = {"numba": "numba" in sys.modules, "scipy.optimize": "scipy.optimize" in sys.modules}
monitor = TopoMonitor(check_every=1, overhead_budget=None)
thread = check.prepare_in_background()
thread.join(120)
import numpy as np
record = monitor.process(np.random.default_rng(0).normal(size=(64, 8)), step=0, loss=1.0)
print(json.dumps({"before": before, "alive": thread.is_alive(), "same": check.prepare_in_background() is thread,
                  "numba": "numba" in sys.modules, "scipy.optimize": "scipy.optimize" in sys.modules,
                  "loaded": _jit._compile.cache_info().currsize, "checked": record.ok}))
"""


def run(switch: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TOPOCALLBACKS_NUMBA", None)
    if switch is not None:
        env["TOPOCALLBACKS_NUMBA"] = switch
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_new_monitor_loads_the_kernels_and_the_solver_in_the_background_once():
    pytest.importorskip("numba")
    found = run(None)
    assert found["before"] == {"numba": False, "scipy.optimize": False}  # a fresh process: nothing paid yet
    assert not found["alive"]
    assert found["same"]  # once per process
    assert found["numba"]
    assert found["scipy.optimize"]
    assert found["loaded"] == 1  # the kernels were compiled or loaded once, by the thread
    assert found["checked"] is True


def test_with_the_kernels_switched_off_numba_is_never_imported():
    found = run("0")
    assert not found["numba"]
    assert found["scipy.optimize"]
    assert found["loaded"] == 0
    assert found["checked"] is True


FORK = """
import os, sys
from topocallbacks import check
from topocallbacks.functional import _jit
check.prepare_in_background()
pid = os.fork()  # while the kernels may be loading: the fork waits for the load, the child loads nothing again
if pid == 0:
    _jit.load()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_process_forked_while_the_kernels_load_does_not_hang():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", FORK], env=env, capture_output=True, text=True, timeout=300,
                         check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "0"


def test_a_failure_in_the_background_is_logged_and_not_raised(monkeypatch, caplog):
    def broken() -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(check, "prepare", broken)
    with caplog.at_level(logging.DEBUG, logger="topocallbacks.check"):
        check._prepare_quietly()  # the thread's body: it must not raise
    assert "no compiler" in caplog.text
