import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import HANG_SECONDS

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mmhm_bench():
    return load("mmhm_bench")


def test_probe_and_stream_scenarios_agree_with_every_baseline(mmhm_bench):
    baselines = ["gudhi", "scratch", "ripser"]
    probe = mmhm_bench.probe_scenario(0.05, n=80, dim=8, updates=3, baselines=baselines).summary()
    stream = mmhm_bench.stream_scenario(60, 8, 8, updates=4, compare_every=2, baselines=baselines).summary()
    for summary in (probe, stream):
        assert summary["exact"] is True
        assert set(summary["baseline_median_ms"]) == set(baselines)
        assert summary["speedup_vs_best"] > 0
    assert probe["compared_updates"] == 3
    assert stream["compared_updates"] == 2
    assert sum(stream["paths"].values()) == 4


def test_real_feature_recording_is_a_real_training_run(tmp_path):
    import numpy as np

    real_features = load("real_features")
    path = real_features.record("mlp", steps=5, path=tmp_path / "mlp.npz")
    data = np.load(path)
    assert data["stream"].shape == (5, 32, 64)
    assert data["probe"].shape == (5, 512, 64)
    assert data["stream"].dtype == np.float16
    assert (data["probe"][0] != data["probe"][-1]).any()  # training moves the features between checks


def test_real_scenarios_replay_through_the_pipeline_and_agree_with_every_baseline(mmhm_bench):
    import numpy as np

    rng = np.random.default_rng(0)
    centres = rng.normal(scale=3.0, size=(4, 8))
    # A drifting stream: the feature scale grows 20x, as a real network's does.
    stream = np.stack([(1 + step) * (centres[rng.integers(0, 4, 8)] + rng.normal(size=(8, 8))) for step in range(20)])
    baselines = ["gudhi", "scratch", "ripser"]
    run = mmhm_bench.real_stream_scenario("stream", stream, 2, baselines, window=64).summary()
    assert run["exact"] is True
    assert run["kind"] == "real stream"
    assert run["moved_median"] == 8 / 64
    assert run["sparse_edit"] is True
    assert run["compared_updates"] >= 3
    frames = np.stack([centres[np.arange(40) % 4] + 0.3 * rng.normal(size=(40, 8)) for _ in range(4)])
    probe = mmhm_bench.real_probe_scenario("probe", frames, baselines, interval=1).summary()
    assert probe["exact"] is True
    assert probe["moved_median"] == 1.0  # every point moves: the table says whether the edges did
    assert probe["compared_updates"] == 3
    assert "NOT SPARSE" in mmhm_bench.format_table([probe]) or probe["sparse_edit"]


def test_busy_runs_the_command_beside_its_busy_processes_and_ends_them_with_it():
    # The command lists the busy processes beside it (its parent's other children) and exits with 3.
    command = (
        "import os, sys\n"
        "parent = os.getppid()\n"
        "busy = []\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        stat = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()\n"
        "        line = open(f'/proc/{pid}/cmdline').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if int(stat[1]) == parent and 'spawn_main' in line and 'resource_tracker' not in line:\n"
        "        busy.append(pid)\n"
        "print('BUSY', *busy)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "busy.py"), "--load", "2", "--", sys.executable, "-c", command],
        capture_output=True, text=True, timeout=HANG_SECONDS,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("BUSY")]
    pids = line.split()[1:]
    assert len(pids) == 2
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # ended (and reaped) with the command
    assert "exit code 3" in done.stdout
    assert "2 busy processes" in done.stdout


def test_busy_says_what_it_needs():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "busy.py")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "give the command to run after --" in done.stderr
