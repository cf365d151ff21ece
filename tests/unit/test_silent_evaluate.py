"""The silent suite's replay of candidates on runs whose signals are known (benchmarks/silent/silent_evaluate.py)."""

import math

import numpy as np
import pytest

from tests.benchmarks import benchmark_module

evaluate = benchmark_module("silent_evaluate", "silent")


def series(n=40, level=10.0, drop_at=None, drop_to=2.0, seed=0):
    rng = np.random.default_rng(seed)
    values = level + 0.1 * rng.normal(size=n)
    if drop_at is not None:
        values[drop_at:] = drop_to + 0.1 * rng.normal(size=n - drop_at)
    return values


def run(evaluate, kind, rankme, fault=200, point=None, scenario="vae_kl_bug", seed=0):
    steps = np.arange(rankme.size) * 10
    names = [s for family in evaluate.FAMILIES.values() for s in family]
    values = {name: np.full(rankme.size, math.nan) for name in names}
    values.update({name: np.zeros(rankme.size) for name in evaluate.SENTINELS})
    values["rankme"] = rankme
    return evaluate.Run(scenario, seed, kind, steps, values, fault, point)


def test_the_frozen_score_is_a_robust_z_against_the_warm_up(evaluate):
    values = np.array([10.0, 11.0, 9.0, 10.0, 12.0, 8.0, 10.0, 13.0, 7.0, 11.0, 10.0, 4.0])
    scores = evaluate.frozen_scores(values, direction=-1)
    assert all(math.isnan(s) for s in scores[:10])
    mad = 1.4826 * np.median(np.abs(values[:10] - 10.0))  # median 10, MAD 1
    assert scores[11] == pytest.approx(6.0 / mad)
    assert scores[10] == pytest.approx(0.0)
    flat = evaluate.frozen_scores(np.full(12, 5.0), direction=1)  # no spread: the floor (1 % of the level)
    assert flat[11] == 0.0


def test_a_drop_after_the_fault_is_caught_before_the_harm_and_healthy_runs_stay_quiet(evaluate):
    faulted = run(evaluate, "collapse", series(drop_at=25), point=300)  # harm from step 300, the drop at 250
    twin = run(evaluate, "healthy", series(seed=1))
    alarm, _ = evaluate.first_alarm(faulted, ("rankme",), "trailing", 4.5, 2)
    assert alarm == 260  # two consecutive checks: 250 and 260
    assert evaluate.first_alarm(twin, ("rankme",), "trailing", 4.5, 2) == (None, False)
    late = run(evaluate, "collapse", series(drop_at=35), point=300)
    assert evaluate.first_alarm(late, ("rankme",), "frozen", 4.5, 2)[0] == 360  # after the 5 % point: not caught


def test_the_choice_needs_no_healthy_alarm_and_counts_classes_with_five_of_six_seeds(evaluate):
    runs = []
    for seed in range(6):
        drop = 25 if seed < 5 else None  # five of six seeds collapse in rankme
        runs.append(run(evaluate, "collapse", series(drop_at=drop, seed=seed), point=300, seed=seed))
        runs.append(run(evaluate, "healthy", series(seed=10 + seed), seed=seed))
    results = evaluate.evaluate(runs, ("S5",))
    spectrum = [r for r in results if r["combination"] == "spectrum" and r["score"] == "trailing" and r["k"] == 4.5
                and r["p"] == 2]  # fmt: skip
    assert spectrum[0]["by_class"] == {"S5": True}
    assert spectrum[0]["runs_caught"] == 5
    assert spectrum[0]["healthy_alarmed"] == 0
    chosen = evaluate.choose(results)
    assert chosen["classes_caught"] == 1
    assert chosen["healthy_alarmed"] == 0
    assert chosen["signals"] == 1  # the spectrum alone: fewest signals among the ties
    assert len(results) == len(evaluate.combinations()) * 2 * 5 * 3


def silent_runs(evaluate):
    """Six seeds of S5 whose rankme drops on five faulted runs (after the fault, before the harm) while the loss
    falls, and their quiet twins."""
    runs = []
    for seed in range(6):
        faulted = run(evaluate, "collapse", series(drop_at=25 if seed < 5 else None, seed=seed), point=300, seed=seed)
        faulted.values["loss"] = series(level=2.0, drop_at=25, drop_to=1.0, seed=seed)  # the loss falls: silent
        healthy = run(evaluate, "healthy", series(seed=10 + seed), seed=seed)
        healthy.values["loss"] = series(level=2.0, seed=20 + seed)
        for r in (faulted, healthy):
            r.values["norm_std"] = series(seed=30 + seed)
            r.values["grad_norm"] = series(seed=40 + seed)
        runs += [faulted, healthy]
    return runs


def test_the_report_gives_the_choice_each_family_and_anchor_the_loss_rule_and_exact_intervals(evaluate):
    found = evaluate.report(silent_runs(evaluate), ("S5",))
    assert found["chosen"]["combination"] == "spectrum"
    assert found["per_scenario"]["vae_kl_bug"]["caught"] == 5
    low, high = found["per_scenario"]["vae_kl_bug"]["interval"]
    assert low == pytest.approx(0.3588, abs=1e-3)  # Clopper-Pearson for 5 of 6
    assert high == pytest.approx(0.9958, abs=1e-3)
    assert found["loss_rule"]["classes_caught"] == 0  # a falling loss never alarms the rising-loss rule
    assert found["loss_rule"]["candidate"] == {"combination": "loss_rule", "score": "trailing", "k": 4.5, "p": 1}
    two_sided = found["anchors"]["loss_two_sided"]["at_zero"]
    assert two_sided["classes_caught"] == 1  # scored both ways, the drop is seen
    assert found["anchors"]["lidar"]["at_zero"]["runs"] == 0  # no views recorded here: LiDAR cannot be judged
    spectrum = found["families"]["spectrum"]["at_zero"]
    assert spectrum["candidate"]["combination"] in ("spectrum", "spectrum+sentinels")
    assert (spectrum["runs_caught"], spectrum["runs"], spectrum["healthy_alarmed"]) == (5, 6, 0)
    low, high = spectrum["catch_interval"]
    assert low == pytest.approx(0.4365, abs=1e-3)  # Wilson for 5 of 6
    assert high == pytest.approx(0.9699, abs=1e-3)
    assert found["families"]["spectrum"]["cheapest_catch"]["classes_caught"] == 1
    assert found["families"]["sentinels"]["cheapest_catch"] is None  # the sentinels never hold here


def test_the_loss_only_rule_is_the_librarys_policy_with_its_noise_floor_and_the_loss_anchor_has_none(evaluate):
    flat = np.full(30, 1.0)
    flat[0] = math.nan  # no loss before the first check
    flat[20] = 1.0001  # a blip far below 1 % of the loss's own scale
    assert not evaluate.alarms(flat, "loss_rule", "trailing", 4.5, 1).any()
    assert evaluate.alarms(flat, "loss", "trailing", 4.5, 1)[20]  # scored as every candidate: no floor
    jump = flat.copy()
    jump[20] = 3.0
    assert np.flatnonzero(evaluate.alarms(jump, "loss_rule", "trailing", 4.5, 1)).tolist() == [20]


def test_the_best_within_a_budget_and_the_choice_need_no_more_healthy_alarms(evaluate):
    rows = [
        {"classes_caught": 2, "runs_caught": 9, "median_lead": 5.0, "signals": 1, "k": 3.0, "p": 2,
         "score": "frozen", "healthy_alarmed": 1},
        {"classes_caught": 0, "runs_caught": 3, "median_lead": 5.0, "signals": 1, "k": 3.0, "p": 2,
         "score": "frozen", "healthy_alarmed": 0},
    ]  # fmt: skip
    assert evaluate.best_within(rows, 0) is rows[1]
    assert evaluate.best_within(rows, 1) is rows[0]
    assert evaluate.choose(rows) is None  # eligible, but it catches no class: no silent path


def test_the_page_says_when_no_candidate_is_eligible_and_shows_every_silence_check(evaluate):
    pages = benchmark_pages()
    found = evaluate.report(silent_runs(evaluate), ("S5",))
    seeds = [{"reached": True, "quiet": s != 0, "passed": s != 0, "checks_before_harm": s} for s in range(6)]
    payload = {
        "split": "design",
        "classes": ["S5"],
        "traps": ["T2"],
        "commit": "0123456789abcdef",
        "silence": {"vae_kl_bug": {"passed": 5, "seeds": 6, "passes": True, "per_seed": seeds}},
        **found,
    }
    text = pages.page(payload)
    assert "| S5 VAE | 5 | 6 | 5 | 2.5; 0-5 | yes |" in text
    assert "Chosen: spectrum" in text
    assert "commit `0123456789ab`" in text
    assert "| spectrum (family) | spectrum, " in text
    assert "| 5/6 (44-97 %) |" in text
    payload["chosen"] = None
    assert "**No candidate was eligible.**" in pages.page(payload)


def benchmark_pages():
    import importlib
    import sys

    from tests.benchmarks import BENCHMARKS

    sys.path.insert(0, str(BENCHMARKS / "silent"))
    try:
        return importlib.import_module("silent_pages")
    finally:
        sys.path.remove(str(BENCHMARKS / "silent"))


def test_the_default_is_replayed_on_recorded_features_and_acts_on_a_constant_cloud_at_once(evaluate):
    rng = np.random.default_rng(0)
    frames = rng.normal(size=(14, 64, 4))
    frames[12] = 1.0  # every point the same: the constant sentinel acts, warm-up or not
    steps = np.arange(14) * 10
    values = {"loss": np.r_[math.nan, np.full(13, 1.0)], "grad_norm": np.full(14, math.nan)}
    acted = evaluate.default_actions(frames, steps, values)
    assert acted.tolist() == [0.0] * 12 + [1.0, 0.0]
    healthy = evaluate.Run("vae_kl_bug", 0, "healthy", steps, {"default": np.r_[1.0, np.zeros(13)]})
    assert evaluate.first_alarm(healthy, ("default",), "trailing", 4.5, 1) == (None, True)  # the warm-up counts


def row(seeds_caught, healthy_alarmed=0, healthy_runs=24, by_class=None):
    runs = 6 * len(seeds_caught)
    by_class = by_class or {}
    return {"seeds_caught": seeds_caught, "runs_caught": sum(seeds_caught.values()), "runs": runs,
            "healthy_alarmed": healthy_alarmed, "healthy_runs": healthy_runs,
            "classes_caught": sum(by_class.values()), "by_class": by_class}  # fmt: skip


def test_the_held_out_split_is_never_chosen_on_and_its_page_says_so(evaluate):
    pages = benchmark_pages()
    found = evaluate.report(silent_runs(evaluate), ("S5",), choosing=False)
    assert found["chosen"] is None  # a spectrum drop is caught below, yet nothing is chosen
    assert found["per_scenario"] == {}
    assert found["families"]["spectrum"]["at_zero"]["classes_caught"] == 1
    payload = {"split": "held_out", "classes": ["S5"], "traps": ["T1"], "commit": "0" * 40, "silence": {}, **found}
    text = pages.page(payload)
    assert "**Nothing is chosen on this split.**" in text
    assert "No candidate was eligible" not in text


def test_the_targets_are_judged_held_out_first_from_both_splits():
    pages = benchmark_pages()
    two_sided = {"at_zero": row({"vae_kl_bug": 6}, by_class={"S5": True})}
    design = {"default": row({"vae_kl_bug": 5, "generator_modes_grid": 6, "generator_modes_circle": 2},
                             healthy_alarmed=1, healthy_runs=36, by_class={"S4": False, "S5": True}),
              "loss_rule": row({"vae_kl_bug": 0}, by_class={"S5": False}),
              "anchors": {"loss_two_sided": two_sided}}  # fmt: skip
    held_out = {"default": row({"contrastive_no_negatives": 5, "minilm_pairs_no_negatives": 6,
                                "minilm_forgetting": 1}, healthy_alarmed=1, by_class={"S2": True, "S6": False}),
                "loss_rule": row({"minilm_forgetting": 5}, by_class={"S6": True}),
                "anchors": {"loss_two_sided": {"at_zero": None}}}  # fmt: skip
    assert pages.classes_caught(design["default"]) == {"S5"}  # as the evaluation judged: S4 is not caught
    found = {what: (text, met) for what, text, met in pages.targets(design, held_out)}
    assert found["the default catches both held-out classes (S2, S6)"] == ("S2 caught", False)
    assert found["the default catches >= 5 of the 6 classes (whole suite)"] == ("2 of 6", False)
    assert found["<= 1 healthy run touched, over >= 48"] == ("2 of 60", False)
    assert found["the loss alone catches <= 1 class"] == ("1 (the two-sided loss anchor: 1)", True)
    held_out["default"]["by_class"]["S6"] = True
    held_out["default"]["healthy_alarmed"] = 0
    found = {what: (text, met) for what, text, met in pages.targets(design, held_out)}
    assert found["the default catches both held-out classes (S2, S6)"] == ("S2, S6 caught", True)
    assert found["<= 1 healthy run touched, over >= 48"] == ("1 of 60", True)
    assert found["the rescue suite with the new default"][1] is None  # no new default: nothing to re-run
    table = pages.targets_table(design, held_out)
    assert table.count("\n") == 7
    assert "| 1 of 60 | yes |" in table
    assert "| does not apply |" in table


def r2_row(seeds, silently=None, healthy_alarmed=0, healthy_runs=18):
    silently = silently or dict.fromkeys(seeds, 0)
    return {"combination": "default", "score": "trailing", "k": 4.5, "p": 1, "seeds_caught": seeds,
            "seeds_caught_silently": silently, "scenarios_caught": sorted(n for n, v in seeds.items() if v >= 5),
            "runs": 6 * len(seeds), "runs_caught": sum(seeds.values()), "healthy_alarmed": healthy_alarmed,
            "healthy_runs": healthy_runs, "median_lead": None}  # fmt: skip


def test_round_four_status_says_what_the_choice_caught_held_out_and_why_the_default_stays_off():
    pages = benchmark_pages()
    design = {"chosen": {**r2_row({"simclr_negatives_fade": 5, "simsiam_stopgrad_fade": 4}), "combination": "geometry",
                         "score": "frozen_r"}}  # fmt: skip
    choice = r2_row({"vicreg_variance_fade": 6, "simsiam_predictor_fade": 1},
                    {"vicreg_variance_fade": 6, "simsiam_predictor_fade": 1}, healthy_alarmed=1)  # fmt: skip
    choice["median_lead"], choice["runs_caught_silently"] = 90.0, 7
    targets = {"catches_admitted": False, "healthy_held_out": 1, "healthy_held_out_met": True, "healthy_both": 1,
               "healthy_both_runs": 36, "healthy_both_met": True, "loss_caught": [], "loss_met": True}  # fmt: skip
    held_out = {"admitted": ["vicreg_variance_fade", "simsiam_predictor_fade"], "design_choice": choice,
                "targets": targets, "loss_rule": r2_row({"vicreg_variance_fade": 0, "simsiam_predictor_fade": 0}),
                "first_signals": {"vicreg_variance_fade": {"spread": 6, "modes": 0}}}  # fmt: skip
    r2_held_out = {"default": r2_row({"classes_dropped": 0, "finetune_forgetting_images": 0})}
    lead = pages.round4_status(design, held_out, r2_held_out)
    assert "(`geometry`, score frozen_r, k 4.5, p 1: 9/12 design faulted runs caught" in lead
    assert (
        "caught H1 VICReg variance fade on 6 of 6 seeds before the harm and H2 SimSiam predictor fade on 1 of 6" in lead
    )
    assert "7 of its 7 catches before any loss-only warning; median lead 90 steps" in lead
    assert "the loss-only rule caught 0/12" in lead
    assert "every admitted held-out class is missed (H2 not caught on 5 of 6 seeds)" in lead
    assert "(1/18 and 1/36 healthy alarms, the loss alone catching <= 1 class) are met" in lead
    assert "What fired first: `spread`, never the topological mode counter" in lead
    assert "round 2's path caught 0/12" in lead
    choice["seeds_caught"]["simsiam_predictor_fade"] = 5
    assert "of every admitted held-out class is met" in pages.round4_status(design, held_out, r2_held_out)


def silence_seeds(points, loud=0):
    """Six seeds' silence checks: ``points`` 5 % points (None: never), the first ``loud`` warned first."""
    return [{"five_percent_point": point, "quiet": i >= loud, "passed": point is not None and i >= loud}
            for i, point in enumerate(points)]  # fmt: skip


def test_an_embedding_round_status_names_what_was_admitted_caught_and_why_the_default_stays_off():
    # Round 5's lead (the README showed it until round 6): round 4's choice judged on round 5's held-out split.
    pages = benchmark_pages()

    def round5(design, held_out, r4_held_out, r2_held_out):
        return pages.embedding_round_status(5, "all of round 4's runs", "", design, held_out, "round4_choice",
                                            r4_held_out, r2_held_out)  # fmt: skip

    design = {"chosen": {**r2_row({"simclr_negatives_fade": 2, "vicreg_variance_fade": 6}, healthy_runs=36),
                         "combination": "geometry", "score": "frozen_r", "k": 4.5, "p": 3},
              "admitted": ["simclr_negatives_fade", "simsiam_stopgrad_fade", "vicreg_variance_fade",
                           "simsiam_predictor_fade"]}  # fmt: skip
    choice = r2_row({"simclr_views_identical": 5, "supcon_labels_shuffled": 1},
                    {"simclr_views_identical": 5, "supcon_labels_shuffled": 1}, healthy_runs=24)  # fmt: skip
    choice["runs_caught_silently"] = 6
    round4 = r2_row({"simclr_views_identical": 3, "supcon_labels_shuffled": 0}, healthy_alarmed=2, healthy_runs=24)
    targets = {"catches_admitted": False, "healthy_held_out": 0, "healthy_held_out_met": True, "healthy_both": 0,
               "healthy_both_runs": 60, "healthy_both_met": True, "loss_caught": [], "loss_met": True}  # fmt: skip
    admission = {
        "barlow_redundancy_fade": {"silence_passed": False, "seeds": silence_seeds([None] * 6)},
        "simclr_views_identical": {"silence_passed": True, "seeds": silence_seeds([600] * 6)},
        "supcon_labels_shuffled": {"silence_passed": True, "seeds": silence_seeds([700] * 6, loud=1)},
    }
    held_out = {"admitted": ["simclr_views_identical", "supcon_labels_shuffled"], "admission": admission,
                "design_choice": choice, "round4_choice": round4, "targets": targets,
                "loss_rule": r2_row({"simclr_views_identical": 0, "supcon_labels_shuffled": 1}),
                "first_signals": {"simclr_views_identical": {"spread": 0, "mean_cosine": 5, "modes": 0}},
                "at_zero": {"loss": r2_row({"simclr_views_identical": 6, "supcon_labels_shuffled": 0})}}  # fmt: skip
    r4_held_out = {"admitted": ["vicreg_variance_fade", "simsiam_predictor_fade"],
                   "design_choice": r2_row({"vicreg_variance_fade": 6, "simsiam_predictor_fade": 1})}  # fmt: skip
    r2_held_out = {"default": r2_row({"classes_dropped": 0, "finetune_forgetting_images": 0})}
    lead = round5(design, held_out, r4_held_out, r2_held_out)
    assert lead.startswith("**Silent collapse, what the loss does not show: a held-out class caught in round 5;")
    assert "(4 fault classes, 36 healthy runs)" in lead
    assert "(`geometry`, score frozen_r, k 4.5, p 3: 8/12 design faulted runs caught" in lead
    assert "H3 Barlow Twins redundancy fade was not admitted (no 5 % point on 6 of 6 seeds)" in lead
    assert "it caught H4 SimCLR views identical on 5 of 6, H5 SupCon labels shuffled on 1 of 6 seeds" in lead
    assert "(6 of its 6 catches before any loss-only warning), alarming on 0 of 24 healthy runs" in lead
    assert "the loss-only rule caught 1/12" in lead
    assert (
        "Round 4's choice there: H4 SimCLR views identical on 3 of 6, H5 SupCon labels shuffled on 0 of 6, 2 of 24"
        in lead
    )
    assert "also catches H4: the loss moves there, the loss-only rule does not flag it" in lead
    assert 'opt-in (`silent_family="geometry"`' in lead
    assert "every admitted held-out class is missed (H5 not caught on 5 of 6 seeds)" in lead
    assert "(0/24 and 0/60 healthy alarms, the loss alone catching <= 1 class) are met" in lead
    assert "What fired first: `mean_cosine`, never the topological mode counter" in lead
    assert "its choice caught H1 VICReg variance fade on 6 of 6, H2 SimSiam predictor fade on 1 of 6" in lead
    assert "round 2's path caught 0/12" in lead
    choice["seeds_caught"]["supcon_labels_shuffled"] = 6
    assert "of every admitted held-out class is met" in round5(design, held_out, r4_held_out, r2_held_out)
    admission["supcon_labels_shuffled"]["seeds"] = silence_seeds([700, None, 700, 700, 700, 700], loud=2)
    held_out["admitted"] = ["simclr_views_identical"]
    lead = round5(design, held_out, r4_held_out, r2_held_out)
    assert "was not admitted (no 5 % point on 1 of 6 seeds, the loss-only rule first on 1)" in lead


def test_round_six_status_says_what_the_new_family_did_and_judges_round_fives_choice():
    pages = benchmark_pages()
    chosen = {**r2_row({"vicreg_variance_fade": 6, "supcon_labels_shuffled": 6}, healthy_runs=60),
              "combination": "geometry", "score": "frozen_r", "k": 4.5, "p": 3}  # fmt: skip
    design = {"chosen": chosen, "admitted": [f"class{i}" for i in range(6)],
              "at_zero": {"neighbours": r2_row({"vicreg_variance_fade": 0})}}  # fmt: skip
    choice = r2_row({"supcon_watermark": 6, "simclr_narrow_finetune": 2}, healthy_runs=18)
    choice["runs_caught_silently"] = 8
    targets = {"catches_admitted": False, "healthy_held_out": 0, "healthy_held_out_met": True, "healthy_both": 1,
               "healthy_both_runs": 78, "healthy_both_met": True, "loss_caught": [], "loss_met": True}  # fmt: skip
    admission = {"supcon_watermark": {"silence_passed": True, "seeds": silence_seeds([900] * 6)},
                 "simclr_narrow_finetune": {"silence_passed": True, "seeds": silence_seeds([800] * 6)}}  # fmt: skip
    held_out = {"admitted": ["supcon_watermark", "simclr_narrow_finetune"], "admission": admission,
                "design_choice": choice, "previous_choice": {**choice, **{k: chosen[k] for k in ("combination", "score",
                                                                                             "k", "p")}},
                "targets": targets,
                "loss_rule": r2_row({"supcon_watermark": 0, "simclr_narrow_finetune": 0}),
                "first_signals": {"supcon_watermark": {"mean_cosine": 6, "modes": 0}}, "at_zero": {}}  # fmt: skip
    r5_held_out = {"admitted": ["simclr_views_identical", "supcon_labels_shuffled"],
                   "design_choice": r2_row({"simclr_views_identical": 0, "supcon_labels_shuffled": 6})}  # fmt: skip
    r2_held_out = {"default": r2_row({"classes_dropped": 0})}
    lead = pages.round6_status(design, held_out, r5_held_out, r2_held_out)
    assert lead.startswith("**Silent collapse, what the loss does not show: a held-out class caught in round 6;")
    assert "Rounds 4 to 6 (pre-registered)" in lead
    assert "Round 6 chose on all of rounds 4 and 5's runs (6 fault classes, 60 healthy runs)" in lead
    assert "none of the healthy runs alarmed). It is round 5's rule again. A new family" in lead
    assert "the probe's neighbourhoods change caught nothing there at no healthy alarm." in lead
    assert "it caught H6 SupCon watermark on 6 of 6, H7 SimCLR narrow fine-tune on 2 of 6 seeds" in lead
    assert "Round 5's choice there: H6 SupCon watermark on 6 of 6" in lead
    assert "every admitted held-out class is missed (H7 not caught on 5 of 6 seeds)" in lead
    assert "(0/18 and 1/78 healthy alarms, the loss alone catching <= 1 class) are met" in lead
    assert "Round 5's held-out split: its choice caught H4 SimCLR views identical on 0 of 6, H5 SupCon labels" in lead
