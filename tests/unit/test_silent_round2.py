"""Round 2 of the silent suite (benchmarks/silent/round2.py, ROUND2.md): the repaired score (ii-r), silent catches
and the choice by scenarios caught."""

import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

round2 = benchmark_module("round2", "silent")


def test_the_repaired_mode_score_counts_modes_lost_since_the_reference(round2):
    modes = np.r_[np.full(9, math.nan), 8.0, 8.0, 7.0, 4.0, 9.0]
    scores = round2.repaired(modes, "modes")
    assert all(math.isnan(s) for s in scores[:10])
    assert scores[10:].tolist() == [0.0, 1.0, 4.0, -1.0]  # one mode a unit; a gained mode scores below 0


def test_the_repaired_drift_score_is_the_rate_against_the_runs_own_healthy_rate(round2):
    rates = np.array([1.0, 2.0, 3.0, 2.0, 2.0, 1.0, 3.0, 2.0, 2.0])  # median 2, MAD 0 -> the floor 0.25 x 2
    drift = np.r_[np.full(9, math.nan), 0.0, 2.0, 3.0, 7.0]
    scores = round2.repaired(drift, "cka_drift", rates)
    assert scores[10:].tolist() == pytest.approx([0.0, 2.0, 10.0])
    spread = np.array([1.0, 2.0, 3.0, 4.0, 5.0])  # median 3, MAD 1 -> 1.4826 over the floor 0.75
    assert round2.repaired(np.r_[np.full(10, 0.0), 6.0], "diagram_drift_ref", spread)[10] == pytest.approx(3.0 / 1.4826)
    assert all(math.isnan(s) for s in round2.repaired(drift, "cka_drift", np.array([math.nan])))  # no healthy rate


def pair(round2, seed, drop_at, loss_jump_at=None, scenario="classes_dropped"):
    """A faulted run (rankme drops at check ``drop_at``, harm at step 300) and its twin, 40 checks each."""
    rng = np.random.default_rng(seed)
    runs = []
    for kind in ("collapse", "healthy"):
        rankme = 10.0 + 0.1 * rng.normal(size=40)
        loss = 1.0 + 0.01 * rng.normal(size=40)
        if kind == "collapse" and drop_at is not None:
            rankme[drop_at:] = 2.0
        if kind == "collapse" and loss_jump_at is not None:
            loss[loss_jump_at:] = 5.0
        values = {"rankme": rankme, "loss": np.r_[math.nan, loss[1:]]}
        runs.append(round2.r1.Run(scenario, seed, kind, np.arange(40) * 10, values, 200, 300))
    return runs


def test_a_catch_is_silent_only_when_the_loss_rule_was_quiet_until_the_alarm(round2):
    runs = [r for seed in range(6) for r in pair(round2, seed, 25, loss_jump_at=24 if seed < 2 else None)]
    found = round2.judge(runs, ("classes_dropped",), ("rankme",), "trailing", 4.5, 2)
    assert found["seeds_caught"] == {"classes_dropped": 6}
    assert found["seeds_caught_silently"] == {"classes_dropped": 4}  # two seeds' loss jumped first
    assert found["scenarios_caught"] == ["classes_dropped"]
    assert found["healthy_alarmed"] == 0
    assert found["median_lead"] == 40.0  # alarm at 260 (checks 250 and 260), harm at 300


def test_the_choice_is_the_candidate_with_most_scenarios_at_zero_healthy_alarms(round2):
    quiet = {"scenarios_caught": ["a"], "runs_caught_silently": 3, "median_lead": 10.0, "signals": 2, "k": 4.5,
             "p": 2, "score": "trailing", "healthy_alarmed": 0}  # fmt: skip
    loud = {**quiet, "scenarios_caught": ["a", "b"], "healthy_alarmed": 1}
    silent = {**quiet, "runs_caught_silently": 5}
    assert round2.best_at_zero([quiet, loud, silent]) is silent  # ``loud`` alarms on a healthy run
    assert round2.best_at_zero([loud]) is None
    assert round2.rank({**quiet, "score": "frozen_r"}) < round2.rank(quiet)  # the last tie: score (ii-r)
