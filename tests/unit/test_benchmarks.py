import importlib.util
from pathlib import Path

import pytest

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


def test_trace_recording_is_a_real_training_run(mmhm_bench, tmp_path):
    path = tmp_path / "trace.npz"
    mmhm_bench.record_trace(path, interval=3, checks=4)
    frames = __import__("numpy").load(path)["features"]
    assert frames.shape == (4, 1024, 64)
    # Training moves the features between checks.
    assert (frames[0] != frames[-1]).any()
