"""Round 5 of the silent suite (benchmarks/silent/ROUND5.md, round5.py, embeddings.ROUND5): round 4's scenarios are
its design split; Barlow Twins' redundancy fade, a view bug and a Barlow trap are held out."""

import json

import numpy as np
import pytest
import torch

from tests.benchmarks import benchmark_module

cases = benchmark_module("cases", "silent")
round5 = benchmark_module("round5", "silent")
library_replay = benchmark_module("library_replay", "silent")


def test_the_design_split_is_round_four_and_the_held_out_split_is_new(cases, round5):
    r4 = round5.r4
    assert round5.LAYOUT.names_of("design") == [*r4.scenarios_of("design"), *r4.scenarios_of("held_out"),
                                                 "trap_simclr_to_supcon", "trap_temperature_anneal"]  # fmt: skip
    held_out = round5.LAYOUT.names_of("held_out")
    assert held_out == [
        "barlow_redundancy_fade", "simclr_views_identical", "supcon_labels_shuffled", "trap_barlow_redundancy_rise"
    ]  # fmt: skip
    assert set(held_out) <= set(cases.SCENARIOS)
    assert not set(held_out) & set(round5.LAYOUT.names_of("design"))
    from silence import NEED_ROOM, ROUND_5_HELD_OUT

    assert set(held_out) == ROUND_5_HELD_OUT  # no features of theirs kept by a tuning run
    assert ROUND_5_HELD_OUT <= NEED_ROOM
    assert round5.LAYOUT.stem == "silent_r5"


def test_barlow_twins_is_the_cross_correlation_towards_the_identity(cases):
    from embeddings import barlow_twins

    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(64, 6, generator=g), torch.randn(64, 6, generator=g)
    a = (z1 - z1.mean(0)) / z1.std(0)
    b = (z2 - z2.mean(0)) / z2.std(0)
    c = a.T @ b / 63
    off = c - torch.diag(torch.diagonal(c))
    by_hand = (1 - torch.diagonal(c)).pow(2).sum() + 0.01 * off.pow(2).sum()
    assert float(barlow_twins(z1, z2, 0.01)) == pytest.approx(float(by_hand), rel=1e-4)
    merged = z1[:, :1].repeat(1, 6)  # every dimension the same feature: invariant, and wholly redundant
    assert float(barlow_twins(merged, merged, 0.0)) < 1e-6
    assert float(barlow_twins(merged, merged, 0.01)) == pytest.approx(0.01 * 30, rel=1e-3)


#: The faults' frozen fades (SCENARIOS.md: the tuning rule's outcome for each).
FADES = {"barlow_redundancy_fade": 600, "simclr_views_identical": 600, "supcon_labels_shuffled": 900}


@pytest.mark.parametrize(("name", "key", "start", "end"), [
    ("barlow_redundancy_fade", "redundancy", 5e-3, 0.0),
    ("simclr_views_identical", "same_view", 0.0, 1.0),
    ("supcon_labels_shuffled", "shuffled", 0.0, 1.0),
])  # fmt: skip
def test_each_held_out_fault_fades_in_on_the_faulted_branch_only(cases, name, key, start, end):
    trainee = cases.SCENARIOS[name].build(100)
    trainee.fault_step = 300
    fade = trainee.fade
    assert fade == FADES[name]
    assert {trainee.schedule(s, "healthy")[key] for s in (0, 450, 1100)} == {start}
    faulted = [trainee.schedule(s, "collapse")[key] for s in (299, 300 + fade // 2, 300 + fade, 400 + fade)]
    assert faulted[0] == start
    assert faulted[1] == pytest.approx((start + end) / 2)
    assert faulted[2] == faulted[3] == pytest.approx(end)


def test_the_view_bug_makes_the_second_view_the_first_and_keeps_the_twins_batch(cases):
    from embeddings import _two_views, nt_xent

    trainee = cases.SCENARIOS["simclr_views_identical"].build(100)
    settings = trainee.schedule(5, "healthy")
    with torch.no_grad():
        healthy = float(trainee.loss(5, settings))
        all_same = float(trainee.loss(5, {**settings, "same_view": 1.0}))
        first, _ = _two_views(trainee, 5, trainee.batch_size)[0].chunk(2)
        z = torch.nn.functional.normalize(trainee.model(torch.cat([first, first])), dim=1)
        assert all_same == pytest.approx(float(nt_xent(z, 0.5)), rel=1e-6)
        assert float(trainee.loss(5, settings)) == healthy  # the bug's own draw leaves the batch's stream alone
    assert all_same < healthy  # matching a view to itself is easier: the loss falls


def test_the_label_bug_replaces_a_share_of_the_labels_and_keeps_the_twins_batch(cases):
    from embeddings import _two_views, nt_xent

    trainee = cases.SCENARIOS["supcon_labels_shuffled"].build(100)
    trainee.fault_step = 300
    assert trainee.schedule(0, "healthy")["supervised"]  # supervised contrastive from the first step
    settings = trainee.schedule(5, "healthy")
    views, labels = _two_views(trainee, 5, trainee.batch_size)
    with torch.no_grad():
        z = torch.nn.functional.normalize(trainee.model(views), dim=1)
        assert float(trainee.loss(5, settings)) == pytest.approx(float(nt_xent(z, 0.5, 1.0, labels)), rel=1e-6)
        shuffled = float(trainee.loss(5, {**settings, "shuffled": 1.0}))
        assert float(trainee.loss(5, settings)) != shuffled
        rng = np.random.default_rng((100, 5, 2))
        rng.random(labels.shape[0])
        random = torch.from_numpy(rng.integers(0, 10, labels.shape[0]))
        assert shuffled == pytest.approx(float(nt_xent(z, 0.5, 1.0, random)), rel=1e-6)  # every label replaced


def test_the_trap_raises_the_redundancy_weight_fourfold_on_both_branches(cases):
    trainee = cases.SCENARIOS["trap_barlow_redundancy_rise"].build(100)
    trainee.fault_step = 1200
    for kind in ("healthy", "collapse"):
        weights = [trainee.schedule(s, kind)["redundancy"] for s in (0, 300, 450, 600, 1100)]
        assert weights == pytest.approx([5e-3, 5e-3, 1.25e-2, 2e-2, 2e-2])


def test_round_fours_choice_is_judged_on_the_held_out_split_and_rendered(round5, monkeypatch, tmp_path):
    row = {"combination": "geometry", "score": "frozen_r", "k": 4.5, "p": 2}
    runs = []
    rng = np.random.default_rng(0)
    for seed in range(6):
        for kind in ("collapse", "healthy"):
            n = 30
            values = {name: 1.0 + 0.01 * rng.normal(size=n) for name in round5.r4.FAMILY_SIGNALS["geometry"]}
            if kind == "collapse":
                values["mean_cosine"][15:] = 3.0  # a cone from step 150, before the 5 % point at 250
            values["loss"] = np.ones(n)
            runs.append(round5.r1.Run("barlow_redundancy_fade", seed, kind, np.arange(n) * 10, values, 100, 250))
    found = round5.r4.judged(runs, ("barlow_redundancy_fade",), row)
    assert found["seeds_caught"] == {"barlow_redundancy_fade": 6}
    assert found["healthy_alarmed"] == 0
    payload = json.loads((round5.r1.RESULTS / "silent_r4_held_out.json").read_text())
    text = round5.markdown({**payload, "round": 5, "round4_choice": found})
    assert text.startswith("Round 5, split **held_out**")
    assert "Round 4's choice" in text
    assert "barlow_redundancy_fade 6/6" in text
    assert "healthy runs alarmed 0/6" in text  # the six twins


def test_the_stored_results_apply_the_registered_rules(round5, library_replay):
    """The stored choice is the best at zero design alarms of the stored rows (ROUND5.md's rule, on 36 healthy runs),
    the held-out split judged that choice and round 4's, and its targets follow from the stored rows."""
    design = json.loads((round5.r1.RESULTS / "silent_r5_design.json").read_text())
    held_out = json.loads((round5.r1.RESULTS / "silent_r5_held_out.json").read_text())
    best = round5.r4.r2.best_at_zero(design["results"])
    assert design["chosen"] == best
    assert (best["healthy_alarmed"], best["healthy_runs"]) == (0, 36)
    from topocallbacks.settings import SILENT_FAMILIES

    # The library's geometry family and the replay that checks it hold the stored choice.
    assert SILENT_FAMILIES["geometry"][:2] == (best["k"], best["p"])
    assert (best["score"], best["k"], best["p"]) == library_replay.CHOICE
    keys = ("combination", "score", "k", "p")
    assert {key: held_out["design_choice"][key] for key in keys} == {key: best[key] for key in keys}
    r4_design = json.loads((round5.r1.RESULTS / "silent_r4_design.json").read_text())
    assert {key: held_out["round4_choice"][key] for key in keys} == {key: r4_design["chosen"][key] for key in keys}
    assert held_out["targets"] == round5.r4.targets(held_out, design)
    assert held_out["design_choice"]["healthy_runs"] == 24  # 18 twins and 6 trap runs (H5 added: ROUND5.md)
    assert held_out["admitted"] == [n for n, found in held_out["admission"].items() if found["silence_passed"]]
    for found in held_out["admission"].values():
        assert found["silence_passed"] == (sum(c["passed"] for c in found["seeds"]) >= 5)


def test_the_library_reproduced_the_replay_on_every_round_five_scenario(round5):
    """Ship rule (c): the stored comparison of the library's geometry family with the benchmark's replay covers seed 0
    of every round-5 scenario, both branches where a recording has them, and every one agrees."""
    payload = json.loads((round5.r1.RESULTS / "silent_r5_library_replay.json").read_text())
    assert payload["seeds"] == [0]
    names = [*round5.LAYOUT.names_of("design"), *round5.LAYOUT.names_of("held_out")]
    assert sorted({row["scenario"] for row in payload["rows"]}) == sorted(names)
    faulted = [n for n in names if not n.startswith("trap_")]
    for name in faulted:
        assert {r["branch"] for r in payload["rows"] if r["scenario"] == name} == {"collapse", "healthy"}
    assert all(row["same_values"] and row["same_holds"] for row in payload["rows"])
    assert payload["all_agree"]
    assert any(row["holds"] for row in payload["rows"])  # the comparison includes checks where the family holds
