"""The rescue suite (benchmarks/rescue): its quick grid end to end, branching against live runs, the baselines."""

import json
import math

import numpy as np
import pytest
import torch

from tests.benchmarks import benchmark_suite, needs_fashion_mnist

MODULES = ("faults", "baselines", "engine", "detectors", "cache", "outputs", "run")


suite = benchmark_suite("rescue", MODULES)


# The quick grid trains a tiny ViT (about a minute on one core, shared by the tests that use it).
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def quick(suite, tmp_path_factory):
    """The quick grid (ViT, seed 0, 80 positions, fault at 50, checks every 5), computed once."""
    root = tmp_path_factory.mktemp("rescue")
    assert suite["run"].main(["--quick", "--cache", str(root / "cache"), "--out", str(root / "out")]) == 0
    directory = suite["cache"].cache_dir(root / "cache", suite["faults"].QUICK)
    payload = json.loads((root / "out" / "rescue.json").read_text())
    return {"root": root, "directory": directory, "payload": payload}


def _records(payload, **where):
    return [r for r in payload["records"] if all(r[k] == v for k, v in where.items())]


@slow
@needs_fashion_mnist
def test_quick_grid_writes_every_record_with_its_fields(quick, suite):
    payload = quick["payload"]
    keys = suite["run"].QUICK_DETECTORS
    # 3 kinds (healthy twin, transient, structural) for each detector and for the unprotected run.
    assert len(payload["records"]) == 3 * (len(keys) + 1)
    fields = {
        "setting", "arm", "scenario", "architecture", "fault", "seed", "detector", "action", "final_metric",
        "healthy_twin_final_metric", "rescued", "steps_lost", "interventions", "intervention_steps",
        "healthy_interventions_per_1000_steps", "healthy_final_metric_change", "wall_clock_ratio", "snapshot_bytes",
    }  # fmt: skip
    for record in payload["records"]:
        assert fields <= set(record)
        assert (record["rescued"] is None) == (record["fault"] == "none")
    assert any(t["target"].startswith("rescues >= 80 % of transient faults") for t in payload["targets"])
    named = {t["target"] for t in payload["targets"]}
    assert "rescues more than plain replay (what skipping the bad window adds), paired p < 0.05" in named
    assert "rescues more than the loss alone, paired p < 0.05" in named
    markdown = (quick["root"] / "out" / "rescue.md").read_text()
    assert "| **ours_default** | rollback |" in markdown  # the row the targets are about
    assert "rescued transient" in markdown
    assert sorted(p.name for p in (quick["root"] / "out" / "rescue").glob("*.png")) == [
        "rates.png",
        "vit_structural.png",
        "vit_transient.png",
    ]


@slow
@needs_fashion_mnist
def test_every_record_names_the_code_it_ran_and_the_results_do_not_mix_code(quick, suite):
    payload, cache = quick["payload"], suite["cache"]
    now = cache.code_version()
    assert payload["code"]["library"] == now["library"]
    assert payload["code"]["suite"] == now["suite"]
    assert payload["mixed_code"] == []
    assert {(r["code"]["library"], r["code"]["suite"]) for r in payload["records"]} == {(now["library"], now["suite"])}
    assert payload["preregistration"] == cache.preregistration()


def test_a_cached_run_of_other_code_is_recomputed_unless_stale_runs_are_reused(suite, tmp_path):
    run, cache = suite["run"], suite["cache"]
    path = tmp_path / "runs.json"
    assert not run.current(path)  # not cached
    path.write_text(json.dumps({"runs": {}}))
    assert not run.current(path)  # cached before runs recorded their code
    path.write_text(json.dumps({"runs": {}, "code": cache.code_version()}))
    assert run.current(path)
    path.write_text(json.dumps({"runs": {}, "code": {**cache.code_version(), "library": "another"}}))
    assert not run.current(path)
    assert run.current(path, reuse_stale=True)
    side = tmp_path / "trunk.code.json"  # a trunk's code is in a file beside it
    side.write_text(json.dumps({"code": cache.code_version()}))
    assert run.current(path, side)


def test_records_of_two_codes_are_named_and_old_code_is_stale(suite):
    outputs, cache = suite["outputs"], suite["cache"]
    one, two = {"library": "a", "suite": "s"}, {"library": "b", "suite": "s"}
    assert outputs.mixed_code([{"code": one, "timing_code": one}, {"code": one, "timing_code": one}]) == []
    assert outputs.mixed_code([{"code": one, "timing_code": one}, {"code": two, "timing_code": None}]) == [
        "library a, suite s",
        "library b, suite s",
        "unrecorded",
    ]
    assert outputs.stale_code([{"code": one, "timing_code": one}])  # one code, but not today's
    now = cache.code_version()
    assert not outputs.stale_code([{"code": now, "timing_code": now}])


@slow
@needs_fashion_mnist
def test_transient_fault_makes_the_unprotected_run_worse_than_its_healthy_twin(quick):
    (unprotected,) = _records(quick["payload"], detector="none", fault="transient")
    assert unprotected["final_metric"] < unprotected["healthy_twin_final_metric"] * 0.9
    assert unprotected["rescued"] is False
    (twin,) = _records(quick["payload"], detector="none", fault="none")
    assert twin["final_metric"] == twin["healthy_twin_final_metric"]


@slow
@needs_fashion_mnist
def test_rollback_records_count_the_updates_undone(quick, suite):
    path = suite["cache"].runs_path(quick["directory"], "vit", 0, "ours_default+rollback")
    runs = json.loads(path.read_text())["runs"]
    rollbacks = [(kind, e) for kind, run in runs.items() for e in run["events"] if e["action"] == "rollback"]
    assert rollbacks, "the quick grid's faults should make our detector roll back"
    for kind, event in rollbacks:
        run = runs[kind]
        assert event["snapshot_step"] < event["position"]
        # The library's record (updates since the snapshot, or since the last rollback) matches the trainee's
        # update count before and after the restore.
        assert event["updates_undone"] == event["steps_lost"] > 0
        if event is run["events"][0]:  # nothing undone before it: updates undone = positions since the snapshot
            assert event["updates_undone"] == event["position"] - event["snapshot_step"]
        if run["stopped_at"] is None:
            assert run["final_updates"] == suite["faults"].QUICK.steps - run["updates_undone"]
        assert run["updates_undone"] == sum(e["updates_undone"] for e in run["events"] if e["action"] == "rollback")
    (record,) = _records(quick["payload"], detector="ours_default", action="rollback", fault="transient")
    assert record["steps_lost"] == runs["transient"]["updates_undone"]


@slow
@needs_fashion_mnist
@pytest.mark.parametrize("key", ["ours_default+rollback", "ours_old_default+rollback", "plain_replay+rollback"])
def test_a_branched_run_equals_a_live_run_from_scratch(quick, suite, key):
    engine, faults, detectors = suite["engine"], suite["faults"], suite["detectors"]
    arch, setup = faults.ARCHITECTURES["vit"], faults.QUICK
    spec = detectors.DETECTORS[key]
    runs = json.loads(suite["cache"].runs_path(quick["directory"], "vit", 0, spec.key).read_text())["runs"]
    branched = runs["transient"]
    assert branched["branched_at"] is not None
    assert branched["branched_at"] > setup.fault
    live = engine.run_live(arch, 0, setup, "transient", lambda: spec.make(arch, setup))
    assert live.final == branched["final_metric"]  # bit for bit
    assert live.final_updates == branched["final_updates"]
    assert [(e["position"], e["action"], e["snapshot_step"]) for e in live.events] == [
        (e["position"], e["action"], e["snapshot_step"]) for e in branched["events"]
    ]


@slow
@needs_fashion_mnist
def test_plain_replay_sends_the_data_back_and_every_run_counts_its_steps(quick, suite):
    setup = suite["faults"].QUICK
    replayed = 0
    for key in suite["run"].QUICK_DETECTORS:
        runs = json.loads(suite["cache"].runs_path(quick["directory"], "vit", 0, key).read_text())["runs"]
        for run in runs.values():
            cost = run["cost"]
            back = [e["position"] - e["snapshot_step"] for e in run["events"] if e["action"] == "rollback"]
            # Plain replay trains the positions since the snapshot again; every other row goes on with new data.
            assert cost["positions_replayed"] == (sum(back) if key == "plain_replay+rollback" else 0)
            end = setup.steps if run["stopped_at"] is None else run["stopped_at"]
            assert cost["steps_trained"] == end + cost["positions_replayed"]
            replayed += cost["positions_replayed"]
            if key == "recompute+recompute":
                assert cost["steps_recomputed"] == sum(e["action"] == "recompute" for e in run["events"])
            if suite["detectors"].DETECTORS[key].family == "baseline" and key != "metric+rollback_cut":
                assert cost["probe_passes"] == cost["snapshots"] == cost["snapshot_bytes"] == 0
            else:  # a probe pass at every check it saw; snapshots of the whole training state
                assert cost["probe_passes"] >= end // setup.check_every
                assert cost["snapshot_bytes"] > 0
    assert replayed > 0, "the quick grid's faults should make plain replay roll back"
    ratios = {r["arm"]: r["wall_clock_ratio"] for r in quick["payload"]["records"] if r["fault"] == "none"}
    assert ratios["none+none"] == 1.0
    assert ratios["ours_default+rollback"] > 1.0  # probe passes and snapshots are not free


@slow
@needs_fashion_mnist
def test_plain_replay_never_cuts_the_rate(suite):
    engine, faults, detectors = suite["engine"], suite["faults"], suite["detectors"]
    arch, setup = faults.ARCHITECTURES["vit"], faults.QUICK
    spec = detectors.DETECTORS["plain_replay+rollback"]
    run = engine.run_live(arch, 0, setup, "structural", lambda: spec.make(arch, setup))
    rollbacks = [e for e in run.events if e["action"] == "rollback"]
    assert len(rollbacks) >= 2  # the policy (rollback_lr_factor=None) asks for a cut from the second one on
    fresh = faults.RescueTrainee(arch, 0, "structural", setup)
    assert run.trainee.scheduler.base_lrs == fresh.scheduler.base_lrs  # no cut reached the optimizer


@needs_fashion_mnist
def test_recomputing_a_step_gives_the_same_update_when_the_compute_is_deterministic(suite):
    faults = suite["faults"]
    arch, setup = faults.ARCHITECTURES["vit"], faults.QUICK
    plain, again = (faults.RescueTrainee(arch, 0, "transient", setup) for _ in range(2))
    position = setup.fault  # a corrupted batch: recomputing it computes the same bad gradients
    loss_a, norm_a, _ = plain.step(position)
    recompute = faults.StepChange("recompute", recompute=True)
    loss_b, norm_b, change = again.step(position, decide=lambda loss, norm: recompute)
    assert change.recompute
    assert (loss_a, norm_a) == (loss_b, norm_b)
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_recompute_flags_what_olmo_skip_flags_and_recomputes_instead(suite):
    baselines = suite["baselines"]
    skip, recompute = baselines.OlmoSkipStep(), baselines.RecomputeStep()
    values = [1.0 + 0.01 * (p % 5) for p in range(70)] + [1.5, 1.01, math.nan]
    for p, loss in enumerate(values):
        a, b = skip.on_step(p, loss, 1.0), recompute.on_step(p, loss, 1.0)
        assert (a is None) == (b is None), p
        if b is not None:
            assert (b.action, b.recompute, b.skip, b.stop) == ("recompute", True, False, False)
    assert recompute.on_step(73, 9.0, 1.0) is not None


def test_mean_interval_is_students_t(suite):
    from scipy import stats

    values = [0.0, 0.01, -0.02, 0.005, 0.0, -0.001]
    mean, low, high = suite["outputs"].mean_interval(values)
    reference = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values))
    assert (low, high) == pytest.approx(reference)
    assert suite["outputs"].mean_interval([0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0)
    assert math.isnan(suite["outputs"].mean_interval([1.0])[1])


def test_wall_clock_ratio_prices_steps_probes_snapshots_and_the_detector(suite):
    outputs, setup = suite["outputs"], suite["faults"].FULL
    timing = {"step_seconds": 0.01, "probe_seconds": 0.05, "copy_seconds": 0.002}
    cost = {"steps_trained": 430, "steps_recomputed": 2, "probe_passes": 43, "snapshots": 40,
            "detector_seconds": 0.4, "positions_replayed": 30, "snapshot_bytes": 1}  # fmt: skip
    expected = (432 * 0.01 + 43 * 0.05 + 40 * 0.002 + 0.4) / (400 * 0.01)
    assert outputs.wall_clock_ratio({"cost": cost}, timing, setup) == pytest.approx(expected)
    assert outputs.wall_clock_ratio({"cost": None}, timing, setup) is None  # cached before costs were recorded
    assert outputs.wall_clock_ratio({"cost": cost}, None, setup) is None


def test_the_transient_target_needs_the_interval_not_only_the_rate(suite):
    outputs = suite["outputs"]

    def row(transient, n=32):
        return {
            "rescued_transient": transient / n, "rescued_transient_count": f"{transient}/{n}",
            "rescued_transient_ci": outputs.wilson(transient, n), "rescued_structural": 0.5,
            "rescued_structural_count": f"{n // 2}/{n}", "healthy_acted": 0, "healthy_runs": n,
            "healthy_acted_ci": outputs.wilson(0, n), "healthy_change": 0.0, "healthy_change_ci": [0.0, 0.0],
            "healthy_worst": 0.0, "rescued": transient + n // 2,
        }  # fmt: skip

    def transient_met(transient, n=32):
        (what, met, _), *_ = outputs.targets({outputs.OURS: row(transient, n)}, [])
        assert what.startswith("rescues >= 80 % of transient faults")
        return met

    assert outputs.wilson(26, 32)[0] < 0.7  # 81 %, but the interval reaches below 70 %
    assert not transient_met(26)
    assert outputs.wilson(29, 32)[0] >= 0.7
    assert transient_met(29)
    healthy = outputs.targets({outputs.OURS: row(20, n=21)}, [])[2]
    assert healthy[0].startswith("acts on no healthy twin in >= 30")
    assert not healthy[1]  # 0 of 21: too few twins to bound the rate below 10 %


def test_lightning_spike_detection_stops_at_three_times_the_running_mean(suite):
    detector = suite["baselines"].LightningSpikeDetection()
    assert all(detector.on_step(p, 1.0, 1.0) is None for p in range(12))
    assert detector.on_step(12, 2.9, 1.0) is None  # below 3x the mean of the last 10
    change = detector.on_step(13, 3.0 * float(sum(detector.losses)) / len(detector.losses) + 0.01, 1.0)
    assert change is not None
    assert change.stop
    fresh = suite["baselines"].LightningSpikeDetection()
    assert fresh.on_step(0, math.nan, 1.0) is None  # the first batch is its warm-up
    assert fresh.on_step(1, math.nan, 1.0).stop  # non-finite


def test_olmo_skip_step_skips_six_sigma_outliers_after_half_a_window(suite):
    detector = suite["baselines"].OlmoSkipStep()
    losses = [1.0 + 0.01 * (p % 5) for p in range(63)]
    assert all(detector.on_step(p, loss, 1.0) is None for p, loss in enumerate(losses))  # fewer than 64 seen
    assert detector.on_step(63, 1.02, 1.0) is None
    change = detector.on_step(64, 1.5, 1.0)
    assert change is not None
    assert change.skip
    assert detector.on_step(65, 1.02, 50.0).skip  # the gradient norm alone


def test_foundry_kill_loss_spike_needs_five_outliers_in_a_row(suite):
    detector = suite["baselines"].FoundryKillLossSpike()
    assert all(detector.on_step(p, 1.0, 1.0) is None for p in range(100))
    assert [detector.on_step(100 + i, 2.5, 1.0) is not None for i in range(5)] == [False] * 4 + [True]


def test_zclip_clips_outliers_to_the_adaptive_threshold(suite):
    zclip = suite["baselines"].ZClip()
    for p in range(25):
        assert zclip.on_step(p, 1.0, 1.0 + 0.1 * (p % 2)) is None
    mean, std = zclip.mean, zclip.var**0.5
    change = zclip.on_step(25, 1.0, 10.0)
    z = (10.0 - mean) / (std + 1e-6)
    assert change is not None
    assert change.clip_to == pytest.approx(mean + 2.5 * std * 2.5 / z)


def test_the_default_rule_is_the_row_rescuing_most_within_the_healthy_targets(suite):
    choose = suite["outputs"].choose_default

    def row(rescued, change, rate):
        return {"rescued": rescued, "healthy_change": change, "healthy_rate": rate}

    rows = {
        "ours_index_only+rollback": row(9, -0.0166, 2.2),  # rescues most, but hurts healthy runs: not eligible
        "ours_default+rollback": row(2, 0.0024, 0.83),
        "ours_loss_only+rollback": row(2, -0.001, 0.5),  # a tie on rescues: fewer interventions wins
        "ours_default+lower_lr": row(0, 0.0076, 0.2),
        "metric+rollback_cut": row(7, 0.009, 0.1),  # a baseline is never the default rule
    }
    key, why = choose(rows)
    assert key == "ours_loss_only+rollback"
    assert why.startswith("ours_loss_only+rollback: 2 faulted runs rescued within the healthy targets")
    rows = {k: v for k, v in rows.items() if k in ("ours_index_only+rollback", "ours_default+lower_lr")}
    key, why = choose(rows)
    assert key is None
    assert "ours_default+lower_lr 0" in why


def test_wilson_interval_matches_its_closed_form_and_covers_the_edges(suite):
    from scipy.stats import binomtest

    wilson = suite["outputs"].wilson
    for k, n in [(13, 21), (3, 21), (1, 9), (7, 9)]:
        reference = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson(k, n) == pytest.approx((reference.low, reference.high), abs=1e-8)
    assert wilson(0, 21)[0] == 0.0
    assert 0.0 < wilson(0, 21)[1] < 0.17  # 0/n still has an upper bound
    assert wilson(21, 21)[1] == 1.0
    assert 0.83 < wilson(21, 21)[0] < 1.0
    assert all(math.isnan(v) for v in wilson(0, 0))


def test_sign_test_is_mcnemars_exact_test_on_the_discordant_pairs(suite):
    outputs = suite["outputs"]
    assert outputs.sign_test(0, 0) == 1.0
    assert outputs.sign_test(5, 0) == pytest.approx(2 / 32)  # 2 * 0.5^5
    assert outputs.sign_test(10, 0) == pytest.approx(2 / 1024)
    assert outputs.sign_test(3, 3) == 1.0
    assert (
        outputs.sign_test(2, 7)
        == outputs.sign_test(7, 2)
        == pytest.approx(2 * sum(math.comb(9, k) for k in range(3)) / 512)
    )
    records = [
        {
            "architecture": "vit",
            "fault": fault,
            "seed": seed,
            "detector": detector,
            "action": "rollback",
            "rescued": rescued,
        }
        for seed, (a, b) in enumerate([(True, True), (True, False), (True, False), (False, True), (False, False)])
        for fault in ("transient",)
        for detector, rescued in (("a", a), ("b", b))
    ] + [{"architecture": "vit", "fault": "none", "seed": 0, "detector": "a", "action": "rollback", "rescued": None}]
    assert outputs.paired(records, "a+rollback", "b+rollback") == (1, 2, 1, 1.0)
