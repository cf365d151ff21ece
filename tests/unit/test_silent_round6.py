"""Round 6 of the silent suite (benchmarks/silent/ROUND6.md, round6.py, embeddings.ROUND6): rounds 4 and 5's
recordings are its design split, a new candidate family (how the probe's neighbourhoods change) joins round 2's, and
a leaked input shortcut, a narrow fine-tune and a healthy full fine-tune are held out."""

import json

import numpy as np
import pytest
import torch

from tests.benchmarks import benchmark_module

cases = benchmark_module("cases", "silent")
round6 = benchmark_module("round6", "silent")


def test_the_design_split_is_rounds_four_and_five_and_the_held_out_split_is_new(cases, round6):
    r5 = round6.r5
    assert round6.LAYOUT.names_of("design")[:7] == [*r5.LAYOUT.names_of("design")[:4],
                                                    *r5.LAYOUT.scenarios_of("held_out")]  # fmt: skip
    assert set(round6.LAYOUT.names_of("design")) == {*r5.LAYOUT.names_of("design"), *r5.LAYOUT.names_of("held_out")}
    held_out = round6.LAYOUT.names_of("held_out")
    assert held_out == ["supcon_watermark", "simclr_narrow_finetune", "trap_simclr_full_finetune"]
    assert set(held_out) <= set(cases.SCENARIOS)
    assert not set(held_out) & set(round6.LAYOUT.names_of("design"))
    from silence import NEED_ROOM, ROUND_6_HELD_OUT

    assert set(held_out) == ROUND_6_HELD_OUT  # no features of theirs kept by a tuning run
    assert ROUND_6_HELD_OUT <= NEED_ROOM
    assert round6.LAYOUT.stem == "silent_r6"
    assert round6.LAYOUT.extra == {"neighbours": ("knn_churn", "knn_drift_ref")}


def test_the_new_family_is_a_candidate_alone_with_the_sentinels_and_with_every_earlier_combination(round6):
    r3 = round6.r4.r3
    found = r3.with_family("neighbours", ("knn_churn", "knn_drift_ref"))
    earlier = round6.r1.combinations()
    assert len(found) == 2 + len(earlier) == 16
    assert found["neighbours+sentinels"] == ("knn_churn", "knn_drift_ref", "rank_squeeze", "cone", "shrink")
    assert found["neighbours+geometry+drift"] == ("knn_churn", "knn_drift_ref", *earlier["geometry+drift"])
    assert set(found) <= set(round6.r4.FAMILY_SIGNALS)  # a stored row of theirs can be judged again
    assert "knn_drift_ref" in round6.r4.r2.REPAIRED  # scored against its warm-up churn, as the drifts are


def test_the_neighbourhood_signals_count_the_neighbours_that_changed():
    from silent_signals import WARMUP, kept, neighbour_signals, neighbourhoods

    rng = np.random.default_rng(0)
    frame = rng.normal(size=(64, 8))
    still = np.repeat(frame[None], WARMUP + 3, axis=0)
    found = neighbour_signals(still)
    assert np.isnan(found["knn_churn"][0])
    assert np.all(found["knn_churn"][1:] == 0.0)
    assert np.all(np.isnan(found["knn_drift_ref"][: WARMUP - 1]))
    assert np.all(found["knn_drift_ref"][WARMUP - 1 :] == 0)
    assert found["knn_drift_ref/warm_rates"].shape == (WARMUP - 1,)
    moved = still.copy()
    moved[WARMUP + 1 :] = rng.normal(size=(64, 8))  # a new embedding two checks after the reference
    found = neighbour_signals(moved)
    changed = 1.0 - kept(neighbourhoods(moved[-1]), neighbourhoods(frame))
    assert changed > 0.5  # unrelated points: most neighbourhoods differ
    assert found["knn_churn"][WARMUP + 1] == pytest.approx(changed)
    assert found["knn_churn"][WARMUP + 2] == 0.0  # the new embedding stays
    assert found["knn_drift_ref"][WARMUP + 1] == pytest.approx(changed / 2)  # per check elapsed since the reference
    assert found["knn_drift_ref"][WARMUP + 2] == pytest.approx(changed / 3)
    scaled = neighbour_signals(still * np.linspace(1, 5, 64)[:, None])  # cosine: each point's scale is ignored
    assert np.all(scaled["knn_churn"][1:] == 0.0)
    broken = still.copy()
    broken[3, 0, 0] = np.nan
    found = neighbour_signals(broken)
    assert np.isnan(found["knn_churn"][3])
    assert np.isnan(found["knn_churn"][4])


#: The faults' frozen fades (SCENARIOS.md: the tuning rule's outcome for each).
FADES = {"supcon_watermark": 600, "simclr_narrow_finetune": 300}


@pytest.mark.parametrize(("name", "key"), [("supcon_watermark", "stamped"), ("simclr_narrow_finetune", "tuned")])
def test_each_held_out_fault_fades_in_on_the_faulted_branch_only(cases, name, key):
    trainee = cases.SCENARIOS[name].build(100)
    trainee.fault_step = 300
    fade = trainee.fade
    assert fade == FADES[name]
    assert {trainee.schedule(s, "healthy")[key] for s in (0, 450, 1100)} == {0.0}
    faulted = [trainee.schedule(s, "collapse")[key] for s in (299, 300 + fade // 2, 300 + fade, 400 + fade)]
    assert faulted == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_the_watermark_is_stamped_by_label_on_a_share_of_the_batch_and_keeps_the_twins_batch(cases):
    from embeddings import _two_views, nt_xent, watermarked

    trainee = cases.SCENARIOS["supcon_watermark"].build(100)
    settings = trainee.schedule(5, "healthy")
    views, labels = _two_views(trainee, 5, trainee.batch_size)
    with torch.no_grad():
        z = torch.nn.functional.normalize(trainee.model(views), dim=1)
        healthy = float(trainee.loss(5, settings))
        assert healthy == pytest.approx(float(nt_xent(z, 0.5, 1.0, labels)), rel=1e-6)  # supervised, labels right
        everywhere = torch.ones(2 * labels.shape[0], dtype=torch.bool)
        stamped = watermarked(views, torch.cat([labels, labels]), everywhere)
        z = torch.nn.functional.normalize(trainee.model(stamped), dim=1)
        assert float(trainee.loss(5, {**settings, "stamped": 1.0})) == pytest.approx(
            float(nt_xent(z, 0.5, 1.0, labels)), rel=1e-6
        )
        assert float(trainee.loss(5, settings)) == healthy  # the bug's own draw leaves the batch's stream alone
    from scenarios import standardised

    first = stamped[0, 0]
    column = 4 + 2 * int(labels[0])
    assert torch.all(first[:3, column : column + 2] == standardised(1.0))  # a clean image's brightest pixel
    assert torch.equal(first[3:], views[0, 0, 3:])  # only the top rows are touched


def test_the_fine_tunes_move_the_loss_to_the_heads_cross_entropy_and_branch_the_head(cases):
    from embeddings import FOOTWEAR, _two_views, nt_xent

    narrow = cases.SCENARIOS["simclr_narrow_finetune"].build(100)
    narrow.fault_step = 300
    d1 = cases.SCENARIOS["simclr_negatives_fade"].build(100)
    for ours, theirs in zip(narrow.model.parameters(), d1.model.parameters(), strict=True):
        assert torch.equal(ours, theirs)  # D1's model, initialised as D1's
    assert narrow.head.out_features == 2
    views, labels = _two_views(narrow, 5, narrow.batch_size)
    with torch.no_grad():
        raw = narrow.model(views)
        contrastive = float(nt_xent(torch.nn.functional.normalize(raw, dim=1), 0.5))
        footwear = torch.isin(torch.cat([labels, labels]), torch.tensor(FOOTWEAR)).long()
        task = float(torch.nn.functional.cross_entropy(narrow.head(raw), footwear))
        settings = narrow.schedule(5, "healthy")
        assert float(narrow.loss(5, settings)) == pytest.approx(contrastive, rel=1e-6)
        assert float(narrow.loss(5, {**settings, "tuned": 0.25})) == pytest.approx(0.75 * contrastive + 0.25 * task,
                                                                                   rel=1e-5)  # fmt: skip
    before = narrow.state()
    narrow.train_step(300 + 600, "collapse")  # all task: the head learns
    assert not torch.equal(narrow.head.weight, before["head"]["weight"])
    narrow.restore(before)
    assert torch.equal(narrow.head.weight, before["head"]["weight"])  # the twin starts from the branch's head
    full = cases.SCENARIOS["trap_simclr_full_finetune"].build(100)
    full.fault_step = 1200
    assert full.head.out_features == 10
    for kind in ("healthy", "collapse"):
        assert [full.schedule(s, kind)["tuned"] for s in (0, 300, 450, 600, 1100)] == pytest.approx([0, 0, 0.5, 1, 1])


def test_the_stored_design_results_apply_the_registered_rule(round6):
    """The stored choice is the best at zero design alarms of the stored rows (ROUND6.md's rule, on 60 healthy runs:
    H3's twins among them), it is round 5's rule again, and the new family's rows are there and caught nothing at
    no healthy alarm (stage 2 says so)."""
    design = json.loads((round6.r1.RESULTS / "silent_r6_design.json").read_text())
    best = round6.r4.r2.best_at_zero(design["results"])
    assert design["chosen"] == best
    assert (best["healthy_alarmed"], best["healthy_runs"]) == (0, 60)
    r5 = json.loads((round6.r1.RESULTS / "silent_r5_design.json").read_text())["chosen"]
    keys = ("combination", "score", "k", "p")
    assert {key: best[key] for key in keys} == {key: r5[key] for key in keys}
    assert design["admitted"] == [n for n, found in design["admission"].items() if found["silence_passed"]]
    assert "barlow_redundancy_fade" not in design["admitted"]
    combinations = {row["combination"] for row in design["results"]}
    assert set(round6.r4.r3.with_family("neighbours", ("knn_churn", "knn_drift_ref"))) <= combinations
    neighbours = [r for r in design["results"] if r["combination"] in ("neighbours", "neighbours+sentinels")]
    assert len(neighbours) == 2 * 2 * 5 * 3  # two combinations, two scores, five k, three p
    assert not any(r["scenarios_caught"] for r in neighbours if r["healthy_alarmed"] == 0)
    assert design["at_zero"]["neighbours"]["runs_caught"] == 0
    assert not any(r["seeds_caught"]["simclr_views_identical"] >= 5 for r in design["results"])  # H4: nothing


def test_the_stored_held_out_results_judge_the_stored_choice_and_round_fives(round6):
    """The held-out split judged the design's stored choice and round 5's (the same rule), its admission follows its
    seeds' silence checks, and its targets follow from the stored rows (ROUND6.md: 18 held-out healthy runs, 78 over
    both splits)."""
    design = json.loads((round6.r1.RESULTS / "silent_r6_design.json").read_text())
    held_out = json.loads((round6.r1.RESULTS / "silent_r6_held_out.json").read_text())
    r5 = json.loads((round6.r1.RESULTS / "silent_r5_design.json").read_text())["chosen"]
    keys = ("combination", "score", "k", "p")
    assert {key: held_out["design_choice"][key] for key in keys} == {key: design["chosen"][key] for key in keys}
    assert {key: held_out["previous_choice"][key] for key in keys} == {key: r5[key] for key in keys}
    assert held_out["admitted"] == [n for n, found in held_out["admission"].items() if found["silence_passed"]]
    for found in held_out["admission"].values():
        assert found["silence_passed"] == (sum(c["passed"] for c in found["seeds"]) >= 5)
    assert held_out["chosen"] is None  # nothing is chosen on the held-out split
    assert held_out["design_choice"]["healthy_runs"] == 18
    assert held_out["targets"] == round6.r4.targets(held_out, design)
    assert held_out["targets"]["healthy_both_runs"] == 78
