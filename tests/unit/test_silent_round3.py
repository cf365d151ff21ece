"""Round 3 of the silent suite (benchmarks/silent/round3.py, ROUND3.md): the held-out scenarios, the outputs family,
admission at each place, and the keep rule."""

import dataclasses
import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

round3 = benchmark_module("round3", "silent")
cases = benchmark_module("cases", "silent")
record = benchmark_module("record", "collapse")


def logits(classes, n_classes=10):
    """Logits whose argmax is ``classes`` (one per point)."""
    return np.eye(n_classes)[np.asarray(classes)] * 5.0


def test_coverage_counts_the_classes_the_argmax_names_for_at_least_one_percent(round3):
    from silent_signals import coverage, output_entropy, output_signals

    everything = logits(np.arange(512) % 10)
    assert coverage(everything) == 10
    five_of_a_class = np.r_[np.arange(502) % 9, [9] * 5, [8] * 5]  # class 9 named 5 times: under 6 of 512
    assert coverage(logits(five_of_a_class)) == 9
    assert output_entropy(everything) == pytest.approx(math.log(10), abs=1e-3)
    found = output_signals(np.stack([everything, logits(np.arange(512) % 8)]))
    assert found["coverage"].tolist() == [10.0, 8.0]
    assert found["output_entropy"][1] == pytest.approx(math.log(8), abs=1e-3)


def run(round3, kind, coverage_values, scenario="labels_merged", seed=0):
    steps = np.arange(len(coverage_values)) * 10
    values = {"coverage": np.asarray(coverage_values, dtype=float), "loss": np.ones(len(coverage_values))}
    return round3.r1.Run(scenario, seed, kind, steps, values, 150, 250)


def test_coverage_under_the_repaired_score_alarms_on_classes_lost_since_the_reference(round3):
    lost = [10.0] * 18 + [8.0] * 12  # two classes gone from check 18 (step 180), the 5 % point at 250
    alarms = round3.alarms(run(round3, "collapse", lost), "coverage", "frozen_r", 2.0, 2)
    assert np.flatnonzero(alarms).tolist()[:1] == [19]  # two checks at >= 2 classes lost
    gained = [8.0] * 10 + [10.0] * 20
    assert not round3.alarms(run(round3, "healthy", gained), "coverage", "frozen_r", 1.0, 2).any()
    runs = [run(round3, kind, lost if kind == "collapse" else [10.0] * 30, seed=s)
            for s in range(6) for kind in ("collapse", "healthy")]  # fmt: skip
    found = round3.r2.judge(runs, ("labels_merged",), ("coverage",), "frozen_r", 2.0, 2, round3.alarms)
    assert found["seeds_caught"] == {"labels_merged": 6}
    assert found["healthy_alarmed"] == 0


def test_the_outputs_family_is_a_candidate_at_the_outputs_only(round3):
    features, outputs = round3.candidates("features"), round3.candidates("outputs")
    assert not any("outputs" in name for name in features)
    assert outputs["outputs"] == ("coverage", "output_entropy")
    assert len(outputs) == 2 * len(features) + 1  # alone, and with each of round 2's combinations


def test_the_keep_rule_needs_a_catch_and_at_most_one_silent_alarm(round3):
    def place(caught, alarmed):
        return {"shipped": {"default": {"scenarios_caught": caught},
                            "default_silent": {"healthy_alarmed": alarmed, "healthy_runs": 18}}}  # fmt: skip

    assert round3.keep_rule({"features": place([], 0), "outputs": place(["labels_merged"], 1)})["keep"]
    assert not round3.keep_rule({"features": place([], 0), "outputs": place(["labels_merged"], 2)})["keep"]
    assert not round3.keep_rule({"features": place([], 0), "outputs": place([], 0)})["keep"]


def synthetic_recording(path, labels, faulted_features, seed):
    """A digits_class_dropped-like pair: the faulted metric falls 10 % from step 250 (fault 150), quiet loss."""
    rng = np.random.default_rng(seed)
    steps = np.arange(0, 310, 10)
    separable = np.eye(64)[labels] * 3.0
    arrays = {}
    for kind in ("collapse", "healthy"):
        metric = np.full(steps.size, 0.9)
        if kind == "collapse":
            metric[steps >= 250] = 0.8
        features = separable if kind == "healthy" or not faulted_features else np.zeros_like(separable)
        frames = np.stack([features + 0.1 * rng.normal(size=features.shape) for _ in steps])
        arrays.update({f"{kind}/check_steps": steps, f"{kind}/metric": metric, f"{kind}/features": frames,
                       f"{kind}/loss": np.ones(300), f"{kind}/grad_norm": np.ones(300)})  # fmt: skip
    np.savez(path, **arrays, scenario="digits_class_dropped", seed=seed, fault_step=150, steps=300,
             check_every=10, metric_name="clean_accuracy", higher_is_better=True)  # fmt: skip


@pytest.mark.parametrize("faulted_features", [True, False])
def test_a_classifier_is_admitted_at_its_features_only_when_they_lost_the_classes(round3, tmp_path, faulted_features):
    labels = round3.probe_labels("digits_class_dropped")
    assert labels.shape == (512,)
    assert set(labels.tolist()) == set(range(10))
    (tmp_path / "round3").mkdir()
    for seed in range(6):
        synthetic_recording(tmp_path / "round3" / f"digits_class_dropped-seed{seed}.npz", labels, faulted_features,
                            seed)  # fmt: skip
    found = round3.admitted(tmp_path, "digits_class_dropped")
    assert found["silence_passed"]
    assert found["outputs"]  # a classifier's accuracy is its logits' argmax
    assert found["features"] is faulted_features
    difference = found["linear_probe_difference"]
    assert (difference["high"] < 0) is faulted_features


def test_round_three_faults_act_on_the_faulted_run_only(cases):
    digits = cases.DigitsClassDropped(100)
    assert cases.DIGIT_DROPPED == 9
    assert cases.MERGED == (5, 1)
    assert digits.weights(350, "collapse", 300)[9] == pytest.approx(1.0 - 50 / digits.fade)
    assert digits.weights(900, "collapse", 300)[9] == 0.0
    assert digits.weights(900, "healthy", 300).tolist() == [1.0] * 10
    merged = cases.LabelsMerged(100)
    merged.fault_step = 300
    assert merged.schedule(400, "collapse")["share"] == pytest.approx(100 / merged.fade)
    assert merged.schedule(400, "healthy")["share"] == 0.0
    tail = cases.LongTail(100).weights(0, "healthy", 900)
    assert tail[0] == 1.0
    assert tail[9] == pytest.approx(0.6**9)


def test_the_label_bug_moves_class_a_to_b_in_the_faulted_batches_only(cases, monkeypatch):
    merged = cases.LabelsMerged(100)
    seen = []
    monkeypatch.setattr(cases.F, "cross_entropy", lambda logits, y: seen.append(y.clone()) or logits.sum() * 0)
    a, b = cases.MERGED
    for share in (0.0, 1.0):
        merged.loss(7, {"lr": 0.05, "share": share})
    index = np.random.default_rng((100, 7)).integers(0, merged.train_x.shape[0], merged.batch_size)
    original = merged.train_y[index]
    assert (seen[0] == original).all()  # share 0: the batch's own labels
    assert (seen[1][original == a] == b).all()
    assert (seen[1][original != a] == original[original != a]).all()
    assert (original == a).any()  # the batch holds class a, so the test saw the bug act


def test_a_classifiers_recording_keeps_its_probe_logits(cases, record, tmp_path):
    short = dataclasses.replace(cases.SCENARIOS["digits_class_dropped"], steps=30, fault_step=20, check_every=10)
    data = np.load(record.record(short.name, 7, tmp_path, scenario=short))
    for kind in ("collapse", "healthy"):
        assert data[f"{kind}/outputs"].shape == (4, 512, 10)
        assert data[f"{kind}/outputs"].dtype == np.float32
        assert data[f"{kind}/features"].shape == (4, 512, 64)
