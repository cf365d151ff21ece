"""The silent scenarios' trainees: LiDAR's views are fixed per check and leave training untouched; a recording
keeps them (benchmarks/silent/cases.py with benchmarks/collapse/record.py)."""

import dataclasses

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

cases = benchmark_module("cases", "silent")
record = benchmark_module("record", "collapse")


@pytest.mark.parametrize(("name", "dim"), [("generator_modes_circle", 2), ("vae_kl_bug", 32),
                                           ("watermark_shortcut", 64)])  # fmt: skip
def test_views_are_the_same_at_every_call_and_do_not_change_the_training(cases, name, dim):
    scenario = cases.SCENARIOS[name]
    one, two = scenario.build(100), scenario.build(100)
    one.fault_step = two.fault_step = scenario.fault_step
    first = one.views()
    assert first.shape == (cases.LIDAR_SAMPLES, cases.LIDAR_VIEWS, dim)
    assert np.array_equal(first, one.views())
    assert not np.array_equal(first[:, 0], first[:, 1])  # the views differ from each other
    one.views()
    losses = [(one.train_step(s, "healthy")[0], two.train_step(s, "healthy")[0]) for s in range(3)]
    assert all(a == b for a, b in losses)  # a run that took views trains exactly as one that did not


def test_a_recording_keeps_the_views_of_every_check(cases, record, tmp_path):
    short = dataclasses.replace(cases.SCENARIOS["generator_modes_grid"], steps=30, fault_step=20, check_every=10)
    path = record.record(short.name, 7, tmp_path, scenario=short)
    data = np.load(path)
    for kind in ("collapse", "healthy"):
        assert data[f"{kind}/views"].shape == (4, cases.LIDAR_SAMPLES, cases.LIDAR_VIEWS, 2)  # checks 0-30
        assert data[f"{kind}/check_steps"].tolist() == [0, 10, 20, 30]


def test_the_pairs_negatives_fade_out_after_the_fault_and_stay_in_the_twin(cases):
    from types import SimpleNamespace

    def weight(step, kind="collapse", fade=300):
        return cases.PairContrastive._schedule_of(SimpleNamespace(fade=fade), step, kind, 300)["negatives"]

    assert [weight(s) for s in (0, 299, 300, 450, 600, 900)] == [1.0, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert weight(450, kind="healthy") == 1.0
    assert [weight(s, fade=0) for s in (299, 300)] == [1.0, 0.0]  # abrupt
