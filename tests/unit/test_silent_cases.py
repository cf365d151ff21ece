"""The silent scenarios' trainees: LiDAR's views are fixed per check and leave training untouched; a recording
keeps them (benchmarks/silent/cases.py with benchmarks/collapse/record.py)."""

import dataclasses

import numpy as np
import pytest
import torch

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


def test_round_two_classes_leave_in_the_faulted_run_only_and_come_in_the_trap(cases):
    dropped, added = cases.ClassesDropped(100), cases.ClassesAdded(100)
    assert cases.DROPPED == (1, 7)
    assert dropped.weights(450, "collapse", 300)[list(cases.DROPPED)].tolist() == [0.25, 0.25]  # fade 200
    assert dropped.weights(600, "collapse", 300)[list(cases.DROPPED)].tolist() == [0.0, 0.0]
    assert dropped.weights(600, "healthy", 300).tolist() == [1.0] * 10
    assert added.weights(299, "healthy", 900)[list(cases.DROPPED)].tolist() == [0.0, 0.0]
    assert added.weights(300, "healthy", 900).tolist() == [1.0] * 10
    # The sampler follows the weights: at zero weight a batch holds none of the dropped classes, at one all appear.
    faulted = {
        int(y) for s in range(20) for y in dropped.train_y[dropped.batch(s, dropped.weights(600, "collapse", 300))]
    }
    healthy = {
        int(y) for s in range(20) for y in dropped.train_y[dropped.batch(s, dropped.weights(600, "healthy", 300))]
    }
    assert faulted == set(range(10)) - set(cases.DROPPED)
    assert healthy == set(range(10))


def test_round_two_fine_tune_ramps_the_body_rate_in_the_faulted_run_only(cases):
    scenario = cases.SCENARIOS["finetune_forgetting_images"]
    trainee = scenario.build(100)
    trainee.fault_step = scenario.fault_step
    body = [trainee.schedule(s, "collapse")["body_lr"] for s in (0, 299, 300, 399, 400, 500, 600, 800)]
    assert body == pytest.approx([0.05, 0.05, 0.002, 0.002, 0.002, 0.026, 0.05, 0.05])
    assert trainee.schedule(800, "healthy")["body_lr"] == 0.002
    trainee.train_step(300, "collapse")
    assert [g["lr"] for g in trainee.optimizer.param_groups] == [0.002, 0.05]  # the body's group, then the heads'
    state = trainee.state()
    twin = scenario.build(100)
    twin.restore(state)
    assert all(
        torch.equal(a, b) for a, b in zip(trainee.binary_head.parameters(), twin.binary_head.parameters(), strict=True)
    )
