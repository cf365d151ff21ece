"""Round 4 of the silent suite (benchmarks/silent/embeddings.py, round4.py, ROUND4.md): embedding models judged by
pair accuracy at the operating threshold, faults that fade in on the faulted branch only, and the evaluation's
replays."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.benchmarks import benchmark_module

cases = benchmark_module("cases", "silent")
record = benchmark_module("record", "collapse")
round4 = benchmark_module("round4", "silent")


def test_every_round_four_scenario_is_registered_with_its_split(cases, round4):
    names = {name for c in round4.CLASSES.values() for name in c} | set(round4.TRAPS.values())
    assert names <= set(cases.SCENARIOS)
    assert round4.scenarios_of("design") == ("simclr_negatives_fade", "simsiam_stopgrad_fade")
    assert round4.scenarios_of("held_out") == ("vicreg_variance_fade", "simsiam_predictor_fade")
    from silence import ROUND_4, ROUND_4_HELD_OUT

    assert names == ROUND_4  # the room rule holds for every one of them
    assert {"vicreg_variance_fade", "simsiam_predictor_fade", "trap_temperature_anneal"} == ROUND_4_HELD_OUT


def test_the_pairs_are_same_and_different_class_in_equal_numbers(cases):
    from embeddings import PAIRS, image_pairs

    labels = np.random.default_rng(0).integers(10, size=1024)
    left, right, same = image_pairs(labels)
    assert left.size == right.size == same.size == 2 * PAIRS
    assert np.array_equal(labels[left] == labels[right], same)
    assert (left != right).all()
    again = image_pairs(labels)
    assert all(np.array_equal(a, b) for a, b in zip((left, right, same), again, strict=True))  # a fixed draw


def test_nt_xent_is_the_cross_entropy_and_fades_to_alignment(cases):
    from embeddings import nt_xent

    z = F.normalize(torch.randn(16, 8, generator=torch.Generator().manual_seed(3)), dim=1)
    n = 8
    logits = (z @ z.T / 0.5).fill_diagonal_(-math.inf)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    assert float(nt_xent(z, 0.5)) == pytest.approx(float(F.cross_entropy(logits, targets)), rel=1e-6)
    alignment = -(z[:n] * z[n:]).sum(1).mean() / 0.5
    assert float(nt_xent(z, 0.5, negatives=0.0)) == pytest.approx(float(alignment), rel=1e-6)
    labels = torch.tensor([0, 1] * 4)  # supervised: every other view of the class is a positive
    supervised = float(nt_xent(z, 0.5, labels=labels))
    both = torch.cat([labels, labels])
    mask = (both[:, None] == both[None, :]) & ~torch.eye(2 * n, dtype=torch.bool)
    by_hand = -(logits.masked_fill(~mask, 0).sum(1) / mask.sum(1)).mean() + torch.logsumexp(logits, 1).mean()
    assert supervised == pytest.approx(float(by_hand), rel=1e-6)


@pytest.mark.parametrize("name", ["simclr_negatives_fade", "simsiam_stopgrad_fade", "vicreg_variance_fade",
                                  "simsiam_predictor_fade"])  # fmt: skip
def test_each_fault_fades_in_on_the_faulted_branch_only(cases, name):
    expected = {"simsiam_predictor_fade": 900}.get(name, 600)  # SCENARIOS.md: H2 lengthened by the tuning rule
    trainee = cases.SCENARIOS[name].build(100)
    trainee.fault_step = 300
    key = {"simclr_negatives_fade": "negatives", "vicreg_variance_fade": "variance"}.get(name, "fault")
    healthy = [trainee.schedule(s, "healthy")[key] for s in (0, 450, 1100)]
    assert len(set(healthy)) == 1
    start = healthy[0]
    fade = trainee.fade
    assert fade == expected
    faulted = [trainee.schedule(s, "collapse")[key] for s in (299, 300 + fade // 2, 300 + fade, 400 + fade)]
    assert faulted[0] == start
    assert faulted[2] == faulted[3] != start  # fully in after the fade
    assert min(start, faulted[3]) < faulted[1] < max(start, faulted[3])  # partly in halfway


def test_the_faulted_simsiams_losses_equal_the_twins_at_zero_and_differ_in_gradient_only(cases):
    """The stop-gradient fade changes the gradient, not the loss's value; the predictor fade changes the value."""
    stopgrad = cases.SCENARIOS["simsiam_stopgrad_fade"].build(100)
    values = [float(stopgrad.loss(5, {"lr": 0.05, "fault": w}).detach()) for w in (0.0, 1.0)]
    assert values[0] == pytest.approx(values[1], rel=1e-6)

    def gradient(w):
        stopgrad.model.zero_grad()
        stopgrad.loss(5, {"lr": 0.05, "fault": w}).backward()
        return torch.cat([p.grad.flatten() for p in stopgrad.model.backbone.parameters()])

    assert not torch.allclose(gradient(0.0), gradient(1.0))
    predictor = cases.SCENARIOS["simsiam_predictor_fade"].build(100)
    with torch.no_grad():
        assert float(predictor.loss(5, {"lr": 0.05, "fault": 0.0})) != float(
            predictor.loss(5, {"lr": 0.05, "fault": 1.0})
        )


def test_the_operating_threshold_is_fixed_at_the_fault_step_and_shared_by_both_branches(cases, record, tmp_path):
    short = dataclasses.replace(cases.SCENARIOS["simclr_negatives_fade"], steps=40, fault_step=20, check_every=10)
    data = np.load(record.record(short.name, 7, tmp_path, scenario=short))
    for kind in ("collapse", "healthy"):
        assert data[f"{kind}/check_steps"].tolist() == [0, 10, 20, 30, 40]
        assert data[f"{kind}/features"].shape == (5, 512, 128)
        assert data[f"{kind}/views"].shape == (5, cases.LIDAR_SAMPLES, cases.LIDAR_VIEWS, 128)
    assert np.array_equal(data["collapse/metric"][:3], data["healthy/metric"][:3])  # the shared prefix
    trainee = short.build(7)
    trainee.fault_step = short.fault_step
    for step in range(20):
        trainee.train_step(step, "healthy")
    first = trainee.evaluate()[0]
    assert trainee.threshold is not None  # fixed at the check at the fault step
    fixed = trainee.threshold
    for step in range(20, 30):
        trainee.train_step(step, "collapse")
    trainee.evaluate()
    assert trainee.threshold == fixed
    assert first == pytest.approx(float(data["collapse/metric"][2]))


def test_the_operating_threshold_scores_pairs_by_the_fixed_cut(cases):
    from embeddings import OperatingThreshold

    judge = OperatingThreshold()
    judge.fault_step = 10
    same = np.array([True, True, False, False])
    judge.step_ = 5  # before the fault: the check's own best threshold
    assert judge.pair_accuracy(np.array([0.9, 0.8, 0.1, 0.2]), same) == 1.0
    assert judge.threshold is None
    judge.step_ = 10
    assert judge.pair_accuracy(np.array([0.9, 0.8, 0.1, 0.2]), same) == 1.0
    assert judge.threshold == pytest.approx(0.8)
    judge.step_ = 20  # a cone: every pair above the fixed cut
    assert judge.pair_accuracy(np.array([0.99, 0.98, 0.97, 0.96]), same) == 0.5


def test_the_opt_in_replay_is_round_twos_path_turned_on(round4):
    """A shrinkage after the warm-up fires the opt-in path's sentinel, and never the default's (its path off)."""
    rng = np.random.default_rng(0)
    spread = [rng.normal(size=(64, 8)) for _ in range(14)]
    frames = np.stack(spread + [0.05 * rng.normal(size=(64, 8)) for _ in range(2)])
    steps = np.arange(16) * 10
    values = {"loss": np.ones(16), "grad_norm": np.ones(16)}
    opt_in = round4.opt_in_replay(frames, steps, values)
    assert opt_in[:14].sum() == 0
    assert opt_in[14] == 1.0  # the shrinkage sentinel (it warns once)
    _, default_silent = round4.r1.default_replay(frames, steps, values)
    assert not default_silent.any()


def synthetic_run(round4, kind, spread, seed=0, scenario="vicreg_variance_fade"):
    """A run whose ``spread`` follows the given values (other geometry signals flat), fault at 100, harm at 250."""
    n = len(spread)
    values = {name: np.ones(n) for name in round4.FAMILY_SIGNALS["geometry"]}
    values["spread"] = np.asarray(spread, dtype=float)
    values["loss"] = np.ones(n)
    return round4.r1.Run(scenario, seed, kind, np.arange(n) * 10, values, 100, 250)


def test_the_design_choice_is_judged_again_and_its_first_signals_are_counted(round4):
    warm = list(1.0 + 0.01 * np.sin(np.arange(12)))
    shrinking = warm + [0.5] * 18  # the spread halves from check 12 (step 120), before the 5 % point at 250
    runs = [synthetic_run(round4, kind, shrinking if kind == "collapse" else warm + [1.0] * 18, seed)
            for seed in range(6) for kind in ("collapse", "healthy")]  # fmt: skip
    row = {"combination": "geometry", "score": "frozen", "k": 4.5, "p": 2}
    found = round4.judged(runs, ("vicreg_variance_fade",), row)
    assert found["seeds_caught"] == {"vicreg_variance_fade": 6}
    assert found["healthy_alarmed"] == 0
    assert round4.judged(runs, ("vicreg_variance_fade",), None) is None
    counts = round4.first_signals(runs, row)["vicreg_variance_fade"]
    assert counts["spread"] == 6
    assert sum(counts.values()) == 6  # no other signal moved


def test_the_held_out_targets_follow_the_registered_thresholds(round4):
    def row(caught, alarmed):
        return {"scenarios_caught": caught, "healthy_alarmed": alarmed, "healthy_runs": 18}

    held_out = {"admitted": ["vicreg_variance_fade", "simsiam_predictor_fade"],
                "design_choice": row(["vicreg_variance_fade", "simsiam_predictor_fade"], 1),
                "loss_rule": row([], 0), "loss_anchor": row(["vicreg_variance_fade"], 0)}  # fmt: skip
    design = {"design_choice": row(["simclr_negatives_fade"], 0)}
    met = round4.targets(held_out, design)
    assert met["catches_admitted"]
    assert met["healthy_held_out_met"]
    assert met["healthy_both_met"]
    assert met["loss_met"]
    assert (met["healthy_both"], met["healthy_both_runs"]) == (1, 36)
    missed = round4.targets({**held_out, "design_choice": row(["vicreg_variance_fade"], 2),
                             "loss_rule": row(["simsiam_predictor_fade"], 0)}, design)  # fmt: skip
    assert not missed["catches_admitted"]
    assert not missed["healthy_held_out_met"]
    assert not missed["healthy_both_met"]
    assert missed["loss_caught"] == ["simsiam_predictor_fade", "vicreg_variance_fade"]
    assert not missed["loss_met"]


def test_the_stored_results_apply_the_registered_rules(round4):
    """The stored choice is the best at zero design alarms of the stored rows (ROUND4.md's rule), the held-out split
    judged that choice, and its targets follow from the stored rows."""
    import json

    design = json.loads((round4.r1.RESULTS / "silent_r4_design.json").read_text())
    held_out = json.loads((round4.r1.RESULTS / "silent_r4_held_out.json").read_text())
    best = round4.r2.best_at_zero(design["results"])
    assert design["chosen"] == best
    assert best["healthy_alarmed"] == 0
    assert best["scenarios_caught"]
    choice = held_out["design_choice"]
    assert {key: choice[key] for key in ("combination", "score", "k", "p")} == {
        key: design["chosen"][key] for key in ("combination", "score", "k", "p")
    }
    assert held_out["targets"] == round4.targets(held_out, design)
    assert held_out["admitted"] == [n for n, found in held_out["admission"].items() if found["silence_passed"]]
    for found in held_out["admission"].values():
        assert found["silence_passed"] == (sum(c["passed"] for c in found["seeds"]) >= 5)
